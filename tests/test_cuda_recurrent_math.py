"""The cuda backend's recurrent state and ops (bloomery/engine/cuda/recurrent.py) run with numpy as
their array module, against the CPU backend's (cpu/recurrent.py): decode rows of several slots in
one step (the captured step's form, slots and positions as arrays only), prompts of several slots in
one pass, long spans in the chunked form, the rule that a state cannot step back, and checkpoints.
The same functions run on the card with CuPy (tests/test_cuda_qwen35.py)."""
from __future__ import annotations

import numpy as np
import pytest

from bloomery.engine.cpu import recurrent as cpu_rec
from bloomery.engine.cuda import recurrent as dev_rec
from bloomery.engine.ops import AttnSpan, Rows, delta_gates

# the step form against ggml's step kernel (fma updates, ggml's dot order): float32 rounding only
STEP_TOL = dict(rtol=2e-5, atol=2e-6)
# the chunked form against the step form: as tests/test_qwen35moe.py's CHUNKED_TOL, with room for the
# block inverse (float32 products where numpy's solve runs in float64)
CHUNKED_TOL = dict(rtol=1e-4, atol=2e-5)


def host_rows(spans, n_rows):
    slots = np.empty(n_rows, np.int32)
    positions = np.empty(n_rows, np.int32)
    for sp in spans:
        slots[sp.row0:sp.row1] = sp.slot
        positions[sp.row0:sp.row1] = np.arange(sp.pos0, sp.pos0 + sp.row1 - sp.row0)
    return Rows(list(spans), slots, positions)


def captured_rows(slots, positions):
    """A captured decode step's rows: no host spans."""
    return Rows(None, np.asarray(slots, np.int32), np.asarray(positions, np.int32))


def inputs(t, hk, h, s, c, seed=0):
    """q, k (L2-normalised, as the model feeds them), v, g < 0, beta in (0, 1), and a conv input [T, C]."""
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((2, t, hk, s), np.float32)
    q, k = (a / np.linalg.norm(a, axis=-1, keepdims=True) for a in (q, k))
    v = rng.standard_normal((t, h, s), np.float32)
    g, beta = -rng.uniform(0, 1, (t, h)).astype(np.float32), rng.uniform(0, 1, (t, h)).astype(np.float32)
    x = rng.standard_normal((t, c), np.float32)
    return q, k, v, g, beta, x


class Pair:
    """The CPU state and the device-code state (numpy) of one layer, stepped alike."""

    def __init__(self, n_slots, hk, h, s, c, width=4, seed=1):
        self.cpu = cpu_rec.RecurrentState(1, n_slots, width - 1, c, h, s)
        self.dev = dev_rec.RecurrentState(np, 1, n_slots, width - 1, c, h, s)
        self.kernel = np.random.default_rng(seed).standard_normal((c, width), np.float32)

    def step(self, spans, q, k, v, g, beta, x, captured=None):
        """Both states through conv then delta over these rows; (cpu conv, dev conv, cpu delta, dev delta)."""
        rows = captured_rows(*captured) if captured else host_rows(spans, q.shape[0])
        cc = cpu_rec.conv_step(self.cpu, 0, spans, x, self.kernel)
        dc = dev_rec.conv_step(self.dev, 0, rows, x, self.kernel)
        cd = cpu_rec.delta_rule(self.cpu, 0, spans, q, k, v, g, beta)
        dd = dev_rec.delta_rule(self.dev, 0, rows, q, k, v, g, beta)
        return cc, dc, cd, dd

    def same_state(self, tol=STEP_TOL):
        np.testing.assert_allclose(self.dev.conv, self.cpu.conv, rtol=0, atol=0)
        np.testing.assert_allclose(self.dev.delta, self.cpu.delta, **tol)
        held = self.dev.positions_held()
        np.testing.assert_array_equal(held[0], self.cpu.conv_pos)
        np.testing.assert_array_equal(held[1], self.cpu.delta_pos)


def check(out, tol=STEP_TOL):
    cc, dc, cd, dd = out
    np.testing.assert_array_equal(dc, cc)                # the conv: the same sums in the same order
    np.testing.assert_allclose(dd, cd, **tol)


@pytest.mark.parametrize("hk, h, s", [(2, 4, 8), (1, 2, 16), (2, 2, 32)])
def test_prompts_then_decode_rows_of_several_slots(hk, h, s):
    """Short prompts in two slots (one pass, the step form on both sides), then decode steps of three
    slots at once in the captured form (slots and positions as arrays, no spans), a slot at position
    0 among them (a fresh state), then an uncaptured decode step (host spans, one row each)."""
    c = 2 * hk * s + h * s
    p = Pair(3, hk, h, s, c)
    q, k, v, g, beta, x = inputs(11, hk, h, s, c)
    spans = [AttnSpan(0, 0, 0, 5), AttnSpan(2, 0, 5, 11)]
    out = p.step(spans, q, k, v, g, beta, x)
    # the device code runs spans of several rows in the chunked form: within its band of the step form
    check(out, CHUNKED_TOL)
    p.same_state(CHUNKED_TOL)
    for i, (slots, pos) in enumerate((([2, 0, 1], [6, 5, 0]), ([0, 1, 2], [6, 1, 7]), ([1], [2]))):
        q, k, v, g, beta, x = inputs(len(slots), hk, h, s, c, seed=10 + i)
        spans = [AttnSpan(sl, ps, b, b + 1) for b, (sl, ps) in enumerate(zip(slots, pos))]
        check(p.step(spans, q, k, v, g, beta, x, captured=(slots, pos)), CHUNKED_TOL)
        p.same_state(CHUNKED_TOL)
    q, k, v, g, beta, x = inputs(2, hk, h, s, c, seed=20)
    spans = [AttnSpan(2, 8, 0, 1), AttnSpan(0, 7, 1, 2)]
    check(p.step(spans, q, k, v, g, beta, x), CHUNKED_TOL)
    p.same_state(CHUNKED_TOL)


def test_decode_rows_step_as_the_cpu_step_kernel():
    """From the same state, a captured step of two slots gives the CPU step kernel's outputs and
    states to float32 rounding (the decode form is the step form, not the chunked one)."""
    hk, h, s = 2, 4, 16
    c = 2 * hk * s + h * s
    p = Pair(2, hk, h, s, c)
    rng = np.random.default_rng(5)
    p.cpu.delta[:] = rng.standard_normal(p.cpu.delta.shape).astype(np.float32) * 0.3
    p.cpu.conv[:] = rng.standard_normal(p.cpu.conv.shape).astype(np.float32)
    p.dev.conv[:], p.dev.delta[:] = p.cpu.conv, p.cpu.delta
    p.cpu.conv_pos[:] = p.cpu.delta_pos[:] = [4, 9]
    p.dev.held[:] = np.array([4, 9], np.int32)
    q, k, v, g, beta, x = inputs(2, hk, h, s, c, seed=6)
    spans = [AttnSpan(1, 9, 0, 1), AttnSpan(0, 4, 1, 2)]
    check(p.step(spans, q, k, v, g, beta, x, captured=([1, 0], [9, 4])))
    p.same_state()


@pytest.mark.parametrize("t, cut, hk, h, s", [(64, 0, 1, 2, 16), (65, 64, 2, 4, 16), (200, 70, 2, 4, 32),
                                               (300, 129, 4, 8, 64), (1100, 0, 1, 2, 16)])
def test_long_spans_in_the_chunked_form(t, cut, hk, h, s):
    """Spans that fill whole chunks and spans padded to them, more than GROUP_CHUNKS chunks in one span
    (1100 rows), a slot's state carried from a first span into a second, another slot beside it in the
    same pass: outputs and states as the CPU's step form's, to the chunked form's rounding."""
    c = 2 * hk * s + h * s
    p = Pair(2, hk, h, s, c)
    q, k, v, g, beta, x = inputs(t, hk, h, s, c)
    if cut:
        sl = slice(0, cut)
        check(p.step([AttnSpan(0, 0, 0, cut)], q[sl], k[sl], v[sl], g[sl], beta[sl], x[sl]), CHUNKED_TOL)
    both = [AttnSpan(0, cut, 0, t - cut), AttnSpan(1, 0, t - cut, 2 * (t - cut))]   # slot 1 reads the same rows

    def cat(a):
        return np.concatenate([a[cut:], a[cut:]])

    check(p.step(both, cat(q), cat(k), cat(v), cat(g), cat(beta), cat(x)), CHUNKED_TOL)
    p.same_state(CHUNKED_TOL)


def test_the_chunked_form_is_the_cpus_chunked_form():
    """The same span through cpu/recurrent.delta_rule_chunked and the device code's chunked form: the
    same algorithm, so closer to each other than either to the step form."""
    hk, h, s, t = 2, 4, 32, 150
    q, k, v, g, beta, _ = inputs(t, hk, h, s, 1)
    st = cpu_rec.RecurrentState(1, 1, 3, 1, h, s)
    ref = cpu_rec.delta_rule_chunked(st, 0, [AttnSpan(0, 0, 0, t)], q, k, v, g, beta)
    qe, ke = dev_rec.expand_heads(np, q, h), dev_rec.expand_heads(np, k, h)
    scale = np.float32(1) / np.sqrt(np.float32(s))
    got, s_new = dev_rec.delta_chunked(np, np.zeros((h, s, s), np.float32), qe, ke, v, g, beta, scale)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose(s_new, st.delta[0, 0].transpose(0, 2, 1), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("size", [1, 2, 8, 64])
def test_unit_lower_inverse(size):
    rng = np.random.default_rng(size)
    a = np.tril(rng.uniform(-1, 1, (3, 2, size, size)), -1).astype(np.float32) * 0.5
    got = dev_rec.unit_lower_inverse(np, a)
    want = np.linalg.inv(np.eye(size) + a.astype(np.float64))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert got.dtype == np.float32


def test_heads_expand_as_ggmls_broadcast():
    a = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)
    got = dev_rec.expand_heads(np, a, 6)
    np.testing.assert_array_equal(got, a[:, np.arange(6) % 3])
    assert dev_rec.expand_heads(np, a, 3) is a


def test_a_state_cannot_step_back_and_says_so():
    hk, h, s = 1, 2, 8
    c = 2 * hk * s + h * s
    p = Pair(2, hk, h, s, c)
    q, k, v, g, beta, x = inputs(5, hk, h, s, c)
    p.step([AttnSpan(0, 0, 0, 5)], q, k, v, g, beta, x)
    before = p.dev.positions_held().copy()
    rows = host_rows([AttnSpan(0, 3, 0, 1)], 1)
    with pytest.raises(dev_rec.RecurrentStateError, match="holds positions 0..4 .* position 3 cannot follow"):
        dev_rec.conv_step(p.dev, 0, rows, x[:1], p.kernel)
    # refused before anything moved: every span of a call is checked first
    rows = host_rows([AttnSpan(1, 0, 0, 1), AttnSpan(0, 7, 1, 2)], 2)
    with pytest.raises(dev_rec.RecurrentStateError, match="slot 0's delta-rule state"):
        dev_rec.delta_rule(p.dev, 0, rows, q[:2], k[:2], v[:2], g[:2], beta[:2])
    np.testing.assert_array_equal(p.dev.positions_held(), before)
    # a captured step at a position the slot does not hold: the slot holds nothing a step can follow,
    # the next span that would carry on is refused by name, one at position 0 starts afresh
    dev_rec.conv_step(p.dev, 0, captured_rows([0], [9]), x[:1], p.kernel)
    assert p.dev.positions_held()[0, 0, 0] == -1
    with pytest.raises(dev_rec.RecurrentStateError, match="holds no position a step can follow"):
        dev_rec.conv_step(p.dev, 0, host_rows([AttnSpan(0, 10, 0, 1)], 1), x[:1], p.kernel)
    dev_rec.conv_step(p.dev, 0, host_rows([AttnSpan(0, 0, 0, 2)], 2), x[:2], p.kernel)
    assert p.dev.positions_held()[0, 0, 0] == 2


def test_checkpoints_save_and_restore_as_the_cpus():
    """save_state / restore_state: the CPU's shapes and rule; a restored slot carries on as the slot it
    was saved from; a slot whose layers hold other positions is refused; slot_nbytes as the CPU's."""
    hk, h, s = 2, 4, 8
    c = 2 * hk * s + h * s
    p = Pair(2, hk, h, s, c)
    q, k, v, g, beta, x = inputs(9, hk, h, s, c)
    p.step([AttnSpan(0, 0, 0, 6)], q[:6], k[:6], v[:6], g[:6], beta[:6], x[:6])
    saved, saved_cpu = p.dev.save_state(0, 6), p.cpu.save_state(0, 6)
    for a, b in zip(saved, saved_cpu):
        assert a.shape == b.shape and a.dtype == b.dtype == np.float32
    assert p.dev.slot_nbytes == p.cpu.slot_nbytes and p.dev.nbytes == p.cpu.nbytes
    with pytest.raises(dev_rec.RecurrentStateError, match="holds 6 positions, not the 5 asked to save"):
        p.dev.save_state(0, 5)
    rows = host_rows([AttnSpan(0, 6, 0, 3)], 3)
    sl = slice(6, 9)
    ahead = dev_rec.delta_rule(p.dev, 0, rows, q[sl], k[sl], v[sl], g[sl], beta[sl])
    dev_rec.conv_step(p.dev, 0, rows, x[sl], p.kernel)
    p.dev.restore_state(1, saved, 6)                                  # into the other slot
    rows = host_rows([AttnSpan(1, 6, 0, 3)], 3)
    again = dev_rec.delta_rule(p.dev, 0, rows, q[sl], k[sl], v[sl], g[sl], beta[sl])
    np.testing.assert_array_equal(again, ahead)
    with pytest.raises(dev_rec.RecurrentStateError, match="does not fit"):
        p.dev.restore_state(1, (saved[0][:, :1], saved[1]), 6)
    saved[0][:] = 7                                                   # a copy, not a view of the state
    assert not (p.dev.conv == 7).all()


# --- the whole model on the device code (numpy as its array module) -----------------------------

class DeviceCodeOps:
    """The numpy backend with its recurrent ops swapped for the device code's (cuda/recurrent.py over
    numpy) and rows carrying their slots as CudaOps.rows does. A step with no host spans (as a captured
    decode step runs) reaches the recurrent ops as it is; the numpy attention needs host spans, so this
    stand-in rebuilds them from the rows' arrays for the attention alone."""

    def __new__(cls):
        from bloomery.engine.cpu.backend import NumpyOps

        class Ops(NumpyOps):
            def rows(self, spans, positions):
                return host_rows(spans, int(np.asarray(positions).shape[0]))

            def recurrent_state(self, n_layer, n_slots, conv_window, conv_channels, n_v_heads, head_size):
                return dev_rec.RecurrentState(np, n_layer, n_slots, conv_window, conv_channels, n_v_heads, head_size)

            def conv_step(self, state, layer, rows, x, kernel, silu=False):
                out = dev_rec.conv_step(state, layer, rows, np.asarray(x, np.float32), kernel.dense())
                return self.silu(out) if silu else out

            def delta_rule(self, state, layer, rows, q, k, v, alpha, b, dt_bias, a):
                g, beta = delta_gates(self, alpha, b, dt_bias, a)
                return dev_rec.delta_rule(state, layer, rows, *(np.ascontiguousarray(x, np.float32)
                                                                for x in (q, k, v, g, beta)))

            def self_attention(self, cache, layer, rows, *args, **kw):
                if rows.spans is None:
                    rows = Rows([AttnSpan(int(s), int(p), b, b + 1) for b, (s, p) in
                                 enumerate(zip(rows.slots, rows.positions))], rows.slots, rows.positions)
                return super().self_attention(cache, layer, rows, *args, **kw)

        return Ops()


MODEL_TOL = dict(rtol=2e-3, atol=2e-3)   # logits after 4 layers of float32 state math in two orders


@pytest.mark.parametrize("arch, shape", [
    ("qwen35moe", dict(n_layer=4, n_embd=64, n_head=4, n_head_kv=2, head_dim=32, n_expert=4, n_expert_used=2,
                       n_ff_exp=64, n_ff_shexp=64, ssm_d_state=16, ssm_n_group=2, ssm_dt_rank=4)),
    ("qwen35", dict(n_layer=4, n_embd=64, n_head=4, n_head_kv=2, head_dim=32, n_ff=128, ssm_d_state=16,
                    ssm_n_group=1, ssm_dt_rank=2, ssm_d_conv=3, full_attn_interval=2, seed=2))])
def test_the_model_on_the_device_code(synthetic_dir, arch, shape):
    """qwen35moe and qwen35 with the device code's recurrent ops, against the numpy backend's: a 70-id and a
    5-id prompt, a decode step of both slots as the captured step runs it (no host spans: slots and
    positions as arrays) and one as the eager step runs it, and a checkpoint put back into the other slot."""
    from bloomery.engine.cpu.backend import NumpyOps
    from bloomery.engine.models.registry import model_class
    from bloomery.gguf_file import open_gguf
    from tests.conftest import load_tool
    path = synthetic_dir / f"devcode_{arch}.gguf"
    if not path.exists():
        load_tool("make_synthetic").write_synthetic(path, arch=arch, **shape)
    gf = open_gguf(str(path))
    ref, dev = (model_class(arch)(gf, ops, 2, 256) for ops in (NumpyOps(), DeviceCodeOps()))
    assert isinstance(dev.state, dev_rec.RecurrentState)
    a, b = list(range(500, 570)), [9707, 11, 1879, 0, 13]
    for m_slot, ids in ((0, a), (1, b)):
        np.testing.assert_allclose(dev.prefill(m_slot, ids, 0), ref.prefill(m_slot, ids, 0), **MODEL_TOL)
    saved = dev.save_checkpoint(1, len(b))
    slots, ids, pos = np.array([1, 0], np.int32), np.array([5, 6], np.int32), np.array([len(b), len(a)], np.int32)
    x = dev.layers_forward(dev.embed(ids), Rows(None, slots, pos))             # the captured step's call
    np.testing.assert_allclose(dev.head(x), ref.decode([1, 0], ids, pos), **MODEL_TOL)
    held = dev.state.positions_held()
    assert (held[:, :, 1] == len(b) + 1).all() and (held[:, :, 0] == len(a) + 1).all()
    np.testing.assert_allclose(dev.decode([0, 1], [7, 8], pos[::-1] + 1), ref.decode([0, 1], [7, 8], pos[::-1] + 1),
                               **MODEL_TOL)
    dev.restore_checkpoint(0, saved, len(b))                                   # slot 1's state, put in slot 0
    dev.restore_kv(0, dev.save_kv(1, len(b)), len(b))                          # with its KV up to there
    got = dev.decode([0], [5], [len(b)])
    ref2 = model_class(arch)(gf, NumpyOps(), 2, 256)
    ref2.prefill(0, b, 0)
    np.testing.assert_allclose(got, ref2.decode([0], [5], [len(b)]), **MODEL_TOL)
