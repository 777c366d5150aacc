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
from bloomery.engine.ops import AttnSpan, Rows

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
