"""The qwen35moe and qwen35 seats on the cuda backend against the numpy backend: synthetic files
(random blocks, the real tokenizer) of several shapes, read in prompts of several lengths (the
step form, and spans past a 64-row chunk: the chunked delta rule; more than 16 rows take the card's
prompt path), greedy runs, a decode batch of two slots, two slots' prompts in one pass, the
captured decode step against the same step run eagerly, a checkpoint put back, and a served chat.
Runs where CuPy sees a card; skips elsewhere (the device code's math is checked on the host in
tests/test_cuda_recurrent_math.py).

Band: as tests/test_cuda_models.py (docs/verify.md, the cuda backend against the numpy backend):
last-position logits within LOGIT_BAND of the numpy backend's; fed the numpy backend's greedy ids,
the cuda backend picks the same id at every step except where the numpy backend's top two lie within
twice the band. The hybrid adds float32 state math (the conv window and the delta rule, in CuPy on
the card, the chunked form in another order than the numpy backend's) to the roundings named there.
"""
from __future__ import annotations

import numpy as np
import pytest

from bloomery.engine.cuda.sizes import DECODE_ROWS

from tests.conftest import load_tool
from tests.test_cuda_backend import ops, rel  # noqa: F401  (ops: the card's CudaOps fixture)
from tests.test_cuda_models import _forced, _greedy, _load, _stream_chat

LOGIT_BAND = {"qwen35": 0.35, "qwen35moe": 0.6}     # as qwen3 and qwen3moe in tests/test_cuda_models.py
N_GREEDY = 32
SHAPES = {
    # grouped value heads over two key heads, heads of 64 with a quarter rotated and IMRoPE's default
    # sections (one pair of four left unturned), 8 experts of 256 and a shared expert, Q4_K_M blocks
    "moe_q4km": ("qwen35moe", dict(mode="blocks", mix="q4_k_m", n_layer=4, n_embd=256, n_head=4, n_head_kv=2,
                                   head_dim=64, n_expert=8, n_expert_used=2, n_ff_exp=256, n_ff_shexp=256,
                                   ssm_d_state=32, ssm_n_group=2, ssm_dt_rank=4, seed=11)),
    # heads of 128 (4 query heads on one KV head), 32 rotated dims with sections that leave pairs
    # unturned, a full-attention layer every second, one key head for 4 value heads of 64, conv width 3
    "moe_h128": ("qwen35moe", dict(mode="blocks", mix="q4_k_m", n_layer=4, n_embd=256, n_head=4, n_head_kv=1,
                                   head_dim=128, n_rot=32, rope_sections="2,1,1,1", full_attn_interval=2,
                                   n_expert=8, n_expert_used=2, n_ff_exp=256, n_ff_shexp=256, ssm_d_conv=3,
                                   ssm_d_state=64, ssm_n_group=1, ssm_dt_rank=4, seed=12)),
    # the dense sibling in Q8_0
    "dense_q8": ("qwen35", dict(mode="blocks", mix="q8_0", n_layer=4, n_embd=128, n_head=4, n_head_kv=2,
                                head_dim=64, n_ff=256, ssm_d_state=32, ssm_n_group=1, ssm_dt_rank=2, seed=5)),
}
PROMPTS = [[151644, 872, 198, 7985, 264, 13027, 729, 13, 151645, 198, 151644, 77091, 198],   # 13: mat-vec path, 9-16 rows
           [750, 75698, 1445, 982, 262, 4210],                                                 # 6: mat-vec path
           list(range(1000, 1100))]                                  # 100: a span past one 64-row chunk


@pytest.fixture(scope="module")
def files(gpu, tokenizer_source, synthetic_dir):
    make = load_tool("make_synthetic")
    return {name: make.write_synthetic(synthetic_dir / f"cuda-q35-{name}.gguf", arch=arch,
                                       tokenizer_from=str(tokenizer_source), **shape)
            for name, (arch, shape) in SHAPES.items()}


@pytest.fixture(scope="module")
def twins(files, synthetic_dir):
    """Each file with its tensors dequantized to F32 (make_synthetic.write_float_twin): read by the numpy
    backend, the model's exact arithmetic, with no quantized activation."""
    make = load_tool("make_synthetic")
    return {name: make.write_float_twin(path, synthetic_dir / f"cuda-q35-{name}-f32.gguf")
            for name, path in files.items()}


EXACT_SLACK = 1.25


def agrees(got, ref, exact, band: float) -> tuple[bool, str]:
    """The card's logits agree with the numpy backend's: within the band of them, or no farther from the float
    twin's (the exact arithmetic) than EXACT_SLACK times the numpy backend's own distance from those. Both
    backends quantize activations, each its own way (the card to int8 per 32 values, the numpy backend as
    llama.cpp's CPU build per 256 for the K-quants): on these random files the numpy backend's own logits
    lie up to 0.81 from the twin's (the 13-id chat prompt on moe_q4km), more than the band between the two."""
    d = float(np.abs(got - ref).max())
    if d < band:
        return True, f"{d:.3f} from numpy's"
    d_card, d_cpu = float(np.abs(got - exact).max()), float(np.abs(ref - exact).max())
    return d_card <= EXACT_SLACK * d_cpu, (f"{d:.3f} from numpy's (band {band}); from the float twin's: "
                                           f"card {d_card:.3f}, numpy {d_cpu:.3f}")


def test_elementwise_ops_match_the_numpy_backend(ops):
    """sigmoid, softplus (both sides of its cut at 20), silu, mul by a weight handle and l2_norm as the
    numpy backend computes them, to float32 rounding (libm's expf against the card's)."""
    import cupy
    from bloomery.engine.cpu.backend import NumpyOps
    cpu = NumpyOps()
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((5, 4, 32)) * 8).astype(np.float32)
    x[0, 0, :4] = [25.0, 20.5, 19.5, -30.0]
    gx = cupy.asarray(x)
    for name in ("sigmoid", "softplus", "silu"):
        got = cupy.asnumpy(getattr(ops, name)(gx))
        assert got.dtype == np.float32 and got.shape == x.shape
        np.testing.assert_allclose(got, getattr(cpu, name)(x), rtol=2e-6, atol=1e-6, err_msg=name)
    w = rng.standard_normal(32).astype(np.float32)
    got = cupy.asnumpy(ops.mul(gx, ops.weight(0, (32,), w.view(np.uint8))))
    np.testing.assert_array_equal(got, cpu.mul(x, cpu.weight(0, (32,), w.view(np.uint8))))
    got = cupy.asnumpy(ops.l2_norm(gx, 1e-6))
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, cpu.l2_norm(x, 1e-6), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows, n, ng", [(1, 2048, 1), (3, 2048, 1), (2, 4096, 4096), (16, 2048, 2048), (40, 96, 96)])
def test_the_fused_gate_matches_the_ops_one_by_one(ops, rows, n, ng):
    """sigmoid_gate (one gate a row as the shared expert's, or one a value as gated attention's; alone,
    with plus, with plus and residual) equals the numpy backend's mul, add, add to float32 rounding
    (libm's expf against the card's); on decode-sized rows its int8-per-32 form, and swiglu's, equal
    what quantize_q8 makes of the output."""
    import cupy
    from bloomery.engine.cpu.backend import NumpyOps
    cpu = NumpyOps()
    rng = np.random.default_rng(rows + n)
    x, plus, res = (rng.standard_normal((rows, n)).astype(np.float32) for _ in range(3))
    gate = (rng.standard_normal((rows, ng)) * 4).astype(np.float32)
    for kw in ({}, {"plus": plus}, {"plus": plus, "residual": res}):
        got = ops.sigmoid_gate(cupy.asarray(x), cupy.asarray(gate), **{k: cupy.asarray(v) for k, v in kw.items()})
        np.testing.assert_allclose(cupy.asnumpy(got), cpu.sigmoid_gate(x, gate, **kw), rtol=2e-6, atol=2e-6)
        if rows <= DECODE_ROWS and n % 32 == 0:
            for a, b in zip(ops.q8(got), ops.q8(got.copy())):           # remembered, and made afresh
                np.testing.assert_array_equal(cupy.asnumpy(a).ravel(), cupy.asnumpy(b).ravel())
    g3, u3 = (cupy.asarray(rng.standard_normal((rows, 4, n // 4)).astype(np.float32)) for _ in range(2))
    out = ops.swiglu(g3, u3)
    np.testing.assert_allclose(cupy.asnumpy(out), cpu.swiglu(cupy.asnumpy(g3), cupy.asnumpy(u3)), rtol=1e-5, atol=1e-6)
    if rows <= DECODE_ROWS:
        flat = out.reshape(rows, n)                                     # the view the next product reads
        for a, b in zip(ops.q8(flat), ops.q8(flat.copy())):
            np.testing.assert_array_equal(cupy.asnumpy(a).ravel(), cupy.asnumpy(b).ravel())


@pytest.mark.parametrize("size, n_v, n_k, width", [(128, 32, 16, 4), (64, 4, 2, 4), (16, 4, 1, 3)])
def test_the_fused_decode_step_matches_the_array_code(ops, monkeypatch, size, n_v, n_k, width):
    """conv_step and delta_rule, the kernels (kernels/recurrent.cu) against the array code of recurrent.py
    (BLOOMERY_CUDA_RECURRENT=array), from the same states: three slots, a captured step's rows (slots 2 and 0,
    one at position 0, one carrying on, and a slot at a position it does not hold), an eager step's host spans
    and a prompt pass of two spans; v's rows strided as the model slices them out of the conv output. The
    conv's decode sums in the array code's order (its windows equal bits), the gates made in the kernel and
    the delta rule within float32 rounding; the counts of held positions equal."""
    import cupy
    from bloomery.engine.cuda.recurrent import CONV, DELTA
    from bloomery.engine.ops import AttnSpan, Rows
    rng = np.random.default_rng(size + width)
    chans = 2 * n_k * size + n_v * size
    kern = (rng.standard_normal((chans, width)) * 0.5).astype(np.float32)
    w = ops.weight(0, (width, chans), kern.view(np.uint8))
    states = []
    for _ in range(2):
        st = ops.recurrent_state(2, 3, width - 1, chans, n_v, size)
        st.conv[...] = cupy.asarray(rng.standard_normal(st.conv.shape, np.float32)) if not states else states[0].conv
        st.delta[...] = (cupy.asarray(rng.standard_normal(st.delta.shape, np.float32) * 0.1) if not states
                         else states[0].delta)
        st.held[...] = 7 if not states else states[0].held
        states.append(st)

    dt_bias = ops.weight(0, (n_v,), rng.uniform(-1, 1, n_v).astype(np.float32).view(np.uint8))
    a = ops.weight(0, (n_v,), -rng.uniform(0.1, 2, n_v).astype(np.float32).view(np.uint8))

    def step(how, st, rows, x):
        monkeypatch.setenv("BLOOMERY_CUDA_RECURRENT", how)
        conv = ops.conv_step(st, 1, rows, x, w, silu=True)                      # [B, C]
        t = conv.shape[0]
        q = ops.l2_norm(conv[:, :n_k * size].reshape(t, n_k, size), 1e-6)
        k = ops.l2_norm(conv[:, n_k * size:2 * n_k * size].reshape(t, n_k, size), 1e-6)
        v = conv[:, 2 * n_k * size:].reshape(t, n_v, size)                      # rows strided for t > 1
        alpha = x[:, :n_v] * 3                                                   # both sides of softplus's cut at 20
        alpha[0, 0] = 25.0
        return conv, ops.delta_rule(st, 1, rows, q, k, v, alpha, x[:, n_v:2 * n_v], dt_bias, a)

    def rows_of(spans):
        slots = np.concatenate([[sp.slot] * (sp.row1 - sp.row0) for sp in spans]).astype(np.int32)
        pos = np.concatenate([np.arange(sp.pos0, sp.pos0 + sp.row1 - sp.row0) for sp in spans]).astype(np.int32)
        return Rows(spans, cupy.asarray(slots), cupy.asarray(pos))

    captured = Rows(None, cupy.asarray([2, 0, 1], np.int32), cupy.asarray([7, 0, 3], np.int32))
    eager = rows_of([AttnSpan(2, 8, 0, 1), AttnSpan(0, 1, 1, 2)])
    # a prompt pass: slot 1 afresh over 70 rows (the array code's chunked form: its own order, so a looser
    # band), slot 2 carrying on over 5
    prompt = rows_of([AttnSpan(1, 0, 0, 70), AttnSpan(2, 9, 70, 75)])
    for rows, tol in ((captured, 2e-5), (eager, 2e-5), (prompt, 2e-4)):
        x = cupy.asarray(rng.standard_normal((rows.slots.size, chans), np.float32))
        ref = step("array", states[0], rows, x)
        got = step("fused", states[1], rows, x)
        # the conv's sums equal; its SiLU made in the kernel, not by the elementwise op (another compile of expf)
        np.testing.assert_allclose(cupy.asnumpy(got[0]), cupy.asnumpy(ref[0]), rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(cupy.asnumpy(states[1].conv), cupy.asnumpy(states[0].conv))
        np.testing.assert_allclose(cupy.asnumpy(got[1]), cupy.asnumpy(ref[1]), rtol=tol, atol=tol / 10)
        np.testing.assert_allclose(cupy.asnumpy(states[1].delta), cupy.asnumpy(states[0].delta), rtol=tol, atol=tol / 10)
        np.testing.assert_array_equal(cupy.asnumpy(states[1].held), cupy.asnumpy(states[0].held))
        if rows is eager:
            held = cupy.asnumpy(states[1].held[:, 1])
            assert held[CONV].tolist() == held[DELTA].tolist() == [2, -1, 9]   # slot 1 stepped at 3, holding 7
    assert cupy.asnumpy(states[1].held[:, 1, 1:]).tolist() == [[70, 14]] * 2


def test_value_heads_read_key_heads_as_ggml_broadcasts_on_the_card(gpu):
    """expand_heads with CuPy arrays: value head h reads key head h % Hk, as with numpy."""
    import cupy
    from bloomery.engine.cuda.recurrent import expand_heads
    a = np.arange(3 * 2 * 4, dtype=np.float32).reshape(3, 2, 4)
    for h in (2, 4, 6):
        got = cupy.asnumpy(expand_heads(cupy, cupy.asarray(a), h))
        np.testing.assert_array_equal(got, a[:, np.arange(h) % 2])
        np.testing.assert_array_equal(expand_heads(np, a, h), a[:, np.arange(h) % 2])


@pytest.mark.parametrize("dh, n_rot, sections", [(64, 16, None), (64, 16, (1, 1, 1, 1)), (128, 32, (2, 1, 1, 1)),
                                                 (256, 64, (11, 11, 10, 0)), (128, 128, None)])
def test_partial_rotation_and_imrope_match_the_numpy_backend(ops, dh, n_rot, sections):
    """The gated attention's core on the card: per-head q/k RMSNorm, NEOX RoPE of n_rot of the head's dims
    (IMRoPE sections leaving some pairs unturned), the cache write and causal attention, for a 40-row prompt
    (the GEMM path) then two decode rows of two slots, against the numpy backend's."""
    import cupy
    from bloomery.engine.cpu.backend import NumpyOps
    from bloomery.engine.ops import AttnSpan
    cpu = NumpyOps()
    rng = np.random.default_rng(dh + n_rot)
    n_head, n_kv = 8, 2
    qn, kn = (rng.uniform(0.5, 1.5, dh).astype(np.float32) for _ in range(2))
    norms = lambda o: dict(q_norm=o.weight(0, (dh,), qn.view(np.uint8)), k_norm=o.weight(0, (dh,), kn.view(np.uint8)),  # noqa: E731
                           eps=1e-6, imrope_sections=sections)
    args = (1 / np.sqrt(dh), n_rot, 1e7)
    c_cache, g_cache = cpu.kv_cache(1, 2, 256, n_kv, dh), ops.kv_cache(1, 2, 256, n_kv, dh)

    def both(spans, pos, t):
        q, k, v = (rng.standard_normal((t, h, dh)).astype(np.float32) for h in (n_head, n_kv, n_kv))
        ref = cpu.self_attention(c_cache, 0, cpu.rows(spans, pos), q, k, v, *args, **norms(cpu))
        got = cupy.asnumpy(ops.self_attention(g_cache, 0, ops.rows(spans, pos), cupy.asarray(q), cupy.asarray(k),
                                              cupy.asarray(v), *args, **norms(ops)))
        return got, ref

    for slot in (0, 1):
        got, ref = both([AttnSpan(slot, 0, 0, 40)], np.arange(40, dtype=np.int32), 40)
        assert rel(got, ref) < 3e-3, (slot, rel(got, ref))
    for step in range(2):
        spans = [AttnSpan(1, 40 + step, 0, 1), AttnSpan(0, 40 + step, 1, 2)]
        got, ref = both(spans, np.array([40 + step, 40 + step], np.int32), 2)
        assert rel(got, ref) < 3e-3, (step, rel(got, ref))


def _band(model) -> float:
    return LOGIT_BAND[model.arch]


class PinnedRoutes:
    """The follower's router takes the reference's picks. A random synthetic router has near ties between
    experts; a last-digit difference of the two backends' activations there selects another expert, and the
    hybrid's recurrent state carries that on (op by op on the card: every op within 2 % of numpy's up to
    layer 0's router, whose second and third expert were within rounding of each other). With the picks
    pinned, what is left to compare is each backend's arithmetic. The reference calls first: its picks are
    queued per moe_route call and the follower takes them in order (`remap` reorders a step's calls).
    Decode steps run eagerly on both (a captured step would not call the router again)."""

    def __init__(self, reference, follower):
        import dataclasses
        self.reference, self.follower, self.queue, self.on = reference, follower, [], True
        for m in (reference, follower):
            m.ops.caps = dataclasses.replace(m.ops.caps, decode_graphs=False)
        own_ref, own_fol = reference.ops.moe_route, follower.ops.moe_route

        def record(logits, n_used, norm_weights):
            ids, w = own_ref(logits, n_used, norm_weights)
            if self.on:
                self.queue.append((np.asarray(reference.ops.to_host(ids)), np.asarray(reference.ops.to_host(w))))
            return ids, w

        def replay(logits, n_used, norm_weights):
            ids, w = own_fol(logits, n_used, norm_weights)
            if not self.on:
                return ids, w
            rid, rw = self.queue.pop(0)
            assert rid.shape == tuple(ids.shape), (rid.shape, ids.shape)
            return (follower.ops.from_host(np.ascontiguousarray(rid, np.int32)),
                    follower.ops.from_host(np.ascontiguousarray(rw, np.float32)))

        reference.ops.moe_route, follower.ops.moe_route = record, replay

    def remap(self, n_calls: int, order) -> None:
        """The last len(order) * n_calls queued calls, made one row at a time (reference row r's calls
        together), as the follower's n_calls calls over all rows in `order` (rows joined per call)."""
        k = len(order)
        if not n_calls:
            return
        got, self.queue = self.queue[-k * n_calls:], self.queue[:-k * n_calls]
        per_row = [got[r * n_calls:(r + 1) * n_calls] for r in range(k)]
        for c in range(n_calls):
            self.queue.append((np.concatenate([per_row[r][c][0] for r in order]),
                               np.concatenate([per_row[r][c][1] for r in order])))


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_cuda_equals_numpy(files, twins, shape, capsys):
    """Each prompt: the last position's logits agree (`agrees`: within the band, or as near the float twin's
    as the numpy backend's are); fed the numpy backend's N_GREEDY greedy ids, the cuda backend's captured
    step picks the same id except at a numpy near tie; the free-running agreement is reported."""
    cpu, card, twin = _load(files[shape], "numpy"), _load(files[shape], "cuda"), _load(twins[shape], "numpy")
    pin, pin_twin = PinnedRoutes(cpu, card), PinnedRoutes(cpu, twin)
    band = _band(cpu)
    report = []
    for i, prompt in enumerate(PROMPTS):
        lc = cpu.prefill(0, np.asarray(prompt, np.int32), 0)
        lg = card.prefill(0, np.asarray(prompt, np.int32), 0)
        ok, how = agrees(lg, lc, twin.prefill(0, np.asarray(prompt, np.int32), 0), band)
        assert ok, (shape, i, how)
        pin_twin.on = False                      # the twin follows no further
        ref_ids, ref_steps = _greedy(cpu, prompt, N_GREEDY)
        picks = _forced(card, prompt, ref_ids)
        assert not pin.queue
        pin.on = False                            # the card's own routing, reported only
        free = _greedy(card, prompt, N_GREEDY)[0]
        pin.on = True
        n_free = next((j for j, (a, b) in enumerate(zip(ref_ids, free)) if a != b), N_GREEDY)
        ties = []
        for j, (a, b) in enumerate(zip(ref_ids, picks)):
            if a != b:
                top = np.sort(ref_steps[j])[-2:]
                gap = float(top[1] - top[0])
                assert gap < 2 * band, (shape, i, j, gap)
                ties.append(f"{j}:{gap:.3f}")
        pin_twin.on = True
        report.append(f"{shape} prompt {i} ({len(prompt)} ids): logits {how}; teacher-forced picks "
                      f"equal at {N_GREEDY - len(ties)}/{N_GREEDY} (near ties at {', '.join(ties) or 'none'}); "
                      f"free-running greedy equal for {n_free}/{N_GREEDY}")
    with capsys.disabled():
        print("\n" + "\n".join(report))


@pytest.mark.parametrize("shape", ["moe_q4km", "dense_q8"])
def test_a_decode_batch_of_two_slots(files, twins, shape, capsys):
    """Two slots at different depths in one captured step (and one more step after): each row's logits agree
    (`agrees`) with the numpy backend's slot run alone."""
    cpu, card, twin = _load(files[shape], "numpy"), _load(files[shape], "cuda"), _load(twins[shape], "numpy")
    pin, _ = PinnedRoutes(cpu, card), PinnedRoutes(cpu, twin)
    band = _band(cpu)
    a, b = PROMPTS[2][:70], PROMPTS[0]
    for m in (cpu, card, twin):
        m.prefill(0, np.asarray(a, np.int32), 0)
        m.prefill(1, np.asarray(b, np.int32), 0)
    n_moe = cpu.hp.n_layer if cpu.arch == "qwen35moe" else 0                     # router calls a pass
    report = []
    for step, ids in enumerate(([5, 9], [17, 3])):
        pos = [len(a) + step, len(b) + step]
        want = np.stack([cpu.decode([0], [ids[0]], [pos[0]])[0], cpu.decode([1], [ids[1]], [pos[1]])[0]])
        pin.remap(n_moe, order=(1, 0))
        got = card.decode([1, 0], ids[::-1], pos[::-1])[::-1]                 # rows in another order than slots
        exact = np.stack([twin.decode([0], [ids[0]], [pos[0]])[0], twin.decode([1], [ids[1]], [pos[1]])[0]])
        for r in range(2):
            ok, how = agrees(got[r], want[r], exact[r], band)
            report.append(f"{shape} step {step} slot {r}: {how}")
            assert ok, (shape, step, r, how)
    with capsys.disabled():
        print("\n" + "\n".join(report))


def test_two_slots_prompts_in_one_pass_as_each_alone(files):
    """prefill_slots on the card: a 150-id prompt (chunked delta rule, the GEMM path) and a 17-id one in one pass
    give each slot the logits and the state it gets alone (the next decode step of both agrees too)."""
    model = _load(files["moe_q4km"], "cuda")
    a, b = np.arange(100, 250, dtype=np.int32), np.arange(900, 917, dtype=np.int32)
    alone = np.stack([model.prefill(0, a, 0), model.prefill(1, b, 0)])
    nxt_alone = model.decode([0, 1], [5, 6], [a.size, b.size])
    together = model.prefill_slots([(0, a, 0), (1, b, 0)])
    np.testing.assert_allclose(together, alone, rtol=2e-2, atol=2e-2)
    assert (together.argmax(-1) == alone.argmax(-1)).all()
    np.testing.assert_allclose(model.decode([0, 1], [5, 6], [a.size, b.size]), nxt_alone, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("pdl", ["1", "0"], ids=["pdl", "plain"])
def test_captured_step_equals_eager_step(files, pdl, monkeypatch):
    """The graph replays exactly the kernels the eager step runs (the recurrent layers' CuPy code
    included): logits bit-equal for batches of 1 and 2 slots, captured with and without programmatic
    dependent launch. The state cannot take a position twice, so each slot's checkpoint is put back
    between the two runs."""
    from bloomery.engine.ops import AttnSpan
    monkeypatch.setenv("BLOOMERY_CUDA_PDL", pdl)
    model = _load(files["moe_q4km"], "cuda")
    prompts = [PROMPTS[0], PROMPTS[1]]
    for s, p in enumerate(prompts):
        model.prefill(s, np.asarray(p, np.int32), 0)
    held = [len(p) for p in prompts]
    for slots, ids in (([0], [5]), ([1, 0], [9, 11])):
        pos = [held[s] for s in slots]
        saved = {s: model.save_checkpoint(s, held[s]) for s in slots}
        graph = model.decode(slots, ids, pos)
        for s in slots:
            model.restore_checkpoint(s, saved[s], held[s])
        spans = [AttnSpan(s, p, b, b + 1) for b, (s, p) in enumerate(zip(slots, pos))]
        eager = model.ops.to_host(model.head(model._run(np.asarray(ids, np.int32), np.asarray(pos, np.int32), spans)))
        np.testing.assert_array_equal(graph, eager)
        for s in slots:
            held[s] += 1


def test_a_checkpoint_put_back_gives_the_cold_runs_ids(files):
    """Slot 1 reads a prompt, saves a checkpoint, runs on (decode steps), has the checkpoint put back and
    reads a second part from there: its greedy ids and logits are the ones slot 0 gets reading the same
    two parts without the detour. A step at a position the state does not hold is refused by name."""
    from bloomery.engine.cpu.recurrent import RecurrentStateError
    model = _load(files["moe_q4km"], "cuda")
    first, second = np.asarray(PROMPTS[2][:70], np.int32), np.asarray(PROMPTS[0], np.int32)

    def greedy(slot, logits, pos0):
        ids = [int(np.argmax(logits))]
        for i in range(15):
            ids.append(int(model.decode_greedy([slot], [ids[-1]], [pos0 + i])[0]))
        return ids

    model.prefill(0, first, 0)
    cold_logits = model.prefill(0, second, first.size)
    cold = greedy(0, cold_logits, first.size + second.size)
    model.prefill(1, first, 0)
    saved = model.save_checkpoint(1, first.size)
    assert sum(a.nbytes for a in saved) == model.checkpoint_bytes
    for i, tok in enumerate([7, 8, 9]):
        model.decode([1], [tok], [first.size + i])
    with pytest.raises(RecurrentStateError, match="cannot step back"):
        model.prefill(1, second, first.size)
    model.restore_checkpoint(1, saved, first.size)
    warm_logits = model.prefill(1, second, first.size)
    np.testing.assert_allclose(warm_logits, cold_logits, rtol=0, atol=1e-5)
    assert greedy(1, warm_logits, first.size + second.size) == cold


def test_served_chat_on_the_card(files, capsys):
    """bloomery-serve --backend cuda on the qwen35moe file: the plan stage takes the seat, the warm-up
    captures the decode steps, a streamed chat completion (with checkpoints at message starts) answers.
    The text beside --backend cpu's is reported (random weights may part at a near tie)."""
    from tests.serve_proc import Served
    texts = {}
    for device in ("cpu", "cuda"):
        with Served("-m", str(files["moe_q4km"]), "--backend", device, "-c", "1024") as srv:
            texts[device] = _stream_chat(srv.url)
            backend = "numpy" if device == "cpu" else "cuda"
            assert any("loading weights" in line and f"backend={backend}" in line for line in srv.lines), srv.lines
    assert texts["cuda"], texts
    n_same = next((i for i, (a, b) in enumerate(zip(texts["cpu"], texts["cuda"])) if a != b),
                  min(len(texts["cpu"]), len(texts["cuda"])))
    with capsys.disabled():
        print(f"\nserved chat: cpu {texts['cpu']!r}, cuda {texts['cuda']!r}: the first {n_same} characters equal")


def test_host_experts_stay_within_the_band_of_the_whole_card(files):
    """The offload tier with this seat (cuda/experts.py, unchanged: the routed experts take qwen3moe's
    path, the shared expert stays on the card): half of each layer's routed experts in host RAM. The
    prompt pass streams them to the card's kernels (logits equal to the whole card's); fed the whole
    card's greedy ids, each decode step (host experts summed by the host's cores) within the band of
    tests/test_cuda_offload.py."""
    from bloomery.engine.loader import load_model
    from bloomery.placement import Placement, TensorPlace, whole
    path = files["moe_q4km"]
    n_expert, n_layer = SHAPES["moe_q4km"][1]["n_expert"], SHAPES["moe_q4km"][1]["n_layer"]
    keep = n_expert // 2
    tensors = tuple(TensorPlace(f"blk.{i}.ffn_{x}_exps.weight", "host", keep, n_expert)
                    for i in range(n_layer) for x in ("gate", "up", "down"))
    split = Placement("cuda", 2, 512, "cuda:0", tensors=tensors, experts_on_card=(keep,) * n_layer, case="flags",
                      n_expert=n_expert)
    card = load_model(str(path), whole("cuda", 2, 512))
    host = load_model(str(path), split, threads=2)
    PinnedRoutes(card, host)                      # the host's q8 activations round otherwise: near ties pinned
    prompt = np.asarray(PROMPTS[0] + PROMPTS[1], np.int32)     # 19 ids: past DECODE_ROWS, the streamed prompt pass
    assert prompt.size > DECODE_ROWS
    first = card.prefill(0, prompt, 0)
    np.testing.assert_array_equal(host.prefill(0, prompt, 0), first)
    ids, worst = [int(np.argmax(first))], 0.0
    for k in range(16):
        want = card.decode([0], [ids[-1]], [prompt.size + k])[0]
        got = host.decode([0], [ids[-1]], [prompt.size + k])[0]
        worst = max(worst, float(np.abs(got - want).max()))
        ids.append(int(np.argmax(want)))
    assert worst <= 0.8, worst                                        # BAND of tests/test_cuda_offload.py
    rep = host.ops.offload.report()
    assert rep["residency"] == "off" and [len(x["on_card"]) for x in rep["layers"]] == [keep] * n_layer
