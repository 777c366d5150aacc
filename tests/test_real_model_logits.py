"""The numpy engine against llama.cpp's CPU build on the real Qwen2.5-Coder-0.5B Q4_K_M.

Goldens: tests/golden/logits/qwen25_*.npz, made by tools/ref/make_logit_goldens.py
(prompt ids from llama.cpp's tokenizer, greedy ids, the last prompt position's
logits, and the logits after STEP greedy tokens).

Every op mirrors the float order and the rounding of the kernel llama.cpp runs
(quantized matmuls: bloomery/engine/quant/; attention, both flash-attention paths
with the C library's expf and ggml_v_expf: kv_cache.py and ops_math.py), so the logits
are llama.cpp's bit for bit: measured max |diff| 0.0 at prefill and at step 16 on all
six prompts, the 86-token one (the tiled attention path) included, and every one of
the 64 greedy ids equal, teacher-forced. The test asks for exactly that.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

GOLDEN = Path(__file__).parent / "golden" / "logits"
CASES = sorted(p.stem for p in GOLDEN.glob("qwen25_*.npz"))

pytestmark = pytest.mark.real_model


@pytest.fixture(autouse=True)
def llama_order(monkeypatch):
    """These goldens are llama.cpp's bits: the kernel order must be llama.cpp's (the default)."""
    from bloomery.engine.quant import formats
    monkeypatch.setattr(formats, "KERNEL_ORDER", True)


@pytest.fixture(scope="module")
def model(real_model_path):
    from bloomery.engine.loader import load_model
    from bloomery.placement import whole
    return load_model(str(real_model_path), whole("numpy", n_slots=2, n_ctx_slot=512))


def _golden(name: str) -> dict:
    with np.load(GOLDEN / f"{name}.npz") as z:
        return {k: z[k] for k in z.files}


def test_goldens_present():
    assert len(CASES) >= 5, f"expected at least 5 real-model goldens in {GOLDEN}, found {CASES}"


@pytest.mark.parametrize("case", CASES)
def test_greedy_and_logits_match_llama_cpp(model, case):
    """Each step is fed llama.cpp's previous id; the prefill and step-STEP logits equal llama.cpp's
    bit for bit and every argmax is llama.cpp's id."""
    g = _golden(case)
    prompt, want = g["prompt_ids"], g["greedy_ids"]
    step = int(g["step"])
    logits = model.prefill(0, prompt, 0)                               # [V]
    n_bad = int((logits != g["logits_prefill"]).sum())
    assert n_bad == 0, f"{case}: {n_bad} prefill logits differ, max {float(np.abs(logits - g['logits_prefill']).max()):.3g}"
    parted = []
    for i in range(want.size):
        if i:
            logits = model.decode([0], [int(want[i - 1])], [prompt.size + i - 1])[0]
        if i == step:
            n_bad = int((logits != g["logits_step"]).sum())
            assert n_bad == 0, f"{case}: {n_bad} logits differ after {step} steps, " \
                               f"max {float(np.abs(logits - g['logits_step']).max()):.3g}"
        if int(logits.argmax()) != int(want[i]):
            parted.append((i, int(logits.argmax()), int(want[i]), round(float(g["margins"][i]), 4)))
    assert not parted, f"{case}: (step, ours, llama.cpp's, its top-2 margin) where the ids part: {parted}"


def test_tiled_flash_attention_bit_for_bit(model):
    """llama.cpp's tiled F32 flash-attention path (64+ query rows): layer 0 of the 86-token
    prompt, fed llama.cpp's own roped Q, K and V, gives its kqv_out bit for bit (rows 64+
    see two KV tiles, the second a partial one padded with -inf)."""
    from bloomery.engine.ops import AttnSpan
    g = _golden("attn_qwen25_long")
    hp = model.hp
    t = g["q"].shape[0]
    assert t >= 64, "the golden must take the tiled path"
    cache = model.ops.kv_cache(1, 1, 128, hp.n_head_kv, hp.head_dim)
    got = model.ops.attention(cache, 0, [AttnSpan(0, 0, 0, t)], g["q"].reshape(t, hp.n_head, hp.head_dim),
                              g["k"].reshape(t, hp.n_head_kv, hp.head_dim), g["v"].reshape(t, hp.n_head_kv, hp.head_dim),
                              model.kq_scale)
    bad = got != g["kqv"]
    assert not bad.any(), f"{int(bad.sum())} of {bad.size} differ in rows {np.unique(np.nonzero(bad)[0])[:8]}"


def test_two_slots_do_not_interfere(model):
    """Slot 1 prefilled with another prompt between slot 0's steps changes nothing in slot 0."""
    g = _golden(CASES[0])
    prompt, want = g["prompt_ids"], g["greedy_ids"]
    first = model.prefill(0, prompt, 0)
    model.prefill(1, prompt[::-1].copy(), 0)                           # different content, same positions
    both = model.decode([1, 0], [int(want[0]), int(want[0])], [prompt.size, prompt.size])   # [2, V]
    alone = model.decode([0], [int(want[0])], [prompt.size])[0]          # rewrites slot 0's position P
    assert int(first.argmax()) == int(want[0])
    np.testing.assert_allclose(both[1], alone, rtol=0, atol=1e-4)
    assert int(both[1].argmax()) == int(want[1])
    assert np.abs(both[0] - both[1]).max() > 1.0, "slot 1 answered like slot 0: slots are shared"


@pytest.mark.parametrize("case", ["mm_qwen25_t1", "mm_qwen25_t6", "mm_qwen25_t13"])
def test_quantized_matmuls_bit_for_bit(model, case, monkeypatch):
    """Each quantized matmul of layers 0 and 2 (Q5_0, Q8_0, Q6_K, Q4_K), fed llama.cpp's
    own input, gives llama.cpp's output bit for bit: one token runs ggml_vec_dot_* and
    the repacked q4_K gemv, six tokens llamafile's tinyBLAS and the q4_K gemm + gemv,
    thirteen also the tiled Q6_K path."""
    from bloomery.engine.quant import formats
    monkeypatch.setattr(formats, "KERNEL_ORDER", True)
    g = _golden(case)
    seen = set()
    for key in sorted(k for k in g if k.endswith("_in")):
        layer, w = key[1:].split("_", 1)
        w = w[:-len("_in")]
        weight = model.layers[int(layer)][w]
        got = model.ops.matmul(g[key], weight)                          # [T, N]
        want = g[key[:-len("in")] + "out"]
        n_bad = int((got != want).sum())
        assert n_bad == 0, f"{case} layer {layer} {w} ({weight.ggml_type}): {n_bad} of {want.size} differ, " \
                           f"max {float(np.abs(got - want).max()):.3g}"
        seen.add(weight.ggml_type)
    assert seen == {6, 8, 12, 14}, f"{case}: weight types covered {sorted(seen)}"   # Q5_0 Q8_0 Q4_K Q6_K
