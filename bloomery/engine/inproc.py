"""EngineClient with the Engine in a worker thread of this process (tests, tools).

The worker sleeps on a condition variable while the engine has nothing to do and
runs engine.step() while it has; each TokenOut is handed to the asyncio loop of
the request's generate() via call_soon_threadsafe, into that request's queue.
Work that must not overlap a step (query_experts: a reset rewrites the kernels' tables; slot_action)
is queued for the worker, which runs it between steps and hands the result back the same way.
"""
from __future__ import annotations

import asyncio
import threading
import time
from typing import AsyncIterator, Callable

from bloomery.engine import experts_query, slot_file
from bloomery.engine.core import Engine
from bloomery.engine.types import EngineRequest, ModelInfo, TokenOut


class InProcessEngineClient:
    def __init__(self, engine: Engine, info: ModelInfo, reload: Callable[[], object] | None = None):
        self.engine = engine
        self.info = info
        self.reload = reload     # --sleep-idle-seconds: loads the model again on a wake
        self._wake = threading.Condition()
        self._routes: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._routes_lock = threading.Lock()
        self._closed = False
        self._between: list[tuple[Callable[[], object], asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._thread = threading.Thread(target=self._run, name="bloomery-engine", daemon=True)
        self._thread.start()

    # -- EngineClient ------------------------------------------------------------
    async def generate(self, req: EngineRequest) -> AsyncIterator[TokenOut]:
        if self._closed:
            raise RuntimeError("the in-process engine client is closed")
        queue: asyncio.Queue[TokenOut] = asyncio.Queue()
        with self._routes_lock:   # route first, so no output of this request can be missed
            if req.req_id in self._routes:
                raise ValueError(f"req_id {req.req_id!r} is already being generated")
            self._routes[req.req_id] = (asyncio.get_running_loop(), queue)
        try:
            self.engine.add(req)
        except Exception:
            self._drop_route(req.req_id)
            raise
        self._notify()
        finished = False
        try:
            while True:
                out = await queue.get()
                if out.finish is not None:
                    finished = True
                yield out
                if finished:
                    return
        finally:
            self._drop_route(req.req_id)
            if not finished:   # the consumer left early (aclose, break, cancelled task)
                self.engine.cancel(req.req_id)
                self._notify()

    def slots(self) -> list[dict]:
        return self.engine.slots()

    async def set_residency(self, sleep: bool, timeout_s: float = 600.0) -> float:
        """Sleep or wake the in-process engine (`reload`: a callable that loads the model again)."""
        if self.reload is None:
            raise RuntimeError("this in-process engine client has no reload: it cannot sleep")
        t0 = time.monotonic()
        self.engine.swap_model(None if sleep else self.reload())
        return time.monotonic() - t0

    def engine_stats(self) -> dict[str, int | float]:
        return self.engine.engine_stats()

    async def query_slots(self, timeout_s: float = 5.0) -> list[dict]:
        """The same as slots() (the table is in this process); the zmq client asks the engine process."""
        return self.engine.slots()

    async def query_experts(self, reset: bool = False, timeout_s: float = 30.0) -> dict:
        """The host experts' report (after a reset to the load's placement when asked), on the worker thread
        between steps; experts_query.ExpertsError when it could not answer."""
        ans = await self._between_steps(lambda: experts_query.answer(self.engine.model, reset), timeout_s)
        return experts_query.result(ans)

    async def slot_action(self, action: str, id_slot: int, path: str = "", filename: str = "",
                          model_name: str = "", timeout_s: float = 120.0) -> slot_file.SlotAnswer:
        """POST /slots/{id}'s save, restore or erase, on the worker thread between steps."""
        return await self._between_steps(
            lambda: slot_file.answer(self.engine, action, id_slot, path, filename, model_name), timeout_s)

    async def _between_steps(self, fn: Callable[[], object], timeout_s: float):
        """fn() on the worker thread, before its next step."""
        if self._closed:
            raise RuntimeError("the in-process engine client is closed")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._wake:
            self._between.append((fn, loop, fut))
            self._wake.notify_all()
        return await asyncio.wait_for(fut, timeout_s)

    @property
    def n_in_flight(self) -> int:
        """Requests whose generate() is still being read."""
        with self._routes_lock:
            return len(self._routes)

    def close(self, timeout_s: float = 5.0) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify_all()
        self._thread.join(timeout_s)

    # -- the worker thread ---------------------------------------------------------
    def _notify(self) -> None:
        with self._wake:
            self._wake.notify_all()

    def _drop_route(self, req_id: str) -> None:
        with self._routes_lock:
            self._routes.pop(req_id, None)

    @staticmethod
    def _hand(loop: asyncio.AbstractEventLoop, fut: asyncio.Future, fn: Callable[[], object]) -> None:
        """Run fn here and set its result (or exception) on fut in its own loop."""
        try:
            value, setter = fn(), fut.set_result
        except Exception as e:
            value, setter = e, fut.set_exception
        def put() -> None:
            if not fut.done():      # a caller that timed out has cancelled it
                setter(value)
        try:
            loop.call_soon_threadsafe(put)
        except RuntimeError:
            pass                    # that loop is closed; nobody is waiting

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._closed and not self._between and not self.engine.has_work():
                    self._wake.wait()
                if self._closed:
                    return
                between, self._between = self._between, []
            if between:
                self.engine.settle()     # a step launched ahead ends before fn touches the model
            for fn, loop, fut in between:
                self._hand(loop, fut, fn)
            if not self.engine.has_work():
                continue
            try:
                outs = self.engine.step()
            except Exception as e:   # a fault in the engine itself: fail everything in flight
                outs = self.engine.abort_all(f"engine step failed: {type(e).__name__}: {e}")
            for out in outs:
                with self._routes_lock:
                    route = self._routes.get(out.req_id)
                if route is None:
                    continue   # its consumer already left
                loop, queue = route
                try:
                    loop.call_soon_threadsafe(queue.put_nowait, out)
                except RuntimeError:
                    pass       # that loop is closed; nobody is listening
