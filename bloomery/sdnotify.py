"""systemd's notify protocol on the stdlib (no python-systemd): READY, STATUS, EXTEND_TIMEOUT_USEC,
WATCHDOG, STOPPING as datagrams to $NOTIFY_SOCKET, and the pulse that keeps a long start and a
live serve loop known to the service manager.

The protocol (sd_notify(3)): one AF_UNIX datagram of newline-separated KEY=VALUE lines to the
path in $NOTIFY_SOCKET ("@name" is the abstract namespace). The unit's NotifyAccess=main makes
systemd take them only from the main process, so only the supervisor sends; stages never do.
The watchdog (sd_watchdog_enabled(3)): $WATCHDOG_USEC is the timeout; $WATCHDOG_PID, when set,
names the one process meant (a child that inherited the variables is not it). We ping at half
the timeout, as the man page advises.
"""
from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Callable, Mapping

from bloomery.records import record
from bloomery.settings import SettingsError

EXTEND_S = 60.0              # each EXTEND_TIMEOUT_USEC promises the next message within this
EXTEND_EVERY_S = EXTEND_S / 3   # re-sent this often while a start phase lasts (a late tick still lands in time)
SEND_TIMEOUT_S = 1.0         # a full systemd queue must not stall the serve loop longer than this


class NotifyError(SettingsError):
    """The notify or watchdog environment cannot be used; the start is refused naming the variable."""


def notify_address(env: Mapping[str, str]) -> str | None:
    """$NOTIFY_SOCKET -> a socket address for sendto, None when not under a notify-type unit."""
    path = env.get("NOTIFY_SOCKET", "")
    if not path:
        return None
    if path.startswith("@"):
        return "\0" + path[1:]          # abstract namespace
    if path.startswith("/"):
        return path
    # systemd 253+ may also pass vsock:CID:PORT (for VMs); we only serve the AF_UNIX forms
    raise NotifyError(f"NOTIFY_SOCKET={path!r}: not served; give an absolute AF_UNIX path or @abstract name")


def watchdog_interval_s(env: Mapping[str, str], pid: int) -> float | None:
    """How often to send WATCHDOG=1 (half of $WATCHDOG_USEC), None when no watchdog is asked of us."""
    raw = env.get("WATCHDOG_USEC", "")
    if not raw:
        return None
    try:
        usec = int(raw)
    except ValueError:
        usec = 0
    if usec <= 0:
        raise NotifyError(f"WATCHDOG_USEC={raw!r}: must be a whole number of microseconds > 0")
    raw_pid = env.get("WATCHDOG_PID", "")
    if raw_pid:
        try:
            wd_pid = int(raw_pid)
        except ValueError:
            raise NotifyError(f"WATCHDOG_PID={raw_pid!r}: must be a process id") from None
        if wd_pid != pid:               # the variables were inherited: the watchdog is another process's
            return None
    return usec / 1e6 / 2


def format_message(**fields: object) -> str:
    """KEY=VALUE lines; a value never carries a newline (it would start a new field)."""
    return "\n".join(f"{k}={' '.join(str(v).splitlines())}" for k, v in fields.items())


class Notifier:
    """Sends datagrams to $NOTIFY_SOCKET; every method is a no-op (False) when not under systemd."""

    def __init__(self, env: Mapping[str, str] | None = None, pid: int | None = None):
        env = os.environ if env is None else env
        self.pid = os.getpid() if pid is None else pid
        self.error: NotifyError | None = None
        self.addr: str | None = None
        self.watchdog_s: float | None = None
        try:                            # kept, not raised: the supervisor refuses the start by name (check())
            self.addr = notify_address(env)
            self.watchdog_s = watchdog_interval_s(env, self.pid)
        except NotifyError as e:
            self.error = e
        self.sent: list[str] = []       # what went out, in order (records and tests)
        self._sock: socket.socket | None = None
        self._warned = False

    @property
    def enabled(self) -> bool:
        return self.addr is not None

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def send(self, message: str) -> bool:
        if self.addr is None:
            return False
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)   # close-on-exec by default
                self._sock.settimeout(SEND_TIMEOUT_S)
            self._sock.sendto(message.encode("utf-8"), self.addr)
        except OSError as e:            # systemd gone or its queue full: say so once, keep serving
            if not self._warned:
                self._warned = True
                record("serve", "sd_notify failed", component="systemd", level="warning",
                       socket=self.addr.replace("\0", "@"), error=str(e))
            return False
        self.sent.append(message)
        return True

    def status(self, text: str, extend_s: float | None = None) -> bool:
        fields = {"STATUS": text}
        if extend_s:
            fields["EXTEND_TIMEOUT_USEC"] = int(extend_s * 1e6)
        return self.send(format_message(**fields))

    def ready(self, status: str) -> bool:
        return self.send(format_message(READY=1, STATUS=status))

    def stopping(self, status: str) -> bool:
        return self.send(format_message(STOPPING=1, STATUS=status))

    def extend(self, extend_s: float) -> bool:
        return self.send(format_message(EXTEND_TIMEOUT_USEC=int(extend_s * 1e6)))

    def watchdog(self) -> bool:
        return self.send("WATCHDOG=1")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def sd_notify(message: str, env: Mapping[str, str] | None = None) -> bool:
    """One datagram to $NOTIFY_SOCKET; False when not under systemd."""
    n = Notifier(env)
    try:
        return n.send(message)
    finally:
        n.close()


async def pulse(notifier: Notifier, starting: Callable[[], bool], extend_s: float = EXTEND_S,
                extend_every_s: float = EXTEND_EVERY_S) -> None:
    """Runs on the serve loop until cancelled: WATCHDOG=1 every watchdog interval (so a stuck loop is
    killed by WatchdogSec), EXTEND_TIMEOUT_USEC every extend_every_s while starting() (so a long
    fetch, queue or load is not killed by TimeoutStartSec)."""
    if not notifier.enabled:
        return
    now = time.monotonic()
    next_dog = now if notifier.watchdog_s else float("inf")
    next_extend = now + extend_every_s        # entering a start phase already sent one (Lifecycle)
    while True:
        now = time.monotonic()
        if now >= next_dog:
            notifier.watchdog()
            next_dog = now + notifier.watchdog_s
        if now >= next_extend:
            if starting():
                notifier.extend(extend_s)
            next_extend = now + extend_every_s
        await asyncio.sleep(max(0.0, min(next_dog, next_extend) - time.monotonic()))
