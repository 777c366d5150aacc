"""Chunked prefill: a prompt admitted beside busy slots runs one pass of at most min(-b, n_ubatch) ids a
round, the other slots' decode steps between its passes; alone, it runs whole. First on the engine over
the stand-in model, then on the real bloomery-serve: a long prompt in one slot does not stop another
slot's stream (its tokens keep arriving while the prompt runs)."""
from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
import requests

from bloomery.engine.core import Engine
from serve_proc import Served
from test_engine_core import StandInModel, drain, greq


class ChunkedModel(StandInModel):
    n_ubatch = 4


def test_a_prompt_beside_a_stream_runs_in_chunks_between_its_decode_steps():
    model = ChunkedModel(2, 64)
    engine = Engine(model, 2, 64)
    engine.add(greq("a", [1, 2, 3], n_predict=12))
    outs_a = [o for o in engine.step()]                       # a alone: its prompt whole
    slot_a = outs_a[0].slot
    assert model.calls == [("prefill", slot_a, 3, 0)]
    long_prompt = list(range(5, 23))                          # 18 ids: 5 passes of 4
    engine.add(greq("b", long_prompt, n_predict=3))
    outs = drain(engine)
    calls = model.calls[1:]
    b_passes = [c for c in calls if c[0] == "prefill"]
    slot_b = outs["b"][0].slot
    assert slot_b != slot_a and b_passes == [("prefill", slot_b, 4, 0), ("prefill", slot_b, 4, 4),
                                             ("prefill", slot_b, 4, 8), ("prefill", slot_b, 4, 12),
                                             ("prefill", slot_b, 2, 16)]
    first_b = calls.index(b_passes[0])
    last_b = calls.index(b_passes[-1])
    between = [c for c in calls[first_b:last_b] if c[0] == "decode"]
    assert len(between) == 4 and all(c[1] == (slot_a,) for c in between)   # a stepped between every two passes
    assert [o.token for o in outs_a + outs["a"]] == model.reference([1, 2, 3], 12)
    assert [o.token for o in outs["b"]] == model.reference(long_prompt, 3)
    assert outs["b"][0].n_prompt == 18 and outs["b"][0].prompt_ms > 0


def test_a_prompt_cancelled_between_its_chunks_leaves_nothing_half_read_for_the_next():
    model = ChunkedModel(2, 64)
    engine = Engine(model, 2, 64)
    engine.add(greq("a", [1, 2, 3], n_predict=20))
    engine.step()
    long_prompt = list(range(5, 23))
    engine.add(greq("b", long_prompt, n_predict=3))
    engine.step()                                             # b's first chunk and a's step
    engine.cancel("b")
    outs = engine.step()
    assert [(o.req_id, o.finish) for o in outs if o.req_id == "b"] == [("b", "cancel")]
    engine.add(greq("c", long_prompt, n_predict=3))
    out = drain(engine)
    assert out["c"][0].n_cached == 0                          # b's chunks were never counted as the slot's
    assert [o.token for o in out["c"]] == model.reference(long_prompt, 3)


def test_a_prompt_alone_runs_whole():
    model = ChunkedModel(2, 64)
    engine = Engine(model, 2, 64)
    engine.add(greq("a", list(range(1, 19)), n_predict=2))
    drain(engine)
    assert [c[2:] for c in model.calls if c[0] == "prefill"] == [(18, 0)]


class SharedPassModel(ChunkedModel):
    """The stand-in that also takes several slots' prompt ids in one call, as CausalLM.prefill_slots."""
    shares_passes = True

    def prefill_slots(self, parts):
        self.calls.append(("prefill_slots", tuple((slot, len(ids), pos0) for slot, ids, pos0 in parts)))
        for slot, ids, pos0 in parts:
            self._write(slot, list(ids), pos0)
        return np.stack([self._logits(self.kv[slot]) for slot, _, _ in parts])


def test_prompts_admitted_together_share_each_pass_within_one_chunk():
    model = SharedPassModel(3, 64)
    engine = Engine(model, 3, 64)
    prompts = {"a": [1, 2, 3], "b": [4, 5, 6, 7, 8, 9], "c": [10, 11]}
    for rid, p in prompts.items():
        engine.add(greq(rid, p, n_predict=4))
    outs = drain(engine)
    passes = [c for c in model.calls if c[0].startswith("prefill")]
    slot = {rid: o[0].slot for rid, o in outs.items()}
    assert (slot["c"], slot["b"], slot["a"]) == (0, 1, 2)   # the least recently used free slot, the last of equals
    # 4 ids a pass in all (n_ubatch), filled in slot order: c's 2 and b's first 2; b's last 4 fill the
    # next (a one-slot call, a waits); then a's 3
    assert passes == [("prefill_slots", ((0, 2, 0), (1, 2, 0))), ("prefill", 1, 4, 2), ("prefill", 2, 3, 0)]
    for rid, p in prompts.items():
        assert [o.token for o in outs[rid]] == model.reference(p, 4)
        assert outs[rid][0].n_prompt == len(p)


def test_a_shared_pass_that_fails_is_run_again_a_slot_at_a_time_so_only_the_faulty_request_fails():
    from test_engine_core import POISON
    model = SharedPassModel(2, 64)
    engine = Engine(model, 2, 64)
    engine.add(greq("a", [1, 2], n_predict=3))
    engine.add(greq("bad", [3, POISON], n_predict=3))
    outs = drain(engine)
    assert model.calls[0] == ("prefill_slots", ((0, 2, 0), (1, 2, 0)))   # tried together first
    assert [o.finish for o in outs["bad"]] == ["error"] and "poisoned" in outs["bad"][0].error
    assert [o.token for o in outs["a"]] == model.reference([1, 2], 3)


@pytest.fixture(scope="module")
def tiny_model(real_model_path, tmp_path_factory):
    from conftest import load_tool
    path = tmp_path_factory.mktemp("chunked") / "tiny_qwen2.gguf"
    load_tool("make_synthetic").write_synthetic(path, "qwen2", tokenizer_from=str(real_model_path))
    return path


def stream(url: str, body: dict, got: list, started: threading.Event | None = None,
           stop: threading.Event | None = None) -> None:
    """Each SSE event with the time it arrived; leaves (the server cancels) once `stop` is set."""
    with requests.post(url + "/completion", json={"stream": True, **body}, stream=True, timeout=300) as r:
        assert r.status_code == 200, r.text
        for line in r.iter_lines():         # bytes: a str line would split at U+2028 and the like
            if line.startswith(b"data: "):
                got.append((time.monotonic(), json.loads(line[6:])))
                if started is not None and len(got) >= 3:
                    started.set()
            if stop is not None and stop.is_set():
                return


@pytest.mark.real_model
@pytest.mark.slow
def test_a_long_prompt_in_one_slot_does_not_stop_another_slots_stream(tiny_model):
    with Served("-m", str(tiny_model), "-c", "2048", "-np", "2", "-b", "16", "--temp", "0") as s:
        a_events: list = []
        b_events: list = []
        started, stop = threading.Event(), threading.Event()
        a = threading.Thread(target=stream, args=(s.url, {"prompt": "Count:", "n_predict": 900, "ignore_eos": True},
                                                  a_events, started, stop))
        a.start()
        assert started.wait(120)
        long_prompt = "the quick brown fox jumps over the lazy dog " * 60          # about 600 ids: ~38 passes
        stream(s.url, {"prompt": long_prompt, "n_predict": 2, "ignore_eos": True, "return_progress": True},
               b_events)
        stop.set()
        a.join(60)
    progress = [t for t, e in b_events if "prompt_progress" in e]
    first_token = next(t for t, e in b_events if "prompt_progress" not in e and e.get("content") is not None)
    assert len(progress) > 30
    # a's tokens kept arriving while b's prompt ran: without chunked prefill the whole prompt is one step
    arrived = [t for t, e in a_events if progress[0] < t < first_token and e.get("content")]
    assert len(arrived) >= 10, (len(arrived), len(progress))


SHAPE = dict(n_layer=2, n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_ff=512)


def test_two_prompts_on_the_numpy_backend_run_in_one_model_call_and_pick_the_ids_they_pick_alone(
        tokenizer_source, synthetic_dir):
    from conftest import load_tool
    from bloomery.engine.loader import load_model
    from bloomery.placement import whole
    path = load_tool("make_synthetic").write_synthetic(synthetic_dir / "shared-pass-qwen3.gguf", arch="qwen3",
                                                        mode="blocks", mix="q4_k_m", seed=5,
                                                        tokenizer_from=str(tokenizer_source), **SHAPE)
    model = load_model(path, whole("numpy", 2, 128))
    calls = []
    one_slot, many = model.prefill, model.prefill_slots
    model.prefill = lambda *a: (calls.append("prefill"), one_slot(*a))[1]
    model.prefill_slots = lambda parts: (calls.append(("prefill_slots", len(parts))), many(parts))[1]
    prompts = {"a": [int(i) for i in np.arange(100, 140)], "b": [int(i) for i in np.arange(900, 917)]}

    def run(rids):
        engine = Engine(model, 2, 128)
        for rid in rids:
            engine.add(greq(rid, prompts[rid], n_predict=6))
        return {rid: [o.token for o in out] for rid, out in drain(engine).items()}

    together = run(["a", "b"])
    assert calls == [("prefill_slots", 2)]                  # both prompts, one model call
    alone = {**run(["a"]), **run(["b"])}
    assert calls[1:] == ["prefill", ("prefill_slots", 1)] * 2    # each alone (prefill runs through prefill_slots)
    assert together == alone

