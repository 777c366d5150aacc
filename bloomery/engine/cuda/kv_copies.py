"""The prompt cache's copies of one slot's K or V between the card's cache and a host array, as 2-D copies
(cudaMemcpy2D): one call a layer, a row per KV head, and no gather on the card first.

Before (session 18's measure on the H200, the 30B-shaped file), each layer's K and V went as its own
synchronous copy of a strided slice, which CuPy first gathers with a copy kernel of its own: 96 of them for
48 layers, 25-27 ms to save 255 new positions and 11 ms to restore 4,255, on the path of the request that
reuses the slot, and the kernel compiled by NVRTC on a fresh machine. The addressing is pure arithmetic,
kept here device-free so that tests/test_kv_copies.py checks it on the CPU against numpy's slicing.

Legend: the card's cache is [L, S, Hkv, C, Dh] (cuda/attention.KVCacheF16), a host copy [L, Hkv, P, Dh];
both C-contiguous. Offsets, pitches and widths are in bytes.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Copy2D:
    dev: int          # the first row's offset in the card's array
    dev_pitch: int    # from one row (KV head) to the next there
    host: int         # the first row's offset in the host array
    host_pitch: int
    width: int        # bytes a row: the positions' K (or V) of one head
    height: int       # rows: the KV heads


def span_copies(cache_shape, itemsize: int, slot: int, dev_first: int, host_positions: int, host_first: int,
                count: int) -> list[Copy2D]:
    """Positions dev_first .. dev_first+count-1 of `slot` in a cache of `cache_shape` against positions
    host_first .. host_first+count-1 of a host array [L, Hkv, host_positions, Dh]: one copy a layer."""
    n_layer, n_slots, n_head_kv, n_ctx, head_dim = (int(v) for v in cache_shape)
    if not 0 <= slot < n_slots:
        raise ValueError(f"slot {slot} is out of range: the cache has {n_slots} slots")
    if count < 1 or dev_first < 0 or dev_first + count > n_ctx:
        raise ValueError(f"positions {dev_first}..{dev_first + count - 1} are not within the slot's {n_ctx}")
    if host_first < 0 or host_first + count > host_positions:
        raise ValueError(f"positions {host_first}..{host_first + count - 1} are not within the host copy's "
                         f"{host_positions}")
    row = head_dim * itemsize
    return [Copy2D(dev=((layer * n_slots + slot) * n_head_kv * n_ctx + dev_first) * row, dev_pitch=n_ctx * row,
                   host=(layer * n_head_kv * host_positions + host_first) * row, host_pitch=host_positions * row,
                   width=count * row, height=n_head_kv)
            for layer in range(n_layer)]
