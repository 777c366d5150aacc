"""OpenAI Responses on one real bloomery-serve (real model), through the openai SDK:
create / retrieve / delete, streaming events, previous_response_id, store false, background with cancel."""
from __future__ import annotations

import time

import openai
import pytest
import requests

pytestmark = [pytest.mark.real_model, pytest.mark.slow]


@pytest.fixture(scope="module")
def server(real_server):
    return real_server        # the session's one server (conftest.py: -c 1024 --metrics)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def test_create_retrieve_delete(client):
    r = client.responses.create(model="x", input="What is the capital of France? Answer in one word.",
                                temperature=0, max_output_tokens=8)
    assert r.status == "completed" and r.output_text.strip().startswith("Paris")
    assert r.usage.output_tokens >= 1 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_cut_by_max_output_tokens_is_incomplete(client):
    r = client.responses.create(model="x", input="Count from one to fifty in words.", max_output_tokens=2,
                                temperature=0, store=False)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    with pytest.raises(openai.NotFoundError):      # store: false keeps nothing
        client.responses.retrieve(r.id)


def test_stream_events(client):
    kinds, text, done = [], "", None
    for ev in client.responses.create(model="x", input="Say hello.", max_output_tokens=4, stream=True):
        kinds.append(ev.type)
        if ev.type == "response.output_text.delta":
            text += ev.delta
        if ev.type in ("response.completed", "response.incomplete"):
            done = ev.response
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert "response.output_text.done" in kinds and kinds[-1] in ("response.completed", "response.incomplete")
    assert text and done.output_text == text
    assert client.responses.retrieve(done.id).output_text == text


def test_previous_response_id_continues_the_conversation(server, client):
    first = client.responses.create(model="x", input="My name is Ada.", max_output_tokens=3, temperature=0)
    alone = requests.post(server.url + "/v1/responses/input_tokens", json={"input": "What is my name?"}).json()
    cont = requests.post(server.url + "/v1/responses/input_tokens",
                         json={"input": "What is my name?", "previous_response_id": first.id}).json()
    assert cont["input_tokens"] > alone["input_tokens"]
    second = client.responses.create(model="x", input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=2, temperature=0)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == cont["input_tokens"]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="x", input="hi", previous_response_id="resp_gone", max_output_tokens=1)
    assert "resp_gone" in str(e.value)


def test_background_then_cancel(server, client):
    r = client.responses.create(model="x", input="Write a long story about a dragon.", background=True,
                                max_output_tokens=400)
    assert r.status == "queued"
    c = client.responses.cancel(r.id)
    assert c.status == "cancelled"
    assert client.responses.retrieve(r.id).status == "cancelled"
    done = client.responses.create(model="x", input="Say hi.", background=True, max_output_tokens=2)
    deadline = time.monotonic() + 120
    while client.responses.retrieve(done.id).status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert client.responses.retrieve(done.id).status in ("completed", "incomplete")


@pytest.mark.parametrize("body,field", [
    ({"background": True, "store": False}, "background"), ({"background": True, "stream": True}, "background"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"text": {"format": {"type": "xml"}}}, "text"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"not": {}}}}}, "text"),
])
def test_refused_by_name(server, body, field):
    r = requests.post(server.url + "/v1/responses", json={"input": "hi", "max_output_tokens": 1, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
