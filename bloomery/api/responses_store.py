"""The kept /v1/responses: a bounded in-memory store (pure bookkeeping, no I/O).

At most MAX_RESPONSES responses and MAX_BYTES of JSON text (the response object
plus the conversation kept for previous_response_id). Past either bound the
oldest finished response goes first; a response still running is never dropped,
and a background request is refused (503, Retry-After) while running ones alone
fill a bound. Everything is lost when the server stops.
"""
from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass, field

from bloomery.http.types import ApiError

MAX_RESPONSES = 1024
MAX_BYTES = 256 * 2**20


def _n_bytes(obj: object) -> int:
    return len(json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8"))


@dataclass
class Stored:
    id: str
    obj: dict                                   # the response object as GET answers it
    conversation: list[dict] = field(default_factory=list)   # input then output messages, no instructions
    finished: bool = False
    background: bool = False
    task: object = None                         # the asyncio task of a background response
    n_bytes: int = 0

    def measure(self) -> None:
        self.n_bytes = _n_bytes(self.obj) + _n_bytes(self.conversation)


class ResponseStore:
    def __init__(self, max_count: int = MAX_RESPONSES, max_bytes: int = MAX_BYTES):
        self.max_count, self.max_bytes = max_count, max_bytes
        self.items: OrderedDict[str, Stored] = OrderedDict()
        self.n_bytes = 0

    def get(self, rid: str) -> Stored | None:
        return self.items.get(rid)

    def conversation(self, rid: str) -> list[dict]:
        """What previous_response_id continues: that response's input and output messages."""
        s = self.items.get(rid)
        if s is None:
            raise ApiError(400, f"Previous response with id {rid!r} not found (never stored, stored with "
                                f"store: false, deleted, or dropped from the store's {self.max_count} responses / "
                                f"{self.max_bytes} bytes)", param="previous_response_id")
        if not s.finished:
            raise ApiError(400, f"Previous response {rid!r} is still {s.obj.get('status')}; wait for it to end",
                           param="previous_response_id")
        return [dict(m) for m in s.conversation]

    def running_fill(self) -> str | None:
        """The bound that responses still running fill on their own, or None."""
        running = [s for s in self.items.values() if not s.finished]
        if len(running) >= self.max_count:
            return f"{len(running)} responses are running (the store keeps {self.max_count})"
        n = sum(s.n_bytes for s in running)
        if n >= self.max_bytes:
            return f"running responses hold {n} bytes (the store keeps {self.max_bytes})"
        return None

    def put(self, s: Stored) -> None:
        old = self.items.pop(s.id, None)
        if old is not None:
            self.n_bytes -= old.n_bytes
        s.measure()
        self.items[s.id] = s
        self.n_bytes += s.n_bytes
        self._evict()

    def delete(self, rid: str) -> Stored | None:
        s = self.items.pop(rid, None)
        if s is not None:
            self.n_bytes -= s.n_bytes
        return s

    def _evict(self) -> None:
        while len(self.items) > self.max_count or self.n_bytes > self.max_bytes:
            victim = next((k for k, s in self.items.items() if s.finished), None)
            if victim is None:      # only running ones left: they stay until they end
                return
            self.delete(victim)
