"""Page-locked host memory on the card (engine/cuda/pinned.py): the host experts' memory in transparent huge pages,
registered with the driver in place and mapped, so a card kernel reads it at its host address (as moe_stream_in
does) and the host kernel walks one page table entry per 2 MiB. Runs where CuPy sees a card; skips elsewhere."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _huge_kib(addr: int) -> int | None:
    """AnonHugePages of the mapping that holds addr (/proc/self/smaps), None where none holds it."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and not head[0].endswith(":"):
            lo, hi = (int(v, 16) for v in head[0].split("-"))
            inside = lo <= addr < hi
        elif inside and head and head[0] == "AnonHugePages:":
            return int(head[1])
    return None


def _read_on_card(a: np.ndarray):
    """The card's sum of a's bytes, read by a kernel at a's host address."""
    import cupy
    mem = cupy.cuda.UnownedMemory(a.ctypes.data, a.nbytes, a)
    on_card = cupy.ndarray((a.nbytes,), cupy.uint8, cupy.cuda.MemoryPointer(mem, 0))
    return int(on_card.astype(cupy.int64).sum())


def test_huge_pinned_memory_lies_in_huge_pages_and_the_card_reads_it_in_place(gpu, monkeypatch):
    from bloomery.engine.cuda.pinned import huge_pinned
    n = 24 << 20
    a = huge_pinned(n)
    assert a.nbytes == n and a.dtype == np.uint8
    a[:] = np.arange(n, dtype=np.uint64).astype(np.uint8)
    if THP.exists() and "[never]" not in THP.read_text():
        # 24 MiB holds at least 11 whole, aligned 2 MiB pages wherever the mapping starts
        assert (_huge_kib(a.ctypes.data) or 0) >= 11 * 2048
    assert _read_on_card(a) == int(a.sum(dtype=np.int64))
    monkeypatch.setenv("BLOOMERY_HOST_HUGE", "0")                 # the driver's allocator, for comparison
    b = huge_pinned(n)
    b[:] = 7
    assert _read_on_card(b) == 7 * n


def test_host_experts_lie_in_huge_pages(gpu):
    """An expert stack's host copy (what the host kernel reads and the streamed lane copies) takes huge_pinned."""
    import cupy
    from bloomery.engine.cuda.experts import ExpertStack
    n_exp, rows, row_bytes = 4, 2048, 1152                    # a Q4_K [2048, 2048] stack: 2.4 MB an expert
    raw = np.random.default_rng(0).integers(0, 256, n_exp * rows * row_bytes, dtype=np.uint8)
    zero = cupy.zeros(rows * row_bytes, cupy.uint8)
    st = ExpertStack("blk.0.ffn_gate_exps.weight", 12, (2048, rows, n_exp), raw, row_bytes, [0],
                     int(zero.data.ptr))
    assert np.array_equal(st.host, raw)
    if THP.exists() and "[never]" not in THP.read_text():
        assert (_huge_kib(st.host.ctypes.data) or 0) >= 2048
    assert _read_on_card(st.host[row_bytes * rows:2 * row_bytes * rows]) == int(raw[row_bytes * rows:
                                                                                     2 * row_bytes * rows].sum())
