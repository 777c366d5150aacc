"""The per-slot F16 KV cache and flash attention over it, as ggml-cpu computes it.

llama.cpp's CPU build runs with flash attention on (`-fa auto` resolves to
enabled when the KV cache sits on the CPU) and an F16 cache. Its
ggml_compute_forward_flash_attn_ext_f16 takes one of two paths by how many
query rows the ubatch holds:

  * fewer than GGML_FA_TILE_Q (64) rows -- every decode step, short prompts:
    Q is rounded to F16, scores are F16 x F16 dots summed in F32, and the
    online softmax keeps its V accumulator in F16 (rounded after every
    rescale and every add), with the C library's expf. `_attend_f16` mirrors
    that step by step.
  * 64 rows or more -- prompts: the tiled path, all in F32 (K, V widened from
    F16), an online softmax over tiles of GGML_FA_TILE_KV (64) positions with
    simd_gemm's FMA chains, ggml_v_expf for the weights and expf for the
    rescale. `_attend_f32` mirrors that tile by tile.

Both are bit for bit with llama.cpp's (tests/test_real_model_logits.py). Not
mirrored: the split-KV decode path llama.cpp takes once its padded KV view
reaches 512 cells (a context past 256 positions): it splits the positions
across its threads and merges the partial softmaxes, in an order that
depends on its thread count; there our last bits may differ.

Legend: T = query rows, L = visible KV positions, H = query heads,
Hkv = KV heads, G = H/Hkv, Dh = head size.
"""
from __future__ import annotations

import numpy as np

from bloomery.engine.cpu.ops_math import expf_libm, vec_soft_max

FA_TILE_Q = 64   # ggml-cpu common.h GGML_FA_TILE_Q: the tiled F32 path from this many rows
FA_TILE_KV = 64  # GGML_FA_TILE_KV: the tiled path's online softmax steps a tile of positions at a time


class KVCacheError(ValueError):
    """A write or read outside a slot's region."""


class KVCache:
    """K and V for every layer and slot: [layer, slot, position, Hkv, Dh] float16."""

    def __init__(self, n_layer: int, n_slots: int, n_ctx_slot: int, n_head_kv: int, head_dim: int):
        shape = (n_layer, n_slots, n_ctx_slot, n_head_kv, head_dim)
        # written now, not left to the kernel's zero pages: the bytes the plan counts are held from
        # the load on (llama.cpp clears its KV buffer too), not found missing at the first long prompt
        self.k = np.empty(shape, np.float16)
        self.v = np.empty(shape, np.float16)
        self.k.fill(0)
        self.v.fill(0)
        self.n_slots = n_slots
        self.n_ctx_slot = n_ctx_slot

    def write(self, layer: int, slot: int, pos0: int, k: np.ndarray, v: np.ndarray) -> None:
        n = k.shape[0]
        if not 0 <= slot < self.n_slots:
            raise KVCacheError(f"slot {slot} is out of range: the cache has {self.n_slots} slots")
        if pos0 < 0 or pos0 + n > self.n_ctx_slot:
            raise KVCacheError(f"positions {pos0}..{pos0 + n - 1} do not fit the slot: n_ctx_slot = {self.n_ctx_slot}")
        self.k[layer, slot, pos0:pos0 + n] = k                          # [T, Hkv, Dh] rounded to f16 (RNE)
        self.v[layer, slot, pos0:pos0 + n] = v

    def save_state(self, slot: int, n: int, start: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Host copies of the slot's positions start .. n-1: K and V [layer, n - start, Hkv, Dh] f16 (the prompt
        cache)."""
        self._check_span(slot, n)
        if not 0 <= start < n:
            raise KVCacheError(f"start {start}: a save of {n} positions starts at 0 .. {n - 1}")
        return self.k[:, slot, start:n].copy(), self.v[:, slot, start:n].copy()

    def restore_state(self, slot: int, state: tuple[np.ndarray, np.ndarray], n: int, keep: int = 0,
                      offset: int = 0) -> None:
        """Positions keep .. n-1 of the slot from a save_state copy whose first position is `offset` (the slot
        holds the same ids' K and V at 0 .. keep-1 already)."""
        self._check_span(slot, n)
        if not 0 <= offset <= keep < n:
            raise KVCacheError(f"keep {keep}, offset {offset}: a restore of {n} positions keeps 0 .. {n - 1} of "
                               "what the slot holds and copies from a state starting at or before that")
        k, v = state
        if k.shape[1] < n - offset or k.shape[0] != self.k.shape[0] or k.shape[2:] != self.k.shape[3:]:
            raise KVCacheError(f"a saved state of shape {k.shape} from position {offset} cannot fill {n} positions "
                               f"of a cache shaped {self.k.shape}")
        self.k[:, slot, keep:n] = k[:, keep - offset:n - offset]
        self.v[:, slot, keep:n] = v[:, keep - offset:n - offset]

    def _check_span(self, slot: int, n: int) -> None:
        if not 0 <= slot < self.n_slots:
            raise KVCacheError(f"slot {slot} is out of range: the cache has {self.n_slots} slots")
        if not 0 < n <= self.n_ctx_slot:
            raise KVCacheError(f"{n} positions do not fit the slot: n_ctx_slot = {self.n_ctx_slot}")

    def attend(self, layer: int, slot: int, pos0: int, q: np.ndarray, scale: float) -> np.ndarray:
        """q [T, H, Dh] at positions pos0.. -> [T, H, Dh]; row t sees positions 0 .. pos0+t."""
        t = q.shape[0]
        n_kv = pos0 + t
        k = self.k[layer, slot, :n_kv]                                  # [L, Hkv, Dh] f16
        v = self.v[layer, slot, :n_kv]                                  # [L, Hkv, Dh] f16
        if _c_attention(q.shape[-1]):
            return _attend_c(q, k, v, pos0, np.float32(scale), tiled=t >= FA_TILE_Q)
        if t >= FA_TILE_Q:
            return _attend_f32(q, k, v, pos0, np.float32(scale))
        return _attend_f16(q, k, v, pos0, np.float32(scale))


def _c_attention(head_dim: int) -> bool:
    """kernels/cpu_lanes.c's attn_f16 / attn_f32 take this (their head-size bound is 1024)."""
    from bloomery.engine.cpu import kernels as cpu_kernels
    return head_dim <= 1024 and cpu_kernels.lib() is not None


def _attend_c(q, k, v, pos0: int, scale, tiled: bool) -> np.ndarray:
    """Both paths through the compiled kernels, the query rows (t, head) spread over the threads."""
    from bloomery.engine.cpu import kernels as cpu_kernels
    from bloomery.engine.quant import threads
    lib = cpu_kernels.lib()
    t, h, dh = q.shape
    n_kv, hkv, _ = k.shape
    q = np.ascontiguousarray(q, dtype=np.float32)
    k, v = np.ascontiguousarray(k), np.ascontiguousarray(v)
    out = np.empty((t, h, dh), np.float32)
    n_rows = t * h
    nth = threads.N_THREADS if n_rows > 1 else 1
    if tiled:
        kq = np.empty((nth, n_kv), np.float32)                          # each thread's row of scores
        kt = np.empty(hkv * (n_kv // 8) * dh * 8, np.float32)           # K widened, 8 positions side by side
        lib.attn_f32(q.ctypes.data, k.ctypes.data, v.ctypes.data, h, hkv, dh, pos0, n_kv, float(scale),
                     out.ctypes.data, n_rows, kq.ctypes.data, kt.ctypes.data, nth)
    else:
        lib.attn_f16(q.ctypes.data, k.ctypes.data, v.ctypes.data, h, hkv, dh, pos0, float(scale),
                     out.ctypes.data, n_rows, nth)
    return out


def _group(q: np.ndarray, n_head_kv: int) -> np.ndarray:
    """q [T, H, Dh] -> [Hkv, G, T, Dh]: query head h reads KV head h // G (ggml's iq2 / rk2)."""
    t, h, dh = q.shape
    return q.reshape(t, n_head_kv, h // n_head_kv, dh).transpose(1, 2, 0, 3)


def _ungroup(o: np.ndarray) -> np.ndarray:
    """[Hkv, G, T, Dh] -> [T, H, Dh]."""
    hkv, g, t, dh = o.shape
    return o.transpose(2, 0, 1, 3).reshape(t, hkv * g, dh)


def _causal(t: int, pos0: int, n_kv: int) -> np.ndarray:
    """[T, L] True where row t may see position l."""
    return np.arange(n_kv)[None, :] <= (pos0 + np.arange(t))[:, None]


def _fma(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """f32 a*b + c with one rounding (the compiler contracts ggml's S*ms + vs to an FMA)."""
    return (a.astype(np.float64) * b + c).astype(np.float32)


def _attend_f32(q, k, v, pos0: int, scale) -> np.ndarray:
    """ggml_compute_forward_flash_attn_ext_tiled, per query row (a row's result does not depend
    on which rows share its tile): K and V widened from F16, Q in F32; for each tile of
    FA_TILE_KV positions the row sees: scores by simd_gemm (one FMA chain over Dh from 0), times
    the scale; the running max, and on a new max a rescale of the accumulator and the sum by the
    C library's expf(M_old - M_new); the tile's weights and their sum by ggml_vec_soft_max_f32
    (ggml_v_expf); the accumulator += weights @ V by simd_gemm (one FMA chain over the tile's
    positions, from the accumulator); at the end a scale by 1/S."""
    t = q.shape[0]
    n_kv, hkv, dh = k.shape
    qg = _group(q.astype(np.float32), hkv)                              # [Hkv, G, T, Dh]
    kt = k.astype(np.float32).transpose(1, 2, 0)[:, None]               # [Hkv, 1, Dh, L]
    vf = v.astype(np.float32).transpose(1, 0, 2)[:, None]               # [Hkv, 1, L, Dh]
    q64 = qg.astype(np.float64)
    kq = np.zeros(qg.shape[:-1] + (n_kv,), np.float32)                  # [Hkv, G, T, L]
    for d in range(dh):                                                 # simd_gemm: C += A[:, d] * B[d, :]
        kq = (q64[..., d:d + 1] * kt[:, :, d][:, :, None, :] + kq).astype(np.float32)
    kq = kq * scale
    kq[..., ~_causal(t, pos0, n_kv)] = -np.inf                          # the mask's -inf (its 0s change nothing)
    m_run = np.full(kq.shape[:-1], -np.inf, np.float32)                 # M [Hkv, G, T]
    s_run = np.zeros(kq.shape[:-1], np.float32)                         # S
    acc = np.zeros(qg.shape, np.float32)                                # VKQ32 [Hkv, G, T, Dh]
    for c in range(0, n_kv, FA_TILE_KV):
        tile = kq[..., c:c + FA_TILE_KV]                                # [Hkv, G, T, <=64]
        if tile.shape[-1] < FA_TILE_KV:                                 # the last tile is padded with -inf
            pad = np.full(tile.shape[:-1] + (FA_TILE_KV - tile.shape[-1],), -np.inf, np.float32)
            tile = np.concatenate([tile, pad], axis=-1)
        tile_max = tile.max(axis=-1)
        live = tile_max != -np.inf                                      # rows with a visible position here
        if not live.any():
            continue
        m_new = np.maximum(m_run, tile_max)
        grow = live & (m_new > m_run)
        if grow.any():
            with np.errstate(invalid="ignore"):
                ms = np.where(grow, expf_libm(m_run - m_new), np.float32(1))
            acc = np.where(grow[..., None], acc * ms[..., None], acc)
            s_run = np.where(grow, s_run * ms, s_run)
        m_run = np.where(live, m_new, m_run)
        w, tile_sum = vec_soft_max(np.where(live[..., None], tile, -np.inf),
                                   np.where(live, m_new, np.float32(0)))   # padded tail: exp(-inf) = 0
        s_run = np.where(live, (s_run.astype(np.float64) + tile_sum).astype(np.float32), s_run)
        w64 = np.where(live[..., None], w, np.float32(0)).astype(np.float64)
        for j in range(min(FA_TILE_KV, n_kv - c)):                       # simd_gemm: VKQ += KQ[:, j] * V[j, :]
            acc = (w64[..., j:j + 1] * vf[:, :, c + j][:, :, None, :] + acc).astype(np.float32)
    inv = np.where(s_run == 0, np.float32(0), np.float32(1) / np.where(s_run == 0, np.float32(1), s_run))
    return _ungroup((acc * inv[..., None]).astype(np.float32))


def _scores_f16(q16: np.ndarray, kf: np.ndarray) -> np.ndarray:
    """q16 [Hkv, G, T, Dh] (F16 values), kf [Hkv, L, Dh] -> [Hkv, G, T, L], as ggml_vec_dot_f16
    sums on AVX-512: exact F16 products in 4 accumulators of 16 lanes (64 per step),
    the accumulators then the lanes added pairwise, a leftover tail in double."""
    dh = q16.shape[-1]
    n_main = dh - dh % 64
    out = np.empty(q16.shape[:-1] + (kf.shape[1],), np.float32)
    step = max(1, (1 << 22) // max(1, q16[..., 0].size * dh))        # bound the [.., L, Dh] temporary
    for l0 in range(0, kf.shape[1], step):
        p = q16[..., None, :] * kf[:, None, None, l0:l0 + step]        # [Hkv, G, T, l, Dh] exact
        if n_main == 0:
            out[..., l0:l0 + step] = p.sum(axis=-1, dtype=np.float64)
            continue
        acc = p[..., :64].reshape(p.shape[:-1] + (4, 16))
        for c in range(64, n_main, 64):
            acc = acc + p[..., c:c + 64].reshape(acc.shape)             # the FMA adds, per lane
        lanes = (acc[..., 0, :] + acc[..., 2, :]) + (acc[..., 1, :] + acc[..., 3, :])   # [.., 16]
        for half in (8, 4, 2, 1):                                       # _mm512_reduce_add_ps
            lanes = lanes[..., :half] + lanes[..., half:2 * half]
        s = lanes[..., 0].astype(np.float64)
        for i in range(n_main, dh):
            s = s + p[..., i]
        out[..., l0:l0 + step] = s
    return out


def _attend_f16(q, k, v, pos0: int, scale) -> np.ndarray:
    """The one-chunk path: F16 Q, online softmax with an F16 V accumulator, position by
    position. M only grows, so its value before each position (and with it each step's
    rescale ms = expf(M_old - s) on a new max, else weight vs = expf(s - M)) comes first for
    all positions at once, with the C library's expf; the loop then carries VKQ16 and S."""
    t = q.shape[0]
    n_kv, hkv, dh = k.shape
    q16 = _group(q.astype(np.float16).astype(np.float32), hkv)         # [Hkv, G, T, Dh]
    kf = k.astype(np.float32).transpose(1, 0, 2)                        # [Hkv, L, Dh]
    vf = v.astype(np.float32).transpose(1, 0, 2)                        # [Hkv, L, Dh]
    s_all = _scores_f16(q16, kf) * scale                                # [Hkv, G, T, L] f32
    visible = _causal(t, pos0, n_kv)                                    # [T, L]
    s_vis = np.where(visible, s_all, -np.inf).astype(np.float32)       # masked positions are skipped
    m_incl = np.maximum.accumulate(s_vis, axis=-1)
    m_prev = np.concatenate([np.full(s_vis.shape[:-1] + (1,), -np.inf, np.float32), m_incl[..., :-1]], axis=-1)
    new_max = (s_vis > m_prev) & visible
    with np.errstate(invalid="ignore"):
        ms_all = np.where(new_max, expf_libm(m_prev - s_vis), np.float32(1))   # expf(-inf) = 0 first
        vs_all = np.where(new_max | ~visible, np.float32(1), expf_libm(s_vis - m_prev))
    g = q16.shape[1]
    acc = np.zeros((hkv, g, t, dh), np.float16)                         # VKQ16
    s_run = np.zeros((hkv, g, t), np.float32)                           # S
    n_always = pos0 + 1                                                 # positions every row sees
    grows = new_max.any(axis=(0, 1, 2)).tolist()                        # [L]
    ms_l = np.ascontiguousarray(np.moveaxis(ms_all, -1, 0))             # [L, Hkv, G, T]
    vs_l = np.ascontiguousarray(np.moveaxis(vs_all, -1, 0))
    nm_l = np.moveaxis(new_max, -1, 0)[..., None]                       # [L, Hkv, G, T, 1]
    step = max(1, (1 << 21) // max(1, acc.size))                        # positions per v*vs block
    for c0 in range(0, n_kv, step):
        c1 = min(n_kv, c0 + step)
        # v * vs for these positions: the FMA's exact product (float64 holds it)
        vv = vf[:, c0:c1].transpose(1, 0, 2)[:, :, None, None, :].astype(np.float64) * vs_l[c0:c1, ..., None]
        for ic in range(c0, c1):
            if grows[ic]:                                               # ggml_vec_scale_f16 where s is a new max
                acc = np.where(nm_l[ic], (acc.astype(np.float32) * ms_l[ic][..., None]).astype(np.float16), acc)
            a64 = acc.astype(np.float64)                                # ggml_vec_mad_f16: one FMA in f32, then f16
            a64 += vv[ic - c0]
            added = a64.astype(np.float32).astype(np.float16)
            # S = S*ms + vs (contracted to an FMA); ms is 1 unless s is a new max
            s_new = _fma(s_run, ms_l[ic], vs_l[ic]) if grows[ic] else s_run + vs_l[ic]
            if ic < n_always:
                acc, s_run = added, s_new
            else:                                                       # masked rows keep their state
                see = visible[:, ic][None, None, :]                     # [1, 1, T]
                acc = np.where(see[..., None], added, acc)
                s_run = np.where(see, s_new, s_run)
    inv = np.where(s_run == 0, np.float32(0), np.float32(1) / np.where(s_run == 0, np.float32(1), s_run))
    o = acc.astype(np.float32) * inv[..., None]                         # [Hkv, G, T, Dh]
    return _ungroup(o)
