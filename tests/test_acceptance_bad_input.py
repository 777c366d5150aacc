"""Issue 2's bad-input acceptance, black-box: each bad request is a clear error by
name, and the same server answers a good request right after it."""
from __future__ import annotations

import json
import struct
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from serve_proc import Served

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.real_model, pytest.mark.slow]


def send(url: str, method: str, path: str, body: bytes | None) -> tuple[int, dict]:
    req = urllib.request.Request(url + path, data=body, method=method, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def server(real_model_path, tmp_path_factory):
    from conftest import load_tool

    path = tmp_path_factory.mktemp("bad") / "tiny.gguf"
    load_tool("make_synthetic").write_synthetic(path, "qwen2", tokenizer_from=str(real_model_path))
    with Served("-m", str(path), "-c", "64") as s:
        yield s


GOOD = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}).encode()

CASES = [
    ("malformed JSON", "POST", "/v1/chat/completions", b'{"messages": [', 400, "invalid_request_error", "parse"),
    ("wrong field type", "POST", "/v1/chat/completions",
     json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}).encode(),
     400, "invalid_request_error", "max_tokens"),
    ("wrong temperature type", "POST", "/completion", json.dumps({"prompt": "x", "temperature": [1]}).encode(),
     400, "invalid_request_error", "temperature"),
    ("prompt longer than the context", "POST", "/completion",
     json.dumps({"prompt": "word " * 600, "n_predict": 1}).encode(), 400, "exceed_context_size_error", "context"),
    ("unknown route", "POST", "/v1/nothing-here", b"{}", 404, "not_found_error", "/v1/nothing-here"),
    ("GET on a POST route", "GET", "/v1/chat/completions", None, 404, "not_found_error", "GET"),
    ("messages not a list", "POST", "/v1/chat/completions", json.dumps({"messages": "hi"}).encode(),
     400, "invalid_request_error", "messages"),
]


@pytest.mark.parametrize("name,method,path,body,status,etype,word", CASES, ids=[c[0] for c in CASES])
def test_bad_request_is_named_and_the_server_goes_on(server, name, method, path, body, status, etype, word):
    code, answer = send(server.url, method, path, body)
    assert code == status, answer
    assert answer["error"]["type"] == etype and answer["error"]["code"] == status
    assert word.lower() in answer["error"]["message"].lower(), answer
    code, answer = send(server.url, "POST", "/v1/chat/completions", GOOD)
    assert code == 200 and answer["choices"][0]["finish_reason"] in ("length", "stop")


def test_absurd_tensor_count_is_refused_by_name(tmp_path):
    bad = tmp_path / "absurd.gguf"
    # magic, version 3, tensor count 2**60, kv count 0: a header that claims more than the file holds
    bad.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 2**60, 0) + b"\0" * 64)
    r = subprocess.run([sys.executable, "-m", "bloomery.supervisor", "-m", str(bad), "--port", "0"], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "tensor count 1152921504606846976" in r.stderr and str(bad) in r.stderr, r.stderr
