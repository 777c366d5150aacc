"""What the HTTP front needs of an engine, whichever side of a socket it runs on.

Two implementations: bloomery/engine/inproc.py (the engine in a thread of this
process: tests and tools) and bloomery/zmq_client.py (the engine process over
ZeroMQ: the server). Route handlers see only this protocol.
"""
from __future__ import annotations

from typing import AsyncIterator, Protocol

from bloomery.engine.types import EngineRequest, ModelInfo, TokenOut


class EngineClient(Protocol):
    info: ModelInfo

    def generate(self, req: EngineRequest) -> AsyncIterator[TokenOut]:
        """Yields one TokenOut per generated id; the last one has finish set.
        Closing the iterator early (aclose, or leaving an `async for`) cancels
        the request in the engine."""
        ...

    n_in_flight: int                 # requests generating now (the stop path waits on it)

    def slots(self) -> list[dict]:
        """The last slot table known: one dict per slot with id, n_ctx, speculative,
        is_processing, and once a request has run there id_task, the prompt counts,
        params and next_token (for /slots and /props)."""
        ...

    async def query_slots(self, timeout_s: float = 5.0) -> list[dict]:
        """A fresh slot table from the engine (same shape as slots())."""
        ...

    async def query_experts(self, reset: bool = False, timeout_s: float = 30.0) -> dict:
        """The report of the routed experts kept in host RAM (engine/experts_query.py's shape: "offload",
        "residency", per layer counts, on_card, hits and misses, and the moved and waited totals), answered
        by the engine between steps; reset=True first returns the card's expert slots to the load's
        placement. Raises experts_query.ExpertsError (its kind says why) when the engine cannot answer:
        a reset on a load with no host experts, or a sleeping engine."""
        ...
