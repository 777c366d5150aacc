"""Attention for the cuda backend: the per-slot F16 KV cache and the two paths over it.

Rows whose slots and positions are only known on the card (a captured decode step), and
any batch of up to MMV_ROWS rows, take the split-context kernels (attn_dec + attn_merge:
each row attends to its own slot up to its own position, its keys cut into pieces that
follow the depth, so the grid captured once serves every depth). Longer prompt batches, whose
spans are known on the host, take two tensor-core GEMMs per span around a masked softmax; so do
the rows of a captured prompt from position 0 (Rows.fresh), over their own keys, which rope_store
writes a second time into a buffer of the pass (the slot is known only on the card there).

Legend: T = rows, H = query heads, Hkv = KV heads, G = H / Hkv, Dh = head size,
C = n_ctx_slot, L = layers, S = slots.
"""
from __future__ import annotations

import math
import os

import cupy
import numpy as np

from bloomery.engine.cuda.gemm import gemm_nn, gemm_nt
from bloomery.engine.cuda.kv_copies import span_copies
from bloomery.engine.cuda.sizes import DECODE_ROWS, SCORE_BYTES, prompt_splits, tc_prompt_fits
from bloomery.engine.cuda.pinned import pinned_chunk
from bloomery.engine.host_arena import MIB, HostArena, huge_mapping, pages
from bloomery.engine.ops import AttnSpan

DEC_MAXG = (4, 8, 16)               # query heads per kv head the attn_dec kernels are built for
DEC_BLOCKS_PER_SM = 3               # attn_dec blocks aimed at per SM, at most what fits (the pieces follow the depth)
MERGE_THREADS = 1024                # attn_merge's block: groups of Dh threads, each over a share of the pieces


def dec_kernel(g: int, dh: int) -> str:
    """The attn_dec instance for g query heads per kv head of size dh."""
    maxg = next((m for m in DEC_MAXG if m >= g), None)
    if dh not in (64, 128, 256) or maxg is None or (dh == 256 and maxg > 8):
        raise ValueError(f"head size {dh} with {g} query heads per KV head: the cuda attention takes head "
                         f"sizes 64 and 128 with up to 16 query heads per KV head, 256 with up to 8")
    return f"attn_dec_{dh}_{maxg}"


def blocks_per_sm() -> int:
    """attn_dec blocks aimed at per SM: DEC_BLOCKS_PER_SM, or BLOOMERY_CUDA_ATTN_BLOCKS (a lever for
    measuring; a step's grid is fixed when it is captured)."""
    raw = os.environ.get("BLOOMERY_CUDA_ATTN_BLOCKS", "")
    if not raw:
        return DEC_BLOCKS_PER_SM
    if not raw.isdigit() or not 1 <= int(raw) <= 64:
        raise ValueError(f"BLOOMERY_CUDA_ATTN_BLOCKS={raw!r}: a whole number of blocks per SM, 1 to 64")
    return int(raw)


def n_pieces(n_ctx_slot: int, n_kv_head: int, rows: int, n_sm: int, fit: int = DEC_BLOCKS_PER_SM) -> int:
    """Pieces the keys of a row are cut into (the grid's x): about blocks_per_sm() blocks per SM, and
    no more than `fit` (the blocks of the kernel that fit an SM at once), over all rows and kv heads,
    never more than the context's 32-position chunks. (On the H200, qwen3moe's 128 x 8 heads: 3 blocks
    a SM, where 3 fit, against 2 gave steps of 8 rows 3-6 % shorter and one row's the same.)"""
    per_sm = max(1, min(blocks_per_sm(), fit))
    return max(1, min(-(-n_ctx_slot // 32), per_sm * n_sm // max(1, n_kv_head * rows)))


_NULL = np.uint64(0)
PIN_MIN = 1 << 20                   # host arrays of at least this many bytes are registered (page-locked in place)


def kv_arena(slot_plane_bytes: int) -> HostArena:
    """The prompt cache's page-locked memory for a KV cache whose one slot holds slot_plane_bytes of K (as many of
    V): chunks that hold a whole slot's plane (64 MiB to 512 MiB), two kept free ahead (a whole slot's K and V)."""
    chunk = min(max(pages(slot_plane_bytes), 64 * MIB), 512 * MIB)
    return HostArena(pinned_chunk, chunk_bytes=chunk, reserve_chunks=2, min_bytes=PIN_MIN, prepare=huge_mapping)


def _copy_2d(dev, host: np.ndarray, copies, to_host: bool, stream) -> None:
    """kv_copies' 2-D copies between the card array `dev` and the C-contiguous host array `host`, on `stream`."""
    rt = cupy.cuda.runtime
    d, h = int(dev.data.ptr), int(host.ctypes.data)
    for c in copies:
        if to_host:
            rt.memcpy2DAsync(h + c.host, c.host_pitch, d + c.dev, c.dev_pitch, c.width, c.height,
                             rt.memcpyDeviceToHost, stream.ptr)
        else:
            rt.memcpy2DAsync(d + c.dev, c.dev_pitch, h + c.host, c.host_pitch, c.width, c.height,
                             rt.memcpyHostToDevice, stream.ptr)


class KVCacheF16:
    """K and V as f16 [L, S, Hkv, C, Dh]: each (slot, kv head) is contiguous over positions."""

    def __init__(self, n_layer: int, n_slots: int, n_ctx_slot: int, n_head_kv: int, head_dim: int):
        shape = (n_layer, n_slots, n_head_kv, n_ctx_slot, head_dim)
        self.k = cupy.zeros(shape, cupy.float16)
        self.v = cupy.zeros(shape, cupy.float16)
        self.n_ctx_slot, self.n_head_kv, self.head_dim = n_ctx_slot, n_head_kv, head_dim
        self.slot_stride = n_head_kv * n_ctx_slot * head_dim          # elements
        self.layer_stride = n_slots * self.slot_stride
        # saved states' page-locked host memory, made ahead within the prompt cache's budget (set_limit)
        self.arena = kv_arena(n_layer * self.slot_stride * 2)

    @property
    def n_bytes(self) -> int:
        return int(self.k.nbytes + self.v.nbytes)

    def save_state(self, slot: int, n: int, start: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Host copies of the slot's positions start .. n-1: K and V [L, Hkv, n - start, Dh] f16 (the prompt
        cache), page-locked (self.arena). One 2-D copy a layer straight from the cache (kv_copies.py), no gather
        on the card first."""
        self._check_span(slot, n)
        if not 0 <= start < n:
            raise ValueError(f"start {start}: a save of {n} positions starts at 0 .. {n - 1}")
        stream = cupy.cuda.get_current_stream()
        out = []
        for a in (self.k, self.v):
            host = self.arena.array((a.shape[0], self.n_head_kv, n - start, self.head_dim), np.float16)
            _copy_2d(a, host, span_copies(a.shape, a.itemsize, slot, start, n - start, 0, n - start), True, stream)
            out.append(host)
        stream.synchronize()
        self.arena.tend_later()          # its reserve made again now the copies are done (host_arena.py)
        return out[0], out[1]

    def restore_state(self, slot: int, state: tuple[np.ndarray, np.ndarray], n: int, keep: int = 0,
                      offset: int = 0) -> None:
        """Positions keep .. n-1 of the slot from a save_state copy whose first position is `offset` (the slot
        holds the same ids' K and V at 0 .. keep-1 already: only the rest crosses the bus)."""
        self._check_span(slot, n)
        if not 0 <= offset <= keep < n:
            raise ValueError(f"keep {keep}, offset {offset}: a restore of {n} positions keeps 0 .. {n - 1} of "
                             "what the slot holds and copies from a state starting at or before that")
        k, v = state
        if (k.shape[2] < n - offset or k.shape[:2] != (self.k.shape[0], self.n_head_kv)
                or k.shape[3] != self.head_dim or v.shape != k.shape):
            raise ValueError(f"a saved state of shape {k.shape} from position {offset} cannot fill {n} positions "
                             f"of a cache shaped {self.k.shape}")
        stream = cupy.cuda.get_current_stream()
        hosts = [np.ascontiguousarray(k, dtype=np.float16), np.ascontiguousarray(v, dtype=np.float16)]
        for a, host in zip((self.k, self.v), hosts):
            _copy_2d(a, host, span_copies(a.shape, a.itemsize, slot, keep, host.shape[2], keep - offset, n - keep),
                     False, stream)
        # the captured decode steps run on their own non-blocking stream: done here, before any of them (and
        # `hosts` holds the host arrays until the copies that read them are done)
        stream.synchronize()

    def _check_span(self, slot: int, n: int) -> None:
        if not 0 <= slot < self.k.shape[1]:
            raise ValueError(f"slot {slot} is out of range: the cache has {self.k.shape[1]} slots")
        if not 0 < n <= self.n_ctx_slot:
            raise ValueError(f"{n} positions do not fit the slot: n_ctx_slot = {self.n_ctx_slot}")


ROPE_MAX_DH = 512                   # ROPE_MAX_DH in attention.cu (rope_store's shared row)


def imrope_args(sections) -> tuple[np.int32, np.int32, np.int32, np.int32]:
    """rope_store's (sec_total, sec0, sec1, sec2): zeros for plain NEOX RoPE; IMRoPE's four section
    counts as their sum and the first three (the fourth turns nothing at a text position)."""
    if sections is None:
        return np.int32(0), np.int32(0), np.int32(0), np.int32(0)
    s = [int(v) for v in sections]
    if len(s) != 4 or min(s) < 0 or sum(s) < 1:
        raise ValueError(f"IMRoPE takes 4 section counts >= 0 (not all 0), got {tuple(sections)}")
    return np.int32(sum(s)), np.int32(s[0]), np.int32(s[1]), np.int32(s[2])


def self_attention(ops, cache: KVCacheF16, layer: int, rows, q, k, v, scale: float, n_rot: int,
                   freq_base: float, q_norm, k_norm, eps: float, imrope_sections=None):
    t, n_head, dh = q.shape
    n_kv_head = k.shape[1]
    if n_rot % 2 or not 0 < n_rot <= dh or dh > ROPE_MAX_DH:
        raise ValueError(f"rope dimension {n_rot} with head size {dh}: the cuda backend rotates an even count of "
                         f"at most the head size, in heads of at most {ROPE_MAX_DH}")
    if n_head % n_kv_head:
        raise ValueError(f"{n_head} query heads are not a multiple of {n_kv_head} KV heads")
    dec_kernel(n_head // n_kv_head, dh)
    q_rot = cupy.empty((t, n_head, dh), cupy.float32)                     # [T, H, Dh]
    tc = rows.spans is None and t > DECODE_ROWS and t % 16 == 0 and tc_prompt_fits(n_head, n_kv_head, dh)
    own = not tc and rows.fresh and t > DECODE_ROWS                       # keys: the pass's own rows
    gemm = own or tc or (rows.spans is not None and t > DECODE_ROWS)      # q16: the GEMMs' (attn_prompt's) queries
    f16 = cupy.float16
    kr, vr = (cupy.empty((n_kv_head, t, dh), f16), cupy.empty((n_kv_head, t, dh), f16)) if own else (_NULL, _NULL)
    q16 = cupy.empty((n_kv_head, t, n_head // n_kv_head, dh), f16) if gemm else _NULL     # [Hkv, T, G, Dh]
    layer_off = np.int64(layer * cache.layer_stride)
    ops.k.rope_store((t, n_head + n_kv_head), (dh // 2,), (
        cupy.ascontiguousarray(q), cupy.ascontiguousarray(k), cupy.ascontiguousarray(v),
        q_norm.vec if q_norm is not None else _NULL, k_norm.vec if k_norm is not None else _NULL,
        np.float32(eps), rows.slots, rows.positions, np.int32(n_head), np.int32(n_kv_head), np.int32(dh),
        np.int32(n_rot), np.float32(math.log2(freq_base)), *imrope_args(imrope_sections), layer_off,
        np.int64(cache.slot_stride),
        np.int32(cache.n_ctx_slot), cache.k, cache.v, q_rot, kr, vr, q16, np.float32(scale)))
    if tc:                                                                # a captured pass at any depth
        out = cupy.empty((t, n_head * dh), cupy.float32)                  # [T, H*Dh]
        n_split = prompt_splits(t // 16 * n_kv_head, ops.n_sm)
        parts = ((cupy.empty((t, n_head, n_split), cupy.float32), cupy.empty((t, n_head, n_split), cupy.float32),
                  cupy.empty((t, n_head, n_split, dh), cupy.float32)) if n_split > 1 else (_NULL, _NULL, _NULL))
        ops.k.attn_prompt((t // 16, n_kv_head, n_split), (32 * (n_head // n_kv_head),), (
            q16, cache.k, cache.v, rows.slots, rows.positions, np.int32(t), np.int32(n_head // n_kv_head),
            layer_off, np.int64(cache.slot_stride), np.int32(cache.n_ctx_slot), out, *parts))
        if n_split > 1:
            ops.k.attn_prompt_merge((t, n_head), (dh,), (*parts, np.int32(n_split), out))
        return out
    if own:                                                               # (no slot: the keys are kr, vr)
        return _gemm_path(ops, [(AttnSpan(-1, 0, 0, t), kr, vr, t)], q16, n_head)
    if not gemm:
        return _split_path(ops, cache, layer_off, rows, q_rot, n_kv_head, scale)
    kf, vf = cache.k.view(cupy.float16), cache.v.view(cupy.float16)
    return _gemm_path(ops, [(sp, kf[layer, sp.slot], vf[layer, sp.slot], cache.n_ctx_slot) for sp in rows.spans],
                      q16, n_head)


def _split_path(ops, cache, layer_off, rows, q_rot, n_kv_head: int, scale: float):
    t, n_head, dh = q_rot.shape
    fn = getattr(ops.k, dec_kernel(n_head // n_kv_head, dh))
    n_split = n_pieces(cache.n_ctx_slot, n_kv_head, t, ops.n_sm, ops.blocks_that_fit(fn, 128, 0))
    part_m = cupy.empty((t, n_head, n_split), cupy.float32)
    part_l = cupy.empty((t, n_head, n_split), cupy.float32)
    part_o = cupy.empty((t, n_head, n_split, dh), cupy.float32)
    fn((n_split, n_kv_head, t), (128,), (
        q_rot, cache.k, cache.v, rows.slots, rows.positions, np.int32(n_head), np.int32(n_kv_head), layer_off,
        np.int64(cache.slot_stride), np.int32(cache.n_ctx_slot), np.float32(scale), part_m, part_l, part_o))
    out = cupy.empty((t, n_head * dh), cupy.float32)                      # [T, H*Dh]
    oq = cupy.empty((t, n_head * dh), cupy.int8)
    od = cupy.empty((t, n_head * dh // 32), cupy.float32)
    os_ = cupy.empty((t, n_head * dh // 32), cupy.float32)
    ops.k.attn_merge((t, n_head), (MERGE_THREADS // dh * dh,), (part_m, part_l, part_o, rows.positions, np.int32(n_split), np.int32(n_head), np.int32(dh), out, oq, od, os_),
                     shared_mem=4 * n_split)
    ops.remember_q8(out, oq, od, os_)
    return out


def _pow2_within(n: int, cap: int) -> int:
    """n rounded up to a power of two where that stays within cap, else n itself."""
    up = 1 << max(0, n - 1).bit_length()
    return up if up <= cap else n


def _gemm_path(ops, span_keys, q16, n_head: int):
    """span_keys: (span, K, V, C) a span, its keys and values [Hkv, C, Dh] f16 from position 0 (the slot's layer
    in the cache, or the pass's own rows); q16 the rows' rotated queries, scaled, as f16 [Hkv, T, G, Dh]
    (rope_store). Every step a prebuilt kernel or cuBLAS: nothing for NVRTC (CuPy's own elementwise kernels
    compile on a machine's first start)."""
    n_kv_head, t, g, dh = q16.shape
    out = cupy.empty((t, n_head * dh), cupy.float32)                      # [T, H*Dh]
    spans = [sk[0] for sk in span_keys]

    def chunk_rows(sp) -> int:
        return max(1, min(sp.row1 - sp.row0, SCORE_BYTES // (4 * n_head * (sp.row1 - sp.row0 + sp.pos0))))

    # One score, probability and output buffer a call, each as large as the largest chunk (rounded up to a
    # power of two, within SCORE_BYTES), every chunk a view of it: chunks whose key counts grow (and the passes
    # of a long prompt) would otherwise ask the pool for ever larger blocks while the last ones are still held,
    # past the SCORE_BYTES the plan counts. The rounding gives a long prompt's passes one size (a chunk's scores
    # come to just under SCORE_BYTES at every depth), so the pool's block of the first serves the next.
    n_s = _pow2_within(max(n_head * chunk_rows(sp) * (sp.row1 - sp.row0 + sp.pos0) for sp in spans), SCORE_BYTES // 4)
    s_buf, p_buf = cupy.empty(n_s, cupy.float32), cupy.empty(n_s, cupy.float16)
    o_buf = cupy.empty(_pow2_within(max(chunk_rows(sp) for sp in spans) * n_head * dh, SCORE_BYTES // 4), cupy.float32)
    for sp, k0, v0, c in span_keys:                                       # k0, v0 [Hkv, C, Dh]
        n_rows = sp.row1 - sp.row0
        chunk = chunk_rows(sp)
        for c0 in range(0, n_rows, chunk):
            cn = min(chunk, n_rows - c0)
            r0 = sp.row0 + c0
            m = cn * g                                                    # rows per kv head
            nk = sp.pos0 + c0 + cn                                        # keys this chunk's rows can see
            s = s_buf[:n_kv_head * m * nk].reshape(n_kv_head, m, nk)      # [Hkv, m, nk]
            gemm_nt(q16[:, r0:r0 + cn], k0, s, batch=n_kv_head, stride_x=t * g * dh, stride_w=c * dh,
                    stride_out=m * nk, m=m, n=nk, k=dh, ldw=dh)          # the chunk's rows of each kv head
            p = p_buf[:n_kv_head * m * nk].reshape(n_kv_head, m, nk)
            ops.k.softmax_causal((n_kv_head * m,), (256,), (s, np.int32(nk), np.int32(sp.pos0 + c0),
                                                            np.int32(g), np.int32(m), p))
            o = o_buf[:n_kv_head * m * dh].reshape(n_kv_head, m, dh)      # [Hkv, m, Dh]
            gemm_nn(p, v0, o, batch=n_kv_head, stride_p=m * nk, stride_v=c * dh, stride_out=m * dh,
                    m=m, n=dh, k=nk, ldv=dh)
            ops.k.attn_unpack((cn, n_head), (dh,), (o, np.int32(cn), np.int32(g), out[r0:], np.int64(n_head * dh)))
    return out
