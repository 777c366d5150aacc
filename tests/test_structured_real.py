"""Structured output on every route through a real bloomery-serve on the real model: Anthropic's
forced tool_choice (any / tool), the Responses API's text.format and forced tools, /completion's
grammar and json_schema fields, and the whole schema corpus (tests/schema_corpus.py): every
document the model writes under each schema parses and validates with the jsonschema package."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import anthropic
import jsonschema
import openai
import pytest
import requests

from bloomery.grammar import Vocab, schema_grammar
from schema_corpus import CORPUS
from test_grammar_corpus import run
from serve_proc import Served

pytestmark = [pytest.mark.real_model]
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
           "additionalProperties": False}
V = jsonschema.Draft202012Validator


CORPUS_AT_ONCE = 4      # the corpus's documents are asked this many at a time (each slot's context: 8192 / 4)


@pytest.fixture(scope="module")
def server(real_model_path):
    with Served("-m", str(real_model_path), "-c", "8192", "-np", str(CORPUS_AT_ONCE)) as s:
        yield s


def test_anthropic_any_and_named_tool_are_forced(server):
    a = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=600)
    tools = [{"name": "get_weather", "description": "Current weather", "input_schema": WEATHER}]
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
        m = a.messages.create(model="m", max_tokens=40, tools=tools, tool_choice=choice,
                              messages=[{"role": "user", "content": "Hi there"}])
        uses = [b for b in m.content if b.type == "tool_use"]
        assert m.stop_reason == "tool_use" and uses and uses[0].name == "get_weather", m
        V(WEATHER).validate(uses[0].input)


def test_responses_text_format_and_required_tools(server):
    o = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=600)
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    r = o.responses.create(model="m", input="Invent a person.", max_output_tokens=60,
                           text={"format": {"type": "json_schema", "name": "person", "schema": person, "strict": True}})
    V(person).validate(json.loads(r.output_text))
    assert r.text.format.type == "json_schema"
    r = o.responses.create(model="m", input="Hello", max_output_tokens=40, tool_choice="required",
                           tools=[{"type": "function", "name": "get_weather", "parameters": WEATHER}])
    calls = [i for i in r.output if i.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    V(WEATHER).validate(json.loads(calls[0].arguments))


def test_completion_grammar_and_json_schema_fields(server):
    url = server.url + "/completion"
    j = requests.post(url, json={"prompt": "The year is", "n_predict": 8, "grammar": 'root ::= " " [0-9]{4} "."'},
                      timeout=600).json()
    assert len(j["content"]) == 6 and j["content"][1:5].isdigit() and j["content"].endswith("."), j["content"]
    schema = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["id"], "additionalProperties": False}
    j = requests.post(url, json={"prompt": "A user as JSON:", "n_predict": 40, "json_schema": schema}, timeout=600).json()
    V(schema).validate(json.loads(j["content"]))
    bad = requests.post(url, json={"prompt": "x", "n_predict": 4, "grammar": "root ::= this is (not valid GBNF"},
                        timeout=600)
    assert bad.status_code == 400 and "line 1, column 33" in bad.json()["error"]["message"]


DOCUMENT_IDS = 400      # max_tokens of each corpus document


def write_document(url: str, name: str, schema: dict, seed: int) -> requests.Response:
    """One document; the seed (llama-server's per-request `seed`) makes a run repeatable on one machine,
    where the server's default (--seed -1) draws a new one per request."""
    ask = f"Write one realistic example of a {name.replace('_', ' ')} as JSON matching this schema:\n" + \
        json.dumps(schema)
    return requests.post(url + "/v1/chat/completions", timeout=1200, json={
        "messages": [{"role": "user", "content": ask}], "max_tokens": DOCUMENT_IDS, "seed": seed,
        "response_format": {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}})


@pytest.fixture(scope="module")
def corpus_answers(server):
    """Every corpus document, asked CORPUS_AT_ONCE at a time as the first corpus test starts: the server decodes
    them in one batch (on 2 cores, four 48-id answers took 9 s of CPU at once against 16 s one after another);
    each test then checks its own answer (a request that raised fails its test only)."""
    with ThreadPoolExecutor(CORPUS_AT_ONCE) as pool:
        pending = {c[0]: pool.submit(write_document, server.url, c[0], c[1], 1000 + i) for i, c in enumerate(CORPUS)}
    return pending


def grammar_refuses_at(tok, schema: dict, text: str) -> int | None:
    """The index of the first id of text (as the tokenizer splits it) the schema's grammar refuses, or None."""
    n, n_ids, _ = run(tok, Vocab.from_tokenizer(tok), schema_grammar(schema), text)
    return None if n == n_ids else n


@pytest.mark.slow
@pytest.mark.parametrize("name,schema", [(c[0], c[1]) for c in CORPUS], ids=[c[0] for c in CORPUS])
def test_every_document_written_validates(corpus_answers, real_tokenizer, name, schema):
    """A finished document validates. A sampled 0.5B model can run on in a free-text field (a markdown body,
    a file's content) past max_tokens: such an answer must be cut at exactly max_tokens, and every id it
    holds must be one the grammar allowed (the cut text is a prefix of some valid document)."""
    r = corpus_answers[name].result()
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    text = choice["message"]["content"]
    if choice["finish_reason"] == "length":
        assert body["usage"]["completion_tokens"] == DOCUMENT_IDS, body["usage"]
        assert grammar_refuses_at(real_tokenizer, schema, text) is None, text
        return
    assert choice["finish_reason"] == "stop", choice
    V(schema, format_checker=V.FORMAT_CHECKER).validate(json.loads(text))



def test_the_cut_document_check_tells_a_prefix_from_a_wrong_id(real_tokenizer):
    """The check a length-cut answer gets: a prefix of a valid document passes, a wrong id is found."""
    schema = next(c[1] for c in CORPUS if c[0] == "markdown_doc")
    assert grammar_refuses_at(real_tokenizer, schema, '{"title": "Notes", "body": "# Heading\\n\\n* item') is None
    assert grammar_refuses_at(real_tokenizer, schema, '{"title": "Notes", "body": 7}') is not None
