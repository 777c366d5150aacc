"""bloomery.engine.cpu.ops_math: the C library's expf, reproduced in numpy, against the library itself.

llama.cpp's CPU flash attention (its one-chunk path's every softmax step, the tiled path's
rescale) and the tails of its SIMD loops call expf from the C library; glibc's (2.27 and
later) is not correctly rounded, so ours must be the same function, not a better one. The
reference here is the library's own expf: called through a small C shim compiled with gcc
(one call per element, as llama.cpp makes them), or through ctypes when gcc is absent.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import shutil
import subprocess

import numpy as np
import pytest

from bloomery.engine.cpu import ops_math


def _glibc_version() -> tuple[int, int] | None:
    try:
        fn = ctypes.CDLL(None).gnu_get_libc_version
    except AttributeError:
        return None
    fn.restype = ctypes.c_char_p
    major, minor = fn().decode().split(".")[:2]
    return int(major), int(minor)


pytestmark = pytest.mark.skipif((_glibc_version() or (0, 0)) < (2, 27),
                                reason="the emulated expf is glibc's (2.27 and later)")

SHIM = r"""
#include <math.h>
void expf_array(const float *x, float *y, long n) { for (long i = 0; i < n; i++) y[i] = expf(x[i]); }
"""


@pytest.fixture(scope="module")
def libm_expf(tmp_path_factory):
    """The C library's expf over a float32 array."""
    if shutil.which("gcc"):
        d = tmp_path_factory.mktemp("expf_shim")
        (d / "shim.c").write_text(SHIM)
        # -fno-builtin: every element goes through the library's expf, never gcc's own folding
        subprocess.run(["gcc", "-O2", "-fno-builtin", "-shared", "-fPIC", "-o", str(d / "shim.so"),
                        str(d / "shim.c"), "-lm"], check=True)
        lib = ctypes.CDLL(str(d / "shim.so"))
        lib.expf_array.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long]

        def call(x):
            x = np.ascontiguousarray(x, np.float32)
            y = np.empty_like(x)
            lib.expf_array(x.ctypes.data, y.ctypes.data, x.size)
            return y
        return call
    libm = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
    libm.expf.argtypes, libm.expf.restype = [ctypes.c_float], ctypes.c_float
    return lambda x: np.array([libm.expf(float(v)) for v in np.asarray(x, np.float32)], np.float32)


def _same_bits(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))


def test_expf_libm_equals_the_library_bit_for_bit(libm_expf):
    rng = np.random.default_rng(20261201)
    n = 4_000_000 if shutil.which("gcc") else 200_000
    x = np.concatenate([
        rng.uniform(-104.5, 89.5, n // 2),                          # the whole finite range
        -rng.exponential(4.0, n // 4),                               # attention: s - M <= 0, mostly small
        rng.uniform(-1.0, 1.0, n // 4),
    ]).astype(np.float32)
    edges = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 88.72283, 88.722839, 88.72284, -103.972076,
                      -103.97208, -87.33654, -87.3366, 1e-30, -1e-30, 1e-45, -1e-45,
                      32.564632], np.float32)                       # r must round once (FMA build)
    x = np.concatenate([x, edges])
    want = libm_expf(x)
    got = ops_math.expf_libm(x)
    bad = ~_same_bits(got, want)
    assert not bad.any(), f"{int(bad.sum())} of {x.size} differ, e.g. x={x[bad][:4]} got={got[bad][:4]} want={want[bad][:4]}"
    # and it is not the correctly rounded exp: the test would not tell the two apart otherwise
    with np.errstate(over="ignore"):
        rounded = np.exp(x.astype(np.float64)).astype(np.float32)
    assert (~_same_bits(rounded, want)).sum() > 100


@pytest.mark.slow                    # every float of a band: ~8 s on 2 cores
def test_expf_libm_every_float_of_a_band(libm_expf):
    """Every float32 in [-2, -1) (2^23 inputs): the range attention's weights live in."""
    if not shutil.which("gcc"):
        pytest.skip("an exhaustive band needs the compiled shim")
    lo = np.float32(-1.0).view(np.uint32)
    bits = np.arange(lo, lo + (1 << 23), dtype=np.uint32)
    x = bits.view(np.float32)
    assert not (~_same_bits(ops_math.expf_libm(x), libm_expf(x))).any()


def test_v_expf_edges():
    """ggml_v_expf's special lanes: |n| > 192 gives 0 (n <= 0) or inf, so -inf gives 0."""
    x = np.array([-np.inf, -200.0, -100.0, 0.0, 1.0, 80.0, np.inf], np.float32)
    y = ops_math.v_expf(x)
    assert y[0] == 0 and y[1] == 0 and y[-1] == np.inf and y[3] == 1.0
    assert 0 < y[2] < 1e-42                                           # subnormal, from scalef
    np.testing.assert_allclose(y[4:6], np.exp(x[4:6].astype(np.float64)), rtol=3e-7)


def test_vec_soft_max_sums_chunks_in_float32_then_double():
    """ggml_vec_soft_max_f32: each 16-lane chunk reduced in float32 (_mm512_reduce_add_ps),
    the chunk sums and the tail's values added in double, in order."""
    rng = np.random.default_rng(3)
    x = rng.normal(0, 3, (5, 37)).astype(np.float32)
    y, total = ops_math.vec_soft_max(x, x.max(axis=-1))
    assert np.array_equal(y[:, :32], ops_math.v_expf(x[:, :32] - x.max(axis=-1, keepdims=True)))
    assert np.array_equal(y[:, 32:], ops_math.expf_libm(x[:, 32:] - x.max(axis=-1, keepdims=True)))
    for r in range(5):
        want = 0.0
        for c in (0, 16):
            v = y[r, c:c + 16]
            h8 = v[:8] + v[8:]
            h4 = h8[:4] + h8[4:]
            h2 = h4[:2] + h4[2:]
            want += float(h2[0] + h2[1])
        for i in range(32, 37):
            want += float(y[r, i])
        assert total[r] == want
