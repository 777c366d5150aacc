"""Anthropic Messages on one real bloomery-serve (real model), through the anthropic SDK:
messages, streaming events, count_tokens, stop_sequences, tool_result input, and its own error object."""
from __future__ import annotations

import anthropic
import pytest
import requests

pytestmark = [pytest.mark.real_model, pytest.mark.slow]
Q = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


@pytest.fixture(scope="module")
def server(real_server):
    return real_server        # the session's one server (conftest.py: -c 1024 --metrics)


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)


def test_messages(client):
    m = client.messages.create(model="x", max_tokens=8, extra_body={"temperature": 0}, system="You are concise.", messages=Q)
    assert m.role == "assistant" and m.content[0].type == "text" and "Paris" in m.content[0].text
    assert m.stop_reason == "end_turn" and m.usage.output_tokens >= 1
    n = client.messages.count_tokens(model="x", system="You are concise.", messages=Q).input_tokens
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) == n


def test_stream_events(client):
    kinds = []
    with client.messages.stream(model="x", max_tokens=3, messages=[{"role": "user", "content": "Say hello."}]) as s:
        for ev in s:
            kinds.append(ev.type)
        final = s.get_final_message()
    assert kinds[0] == "message_start" and "content_block_delta" in kinds and kinds[-1] == "message_stop"
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 3 and final.content[0].text


def test_stop_sequence(client):
    m = client.messages.create(model="x", max_tokens=16, extra_body={"temperature": 0}, stop_sequences=["ar"], messages=Q)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "ar" and "ar" not in m.content[0].text


def test_tool_result_input_and_tools(client):
    tools = [{"name": "get_weather", "description": "Weather of a city",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather",
                                               "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "22 C, sunny"}]}]
    n_with = client.messages.count_tokens(model="x", messages=msgs, tools=tools).input_tokens
    n_without = client.messages.count_tokens(model="x", messages=msgs[:1]).input_tokens
    assert n_with > n_without + 10
    m = client.messages.create(model="x", max_tokens=6, extra_body={"temperature": 0}, messages=msgs, tools=tools)
    assert m.content and m.stop_reason in ("end_turn", "max_tokens", "tool_use")


@pytest.mark.parametrize("body,words", [
    ({"messages": Q}, "max_tokens"),
    ({"messages": Q, "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}], "max_tokens": 1}, "image"),
    ({"messages": Q, "max_tokens": 1, "tool_choice": {"type": "all"},
      "tools": [{"name": "f", "input_schema": {"type": "object"}}]}, "tool_choice"),
    ({"messages": Q, "max_tokens": 1, "tool_choice": {"type": "any"},
      "tools": [{"name": "f", "input_schema": {"type": "object", "properties": {"x": {"not": {}}}}}]}, "#/properties/x/not"),
])
def test_errors_are_anthropics_object(server, client, body, words):
    r = requests.post(server.url + "/v1/messages", json=body)
    assert r.status_code == 400
    j = r.json()
    assert j["type"] == "error" and j["error"]["type"] == "invalid_request_error" and words in j["error"]["message"]
    if "max_tokens" not in body:
        with pytest.raises(anthropic.BadRequestError):
            client.messages.create(model="x", messages=Q, max_tokens=0)
