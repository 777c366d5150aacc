"""sd_notify and socket activation on real sockets and fds, without a model: the protocol
pieces (sdnotify.py, socket_activation.py, the lifecycle's messages) and the start refusals
a wrong environment gets from a real bloomery-serve process."""
from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from bloomery.lifecycle import Lifecycle, Phase
from bloomery.sdnotify import Notifier, NotifyError, pulse, watchdog_interval_s
from bloomery.socket_activation import ActivationError, listening_socket, passed_fds

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def notify_rx(tmp_path):
    rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    rx.bind(str(tmp_path / "notify"))
    rx.settimeout(5)
    yield rx, str(tmp_path / "notify")
    rx.close()


def _drain(rx, quiet_s: float = 0.2):
    """Every datagram until none came for quiet_s."""
    out = []
    rx.settimeout(quiet_s)
    try:
        while True:
            out.append(rx.recv(4096).decode())
    except TimeoutError:
        return out


# -- sd_notify ----------------------------------------------------------------------------
def test_lifecycle_tells_systemd_each_phase_in_order(notify_rx):
    rx, path = notify_rx
    life = Lifecycle(Notifier({"NOTIFY_SOCKET": path}))
    for p in (Phase.PLAN, Phase.QUEUED, Phase.LOAD, Phase.READY, Phase.DRAINING, Phase.STOPPED):
        life.advance(p, **({"reason": "SIGTERM"} if p in (Phase.DRAINING, Phase.STOPPED) else {}))
    got = [dict(line.split("=", 1) for line in m.split("\n")) for m in _drain(rx)]
    statuses = [g["STATUS"].split(" (")[0] for g in got]
    assert statuses == ["fetching the model", "planning the load",
                        "queued: waiting for the need hook to grant the start", "loading the weights",
                        "ready", "draining", "stopped"]
    # every start phase extends TimeoutStartSec; READY only on ready; STOPPING on draining
    assert [("EXTEND_TIMEOUT_USEC" in g) for g in got] == [True] * 4 + [False] * 3
    assert [g.get("READY") for g in got] == [None] * 4 + ["1", None, None]
    assert [g.get("STOPPING") for g in got] == [None] * 5 + ["1", None]
    assert got[5]["STATUS"] == "draining (SIGTERM)"


def test_abstract_notify_socket(tmp_path):
    name = f"bloomery-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as rx:
        rx.bind("\0" + name)
        rx.settimeout(5)
        assert Notifier({"NOTIFY_SOCKET": "@" + name}).ready("ready")
        assert rx.recv(100) == b"READY=1\nSTATUS=ready"


def test_status_text_cannot_inject_a_field(notify_rx):
    rx, path = notify_rx
    Notifier({"NOTIFY_SOCKET": path}).status("refused: bad\nREADY=1")
    assert rx.recv(200) == b"STATUS=refused: bad READY=1"


def test_no_notify_socket_sends_nothing():
    n = Notifier({})
    assert not n.enabled and not n.ready("ready") and n.sent == []


@pytest.mark.parametrize("env,named", [
    ({"NOTIFY_SOCKET": "vsock:2:1234"}, "NOTIFY_SOCKET='vsock:2:1234'"),
    ({"NOTIFY_SOCKET": "relative/path"}, "NOTIFY_SOCKET='relative/path'"),
    ({"WATCHDOG_USEC": "soon"}, "WATCHDOG_USEC='soon'"),
    ({"WATCHDOG_USEC": "0"}, "WATCHDOG_USEC='0'"),
    ({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "me"}, "WATCHDOG_PID='me'"),
])
def test_unusable_notify_environment_is_named(env, named):
    n = Notifier(env)
    with pytest.raises(NotifyError) as e:
        n.check()
    assert named in str(e.value)


def test_watchdog_interval_is_half_and_only_for_the_named_pid():
    assert watchdog_interval_s({"WATCHDOG_USEC": "3000000"}, 7) == 1.5
    assert watchdog_interval_s({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": "7"}, 7) == 1.5
    assert watchdog_interval_s({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": "8"}, 7) is None   # inherited
    assert watchdog_interval_s({}, 7) is None


def test_pulse_pings_the_watchdog_and_extends_only_while_starting(notify_rx):
    rx, path = notify_rx
    n = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "100000"})    # ping every 0.05 s
    starting = {"now": True}
    got: list[tuple[float, str]] = []
    t0 = time.monotonic()

    def read():
        rx.settimeout(1.0)
        try:
            while True:
                m = rx.recv(4096).decode()
                got.append((time.monotonic() - t0, m))
        except TimeoutError:
            pass

    reader = threading.Thread(target=read)
    reader.start()

    async def run():
        task = asyncio.create_task(pulse(n, lambda: starting["now"], extend_s=9, extend_every_s=0.1))
        await asyncio.sleep(0.35)
        starting["now"] = False
        starting["at"] = time.monotonic() - t0
        await asyncio.sleep(0.35)
        task.cancel()

    asyncio.run(run())
    reader.join()
    dogs = [t for t, m in got if m == "WATCHDOG=1"]
    extends = [t for t, m in got if m == "EXTEND_TIMEOUT_USEC=9000000"]
    assert len(dogs) >= 10 and max(b - a for a, b in zip(dogs, dogs[1:])) < 0.1   # never a gap of WATCHDOG_USEC
    assert 2 <= len(extends) <= 4 and max(extends) < starting["at"] + 0.02          # none once the start ended
    assert n.sent.count("WATCHDOG=1") == len(dogs)                                  # none lost


# -- socket activation: the environment -------------------------------------------------
@pytest.mark.parametrize("env,named", [
    ({"LISTEN_FDS": "1", "LISTEN_PID": "99"}, "LISTEN_PID=99: the sockets were passed to another process"),
    ({"LISTEN_FDS": "1"}, "without LISTEN_PID"),
    ({"LISTEN_FDS": "0", "LISTEN_PID": "42"}, "LISTEN_FDS='0'"),
    ({"LISTEN_FDS": "x", "LISTEN_PID": "42"}, "LISTEN_FDS='x'"),
    ({"LISTEN_FDS": "1", "LISTEN_PID": "pid"}, "LISTEN_PID='pid'"),
    ({"LISTEN_FDS": "2", "LISTEN_PID": "42", "LISTEN_FDNAMES": "http"}, "names 1 sockets, LISTEN_FDS=2"),
    ({"LISTEN_PID": "42"}, "without LISTEN_FDS"),
])
def test_inconsistent_activation_environment_is_named(env, named):
    with pytest.raises(ActivationError) as e:
        passed_fds(env, 42)
    assert named in str(e.value)


def test_passed_fds_start_at_3_with_their_names():
    assert passed_fds({}, 42) is None
    assert passed_fds({"LISTEN_FDS": "2", "LISTEN_PID": "42", "LISTEN_FDNAMES": "http:admin"}, 42) == \
        [(3, "http"), (4, "admin")]
    assert passed_fds({"LISTEN_FDS": "1", "LISTEN_PID": "42"}, 42) == [(3, "unknown")]


# -- socket activation: the fd, through a real bloomery-serve ----------------------------
LAUNCHER = r"""
import os, sys
fd, args = int(sys.argv[1]), sys.argv[2:]
if fd != 3:
    os.dup2(fd, 3)
    os.close(fd)
os.set_inheritable(3, True)
while args[0] != "--":                      # KEY=VALUE pairs; $PID is this process (exec keeps it)
    key, value = args.pop(0).split("=", 1)
    os.environ[key] = value.replace("$PID", str(os.getpid()))
os.execv(sys.executable, [sys.executable, *args[1:]])
"""


def launch(fd: int, env_pairs: dict, *args: str, env: dict | None = None, **popen) -> subprocess.Popen:
    """bloomery-serve with `fd` at fd 3 and env_pairs set in the exec'd process, as systemd starts a
    socket-activated unit ($PID in a value: the server's own pid)."""
    pairs = [f"{k}={v}" for k, v in env_pairs.items()]
    return subprocess.Popen([sys.executable, "-c", LAUNCHER, str(fd), *pairs, "--", "-m", "bloomery.supervisor", *args],
                            cwd=REPO, pass_fds=(fd,), env={**os.environ, **(env or {})},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, **popen)


def start_with_fd(fd: int, listen_pid: str, *args: str) -> subprocess.Popen:
    return launch(fd, {"LISTEN_FDS": "1", "LISTEN_FDNAMES": "http", "LISTEN_PID": listen_pid}, *args)


def _refused(proc: subprocess.Popen) -> str:
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err.decode()
    return err.decode()


@pytest.fixture
def tcp_listener():
    s = socket.create_server(("127.0.0.1", 0))
    yield s
    s.close()


def test_listen_pid_of_another_process_is_refused(tcp_listener, tmp_path):
    err = _refused(start_with_fd(tcp_listener.fileno(), "1", "-m", str(tmp_path / "x.gguf")))
    assert "LISTEN_PID=1: the sockets were passed to another process" in err


@pytest.mark.parametrize("kind,named", [
    ("udp", "a SOCK_DGRAM socket; bloomery@.socket must use ListenStream="),
    ("pipe", "not a socket (a pipe)"),
    ("connected", "not listening (Accept=yes passes one connection)"),
    ("unix", "a AF_UNIX socket; ListenStream= must be an IP address"),
])
def test_wrong_fd_kind_is_refused_by_name(kind, named, tcp_listener, tmp_path):
    keep = []
    if kind == "udp":
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind(("127.0.0.1", 0))
        keep.append(s)
        fd = s.fileno()
    elif kind == "pipe":
        r, w = os.pipe()
        keep += [r, w]
        fd = r
    elif kind == "connected":
        c = socket.create_connection(tcp_listener.getsockname())
        keep.append(c)
        fd = c.fileno()
    else:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(str(tmp_path / "u.sock"))
        s.listen()
        keep.append(s)
        fd = s.fileno()
    try:
        err = _refused(start_with_fd(fd, "$PID", "-m", str(tmp_path / "x.gguf")))
    finally:
        for k in keep:
            os.close(k) if isinstance(k, int) else k.close()
    assert f"LISTEN_FDS socket fd 3 (http): {named}" in err


def test_unusable_notify_socket_refuses_the_start(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bloomery.supervisor", "-m", str(tmp_path / "x.gguf"), "--port", "0"],
                          cwd=REPO, env={**os.environ, "NOTIFY_SOCKET": "vsock:2:99"}, capture_output=True, timeout=60)
    assert proc.returncode == 1
    assert "NOTIFY_SOCKET='vsock:2:99': not served" in proc.stderr.decode()


def test_listening_socket_adopts_fd3_and_clears_the_variables(tcp_listener):
    """In-process: the passed listener at fd 3 comes back close-on-exec, and LISTEN_* are gone."""
    saved = os.dup(3) if _fd_open(3) else None
    try:
        os.dup2(tcp_listener.fileno(), 3)
        env = {"LISTEN_FDS": "1", "LISTEN_PID": str(os.getpid()), "LISTEN_FDNAMES": "http", "OTHER": "x"}
        sock = listening_socket(env)
        assert sock.fileno() == 3 and sock.getsockname() == tcp_listener.getsockname()
        assert not os.get_inheritable(3)
        assert env == {"OTHER": "x"}
        sock.detach()
    finally:
        if saved is not None:
            os.dup2(saved, 3)
            os.close(saved)
        else:
            os.close(3)


def _fd_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False
