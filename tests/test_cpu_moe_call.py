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


def _prompt(path, compiled: bool, monkeypatch, n: int):
    from bloomery.engine.loader import load_model
    from bloomery.placement import whole
    calls = []
    inner = NumpyOps._experts_c
    def spy(*a):
        y = inner(*a) if compiled else None
        calls.append(None if y is None else a[0].shape[0])
        return y
    monkeypatch.setattr(NumpyOps, "_experts_c", staticmethod(spy))
    m = load_model(str(path), whole("numpy", n_slots=1, n_ctx_slot=512))
    ids = np.random.default_rng(5).integers(0, 1000, n).astype(np.int32)
    logits = np.asarray(m.prefill(0, ids, 0), np.float32)
    monkeypatch.undo()
    return logits, m.cache.k.copy(), calls, m


def test_a_long_prompt_in_one_call_gives_the_loops_bits(moe_file, monkeypatch):
    """A 400-id pass takes the one call too: each expert's ~150 rows go through in chunks of MOE_CHUNK_ROWS,
    the same bits as the per-expert loop, and the workers hold no more than the plan counts for the pass."""
    from bloomery.engine.quant import threads
    from bloomery.engine.cpu.sizes import MOE_CHUNK_ROWS, moe_call_bytes
    lib = cpu_kernels.lib()
    lib.moe_scratch_peak(1)
    a, a_k, calls, m = _prompt(moe_file, True, monkeypatch, 400)
    held = lib.moe_scratch_peak(0)
    b, b_k, _, _ = _prompt(moe_file, False, monkeypatch, 400)
    assert calls and all(c == 400 for c in calls)
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    assert np.array_equal(a_k.view(np.uint16), b_k.view(np.uint16))
    d, f = m.hp.n_embd, m.layers[0]["gate_exps"].shape[1]
    # three of eight experts a row: some expert takes more than a chunk's rows
    assert 400 * 3 / 8 > MOE_CHUNK_ROWS
    assert 0 < held <= threads.N_THREADS * moe_call_bytes(400, d, f)
