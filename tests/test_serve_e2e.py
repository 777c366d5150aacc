"""Black-box: the real bloomery-serve process, its stages, signals and exits."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

from serve_proc import Served

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.real_model, pytest.mark.slow]


def get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def serve_cmd(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bloomery.supervisor", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout_s)


def stage_pids(proc: subprocess.Popen) -> list[psutil.Process]:
    return psutil.Process(proc.pid).children(recursive=True)


@pytest.fixture(scope="module")
def tiny_model(real_model_path, tmp_path_factory) -> Path:
    """A small random qwen2 with the real tokenizer: the plumbing tests load it in a second."""
    from conftest import load_tool
    path = tmp_path_factory.mktemp("serve") / "tiny_qwen2.gguf"
    load_tool("make_synthetic").write_synthetic(path, "qwen2", tokenizer_from=str(real_model_path))
    return path


def test_real_model_loading_gate_chat_stream_and_sigterm(real_model_path):
    import openai

    s = Served("-m", str(real_model_path), "-c", "4096", "--top-k", "7", "--seed", "11").start(wait_ready=False)
    try:
        status, body = get(s.url + "/health")      # bound before fetch: a client sees the phase, not ECONNREFUSED
        assert status == 503 and body["error"]["message"] == "Loading model", body
        assert body["error"]["type"] == "unavailable_error" and body["error"]["phase"] in ("fetch", "plan", "load")
        s.wait_ready()
        assert get(s.url + "/health") == (200, {"status": "ok"})
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", timeout=300)
        msgs = [{"role": "user", "content": "Say hi"}]
        r = client.chat.completions.create(model="m", messages=msgs, temperature=0, max_tokens=8)
        assert r.choices[0].message.content and r.usage.completion_tokens <= 8
        parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="m", messages=msgs, temperature=0, max_tokens=8, stream=True) if c.choices]
        assert "".join(parts) == r.choices[0].message.content
        meta = get(s.url + "/v1/models")[1]["data"][0]["meta"]      # the facts as llama-server reports this file
        assert (meta["n_embd"], meta["vocab_type"], meta["ftype"], meta["n_params"], meta["size"]) == \
            (896, 2, "Q4_K - Medium", 630167424, 485452288)
        params = get(s.url + "/props")[1]["default_generation_settings"]["params"]
        assert (params["top_k"], params["seed"]) == (7, 11)            # the flags set the request defaults
        status, slots = get(s.url + "/slots")
        assert status == 200 and len(slots) == 1 and slots[0]["id_task"] >= 0
        assert slots[0]["params"]["top_k"] == 7 and slots[0]["params"]["n_predict"] == 8
        children = stage_pids(s.proc)
        # the engine, and the front's parser and tokenizer processes (bloomery/workpool.py, multiprocessing spawn)
        lines = sorted(" ".join(c.cmdline()) for c in children)
        assert [x for x in lines if "bloomery.stages.engine" in x] and \
            all("bloomery.stages.engine" in x or "from multiprocessing." in x for x in lines), lines
    finally:
        code = s.stop()
    assert code == 0, "\n".join(s.lines)
    assert any("stopping cause=SIGTERM" in line for line in s.lines)
    time.sleep(0.2)
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]


def test_engine_killed_ends_the_server_naming_it(tiny_model):
    with Served("-m", str(tiny_model), "-c", "256") as s:
        engine = [c for c in stage_pids(s.proc) if "bloomery.stages.engine" in " ".join(c.cmdline())]
        assert len(engine) == 1
        engine[0].send_signal(signal.SIGKILL)
        code = s.proc.wait(timeout=60)
    assert code == 70, "\n".join(s.lines)
    died = [line for line in s.lines if "engine died" in line]
    assert died and "SIGKILL" in died[0] and "engine" in died[0]


def test_sigint_during_load_exits_zero_and_leaves_no_child(tiny_model):
    s = Served("-m", str(tiny_model), "-c", "256").start(wait_ready=False)
    s.proc.send_signal(signal.SIGINT)
    assert s.proc.wait(timeout=60) == 0, "\n".join(s.lines)
    time.sleep(0.5)
    assert any("stopping cause=SIGINT" in line for line in s.lines)
    assert not [p for p in psutil.process_iter(["cmdline"])
                if p.info["cmdline"] and "bloomery.stages" in " ".join(p.info["cmdline"])
                and str(tiny_model) in " ".join(p.info["cmdline"])]


def test_plan_prints_records_and_exits_without_loading(real_model_path):
    r = serve_cmd("-m", str(real_model_path), "-c", "4096", "--plan")
    assert r.returncode == 0, r.stderr
    assert "[plan] plan: ctx n_ctx_slot=4096 n_ctx=4096 rule=set" in r.stderr
    assert "[plan] plan: parallel slots=1" in r.stderr
    assert "stages.engine" not in r.stderr and "loading weights" not in r.stderr and "listening" not in r.stderr


def test_truncated_gguf_is_refused_at_plan(real_model_path, tmp_path):
    cut = tmp_path / "cut.gguf"
    with open(real_model_path, "rb") as f:
        cut.write_bytes(f.read(4096))
    r = serve_cmd("-m", str(cut), "--port", "0")
    assert r.returncode == 1, r.stderr
    failed = [line for line in r.stderr.splitlines() if "stage failed" in line]
    assert failed and "stage=plan" in failed[0] and str(cut) in failed[0], r.stderr


@pytest.mark.parametrize("args,match", [(["-m", "x.gguf", "--bogus"], "unknown flag '--bogus'"),
                                        (["-m", "x.gguf", "-c", "1", "-c", "2"], "given twice"),
                                        (["-m", "/nonexistent/m.gguf", "--port", "0"], "no such file")])
def test_refusals_end_the_start_by_name(args, match):
    r = serve_cmd(*args)
    assert r.returncode == 1 and match in r.stderr, r.stderr


def test_supervisor_killed_takes_the_engine_with_it(tiny_model):
    s = Served("-m", str(tiny_model), "-c", "256").start()
    children = stage_pids(s.proc)
    assert children
    s.proc.kill()                     # no handler runs: the kernel's parent-death signal must end the engine
    s.proc.wait(timeout=10)
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, [c.cmdline() for c in alive]


def test_sigterm_mid_stream_ends_it_cleanly_and_refuses_new_requests(tiny_model):
    import http.client
    import threading

    s = Served("-m", str(tiny_model), "-c", "4096", "--drain-timeout", "8").start()
    conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=60)
    conn.request("POST", "/completion", json.dumps({"prompt": "Hello", "n_predict": 100000, "ignore_eos": True,
                                                    "stream": True}), {"content-type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    first = resp.readline()
    assert first.startswith(b"data: "), first
    t_signal = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)
    got: dict = {}

    def read_rest():   # http.client raises IncompleteRead if the chunked body is cut
        try:
            got["body"] = resp.read()
        except Exception as e:
            got["error"] = repr(e)
    reader = threading.Thread(target=read_rest)
    reader.start()
    time.sleep(1.0)
    status, body = get(s.url + "/health")          # the port stays open through the drain: a 503, not ECONNREFUSED
    assert status == 503 and body["error"]["message"] == "Server is shutting down", body
    reader.join(30)
    code = s.proc.wait(timeout=30)
    assert "error" not in got, got
    events = [json.loads(block[6:]) for block in got["body"].split(b"\n\n") if block.startswith(b"data: ")]
    last = events[-1]
    assert last["error"]["code"] == 503 and "shutting down (SIGTERM)" in last["error"]["message"], last
    assert 7.5 < time.monotonic() - t_signal < 25, "the drain gave the stream about 8 s (--drain-timeout)"
    assert code == 0, "\n".join(s.lines)
    assert any("ending requests still generating" in line for line in s.lines)


@pytest.mark.parametrize("value,shown", [(None, "value=on"), ("off", "value=off")])
def test_kernel_order_lever_is_read_and_recorded(tiny_model, value, shown):
    env = {"BLOOMERY_KERNEL_ORDER": value} if value else {}
    s = Served("-m", str(tiny_model), "-c", "256", env=env)
    if not value:
        s.env.pop("BLOOMERY_KERNEL_ORDER", None)
    with s:
        lever = [line for line in s.lines if "BLOOMERY_KERNEL_ORDER" in line]
    assert lever and shown in lever[0], s.lines


def test_threads_flag_sets_the_cpu_backends_threads(tiny_model):
    """-t as llama-server: the CPU threads the engine computes with."""
    s = Served("-m", str(tiny_model), "-c", "256", "-t", "1")
    s.env.pop("BLOOMERY_NUMPY_THREADS", None)
    with s:
        got = [line for line in s.lines if "engine: threads" in line]
    assert got and "threads=1" in got[0], s.lines


@pytest.mark.parametrize("flag,warmed", [((), True), (("--no-warmup",), False)])
def test_warmup_prepares_the_weights_at_load_unless_told_not_to(tiny_model, flag, warmed):
    with Served("-m", str(tiny_model), "-c", "256", *flag) as s:
        lines = list(s.lines)
    assert any("[load] engine: warmup" in line for line in lines) == warmed, lines
