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

    def slots(self) -> list[dict]:
        """One dict per slot: id, n_ctx, is_processing, id_task (for /slots and /props)."""
        ...
