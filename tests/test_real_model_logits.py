"""The numpy engine against llama.cpp's CPU build on the real Qwen2.5-Coder-0.5B Q4_K_M.

Goldens: tests/golden/logits/qwen25_*.npz, made by tools/ref/make_logit_goldens.py
(prompt ids from llama.cpp's tokenizer, greedy ids, the last prompt position's
logits, and the logits after STEP greedy tokens).

Band: every quantized matmul mirrors the float order of the kernel llama.cpp runs
(see bloomery/engine/quant.py), SwiGLU mirrors ggml_v_expf, so prompts whose
attention has no glibc-expf rounding case match to the bit: measured max |diff|
0.0 at prefill and at step 16 for prose_paris, code_fib, chat_sql, list_json.
The attention softmax (kv_cache._exp) rounds exp through float64 where glibc's
expf is off by an ulp in ~0.06% of inputs; that alone leaves chat_prime at
0.15 / 0.22 and long_class at 0.38 / 0.34 (prefill / step 16). LOGIT_BAND is
twice the worst; the greedy ids over 64 steps on 6 prompts are the sharp check.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

GOLDEN = Path(__file__).parent / "golden" / "logits"
CASES = sorted(p.stem for p in GOLDEN.glob("qwen25_*.npz"))
TIE_BAND = 0.1            # llama.cpp's top-1 minus top-2 logit under which either id is faithful
LOGIT_BAND = 0.8           # max |logit - llama.cpp's| over the vocabulary; seen up to 0.38 (logits span ~30)

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def model(real_model_path):
    from bloomery.engine.loader import load_model
    return load_model(str(real_model_path), n_slots=2, n_ctx_slot=512)


def _golden(name: str) -> dict:
    with np.load(GOLDEN / f"{name}.npz") as z:
        return {k: z[k] for k in z.files}


def test_goldens_present():
    assert len(CASES) >= 5, f"expected at least 5 real-model goldens in {GOLDEN}, found {CASES}"


@pytest.mark.parametrize("case", CASES)
def test_greedy_and_logits_match_llama_cpp(model, case):
    """Each step is fed llama.cpp's previous id (so one near-tie does not end the
    comparison); every argmax must equal llama.cpp's unless llama.cpp's own top-2
    margin there is under TIE_BAND, where float-order noise may pick either id."""
    g = _golden(case)
    prompt, want = g["prompt_ids"], g["greedy_ids"]
    step = int(g["step"])
    logits = model.prefill(0, prompt, 0)                               # [V]
    diff0 = float(np.abs(logits - g["logits_prefill"]).max())
    assert diff0 < LOGIT_BAND, f"{case}: prefill logits differ by {diff0:.4g} (band {LOGIT_BAND})"
    ties = []
    for i in range(want.size):
        if i:
            logits = model.decode([0], [int(want[i - 1])], [prompt.size + i - 1])[0]
        if i == step:
            diff = float(np.abs(logits - g["logits_step"]).max())
            assert diff < LOGIT_BAND, f"{case}: logits after {step} steps differ by {diff:.4g} (band {LOGIT_BAND})"
        got = int(logits.argmax())
        if got != int(want[i]):
            assert g["margins"][i] < TIE_BAND, (
                f"{case}: greedy id {i} is {got}, llama.cpp's {int(want[i])}, whose top-2 margin "
                f"{g['margins'][i]:.3g} is no tie (> {TIE_BAND})")
            ties.append(i)
    assert len(ties) <= 2, f"{case}: {len(ties)} near-tie steps went the other way: {ties}"


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
    from bloomery.engine import quant
    monkeypatch.setattr(quant, "KERNEL_ORDER", True)
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
