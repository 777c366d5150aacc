"""The front's follow-ups: /slots and /metrics, model facts from ModelInfo, id_slot from the engine,
the server's request defaults (sampling flags, -n) and the shutdown finish.

/slots runs over the real Engine and InProcessEngineClient with a stand-in model (the engine's
table is part of what is under test); the rest over the scripted engine of test_api_shapes.
"""
from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from bloomery.api.app import App
from bloomery.engine.core import Engine
from bloomery.engine.inproc import InProcessEngineClient
from bloomery.engine.model_api import EngineModel
from bloomery.engine.types import EngineRequest, SamplingParams, TokenOut
from bloomery.http.types import Request
from test_api_shapes import INFO, ByteTok, Scripted, Template, assert_same_shape, dispatch, load_case, scripted_app


class NextByte(EngineModel):
    """Stand-in model over ByteTok's 257 ids: logits favour (last id + 1), so text is predictable."""
    n_vocab, n_ctx_train, arch = 257, 4096, "standin"

    def _row(self, last: int) -> np.ndarray:
        row = np.zeros(self.n_vocab, dtype=np.float32)                 # [V]
        row[(last + 1) % 256] = 10.0
        return row

    def prefill(self, slot, ids, pos0):
        return self._row(int(ids[-1]))

    def decode(self, slots, ids, positions):
        return np.stack([self._row(int(i)) for i in ids])               # [B, V]


def engine_app(n_slots: int = 2, **kw) -> tuple[App, InProcessEngineClient]:
    info = INFO.__class__(**{**INFO.__dict__, "n_slots": n_slots, "n_ctx": 4096 * n_slots})
    client = InProcessEngineClient(Engine(NextByte(), n_slots, 4096), info)
    return App(ByteTok(), Template(), client, info, **kw), client


def get(app: App, path: str, query: dict | None = None):
    r = asyncio.run(app.dispatch(Request("GET", path, query or {}, {}, b"")))
    return r.status, json.loads(r.body)


# -- /slots -----------------------------------------------------------------------------
def test_slots_before_and_after_a_request_have_llama_servers_shape():
    app, client = engine_app(n_slots=2)
    try:
        status, before = get(app, "/slots")
        _, _, ref_before = load_case("slots")
        assert status == 200 and [s["id"] for s in before] == [0, 1]
        for s in before:
            assert_same_shape(ref_before[0], s)
        status, body = dispatch(app, {"method": "POST", "path": "/completion", "body": json.dumps(
            {"prompt": "ab", "n_predict": 3, "temperature": 0.5, "top_k": 7, "seed": 9})})
        assert status == 200 and body["content"] == "cde"
        _, after = get(app, "/slots")
    finally:
        client.close()
    _, _, ref_after = load_case("slots_after")
    ran = [s for s in after if "id_task" in s]
    assert len(ran) == 1 and ran[0]["id"] == body["id_slot"]
    assert_same_shape(ref_after[0], ran[0])
    assert (ran[0]["n_prompt_tokens"], ran[0]["is_processing"]) == (2, False)
    assert ran[0]["params"]["top_k"] == 7 and ran[0]["params"]["seed"] == 9 and ran[0]["params"]["n_predict"] == 3
    # idle after the request: no budget left over, as llama-server's slots_after capture shows
    assert ran[0]["next_token"] == [{"has_next_token": False, "has_new_line": False, "n_remain": -1, "n_decoded": 0}]


def test_no_slots_and_metrics_answer_501_naming_the_flag():
    app = scripted_app(endpoint_slots=False)
    status, body = get(app, "/slots")
    assert status == 501 and body["error"] == {
        "code": 501, "message": "This server does not support slots endpoint. Start it with `--slots`",
        "type": "not_supported_error"}
    status, body = get(app, "/metrics")
    assert status == 501 and body["error"]["message"] == \
        "This server does not support metrics endpoint. Start it with `--metrics`"
    assert body["error"]["type"] == "not_supported_error"


def test_fail_on_no_slot_answers_503_while_every_slot_is_busy():
    app, client = engine_app(n_slots=1)

    async def main():
        gen = client.generate(EngineRequest("busy", (1, 2), -1, SamplingParams(temperature=0.0)))
        await gen.__anext__()           # the only slot is running it now
        busy = await app.dispatch(Request("GET", "/slots", {"fail_on_no_slot": "1"}, {}, b""))
        await gen.aclose()
        return busy
    try:
        busy = asyncio.run(main())
    finally:
        client.close()
    assert busy.status == 503 and json.loads(busy.body)["error"]["message"] == "no slot available"


# -- model facts and id_slot -----------------------------------------------------------------
def test_models_and_props_report_modelinfo_facts():
    info = INFO.__class__(**{**INFO.__dict__, "n_embd": 1234, "vocab_type": 1, "ftype": "Q8_0",
                             "n_params": 77, "size_bytes": 88})
    app = App(ByteTok(), Template(), Scripted(), info)
    _, models = get(app, "/v1/models")
    assert models["data"][0]["meta"] == {"vocab_type": 1, "n_vocab": 257, "n_ctx": 4096, "n_ctx_train": 32768,
                                         "n_embd": 1234, "n_params": 77, "size": 88, "ftype": "Q8_0"}
    _, props = get(app, "/props")
    assert props["model_ftype"] == "Q8_0" and props["endpoint_metrics"] is False
    _, ref_models = dispatch(scripted_app(), load_case("v1_models")[0])
    assert ref_models["data"][0]["meta"] == {**load_case("v1_models")[2]["data"][0]["meta"], "n_vocab": 257}


def test_id_slot_is_the_slot_that_ran_the_request():
    app = scripted_app(client=Scripted(slot=3))
    _, body = dispatch(app, {"method": "POST", "path": "/completion", "body": json.dumps({"prompt": "x",
                                                                                          "n_predict": 2})})
    assert body["id_slot"] == 3
    _, events = dispatch(app, {"method": "POST", "path": "/completion", "body": json.dumps(
        {"prompt": "x", "n_predict": 2, "stream": True})})
    assert [e["id_slot"] for e in events] == [-1] * (len(events) - 1) + [3]    # as llama-server's stream


# -- the server's request defaults -------------------------------------------------------------
class Recording(Scripted):
    def __init__(self):
        super().__init__()
        self.requests = []

    async def generate(self, req):
        self.requests.append(req)
        async for out in super().generate(req):
            yield out


def test_sampling_flags_set_the_request_defaults_and_props_shows_them():
    client = Recording()
    flags = SamplingParams(temperature=0.0, top_k=5, top_p=0.5, min_p=0.1, repeat_penalty=1.1, repeat_last_n=32,
                           presence_penalty=0.2, frequency_penalty=0.3, seed=42)
    app = scripted_app(client=client, sampling_defaults=flags, n_predict_default=4)
    dispatch(app, {"method": "POST", "path": "/completion", "body": json.dumps({"prompt": "x"})})
    dispatch(app, {"method": "POST", "path": "/v1/completions", "body": json.dumps(
        {"prompt": "x", "top_k": 9, "seed": -1})})
    first, second = client.requests
    assert first.sampling == flags and first.n_predict == 4
    assert second.sampling.top_k == 9 and second.sampling.seed == 0xFFFFFFFF     # the request's own win
    assert second.sampling.temperature == 0.0 and second.sampling.min_p == pytest.approx(0.1)
    _, props = get(app, "/props")
    shown = props["default_generation_settings"]["params"]
    assert (shown["temperature"], shown["top_k"], shown["seed"], shown["repeat_last_n"]) == (0.0, 5, 42, 32)
    assert shown["top_p"] == pytest.approx(0.5) and shown["n_predict"] == 4


# -- stopping: the front's client ends a generation with finish "shutdown" -----------------------
class StoppedMidway(Scripted):
    async def generate(self, req):
        yield TokenOut(req.req_id, ord("a"), None, n_prompt=len(req.prompt_ids), slot=0)
        yield TokenOut(req.req_id, None, "shutdown", error="the server is shutting down (SIGTERM)", slot=0)


@pytest.mark.parametrize("path,body", [
    ("/completion", {"prompt": "x", "stream": True}),
    ("/v1/completions", {"prompt": "x", "stream": True}),
])
def test_a_stream_ended_by_shutdown_closes_with_an_error_event_naming_it(path, body):
    _, events = dispatch(scripted_app(client=StoppedMidway()), {"method": "POST", "path": path,
                                                                "body": json.dumps(body)})
    err = events[-1]["error"]
    assert err["code"] == 503 and err["type"] == "unavailable_error"
    assert "shutting down (SIGTERM)" in err["message"] and "after 1 ids" in err["message"]
    status, plain = dispatch(scripted_app(client=StoppedMidway()), {"method": "POST", "path": path,
                                                                    "body": json.dumps({**body, "stream": False})})
    assert status == 503 and "shutting down" in plain["error"]["message"]
