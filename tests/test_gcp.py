"""Vertex AI prediction mode (AIP_MODE=PREDICTION): the predict route's names and one real bloomery-serve."""
from __future__ import annotations

import socket

import pytest
import requests

from bloomery.api.gcp import GcpMode, aliases, camel_name, from_env
from bloomery.settings import SettingsError, parse
from serve_proc import Served


def test_camel_names_as_llama_server():
    assert camel_name("/v1/chat/completions") == "chatCompletions"
    assert camel_name("/completion") == "completion"
    assert camel_name("/apply-template") == "applyTemplate"
    assert camel_name("/v1/messages/count_tokens") == "messagesCountTokens"
    assert camel_name("/slots/:id_slot") == "slots"
    assert aliases(["/v1/chat/completions", "/chat/completions"]) == {"chatCompletions": "/v1/chat/completions"}


def test_mode_from_env():
    assert from_env({}) is None and from_env({"AIP_MODE": "TRAINING"}) is None
    assert from_env({"AIP_MODE": "PREDICTION"}) == GcpMode("/predict", "")
    assert from_env({"AIP_MODE": "PREDICTION", "AIP_PREDICT_ROUTE": "p", "AIP_HEALTH_ROUTE": "/h"}) == GcpMode("/p", "/h")


def test_port_from_env_and_refusals():
    env = {"AIP_MODE": "PREDICTION", "AIP_HTTP_PORT": "9123"}
    assert parse(["-m", "m.gguf", "--port", "8080"], env).port == 9123
    assert parse(["-m", "m.gguf"], {"AIP_MODE": "PREDICTION"}).port == 8080
    with pytest.raises(SettingsError, match="AIP_HTTP_PORT='x'"):
        parse(["-m", "m.gguf"], {**env, "AIP_HTTP_PORT": "x"})
    with pytest.raises(SettingsError, match="AIP_PREDICT_ROUTE=/completion is one of this server's routes"):
        parse(["-m", "m.gguf"], {**env, "AIP_PREDICT_ROUTE": "/completion"})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(real_model_path):
    env = {"AIP_MODE": "PREDICTION", "AIP_HTTP_PORT": str(_free_port()), "AIP_HEALTH_ROUTE": "/aip-health"}
    with Served("-m", str(real_model_path), "-c", "1024", "-np", "2", "--temp", "0", "--no-warmup", env=env) as s:
        yield s


@pytest.mark.real_model
def test_predict_runs_every_instance(server):
    chat = {"max_tokens": 3, "messages": [{"role": "user", "content": "Say hello"}]}
    r = requests.post(server.url + "/predict", timeout=300, json={"instances": [
        {"@requestFormat": "chatCompletions", **chat},
        {"@requestFormat": "/completion", "prompt": "Hello", "n_predict": 2, "stream": True},
        {"@requestFormat": "tokenize", "content": "Hello"},
        {"@requestFormat": "nope"},
        {"max_tokens": 3},
        "x",
    ]})
    assert r.status_code == 200, r.text
    p = r.json()["predictions"]
    assert p[0]["choices"][0]["message"]["role"] == "assistant" and p[0]["choices"][0]["message"]["content"]
    assert p[1]["tokens_predicted"] == 2 and isinstance(p[1]["content"], str)     # never streamed
    assert p[2] == requests.post(server.url + "/tokenize", json={"content": "Hello"}, timeout=30).json()
    assert p[3]["error"]["message"] == "no handler registered for @requestFormat: nope"
    assert p[4]["error"]["message"] == "each instance must include a string @requestFormat"
    assert p[5]["error"]["message"] == "each instance must be a JSON object"
    assert requests.get(server.url + "/aip-health", timeout=30).json() == {"status": "ok"}


@pytest.mark.real_model
@pytest.mark.parametrize("body, says", [
    ([], "must be a JSON object"),
    ({"instances": {}}, "array field named instances"),
    ({"instances": [{}] * 129}, "exceeds maximum size of 128"),
])
def test_predict_refuses_bad_bodies(server, body, says):
    r = requests.post(server.url + "/predict", json=body, timeout=60)
    assert r.status_code == 400 and says in r.json()["error"]["message"]
