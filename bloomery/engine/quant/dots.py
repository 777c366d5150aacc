"""Dot products of a quantized weight with float activations, as llama.cpp's CPU backend
computes them: exact integer sums per (sub-)block from the decoded blocks (blocks.py), the
activations quantized to the weight's vec_dot partner type (activations.py), then the float
combine with the scales, in llama.cpp's kernel order per type family where KERNEL_ORDER is on:
the Q8_0 family (Q8_0, Q5_0, Q4_0: lane sums and fma chains, saxpy where it fuses), the
K-quants (Q6_K's tiled and lane paths, the repacked Q4_K gemm/gemv), F32 weights, the compiled
kernels' entry (dot_c), and the few largest rows of a Q8_0 head (top_llama).

Legend: N = weight rows (outputs), K = row length (inputs), T = activation rows,
B = blocks per row, S = sub-blocks per row, Q = elements per (sub-)block.
"""
from __future__ import annotations

import os

import numpy as np
from gguf import GGMLQuantizationType as QT

from bloomery.engine.quant.activations import quantize_q8_0, quantize_q8_K
from bloomery.engine.quant import blocks
from bloomery.engine.quant.blocks import VEC_DOT_TYPE, QK8_0, QK_K, Planes, set_scaled
from bloomery.engine.quant.threads import _OPENBLAS, N_THREADS, OneBlasThread, row_chunks

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
    set_scaled(p, False)
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
    with OneBlasThread():   # tiny GEMMs: OpenBLAS's thread hand-off would cost far more than the work
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


# --- llama.cpp's float order (x86 build with AVX2/AVX512, CPU_REPACK and llamafile on) ------
# Which kernel llama.cpp runs for each weight type, and so which order we mirror:
#   Q8_0, Q5_0: ggml_vec_dot_*_q8_0 for one column and llamafile's tinyBLAS_Q0_AVX for more
#     (n >= 2): both keep 8 float lanes per output, lane l = the integer sum of elements
#     4l..4l+3 of each 32-block, acc = fma(d_w*d_a, lane, acc) block after block, then
#     hsum_float_8: ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)).
#   Q6_K: ggml_vec_dot_q6_K_q8_K: 8 int32 lanes per super-block; lane l holds elements
#     128j+32k+4l..+3 (unsigned 6-bit quants times their scale) minus 32*scale*bsum of
#     sub-blocks 2l, 2l+1; acc = fma(d, float(lane), acc); hsum_float_8.
#   Q6_K with T >= 8 columns: ggml-cpu's tiled K-quant matmul (tiled/tiled-kernel.cpp, the
#     AVX512-VNNI microkernel): per super-block s1 = sum over 16-sub-blocks of
#     scale*(raw - 32*bsum), an exact int32; r = float(s1)*d_w rounded, then buf = fma(r, d_a, buf)
#     super-block after super-block (the source says add(buf, mul(r, d_a)); gcc's default
#     -ffp-contract=fast fuses it: measured, the unfused order misses on ~70% of outputs).
#   Q4_K with rows % 8 == 0: repacked at load to q4_K_8x8 (ggml_gemv/gemm_q4_K_8x8_q8_K):
#     acc = fma(float(isum), d_w*d_a, acc) with isum an exact integer sum per super-block (gemv:
#     T%4 trailing columns) or per 64 elements (gemm: the first T - T%4, quantized by
#     ggml_quantize_mat_q8_K_4x8), mins in a second accumulator the same way, out = acc - acc_min.
#   ggml_mul_mat_id (MoE experts): as above per expert's rows, except that the repacked Q4_K
#     runs its gemv row by row (dot_llama(per_row=True)).
#   F32 weights: dot_f32_llama (ggml_vec_dot_f32 / llamafile's tinyBLAS<16, __m512>).
# How, in numpy, with no Python per row: every integer lane sum comes from one BLAS product
# (exact: every partial sum is an integer below 2^24), and the fma chain over blocks is one call
# per block over all rows at once. For Q5_0 (and Q4_0) the plane holds d_w*q (set_scaled), so
# BLAS gives d_w*lane exactly and each chain step is one fused saxpy from numpy's OpenBLAS with
# a = d_a (the same exact product as d_w*d_a times lane, rounded once); elsewhere a float32 fma
# is emulated in float64: the product is exact there (< 53 bits), only the sum rounds twice,
# which differs from one rounding in about 2^-29 of the inexact cases (_fma_chain). Large
# products split their rows over N_THREADS threads.
LLAMA_ORDER_TYPES = frozenset({QT.Q8_0, QT.Q5_0, QT.Q6_K, QT.Q4_K})
# True (default; BLOOMERY_KERNEL_ORDER=off turns it off): the four types above, and F32
# weights (dot_f32_llama), sum in llama.cpp's kernel order, bit for bit, so the numpy backend's
# logits equal llama.cpp's CPU build's. False: every batch size takes dot_planes' one order
# (exact integer sums, float order our own; final logits within ~0.5 of llama.cpp's); tests that
# compare batch shapes use it, since llama.cpp's kernels, so ours, give a prompt's logits
# differently at T=1, T<8 and T>=8.
KERNEL_ORDER = os.environ.get("BLOOMERY_KERNEL_ORDER", "on").strip().lower() not in ("off", "0", "false", "no")


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


CHUNK_BYTES = 1 << 21    # a chunk's float64 product array: about the L2 cache, so each chain step reads it from there


def _rows_per_chunk(bytes_per_row: int, n_rows: int, at_least: int = 64) -> int:
    return max(1, min(n_rows, max(at_least, CHUNK_BYTES // max(1, bytes_per_row))))


def _fma_chain(prod: np.ndarray, acc: np.ndarray) -> np.ndarray:
    """acc = fma(d_s, v_s, acc) for s = 0, 1, .. from acc = 0, in float32; prod [S, ...] holds the
    products d_s*v_s exactly in float64, so each step rounds the sum once (twice, to float64
    first, in about 2^-29 of the inexact cases). One numpy call per step, over every row."""
    np.copyto(acc, prod[0], casting="unsafe")
    for s in range(1, prod.shape[0]):
        np.add(prod[s], acc, out=acc, casting="unsafe")
    return acc


def _hsum8(a: np.ndarray) -> np.ndarray:
    """hsum_float_8 over axis 0 (8 lanes): 128-bit halves, then movehl, then the last pair."""
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))


def dot_llama(x: np.ndarray, p: Planes, per_row: bool = False) -> np.ndarray:
    """x [T, K] float32 @ planes [N, K]^T -> [T, N] in llama.cpp's CPU float order.

    per_row: the product of ggml_mul_mat_id (an expert's rows): a repacked Q4_K weight runs its
    gemv row by row there, whatever the batch; Q6_K takes the tiled path from 8 rows per expert
    as in mul_mat, and the Q8_0 family has one order for any batch."""
    with OneBlasThread():
        return _dot_llama(x, p, per_row)


def _dot_llama(x: np.ndarray, p: Planes, per_row: bool = False) -> np.ndarray:
    qt = QT(p.ggml_type)
    if qt in (QT.Q8_0, QT.Q5_0):
        return _dot_q8_0_lanes(x, p)                                    # vec_dot and tinyBLAS: one order
    if qt == QT.Q6_K:
        return _dot_q6_K_tiled(x, p) if x.shape[0] >= TILED_MIN_T else _dot_q6_K_lanes(x, p)
    if qt == QT.Q4_K and p.q.shape[1] % 8 == 0:
        return _dot_q4_K_repacked(x, p, gemv_only=per_row)
    return dot_planes(x, p)                                             # no mirrored kernel: exact sums


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
        acc = _fma_chain(prod, np.empty((n, 8, t), np.float32))         # [n, 8, T]
        out[:, n0:n1] = _hsum8(acc.transpose(1, 0, 2)).T                # [T, n]
    row_chunks(chunk, n_rows, _rows_per_chunk(n_blocks * 8 * t * 8, n_rows), t * n_rows * n_blocks * 32)
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
        out[:, n0:n1] = _hsum8(acc.T) if t == 1 else _hsum8(acc.transpose(1, 0, 2))
    nc = n_rows if n_rows <= 1024 else max(256, AXPY_CHUNK_BYTES // (n_blocks * 8 * t * 4))
    row_chunks(chunk, n_rows, nc, t * n_rows * n_blocks * 32, multiple=_saxpy_rows(n_rows))
    return out


def c_threads(macs: int) -> int:
    """Threads a compiled call spreads over: N_THREADS, or one where the work is too small to share."""
    return N_THREADS if macs >= C_PARALLEL_MIN_MACS else 1


C_PARALLEL_MIN_MACS = 1 << 16   # OpenMP's hand-off costs microseconds, not the pool's tens of them


class CAct:
    """x [T, K] quantized once for the compiled kernels: to Q8_0, and to Q8_K with t_gemm rows
    in the repacked gemm's tie rule, each made on first use (products of one input share them)."""

    def __init__(self, x: np.ndarray):
        x = np.ascontiguousarray(x, dtype=np.float32)
        self.bad = ~np.isfinite(x).all(axis=1)                          # such a row's quantized blocks are NaN:
        if self.bad.any():                                              # its whole output is NaN, as the numpy
            x = np.where(self.bad[:, None], np.float32(0), x)           # kernels' (no NaN cast to int8)
        self.x = x
        self.t, self.k = x.shape
        self._q8_0 = None
        self._q8_K: dict[int, tuple] = {}

    def q8_0(self, lib):
        if self._q8_0 is None:
            q, d = np.empty((self.t, self.k), np.int8), np.empty((self.t, self.k // QK8_0), np.float32)
            lib.quant_q8_0(self.x.ctypes.data, self.t, self.k, q.ctypes.data, d.ctypes.data)
            self._q8_0 = (q, d)
        return self._q8_0

    def q8_K(self, lib, t_gemm: int):
        if t_gemm not in self._q8_K:
            q, d = np.empty((self.t, self.k), np.int8), np.empty((self.t, self.k // QK_K), np.float32)
            bsums = np.empty((self.t, self.k // 16), np.int16)
            wins = (np.arange(self.t) < t_gemm).astype(np.uint8)
            lib.quant_q8_K(self.x.ctypes.data, self.t, self.k, wins.ctypes.data, q.ctypes.data, d.ctypes.data,
                           bsums.ctypes.data)
            self._q8_K[t_gemm] = (q, d, bsums)
        return self._q8_K[t_gemm]


def dot_c(x, ggml_type: int, raw: np.ndarray, n_rows: int, n_cols: int, per_row: bool = False) -> np.ndarray:
    """x [T, K] float32 (or a CAct of it) @ w^T -> [T, N] in llama.cpp's order, through the compiled
    kernels, which read the stored blocks `raw` of the [N, K] weight in place (cpu_kernels.lib()
    must not be None; blocks.c_takes(ggml_type, n_rows) must hold); per_row as dot_llama's."""
    from bloomery.engine.cpu import kernels as cpu_kernels
    lib = cpu_kernels.lib()
    blocks.check_raw(ggml_type, raw, n_rows, n_cols)
    raw = np.ascontiguousarray(raw)
    act = x if isinstance(x, CAct) else CAct(x)
    if act.k != n_cols:
        raise ValueError(f"matmul: input has {act.k} columns, the weight's rows are {n_cols} long")
    t, k = act.t, act.k
    out = np.empty((t, n_rows), np.float32)
    nth = c_threads(t * n_rows * k)
    if ggml_type in (Q8_0, Q5_0):
        qa, da = act.q8_0(lib)
        lib.q80_mm(raw.ctypes.data, 0 if ggml_type == Q8_0 else 1, n_rows, k // QK8_0, qa.ctypes.data, da.ctypes.data,
                   t, out.ctypes.data, n_rows, nth)
    elif ggml_type == Q6_K:
        qa, da, bsums = act.q8_K(lib, 0)
        lib.q6k_mm(raw.ctypes.data, n_rows, k // QK_K, qa.ctypes.data, da.ctypes.data, bsums.ctypes.data, t,
                   int(t >= TILED_MIN_T), out.ctypes.data, n_rows, nth)
    else:
        t_gemm = _q4_K_gemm_rows(t, per_row)
        qa, da, bsums = act.q8_K(lib, t_gemm)
        lib.q4k_mm(raw.ctypes.data, n_rows, k // QK_K, qa.ctypes.data, da.ctypes.data, bsums.ctypes.data, t,
                   t_gemm, out.ctypes.data, n_rows, nth)
    out[act.bad] = np.nan
    return out


Q8_0, Q5_0, Q6_K = int(QT.Q8_0), int(QT.Q5_0), int(QT.Q6_K)


def dot_f32_llama(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x [T, K] float32 @ w [N, K]^T in llama.cpp's order for F32 weights (AVX-512 build).

    T >= 2 with N % 4 == 0 goes to llamafile's tinyBLAS<16, __m512>: per output one 16-lane
    accumulator, fma over the row in 16-wide steps (a partial last step reads zeros), then
    _mm512_reduce_add_ps. Otherwise ggml_vec_dot_f32: four 16-lane accumulators over 64-wide
    steps, (acc0 + acc2) + (acc1 + acc3), _mm512_reduce_add_ps, then the tail one fma at a time."""
    from bloomery.engine.cpu.ops_math import reduce_add16
    t, k = x.shape
    n = w.shape[0]
    out = np.empty((t, n), np.float32)
    tiny = t >= 2 and n % 4 == 0
    width = 16 if tiny else 64
    x64 = x.astype(np.float64)
    step = max(1, MAX_TMP_ELEMS // max(1, t * width))
    for n0 in range(0, n, step):
        n1 = min(n, n0 + step)
        wc = w[n0:n1]
        acc = np.zeros((t, n1 - n0, width), np.float32)
        k_main = k if tiny else k - k % 64
        for c in range(0, k_main, width):
            xs, ws = x64[:, None, c:c + width], wc[None, :, c:c + width]
            if xs.shape[-1] < width:                                    # tinyBLAS's partial load: zeros
                xs = np.concatenate([xs, np.zeros(xs.shape[:-1] + (width - xs.shape[-1],))], axis=-1)
                ws = np.concatenate([ws, np.zeros(ws.shape[:-1] + (width - ws.shape[-1],), np.float32)], axis=-1)
            acc = (xs * ws + acc).astype(np.float32)
        if tiny:
            out[:, n0:n1] = reduce_add16(acc)
            continue
        a4 = acc.reshape(t, n1 - n0, 4, 16)
        res = reduce_add16((a4[:, :, 0] + a4[:, :, 2]) + (a4[:, :, 1] + a4[:, :, 3]))
        for i in range(k_main, k):                                      # sumf += x[i]*y[i], contracted
            res = (x64[:, None, i] * wc[None, :, i] + res).astype(np.float32)
        out[:, n0:n1] = res
    return out


TILED_MIN_T = 8          # ggml_tiled_min_batch: the tiled path takes batches of 8+ columns


def _dot_q6_K_tiled(x: np.ndarray, p: Planes) -> np.ndarray:
    t = x.shape[0]
    n_sub, n_rows, sub = p.q.shape
    n_super = p.d.shape[1]
    qa, da, _ = quantize_q8_K(x)
    qa_b = np.ascontiguousarray(qa.reshape(t, n_sub, sub).transpose(1, 0, 2))   # [S, T, 16]
    da64 = da.T.astype(np.float64)[:, :, None]                          # [Bs, T, 1]
    out = np.empty((t, n_rows), np.float32)
    step = max(8, MAX_TMP_ELEMS // max(1, n_sub * t))
    for n0 in range(0, n_rows, step):
        n1 = min(n_rows, n0 + step)
        isum = _block_sums(p.q[:, n0:n1], qa_b)                         # [S, T, n] exact, signed quants
        sc = p.sc[n0:n1].T.astype(np.float64)                           # [S, n]
        s1 = (isum * sc[:, None, :]).reshape(n_super, n_sub // n_super, t, n1 - n0).sum(axis=1)
        r = s1.astype(np.float32) * p.d[n0:n1].T[:, None, :]           # [Bs, T, n] f32(s1)*d_w, rounded
        prod = r.astype(np.float64) * da64                              # gcc contracts add(buf, mul(r, d_a))
        out[:, n0:n1] = _fma_chain(prod, np.empty((t, n1 - n0), np.float32))
    return out


def _q6_K_layout(p: Planes) -> tuple[np.ndarray, np.ndarray]:
    """Scale-times-unsigned-quant weights [Bs, 2, 8, N, 16] in the AVX2 kernel's lane order
    (lane l of half j holds elements 128j + 32k + 4l + e, k < 4, e < 4), and the scales of
    sub-blocks 2l, 2l+1 as [Bs, 8, N, 2] for the lane's bsums term."""
    if "q6_lanes" not in p.cache:
        n_sub, n_rows, _ = p.q.shape
        n_super = n_sub // 16
        w = (p.q.transpose(1, 0, 2) + 32) * p.sc.astype(np.float32)[:, :, None]   # [N, S, 16] <= 8064
        w = w.reshape(n_rows, n_super, 2, 4, 8, 4)                      # [N, Bs, j, k, lane, e]
        sc = p.sc.astype(np.float32).reshape(n_rows, n_super, 8, 2)     # [N, Bs, lane, 2]
        p.cache["q6_lanes"] = (np.ascontiguousarray(w.transpose(1, 2, 4, 0, 3, 5).reshape(n_super, 2, 8, n_rows, 16)),
                               np.ascontiguousarray(sc.transpose(1, 2, 0, 3)))
    return p.cache["q6_lanes"]


def _dot_q6_K_lanes(x: np.ndarray, p: Planes) -> np.ndarray:
    """ggml_vec_dot_q6_K_q8_K: per super-block, 8 int32 lanes: the two halves' sums of
    unsigned quant * scale * a (each below 2^24, exact in float32), minus 32 * the scales
    times the bsums of sub-blocks 2l, 2l+1; _mm256_cvtepi32_ps, then fma(d_a*d_w, lane, acc)."""
    t = x.shape[0]
    n_sub, n_rows, _ = p.q.shape
    n_super = n_sub // 16
    w, sc = _q6_K_layout(p)                                             # [Bs, 2, 8, N, 16], [Bs, 8, N, 2]
    qa, da, bsums = quantize_q8_K(x)
    a = qa.reshape(t, n_super, 2, 4, 8, 4).transpose(1, 2, 4, 3, 5, 0).reshape(n_super, 2, 8, 16, t)
    bs = np.ascontiguousarray(bsums.reshape(t, n_super, 8, 2).transpose(1, 2, 3, 0))   # [Bs, lane, 2, T]
    out = np.empty((t, n_rows), np.float32)
    step = max(8, MAX_TMP_ELEMS // max(1, n_super * 16 * t))
    for n0 in range(0, n_rows, step):
        n1 = min(n_rows, n0 + step)
        half = np.matmul(w[:, :, :, n0:n1], a)                          # [Bs, 2, 8, n, T] exact (< 2^24)
        corr = np.matmul(sc[:, :, n0:n1], bs)                           # [Bs, 8, n, T] exact (< 2^20)
        lanes = half[:, 0].astype(np.float64)
        lanes += half[:, 1]
        lanes -= 32 * corr                                              # exact ints
        lanes = lanes.astype(np.float32).astype(np.float64)             # _mm256_cvtepi32_ps rounds past 2^24
        d = da.T[:, None, :] * p.d[n0:n1].T[:, :, None]                 # [Bs, n, T] f32 d_a*d_w, rounded
        lanes *= d[:, None].astype(np.float64)                          # exact products
        out[:, n0:n1] = _hsum8(_fma_chain(lanes, np.empty(lanes.shape[1:], np.float32))).T
    return out


def _q4_K_gemm_rows(t: int, gemv_only: bool) -> int:
    """Rows the repacked Q4_K's gemm takes (the rest go to its gemv): forward_mul_mat_one_chunk's
    split at a multiple of 4; none in mul_mat_id (an expert's rows run the gemv one by one)."""
    return 0 if gemv_only else t - t % 4


def _dot_q4_K_repacked(x: np.ndarray, p: Planes, gemv_only: bool = False) -> np.ndarray:
    """ggml_gemm/gemv_q4_K_8x8_q8_K: gemm rows (the first T - T%4) fma once per 64 elements,
    gemv rows once per super-block; the mins' products in a second accumulator the same way.

    The plane holds q * sub-block scale (set_scaled), so one BLAS sum per 32 elements is that
    sub-block's scaled integer sum (<= 32*945*127 < 2^24, exact) and two of them the 64's."""
    set_scaled(p, True)
    t = x.shape[0]
    n_sub, n_rows, sub = p.q.shape
    n_super = p.d.shape[1]
    t_gemm = _q4_K_gemm_rows(t, gemv_only)
    qa, da, bsums = quantize_q8_K(x, positive_wins=np.arange(t) < t_gemm)
    qa_b = np.ascontiguousarray(qa.reshape(t, n_sub, sub).transpose(1, 0, 2))   # [S, T, Q]
    bs32 = bsums.reshape(t, n_super * 4, 2, 2).sum(axis=3)             # [T, Bs*4, 2] sums per 32, exact
    bs32 = np.ascontiguousarray(bs32.transpose(1, 0, 2))              # [Bs*4, T, 2]
    if "q4_mins" not in p.cache:                                        # the 6-bit mins as [Bs*4, 2, N]
        p.cache["q4_mins"] = np.ascontiguousarray(
            p.m.astype(np.float32).reshape(n_rows, n_super * 4, 2).transpose(1, 2, 0))
    mins = p.cache["q4_mins"]
    out = np.empty((t, n_rows), np.float32)
    step = max(8, MAX_TMP_ELEMS // max(1, n_sub * t))
    for n0 in range(0, n_rows, step):
        n1 = min(n_rows, n0 + step)
        n = n1 - n0
        isum = _block_sums(p.q[:, n0:n1], qa_b).reshape(n_super, 4, 2, t, n)   # scaled sums per 32
        sumi = isum[:, :, 0] + isum[:, :, 1]                            # [Bs, sb, T, n] per 64, exact
        summ = np.matmul(bs32, mins[:, :, n0:n1]).reshape(n_super, 4, t, n)    # sum of mins * bsums, exact
        dd = (da.T[:, :, None] * p.d[n0:n1].T[:, None, :]).astype(np.float64)  # [Bs, T, n] f32 d_w*d_a
        dm = (da.T[:, :, None] * p.dmin[n0:n1].T[:, None, :]).astype(np.float64)
        for rows, per_sb in ((slice(0, t_gemm), True), (slice(t_gemm, t), False)):
            if rows.start == rows.stop:
                continue
            si, sm = sumi[:, :, rows], summ[:, :, rows]
            if not per_sb:                                              # int32 sums per super-block, then
                si = si.sum(axis=1, keepdims=True, dtype=np.float64).astype(np.float32)   # _mm256_cvtepi32_ps
                sm = sm.sum(axis=1, keepdims=True, dtype=np.float64).astype(np.float32)
            k = si.shape[1]                                             # fma steps per super-block
            p_si = si.astype(np.float64) * dd[:, None, rows]            # [Bs, k, rows, n] exact products
            p_sm = sm.astype(np.float64) * dm[:, None, rows]
            shape = (n_super * k,) + p_si.shape[2:]
            acc = _fma_chain(p_si.reshape(shape), np.empty(shape[1:], np.float32))
            acc_min = _fma_chain(p_sm.reshape(shape), np.empty(shape[1:], np.float32))
            out[rows, n0:n1] = acc - acc_min
    return out


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


def _q8_0_estimate(x: np.ndarray, p: Planes) -> tuple[np.ndarray, np.ndarray]:
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
    est, bound = _q8_0_estimate(x, p)
    out: list[tuple[np.ndarray, np.ndarray] | None] = []
    for r in range(t):
        if not (np.isfinite(x[r]).all() and np.isfinite(est[r]).all()):
            out.append(None)
            continue
        low = est[r] - bound[r]
        kth = np.partition(low, n_rows - k)[n_rows - k]                 # the k-th largest lower end
        cand = np.flatnonzero(est[r] + bound[r] >= kth)                 # ascending ids
        with OneBlasThread():
            vals = _dot_llama(x[r:r + 1], _rows_of(p, cand))[0]         # [C] llama order
        if not np.isfinite(vals).all():
            out.append(None)
            continue
        order = np.argsort(-vals, kind="stable")[:k]                    # ties keep the lower id
        out.append((cand[order].astype(np.int32), vals[order]))
    return out
