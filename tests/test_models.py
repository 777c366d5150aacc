"""Every architecture on small synthetic files: llama.cpp's greedy ids and logits
(goldens from tools/ref/make_logit_goldens.py), KV cache vs no cache, slots
apart, and the errors a caller can cause."""
from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from conftest import load_tool

REPO = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).parent / "golden" / "logits"
# Every op mirrors llama.cpp's kernels bit for bit (quantized and F32 matmuls in its kernel
# order, the experts' mul_mat_id, both flash-attention paths with the C library's expf), so a
# decode step's logits are llama.cpp's exactly. The prompt's last position is not quite: in
# the last layer llama.cpp keeps only the rows it needs after attention, so that row's FFN runs
# the one-row kernels, where ours runs the whole prompt's (the loader does not prune yet):
# measured up to 1.4e-6 on these logits (|logit| < ~5), zero once pruned.
PREFILL_BAND = 1e-5


def _goldens_tool():
    spec = importlib.util.spec_from_file_location("make_logit_goldens", REPO / "tools" / "ref" / "make_logit_goldens.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def synth(synthetic_dir):
    """arch -> path of a synthetic file; the quantized ones are the goldens' files."""
    make = load_tool("make_synthetic")
    shape = _goldens_tool().SYNTH_SHAPE
    out = {}
    try:
        for arch in ("qwen3", "qwen3moe"):
            out[arch] = make.write_synthetic(synthetic_dir / f"golden-{arch}.gguf", arch=arch, **shape)
        out["qwen2"] = make.write_synthetic(synthetic_dir / "tiny-qwen2.gguf", arch="qwen2")   # F32 weights
    except (Exception, SystemExit) as e:      # the tokenizer keys come from the real file
        pytest.skip(f"synthetic files need the real model's tokenizer: {e}")
    return out


def _load(path, **kw):
    from bloomery.engine.loader import load_model
    from bloomery.placement import whole
    return load_model(str(path), whole(kw.pop("backend", "numpy"), **kw))


def _golden(name: str) -> dict:
    with np.load(GOLDEN / f"{name}.npz") as z:
        return {k: z[k] for k in z.files}


@pytest.mark.parametrize("arch", ["qwen3", "qwen3moe"])
def test_greedy_and_logits_match_llama_cpp(synth, arch, monkeypatch):
    """Three prompts each: llama.cpp's 32 greedy ids, free-running and teacher-forced; the
    logits after `step` ids bit for bit, the prompt's within PREFILL_BAND."""
    from bloomery.engine.quant import formats
    monkeypatch.setattr(formats, "KERNEL_ORDER", True)
    cases = sorted(p.stem for p in GOLDEN.glob(f"{arch}_*.npz"))
    assert len(cases) >= 3, f"expected 3 goldens for {arch} in {GOLDEN}, found {cases}"
    digest = hashlib.sha256(Path(synth[arch]).read_bytes()).hexdigest()
    model = _load(synth[arch], n_ctx_slot=256)
    for case in cases:
        g = _golden(case)
        assert str(g["sha256"]) == digest, (f"{case}: the synthetic file changed since the golden was made "
                                            "(run tools/ref/make_logit_goldens.py --only synthetic)")
        assert json.loads(str(g["shape"])) == _goldens_tool().SYNTH_SHAPE
        prompt, want, step = g["prompt_ids"], g["greedy_ids"], int(g["step"])
        logits = model.prefill(0, prompt, 0)
        diff = np.abs(logits - g["logits_prefill"]).max()
        assert diff < PREFILL_BAND, f"{case}: prefill logits differ by {diff:.4g} (band {PREFILL_BAND})"
        ours = []                                                       # free-running greedy
        for i in range(want.size):
            if i:
                logits = model.decode([0], [ours[-1]], [prompt.size + i - 1])[0]
            ours.append(int(logits.argmax()))
        assert ours == want.tolist(), f"{case}: free-running greedy ids part at {next(i for i, (a, b) in enumerate(zip(ours, want)) if a != b)}"
        logits = model.prefill(0, prompt, 0)                            # teacher-forced: the same, and the logits
        for i in range(want.size):
            if i:
                logits = model.decode([0], [int(want[i - 1])], [prompt.size + i - 1])[0]
            if i == step:
                n_bad = int((logits != g["logits_step"]).sum())
                assert n_bad == 0, f"{case}: {n_bad} logits differ after {step} steps, " \
                                   f"max {float(np.abs(logits - g['logits_step']).max()):.3g}"
            assert int(logits.argmax()) == int(want[i]), f"{case}: teacher-forced id {i}"


@pytest.fixture
def one_kernel_order(monkeypatch):
    """llama.cpp's quantized kernels (so ours, see formats.KERNEL_ORDER) sum in a different
    float order for 1, 2..7 and 8+ columns; tests comparing batch shapes take one order."""
    from bloomery.engine.quant import formats
    monkeypatch.setattr(formats, "KERNEL_ORDER", False)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "qwen3moe"])
def test_cache_equals_no_cache(synth, arch, one_kernel_order):
    """forward_all over the whole prompt == prefill of a prefix, then one decode per token.

    Quantized weights (in one kernel order) give identical block sums whatever the batch; the F32
    qwen2 file goes through BLAS sgemm, whose blocking (so its last ulp) depends on
    the row count (sgemv for one row), and the F16 attention accumulators turn that
    ulp into an F16 ulp now and then: ~1.5e-4 on these logits."""
    model = _load(synth[arch], n_ctx_slot=64)
    ids = np.array([5, 99, 1024, 7, 300, 42, 8, 77, 151000, 3], np.int32)
    full = model.forward_all(0, ids, 0)                                 # [T, V]
    assert full.shape == (ids.size, model.n_vocab)
    last = model.prefill(0, ids[:4], 0)
    atol = 1e-3 if arch == "qwen2" else 1e-4                          # qwen2's file is F32, the others quantized
    np.testing.assert_allclose(last, full[3], rtol=0, atol=atol)
    for i in range(4, ids.size):
        step = model.decode([0], [ids[i]], [i])[0]
        np.testing.assert_allclose(step, full[i], rtol=0, atol=atol, err_msg=f"{arch} position {i}")


def test_slots_are_apart_and_batched_decode_equals_single(synth, one_kernel_order):
    model = _load(synth["qwen3"], n_slots=3, n_ctx_slot=32)
    a = np.array([11, 12, 13, 14], np.int32)
    b = np.array([900, 800, 700, 600, 500], np.int32)
    model.prefill(0, a, 0)
    model.prefill(2, b, 0)
    both = model.decode([2, 0], [9, 9], [b.size, a.size])              # [2, V]
    model.prefill(0, a, 0)                                              # rebuild slot 0 alone
    alone0 = model.decode([0], [9], [a.size])[0]
    model.prefill(2, b, 0)
    alone2 = model.decode([2], [9], [b.size])[0]
    np.testing.assert_allclose(both[1], alone0, rtol=0, atol=1e-5)
    np.testing.assert_allclose(both[0], alone2, rtol=0, atol=1e-5)
    assert np.abs(both[0] - both[1]).max() > 1e-2, "two different histories gave the same logits"


def test_prefill_overwrites_from_pos0(synth):
    model = _load(synth["qwen2"], n_ctx_slot=32)
    ids = np.array([1, 2, 3, 4, 5, 6], np.int32)
    want = model.prefill(0, ids, 0)
    model.prefill(0, np.array([9, 9, 9, 9, 9, 9], np.int32), 0)        # junk in the same region
    model.prefill(0, ids[:3], 0)
    got = model.prefill(0, ids[3:], 3)                                  # prefix reuse: only the tail
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def test_attributes(synth):
    model = _load(synth["qwen3moe"], n_ctx_slot=16)
    assert model.arch == "qwen3moe" and model.n_vocab == 151936 and model.n_ctx_train == 4096
    assert model.n_params > 0


@pytest.mark.parametrize("call, message", [
    (lambda m: m.prefill(0, [151936], 0), "token id 151936 is out of range: n_vocab = 151936"),
    (lambda m: m.prefill(0, [-1], 0), "token id -1 is out of range"),
    (lambda m: m.prefill(2, [1], 0), "slot 2 is out of range: the model has 2 slots"),
    (lambda m: m.prefill(0, [1, 2, 3], 14), r"positions 14..16 do not fit the slot: n_ctx_slot = 16"),
    (lambda m: m.prefill(0, [], 0), "ids is empty"),
    (lambda m: m.decode([0, 1], [1], [0, 0]), "one id and one position per slot: got 2 slots, 1 ids"),
    (lambda m: m.decode([1, 1], [1, 2], [0, 0]), "slot.* more than once"),
    (lambda m: m.decode([0], [1], [16]), r"positions 16..16 do not fit the slot"),
])
def test_bad_calls_are_named(synth, call, message):
    from bloomery.engine.loader import ModelError
    model = _load(synth["qwen2"], n_slots=2, n_ctx_slot=16)
    with pytest.raises(ModelError, match=message):
        call(model)


def test_bad_load_arguments(synth, tmp_path):
    from bloomery.engine.loader import ModelError
    with pytest.raises(ModelError, match="n_slots must be at least 1, got 0"):
        _load(synth["qwen2"], n_slots=0)
    with pytest.raises(ModelError, match="backend 'metal' is not available: choose 'numpy' or 'cuda'"):
        _load(synth["qwen2"], backend="metal")
    from tests.conftest import gpu_count
    if gpu_count() == 0:
        try:
            import cupy  # noqa: F401
        except ImportError:
            with pytest.raises(ModelError, match="backend 'cuda' needs CuPy"):
                _load(synth["qwen2"], backend="cuda")


def test_moe_route_renormalises_top_k():
    from bloomery.engine.cpu.backend import NumpyOps
    ops = NumpyOps()
    logits = np.array([[0.0, 2.0, 1.0, -1.0]], np.float32)              # [T, E]
    ids, w = ops.moe_route(logits, 2, norm_weights=True)
    assert ids.tolist() == [[1, 2]]
    p = np.exp(logits[0]) / np.exp(logits[0]).sum()
    np.testing.assert_allclose(w[0], p[[1, 2]] / p[[1, 2]].sum(), rtol=1e-6)
    _, w_raw = ops.moe_route(logits, 2, norm_weights=False)
    np.testing.assert_allclose(w_raw[0], p[[1, 2]], rtol=1e-6)


def test_layer0_ops_match_llama_cpp_bit_for_bit(synth, monkeypatch):
    """Each op fed llama.cpp's own inputs (tests/golden/logits/ops_qwen3_c.npz, its
    layer-0 tensors for one prompt) gives llama.cpp's output: bit for bit where we
    mirror its rounding (norms, RoPE, the F16 flash-attention path, the quantized
    matmuls' kernel float order, SwiGLU's SIMD expf): every op, bit for bit."""
    from bloomery.engine.quant import formats
    monkeypatch.setattr(formats, "KERNEL_ORDER", True)  # the lever on: llama.cpp's kernel order
    from bloomery.engine.ops import AttnSpan
    g = _golden("ops_qwen3_c")
    assert str(g["sha256"]) == hashlib.sha256(Path(synth["qwen3"]).read_bytes()).hexdigest(), \
        "the synthetic file changed since the golden was made (run tools/ref/make_logit_goldens.py --only synthetic)"
    model = _load(synth["qwen3"], n_ctx_slot=64)
    ops, hp, ly = model.ops, model.hp, model.layers[0]
    ids = g["prompt_ids"]
    t, pos = ids.size, np.arange(ids.size)
    heads = lambda a, n: a.reshape(t, n, hp.head_dim)                  # noqa: E731

    def exact(name, got):
        np.testing.assert_array_equal(np.asarray(got).reshape(t, -1), g[name], err_msg=name)

    exact("attn_norm", ops.rms_norm(model.embed(ids), ly["attn_norm"], hp.rms_eps))
    exact("q_mm", ops.matmul(g["attn_norm"], ly["wq"]))
    exact("v", ops.matmul(g["attn_norm"], ly["wv"]))
    exact("q_normed", ops.rms_norm(heads(g["q_mm"], hp.n_head), ly["q_norm"], hp.rms_eps))
    exact("k_normed", ops.rms_norm(heads(g["k_mm"], hp.n_head_kv), ly["k_norm"], hp.rms_eps))
    exact("q_rope", ops.rope_neox(heads(g["q_normed"], hp.n_head), pos, hp.n_rot, hp.freq_base))
    exact("k_rope", ops.rope_neox(heads(g["k_normed"], hp.n_head_kv), pos, hp.n_rot, hp.freq_base))
    kqv = ops.attention(model.cache, 0, [AttnSpan(0, 0, 0, t)], heads(g["q_rope"], hp.n_head),
                        heads(g["k_rope"], hp.n_head_kv), heads(g["v"], hp.n_head_kv), model.kq_scale)
    exact("kqv", kqv)
    exact("ffn_norm", ops.rms_norm(g["ffn_inp"], ly["ffn_norm"], hp.rms_eps))
    exact("gate", ops.matmul(g["ffn_norm"], ly["ffn_gate"]))
    exact("swiglu", ops.swiglu(g["gate"], g["up"]))
    exact("ffn_out", ops.matmul(g["swiglu"], ly["ffn_down"]))
    exact("l_out", ops.add(g["ffn_out"], g["ffn_inp"]))


class _PiecesRunner:
    """Stands in for a backend's captured decode steps of at most max_batch rows: each call runs
    the model's uncaptured step on its rows and records its width."""

    def __init__(self, model, max_batch: int, prompt_rows: int = 0):
        self.model, self.max_batch, self.widths = model, max_batch, []
        self.prompt_rows, self.prompts = prompt_rows, []     # "captured" prompts of at most prompt_rows ids

    def _x(self, slots, ids, positions):
        from bloomery.engine.ops import AttnSpan
        assert len(slots) <= self.max_batch, "a batch wider than the widest captured graph reached it"
        self.widths.append(len(slots))
        spans = [AttnSpan(int(s), int(p), b, b + 1) for b, (s, p) in enumerate(zip(slots, positions))]
        return self.model._run(np.asarray(ids, np.int32), np.asarray(positions, np.int32), spans)

    def run(self, slots, ids, positions, want_logits):
        x = self._x(slots, ids, positions)
        return self.model.head(x) if want_logits else self.model.head_argmax(x)

    def run_topk(self, slots, ids, positions, k):
        return tuple(self.model.head_topk(self._x(slots, ids, positions), k))

    def prompt(self, slot, ids, pos0):
        from bloomery.engine.ops import AttnSpan
        if len(ids) > self.prompt_rows:
            return None
        self.prompts.append((slot, len(ids), pos0))
        x = self.model._run(np.asarray(ids, np.int32), np.arange(pos0, pos0 + len(ids), dtype=np.int32),
                            [AttnSpan(slot, pos0, 0, len(ids))])
        return self.model.head(x[-1:])[0]


def test_a_prompt_of_one_slot_asks_the_captured_passes_first(synth):
    """prefill_slots hands a prompt of one slot to the backend's captured prompt passes (runner.prompt), which
    may decline it (None: the uncaptured passes run it); prompts of several slots in one call take the
    uncaptured passes. Either way the logits and the KV are the same."""
    import dataclasses
    plain = _load(synth["qwen3moe"], n_slots=2, n_ctx_slot=64)
    graphed = _load(synth["qwen3moe"], n_slots=2, n_ctx_slot=64)
    runner = _PiecesRunner(graphed, 2, prompt_rows=8)
    graphed.ops.caps = dataclasses.replace(graphed.ops.caps, decode_graphs=True)
    graphed.ops.decode_runner = lambda model: runner
    short, long_ = np.array([11, 42, 7], np.int32), np.arange(100, 120, dtype=np.int32)
    np.testing.assert_allclose(graphed.prefill(0, short, 0), plain.prefill(0, short, 0), rtol=1e-5, atol=1e-5)
    assert runner.prompts == [(0, 3, 0)]
    np.testing.assert_allclose(graphed.prefill(1, long_, 0), plain.prefill(1, long_, 0), rtol=1e-5, atol=1e-5)
    assert runner.prompts == [(0, 3, 0)]                                       # declined: 20 ids > 8
    both = [(0, np.array([5, 6], np.int32), 3), (1, np.array([9], np.int32), 20)]
    np.testing.assert_allclose(graphed.prefill_slots(both), plain.prefill_slots(both), rtol=1e-5, atol=1e-5)
    assert runner.prompts == [(0, 3, 0)]                                       # two slots: uncaptured
    np.testing.assert_allclose(graphed.decode([0, 1], [3, 4], [5, 21]), plain.decode([0, 1], [3, 4], [5, 21]),
                               rtol=1e-5, atol=1e-5)


def test_a_decode_batch_wider_than_the_captured_graphs_replays_them_in_pieces(synth):
    """With captured steps of at most 3 rows, a 7-slot decode runs as 3 + 3 + 1 replays (never the
    prompt path) and gives the same logits, ids and top-k as the uncaptured 7-row step."""
    import dataclasses
    n = 7
    plain = _load(synth["qwen3moe"], n_slots=n, n_ctx_slot=64)
    graphed = _load(synth["qwen3moe"], n_slots=n, n_ctx_slot=64)
    runner = _PiecesRunner(graphed, 3)
    graphed.ops.caps = dataclasses.replace(graphed.ops.caps, decode_graphs=True)
    graphed.ops.decode_runner = lambda model: runner
    slots = list(range(n))
    prompt = [11, 42, 7, 300]
    for m in (plain, graphed):
        for s in slots:
            m.prefill_slots([(s, np.array(prompt + [s + 1], np.int32), 0)])
    ids, pos = np.arange(5, 5 + n, dtype=np.int32), np.full(n, len(prompt) + 1, np.int32)
    want = plain.decode(slots, ids, pos)
    got = graphed.decode(slots, ids, pos)
    assert runner.widths == [3, 3, 1]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)    # rows in other batch widths: sums in another order
    runner.widths.clear()
    assert list(graphed.decode_greedy(slots, ids + 1, pos + 1)) == list(plain.decode_greedy(slots, ids + 1, pos + 1))
    assert runner.widths == [3, 3, 1]
    k = min(4, plain.topk_max)
    got_k, want_k = graphed.decode_topk(slots, ids + 2, pos + 2, k), plain.decode_topk(slots, ids + 2, pos + 2, k)
    np.testing.assert_array_equal(got_k[0], want_k[0])
    np.testing.assert_allclose(got_k[1], want_k[1], rtol=1e-5, atol=1e-5)
