"""The host-RAM prompt cache (-cram/--cache-ram): saved slot states, kept within a byte budget.

An entry is the ids a slot held, by position, and their K and V as host arrays (what the KV
cache's save_state returned; the engine copies in and out through the KV cache's own methods).
A model with a state that cannot rewind (the qwen35 family's recurrent layers) saves it beside
the KV of its attention layers as the entry's marks: (position, state) at the entry's end and at
each checkpoint the slot kept, as llama-server saves a slot's whole state with its checkpoints.
An entry without marks restores any prefix it shares with a prompt; one with marks only up to a
mark (scheduler.reuse_point: the latest within the shared prefix, short of the whole prompt).
Pure bookkeeping, no model: the engine saves a slot's state before a request whose prompt
does not extend it overwrites it, and looks here for the entry restoring the longest prefix of
a new prompt. The bytes are the arrays' nbytes, exactly (marks included); the store never holds
more than its budget, evicting the least recently used entries first (a save or a restore uses
an entry).
"""
from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

from bloomery.engine.scheduler import common_prefix_len, reuse_point


@dataclass(frozen=True)
class Entry:
    ids: tuple[int, ...]          # [N] the ids whose K and V the state holds, positions 0 .. N-1
    state: tuple[Any, ...]        # host arrays (K and V), as the KV cache's save_state gave them
    n_bytes: int                  # sum of the arrays' nbytes, the marks' too
    # a state that cannot rewind: (position, its host arrays) at N and at the slot's checkpoints, by position;
    # () for a KV cache alone, which restores any prefix
    marks: tuple[tuple[int, tuple[Any, ...]], ...] = ()

    @property
    def points(self) -> frozenset[int]:
        return frozenset(n for n, _ in self.marks)

    def restorable(self, prompt_ids) -> int:
        """How many of the prompt's ids this entry restores (at least one prompt id is left to run)."""
        n = common_prefix_len(self.ids, prompt_ids)
        if self.marks:
            return reuse_point(n, len(prompt_ids), self.points)
        return min(n, len(prompt_ids) - 1)

    def mark(self, n: int) -> tuple[Any, ...]:
        """The saved state that cannot rewind at position n (one of the marks)."""
        return next(st for p, st in self.marks if p == n)

    def holds(self, ids: tuple[int, ...], points: frozenset[int]) -> bool:
        """Restores all that a state of these ids with these marks would: its ids extend them, and (for a
        state that cannot rewind) it has a mark at each of theirs."""
        return (len(self.ids) >= len(ids) and common_prefix_len(self.ids, ids) == len(ids)
                and (not points or (bool(self.marks) and points <= self.points)))


def nbytes(state: tuple[Any, ...], marks=()) -> int:
    """What a state and its marks hold: their arrays' nbytes."""
    return sum(int(a.nbytes) for a in state) + sum(int(a.nbytes) for _, st in marks for a in st)


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

    def covers(self, ids: tuple[int, ...] | list[int], points=()) -> bool:
        """An entry already holds these ids (or more after them), and marks at these positions (a state that
        cannot rewind): saving them again adds nothing; that entry counts as used."""
        ids, points = tuple(ids), frozenset(points)
        for key, e in self._entries.items():
            if e.holds(ids, points):
                self._entries.move_to_end(key)
                return True
        return False

    def fits(self, n_bytes: int) -> bool:
        return 0 < n_bytes <= self.budget_bytes

    def save(self, ids: tuple[int, ...] | list[int], state: tuple[Any, ...], marks=()) -> bool:
        """Keep a state (with its marks, for a state that cannot rewind: (position, arrays) pairs, one at
        len(ids)); False (nothing kept) when it alone passes the budget. Entries the new one holds all of
        (their ids a prefix of these, their marks among these) are dropped, then the oldest go until it fits."""
        ids = tuple(ids)
        marks = tuple(sorted(((int(n), tuple(st)) for n, st in marks), key=lambda m: m[0]))
        if marks and (marks[-1][0] != len(ids) or marks[0][0] < 1):
            raise ValueError(f"a state's marks lie at positions 1 .. {len(ids)} and one at its end ({len(ids)}), "
                             f"not {[n for n, _ in marks]}")
        n_bytes = nbytes(state, marks)
        if not ids or not self.fits(n_bytes):
            return False
        new = Entry(ids, tuple(state), n_bytes, marks)
        for key in [k for k, e in self._entries.items() if new.holds(e.ids, e.points)]:
            self._drop(key)
        while self.n_bytes + n_bytes > self.budget_bytes:
            self._drop(next(iter(self._entries)))
            self.n_evicted += 1
        self._entries[self._next_key] = new
        self._next_key += 1
        self.n_bytes += n_bytes
        self.n_saved += 1
        return True

    def best(self, prompt_ids: tuple[int, ...] | list[int], more_than: int) -> tuple[Entry, int] | None:
        """The entry restoring the longest prefix of the prompt (Entry.restorable: short of the whole prompt,
        and for a state that cannot rewind at one of its marks), and that length, when it is longer than
        `more_than` (what the live slot reuses); the entry counts as used."""
        found, n_best = None, more_than
        for key, e in self._entries.items():
            n = e.restorable(prompt_ids)
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
