"""Weights from the mapped file to the card, while a model loads: a tensor's bytes are cut into
chunks, and several threads each copy theirs from the file's pages into a pinned buffer of their
own and hand it to the card on a stream of their own (two buffers a thread, so the next chunk's
read overlaps the last one's copy to the card). One thread reading the mapping and a pageable
cupy.asarray copy moved 4.6 GB/s on the H200's host (session 18: 19.8 GB in 4.25 s); the page
cache and the bus (55 GB/s pinned) give far more to several readers.

Small tensors (norms, biases, the router) go the plain way: their count, not their bytes, is what
they cost. The pinned buffers live while the load runs (Uploader is a context the backend's
loading() opens) and are freed after: THREADS x 2 x CHUNK = 64 MiB at most, during the load only,
within the host reserve the plan keeps beside its terms (plan.HOST_RESERVE_BYTES, 256 MiB).
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import cupy
import numpy as np

CHUNK = 4 << 20          # bytes one thread copies at a time
SMALL = 4 << 20          # a tensor at most this long is copied in one call
THREADS = 8              # at most: the bus is full well before 8 readers (the host's cores permitting)


def reader_threads() -> int:
    """Threads that read the file: the cores this process may use, at most THREADS."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:      # not Linux
        n = os.cpu_count() or 1
    return max(1, min(THREADS, n))


class Uploader:
    """Copies host arrays (the file's mapped bytes) to new card arrays, in parallel chunks."""

    def __init__(self, threads: int | None = None):
        self.threads = threads or reader_threads()
        self.device = cupy.cuda.Device().id
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="bloomery-upload")
        self._lanes: dict[int, tuple] = {}       # lane -> (pinned [2*CHUNK], stream, (event, event))

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for _, stream, _ in self._lanes.values():
            stream.synchronize()
        self._lanes.clear()                      # the pinned buffers go back to CuPy's pinned pool
        cupy.get_default_pinned_memory_pool().free_all_blocks()

    def __enter__(self) -> "Uploader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def to_card(self, host: np.ndarray) -> cupy.ndarray:
        """A new card array [n] (uint8) holding `host`'s bytes; returns once they are all on the card."""
        src = np.ascontiguousarray(host).reshape(-1).view(np.uint8)
        n = int(src.size)
        if n <= SMALL or self.threads == 1:
            return cupy.asarray(src)
        dev = cupy.empty(n, np.uint8)
        chunks = [(a, min(a + CHUNK, n)) for a in range(0, n, CHUNK)]
        lanes = min(self.threads, len(chunks))
        done = [self._pool.submit(self._lane, i, src, int(dev.data.ptr), chunks[i::lanes]) for i in range(lanes)]
        for f in done:
            f.result()                           # a failed copy raises here, in the loading thread
        return dev

    def _lane(self, lane: int, src: np.ndarray, dst: int, chunks) -> None:
        with cupy.cuda.Device(self.device):
            state = self._lanes.get(lane)
            if state is None:
                mem = cupy.cuda.alloc_pinned_memory(2 * CHUNK)
                state = self._lanes[lane] = (np.frombuffer(mem, np.uint8, 2 * CHUNK), cupy.cuda.Stream(non_blocking=True),
                                             (cupy.cuda.Event(), cupy.cuda.Event()))
            buf, stream, events = state
            for j, (a, b) in enumerate(chunks):
                half = j % 2
                events[half].synchronize()           # this half's last copy to the card is done
                staged = buf[half * CHUNK: half * CHUNK + (b - a)]
                np.copyto(staged, src[a:b])          # the file's pages -> pinned (numpy lets go of the GIL)
                cupy.cuda.runtime.memcpyAsync(dst + a, staged.ctypes.data, b - a,
                                              cupy.cuda.runtime.memcpyHostToDevice, stream.ptr)
                events[half].record(stream)
            stream.synchronize()
