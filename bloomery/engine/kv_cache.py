"""The per-slot F16 KV cache and flash attention over it, as ggml-cpu computes it.

llama.cpp's CPU build runs with flash attention on (`-fa auto` resolves to
enabled when the KV cache sits on the CPU) and an F16 cache. Its
ggml_compute_forward_flash_attn_ext_f16 takes one of two paths by how many
query rows the ubatch holds:

  * fewer than GGML_FA_TILE_Q (64) rows -- every decode step, short prompts:
    Q is rounded to F16, scores are F16 x F16 dots summed in F32, and the
    online softmax keeps its V accumulator in F16 (rounded after every
    rescale and every add). `_attend_f16` mirrors that step by step.
  * 64 rows or more -- prompts: the tiled path, all in F32 (K, V widened from
    F16). `_attend_f32` computes the same softmax attention in F32.

Legend: T = query rows, L = visible KV positions, H = query heads,
Hkv = KV heads, G = H/Hkv, Dh = head size.
"""
from __future__ import annotations

import numpy as np

FA_TILE_Q = 64   # ggml-cpu common.h GGML_FA_TILE_Q: the tiled F32 path from this many rows


class KVCacheError(ValueError):
    """A write or read outside a slot's region."""


class KVCache:
    """K and V for every layer and slot: [layer, slot, position, Hkv, Dh] float16."""

    def __init__(self, n_layer: int, n_slots: int, n_ctx_slot: int, n_head_kv: int, head_dim: int):
        shape = (n_layer, n_slots, n_ctx_slot, n_head_kv, head_dim)
        self.k = np.zeros(shape, np.float16)
        self.v = np.zeros(shape, np.float16)
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

    def attend(self, layer: int, slot: int, pos0: int, q: np.ndarray, scale: float) -> np.ndarray:
        """q [T, H, Dh] at positions pos0.. -> [T, H, Dh]; row t sees positions 0 .. pos0+t."""
        t = q.shape[0]
        n_kv = pos0 + t
        k = self.k[layer, slot, :n_kv]                                  # [L, Hkv, Dh] f16
        v = self.v[layer, slot, :n_kv]                                  # [L, Hkv, Dh] f16
        if t >= FA_TILE_Q:
            return _attend_f32(q, k, v, pos0, np.float32(scale))
        return _attend_f16(q, k, v, pos0, np.float32(scale))


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


def _exp(x: np.ndarray) -> np.ndarray:
    """expf, correctly rounded (through float64) as glibc's expf is."""
    return np.exp(x.astype(np.float64)).astype(np.float32)


def _fma(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """f32 a*b + c with one rounding (the compiler contracts ggml's S*ms + vs to an FMA)."""
    return (a.astype(np.float64) * b + c).astype(np.float32)


def _attend_f32(q, k, v, pos0: int, scale) -> np.ndarray:
    """The tiled path: F32 Q, K and V widened from F16, F32 softmax."""
    hkv = k.shape[1]
    qg = _group(q.astype(np.float32), hkv)                              # [Hkv, G, T, Dh]
    kf = k.astype(np.float32).transpose(1, 2, 0)                        # [Hkv, Dh, L]
    vf = v.astype(np.float32).transpose(1, 0, 2)                        # [Hkv, L, Dh]
    s = np.matmul(qg, kf[:, None]) * scale                              # [Hkv, G, T, L]
    s = np.where(_causal(q.shape[0], pos0, k.shape[0]), s, -np.inf).astype(np.float32)
    m = s.max(axis=-1, keepdims=True)                                   # [Hkv, G, T, 1]
    p = _exp(s - m)                                                     # [Hkv, G, T, L]
    denom = p.sum(axis=-1, keepdims=True, dtype=np.float64).astype(np.float32)
    o = np.matmul(p, vf[:, None]) * (np.float32(1) / denom)             # [Hkv, G, T, Dh]
    return _ungroup(o.astype(np.float32))


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
    """The one-chunk path: F16 Q, online softmax with an F16 V accumulator."""
    t = q.shape[0]
    n_kv, hkv, dh = k.shape
    q16 = _group(q.astype(np.float16).astype(np.float32), hkv)         # [Hkv, G, T, Dh]
    kf = k.astype(np.float32).transpose(1, 0, 2)                        # [Hkv, L, Dh]
    vf = v.astype(np.float32).transpose(1, 0, 2)                        # [Hkv, L, Dh]
    s_all = _scores_f16(q16, kf) * scale                                # [Hkv, G, T, L] f32
    g = q16.shape[1]
    acc = np.zeros((hkv, g, t, dh), np.float16)                         # VKQ16
    m_run = np.full((hkv, g, t), -np.inf, np.float32)                   # M
    s_run = np.zeros((hkv, g, t), np.float32)                           # S
    visible = _causal(t, pos0, n_kv)                                    # [T, L]
    n_always = pos0 + 1                                                 # positions every row sees
    for ic in range(n_kv):
        s = s_all[..., ic]                                              # [Hkv, G, T]
        new_max = s > m_run
        with np.errstate(invalid="ignore"):
            ms = np.where(new_max, _exp(m_run - s), np.float32(1))
            vs = np.where(new_max, np.float32(1), _exp(s - m_run))
        scaled = np.where(new_max[..., None], (acc.astype(np.float32) * ms[..., None]).astype(np.float16), acc)
        v_ic = vf[:, ic][:, None, None, :]                              # [Hkv, 1, 1, Dh]
        # ggml_vec_mad_f16: one FMA in f32 (float64 holds the exact product), then f16
        added = (scaled.astype(np.float64) + v_ic * vs[..., None].astype(np.float64)).astype(np.float32).astype(np.float16)
        if ic < n_always:
            acc, m_run = added, np.where(new_max, s, m_run)
            s_run = _fma(s_run, ms, vs)
        else:                                                           # masked rows keep their state
            see = visible[:, ic][None, None, :]                         # [1, 1, T]
            acc = np.where(see[..., None], added, acc)
            m_run = np.where(see & new_max, s, m_run)
            s_run = np.where(see, _fma(s_run, ms, vs), s_run)
    inv = np.where(s_run == 0, np.float32(0), np.float32(1) / s_run)    # [Hkv, G, T]
    o = acc.astype(np.float32) * inv[..., None]                         # [Hkv, G, T, Dh]
    return _ungroup(o)
