"""Block formats: the stored bytes of each llama.cpp block type decoded, for the numpy
kernels (planes: block-major float32 integers and their scales) and for the compiled kernels
(int rows), and `dequantize` (gguf's reference numpy code) as the exact float reference.

Legend: N = weight rows (outputs), K = row length (inputs), B = blocks per row,
S = sub-blocks per row, Q = elements per (sub-)block.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT
from gguf import quants as gguf_quants

from bloomery.engine.quant.threads import row_chunks

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
class _Split:
    """A quantized weight's integers and scales; the layout of q is the subclass's."""
    ggml_type: int
    q: np.ndarray
    d: np.ndarray
    sc: np.ndarray | None = None
    dmin: np.ndarray | None = None
    m: np.ndarray | None = None


@dataclass
class Planes(_Split):
    """A weight split for exact integer dot products.

    q:      [B, N, Q] float32 small integers (exact in float32), block-major so
            one batched matmul over B gives every block's integer sum
    d:      [N, Bs] float32 super-block (or block) scale
    sc:     [N, S] int sub-block scales (K-quants), None for Q8_0-family
    dmin:   [N, Bs] float32 (Q4_K / Q5_K) min scale, None otherwise
    m:      [N, S] int sub-block mins (Q4_K / Q5_K), None otherwise
    """
    cache: dict = field(default_factory=dict, repr=False)   # lazily built kernel-order layouts
    scaled: bool = False    # llama.cpp's order for Q5_0 / Q4_0 / Q4_K: q holds q times its scale, see set_scaled


def set_scaled(p: Planes, scaled: bool) -> None:
    """Switch a plane in place between the integer quants and the quants times their scale:
    d_w * q for the Q8_0 family (exact in float32: 11 significant bits times 5), the sub-block
    scale times q for Q4_K (<= 63 * 15). The llama-order kernels (_dot_q8_0_axpy,
    _dot_q4_K_repacked) read the scaled plane, everything else the integers; q = (s*q) / s is
    exact, and where a scale is 0 the quants contribute 0 either way, so they come back as 0."""
    if p.scaled == scaled:
        return
    if QT(p.ggml_type) == QT.Q4_K:
        f = p.sc.T.astype(np.float32)[:, :, None]                       # [S, N, 1]
    else:
        f = p.d.T[:, :, None]                                           # [B, N, 1]
    if scaled:
        np.multiply(p.q, f, out=p.q)
    else:
        np.divide(p.q, f, out=p.q, where=f != 0)
        p.q[np.broadcast_to(f == 0, p.q.shape)] = 0
    p.scaled = scaled


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
        hb = np.unpackbits(blocks[:, 2:6], axis=1, bitorder="little")  # [R, 32]: bit j of the LE u32 qh
        qs = blocks[:, 6:22]
        q = np.empty((blocks.shape[0], 32), np.uint8)
        np.bitwise_and(qs, 0xF, out=q[:, :16])
        np.right_shift(qs, 4, out=q[:, 16:])
        np.left_shift(hb, 4, out=hb)
        q |= hb
        q -= 16                                                        # 0..31 - 16, wrapping: int8 below
        return q.view(np.int8), {"d": _f16(blocks, 0)}
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


DECODE_CHUNK_BYTES = 1 << 20   # stored bytes a decode chunk reads: its int8 temporaries stay in the L2 cache


def decode_planes(ggml_type: int, raw: np.ndarray, n_rows: int, n_cols: int) -> Planes:
    """Split a stored [N, K] quantized matrix into integer planes and scales.

    Row chunk by row chunk (spread over the worker threads): the chunk's integers in int8, then
    one transposing int8 -> float32 copy into its rows of the block-major plane."""
    block_elems, block_bytes = _check(ggml_type, raw, n_rows, n_cols)
    n_blocks = n_cols // block_elems
    rows = np.asarray(raw).reshape(n_rows, n_blocks * block_bytes)
    sub = 16 if QT(ggml_type) == QT.Q6_K else 32                       # integer-sum granularity
    n_sub = n_cols // sub
    q = np.empty((n_sub, n_rows, sub), np.float32)                     # [S, N, Q]
    fields: dict[int, dict] = {}

    def chunk(n0: int, n1: int) -> None:
        ints, f = _int_plane(ggml_type, rows[n0:n1].reshape((n1 - n0) * n_blocks, block_bytes))
        q[:, n0:n1, :] = ints.reshape(n1 - n0, n_sub, sub).transpose(1, 0, 2)
        fields[n0] = f
    nc = max(1, DECODE_CHUNK_BYTES // rows.shape[1])
    row_chunks(chunk, n_rows, nc, n_rows * n_cols * 32)               # parallel past PARALLEL_MIN_MACS / 32
    f = {k: np.concatenate([fields[n0][k] for n0 in sorted(fields)]) for k in fields[0]}
    d = f["d"].reshape(n_rows, n_blocks)
    sc = f["sc"].reshape(n_rows, -1) if "sc" in f else None
    dmin = f["dmin"].reshape(n_rows, n_blocks) if "dmin" in f else None
    m = f["m"].reshape(n_rows, -1) if "m" in f else None
    return Planes(ggml_type, q, d, sc, dmin, m)


def planes_to_float(p: Planes) -> np.ndarray:
    """Rebuild float32 [N, K] from planes (checks decode_planes against `dequantize`)."""
    set_scaled(p, False)
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


# --- the compiled kernels (kernels/cpu_lanes.c) --------------------------------------------
# The same float order as the numpy kernels above (_dot_q8_0_lanes / _axpy for Q8_0 and Q5_0,
# _dot_q6_K_tiled / _lanes, _dot_q4_K_repacked), reading the stored blocks in place: nothing is
# decoded or kept beside them. cpu_kernels.lib() is None where they cannot be built.
C_TYPES = frozenset({QT.Q8_0, QT.Q5_0, QT.Q6_K, QT.Q4_K})


def check_raw(ggml_type: int, raw: np.ndarray, n_rows: int, n_cols: int) -> None:
    """A QuantError unless raw holds exactly the uint8 blocks of an [N, K] matrix of this type."""
    if raw.dtype != np.uint8:
        raise QuantError(f"{QT(ggml_type).name}: stored blocks must be uint8 bytes, got {raw.dtype}")
    _check(ggml_type, raw.reshape(-1), n_rows, n_cols)


def c_takes(ggml_type: int, n_rows: int) -> bool:
    """The compiled kernels give this weight's llama-order product (Q4_K is repacked, so in
    llama.cpp's 8x8 order, only where its rows come in eights)."""
    qt = QT(ggml_type)
    return qt in C_TYPES and (qt != QT.Q4_K or n_rows % 8 == 0)
