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
a new prompt. An entry's K and V come in pieces (`Piece`: positions start .. end-1 from arrays whose
first position is `offset`): a new entry whose ids share a long prefix with an entry held already
(`prefix_source`) takes that prefix from the held entry's arrays and copies only the rest out of the
slot; arrays are never written after a save, so entries share them. The bytes are those of the
distinct arrays the entries hold, exactly (marks included); the store never holds more than its
budget, evicting the least recently used entries first (a save or a restore uses an entry), passing
over one whose arrays all live on in other entries, since its going frees nothing.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

from bloomery.engine.scheduler import common_prefix_len, reuse_point


SHARE_MIN = 64        # positions a new entry must share with a held one to take them from it (fewer: copied whole)


@dataclass(frozen=True)
class Piece:
    """Positions start .. end-1 of an entry: from `arrays` (the KV cache's save_state copy), whose first
    position is `offset` (<= start)."""
    start: int
    end: int
    arrays: tuple[Any, ...]
    offset: int


@dataclass(frozen=True)
class Entry:
    ids: tuple[int, ...]          # [N] the ids whose K and V the state holds, positions 0 .. N-1
    pieces: tuple[Piece, ...]     # positions 0 .. N-1 in order
    n_bytes: int                  # the nbytes of the arrays it holds (shared ones too), the marks' too
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

    def upto(self, p: int) -> tuple[Piece, ...]:
        """Its pieces cut to positions 0 .. p-1."""
        return tuple(Piece(c.start, min(c.end, p), c.arrays, c.offset) for c in self.pieces if c.start < p)

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


def _held(pieces: tuple[Piece, ...], marks) -> list[tuple[Any, ...]]:
    """The array groups an entry holds (each piece's arrays once, each mark's)."""
    seen, out = set(), []
    for group in [c.arrays for c in pieces] + [tuple(st) for _, st in marks]:
        if id(group) not in seen:
            seen.add(id(group))
            out.append(group)
    return out


class PromptCache:
    def __init__(self, budget_bytes: int):
        if budget_bytes < 0:
            raise ValueError(f"the prompt cache's budget must be >= 0 bytes (0: off), got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._entries: collections.OrderedDict[int, Entry] = collections.OrderedDict()   # oldest use first
        self._next_key = 0
        self._refs: dict[int, list] = {}   # id(array group) -> [entries holding it, its nbytes, the group]
        self.n_bytes = 0                   # the distinct array groups' nbytes
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

    def prefix_source(self, ids: tuple[int, ...] | list[int]) -> tuple[Entry, int] | None:
        """The held entry sharing the longest prefix with these ids, and its length, when it is SHARE_MIN or more
        (a new entry of these ids then takes those positions from it: save's `base`). At most all but the last
        id: an entry holding every one of them lacks some mark the new one brings (else it covers them), and
        the new entry's own piece keeps at least one position."""
        best, n_best = None, SHARE_MIN - 1
        for e in self._entries.values():
            n = min(common_prefix_len(e.ids, ids), len(ids) - 1)
            if n > n_best:
                best, n_best = e, n
        return None if best is None else (best, n_best)

    def save(self, ids: tuple[int, ...] | list[int], state: tuple[Any, ...], marks=(),
             base: tuple[Entry, int] | None = None) -> bool:
        """Keep a state (with its marks, for a state that cannot rewind: (position, arrays) pairs, one at
        len(ids)); with `base` (an entry and p, from prefix_source), positions 0 .. p-1 come from that entry's
        arrays and `state` holds p .. len(ids)-1. False (nothing kept) when it alone passes the budget. Entries
        the new one holds all of (their ids a prefix of these, their marks among these) are dropped, then the
        oldest go until it fits."""
        ids = tuple(ids)
        marks = tuple(sorted(((int(n), tuple(st)) for n, st in marks), key=lambda m: m[0]))
        if marks and (marks[-1][0] != len(ids) or marks[0][0] < 1):
            raise ValueError(f"a state's marks lie at positions 1 .. {len(ids)} and one at its end ({len(ids)}), "
                             f"not {[n for n, _ in marks]}")
        p = 0 if base is None else base[1]
        if base is not None and not (0 < p < len(ids) and common_prefix_len(base[0].ids, ids) >= p):
            raise ValueError(f"a base of {p} positions must be a prefix shared with the {len(ids)} ids saved")
        pieces = (*(base[0].upto(p) if base else ()), Piece(p, len(ids), tuple(state), p))
        held = _held(pieces, marks)
        n_bytes = nbytes(tuple(a for g in held for a in g))
        added = nbytes(tuple(a for g in held if id(g) not in self._refs for a in g))
        if not ids or not self.fits(added):
            return False
        new = Entry(ids, pieces, n_bytes, marks)
        for key in [k for k, e in self._entries.items() if new.holds(e.ids, e.points)]:
            self._drop(key)
        key = self._next_key
        self._next_key += 1
        self._entries[key] = new
        self._take(held)
        while self.n_bytes > self.budget_bytes:          # the oldest go (the new entry last: alone it fits)
            self._drop(self._victim())
            self.n_evicted += 1
        if key not in self._entries:
            return False
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

    def _victim(self) -> int:
        """The entry to evict: the least recently used one whose going frees bytes (one whose arrays all live
        on in other entries frees nothing, so it stays while another can go); else the least recently used."""
        for key, e in self._entries.items():
            if any(self._refs[id(g)][0] == 1 for g in _held(e.pieces, e.marks)):
                return key
        return next(iter(self._entries))

    def _take(self, groups) -> None:
        for g in groups:
            ref = self._refs.get(id(g))
            if ref is None:
                ref = self._refs[id(g)] = [0, nbytes(g), g]
                self.n_bytes += ref[1]
            ref[0] += 1

    def _drop(self, key: int) -> None:
        e = self._entries.pop(key)
        for g in _held(e.pieces, e.marks):
            ref = self._refs[id(g)]
            ref[0] -= 1
            if ref[0] == 0:
                del self._refs[id(g)]
                self.n_bytes -= ref[1]
