"""The qwen35moe seat (and its dense sibling qwen35): synthetic files as llama.cpp reads them,
the recurrent ops against plain formulas, the slot state that cannot step back, refusals at
plan time, and (slow, where llama.cpp's CPU build is at hand) greedy ids and logits against
llama-server on files of several shapes."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, load_tool

from bloomery.engine.cpu import recurrent
from bloomery.engine.cpu.backend import NumpyOps, imrope_text_pairs
from bloomery.engine.models.base import ModelError
from bloomery.engine.models.registry import model_class
from bloomery.engine.ops import AttnSpan
from bloomery.engine.scheduler import Scheduler
from bloomery.engine.types import EngineRequest
from bloomery.gguf_file import open_gguf
from bloomery.header_check import HeaderError, check_header
from bloomery.plan import model_facts

ms = load_tool("make_synthetic")

# small shapes: 4 layers (3 Gated DeltaNet + 1 full attention) unless said otherwise
SMALL = dict(n_layer=4, n_embd=64, n_head=4, n_head_kv=2, head_dim=32, n_expert=4, n_expert_used=2, n_ff_exp=64,
             n_ff_shexp=64, ssm_d_state=16, ssm_n_group=2, ssm_dt_rank=4)
# the shapes checked against llama.cpp: quantized blocks with grouped value heads, float with
# IMRoPE sections that leave pairs unturned and a full-attention layer every second, the dense sibling
SHAPES = {
    "moe_q4km": ("qwen35moe", dict(mode="blocks", mix="q4_k_m", n_layer=4, n_embd=256, n_head=4, n_head_kv=2,
                                   head_dim=64, n_expert=8, n_expert_used=2, n_ff_exp=256, n_ff_shexp=256,
                                   ssm_d_state=32, ssm_n_group=2, ssm_dt_rank=4)),
    "moe_f16_sections": ("qwen35moe", dict(mode="float", ftype="f16", n_layer=4, n_embd=64, n_head=2, n_head_kv=1,
                                           head_dim=32, n_rot=16, rope_sections="1,1,1,1", full_attn_interval=2,
                                           n_expert=4, n_expert_used=1, n_ff_exp=32, n_ff_shexp=48,
                                           ssm_d_state=16, ssm_n_group=2, ssm_dt_rank=2, ssm_d_conv=3, seed=3)),
    "dense_q8": ("qwen35", dict(mode="blocks", mix="q8_0", n_layer=4, n_embd=128, n_head=4, n_head_kv=2,
                                head_dim=32, n_ff=256, ssm_d_state=32, ssm_n_group=1, ssm_dt_rank=2, seed=5)),
}


def make(synthetic_dir: Path, name: str, arch: str = "qwen35moe", **kw) -> Path:
    path = synthetic_dir / f"q35_{name}.gguf"
    if not path.exists():
        ms.write_synthetic(path, arch=arch, **kw)
    return path


def load(path: Path, n_slots: int = 2, n_ctx: int = 256):
    gf = open_gguf(str(path))
    return model_class(gf.arch())(gf, NumpyOps(), n_slots, n_ctx)


# --- the file ---------------------------------------------------------------------------

def test_synthetic_names_shapes_and_keys(synthetic_dir):
    g = open_gguf(str(make(synthetic_dir, "small", **SMALL)))
    lin = {k[6:]: v.shape for k, v in g.tensors.items() if k.startswith("blk.0.")}
    assert lin == {   # ne order; conv channels 2 * 2 key heads * 16 + 4 value heads * 16 = 128
        "attn_norm.weight": (64,), "attn_qkv.weight": (64, 128), "attn_gate.weight": (64, 64),
        "ssm_conv1d.weight": (4, 128), "ssm_dt.bias": (4,), "ssm_a": (4,), "ssm_beta.weight": (64, 4),
        "ssm_alpha.weight": (64, 4), "ssm_norm.weight": (16,), "ssm_out.weight": (64, 64),
        "post_attention_norm.weight": (64,), "ffn_gate_inp.weight": (64, 4), "ffn_gate_exps.weight": (64, 64, 4),
        "ffn_up_exps.weight": (64, 64, 4), "ffn_down_exps.weight": (64, 64, 4), "ffn_gate_inp_shexp.weight": (64,),
        "ffn_gate_shexp.weight": (64, 64), "ffn_up_shexp.weight": (64, 64), "ffn_down_shexp.weight": (64, 64)}
    full = {k[6:]: v.shape for k, v in g.tensors.items() if k.startswith("blk.3.") and "ffn" not in k}
    assert full == {"attn_norm.weight": (64,), "attn_q.weight": (64, 256), "attn_k.weight": (64, 64),
                    "attn_v.weight": (64, 64), "attn_output.weight": (128, 64), "attn_q_norm.weight": (32,),
                    "attn_k_norm.weight": (32,), "post_attention_norm.weight": (64,)}
    assert {k: g.get(f"qwen35moe.{k}") for k in ("ssm.conv_kernel", "ssm.state_size", "ssm.group_count",
                                                  "ssm.time_step_rank", "ssm.inner_size", "full_attention_interval",
                                                  "rope.dimension_count", "rope.dimension_sections",
                                                  "expert_shared_feed_forward_length")} == {
        "ssm.conv_kernel": 4, "ssm.state_size": 16, "ssm.group_count": 2, "ssm.time_step_rank": 4,
        "ssm.inner_size": 64, "full_attention_interval": 4, "rope.dimension_count": 8,
        "rope.dimension_sections": [2, 2, 0, 0], "expert_shared_feed_forward_length": 64}
    assert (g.tensor_data("blk.0.ssm_a").view(np.float32) < 0).all()        # -exp(A_log): every step decays


def test_synthetic_refuses_inconsistent_shapes(tmp_path):
    with pytest.raises(ms.ShapeError, match="ssm-dt-rank 3 .* multiple of --ssm-n-group 2"):
        ms.write_synthetic(tmp_path / "x.gguf", arch="qwen35moe", **{**SMALL, "ssm_dt_rank": 3})
    with pytest.raises(ms.ShapeError, match="--rope-sections"):
        ms.write_synthetic(tmp_path / "x.gguf", arch="qwen35moe", **{**SMALL, "rope_sections": "1,2"})


# --- the ops ----------------------------------------------------------------------------

def test_delta_rule_matches_the_formula_and_carries_its_state():
    rng = np.random.default_rng(0)
    t, hk, h, s = 7, 2, 4, 8
    q, k = rng.standard_normal((2, t, hk, s), np.float32)
    v = rng.standard_normal((t, h, s), np.float32)
    g, beta = -rng.uniform(0, 1, (t, h)).astype(np.float32), rng.uniform(0, 1, (t, h)).astype(np.float32)
    st = recurrent.RecurrentState(1, 2, 3, 5, h, s)
    out = recurrent.delta_rule(st, 0, [AttnSpan(1, 0, 0, t)], q, k, v, g, beta)
    ref, state = np.empty((t, h, s)), np.zeros((h, s, s))            # state[h] = S, out = S^T q / sqrt(s)
    for i in range(t):
        for hh in range(h):
            kk, qq = k[i, hh % hk].astype(np.float64), q[i, hh % hk].astype(np.float64)
            S = state[hh] * np.exp(g[i, hh])
            S = S + np.outer(kk, (v[i, hh] - S.T @ kk) * beta[i, hh])
            state[hh] = S
            ref[i, hh] = S.T @ qq / np.sqrt(s)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(st.delta[0, 1].transpose(0, 2, 1), state, rtol=1e-4, atol=1e-5)
    assert not st.delta[0, 0].any()                                    # the other slot untouched
    # in two spans (a prompt then a step) the same as in one
    st2 = recurrent.RecurrentState(1, 2, 3, 5, h, s)
    a = recurrent.delta_rule(st2, 0, [AttnSpan(0, 0, 0, 4)], q[:4], k[:4], v[:4], g[:4], beta[:4])
    b = recurrent.delta_rule(st2, 0, [AttnSpan(0, 4, 0, 3)], q[4:], k[4:], v[4:], g[4:], beta[4:])
    np.testing.assert_allclose(np.concatenate([a, b]), out, rtol=1e-5, atol=1e-6)


def test_conv_step_is_causal_over_the_window():
    rng = np.random.default_rng(1)
    x, kern = rng.standard_normal((6, 5), np.float32), rng.standard_normal((5, 3), np.float32)
    st = recurrent.RecurrentState(1, 1, 2, 5, 1, 1)
    y = np.concatenate([recurrent.conv_step(st, 0, [AttnSpan(0, 0, 0, 4)], x[:4], kern),
                        recurrent.conv_step(st, 0, [AttnSpan(0, 4, 0, 2)], x[4:], kern)])
    padded = np.concatenate([np.zeros((2, 5)), x])
    ref = np.stack([sum(padded[t + j] * kern[:, j] for j in range(3)) for t in range(6)])
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(st.conv[0, 0], x[4:])


def test_a_recurrent_state_cannot_step_back():
    st = recurrent.RecurrentState(1, 1, 2, 3, 1, 2)
    recurrent.conv_step(st, 0, [AttnSpan(0, 0, 0, 5)], np.ones((5, 3), np.float32), np.ones((3, 3), np.float32))
    with pytest.raises(recurrent.RecurrentStateError, match="holds positions 0..4 .* position 3 cannot follow"):
        recurrent.conv_step(st, 0, [AttnSpan(0, 3, 0, 1)], np.ones((1, 3), np.float32), np.ones((3, 3), np.float32))


def test_imrope_turns_pairs_by_their_sector():
    assert imrope_text_pairs(16, (11, 11, 10, 0)).all()              # Qwen3.6's sections turn every pair
    assert imrope_text_pairs(8, (1, 1, 1, 1)).tolist() == [True, True, True, False] * 2
    ops = NumpyOps()
    x = np.random.default_rng(2).standard_normal((3, 2, 16), np.float32)
    pos = np.array([0, 5, 9], np.int32)
    plain, sect = ops.rope_neox(x, pos, 16, 1e6), ops.rope_neox(x, pos, 16, 1e6, (1, 1, 1, 1))
    still = [3, 7]                                                       # pairs (3, 11) and (7, 15)
    np.testing.assert_array_equal(sect[..., still], x[..., still])
    np.testing.assert_array_equal(sect[..., [i + 8 for i in still]], x[..., [i + 8 for i in still]])
    moved = [0, 1, 2, 4, 5, 6]
    np.testing.assert_array_equal(sect[..., moved], plain[..., moved])


# --- the model --------------------------------------------------------------------------

def test_prompt_in_parts_and_decode_agree_with_one_pass(synthetic_dir):
    m = load(make(synthetic_dir, "small", **SMALL))
    assert m.recurrent == [True, True, True, False] and m.rewinds is False
    ids = [9707, 11, 1879, 0, 13, 576, 9707]
    whole = m.prefill(0, ids, 0)
    m.prefill(1, ids[:3], 0)
    parts = m.prefill(1, ids[3:6], 3)
    step = m.decode([1], [ids[6]], [6])[0]
    np.testing.assert_allclose(parts, m.prefill(0, ids[:6], 0), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(step, whole, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="cannot step back"):           # slot 1 holds 0..6
        m.prefill(1, ids[4:], 4)
    np.testing.assert_allclose(m.prefill(1, ids, 0), whole, rtol=1e-4, atol=1e-4)   # from 0: a fresh state


def test_batched_decode_keeps_each_slots_state(synthetic_dir):
    m = load(make(synthetic_dir, "small", **SMALL), n_slots=3)
    m.prefill(0, [9707, 11], 0)
    m.prefill(2, [1879, 13, 576], 0)
    both = m.decode([0, 2], [5, 7], [2, 3])
    m2 = load(make(synthetic_dir, "small", **SMALL), n_slots=3)
    m2.prefill(0, [9707, 11], 0)
    m2.prefill(2, [1879, 13, 576], 0)
    # (a batch of two sums in another float order than one row: a few 1e-4 apart, not a mixed-up state)
    np.testing.assert_allclose(both[0], m2.decode([0], [5], [2])[0], atol=1e-3)
    np.testing.assert_allclose(both[1], m2.decode([2], [7], [3])[0], atol=1e-3)


def test_the_plan_counts_the_recurrent_state(synthetic_dir):
    path = make(synthetic_dir, "small", **SMALL)
    facts = model_facts(open_gguf(str(path)))
    m = load(path, n_slots=3, n_ctx=128)
    assert facts.n_head_kv == (0, 0, 0, 2)                              # KV only for the full-attention layer
    assert 3 * facts.state_bytes == m.state.nbytes > 0
    assert m.cache.k.shape[0] == 1


def test_other_backends_refuse_by_name(synthetic_dir):
    gf = open_gguf(str(make(synthetic_dir, "small", **SMALL)))

    class NoRecurrent(NumpyOps):
        name = "cuda"
        caps = dataclasses.replace(NumpyOps.caps, recurrent=False)

    with pytest.raises(ModelError, match="qwen35moe runs on the CPU backend in this build"):
        model_class("qwen35moe")(gf, NoRecurrent(), 1, 64)


# --- slots ------------------------------------------------------------------------------

def _req(name: str, ids) -> EngineRequest:
    return EngineRequest(req_id=name, prompt_ids=tuple(ids), n_predict=4)


@pytest.mark.parametrize("prompt, kept, kept_kv", [((1, 2, 3, 4, 9), 4, 4), ((1, 2, 3, 4), 0, 3),
                                                   ((1, 2, 7, 8), 0, 2), ((1, 2, 3), 0, 2)])
def test_a_slot_without_rewinds_keeps_only_what_the_prompt_extends(prompt, kept, kept_kv):
    for rewinds, want in ((False, kept), (True, kept_kv)):   # a KV cache keeps any common prefix
        sch = Scheduler(1, 64, rewinds=rewinds)
        sch.slots[0].cached_ids[:] = [1, 2, 3, 4]
        sch.add(_req("a", prompt))
        (slot,) = sch.schedule()
        assert slot.n_cached == want and slot.cached_ids == [1, 2, 3, 4][:want]


# --- bad input at plan time -------------------------------------------------------------

def _header(path: Path):
    g = open_gguf(str(path))
    return dict(g.metadata), dict(g.tensors)


def test_header_refuses_a_missing_recurrent_tensor_and_inconsistent_sizes(synthetic_dir):
    path = make(synthetic_dir, "small", **SMALL)
    md, tensors = _header(path)
    check_header(str(path), md, tensors)
    del tensors["blk.1.ssm_conv1d.weight"]
    with pytest.raises(HeaderError, match="tensor 'blk.1.ssm_conv1d.weight' is missing"):
        check_header(str(path), md, tensors)
    md, tensors = _header(path)
    with pytest.raises(HeaderError, match="inconsistent SSM sizes: ssm.inner_size 96 is not ssm.state_size 16"):
        check_header(str(path), {**md, "qwen35moe.ssm.inner_size": 96}, tensors)
    with pytest.raises(HeaderError, match="inconsistent SSM sizes: ssm.time_step_rank 3"):
        check_header(str(path), {**md, "qwen35moe.ssm.time_step_rank": 3, "qwen35moe.ssm.inner_size": 48}, tensors)
    with pytest.raises(HeaderError, match="blk.0.ssm_conv1d.weight' has shape \\[4, 128\\], .* give \\[5, 128\\]"):
        check_header(str(path), {**md, "qwen35moe.ssm.conv_kernel": 5}, tensors)
