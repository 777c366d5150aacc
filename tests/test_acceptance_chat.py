"""Issue 2's acceptance on the real model: greedy chat text equal to llama-server's.

The expected answers in tests/golden/chat/expected.json come from llama.cpp's
llama-server on the same file (tools/ref/make_chat_goldens.py, cache_prompt
false, temperature 0). Here the real bloomery-serve answers the same requests
through the openai SDK; a live comparison is in test_live_reference.py.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from serve_proc import Served

GOLDEN = Path(__file__).parent / "golden" / "chat"
pytestmark = [pytest.mark.real_model, pytest.mark.slow]


@pytest.fixture(scope="module")
def server(real_model_path):
    with Served("-m", str(real_model_path), "-c", "4096") as s:
        yield s


def cases():
    requests = json.loads((GOLDEN / "requests.json").read_text())
    return [pytest.param(c, id=c["name"]) for c in requests]


@pytest.mark.parametrize("case", cases())
def test_greedy_chat_equals_llama_server(server, case):
    import openai

    expected = json.loads((GOLDEN / "expected.json").read_text())[case["name"]]
    body = dict(case["body"])
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    r = client.chat.completions.create(model="any", messages=body.pop("messages"),
                                       temperature=body.pop("temperature"), max_tokens=body.pop("max_tokens"),
                                       extra_body=body)
    assert r.choices[0].message.content == expected["content"]
    assert r.choices[0].finish_reason == expected["finish_reason"]
    assert r.usage.prompt_tokens == expected["usage"]["prompt_tokens"]
    assert r.usage.completion_tokens == expected["usage"]["completion_tokens"]


def test_apply_template_equals_llama_server(server):
    import urllib.request

    expected = json.loads((GOLDEN / "expected.json").read_text())
    for case in json.loads((GOLDEN / "requests.json").read_text()):
        req = urllib.request.Request(server.url + "/apply-template",
                                     data=json.dumps({"messages": case["body"]["messages"]}).encode())
        with urllib.request.urlopen(req, timeout=30) as r:
            assert json.loads(r.read())["prompt"] == expected[case["name"]]["prompt"], case["name"]


def test_openai_stream_matches_non_stream(server):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    msgs = [{"role": "user", "content": "Say hello in three languages."}]
    whole = client.chat.completions.create(model="m", messages=msgs, temperature=0, max_tokens=24)
    parts = []
    for chunk in client.chat.completions.create(model="m", messages=msgs, temperature=0, max_tokens=24, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
    assert len(parts) > 1, "a stream arrives in pieces"
    assert "".join(parts) == whole.choices[0].message.content


def test_curl_gets_sse(server):
    body = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0,
                       "stream": True})
    out = subprocess.run(["curl", "-sN", "--max-time", "120", server.url + "/v1/chat/completions", "-d", body],
                         capture_output=True, text=True, check=True).stdout
    events = [line for line in out.splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    first = json.loads(events[0][6:])
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"]["role"] == "assistant"
