"""Hostile load: each heavy request runs beside a stream and a /health probe (issue 16, part 1).

One real bloomery-serve on a tiny synthetic qwen2 file with the real tokenizer (so the
tokenizer's and the template's costs are the real ones). For each heavy request:
/health answers within HEALTH_BOUND_S every time, and a streamed completion next to it
never waits more than STREAM_GAP_S between two chunks. Requests past the documented
limits (bloomery/api/limits.py) are refused by name; requests just under them run.
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from bloomery.api import limits
from serve_proc import Served

pytestmark = [pytest.mark.slow, pytest.mark.real_model]

HEALTH_BOUND_S = 0.25     # what one heavy request may add to the quiet server's worst /health answer
STREAM_GAP_S = 1.0        # ... and to a stream's worst gap (a shared CI machine has its own noise, measured first)
WATCHDOG_S = 2.0          # WATCHDOG_USEC for the server: a ping every 1 s is expected


def post(url: str, path: str, obj: object, timeout: float = 300) -> tuple[int, bytes]:
    data = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    req = urllib.request.Request(url + path, data=data, method="POST",
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


class Probe(threading.Thread):
    """/health every 50 ms; the slowest answer."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.worst, self.stop, self.n = url, 0.0, threading.Event(), 0

    def run(self) -> None:
        while not self.stop.is_set():
            t0 = time.monotonic()
            with urllib.request.urlopen(self.url + "/health", timeout=30) as r:
                assert r.status == 200
                r.read()
            self.worst = max(self.worst, time.monotonic() - t0)
            self.n += 1
            time.sleep(0.05)


class Stream(threading.Thread):
    """Streamed /completion requests one after another until stopped; the longest silence between two
    chunks of one stream."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.worst_gap, self.n_chunks, self.error = url, 0.0, 0, None
        self.stop = threading.Event()

    def run(self) -> None:
        body = json.dumps({"prompt": "count:", "n_predict": 200, "stream": True, "temperature": 0,
                           "ignore_eos": True}).encode()
        try:
            while not self.stop.is_set():
                req = urllib.request.Request(self.url + "/completion", data=body, method="POST")
                with urllib.request.urlopen(req, timeout=300) as r:
                    last = None
                    for line in r:
                        if self.stop.is_set() and self.n_chunks > 10:
                            break      # closing the connection ends the generation: no test waits for its rest
                        if not line.startswith(b"data: "):
                            continue
                        now = time.monotonic()
                        if last is not None:
                            self.worst_gap = max(self.worst_gap, now - last)
                        last = now
                        self.n_chunks += 1
        except Exception as e:   # reported by the test
            self.error = e


class Watchdog(threading.Thread):
    """A NOTIFY_SOCKET of our own: the longest gap between two WATCHDOG=1 datagrams."""

    def __init__(self, path: str):
        super().__init__(daemon=True)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.settimeout(0.5)
        self.pings: list[float] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                data = self.sock.recv(4096)
            except socket.timeout:
                continue
            if b"WATCHDOG=1" in data:
                self.pings.append(time.monotonic())

    def worst_gap(self, since: float) -> float:
        times = [since] + [t for t in self.pings if t >= since] + [time.monotonic()]
        return max(b - a for a, b in zip(times, times[1:]))


@pytest.fixture(scope="module")
def server(real_model_path, tmp_path_factory):
    from conftest import load_tool

    folder = tmp_path_factory.mktemp("hostile")
    path = folder / "tiny.gguf"
    load_tool("make_synthetic").write_synthetic(path, "qwen2", tokenizer_from=str(real_model_path))
    dog = Watchdog(str(folder / "notify"))
    dog.start()
    env = {"NOTIFY_SOCKET": str(folder / "notify"), "WATCHDOG_USEC": str(int(WATCHDOG_S * 1e6))}
    with Served("-m", str(path), "-c", "1024", "--parallel", "2", env=env) as s:
        s.dog = dog
        s.quiet = beside(s, lambda: time.sleep(3.0))
        print(f"quiet: health worst {s.quiet[0] * 1e3:.0f} ms; stream worst gap {s.quiet[1]:.2f} s")
        yield s
    dog.stop.set()


def text_of(n_chars: int) -> str:
    words = ["def", "x", "=", "1", "\n", "é", "中", "return", "  ", "foo(bar)"]
    out, n = [], 0
    i = 0
    while n < n_chars:
        w = words[i % len(words)] + str(i % 97)
        out.append(w)
        n += len(w)
        i += 1
    return "".join(out)[:n_chars]


UNDER = limits.MAX_PROMPT_CHARS // 4      # heavy, under the limit: runs (and then exceeds the context)
HEAVY = {
    "chat prompt over the limit": ("/v1/chat/completions", lambda: {
        "messages": [{"role": "user", "content": text_of(limits.MAX_PROMPT_CHARS + 1)}], "max_tokens": 1}, 400,
        "MAX_PROMPT_CHARS"),
    "chat prompt under the limit": ("/v1/chat/completions", lambda: {
        "messages": [{"role": "user", "content": text_of(UNDER)}], "max_tokens": 1}, 400, "exceeds"),
    "messages over the limit": ("/v1/chat/completions", lambda: {
        "messages": [{"role": "user", "content": "hi"}] * (limits.MAX_MESSAGES + 1), "max_tokens": 1}, 400,
        "MAX_MESSAGES"),
    "messages under the limit": ("/v1/chat/completions", lambda: {
        "messages": [{"role": "user", "content": "hi"}] * limits.MAX_MESSAGES, "max_tokens": 1}, 400, "exceeds"),
    "token ids over the limit": ("/completion", lambda: {"prompt": [1] * (limits.MAX_IDS + 1), "n_predict": 1},
                                 400, "MAX_IDS"),
    "token ids under the limit": ("/completion", lambda: {"prompt": [1] * limits.MAX_IDS, "n_predict": 1},
                                  400, "exceeds"),
    "tokenize with pieces": ("/tokenize", lambda: {"content": text_of(UNDER), "with_pieces": True}, 200, "piece"),
    "n_probs over the limit": ("/completion", lambda: {"prompt": "hi", "n_probs": 151000, "n_predict": 2},
                               400, "MAX_N_PROBS"),
    "n_probs at the limit": ("/completion", lambda: {"prompt": "hi", "n_probs": limits.MAX_N_PROBS, "n_predict": 16,
                                                     "temperature": 0, "stream": True}, 200,
                             "completion_probabilities"),
}


def beside(server, work) -> tuple[float, float, object, float]:
    """Runs work() while a stream and a /health probe run: (worst /health, worst stream gap, work's answer,
    seconds work took)."""
    stream, probe = Stream(server.url), Probe(server.url)
    stream.start()
    while stream.n_chunks < 2 and stream.is_alive():
        time.sleep(0.01)
    probe.start()
    t0 = time.monotonic()
    answer = work()
    took = time.monotonic() - t0
    time.sleep(0.3)
    probe.stop.set()
    stream.stop.set()
    probe.join()
    stream.join(timeout=300)
    assert stream.error is None and stream.n_chunks > 10, stream.error
    return probe.worst, stream.worst_gap, answer, took


@pytest.mark.parametrize("name", list(HEAVY))
def test_heavy_request_beside_a_stream_and_health(server, name):
    path, make, status, word = HEAVY[name]
    body = json.dumps(make()).encode()     # here, not beside the probe (json.dumps holds this process's GIL)
    best = [float("inf")] * 3          # each measure's best over the tries: health, stream gap, watchdog gap
    for attempt in (1, 2, 3):
        t_start = time.monotonic()
        health, gap, (code, answer), took = beside(server, lambda: post(server.url, path, body))
        dog = server.dog.worst_gap(t_start)
        print(f"{name} (try {attempt}): {code} in {took:.2f} s; health worst {health * 1e3:.0f} ms; stream worst gap "
              f"{gap:.2f} s; watchdog worst gap {dog:.2f} s")
        assert code == status and word.encode() in answer, answer[:300]
        best = [min(b, v) for b, v in zip(best, (health, gap, dog))]
        if best[0] < HEALTH_BOUND_S + server.quiet[0] and best[1] < STREAM_GAP_S + server.quiet[1] and \
                best[2] < WATCHDOG_S * 0.75:
            break
        # a 2-core machine busy with other jobs can hold one probe past a bound now and then (CI, beside the
        # llama.cpp suite: a stream gap of 1.35 s in one try, /health 113 ms in the next): measure again, and
        # each measure must keep to its bound in one try at least. Work that really blocks the loop (seconds,
        # as before the worker pool) breaks its bound in every try.
    health, gap, dog = best
    assert health < HEALTH_BOUND_S + server.quiet[0], f"/health took {health:.3f} s beside {name}"
    assert gap < STREAM_GAP_S + server.quiet[1], f"a stream waited {gap:.2f} s beside {name}"
    assert dog < WATCHDOG_S * 0.75, f"the watchdog ping waited {dog:.2f} s beside {name}"


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def quick_server(real_model_path, tmp_path_factory):
    """The same tiny shape and the real tokenizer, in Q8_0: the numpy backend's compiled kernels, about 3 ms of
    CPU an id here, where the float file's head (151,936 x 64 in llama.cpp's float order, in numpy) takes 60-80 ms.
    For the memory test, whose 105 requests of 8 ids measure the front's memory, not the pace of its answers
    (the float file, whose pace is nearer the real model's, stays under the tests of latency above)."""
    from conftest import load_tool

    path = tmp_path_factory.mktemp("hostile-q8") / "tiny-q8_0.gguf"
    load_tool("make_synthetic").write_synthetic(path, "qwen2", tokenizer_from=str(real_model_path), mode="blocks",
                                                mix="q8_0")
    with Served("-m", str(path), "-c", "1024", "--parallel", "2") as s:
        yield s


def test_memory_after_100_heavy_requests_returns_to_where_it_started(quick_server):
    """Each request asks for the largest probability tables and a long prompt; /slots keeps memos only."""
    server = quick_server
    body = {"prompt": text_of(400), "n_probs": limits.MAX_N_PROBS, "n_predict": 8, "temperature": 0}
    for _ in range(5):           # warm: the allocator's arenas, the pools' threads
        assert post(server.url, "/completion", body)[0] == 200
    start = rss_bytes(server.proc.pid)
    for _ in range(100):
        code, answer = post(server.url, "/completion", body)
        assert code == 200, answer[:300]
    with urllib.request.urlopen(server.url + "/slots", timeout=30) as r:
        assert r.status == 200 and b"n_probs" in r.read()
    end = rss_bytes(server.proc.pid)
    print(f"supervisor RSS: {start / 2**20:.1f} MiB -> {end / 2**20:.1f} MiB after 100 requests")
    assert end <= start * 1.10, f"RSS grew from {start / 2**20:.1f} to {end / 2**20:.1f} MiB"
