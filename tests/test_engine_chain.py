"""Greedy steps chained behind the step launched ahead (core.Engine._chain_behind, model.decode_greedy_chain): the
step after the launched one goes out at once, its ids that step's picks on the device, so the device runs the two
back to back while the host reads the first's ids. A stand-in model plays the card: every launch computes its ids
at once (a chained one from the picks of the launch it follows) and writes the slots' positions, and handles must
be waited for in launch order; any other model call while a launched step is not waited for fails the test."""
from __future__ import annotations

import pytest

from bloomery.engine.core import Engine
from bloomery.engine.types import SamplingParams
from tests.test_engine_ahead import AheadBans
from tests.test_engine_core import drain, greq


class Chains(AheadBans):
    greedy_chain = True

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.flight: list = []      # launched handles not yet waited for, in launch order
        self.chained = 0

    def _idle(self, what: str) -> None:
        if self.flight:
            raise AssertionError(f"{what} while {len(self.flight)} launched step(s) are not waited for")

    def _hold(self, got):
        self.launched += 1
        model = self

        class Handle:
            picks = got

            def wait(self):
                if self in model.flight:
                    if model.flight[0] is not self:
                        raise AssertionError("a chained step waited for before the step it follows")
                    model.flight.remove(self)
                return got
        handle = Handle()
        self.flight.append(handle)
        return handle

    @property
    def in_flight(self):
        return self.flight[-1] if self.flight else None

    @in_flight.setter
    def in_flight(self, value):     # Ahead's constructor sets it
        pass

    def decode_greedy_chain(self, after, slots, positions, bans=None):
        if after not in self.flight:
            raise AssertionError("chained behind a step that is not in flight")
        if len(after.picks) != len(slots):
            raise AssertionError("chained behind a step of other rows")
        self.chained += 1
        return self._hold(self._banned_greedy(slots, after.picks, positions, bans, "chain"))


IGNORE_EOS = [(9, float("-inf")), (17, float("-inf"))]     # a bias that only bans ids, as ignore_eos's


def test_one_stream_runs_on_chained_steps_and_gives_the_reference_ids():
    model = Chains(1, 64)
    engine = Engine(model, 1, 64)
    engine.add(greq("a", [1, 2, 3], n_predict=12))
    outs = drain(engine)
    assert [o.token for o in outs["a"]] == model.reference([1, 2, 3], 12)
    # the prompt's pick, one step in place, one launched ahead, then every later step chained behind the one
    # before; none is made for an id past n_predict, so none is dropped
    assert [c[0] for c in model.calls] == ["prefill", "decode_greedy", "begin"] + ["chain"] * 9
    assert engine.chained_steps == 9 and engine.ahead_steps == 10 and engine.ahead_dropped == 0
    assert not model.flight


def test_bans_ride_along_the_chain():
    model = Chains(1, 64)
    engine = Engine(model, 1, 64)
    engine.add(greq("a", [5, 6], n_predict=10, sampling=SamplingParams(temperature=0.0, logit_bias=IGNORE_EOS)))
    outs = drain(engine)
    assert [o.token for o in outs["a"]] == model.banned_reference([5, 6], 10, [t for t, _ in IGNORE_EOS])
    chain_bans = {c[2] for c in model.calls if c[0] == "chain"}
    assert chain_bans and all(b is not None and set(b[0]) == {t for t, _ in IGNORE_EOS} for b in chain_bans)


def test_arrivals_and_cancels_drop_the_chained_step_and_every_stream_keeps_its_ids():
    model = Chains(3, 64)
    engine = Engine(model, 3, 64)
    prompts = {"a": [1, 2, 3], "b": [4, 5, 6, 7], "c": [9, 10], "d": [11, 12, 13]}
    n = {"a": 14, "b": 9, "c": 7, "d": 30}
    engine.add(greq("a", prompts["a"], n_predict=n["a"]))
    engine.add(greq("b", prompts["b"], n_predict=n["b"]))
    outs: dict = {}
    for i in range(300):
        if i == 4:
            assert model.flight, "a step chained behind the launched one"
            engine.add(greq("c", prompts["c"], n_predict=n["c"]))     # a prompt while two steps are on the device
        if i == 9:
            engine.add(greq("d", prompts["d"], n_predict=n["d"]))
        if i == 14:
            engine.cancel("d")
        if not engine.has_work():
            break
        for o in engine.step():
            outs.setdefault(o.req_id, []).append(o)
    for rid in "abc":
        assert [o.token for o in outs[rid]] == model.reference(prompts[rid], n[rid]), rid
    assert outs["d"][-1].finish == "cancel"
    assert [o.token for o in outs["d"] if o.token is not None] == model.reference(prompts["d"], 30)[:len(
        [o for o in outs["d"] if o.token is not None])]
    assert engine.chained_steps > 0 and engine.ahead_dropped >= 1
    assert not model.flight


def test_a_stop_id_drops_the_chained_step_and_the_slot_is_reused_cleanly():
    """A request ending on a stop id with a step chained behind: that step wrote two positions past what the slot
    keeps; a later prompt reusing the slot's prefix rewrites them and reads the reference ids."""
    model = Chains(1, 64)
    ref = model.reference([3, 1, 4], 12)
    k = next(i for i in range(4, 12) if ref[i] not in ref[:i])
    engine = Engine(model, 1, 64)
    engine.add(greq("a", [3, 1, 4], n_predict=50, stop_ids=(ref[k],)))
    out_a = drain(engine)["a"]
    assert [o.token for o in out_a] == ref[:k + 1] and out_a[-1].finish == "stop"
    assert engine.ahead_dropped >= 1 and not model.flight
    follow = [3, 1, 4] + ref[:k - 1] + [7, 7]
    engine.add(greq("b", follow, n_predict=6))
    out_b = drain(engine)["b"]
    assert out_b[0].n_cached > 0
    assert [o.token for o in out_b] == model.reference(follow, 6)


def test_settle_waits_for_both_steps_in_order_and_keeps_them():
    model = Chains(1, 64)
    engine = Engine(model, 1, 64)
    engine.add(greq("a", [1, 2, 3], n_predict=10))
    outs = []
    for _ in range(4):
        outs += engine.step()
    assert len(model.flight) == 2
    engine.settle()
    assert not model.flight
    outs += drain(engine)["a"]
    assert [o.token for o in outs] == model.reference([1, 2, 3], 10)
    assert engine.ahead_dropped == 0


@pytest.mark.parametrize("env", ["0", "1"])
def test_no_chain_where_the_model_does_not_chain(env, monkeypatch):
    """A model without greedy_chain is never asked; with it, the context's end stops the chain before the slot's
    last position."""
    if env == "0":
        model = AheadBans(1, 64)
        engine = Engine(model, 1, 64)
        engine.add(greq("a", [1, 2, 3], n_predict=8))
        assert [o.token for o in drain(engine)["a"]] == model.reference([1, 2, 3], 8)
        assert engine.chained_steps == 0
        return
    model = Chains(1, 16)
    engine = Engine(model, 1, 16)
    engine.add(greq("a", [1, 2, 3], n_predict=-1))
    outs = drain(engine)["a"]
    assert outs[-1].finish == "length"
    assert [o.token for o in outs] == model.reference([1, 2, 3], len(outs))
    # the stand-in's write fails a step past n_ctx_slot: the chain stopped before the slot's last position
    assert not model.flight and engine.chained_steps > 0


@pytest.mark.gpu
def test_on_the_card_chained_steps_give_the_ids_of_steps_run_in_place(gpu, tokenizer_source, synthetic_dir,
                                                                      monkeypatch):
    """A synthetic qwen3moe on the cuda backend, three greedy streams whose bias only bans ids (ignore_eos's, the
    ids the streams pick first, banned inside the captured step): the same ids with steps chained on the card
    as with every step run in place."""
    import numpy as np
    from bloomery.engine.models.base import CausalLM
    from tests.test_engine_ahead import _card_greedy, _card_moe
    model = _card_moe(synthetic_dir, tokenizer_source, "chain-qwen3moe.gguf", 13, 3)
    assert model.greedy_chain
    free, _ = _card_greedy(model, [])
    banned = sorted({t for ids in free.values() for t in ids[:3]})[:model.greedy_bans]
    bias = [(t, -np.inf) for t in banned]
    chained, engine = _card_greedy(model, bias)
    assert engine.chained_steps >= 10 and engine.top_steps == 0
    assert not {t for ids in chained.values() for t in ids} & set(banned)
    monkeypatch.setattr(CausalLM, "greedy_ahead", property(lambda self: False))
    in_place, engine = _card_greedy(model, bias)
    assert engine.ahead_steps == 0 and chained == in_place
