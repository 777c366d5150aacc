"""The captured prompt passes (engine/cuda/graph.py, DecodeGraphs.prompt): a prompt of n ids runs in its bucket's
graph, padded past its end in the same slot; it gives the uncaptured pass's logits and KV (within the band between
the decode kernels' attention and the GEMM path's; the buckets from position 0 take the GEMM path over their own
rows), the padding is never read, and what may not be captured is not."""
from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest

from tests.conftest import load_tool

pytestmark = pytest.mark.gpu
SHAPE = dict(n_layer=2, n_embd=512, n_head=8, n_head_kv=2, head_dim=128, n_expert=16, n_expert_used=4, n_ff_exp=256)


def _warmed(tokenizer_source, synthetic_dir, name: str, attn: str, n_slots: int, n_ctx_slot: int):
    """The synthetic file loaded and warmed up with its graphs captured under BLOOMERY_CUDA_PROMPT_ATTN=attn
    (fixed at the capture): the model and the warm-up's parts."""
    from bloomery.engine.loader import load_model
    from bloomery.engine.warmup import warm_up
    from bloomery.placement import whole
    path = load_tool("make_synthetic").write_synthetic(synthetic_dir / name, arch="qwen3moe", mode="blocks",
                                                        mix="q4_k_m", seed=7, tokenizer_from=str(tokenizer_source),
                                                        **SHAPE)
    with _prompt_attn(attn):
        model = load_model(str(path), whole("cuda", n_slots, n_ctx_slot))
        return model, dict(warm_up(model, n_slots))


@pytest.fixture(scope="module")
def warmed(gpu, tokenizer_source, synthetic_dir):
    """The graphs as BLOOMERY_CUDA_PROMPT_ATTN=gemm captures them: the wider buckets from position 0 only, over
    their own rows."""
    model, parts = _warmed(tokenizer_source, synthetic_dir, "graphs-qwen3moe.gguf", "gemm", 3, 256)
    assert "prompt graphs (8, 16, 32, 64, 128, 256 rows)" in parts, parts      # 512 passes the slot
    return model


@contextlib.contextmanager
def _prompt_attn(mode: str):
    kept = os.environ.get("BLOOMERY_CUDA_PROMPT_ATTN")
    os.environ["BLOOMERY_CUDA_PROMPT_ATTN"] = mode
    try:
        yield
    finally:
        if kept is None:
            os.environ.pop("BLOOMERY_CUDA_PROMPT_ATTN", None)
        else:
            os.environ["BLOOMERY_CUDA_PROMPT_ATTN"] = kept


def _uncaptured(model, fn):
    """fn() with the prompt graphs set aside (the pass as a several-slot prefill takes it)."""
    runner = model.ops.decode_runner(model)
    kept, runner._prompts = runner._prompts, {}
    try:
        return fn()
    finally:
        runner._prompts = kept


def _close(got, ref):
    # the captured rows' attention runs in f32 (the decode kernels), the uncaptured pass's through f16
    # probabilities (cuBLAS): up to 0.048 apart on this file's 151,936 logits (H200, session 18)
    np.testing.assert_allclose(got, ref, rtol=2e-2, atol=8e-2)
    assert got[int(ref.argmax())] >= got.max() - 0.05          # the pick, up to a near tie


def _captured_as_uncaptured(model, n: int, pos0: int) -> None:
    """A prompt of n ids at pos0 in slot 1 (after pos0 ids of its own), captured: the uncaptured pass's logits,
    its bucket's graph replayed (not captured again), and the KV it left reads the same to the next decode step."""
    runner = model.ops.decode_runner(model)
    b = runner.prompt_bucket(n, pos0)
    assert b is not None and b >= n
    ids = np.random.default_rng(n + pos0).integers(10, 30000, n).astype(np.int32)
    head = np.arange(500, 500 + pos0, dtype=np.int32) % 30000
    if pos0:
        model.prefill(1, head, 0)
    ref = _uncaptured(model, lambda: model.prefill(1, ids, pos0))
    room = pos0 + n < model.n_ctx_slot                                       # a position left for the next id
    ref_next = model.decode([1], [7], [pos0 + n])[0] if room else None
    if pos0:
        model.prefill(1, head, 0)
    before, counts = runner._prompts[b].graph, model.pass_counts()
    got = model.prefill(1, ids, pos0)
    assert runner._prompts[b].graph is before                                 # replayed, not captured again
    after = model.pass_counts()                                               # and counted so (/metrics)
    assert after["passes_prompt_captured"] == counts["passes_prompt_captured"] + 1
    assert after["passes_prompt"] == counts["passes_prompt"] + 1
    _close(got, ref)
    if room:
        _close(model.decode([1], [7], [pos0 + n])[0], ref_next)              # the KV it left reads the same


@pytest.mark.parametrize("n,pos0", [(1, 0), (5, 0), (8, 0), (13, 0), (16, 7), (16, 200), (40, 100), (64, 0),
                                    (64, 190), (100, 0), (128, 120), (129, 0), (200, 0), (256, 0)])
def test_a_captured_prompt_gives_the_uncaptured_logits_and_kv(warmed, n, pos0):
    _captured_as_uncaptured(warmed, n, pos0)


def test_the_padding_is_never_read(warmed):
    """A 5-id prompt runs in the bucket of 8: positions 5-7 of the slot get padding; the next ids write there
    before anything reads them, so a decode after it equals one after an uncaptured prompt."""
    model = warmed
    ids = np.array([11, 12, 13, 14, 15], np.int32)
    model.prefill(2, np.arange(900, 908, dtype=np.int32), 0)                  # something else at 0..7 first
    _uncaptured(model, lambda: model.prefill(2, ids, 0))
    ref = [model.decode([2], [t], [5 + i])[0] for i, t in enumerate((3, 4, 5))]
    model.prefill(2, np.arange(900, 908, dtype=np.int32), 0)
    model.prefill(2, ids, 0)
    for i, t in enumerate((3, 4, 5)):
        _close(model.decode([2], [t], [5 + i])[0], ref[i])


def test_what_may_not_be_captured_is_not(warmed, monkeypatch):
    model = warmed
    runner = model.ops.decode_runner(model)
    assert runner.prompt_bucket(65, 0) == 128
    assert runner.prompt_bucket(129, 0) == 256                     # from position 0 only:
    assert runner.prompt_bucket(129, 1) is None
    assert runner.prompt_bucket(257, 0) is None                    # the bucket of 512 passes the slot of 256
    assert runner.prompt_bucket(10, 256 - 16) == 16
    assert runner.prompt_bucket(10, 256 - 15) is None              # the bucket would run past the slot's end
    from bloomery.engine.cuda import graph
    monkeypatch.setitem(graph.PROMPT_DEPTH, 64, 128)                # the wider buckets stop at their depth
    assert runner.prompt_bucket(40, 64) == 64 and runner.prompt_bucket(40, 65) is None
    assert runner.prompt_bucket(16, 200) == 16
    assert runner.prompt(0, np.arange(10, 20, dtype=np.int32), 256 - 15) is None
    monkeypatch.setenv("BLOOMERY_CUDA_PROMPT_GRAPHS", "0")
    assert runner.prompt_bucket(10, 0) is None
    assert runner.prompt(0, np.arange(10, 20, dtype=np.int32), 0) is None


def test_the_prompt_graphs_share_one_pool_the_plan_counts(warmed):
    """Every bucket's graph allocates from one pool (they never run at once), which holds no more than the plan
    counts for it: the scratch of the whole card's plan less that of a plan without the captured prompts."""
    from bloomery.plan import model_facts, scratch_bytes_for
    model = warmed
    runner = model.ops.decode_runner(model)
    pools = {id(g.pool) for g in runner._prompts.values()}
    assert len(pools) == 1 and len(runner._prompts) == 6
    facts = model_facts(model.gf)
    counted = (scratch_bytes_for(facts, model.n_ctx_slot, "cuda", 3, graphs=True)
               - scratch_bytes_for(facts, model.n_ctx_slot, "cuda", 3))
    held = runner._prompt_pool.total_bytes()
    assert 0 < held <= counted, (held, counted)


@pytest.fixture(scope="module")
def warmed_tc(gpu, tokenizer_source, synthetic_dir):
    """The same file with BLOOMERY_CUDA_PROMPT_ATTN=tc (the default): a slot of 1,024 positions, so the buckets
    of 256 and 512 rows are captured and taken at a depth."""
    model, parts = _warmed(tokenizer_source, synthetic_dir, "graphs-tc-qwen3moe.gguf", "tc", 2, 1024)
    assert "prompt graphs (8, 16, 32, 64, 128, 256, 512 rows)" in parts, parts
    return model


@pytest.mark.parametrize("n,pos0", [(17, 3), (40, 500), (100, 700), (129, 1), (200, 300), (256, 512), (300, 200),
                                    (512, 0), (512, 512)])
def test_tc_captures_a_prompt_at_any_depth_with_the_uncaptured_logits(warmed_tc, n, pos0):
    """attn_prompt (the tensor cores over the slot's keys) in a captured pass that starts past position 0: the
    logits of the uncaptured pass (the GEMM path over the same keys, f16 probabilities both), and the KV it
    leaves reads the same to the next decode step."""
    _captured_as_uncaptured(warmed_tc, n, pos0)
