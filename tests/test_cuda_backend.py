"""The cuda backend's kernels against plain references (gguf-py's dequantization, float64
products, the numpy backend's attention and MoE). Runs where CuPy sees a card; skips
elsewhere (CI has none).

Bands: the mat-vec kernels quantize the activation to int8 per 32 values (as llama.cpp's
CUDA mmvq does), which alone gives a relative error near 0.4 %; the GEMM path rounds both
operands to f16 (about 0.05 % each). Attention keeps K and V in f16 like the numpy backend.
"""
from __future__ import annotations

import numpy as np
import pytest

from bloomery.engine.cuda.sizes import DECODE_ROWS, MMV3N_ROWS

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

TYPES = [Q.Q4_0, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.F16, Q.BF16, Q.F32]
SCALE_AT = {Q.Q4_0: (0,), Q.Q5_0: (0,), Q.Q8_0: (0,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def random_tensor(qt, n_rows: int, n_cols: int, rng) -> np.ndarray:
    """Random stored bytes of a [n_rows, n_cols] tensor of type qt, with sane f16 scales."""
    block, size = gguf.GGML_QUANT_SIZES[qt]
    if qt in (Q.F32, Q.F16, Q.BF16):
        x = rng.standard_normal((n_rows, n_cols)).astype(np.float32)
        if qt == Q.F32:
            return x.view(np.uint8).reshape(-1)
        if qt == Q.F16:
            return x.astype(np.float16).view(np.uint8).reshape(-1)
        return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(-1)
    n_blocks = n_rows * n_cols // block
    raw = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    for off in SCALE_AT[qt]:
        d = (rng.uniform(0.5, 1.5, n_blocks) / 64).astype(np.float16)
        raw[:, off:off + 2] = d.view(np.uint8).reshape(n_blocks, 2)
    return raw.reshape(-1)


def reference(qt, data: np.ndarray, n_rows: int, n_cols: int) -> np.ndarray:
    return gguf.quants.dequantize(data.reshape(n_rows, -1), qt).astype(np.float64).reshape(n_rows, n_cols)


# (head size, query heads, kv heads): every attn_dec bucket of query heads per kv head (4, 8,
# 16; 7 as Qwen2.5-0.5B's 14/2 runs in the 8 bucket) and each head size
SHAPES = [(128, 8, 2), (64, 14, 2), (128, 32, 4), (128, 16, 1), (256, 8, 1), (256, 16, 2)]


@pytest.fixture(scope="module")
def ops(gpu):
    from bloomery.engine.cuda.backend import CudaOps
    return CudaOps()


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.mark.parametrize("qt", TYPES, ids=lambda t: t.name)
def test_dequant_and_rows_equal_gguf_py(ops, qt):
    import cupy
    rng = np.random.default_rng(int(qt))
    n_rows, n_cols = 48, 512
    data = random_tensor(qt, n_rows, n_cols, rng)
    ref = reference(qt, data, n_rows, n_cols)
    w = ops.weight(int(qt), (n_cols, n_rows), data)
    deq = cupy.asnumpy(ops.dequant_f16(w)).astype(np.float64)
    np.testing.assert_allclose(deq, ref.astype(np.float16).astype(np.float64), rtol=2e-3, atol=1e-6)
    ids = np.array([0, 47, 5, 5, 31], np.int32)
    rows = cupy.asnumpy(ops.get_rows(w, ids))
    np.testing.assert_allclose(rows, ref[ids], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("qt", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("t", [1, 3, 8, 12, 16, 17, 40])
def test_matmul_matches_float64(ops, qt, t):
    """Every type against float64 on the mat-vec path (up to DECODE_ROWS = 16 rows: mmv3_b16 from 9, mmt for Q4_K
    and Q6_K from 4) and on the GEMM path (17 and 40 rows)."""
    import cupy
    rng = np.random.default_rng([int(qt), t])
    n_rows, n_cols = 200, 768
    data = random_tensor(qt, n_rows, n_cols, rng)
    ref_w = reference(qt, data, n_rows, n_cols)
    w = ops.weight(int(qt), (n_cols, n_rows), data)
    x = rng.standard_normal((t, n_cols)).astype(np.float32)
    res = rng.standard_normal((t, n_rows)).astype(np.float32)
    y = cupy.asnumpy(ops.matmul(cupy.asarray(x), w, residual=cupy.asarray(res)))
    ref = x.astype(np.float64) @ ref_w.T + res
    band = 2e-3 if qt in (Q.F32,) else (1.5e-2 if t <= DECODE_ROWS else 4e-3)
    assert rel(y, ref) < band, (qt.name, t, rel(y, ref))


@pytest.mark.parametrize("mats", [((Q.Q4_K, 256), (Q.Q6_K, 64), (Q.Q8_0, 64)),
                                  ((Q.Q4_K, 256), (Q.Q6_K, 64), (Q.Q8_0, 64), (Q.F32, 3)),
                                  ((Q.Q5_K, 32), (Q.Q6_K, 64), (Q.Q8_0, 64), (Q.Q4_K, 96), (Q.F32, 1))],
                         ids=["three", "four", "five"])
@pytest.mark.parametrize("t", [2, 16])
def test_several_weights_in_one_pass_with_biases(ops, mats, t):
    """matmuls: up to four weights a launch (mmv3; at 16 rows mmt for Q4_K / Q6_K, mmv3_b16 for the rest), the
    fifth in the next."""
    import cupy
    rng = np.random.default_rng(3)
    ws, refs, biases = [], [], []
    for qt, n in mats:
        data = random_tensor(qt, n, 512, rng)
        ws.append(ops.weight(int(qt), (512, n), data))
        refs.append(reference(qt, data, n, 512))
        b = rng.standard_normal(n).astype(np.float32)
        biases.append((ops.weight(int(Q.F32), (n,), b.view(np.uint8)), b))
    x = rng.standard_normal((t, 512)).astype(np.float32)
    outs = ops.matmuls(cupy.asarray(x), ws, [b for b, _ in biases])
    for o, r, (_, b) in zip(outs, refs, biases):
        assert rel(cupy.asnumpy(o), x @ r.T + b) < 1.5e-2


@pytest.mark.parametrize("t", [1, 3, 8, 9, 12, 16, 17])
@pytest.mark.parametrize("mats", [(Q.Q4_K, Q.Q6_K, Q.Q8_0), (Q.F32,), (Q.Q4_K, Q.F16), (Q.Q4_K, Q.Q5_K, Q.F32, Q.F32),
                                  (Q.Q6_K, Q.Q4_K, Q.Q4_K, Q.F32, Q.Q8_0)], ids=["q3", "f32", "mixed", "four", "five"])
@pytest.mark.parametrize("mmt", [True, False], ids=["mmt", "int8"])
def test_norm_fused_into_the_products(ops, t, mats, mmt, monkeypatch):
    """norm_matmuls (mmv3n: the RMSNorm in each block's prologue, with the first four weights, the others
    after on its int8 form, as the qwen35 family's four; 9-16 rows: rms_norm_q8 on its own, then mmt / mmv3_b16,
    with mmt off too (no mmv3n of 16 rows); 17 rows: the unfused path) equals rms_norm then matmuls: the same
    int8 activation for quantized weights, the norm's scale after the dot for float ones; h and its int8 form
    are left for the kernels after."""
    import cupy
    monkeypatch.setattr(ops, "mmt", mmt)
    rng = np.random.default_rng(t)
    k = 2048
    ws = [ops.weight(int(qt), (k, n), random_tensor(qt, n, k, rng)) for qt, n in zip(mats, (256, 128, 64, 32, 1))]
    g = rng.uniform(0.5, 1.5, k).astype(np.float32)
    nw = ops.weight(int(Q.F32), (k,), g.view(np.uint8))
    x = cupy.asarray(rng.standard_normal((t, k)).astype(np.float32) * 3)
    h, outs = ops.norm_matmuls(x, nw, 1e-6, ws, [None] * len(ws))
    h_ref = ops.rms_norm(x, nw, 1e-6)
    # the sum of squares is added in another order (a last-bit difference in the row's scale)
    np.testing.assert_allclose(cupy.asnumpy(h), cupy.asnumpy(h_ref), rtol=1e-6, atol=0)
    for o, r in zip(outs, ops.matmuls(h_ref, ws, [None] * len(ws))):
        assert rel(cupy.asnumpy(o), cupy.asnumpy(r)) < 1e-4
    xq, xd, xs = (cupy.asnumpy(a) for a in ops.q8(h))     # the fused kernel's own int8 form of h
    rq, rd, rs = (cupy.asnumpy(a) for a in ops.q8(cupy.array(h)))   # quantize_q8 of the same h
    assert (xq != rq).mean() < 1e-3 and np.abs(xq.astype(int) - rq).max() <= 1
    np.testing.assert_allclose(xd, rd, rtol=1e-6)
    np.testing.assert_allclose(xs, rs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("t", [2, 5, 8, 9, 12, 16])
@pytest.mark.parametrize("mmt", [True, False], ids=["mmt", "int8"])
def test_norm_fused_rows_in_a_batch_equal_each_alone(ops, t, mmt, monkeypatch):
    """Several rows give each row the bits it gets beside another row: with mmt (the norm on its own, then
    the tensor cores for Q4_K / Q6_K, mmv3 for the rest); and with mmv3n for every row (BLOOMERY_MMT=0)
    the bits it gets alone, the block-wide norm adding the sum of squares in the same order. Past mmv3n's
    8 rows (BLOOMERY_MMT=0): the bits it gets in any other batch past 8 (rms_norm_q8, then mmv3_b16)."""
    import cupy
    monkeypatch.setattr(ops, "mmt", mmt)
    monkeypatch.setattr(ops, "mmt_min", 2)               # so that a batch of 2 takes the same kernels
    rng = np.random.default_rng(30 + t)
    k = 2048
    mats = (Q.Q4_K, Q.Q6_K, Q.F16)
    ws = [ops.weight(int(qt), (k, n), random_tensor(qt, n, k, rng)) for qt, n in zip(mats, (256, 128, 64))]
    nw = ops.weight(int(Q.F32), (k,), rng.uniform(0.5, 1.5, k).astype(np.float32).view(np.uint8))
    x = cupy.asarray(rng.standard_normal((t, k)).astype(np.float32) * 3)
    h, outs = ops.norm_matmuls(x, nw, 1e-6, ws, [None] * len(ws))
    other = cupy.asarray(rng.standard_normal((1, k)).astype(np.float32))
    at = 1 if mmt else (0 if t <= MMV3N_ROWS else MMV3N_ROWS)     # rows before row b in the batch it is checked in
    for b in range(t):
        hb, ob = ops.norm_matmuls(cupy.concatenate([other] * at + [x[b:b + 1]]), nw, 1e-6, ws, [None] * len(ws))
        np.testing.assert_array_equal(cupy.asnumpy(h[b]), cupy.asnumpy(hb[at]))
        for o, r in zip(outs, ob):
            np.testing.assert_array_equal(cupy.asnumpy(o[b]), cupy.asnumpy(r[at]))


@pytest.mark.parametrize("qt", [Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("t", [2, 5, 8, 12, 16])
@pytest.mark.parametrize("k", [768, 4096])
def test_tensor_core_products_match_float64(ops, qt, t, k, monkeypatch):
    """mmt (Q4_K and Q6_K expanded to f16 onto the tensor cores, 2 to 16 rows, DECODE_ROWS) against float64, with a bias and a residual, over rows that are not
    a multiple of its 16 and K of 3 super-blocks (3 warps; Q6_K rows only 2-aligned) or 16; and each row's
    result is the bits it gets beside another row."""
    import cupy
    monkeypatch.setattr(ops, "mmt_min", 2)               # the kernel's reach, whatever rows it starts at
    rng = np.random.default_rng([int(qt), t, k])
    n_rows = 200
    data = random_tensor(qt, n_rows, k, rng)
    ref_w = reference(qt, data, n_rows, k)
    w = ops.weight(int(qt), (k, n_rows), data)
    assert ops._mmt_takes(w, t)
    b = rng.standard_normal(n_rows).astype(np.float32)
    bias = ops.weight(int(Q.F32), (n_rows,), b.view(np.uint8))
    x = rng.standard_normal((t, k)).astype(np.float32)
    res = rng.standard_normal((t, n_rows)).astype(np.float32)
    (y,) = ops._mat_vecs(cupy.asarray(x), [w], [bias], [cupy.asarray(res)])
    y = cupy.asnumpy(y)
    ref = x.astype(np.float64) @ ref_w.T + b + res
    assert rel(y, ref) < 4e-3, rel(y, ref)
    other = rng.standard_normal((1, k)).astype(np.float32)
    for r in {0, t // 2, t - 1}:
        (two,) = ops._mat_vecs(cupy.asarray(np.concatenate([other, x[r:r + 1]])), [w], [bias],
                               [cupy.asarray(np.concatenate([res[r:r + 1], res[r:r + 1]]))])
        np.testing.assert_array_equal(y[r], cupy.asnumpy(two)[1])


@pytest.mark.parametrize("t", [1, 4, 12, 16])
def test_tensor_core_products_beside_int8_ones(ops, t, monkeypatch):
    """One call with Q4_K, Q6_K, F32 and Q8_0 weights: at 4 to 16 rows the first two through mmt, the others
    through mmv3 (mmv3_b16 past 8 rows), each output in its place (a lone row: all through mmv3); with mmt off (BLOOMERY_MMT=0) every weight
    takes mmv3 and the products agree within the int8 activation's band."""
    import cupy
    rng = np.random.default_rng(40 + t)
    k = 2048
    mats = ((Q.Q8_0, 64), (Q.Q4_K, 4096), (Q.F32, 128), (Q.Q6_K, 520), (Q.Q4_K, 512))
    ws, refs = [], []
    for qt, n in mats:
        data = random_tensor(qt, n, k, rng)
        ws.append(ops.weight(int(qt), (k, n), data))
        refs.append(reference(qt, data, n, k))
    x = rng.standard_normal((t, k)).astype(np.float32)
    on = [cupy.asnumpy(o) for o in ops.matmuls(cupy.asarray(x), ws, [None] * len(ws))]
    monkeypatch.setattr(ops, "mmt", False)
    off = [cupy.asnumpy(o) for o in ops.matmuls(cupy.asarray(x), ws, [None] * len(ws))]
    for (qt, n), w, a, b, r in zip(mats, ws, on, off, refs):
        assert a.shape == (t, n)
        monkeypatch.setattr(ops, "mmt", True)
        assert rel(a, x @ r.T) < (4e-3 if ops._mmt_takes(w, t) else 1.5e-2), qt.name
        assert rel(a, b) < 1.5e-2, qt.name


def test_rms_norm_and_argmax(ops):
    import cupy
    rng = np.random.default_rng(4)
    x = rng.standard_normal((5, 1024)).astype(np.float32)
    g = rng.uniform(0.5, 1.5, 1024).astype(np.float32)
    w = ops.weight(int(Q.F32), (1024,), g.view(np.uint8))
    y = cupy.asnumpy(ops.rms_norm(cupy.asarray(x), w, 1e-6))
    ref = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6) * g
    assert rel(y, ref) < 1e-5
    logits = rng.standard_normal((5, 151936)).astype(np.float32)
    logits[1, 77] = logits[1, 99] = 50.0                 # a tie: the first index wins
    logits[2, 2047] = logits[2, 2048] = 50.0             # a tie across two of argmax_part's pieces
    logits[3, 4100] = logits[3, 2050] = 50.0             # the later piece's index comes first in memory order
    logits[4, -1] = 50.0                                 # in the last, partial piece
    want = [int(logits[0].argmax()), 77, 2047, 2050, 151935]
    assert want[0] == int(np.argmax(logits[0]))
    assert cupy.asnumpy(ops.argmax(cupy.asarray(logits))).tolist() == want
    assert cupy.asnumpy(ops.argmax(cupy.asarray(logits[:, :1000]))).tolist() == np.argmax(logits[:, :1000], -1).tolist()


@pytest.mark.parametrize("n,k", [(151936, 40), (151936, 64), (1000, 64), (4096, 1), (4097, 7)])
def test_topk_in_the_chain_order(ops, n, k):
    """ops.topk hands over each row's k largest logits in the sampler chain's order (descending,
    ties to the lower id: sampler.sorted_top), ties straddling topk_part's 4096-value pieces,
    and counts a row's NaNs."""
    import cupy
    from bloomery.engine.sampler import sorted_top
    rng = np.random.default_rng(n + k)
    x = (rng.standard_normal((3, n)) * 3).astype(np.float32)
    top = x.max()
    x[0, rng.integers(0, n, 12)] = top + 1                   # a run of equal maxima, any piece
    x[1, [n - 1, 0, n // 2]] = top + 2                       # ties in the first, a middle, the last piece
    x[2, 5] = np.nan
    ids, vals, nan = (cupy.asnumpy(a) for a in ops.topk(cupy.asarray(x), k))
    for r in range(2):
        want = sorted_top(x[r], k)
        np.testing.assert_array_equal(ids[r], want)
        np.testing.assert_array_equal(vals[r], x[r, want])
    assert nan.tolist() == [0, 0, 1]
    clean = np.where(np.isnan(x[2]), -np.inf, x[2])
    np.testing.assert_array_equal(ids[2], sorted_top(clean, k))
    assert k <= ops.topk_max(n)


def test_norm_fused_two_rows_per_warp(ops, monkeypatch):
    """mmv3n with each warp taking two rows in turn (what the launch picks when one row a warp
    would need a second wave of blocks) gives the same bits as one row a warp."""
    import cupy
    rng = np.random.default_rng(12)
    k = 2048
    mats = ((Q.Q4_K, 4096), (Q.Q4_K, 512), (Q.Q6_K, 520))       # rows not a multiple of 16
    ws = [ops.weight(int(qt), (k, n), random_tensor(qt, n, k, rng)) for qt, n in mats]
    nw = ops.weight(int(Q.F32), (k,), rng.uniform(0.5, 1.5, k).astype(np.float32).view(np.uint8))
    x = cupy.asarray(rng.standard_normal((1, k)).astype(np.float32))
    monkeypatch.setattr(ops, "mmt", False)                      # these types go to mmt otherwise
    picked = []
    real = type(ops)._rows_per_warp
    monkeypatch.setattr(type(ops), "_rows_per_warp", lambda self, *a: picked.append(real(self, *a)) or 1)
    _, one = ops.norm_matmuls(x, nw, 1e-6, ws, [None] * 3)
    monkeypatch.setattr(type(ops), "_rows_per_warp", lambda self, *a: 2)
    _, two = ops.norm_matmuls(x, nw, 1e-6, ws, [None] * 3)
    for a, b in zip(one, two):
        np.testing.assert_array_equal(cupy.asnumpy(a), cupy.asnumpy(b))
    # 641 blocks of 8 rows: more than one wave on any card of fewer than 214 SMs at 3 blocks each
    assert picked and picked[0] >= 2, picked


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"dh{s[0]}-h{s[1]}-kv{s[2]}")
@pytest.mark.parametrize("n_slots", [4, 16])
def test_decode_rows_each_in_their_slot(ops, shape, n_slots, monkeypatch):
    """Decode rows, one per slot at its own depth (1 to 1500: from one piece to many chunks a
    piece), three steps in a row, against the numpy backend's F32 attention; 4 rows, and a whole
    captured step's 16 (DECODE_ROWS: fewer pieces a row)."""
    import cupy
    from bloomery.engine.cpu import kv_cache
    from bloomery.engine.cpu.backend import NumpyOps
    from bloomery.engine.ops import AttnSpan
    monkeypatch.setattr(kv_cache, "FA_TILE_Q", 1)
    cpu = NumpyOps()
    rng = np.random.default_rng(7)
    dh, n_head, n_kv = shape
    depths = [5, 700, 64, 1500, 1, 33, 900, 260, 31, 1200, 2, 96, 480, 1499, 17, 640][:n_slots]   # one slot each
    qn = rng.uniform(0.5, 1.5, dh).astype(np.float32)
    kn = rng.uniform(0.5, 1.5, dh).astype(np.float32)
    norms = lambda o: dict(q_norm=o.weight(0, (dh,), qn.view(np.uint8)),  # noqa: E731
                           k_norm=o.weight(0, (dh,), kn.view(np.uint8)), eps=1e-6)
    args = (0.088, dh, 1e6)
    c_cache, g_cache = cpu.kv_cache(1, n_slots, 2048, n_kv, dh), ops.kv_cache(1, n_slots, 2048, n_kv, dh)
    for slot, n in enumerate(depths):                   # histories, through the prompt paths
        q, k, v = (rng.standard_normal((n, h, dh)).astype(np.float32) for h in (n_head, n_kv, n_kv))
        spans, pos = [AttnSpan(slot, 0, 0, n)], np.arange(n, dtype=np.int32)
        cpu.self_attention(c_cache, 0, cpu.rows(spans, pos), q, k, v, *args, **norms(cpu))
        ops.self_attention(g_cache, 0, ops.rows(spans, pos), cupy.asarray(q), cupy.asarray(k), cupy.asarray(v),
                           *args, **norms(ops))
    for step in range(3):
        q, k, v = (rng.standard_normal((n_slots, h, dh)).astype(np.float32) for h in (n_head, n_kv, n_kv))
        spans = [AttnSpan(slot, depths[slot] + step, slot, slot + 1) for slot in range(n_slots)]
        pos = np.array([d + step for d in depths], np.int32)
        ref = cpu.self_attention(c_cache, 0, cpu.rows(spans, pos), q, k, v, *args, **norms(cpu))
        got = cupy.asnumpy(ops.self_attention(g_cache, 0, ops.rows(spans, pos), cupy.asarray(q), cupy.asarray(k),
                                              cupy.asarray(v), *args, **norms(ops)))
        assert rel(got, ref) < 3e-3, (step, rel(got, ref))


@pytest.mark.parametrize("t", [2, 12, 16, 40])
def test_moe_matches_numpy_backend(ops, t):
    """The router and the expert FFN against the numpy backend: the per-pair decode kernels up to DECODE_ROWS = 16
    rows, the prompt path past them."""
    import cupy
    from bloomery.engine.cpu.backend import NumpyOps
    cpu = NumpyOps()
    rng = np.random.default_rng(5 + t)
    d, f, n_expert, n_used = 512, 256, 16, 4
    gate, up = (random_tensor(Q.Q4_K, n_expert * f, d, rng) for _ in range(2))
    down = random_tensor(Q.Q6_K, n_expert * d, f, rng)
    x = (0.1 * rng.standard_normal((t, d))).astype(np.float32)     # activations in f16's range
    res = rng.standard_normal((t, d)).astype(np.float32)
    logits = rng.standard_normal((t, n_expert)).astype(np.float32)
    ids_c, w_c = cpu.moe_route(logits, n_used, True)
    ids_g, w_g = ops.moe_route(cupy.asarray(logits), n_used, True)
    np.testing.assert_array_equal(cupy.asnumpy(ids_g), ids_c)
    np.testing.assert_allclose(cupy.asnumpy(w_g), w_c, rtol=1e-5)
    mk = lambda o, data, shape: o.weight(int(Q.Q4_K if shape[0] == d else Q.Q6_K), shape, data)  # noqa: E731
    cw = [mk(cpu, gate, (d, f, n_expert)), mk(cpu, up, (d, f, n_expert)), mk(cpu, down, (f, d, n_expert))]
    gw = [mk(ops, gate, (d, f, n_expert)), mk(ops, up, (d, f, n_expert)), mk(ops, down, (f, d, n_expert))]
    ref = cpu.moe_ffn(x, ids_c, w_c, *cw, residual=res)
    got = cupy.asnumpy(ops.moe_ffn(cupy.asarray(x), ids_g, w_g, *gw, residual=cupy.asarray(res)))
    # both sides quantize the activation (int8 per 32 here, Q8_K per 256 on the CPU) before the
    # expert matrices and again before down: two roundings each, about 1 % apiece
    assert rel(got - res, ref - res) < 3e-2, rel(got - res, ref - res)


PLANNED = [  # t, experts, used, d, f, (gate, up, down), skewed routing
    (9, 16, 4, 512, 256, (Q.Q4_K, Q.Q4_K, Q.Q6_K), False),
    (40, 16, 4, 512, 256, (Q.Q4_K, Q.Q4_K, Q.Q6_K), False),
    (200, 16, 4, 512, 256, (Q.Q4_K, Q.Q4_K, Q.Q6_K), True),       # 4 experts of 200 rows: 4 tiles each
    (130, 128, 8, 2048, 768, (Q.Q4_K, Q.Q4_K, Q.Q6_K), False),    # the 30B-A3B shape
    (33, 8, 2, 256, 192, (Q.Q5_K, Q.Q5_K, Q.Q8_0), False),        # F = 1.5 x MM_BN: a part tile of outputs
    (70, 8, 3, 256, 128, (Q.Q4_0, Q.Q4_0, Q.Q5_0), True),
]


@pytest.mark.parametrize("t,n_expert,n_used,d,f,types,skew", PLANNED,
                         ids=["t9", "t40", "t200-skew", "30b-t130", "q5k-f192", "q4_0-skew"])
def test_planned_prompt_experts(ops, t, n_expert, n_used, d, f, types, skew, monkeypatch):
    """The prompt's experts grouped on the card (moe_mm.cu) against the host-planned GEMMs and the
    numpy backend; and the same bits twice (where the plan's atomics put a row does not matter)."""
    import cupy
    from bloomery.engine.cpu.backend import NumpyOps
    from bloomery.engine.cuda import moe
    cpu = NumpyOps()
    rng = np.random.default_rng(t + n_expert)
    tg, tu, td = types
    data = [random_tensor(tg, n_expert * f, d, rng), random_tensor(tu, n_expert * f, d, rng),
            random_tensor(td, n_expert * d, f, rng)]
    shapes = [(d, f, n_expert), (d, f, n_expert), (f, d, n_expert)]
    gw = [ops.weight(int(q), sh, a) for q, sh, a in zip(types, shapes, data)]
    cw = [cpu.weight(int(q), sh, a) for q, sh, a in zip(types, shapes, data)]
    assert moe.planned_fits(*gw, d)
    x = (0.1 * rng.standard_normal((t, d))).astype(np.float32)
    res = rng.standard_normal((t, d)).astype(np.float32)
    logits = rng.standard_normal((t, n_expert)).astype(np.float32)
    if skew:
        logits[:, :n_used] += 20.0
    ids_c, w_c = cpu.moe_route(logits, n_used, True)
    ids, wts = ops.moe_route(cupy.asarray(logits), n_used, True)
    outs = {}
    for mode in ("planned", "planned-again", "grouped"):
        monkeypatch.setenv("BLOOMERY_CUDA_MOE_PROMPT", mode.split("-")[0])
        outs[mode] = cupy.asnumpy(ops.moe_ffn(cupy.asarray(x), ids, wts, *gw, residual=cupy.asarray(res)))
    assert np.isfinite(outs["planned"]).all()
    np.testing.assert_array_equal(outs["planned"], outs["planned-again"])
    assert rel(outs["planned"] - res, outs["grouped"] - res) < 2e-3
    ref = cpu.moe_ffn(x, ids_c, w_c, *cw, residual=res)
    assert rel(outs["planned"] - res, ref - res) < 3e-2


def test_planned_takes_only_what_it_reads(ops):
    """Gate and up of two formats, or float experts, go to the host-planned GEMMs."""
    from bloomery.engine.cuda import moe
    rng = np.random.default_rng(1)
    d, f, e = 256, 128, 4
    mk = lambda q, sh: ops.weight(int(q), sh, random_tensor(q, sh[1] * sh[2], sh[0], rng))  # noqa: E731
    assert moe.planned_fits(mk(Q.Q4_K, (d, f, e)), mk(Q.Q4_K, (d, f, e)), mk(Q.Q8_0, (f, d, e)), d)
    assert not moe.planned_fits(mk(Q.Q4_K, (d, f, e)), mk(Q.Q5_K, (d, f, e)), mk(Q.Q8_0, (f, d, e)), d)
    assert not moe.planned_fits(mk(Q.F16, (d, f, e)), mk(Q.F16, (d, f, e)), mk(Q.F16, (f, d, e)), d)


@pytest.mark.parametrize("t,n_expert,n_used,d,f,types,skew", [
    (2, 128, 8, 2048, 768, (Q.Q4_K, Q.Q4_K, Q.Q6_K), False),       # the 30B-A3B shape
    (8, 128, 8, 2048, 768, (Q.Q4_K, Q.Q4_K, Q.Q6_K), False),
    (16, 32, 8, 2048, 768, (Q.Q4_K, Q.Q4_K, Q.Q6_K), True),        # 16 rows on the same 8 experts
    (5, 16, 4, 512, 256, (Q.Q6_K, Q.Q6_K, Q.Q4_K), False),          # one super-block of F: one warp in down
], ids=["30b-t2", "30b-t8", "t16-skew", "q6k-f256"])
def test_decode_experts_on_the_tensor_cores(ops, t, n_expert, n_used, d, f, types, skew, monkeypatch):
    """A decode step's experts grouped on the card (moe_dplan, moe_mt_gu, moe_mt_dn) against float64 on the
    dequantized experts (the input and the activation rounded to f16 on the way, as the kernels do), the
    same bits twice, and near the per-pair int8 kernels (BLOOMERY_MMT=0)."""
    import cupy
    from bloomery.engine.cuda import moe
    rng = np.random.default_rng(60 + t)
    tg, tu, td = types
    data = [random_tensor(tg, n_expert * f, d, rng), random_tensor(tu, n_expert * f, d, rng),
            random_tensor(td, n_expert * d, f, rng)]
    shapes = [(d, f, n_expert), (d, f, n_expert), (f, d, n_expert)]
    gate, up, down = (ops.weight(int(q), sh, a) for q, sh, a in zip(types, shapes, data))
    monkeypatch.setattr(ops, "moe_mt_min", 2)             # whatever rows the default starts at
    assert moe.mt_fits(ops, t, n_used, gate, up, down, d)
    x = (0.1 * rng.standard_normal((t, d))).astype(np.float32)
    res = rng.standard_normal((t, d)).astype(np.float32)
    logits = rng.standard_normal((t, n_expert)).astype(np.float32)
    if skew:
        logits[:, :n_used] += 20.0
    ids, wts = ops.moe_route(cupy.asarray(logits), n_used, True)
    run = lambda: cupy.asnumpy(moe._decode_mt(ops, cupy.asarray(x), ids, wts, gate, up, down,  # noqa: E731
                                              cupy.asarray(res)))
    got, again = run(), run()
    np.testing.assert_array_equal(got, again)
    wg, wu = (reference(q, a, n_expert * f, d).reshape(n_expert, f, d) for q, a in zip(types[:2], data[:2]))
    wd = reference(td, data[2], n_expert * d, f).reshape(n_expert, d, f)
    ids_h, wts_h = cupy.asnumpy(ids), cupy.asnumpy(wts).astype(np.float64)
    x16 = x.astype(np.float16).astype(np.float64)
    ref = res.astype(np.float64)
    for i in range(t):
        for a in range(n_used):
            e = ids_h[i, a]
            g, u = wg[e] @ x16[i], wu[e] @ x16[i]
            act = (g / (1 + np.exp(-g)) * u).astype(np.float16).astype(np.float64)
            ref[i] += wts_h[i, a] * (wd[e] @ act)
    assert rel(got - res, ref - res) < 5e-3, rel(got - res, ref - res)
    if t <= DECODE_ROWS:                               # the per-pair kernels take at most the decode batch
        monkeypatch.setattr(ops, "mmt", False)
        pairs = cupy.asnumpy(ops.moe_ffn(cupy.asarray(x), ids, wts, gate, up, down, residual=cupy.asarray(res)))
        assert rel(got - res, pairs - res) < 3e-2


@pytest.mark.parametrize("t,n_used,types", [(1, 8, (Q.Q4_K, Q.Q4_K, Q.Q6_K)), (3, 8, (Q.Q4_K, Q.Q4_K, Q.Q6_K)),
                                           (8, 10, (Q.Q4_K, Q.Q4_K, Q.Q6_K)), (2, 4, (Q.Q4_K, Q.Q5_K, Q.Q8_0)),
                                           (16, 8, (Q.Q4_K, Q.Q4_K, Q.Q6_K)), (13, 10, (Q.Q4_K, Q.Q5_K, Q.Q8_0))],
                         ids=["t1", "t3", "t8-a10", "mixed", "t16", "t13-a10-mixed"])
def test_staged_expert_kernels_equal_direct(ops, t, n_used, types, monkeypatch):
    """moe_gate_up_s / moe_down_s (the block's bytes staged in shared memory) give the same bits
    as moe_gate_up / moe_down: 10 experts a token take moe_down_s's second pass per warp; gate
    and up of different types take the one-row path."""
    import cupy
    rng = np.random.default_rng(20 + t)
    d, f, n_expert = 2048, 768, 32
    tg, tu, td = types
    gate = ops.weight(int(tg), (d, f, n_expert), random_tensor(tg, n_expert * f, d, rng))
    up = ops.weight(int(tu), (d, f, n_expert), random_tensor(tu, n_expert * f, d, rng))
    down = ops.weight(int(td), (f, d, n_expert), random_tensor(td, n_expert * d, f, rng))
    x = cupy.asarray((0.1 * rng.standard_normal((t, d))).astype(np.float32))
    res = cupy.asarray(rng.standard_normal((t, d)).astype(np.float32))
    ids, wts = ops.moe_route(cupy.asarray(rng.standard_normal((t, n_expert)).astype(np.float32)), n_used, True)
    monkeypatch.setattr(ops, "mmt", False)             # 2 rows and more take moe_mt_* otherwise
    outs = {}
    for mode in ("staged", "direct"):
        monkeypatch.setenv("BLOOMERY_CUDA_MOE", mode)
        outs[mode] = cupy.asnumpy(ops.moe_ffn(x, ids, wts, gate, up, down, residual=res))
    assert np.isfinite(outs["staged"]).all()
    np.testing.assert_array_equal(outs["staged"], outs["direct"])


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"dh{s[0]}-h{s[1]}-kv{s[2]}")
@pytest.mark.parametrize("t,pos0,n_ctx", [(1, 0, 256), (3, 70, 256), (8, 5, 256), (40, 0, 256), (33, 100, 256),
                                          (1, 1000, 2048), (8, 3000, 4096), (1, 4000, 4096), (12, 7, 256),
                                          (16, 0, 256), (16, 3000, 4096), (17, 50, 256)])
def test_attention_matches_numpy_backend(ops, shape, t, pos0, n_ctx, monkeypatch):
    """Short and long contexts: at depth 3000 with 8 rows each block walks several 32-position
    chunks of its piece (the online softmax across chunks); at depth 4000 with one row the keys
    are cut into over a hundred pieces, which attn_merge's groups of threads share out. The reference is the numpy
    backend's F32 attention for every row count: its decode path mirrors llama.cpp's CPU,
    whose V accumulator is F16, an error that grows with the depth (0.44 % at depth 1000)."""
    import cupy
    from bloomery.engine.cpu import kv_cache
    from bloomery.engine.cpu.backend import NumpyOps
    monkeypatch.setattr(kv_cache, "FA_TILE_Q", 1)
    from bloomery.engine.ops import AttnSpan
    cpu = NumpyOps()
    rng = np.random.default_rng(t + pos0)
    dh, n_head, n_kv = shape
    qn = rng.uniform(0.5, 1.5, dh).astype(np.float32)
    kn = rng.uniform(0.5, 1.5, dh).astype(np.float32)
    c_cache, g_cache = cpu.kv_cache(1, 2, n_ctx, n_kv, dh), ops.kv_cache(1, 2, n_ctx, n_kv, dh)
    out_c = out_g = None
    for p0, n in ((0, pos0), (pos0, t)):               # a history, then the rows under test
        if n == 0:
            continue
        q = rng.standard_normal((n, n_head, dh)).astype(np.float32)
        k = rng.standard_normal((n, n_kv, dh)).astype(np.float32)
        v = rng.standard_normal((n, n_kv, dh)).astype(np.float32)
        spans = [AttnSpan(1, p0, 0, n)]
        pos = np.arange(p0, p0 + n, dtype=np.int32)
        args = (0.088, dh, 1e6)
        out_c = cpu.self_attention(c_cache, 0, cpu.rows(spans, pos), q, k, v, *args,
                                   q_norm=cpu.weight(0, (dh,), qn.view(np.uint8)),
                                   k_norm=cpu.weight(0, (dh,), kn.view(np.uint8)), eps=1e-6)
        out_g = ops.self_attention(g_cache, 0, ops.rows(spans, pos), cupy.asarray(q), cupy.asarray(k),
                                   cupy.asarray(v), *args, q_norm=ops.weight(0, (dh,), qn.view(np.uint8)),
                                   k_norm=ops.weight(0, (dh,), kn.view(np.uint8)), eps=1e-6)
    assert rel(cupy.asnumpy(out_g), out_c) < 3e-3, rel(cupy.asnumpy(out_g), out_c)
