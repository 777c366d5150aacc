"""Engine and InProcessEngineClient on a small deterministic stand-in model.

StandInModel keeps a real per-slot id cache (its "KV") and computes each
position's logits from every id before it with fixed random matrices, so wrong
positions, a stale prefix or mixed-up slots change the ids the engine picks.
"""
from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from bloomery.engine.core import Engine
from bloomery.engine.inproc import InProcessEngineClient
from bloomery.engine.model_api import EngineModel
from bloomery.engine.scheduler import QueueFullError
from bloomery.engine.types import EngineRequest, ModelInfo, SamplingParams

V, D, POISON = 64, 16, 63   # POISON: an id the stand-in refuses, to raise inside the model
GREEDY = SamplingParams(temperature=0.0)


class StandInModel(EngineModel):
    """A model of no optional ability: whole rows of logits from decode(), picked by the sampler."""

    def __init__(self, n_slots: int, n_ctx_slot: int, delay_s: float = 0.0):
        rng = np.random.default_rng(0)
        self.emb = rng.normal(size=(V, D)).astype(np.float32)      # [V, D]
        self.out = rng.normal(size=(D, V)).astype(np.float32)      # [D, V]
        self.n_vocab, self.n_ctx_train, self.arch = V, n_ctx_slot, "standin"
        self.kv = [[] for _ in range(n_slots)]                      # ids by position, per slot
        self.n_ctx_slot, self.delay_s = n_ctx_slot, delay_s
        self.calls: list[tuple] = []

    def _write(self, slot: int, ids, pos0: int) -> None:
        if pos0 > len(self.kv[slot]):
            raise AssertionError(f"slot {slot}: write at {pos0} leaves a hole after {len(self.kv[slot])}")
        if pos0 + len(ids) > self.n_ctx_slot:
            raise AssertionError(f"slot {slot}: position {pos0 + len(ids) - 1} past n_ctx_slot")
        if POISON in ids:
            raise RuntimeError(f"poisoned id {POISON} in slot {slot}")
        del self.kv[slot][pos0:]
        self.kv[slot].extend(int(i) for i in ids)

    def _logits(self, history: list[int]) -> np.ndarray:
        h = self.emb[history]                                        # [T, D]
        w = np.arange(1, len(history) + 1, dtype=np.float32)[:, None]
        state = (h * w).sum(0) / w.sum() + h[-1]                     # [D] order- and position-aware
        logits = np.tanh(state) @ self.out * 3.0                     # [V]
        logits[POISON] -= 100.0   # never chosen unless a request biases it in
        return logits

    def prefill(self, slot, ids, pos0):
        self.calls.append(("prefill", slot, len(ids), pos0))
        time.sleep(self.delay_s)
        self._write(slot, list(ids), pos0)
        return self._logits(self.kv[slot])

    def decode(self, slots, ids, positions):
        self.calls.append(("decode", tuple(slots)))
        time.sleep(self.delay_s)
        for s, i, p in zip(slots, ids, positions):
            self._write(s, [int(i)], int(p))
        return np.stack([self._logits(self.kv[s]) for s in slots])   # [B, V]

    def reference(self, prompt, n: int) -> list[int]:
        """Greedy ids from a fresh full recomputation per step (no cache bookkeeping)."""
        ids, out = list(prompt), []
        for _ in range(n):
            out.append(int(np.argmax(self._logits(ids))))
            ids.append(out[-1])
        return out


def make(n_slots=2, n_ctx_slot=64, **kw):
    model = StandInModel(n_slots, n_ctx_slot, **kw)
    return model, Engine(model, n_slots, n_ctx_slot)


def drain(engine, max_steps=500):
    outs = {}
    for _ in range(max_steps):
        if not engine.has_work():
            return outs
        for o in engine.step():
            outs.setdefault(o.req_id, []).append(o)
    raise AssertionError("engine did not finish")


def greq(rid, prompt, n_predict=6, **kw):
    return EngineRequest(rid, tuple(prompt), n_predict, sampling=kw.pop("sampling", GREEDY), **kw)


# -- the engine ------------------------------------------------------------------
def test_greedy_ids_equal_a_fresh_recomputation_three_requests_two_slots():
    model, engine = make()
    prompts = {"a": [1, 2, 3], "b": [4, 5, 6, 7, 8], "c": [9, 10]}
    for rid, p in prompts.items():
        engine.add(greq(rid, p))
    outs = drain(engine)
    for rid, p in prompts.items():
        assert [o.token for o in outs[rid]] == model.reference(p, 6)
        assert [o.finish for o in outs[rid]] == [None] * 5 + ["length"]
        assert outs[rid][0].n_prompt == len(p) and outs[rid][0].prompt_ms > 0
    decodes = [c for c in model.calls if c[0] == "decode"]
    assert any(len(c[1]) == 2 for c in decodes)      # two slots went in one batched call
    assert sum(c[0] == "prefill" for c in model.calls) == 3


def test_prefix_reuse_gives_the_same_ids_and_counts_cached():
    model, engine = make(n_slots=1)
    engine.add(greq("a", [1, 2, 3, 4, 5]))
    drain(engine)
    engine.add(greq("b", [1, 2, 3, 4, 9, 9]))
    out = drain(engine)["b"]
    assert out[0].n_cached == 4 and out[0].n_prompt == 6
    assert model.calls[-6] == ("prefill", 0, 2, 4)    # only the uncached part, from position 4
    assert [o.token for o in out] == model.reference([1, 2, 3, 4, 9, 9], 6)
    engine.add(greq("c", [1, 2, 3, 4, 9, 9], cache_prompt=False))
    out_c = drain(engine)["c"]
    assert out_c[0].n_cached == 0 and [o.token for o in out_c] == [o.token for o in out]


def test_stop_id_is_reported_with_finish_stop():
    model, engine = make()
    ref = model.reference([3, 1, 4], 6)
    engine.add(greq("a", [3, 1, 4], n_predict=50, stop_ids=(ref[2],)))
    out = drain(engine)["a"]
    assert [o.token for o in out] == ref[:3] and out[-1].finish == "stop"


def test_full_slot_finishes_with_length():
    model, engine = make(n_slots=1, n_ctx_slot=10)
    engine.add(greq("a", [1, 2, 3, 4, 5, 6, 7], n_predict=-1))
    out = drain(engine)["a"]
    assert len(out) == 3 and out[-1].finish == "length"      # prompt 7 + 3 sampled = n_ctx_slot
    assert max(len(kv) for kv in model.kv) <= 10


def test_n_predict_zero_still_samples_one_id_as_llama_server():
    _, engine = make()
    engine.add(greq("a", [1, 2], n_predict=0))
    out = drain(engine)["a"]
    assert len(out) == 1 and out[0].finish == "length" and out[0].token is not None


def test_cancel_running_and_queued():
    _, engine = make(n_slots=1)
    engine.add(greq("a", [1, 2], n_predict=100))
    engine.add(greq("b", [1, 2], n_predict=100))
    engine.step()
    engine.step()
    engine.cancel("a")
    engine.cancel("b")
    outs = engine.step()
    assert {(o.req_id, o.token, o.finish) for o in outs} == {("a", None, "cancel"), ("b", None, "cancel")}
    assert not engine.has_work() and not engine.slots()[0]["is_processing"]


def test_every_output_names_the_slot_that_ran_it():
    _, engine = make(n_slots=2)
    for rid in ("a", "b", "c"):
        engine.add(greq(rid, [1, 2, 3], n_predict=3))
    engine.add(greq("queued", [4, 5], n_predict=3))
    engine.cancel("queued")          # cancelled while waiting: no slot ever ran it
    outs = drain(engine)
    slot_of = {rid: {o.slot for o in got} for rid, got in outs.items()}
    assert slot_of["queued"] == {-1}
    assert slot_of["a"] != slot_of["b"] and slot_of["a"] | slot_of["b"] == {0, 1}
    assert len(slot_of["c"]) == 1 and slot_of["c"] <= {0, 1}       # c waited, then one slot ran all of it


def test_slots_table_reports_the_last_request_of_each_slot():
    _, engine = make(n_slots=2)
    assert engine.slots() == [{"id": i, "n_ctx": 64, "speculative": False, "is_processing": False}
                              for i in (0, 1)]                     # nothing ran yet: no task keys
    engine.add(greq("a", [1, 2, 3, 4], n_predict=5, id_task=7))
    engine.step()                                                   # prefill + first id
    ran = [e for e in engine.slots() if "id_task" in e]
    assert len(ran) == 1
    k, running = ran[0]["id"], ran[0]
    assert running["is_processing"] and running["id_task"] == 7 and running["req_id"] == "a"
    assert running["next_token"] == [{"has_next_token": True, "n_remain": 4, "n_decoded": 1}]
    drain(engine)
    engine.add(greq("b", [1, 2, 3, 9], n_predict=-1, id_task=8))   # shares 3 ids with a: a's slot
    engine.step()
    engine.cancel("b")
    drain(engine)
    done = engine.slots()[k]
    assert (done["is_processing"], done["id_task"], done["n_prompt_tokens"], done["n_prompt_tokens_cache"],
            done["n_prompt_tokens_processed"]) == (False, 8, 4, 3, 1)
    assert done["next_token"] == [{"has_next_token": False, "n_remain": -1, "n_decoded": 1}]
    assert "id_task" not in engine.slots()[1 - k]


def test_model_error_fails_only_that_request():
    model, engine = make()
    engine.add(greq("bad", [1, POISON]))
    engine.add(greq("good", [1, 2]))
    outs = drain(engine)
    assert outs["bad"][-1].finish == "error" and "poisoned id 63" in outs["bad"][-1].error
    assert outs["bad"][-1].token is None
    assert [o.token for o in outs["good"]] == model.reference([1, 2], 6)


def test_decode_error_in_a_batch_fails_only_that_request():
    model, engine = make()
    poison_first = SamplingParams(temperature=0.0, logit_bias=((POISON, 1000.0),))
    engine.add(greq("bad", [1, 2], sampling=poison_first))   # its first id poisons the next decode
    engine.add(greq("good", [5, 6]))
    outs = drain(engine)
    assert outs["bad"][0].token == POISON and outs["bad"][-1].finish == "error"
    assert [o.token for o in outs["good"]] == model.reference([5, 6], 6)


def test_sampler_refusal_is_a_named_error():
    _, engine = make()
    engine.add(greq("a", [1], sampling=SamplingParams(repeat_penalty=0.0)))
    out = drain(engine)["a"]
    assert out[-1].finish == "error" and "penalty_repeat must be finite" in out[-1].error


def test_n_probs_and_seeded_sampling_through_the_engine():
    _, engine = make()
    sp = SamplingParams(temperature=1.0, seed=1234, n_probs=3)
    engine.add(greq("a", [1, 2, 3], sampling=sp))
    engine.add(greq("b", [1, 2, 3], sampling=sp))
    outs = drain(engine)
    assert [o.token for o in outs["a"]] == [o.token for o in outs["b"]]
    for o in outs["a"]:
        assert len(o.top) == 3 and o.logprob <= 0.0 and o.top[0].prob >= o.top[1].prob


def test_queue_full_is_refused_at_add():
    model = StandInModel(1, 32)
    engine = Engine(model, 1, 32, max_queue=0)
    engine.add(greq("a", [1]))
    with pytest.raises(QueueFullError, match="max_queue=0"):
        engine.add(greq("b", [1]))


# -- the in-process client ----------------------------------------------------------
INFO = ModelInfo(name="standin", arch="standin", n_ctx=128, n_ctx_slot=64, n_slots=2,
                 n_vocab=V, n_ctx_train=64, backend="numpy", model_path="-")


async def collect(client, req):
    return [o async for o in client.generate(req)]


def test_concurrent_requests_on_two_slots():
    model, engine = make(delay_s=0.002)
    client = InProcessEngineClient(engine, INFO)
    prompts = {f"r{i}": [i + 1, i + 2, i + 3] for i in range(5)}

    async def main():
        return await asyncio.gather(*(collect(client, greq(r, p)) for r, p in prompts.items()))
    try:
        results = asyncio.run(main())
    finally:
        client.close()
    for (rid, p), outs in zip(prompts.items(), results):
        assert [o.token for o in outs] == model.reference(p, 6) and outs[-1].finish == "length"
    slots = client.slots()
    assert [(e["id"], e["n_ctx"], e["is_processing"]) for e in slots] == [(0, 64, False), (1, 64, False)]
    assert {e["req_id"] for e in slots} <= set(prompts) and len({e["req_id"] for e in slots}) == 2


def test_leaving_early_cancels_and_frees_the_slot():
    model, engine = make(n_slots=1, n_ctx_slot=4096, delay_s=0.002)
    client = InProcessEngineClient(engine, INFO)

    async def main():
        gen = client.generate(greq("long", [1, 2], n_predict=10_000))
        first = await gen.__anext__()
        await gen.aclose()
        for _ in range(200):   # the cancel lands within a few steps
            if not client.slots()[0]["is_processing"]:
                break
            await asyncio.sleep(0.01)
        n_kv_after_cancel = len(model.kv[0])
        follow = await asyncio.wait_for(collect(client, greq("next", [3, 4], n_predict=3)), 10)
        return first, n_kv_after_cancel, follow
    try:
        first, n_kv_after_cancel, follow = asyncio.run(main())
    finally:
        client.close()
    assert first.token is not None and len(follow) == 3
    assert n_kv_after_cancel < 100       # "long" stopped far before its n_predict
    assert not engine.has_work()


def test_refusal_raises_from_generate():
    model = StandInModel(1, 8)
    client = InProcessEngineClient(Engine(model, 1, 8), INFO)
    try:
        with pytest.raises(ValueError, match="n_ctx_slot=8"):
            asyncio.run(collect(client, greq("a", range(8))))
    finally:
        client.close()


def test_idle_worker_does_not_spin():
    model, engine = make()
    n_steps, n_polls = [], []
    real_step, real_has_work = engine.step, engine.has_work
    engine.step = lambda: n_steps.append(1) or real_step()   # count calls of the real methods
    engine.has_work = lambda: n_polls.append(1) or real_has_work()
    client = InProcessEngineClient(engine, INFO)
    try:
        asyncio.run(collect(client, greq("a", [1, 2], n_predict=3)))
        settled, polls = len(n_steps), len(n_polls)
        cpu0 = time.process_time()      # every thread of this process
        time.sleep(0.3)
        assert time.process_time() - cpu0 < 0.1   # a polling worker would burn the 0.3 s
        assert len(n_steps) == settled and settled <= 4
        assert len(n_polls) - polls <= 1            # asleep on the condition, not polling
        assert any(t.name == "bloomery-engine" for t in threading.enumerate())
    finally:
        client.close()


# -- end to end on a tiny synthetic qwen2 file through the real loader ---------------------
@pytest.mark.real_model   # the synthetic file copies the real file's tokenizer keys
def test_engine_on_synthetic_qwen2_matches_full_recomputation(real_model_path, synthetic_dir):
    from bloomery.engine.loader import load_model
    from bloomery.placement import whole
    from conftest import load_tool
    path = synthetic_dir / "core_qwen2.gguf"
    if not path.exists():
        load_tool("make_synthetic").write_synthetic(path, "qwen2", tokenizer_from=str(real_model_path))
    model = load_model(str(path), whole("numpy", n_slots=2, n_ctx_slot=48))
    engine = Engine(model, 2, 48)
    prompts = {"a": [151644, 872, 198, 9707], "b": [151644, 872, 198, 3838, 374], "c": [9707, 11, 1879]}
    for rid, p in prompts.items():
        engine.add(greq(rid, p, n_predict=5))
    outs = drain(engine)
    ref_model = load_model(str(path), whole("numpy", n_slots=1, n_ctx_slot=48))
    def reference(p):
        ids, ref = list(p), []
        for _ in range(5):   # every position recomputed from scratch: no cache bookkeeping
            ref.append(int(np.argmax(ref_model.forward_all(0, np.array(ids, dtype=np.int32), 0)[-1])))
            ids.append(ref[-1])
        return ref
    for rid, p in prompts.items():
        assert [o.token for o in outs[rid]] == reference(p), rid
    # a's slot holds a's prompt and its ids: a follow-up sharing that prefix reuses it
    d = prompts["a"] + [outs["a"][0].token, 11]
    engine.add(greq("d", d, n_predict=5))
    out_d = drain(engine)["d"]
    assert out_d[0].n_cached == 5 and [o.token for o in out_d] == reference(d)


class PicksOnDevice(StandInModel):
    """A model with decode_greedy (a backend that picks on its card): the engine must use it
    for plain greedy batches and fall back to decode() + the sampler otherwise."""
    picks_on_device = True

    def decode_greedy(self, slots, ids, positions):
        self.calls.append(("decode_greedy", tuple(slots)))
        for s, i, p in zip(slots, ids, positions):
            self._write(s, [int(i)], int(p))
        return np.array([int(np.argmax(self._logits(self.kv[s]))) for s in slots], np.int32)


def greedy_run(model, n_slots: int, prompt, n: int) -> Engine:
    """One greedy request on a fresh engine over model, its ids checked against the reference."""
    engine = Engine(model, n_slots, 64)
    engine.add(greq("g", prompt, n_predict=n))
    assert [o.token for o in drain(engine)["g"]] == model.reference(prompt, n)
    return engine


def test_plain_greedy_batches_take_only_ids_from_the_model():
    model = PicksOnDevice(2, 64)
    engine = greedy_run(model, 2, [1, 2, 3], 5)
    assert {c[0] for c in model.calls} == {"prefill", "decode_greedy"}
    model.calls.clear()
    # asking for probabilities needs the logits on the host: a batch with such a request decodes
    engine.add(greq("p", [4, 5], n_predict=5, sampling=SamplingParams(temperature=0.0, n_probs=2)))
    engine.add(greq("g2", [1, 2, 3], n_predict=5))
    outs = drain(engine)
    assert [o.token for o in outs["p"]] == model.reference([4, 5], 5)
    assert [o.token for o in outs["g2"]] == model.reference([1, 2, 3], 5)
    assert "decode" in {c[0] for c in model.calls}
    assert all(o.top for o in outs["p"]) and not any(o.top for o in outs["g2"])


class HandsOverTopK(StandInModel):
    """A model with decode_topk (a backend that keeps the logits on its card and hands over a
    row's k largest): the engine must use it for sampled batches whose chain needs no more."""
    topk_max = 16

    def decode_topk(self, slots, ids, positions, k):
        from bloomery.engine.sampler import sorted_top
        self.calls.append(("decode_topk", tuple(slots), k))
        rows = StandInModel.decode(self, slots, ids, positions)
        self.calls.pop()
        order = np.stack([sorted_top(r, k) for r in rows])
        vals = np.take_along_axis(rows, order, 1)
        return order.astype(np.int32), vals.astype(np.float32), np.zeros(len(slots), np.int32)


@pytest.mark.parametrize("params", [dict(top_k=8, top_p=0.9, min_p=0.05), dict(top_k=16, top_p=1.0, min_p=0.0),
                                    dict(top_k=3, top_p=0.5, min_p=0.2, temperature=1.5)])
def test_sampled_batches_take_only_the_top_k_from_the_model(params):
    """Seeded sampled requests draw the same ids from the top_k the model hands over as from the
    whole rows; a request the top_k cannot serve (penalties, more than the model's topk_max)
    makes its batch decode whole rows."""
    sampling = SamplingParams(**{"temperature": 0.8, **params, "seed": 7})
    runs = {}
    for cls in (StandInModel, HandsOverTopK):
        model = cls(2, 64)
        engine = Engine(model, 2, 64)
        engine.add(greq("a", [1, 2, 3], n_predict=12, sampling=sampling))
        engine.add(greq("b", [4, 5], n_predict=12, sampling=SamplingParams(**{**sampling.__dict__, "seed": 9})))
        runs[cls] = ({r: [o.token for o in v] for r, v in drain(engine).items()}, model.calls)
    assert runs[HandsOverTopK][0] == runs[StandInModel][0]
    kinds = {c[0] for c in runs[HandsOverTopK][1]}
    assert kinds == {"prefill", "decode_topk"}, kinds
    for extra in (dict(repeat_penalty=1.1), dict(top_k=17), dict(top_k=0)):
        model = HandsOverTopK(1, 64)
        engine = Engine(model, 1, 64)
        engine.add(greq("c", [1, 2, 3], n_predict=4, sampling=SamplingParams(**{**sampling.__dict__, **extra})))
        drain(engine)
        assert {c[0] for c in model.calls} == {"prefill", "decode"}, extra


def test_a_nan_in_the_top_k_path_fails_that_request_by_name():
    class NaNs(HandsOverTopK):
        def decode_topk(self, slots, ids, positions, k):
            i, v, _ = super().decode_topk(slots, ids, positions, k)
            return i, v, np.full(len(slots), 3, np.int32)
    engine = Engine(NaNs(1, 64), 1, 64)
    engine.add(greq("x", [1, 2], n_predict=4, sampling=SamplingParams(temperature=0.8, top_k=5, seed=1)))
    outs = drain(engine)
    assert outs["x"][-1].finish == "error" and "NaN" in outs["x"][-1].error


def test_the_engine_reads_the_declared_abilities_and_probes_for_none():
    """A decode_greedy the model does not declare (picks_on_device False) is never called: the
    batch goes through decode() and the sampler; calling an undeclared ability names the
    declaration; a model without the contract is refused by name."""
    class Undeclared(PicksOnDevice):
        picks_on_device = False
    model = Undeclared(1, 64)
    greedy_run(model, 1, [1, 2, 3], 4)
    assert {c[0] for c in model.calls} == {"prefill", "decode"}
    with pytest.raises(NotImplementedError, match="no decode_greedy: it declares picks_on_device = False"):
        StandInModel(1, 64).decode_greedy([0], [1], [0])
    with pytest.raises(NotImplementedError, match="no decode_topk: it declares topk_max = 0"):
        StandInModel(1, 64).decode_topk([0], [1], [0], 4)
    with pytest.raises(TypeError, match="the engine runs an EngineModel .* not a SimpleNamespace"):
        Engine(SimpleNamespace(n_vocab=V, prefill=None, decode=None), 1, 64)


def test_a_greedy_pick_outside_the_vocabulary_fails_that_request_by_name():
    class Broken(PicksOnDevice):
        def decode_greedy(self, slots, ids, positions):
            super().decode_greedy(slots, ids, positions)
            return np.full(len(slots), 2**31 - 1, np.int32)          # what an all-NaN argmax gives
    engine = Engine(Broken(1, 64), 1, 64)
    engine.add(greq("x", [1, 2], n_predict=4))
    outs = drain(engine)
    assert outs["x"][-1].finish == "error" and "not a token id" in outs["x"][-1].error


def test_return_progress_runs_the_prompt_in_batches_and_reports_each():
    model = StandInModel(1, 64)
    engine = Engine(model, 1, 64, n_batch=4)
    prompt = list(range(1, 11))
    engine.add(greq("p", prompt, return_progress=True))
    outs = drain(engine)["p"]
    progress = [o for o in outs if o.is_progress]
    assert [o.n_processed for o in progress] == [0, 4, 8, 10]          # before the first pass, then after each
    assert all(o.token is None and o.finish is None and o.n_prompt == 10 and o.slot == 0 for o in progress)
    assert progress[0].prompt_ms == 0.0 and 0 < progress[1].prompt_ms <= progress[2].prompt_ms <= progress[3].prompt_ms
    assert [c for c in model.calls if c[0] == "prefill"] == [("prefill", 0, 4, 0), ("prefill", 0, 4, 4),
                                                             ("prefill", 0, 2, 8)]
    assert [o.token for o in outs if not o.is_progress] == model.reference(prompt, 6)
    # a cached prefix counts as processed from the first report; emit sends each report as it happens
    sent = []
    engine.emit = sent.append
    engine.add(greq("q", prompt[:8] + [30, 31], return_progress=True))
    outs = drain(engine)["q"]
    assert not any(o.is_progress for o in outs)
    assert [(b[0].n_cached, b[0].n_processed) for b in sent] == [(8, 8), (8, 10)]


def test_without_return_progress_the_prompt_is_one_pass():
    model = StandInModel(1, 64)
    engine = Engine(model, 1, 64, n_batch=4)
    engine.add(greq("p", list(range(1, 11))))
    assert not any(o.is_progress for o in drain(engine)["p"])
    assert [c for c in model.calls if c[0] == "prefill"] == [("prefill", 0, 10, 0)]


def test_id_slot_waits_for_its_slot_while_others_go_ahead():
    model = StandInModel(2, 64)
    engine = Engine(model, 2, 64)
    engine.add(greq("a", [1, 2, 3], id_slot=0))
    engine.add(greq("b", [4, 5, 6], id_slot=0))      # slot 0 is taken: b waits
    engine.add(greq("c", [7, 8, 9]))                 # c takes slot 1 meanwhile
    outs = drain(engine)
    assert {o.slot for o in outs["a"]} == {0} and {o.slot for o in outs["b"]} == {0} and {o.slot for o in outs["c"]} == {1}
    prefills = [c for c in model.calls if c[0] == "prefill"]
    assert [c[1] for c in prefills] == [0, 1, 0]
    for rid, p in (("a", [1, 2, 3]), ("b", [4, 5, 6]), ("c", [7, 8, 9])):
        assert [o.token for o in outs[rid]] == model.reference(p, 6)
    with pytest.raises(Exception, match="id_slot 2 is not a slot: this server has slots 0..1"):
        engine.add(greq("d", [1], id_slot=2))
