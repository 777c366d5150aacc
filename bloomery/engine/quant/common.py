"""What every block format family shares: the check of a tensor's bytes against its type and
shape, the planes a quantized weight is split into (and the row-chunked split itself, given a
family's block decoder), and the pieces of llama.cpp's float order that the families' kernels
have in common: the exact block sums, the fma chain over blocks and hsum_float_8.

Legend: N = weight rows (outputs), K = row length (inputs), T = activation rows,
B = blocks per row, S = sub-blocks per row, Q = elements per (sub-)block.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

from bloomery.engine.quant.threads import OneBlasThread, row_chunks


class QuantError(ValueError):
    """A tensor's bytes do not fit its declared type and shape."""


def check_size(ggml_type: int, raw: np.ndarray, n_rows: int, n_cols: int) -> tuple[int, int]:
    block_elems, block_bytes = GGML_QUANT_SIZES[QT(ggml_type)]
    if n_cols % block_elems:
        raise QuantError(f"{QT(ggml_type).name}: row length {n_cols} is not a multiple of the block size {block_elems}")
    want = n_rows * (n_cols // block_elems) * block_bytes
    if raw.size != want:
        raise QuantError(f"{QT(ggml_type).name} [{n_rows}, {n_cols}]: expected {want} bytes, got {raw.size}")
    return block_elems, block_bytes


def check_raw(ggml_type: int, raw: np.ndarray, n_rows: int, n_cols: int) -> None:
    """A QuantError unless raw holds exactly the uint8 blocks of an [N, K] matrix of this type."""
    if raw.dtype != np.uint8:
        raise QuantError(f"{QT(ggml_type).name}: stored blocks must be uint8 bytes, got {raw.dtype}")
    check_size(ggml_type, raw.reshape(-1), n_rows, n_cols)


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


def f16_column(raw: np.ndarray, col: int) -> np.ndarray:
    """Column `col` .. col+2 of a [rows, bytes] uint8 array as float32."""
    return raw[:, col:col + 2].copy().view(np.float16)[:, 0].astype(np.float32)


DECODE_CHUNK_BYTES = 1 << 20   # stored bytes a decode chunk reads: its int8 temporaries stay in the L2 cache


def split_planes(ggml_type: int, raw: np.ndarray, n_rows: int, n_cols: int, int_plane, sub: int) -> Planes:
    """Split a stored [N, K] quantized matrix into integer planes and scales, the family's
    int_plane(ggml_type, blocks) giving each block's integers and scale fields, `sub` integers
    to a sub-block (the integer-sum granularity).

    Row chunk by row chunk (spread over the worker threads): the chunk's integers in int8, then
    one transposing int8 -> float32 copy into its rows of the block-major plane."""
    block_elems, block_bytes = check_size(ggml_type, raw, n_rows, n_cols)
    n_blocks = n_cols // block_elems
    rows = np.asarray(raw).reshape(n_rows, n_blocks * block_bytes)
    n_sub = n_cols // sub
    q = np.empty((n_sub, n_rows, sub), np.float32)                     # [S, N, Q]
    fields: dict[int, dict] = {}

    def chunk(n0: int, n1: int) -> None:
        ints, f = int_plane(ggml_type, rows[n0:n1].reshape((n1 - n0) * n_blocks, block_bytes))
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


# --- the float order's shared pieces ---------------------------------------------------

MAX_TMP_ELEMS = 1 << 22   # bound on a [S, N, T] block-sum temporary (16 MiB of float32)


def exact_dot(p: Planes, qa: np.ndarray, da: np.ndarray, bsums: np.ndarray | None, combine) -> np.ndarray:
    """The activation qa [T, K] (quantized to the weight's vec_dot partner, scales da, bsums)
    @ weight planes [N, K]^T -> [T, N] float32: integer sums per (sub-)block from one batched
    float32 matmul (exact: every partial sum is below 2^24), then the family's
    combine(p, isum [S, T, n], da, bsums, n0, n1) with the scales of rows n0..n1."""
    t = qa.shape[0]
    n_sub, n_rows, sub = p.q.shape
    qa_b = np.ascontiguousarray(qa.reshape(t, n_sub, sub).transpose(1, 0, 2))   # [S, T, Q]
    out = np.empty((t, n_rows), np.float32)                                      # [T, N]
    step = max(1, MAX_TMP_ELEMS // max(1, n_sub * t))
    for n0 in range(0, n_rows, step):
        n1 = min(n_rows, n0 + step)
        out[:, n0:n1] = combine(p, block_sums(p.q[:, n0:n1], qa_b), da, bsums, n0, n1)
    return out


def block_sums(wq: np.ndarray, qa_b: np.ndarray) -> np.ndarray:
    """wq [S, n, Q], qa_b [S, T, Q] -> [S, T, n] integer sums per (sub-)block (exact in f32)."""
    n_sub, t, _ = qa_b.shape
    if t == 1:      # one batched GEMV: numpy's stacked matmul is quick for a single column
        return np.matmul(wq, qa_b.transpose(0, 2, 1)).reshape(n_sub, 1, -1)
    isum = np.empty((n_sub, t, wq.shape[1]), np.float32)
    with OneBlasThread():   # tiny GEMMs: OpenBLAS's thread hand-off would cost far more than the work
        for s in range(n_sub):  # one BLAS GEMM per block: stacked matmul does not reach BLAS here
            np.dot(qa_b[s], wq[s].T, out=isum[s])
    return isum


CHUNK_BYTES = 1 << 21    # a chunk's float64 product array: about the L2 cache, so each chain step reads it from there


def rows_per_chunk(bytes_per_row: int, n_rows: int, at_least: int = 64) -> int:
    return max(1, min(n_rows, max(at_least, CHUNK_BYTES // max(1, bytes_per_row))))


def fma_chain(prod: np.ndarray, acc: np.ndarray) -> np.ndarray:
    """acc = fma(d_s, v_s, acc) for s = 0, 1, .. from acc = 0, in float32; prod [S, ...] holds the
    products d_s*v_s exactly in float64, so each step rounds the sum once (twice, to float64
    first, in about 2^-29 of the inexact cases). One numpy call per step, over every row."""
    np.add(prod[0], 0.0, out=acc, casting="unsafe")                    # 0 + d_0*v_0: a -0 product gives +0
    for s in range(1, prod.shape[0]):
        np.add(prod[s], acc, out=acc, casting="unsafe")
    return acc


def hsum8(a: np.ndarray) -> np.ndarray:
    """hsum_float_8 over axis 0 (8 lanes): 128-bit halves, then movehl, then the last pair."""
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))
