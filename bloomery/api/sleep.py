"""--sleep-idle-seconds N: after N idle seconds the engine frees its weights and KV; a request wakes it.

As llama-server: a request that uses the model (here every POST: generation, token counts,
the tokenizer, templates) wakes the server first, waiting while the engine loads the weights
again; GET routes (/health, /props, /models, /metrics, /slots) answer while asleep and do not
wake it. Idle time counts from the end of the last request. /props says is_sleeping. The slots'
cached prompts go with the KV, so the first request after a wake runs its whole prompt.
The engine side (freeing and reloading) is stages/engine.py; the client sends Sleep / Wake.
"""
from __future__ import annotations

import asyncio
import time
from typing import Callable

CHECK_S = 0.25      # how often the idle time is looked at


class Residency:
    """Whether the engine holds its weights, and the idle watch that puts it to sleep."""

    def __init__(self, client, idle_s: int, log: Callable[[str], None]):
        self.client, self.idle_s, self.log = client, idle_s, log
        self.sleeping = False
        self._active = 0                         # POST requests running (a stream counts until it ends)
        self._idle_since = time.monotonic()
        self._lock = asyncio.Lock()              # one change of state at a time; wakers wait on it
        self._task: asyncio.Task | None = None

    @property
    def enabled(self) -> bool:
        return self.idle_s >= 0

    def start(self) -> None:
        if self.enabled and self._task is None:
            self._task = asyncio.ensure_future(self._watch())

    async def enter(self) -> None:
        """A request that uses the model begins: wake the engine first when it sleeps."""
        self._active += 1
        if not self.sleeping and not self._lock.locked():   # locked: a sleep may be under way; wait for it
            return
        async with self._lock:
            if self.sleeping:
                t0 = time.monotonic()
                await self.client.set_residency(sleep=False)
                self.sleeping = False
                self.log(f"bloomery-serve: awake: the engine loaded its weights again in "
                         f"{time.monotonic() - t0:.1f} s")

    def leave(self) -> None:
        self._active -= 1
        self._idle_since = time.monotonic()

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(CHECK_S)
            if self.sleeping or self._active or time.monotonic() - self._idle_since < self.idle_s:
                continue
            async with self._lock:
                if self.sleeping or self._active or getattr(self.client, "n_in_flight", 0):
                    continue
                try:
                    await self.client.set_residency(sleep=True)
                except Exception as e:   # the engine is gone or refused: stay awake, say why, stop watching
                    self.log(f"bloomery-serve: sleep failed, staying awake: {type(e).__name__}: {e}")
                    return
                self.sleeping = True
                self.log(f"bloomery-serve: asleep after {self.idle_s} s idle: the engine freed its weights and KV")


async def released(chunks, leave: Callable[[], None]):
    """A stream's chunks; its request counts as running until the stream ends (or the client leaves)."""
    try:
        async for chunk in chunks:
            yield chunk
    finally:
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            await aclose()
        leave()
