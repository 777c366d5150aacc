"""The models' children and the waits on them: one owner of every load and unload (table.py keeps the
bookkeeping, this module does the I/O and announces each change).

A load is claimed at once (the model counts against --models-max from then on, and the victim it displaces
takes no new request), then runs in a task of its own, so a client that leaves does not stop a load it
started. Waiters re-check the table after every change (notify), so requests for one model share its one load,
and a request that finds every loaded model busy at the cap waits until one is idle, in arrival order.
"""
from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Callable

from bloomery.http.types import ApiError
from bloomery.records import record
from bloomery.router.catalog import Entry
from bloomery.router.children import STOP_S, Child, child_argv, free_port
from bloomery.router.table import LOADED, LOADING, UNLOADED, ModelTable


class ModelPool:
    def __init__(self, entries: dict[str, Entry], base_args: list[str], env: dict[str, str], *,
                 models_max: int, log: Callable[..., None] = record):
        self.entries = entries
        self.base_args = base_args      # the router's own flags, router-only ones taken out (settings.argv_without)
        self.env = env
        self.table = ModelTable(list(entries), models_max)
        self.children: dict[str, Child] = {}
        self.tasks: set[asyncio.Task] = set()
        self._changed = asyncio.Event()
        self.closing = False            # the router is stopping: nothing new is loaded, waiters are answered 503
        self.reloading = False          # a reload is replacing the entries: nothing new is loaded until it is done
        self._reload_lock = asyncio.Lock()
        self.log = log

    # -- the one place the table's changes are announced ------------------------------------------
    def notify(self) -> None:
        event, self._changed = self._changed, asyncio.Event()
        event.set()

    def task(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    # -- loading and unloading ----------------------------------------------------------------
    def _claim(self, name: str, victim: str | None) -> None:
        """Mark the model loading now (it holds its place under --models-max from here), then load it in a task
        of its own: a client that leaves does not stop a load it started."""
        entry = self.entries[name]
        port = free_port()
        argv = child_argv(entry.args(self.base_args), name, port)
        self.table.loading(name, port, argv)
        if victim is not None:   # from now on no request is routed to it, so none can hold it up
            self.table.get(victim).stopping = True
        self.log("router", "loading model", model=name, port=port, **({"evicting": victim} if victim else {}))
        self.notify()
        self.task(self._run_child(name, victim, Child(argv, port, self.env, entry.stop_s(STOP_S))))

    async def _run_child(self, name: str, victim: str | None, child: Child) -> None:
        code: int | None = None
        try:
            if victim is not None:
                await self.unload(victim)
            if self.table.get(name).stopping:
                return
            self.children[name] = child
            await child.start()
            info = await child.ready()
            if self.table.get(name).stopping:
                await child.stop()
                return
            self.table.loaded(name, info)
            self.log("router", "model loaded", model=name, port=child.port)
            self.notify()
            code = await child.wait()
        except asyncio.CancelledError:
            child.kill()
            raise
        except Exception as e:
            self.log("router", "model failed to load", level="error", model=name, error=str(e))
            code = child.proc.returncode if child.proc is not None and child.proc.returncode is not None else -1
            child.kill()
        finally:
            asked = self.table.get(name).stopping
            if self.children.get(name) is child:
                del self.children[name]
            self.table.ended(name, None if asked else code)
            if code is not None and not asked:
                self.log("router", "model's server exited", level="warning", model=name, exit_code=code)
            self.notify()

    async def unload(self, name: str) -> None:
        """Stop the model's child and wait until it is gone."""
        st = self.table.get(name)
        if not st.running:
            return
        st.stopping = True
        self.log("router", "unloading model", model=name)
        self.notify()
        child = self.children.get(name)
        if child is not None:
            await child.stop()
        while self.table.get(name).status != UNLOADED:
            await self._changed.wait()

    def load_now(self, name: str) -> bool:
        """Start the model's load if there is room, or room once an idle model is given up; False: wait."""
        if self.table.has_capacity():
            self._claim(name, None)
            return True
        victim = self.table.victim()
        if victim is None:
            return False
        self._claim(name, victim)
        return True

    async def ready(self, name: str) -> int:
        """Wait until the model is loaded; count the request against it (a model serving one is never given
        up) and return its child's port."""
        saw_loading = False
        while True:
            st, changed = self.table.get(name), self._changed
            if self.closing:
                raise ApiError(503, "Server is shutting down", "unavailable_error")
            if self.reloading:
                await changed.wait()
                continue
            if st is None:                  # gone from every source in a reload while this request waited
                raise ApiError(400, f"model '{name}' not found")
            if st.status == LOADED and not st.stopping:
                self.table.acquire(name)
                return st.port
            if st.status == LOADING:
                saw_loading = True
            elif st.status == UNLOADED:
                if saw_loading and st.exit_code is not None:
                    raise ApiError(500, f"model name={name} failed to load", "server_error")
                if self.load_now(name):
                    continue
            await changed.wait()

    async def settled(self) -> None:
        """Wait until no reload is under way (a load asked meanwhile is made against the new entries)."""
        while self.reloading:
            await self._changed.wait()

    async def reload(self, entries: dict[str, Entry]) -> dict[str, list[str]]:
        """Replace the entries with a fresh reading of the sources, as llama-server's reload: a running model
        gone from them or changed is unloaded first; the others are added, updated or removed as they stand
        (a failed one's exit status is cleared, so it can be loaded again). Returns what changed, by kind."""
        async with self._reload_lock:
            self.reloading = True
            self.notify()
            try:
                old = self.entries
                stale = [n for n, st in self.table.states.items()
                         if st.running and (n not in entries or _differs(old[n], entries[n]))]
                for name in stale:
                    self.log("router", "reload: unloading model", model=name,
                             why="removed" if name not in entries else "changed")
                await asyncio.gather(*(self.unload(n) for n in stale))
                removed = [n for n in old if n not in entries]
                added = [n for n in entries if n not in old]
                for name in removed:
                    self.table.remove(name)
                for name in added:
                    self.table.add(name)
                for name, st in self.table.states.items():
                    if not st.running:
                        st.exit_code = None
                self.entries.clear()        # the one dict the Router reads too
                self.entries.update(entries)
            finally:
                self.reloading = False
                self.notify()
        changes = {"added": added, "removed": removed, "unloaded": stale}
        self.log("router", "models reloaded", n_models=len(entries), **{k: v for k, v in changes.items() if v})
        return changes

    async def remove(self, name: str, action: Callable[[], list[str]]) -> list[str] | None:
        """Take a model out for good (DELETE /models): no request is routed to it from here (waiters pause as in
        a reload), its child is stopped and waited for, then `action` runs (its files removed) and the model
        leaves the table; returns what `action` returned, None when the model was already gone (a reload or
        another removal took it). A request that waited for it then finds it gone."""
        async with self._reload_lock:
            if self.table.get(name) is None:
                return None
            self.reloading = True
            self.notify()
            try:
                await self.unload(name)
                failed = action()
                self.table.remove(name)
                self.entries.pop(name, None)
            finally:
                self.reloading = False
                self.notify()
        self.log("router", "model removed from the cache", model=name, **({"failed": failed} if failed else {}))
        return failed

    async def close(self) -> None:
        """Stop every child (they drain as under systemd), then end the tasks that watched them."""
        self.closing = True
        self.notify()
        await asyncio.gather(*(self.unload(n) for n, st in self.table.states.items() if st.running),
                             return_exceptions=True)
        for task in list(self.tasks):
            task.cancel()
        for child in self.children.values():
            child.kill()


def _differs(a: Entry, b: Entry) -> bool:
    """Whether a running model's child would start otherwise now (being hidden from the listing is not that)."""
    return replace(a, hidden=False) != replace(b, hidden=False)
