"""Page-locked host memory for the prompt cache's saved states, made ahead of need and used again.

A saved state crosses the bus at the pinned rate only from page-locked memory (on the H200's host 54 GB/s
against 5.5 GB/s from pageable memory). Locking fresh memory makes the kernel fault in and zero every page
first: on that host 81-91 ms for the 418 MB of a 4,255-position state and about 8 ms for a 256-position turn,
each paid on the path of the request that follows (session 23's replay). The arena keeps page-locked chunks:
a save takes a span of one, the span comes back when the last array over it is freed, and a thread of the
arena's own keeps a reserve of wholly free chunks made ahead, so a save rarely waits for the kernel.

- `Spans` is the bookkeeping (first fit over each chunk's free spans, neighbours merged on return): pure, tested
  on the CPU.
- `HostArena` holds the chunks, which come from a maker the backend gives (the card's: an anonymous mapping
  in huge pages, touched, then registered with the driver). A span's arrays are numpy views over a ctypes array of
  the span; its weakref finalizer returns the span, so the span is free only once nothing reads it, and the
  span holds its chunk's owner, so the memory outlives the arena itself while any array is read.
- The reserve is tended after a save's copies (`tend_later`), not while they run, and only once the engine has
  been idle for QUIET_S (`set_idle`): making a chunk page-locks it, which holds the driver, and copies and
  launches issued meanwhile wait. Made while requests ran, the reserve's chunks held up the next prompt pass:
  a replay's first turns, back to back, went from 0.35 s to 0.42-0.64 s (H200, session 23). Requests back to
  back leave no quiet, so their saves lock their own chunks on the path, from the mappings made ready (below).
- The reserve is counted in wholly free chunks, not free bytes: a chunk holds one slot's whole K (or V), and
  the tails that smaller saves leave in older chunks would otherwise count as room no large save fits in. Small
  saves take those tails first (first fit, oldest chunk first).
- Memory made ready ahead, not locked. Of a chunk's making on the H200's host (251 MiB), mapping it and faulting
  in its huge pages took 50-59 ms and registering it 8-9 ms (session 26). Only the registering holds the driver,
  so where the backend gives a `prepare` (the card's: huge_mapping), the thread keeps up to the reserve's count of
  chunk-sized mappings faulted in whether or not the engine is quiet, and a chunk made on the path, or in a quiet,
  registers one of them. Back-to-back requests' saves then pay only the registering on their path: a replay's
  first-turn save of 418 MB took 16-21 ms against 85-106 (session 26). These mappings count against the limit as
  chunks do, and their pages are faulted in outside the GIL (populate).
- Limits. Saves always get their memory: where no free span fits, a chunk of at least the save's size is made
  on the spot, as without the arena. The reserve grows only while the arena's bytes stay within the limit, the
  prompt cache's budget (`prompt_cache_budget`), and wholly free chunks beyond the reserve are let go. So the arena holds at most the budget, plus one save's bytes while a save is passing it
  (the prompt cache evicts after it saves), as before it.
"""
from __future__ import annotations

import bisect
import collections
import ctypes
import functools
import mmap
import threading
import time
import weakref
from typing import Callable

import numpy as np

PAGE = 4096
MIB = 1 << 20
HUGE_PAGE = 2 * MIB
QUIET_S = 0.05       # the engine idle this long before the arena's thread page-locks a chunk


def huge_mapping(n: int) -> np.ndarray | None:
    """n bytes of fresh anonymous memory as a uint8 array (unmapped once the array goes), in transparent huge pages
    where the kernel gives them (MADV_HUGEPAGE: its `madvise` mode gives them only so asked), every page faulted in
    (populate). Registering such memory with the card's driver took half the time of 4 KiB pages: 251 MiB made and
    registered in 66-76 ms against 138-142 ms on the H200's host (session 24, tools/bench_pinned.py). None where
    the mapping cannot be made; plain pages where the platform has no such advice."""
    try:
        m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, ValueError):
        return None
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            m.madvise(advice)
        except OSError:
            pass
    a = np.frombuffer(m, np.uint8)
    populate(a)
    return a


MADV_POPULATE_WRITE = 23            # Linux 5.14: fault in a range writable, as writes would


@functools.cache
def _libc():
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def populate(a: np.ndarray) -> None:
    """Every page of a's fresh mapping faulted in, outside the GIL: the kernel's zeroing of 251 MiB took 50-59 ms on
    the H200's host, and a thread that faults it in under the GIL (numpy's writes) holds up the engine's thread,
    whose prompt passes launch from Python (a 4,128-id pass went from 266 ms to 322-358 ms beside it, session 26).
    madvise(MADV_POPULATE_WRITE) through ctypes, which lets the GIL go; on a kernel without it, memset, also
    through ctypes; numpy's write a huge page where there is no C library."""
    libc = _libc()
    if libc is not None:
        addr, n = ctypes.c_void_p(a.ctypes.data), ctypes.c_size_t(a.nbytes)
        if libc.madvise(addr, n, MADV_POPULATE_WRITE) == 0:
            return
        libc.memset(addr, 0, n)
        return
    a[::HUGE_PAGE] = 0                  # a write a huge page faults it in whole


def pages(n: int) -> int:
    """n bytes rounded up to whole pages."""
    return -(-n // PAGE) * PAGE


class Spans:
    """Free spans of chunks (bytes, page-granular by the caller): take() by first fit, oldest chunk first;
    give() returns a span and merges it with free neighbours. A span given that overlaps a free one, or lies
    outside its chunk, is an error (a double return)."""

    def __init__(self):
        self.size: dict[int, int] = {}                  # chunk -> bytes (insertion order: oldest first)
        self._free: dict[int, list[list[int]]] = {}     # chunk -> sorted [offset, bytes] spans
        self.free_bytes = 0

    @property
    def total_bytes(self) -> int:
        return sum(self.size.values())

    def add(self, chunk: int, n: int) -> None:
        if chunk in self.size or n <= 0:
            raise ValueError(f"chunk {chunk}: already held, or {n} bytes")
        self.size[chunk], self._free[chunk] = n, [[0, n]]
        self.free_bytes += n

    def take(self, n: int) -> tuple[int, int] | None:
        """(chunk, offset) of n free bytes, or None where no free span holds them."""
        for chunk, spans in self._free.items():
            for i, (off, m) in enumerate(spans):
                if m >= n:
                    if m == n:
                        del spans[i]
                    else:
                        spans[i] = [off + n, m - n]
                    self.free_bytes -= n
                    return chunk, off
        return None

    def give(self, chunk: int, off: int, n: int) -> None:
        spans = self._free.get(chunk)
        if spans is None or off < 0 or n <= 0 or off + n > self.size[chunk]:
            raise ValueError(f"span {off}+{n} of chunk {chunk}: no such chunk, or outside it")
        i = bisect.bisect_left(spans, [off, 0])
        if (i > 0 and spans[i - 1][0] + spans[i - 1][1] > off) or (i < len(spans) and off + n > spans[i][0]):
            raise ValueError(f"span {off}+{n} of chunk {chunk} overlaps a free span: returned twice")
        spans.insert(i, [off, n])
        if i + 1 < len(spans) and off + n == spans[i + 1][0]:          # merge with the next
            spans[i][1] += spans.pop(i + 1)[1]
        if i > 0 and spans[i - 1][0] + spans[i - 1][1] == off:         # and with the previous
            spans[i - 1][1] += spans.pop(i)[1]
        self.free_bytes += n

    def idle(self, chunk: int) -> bool:
        """Every byte of the chunk is free."""
        return self._free[chunk] == [[0, self.size[chunk]]]

    def remove(self, chunk: int) -> int:
        """Let an idle chunk go: its bytes."""
        if not self.idle(chunk):
            raise ValueError(f"chunk {chunk} still has spans taken")
        n = self.size.pop(chunk)
        del self._free[chunk]
        self.free_bytes -= n
        return n


# a chunk maker: bytes -> (the chunk's owner object, its address, a release callable), or None where it cannot
Maker = Callable[[int], "tuple[object, int, Callable[[], None]] | None"]


class HostArena:
    """Host arrays from recycled chunks (see the module's legend). `make` gives chunks; arrays under `min_bytes`
    are plain numpy memory, as is any array whose chunk could not be made."""

    def __init__(self, make: Maker, *, chunk_bytes: int = 64 * MIB, reserve_chunks: int = 2,
                 min_bytes: int = MIB, limit_bytes: int = 0, background: bool = True,
                 prepare: Callable[[int], object | None] | None = None):
        self._make, self.chunk_bytes, self.min_bytes = make, pages(chunk_bytes), min_bytes
        # prepare(n): n bytes made ready without the driver (mapped, faulted in), which make(n, ready) then locks
        self._prepare, self._ready = prepare, []
        self.reserve_chunks, self.limit_bytes = reserve_chunks, limit_bytes
        self.spans = Spans()
        self._chunks: dict[int, tuple[object, int, Callable[[], None]]] = {}
        self._next = 0
        self._lock = threading.Lock()
        self._returned: collections.deque = collections.deque()   # spans whose arrays were freed (any thread)
        self._wake = threading.Event()
        self._idle = threading.Event()                # the engine runs no request (set_idle)
        self._idle.set()
        self._busy_epoch = 0                          # set_idle(False) calls, to see a request come and go
        self._background, self._thread = background, None
        self.made_ahead = self.made_on_path = self.let_go = 0   # chunks, for tests and records
        self.prepared = self.prepared_used = 0                  # mappings made ready ahead, and those made chunks

    # --- what the backend calls ---
    def array(self, shape, dtype) -> np.ndarray:
        """An empty array of this shape, in page-locked memory where it is min_bytes or more."""
        dtype = np.dtype(dtype)
        n = int(np.prod(shape)) * dtype.itemsize
        if n < self.min_bytes:
            return np.empty(shape, dtype)
        need = pages(n)
        with self._lock:
            self._settle()
            got = self.spans.take(need)
        if got is None:        # on the path: a chunk of its own, as without the arena (a whole chunk where a
            # budget lets the rest serve later saves)
            chunk = self._new_chunk(max(need, self.chunk_bytes) if self.limit_bytes else need, ahead=False)
            if chunk is None:
                return np.empty(shape, dtype)
            with self._lock:
                got = self.spans.take(need)
        chunk, off = got
        owner, address, _ = self._chunks[chunk]
        base = (ctypes.c_uint8 * need).from_address(address + off)
        base.chunk_owner = owner          # the chunk's memory lives while any array over it does, arena or not
        weakref.finalize(base, self._returned.append, (chunk, off, need))
        return np.frombuffer(base, dtype, count=n // dtype.itemsize).reshape(shape)

    def set_limit(self, limit_bytes: int) -> None:
        """The most bytes the arena grows its reserve within (the prompt cache's budget). 0 (no prompt cache, or
        the model going: a sleep) lets every wholly free chunk go now, and the thread ends."""
        self.limit_bytes = max(0, int(limit_bytes))
        if not self.limit_bytes:
            self.tend()
            self._wake.set()

    def set_idle(self, idle: bool) -> None:
        """The engine runs no request (True) or runs some (False): the arena's thread makes chunks only in a quiet
        of QUIET_S."""
        if idle:
            self._idle.set()
        else:
            self._busy_epoch += 1
            self._idle.clear()

    def tend(self, quiet: bool = False) -> int:
        """Bring the wholly free chunks to the reserve (made ahead, within the limit) and let go of those beyond
        it: the background thread's work (quiet: each chunk only in a quiet of the engine's), callable directly
        (tests, no thread). Chunks made."""
        made = 0
        while True:
            self.top_up()
            with self._lock:
                self._settle()
                self._trim()
                short = self._idle_count() < self.reserve_chunks
                room = self.spans.total_bytes + self.chunk_bytes <= self.limit_bytes
            if not (short and room) or (quiet and not self._quiet()):
                return made
            if self._new_chunk(self.chunk_bytes, ahead=True) is None:
                return made
            made += 1

    def top_up(self) -> int:
        """Mappings made ready (prepare) up to the reserve's shortfall, within the limit with the chunks' bytes: no
        driver, so at any time (the thread's work, callable directly). Those made."""
        if self._prepare is None:
            return 0
        made = 0
        while True:
            with self._lock:
                self._settle()
                want = self.reserve_chunks - self._idle_count() - len(self._ready)
                room = (self.spans.total_bytes + (len(self._ready) + 1) * self.chunk_bytes) <= self.limit_bytes
            if want <= 0 or not room:
                return made
            got = self._prepare(self.chunk_bytes)         # outside the lock: it faults in every page
            if got is None:
                return made
            with self._lock:
                self._ready.append(got)
                self.prepared += 1
            made += 1

    def _quiet(self) -> bool:
        """(the thread) wait for the engine to be idle for QUIET_S, keeping the mappings made ready meanwhile; False
        where the limit went to 0."""
        while self.limit_bytes:
            self.top_up()
            if not self._idle.wait(0.5):
                continue
            epoch = self._busy_epoch
            time.sleep(QUIET_S)
            if self._idle.is_set() and epoch == self._busy_epoch:
                return True
        return False

    def stats(self) -> dict[str, int]:
        with self._lock:
            self._settle()
            return {"chunks": len(self.spans.size), "idle_chunks": self._idle_count(),
                    "bytes": self.spans.total_bytes, "free_bytes": self.spans.free_bytes, "made_ahead": self.made_ahead,
                    "made_on_path": self.made_on_path, "let_go": self.let_go, "ready": len(self._ready),
                    "prepared": self.prepared, "prepared_used": self.prepared_used}

    # --- inside ---
    def _new_chunk(self, n: int, ahead: bool) -> int | None:
        with self._lock:                                  # a mapping made ready for a chunk of this size
            ready = self._ready.pop() if n == self.chunk_bytes and self._ready else None
        # outside the lock: it faults in every page (a ready mapping's are in), then locks them
        got = self._make(n) if ready is None else self._make(n, ready)
        if got is None:
            return None
        with self._lock:
            chunk, self._next = self._next, self._next + 1
            self._chunks[chunk] = got
            self.spans.add(chunk, n)
            if ahead:
                self.made_ahead += 1
            else:
                self.made_on_path += 1
            self.prepared_used += ready is not None
        return chunk

    def _settle(self) -> None:
        """(under the lock) the spans whose arrays were freed go back."""
        while self._returned:
            self.spans.give(*self._returned.popleft())

    def _idle_count(self) -> int:
        """(under the lock) the wholly free chunks of at least chunk_bytes."""
        return sum(1 for c, n in self.spans.size.items() if n >= self.chunk_bytes and self.spans.idle(c))

    def _trim(self) -> None:
        """(under the lock) wholly free chunks go while there are more than the reserve, or the arena passes its
        limit; the newest first."""
        for chunk in reversed(list(self.spans.size)):
            over = self.spans.total_bytes > self.limit_bytes or self._idle_count() > self.reserve_chunks
            if over and self.spans.idle(chunk):
                self.spans.remove(chunk)
                self._chunks.pop(chunk)[2]()
                self.let_go += 1
        while self._ready and (self.spans.total_bytes + len(self._ready) * self.chunk_bytes > self.limit_bytes
                               or self._idle_count() + len(self._ready) > self.reserve_chunks):
            self._ready.pop()                             # unmapped once nothing holds it

    def tend_later(self) -> None:
        """The background thread tends the reserve now (started on the first call). The caller calls this once
        its copies into the arrays it took are done: registering a chunk holds the driver, and copies issued
        meanwhile wait for it (on the H200's host a 418 MB save took 158-233 ms beside it, 8 ms alone)."""
        if not self._background or not self.limit_bytes:
            return
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="host-arena", daemon=True)
                self._thread.start()
        self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            try:
                self.tend(quiet=True)
            except Exception:    # noqa: BLE001 (a chunk that cannot be made: saves make their own, as before)
                pass
            with self._lock:
                if not self.limit_bytes:     # no reserve to keep (set_limit(0)): the thread ends
                    self._thread = None
                    return
