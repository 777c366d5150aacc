"""Tool calls, structured output and logit_bias through a real bloomery-serve on the real model,
with the openai SDK. The model is small: calls are forced (tool_choice required / named) so
they are well formed; short max_tokens keep the run modest."""
from __future__ import annotations

import json

import openai
import pytest
from pydantic import BaseModel

pytestmark = [pytest.mark.real_model]

WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"},
                                                     "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}]
ASK = [{"role": "user", "content": "What's the weather like in Paris right now?"}]


@pytest.fixture(scope="module")
def client(real_server):       # the session's one server (conftest.py)
    return openai.OpenAI(base_url=real_server.url + "/v1", api_key="none", max_retries=0, timeout=600)


def test_forced_call_not_streamed(client):
    r = client.chat.completions.create(model="m", messages=ASK, tools=WEATHER, tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=48)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls", ch
    call = ch.message.tool_calls[0]
    assert call.function.name == "get_weather" and len(call.id) == 32
    args = json.loads(call.function.arguments)
    assert isinstance(args["city"], str) and set(args) <= {"city", "unit"}
    assert not ch.message.content


def test_named_call_streamed_as_deltas(client):
    stream = client.chat.completions.create(
        model="m", messages=ASK, tools=WEATHER, stream=True, max_tokens=48, parallel_tool_calls=False,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    firsts, args, finish = [], "", None
    for chunk in stream:
        for tc in chunk.choices[0].delta.tool_calls or []:
            if tc.id:
                firsts.append((tc.index, tc.type, tc.function.name))
            args += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert firsts == [(0, "function", "get_weather")]
    assert finish == "tool_calls"
    assert "city" in json.loads(args)


class Person(BaseModel):
    name: str
    age: int


def test_json_schema_parsed_by_the_sdk(client):
    r = client.beta.chat.completions.parse(
        model="m", messages=[{"role": "user", "content": "Invent a person and give their name and age as JSON."}],
        response_format=Person, max_tokens=48)
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and person.name
    assert r.choices[0].finish_reason == "stop"


def test_json_object_is_an_object(client):
    r = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Give me a JSON object with one key x set to 1."}],
        response_format={"type": "json_object"}, max_tokens=32)
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_unsupported_schema_keyword_refused_by_name(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=ASK, max_tokens=8, response_format={
            "type": "json_schema", "json_schema": {"name": "p", "schema": {
                "type": "object", "properties": {"name": {"type": "string", "minLength": 2}}}}})
    assert "minLength" in str(e.value) and e.value.status_code == 400


def test_logit_bias_bans_the_greedy_pick(client):
    base = client.chat.completions.create(model="m", messages=ASK, max_tokens=1, temperature=0, logprobs=True)
    first = base.choices[0].message.content
    tok = client.with_options().post("/../tokenize", body={"content": first}, cast_to=object)["tokens"][0]
    again = client.chat.completions.create(model="m", messages=ASK, max_tokens=1, temperature=0,
                                           logit_bias={str(tok): -100})
    assert again.choices[0].message.content != first
