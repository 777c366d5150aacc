"""bloomery-broker as a real process, asked over its real ipc socket, by raw zmq and by hooks/bloomery-need.

Lease holders are real processes (sleep); the broker is killed with SIGKILL and started again."""
from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import zmq

from bloomery.broker import protocol

REPO = Path(__file__).resolve().parents[1]
HOOK = REPO / "hooks" / "bloomery-need"
MB = 10**6


class BrokerProc:
    def __init__(self, tmp: Path, cap: str = "1000MB"):
        self.tmp = tmp
        self.cfg = tmp / "broker.toml"
        self.cfg.write_text(f'[host]\ncap_bytes = "{cap}"\n')
        self.env = {**os.environ, "BLOOMERY_BROKER_DIR": str(tmp / "run"), "BLOOMERY_BROKER_STATE": str(tmp / "state")}
        self.sock = tmp / "run" / "broker.sock"
        self.proc = None
        self.hooks: list[subprocess.Popen] = []

    def start(self) -> "BrokerProc":
        self.log = open(self.tmp / "broker.log", "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "bloomery.broker.cli", "--config", str(self.cfg)],
                                     cwd=REPO, env=self.env, stderr=self.log)
        deadline = time.monotonic() + 20
        while self.ask({"op": "status"}, 0.5) is None:
            assert self.proc.poll() is None, (self.tmp / "broker.log").read_text()
            assert time.monotonic() < deadline, "the broker never answered"
            time.sleep(0.1)
        return self

    def ask(self, request, timeout_s=5.0, raw: bytes | None = None):
        if not self.sock.exists():
            return None
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        try:
            s.connect(f"ipc://{self.sock}")
            s.send(raw if raw is not None else protocol.encode(request))
            return json.loads(s.recv()) if s.poll(int(timeout_s * 1000)) else None
        finally:
            s.close(0)
            ctx.term()

    def status(self):
        return self.ask({"op": "status"})

    def hook(self, record: dict | bytes) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, str(HOOK)], env=self.env, stdin=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=False)
        p.stdin.write(record if isinstance(record, bytes) else json.dumps(record).encode())
        p.stdin.close()
        self.hooks.append(p)
        return p

    def stop(self, sig=signal.SIGTERM):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(10)

    def close(self):
        """stop() and reap every hook this broker was asked through: one still queued waits for a grant
        forever (hooks outlive a broker restart), so it gets SIGTERM, as systemd would send it."""
        self.stop()
        for p in self.hooks:
            if p.poll() is None:
                p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            p.stderr.close()


@pytest.fixture
def broker(tmp_path):
    b = BrokerProc(tmp_path).start()
    yield b
    b.close()


@pytest.fixture(autouse=True)
def no_process_left():
    """Every process a test started is gone when it ends (a left hook would wait for its grant forever);
    those alive before it (a session's shared server) and llama.cpp's suite running beside are not its."""
    from conftest import of_the_suite_beside

    def alive() -> dict[int, psutil.Process]:
        return {c.pid: c for c in psutil.Process().children(recursive=True)
                if not of_the_suite_beside(c) and c.status() != psutil.STATUS_ZOMBIE}
    before = alive()
    yield
    left = [(pid, c.cmdline()) for pid, c in alive().items() if pid not in before]
    assert not left, f"processes left behind: {left}"


@pytest.fixture
def holders():
    procs = []

    def make(cmd=("sleep", "60")):
        p = subprocess.Popen(list(cmd))
        procs.append(p)
        return p
    yield make
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def wait_for(cond, timeout_s=10.0, what=""):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def lines(p: subprocess.Popen) -> list[dict]:
    return [json.loads(x) for x in p.stderr.read().decode().splitlines() if x.strip()]


def test_socket_is_group_only(broker):
    assert stat.S_IMODE(broker.sock.stat().st_mode) == 0o660


def test_malformed_and_oversized_refused_by_name_and_the_broker_keeps_serving(broker, holders):
    dead = subprocess.Popen(["true"])
    dead.wait()
    cases = [
        (b"not json", "request: not JSON"),
        (b"x" * (100 * 1024), f"request: {100 * 1024} bytes; the bound is {protocol.MAX_REQUEST_BYTES} bytes"),
        (b'{"op": "need", "id": "a", "need": {"pid": 1, "host_bytes": -5}}', "need field 'host_bytes': -5"),
        (b'{"op": "need", "id": "a", "need": {"host_bytes": 5}}', "need field 'pid': missing"),
        (b'{"op": "need", "id": "a", "need": {"pid": %d, "host_bytes": 5}}' % dead.pid,
         f"need field 'pid': {dead.pid} is not a live process"),
        (b'{"op": "launch"}', "request field 'op': 'launch'"),
    ]
    for raw, named in cases:
        answer = broker.ask(None, raw=raw)
        assert answer == {"op": "refused", "reason": answer["reason"]} and named in answer["reason"], (named, answer)
        assert broker.status()["op"] == "status"
    assert broker.ask(None, raw=b"y" * (2 * protocol.MAX_WIRE_BYTES), timeout_s=1) is None   # cut off, no answer
    h = holders()
    answer = broker.ask({"op": "need", "id": "ok", "need": {"pid": h.pid, "host_bytes": 5}})
    assert answer["op"] == "granted" and answer["lease"]["need"]["pid"] == h.pid
    assert broker.proc.poll() is None


def test_hook_contract_refusals(broker, holders):
    h = holders()
    p = broker.hook({"pid": h.pid, "host_bytes": 5 * 10**9, "unit": "big.service"})
    assert p.wait(10) == 1
    last = lines(p)[-1]
    assert last["event"] == "refused" and "host_bytes 5000000000" in last["reason"] \
        and "larger than the host can ever grant" in last["reason"]
    p = broker.hook(b"{nope")
    assert p.wait(10) == 2 and "need record on stdin: not JSON" in lines(p)[-1]["reason"]
    env = {**broker.env, "BLOOMERY_BROKER_DIR": str(broker.tmp / "nowhere")}
    p = subprocess.Popen([sys.executable, str(HOOK)], env=env, stdin=subprocess.PIPE, stderr=subprocess.PIPE)
    _, err = p.communicate(json.dumps({"pid": h.pid, "host_bytes": 1}).encode(), 10)
    assert p.returncode == 3 and "no broker socket at" in err.decode()
    assert broker.status()["leases"] == [] and broker.status()["queue"] == []


def test_lease_released_when_its_process_is_killed_and_waits_for_descendants(broker, holders):
    parent = holders(["sh", "-c", "sleep 60 & wait"])       # the lease's pid has a child (as the engine stage)
    p = broker.hook({"pid": parent.pid, "host_bytes": 600 * MB})
    assert p.wait(10) == 0 and lines(p)[-1]["event"] == "granted"
    wait_for(lambda: broker.status()["leases"][0]["kids"], 5, "the lease to note the child")
    child = broker.status()["leases"][0]["kids"][0][0]
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    time.sleep(1.5)
    assert len(broker.status()["leases"]) == 1, "released while the child still holds the memory"
    t0 = time.monotonic()
    os.kill(child, signal.SIGKILL)
    wait_for(lambda: broker.status()["leases"] == [], 5, "the lease to be released")
    assert time.monotonic() - t0 < 3


def test_broker_sigkill_mid_queue_keeps_leases_and_queue_order(tmp_path, holders):
    b = BrokerProc(tmp_path).start()
    try:
        a, x, y = holders(), holders(), holders()
        ha = b.hook({"pid": a.pid, "host_bytes": 600 * MB, "unit": "a.service"})
        assert ha.wait(10) == 0
        hx = b.hook({"pid": x.pid, "host_bytes": 600 * MB, "unit": "x.service"})
        wait_for(lambda: len(b.status()["queue"]) == 1, 5, "x queued")
        hy = b.hook({"pid": y.pid, "host_bytes": 300 * MB, "unit": "y.service"})   # fits now, but behind x
        wait_for(lambda: len(b.status()["queue"]) == 2, 5, "y queued")
        before = b.status()
        b.stop(signal.SIGKILL)
        time.sleep(1.0)
        assert hx.poll() is None and hy.poll() is None, "the hooks must keep waiting through a broker restart"
        b.start()
        after = b.status()
        assert [e["id"] for e in after["leases"]] == [e["id"] for e in before["leases"]]
        assert [e["need"]["unit"] for e in after["queue"]] == ["x.service", "y.service"]
        assert after["queue"][0]["position"] == 1 and "held by lease(s)" in after["queue"][0]["waits_for"]
        a.kill()
        assert hx.wait(10) == 0 and hy.wait(10) == 0            # x first, then y beside it
        assert sorted(e["need"]["unit"] for e in b.status()["leases"]) == ["x.service", "y.service"]
        events = [e["event"] for e in lines(hx)]
        assert events[0] == "queued" and events[-1] == "granted" and "refused" not in events
    finally:
        b.close()


def test_a_reused_pid_does_not_keep_a_lease(tmp_path, holders):
    """The state names a live pid with another start time (the pid was reused): released at restart."""
    b = BrokerProc(tmp_path).start()
    h = holders()
    assert b.hook({"pid": h.pid, "host_bytes": 5}).wait(10) == 0
    b.stop()
    path = tmp_path / "state" / "state.json"
    st = json.loads(path.read_text())
    assert st["leases"][0]["need"]["pid"] == h.pid
    st["leases"][0]["start_time"] -= 100.0
    path.write_text(json.dumps(st))
    b.start()
    try:
        wait_for(lambda: b.status()["leases"] == [], 5, "the stale lease to go")
    finally:
        b.close()


def test_hook_stopped_while_queued_withdraws_its_need(broker, holders):
    a, x = holders(), holders()
    assert broker.hook({"pid": a.pid, "host_bytes": 600 * MB}).wait(10) == 0
    hx = broker.hook({"pid": x.pid, "host_bytes": 600 * MB})
    wait_for(lambda: len(broker.status()["queue"]) == 1, 5, "x queued")
    hx.send_signal(signal.SIGTERM)
    assert hx.wait(10) == 4 and "withdrawn" in lines(hx)[-1]["reason"]
    assert broker.status()["queue"] == []


def test_status_command_prints_grants_and_queue(broker, holders):
    a, x = holders(), holders()
    assert broker.hook({"pid": a.pid, "host_bytes": 600 * MB, "unit": "a.service"}).wait(10) == 0
    broker.hook({"pid": x.pid, "host_bytes": 600 * MB, "unit": "x.service"})
    wait_for(lambda: len(broker.status()["queue"]) == 1, 5, "x queued")
    out = subprocess.run([sys.executable, "-m", "bloomery.broker.cli", "status"], env=broker.env, cwd=REPO,
                         capture_output=True, text=True, timeout=20)
    assert out.returncode == 0
    assert "leases: 1" in out.stdout and "unit=a.service" in out.stdout
    assert "queue: 1" in out.stdout and "1. " in out.stdout and "unit=x.service" in out.stdout \
        and "waits for: host: needs 600000000" in out.stdout


def test_a_second_broker_and_a_broken_state_are_refused_by_name(tmp_path):
    b = BrokerProc(tmp_path).start()
    try:
        out = subprocess.run([sys.executable, "-m", "bloomery.broker.cli", "--config", str(b.cfg)], env=b.env,
                             cwd=REPO, capture_output=True, text=True, timeout=20)
        assert out.returncode == 1 and f"another broker answers at {b.sock}" in out.stderr
        assert b.status()["op"] == "status"                    # the first one still serves
    finally:
        b.close()
    (tmp_path / "state" / "state.json").write_text('{"version": 1, "leases": [{"id": "x"}]}')
    out = subprocess.run([sys.executable, "-m", "bloomery.broker.cli", "--config", str(b.cfg)], env=b.env,
                         cwd=REPO, capture_output=True, text=True, timeout=20)
    assert out.returncode == 1 and "state.json: unreadable (KeyError" in out.stderr and "move it aside" in out.stderr


def test_a_process_of_another_session_cannot_take_or_release_a_lease_in_another_name(broker, holders):
    """The broker reads the asker's pid from the socket (SO_PEERCRED, through libzmq's Peer-Address)."""
    h = holders()
    mine = broker.ask({"op": "need", "id": "mine", "need": {"pid": h.pid, "host_bytes": 5}})
    assert mine["op"] == "granted"
    other = holders(["sleep", "60"])
    asker = [sys.executable, "-c", f"""
import json, sys, zmq
s = zmq.Context().socket(zmq.DEALER); s.setsockopt(zmq.LINGER, 0); s.connect("ipc://{broker.sock}")
for req in ({{"op": "need", "id": "theirs", "need": {{"pid": {other.pid}, "host_bytes": 5}}}},
            {{"op": "release", "id": "mine"}}):
    s.send(json.dumps(req).encode()); print(s.recv().decode())
"""]
    out = subprocess.run(asker, capture_output=True, text=True, timeout=20, start_new_session=True)
    answers = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(answers) == 2, out.stderr
    for answer in answers:
        assert answer["op"] == "refused" and "not in its session" in answer["reason"], answer
    st = broker.status()
    assert [e["id"] for e in st["leases"]] == ["mine"] and st["queue"] == []
    # the same asker in this session (as a need hook in its server's) may
    out = subprocess.run(asker, capture_output=True, text=True, timeout=20)
    assert [json.loads(line)["op"] for line in out.stdout.splitlines()] == ["granted", "released"], out.stderr
