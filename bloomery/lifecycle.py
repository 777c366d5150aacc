"""The one phase machine of a server: fetch -> plan -> load -> ready -> draining -> stopped.

It drives /health and the loading gate (every route answers llama-server's 503
"Loading model" with the phase until READY), sd_notify, and one record per
change. Pure bookkeeping: no sockets except the optional NOTIFY_SOCKET datagram.
"""
from __future__ import annotations

import os
import socket
import time
from enum import Enum

from bloomery.records import record


class Phase(str, Enum):
    FETCH = "fetch"
    PLAN = "plan"
    LOAD = "load"
    READY = "ready"
    DRAINING = "draining"
    STOPPED = "stopped"


_NEXT = {
    Phase.FETCH: {Phase.PLAN, Phase.DRAINING, Phase.STOPPED},
    Phase.PLAN: {Phase.LOAD, Phase.DRAINING, Phase.STOPPED},
    Phase.LOAD: {Phase.READY, Phase.DRAINING, Phase.STOPPED},
    Phase.READY: {Phase.DRAINING, Phase.STOPPED},
    Phase.DRAINING: {Phase.STOPPED},
    Phase.STOPPED: set(),
}


class LifecycleError(Exception):
    pass


def sd_notify(message: str, env: dict | None = None) -> bool:
    """systemd's notify protocol: one datagram to $NOTIFY_SOCKET; False when not under systemd."""
    path = (env if env is not None else os.environ).get("NOTIFY_SOCKET")
    if not path:
        return False
    addr = "\0" + path[1:] if path.startswith("@") else path   # abstract namespace
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(message.encode(), addr)
    return True


class Lifecycle:
    def __init__(self, notify_env: dict | None = None):
        self.phase = Phase.FETCH
        self.since_s = time.monotonic()
        self.reason = ""
        self._notify_env = notify_env
        sd_notify(f"STATUS=phase {self.phase.value}", self._notify_env)

    def advance(self, to: Phase, reason: str = "", **kv) -> None:
        if to == self.phase:
            return
        if to not in _NEXT[self.phase]:
            raise LifecycleError(f"phase {self.phase.value} cannot go to {to.value} "
                                 f"(it goes to {', '.join(sorted(p.value for p in _NEXT[self.phase])) or 'nothing'})")
        took_s = round(time.monotonic() - self.since_s, 3)
        record(to.value, "phase", component="lifecycle", **{"from": self.phase.value}, took_s=took_s,
               **({"reason": reason} if reason else {}), **kv)
        self.phase, self.since_s, self.reason = to, time.monotonic(), reason
        if to == Phase.READY:
            sd_notify("READY=1\nSTATUS=ready", self._notify_env)
        elif to == Phase.DRAINING:
            sd_notify(f"STOPPING=1\nSTATUS=draining ({reason})", self._notify_env)
        else:
            sd_notify(f"STATUS=phase {to.value}", self._notify_env)

    @property
    def ready(self) -> bool:
        return self.phase == Phase.READY

    @property
    def loading(self) -> bool:
        return self.phase in (Phase.FETCH, Phase.PLAN, Phase.LOAD)

    def gate(self) -> tuple[int, dict] | None:
        """None when requests pass; else (status, body) every route answers."""
        if self.ready:
            return None
        if self.loading:   # llama-server's loading body, plus the phase
            return 503, {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error",
                                   "phase": self.phase.value}}
        return 503, {"error": {"code": 503, "message": "Server is shutting down", "type": "unavailable_error",
                               "phase": self.phase.value}}

    def health(self) -> tuple[int, dict]:
        return self.gate() or (200, {"status": "ok"})
