"""The numpy backend's one-call MoE layer (kernels/cpu_lanes.c moe_ffn_rows, NumpyOps._experts_c) gives the
per-expert loop's bits: prompt and decode logits and the KV, on synthetic qwen3moe files in the q4_k_m mix,
rows of 256 (Q4_K / Q6_K experts) and of 96 (the Q5_0 / Q8_0 fallback), with several slots decoding at once."""
from __future__ import annotations

import numpy as np
import pytest

from bloomery.engine.cpu import kernels as cpu_kernels
from bloomery.engine.cpu.backend import NumpyOps

pytestmark = pytest.mark.skipif(cpu_kernels.lib() is None, reason="the C kernels did not build here")


@pytest.fixture(scope="module", params=[256, 96], ids=["k_quants", "q8_0_family"])
def moe_file(request, synthetic_dir, tokenizer_source):
    from conftest import load_tool
    d = request.param
    path = synthetic_dir / f"moe-call-qwen3moe-{d}.gguf"
    if not path.exists():
        load_tool("make_synthetic").write_synthetic(path, "qwen3moe", tokenizer_from=str(tokenizer_source), n_layer=2,
                                                    n_embd=d, n_head=4, n_head_kv=2, n_ff=2 * d, n_expert=8,
                                                    n_expert_used=3, n_ff_exp=d, mode="blocks")
    return path


def _run(path, compiled: bool, monkeypatch):
    from bloomery.engine.loader import load_model
    from bloomery.placement import whole
    calls = []
    inner = NumpyOps._experts_c
    def spy(*a):
        y = inner(*a) if compiled else None
        calls.append(y is not None)
        return y
    monkeypatch.setattr(NumpyOps, "_experts_c", staticmethod(spy))
    m = load_model(str(path), whole("numpy", n_slots=3, n_ctx_slot=64))
    rng = np.random.default_rng(7)
    out = [np.atleast_2d(np.asarray(m.prefill(s, rng.integers(0, 1000, 5 + 4 * s).astype(np.int32), 0), np.float32))[-1]
           for s in range(3)]
    depth, toks = [5, 9, 13], [9, 9, 9]
    for slots in ([0, 1, 2], [1], [0, 2]):
        lg = m.decode(slots, [toks[s] for s in slots], [depth[s] for s in slots])
        for s, row in zip(slots, lg):
            out.append(np.array(row, np.float32))
            toks[s], depth[s] = int(np.argmax(row)), depth[s] + 1
    monkeypatch.undo()
    return np.stack(out), m.cache.k.copy(), calls


def test_moe_layer_in_one_call_bit_equal(moe_file, monkeypatch):
    a, a_k, calls = _run(moe_file, True, monkeypatch)
    b, b_k, _ = _run(moe_file, False, monkeypatch)
    assert calls and all(calls)                                       # every MoE layer of every pass (<= 16 rows)
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    assert np.array_equal(a_k.view(np.uint16), b_k.view(np.uint16))


def test_a_long_prompt_keeps_the_loop(moe_file, monkeypatch):
    """Passes of more than MOE_CALL_MAX_ROWS rows run the per-expert loop (the plan counts its arrays)."""
    from bloomery.engine.cpu.sizes import MOE_CALL_MAX_ROWS
    from bloomery.engine.loader import load_model
    from bloomery.placement import whole
    m = load_model(str(moe_file), whole("numpy", n_slots=1, n_ctx_slot=64))
    assert NumpyOps._experts_c(np.zeros((MOE_CALL_MAX_ROWS + 1, m.hp.n_embd), np.float32),
                               np.zeros((MOE_CALL_MAX_ROWS + 1, 3), np.int64),
                               np.full((MOE_CALL_MAX_ROWS + 1, 3), 0.3, np.float32),
                               tuple(m.layers[0][n] for n in ("gate_exps", "up_exps", "down_exps"))) is None
