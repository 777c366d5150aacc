"""The 32-element family: Q8_0, Q5_0 and Q4_0 weights (one f16 scale per block of 32), with
their vec_dot partner, Q8_0 activations. Each block decoded to integers (int_plane), the
activations rounded as ggml-cpu's x86 build does (quantize_q8_0), the exact-sum product
(dot_planes), llama.cpp's float order (dot_llama: lane sums and fma chains, saxpy where it
fuses), the compiled kernels' call (c_mm), and the few largest rows of a Q8_0 head (top_llama).

Legend: N = weight rows (outputs), K = row length (inputs), T = activation rows,
B = blocks per row, Q = elements per block.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as QT

from bloomery.engine.quant.common import (Planes, QuantError, exact_dot, f16_column, fma_chain, hsum8,
                                          rows_per_chunk, set_scaled)
from bloomery.engine.quant.threads import _OPENBLAS, OneBlasThread, row_chunks

QK8_0 = 32
VEC_DOT_TYPE = {QT.Q4_0: QT.Q8_0, QT.Q5_0: QT.Q8_0, QT.Q8_0: QT.Q8_0}   # ggml-cpu.c type_traits_cpu
SUB_ELEMS = {QT.Q4_0: QK8_0, QT.Q5_0: QK8_0, QT.Q8_0: QK8_0}            # integers to an exact sum: a block


def int_plane(ggml_type: int, blocks: np.ndarray) -> tuple[np.ndarray, dict]:
    """blocks [R, block_bytes] uint8 -> (ints [R, block_elems] int8, scale fields)."""
    qt = QT(ggml_type)
    if qt == QT.Q8_0:
        return blocks[:, 2:].view(np.int8), {"d": f16_column(blocks, 0)}
    if qt == QT.Q4_0:
        qs = blocks[:, 2:18]
        q = np.concatenate([qs & 0xF, qs >> 4], axis=1).astype(np.int8) - 8
        return q, {"d": f16_column(blocks, 0)}
    if qt == QT.Q5_0:
        hb = np.unpackbits(blocks[:, 2:6], axis=1, bitorder="little")  # [R, 32]: bit j of the LE u32 qh
        qs = blocks[:, 6:22]
        q = np.empty((blocks.shape[0], 32), np.uint8)
        np.bitwise_and(qs, 0xF, out=q[:, :16])
        np.right_shift(qs, 4, out=q[:, 16:])
        np.left_shift(hb, 4, out=hb)
        q |= hb
        q -= 16                                                        # 0..31 - 16, wrapping: int8 below
        return q.view(np.int8), {"d": f16_column(blocks, 0)}
    raise QuantError(f"no exact integer path for {QT(ggml_type).name}")


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


def _combine(p: Planes, isum, da, bsums, n0: int, n1: int) -> np.ndarray:
    """Block sums [B, T, n] -> [T, n] with the scales of rows n0..n1: one scale per block."""
    scale = da.T[:, :, None] * p.d[n0:n1].T[:, None, :]                # [B, T, n] f32 d_a*d_w
    return (scale * isum).sum(axis=0)


def dot_planes(x: np.ndarray, p: Planes) -> np.ndarray:
    """x [T, K] float32 @ weight planes [N, K]^T -> [T, N] float32 as ggml_vec_dot_*_q8_0's sums:
    exact integer sums per block, the block scales last in float32 as llama.cpp does."""
    set_scaled(p, False)
    qa, da = quantize_q8_0(x)
    return exact_dot(p, qa, da, None, _combine)


# --- llama.cpp's float order ----------------------------------------------------------------
# Q8_0, Q5_0: ggml_vec_dot_*_q8_0 for one column and llamafile's tinyBLAS_Q0_AVX for more
#   (n >= 2): both keep 8 float lanes per output, lane l = the integer sum of elements
#   4l..4l+3 of each 32-block, acc = fma(d_w*d_a, lane, acc) block after block, then
#   hsum_float_8: ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)). One order for any batch, experts'
#   rows (ggml_mul_mat_id) included.
# For Q5_0 (and Q4_0) the plane holds d_w*q (set_scaled), so BLAS gives d_w*lane exactly and
# each chain step is one fused saxpy from numpy's OpenBLAS with a = d_a (the same exact product
# as d_w*d_a times lane, rounded once); elsewhere the float32 fma is emulated in float64
# (common.fma_chain).
LLAMA_ORDER_TYPES = frozenset({QT.Q8_0, QT.Q5_0})
C_TYPES = LLAMA_ORDER_TYPES              # the compiled kernels (kernels/cpu_lanes.c) take these


def c_takes(ggml_type: int, n_rows: int) -> bool:
    """The compiled kernels give this weight's llama-order product."""
    return QT(ggml_type) in C_TYPES


def _find_saxpy():
    """OpenBLAS's contiguous saxpy, y = a*x + y, if it is a fused multiply-add here.

    llama.cpp's Q8_0-family kernels do acc = fma(d, lane, acc) in float32. Where d*lane is a
    float32 a times a float32 x exactly (see _dot_q8_0_lanes), one saxpy call is that step for
    a whole row block. OpenBLAS's x86 kernels (Haswell, SkylakeX) use FMA instructions, but a
    build may not, so the call is checked against a float64 fma on inputs where one rounding
    and two differ; None (the float64 emulation is used) if it is absent or not fused."""
    if _OPENBLAS is None:
        return None
    import ctypes
    for name, int_t in (("scipy_cblas_saxpy64_", ctypes.c_int64), ("cblas_saxpy64_", ctypes.c_int64),
                        ("cblas_saxpy", ctypes.c_int)):
        fn = getattr(_OPENBLAS, name, None)
        if fn is not None:
            break
    else:
        return None
    fn.argtypes = [int_t, ctypes.c_float, ctypes.c_void_p, int_t, ctypes.c_void_p, int_t]
    fn.restype = None
    grain = fused_grain(fn)
    return None if grain is None else (fn, grain)


def fused_grain(fn) -> int | None:
    """1 if saxpy fn(n, a, x, 1, y, 1) is one fused multiply-add per element for every length
    tried, 32 if only for whole multiples of 32 (some builds fuse whole 32-float steps and
    finish a tail with a multiply and an add: OpenBLAS's Zen kernel on an AMD EPYC here), None
    if neither."""
    rng = np.random.default_rng(12345)

    def fused(lengths) -> bool:
        with OneBlasThread():
            for n in lengths:
                x = rng.standard_normal(n).astype(np.float32)
                y = rng.standard_normal(n).astype(np.float32)
                a = np.float32(rng.standard_normal())
                want = (np.float64(a) * x.astype(np.float64) + y).astype(np.float32)
                fn(n, float(a), x.ctypes.data, 1, y.ctypes.data, 1)
                if not np.array_equal(y, want):
                    return False
        return True
    for grain in (1, 32):
        if fused([grain * m for m in (1, 2, 3, 7, 16, 31, 128, 1000)] + ([7, 15, 17, 100, 4099] if grain == 1 else [])):
            return grain
    return None


_SAXPY, SAXPY_GRAIN = _find_saxpy() or (None, 0)    # the saxpy, and the lengths (multiples) it fuses
USE_SAXPY = _SAXPY is not None


def dot_llama(x: np.ndarray, p: Planes, per_row: bool = False) -> np.ndarray:
    """x [T, K] float32 @ planes [N, K]^T -> [T, N] in llama.cpp's CPU float order (the caller
    holds OneBlasThread); Q4_0 has no mirrored kernel: its exact sums."""
    if QT(p.ggml_type) in LLAMA_ORDER_TYPES:
        return _dot_q8_0_lanes(x, p)                                    # vec_dot and tinyBLAS: one order
    return dot_planes(x, p)


def _lane_diag(qa: np.ndarray, n_blocks: int) -> np.ndarray:
    """Q8_0 activation [T, K] -> [B, 32, 8T] block-diagonal: column (lane, t) holds elements
    4*lane .. 4*lane+3 of block b of row t, so [n, 32] @ it gives every lane's integer sum."""
    t = qa.shape[0]
    qa_b = qa.reshape(t, n_blocks, 8, 4).transpose(1, 2, 3, 0)          # [B, lane, 4, T]
    a_bd = np.zeros((n_blocks, 8, 4, 8, t), np.float32)
    for lane in range(8):
        a_bd[:, lane, :, lane, :] = qa_b[:, lane]
    return a_bd.reshape(n_blocks, 32, 8 * t)


def _saxpy_rows(n_rows: int) -> int:
    """Rows a saxpy chunk of _dot_q8_0_axpy must be a multiple of (its length is 8 per row)
    for the saxpy to fuse every step; 0: n_rows cannot be cut so."""
    per = max(1, SAXPY_GRAIN // 8)
    return per if n_rows % per == 0 else 0


def _dot_q8_0_lanes(x: np.ndarray, p: Planes) -> np.ndarray:
    if USE_SAXPY and QT(p.ggml_type) in AXPY_TYPES and _saxpy_rows(p.q.shape[1]):
        return _dot_q8_0_axpy(x, p)
    set_scaled(p, False)
    t = x.shape[0]
    n_blocks, n_rows, _ = p.q.shape
    qa, da = quantize_q8_0(x)
    a_bd = _lane_diag(qa, n_blocks)                                     # [B, 32, 8T]
    da64 = da.T.astype(np.float64)[:, None, None, :]                   # [B, 1, 1, T]
    out = np.empty((t, n_rows), np.float32)

    def chunk(n0: int, n1: int) -> None:
        n = n1 - n0
        lanes = np.matmul(p.q[:, n0:n1], a_bd)                          # [B, n, 8T] exact ints
        d = np.multiply(p.d[n0:n1].T[:, :, None, None], da64)           # d_w*d_a: exact, as f32
        prod = lanes.reshape(n_blocks, n, 8, t).astype(np.float64)
        np.multiply(prod, d, out=prod)                                  # [B, n, 8, T] exact products
        acc = fma_chain(prod, np.empty((n, 8, t), np.float32))         # [n, 8, T]
        out[:, n0:n1] = hsum8(acc.transpose(1, 0, 2)).T                # [T, n]
    row_chunks(chunk, n_rows, rows_per_chunk(n_blocks * 8 * t * 8, n_rows), t * n_rows * n_blocks * 32)
    return out


# Types whose lane sums times the weight's f16 scale are exact in float32 (|q| <= 16:
# |lane| <= 4*16*127 < 2^13, an f16 holds 11 significant bits), so fma(d_w*d_a, lane, acc)
# is saxpy(d_a, d_w*lane, acc): the same exact product, rounded once.
AXPY_TYPES = frozenset({QT.Q5_0, QT.Q4_0})
AXPY_CHUNK_BYTES = 1 << 23   # the [B, 8T, n] lane array of one chunk


def _dot_q8_0_axpy(x: np.ndarray, p: Planes) -> np.ndarray:
    """One column: lanes [B, n, 8] from [n, 32] @ [32, 8] per block, contiguous per block.
    More: [B, 8T, n] from [8T, 32] @ [32, n], contiguous per (block, column). Either way the
    plane is d_w*q, so each BLAS sum is d_w*lane exactly, and each saxpy one fma step."""
    set_scaled(p, True)
    t = x.shape[0]
    n_blocks, n_rows, _ = p.q.shape
    qa, da = quantize_q8_0(x)
    a_bd = _lane_diag(qa, n_blocks)                                     # [B, 32, 8T], column (lane, t)
    if t > 1:                                                           # rows (t, lane)
        a_bd = np.ascontiguousarray(a_bd.reshape(n_blocks, 32, 8, t).transpose(0, 3, 2, 1)).reshape(n_blocks, 8 * t, 32)
    da_list = da.tolist()                                               # [T][B] f16 values
    out = np.empty((t, n_rows), np.float32)
    saxpy = _SAXPY

    def chunk(n0: int, n1: int) -> None:
        n = n1 - n0
        if t == 1:
            y = np.matmul(p.q[:, n0:n1], a_bd)                          # [B, n, 8] d_w*lane
            acc = np.zeros((n, 8), np.float32)
        else:
            y = np.matmul(a_bd, p.q[:, n0:n1].transpose(0, 2, 1))       # [B, 8T, n] d_w*lane
            acc = np.zeros((t, 8, n), np.float32)
        y_ptr, acc_ptr, step = y.ctypes.data, acc.ctypes.data, 8 * n
        for b in range(n_blocks):
            base = y_ptr + b * 4 * 8 * t * n
            for r in range(t):
                saxpy(step, da_list[r][b], base + r * 4 * step, 1, acc_ptr + r * 4 * step, 1)
        out[:, n0:n1] = hsum8(acc.T) if t == 1 else hsum8(acc.transpose(1, 0, 2))
    nc = n_rows if n_rows <= 1024 else max(256, AXPY_CHUNK_BYTES // (n_blocks * 8 * t * 4))
    row_chunks(chunk, n_rows, nc, t * n_rows * n_blocks * 32, multiple=_saxpy_rows(n_rows))
    return out


def c_mm(lib, act, ggml_type: int, raw: np.ndarray, n_rows: int, per_row: bool, out: np.ndarray, nth: int) -> None:
    """The compiled kernels' product of act (a formats.CAct) with the stored blocks raw of an
    [N, K] Q8_0 or Q5_0 weight, into out [T, N] (one order for any batch: per_row is moot)."""
    qa, da = act.q8_0(lib)
    lib.q80_mm(raw.ctypes.data, 0 if ggml_type == QT.Q8_0 else 1, n_rows, act.k // QK8_0, qa.ctypes.data,
               da.ctypes.data, act.t, out.ctypes.data, n_rows, nth)


# --- the largest few of a Q8_0 head, without every row's llama-order sum -------------------
# A greedy or top-k pick needs the exact (llama-order) logits only of the rows that can be among
# the k largest. Every row's sum in float64 from the same exact block sums and the same float32
# scales d_w*d_a differs from the llama-order float32 result only by that order's roundings: at
# most 2^-24 per fma step and per hsum level, each on at most sum_b |d_w*d_a| * sum_l |lane_l|
# <= sum_b |d_w*d_a| * |q_b|_2 * |a_b|_2 (Cauchy-Schwarz), hence the bound below with B + 5
# steps for B blocks, three hsum levels, the float64 sum's own rounding and slack. A row whose
# estimate plus bound is below the k-th largest estimate minus its bound cannot be among the k
# largest, nor tie with them; the rest get the llama-order sum (dot_llama on those rows alone:
# each row's sum there is computed from that row only, so it is the full product's, bit for bit).
TOP_TYPES = frozenset({QT.Q8_0})


def _estimate(x: np.ndarray, p: Planes) -> tuple[np.ndarray, np.ndarray]:
    """Every row's sum in float64 for each column of x [T, K] (est [T, N]), and the bound on its
    distance from the llama-order float32 sum (bound [T, N]); one pass over the plane for all T."""
    set_scaled(p, False)
    t = x.shape[0]
    n_blocks, n_rows, _ = p.q.shape
    qa, da = quantize_q8_0(x)
    qa_b = np.ascontiguousarray(qa.reshape(t, n_blocks, 32).transpose(1, 2, 0))   # [B, 32, T]
    if "q_norms" not in p.cache:                                        # |q_b|_2 per row and block, [N, B]
        p.cache["q_norms"] = np.sqrt(np.square(p.q).sum(axis=2, dtype=np.float64)).T.copy()
    q_norms = p.cache["q_norms"]
    a_norms = np.sqrt(np.square(qa.reshape(t, n_blocks, 32), dtype=np.float64).sum(axis=2))   # [T, B]
    est, bound = np.empty((t, n_rows)), np.empty((t, n_rows))

    def chunk(n0: int, n1: int) -> None:
        isum = np.matmul(p.q[:, n0:n1], qa_b).astype(np.float64)       # [B, n, T] exact block sums
        for r in range(t):
            sc = (p.d[n0:n1] * da[r][None, :]).astype(np.float64)       # [n, B] f32 d_w*d_a, as the kernel
            est[r, n0:n1] = np.einsum("nb,bn->n", sc, isum[:, :, r])
            bound[r, n0:n1] = (np.abs(sc) * q_norms[n0:n1]) @ a_norms[r]
    row_chunks(chunk, n_rows, 8192, t * n_rows * n_blocks * 32)
    bound *= 2.0 ** -24 * (n_blocks + 5)
    return est, bound


def _rows_of(p: Planes, rows: np.ndarray) -> Planes:
    return Planes(p.ggml_type, p.q[:, rows], p.d[rows], scaled=p.scaled)


def top_llama(x: np.ndarray, p: Planes, k: int) -> list[tuple[np.ndarray, np.ndarray] | None]:
    """The k largest of each row of dot_llama(x, p) for x [T, K]: per row (ids, values), descending,
    ties to the lower id, each value bit-equal to the full product's; None for a row where this
    cannot be told so (a non-finite input or sum), and for every row of a type not in TOP_TYPES:
    the caller takes the full product there."""
    t = x.shape[0]
    if QT(p.ggml_type) not in TOP_TYPES:
        return [None] * t
    n_rows = p.q.shape[1]
    k = min(k, n_rows)
    est, bound = _estimate(x, p)
    out: list[tuple[np.ndarray, np.ndarray] | None] = []
    for r in range(t):
        if not (np.isfinite(x[r]).all() and np.isfinite(est[r]).all()):
            out.append(None)
            continue
        low = est[r] - bound[r]
        kth = np.partition(low, n_rows - k)[n_rows - k]                 # the k-th largest lower end
        cand = np.flatnonzero(est[r] + bound[r] >= kth)                 # ascending ids
        with OneBlasThread():
            vals = dot_llama(x[r:r + 1], _rows_of(p, cand))[0]         # [C] llama order
        if not np.isfinite(vals).all():
            out.append(None)
            continue
        order = np.argsort(-vals, kind="stable")[:k]                    # ties keep the lower id
        out.append((cand[order].astype(np.int32), vals[order]))
    return out
