"""The head's k largest logits without every row's llama-order sum (formats.top_llama, NumpyOps.matmul_topk
/ matmul_argmax): ids and values bit-equal to the full product's top-k, ties to the lower id, and the
full product taken where the shortcut cannot be sure (non-finite input, a type it does not cover)."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from bloomery.engine.quant import formats, q8_0
from bloomery.engine.cpu.backend import NumpyOps
from bloomery.engine.sampler import sorted_top
from tests.test_quant import random_blocks


def _head(n_rows: int, n_cols: int, seed: int, tie_rows: int = 0, qt: QT = QT.Q8_0):
    """A head weight; its last tie_rows rows copy rows 3.. so their logits tie exactly with those."""
    raw = random_blocks(qt, n_rows, n_cols, seed=seed).reshape(n_rows, -1).copy()
    if tie_rows:
        raw[n_rows - tie_rows:] = raw[3:3 + tie_rows]
    return NumpyOps().weight(int(qt), (n_cols, n_rows), raw.reshape(-1))


def _want(ops, x, w, k):
    full = ops.matmul(x, w)                                             # [T, V] llama order
    ids = np.stack([sorted_top(row, k) for row in full]).astype(np.int32)
    return ids, np.take_along_axis(full, ids, axis=1)


@pytest.mark.parametrize("k", [1, 2, 40, 64])
def test_top_k_equals_the_full_products_top_k(k):
    ops = NumpyOps()
    w = _head(3000, 256, seed=k, tie_rows=40)
    rng = np.random.default_rng(k)
    x = (rng.standard_normal((3, 256)) * 3).astype(np.float32)
    x[2] = x[0]                                                         # a row whose best logit ties: rows 3.. and copies
    ids, vals, n_nan = ops.matmul_topk(x, w, k)
    want_ids, want_vals = _want(ops, x, w, k)
    assert np.array_equal(ids, want_ids)
    assert np.array_equal(vals.view(np.uint32), want_vals.view(np.uint32))   # bit for bit
    assert not n_nan.any()
    assert np.array_equal(ops.matmul_argmax(x, w), ops.argmax(ops.matmul(x, w)))


def test_ties_go_to_the_lower_id():
    """A head whose rows are all one row: every logit ties, so the top k are ids 0..k-1."""
    ops = NumpyOps()
    raw = random_blocks(QT.Q8_0, 1, 128, seed=3).reshape(1, -1)
    w = ops.weight(int(QT.Q8_0), (128, 500), np.repeat(raw, 500, axis=0).reshape(-1))
    x = np.random.default_rng(1).standard_normal((1, 128)).astype(np.float32)
    ids, _, _ = ops.matmul_topk(x, w, 8)
    assert ids[0].tolist() == list(range(8))
    assert ops.matmul_argmax(x, w).tolist() == [0]


def test_few_rows_get_the_llama_order_sum():
    """The shortcut is only worth it if the candidates are few: on random rows, about k of 3000."""
    w = _head(3000, 256, seed=9)
    x = np.random.default_rng(2).standard_normal((1, 256)).astype(np.float32)
    est, bound = q8_0._estimate(x, w.planes())
    full = formats.dot_llama(x, w.planes())[0]
    assert (np.abs(est[0] - full) <= bound[0]).all()                   # the bound holds
    kth = np.sort(est[0] - bound[0])[-40]
    assert np.count_nonzero(est[0] + bound[0] >= kth) < 60


def test_non_finite_input_takes_the_full_product():
    ops = NumpyOps()
    w = _head(600, 128, seed=4)
    x = np.random.default_rng(3).standard_normal((2, 128)).astype(np.float32)
    x[1, 5] = np.nan
    ids, vals, n_nan = ops.matmul_topk(x, w, 5)
    full = ops.matmul(x, w)
    assert n_nan.tolist() == [0, int(np.isnan(full[1]).sum())] and n_nan[1] > 0
    assert np.array_equal(ids[0], sorted_top(full[0], 5))
    assert ops.matmul_argmax(x, w).tolist() == ops.argmax(full).tolist()   # numpy's argmax: the first NaN


def test_other_types_take_the_full_product():
    ops = NumpyOps()
    w = _head(512, 256, seed=5, qt=QT.Q6_K)
    assert QT.Q6_K not in formats.TOP_TYPES
    x = np.random.default_rng(4).standard_normal((1, 256)).astype(np.float32)
    ids, vals, _ = ops.matmul_topk(x, w, 10)
    want_ids, want_vals = _want(ops, x, w, 10)
    assert np.array_equal(ids, want_ids) and np.array_equal(vals, want_vals)


@pytest.mark.real_model
def test_real_head_top_k_bit_equal(real_model_path):
    """The real file's Q8_0 head (151,936 rows) after its output norm, on hidden states of a prompt."""
    from bloomery.engine.loader import load_model
    from bloomery.placement import whole
    m = load_model(str(real_model_path), whole("numpy", n_slots=1, n_ctx_slot=64))
    x = m._run(np.array([151644, 872, 198, 7985, 264, 13027], np.int32), np.arange(6, dtype=np.int32),
               [quant_span()])
    h = m.ops.rms_norm(x, m.output_norm, m.hp.rms_eps)
    ids, vals, _ = m.ops.matmul_topk(h, m.output, 40)
    want_ids, want_vals = _want(m.ops, h, m.output, 40)
    assert np.array_equal(ids, want_ids) and np.array_equal(vals.view(np.uint32), want_vals.view(np.uint32))
    assert np.array_equal(m.head_argmax(x), m.ops.argmax(m.head(x)))


def quant_span():
    from bloomery.engine.ops import AttnSpan
    return AttnSpan(0, 0, 0, 6)
