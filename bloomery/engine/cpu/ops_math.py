"""The exp functions llama.cpp's CPU backend calls, reproduced in numpy bit for bit.

llama.cpp's CPU ops use two different float32 exps, and neither is correctly rounded:

  * `expf` from the C library, for scalar code: the flash-attention rescales and
    softmax weights of the one-chunk path (every decode step, prompts under 64 rows),
    the tiled path's per-tile rescale, and the tails of the SIMD loops. On x86-64 Linux
    that is glibc's expf (2.27 and later: the symbol llama.cpp's libggml-cpu binds is
    expf@GLIBC_2.27). `expf_libm` below mirrors its algorithm: x * 32/ln2 split into
    k + r by the 1.5*2^52 shift (r rounded once, as the library's FMA build computes
    it), 2^(k/32) from a 32-entry table of 2^(i/32) with the exponent bits added, a
    cubic in r evaluated in float64, rounded once to float32.
    Its result is off by an ulp from the correctly rounded one for ~0.06% of inputs;
    the test (tests/test_ops_math.py) checks it against the library's own expf.
  * `ggml_v_expf`, for SIMD loops (softmax tiles, SwiGLU): AVX-512 build, 16 lanes.

Both are pure element-wise functions, so a numpy array of any shape goes in.
"""
from __future__ import annotations

import numpy as np

# --- the C library's expf (glibc >= 2.27, x86-64) -------------------------------------------
# The cubic's coefficients are the library's own (they are its data, read from libm.so.6 next
# to the 2^(i/32) table and confirmed against its expf over every float32 input; see the test).
_EXP_N = 32                                                  # table entries: 2^(i/32)
_INV_LN2_N = float.fromhex("0x1.71547652b82fep+5")          # 32 / ln 2
_SHIFT = float.fromhex("0x1.8p+52")                         # round to an integer in the add
_C0 = float.fromhex("0x1.c6af84b912394p-20")               # ~ (ln2/32)^3 / 6
_C1 = float.fromhex("0x1.ebfce50fac4f3p-13")               # ~ (ln2/32)^2 / 2
_C2 = float.fromhex("0x1.62e42ff0c52d6p-6")                # ~ ln2/32
# 2^(i/32) as float64 bits, less i << 47 so that adding k << 47 (k = 32*e + i) sets the exponent
_EXP_TAB = np.array([np.float64(2.0 ** (i / _EXP_N)).view(np.int64) - (i << 47) for i in range(_EXP_N)], np.int64)
_INV_HI = float(np.int64(np.float64(_INV_LN2_N).view(np.int64) & ~np.int64((1 << 24) - 1)).view(np.float64))
_INV_LO = _INV_LN2_N - _INV_HI                              # exact: the low 24 bits
_EXPF_OVER = np.float32(float.fromhex("0x1.62e42ep+6"))     # above this: +inf
_EXPF_UNDER = np.float32(-float.fromhex("0x1.9fe368p+6"))   # below this: +0


def expf_libm(x) -> np.ndarray:
    """glibc's expf(x) for a float32 array (nan -> nan, -inf -> 0, +inf -> inf)."""
    x = np.asarray(x, np.float32)
    shape, x = x.shape, x.reshape(-1)
    with np.errstate(invalid="ignore"):                         # nan passes through clip
        xd = np.clip(x, _EXPF_UNDER, _EXPF_OVER).astype(np.float64)
    xd[np.isnan(xd)] = 0.0
    z = _INV_LN2_N * xd
    kd = (z + _SHIFT) - _SHIFT                                  # nearest integer, ties to even
    # r = x*32/ln2 - k with one rounding: the library is built with FMA contraction (its
    # __expf_fma variant on this CPU). 32/ln2 = hi + lo with hi's 29 bits: x*hi and x*lo are
    # exact in float64, x*hi - k is exact (Sterbenz), so the one add left rounds once.
    r = (_INV_HI * xd - kd) + _INV_LO * xd                      # |r| <= 1/2
    ki = kd.astype(np.int64)
    s = (_EXP_TAB[ki & (_EXP_N - 1)] + (ki << 47)).view(np.float64)   # 2^(k/32)
    y = (_C0 * r + _C1) * (r * r) + (_C2 * r + 1.0)
    out = (y * s).astype(np.float32)
    out[x > _EXPF_OVER] = np.inf
    out[x < _EXPF_UNDER] = 0.0
    nan = np.isnan(x)
    if nan.any():
        out[nan] = x[nan]
    return out.reshape(shape)


# --- ggml_v_expf (ggml-cpu vec.h, the __m512 version of the AVX-512 build) ------------------

def fma32(a, b, c) -> np.ndarray:
    """float32 fma: the product is exact in float64, the sum rounds (twice in ~2^-29 of cases)."""
    return (np.asarray(a, np.float64) * b + c).astype(np.float32)


def _h(hex_literal: str) -> np.float32:
    return np.float32(float.fromhex(hex_literal))


def v_expf(x) -> np.ndarray:
    """ggml_v_expf for __m512: Cody-Waite split on 2^n, a degree-5 polynomial in f32 FMAs,
    scalef; |n| > 192 goes to 0 or inf (so -inf gives 0)."""
    x = np.asarray(x, np.float32)
    r = _h('0x1.8p23')
    with np.errstate(invalid="ignore", over="ignore"):
        z = fma32(x, _h('0x1.715476p+0'), r)
        n = z - r                                                       # round(x/ln2) as f32
        b = fma32(-n, _h('0x1.7f7d1cp-20'), fma32(-n, _h('0x1.62e4p-1'), x))
        u = b * b
        j = fma32(fma32(fma32(_h('0x1.0e4020p-7'), b, _h('0x1.573e2ep-5')), u,
                        fma32(_h('0x1.555e66p-3'), b, _h('0x1.fffdb6p-2'))),
                  u, fma32(_h('0x1.ffffecp-1'), b, np.float32(1.0)))
        big = np.abs(n) > 192
        res = np.ldexp(j, np.where(big, 0, n).astype(np.int32))         # _mm512_scalef_ps
    return np.where(big, np.where(n > 0, np.float32(np.inf), np.float32(0)), res).astype(np.float32)


def reduce_add16(v: np.ndarray) -> np.ndarray:
    """_mm512_reduce_add_ps over the last axis (16 lanes): halves 8, 4, 2, 1, as gcc's macro."""
    for half in (8, 4, 2, 1):
        v = v[..., :half] + v[..., half:2 * half]
    return v[..., 0]


def vec_dot_f32(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """ggml_vec_dot_f32 over the last axis, broadcast over the others (AVX-512 build): four 16-lane
    fma accumulators over 64-wide steps, (acc0 + acc2) + (acc1 + acc3), _mm512_reduce_add_ps, then
    the tail one fma at a time (each fma an exact product rounded once with the sum)."""
    a64 = np.asarray(a, np.float32).astype(np.float64)
    b = np.asarray(b, np.float32)
    n = a64.shape[-1]
    main = n - n % 64
    shape = np.broadcast_shapes(a64.shape[:-1], b.shape[:-1])
    acc = np.zeros(shape + (64,), np.float32)
    for c in range(0, main, 64):
        acc = (a64[..., c:c + 64] * b[..., c:c + 64] + acc).astype(np.float32)
    a4 = acc.reshape(shape + (4, 16))
    res = reduce_add16((a4[..., 0, :] + a4[..., 2, :]) + (a4[..., 1, :] + a4[..., 3, :]))
    for i in range(main, n):
        res = (a64[..., i] * b[..., i] + res).astype(np.float32)
    return res


def vec_soft_max(x: np.ndarray, max_: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml_vec_soft_max_f32 over the last axis (AVX-512 build): y = exp(x - max), ggml_v_expf on
    16-wide chunks and expf on the tail; returns (y float32, sum float64): each chunk's lanes
    added in float32 (_mm512_reduce_add_ps), chunk sums and tail values added in order in double."""
    d = (np.asarray(x, np.float32) - np.asarray(max_, np.float32)[..., None]).astype(np.float32)
    n = d.shape[-1]
    n_vec = n - n % 16
    y = np.empty_like(d)
    y[..., :n_vec] = v_expf(d[..., :n_vec])
    y[..., n_vec:] = expf_libm(d[..., n_vec:])
    total = np.zeros(d.shape[:-1], np.float64)
    for c in range(0, n_vec, 16):
        total += reduce_add16(y[..., c:c + 16])
    for i in range(n_vec, n):
        total += y[..., i]
    return y, total
