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

import os
from dataclasses import dataclass, field

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
    cache: dict = field(default_factory=dict, repr=False)   # lazily built kernel-order layouts


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
    with _OneBlasThread():   # tiny GEMMs: OpenBLAS's thread hand-off would cost far more than the work
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
# A float32 fma is emulated in float64: the product is exact there (< 53 bits), only the sum
# rounds twice, which differs from one rounding in about 2^-29 of the inexact cases.
LLAMA_ORDER_TYPES = frozenset({QT.Q8_0, QT.Q5_0, QT.Q6_K, QT.Q4_K})
# True (the lever BLOOMERY_KERNEL_ORDER=on): the four types above sum in llama.cpp's kernel
# order, bit for bit, at about 2.5x the time of dot_planes on this machine. False (default):
# every batch size takes dot_planes' one order (exact integer sums, float order our own), whose
# final logits sit within ~0.5 of llama.cpp's; tests that compare batch shapes use it, since
# llama.cpp's kernels, so ours, give a prompt's logits differently at T=1, T<8 and T>=8.
KERNEL_ORDER = os.environ.get("BLOOMERY_KERNEL_ORDER", "off").lower() in ("on", "1", "true")


def _find_blas_threads_local():
    """numpy's OpenBLAS `openblas_set_num_threads_local` (None if numpy uses another BLAS)."""
    import ctypes
    import glob
    libs = os.path.join(os.path.dirname(np.__file__), os.pardir, "numpy.libs")
    for path in glob.glob(os.path.join(libs, "*openblas*")):
        try:
            fn = ctypes.CDLL(path).openblas_set_num_threads_local
        except (OSError, AttributeError):
            continue
        fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
        return fn
    return None


_BLAS_THREADS_LOCAL = _find_blas_threads_local()


class _OneBlasThread:
    """The lane kernels run hundreds of tiny GEMMs ([n, 32] @ [32, 8T]); OpenBLAS's thread
    hand-off costs ~100x their work on a busy 2-core machine, so run them on this thread."""

    def __enter__(self):
        self.prev = _BLAS_THREADS_LOCAL(1) if _BLAS_THREADS_LOCAL else None

    def __exit__(self, *exc):
        if self.prev is not None:
            _BLAS_THREADS_LOCAL(self.prev)


def _fma_step(d, v, acc32: np.ndarray, tmp64: np.ndarray) -> None:
    """acc32 = fma(d, v, acc32) in float32 with one product and (almost always) one rounding."""
    np.multiply(d, v, out=tmp64, dtype=np.float64)
    np.add(tmp64, acc32, out=tmp64)
    np.copyto(acc32, tmp64, casting="same_kind")


def _hsum8(a: np.ndarray) -> np.ndarray:
    """hsum_float_8 over axis 0 (8 lanes): 128-bit halves, then movehl, then the last pair."""
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))


def dot_llama(x: np.ndarray, p: Planes) -> np.ndarray:
    """x [T, K] float32 @ planes [N, K]^T -> [T, N] in llama.cpp's CPU float order."""
    with _OneBlasThread():
        return _dot_llama(x, p)


def _dot_llama(x: np.ndarray, p: Planes) -> np.ndarray:
    qt = QT(p.ggml_type)
    if qt in (QT.Q8_0, QT.Q5_0):
        return _dot_q8_0_lanes(x, p)
    if qt == QT.Q6_K:
        return _dot_q6_K_tiled(x, p) if x.shape[0] >= TILED_MIN_T else _dot_q6_K_lanes(x, p)
    if qt == QT.Q4_K and p.q.shape[1] % 8 == 0:
        return _dot_q4_K_repacked(x, p)
    return dot_planes(x, p)                                             # no mirrored kernel: exact sums


def _dot_q8_0_lanes(x: np.ndarray, p: Planes) -> np.ndarray:
    t = x.shape[0]
    n_blocks, n_rows, _ = p.q.shape
    qa, da = quantize_q8_0(x)
    qa_b = qa.reshape(t, n_blocks, 8, 4).transpose(1, 2, 3, 0)          # [B, lane, 4, T]
    a_bd = np.zeros((n_blocks, 8, 4, 8, t), np.float32)                 # block-diagonal per lane
    for lane in range(8):
        a_bd[:, lane, :, lane, :] = qa_b[:, lane]
    a_bd = a_bd.reshape(n_blocks, 32, 8 * t)                            # [B, 32, 8T]
    out = np.empty((t, n_rows), np.float32)
    step = max(8, MAX_TMP_ELEMS // max(1, 8 * t))
    for n0 in range(0, n_rows, step):
        n1 = min(n_rows, n0 + step)
        d = p.d[n0:n1].T[:, :, None] * da.T[:, None, :]                 # [B, n, T] f32 d_w*d_a
        acc = np.zeros((n1 - n0, 8, t), np.float32)                     # [n, 8, T]
        lanes = np.empty((n1 - n0, 8 * t), np.float32)
        tmp = np.empty(acc.shape, np.float64)
        for b in range(n_blocks):                                       # p.q[b, n0:n1] is contiguous: BLAS
            np.dot(p.q[b, n0:n1], a_bd[b], out=lanes)                   # [n, 8T] exact ints
            _fma_step(d[b][:, None, :], lanes.reshape(n1 - n0, 8, t), acc, tmp)
        out[:, n0:n1] = _hsum8(acc.transpose(1, 0, 2)).T                # [T, n]
    return out


TILED_MIN_T = 8          # ggml_tiled_min_batch: the tiled path takes batches of 8+ columns


def _dot_q6_K_tiled(x: np.ndarray, p: Planes) -> np.ndarray:
    t = x.shape[0]
    n_sub, n_rows, sub = p.q.shape
    n_super = p.d.shape[1]
    qa, da, _ = quantize_q8_K(x)
    qa_b = np.ascontiguousarray(qa.reshape(t, n_sub, sub).transpose(1, 0, 2))   # [S, T, 16]
    out = np.empty((t, n_rows), np.float32)
    step = max(8, MAX_TMP_ELEMS // max(1, n_sub * t))
    for n0 in range(0, n_rows, step):
        n1 = min(n_rows, n0 + step)
        isum = _block_sums(p.q[:, n0:n1], qa_b)                         # [S, T, n] exact, signed quants
        sc = p.sc[n0:n1].T.astype(np.float64)                           # [S, n]
        s1 = (isum * sc[:, None, :]).reshape(n_super, n_sub // n_super, t, n1 - n0).sum(axis=1)
        r = s1.astype(np.float32) * p.d[n0:n1].T[:, None, :]           # [Bs, T, n] f32(s1)*d_w, rounded
        acc = np.zeros((t, n1 - n0), np.float32)
        tmp = np.empty(acc.shape, np.float64)
        for i in range(n_super):
            _fma_step(r[i], da[:, i:i + 1], acc, tmp)                  # gcc contracts add(buf, mul(r, d_a))
        out[:, n0:n1] = acc
    return out


def _q6_K_layout(p: Planes) -> np.ndarray:
    """Scale-times-unsigned-quant weights [Bs, 2, 8, N, 16] in the AVX2 kernel's lane order."""
    if "q6_lanes" not in p.cache:
        n_sub, n_rows, _ = p.q.shape
        n_super = n_sub // 16
        w = (p.q.transpose(1, 0, 2) + 32) * p.sc.astype(np.float32)[:, :, None]   # [N, S, 16] <= 8064
        w = w.reshape(n_rows, n_super, 2, 4, 8, 4)                      # [N, Bs, j, k, lane, e]
        p.cache["q6_lanes"] = np.ascontiguousarray(
            w.transpose(1, 2, 4, 0, 3, 5).reshape(n_super, 2, 8, n_rows, 16))
    return p.cache["q6_lanes"]


def _dot_q6_K_lanes(x: np.ndarray, p: Planes) -> np.ndarray:
    t = x.shape[0]
    n_sub, n_rows, _ = p.q.shape
    n_super = n_sub // 16
    w = _q6_K_layout(p)
    qa, da, bsums = quantize_q8_K(x)
    a = qa.reshape(t, n_super, 2, 4, 8, 4).transpose(1, 2, 4, 3, 5, 0).reshape(n_super, 2, 8, 16, t)
    bs = bsums.reshape(t, n_super, 8, 2).astype(np.float64)            # [T, Bs, lane, 2]
    sc = p.sc.reshape(n_rows, n_super, 8, 2).astype(np.float64)         # [N, Bs, lane, 2]
    out = np.empty((t, n_rows), np.float32)
    step = max(8, MAX_TMP_ELEMS // max(1, n_super * 16 * t))
    for n0 in range(0, n_rows, step):
        n1 = min(n_rows, n0 + step)
        half = np.matmul(w[:, :, :, n0:n1], a)                          # [Bs, 2, 8, n, T] exact (< 2^24)
        lanes = half[:, 0].astype(np.float64) + half[:, 1]              # [Bs, 8, n, T] exact ints
        lanes -= 32 * np.einsum("nilp,tilp->ilnt", sc[n0:n1], bs)
        lanes32 = lanes.astype(np.float32)                              # _mm256_cvtepi32_ps
        d = da.T[:, None, :] * p.d[n0:n1].T[:, :, None]      # [Bs, n, T] f32
        acc = np.zeros((8, n1 - n0, t), np.float32)
        tmp = np.empty(acc.shape, np.float64)
        for i in range(n_super):
            _fma_step(d[i][None], lanes32[i], acc, tmp)
        out[:, n0:n1] = _hsum8(acc).T
    return out


def _dot_q4_K_repacked(x: np.ndarray, p: Planes) -> np.ndarray:
    """gemm rows (the first T - T%4) fma once per 64 elements, gemv rows once per super-block."""
    t = x.shape[0]
    n_sub, n_rows, sub = p.q.shape
    n_super = p.d.shape[1]
    t_gemm = t - t % 4                                                  # forward_mul_mat_one_chunk's split
    qa, da, bsums = quantize_q8_K(x, positive_wins=np.arange(t) < t_gemm)
    qa_b = np.ascontiguousarray(qa.reshape(t, n_sub, sub).transpose(1, 0, 2))   # [S, T, Q]
    bs32 = bsums.reshape(t, n_super, 4, 2, 2).sum(axis=4).astype(np.float64)    # [T, Bs, sb, 2]
    out = np.empty((t, n_rows), np.float32)
    step = max(8, MAX_TMP_ELEMS // max(1, n_sub * t))
    for n0 in range(0, n_rows, step):
        n1 = min(n_rows, n0 + step)
        n = n1 - n0
        isum = _block_sums(p.q[:, n0:n1], qa_b)                         # [S, T, n] exact
        sc = p.sc[n0:n1].T.astype(np.float64)                           # [S, n]
        sumi = (isum * sc[:, None, :]).reshape(n_super, 4, 2, t, n).sum(axis=2)   # [Bs, sb, T, n] exact
        m = p.m[n0:n1].reshape(n, n_super, 4, 2).astype(np.float64)
        summ = np.einsum("nsbj,tsbj->sbtn", m, bs32)                    # [Bs, sb, T, n] exact
        dd = da.T[:, :, None] * p.d[n0:n1].T[:, None, :]                # [Bs, T, n] f32 d_w*d_a
        dm = da.T[:, :, None] * p.dmin[n0:n1].T[:, None, :]
        for rows, per_sb in ((slice(0, t_gemm), True), (slice(t_gemm, t), False)):
            if rows.start == rows.stop:
                continue
            si, sm = sumi[:, :, rows], summ[:, :, rows]
            if not per_sb:
                si, sm = si.sum(axis=1, keepdims=True), sm.sum(axis=1, keepdims=True)
            si32, sm32 = si.astype(np.float32), sm.astype(np.float32)   # _mm256_cvtepi32_ps
            acc = np.zeros(si32.shape[2:], np.float32)                  # [rows, n]
            acc_min = np.zeros_like(acc)
            tmp = np.empty(acc.shape, np.float64)
            for i in range(n_super):
                for j in range(si32.shape[1]):
                    _fma_step(si32[i, j], dd[i, rows], acc, tmp)
                    _fma_step(sm32[i, j], dm[i, rows], acc_min, tmp)
            out[rows, n0:n1] = acc - acc_min
    return out
