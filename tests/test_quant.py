"""bloomery.engine.quant: block decoding and llama.cpp's activation quantization."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

from bloomery.engine import quant

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
    ref = quant.dequantize(qt, raw, 6, 512)                            # gguf's reference numpy code
    got = quant.planes_to_float(quant.decode_planes(qt, raw, 6, 512))
    assert np.array_equal(got, ref), f"{qt.name}: max diff {np.abs(got - ref).max()}"


@pytest.mark.parametrize("qt", BLOCK_TYPES, ids=lambda t: t.name)
def test_dot_is_exact_block_sums(qt):
    """dot_planes equals float64 math on the quantized activation and the dequantized weight."""
    n_rows, n_cols = 40, 512
    raw = random_blocks(qt, n_rows, n_cols, seed=1)
    w = quant.dequantize(qt, raw, n_rows, n_cols).astype(np.float64)
    x = np.random.default_rng(2).standard_normal((3, n_cols)).astype(np.float32)
    if quant.VEC_DOT_TYPE[qt] == QT.Q8_0:
        qa, da = quant.quantize_q8_0(x)
        xa = (qa.reshape(3, -1, 32) * da[:, :, None]).reshape(3, -1)
    else:
        qa, da, _ = quant.quantize_q8_K(x)
        xa = (qa.reshape(3, -1, 256) * da[:, :, None]).reshape(3, -1)
    want = xa.astype(np.float64) @ w.T                                  # [T, N]
    p = quant.decode_planes(qt, raw, n_rows, n_cols)
    for t in (1, 3):                                                    # the GEMV and the GEMM branches
        got = quant.dot_planes(x[:t], p)
        scale = np.abs(want[:t]).max()
        assert np.abs(got - want[:t]).max() <= 2e-6 * scale, f"{qt.name} T={t}"


def test_q8_0_rounds_half_to_even_with_127_over_amax():
    # amax 127 -> multiplier exactly 1: the halves show the rounding mode (AVX _mm256_round_ps)
    x = np.zeros((1, 32), np.float32)
    x[0, :5] = [127.0, 0.5, 1.5, 2.5, -2.5]
    q, d = quant.quantize_q8_0(x)
    assert q[0, :5].tolist() == [127, 0, 2, 2, -2]
    assert d[0, 0] == np.float32(np.float16(1.0))
    # the scale is stored as f16: amax/127 rounded to half precision
    y = np.full((1, 32), 0.3, np.float32)
    _, d = quant.quantize_q8_0(y)
    assert d[0, 0] == np.float32(np.float16(np.float32(0.3) / np.float32(127)))
    assert d[0, 0] != np.float32(0.3) / np.float32(127)


def test_q8_0_zero_block():
    q, d = quant.quantize_q8_0(np.zeros((2, 64), np.float32))
    assert not q.any() and not d.any()


def test_q8_K_largest_magnitude_maps_to_minus_127():
    x = np.random.default_rng(3).uniform(-1, 1, (1, 256)).astype(np.float32)
    x[0, 10] = 2.0
    q, d, bsums = quant.quantize_q8_K(x)
    assert q[0, 10] == -127 and d[0, 0] == np.float32(1) / (np.float32(-127) / np.float32(2.0))
    assert np.array_equal(bsums[0], q[0].reshape(16, 16).sum(axis=1))
    x[0, 10] = -2.0                                                     # negative max: it still maps to -127
    q, d, _ = quant.quantize_q8_K(x)
    assert q[0, 10] == -127 and d[0, 0] > 0


def test_q8_K_first_max_wins_and_caps_at_127():
    x = np.zeros((1, 256), np.float32)
    x[0, 3], x[0, 7] = -1.0, 1.0                                        # tie on magnitude: the first one
    q, _, _ = quant.quantize_q8_K(x)
    assert q[0, 3] == -127 and q[0, 7] == 127


def test_bad_sizes_are_named():
    raw = np.zeros(33, np.uint8)
    with pytest.raises(quant.QuantError, match="expected 34 bytes, got 33"):
        quant.decode_planes(QT.Q8_0, raw, 1, 32)
    with pytest.raises(quant.QuantError, match="row length 48 is not a multiple of the block size 32"):
        quant.dequantize(QT.Q8_0, np.zeros(34, np.uint8), 1, 48)


def test_q8_K_mat_4x8_rows_let_the_positive_max_win_a_tie():
    # ggml_quantize_mat_q8_K_4x8 (the repacked Q4_K gemm's rows) maps a +amax element to -127
    # when there is one anywhere; quantize_row_q8_K_ref takes the first max's sign
    x = np.zeros((2, 256), np.float32)
    x[:, 3], x[:, 9], x[:, 20] = -2.0, 2.0, 1.0
    q_ref, d_ref, _ = quant.quantize_q8_K(x)
    q_mat, d_mat, _ = quant.quantize_q8_K(x, positive_wins=np.array([True, False]))
    assert q_ref[0, [3, 9, 20]].tolist() == [-127, 127, 64] and d_ref[0, 0] > 0
    assert q_mat[0, [3, 9, 20]].tolist() == [127, -127, -64] and d_mat[0, 0] == -d_ref[0, 0]
    assert np.array_equal(q_mat[1], q_ref[1]) and d_mat[1, 0] == d_ref[1, 0]     # row 1: the ref rule
