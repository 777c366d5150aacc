"""The engine process's idle loop gathers a burst (stages/engine.gather): requests that reach an idle engine close
together wait for each other, so they share their first prompt pass and decode from the same step."""
from __future__ import annotations

import queue
import threading
import time

from bloomery.stages.engine import gather


def test_a_burst_arriving_close_together_is_gathered_and_a_lone_message_waits_only_the_quiet_time():
    inbox: queue.Queue = queue.Queue()

    def send():
        for i in range(4):
            time.sleep(0.0005)
            inbox.put(i)
    t = threading.Thread(target=send)
    t.start()
    got = gather(inbox, quiet_s=0.05, most_s=1.0)         # (wide margins: a loaded CI machine)
    t.join()
    assert got == [0, 1, 2, 3]
    t0 = time.monotonic()
    assert gather(inbox, quiet_s=0.02, most_s=1.0) == []
    assert time.monotonic() - t0 < 0.5


def test_the_wait_ends_at_most_s_however_the_messages_keep_coming():
    inbox: queue.Queue = queue.Queue()
    stop = threading.Event()

    def flood():
        while not stop.is_set():
            inbox.put(1)
            time.sleep(0.001)
    t = threading.Thread(target=flood)
    t.start()
    t0 = time.monotonic()
    try:
        got = gather(inbox, quiet_s=0.2, most_s=0.1)
    finally:
        stop.set()
        t.join()
    assert got and time.monotonic() - t0 < 0.4


def test_a_clock_past_most_s_takes_nothing():
    inbox: queue.Queue = queue.Queue()
    inbox.put(1)
    ticks = iter([0.0, 5.0])
    assert gather(inbox, quiet_s=0.01, most_s=1.0, clock=lambda: next(ticks)) == []
