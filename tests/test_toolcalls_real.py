"""Tool calls, structured output and logit_bias through a real bloomery-serve on the real model,
with the openai SDK. The model is small: calls are forced (tool_choice required / named) so
they are well formed; short max_tokens keep the run modest."""
from __future__ import annotations

import ast
import json

import openai
import pytest
from pydantic import BaseModel, Field

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
                "type": "object", "properties": {"name": {"type": "string", "not": {"const": "x"}}}}}})
    assert "'not' at #/properties/name/not" in str(e.value) and e.value.status_code == 400


class Bounded(BaseModel):
    name: str = Field(min_length=2, max_length=12, pattern=r"^[A-Z][a-z]+$")
    age: int = Field(ge=18, le=99)
    score: float = Field(gt=0, lt=1)
    tags: list[str] = Field(min_length=1, max_length=3)


def test_pydantic_constraints_served_and_kept(client):
    r = client.beta.chat.completions.parse(
        model="m", messages=[{"role": "user", "content": "Invent a person: name, age, a score and tags."}],
        response_format=Bounded, max_tokens=96)
    got = r.choices[0].message.parsed
    assert isinstance(got, Bounded) and 18 <= got.age <= 99 and 0 < got.score < 1


WRITE = [{"type": "function", "function": {
    "name": "write_file", "description": "Write a file",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                   "required": ["path", "content"], "additionalProperties": False}, "strict": True}}]


def test_forced_call_keeps_newlines_and_quotes(client):
    """The issue's case: two lines of Python in a forced call's argument come back whole (the old grammar
    took no escape: no newline, and no double quote). Double quotes and backslashes as the real tokenizer
    writes them: test_grammar_corpus.py (write_file, edit_file)."""
    ask = [{"role": "user", "content": "Write the file hello.py containing the code print('hello') on line 1 and "
                                       "print('bye') on line 2."}]
    r = client.chat.completions.create(model="m", messages=ask, tools=WRITE, tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=64)
    call = r.choices[0].message.tool_calls[0]
    content = json.loads(call.function.arguments)["content"]
    body = ast.parse(content).body
    assert len(content.strip().splitlines()) == 2 and len(body) == 2, content
    assert [ast.literal_eval(stmt.value.args[0]) for stmt in body] == ["hello", "bye"]
