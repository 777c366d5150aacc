"""Greedy steps launched ahead (core.Engine._launch_ahead, model.decode_greedy_begin): when every slot of a step
goes on with a plain greedy pick, the next step is launched before the step's ids go out, and the next round takes
its ids when it decodes the same slots. A stand-in model plays the card: the launch writes the slots' next
positions at once, the ids are computed then and handed over by wait(), and any other model call while a
launched step is not waited for fails the test (nothing may touch the device under a step in flight)."""
from __future__ import annotations

import numpy as np
import pytest

from bloomery.engine.core import Engine
from bloomery.engine.types import SamplingParams
from tests.test_engine_core import PicksOnDevice, drain, greq


class Ahead(PicksOnDevice):
    greedy_ahead = True

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.in_flight = None
        self.launched = 0

    def _idle(self, what: str) -> None:
        if self.in_flight is not None:
            raise AssertionError(f"{what} while a launched step is not waited for")

    def prefill(self, slot, ids, pos0):
        self._idle("prefill")
        return super().prefill(slot, ids, pos0)

    def decode(self, slots, ids, positions):
        self._idle("decode")
        return super().decode(slots, ids, positions)

    def decode_greedy(self, slots, ids, positions):
        self._idle("decode_greedy")
        return super().decode_greedy(slots, ids, positions)

    def decode_greedy_begin(self, slots, ids, positions):
        self._idle("decode_greedy_begin")
        picks = PicksOnDevice.decode_greedy(self, slots, ids, positions)
        self.calls[-1] = ("begin", tuple(slots))
        return self._hold(picks)

    def _hold(self, got):
        """A launched step's handle: it is in flight until its wait() hands over got."""
        self.launched += 1
        model = self

        class Handle:
            def wait(self):
                if model.in_flight is self:
                    model.in_flight = None
                return got
        self.in_flight = Handle()
        return self.in_flight


class AheadTop(Ahead):
    """The stand-in card handing over each row's k largest logits too (decode_topk), also launched ahead."""
    topk_max = 16

    def decode_topk(self, slots, ids, positions, k):
        self._idle("decode_topk")
        return self._topk(slots, ids, positions, k, "decode_topk")

    def _topk(self, slots, ids, positions, k, name):
        from bloomery.engine.sampler import sorted_top
        self.calls.append((name, tuple(slots)))
        for s, i, p in zip(slots, ids, positions):
            self._write(s, [int(i)], int(p))
        rows = np.stack([self._logits(self.kv[s]) for s in slots])                       # [B, V]
        top = np.stack([sorted_top(r, k) for r in rows]).astype(np.int32)
        return top, np.take_along_axis(rows, top, axis=1), np.zeros(len(slots), np.int32)

    def decode_topk_begin(self, slots, ids, positions, k):
        self._idle("decode_topk_begin")
        return self._hold(self._topk(slots, ids, positions, k, "begin_topk"))

    def banned_reference(self, prompt, n: int, banned) -> list[int]:
        """Greedy ids from a fresh recomputation per step, never a banned id."""
        ids, out = list(prompt), []
        for _ in range(n):
            row = self._logits(ids)
            row[list(banned)] = -np.inf
            out.append(int(np.argmax(row)))
            ids.append(out[-1])
        return out


class AheadBans(AheadTop):
    """The stand-in card banning up to greedy_bans ids a row before its argmax (decode_greedy's bans, as the
    captured step's ban_ids kernel), launched ahead too."""
    greedy_bans = 4

    def _banned_greedy(self, slots, ids, positions, bans, name):
        self.calls.append((name, tuple(slots), None if bans is None else tuple(map(tuple, bans))))
        for s, i, p in zip(slots, ids, positions):
            self._write(s, [int(i)], int(p))
        out = []
        for b, s in enumerate(slots):
            row = self._logits(self.kv[s])
            if bans is not None:
                assert len(bans[b]) <= self.greedy_bans
                row[list(bans[b])] = -np.inf
            out.append(int(np.argmax(row)))
        return np.array(out, np.int32)

    def decode_greedy(self, slots, ids, positions, bans=None):
        self._idle("decode_greedy")
        return self._banned_greedy(slots, ids, positions, bans, "decode_greedy")

    def decode_greedy_begin(self, slots, ids, positions, bans=None):
        self._idle("decode_greedy_begin")
        return self._hold(self._banned_greedy(slots, ids, positions, bans, "begin"))


def run(model, n_slots, reqs, max_steps=500):
    engine = Engine(model, n_slots, 64)
    for r in reqs:
        engine.add(r)
    return engine, drain(engine, max_steps)


CARD_PROMPTS = {"a": [100, 200, 300, 400], "b": [500, 600], "c": [700, 800, 900]}


def _card_moe(synthetic_dir, tokenizer_source, name: str, seed: int, n_slots: int):
    """A small synthetic qwen3moe (2 layers, 16 experts, 4 a token) loaded whole on the cuda backend."""
    from bloomery.engine.loader import load_model
    from bloomery.placement import whole
    from tests.conftest import load_tool
    path = load_tool("make_synthetic").write_synthetic(synthetic_dir / name, arch="qwen3moe", mode="blocks",
                                                        mix="q4_k_m", seed=seed, tokenizer_from=str(tokenizer_source),
                                                        n_layer=2, n_embd=512, n_head=8, n_head_kv=2, head_dim=128,
                                                        n_expert=16, n_expert_used=4, n_ff_exp=256)
    return load_model(str(path), whole("cuda", n_slots, 256))


def _card_greedy(model, bias, engine_setup=lambda engine: None) -> tuple[dict, Engine]:
    """CARD_PROMPTS' three greedy streams of 16 ids under `bias` through an engine of 3 slots: their ids, the engine."""
    engine = Engine(model, 3, 256)
    engine_setup(engine)
    for rid, p in CARD_PROMPTS.items():
        engine.add(greq(rid, p, n_predict=16, sampling=SamplingParams(temperature=0.0, logit_bias=bias)))
    outs: dict = {}
    while engine.has_work():
        for o in engine.step():
            outs.setdefault(o.req_id, []).append(o.token)
    return outs, engine


def test_one_stream_takes_its_ids_from_the_steps_launched_ahead():
    model = Ahead(1, 64)
    engine, outs = run(model, 1, [greq("a", [1, 2, 3], n_predict=12)])
    assert [o.token for o in outs["a"]] == model.reference([1, 2, 3], 12)
    # the prompt's pick, one decode step run in place, then each later step launched at the end of the one before;
    # the last step (the 12th id ends the request) is not launched
    assert engine.ahead_steps == 10 and engine.ahead_dropped == 0 and model.launched == 10
    assert [c[0] for c in model.calls] == ["prefill", "decode_greedy"] + ["begin"] * 10


def test_several_streams_and_arrivals_give_the_reference_ids():
    model = Ahead(3, 64)
    engine = Engine(model, 3, 64)
    prompts = {"a": [1, 2, 3], "b": [4, 5, 6, 7], "c": [9, 10], "d": [11, 12, 13]}
    engine.add(greq("a", prompts["a"], n_predict=9))
    engine.add(greq("b", prompts["b"], n_predict=5))
    outs: dict = {}
    for i in range(200):
        if i == 3:
            engine.add(greq("c", prompts["c"], n_predict=7))    # admitted while a and b decode, a step launched
        if i == 6:
            engine.add(greq("d", prompts["d"], n_predict=4))
        if not engine.has_work():
            break
        for o in engine.step():
            outs.setdefault(o.req_id, []).append(o)
    n = {"a": 9, "b": 5, "c": 7, "d": 4}
    for rid, p in prompts.items():
        assert [o.token for o in outs[rid]] == model.reference(p, n[rid]), rid
    assert engine.ahead_steps > 0
    # no step is launched for a batch that a slot finishing its prompt is about to join, or after a last id
    assert engine.ahead_dropped == 0
    assert model.in_flight is None


def test_a_cancel_drops_the_launched_step_and_the_other_stream_goes_on():
    model = Ahead(2, 64)
    engine = Engine(model, 2, 64)
    engine.add(greq("a", [1, 2, 3], n_predict=20))
    engine.add(greq("b", [4, 5], n_predict=20))
    outs: dict = {}
    for _ in range(5):
        for o in engine.step():
            outs.setdefault(o.req_id, []).append(o)
    assert model.in_flight is not None                  # the next step of both is on the device
    engine.cancel("a")
    for rid, got in drain(engine).items():
        outs.setdefault(rid, []).extend(got)
    assert outs["a"][-1].finish == "cancel"
    assert [o.token for o in outs["b"]] == model.reference([4, 5], 20)
    assert engine.ahead_dropped >= 1


def test_a_request_ending_on_a_stop_id_launches_nothing_after_it():
    model = Ahead(1, 64)
    ref = model.reference([3, 1, 4], 12)
    k = next(i for i in range(3, 12) if ref[i] not in ref[:i])
    engine, outs = run(model, 1, [greq("a", [3, 1, 4], n_predict=50, stop_ids=(ref[k],))])
    assert [o.token for o in outs["a"]] == ref[:k + 1] and outs["a"][-1].finish == "stop"
    assert engine.ahead_dropped == 0 and model.launched == k - 1 and model.in_flight is None


def test_the_write_of_a_dropped_step_is_past_what_the_slot_keeps():
    """A cancel while a step is launched: that step wrote the slot's next position, which the slot does not count
    as held, so a later prompt reusing the slot's prefix rewrites it and reads the reference ids."""
    model = Ahead(1, 64)
    engine = Engine(model, 1, 64)
    engine.add(greq("a", [3, 1, 4], n_predict=50))
    got = []
    for _ in range(5):
        got += [o.token for o in engine.step()]
    assert model.in_flight is not None
    engine.cancel("a")
    drain(engine)
    follow = [3, 1, 4] + got + [7, 7]
    engine.add(greq("b", follow, n_predict=6))
    out_b = drain(engine)["b"]
    assert out_b[0].n_cached > 0
    assert [o.token for o in out_b] == model.reference(follow, 6)


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.0, n_probs=2),
                                      SamplingParams(temperature=0.8, seed=3)])
def test_nothing_is_launched_ahead_for_a_pick_that_needs_the_logits(sampling):
    model = Ahead(1, 64)
    engine, outs = run(model, 1, [greq("p", [1, 2], n_predict=6, sampling=sampling)])
    assert len(outs["p"]) == 6
    assert model.launched == 0 and engine.ahead_steps == 0


def test_settle_ends_the_launched_step_and_keeps_its_ids():
    model = Ahead(1, 64)
    engine = Engine(model, 1, 64)
    engine.add(greq("a", [1, 2, 3], n_predict=8))
    outs = []
    for _ in range(3):
        outs += engine.step()
    assert model.in_flight is not None
    engine.settle()
    assert model.in_flight is None
    outs += drain(engine)["a"]
    assert [o.token for o in outs] == model.reference([1, 2, 3], 8)
    assert engine.ahead_dropped == 0


def test_a_model_without_the_ability_is_never_asked():
    model = PicksOnDevice(1, 64)
    engine, outs = run(model, 1, [greq("a", [1, 2, 3], n_predict=6)])
    assert [o.token for o in outs["a"]] == model.reference([1, 2, 3], 6)
    assert engine.ahead_steps == 0 and not any(c[0] == "begin" for c in model.calls)


@pytest.mark.gpu
def test_on_the_card_the_launched_steps_give_the_ids_of_steps_run_in_place(gpu, tokenizer_source, synthetic_dir,
                                                                            monkeypatch):
    """A synthetic qwen3moe on the cuda backend, three greedy streams (two start together, one joins): the same ids
    with steps launched ahead as with every step run in place."""
    from bloomery.engine.models.base import CausalLM
    model = _card_moe(synthetic_dir, tokenizer_source, "ahead-qwen3moe.gguf", 11, 3)
    assert model.greedy_ahead

    def serve() -> tuple[dict, Engine]:
        engine = Engine(model, 3, 256)
        engine.add(greq("a", [100, 200, 300, 400], n_predict=24))
        engine.add(greq("b", [500, 600], n_predict=16))
        outs: dict = {}
        for i in range(400):
            if i == 5:
                engine.add(greq("c", [700, 800, 900], n_predict=12))
            if not engine.has_work():
                break
            for o in engine.step():
                outs.setdefault(o.req_id, []).append(o.token)
        return outs, engine

    ahead, engine = serve()
    assert engine.ahead_steps >= 15             # most of a's 23 steps after its first (19 on the H200)
    assert engine.chained_steps >= 10           # most of those chained behind the one before (model.greedy_chain)
    monkeypatch.setenv("BLOOMERY_GREEDY_CHAIN", "0")
    unchained, engine = serve()
    assert engine.ahead_steps >= 15 and engine.chained_steps == 0
    monkeypatch.setattr(CausalLM, "greedy_ahead", property(lambda self: False))
    in_place, engine = serve()
    assert engine.ahead_steps == 0
    assert ahead == in_place and unchained == in_place


@pytest.mark.gpu
def test_on_the_card_greedy_with_bans_picks_from_the_largest_logits(gpu, tokenizer_source, synthetic_dir,
                                                                    monkeypatch):
    """ignore_eos's bans (-inf biases) on a synthetic qwen3moe on the cuda backend: three greedy streams pick from
    each row's largest logits on the card (the top-k step, launched ahead), with the same ids as from whole rows
    on the host, and never a banned id, though the bans are the ids whole rows would pick first."""
    from bloomery.engine.models.base import CausalLM
    model = _card_moe(synthetic_dir, tokenizer_source, "bans-qwen3moe.gguf", 12, 3)
    monkeypatch.setattr(CausalLM, "greedy_bans", property(lambda self: 0))   # bans not in the greedy step itself

    def whole_rows_only(engine):
        engine.greedy_top_k = 0

    free, _ = _card_greedy(model, [])
    banned = sorted({t for ids in free.values() for t in ids[:4]})      # the ids the streams pick first
    bias = [(t, -np.inf) for t in banned]
    whole_rows, _ = _card_greedy(model, bias, whole_rows_only)
    top, engine = _card_greedy(model, bias)
    assert top == whole_rows
    assert not {t for ids in top.values() for t in ids} & set(banned)
    assert engine.top_steps > 0 and engine.top_misses == 0
    assert engine.ahead_steps > 0                  # the largest logits launched ahead (graph.begin_topk)


def test_greedy_with_bans_launches_the_largest_logits_ahead():
    """Two streams whose bias only bans ids (as ignore_eos's), the ids the plain chain picks first among them: the
    next step's rows' largest logits are launched ahead (decode_topk_begin, one more than the bans), each pick
    the first not banned, the ids those of a recomputation that never picks a banned id; a plain greedy stream
    beside them goes the same way."""
    model = AheadTop(3, 64)
    banned = sorted(set(model.reference([1, 2, 3], 6)[:3]) | set(model.reference([4, 5], 6)[:2]))
    bias = SamplingParams(temperature=0.0, logit_bias=[(t, -np.inf) for t in banned])
    engine, outs = run(model, 3, [greq("a", [1, 2, 3], n_predict=10, sampling=bias),
                                  greq("b", [4, 5], n_predict=8, sampling=bias), greq("c", [6, 7], n_predict=9)])
    assert [o.token for o in outs["a"]] == model.banned_reference([1, 2, 3], 10, banned)
    assert [o.token for o in outs["b"]] == model.banned_reference([4, 5], 8, banned)
    assert [o.token for o in outs["c"]] == model.reference([6, 7], 9)
    assert engine.ahead_steps >= 5 and engine.top_misses == 0
    assert {c[0] for c in model.calls} >= {"begin_topk"} and "begin" not in {c[0] for c in model.calls}
    assert not any(c[0] == "decode" for c in model.calls)          # no whole rows


def test_a_finite_bias_is_not_launched_ahead():
    model = AheadTop(1, 64)
    bias = SamplingParams(temperature=0.0, logit_bias=[(5, -np.inf), (9, 1.5)])
    engine, outs = run(model, 1, [greq("a", [1, 2, 3], n_predict=8, sampling=bias)])
    assert engine.ahead_steps == 0 and not any(c[0].startswith("begin") for c in model.calls)



def test_greedy_with_bans_picks_on_the_device_when_the_model_bans_there():
    """A model that bans ids before its argmax (greedy_bans): ignore_eos-like bans go with the greedy step itself,
    launched ahead, never through the largest logits or whole rows; the ids those of a recomputation that never
    picks a banned id, a plain stream beside them unchanged (its row bans nothing)."""
    model = AheadBans(3, 64)
    banned = sorted(set(model.reference([1, 2, 3], 6)[:2]) | set(model.reference([4, 5], 6)[:2]))
    assert len(banned) <= model.greedy_bans
    bias = SamplingParams(temperature=0.0, logit_bias=[(t, -np.inf) for t in banned])
    engine, outs = run(model, 3, [greq("a", [1, 2, 3], n_predict=10, sampling=bias),
                                  greq("b", [4, 5], n_predict=8, sampling=bias), greq("c", [6, 7], n_predict=9)])
    assert [o.token for o in outs["a"]] == model.banned_reference([1, 2, 3], 10, banned)
    assert [o.token for o in outs["b"]] == model.banned_reference([4, 5], 8, banned)
    assert [o.token for o in outs["c"]] == model.reference([6, 7], 9)
    assert engine.ahead_steps >= 5 and engine.top_steps == 0
    names = {c[0] for c in model.calls}
    assert "begin" in names and not names & {"begin_topk", "decode_topk", "decode"}
    for c in model.calls:
        if c[0] in ("begin", "decode_greedy") and c[2] is not None:     # a step with the banning slots in it
            assert all(row in (tuple(banned), ()) for row in c[2])
    # steps of the three together: the plain stream's row bans nothing
    assert any(c[2] is not None and sorted(c[2]) == [(), tuple(banned), tuple(banned)] for c in model.calls
               if c[0] == "begin")


def test_more_bans_than_the_model_takes_go_through_the_largest_logits():
    model = AheadBans(1, 64)
    banned = list(range(20, 20 + model.greedy_bans + 1))
    bias = SamplingParams(temperature=0.0, logit_bias=[(t, -np.inf) for t in banned])
    engine, outs = run(model, 1, [greq("a", [1, 2, 3], n_predict=8, sampling=bias)])
    assert [o.token for o in outs["a"]] == model.banned_reference([1, 2, 3], 8, banned)
    assert engine.top_steps > 0 and "begin_topk" in {c[0] for c in model.calls}
    assert not any(c[0] in ("begin", "decode_greedy") for c in model.calls)


def _banned_greedy_checks(model, n_rows: int) -> None:
    """decode_greedy with bans against decode()'s rows with those ids at -inf, on slots 0 .. n_rows-1 (each holding
    a prompt): the bans are each row's own argmax and the next two largest, so the pick must move."""
    rng = np.random.default_rng(3)
    slots = list(range(n_rows))
    for s in slots:
        model.prefill(s, rng.integers(100, 5000, 5 + s).astype(np.int32), 0)
    ids = rng.integers(100, 5000, n_rows).astype(np.int32)
    positions = np.array([5 + s for s in slots], np.int32)
    rows = np.asarray(model.decode(slots, ids, positions), np.float32)                       # [B, V]
    bans = [tuple(int(i) for i in np.argsort(-r, kind="stable")[:3]) if b % 2 == 0 else () for b, r in enumerate(rows)]
    want = []
    for r, ban in zip(rows, bans):
        r = r.copy()
        r[list(ban)] = -np.inf
        want.append(int(np.argmax(r)))
    assert [int(t) for t in model.decode_greedy(slots, ids, positions, bans=bans)] == want
    assert [int(t) for t in model.decode_greedy(slots, ids, positions)] == [int(np.argmax(r)) for r in rows]
    handle = model.decode_greedy_begin(slots, ids, positions, bans=bans)
    if handle is not None:
        assert [int(t) for t in handle.wait()] == want
    with pytest.raises(Exception, match="bans at most"):
        model.decode_greedy(slots, ids, positions, bans=[tuple(range(model.greedy_bans + 1))] * n_rows)


def test_the_greedy_step_bans_ids_on_the_numpy_backend_when_it_takes_bans(tokenizer_source, synthetic_dir):
    """models/base._step's uncaptured path with bans (head, ops.ban, argmax), on the numpy backend given the
    capability (its own caps take none: its fused head picks without whole rows)."""
    import dataclasses
    from bloomery.engine.loader import load_model
    from bloomery.placement import whole
    from tests.conftest import load_tool
    path = load_tool("make_synthetic").write_synthetic(synthetic_dir / "bans-qwen3.gguf", arch="qwen3", mode="blocks",
                                                        mix="q4_k_m", seed=6, tokenizer_from=str(tokenizer_source),
                                                        n_layer=2, n_embd=256, n_head=4, n_head_kv=2, head_dim=64,
                                                        n_ff=512)
    model = load_model(str(path), whole("numpy", 3, 64))
    assert model.greedy_bans == 0
    model.ops.caps = dataclasses.replace(model.ops.caps, greedy_bans=4)
    _banned_greedy_checks(model, 3)


@pytest.mark.gpu
@pytest.mark.parametrize("n_rows", [3, 11])           # one captured step; two (8 + 3 rows)
def test_on_the_card_the_greedy_step_bans_ids_itself(gpu, tokenizer_source, synthetic_dir, n_rows):
    """The captured step's ban_ids before its argmax (graph.py, the graph's ban rows), on a synthetic qwen3moe: the
    argmax of decode()'s rows with the bans at -inf, launched or not; then three engine streams under bans pick
    with the greedy step itself (no largest logits, no whole rows), launched ahead, the ids of whole rows'."""
    model = _card_moe(synthetic_dir, tokenizer_source, "devbans-qwen3moe.gguf", 13, n_rows)
    assert model.greedy_bans == 8
    _banned_greedy_checks(model, n_rows)

    def whole_rows_only(engine):                    # whole rows on the host
        engine.greedy_top_k = 0
        engine._device_bans = lambda slots: None

    free, _ = _card_greedy(model, [])
    banned = sorted({t for ids in free.values() for t in ids[:2]})[:8]
    bias = [(t, -np.inf) for t in banned]
    whole_rows, _ = _card_greedy(model, bias, whole_rows_only)
    on_card, engine = _card_greedy(model, bias)
    assert on_card == whole_rows
    assert not {t for ids in on_card.values() for t in ids} & set(banned)
    assert engine.top_steps == 0 and engine.ahead_steps > 0


def test_host_experts_keep_steps_in_place_unless_offload_ahead_is_asked(monkeypatch):
    """greedy_ahead: a model whose routed experts are partly on the host launches no step ahead (its residency runs
    between steps) unless BLOOMERY_OFFLOAD_AHEAD=1, which the card's measurement turns on; a model without host
    experts launches ahead unless BLOOMERY_GREEDY_AHEAD=0."""
    from types import SimpleNamespace
    from bloomery.engine.models.base import CausalLM

    def model(offload):
        m = object.__new__(CausalLM)
        m.ops = SimpleNamespace(offload=offload, caps=SimpleNamespace(decode_graphs=True),
                                decode_runner=lambda _m: "graphs")
        return m
    monkeypatch.delenv("BLOOMERY_OFFLOAD_AHEAD", raising=False)
    monkeypatch.delenv("BLOOMERY_GREEDY_AHEAD", raising=False)
    assert model(None).greedy_ahead and not model(object()).greedy_ahead
    monkeypatch.setenv("BLOOMERY_OFFLOAD_AHEAD", "1")
    assert model(object()).greedy_ahead
    monkeypatch.setenv("BLOOMERY_GREEDY_AHEAD", "0")
    assert not model(object()).greedy_ahead and not model(None).greedy_ahead
