"""The router's bookkeeping, pure (no I/O): each model's status, its child's port, its last use,
its requests in flight, and which model the --models-max cap gives up (least recently used).

Statuses are llama-server's words (server-models.h): unloaded, loading, loaded. A child that
exited on its own is "unloaded" with failed and its exit code, as llama-server lists it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

UNLOADED, LOADING, LOADED = "unloaded", "loading", "loaded"


@dataclass
class ModelState:
    name: str
    status: str = UNLOADED
    port: int = 0
    last_used_s: float = 0.0        # monotonic time of the last request routed to it (or its load)
    n_busy: int = 0                 # requests forwarded and not yet answered in full
    stopping: bool = False          # an unload was asked; the child is ending
    exit_code: int | None = None    # the last child's exit status when it ended on its own (failed)
    args: list[str] = field(default_factory=list)   # the child's command line, as GET /models shows it
    loaded_info: dict = field(default_factory=dict)  # the child's own /v1/models entry, merged into the listing

    @property
    def running(self) -> bool:
        """Holds (or is getting) a child: counts against --models-max."""
        return self.status in (LOADING, LOADED)


class ModelTable:
    def __init__(self, names: list[str], models_max: int):
        if models_max < 0:
            raise ValueError(f"--models-max {models_max}: must be >= 0 (0: no limit)")
        self.models_max = models_max
        self.states: dict[str, ModelState] = {n: ModelState(n) for n in names}

    def get(self, name: str) -> ModelState | None:
        return self.states.get(name)

    def add(self, name: str) -> None:
        self.states.setdefault(name, ModelState(name))

    def remove(self, name: str) -> None:
        """A model gone from every source (a reload); it must not be running."""
        if self.states[name].running:
            raise ValueError(f"model {name} is running; unload it before it is removed")
        del self.states[name]

    def n_running(self) -> int:
        return sum(1 for st in self.states.values() if st.running)

    def has_capacity(self) -> bool:
        return self.models_max == 0 or self.n_running() < self.models_max

    def victim(self) -> str | None:
        """The loaded model used least recently that serves no request and is not already ending; None when every
        running model is busy, loading or ending (then a new load waits for one to go idle)."""
        idle = [st for st in self.states.values() if st.status == LOADED and st.n_busy == 0 and not st.stopping]
        return min(idle, key=lambda st: st.last_used_s).name if idle else None

    # -- transitions (the router's one owner of them) -------------------------------------------
    def loading(self, name: str, port: int, args: list[str]) -> None:
        st = self.states[name]
        st.status, st.port, st.args, st.exit_code, st.stopping = LOADING, port, args, None, False
        st.loaded_info = {}
        st.last_used_s = time.monotonic()

    def loaded(self, name: str, info: dict) -> None:
        st = self.states[name]
        st.status, st.loaded_info = LOADED, info

    def ended(self, name: str, exit_code: int | None) -> None:
        """The child is gone: asked to stop (exit_code None) or on its own (failed, with its status)."""
        st = self.states[name]
        st.status, st.port, st.stopping, st.loaded_info = UNLOADED, 0, False, {}
        st.exit_code = exit_code

    def acquire(self, name: str) -> None:
        st = self.states[name]
        st.n_busy += 1
        st.last_used_s = time.monotonic()

    def release(self, name: str) -> None:
        st = self.states[name]
        st.n_busy = max(0, st.n_busy - 1)
