"""The constraint engine against a corpus of real-world schemas (tests/schema_corpus.py), with the
real Qwen2.5 tokenizer: valid values are accepted token by token (as the tokenizer splits them,
in several JSON layouts, every escape included), invalid ones are refused at the first token
where they go wrong; and every schema's document the real model writes validates."""
from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bloomery.grammar import Matcher, Vocab, schema_grammar
from schema_corpus import CORPUS

pytestmark = [pytest.mark.real_model]
V = jsonschema.Draft202012Validator


@pytest.fixture(scope="module")
def tok(real_tokenizer):
    return real_tokenizer


@pytest.fixture(scope="module")
def vocab(tok):
    return Vocab.from_tokenizer(tok)


def layouts(value) -> list[str]:
    """The ways a model writes one value: compact, spaced, indented, with and without \\u escapes."""
    return [json.dumps(value, ensure_ascii=False), json.dumps(value, ensure_ascii=True),
            json.dumps(value, ensure_ascii=False, separators=(",", ":")),
            json.dumps(value, ensure_ascii=False, indent=2), json.dumps(value, ensure_ascii=True, indent="\t")]


def run(tok, vocab, grammar: str, text: str) -> tuple[int, int, bool]:
    """(ids accepted, ids in the text, whole document): the text as the tokenizer splits it, id by id."""
    ids = tok.encode(text, add_special=False)
    m = Matcher(grammar, vocab, stop_ids=sorted(tok.eog_ids))
    for i, t in enumerate(ids):
        if m.done or not m.allowed()[t]:
            return i, len(ids), False
        m.accept(t)
    return len(ids), len(ids), m.complete and bool(m.allowed()[tok.eos_id] if not m.done else True)


def first_bad_id(tok, prefix: str, rest: str) -> int:
    """Index of the id that holds the first byte of rest."""
    at = len(prefix.encode("utf-8"))
    end = 0
    for i, t in enumerate(tok.encode(prefix + rest, add_special=False)):
        end += len(tok.token_to_piece(t))
        if end > at:
            return i
    raise AssertionError("rest is empty")


def test_corpus_size():
    assert len(CORPUS) >= 30


@pytest.mark.parametrize("name,schema,good,bad", CORPUS, ids=[c[0] for c in CORPUS])
def test_valid_values_accepted_id_by_id(tok, vocab, name, schema, good, bad):
    g = schema_grammar(schema, name)
    for value in good:
        V(schema, format_checker=V.FORMAT_CHECKER).validate(value)
        for text in layouts(value):
            n, n_ids, whole = run(tok, vocab, g, text)
            assert (n, whole) == (n_ids, True), f"refused at id {n} of {n_ids}: {text!r}"


@pytest.mark.parametrize("name,schema,good,bad", CORPUS, ids=[c[0] for c in CORPUS])
def test_invalid_values_refused_at_the_first_wrong_id(tok, vocab, name, schema, good, bad):
    g = schema_grammar(schema, name)
    val = V(schema, format_checker=V.FORMAT_CHECKER)
    for prefix, rest in bad:
        try:
            assert not val.is_valid(json.loads(prefix + rest)), "the invalid case validates"
        except json.JSONDecodeError:
            pass
        n, n_ids, whole = run(tok, vocab, g, prefix + rest)
        assert n == first_bad_id(tok, prefix, rest), (prefix, rest, n, n_ids)
        assert not whole


# every character but lone surrogates; DEL only escaped: llguidance takes it as \u007f, not raw
TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=st.lists(TEXT, max_size=3), ascii_only=st.booleans())
def test_any_string_in_any_escape_form_is_accepted(tok, vocab, value, ascii_only):
    """Every character (control characters, quotes, backslashes, non-ASCII) as json.dumps writes it."""
    if not ascii_only:
        value = [v.replace("\x7f", "") for v in value]
    schema = {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string"}}},
              "required": ["items"], "additionalProperties": False}
    g = _grammar(json.dumps(schema))
    text = json.dumps({"items": value}, ensure_ascii=ascii_only)
    n, n_ids, whole = run(tok, vocab, g, text)
    assert (n, whole) == (n_ids, True), text


_GRAMMARS: dict[str, str] = {}


def _grammar(schema_text: str) -> str:
    if schema_text not in _GRAMMARS:
        _GRAMMARS[schema_text] = schema_grammar(json.loads(schema_text))
    return _GRAMMARS[schema_text]


def test_auto_call_grammar_with_the_real_call_tag(tok, vocab):
    """tool_choice auto with a strict tool: text, then <tool_call> as the model writes it (its one special
    id), then the call, accepted id by id; a wrong argument refused where it goes wrong."""
    from bloomery.api.toolcalls import read_tool_request
    from bloomery.api.toolcalls.forced import auto_call_grammar
    params = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "maximum": 7}},
              "required": ["city", "days"]}
    g = auto_call_grammar("hermes", read_tool_request({"tools": [
        {"type": "function", "function": {"name": "get_forecast", "parameters": params, "strict": True}}]}))
    call = '<tool_call>\n{"name": "get_forecast", "arguments": {"city": "Oslo", "days": 3}}\n</tool_call>'
    assert tok.encode(call, add_special=False)[0] == tok.encode("<tool_call>", add_special=False)[0] == 151657
    for text in ("Checking the forecast now.\n" + call, call, "No call here: <b>bold</b> and </tool_call>"):
        n, n_ids, whole = run(tok, vocab, g, text)
        assert (n, whole) == (n_ids, True), text
    prefix = 'Sure.\n<tool_call>\n{"name": "get_forecast", "arguments": {"city": "Oslo", "days": '
    n, _, _ = run(tok, vocab, g, prefix + '9}}\n</tool_call>')
    assert n == first_bad_id(tok, prefix, '9}}\n</tool_call>')
