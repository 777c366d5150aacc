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
import sys
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
# the shapes checked against llama.cpp: quantized blocks with grouped value heads, float16 with
# IMRoPE sections that leave pairs unturned and a full-attention layer every second, float32, the
# dense sibling
SHAPES = {
    "moe_q4km": ("qwen35moe", dict(mode="blocks", mix="q4_k_m", n_layer=4, n_embd=256, n_head=4, n_head_kv=2,
                                   head_dim=64, n_expert=8, n_expert_used=2, n_ff_exp=256, n_ff_shexp=256,
                                   ssm_d_state=32, ssm_n_group=2, ssm_dt_rank=4)),
    "moe_f16_sections": ("qwen35moe", dict(mode="float", ftype="f16", n_layer=4, n_embd=64, n_head=2, n_head_kv=1,
                                           head_dim=32, n_rot=16, rope_sections="1,1,1,1", full_attn_interval=2,
                                           n_expert=4, n_expert_used=1, n_ff_exp=32, n_ff_shexp=48,
                                           ssm_d_state=16, ssm_n_group=2, ssm_dt_rank=2, ssm_d_conv=3, seed=3)),
    # float32 weights: no activation is rounded to int8 or f16 on the way, so no rounding edge can
    # amplify a last-bit difference (the control for the quantized shapes' band)
    "moe_f32": ("qwen35moe", dict(mode="float", ftype="f32", n_layer=4, n_embd=128, n_head=4, n_head_kv=2,
                                  head_dim=32, n_expert=8, n_expert_used=2, n_ff_exp=128, n_ff_shexp=128,
                                  ssm_d_state=32, ssm_n_group=2, ssm_dt_rank=4, seed=7)),
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


def _delta_inputs(t: int, hk: int, h: int, s: int, seed: int = 0):
    """q, k (L2-normalised, as the model feeds them), v, g < 0 and beta in (0, 1), float32."""
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((2, t, hk, s), np.float32)
    q, k = (a / np.linalg.norm(a, axis=-1, keepdims=True) for a in (q, k))
    v = rng.standard_normal((t, h, s), np.float32)
    g, beta = -rng.uniform(0, 1, (t, h)).astype(np.float32), rng.uniform(0, 1, (t, h)).astype(np.float32)
    return q, k, v, g, beta


# the chunked form against the step form, float32 both: measured at most 1.2e-7 on the outputs and 6.6e-7 on
# the state (every shape here and the Qwen3.6 head shape, 32 heads of 128, over 1024 rows)
CHUNKED_TOL = dict(rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("t, cut, hk, h, s", [(7, 3, 2, 4, 8), (64, 0, 1, 2, 16), (65, 64, 2, 4, 16),
                                               (200, 70, 2, 4, 32), (300, 129, 4, 8, 64)])
def test_the_chunked_delta_rule_is_the_step_forms_to_rounding(t, cut, hk, h, s):
    """Spans that fill whole chunks and spans padded to them, one slot's state carried from a first span
    into a second, another slot beside it in the same call: outputs and states as the step form's."""
    q, k, v, g, beta = _delta_inputs(t, hk, h, s)
    got = {}
    for form in (recurrent.delta_rule, recurrent.delta_rule_chunked):
        st = recurrent.RecurrentState(1, 2, 3, 5, h, s)
        parts = [] if not cut else [form(st, 0, [AttnSpan(0, 0, 0, cut)], q[:cut], k[:cut], v[:cut], g[:cut],
                                         beta[:cut])]
        both = [AttnSpan(0, cut, 0, t - cut), AttnSpan(1, 0, t - cut, 2 * (t - cut))]   # slot 1 reads the same rows
        cat = lambda a: np.concatenate([a[cut:], a[cut:]])                            # noqa: E731
        rest = form(st, 0, both, cat(q), cat(k), cat(v), cat(g), cat(beta))
        got[form.__name__] = (np.concatenate(parts + [rest[:t - cut]]), rest[t - cut:], st.delta.copy(),
                              st.delta_pos.copy())
    step, chunked = got["delta_rule"], got["delta_rule_chunked"]
    for a, b in zip(step[:3], chunked[:3]):
        np.testing.assert_allclose(b, a, **CHUNKED_TOL)
    np.testing.assert_array_equal(step[3], chunked[3])                  # the same positions held
    assert np.abs(step[0] - chunked[0]).max() > 0 or t < 64             # not the same code: rounding shows


def test_a_pass_takes_the_chunked_form_from_64_rows_unless_the_lever_says_off(monkeypatch):
    q, k, v, g, beta = _delta_inputs(100, 2, 4, 16, seed=1)
    spans = [AttnSpan(0, 0, 0, 63), AttnSpan(1, 0, 63, 100)]             # 63 and 37 rows: both step by step
    long = [AttnSpan(0, 0, 0, 100)]                                      # 100 rows: chunked

    def run(fn, sp):
        st = recurrent.RecurrentState(1, 2, 3, 5, 4, 16)
        return fn(st, 0, sp, q, k, v, g, beta)

    assert recurrent.CHUNKED_MIN_ROWS == 64
    np.testing.assert_array_equal(run(recurrent.delta_rule_spans, spans), run(recurrent.delta_rule, spans))
    np.testing.assert_array_equal(run(recurrent.delta_rule_spans, long), run(recurrent.delta_rule_chunked, long))
    monkeypatch.setattr(recurrent, "CHUNKED", False)
    np.testing.assert_array_equal(run(recurrent.delta_rule_spans, long), run(recurrent.delta_rule, long))


@pytest.mark.parametrize("shape, band", [("moe_f32", 1e-4), ("moe_q4km", 0.06)])     # 0.06: LOGPROB_BAND
def test_a_long_prompt_in_the_chunked_form_stays_within_the_band(synthetic_dir, monkeypatch, shape, band):
    """A 300-id prompt read in one pass both ways: the last position's log-probabilities. On float32 weights
    the two forms' rounding alone (measured 1.2e-5); on the Q4_K_M mix an activation on an int8 rounding edge
    can move a step, as against llama.cpp's AVX2 build (docs/verify.md): its band."""
    arch, kw = SHAPES[shape]
    m = load(make(synthetic_dir, shape, arch=arch, **kw), n_slots=1, n_ctx=512)
    prompt = np.random.default_rng(3).integers(100, 150000, 300)
    logp = {}
    for on in (False, True):
        monkeypatch.setattr(recurrent, "CHUNKED", on)
        z = m.prefill(0, prompt, 0).astype(np.float64)
        logp[on] = z - z.max() - np.log(np.exp(z - z.max()).sum())
    gap = np.abs(logp[True] - logp[False]).max()
    print(f"{shape}: chunked against step, widest log-probability gap {gap:.2e}")
    assert 0 < gap < band
    assert int(np.argmax(logp[True])) == int(np.argmax(logp[False]))


@pytest.mark.parametrize("n", [16, 64, 100, 128])
def test_vec_dot_f32_adds_in_ggmls_order(n):
    """Lanes l of 64-wide steps into four 16-lane accumulators, (0 + 2) + (1 + 3), halves 8, 4, 2, 1,
    then the tail: written out one float at a time."""
    from bloomery.engine.cpu.ops_math import vec_dot_f32
    rng = np.random.default_rng(n)
    a, b = rng.standard_normal((2, 3, n)).astype(np.float32)
    f32 = np.float32
    for r in range(3):
        main, acc = n - n % 64, [f32(0)] * 64
        for c in range(0, main, 64):
            acc = [f32(float(a[r, c + i]) * float(b[r, c + i]) + float(acc[i])) for i in range(64)]
        v = [(acc[i] + acc[32 + i]) + (acc[16 + i] + acc[48 + i]) for i in range(16)]
        for half in (8, 4, 2, 1):
            v = [v[i] + v[half + i] for i in range(half)]
        res = v[0]
        for i in range(main, n):
            res = f32(float(a[r, i]) * float(b[r, i]) + float(res))
        assert vec_dot_f32(a[r], b[r]) == res
    np.testing.assert_allclose(vec_dot_f32(a, b), (a.astype(np.float64) * b).sum(-1), rtol=1e-5, atol=1e-5)


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
        name = "other"
        caps = dataclasses.replace(NumpyOps.caps, recurrent=False)

    with pytest.raises(ModelError, match="qwen35moe needs linear-attention ops .* which the other backend lacks"):
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


# --- against llama.cpp's CPU build (slow; skips where no llama-server binary is built) ------------

def llama_cpu_server() -> Path | None:
    """A CPU llama-server of the reference version: BLOOMERY_LLAMA_CPU_SERVER, else the cache's
    llama-cpu build, else build-llama.sh's CPU build folder (none is built here)."""
    cache = Path(os.environ.get("BLOOMERY_CACHE") or Path.home() / ".cache/bloomery")
    for p in (os.environ.get("BLOOMERY_LLAMA_CPU_SERVER"), cache / "llama-cpu/build/bin/llama-server",
              *sorted((cache / "ref").glob("build-cpu-*/bin/llama-server"))):
        if p and Path(p).is_file():
            return Path(p)
    return None


def load_tool_path(path: Path):
    spec = importlib.util.spec_from_file_location(f"bloomery_tools_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


LLAMA = llama_cpu_server()
needs_llama = pytest.mark.skipif(LLAMA is None, reason="no CPU llama-server built (BLOOMERY_LLAMA_CPU_SERVER)")
N_GEN = 64
# docs/verify.md: the widest top-5 log-probability gap measured against this machine's llama.cpp
# CPU build, with margin. That build runs AVX2 kernels (the numpy backend mirrors the AVX-512
# ones): the delta rule's dot products add in another order, and where an activation then sits on
# an int8 rounding edge before a quantized matmul, the flip moves a few logits by up to ~3e-2.
LOGPROB_BAND = 0.06


def teacher_forced(m, slot: int, prompt: list[int], forced: list[int]) -> list[np.ndarray]:
    """Each step's log-softmax in process, fed llama-server's ids (so one parting does not carry on)."""
    logits = m.prefill(slot, prompt, 0)
    logps = []
    for pos, token in enumerate(forced, start=len(prompt)):
        z = logits.astype(np.float64)
        logps.append(z - z.max() - np.log(np.exp(z - z.max()).sum()))
        logits = m.decode([slot], [token], [pos])[0]
    return logps


@pytest.mark.slow
@needs_llama
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_greedy_ids_and_logprobs_match_llama_server(synthetic_dir, shape):
    """Two prompts (5 ids, and 70: the prompt paths of 64+ rows) x 64 greedy ids. Every step, fed
    llama-server's ids: our top id is llama-server's, unless its own top two lie within the band;
    every top-5 log-probability within the band. Free-running, the count of ids equal is printed."""
    arch, kw = SHAPES[shape]
    path = make(synthetic_dir, shape, arch=arch, **kw)
    ref = load_tool_path(REPO / "tools" / "ref" / "reference_server.py")
    rng = np.random.default_rng(len(shape))
    prompts = [rng.integers(100, 150000, 5).tolist(), rng.integers(100, 150000, 70).tolist()]
    m = load(path, n_slots=1, n_ctx=512)
    widest, report = 0.0, []
    with ref.ReferenceServer(path, "-t", "2", "--no-warmup", ctx_size=512, binary=LLAMA) as srv:
        for prompt in prompts:
            status, got = srv.post("/completion", {"prompt": prompt, "n_predict": N_GEN, "temperature": 0,
                                                    "n_probs": 5, "return_tokens": True, "ignore_eos": True,
                                                    "cache_prompt": False})
            assert status == 200, got
            theirs = got["tokens"]
            logps = teacher_forced(m, 0, prompt, theirs)
            for step, probs in aligned(theirs, got["completion_probabilities"]):
                tops = probs["top_logprobs"]
                for top in tops:
                    widest = max(widest, abs(logps[step][top["id"]] - top["logprob"]))
                if int(np.argmax(logps[step])) != theirs[step]:
                    assert tops[0]["logprob"] - tops[1]["logprob"] < LOGPROB_BAND, (shape, step, tops[:2])
            mine = [int(np.argmax(lp)) for lp in logps]
            free = ours_free_running(m, prompt, N_GEN)
            n_free = next((i for i, (a, b) in enumerate(zip(free, theirs)) if a != b), N_GEN)
            report.append(f"{len(prompt)} ids: {sum(a == b for a, b in zip(mine, theirs))}/{N_GEN} teacher-forced, "
                          f"{n_free}/{N_GEN} free-running")
    print(f"{shape}: {'; '.join(report)}; widest top-5 logprob gap {widest:.2e}")
    assert widest < LOGPROB_BAND


def ours_free_running(m, prompt: list[int], n: int) -> list[int]:
    ids, logits = [], m.prefill(0, prompt, 0)
    for pos in range(len(prompt), len(prompt) + n):
        ids.append(int(np.argmax(logits)))
        logits = m.decode([0], [ids[-1]], [pos])[0]
    return ids


def aligned(tokens: list[int], probs: list[dict]):
    """(step, entry) of llama-server's completion_probabilities: an id whose piece ends inside a UTF-8
    character has no entry of its own, so each entry is matched to the next step with its id."""
    step = 0
    for entry in probs:
        while tokens[step] != entry["id"]:
            step += 1
        yield step, entry
        step += 1


# --- through the server -----------------------------------------------------------------

def completion(url: str, prompt: list[int], n: int, cache_prompt: bool = True) -> dict:
    body = json.dumps({"prompt": prompt, "n_predict": n, "temperature": 0, "return_tokens": True,
                       "ignore_eos": True, "cache_prompt": cache_prompt}).encode()
    req = urllib.request.Request(url + "/completion", data=body, headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


@pytest.mark.slow
def test_a_second_turn_reuses_the_slot_and_gives_the_cold_runs_ids(synthetic_dir):
    """Turn 2 extends turn 1 (its prompt, its answer, a new question): the slot's recurrent state
    carries on from what it holds (cache_n counts it) and the ids equal a cold run's; a prompt that
    parts from what the slot holds (these raw ids carry no message start) is read whole, from a fresh
    state, with the cold run's ids too. Chat prompts keep checkpoints at message starts."""
    from serve_proc import Served
    path = make(synthetic_dir, "small", **SMALL)
    p1 = [9707, 11, 1879, 0, 13, 576, 3555, 374]
    with Served("-m", str(path), "--backend", "cpu", "-c", "256", "-np", "1", "--no-warmup") as s:
        g1 = completion(s.url, p1, 12)["tokens"]
        p2 = p1 + g1 + [198, 3838, 374, 279]
        warm = completion(s.url, p2, 16)
        assert warm["timings"]["cache_n"] == len(p1) + len(g1) - 1     # all the slot held (the last id never fed)
        cold = completion(s.url, p2, 16, cache_prompt=False)
        assert cold["timings"]["cache_n"] == 0 and warm["tokens"] == cold["tokens"]
        p3 = p1[:4] + [42, 43, 44]                                    # parts from what the slot holds
        reread = completion(s.url, p3, 16)
        assert reread["timings"]["cache_n"] == 0
        assert reread["tokens"] == completion(s.url, p3, 16, cache_prompt=False)["tokens"]
        # the chat route renders the file's own template; asked twice (the second a prompt shorter than
        # what the slot then holds, so read whole), the same answer
        chat = json.dumps({"messages": [{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": "Hello?"}],
                           "max_tokens": 8, "temperature": 0}).encode()
        answers = []
        for _ in range(2):
            req = urllib.request.Request(s.url + "/v1/chat/completions", data=chat,
                                         headers={"content-type": "application/json"})
            with urllib.request.urlopen(req, timeout=300) as r:
                answers.append(json.loads(r.read()))
        assert answers[0]["usage"]["completion_tokens"] == 8
        assert answers[0]["choices"][0]["message"] == answers[1]["choices"][0]["message"]
        # the file's vocabulary and template carry <|im_start|>: the second asking restored the checkpoint at the
        # assistant turn's start; another question after the same system prompt restores the one after it
        t0, t1 = answers[0]["timings"], answers[1]["timings"]
        assert t0["cache_n"] == 0 and 0 < t1["cache_n"] < t0["prompt_n"]
        other = json.dumps({"messages": [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "And what else, then?"}],
                            "max_tokens": 8, "temperature": 0}).encode()
        req = urllib.request.Request(s.url + "/v1/chat/completions", data=other,
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            t2 = json.loads(r.read())["timings"]
        assert 0 < t2["cache_n"] < t1["cache_n"] and t2["cache_n"] + t2["prompt_n"] > t1["cache_n"]


def test_inconsistent_ssm_sizes_refuse_the_start_by_name(synthetic_dir, tmp_path):
    """The plan stage refuses the file before any load (exit 1, the key and the sizes named)."""
    good = make(synthetic_dir, "small", **SMALL).read_bytes()
    key = b"qwen35moe.ssm.inner_size"
    at = good.index(key) + len(key) + 4                                # after the key, its uint32 type tag
    assert int.from_bytes(good[at:at + 4], "little") == 64
    bad = tmp_path / "bad_ssm.gguf"
    bad.write_bytes(good[:at] + (96).to_bytes(4, "little") + good[at + 4:])
    r = subprocess.run([sys.executable, "-m", "bloomery.supervisor", "-m", str(bad), "--port", "0",
                        "--backend", "cpu"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "inconsistent SSM sizes: ssm.inner_size 96 is not ssm.state_size 16" in r.stderr, r.stderr[-2000:]


def test_the_plan_stage_plans_the_seat_on_either_backend(synthetic_dir):
    from bloomery.plan import Census
    from bloomery.stages.plan import make as make_stage_plan
    gf = open_gguf(str(make(synthetic_dir, "small", **SMALL)))
    card = Census(host_avail_bytes=64 << 30, card_free_bytes=(80 << 30,))
    plan, _ = make_stage_plan({"device": "cpu", "ctx_size": 256}, gf, card)
    facts = model_facts(gf)
    rope = 256 * (facts.n_rot or facts.head_dim_k) // 2 * 4 * 2          # RoPE's cos and sin for 256 positions
    # the state, and the checkpoints at message starts a slot keeps of it (--ctx-checkpoints' default, 32)
    assert plan.backend == "numpy" and plan.kv_bytes == 256 * 2 * 2 * 32 * 2 + 33 * facts.state_bytes + rope
    plan, _ = make_stage_plan({"device": "cpu", "ctx_size": 256, "ctx_checkpoints": 0}, gf, card)
    assert plan.kv_bytes == 256 * 2 * 2 * 32 * 2 + facts.state_bytes + rope
    # on the card (no switch needed since session 16: docs/verify.md): the state beside the KV there, its
    # checkpoints (host copies) in the host's KV term
    plan, _ = make_stage_plan({"device": "cuda", "ctx_size": 256}, gf, card)
    host, main = plan.placement.devices[0], plan.placement.devices[1]
    assert plan.backend == "cuda" and plan.kv_bytes == 256 * 2 * 2 * 32 * 2 + facts.state_bytes
    assert main.terms.kv == plan.kv_bytes and host.terms.kv == 32 * facts.state_bytes == plan.checkpoint_bytes
    assert any("counted in the host's KV term" in line for _, line, _ in plan.explain())
