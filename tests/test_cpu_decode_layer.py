"""The numpy backend's one-call decode layer (kernels/cpu_lanes.c decode_layers, NumpyOps.decode_layers)
gives the op-by-op path's bits: logits and the KV it writes, over several steps and two slots, on
synthetic files in the q4_k_m mix: qwen2 (Q/K/V biases) with rows of 256 (Q4_K and Q6_K products) and of
96 (llama-quantize's fallback: Q5_0 and Q8_0); qwen3 (per-head q/k norms); qwen3moe (q/k norms and a
routed FFN: the F32 router, the softmax and top-k, the experts), rows of 256 and of 96; and in the q5_k_m
mix (Q5_K and Q6_K), qwen2 and qwen3moe."""
from __future__ import annotations

import numpy as np
import pytest

from bloomery.engine.cpu import kernels as cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.lib() is None, reason="the C kernels did not build here")


SHAPES = {"qwen2": {}, "qwen3": dict(head_dim=64),
          "qwen3moe": dict(head_dim=64, n_expert=8, n_expert_used=3, n_ff_exp=None)}


@pytest.fixture(scope="module", params=[("qwen2", 256, "q4_k_m"), ("qwen2", 96, "q4_k_m"), ("qwen3", 256, "q4_k_m"),
                                        ("qwen3moe", 256, "q4_k_m"), ("qwen3moe", 96, "q4_k_m"),
                                        ("qwen2", 256, "q5_k_m"), ("qwen3moe", 256, "q5_k_m")],
                ids=["k_quants", "q8_0_family", "qwen3_qk_norm", "qwen3moe_k_quants", "qwen3moe_q8_0_family",
                     "q5_k", "qwen3moe_q5_k"])
def qwen2_blocks(request, synthetic_dir, tokenizer_source):
    from conftest import load_tool
    arch, d, mix = request.param
    extra = {k: (d if v is None else v) for k, v in SHAPES[arch].items()}
    path = synthetic_dir / f"decode-layer-{arch}-{d}-{mix}.gguf"
    if not path.exists():
        load_tool("make_synthetic").write_synthetic(path, arch, tokenizer_from=str(tokenizer_source), n_layer=2,
                                                    n_embd=d, n_head=4, n_head_kv=2, n_ff=2 * d, mode="blocks",
                                                    mix=mix, **extra)
    return path


def _run(path, fused: bool, poison: bool = False):
    from bloomery.engine.loader import load_model
    from bloomery.placement import whole
    m = load_model(str(path), whole("numpy", n_slots=2, n_ctx_slot=64))
    calls = []
    if fused:
        inner = m.ops.decode_layers
        def counted(*a):
            y = inner(*a)
            calls.append(y is not None)
            return y
        m.ops.decode_layers = counted
    else:
        m.ops.decode_layers = lambda *a: None
    rng = np.random.default_rng(3)
    for slot, n in ((0, 9), (1, 5)):
        m.prefill(slot, rng.integers(0, 1000, n).astype(np.int32), 0)
    out, tok = [], [11, 12]
    for i in range(6):
        for slot, pos0 in ((0, 9), (1, 5)):
            if poison and i == 3 and slot == 0:                     # an inf embedding: NaN from layer 0's products
                embed = m.embed
                m.embed = lambda ids: np.full_like(embed(ids), np.inf)
            elif poison:
                m.__dict__.pop("embed", None)
            lg = m.decode([slot], [tok[slot]], [pos0 + i])[0]
            out.append(lg.copy())
            tok[slot] = int(np.nanargmax(lg)) if np.isfinite(lg).any() else 0
    return np.stack(out), m.cache.k.copy(), m.cache.v.copy(), sum(calls)


def test_decode_layer_bit_equal(qwen2_blocks):
    a_logits, a_k, a_v, n_fused = _run(qwen2_blocks, fused=True)
    b_logits, b_k, b_v, _ = _run(qwen2_blocks, fused=False)
    assert n_fused == 6 * 2                                           # every decode step
    assert np.array_equal(a_logits.view(np.uint32), b_logits.view(np.uint32))
    assert np.array_equal(a_k.view(np.uint16), b_k.view(np.uint16))
    assert np.array_equal(a_v.view(np.uint16), b_v.view(np.uint16))


def test_decode_layer_non_finite_input_as_op_by_op(qwen2_blocks):
    """A layer's input with an inf: the products' outputs are NaN, as formats.CAct gives them, and
    the NaN K and V written at that position reach slot 0's later steps, not slot 1's."""
    a = _run(qwen2_blocks, fused=True, poison=True)[0]
    b = _run(qwen2_blocks, fused=False, poison=True)[0]
    assert np.isnan(a[6]).all() and np.isnan(a[-2]).all() and not np.isnan(a[-1]).any()
    assert np.array_equal(np.isnan(a), np.isnan(b))
    assert np.array_equal(a[~np.isnan(a)].view(np.uint32), b[~np.isnan(b)].view(np.uint32))


ROWS_A_STEP = (2, 4, 5, 8, 9, 3, 1)     # the rows of each step: Q4_K's gemm rows (t - t % 4) and Q6_K's
                                        # tiled path (from 8) change with the count


def _run_batched(path, fused: bool, poison_row: int | None = None):
    """Steps of several decode rows at once, one row a slot, each slot at its own depth."""
    from bloomery.engine.loader import load_model
    from bloomery.placement import whole
    n_slots = max(ROWS_A_STEP)
    m = load_model(str(path), whole("numpy", n_slots=n_slots, n_ctx_slot=64))
    calls = []
    inner = m.ops.decode_layers
    def counted(*a):
        y = inner(*a) if fused else None
        calls.append(y is not None)
        return y
    m.ops.decode_layers = counted
    rng = np.random.default_rng(5)
    depth = [3 + 2 * s for s in range(n_slots)]
    for slot in range(n_slots):
        m.prefill(slot, rng.integers(0, 1000, depth[slot]).astype(np.int32), 0)
    if poison_row is not None:                                        # one row's embedding all inf
        embed = m.embed
        def poisoned(ids):
            e = np.array(embed(ids))
            if len(ids) > poison_row:
                e[poison_row] = np.inf
            return e
        m.embed = poisoned
    toks, out = [7] * n_slots, []
    calls.clear()                                                     # the prompts' passes are not decode steps
    for b in ROWS_A_STEP:
        slots = list(range(n_slots - b, n_slots))                    # a different set of slots each time
        lg = m.decode(slots, [toks[s] for s in slots], [depth[s] for s in slots])
        for s, row in zip(slots, lg):
            out.append(np.array(row, np.float32))
            toks[s] = int(np.nanargmax(row)) if np.isfinite(row).any() else 0
            depth[s] += 1
    return np.stack(out), m.cache.k.copy(), m.cache.v.copy(), calls


def test_decode_rows_of_several_slots_in_one_call_bit_equal(qwen2_blocks):
    a_logits, a_k, a_v, calls = _run_batched(qwen2_blocks, fused=True)
    b_logits, b_k, b_v, _ = _run_batched(qwen2_blocks, fused=False)
    assert calls == [True] * len(ROWS_A_STEP)                         # one call a step, whatever its rows
    assert np.array_equal(a_logits.view(np.uint32), b_logits.view(np.uint32))
    assert np.array_equal(a_k.view(np.uint16), b_k.view(np.uint16))
    assert np.array_equal(a_v.view(np.uint16), b_v.view(np.uint16))


def test_one_non_finite_row_of_a_step_as_op_by_op(qwen2_blocks):
    """Row 1 of each step inf: that row's logits NaN, the others' as the op-by-op path's."""
    a = _run_batched(qwen2_blocks, fused=True, poison_row=1)[0]
    b = _run_batched(qwen2_blocks, fused=False, poison_row=1)[0]
    assert np.isnan(a).any() and not np.isnan(a).all()
    assert np.array_equal(np.isnan(a), np.isnan(b))
    assert np.array_equal(a[~np.isnan(a)].view(np.uint32), b[~np.isnan(b)].view(np.uint32))


def test_a_moe_step_over_the_planned_rows_goes_op_by_op(synthetic_dir, tokenizer_source):
    """A MoE file's step of more than MOE_CALL_MAX_ROWS rows takes the ops (whose buffers the plan counts
    at that many rows), one of that many the one call."""
    from conftest import load_tool
    from bloomery.engine.cpu.sizes import MOE_CALL_MAX_ROWS
    from bloomery.engine.loader import load_model
    from bloomery.placement import whole
    path = synthetic_dir / "decode-layer-qwen3moe-rows.gguf"
    if not path.exists():
        load_tool("make_synthetic").write_synthetic(path, "qwen3moe", tokenizer_from=str(tokenizer_source), n_layer=1,
                                                    n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_expert=8,
                                                    n_expert_used=2, n_ff_exp=256, mode="blocks")
    n = MOE_CALL_MAX_ROWS + 1
    m = load_model(str(path), whole("numpy", n_slots=n, n_ctx_slot=16))
    for s in range(n):
        m.prefill(s, [5, 6], 0)
    calls = []
    inner = m.ops.decode_layers
    m.ops.decode_layers = lambda *a: calls.append(inner(*a) is not None) or None
    m.decode(list(range(n)), [7] * n, [2] * n)
    m.decode(list(range(n - 1)), [7] * (n - 1), [3] * (n - 1))
    assert calls == [False, True]
