"""GET /residency, POST /residency/reset and /metrics' bloomery: expert series (api/experts.py), and the
engine's side of them (engine/experts_query.py) through both engine clients.

A load with host experts exists only on a card (engine/cuda/experts.py's Offload: tests/test_cuda_offload.py
serves one). Here the engine side runs over a CPU stand-in of that tier with the same report shape, so
what the CPU can check is checked: the query runs on the engine's thread between steps (never while a
step runs), a reset comes before its report, both clients carry it, a slow step leaves the expert series
out of that scrape without failing /metrics. A real bloomery-serve on a synthetic qwen3moe file (CPU
backend: no host tier) answers "offload": false, refuses a reset by name, and adds no series.
"""
from __future__ import annotations

import asyncio
import json
import os
import queue
import subprocess
import threading
import time

import numpy as np
import pytest
import requests

from bloomery.api import experts
from bloomery.api.app import App
from bloomery.engine import experts_query
from bloomery.engine.core import Engine
from bloomery.engine.inproc import InProcessEngineClient
from bloomery.engine.model_api import EngineModel
from bloomery.engine.types import EngineRequest, SamplingParams
from bloomery.http.types import Request
from test_api_shapes import INFO, ByteTok, Template

GREEDY = SamplingParams(temperature=0.0)


class Tier:
    """A CPU stand-in of the cuda Offload: two layers of 4 experts, experts 0 and 1 on the card at load;
    each step routes expert (id % 4) in both layers. Every call records its thread and whether a step
    was running then."""

    def __init__(self, model):
        self.model, self.calls = model, []
        self.counts = [[0] * 4 for _ in range(2)]
        self.on_card = [{0, 1}, {0, 1}]
        self.moved = 0

    def route(self, ids) -> None:
        for i in ids:
            for layer in self.counts:
                layer[int(i) % 4] += 1
        self.on_card = [{2, 3}, {2, 3}]           # as residency would: the hot ones moved in
        self.moved = 4

    def _call(self, what: str) -> None:
        self.calls.append((what, threading.current_thread().name, self.model.stepping))

    def reset(self) -> None:
        self._call("reset")
        self.on_card = [{0, 1}, {0, 1}]

    def report(self) -> dict:
        self._call("report")
        return {"residency": "on", "layers": [
            {"layer": i, "counts": list(c), "on_card": sorted(self.on_card[i]),
             "hits": sum(n for e, n in enumerate(c) if e in self.on_card[i]),
             "misses": sum(n for e, n in enumerate(c) if e not in self.on_card[i])}
            for i, c in enumerate(self.counts)],
            "moved_experts": self.moved, "moved_bytes": self.moved * 3_000_000, "host_wait_s": 0.25, "updates": 1}


class Ops:
    def __init__(self, offload):
        self.offload = offload


class NextByte(EngineModel):
    """Stand-in model over ByteTok's 257 ids (logits favour last id + 1); `step_s` per pass; with_tier:
    its ops carry the stand-in tier, as a load with host experts carries the Offload."""
    n_vocab, n_ctx_train, arch = 257, 4096, "standin"

    def __init__(self, with_tier: bool = True, step_s: float = 0.0):
        self.step_s, self.stepping = step_s, False
        self.ops = Ops(Tier(self) if with_tier else None)

    def _pass(self, ids) -> None:
        self.stepping = True
        time.sleep(self.step_s)
        if self.ops.offload is not None:
            self.ops.offload.route(ids)
        self.stepping = False

    def _row(self, last: int) -> np.ndarray:
        row = np.zeros(self.n_vocab, dtype=np.float32)                 # [V]
        row[(last + 1) % 256] = 10.0
        return row

    def prefill(self, slot, ids, pos0):
        self._pass(ids)
        return self._row(int(ids[-1]))

    def decode(self, slots, ids, positions):
        self._pass(ids)
        return np.stack([self._row(int(i)) for i in ids])               # [B, V]


def inproc_app(model, **kw) -> tuple[App, InProcessEngineClient]:
    client = InProcessEngineClient(Engine(model, 1, 4096), INFO)
    return App(ByteTok(), Template(), client, INFO, **kw), client


def call(app: App, method: str, path: str) -> tuple[int, object]:
    r = asyncio.run(app.dispatch(Request(method, path, {}, {}, b"")))
    body = r.body.decode()
    return r.status, (json.loads(body) if body.startswith("{") else body)


# -- the engine's side ---------------------------------------------------------------------------
def test_answer_resets_first_then_reports_and_names_what_it_cannot_answer():
    model = NextByte()
    ans = experts_query.answer(model, reset=True)
    assert not ans.error and [c[0] for c in model.ops.offload.calls] == ["reset", "report"]
    assert ans.report["offload"] is True and ans.report["residency"] == "on" and len(ans.report["layers"]) == 2

    plain = experts_query.answer(NextByte(with_tier=False), reset=False)
    assert plain == experts_query.ExpertsAnswer(experts_query.empty_report())
    assert plain.report["offload"] is False and plain.report["layers"] == []
    refused = experts_query.answer(NextByte(with_tier=False), reset=True)
    assert (refused.kind, refused.error) == (experts_query.NO_OFFLOAD, "no routed experts in host RAM: nothing to reset")
    assert experts_query.answer(None, reset=False).kind == experts_query.ASLEEP

    broken = NextByte()
    broken.ops.offload.reset = lambda: (_ for _ in ()).throw(RuntimeError("copy failed"))
    failed = experts_query.answer(broken, reset=True)
    assert (failed.kind, failed.error, failed.report["offload"]) == (experts_query.FAILED, "RuntimeError: copy failed",
                                                                     True)


def test_inproc_query_runs_on_the_engine_thread_between_steps():
    model = NextByte(step_s=0.02)
    app, client = inproc_app(model)

    async def main():
        async def generate():
            return [o.token async for o in client.generate(EngineRequest("g", (97,), 40, GREEDY))]
        gen = asyncio.ensure_future(generate())
        reports = []
        while not gen.done():
            reports.append(await client.query_experts(reset=len(reports) % 2 == 1))
            await asyncio.sleep(0.005)
        return await gen, reports

    try:
        tokens, reports = asyncio.run(main())
    finally:
        client.close()
    assert len(tokens) == 40 and len(reports) >= 4
    calls = model.ops.offload.calls
    assert {(name, stepping) for _, name, stepping in calls} == {("bloomery-engine", False)}, calls
    assert all(calls[i + 1][0] == "report" for i, c in enumerate(calls) if c[0] == "reset")
    assert all(r["offload"] for r in reports)


def test_zmq_client_carries_the_query_through_the_engine_loop(tmp_path):
    import zmq
    import zmq.asyncio
    from bloomery.stages import engine as stage_engine
    from bloomery.zmq_client import ZmqEngineClient

    model = NextByte(step_s=0.01)

    async def main():
        ctx = zmq.asyncio.Context()
        client = ZmqEngineClient(ctx, f"ipc://{tmp_path}/req", f"ipc://{tmp_path}/out")
        client.info = INFO
        client.start()
        sync = zmq.Context()
        inbox, stop = queue.Queue(), threading.Event()
        threading.Thread(target=stage_engine._input_thread, args=(sync, f"ipc://{tmp_path}/req", inbox, stop),
                         daemon=True).start()
        push = sync.socket(zmq.PUSH)
        push.connect(f"ipc://{tmp_path}/out")
        engine = Engine(model, 1, 4096)
        loop = threading.Thread(target=stage_engine.serve, args=(engine, inbox, push, os.getppid()), daemon=True)
        loop.start()
        try:
            assert await client.wait_hello(10)
            tokens = [o.token async for o in client.generate(EngineRequest("z", (97,), 8, GREEDY))]
            got = await client.query_experts()
            reset = await client.query_experts(reset=True)
            engine.swap_model(None)                      # as --sleep-idle-seconds does
            with pytest.raises(experts_query.ExpertsError) as asleep:
                await client.query_experts()
            await client.shutdown("test")
            loop.join(10)
            return tokens, got, reset, asleep.value
        finally:
            stop.set()
            client.close()
            push.close(0)

    tokens, got, reset, asleep = asyncio.run(main())
    assert tokens == list(range(98, 106))
    assert got["offload"] is True and [ly["on_card"] for ly in got["layers"]] == [[2, 3], [2, 3]]
    assert sum(got["layers"][0]["counts"]) == 1 + 7 and got["moved_bytes"] == 12_000_000
    assert [ly["on_card"] for ly in reset["layers"]] == [[0, 1], [0, 1]]      # the load's placement again
    assert [c[0] for c in model.ops.offload.calls] == ["report", "reset", "report"]
    assert asleep.kind == experts_query.ASLEEP


# -- the routes over the in-process client -----------------------------------------------------------
def test_routes_answer_the_report_and_name_each_refusal():
    app, client = inproc_app(NextByte(with_tier=False))
    try:
        assert call(app, "GET", "/residency") == (200, experts_query.empty_report())
        status, body = call(app, "POST", "/residency/reset")
        assert status == 409 and body["error"] == {"code": 409, "type": "invalid_request_error",
                                                   "message": "no routed experts in host RAM: nothing to reset"}
        assert call(app, "GET", "/residency/reset")[0] == 404
        client.engine.swap_model(None)
        status, body = call(app, "GET", "/residency")
        assert status == 503 and "asleep" in body["error"]["message"]
    finally:
        client.close()
    app, client = inproc_app(NextByte())
    try:
        status, body = call(app, "POST", "/residency/reset")
        assert status == 200 and body["offload"] is True and body["layers"][0]["on_card"] == [0, 1]
    finally:
        client.close()


def test_metrics_add_the_expert_series_only_for_a_load_with_host_experts():
    model = NextByte()
    app, client = inproc_app(model, metrics_requested=True)
    try:
        asyncio.run(app.dispatch(Request("POST", "/completion", {}, {}, b'{"prompt": "a", "n_predict": 3}')))
        status, text = call(app, "GET", "/metrics")
    finally:
        client.close()
    assert status == 200 and "llamacpp:prompt_tokens_total" in text
    layers = model.ops.offload.report()["layers"]
    assert sum(layers[0]["counts"]) >= 3 and layers[0]["misses"] > 0
    ours = [line for line in text.splitlines() if line.startswith("bloomery:")                # the expert series:
            and "decode_steps" not in line and "prompt_passes" not in line]               # not the engine's own
    assert ours == [f'bloomery:expert_hits_total{{layer="{i}"}} {layers[i]["hits"]}' for i in (0, 1)] + \
        [f'bloomery:expert_misses_total{{layer="{i}"}} {layers[i]["misses"]}' for i in (0, 1)] + \
        ["bloomery:experts_moved_total 4", "bloomery:expert_bytes_moved_total 12000000",
         "bloomery:host_wait_seconds_total 0.25"]
    for name in ("expert_hits_total", "expert_misses_total", "experts_moved_total", "expert_bytes_moved_total",
                 "host_wait_seconds_total"):
        assert f"# TYPE bloomery:{name} counter" in text and f"# HELP bloomery:{name} " in text

    app, client = inproc_app(NextByte(with_tier=False), metrics_requested=True)
    try:
        status, text = call(app, "GET", "/metrics")
    finally:
        client.close()
    assert status == 200 and "llamacpp:" in text and "bloomery:expert" not in text and "bloomery:host" not in text
    assert "bloomery:decode_steps_total 0" in text           # the engine's own step counts, on every load
    assert "bloomery:prompt_passes_total 0" in text


def test_asleep_the_expert_series_are_those_of_the_last_awake_scrape():
    """llama-server serves /metrics from the snapshot taken on entering sleep: the expert series too, and
    no comment line appears (llama.cpp's test_server_sleep_read_only_endpoints compares the texts)."""
    app, client = inproc_app(NextByte(), metrics_requested=True)
    try:
        asyncio.run(app.dispatch(Request("POST", "/completion", {}, {}, b'{"prompt": "a", "n_predict": 3}')))
        _, awake = call(app, "GET", "/metrics")
        client.engine.swap_model(None)                 # as --sleep-idle-seconds does
        _, asleep = call(app, "GET", "/metrics")
    finally:
        client.close()
    ours = [line for line in awake.splitlines() if "bloomery" in line]
    assert ours and [line for line in asleep.splitlines() if "bloomery" in line] == ours


def test_a_scrape_during_a_long_step_leaves_the_expert_series_out(monkeypatch):
    monkeypatch.setattr(experts, "METRICS_TIMEOUT_S", 0.2)
    app, client = inproc_app(NextByte(step_s=1.5), metrics_requested=True)

    async def main():
        gen = asyncio.ensure_future(app.dispatch(Request("POST", "/completion", {}, {},
                                                         b'{"prompt": "a", "n_predict": 1}')))
        await asyncio.sleep(0.3)                       # the prompt's step is running
        t0 = time.monotonic()
        during = await app.dispatch(Request("GET", "/metrics", {}, {}, b""))
        waited = time.monotonic() - t0
        await gen
        after = await app.dispatch(Request("GET", "/metrics", {}, {}, b""))
        return during, waited, after

    try:
        during, waited, after = asyncio.run(main())
    finally:
        client.close()
    text = during.body.decode()
    assert during.status == 200 and "llamacpp:prompt_tokens_total" in text and waited < 1.0
    assert "bloomery:expert" not in text.replace("# bloomery:", "")
    assert "# bloomery: expert series left out: the engine did not answer within 0.2 s" in text
    assert after.status == 200 and 'bloomery:expert_hits_total{layer="0"}' in after.body.decode()


# -- a real bloomery-serve on the CPU backend ----------------------------------------------------------
@pytest.fixture(scope="module")
def cpu_moe_server(tokenizer_source, synthetic_dir):
    from conftest import load_tool
    from serve_proc import Served
    path = load_tool("make_synthetic").write_synthetic(synthetic_dir / "residency-qwen3moe.gguf", arch="qwen3moe",
                                                       tokenizer_from=str(tokenizer_source))
    with Served("-m", str(path), "--backend", "cpu", "-c", "256", "--metrics", "--temp", "0") as s:
        yield s


@pytest.mark.slow
def test_a_cpu_load_has_no_host_experts_to_show_or_reset(cpu_moe_server):
    url = cpu_moe_server.url
    r = requests.post(url + "/completion", json={"prompt": "Hello", "n_predict": 4, "ignore_eos": True}, timeout=120)
    assert r.status_code == 200 and r.json()["tokens_predicted"] == 4
    r = requests.get(url + "/residency", timeout=30)
    assert r.status_code == 200 and r.json() == {"offload": False, "residency": "off", "layers": [],
                                                 "moved_experts": 0, "moved_bytes": 0, "host_wait_s": 0.0,
                                                 "updates": 0}
    out = subprocess.run(["curl", "-s", "-w", "\n%{http_code}", "-X", "POST", url + "/residency/reset"],
                         capture_output=True, text=True, timeout=60).stdout
    body, code = out.rsplit("\n", 1)
    assert code == "409" and json.loads(body)["error"]["message"] == "no routed experts in host RAM: nothing to reset"
    text = requests.get(url + "/metrics", timeout=30).text
    assert "llamacpp:tokens_predicted_total 4" in text and "bloomery:expert" not in text and "bloomery:host" not in text
