"""bloomery.engine.quant: block decoding and llama.cpp's activation quantization."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

from bloomery.engine.quant import formats, k_quants, q8_0, threads

# byte offsets of each type's f16 scale fields inside a block
F16_FIELDS = {QT.Q8_0: [0], QT.Q4_0: [0], QT.Q5_0: [0], QT.Q4_K: [0, 2], QT.Q5_K: [0, 2], QT.Q6_K: [208]}
BLOCK_TYPES = sorted(F16_FIELDS, key=int)


def random_blocks(qt: QT, n_rows: int, n_cols: int, seed: int = 0) -> np.ndarray:
    """Random bytes for every quant, with finite, modest f16 scales."""
    rng = np.random.default_rng(seed)
    elems, nbytes = GGML_QUANT_SIZES[qt]
    raw = rng.integers(0, 256, size=(n_rows * n_cols // elems, nbytes), dtype=np.uint8)
    for off in F16_FIELDS[qt]:
        d = rng.uniform(1e-3, 2e-2, size=raw.shape[0]).astype(np.float16)
        raw[:, off:off + 2] = d.view(np.uint8).reshape(-1, 2)
    return raw.reshape(-1)


@pytest.mark.parametrize("qt", BLOCK_TYPES, ids=lambda t: t.name)
def test_planes_rebuild_gguf_dequantize_exactly(qt):
    raw = random_blocks(qt, 6, 512)
    ref = formats.dequantize(qt, raw, 6, 512)                         # gguf's reference numpy code
    got = formats.planes_to_float(formats.decode_planes(qt, raw, 6, 512))
    assert np.array_equal(got, ref), f"{qt.name}: max diff {np.abs(got - ref).max()}"


@pytest.mark.parametrize("qt", BLOCK_TYPES, ids=lambda t: t.name)
def test_dot_is_exact_block_sums(qt):
    """dot_planes equals float64 math on the quantized activation and the dequantized weight."""
    n_rows, n_cols = 40, 512
    raw = random_blocks(qt, n_rows, n_cols, seed=1)
    w = formats.dequantize(qt, raw, n_rows, n_cols).astype(np.float64)
    x = np.random.default_rng(2).standard_normal((3, n_cols)).astype(np.float32)
    if formats.VEC_DOT_TYPE[qt] == QT.Q8_0:
        qa, da = q8_0.quantize_q8_0(x)
        xa = (qa.reshape(3, -1, 32) * da[:, :, None]).reshape(3, -1)
    else:
        qa, da, _ = k_quants.quantize_q8_K(x)
        xa = (qa.reshape(3, -1, 256) * da[:, :, None]).reshape(3, -1)
    want = xa.astype(np.float64) @ w.T                                  # [T, N]
    p = formats.decode_planes(qt, raw, n_rows, n_cols)
    for t in (1, 3):                                                    # the GEMV and the GEMM branches
        got = formats.dot_planes(x[:t], p)
        scale = np.abs(want[:t]).max()
        assert np.abs(got - want[:t]).max() <= 2e-6 * scale, f"{qt.name} T={t}"


def test_q8_0_rounds_half_to_even_with_127_over_amax():
    # amax 127 -> multiplier exactly 1: the halves show the rounding mode (AVX _mm256_round_ps)
    x = np.zeros((1, 32), np.float32)
    x[0, :5] = [127.0, 0.5, 1.5, 2.5, -2.5]
    q, d = q8_0.quantize_q8_0(x)
    assert q[0, :5].tolist() == [127, 0, 2, 2, -2]
    assert d[0, 0] == np.float32(np.float16(1.0))
    # the scale is stored as f16: amax/127 rounded to half precision
    y = np.full((1, 32), 0.3, np.float32)
    _, d = q8_0.quantize_q8_0(y)
    assert d[0, 0] == np.float32(np.float16(np.float32(0.3) / np.float32(127)))
    assert d[0, 0] != np.float32(0.3) / np.float32(127)


def test_q8_0_zero_block():
    q, d = q8_0.quantize_q8_0(np.zeros((2, 64), np.float32))
    assert not q.any() and not d.any()


def test_q8_K_largest_magnitude_maps_to_minus_127():
    x = np.random.default_rng(3).uniform(-1, 1, (1, 256)).astype(np.float32)
    x[0, 10] = 2.0
    q, d, bsums = k_quants.quantize_q8_K(x)
    assert q[0, 10] == -127 and d[0, 0] == np.float32(1) / (np.float32(-127) / np.float32(2.0))
    assert np.array_equal(bsums[0], q[0].reshape(16, 16).sum(axis=1))
    x[0, 10] = -2.0                                                     # negative max: it still maps to -127
    q, d, _ = k_quants.quantize_q8_K(x)
    assert q[0, 10] == -127 and d[0, 0] > 0


def test_q8_K_first_max_wins_and_caps_at_127():
    x = np.zeros((1, 256), np.float32)
    x[0, 3], x[0, 7] = -1.0, 1.0                                        # tie on magnitude: the first one
    q, _, _ = k_quants.quantize_q8_K(x)
    assert q[0, 3] == -127 and q[0, 7] == 127


def test_bad_sizes_are_named():
    raw = np.zeros(33, np.uint8)
    with pytest.raises(formats.QuantError, match="expected 34 bytes, got 33"):
        formats.decode_planes(QT.Q8_0, raw, 1, 32)
    with pytest.raises(formats.QuantError, match="row length 48 is not a multiple of the block size 32"):
        formats.dequantize(QT.Q8_0, np.zeros(34, np.uint8), 1, 48)


def test_q8_K_mat_4x8_rows_let_the_positive_max_win_a_tie():
    # ggml_quantize_mat_q8_K_4x8 (the repacked Q4_K gemm's rows) maps a +amax element to -127
    # when there is one anywhere; quantize_row_q8_K_ref takes the first max's sign
    x = np.zeros((2, 256), np.float32)
    x[:, 3], x[:, 9], x[:, 20] = -2.0, 2.0, 1.0
    q_ref, d_ref, _ = k_quants.quantize_q8_K(x)
    q_mat, d_mat, _ = k_quants.quantize_q8_K(x, positive_wins=np.array([True, False]))
    assert q_ref[0, [3, 9, 20]].tolist() == [-127, 127, 64] and d_ref[0, 0] > 0
    assert q_mat[0, [3, 9, 20]].tolist() == [127, -127, -64] and d_mat[0, 0] == -d_ref[0, 0]
    assert np.array_equal(q_mat[1], q_ref[1]) and d_mat[1, 0] == d_ref[1, 0]     # row 1: the ref rule


# --- llama.cpp's float order ---------------------------------------------------------------

def _rn32(v) -> np.float32:
    """An exact rational rounded once to float32 (nearest, ties to even): a true fma's rounding."""
    from fractions import Fraction
    v = Fraction(v)
    if v == 0:
        return np.float32(0)
    sign, a = (-1 if v < 0 else 1), abs(v)
    e = a.numerator.bit_length() - a.denominator.bit_length() - 24
    while a / Fraction(2) ** e >= 2 ** 24:
        e += 1
    while a / Fraction(2) ** e < 2 ** 23:
        e -= 1
    m = a / Fraction(2) ** e
    q, r = divmod(m.numerator, m.denominator)
    if 2 * r > m.denominator or (2 * r == m.denominator and q % 2):
        q += 1
    return np.float32(sign * q * 2.0 ** e)


def _q8_0_family_reference(x: np.ndarray, qt, raw: np.ndarray, n_rows: int) -> np.ndarray:
    """ggml_vec_dot_q{5,8}_0_q8_0 (AVX2/AVX-512) written out: per block d = d_w*d_a in f32, eight
    integer lane sums of four products, acc_l = fma(d, lane_l, acc_l) rounded once, then
    hsum_float_8; plain Python, from gguf's dequantizer for the integers."""
    from fractions import Fraction
    t, k = x.shape
    ref = formats.dequantize(qt, raw, n_rows, k)                       # d_w * q, exact
    p = formats.decode_planes(qt, raw, n_rows, k)
    qa, da = q8_0.quantize_q8_0(x)
    out = np.zeros((t, n_rows), np.float32)
    for r in range(t):
        for n in range(n_rows):
            acc = [np.float32(0)] * 8
            for b in range(k // 32):
                dw = p.d[n, b]
                d = np.float32(dw * da[r, b])
                q = ref[n, 32 * b:32 * b + 32] / dw if dw else np.zeros(32)
                for lane in range(8):
                    s = sum(int(round(q[4 * lane + e])) * int(qa[r, 32 * b + 4 * lane + e]) for e in range(4))
                    acc[lane] = _rn32(Fraction(float(d)) * s + Fraction(float(acc[lane])))
            a = acc
            out[r, n] = ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))
    return out


@pytest.mark.parametrize("qt", [QT.Q8_0, QT.Q5_0], ids=lambda t: t.name)
@pytest.mark.parametrize("saxpy", [True, False], ids=["saxpy", "float64"])
def test_q8_0_family_llama_order_equals_the_written_out_kernel(qt, saxpy, monkeypatch):
    if saxpy and not q8_0.USE_SAXPY:
        pytest.skip("numpy's BLAS has no fused saxpy here: the float64 path is the one in use")
    monkeypatch.setattr(q8_0, "USE_SAXPY", saxpy)
    n_rows, n_cols = 12, 128
    raw = random_blocks(qt, n_rows, n_cols, seed=5)
    x = np.random.default_rng(6).standard_normal((3, n_cols)).astype(np.float32) * 3
    p = formats.decode_planes(qt, raw, n_rows, n_cols)
    want = _q8_0_family_reference(x, qt, raw, n_rows)
    for t in (1, 3):                                                    # vec_dot, tinyBLAS: one order
        got = formats.dot_llama(x[:t], p)
        assert np.array_equal(got, want[:t]), f"{qt.name} T={t}: {int((got != want[:t]).sum())} differ"


def test_scaled_plane_round_trips_and_both_orders_share_it():
    """The Q5_0 llama-order kernel scales the plane by d_w in place; the other path (and
    planes_to_float) scale it back, exactly, a zero-scale block included."""
    raw = random_blocks(QT.Q5_0, 8, 256, seed=9)
    raw.reshape(-1, 22)[3, 0:2] = 0                                     # one block with d = 0
    p = formats.decode_planes(QT.Q5_0, raw, 8, 256)
    q0 = p.q.copy()
    x = np.random.default_rng(1).standard_normal((2, 256)).astype(np.float32)
    a = formats.dot_planes(x, p)
    b = formats.dot_llama(x, p)
    scaling = QT.Q5_0 in q8_0.AXPY_TYPES and q8_0.USE_SAXPY        # a fused saxpy in this BLAS
    assert p.scaled == scaling
    assert np.array_equal(formats.dot_planes(x, p), a) and not p.scaled
    keep = np.ones(q0.shape, bool)
    keep[3, 0] = False                                                  # block 3 of row 0: d = 0
    assert np.array_equal(p.q[keep], q0[keep])
    # scaled by d = 0 and back: that block's codes are gone (they never count); without the
    # fused saxpy the plane is never scaled, so it is untouched
    assert not p.q[3, 0].any() if scaling else np.array_equal(p.q[3, 0], q0[3, 0])
    assert np.array_equal(formats.dot_llama(x, p), b)
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-4)             # two float orders, one sum


def test_f32_weights_in_llama_order():
    """dot_f32_llama: ggml_vec_dot_f32 (one row, or N % 4 != 0) and llamafile's tinyBLAS (T >= 2,
    N % 4 == 0) written out in float64-emulated fmas: both equal the float64 product to ~1e-6
    and differ from each other, as the two kernels do."""
    from bloomery.engine.cpu.ops_math import reduce_add16
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 200)).astype(np.float32)
    w = rng.standard_normal((8, 200)).astype(np.float32)
    exact = x.astype(np.float64) @ w.T.astype(np.float64)
    one = np.concatenate([formats.dot_f32_llama(x[i:i + 1], w) for i in range(3)])   # vec_dot
    many = formats.dot_f32_llama(x, w)                                            # tinyBLAS
    np.testing.assert_allclose(one, exact, rtol=0, atol=2e-5)
    np.testing.assert_allclose(many, exact, rtol=0, atol=2e-5)
    assert not np.array_equal(one, many)
    # tinyBLAS for row 0, output 0, by hand: 16 lanes, fma over 13 steps (the last one partial)
    acc = np.zeros(16, np.float32)
    xs, ws = np.zeros(208, np.float32), np.zeros(208, np.float32)
    xs[:200], ws[:200] = x[0], w[0]
    for c in range(0, 208, 16):
        acc = (xs[c:c + 16].astype(np.float64) * ws[c:c + 16] + acc).astype(np.float32)
    assert many[0, 0] == reduce_add16(acc)


def _fake_saxpy(fused_below: int | None):
    """A saxpy through ctypes, y += a*x: fused (one rounding, as the check computes it) on whole
    multiples of fused_below floats (every element when 1, none when None), a float32 multiply
    then add on the rest."""
    import ctypes

    @ctypes.CFUNCTYPE(None, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                      ctypes.c_int64)
    def saxpy(n, a, xp, incx, yp, incy):
        x = np.ctypeslib.as_array(ctypes.cast(xp, ctypes.POINTER(ctypes.c_float)), shape=(n,))
        y = np.ctypeslib.as_array(ctypes.cast(yp, ctypes.POINTER(ctypes.c_float)), shape=(n,))
        main = 0 if fused_below is None else n - n % fused_below
        y[:main] = (np.float64(a) * x[:main].astype(np.float64) + y[:main]).astype(np.float32)
        y[main:] = np.float32(a) * x[main:] + y[main:]
    return saxpy


def test_saxpy_fused_grain():
    """A BLAS whose saxpy fuses only whole 32-float steps (seen: OpenBLAS's Zen kernel here)
    is still used, for lengths that are whole steps; one that never fuses is not."""
    assert q8_0.fused_grain(_fake_saxpy(1)) == 1
    assert q8_0.fused_grain(_fake_saxpy(32)) == 32
    assert q8_0.fused_grain(_fake_saxpy(None)) is None


def test_row_chunks_keep_the_saxpy_multiple(monkeypatch):
    monkeypatch.setattr(threads, "N_THREADS", 2)
    for n_rows, nc in ((4864, 1000), (2052, 999), (8, 8), (12, 5)):
        seen = []
        threads.row_chunks(lambda a, b: seen.append((a, b)), n_rows, nc, 1 << 30, multiple=4)
        seen.sort()
        assert seen[0][0] == 0 and seen[-1][1] == n_rows and all(b == c for (_, b), (c, _) in zip(seen, seen[1:]))
        assert all((b - a) % 4 == 0 for a, b in seen), (n_rows, nc, seen)


@pytest.mark.parametrize("t", [1, 3])
def test_q5_0_saxpy_path_in_whole_steps_equals_the_emulation(monkeypatch, t):
    """With a saxpy fused only on whole 32-float steps the Q5_0 llama-order product takes the
    saxpy path in chunks of whole steps, and gives the float64 emulation's bits exactly; rows
    that cannot be cut so (not a multiple of 4) take the emulation."""
    saxpy = _fake_saxpy(32)
    monkeypatch.setattr(q8_0, "_SAXPY", saxpy)
    monkeypatch.setattr(q8_0, "SAXPY_GRAIN", 32)
    n_rows, n_cols = 2052, 256                                          # > 1024 rows: several chunks
    raw = random_blocks(QT.Q5_0, n_rows, n_cols, seed=3)
    x = np.random.default_rng(4).standard_normal((t, n_cols)).astype(np.float32)
    p = formats.decode_planes(QT.Q5_0, raw, n_rows, n_cols)
    monkeypatch.setattr(q8_0, "USE_SAXPY", True)
    got = formats.dot_llama(x, p)
    assert p.scaled
    monkeypatch.setattr(q8_0, "USE_SAXPY", False)
    want = formats.dot_llama(x, p)
    assert not p.scaled
    np.testing.assert_array_equal(got, want)
    monkeypatch.setattr(q8_0, "USE_SAXPY", True)
    odd = formats.decode_planes(QT.Q5_0, random_blocks(QT.Q5_0, 6, n_cols, seed=5), 6, n_cols)
    formats.dot_llama(x, odd)
    assert not odd.scaled


@pytest.mark.parametrize("t", [1, 3, 7, 8, 12])
def test_q5_k_llama_order_is_ggml_mul_mat_bit_for_bit(t):
    """Q5_K in llama.cpp's CPU float order (k_quants.dot_llama): the lanes of ggml_vec_dot_q5_K_q8_K under 8
    columns, the tiled K-quant matmul from 8, against b11434's own mul_mat (tools/ref/make_q5k_golden.py); the
    exact sums it replaced differ from it on most outputs, so the golden tells the two apart."""
    from pathlib import Path
    g = np.load(Path(__file__).parent / "golden" / "logits" / "q5_k_mm.npz")
    k, n = int(g["k"]), int(g["n"])
    planes = formats.decode_planes(int(QT.Q5_K), g["blocks"].reshape(-1), n, k)
    x, ref = g[f"x_{t}"], g[f"y_{t}"]
    with threads.OneBlasThread():
        got = formats.dot_llama(x, planes)
        exact = formats.dot_planes(x, planes)
    np.testing.assert_array_equal(got.view(np.int32), ref.view(np.int32))
    assert (exact.view(np.int32) != ref.view(np.int32)).mean() > 0.2
    per_row = formats.dot_llama(x, planes, per_row=True)              # an expert's rows: the same paths
    np.testing.assert_array_equal(per_row.view(np.int32), ref.view(np.int32))
    from bloomery.engine.cpu import kernels as cpu_kernels
    if cpu_kernels.lib() is not None:                                   # and the compiled lane (cpu_lanes.c)
        c = formats.dot_c(x, int(QT.Q5_K), g["blocks"].reshape(-1), n, k)
        np.testing.assert_array_equal(c.view(np.int32), ref.view(np.int32))
