"""The compiled kernels of the numpy backend (kernels/cpu_lanes.c) give the numpy kernels' bits:
the five llama-order products and both flash-attention paths, on random inputs of many shapes."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import quants as gguf_quants

from bloomery.engine.cpu import kernels as cpu_kernels
from bloomery.engine.cpu import kv_cache
from bloomery.engine.quant import formats
from test_quant import random_blocks

needs_c = pytest.mark.skipif(cpu_kernels.lib() is None, reason=f"no compiled kernels: {cpu_kernels.status()}")


def _weight(qt, n, k, rng, zero_blocks=False):
    if qt in (QT.Q6_K, QT.Q5_K, QT.Q4_K):                              # gguf quantizes none: random blocks
        return random_blocks(qt, n, k, seed=int(rng.integers(1 << 30)))
    w = rng.standard_normal((n, k)).astype(np.float32) * rng.uniform(0.01, 4, (n, 1)).astype(np.float32)
    if zero_blocks:
        w[::3, 32:64] = 0                                              # blocks whose scale is 0
    return gguf_quants.quantize(w, qt).reshape(-1)


def _bits_equal(a, b) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


SHAPES_32 = [(1, 32, 1), (37, 96, 1), (64, 896, 3), (200, 896, 4), (130, 4864, 9), (513, 256, 70),
             (48, 96, 8), (40, 160, 21), (16, 896, 33)]   # from 8 rows and 16 weight rows: the tiles
SHAPES_256 = [(8, 256, 1), (24, 512, 3), (64, 1024, 4), (40, 256, 7), (16, 512, 8), (72, 768, 13), (96, 256, 64),
              (40, 512, 37), (24, 768, 33), (48, 256, 130), (32, 1024, 20)]   # from 20 rows: the tiles


@needs_c
@pytest.mark.parametrize("qt,n,k,t", [(q, *s) for q in (QT.Q8_0, QT.Q5_0) for s in SHAPES_32]
                         + [(q, *s) for q in (QT.Q6_K, QT.Q5_K, QT.Q4_K) for s in SHAPES_256])
def test_compiled_product_equals_numpy_kernel(qt, n, k, t):
    rng = np.random.default_rng(n * 1000 + t + int(qt))
    raw = _weight(qt, n, k, rng, zero_blocks=k >= 64)
    x = (rng.standard_normal((t, k)) * rng.uniform(1e-3, 50, (t, 1))).astype(np.float32)
    if t > 2:
        x[1, :32] = 0                                                  # an all-zero activation block
    want = formats.dot_llama(x, formats.decode_planes(qt, raw, n, k))
    assert _bits_equal(formats.dot_c(x, qt, raw, n, k), want)


@needs_c
@pytest.mark.parametrize("t", [1, 3, 4, 9])
def test_compiled_q4_K_expert_rows_take_the_gemv(t):
    """per_row (an expert's rows in mul_mat_id): the repacked Q4_K runs its gemv for every row."""
    rng = np.random.default_rng(t)
    raw = _weight(QT.Q4_K, 16, 512, rng)
    x = rng.standard_normal((t, 512)).astype(np.float32)
    want = formats.dot_llama(x, formats.decode_planes(QT.Q4_K, raw, 16, 512), per_row=True)
    assert _bits_equal(formats.dot_c(x, QT.Q4_K, raw, 16, 512, per_row=True), want)


@needs_c
def test_compiled_q8_0_takes_the_full_int8_range():
    """Stored quants of -128 (random bytes): the kernel's sign trick must still give the product."""
    rng = np.random.default_rng(11)
    raw = random_blocks(QT.Q8_0, 40, 256, seed=3)
    x = rng.standard_normal((5, 256)).astype(np.float32)
    assert (formats.decode_planes(QT.Q8_0, raw, 40, 256).q == -128).any()
    assert _bits_equal(formats.dot_c(x, QT.Q8_0, raw, 40, 256),
                       formats.dot_llama(x, formats.decode_planes(QT.Q8_0, raw, 40, 256)))


def test_q4_K_rows_not_in_eights_stay_off_the_compiled_kernel():
    assert formats.c_takes(QT.Q4_K, 16) and not formats.c_takes(QT.Q4_K, 12)
    assert formats.c_takes(QT.Q5_0, 7) and not formats.c_takes(QT.Q4_0, 8)


@needs_c
def test_compiled_product_refuses_blocks_of_the_wrong_size():
    rng = np.random.default_rng(5)
    raw = _weight(QT.Q5_0, 9, 128, rng)
    x = rng.standard_normal((1, 128)).astype(np.float32)
    with pytest.raises(formats.QuantError, match="expected 792 bytes, got 770"):
        formats.dot_c(x, QT.Q5_0, raw[:-22], 9, 128)


@needs_c
def test_numpy_backend_takes_the_compiled_kernel():
    from bloomery.engine.cpu.backend import NumpyOps, _compiled
    rng = np.random.default_rng(7)
    raw = _weight(QT.Q8_0, 48, 64, rng)
    ops = NumpyOps()
    w = ops.weight(QT.Q8_0, (64, 48), raw)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    assert _compiled(w)
    got = ops.matmul(x, w)
    from bloomery.engine.cpu.forms import form_bytes
    assert form_bytes(w) == 0                                          # the blocks are read in place: no form kept
    assert _bits_equal(got, formats.dot_llama(x, formats.decode_planes(QT.Q8_0, raw, 48, 64)))


@needs_c
@pytest.mark.parametrize("t,h,hkv,dh,pos0", [(1, 14, 2, 64, 0), (1, 14, 2, 64, 300), (5, 8, 8, 32, 17), (2, 4, 1, 128, 9),
                                             (63, 14, 2, 64, 10), (64, 14, 2, 64, 0), (100, 4, 1, 128, 70),
                                             (70, 2, 2, 80, 3), (3, 2, 1, 80, 5), (65, 4, 2, 256, 1),
                                             (130, 14, 2, 64, 0), (200, 4, 2, 64, 250)])
def test_compiled_attention_equals_numpy_paths(t, h, hkv, dh, pos0):
    rng = np.random.default_rng(t * 7 + pos0)
    n_kv = pos0 + t
    q = (rng.standard_normal((t, h, dh)) * 2).astype(np.float32)
    k = rng.standard_normal((n_kv, hkv, dh)).astype(np.float16)
    v = rng.standard_normal((n_kv, hkv, dh)).astype(np.float16)
    scale = np.float32(1 / np.sqrt(dh))
    tiled = t >= kv_cache.FA_TILE_Q
    want = (kv_cache._attend_f32 if tiled else kv_cache._attend_f16)(q, k, v, pos0, scale)
    assert _bits_equal(kv_cache._attend_c(q, k, v, pos0, scale, tiled=tiled), want)


@needs_c
def test_compiled_isa_is_the_one_chosen():
    import os
    choice = os.environ.get("BLOOMERY_CPU_KERNELS", "on")
    flags = cpu_kernels._cpu_flags().split()
    want = 0
    if choice != "portable" and "avx2" in flags and "fma" in flags:
        want = 1
        if choice != "avx2" and {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= set(flags):
            want = 2
    assert cpu_kernels.lib().lanes_isa() == want
    assert cpu_kernels.status().endswith(f"({cpu_kernels.ISA_NAMES[want]})")


def test_kernels_off_by_choice(monkeypatch):
    monkeypatch.setenv("BLOOMERY_CPU_KERNELS", "off")
    lib, why = cpu_kernels._load()
    assert lib is None and "BLOOMERY_CPU_KERNELS=off" in why


def test_no_compiler_falls_back_by_name(monkeypatch, tmp_path):
    monkeypatch.setenv("BLOOMERY_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_kernels, "_compiler", lambda: None)
    lib, why = cpu_kernels._load()
    assert lib is None and "no C compiler" in why


def test_a_failed_build_is_named_and_leaves_no_library(monkeypatch, tmp_path):
    monkeypatch.setenv("BLOOMERY_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_kernels, "_compiler", lambda: "/bin/false")
    lib, why = cpu_kernels._load()
    assert lib is None and "did not build" in why
    assert not list((tmp_path / "kernels").glob("*.so"))


@needs_c
@pytest.mark.parametrize("shape", [(1, 4864), (7, 37), (300, 1000)])
def test_compiled_swiglu_equals_numpy(shape, monkeypatch):
    from bloomery.engine.cpu.backend import NumpyOps
    rng = np.random.default_rng(shape[0])
    g = (rng.standard_normal(shape) * 12).astype(np.float32)
    up = rng.standard_normal(shape).astype(np.float32)
    g.flat[:6] = [0.0, -0.0, 100.0, -100.0, 88.7, -89.0]              # exp's edges: overflow, underflow
    edges = [150.0, -150.0, 133.0, -133.0, 103.0, 104.0, 126.0, 127.0, 128.0, -87.5, np.nan, np.inf, -np.inf, 1e-30]
    g.flat[16:16 + len(edges)] = edges    # in the 16-wide chunks (AVX-512 lanes): 2^n past 192, subnormal, NaN
    got = NumpyOps().swiglu(g, up)
    monkeypatch.setattr(cpu_kernels, "lib", lambda: None)              # the numpy form
    assert _bits_equal(got, NumpyOps().swiglu(g, up))


@pytest.mark.slow                    # a second build of the kernels: 4-12 s on 2 cores
@needs_c
@pytest.mark.parametrize("isa", ["portable", "avx2"])
def test_portable_build_gives_the_same_bits(tmp_path, isa):
    """The plain C loops (what a machine without AVX2 builds), and the AVX2 loops on a machine
    with AVX-512, pass the same comparisons."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, BLOOMERY_CPU_KERNELS=isa, BLOOMERY_CACHE=str(tmp_path))
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
                          "-k", "compiled and not portable", "-x", "-rA"], env=env, capture_output=True, text=True,
                         timeout=600, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert " passed" in res.stdout and "skipped" not in res.stdout.splitlines()[-1]
    assert "PASSED tests/test_cpu_kernels.py::test_compiled_isa_is_the_one_chosen" in res.stdout   # it ran that build


@needs_c
@pytest.mark.parametrize("qt", [QT.Q8_0, QT.Q5_0, QT.Q6_K, QT.Q5_K, QT.Q4_K])
def test_non_finite_rows_give_nan_rows_as_numpy(qt):
    rng = np.random.default_rng(2)
    raw = _weight(qt, 16, 256, rng)
    x = rng.standard_normal((4, 256)).astype(np.float32)
    x[1, 7], x[2, 200] = np.nan, -np.inf
    want = formats.dot_llama(x, formats.decode_planes(qt, raw, 16, 256))
    got = formats.dot_c(x, qt, raw, 16, 256)
    assert np.isnan(want[1:3]).all() and np.isnan(got[1:3]).all()
    assert _bits_equal(got[[0, 3]], want[[0, 3]])


@needs_c
@pytest.mark.parametrize("t,k", [(1, 256), (5, 1024), (9, 4864)])
def test_compiled_activation_quantizers_equal_numpy(t, k):
    """quant_q8_0 / quant_q8_K give q8_0.py's and k_quants.py's integers, scales and bsums, ties included."""
    from bloomery.engine.quant.k_quants import quantize_q8_K
    from bloomery.engine.quant.q8_0 import quantize_q8_0
    rng = np.random.default_rng(t * k)
    x = (rng.standard_normal((t, k)) * rng.uniform(1e-3, 80, (t, 1))).astype(np.float32)
    x[0, :32] = 0                                                      # an all-zero block
    x[-1, 3], x[-1, 100] = 7.5, -7.5                                   # a +max / -max tie in a Q8_K block
    x[-1, :256] = np.clip(x[-1, :256], -7.5, 7.5)
    x[0, 40:48] = np.float32(127 / 2) / 127 * np.arange(8)              # halves: round to even
    act = formats.CAct(x)
    q, d = act.q8_0(cpu_kernels.lib())
    wq, wd = quantize_q8_0(x)
    assert np.array_equal(q, wq.astype(np.int8)) and _bits_equal(d, wd)
    for t_gemm in (0, t - t % 4):
        q, d, bs = act.q8_K(cpu_kernels.lib(), t_gemm)
        wq, wd, wbs = quantize_q8_K(x, positive_wins=np.arange(t) < t_gemm)
        assert np.array_equal(q, wq.astype(np.int8)) and _bits_equal(d, wd) and np.array_equal(bs, wbs.astype(np.int16))


@needs_c
@pytest.mark.parametrize("n_rot,sections", [(64, None), (32, None), (64, (11, 11, 10, 0))])
def test_compiled_rope_equals_numpy(n_rot, sections, monkeypatch):
    from bloomery.engine.cpu.backend import NumpyOps
    rng = np.random.default_rng(n_rot)
    x = (rng.standard_normal((6, 7, 64)) * 30).astype(np.float32)
    pos = np.array([0, 1, 5, 300, 4095, 70000], np.int32)
    got = NumpyOps().rope_neox(x, pos, n_rot, 1e6, sections)
    assert np.array_equal(got[..., n_rot:], x[..., n_rot:])            # past n_rot: left as it is
    monkeypatch.setattr(cpu_kernels, "lib", lambda: None)              # the numpy form
    assert _bits_equal(got, NumpyOps().rope_neox(x, pos, n_rot, 1e6, sections))


@needs_c
@pytest.mark.parametrize("shape", [(1, 896), (5, 7, 64), (3, 4864)])
def test_compiled_rms_norm_sums_in_order(shape):
    """ggml's sum of squares: f32 squares added in double, in order (np.add.accumulate's order)."""
    from bloomery.engine.cpu.backend import NumpyOps
    rng = np.random.default_rng(len(shape))
    x = (rng.standard_normal(shape) * rng.uniform(1e-3, 1e3, shape[:-1] + (1,))).astype(np.float32)
    w = rng.standard_normal(shape[-1]).astype(np.float32)
    got = NumpyOps().rms_norm(x, w, 1e-6)
    sq = np.add.accumulate((x * x).astype(np.float64), axis=-1)[..., -1:]
    scale = np.float32(1) / np.sqrt((sq / shape[-1]).astype(np.float32) + np.float32(1e-6))
    assert _bits_equal(got, (x * scale) * w)


def test_spin_rounds_read_and_refused(monkeypatch):
    monkeypatch.delenv("BLOOMERY_CPU_SPIN", raising=False)
    assert cpu_kernels.spin_rounds() == 500
    monkeypatch.setenv("BLOOMERY_CPU_SPIN", "0")
    assert cpu_kernels.spin_rounds() == 0
    for bad in ("-1", "fast"):
        monkeypatch.setenv("BLOOMERY_CPU_SPIN", bad)
        with pytest.raises(ValueError, match="BLOOMERY_CPU_SPIN"):
            cpu_kernels.spin_rounds()


@needs_c
@pytest.mark.parametrize("n,k,t", [(7, 100, 1), (64, 1024, 1), (8, 1000, 3), (6, 64, 3), (12, 17, 5),
                                   (128, 2048, 16), (64, 1024, 512), (3, 200, 2)])
def test_compiled_f32_product_equals_llamas_order(n, k, t):
    """An F32 weight's product (the MoE router): f32_mm against quant/floats.dot_f32_llama, bit for bit,
    through both of llama's orders (ggml_vec_dot_f32 for one row or N % 4 != 0, tinyBLAS otherwise)
    and the numpy backend's matmul."""
    from bloomery.engine.cpu.backend import NumpyOps, NumpyWeight
    rng = np.random.default_rng(n * 1000 + k + t)
    w = (rng.standard_normal((n, k)) * rng.uniform(0.01, 4, (n, 1))).astype(np.float32)
    x = rng.standard_normal((t, k)).astype(np.float32)
    out = np.full((t, n), np.nan, np.float32)
    cpu_kernels.lib().f32_mm(x.ctypes.data, t, k, w.ctypes.data, n, out.ctypes.data, 2)
    assert _bits_equal(out, formats.dot_f32_llama(x, w))
    weight = NumpyWeight(QT.F32, (k, n), w.reshape(-1).view(np.uint8))
    assert _bits_equal(NumpyOps().matmul(x, weight), out)
