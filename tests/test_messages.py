"""Typed messages: every boundary's messages round-trip through JSON; bad ones are refused by name."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from bloomery.engine.types import EngineRequest, ModelInfo, SamplingParams, TokenOut, TokenProb
from bloomery.messages import engine as em
from bloomery.messages import stage as sm
from bloomery.messages.codec import MessageError
from bloomery.placement import DeviceNeed, Placement, Terms

INFO = ModelInfo(name="m", arch="qwen2", n_ctx=4096, n_ctx_slot=4096, n_slots=1, n_vocab=151936,
                 n_ctx_train=32768, backend="numpy", model_path="/x.gguf", n_params=494_000_000, size_bytes=491_400_064)
REQ = EngineRequest("r1", (1, 2, 3), 8, SamplingParams(temperature=0.0, seed=7, logit_bias=((5, -math.inf), (9, 1.5))),
                    stop_ids=(151645,), cache_prompt=False)
OUT = TokenOut("r1", 42, "stop", logprob=-0.25, top=(TokenProb(42, -0.25, 0.78), TokenProb(7, -math.inf, 0.0)),
               n_prompt=3, n_cached=1, prompt_ms=12.5)

STAGE_MSGS = [
    sm.Record("load", "engine", "tensors read", {"n": 291, "ok": True, "x": 1.5, "none": None, "s": "a b"}),
    sm.Progress("fetch", "fetch", 10, 100),
    sm.FetchDone("/m.gguf", ("/m.gguf",), 491_400_064),
    sm.PlanDone((sm.Record("plan", "plan", "ctx", {"n_ctx": 4096}),), {"n_ctx": 4096, "nested": {"a": [1, 2]}}),
    sm.PlanDone((), {}, Placement("numpy", 2, 2048, "host", devices=(
        DeviceNeed("host", 8 << 30, Terms(weights=491_400_064, decoded=551_000_000, kv=50_331_648, scratch=1, margin=2)),))),
    sm.Ready(INFO, {"load_s": 3.2}),
    sm.Dead("engine", "MemoryError: out of memory"),
]
EXPERTS_REPORT = {"offload": True, "residency": "on", "moved_experts": 3, "moved_bytes": 9_437_184,
                  "host_wait_s": 0.125, "updates": 2,
                  "layers": [{"layer": 0, "counts": [5, 0, 2, 9], "on_card": [0, 3], "hits": 14, "misses": 2}]}
ENGINE_TO = [em.Generate(REQ), em.Cancel("r1"), em.SlotsQuery("q1"), em.Shutdown("SIGTERM"),
             em.ExpertsQuery("e1"), em.ExpertsQuery("e2", reset=True),
             em.SlotAction("s1", "save", 1, "/srv/slots/a.bin", "a.bin", "model.gguf"), em.SlotAction("s2", "erase", 0)]
ENGINE_FROM = [em.Hello(123), em.Tokens((OUT, TokenOut("r2", None, "cancel"))),
               em.SlotsReply("", ({"id": 0, "n_ctx": 4096, "is_processing": False, "id_task": -1},)),
               em.ExpertsReply("e1", EXPERTS_REPORT),
               em.ExpertsReply("e2", {"offload": False, "layers": []}, "no routed experts in host RAM: nothing to reset",
                               "no_offload"),
               em.SlotActionReply("s1", 200, {"id_slot": 1, "filename": "a.bin", "n_saved": 7, "n_written": 900,
                                              "timings": {"save_ms": 1.5}}),
               em.SlotActionReply("s2", 503, {}, "slot 0 is processing a request: erase needs an idle slot")]


def same(a, b) -> bool:
    """Equality where NaN/inf compare by their JSON spelling."""
    return json.dumps(repr(a)) == json.dumps(repr(b))


@pytest.mark.parametrize("msg", STAGE_MSGS, ids=lambda m: type(m).__name__)
def test_stage_round_trip(msg):
    back = sm.decode(sm.encode(msg))
    assert back == msg and type(back) is type(msg)


@pytest.mark.parametrize("msg", ENGINE_TO, ids=lambda m: type(m).__name__)
def test_to_engine_round_trip(msg):
    back = em.decode_to_engine(em.encode(msg))
    assert same(back, msg) and type(back) is type(msg)


@pytest.mark.parametrize("msg", ENGINE_FROM, ids=lambda m: type(m).__name__)
def test_from_engine_round_trip(msg):
    back = em.decode_from_engine(em.encode(msg))
    assert same(back, msg)


def test_tuples_come_back_as_tuples_and_inf_survives():
    back = em.decode_to_engine(em.encode(em.Generate(REQ))).req
    assert isinstance(back.prompt_ids, tuple) and back.sampling.logit_bias[0] == (5, -math.inf)
    assert hash(back) == hash(REQ)      # frozen and hashable, as the engine may key on it


def test_wire_is_json_with_a_type_tag_never_pickle():
    data = em.encode(em.Cancel("r9"))
    assert json.loads(data) == {"type": "Cancel", "req_id": "r9"}
    assert b"\x80" not in sm.encode(sm.Ready(INFO))


def wire(tag, **fields) -> bytes:
    return json.dumps({"type": tag, **fields}).encode()


@pytest.mark.parametrize("data,match", [
    (wire("Pickle", x=1), "unknown message type 'Pickle'"),
    (b'{"req_id": "r"}', "unknown message type None"),
    (b"not json", "not JSON"),
    (b"[1]", "must be a JSON object"),
    (wire("Cancel", req_id=5), r"Cancel.req_id: want str, got int 5"),
    (wire("Cancel"), "Cancel: missing field 'req_id'"),
    (wire("Cancel", req_id="r", extra=1), "Cancel: unknown field 'extra'"),
    (wire("Generate", req={"req_id": "r", "prompt_ids": [1, "2"], "n_predict": 1}),
     r"Generate.req.prompt_ids\[1\]: want int, got str '2'"),
    (wire("Generate", req={"req_id": "r", "prompt_ids": [1], "n_predict": True}), "Generate.req.n_predict: want int"),
    # a long run of ids takes the fast path only when every one is a plain int
    (wire("Generate", req={"req_id": "r", "prompt_ids": list(range(5000)) + [True], "n_predict": 1}),
     r"Generate.req.prompt_ids\[5000\]: want int, got bool True"),
    (wire("Generate", req={"req_id": "r", "prompt_ids": list(range(5000)) + [7.0], "n_predict": 1}),
     r"Generate.req.prompt_ids\[5000\]: want int, got float 7.0"),
    (wire("Generate", req={"req_id": "r", "prompt_ids": [1], "n_predict": 1, "sampling": {"top_k": 1.5}}),
     "Generate.req.sampling.top_k: want int, got float"),
    (wire("Generate", req={"req_id": "r", "prompt_ids": [1], "n_predict": 1,
                           "sampling": {"logit_bias": [[1, 2.0, 3]]}}), r"logit_bias\[0\]: want 2 items"),
    (wire("Shutdown", reason=None), "Shutdown.reason: want str"),
    (wire("ExpertsQuery", query_id="e", reset="yes"), "ExpertsQuery.reset: want bool, got str 'yes'"),
    (wire("ExpertsQuery", reset=True), "ExpertsQuery: missing field 'query_id'"),
])
def test_to_engine_refusals_name_the_field(data, match):
    with pytest.raises(MessageError, match=match):
        em.decode_to_engine(data)


def test_an_experts_reply_keeps_its_report_whole_and_refuses_a_bad_one():
    back = em.decode_from_engine(em.encode(em.ExpertsReply("e1", EXPERTS_REPORT)))
    assert back.report == EXPERTS_REPORT and back.report["layers"][0]["counts"] == [5, 0, 2, 9]
    with pytest.raises(MessageError, match=r"ExpertsReply.report: want an object, got list"):
        em.decode_from_engine(wire("ExpertsReply", query_id="e", report=[1]))
    with pytest.raises(MessageError, match="unknown message type 'ExpertsQuery'"):
        em.decode_from_engine(em.encode(em.ExpertsQuery("e")))


def test_boundaries_do_not_mix():
    with pytest.raises(MessageError, match="unknown message type 'Tokens'"):
        em.decode_to_engine(em.encode(em.Tokens(())))
    with pytest.raises(MessageError, match="unknown message type 'Generate'"):
        sm.decode(em.encode(em.Generate(REQ)))


@pytest.mark.parametrize("data,match", [
    (wire("Ready", info={"name": "m"}), "Ready.info: missing field 'arch'"),
    (wire("Record", phase="x", component="c", message="m", fields={"k": [1]}), r"Record.fields.k: want str or int"),
    (wire("Dead", stage="engine", reason=7), "Dead.reason: want str"),
    (wire("Progress", phase="p", component="c", done="1", total=2), "Progress.done: want int"),
])
def test_stage_refusals_name_the_field(data, match):
    with pytest.raises(MessageError, match=match):
        sm.decode(data)


@settings(max_examples=60, deadline=None)
@given(req_id=st.text(max_size=20), ids=st.lists(st.integers(0, 2**31 - 1), max_size=50),
       n_predict=st.integers(-1, 2**31 - 1), temp=st.floats(allow_nan=False), top_k=st.integers(-5, 500),
       bias=st.lists(st.tuples(st.integers(0, 10**6), st.floats(allow_nan=False)), max_size=4))
def test_generate_round_trip_property(req_id, ids, n_predict, temp, top_k, bias):
    req = EngineRequest(req_id, tuple(ids), n_predict, SamplingParams(temperature=temp, top_k=top_k,
                                                                      logit_bias=tuple(bias)))
    assert em.decode_to_engine(em.encode(em.Generate(req))).req == req


def test_a_long_prompt_crosses_whole_and_as_a_tuple_of_ints():
    ids = tuple(int(i) for i in np.random.default_rng(1).integers(0, 150_000, 8192))
    back = em.decode_to_engine(em.encode(em.Generate(EngineRequest("r", ids, 4))))
    assert back.req.prompt_ids == ids and type(back.req.prompt_ids) is tuple
    assert all(type(i) is int for i in back.req.prompt_ids)
