"""EngineClient over ZeroMQ: the front's side of the engine process (zmq.asyncio).

front ROUTER (bound here) -> engine DEALER: Generate, Cancel, SlotsQuery, Shutdown, Residency, ExpertsQuery
engine PUSH -> front PULL (bound here): Tokens (one per engine step), SlotsReply, ResidencyReply, ExpertsReply
One reader task routes each TokenOut to its request's asyncio queue. When the
engine dies, fail_all() ends every request in flight with finish="error"; when the
server stops, end_all() ends them with finish="shutdown".
"""
from __future__ import annotations

import asyncio
import itertools
from typing import AsyncIterator

import zmq
import zmq.asyncio

from bloomery import workpool
from bloomery.engine import experts_query
from bloomery.engine.slot_file import SlotAnswer
from bloomery.engine.types import EngineRequest, ModelInfo, TokenOut
from bloomery.messages import engine as em
from bloomery.messages.codec import MessageError
from bloomery.records import record

ENGINE_ID = b"engine"
HEAVY_MESSAGE_BYTES = 1 << 20   # a message this long is decoded in bloomery.workpool's threads


class EngineGone(RuntimeError):
    pass


class ZmqEngineClient:
    def __init__(self, ctx: zmq.asyncio.Context, req_addr: str, out_addr: str):
        self.info: ModelInfo | None = None          # set from READY
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)   # a send to an absent engine raises, never vanishes
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(req_addr)
        self.pull = ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.pull.bind(out_addr)
        self.engine_pid: int | None = None
        self.dead: str | None = None
        self._routes: dict[str, asyncio.Queue] = {}
        self._queries: dict[str, asyncio.Future] = {}
        self._slots: list[dict] | None = None
        self._stats: dict[str, int | float] = {}    # as the engine's latest slots reply gave it
        self._query_ids = itertools.count()
        self._hello = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._read_outputs()), asyncio.create_task(self._read_router())]

    async def wait_hello(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self._hello.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    async def _read_router(self) -> None:
        while True:
            frames = await self.router.recv_multipart()
            try:
                msg = em.decode_from_engine(frames[-1])
            except MessageError as e:
                record("serve", "engine message refused", component="front", level="error", error=str(e))
                continue
            if isinstance(msg, em.Hello):
                self.engine_pid = msg.pid
                self._hello.set()

    async def _read_outputs(self) -> None:
        while True:
            data = await self.pull.recv()
            try:   # a step's probability tables (n_probs in the thousands) are megabytes of JSON: off the loop
                msg = em.decode_from_engine(data) if len(data) < HEAVY_MESSAGE_BYTES else \
                    await workpool.run(em.decode_from_engine, data)
            except MessageError as e:
                record("serve", "engine message refused", component="front", level="error", error=str(e))
                continue
            if isinstance(msg, em.Tokens):
                for out in msg.outs:
                    q = self._routes.get(out.req_id)
                    if q is not None:          # else its consumer already left
                        q.put_nowait(out)
            elif isinstance(msg, em.SlotsReply):
                self._slots = [dict(s) for s in msg.slots]
                self._stats = dict(msg.stats)
                fut = self._queries.pop(msg.query_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(self._slots)
            elif isinstance(msg, (em.ResidencyReply, em.ExpertsReply, em.SlotActionReply)):
                fut = self._queries.pop(msg.query_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)

    async def _send(self, msg) -> None:
        if self.dead is not None:
            raise EngineGone(f"the engine process is gone ({self.dead})")
        try:
            await self.router.send_multipart([ENGINE_ID, em.encode(msg)])
        except zmq.ZMQError as e:
            raise EngineGone(f"the engine process cannot be reached ({e})") from None

    # -- EngineClient ---------------------------------------------------------------
    async def generate(self, req: EngineRequest) -> AsyncIterator[TokenOut]:
        if req.req_id in self._routes:
            raise ValueError(f"req_id {req.req_id!r} is already being generated")
        q: asyncio.Queue[TokenOut] = asyncio.Queue()
        self._routes[req.req_id] = q          # route first: no output of this request can be missed
        finished = False
        try:
            try:
                await self._send(em.Generate(req))
            except EngineGone as e:
                finished = True
                yield TokenOut(req.req_id, None, "error", error=str(e))
                return
            while True:
                out = await q.get()
                finished = out.finish is not None
                yield out
                if finished:
                    return
        finally:
            self._routes.pop(req.req_id, None)
            if not finished and self.dead is None:   # the consumer left early: the engine stops it
                try:
                    await self._send(em.Cancel(req.req_id))
                except EngineGone:
                    pass

    def slots(self) -> list[dict]:
        if self._slots is not None:
            return [dict(s) for s in self._slots]
        n_slots = self.info.n_slots if self.info else 1
        n_ctx = self.info.n_ctx_slot if self.info else 0
        return [{"id": i, "n_ctx": n_ctx, "speculative": False, "is_processing": False} for i in range(n_slots)]

    def engine_stats(self) -> dict[str, int | float]:
        """Engine.engine_stats() as of the latest slots reply (/metrics asks for the slots first, so they are that
        fresh)."""
        return dict(self._stats)

    async def _ask(self, prefix: str, make, timeout_s: float):
        """Send make(query_id) and wait for the reply of that query_id (what _read_outputs hands on)."""
        qid = f"{prefix}{next(self._query_ids)}"
        fut = asyncio.get_running_loop().create_future()
        self._queries[qid] = fut
        try:
            await self._send(make(qid))
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            self._queries.pop(qid, None)

    async def query_slots(self, timeout_s: float = 5.0) -> list[dict]:
        return await self._ask("q", em.SlotsQuery, timeout_s)

    async def set_residency(self, sleep: bool, timeout_s: float = 600.0) -> float:
        """Put the engine to sleep (weights and KV freed) or wake it (loaded again); the seconds it took."""
        reply = await self._ask("r", lambda qid: em.Residency(qid, sleep), timeout_s)
        if reply.error:
            raise EngineGone(reply.error)
        return reply.took_s

    async def query_experts(self, reset: bool = False, timeout_s: float = 30.0) -> dict:
        """The host experts' report (after a reset to the load's placement when asked): an ExpertsQuery round
        trip, answered by the engine between steps; experts_query.ExpertsError when it could not answer."""
        reply = await self._ask("e", lambda qid: em.ExpertsQuery(qid, reset), timeout_s)
        return experts_query.result(experts_query.ExpertsAnswer(reply.report, reply.error, reply.kind))

    async def slot_action(self, action: str, id_slot: int, path: str = "", filename: str = "",
                          model_name: str = "", timeout_s: float = 120.0):
        """POST /slots/{id}'s save, restore or erase, run by the engine between steps: a slot_file.SlotAnswer."""
        reply = await self._ask("s", lambda qid: em.SlotAction(qid, action, id_slot, path, filename, model_name),
                                timeout_s)
        return SlotAnswer(reply.status, dict(reply.body), reply.error)

    # -- the supervisor's side ---------------------------------------------------------
    @property
    def n_in_flight(self) -> int:
        """Requests whose generate() is still being read (the drain waits for these)."""
        return len(self._routes)

    def end_all(self, message: str) -> None:
        """The server is stopping: every request in flight ends now with finish "shutdown" naming why
        (its client gets a clean 503 answer or error event, not a cut connection)."""
        for req_id, q in list(self._routes.items()):
            q.put_nowait(TokenOut(req_id, None, "shutdown", error=message))

    def fail_all(self, reason: str) -> None:
        """The engine died: every request in flight ends with an error naming why."""
        self.dead = reason
        for req_id, q in list(self._routes.items()):
            q.put_nowait(TokenOut(req_id, None, "error", error=f"the engine process died: {reason}"))

    async def shutdown(self, reason: str) -> None:
        try:
            await self._send(em.Shutdown(reason))
        except EngineGone:
            pass

    def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        self.router.close(0)
        self.pull.close(0)
