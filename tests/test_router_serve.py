"""Router mode end to end: bloomery-serve with no model and a --models-dir of two synthetic files starts a
child bloomery-serve per model on demand and routes each request by its "model" (real processes, sockets).

Each child start is a few seconds (--no-warmup), so one router serves several checks in order."""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from conftest import load_tool
from serve_proc import Served

pytestmark = pytest.mark.slow
TIMEOUT_S = 180
CHILD_FLAGS = ("-c", "256", "--no-warmup")


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory, tokenizer_source) -> Path:
    folder = tmp_path_factory.mktemp("router-models")
    make = load_tool("make_synthetic").write_synthetic
    make(folder / "alpha.gguf", "qwen2", tokenizer_from=str(tokenizer_source))
    make(folder / "beta.gguf", "qwen3", tokenizer_from=str(tokenizer_source))
    return folder


@pytest.fixture
def empty_caches(tmp_path) -> dict[str, str]:
    """No cached model beside the --models-dir: the listing is the folder's two."""
    return {"BLOOMERY_CACHE": str(tmp_path / "bloomery"), "LLAMA_CACHE": str(tmp_path / "llama"),
            "HF_HUB_CACHE": str(tmp_path / "hub")}


def call(server: Served, method: str, path: str, body: dict | None = None,
         headers: dict | None = None) -> tuple[int, dict | bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(server.url + path, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as r:
            status, raw, kind = r.status, r.read(), r.headers.get("content-type", "")
    except urllib.error.HTTPError as e:
        status, raw, kind = e.code, e.read(), e.headers.get("content-type", "")
    return status, json.loads(raw) if "json" in kind else raw


def statuses(server: Served, headers: dict | None = None) -> dict[str, str]:
    status, body = call(server, "GET", "/models", headers=headers)
    assert status == 200
    return {m["id"]: m["status"]["value"] for m in body["data"]}


def wait_status(server: Served, name: str, want: str, headers: dict | None = None) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while statuses(server, headers)[name] != want:
        assert time.monotonic() < deadline, f"{name} never became {want}"
        time.sleep(0.1)


def chat(model: str, **kw) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3, **kw}


def test_router_routes_by_model_within_the_cap(models_dir, empty_caches):
    with Served("--models-dir", str(models_dir), "--models-max", "1", *CHILD_FLAGS, env=empty_caches) as server:
        status, props = call(server, "GET", "/props")
        assert status == 200 and props["role"] == "router" and props["max_instances"] == 1
        assert props["models_autoload"] is True and props["build_info"].startswith("b")
        status, listing = call(server, "GET", "/v1/models")
        assert {m["id"]: (m["status"]["value"], m["source"]) for m in listing["data"]} == {
            "alpha": ("unloaded", "models_dir"), "beta": ("unloaded", "models_dir")}

        # unknown and missing names: llama-server's 400s, and no child is started for them
        assert call(server, "POST", "/v1/chat/completions", chat("nope")) == (400, {"error": {
            "code": 400, "message": "model 'nope' not found", "type": "invalid_request_error"}})
        status, body = call(server, "POST", "/completion", {"prompt": "hi"})
        assert status == 400 and body["error"]["message"] == "model name is missing from the request"
        assert call(server, "POST", "/models/load", {"model": "nope"})[0] == 404

        # the first request loads alpha (autoload) and is answered by alpha's child
        status, body = call(server, "POST", "/v1/chat/completions", chat("alpha"))
        assert status == 200 and body["model"] == "alpha" and body["usage"]["completion_tokens"] == 3
        assert statuses(server) == {"alpha": "loaded", "beta": "unloaded"}
        status, listing = call(server, "GET", "/models")
        alpha = next(m for m in listing["data"] if m["id"] == "alpha")
        assert "--alias" in alpha["status"]["args"] and str(models_dir / "alpha.gguf") in alpha["status"]["args"]

        # a stream for beta passes through chunk by chunk; the cap of 1 unloads alpha (least recently used)
        status, raw = call(server, "POST", "/v1/chat/completions", chat("beta", stream=True))
        events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
        assert status == 200 and events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert {c["model"] for c in chunks} == {"beta"} and chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert statuses(server) == {"alpha": "unloaded", "beta": "loaded"}

        # GET routes are named by ?model=
        status, body = call(server, "GET", "/props?model=beta")
        assert status == 200 and body["model_alias"] == "beta"
        status, body = call(server, "POST", "/tokenize", {"model": "beta", "content": "hello world"})
        assert status == 200 and len(body["tokens"]) == 2

        assert call(server, "POST", "/models/load", {"model": "beta"}) == (400, {"error": {
            "code": 400, "message": "model is already running", "type": "invalid_request_error"}})
        assert call(server, "POST", "/models/unload", {"model": "beta"}) == (200, {"success": True})
        wait_status(server, "beta", "unloaded")
        assert call(server, "POST", "/models/unload", {"model": "beta"})[1]["error"]["message"] == \
            "model is not running"
        port = int(alpha["status"]["args"][alpha["status"]["args"].index("--port") + 1])
    with pytest.raises(OSError):      # the router's stop ended its children
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)


def test_router_without_autoload_loads_on_request_and_keeps_two(models_dir, empty_caches):
    key = {"Authorization": "Bearer sk-router-test"}
    with Served("--models-dir", str(models_dir), "--models-max", "2", "--no-models-autoload", *CHILD_FLAGS,
                env={**empty_caches, "LLAMA_API_KEY": "sk-router-test"}) as server:
        assert call(server, "POST", "/v1/chat/completions", chat("alpha"))[0] == 401
        assert call(server, "POST", "/v1/chat/completions", chat("alpha"), key) == (400, {"error": {
            "code": 400, "message": "model is not loaded", "type": "invalid_request_error"}})
        for name in ("alpha", "beta"):
            assert call(server, "POST", "/models/load", {"model": name}, key) == (200, {"success": True})
        wait_status(server, "alpha", "loaded", key)
        wait_status(server, "beta", "loaded", key)
        for name in ("alpha", "beta"):       # under a cap of 2 both stay; the child checks the key too
            status, body = call(server, "POST", "/completion", {"model": name, "prompt": "hi", "n_predict": 2}, key)
            assert status == 200 and body["model"] == name and body["tokens_predicted"] == 2
        assert statuses(server, key) == {"alpha": "loaded", "beta": "loaded"}


def test_router_presets_start_their_children_with_their_options_and_reload(models_dir, empty_caches, tmp_path):
    """--models-preset: a preset's options reach its child under the router's own flags; a reload unloads a
    running preset that changed and lists the new file's models; a refused option refuses its model by name."""
    ini = tmp_path / "presets.ini"
    ini.write_text(f"[*]\nc = 512\n\n[first]\nmodel = {models_dir / 'alpha.gguf'}\nseed = 11\n"
                   f"no-slots = 1\n\n[alpha]\nn-predict = 2\n")
    with Served("--models-preset", str(ini), "--models-dir", str(models_dir), *CHILD_FLAGS,
                env=empty_caches) as server:
        status, listing = call(server, "GET", "/models")
        sources = {m["id"]: m["source"] for m in listing["data"]}
        assert sources == {"alpha": "preset", "beta": "models_dir", "first": "preset"}
        status, body = call(server, "POST", "/completion", {"model": "first", "prompt": "hi", "n_predict": 2})
        assert status == 200 and body["model"] == "first" and body["tokens_predicted"] == 2
        first = next(m for m in call(server, "GET", "/models")[1]["data"] if m["id"] == "first")
        args = first["status"]["args"]
        assert args[args.index("-c") + 1] == "256"                # the router's command line wins over [*]
        assert args[args.index("--seed") + 1] == "11" and "--no-slots" in args
        assert call(server, "GET", "/slots?model=first")[0] == 501           # no-slots reached the child
        status, body = call(server, "POST", "/completion", {"model": "alpha", "prompt": "hi"})
        assert status == 200 and body["tokens_predicted"] == 2                # [alpha]'s n-predict

        ini.write_text(f"[first]\nmodel = {models_dir / 'beta.gguf'}\n\n[third]\nmodel = {models_dir / 'alpha.gguf'}\n"
                       "model-draft = /nowhere/draft.gguf\n")
        status, listing = call(server, "GET", "/models?reload=1")
        assert status == 200
        now = {m["id"]: m["status"]["value"] for m in listing["data"]}
        # first's model changed and alpha lost its section: both were unloaded; beta and third were never loaded
        assert now == {"alpha": "unloaded", "beta": "unloaded", "first": "unloaded", "third": "unloaded"}
        assert {m["id"]: m["source"] for m in listing["data"]}["alpha"] == "models_dir"
        status, body = call(server, "POST", "/completion", {"model": "third", "prompt": "hi", "n_predict": 1})
        assert status == 501 and "'model-draft' (--model-draft) is refused" in body["error"]["message"]
        status, body = call(server, "POST", "/completion", {"model": "first", "prompt": "hi", "n_predict": 1})
        assert status == 200 and body["model"] == "first"
        first = next(m for m in call(server, "GET", "/models")[1]["data"] if m["id"] == "first")
        assert str(models_dir / "beta.gguf") in first["status"]["args"]
