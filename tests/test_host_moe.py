"""The host expert kernel (kernels/host_moe.c through engine/cpu/host_moe.py) against the CPU
backend: every weight type on every SIMD path this machine builds (AVX-512 VNNI, AVX2, portable
C), skip flags, the row and slot counts, the thread count, the persistent struct the cuda backend's
bell runs, and the refusals.

host_moe.c and the CPU backend's kernels/cpu_lanes.c compute the products with the same code
(kernels/lanes_dot.h), so the reference is the CPU backend's own computation of the same experts,
and the comparisons are bit for bit:
  - each (token, slot)'s down output before its weight, down_e(swiglu(gate_e x, up_e x)), has the
    bits of the CPU backend's expert loop (NumpyOps._experts_c, cpu_lanes.c moe_chunk: ggml_mul_mat_id's
    products in llama.cpp's float order, the activations rounded as ggml's Q8_0 / Q8_K, swiglu
    with ggml_v_expf, Q6_K and Q5_K tiled for 8 or more of an expert's rows in a chunk of 64);
    Q4_0, which the CPU backend leaves to its numpy dot_planes, is held to ggml's x86
    ggml_vec_dot_q4_0_q8_0 order instead (q8_0._dot_q8_0_lanes, the Q8_0 family's lanes);
  - host_moe's out row is the float32 sum, in slot order, of wts * that output over the slots whose
    expert is not flagged skip, the first term alone then each next added: with no skip flags
    the CPU backend's moe_ffn (no residual) bit for bit.
What is only close: the cuda backend's layer output. The card adds the host's sum of its slots to
its own sum of the card's slots (and the card's products round as the card does), so that total
is a different float sum order from the CPU backend's all-slots-in-rank-order sum; the float
reference below (dequantized weights, unrounded activations) holds out to 5e-2 of its row's
largest value, a check of the whole that shares no code with either."""
from __future__ import annotations

import ctypes
import os
import stat

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from bloomery.engine.cpu import host_moe as hm
from bloomery.engine.cpu.backend import NumpyOps, NumpyWeight
from bloomery.engine.quant import formats, q8_0
from bloomery.engine.quant.formats import dequantize
from bloomery.engine.quant.threads import OneBlasThread
from test_quant import random_blocks

X86 = os.uname().machine in ("x86_64", "AMD64")
ISAS = ["native", "avx2", "portable"] if X86 else ["native"]
PAIRS = [(QT.Q4_K, QT.Q6_K), (QT.Q5_K, QT.Q4_K), (QT.Q6_K, QT.Q5_K), (QT.Q8_0, QT.Q5_0), (QT.Q4_0, QT.Q8_0),
         (QT.Q5_0, QT.Q4_0)]
MOE_CHUNK_ROWS = 64                    # cpu_lanes.c moe_chunk: an expert's rows go 64 at a time


def _stack(qt, n_exp, n_rows, row_len, seed):
    return hm.ExpertStack(random_blocks(qt, n_exp * n_rows, row_len, seed=seed), qt, n_rows, row_len)


def _expert_bytes(st: hm.ExpertStack, e: int) -> np.ndarray:
    nbytes = st.n_rows * st.row_bytes
    return st.data[e * nbytes:(e + 1) * nbytes]


def _dequantized(st: hm.ExpertStack, e: int) -> np.ndarray:
    return dequantize(st.ggml_type, _expert_bytes(st, e), st.n_rows, st.row_len).astype(np.float64)


def _bits_equal(a, b) -> bool:
    return a.shape == b.shape and np.array_equal(np.asarray(a, np.float32).view(np.uint32),
                                                 np.asarray(b, np.float32).view(np.uint32))


def _product(x, st: hm.ExpertStack, e: int) -> np.ndarray:
    """x [t, K] @ expert e's [N, K]^T as the CPU backend's numpy kernels give an expert's rows
    (formats.dot_llama per_row: ggml_mul_mat_id's order); Q4_0 in the Q8_0 family's lanes."""
    planes = formats.decode_planes(st.ggml_type, _expert_bytes(st, e), st.n_rows, st.row_len)
    if st.ggml_type == QT.Q4_0:
        with OneBlasThread():
            return q8_0._dot_q8_0_lanes(np.asarray(x, np.float32), planes)
    return formats.dot_llama(np.asarray(x, np.float32), planes, per_row=True)


def _cpu_outputs(x, ids, gate, up, down) -> np.ndarray:
    """[T, A, D] f32: each (token, slot)'s down output before its weight, as the CPU backend's
    expert loop computes it (cpu_lanes.c moe_chunk: an expert's rows in token order, 64 at a
    time; swiglu by NumpyOps). Where the compiled call takes these stacks, the call's own result
    (weights 1) is checked to be the same bits."""
    ops = NumpyOps()
    y = np.zeros((ids.shape[0], ids.shape[1], x.shape[1]), np.float32)
    for e in np.unique(ids):
        tok, rank = np.nonzero(ids == e)                               # token order, then slot
        for c0 in range(0, len(tok), MOE_CHUNK_ROWS):
            tt, rr = tok[c0:c0 + MOE_CHUNK_ROWS], rank[c0:c0 + MOE_CHUNK_ROWS]
            h = ops.swiglu(_product(x[tt], gate, e), _product(x[tt], up, e))
            y[tt, rr] = _product(h, down, e)
    stacks = [NumpyWeight(st.ggml_type, (st.row_len, st.n_rows, st.n_experts), st.data) for st in (gate, up, down)]
    compiled = NumpyOps._experts_c(np.asarray(x, np.float32), ids, np.ones(ids.shape, np.float32), stacks)
    if compiled is not None:
        assert _bits_equal(compiled, y)
    return y


def _weighted_sum(y, ids, wts, skip) -> np.ndarray:
    """[T, D] f32: sum over the slots not skipped, in slot order, of wts * y (the first term alone)."""
    out = np.zeros((ids.shape[0], y.shape[2]), np.float32)
    for t in range(ids.shape[0]):
        acc = None
        for a in range(ids.shape[1]):
            if skip[ids[t, a]]:
                continue
            term = np.float32(wts[t, a]) * y[t, a]
            acc = term if acc is None else acc + term
        if acc is not None:
            out[t] = acc
    return out


def _float_reference(x, ids, wts, gate, up, down, skip):
    """Float64 math on gguf's dequantized weights and the unrounded activations."""
    out = np.zeros(x.shape, np.float64)
    seen = {}

    def _expert(st, e):                                                # each matrix dequantized once
        if (id(st), e) not in seen:
            seen[id(st), e] = _dequantized(st, e)
        return seen[id(st), e]
    for t in range(x.shape[0]):
        for a in range(ids.shape[1]):
            e = int(ids[t, a])
            if skip[e]:
                continue
            g, u = _expert(gate, e) @ x[t].astype(np.float64), _expert(up, e) @ x[t].astype(np.float64)
            with np.errstate(over="ignore"):
                h = g / (1 + np.exp(-g)) * u
            out[t] += wts[t, a] * (_expert(down, e) @ h)
    return out


def _routing(rng, n_tok, n_used, n_exp):
    ids = np.stack([rng.permutation(n_exp)[:n_used] for _ in range(n_tok)]).astype(np.int32)   # [T, A]
    wts = rng.uniform(0.05, 1, (n_tok, n_used)).astype(np.float32)                              # [T, A]
    return ids, wts


def _case(gt, dt, n_exp=6, d=512, f=256, seed=0):
    return _stack(gt, n_exp, f, d, seed + 1), _stack(gt, n_exp, f, d, seed + 2), _stack(dt, n_exp, d, f, seed + 3)


def _row_err(out, ref):
    return np.abs(out - ref).max(axis=1) / np.abs(ref).max(axis=1)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("gt,dt", PAIRS, ids=lambda t: t.name)
def test_layer_is_the_cpu_backends_bit_for_bit(isa, gt, dt):
    """Each slot's down output (a call of one slot, weights 1) and the weighted sum of a layer with
    a skipped expert: the CPU backend's bits; the float reference close."""
    rng = np.random.default_rng(int(gt) * 100 + int(dt))
    gate, up, down = _case(gt, dt, seed=int(gt))
    x = rng.standard_normal((3, 512)).astype(np.float32)
    ids, wts = _routing(rng, 3, 4, 6)
    skip = np.zeros(6, np.uint8)
    one = hm.host_moe_layer(x, ids[:, :1], np.ones((3, 1), np.float32), gate, up, down, skip, n_threads=2, isa=isa)
    assert _bits_equal(one, _cpu_outputs(x, ids[:, :1], gate, up, down)[:, 0])   # weight 1: the output itself
    y = _cpu_outputs(x, ids, gate, up, down)
    out = hm.host_moe_layer(x, ids, wts, gate, up, down, skip, n_threads=2, isa=isa)
    assert _bits_equal(out, _weighted_sum(y, ids, wts, skip))
    skip[ids[0, 1]] = 1
    out = hm.host_moe_layer(x, ids, wts, gate, up, down, skip, n_threads=2, isa=isa)
    assert _bits_equal(out, _weighted_sum(y, ids, wts, skip))
    assert np.all(_row_err(out, _float_reference(x, ids, wts, gate, up, down, skip)) <= 5e-2)


def test_no_skip_flags_give_the_cpu_backends_moe_ffn():
    """The CPU backend's whole routed FFN (NumpyOps.moe_ffn: every slot's weighted output, added in
    rank order) is host_moe's out with no skip flags, bit for bit."""
    rng = np.random.default_rng(12)
    gate, up, down = _case(QT.Q4_K, QT.Q6_K, n_exp=8, d=512, f=256, seed=5)
    x = rng.standard_normal((5, 512)).astype(np.float32)
    ids, wts = _routing(rng, 5, 8, 8)
    stacks = [NumpyWeight(st.ggml_type, (st.row_len, st.n_rows, st.n_experts), st.data) for st in (gate, up, down)]
    want = NumpyOps().moe_ffn(x, ids, wts, *stacks)
    assert _bits_equal(hm.host_moe_layer(x, ids, wts, gate, up, down, n_threads=2), want)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("gt,ut,dt,d,f", [(QT.Q8_0, QT.Q4_0, QT.Q5_0, 288, 160), (QT.Q4_K, QT.Q6_K, QT.Q8_0, 512, 96),
                                          (QT.Q5_K, QT.Q8_0, QT.Q4_K, 256, 256)], ids=["32s", "K+K", "K+32"])
def test_mixed_types_and_rows_that_are_not_whole_256s(isa, gt, ut, dt, d, f):
    """gate and up of different types (the input rounded for each: Q8_K, Q8_0), rows of 32 blocks
    that do not fill a 256."""
    rng = np.random.default_rng(4)
    gate, up, down = _stack(gt, 3, f, d, 1), _stack(ut, 3, f, d, 2), _stack(dt, 3, d, f, 3)
    x = rng.standard_normal((2, d)).astype(np.float32)
    ids, wts = _routing(rng, 2, 2, 3)
    skip = np.zeros(3, np.uint8)
    out = hm.host_moe_layer(x, ids, wts, gate, up, down, skip, n_threads=3, isa=isa)
    assert _bits_equal(out, _weighted_sum(_cpu_outputs(x, ids, gate, up, down), ids, wts, skip))


def test_the_paths_are_the_ones_asked_for():
    assert hm.lib("native").host_moe_isa() >= hm.lib(ISAS[-1]).host_moe_isa()
    if X86:
        assert (hm.lib("avx2").host_moe_isa(), hm.lib("portable").host_moe_isa()) == (1, 0)
        if "avx512_vnni" in open("/proc/cpuinfo").read():
            assert hm.lib("native").host_moe_isa() == 2


@pytest.mark.parametrize("n_tok,n_used", [(1, 1), (1, 8), (2, 3), (5, 8), (16, 8), (16, 1), (9, 5)])
def test_rows_slots_and_threads(n_tok, n_used):
    """T 1..16, A 1..8, experts repeated across rows (8 experts, so rows share them: from 8 rows of
    one expert its Q6_K down takes the tiled order); the bits do not depend on the thread count and
    are the CPU backend's."""
    rng = np.random.default_rng(n_tok * 10 + n_used)
    gate, up, down = _case(QT.Q4_K, QT.Q6_K, n_exp=8, d=256, f=512, seed=n_tok)
    x = (rng.standard_normal((n_tok, 256)) * rng.uniform(0.1, 10, (n_tok, 1))).astype(np.float32)
    ids, wts = _routing(rng, n_tok, n_used, 8)
    skip = np.zeros(8, np.uint8)
    outs = [hm.host_moe_layer(x, ids, wts, gate, up, down, skip, n_threads=n) for n in (1, 2, 3, 7)]
    for o in outs[1:]:
        assert np.array_equal(o.view(np.uint32), outs[0].view(np.uint32))
    assert _bits_equal(outs[0], _weighted_sum(_cpu_outputs(x, ids, gate, up, down), ids, wts, skip))


@pytest.mark.parametrize("units,prefetch", [(0, 0), (1, 2048), (8, 64), (64, 100000), (1000, 0)])
def test_how_a_call_is_cut_and_read_ahead_never_changes_its_bits(units, prefetch):
    """set_tuning: the rows a unit (the fixed 16 / 32, or down to a quarter of that for few experts) and the bytes
    asked for ahead of each row (past the stack's end too): every setting gives the CPU backend's bits, on one
    expert (the most cut) and on eight."""
    rng = np.random.default_rng(units + prefetch)
    gate, up, down = _case(QT.Q4_K, QT.Q6_K, n_exp=8, d=512, f=256, seed=units)
    x = rng.standard_normal((2, 512)).astype(np.float32)
    was = hm.set_tuning(units, prefetch)
    try:
        assert hm.set_tuning() == (units, prefetch)
        for n_used in (1, 8):
            ids, wts = _routing(rng, 2, n_used, 8)
            skip = np.zeros(8, np.uint8)
            out = hm.host_moe_layer(x, ids, wts, gate, up, down, skip, n_threads=7)
            assert _bits_equal(out, _weighted_sum(_cpu_outputs(x, ids, gate, up, down), ids, wts, skip))
    finally:
        hm.set_tuning(*was)


@pytest.fixture
def spin_us(request):
    hm.set_spin_us(request.param)
    yield request.param
    hm.set_spin_us(2000)


@pytest.mark.parametrize("spin_us", [0, 2000], indirect=True)
def test_callers_on_many_threads_share_the_pool(spin_us):
    """Python threads calling at once (ctypes lets the GIL go), each with its own thread count,
    some calls after a pause long enough for the workers to fall asleep (with spin 0, every
    call): every result has the bits of the same call made alone."""
    import threading
    import time
    rng = np.random.default_rng(5)
    gate, up, down = _case(QT.Q4_K, QT.Q6_K, n_exp=16, d=512, f=256, seed=9)
    cases = []
    for i in range(8):
        n_tok = 1 + i % 4
        ids, wts = _routing(rng, n_tok, 4, 16)
        cases.append((rng.standard_normal((n_tok, 512)).astype(np.float32), ids, wts))
    want = [hm.host_moe_layer(x, ids, wts, gate, up, down, n_threads=1) for x, ids, wts in cases]
    bad = []

    def caller(k):
        for r in range(12):
            i = (k + r) % len(cases)
            if r == 6:
                time.sleep(0.02)                                       # past the workers' spin
            got = hm.host_moe_layer(*cases[i], gate, up, down, n_threads=1 + (k + r) % 4)
            if not np.array_equal(got.view(np.uint32), want[i].view(np.uint32)):
                bad.append((k, r))
    threads = [threading.Thread(target=caller, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads) and not bad


def test_a_forked_child_gets_a_pool_of_its_own():
    """The parent's workers do not exist in a fork; the child's first call starts its own."""
    rng = np.random.default_rng(6)
    gate, up, down = _case(QT.Q4_K, QT.Q6_K, n_exp=4, d=256, f=256)
    x = rng.standard_normal((2, 256)).astype(np.float32)
    ids, wts = _routing(rng, 2, 2, 4)
    want = hm.host_moe_layer(x, ids, wts, gate, up, down, n_threads=3)
    pid = os.fork()
    if pid == 0:                                                        # the child: exit status is the verdict
        ok = np.array_equal(hm.host_moe_layer(x, ids, wts, gate, up, down, n_threads=3), want)
        names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
        os._exit(0 if ok and names.count("bloomery-hostk") == 2 else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_slot_repeated_in_one_row_counts_twice():
    rng = np.random.default_rng(3)
    gate, up, down = _case(QT.Q8_0, QT.Q8_0, n_exp=4, d=256, f=256)
    x = rng.standard_normal((2, 256)).astype(np.float32)
    ids = np.array([[2, 2], [1, 3]], np.int32)
    wts = np.array([[0.25, 0.5], [1, 1]], np.float32)
    skip = np.zeros(4, np.uint8)
    out = hm.host_moe_layer(x, ids, wts, gate, up, down, skip)
    assert _bits_equal(out, _weighted_sum(_cpu_outputs(x, ids, gate, up, down), ids, wts, skip))


def test_a_skipped_expert_contributes_nothing():
    """Its bytes are never read (NaN scales in them leave no trace), its rows add exactly 0, and a
    row whose every expert is skipped comes out as exact zeros."""
    rng = np.random.default_rng(7)
    gate, up, down = _case(QT.Q4_K, QT.Q6_K, n_exp=6, d=256, f=256)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    ids = np.array([[0, 1, 2], [3, 1, 4], [5, 1, 0]], np.int32)
    wts = rng.uniform(0.1, 1, (3, 3)).astype(np.float32)
    clean = hm.host_moe_layer(x, ids, np.where(ids == 1, 0, wts).astype(np.float32), gate, up, down)
    nan_down = down.data.copy().reshape(-1, 210)
    per_expert = nan_down.shape[0] // 6
    nan_down[per_expert:2 * per_expert, 208:210] = np.frombuffer(np.float16(np.nan).tobytes(), np.uint8)
    poisoned = hm.ExpertStack(nan_down.reshape(-1), QT.Q6_K, down.n_rows, down.row_len)
    skip = np.zeros(6, np.uint8)
    skip[1] = 1
    out = hm.host_moe_layer(x, ids, wts, gate, up, poisoned, skip)
    assert np.array_equal(out.view(np.uint32), clean.view(np.uint32))
    skip[[3, 4]] = 1                                                    # row 1: every expert elsewhere
    out = hm.host_moe_layer(x, ids, wts, gate, up, poisoned, skip)
    assert np.array_equal(out[1], np.zeros(256, np.float32)) and np.all(out[[0, 2]] != 0)
    out = hm.host_moe_layer(x, ids, wts, gate, up, poisoned, np.ones(6, np.uint8))
    assert np.array_equal(out, np.zeros_like(out))


@pytest.mark.parametrize("gt,dt", [(QT.Q4_K, QT.Q6_K), (QT.Q6_K, QT.Q5_K)], ids=lambda t: t.name)
def test_an_experts_rows_past_a_chunk_of_64(gt, dt):
    """70 rows on one expert: the CPU backend takes an expert's rows 64 at a time, so the Q6_K /
    Q5_K products of the first 64 are in the tiled order and those of the last 6 in the lanes';
    host_moe's are the same bits."""
    rng = np.random.default_rng(70)
    gate, up, down = _case(gt, dt, n_exp=3, d=256, f=256, seed=2)
    x = rng.standard_normal((70, 256)).astype(np.float32)
    ids = np.stack([np.zeros(70, np.int32), 1 + (np.arange(70) % 2).astype(np.int32)], axis=1)   # [70, 2]
    wts = rng.uniform(0.1, 1, (70, 2)).astype(np.float32)
    skip = np.zeros(3, np.uint8)
    out = hm.host_moe_layer(x, ids, wts, gate, up, down, skip, n_threads=2)
    assert _bits_equal(out, _weighted_sum(_cpu_outputs(x, ids, gate, up, down), ids, wts, skip))


@pytest.mark.parametrize("isa", ISAS)
def test_a_non_finite_row_comes_out_nan_as_on_the_cpu_backend(isa):
    """A row with a NaN or an inf in its input gives NaN outputs (formats.CAct: its quantized
    blocks are not rounded from it), the other rows their bits, whatever shares their experts."""
    rng = np.random.default_rng(8)
    gate, up, down = _case(QT.Q5_K, QT.Q8_0, n_exp=4, d=256, f=256, seed=4)
    x = rng.standard_normal((4, 256)).astype(np.float32)
    x[1, 17], x[2, 255] = np.nan, np.inf
    ids = np.array([[0, 1], [0, 2], [1, 3], [3, 2]], np.int32)
    wts = rng.uniform(0.1, 1, (4, 2)).astype(np.float32)
    out = hm.host_moe_layer(x, ids, wts, gate, up, down, n_threads=2, isa=isa)
    assert np.isnan(out[1:3]).all() and np.isfinite(out[[0, 3]]).all()
    ok = [0, 3]
    assert _bits_equal(out[ok], _weighted_sum(_cpu_outputs(x[ok], ids[ok], gate, up, down), ids[ok], wts[ok],
                                              np.zeros(4, np.uint8)))


def test_one_header_is_in_both_builds_and_their_keys():
    """kernels/lanes_dot.h is the one copy of the products: both sources include it, it is part of
    both libraries' cache keys (a changed header rebuilds them) and the wheel ships it."""
    from bloomery.engine.cpu import kernels as cpu_kernels
    from bloomery.kernels import kernel_dir
    header = (kernel_dir() / "lanes_dot.h").read_bytes()
    for source in ("cpu_lanes.c", "host_moe.c"):
        assert b'#include "lanes_dot.h"' in (kernel_dir() / source).read_bytes()
        assert header in cpu_kernels._sources(kernel_dir() / source)
    pyproject = (kernel_dir().parent / "pyproject.toml").read_text()
    assert '"bloomery.kernels" = ["*.cu", "*.cuh", "*.c", "*.h"]' in pyproject


def test_the_persistent_struct_called_again_and_again():
    """What the cuda backend's bell does: one struct, host_moe called on its address, the
    expert tables rewritten in place (residency) and n_rows changed between calls; the experts on
    the card have no host address at all."""
    rng = np.random.default_rng(11)
    gate, up, down = _case(QT.Q4_K, QT.Q4_K, n_exp=4, d=256, f=256)
    x = np.zeros((4, 256), np.float32)
    out = np.full((4, 256), 7, np.float32)
    ids = np.zeros((4, 2), np.int32)
    wts = np.zeros((4, 2), np.float32)
    skip = np.array([0, 0, 1, 1], np.uint8)
    gp, upp, dp = gate.pointers(), up.pointers(), down.pointers()
    for t in (gp, upp, dp):
        t[2:] = 0                                                       # on the card: no host copy
    args = hm.args_struct(d=256, f=256, n_used=2, gate_type=QT.Q4_K, up_type=QT.Q4_K, down_type=QT.Q4_K,
                          gate=gp, up=upp, down=dp, skip=skip, ids=ids, wts=wts, x=x, out=out)
    hm.check_args(args)
    fn = hm.lib().host_moe
    for n_tok in (1, 3):
        x[:n_tok] = rng.standard_normal((n_tok, 256))
        ids[:n_tok] = [rng.permutation(4)[:2] for _ in range(n_tok)]
        wts[:n_tok] = rng.uniform(0.1, 1, (n_tok, 2))
        args.n_rows = n_tok
        fn(ctypes.addressof(args))
        want = hm.host_moe_layer(x[:n_tok], ids[:n_tok], wts[:n_tok], gate, up, down, skip)
        assert np.array_equal(out[:n_tok], want)
    skip[2] = 0                                                         # expert 2 moves to the host
    gp[2], upp[2], dp[2] = gate.pointers()[2], up.pointers()[2], down.pointers()[2]
    fn(ctypes.addressof(args))
    assert np.array_equal(out[:3], hm.host_moe_layer(x[:3], ids[:3], wts[:3], gate, up, down, skip))


def test_refusals_name_the_problem():
    gate, up, down = _case(QT.Q4_K, QT.Q6_K, n_exp=2, d=256, f=256)
    x = np.zeros((1, 256), np.float32)
    ids, wts = np.array([[0, 1]], np.int32), np.ones((1, 2), np.float32)
    with pytest.raises(ValueError, match=r"expert ids must lie in \[0, 2\)"):
        hm.host_moe_layer(x, ids + 1, wts, gate, up, down)
    with pytest.raises(ValueError, match="gate experts are"):
        hm.host_moe_layer(np.zeros((1, 512), np.float32), ids, wts, gate, up, down)
    f16 = hm.ExpertStack(np.zeros(2 * 256 * 256 * 2, np.uint8), QT.F16, 256, 256)
    with pytest.raises(ValueError, match="F16 has no host kernel"):
        hm.host_moe_layer(x, ids, wts, f16, up, down)
    with pytest.raises(ValueError, match="not a whole number of 256-element blocks"):
        hm.args_struct(d=288, f=256, n_used=2, gate_type=QT.Q4_K, up_type=QT.Q4_K, down_type=QT.Q6_K,
                       gate=[0], up=[0], down=[0], skip=np.zeros(1, np.uint8))
    args = hm.args_struct(d=256, f=256, n_used=2, gate_type=QT.Q4_K, up_type=QT.Q4_K, down_type=QT.Q6_K,
                          gate=gate.pointers(), up=up.pointers(), down=down.pointers(), skip=np.zeros(2, np.uint8),
                          ids=ids, wts=wts, x=x, out=np.zeros((1, 256), np.float32))
    args.n_rows = 0
    with pytest.raises(ValueError, match="n_rows < 1"):
        hm.check_args(args)
    args.n_rows, args.down_row_bytes = 1, 1
    with pytest.raises(ValueError, match="byte count does not match"):
        hm.check_args(args)
    hm.lib().host_moe(ctypes.addressof(args))                           # called anyway: NaN, not a guess
    assert np.all(np.isnan(args._keep[-1]))


def test_a_failed_build_is_refused_by_name(tmp_path, monkeypatch):
    cc = tmp_path / "cc-without-pthread"
    cc.write_text("#!/bin/sh\necho 'fatal error: pthread.h: No such file or directory' >&2\nexit 1\n")
    cc.chmod(cc.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("BLOOMERY_CACHE", str(tmp_path / "cache"))
    with pytest.raises(hm.HostKernelError, match="did not build with .*pthread.h: No such file"):
        hm._load("native")
    with pytest.raises(hm.HostKernelError, match="isa 'sse9'"):
        hm._load("sse9")


def test_read_bandwidth_and_phase_times_are_measured():
    assert hm.read_bandwidth_gbs(1 << 24, n_threads=1, reps=2) > 0.1
    gate, up, down = _case(QT.Q4_K, QT.Q6_K, n_exp=2, d=256, f=256)
    hm.host_moe_layer(np.ones((2, 256), np.float32), np.array([[0, 1], [1, 0]], np.int32), np.ones((2, 2), np.float32),
                      gate, up, down, n_threads=2)
    ends = hm.last_phases_us()
    assert len(ends) == 5 and 0 <= ends[0] and ends == sorted(ends)



def test_each_call_adds_its_time_to_busy_ns():
    """The persistent struct's busy_ns grows by each call's duration (the offload tier's host wait)."""
    import ctypes
    gate, up, down = _case(QT.Q4_K, QT.Q6_K, n_exp=4, d=256, f=256)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((1, 256)).astype(np.float32)
    out = np.zeros((1, 256), np.float32)
    ids, wts, skip = np.array([[0, 1]], np.int32), np.full((1, 2), 0.5, np.float32), np.zeros(4, np.uint8)
    args = hm.args_struct(d=256, f=256, n_used=2, gate_type=QT.Q4_K, up_type=QT.Q4_K, down_type=QT.Q6_K,
                          gate=gate.pointers(), up=up.pointers(), down=down.pointers(), skip=skip, ids=ids,
                          wts=wts, x=x, out=out)
    fn = hm.lib().host_moe
    assert args.busy_ns == 0
    fn(ctypes.addressof(args))
    first = args.busy_ns
    fn(ctypes.addressof(args))
    assert 0 < first < args.busy_ns


def _bell_layer(rng, n_rows, d=256, f=256, n_exp=4, n_used=2):
    gate, up, down = _case(QT.Q4_K, QT.Q6_K, n_exp=n_exp, d=d, f=f, seed=int(rng.integers(1000)))
    x = rng.standard_normal((n_rows, d)).astype(np.float32)
    ids, wts = _routing(rng, n_rows, n_used, n_exp)
    out = np.full((n_rows, d), 7, np.float32)
    skip = np.zeros(n_exp, np.uint8)
    args = hm.args_struct(d=d, f=f, n_used=n_used, gate_type=gate.ggml_type, up_type=up.ggml_type,
                          down_type=down.ggml_type, gate=gate.pointers(), up=up.pointers(), down=down.pointers(),
                          skip=skip, n_rows=n_rows, ids=ids, wts=wts, x=x, out=out)
    want = hm.host_moe_layer(x, ids, wts, gate, up, down, skip)
    args.stacks = (gate, up, down)                     # the tables point into their bytes
    return args, out, want


def _wait(pred, what, timeout_s=10.0):
    import time
    t = time.monotonic()
    while not pred():
        assert time.monotonic() - t < timeout_s, f"the bell did not serve {what} in {timeout_s} s"
        time.sleep(0.0005)


def test_the_bell_serves_each_posted_job_once_in_any_layer_order():
    """What the card does through host_post / host_take (kernels/moe.cu), played from Python: the
    job word BELL_WORD n + T in post[l] runs host_moe on the args of (l, T), and done[l] gets the same
    word once the sum is written; a word seen before is not served again; layers post in any
    order; after its idle spin the thread sleeps, and an arm wakes it."""
    rng = np.random.default_rng(5)
    post, done = np.zeros(4, np.int64), np.zeros(4, np.int64)
    bell = hm.Bell(4, 16, post, done)
    try:
        jobs = {(0, 1): _bell_layer(rng, 1), (0, 3): _bell_layer(rng, 3), (2, 2): _bell_layer(rng, 2),
                (0, 16): _bell_layer(rng, 16)}          # 16 rows: a captured step's most (sizes.DECODE_ROWS)
        for (layer, t), (args, _, _) in jobs.items():
            bell.set_args(layer, t, args)
        n = {0: 0, 2: 0}
        for layer, t in ((2, 2), (0, 1), (0, 16), (0, 3), (2, 2), (0, 16), (0, 1)):
            args, out, want = jobs[(layer, t)]
            out[:] = 7
            n[layer] += 1
            word = hm.BELL_WORD * n[layer] + t
            bell.arm(1)
            post[layer] = word
            _wait(lambda: done[layer] == word, f"layer {layer}'s job {word}")
            assert np.array_equal(out, want)
        assert bell.served == 7
        served = bell.served
        out = jobs[(0, 1)][1]
        out[:] = 7
        import time
        time.sleep(0.05)
        assert bell.served == served and (out == 7).all()          # nothing new posted, nothing run
        hm.set_spin_us(0)                                           # the thread sleeps at once now
        try:
            time.sleep(0.05)
            bell.arm(1)                                             # woken by the arm
            post[0] = hm.BELL_WORD * 10 + 1
            _wait(lambda: done[0] == hm.BELL_WORD * 10 + 1, "a job after the thread slept")
            assert np.array_equal(out, jobs[(0, 1)][2])
        finally:
            hm.set_spin_us(2000)
    finally:
        bell.close()


def test_the_bell_refuses_bad_sizes_by_name():
    post, done = np.zeros(4, np.int64), np.zeros(4, np.int64)
    with pytest.raises(ValueError, match="post must be int64 \\[3\\]"):
        hm.Bell(3, 8, post, done)
    with pytest.raises(ValueError, match="rows 64 must lie in 1 .. 63"):
        hm.Bell(4, 64, post, done)
    bell = hm.Bell(4, 8, post, done)
    try:
        with pytest.raises(ValueError, match="layer 4 of 4, rows 1"):
            bell.set_args(4, 1, None)
    finally:
        bell.close()
