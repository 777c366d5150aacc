"""How fast the host makes page-locked memory, each way the prompt cache could: cudaHostAlloc, an anonymous
mapping registered with the driver (4 KiB pages, populated first or not), the same in transparent huge pages
(MADV_HUGEPAGE, touched, then registered), and registered as portable memory. Each way makes --mib MiB three
times and then copies --copy-mb MB from the card into it (the first copy into fresh memory). Needs a card.

    python3 tools/bench_pinned.py [--mib 251] [--copy-mb 209]

(session 24 on the H200 host: 251 MiB in 138-142 ms registered in 4 KiB pages, 66-76 ms in huge pages, 146-182 ms
by cudaHostAlloc; bloomery/engine/cuda/pinned.py pinned_chunk takes the huge pages. Session 26, the last way, by a
script doing the same: mapping and faulting in 50-59 ms, registering 8-9 ms.)
"""
from __future__ import annotations

import argparse
import ctypes
import mmap
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=251)
    ap.add_argument("--copy-mb", type=int, default=209)
    a = ap.parse_args()
    import cupy

    n = a.mib << 20
    dev = cupy.empty(min(n, a.copy_mb * 1_000_000), cupy.uint8)
    rt = cupy.cuda.runtime
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

    def copy_in(ptr: int) -> float:
        t = time.perf_counter()
        rt.memcpy(ptr, dev.data.ptr, dev.nbytes, rt.memcpyDeviceToHost)
        return (time.perf_counter() - t) * 1e3

    def host_alloc():
        t = time.perf_counter()
        m = cupy.cuda.alloc_pinned_memory(n)
        return (time.perf_counter() - t) * 1e3, copy_in(m.ptr), m

    def registered(flags: int = 0, populate: bool = False, huge: bool = False):
        t = time.perf_counter()
        f = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        p = libc.mmap(None, n, mmap.PROT_READ | mmap.PROT_WRITE, f, -1, 0)
        if huge:
            libc.madvise(p, n, mmap.MADV_HUGEPAGE)
            ctypes.memset(p, 0, n)
        rt.hostRegister(p, n, flags)
        return (time.perf_counter() - t) * 1e3, copy_in(p), p

    try:
        print("transparent huge pages:", open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip())
    except OSError:
        pass
    ways = [("cudaHostAlloc", host_alloc), ("mmap+register", registered),
            ("mmap populated+register", lambda: registered(populate=True)),
            ("mmap huge pages+touch+register", lambda: registered(huge=True)),
            ("mmap+register portable", lambda: registered(flags=1))]
    for name, fn in ways:
        keep = []
        for _ in range(3):
            made, first, held = fn()
            keep.append(held)
            print(f"{name}: made {made:.1f} ms, first copy of {dev.nbytes / 1e6:.0f} MB {first:.1f} ms", flush=True)
    # the prompt cache's way (host_arena): the mapping made ready ahead, which holds no driver, then registered
    from bloomery.engine.host_arena import huge_mapping
    keep = []
    for _ in range(3):
        t0 = time.perf_counter()
        m = huge_mapping(n)
        t1 = time.perf_counter()
        rt.hostRegister(m.ctypes.data, n, 0)
        t2 = time.perf_counter()
        keep.append(m)
        print(f"huge_mapping, then registered: mapping and faulting in {(t1 - t0) * 1e3:.1f} ms, registering "
              f"{(t2 - t1) * 1e3:.1f} ms, first copy {copy_in(m.ctypes.data):.1f} ms", flush=True)


if __name__ == "__main__":
    main()
