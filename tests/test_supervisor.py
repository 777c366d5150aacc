"""The supervisor's parts: lifecycle machine, gate order, stage processes through their
real entry points, and the zmq client against the real engine loop."""
from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import zmq

from bloomery.engine.model_api import EngineModel
from bloomery.engine.types import EngineRequest, ModelInfo, SamplingParams
from bloomery.http.types import Request
from bloomery.lifecycle import Lifecycle, LifecycleError, Phase, sd_notify
from bloomery.messages import stage as sm
from bloomery.settings import parse
from bloomery.stages import fetch
from bloomery.supervisor import Supervisor, bind_port, runtime_dir
import captures

REPO = Path(__file__).resolve().parents[1]


# -- lifecycle ------------------------------------------------------------------------
def test_lifecycle_gate_follows_the_phase():
    life = Lifecycle(notify_env={})
    for phase in (Phase.FETCH, Phase.PLAN, Phase.LOAD):
        life.advance(phase)
        status, body = life.gate()
        assert status == 503 and body == {"error": {"code": 503, "message": "Loading model",
                                                    "type": "unavailable_error", "phase": phase.value}}
        assert life.health()[0] == 503
    life.advance(Phase.READY)
    assert life.gate() is None and life.health() == (200, {"status": "ok"})
    life.advance(Phase.DRAINING, reason="SIGTERM")
    assert life.gate()[1]["error"]["phase"] == "draining"


@pytest.mark.parametrize("path,bad", [((), Phase.READY), ((Phase.PLAN,), Phase.FETCH),
                                      ((Phase.PLAN, Phase.LOAD, Phase.READY), Phase.LOAD)])
def test_lifecycle_refuses_a_wrong_step(path, bad):
    life = Lifecycle(notify_env={})
    for p in path:
        life.advance(p)
    with pytest.raises(LifecycleError, match=f"cannot go to {bad.value}"):
        life.advance(bad)


def test_a_router_lifecycle_is_ready_at_once():
    life = Lifecycle(notify_env={}, router=True)     # no model: nothing to fetch, plan or load
    life.advance(Phase.READY)
    assert life.gate() is None
    with pytest.raises(LifecycleError, match="cannot go to load"):
        life.advance(Phase.LOAD)


def test_sd_notify_sends_ready(tmp_path):
    addr = str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(addr)
        life = Lifecycle(notify_env={"NOTIFY_SOCKET": addr})
        for p in (Phase.PLAN, Phase.LOAD, Phase.READY):
            life.advance(p)
        got = [s.recv(256) for _ in range(4)]
    assert got[-1].startswith(b"READY=1")
    assert not sd_notify("READY=1", {})


# -- the gate order: OPTIONS, loading 503, API key 401 ---------------------------------
def _req(path="/v1/models", method="GET", headers=None):
    return Request(method, path, {}, headers or {}, b"")


def test_precheck_order_and_keys():
    sup = Supervisor(parse(["-m", "x.gguf", "--api-key", "k1,k2"], {}))
    loading = sup.precheck(_req("/props"))
    assert loading.status == 503 and json.loads(loading.body)["error"]["phase"] == "fetch"
    assert sup.precheck(_req("/props", method="OPTIONS")).status == 200     # preflight, even while loading
    for p in (Phase.PLAN, Phase.LOAD, Phase.READY):
        sup.life.advance(p)
    denied = sup.precheck(_req("/props"))
    assert denied.status == 401 and json.loads(denied.body)["error"]["message"] == "Invalid API Key"
    assert sup.precheck(_req("/props", headers={"authorization": "Bearer k2"})) is None
    assert sup.precheck(_req("/props", headers={"x-api-key": "k1"})) is None
    assert sup.precheck(_req("/health")) is None
    assert sup.precheck(_req("/v1/models")) is None                        # public, as issue 4 asks


def test_draining_answers_503_to_new_requests_before_and_after_the_body():
    sup = Supervisor(parse(["-m", "x.gguf"], {}))
    for p in (Phase.PLAN, Phase.LOAD, Phase.READY):
        sup.life.advance(p)
    assert sup.precheck(_req()) is None
    sup.life.advance(Phase.DRAINING, reason="SIGTERM")
    for r in (sup.precheck(_req()), asyncio.run(sup.dispatch(_req("/completion", "POST")))):
        assert r.status == 503 and json.loads(r.body)["error"]["message"] == "Server is shutting down"


def test_make_app_takes_the_request_defaults_and_switches_from_the_flags():
    from bloomery.front import make_app
    s = parse(["-m", "x.gguf", "--temp", "0", "--top-k", "3", "-n", "9", "--no-slots", "--metrics"], {})
    info = ModelInfo("t", "tiny", 64, 64, 1, 16, 64, "numpy", "-")
    app = make_app(s, None, None, None, info)
    assert (app.sampling_defaults.temperature, app.sampling_defaults.top_k, app.n_predict_default) == (0.0, 3, 9)
    assert app.endpoint_slots is False and app.metrics_requested is True


def test_runtime_dir_is_private_and_port_zero_binds(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    rt = runtime_dir()
    assert rt == str(tmp_path / f"bloomery-{os.getpid()}")
    assert stat.S_IMODE(os.stat(rt).st_mode) == 0o700
    sock = bind_port("127.0.0.1", 0)
    assert sock.getsockname()[1] > 0
    sock.close()


# -- fetch ------------------------------------------------------------------------------
def test_fetch_resolves_split_shards(tmp_path):
    for i in (1, 2, 3):
        (tmp_path / f"m-{i:05d}-of-00003.gguf").write_bytes(b"x" * i)
    path, shards, n_bytes = fetch.resolve(str(tmp_path / "m-00001-of-00003.gguf"))
    assert len(shards) == 3 and n_bytes == 6
    with pytest.raises(fetch.StageRefusal, match="name the first shard"):
        fetch.resolve(str(tmp_path / "m-00002-of-00003.gguf"))
    (tmp_path / "m-00003-of-00003.gguf").unlink()
    with pytest.raises(fetch.StageRefusal, match="shard 3 of 3 .*no such file"):
        fetch.resolve(str(tmp_path / "m-00001-of-00003.gguf"))
    with pytest.raises(fetch.StageRefusal, match="not a regular file"):
        fetch.resolve(str(tmp_path))


def run_stage(name: str, args: dict, tmp_path) -> tuple[int, list]:
    """The stage's real entry point as a process; returns (exit status, its messages)."""
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    addr = f"ipc://{tmp_path}/stage"
    pull.bind(addr)
    proc = subprocess.run([sys.executable, "-m", f"bloomery.stages.{name}", addr, json.dumps(args)],
                          cwd=REPO, capture_output=True, timeout=120)
    msgs = []
    while pull.poll(500):
        msgs.append(sm.decode(pull.recv()))
    ctx.destroy(0)
    return proc.returncode, msgs


def test_fetch_stage_process(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    code, msgs = run_stage("fetch", {"model_file": str(f)}, tmp_path)
    assert code == 0 and sm.FetchDone(str(f), (str(f),), 4) in msgs
    code, msgs = run_stage("fetch", {"model_file": str(tmp_path / "none.gguf")}, tmp_path)
    assert code == 1 and msgs[-1] == sm.Dead("fetch", f"model file {tmp_path / 'none.gguf'}: no such file")


@pytest.mark.real_model
def test_plan_stage_on_the_real_header(real_model_path, tmp_path):
    args = {"model_file": str(real_model_path), "ctx_size": 4096, "parallel": 2, "device": "cpu"}
    code, msgs = run_stage("plan", args, tmp_path)
    done = [m for m in msgs if isinstance(m, sm.PlanDone)]
    assert code == 0 and done, msgs
    assert {k: done[0].facts[k] for k in ("n_ctx", "n_ctx_slot", "n_slots", "backend", "arch")} == \
        {"n_ctx": 4096, "n_ctx_slot": 2048, "n_slots": 2, "backend": "numpy", "arch": "qwen2"}
    assert [r.message for r in done[0].records][:3] == ["plan", "ctx", "parallel"]


@pytest.mark.real_model
def test_plan_stage_facts_carry_the_model_facts_llama_server_reports(real_model_path, tmp_path):
    code, msgs = run_stage("plan", {"model_file": str(real_model_path), "ctx_size": 4096, "device": "cpu"}, tmp_path)
    planned = next(m for m in msgs if isinstance(m, sm.PlanDone))
    facts = planned.facts
    ref = captures.response("v1_models")
    meta = ref["data"][0]["meta"]           # llama-server's answer on this very file
    assert (facts["n_embd"], facts["vocab_type"], facts["ftype"], facts["n_params"], facts["size_bytes"]) == \
        (meta["n_embd"], meta["vocab_type"], meta["ftype"], meta["n_params"], meta["size"])
    from bloomery.stages.engine import model_info
    model = type("M", (), {"arch": "qwen2", "n_vocab": 151936, "n_ctx_train": 32768})()
    info = model_info({"model_file": str(real_model_path)}, facts, planned.placement, model)
    assert (info.n_embd, info.vocab_type, info.ftype, info.n_params, info.size_bytes) == \
        (896, 2, "Q4_K - Medium", meta["n_params"], meta["size"])


def test_ftype_name_as_llama_cpp_names_and_guesses_it():
    from bloomery.stages.meta import ftype_name
    assert ftype_name(15, []) == "Q4_K - Medium" and ftype_name(1, []) == "F16"
    assert ftype_name(1024 | 7, []) == "(guessed) Q8_0"
    assert ftype_name(None, ["F32", "Q6_K", "Q4_K", "Q4_K", "F32", "F32"]) == "(guessed) all F32"  # most tensors
    assert ftype_name(None, ["Q4_K", "Q6_K", "Q4_K"]) == "(guessed) Q4_K - Medium"
    assert ftype_name(None, ["IQ9_Z"]) == "(guessed) all F32"        # a type llama.cpp does not map


@pytest.mark.real_model
def test_plan_stage_parallel_auto_is_the_plan_modules_rule(real_model_path):
    from bloomery.gguf_file import open_gguf
    from bloomery.plan import Census, make_plan, model_facts
    from bloomery.stages import plan as plan_stage
    census = Census(host_avail_bytes=64 << 30)
    with open_gguf(str(real_model_path)) as gf:
        plan, _ = plan_stage.make({"parallel": "auto", "device": "cpu", "slot_ctx": 2048}, gf, census)
        want = make_plan(model_facts(gf), census, "numpy", 0, "auto", 2048)
        plain, _ = plan_stage.make({"parallel": "auto", "device": "cpu"}, gf, census)
    assert plan == want and plan.parallel_from == "auto"
    assert plain.ctx_rule == "target" and plain.n_ctx_slot == 32768     # one request's context, as the plan says


@pytest.mark.real_model
@pytest.mark.parametrize("extra,match", [({"seat": "qwen3"}, "--seat qwen3: the file .* is 'qwen2'"),
                                         ({"ngl": "10"}, "-ngl 10: a count below the file's layers \\+ 1 \\(25\\)"),
                                         ({"ctx_size": 10**9}, "--ctx-size 1000000000 .* does not fit")])
def test_plan_stage_refusals(real_model_path, tmp_path, extra, match):
    code, msgs = run_stage("plan", {"model_file": str(real_model_path), "device": "cpu", **extra}, tmp_path)
    assert code == 1 and isinstance(msgs[-1], sm.Dead)
    assert __import__("re").search(match, msgs[-1].reason), msgs[-1].reason


@pytest.mark.real_model
def test_plan_stage_refuses_a_truncated_file(real_model_path, tmp_path):
    cut = tmp_path / "cut.gguf"
    with open(real_model_path, "rb") as r:
        cut.write_bytes(r.read(1 << 20))      # the header is whole, the tensor data is not
    code, msgs = run_stage("plan", {"model_file": str(cut), "device": "cpu"}, tmp_path)
    assert code == 1 and isinstance(msgs[-1], sm.Dead) and str(cut) in msgs[-1].reason


# -- the zmq client against the real engine loop -----------------------------------------
class TinyModel(EngineModel):
    """A stand-in model (not the thing under test): logits favour (last id + 1) % V."""
    n_vocab, n_ctx_train, arch = 16, 64, "tiny"

    def __init__(self):
        self.last = {}
        self.n_decode = 0

    def prefill(self, slot, ids, pos0):
        self.last[slot] = int(ids[-1])
        return self._row(self.last[slot])

    def decode(self, slots, ids, positions):
        import time

        import numpy as np
        self.n_decode += 1
        time.sleep(0.01)        # a step takes time, so a cancel lands mid-generation
        return np.stack([self._row(int(i)) for i in ids])

    def _row(self, last):
        import numpy as np
        row = np.zeros(self.n_vocab, dtype=np.float32)
        row[(last + 1) % self.n_vocab] = 10.0
        return row


def test_zmq_client_and_engine_loop(tmp_path):
    import zmq.asyncio
    from bloomery.engine.core import Engine
    from bloomery.stages import engine as stage_engine
    from bloomery.zmq_client import ZmqEngineClient

    async def main():
        ctx = zmq.asyncio.Context()
        client = ZmqEngineClient(ctx, f"ipc://{tmp_path}/req", f"ipc://{tmp_path}/out")
        client.info = ModelInfo("t", "tiny", 64, 64, 1, 16, 64, "numpy", "-")
        client.start()
        sync = zmq.Context()
        inbox, stop = __import__("queue").Queue(), threading.Event()
        reader = threading.Thread(target=stage_engine._input_thread,
                                  args=(sync, f"ipc://{tmp_path}/req", inbox, stop), daemon=True)
        reader.start()
        push = sync.socket(zmq.PUSH)
        push.connect(f"ipc://{tmp_path}/out")
        result, model = {}, TinyModel()
        loop = threading.Thread(target=lambda: result.setdefault(
            "why", stage_engine.serve(Engine(model, 1, 64), inbox, push, os.getppid())), daemon=True)
        loop.start()
        assert await client.wait_hello(10)
        greedy = SamplingParams(temperature=0.0)
        outs = [o async for o in client.generate(EngineRequest("a", (3,), 4, greedy))]
        assert [o.token for o in outs] == [4, 5, 6, 7] and outs[-1].finish == "length"
        gen = client.generate(EngineRequest("b", (1,), -1, greedy))
        first = await gen.__anext__()
        await gen.aclose()                       # leaving early cancels in the engine
        assert first.token == 2
        for _ in range(100):
            slots = await client.query_slots()
            if not slots[0]["is_processing"]:
                break
            await asyncio.sleep(0.05)
        assert [(e["id"], e["is_processing"], e["req_id"]) for e in slots] == [(0, False, "b")]
        assert slots[0]["next_token"][0]["has_next_token"] is False
        assert model.n_decode < 3 + 30, "the cancel stopped request b long before its slot filled (62 steps)"
        # stopping: end_all ends a request still generating with "shutdown", naming why
        gen = client.generate(EngineRequest("d", (1,), -1, greedy))
        assert (await gen.__anext__()).token == 2 and client.n_in_flight == 1
        client.end_all("the server is shutting down (SIGTERM)")
        rest = [o async for o in gen]
        assert rest[-1].finish == "shutdown" and rest[-1].error == "the server is shutting down (SIGTERM)"
        assert client.n_in_flight == 0
        await client.shutdown("test")
        loop.join(10)
        assert result["why"] == "shutdown: test"
        client.fail_all("engine gone")
        after = [o async for o in client.generate(EngineRequest("c", (1,), 2, greedy))]
        assert after[-1].finish == "error" and "engine gone" in after[-1].error
        stop.set()
        reader.join(5)
        push.close(0)
        sync.destroy(0)
        client.close()
        ctx.destroy(0)

    asyncio.run(asyncio.wait_for(main(), 60))
