"""host_arena: the prompt cache's recycled host memory, on the CPU with plain numpy chunks in place of
page-locked ones (the card's maker is tested in test_prompt_cache_cuda.py)."""
from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

from bloomery.engine.host_arena import MIB, PAGE, HostArena, Spans, pages


def test_spans_first_fit_and_merge_on_return():
    s = Spans()
    s.add(0, 10 * PAGE)
    a, b, c = s.take(2 * PAGE), s.take(3 * PAGE), s.take(5 * PAGE)
    assert (a, b, c) == ((0, 0), (0, 2 * PAGE), (0, 5 * PAGE)) and s.free_bytes == 0
    assert s.take(PAGE) is None
    s.give(0, 0, 2 * PAGE)
    s.give(0, 5 * PAGE, 5 * PAGE)
    assert s.take(4 * PAGE) == (0, 5 * PAGE)            # the first span that holds it
    s.give(0, 5 * PAGE, 4 * PAGE)
    s.give(0, 2 * PAGE, 3 * PAGE)                       # merges with both neighbours
    assert s.idle(0) and s.free_bytes == 10 * PAGE
    assert s.take(10 * PAGE) == (0, 0)


def test_spans_refuse_a_double_return_and_a_busy_removal():
    s = Spans()
    s.add(0, 4 * PAGE)
    s.add(1, 4 * PAGE)
    assert s.take(4 * PAGE) == (0, 0) and s.take(2 * PAGE) == (1, 0)   # the oldest chunk first
    with pytest.raises(ValueError, match="chunk 1 still has spans taken"):
        s.remove(1)
    s.give(1, 0, 2 * PAGE)
    with pytest.raises(ValueError, match="overlaps a free span: returned twice"):
        s.give(1, 0, PAGE)
    with pytest.raises(ValueError, match="outside it"):
        s.give(1, 3 * PAGE, 2 * PAGE)
    assert s.remove(1) == 4 * PAGE and s.total_bytes == 4 * PAGE


class Maker:
    """Plain numpy chunks, with a record of what was made and let go (and of the ready mappings it was handed)."""

    def __init__(self, fail: bool = False):
        self.made, self.released, self.fail, self.from_ready = [], [], fail, []

    def __call__(self, n: int, ready=None):
        if self.fail:
            return None
        owner = np.zeros(n + PAGE, np.uint8) if ready is None else ready
        ptr = owner.ctypes.data + (-owner.ctypes.data) % PAGE
        self.made.append(n)
        self.from_ready.append(ready is not None)
        return owner, ptr, lambda: self.released.append(n)


class Prepare:
    """A chunk-sized mapping made ready (the card's huge_mapping), counted."""

    def __init__(self):
        self.calls = 0

    def __call__(self, n: int):
        self.calls += 1
        return np.zeros(n + PAGE, np.uint8)


def until(pred, seconds: float = 10.0) -> bool:
    """pred() once it holds, polled, or its last value after `seconds` (the arena's thread works meanwhile)."""
    import time
    t0 = time.monotonic()
    while not pred() and time.monotonic() - t0 < seconds:
        time.sleep(0.01)
    return pred()


def arena(maker, **kw) -> HostArena:
    kw = {"chunk_bytes": 4 * MIB, "reserve_chunks": 2, "min_bytes": MIB, "background": False, **kw}
    return HostArena(maker, **kw)


def test_an_array_is_the_same_memory_again_once_freed():
    m = Maker()
    a = arena(m, limit_bytes=64 * MIB)
    x = a.array((2, MIB), np.uint8)                     # 2 MiB: a chunk made on the path, 4 MiB
    x[...] = 7
    view = x[1]                                         # a view keeps the span taken
    ptr = x.ctypes.data
    del x
    gc.collect()
    y = a.array((MIB // 2,), np.float32)                # 2 MiB: another span, the first is still read
    assert y.ctypes.data != ptr and (view == 7).all()
    del view, y
    gc.collect()
    z = a.array((2 * MIB,), np.uint8)
    assert z.ctypes.data == ptr and m.made == [4 * MIB]
    assert a.stats()["made_on_path"] == 1 and a.stats()["made_ahead"] == 0


def test_the_reserve_is_whole_chunks_made_ahead_within_the_limit_and_let_go_beyond_it():
    m = Maker()
    a = arena(m)
    assert a.tend() == 0                                # no limit (no prompt cache budget): nothing ahead
    a.set_limit(64 * MIB)
    assert a.tend() == 2 and a.stats()["idle_chunks"] == 2
    x = a.array((3 * MIB,), np.uint8)
    assert a.stats()["made_on_path"] == 0               # from the reserve
    assert a.tend() == 1                                # a chunk with a 1 MiB tail is no longer reserve
    y = a.array((MIB,), np.uint8)                       # the tail takes a small one
    assert y.ctypes.data == x.ctypes.data + 3 * MIB and a.stats()["idle_chunks"] == 2
    a.set_limit(6 * MIB)                                # a smaller budget: no reserve past it, free chunks go
    a.tend()
    assert a.stats()["bytes"] <= 6 * MIB and len(m.released) == 2
    del x, y
    gc.collect()
    a.set_limit(0)
    a.tend()
    assert a.stats()["bytes"] == 0 and len(m.released) == 3


def test_without_a_budget_a_save_gets_a_chunk_of_its_own_size():
    m = Maker()
    a = arena(m)                                        # no prompt cache budget: nothing kept for later
    x = a.array((2 * MIB + 1,), np.uint8)
    assert m.made == [pages(2 * MIB + 1)] and x.nbytes == 2 * MIB + 1


def test_a_save_larger_than_a_chunk_gets_a_chunk_of_its_size_and_small_arrays_plain_memory():
    m = Maker()
    a = arena(m, limit_bytes=64 * MIB)
    big = a.array((10 * MIB + 1,), np.uint8)
    assert m.made == [pages(10 * MIB + 1)] and big.nbytes == 10 * MIB + 1
    small = a.array((100,), np.float32)
    assert small.base is None and len(m.made) == 1      # under min_bytes: numpy's own memory
    assert arena(Maker(fail=True)).array((2 * MIB,), np.uint8).base is None    # no chunk: pageable, as before


def test_the_background_thread_keeps_the_reserve():
    m = Maker()
    a = arena(m, background=True)
    a.set_limit(64 * MIB)
    x = a.array((2 * MIB,), np.uint8)
    assert a._thread is None                            # not while the caller copies into it
    a.tend_later()                                      # the first call starts the thread
    assert until(lambda: a.stats()["idle_chunks"] == 2) and a.stats()["made_ahead"] == 2 and x.base is not None


def test_a_limit_of_0_lets_every_free_chunk_go_and_ends_the_thread():
    """A sleep (the engine's swap_model) sets the limit to 0: the reserve goes at once, the thread ends, and the
    arena makes a reserve again once a budget comes back."""
    m = Maker()
    a = arena(m, background=True)
    a.set_limit(64 * MIB)
    x = a.array((2 * MIB,), np.uint8)
    a.tend_later()
    assert until(lambda: a.stats()["idle_chunks"] == 2)
    del x
    gc.collect()
    a.set_limit(0)
    assert a.stats()["bytes"] == 0 and len(m.released) == len(m.made) == 3
    assert until(lambda: a._thread is None)
    a.set_limit(64 * MIB)
    y = a.array((2 * MIB,), np.uint8)
    a.tend_later()
    assert until(lambda: a.stats()["made_ahead"] == 4) and y.base is not None


def test_an_array_keeps_its_chunk_after_the_arena_is_gone():
    """The memory under a saved state outlives the arena (a model freed while an entry is still read)."""
    m = Maker()
    a = arena(m, limit_bytes=64 * MIB)
    x = a.array((2 * MIB,), np.uint8)
    x[...] = 9
    owner_ref = weakref.ref(a._chunks[0][0])
    del a
    gc.collect()
    assert owner_ref() is not None and (x == 9).all()
    del x
    gc.collect()
    assert owner_ref() is None


def test_the_thread_makes_chunks_only_in_the_engines_quiet(monkeypatch):
    """Page-locking a chunk holds the driver: while requests run (set_idle(False)) the thread waits, and it makes
    the reserve once the engine has been idle for QUIET_S."""
    from bloomery.engine import host_arena
    monkeypatch.setattr(host_arena, "QUIET_S", 0.05)
    m = Maker()
    a = arena(m, background=True)
    a.set_limit(64 * MIB)
    a.set_idle(False)                                   # a request runs
    x = a.array((2 * MIB,), np.uint8)
    a.tend_later()
    assert not until(lambda: a.stats()["made_ahead"] > 0, seconds=0.5)
    a.set_idle(True)
    assert until(lambda: a.stats()["made_ahead"] == 2) and x.base is not None


def test_a_huge_mapping_asks_for_huge_pages_and_is_plain_zeroed_memory():
    import mmap
    from bloomery.engine.host_arena import HUGE_PAGE, huge_mapping
    a = huge_mapping(3 * HUGE_PAGE + 4096)
    assert a is not None and a.dtype == np.uint8 and a.size == 3 * HUGE_PAGE + 4096
    assert not a.any()                                   # fresh pages read as zeros, the touches wrote zeros
    a[-1] = 7
    assert a[-1] == 7
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return
    try:
        smaps = open("/proc/self/smaps").read().split("\n")
    except OSError:
        pytest.skip("no /proc/self/smaps to read the mapping's flags from")
    start = a.ctypes.data
    for i, line in enumerate(smaps):
        head = line.split(" ", 1)[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head) and \
                int(head.split("-")[0], 16) <= start < int(head.split("-")[1], 16):   # (neighbours may merge)
            flags = next(x for x in smaps[i + 1:] if x.startswith("VmFlags:"))
            assert " hg" in flags, flags                # MADV_HUGEPAGE took
            return
    pytest.fail(f"no mapping holds {start:#x} in /proc/self/smaps")


def test_mappings_are_made_ready_while_requests_run_and_a_save_on_the_path_locks_one():
    """Mapping and faulting in a chunk holds no driver, so the thread keeps the reserve's count of them ready while
    requests run; a save that finds no free chunk then only locks one (make(n, ready)), and the thread makes the
    ready ones again at once, within the limit."""
    m, prep = Maker(), Prepare()
    a = arena(m, background=True, prepare=prep)
    a.set_limit(64 * MIB)
    a.set_idle(False)                                   # requests run from the start: never quiet
    a.tend_later()
    assert until(lambda: a.stats()["ready"] == 2) and a.stats()["made_ahead"] == 0
    x = a.array((4 * MIB,), np.uint8)                   # a save of a whole chunk: locks a ready mapping
    y = a.array((3 * MIB,), np.uint8)
    assert m.from_ready == [True, True] and a.stats()["made_on_path"] == 2 and a.stats()["prepared_used"] == 2
    a.tend_later()
    assert until(lambda: a.stats()["ready"] == 2) and prep.calls == 4
    z = a.array((5 * MIB,), np.uint8)                   # larger than a chunk: one of its own size
    assert m.from_ready[-1] is False and z.base is not None
    a.set_idle(True)                                    # a quiet (QUIET_S): the ready ones are locked as the reserve
    assert until(lambda: a.stats()["made_ahead"] == 2)
    assert a.stats()["ready"] == 0 and m.from_ready[-2:] == [True, True]
    del x, y, z


def test_ready_mappings_count_against_the_limit_and_go_with_it():
    m, prep = Maker(), Prepare()
    a = arena(m, prepare=prep, limit_bytes=6 * MIB)     # room for one chunk of 4 MiB only
    assert a.top_up() == 1 and a.stats()["ready"] == 1
    a.set_limit(0)
    a.tend()
    assert a.stats()["ready"] == 0


def _rss_of(address: int) -> int:
    """The resident bytes of the mapping that starts at address (/proc/self/smaps)."""
    lines = open("/proc/self/smaps").read().splitlines()
    for i, line in enumerate(lines):
        if line.split("-")[0] == f"{address:x}" or line.split("-")[0] == f"{address:08x}":
            for follow in lines[i + 1:]:
                if follow.startswith("Rss:"):
                    return int(follow.split()[1]) * 1024
    raise AssertionError(f"no mapping at {address:#x}")


def test_a_huge_mapping_is_resident_when_made_and_its_faulting_lets_the_gil_go():
    """Every page is faulted in before huge_mapping returns, and the faulting runs outside the GIL: a Python thread
    counts on meanwhile (with the GIL held for the whole call it could not count at all)."""
    import threading
    from bloomery.engine.host_arena import huge_mapping, populate
    n = 64 * MIB
    a = huge_mapping(n)
    assert _rss_of(a.ctypes.data) >= n
    import mmap
    m = mmap.mmap(-1, 128 * MIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    fresh = np.frombuffer(m, np.uint8)
    count, stop = [0], threading.Event()

    def counter():
        while not stop.is_set():
            count[0] += 1
    t = threading.Thread(target=counter)
    t.start()
    while count[0] == 0:
        pass
    before = count[0]
    populate(fresh)
    during = count[0] - before
    stop.set()
    t.join()
    assert _rss_of(fresh.ctypes.data) >= 128 * MIB
    assert during > 100, during
