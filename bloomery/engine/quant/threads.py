"""The numpy kernels' threads: numpy's bundled OpenBLAS held to one thread inside the lane
kernels (OneBlasThread), and the worker threads a large product's row chunks are spread over
(row_chunks; BLOOMERY_NUMPY_THREADS=1 keeps everything on the calling thread)."""
from __future__ import annotations

import os

import numpy as np

def _numpy_openblas():
    """numpy's bundled OpenBLAS as a ctypes library (None if numpy uses another BLAS)."""
    import ctypes
    import glob
    libs = os.path.join(os.path.dirname(np.__file__), os.pardir, "numpy.libs")
    for path in sorted(glob.glob(os.path.join(libs, "*openblas*"))):
        try:
            lib = ctypes.CDLL(path)
            lib.openblas_set_num_threads_local
        except (OSError, AttributeError):
            continue
        return lib
    return None


_OPENBLAS = _numpy_openblas()
_BLAS_THREADS_LOCAL = None
if _OPENBLAS is not None:
    import ctypes as _ct
    _BLAS_THREADS_LOCAL = _OPENBLAS.openblas_set_num_threads_local
    _BLAS_THREADS_LOCAL.argtypes, _BLAS_THREADS_LOCAL.restype = [_ct.c_int], _ct.c_int


class OneBlasThread:
    """The lane kernels run hundreds of small GEMMs and AXPYs; OpenBLAS's thread hand-off
    costs far more than their work on a busy 2-core machine, so run them on this thread."""

    def __enter__(self):
        self.prev = _BLAS_THREADS_LOCAL(1) if _BLAS_THREADS_LOCAL else None

    def __exit__(self, *exc):
        if self.prev is not None:
            _BLAS_THREADS_LOCAL(self.prev)


# Worker threads for the row chunks of the large products (numpy, BLAS and the saxpy calls all
# release the GIL); BLOOMERY_NUMPY_THREADS=1 keeps everything on the calling thread.
N_THREADS = max(1, int(os.environ.get("BLOOMERY_NUMPY_THREADS", "0") or 0) or min(2, os.cpu_count() or 1))
PARALLEL_MIN_MACS = 1 << 22           # products smaller than this run on the calling thread
_POOL = None


def _one_blas_thread_call(fn, *args):
    with OneBlasThread():
        return fn(*args)


def row_chunks(fn, n_rows: int, nc: int, macs: int, multiple: int = 1) -> None:
    """fn(n0, n1) for each chunk of nc rows, spread over N_THREADS threads when the product is
    big; every chunk but the last a whole number of `multiple` rows."""
    global _POOL
    if N_THREADS > 1 and macs >= PARALLEL_MIN_MACS:
        nc = min(nc, -(-n_rows // N_THREADS))                          # at least one chunk per thread
    nc = max(multiple, nc - nc % multiple)
    starts = list(range(0, n_rows, nc))
    if N_THREADS < 2 or len(starts) < 2 or macs < PARALLEL_MIN_MACS:
        for n0 in starts:
            fn(n0, min(n_rows, n0 + nc))
        return
    if _POOL is None:
        from concurrent.futures import ThreadPoolExecutor
        _POOL = ThreadPoolExecutor(N_THREADS, thread_name_prefix="bloomery-numpy")
    per = -(-len(starts) // N_THREADS)                                 # contiguous runs of chunks per thread

    def run(group):
        for n0 in group:
            fn(n0, min(n_rows, n0 + nc))
    futures = [_POOL.submit(_one_blas_thread_call, run, starts[i:i + per]) for i in range(per, len(starts), per)]
    run(starts[:per])                                                   # the first run on this thread
    for f in futures:
        f.result()
