"""Block formats as llama.cpp's CPU backend computes with them.

Two halves:
  * weights: `decode_planes` splits a quantized [N, K] matrix into an integer
    plane (the stored quants, as small integers) and its block scales, so a
    dot product can be done as llama.cpp's `ggml_vec_dot_*` does it: exact
    integer sums per (sub-)block, then a float combine with the scales.
  * activations: `quantize_q8_0` / `quantize_q8_K` round a float row the way
    ggml-cpu's x86 `quantize_row_q8_0` / `quantize_row_q8_K` do (the vec_dot
    partner type of each weight type, see type_traits_cpu in ggml-cpu.c).

`dequantize` (gguf's reference numpy code) stays beside it as the exact float
reference the tests compare against.

Legend: N = weight rows (outputs), K = row length (inputs), T = activation rows,
B = blocks per row, S = sub-blocks per row, Q = elements per (sub-)block.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT
from gguf import quants as gguf_quants

QK8_0 = 32
QK_K = 256

# weight type -> the activation type its CPU vec_dot takes (ggml-cpu.c type_traits_cpu)
VEC_DOT_TYPE = {
    QT.F32: QT.F32, QT.F16: QT.F16,
    QT.Q4_0: QT.Q8_0, QT.Q5_0: QT.Q8_0, QT.Q8_0: QT.Q8_0,
    QT.Q4_K: QT.Q8_K, QT.Q5_K: QT.Q8_K, QT.Q6_K: QT.Q8_K,
}
EXACT_TYPES = frozenset(VEC_DOT_TYPE)


class QuantError(ValueError):
    """A tensor's bytes do not fit its declared type and shape."""


def _check(ggml_type: int, raw: np.ndarray, n_rows: int, n_cols: int) -> tuple[int, int]:
    block_elems, block_bytes = GGML_QUANT_SIZES[QT(ggml_type)]
    if n_cols % block_elems:
        raise QuantError(f"{QT(ggml_type).name}: row length {n_cols} is not a multiple of the block size {block_elems}")
    want = n_rows * (n_cols // block_elems) * block_bytes
    if raw.size != want:
        raise QuantError(f"{QT(ggml_type).name} [{n_rows}, {n_cols}]: expected {want} bytes, got {raw.size}")
    return block_elems, block_bytes


def dequantize(ggml_type: int, raw: np.ndarray, n_rows: int, n_cols: int) -> np.ndarray:
    """Reference float32 [N, K] of a stored matrix (gguf's numpy dequantizers)."""
    _check(ggml_type, raw, n_rows, n_cols)
    qt = QT(ggml_type)
    if qt == QT.F32:
        return np.frombuffer(raw, dtype=np.float32).reshape(n_rows, n_cols)
    if qt == QT.F16:
        return np.frombuffer(raw, dtype=np.float16).reshape(n_rows, n_cols).astype(np.float32)
    return gguf_quants.dequantize(raw.reshape(n_rows, -1), qt).astype(np.float32, copy=False)


@dataclass
class Planes:
    """A weight split for exact integer dot products.

    q:      [B, N, Q] float32 small integers (exact in float32), block-major so
            one batched matmul over B gives every block's integer sum
    d:      [N, Bs] float32 super-block (or block) scale
    sc:     [N, S] int sub-block scales (K-quants), None for Q8_0-family
    dmin:   [N, Bs] float32 (Q4_K / Q5_K) min scale, None otherwise
    m:      [N, S] int sub-block mins (Q4_K / Q5_K), None otherwise
    """
    ggml_type: int
    q: np.ndarray
    d: np.ndarray
    sc: np.ndarray | None = None
    dmin: np.ndarray | None = None
    m: np.ndarray | None = None


def _f16(raw: np.ndarray, col: int) -> np.ndarray:
    """Column `col` .. col+2 of a [rows, bytes] uint8 array as float32."""
    return raw[:, col:col + 2].copy().view(np.float16)[:, 0].astype(np.float32)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: 12 packed bytes -> 8 six-bit scales and 8 six-bit mins (get_scale_min_k4)."""
    s = scales.astype(np.int32)                                        # [R, 12]
    sc = np.empty(s.shape[:-1] + (8,), np.int32)
    mn = np.empty_like(sc)
    sc[:, :4] = s[:, 0:4] & 63
    mn[:, :4] = s[:, 4:8] & 63
    sc[:, 4:] = (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return sc, mn


def _int_plane(ggml_type: int, blocks: np.ndarray) -> tuple[np.ndarray, dict]:
    """blocks [R, block_bytes] uint8 -> (ints [R, block_elems] int8, scale fields)."""
    qt = QT(ggml_type)
    if qt == QT.Q8_0:
        return blocks[:, 2:].view(np.int8), {"d": _f16(blocks, 0)}
    if qt == QT.Q4_0:
        qs = blocks[:, 2:18]
        q = np.concatenate([qs & 0xF, qs >> 4], axis=1).astype(np.int8) - 8
        return q, {"d": _f16(blocks, 0)}
    if qt == QT.Q5_0:
        qh = blocks[:, 2:6].copy().view("<u4")[:, 0]                   # [R]
        hbits = ((qh[:, None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # [R, 32]
        qs = blocks[:, 6:22]
        lo = np.concatenate([qs & 0xF, qs >> 4], axis=1)               # [R, 32]
        q = (lo | (hbits << 4)).astype(np.int8) - 16
        return q, {"d": _f16(blocks, 0)}
    if qt in (QT.Q4_K, QT.Q5_K):
        sc, mn = _k_scales(blocks[:, 4:16])
        qs = blocks[:, 16:144] if qt == QT.Q4_K else blocks[:, 48:176]
        qs = qs.reshape(-1, 4, 32)                                     # [R, chunk, 32]
        q = np.stack([qs & 0xF, qs >> 4], axis=2).reshape(-1, 256)      # sub-block 2c low, 2c+1 high
        if qt == QT.Q5_K:
            qh = blocks[:, 16:48]                                      # [R, 32]
            hb = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1   # [R, 8, 32]
            q = q | (hb.reshape(-1, 256) << 4)
        return q.astype(np.int8), {"d": _f16(blocks, 0), "dmin": _f16(blocks, 2), "sc": sc, "m": mn}
    if qt == QT.Q6_K:
        ql = blocks[:, 0:128].reshape(-1, 2, 2, 32)                   # [R, half, lo/hi 32, 32]
        qh = blocks[:, 128:192].reshape(-1, 2, 32)                    # [R, half, 32]
        sc = blocks[:, 192:208].view(np.int8).astype(np.int32)         # [R, 16]
        shifts = np.array([0, 2, 4, 6], dtype=np.uint8)
        hi = (qh[:, :, None, :] >> shifts[None, None, :, None]) & 3    # [R, half, 4, 32]
        lo = np.stack([ql[:, :, 0] & 0xF, ql[:, :, 1] & 0xF, ql[:, :, 0] >> 4, ql[:, :, 1] >> 4], axis=2)
        q = (lo | (hi << 4)).astype(np.int8).reshape(-1, 256) - 32
        return q, {"d": _f16(blocks, 208), "sc": sc}
    raise QuantError(f"no exact integer path for {qt.name}")


def decode_planes(ggml_type: int, raw: np.ndarray, n_rows: int, n_cols: int) -> Planes:
    """Split a stored [N, K] quantized matrix into integer planes and scales."""
    block_elems, block_bytes = _check(ggml_type, raw, n_rows, n_cols)
    n_blocks = n_cols // block_elems
    blocks = np.asarray(raw).reshape(n_rows * n_blocks, block_bytes)
    ints, f = _int_plane(ggml_type, blocks)                            # [N*B, E]
    sub = 16 if QT(ggml_type) == QT.Q6_K else 32                       # integer-sum granularity
    n_sub = n_cols // sub
    q = ints.reshape(n_rows, n_sub, sub).transpose(1, 0, 2).astype(np.float32)   # [S, N, Q]
    d = f["d"].reshape(n_rows, n_blocks)
    sc = f["sc"].reshape(n_rows, -1) if "sc" in f else None
    dmin = f["dmin"].reshape(n_rows, n_blocks) if "dmin" in f else None
    m = f["m"].reshape(n_rows, -1) if "m" in f else None
    return Planes(ggml_type, np.ascontiguousarray(q), d, sc, dmin, m)


def planes_to_float(p: Planes) -> np.ndarray:
    """Rebuild float32 [N, K] from planes (checks decode_planes against `dequantize`)."""
    n_sub, n_rows, sub = p.q.shape
    q = p.q.transpose(1, 0, 2)                                          # [N, S, Q]
    qt = QT(p.ggml_type)
    if p.sc is None:
        return (p.d[:, :, None] * q).reshape(n_rows, -1)
    per = p.sc.shape[1] // p.d.shape[1]                                 # sub-blocks per super-block
    dl = np.repeat(p.d, per, axis=1) * p.sc.astype(np.float32)          # [N, S]
    out = dl[:, :, None] * q
    if qt in (QT.Q4_K, QT.Q5_K):
        ml = np.repeat(p.dmin, per, axis=1) * p.m.astype(np.float32)    # [N, S]
        out = out - ml[:, :, None]
    return out.reshape(n_rows, -1)


# --- activations -------------------------------------------------------------

def quantize_q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [T, K] float32 -> (q [T, K] float32 ints, d [T, K/32] float32).

    As ggml-cpu's x86 quantize_row_q8_0: d = amax/127 stored as f16,
    multiplier 127/amax in f32, round half to even (_mm256_round_ps).
    """
    t, k = x.shape
    xb = x.reshape(t, k // QK8_0, QK8_0)                                # [T, B, 32]
    amax = np.abs(xb).max(axis=2)                                       # [T, B]
    with np.errstate(divide="ignore"):
        mult = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    d = (amax / np.float32(127)).astype(np.float16).astype(np.float32)  # [T, B]
    q = np.rint(xb * mult[:, :, None])                                  # [T, B, 32]
    return q.reshape(t, k).astype(np.float32), d


def quantize_q8_K(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x [T, K] float32 -> (q [T, K] float32 ints, d [T, K/256], bsums [T, K/16]).

    As quantize_row_q8_K_ref: the element of largest magnitude (first one on a
    tie) maps to -127, iscale = -127/max, nearest_int rounds half to even,
    values capped at 127; d = 1/iscale kept in f32.
    """
    t, k = x.shape
    xb = x.reshape(t, k // QK_K, QK_K)                                  # [T, B, 256]
    idx = np.abs(xb).argmax(axis=2)                                     # first max, as the ref's strict '>'
    vmax = np.take_along_axis(xb, idx[:, :, None], axis=2)[:, :, 0]     # [T, B] signed
    zero = vmax == 0
    safe = np.where(zero, np.float32(1), vmax).astype(np.float32)
    iscale = (np.float32(-127) / safe).astype(np.float32)               # [T, B]
    q = np.minimum(np.rint(iscale[:, :, None] * xb), 127)               # [T, B, 256]
    q[zero] = 0
    d = np.where(zero, np.float32(0), np.float32(1) / iscale).astype(np.float32)
    q = q.reshape(t, k).astype(np.float32)
    bsums = q.reshape(t, k // 16, 16).sum(axis=2)                       # [T, K/16] exact ints
    return q, d, bsums


# --- dot products ------------------------------------------------------------

MAX_TMP_ELEMS = 1 << 22   # bound on a [S, N, T] block-sum temporary (16 MiB of float32)


def dot_planes(x: np.ndarray, p: Planes) -> np.ndarray:
    """x [T, K] float32 @ weight planes [N, K]^T -> [T, N] float32, as ggml_vec_dot_*.

    The activation is quantized to the weight's vec_dot partner, integer sums
    per (sub-)block come from one batched float32 matmul (exact: every partial
    sum is below 2^24), the sub-block scales combine in float64 (exact
    integers, as llama.cpp's int32 accumulators), and the block scales last in
    float32 as llama.cpp does.
    """
    t = x.shape[0]
    n_sub, n_rows, sub = p.q.shape
    qt = QT(p.ggml_type)
    if VEC_DOT_TYPE[qt] == QT.Q8_0:
        qa, da = quantize_q8_0(x)
        bsums = None
    else:
        qa, da, bsums = quantize_q8_K(x)
    qa_b = np.ascontiguousarray(qa.reshape(t, n_sub, sub).transpose(1, 0, 2))   # [S, T, Q]
    out = np.empty((t, n_rows), np.float32)                                      # [T, N]
    step = max(1, MAX_TMP_ELEMS // max(1, n_sub * t))
    for n0 in range(0, n_rows, step):
        n1 = min(n_rows, n0 + step)
        out[:, n0:n1] = _combine(qt, p, _block_sums(p.q[:, n0:n1], qa_b), da, bsums, n0, n1)
    return out


def _block_sums(wq: np.ndarray, qa_b: np.ndarray) -> np.ndarray:
    """wq [S, n, Q], qa_b [S, T, Q] -> [S, T, n] integer sums per (sub-)block (exact in f32)."""
    n_sub, t, _ = qa_b.shape
    if t == 1:      # one batched GEMV: numpy's stacked matmul is quick for a single column
        return np.matmul(wq, qa_b.transpose(0, 2, 1)).reshape(n_sub, 1, -1)
    isum = np.empty((n_sub, t, wq.shape[1]), np.float32)
    for s in range(n_sub):  # one BLAS GEMM per block: stacked matmul does not reach BLAS here
        np.dot(qa_b[s], wq[s].T, out=isum[s])
    return isum


def _combine(qt, p: Planes, isum, da, bsums, n0: int, n1: int) -> np.ndarray:
    """Block sums [S, T, n] -> [T, n] with the scales of rows n0..n1."""
    if p.sc is None:                                                    # Q8_0 family: one scale per block
        scale = da.T[:, :, None] * p.d[n0:n1].T[:, None, :]            # [B, T, n] f32 d_a*d_w
        return (scale * isum).sum(axis=0)
    n_super = p.d.shape[1]
    per = p.sc.shape[1] // n_super                                      # sub-blocks per super-block
    sc = p.sc[n0:n1].T.astype(np.float64)                               # [S, n]
    sumi = (isum * sc[:, None, :]).reshape(n_super, per, isum.shape[1], n1 - n0).sum(axis=1)   # [Bs, T, n] exact
    d = da.T[:, :, None] * p.d[n0:n1].T[:, None, :]                     # [Bs, T, n] f32
    acc = d * sumi.astype(np.float32)
    if qt in (QT.Q4_K, QT.Q5_K):
        t = da.shape[0]
        bs32 = bsums.reshape(t, n_super, per, 2).sum(axis=3)            # [T, Bs, 8] sums per 32
        m = p.m[n0:n1].reshape(n1 - n0, n_super, per).astype(np.float64)  # [n, Bs, 8]
        summ = np.einsum("nsj,tsj->stn", m, bs32.astype(np.float64))    # [Bs, T, n] exact
        dmin = -(da.T[:, :, None] * p.dmin[n0:n1].T[:, None, :])        # [Bs, T, n] f32
        acc = acc + dmin * summ.astype(np.float32)
    return acc.sum(axis=0)
