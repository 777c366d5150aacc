"""The one phase machine of a server: fetch -> plan [-> queued] -> load -> ready -> draining -> stopped.

It drives /health and the loading gate (every route answers llama-server's 503
"Loading model" with the phase until READY), one record per change, and what
systemd hears (sdnotify.py sends it): a STATUS line per phase, EXTEND_TIMEOUT_USEC
on entering each start phase (the supervisor's pulse re-sends it while the phase
lasts), READY=1 only on ready (after the engine's READY), STOPPING=1 on draining.
Bookkeeping only: the datagrams go through the Notifier it is given.
"""
from __future__ import annotations

import time
from enum import Enum

from bloomery.records import record
from bloomery.sdnotify import EXTEND_S, Notifier, sd_notify  # noqa: F401  (sd_notify: older callers)


class Phase(str, Enum):
    FETCH = "fetch"
    PLAN = "plan"
    QUEUED = "queued"       # the need hook (a host broker) has not granted the start yet
    LOAD = "load"
    READY = "ready"
    DRAINING = "draining"
    STOPPED = "stopped"


# the phases of a start: systemd's TimeoutStartSec is extended while one lasts
STARTING = frozenset({Phase.FETCH, Phase.PLAN, Phase.QUEUED, Phase.LOAD})

_NEXT = {
    Phase.FETCH: {Phase.PLAN, Phase.DRAINING, Phase.STOPPED},
    Phase.PLAN: {Phase.QUEUED, Phase.LOAD, Phase.DRAINING, Phase.STOPPED},
    Phase.QUEUED: {Phase.LOAD, Phase.DRAINING, Phase.STOPPED},
    Phase.LOAD: {Phase.READY, Phase.DRAINING, Phase.STOPPED},
    Phase.READY: {Phase.DRAINING, Phase.STOPPED},
    Phase.DRAINING: {Phase.STOPPED},
    Phase.STOPPED: set(),
}

_STATUS = {   # what `systemctl status` shows per phase
    Phase.FETCH: "fetching the model",
    Phase.PLAN: "planning the load",
    Phase.QUEUED: "queued: waiting for the need hook to grant the start",
    Phase.LOAD: "loading the weights",
    Phase.READY: "ready",
    Phase.DRAINING: "draining",
    Phase.STOPPED: "stopped",
}


class LifecycleError(Exception):
    pass


def status_text(phase: Phase, reason: str = "", **kv) -> str:
    """The STATUS= line of a phase: its words, then the reason and the facts given (k=v)."""
    extra = [reason] if reason else []
    extra += [f"{k}={v}" for k, v in kv.items()]
    return f"{_STATUS[phase]} ({', '.join(extra)})" if extra else _STATUS[phase]


class Lifecycle:
    def __init__(self, notifier: Notifier | None = None, *, notify_env: dict | None = None, router: bool = False):
        # a router (no model; bloomery/router) has nothing to fetch, plan or load: it is ready at once
        self._next = {**_NEXT, Phase.FETCH: _NEXT[Phase.FETCH] | {Phase.READY}} if router else _NEXT
        self.phase = Phase.FETCH
        self.since_s = time.monotonic()
        self.reason = ""
        self.notifier = notifier if notifier is not None else Notifier(notify_env)
        self._tell(self.phase)

    def _tell(self, to: Phase, reason: str = "", **kv) -> None:
        text = status_text(to, reason, **kv)
        if to == Phase.READY:
            self.notifier.ready(text)
        elif to == Phase.DRAINING:
            self.notifier.stopping(text)
        else:
            self.notifier.status(text, extend_s=EXTEND_S if to in STARTING else None)

    def advance(self, to: Phase, reason: str = "", **kv) -> None:
        if to == self.phase:
            return
        allowed = self._next[self.phase]
        if to not in allowed:
            raise LifecycleError(f"phase {self.phase.value} cannot go to {to.value} "
                                 f"(it goes to {', '.join(sorted(p.value for p in allowed)) or 'nothing'})")
        took_s = round(time.monotonic() - self.since_s, 3)
        record(to.value, "phase", component="lifecycle", **{"from": self.phase.value}, took_s=took_s,
               **({"reason": reason} if reason else {}), **kv)
        self.phase, self.since_s, self.reason = to, time.monotonic(), reason
        self._tell(to, reason, **kv)

    def starting(self) -> bool:
        """True while a start phase lasts (the pulse extends systemd's start timeout then)."""
        return self.phase in STARTING

    @property
    def ready(self) -> bool:
        return self.phase == Phase.READY

    @property
    def loading(self) -> bool:
        return self.phase in STARTING

    def gate(self) -> tuple[int, dict] | None:
        """None when requests pass; else (status, body) every route answers."""
        if self.ready:
            return None
        if self.loading:   # llama-server's loading body, plus the phase (queued included)
            return 503, {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error",
                                   "phase": self.phase.value}}
        return 503, {"error": {"code": 503, "message": "Server is shutting down", "type": "unavailable_error",
                               "phase": self.phase.value}}

    def health(self) -> tuple[int, dict]:
        return self.gate() or (200, {"status": "ok"})
