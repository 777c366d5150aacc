"""The host-RAM prompt cache (-cram/--cache-ram): saved slot states, kept within a byte budget.

An entry is the ids a slot held, by position, and their K and V as host arrays (what the KV
cache's save_state returned; the engine copies in and out through the KV cache's own methods).
Pure bookkeeping, no model: the engine saves a slot's state before a request whose prompt
does not extend it overwrites it, and looks here for the entry sharing the longest prefix with
a new prompt. The bytes are the arrays' nbytes, exactly; the store never holds more than its
budget, evicting the least recently used entries first (a save or a restore uses an entry).
"""
from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

from bloomery.engine.scheduler import common_prefix_len


@dataclass(frozen=True)
class Entry:
    ids: tuple[int, ...]          # [N] the ids whose K and V the state holds, positions 0 .. N-1
    state: tuple[Any, ...]        # host arrays (K and V), as the KV cache's save_state gave them
    n_bytes: int                  # sum of the arrays' nbytes


class PromptCache:
    def __init__(self, budget_bytes: int):
        if budget_bytes < 0:
            raise ValueError(f"the prompt cache's budget must be >= 0 bytes (0: off), got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._entries: collections.OrderedDict[int, Entry] = collections.OrderedDict()   # oldest use first
        self._next_key = 0
        self.n_bytes = 0
        self.n_saved = self.n_evicted = self.n_restored = 0
        self.restore_s = 0.0      # time spent restoring (prompt_cache_seconds_total)

    @property
    def n_entries(self) -> int:
        return len(self._entries)

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    def entries(self) -> list[Entry]:
        """Oldest use first (the next to be evicted first)."""
        return list(self._entries.values())

    def covers(self, ids: tuple[int, ...] | list[int]) -> bool:
        """An entry already holds these ids (or more after them): saving them again adds nothing;
        that entry counts as used."""
        for key, e in self._entries.items():
            if len(e.ids) >= len(ids) and common_prefix_len(e.ids, ids) == len(ids):
                self._entries.move_to_end(key)
                return True
        return False

    def fits(self, n_bytes: int) -> bool:
        return 0 < n_bytes <= self.budget_bytes

    def save(self, ids: tuple[int, ...] | list[int], state: tuple[Any, ...]) -> bool:
        """Keep a state; False (nothing kept) when it alone passes the budget. Entries whose ids are a
        prefix of these are dropped (the new one restores all they would), then the oldest go until
        it fits."""
        ids = tuple(ids)
        n_bytes = sum(int(a.nbytes) for a in state)
        if not ids or not self.fits(n_bytes):
            return False
        for key in [k for k, e in self._entries.items() if common_prefix_len(e.ids, ids) == len(e.ids)]:
            self._drop(key)
        while self.n_bytes + n_bytes > self.budget_bytes:
            self._drop(next(iter(self._entries)))
            self.n_evicted += 1
        self._entries[self._next_key] = Entry(ids, tuple(state), n_bytes)
        self._next_key += 1
        self.n_bytes += n_bytes
        self.n_saved += 1
        return True

    def best(self, prompt_ids: tuple[int, ...] | list[int], more_than: int) -> tuple[Entry, int] | None:
        """The entry sharing the longest prefix with the prompt, and that length, when it is longer
        than `more_than` (what the live slot reuses); the entry counts as used."""
        found, n_best = None, more_than
        for key, e in self._entries.items():
            n = common_prefix_len(e.ids, prompt_ids)
            if n > n_best:
                found, n_best = key, n
        if found is None:
            return None
        self._entries.move_to_end(found)
        return self._entries[found], n_best

    def clear(self) -> None:
        for key in list(self._entries):
            self._drop(key)

    def stats(self) -> dict[str, float]:
        """What /metrics shows of it."""
        return {"bytes": self.n_bytes, "entries": self.n_entries, "budget_bytes": self.budget_bytes,
                "restore_seconds": self.restore_s}

    def _drop(self, key: int) -> None:
        self.n_bytes -= self._entries.pop(key).n_bytes
