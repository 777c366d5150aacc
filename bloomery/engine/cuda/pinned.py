"""Page-locked host memory for the cuda backend: small buffers from the driver's allocator, large ones as
anonymous mappings in transparent huge pages registered with the driver in place.

Huge pages make page-locked memory quick to make on the card's host (sessions 24-25, tools/bench_pinned.py):
registering 251 MiB took 66-76 ms against 138-142 ms in 4 KiB pages and 146-182 ms through cudaHostAlloc, and
512 MiB of host experts 78 ms against 498 ms from cudaHostAlloc (which gave no huge pages), so an offload start
reached /health in 15 s against 26 s. The host expert kernel's rate did not measurably change with them.
"""
from __future__ import annotations

import functools
import os
import weakref

import cupy
import numpy as np

from bloomery.engine.host_arena import huge_mapping

CAN_USE_HOST_POINTER = 91          # cudaDevAttrCanUseHostPointerForRegisteredMem
REGISTER_MAPPED = 2                 # cudaHostRegisterMapped: card kernels may read it too (moe_stream_in)


def pinned(nbytes: int, dtype=np.uint8, shape=None) -> np.ndarray:
    """nbytes of page-locked memory from the driver's allocator (cudaHostAlloc), as an array of dtype."""
    mem = cupy.cuda.alloc_pinned_memory(max(1, nbytes))
    a = np.frombuffer(mem, dtype, nbytes // np.dtype(dtype).itemsize)
    return a.reshape(shape) if shape is not None else a


def _unregister(ptr: int) -> None:
    try:
        cupy.cuda.runtime.hostUnregister(ptr)
    except Exception:               # noqa: BLE001 (at interpreter exit the driver may be gone; nothing to undo then)
        pass


def pinned_chunk(n: int, ready: np.ndarray | None = None, flags: int = 0):
    """host_arena's chunk maker on the card: n bytes of an anonymous mapping, in huge pages where the kernel gives
    them (host_arena.huge_mapping; or `ready`, one made so ahead), then registered with the driver (flags:
    cudaHostRegister's): page-locked in place, so copies run at the bus's pinned rate (on the H200's host 54 GB/s
    to the card, against 5.5 GB/s from pageable memory). Registering faults in whatever is left and pins every
    page, outside the GIL; of 251 MiB in huge pages, the mapping took 50-59 ms and the registering 8-9 ms (session
    26). (owner, address, release); None where either step fails (the array is pageable then)."""
    owner = ready if ready is not None and ready.nbytes == n else huge_mapping(n)    # unmapped once the owner goes
    if owner is None:
        return None
    ptr = owner.ctypes.data
    try:
        cupy.cuda.runtime.hostRegister(ptr, n, flags)
    except cupy.cuda.runtime.CUDARuntimeError:
        return None
    # unregistered once: when the arena lets the chunk go, or else as the owner is freed, before its unmapping
    return owner, ptr, weakref.finalize(owner, _unregister, ptr)


@functools.cache
def _host_pointer_is_device_pointer() -> bool:
    """Whether card kernels may read registered memory at its host address (cudaDevAttrCanUseHostPointerFor-
    RegisteredMem), as they read the driver allocator's under unified addressing; asked once a process."""
    try:
        return bool(cupy.cuda.runtime.deviceGetAttribute(CAN_USE_HOST_POINTER, cupy.cuda.Device().id))
    except cupy.cuda.runtime.CUDARuntimeError:
        return False


def huge_pinned(nbytes: int) -> np.ndarray:
    """nbytes of page-locked memory that card kernels may read as well, in huge pages where the host gives them
    (pinned_chunk, mapped), else from the driver's allocator. BLOOMERY_HOST_HUGE=0 takes the driver's allocator
    always (for comparison). Unregistered and unmapped once the array goes."""
    if os.environ.get("BLOOMERY_HOST_HUGE", "1") != "0" and _host_pointer_is_device_pointer():
        got = pinned_chunk(max(1, nbytes), flags=REGISTER_MAPPED)
        if got is not None:
            return got[0][:nbytes]
    return pinned(nbytes)
