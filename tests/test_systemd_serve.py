"""A real bloomery-serve on the real model, started as systemd starts bloomery@.service with
bloomery@.socket: the listening socket at fd 3 (LISTEN_FDS/LISTEN_PID), a NOTIFY_SOCKET,
WATCHDOG_USEC/WATCHDOG_PID, and a need hook that keeps the start queued for a while.
What a service manager sees is checked: the datagrams in order, from the main pid only,
READY only once the server answers, the watchdog never silent, STOPPING on SIGTERM."""
from __future__ import annotations

import json
import os
import signal
import socket
import struct
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from test_systemd_protocol import launch

pytestmark = pytest.mark.real_model

REPO = Path(__file__).resolve().parents[1]
WATCHDOG_USEC = 2_000_000       # pings every 1 s; systemd would kill after 2 s of silence
HOOK_S = 1.5                    # how long the need hook keeps the start queued


def _health(port: int) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


class Manager:
    """Plays systemd: holds the port, receives the notify datagrams with their sender's pid."""

    def __init__(self, tmp: Path, model: Path):
        self.listener = socket.create_server(("127.0.0.1", 0), backlog=64)
        self.port = self.listener.getsockname()[1]
        self.decoy = socket.create_server(("127.0.0.1", 0))   # --port names it: binding it would fail
        self.rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.rx.bind(str(tmp / "notify"))
        self.rx.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.got: list[dict] = []          # {"t", "pid", "fields", "health"}
        self.ready = threading.Event()
        hook = tmp / "need-hook"
        hook.write_text(f"#!/bin/sh\ncat > {tmp}/need.json\nsleep {HOOK_S}\nexit 0\n")
        hook.chmod(0o755)
        manager_env = {"LISTEN_FDS": "1", "LISTEN_FDNAMES": "http", "LISTEN_PID": "$PID",
                       "NOTIFY_SOCKET": str(tmp / "notify"), "WATCHDOG_USEC": str(WATCHDOG_USEC), "WATCHDOG_PID": "$PID"}
        self.proc = launch(self.listener.fileno(), manager_env, "-m", str(model), "--port", str(self.decoy.getsockname()[1]),
                           "-c", "512", "--no-warmup", "--need-hook", str(hook))
        self.lines: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()
        threading.Thread(target=self._receive, daemon=True).start()

    def _pump(self) -> None:
        for raw in self.proc.stderr:
            self.lines.append(raw.decode("utf-8", "replace").rstrip("\n"))

    def _receive(self) -> None:
        t0 = time.monotonic()
        while True:
            try:
                data, anc, _, _ = self.rx.recvmsg(4096, socket.CMSG_SPACE(12))
            except OSError:
                return
            pid = next((struct.unpack("3i", d)[0] for lvl, typ, d in anc
                        if lvl == socket.SOL_SOCKET and typ == socket.SCM_CREDENTIALS), None)
            fields = dict(line.split("=", 1) for line in data.decode().split("\n"))
            entry = {"t": time.monotonic() - t0, "pid": pid, "fields": fields, "health": None}
            status = fields.get("STATUS", "")
            if "READY" in fields or status.startswith(("loading", "queued")):
                entry["health"] = _health(self.port)      # what a client sees the moment systemd hears it
            self.got.append(entry)
            if "READY" in fields:
                self.ready.set()

    def messages(self) -> list[dict]:
        return [g["fields"] for g in self.got]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for s in (self.listener, self.decoy, self.rx):
            s.close()


@pytest.fixture(scope="module")
def manager(real_model_path, tmp_path_factory):
    m = Manager(tmp_path_factory.mktemp("systemd"), real_model_path)
    try:
        if not m.ready.wait(600):
            pytest.fail("no READY=1 in 600 s:\n" + "\n".join(m.lines[-30:]))
        yield m
    finally:
        m.close()


def _statuses(m: Manager) -> list[str]:
    return [f["STATUS"].split(" (")[0] for f in m.messages() if "STATUS" in f]


def test_phases_reach_systemd_in_order_with_extend_while_starting(manager):
    assert _statuses(manager)[:5] == ["fetching the model", "planning the load",
                                      "queued: waiting for the need hook to grant the start",
                                      "loading the weights", "ready"]
    starting = [f for f in manager.messages() if f.get("STATUS", "").startswith(("fetching", "planning",
                                                                                   "queued", "loading"))]
    assert all(int(f["EXTEND_TIMEOUT_USEC"]) >= 30_000_000 for f in starting)   # each start phase extends


def test_ready_only_once_the_server_answers(manager):
    ready = [g for g in manager.got if "READY" in g["fields"]]
    assert len(ready) == 1 and ready[0]["fields"]["READY"] == "1"
    assert ready[0]["health"] == (200, {"status": "ok"})
    for g in manager.got[:manager.got.index(ready[0])]:      # before READY: loading or queued, answered 503
        if g["health"] is not None:
            status, body = g["health"]
            assert status == 503 and body["error"]["phase"] in ("queued", "load")


def test_every_datagram_comes_from_the_main_pid(manager):
    """NotifyAccess=main: systemd drops what a stage or the hook would send."""
    assert {g["pid"] for g in manager.got} == {manager.proc.pid}


def test_watchdog_pings_from_start_to_ready_and_after(manager):
    time.sleep(2.5)                    # a few pings while ready
    ready_t = next(g["t"] for g in manager.got if "READY" in g["fields"])
    pings = [g["t"] for g in manager.got if g["fields"] == {"WATCHDOG": "1"}]
    assert pings[0] < manager.got[1]["t"] + 1.0 and any(t > ready_t for t in pings)
    gaps = [b - a for a, b in zip(pings, pings[1:])]
    assert max(gaps) < WATCHDOG_USEC / 1e6, f"the watchdog went silent for {max(gaps):.2f} s"


def test_the_passed_socket_serves_and_no_port_is_bound(manager):
    listen = next(line for line in manager.lines if "listening" in line)
    assert f"port={manager.port}" in listen
    body = json.dumps({"content": "def add(a, b):"}).encode()      # the App answers (not the engine: kept fast)
    req = urllib.request.Request(f"http://127.0.0.1:{manager.port}/tokenize", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        out = json.loads(r.read())
    assert r.status == 200 and len(out["tokens"]) >= 5
    need = json.loads((Path(manager.rx.getsockname()).parent / "need.json").read_text())
    assert need["pid"] == manager.proc.pid


def test_sigterm_sends_stopping_then_exits_0(manager):
    n_before = len(manager.got)
    manager.proc.send_signal(signal.SIGTERM)
    assert manager.proc.wait(60) == 0
    time.sleep(0.3)
    after = [f for f in manager.messages()[n_before:] if f != {"WATCHDOG": "1"}]
    assert after[0]["STOPPING"] == "1" and after[0]["STATUS"].startswith("draining (SIGTERM")
    assert after[-1]["STATUS"].startswith("stopped")
