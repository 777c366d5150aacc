"""The K-quants: Q4_K, Q5_K and Q6_K weights (super-blocks of 256 with 6- or 8-bit sub-block
scales), with their vec_dot partner, Q8_K activations. Each super-block decoded to integers
(int_plane), the activations rounded as quantize_row_q8_K does (quantize_q8_K), the exact-sum
product (dot_planes), llama.cpp's float order (dot_llama: Q6_K's and Q5_K's tiled and lane paths,
the repacked Q4_K gemm/gemv) and the compiled kernels' call (c_mm).

Legend: N = weight rows (outputs), K = row length (inputs), T = activation rows,
Bs = super-blocks per row, S = sub-blocks per row, Q = elements per sub-block.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as QT

from bloomery.engine.quant.common import (MAX_TMP_ELEMS, Planes, QuantError, block_sums, exact_dot,
                                          f16_column, fma_chain, hsum8, set_scaled)

QK_K = 256
VEC_DOT_TYPE = {QT.Q4_K: QT.Q8_K, QT.Q5_K: QT.Q8_K, QT.Q6_K: QT.Q8_K}   # ggml-cpu.c type_traits_cpu
SUB_ELEMS = {QT.Q4_K: 32, QT.Q5_K: 32, QT.Q6_K: 16}                     # integers to an exact sum


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


def int_plane(ggml_type: int, blocks: np.ndarray) -> tuple[np.ndarray, dict]:
    """blocks [R, block_bytes] uint8 -> (ints [R, block_elems] int8, scale fields)."""
    qt = QT(ggml_type)
    if qt in (QT.Q4_K, QT.Q5_K):
        sc, mn = _k_scales(blocks[:, 4:16])
        qs = blocks[:, 16:144] if qt == QT.Q4_K else blocks[:, 48:176]
        qs = qs.reshape(-1, 4, 32)                                     # [R, chunk, 32]
        q = np.stack([qs & 0xF, qs >> 4], axis=2).reshape(-1, 256)      # sub-block 2c low, 2c+1 high
        if qt == QT.Q5_K:
            qh = blocks[:, 16:48]                                      # [R, 32]
            hb = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1   # [R, 8, 32]
            q = q | (hb.reshape(-1, 256) << 4)
        return q.astype(np.int8), {"d": f16_column(blocks, 0), "dmin": f16_column(blocks, 2), "sc": sc, "m": mn}
    if qt == QT.Q6_K:
        ql = blocks[:, 0:128].reshape(-1, 2, 2, 32)                   # [R, half, lo/hi 32, 32]
        qh = blocks[:, 128:192].reshape(-1, 2, 32)                    # [R, half, 32]
        sc = blocks[:, 192:208].view(np.int8).astype(np.int32)         # [R, 16]
        shifts = np.array([0, 2, 4, 6], dtype=np.uint8)
        hi = (qh[:, :, None, :] >> shifts[None, None, :, None]) & 3    # [R, half, 4, 32]
        lo = np.stack([ql[:, :, 0] & 0xF, ql[:, :, 1] & 0xF, ql[:, :, 0] >> 4, ql[:, :, 1] >> 4], axis=2)
        q = (lo | (hi << 4)).astype(np.int8).reshape(-1, 256) - 32
        return q, {"d": f16_column(blocks, 208), "sc": sc}
    raise QuantError(f"no exact integer path for {qt.name}")


def quantize_q8_K(x: np.ndarray, positive_wins: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x [T, K] float32 -> (q [T, K] float32 ints, d [T, K/256], bsums [T, K/16]).

    As quantize_row_q8_K_ref: the element of largest magnitude (first one on a
    tie) maps to -127, iscale = -127/max, nearest_int rounds half to even,
    values capped at 127; d = 1/iscale kept in f32. Rows where positive_wins [T]
    is set follow x86 ggml_quantize_mat_q8_K_4x8 instead (the repacked gemm's
    rows): on a +max / -max tie the positive one maps to -127, wherever it is.
    """
    t, k = x.shape
    xb = x.reshape(t, k // QK_K, QK_K)                                  # [T, B, 256]
    idx = np.abs(xb).argmax(axis=2)                                     # first max, as the ref's strict '>'
    vmax = np.take_along_axis(xb, idx[:, :, None], axis=2)[:, :, 0]     # [T, B] signed
    if positive_wins is not None and positive_wins.any():
        amax = np.abs(vmax)
        has_pos = (xb == amax[:, :, None]).any(axis=2) & positive_wins[:, None]   # [T, B]
        vmax = np.where(has_pos, amax, vmax)
    zero = vmax == 0
    safe = np.where(zero, np.float32(1), vmax).astype(np.float32)
    iscale = (np.float32(-127) / safe).astype(np.float32)               # [T, B]
    q = np.minimum(np.rint(iscale[:, :, None] * xb), 127)               # [T, B, 256]
    q[zero] = 0
    d = np.where(zero, np.float32(0), np.float32(1) / iscale).astype(np.float32)
    q = q.reshape(t, k).astype(np.float32)
    bsums = q.reshape(t, k // 16, 16).sum(axis=2)                       # [T, K/16] exact ints
    return q, d, bsums


def _combine(p: Planes, isum, da, bsums, n0: int, n1: int) -> np.ndarray:
    """Sub-block sums [S, T, n] -> [T, n] with the scales of rows n0..n1: the sub-block scales
    combine in float64 (exact integers, as llama.cpp's int32 accumulators), the super-block
    scales last in float32 as llama.cpp does; the mins of Q4_K / Q5_K against the bsums."""
    qt = QT(p.ggml_type)
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


def dot_planes(x: np.ndarray, p: Planes) -> np.ndarray:
    """x [T, K] float32 @ weight planes [N, K]^T -> [T, N] float32 as ggml_vec_dot_*_q8_K's sums."""
    set_scaled(p, False)
    qa, da, bsums = quantize_q8_K(x)
    return exact_dot(p, qa, da, bsums, _combine)


# --- llama.cpp's float order ----------------------------------------------------------------
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
#   Q5_K (not repacked on x86): below 8 columns ggml_vec_dot_q5_K_q8_K (AVX2): lanes as Q6_K's over
#     elements 64j+32h+4l..+3 of unsigned 5-bit quants times their scale, acc = fma(d, lane, acc),
#     hsum_float_8, plus a scalar summs = fma(-d_a*dmin_w, sum of mins * bsums, summs); from 8 the
#     tiled matmul: r = fma(-dmin_w, s2, f32(s1)*d_w), buf = fma(r, d_a, buf). Both checked bit for bit
#     against b11434's mul_mat (tools/ref/make_q5k_golden.py, tests/golden/logits/q5_k_mm.npz).
#   ggml_mul_mat_id (MoE experts): as above per expert's rows, except that the repacked Q4_K
#     runs its gemv row by row (dot_llama(per_row=True)).
# Every integer sum comes from one BLAS product (exact: every partial sum is an integer below
# 2^24); the float32 fma chains over super-blocks are emulated in float64 (common.fma_chain).
LLAMA_ORDER_TYPES = frozenset({QT.Q6_K, QT.Q5_K, QT.Q4_K})
C_TYPES = LLAMA_ORDER_TYPES              # the compiled kernels (kernels/cpu_lanes.c) take these


def c_takes(ggml_type: int, n_rows: int) -> bool:
    """The compiled kernels give this weight's llama-order product: Q4_K is repacked, so in
    llama.cpp's 8x8 order, only where its rows come in eights."""
    qt = QT(ggml_type)
    return qt in C_TYPES and (qt != QT.Q4_K or n_rows % 8 == 0)


def dot_llama(x: np.ndarray, p: Planes, per_row: bool = False) -> np.ndarray:
    """x [T, K] float32 @ planes [N, K]^T -> [T, N] in llama.cpp's CPU float order (the caller
    holds OneBlasThread). per_row: the product of ggml_mul_mat_id (an expert's rows): a repacked
    Q4_K weight runs its gemv row by row there, whatever the batch; Q6_K takes the tiled path
    from 8 rows per expert as in mul_mat, and so does Q5_K (not repacked on x86). Q4_K whose rows
    do not come in eights has no mirrored kernel: its exact sums."""
    qt = QT(p.ggml_type)
    if qt == QT.Q6_K:
        return _dot_q6_K_tiled(x, p) if x.shape[0] >= TILED_MIN_T else _dot_q6_K_lanes(x, p)
    if qt == QT.Q5_K:
        return _dot_q5_K_tiled(x, p) if x.shape[0] >= TILED_MIN_T else _dot_q5_K_lanes(x, p)
    if qt == QT.Q4_K and p.q.shape[1] % 8 == 0:
        return _dot_q4_K_repacked(x, p, gemv_only=per_row)
    return dot_planes(x, p)


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
        isum = block_sums(p.q[:, n0:n1], qa_b)                         # [S, T, n] exact, signed quants
        sc = p.sc[n0:n1].T.astype(np.float64)                           # [S, n]
        s1 = (isum * sc[:, None, :]).reshape(n_super, n_sub // n_super, t, n1 - n0).sum(axis=1)
        r = s1.astype(np.float32) * p.d[n0:n1].T[:, None, :]           # [Bs, T, n] f32(s1)*d_w, rounded
        prod = r.astype(np.float64) * da64                              # gcc contracts add(buf, mul(r, d_a))
        out[:, n0:n1] = fma_chain(prod, np.empty((t, n1 - n0), np.float32))
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
        out[:, n0:n1] = hsum8(fma_chain(lanes, np.empty(lanes.shape[1:], np.float32))).T
    return out


def _q5_K_terms(x: np.ndarray, p: Planes):
    """What both Q5_K paths read: the activations as Q8_K, each 32-element sub-block's mins times its
    activations' sum per super-block (an exact integer, [Bs, T, N]), and the weight's d and dmin [Bs, N]."""
    set_scaled(p, False)
    t = x.shape[0]
    n_super = p.d.shape[1]
    qa, da, bsums = quantize_q8_K(x)
    bs32 = bsums.reshape(t, n_super, 8, 2).sum(axis=3).astype(np.float64)            # [T, Bs, 8] exact
    summ = np.einsum("nbs,tbs->btn", p.m.reshape(-1, n_super, 8).astype(np.float64), bs32)   # [Bs, T, N]
    return qa, da, summ, p.d.T, p.dmin.T


def _q5_K_layout(p: Planes) -> np.ndarray:
    """Scale-times-quant weights [Bs, 8, N, 32] in the AVX2 kernel's lane order: lane l's 32 elements of a
    super-block are 64j + 32h + 4l + e (j < 4, h < 2, e < 4), sub-block 2j + h (each <= 63 * 31)."""
    if "q5_lanes" not in p.cache:
        n_sub, n_rows, _ = p.q.shape
        w = p.q * p.sc.T.astype(np.float32)[:, :, None]                  # [S, N, 32]
        w = w.reshape(n_sub // 8, 8, n_rows, 8, 4)                      # [Bs, sub, N, lane, e]
        p.cache["q5_lanes"] = np.ascontiguousarray(w.transpose(0, 3, 2, 1, 4).reshape(n_sub // 8, 8, n_rows, 32))
    return p.cache["q5_lanes"]


def _q5_K_product(x: np.ndarray, p: Planes, finish) -> np.ndarray:
    """Both Q5_K paths: per chunk of weight rows, the 8 lanes' exact sums of each super-block [Bs, 8, n, T]
    (scaled quants times activations, below 2^23 each), handed with the chunk's terms to finish(lanes,
    d_a [T, Bs], the mins' sums [Bs, n, T], d_w [Bs, n], dmin_w [Bs, n]) -> out rows [n, T]."""
    t = x.shape[0]
    n_sub, n_rows, _ = p.q.shape
    n_super = n_sub // 8
    w = _q5_K_layout(p)                                                 # [Bs, 8, N, 32]
    qa, da, summ, dw, dmw = _q5_K_terms(x, p)
    a = np.ascontiguousarray(qa.reshape(t, n_super, 4, 2, 8, 4).transpose(1, 4, 2, 3, 5, 0)
                             .reshape(n_super, 8, 32, t))               # [Bs, lane, 32, T]
    out = np.empty((t, n_rows), np.float32)
    step = max(8, MAX_TMP_ELEMS // max(1, n_super * 8 * t))
    for n0 in range(0, n_rows, step):
        n1 = min(n_rows, n0 + step)
        lanes = np.matmul(w[:, :, n0:n1], a)                            # [Bs, 8, n, T] exact
        s2 = summ[:, :, n0:n1].transpose(0, 2, 1).astype(np.float32).astype(np.float64)   # [Bs, n, T]
        out[:, n0:n1] = finish(lanes, da, s2, dw[:, n0:n1], dmw[:, n0:n1]).T
    return out


def _dot_q5_K_lanes(x: np.ndarray, p: Planes) -> np.ndarray:
    """ggml_vec_dot_q5_K_q8_K (x86 AVX2, fewer than 8 columns): per super-block 8 int32 lanes, lane l the
    scaled sums over elements 64j + 32h + 4l + e, acc_l = fma(f32(d_a*d_w), f32(lane), acc_l),
    hsum_float_8; the mins apart in a scalar, summs = fma(-f32(d_a*dmin_w), f32(sum of mins * bsums), summs)
    super-block after super-block (gcc fuses the source's summs += dmin * x); the output hsum + summs.
    Checked bit for bit against b11434's own mul_mat (ggml-cpu, AVX2 + AVX-512)."""
    def finish(lanes, da, s2, dw, dmw):
        d = (da.T[:, None, :] * dw[:, :, None]).astype(np.float64)      # [Bs, n, T] f32 d_a*d_w, rounded
        lanes = lanes.astype(np.float64) * d[:, None]                   # exact products
        acc = hsum8(fma_chain(lanes, np.empty(lanes.shape[1:], np.float32)))
        dmin = -(da.T[:, None, :] * dmw[:, :, None])                    # [Bs, n, T] f32
        prod = dmin.astype(np.float64) * s2
        return acc + fma_chain(prod, np.empty(prod.shape[1:], np.float32))
    return _q5_K_product(x, p, finish)


def _dot_q5_K_tiled(x: np.ndarray, p: Planes) -> np.ndarray:
    """ggml-cpu's tiled K-quant matmul for Q5_K (8 columns or more): per super-block s1 = the scaled
    sub-block sums (the lanes' total) and s2 = the mins times the bsums (exact ints), r = fma(-dmin_w,
    f32(s2), f32(s1)*d_w rounded), then buf = fma(r, d_a, buf) super-block after super-block (gcc fuses the
    source's add(buf, mul(r, d_a)), as for Q6_K)."""
    def finish(lanes, da, s2, dw, dmw):
        s1 = lanes.sum(axis=1, dtype=np.float64)                        # [Bs, n, T] exact
        r1 = (s1.astype(np.float32) * dw[:, :, None]).astype(np.float64)   # f32(s1)*d_w, rounded
        r = (r1 - dmw[:, :, None].astype(np.float64) * s2).astype(np.float32)   # the fnmadd, one rounding
        prod = r.astype(np.float64) * da.T[:, None, :].astype(np.float64)
        return fma_chain(prod, np.empty(prod.shape[1:], np.float32))
    return _q5_K_product(x, p, finish)


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
        isum = block_sums(p.q[:, n0:n1], qa_b).reshape(n_super, 4, 2, t, n)   # scaled sums per 32
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
            acc = fma_chain(p_si.reshape(shape), np.empty(shape[1:], np.float32))
            acc_min = fma_chain(p_sm.reshape(shape), np.empty(shape[1:], np.float32))
            out[rows, n0:n1] = acc - acc_min
    return out


def c_mm(lib, act, ggml_type: int, raw: np.ndarray, n_rows: int, per_row: bool, out: np.ndarray, nth: int) -> None:
    """The compiled kernels' product of act (a formats.CAct) with the stored blocks raw of an
    [N, K] Q6_K, Q5_K or Q4_K weight (rows in eights), into out [T, N]; per_row as dot_llama's."""
    t, k = act.t, act.k
    if ggml_type in (QT.Q6_K, QT.Q5_K):
        qa, da, bsums = act.q8_K(lib, 0)
        mm = lib.q6k_mm if ggml_type == QT.Q6_K else lib.q5k_mm
        mm(raw.ctypes.data, n_rows, k // QK_K, qa.ctypes.data, da.ctypes.data, bsums.ctypes.data, t,
           int(t >= TILED_MIN_T), out.ctypes.data, n_rows, nth)
    else:
        t_gemm = _q4_K_gemm_rows(t, per_row)
        qa, da, bsums = act.q8_K(lib, t_gemm)
        lib.q4k_mm(raw.ctypes.data, n_rows, k // QK_K, qa.ctypes.data, da.ctypes.data, bsums.ctypes.data, t,
                   t_gemm, out.ctypes.data, n_rows, nth)
