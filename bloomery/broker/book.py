"""The broker's bookkeeping: capacity, need records, the FIFO queue, fit checks and the lease table.

Pure: no sockets, no files, no clock reads except where a caller passes the time,
no process table (liveness is a function the caller passes in), so every rule is
unit-tested on its own.

Rules:
- Capacity is what leases may hold in total: host RAM and each card's bytes
  (capacity.py derives it from the machine and the config: caps and reserves).
- A need fits when every term (host, each card) plus what the leases already hold
  stays within capacity. Disk bytes are recorded and shown, never queued on
  (the files are already on disk when the plan runs).
- Strict FIFO: the queue is granted from its head only; a later need that would
  fit never jumps an earlier one that does not (no starvation of large needs).
- A need no capacity could ever hold (a term above the capacity itself, or bytes on
  a card the host does not have) is refused by name, never queued.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

MAX_CARDS = 64
MAX_TEXT = 512                  # unit / model strings
ID_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
NEED_FIELDS = {"version", "pid", "unit", "model", "host_bytes", "card_bytes", "disk_bytes"}
MAX_BYTES = 1 << 62             # any larger byte count is nonsense, refused by name


class NeedError(Exception):
    """A need record refused: the message names the field, the value and the rule."""


@dataclass(frozen=True)
class Capacity:
    host_bytes: int
    card_bytes: tuple[int, ...] = ()

    def to_dict(self) -> dict:
        return {"host_bytes": self.host_bytes, "card_bytes": list(self.card_bytes)}


@dataclass(frozen=True)
class Need:
    pid: int
    host_bytes: int
    card_bytes: tuple[int, ...] = ()
    disk_bytes: int = 0
    unit: str | None = None
    model: str = ""

    def to_dict(self) -> dict:
        return {"version": 1, "pid": self.pid, "unit": self.unit, "model": self.model, "host_bytes": self.host_bytes,
                "card_bytes": list(self.card_bytes), "disk_bytes": self.disk_bytes}


def _count(obj: dict, name: str, default=None) -> int:
    v = obj.get(name, default)
    if isinstance(v, bool) or not isinstance(v, int):
        raise NeedError(f"need field {name!r}: expected a non-negative integer, got {v!r}")
    if not 0 <= v <= MAX_BYTES:
        raise NeedError(f"need field {name!r}: {v} is outside 0 .. {MAX_BYTES}")
    return v


def parse_need(obj: object) -> Need:
    """A need record (JSON object) -> Need, or NeedError naming the field."""
    if not isinstance(obj, dict):
        raise NeedError(f"need record: expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - NEED_FIELDS)
    if unknown:
        raise NeedError(f"need record: unknown field(s) {', '.join(map(repr, unknown))} "
                        f"(known: {', '.join(sorted(NEED_FIELDS))})")
    if obj.get("version", 1) != 1:
        raise NeedError(f"need field 'version': {obj.get('version')!r} is not supported (this broker reads 1)")
    if "pid" not in obj:
        raise NeedError("need field 'pid': missing (the process the lease is bound to)")
    pid = _count(obj, "pid")
    if pid < 1:
        raise NeedError(f"need field 'pid': {pid} is not a process id (>= 1)")
    if "host_bytes" not in obj:
        raise NeedError("need field 'host_bytes': missing")
    cards = obj.get("card_bytes", [])
    if not isinstance(cards, list):
        raise NeedError(f"need field 'card_bytes': expected a list of byte counts (one per card), got {cards!r}")
    if len(cards) > MAX_CARDS:
        raise NeedError(f"need field 'card_bytes': {len(cards)} entries; the bound is {MAX_CARDS}")
    card_bytes = tuple(_count({"card_bytes[%d]" % i: c}, "card_bytes[%d]" % i) for i, c in enumerate(cards))
    texts = {}
    for name in ("unit", "model"):
        v = obj.get(name)
        if v is not None and not isinstance(v, str):
            raise NeedError(f"need field {name!r}: expected a string, got {v!r}")
        if v is not None and len(v) > MAX_TEXT:
            raise NeedError(f"need field {name!r}: {len(v)} characters; the bound is {MAX_TEXT}")
        texts[name] = v
    return Need(pid, _count(obj, "host_bytes"), card_bytes, _count(obj, "disk_bytes", 0),
                texts["unit"], texts["model"] or "")


@dataclass
class Entry:
    """A queued need or a lease: the need, the process it is bound to, its arrival order."""
    id: str
    need: Need
    start_time: float                         # the pid's start time as the broker read it
    seq: int                                  # arrival order (FIFO across restarts)
    since: float = 0.0                        # wall time it was queued / granted (shown in status)
    kids: list[tuple[int, float]] = field(default_factory=list)   # descendants seen (pid, start time)

    def to_dict(self) -> dict:
        return {"id": self.id, "need": self.need.to_dict(), "start_time": self.start_time, "seq": self.seq,
                "since": self.since, "kids": [list(k) for k in self.kids]}

    @classmethod
    def from_dict(cls, d: dict) -> "Entry":
        return cls(str(d["id"]), parse_need(d["need"]), float(d["start_time"]), int(d["seq"]),
                   float(d.get("since", 0.0)), [(int(p), float(t)) for p, t in d.get("kids", [])])


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


class Book:
    def __init__(self, capacity: Capacity):
        self.capacity = capacity
        self.leases: dict[str, Entry] = {}
        self.queue: list[Entry] = []
        self.next_seq = 1

    # -- reads ---------------------------------------------------------------------------
    def held(self) -> Capacity:
        cards = [0] * len(self.capacity.card_bytes)
        for e in self.leases.values():
            for i, n in enumerate(e.need.card_bytes[:len(cards)]):
                cards[i] += n
        return Capacity(sum(e.need.host_bytes for e in self.leases.values()), tuple(cards))

    def never_fits(self, need: Need) -> str | None:
        """The reason no state of the leases could grant this need; None when it could fit."""
        cap = self.capacity
        if need.host_bytes > cap.host_bytes:
            return (f"the need's host_bytes {need.host_bytes} ({_gib(need.host_bytes)}) is larger than the host can "
                    f"ever grant: capacity {cap.host_bytes} ({_gib(cap.host_bytes)}) after caps and reserves")
        for i, n in enumerate(need.card_bytes):
            if i >= len(cap.card_bytes):
                if n:
                    return (f"the need's card_bytes[{i}] {n} names card {i}; the host has "
                            f"{len(cap.card_bytes)} card(s)")
                continue
            if n > cap.card_bytes[i]:
                return (f"the need's card_bytes[{i}] {n} ({_gib(n)}) is larger than card {i} can ever grant: "
                        f"capacity {cap.card_bytes[i]} ({_gib(cap.card_bytes[i])}) after caps and reserves")
        return None

    def shortfall(self, need: Need) -> str | None:
        """What a need waits for now (None: it fits beside the current leases)."""
        held, cap = self.held(), self.capacity
        short = []
        if held.host_bytes + need.host_bytes > cap.host_bytes:
            short.append(f"host: needs {need.host_bytes}, free {cap.host_bytes - held.host_bytes} of "
                         f"{cap.host_bytes}")
        for i, n in enumerate(need.card_bytes):
            total = cap.card_bytes[i] if i < len(cap.card_bytes) else 0   # a card gone since (config change)
            used = held.card_bytes[i] if i < len(held.card_bytes) else 0
            if n and used + n > total:
                short.append(f"card {i}: needs {n}, free {total - used} of {total}")
        if not short:
            return None
        return "; ".join(short) + f" (held by lease(s) {', '.join(sorted(self.leases)) or 'none'})"

    def position(self, entry_id: str) -> int | None:
        """1-based place in the queue, None when not queued."""
        return next((i + 1 for i, e in enumerate(self.queue) if e.id == entry_id), None)

    def waits_for(self, entry_id: str) -> str:
        pos = self.position(entry_id)
        if pos is None:
            return ""
        if pos > 1:
            ahead = self.queue[pos - 2]
            return f"queued behind {ahead.id} (pid {ahead.need.pid}); strict FIFO"
        return self.shortfall(self.queue[0].need) or "the next grant round"

    def find(self, entry_id: str) -> tuple[str, Entry] | None:
        if entry_id in self.leases:
            return "lease", self.leases[entry_id]
        e = next((e for e in self.queue if e.id == entry_id), None)
        return ("queued", e) if e else None

    # -- changes -------------------------------------------------------------------------
    def enqueue(self, entry_id: str, need: Need, start_time: float, now: float) -> Entry:
        """Queue a need (NeedError when it can never fit or its pid already has another entry)."""
        if not ID_RE.match(entry_id):
            raise NeedError(f"request field 'id': {entry_id!r} must be 1-64 of A-Z a-z 0-9 _ . -")
        why = self.never_fits(need)
        if why:
            raise NeedError(why)
        for e in [*self.leases.values(), *self.queue]:
            if e.need.pid == need.pid and e.start_time == start_time:
                raise NeedError(f"pid {need.pid} already has {e.id} ({'lease' if e.id in self.leases else 'queued'});"
                                f" one need per process")
        e = Entry(entry_id, need, start_time, self.next_seq, now)
        self.next_seq += 1
        self.queue.append(e)
        return e

    def grant(self, now: float) -> list[Entry]:
        """Grant from the head of the queue while the head fits (strict FIFO)."""
        granted = []
        while self.queue and self.shortfall(self.queue[0].need) is None:
            e = self.queue.pop(0)
            e.since = now
            self.leases[e.id] = e
            granted.append(e)
        return granted

    def remove(self, entry_id: str) -> str | None:
        """Release a lease or withdraw a queued need; what it was, or None."""
        if self.leases.pop(entry_id, None) is not None:
            return "lease"
        for i, e in enumerate(self.queue):
            if e.id == entry_id:
                del self.queue[i]
                return "queued"
        return None

    def prune(self, alive: Callable[[Entry], bool]) -> list[tuple[str, Entry]]:
        """Drop every lease and queued need whose process is gone: [(was, entry)]."""
        gone = [("lease", e) for e in self.leases.values() if not alive(e)]
        gone += [("queued", e) for e in self.queue if not alive(e)]
        for _, e in gone:
            self.remove(e.id)
        return gone

    # -- state ---------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"version": 1, "next_seq": self.next_seq,
                "leases": [e.to_dict() for e in sorted(self.leases.values(), key=lambda e: e.seq)],
                "queue": [e.to_dict() for e in self.queue]}

    def load(self, d: dict) -> None:
        """Restore leases and queue (queue order = arrival order, kept across restarts)."""
        if d.get("version") != 1:
            raise ValueError(f"state version {d.get('version')!r}: this broker reads 1")
        self.leases = {e.id: e for e in map(Entry.from_dict, d.get("leases", []))}
        self.queue = sorted(map(Entry.from_dict, d.get("queue", [])), key=lambda e: e.seq)
        seqs = [e.seq for e in [*self.leases.values(), *self.queue]]
        self.next_seq = max([int(d.get("next_seq", 1)), *(s + 1 for s in seqs)])
