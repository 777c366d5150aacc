"""The constraint engine on the CPU: schemas, GBNF and refusals (front side), and the token mask
(engine side) over a small byte-level vocabulary. The real tokenizer: test_grammar_corpus.py."""
from __future__ import annotations

import json

import numpy as np
import pytest

from byte_vocab import EOS, PIECES, VOCAB, ok
from bloomery.grammar import (GrammarError, GrammarSyntaxError, Matcher, SchemaError, after_prefix, gbnf_grammar,
                              json_object_grammar, schema_grammar)

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5}, "age": {"type": "integer"},
                                          "tags": {"type": "array", "items": {"enum": ["a", "b"]}}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.mark.parametrize("schema,good,bad", [
    (PERSON, ['{"name": "bob", "age": 12}', '{"name":"bob","age":12,"tags":["a","b"]}',
              '{\n  "name": "\\n\\"\\\\\\u00e9é",\n  "age": -1\n}'],
     ['{"name": "bobbyx", "age": 1}', '{"name": "b", "age": 012}', '{"name": "b"}', '{"name": "b", "age": 1, "x": 1}']),
    ({"type": "integer", "minimum": 3, "maximum": 17}, ["3", "17", "10"], ["2", "18", "-3", "3.0"]),
    ({"type": "integer", "exclusiveMinimum": 3, "exclusiveMaximum": 17}, ["4", "16"], ["3", "17"]),
    ({"type": "number", "minimum": -1.5, "maximum": 2}, ["-1.5", "0.25", "2"], ["-1.6", "2.01"]),
    ({"type": "integer", "multipleOf": 5}, ["0", "15", "-20"], ["7"]),
    ({"type": "string", "minLength": 2, "maxLength": 3}, ['"ab"', '"abc"', '"\\n\\t"'], ['"a"', '"abcd"']),
    ({"type": "string", "pattern": "^[a-z]+-[0-9]{2}$"}, ['"ab-12"'], ['"ab-1x"', '"AB-12"']),
    ({"type": "string", "format": "date"}, ['"2024-02-29"'], ['"2024-13-01"', '"24-01-01"']),
    ({"type": "string", "format": "time"}, ['"12:30:00Z"', '"23:59:59+02:00"'], ['"25:00:00Z"']),
    ({"type": "string", "format": "date-time"}, ['"2024-02-29T12:30:00Z"'], ['"2024-02-29 12:30"']),
    ({"type": "string", "format": "uuid"}, ['"123e4567-e89b-12d3-a456-426614174000"'], ['"123e4567"']),
    ({"type": "string", "format": "email"}, ['"a.b@example.com"'], ['"no-at-sign"']),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2}, ["[1]", "[1, 2]"],
     ["[]", "[1, 2, 3]"]),
    ({"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}], "items": False},
     ['["a", 1]'], ['[1, "a"]', '["a", 1, 2]']),
    ({"type": ["string", "null"]}, ['"x"', "null"], ["1"]),
    ({"oneOf": [{"type": "integer"}, {"type": "boolean"}]}, ["1", "true"], ['"x"']),
    ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                {"properties": {"b": {"type": "string"}}, "required": ["b"]}]}, ['{"a": 1, "b": "x"}'], ['{"a": 1}']),
    ({"$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer"},
                                                          "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}},
                         "required": ["v", "next"], "additionalProperties": False}}, "$ref": "#/$defs/node"},
     ['{"v": 1, "next": {"v": 2, "next": null}}'], ['{"v": 1, "next": {"v": 2}}']),
    ({"type": "object", "additionalProperties": {"type": "integer"}}, ['{"a": 1, "b": 2}', "{}"], ['{"a": "x"}']),
    ({"type": "object", "properties": {"a": {"type": "null"}, "b": {"type": "boolean"}}, "additionalProperties": False},
     ["{}", '{"a": null}', '{"b": true}', '{"a": null, "b": false}'], ['{, "b": true}']),
    ({"enum": ["red", 1, None, {"k": [1]}]}, ['"red"', "1", "null", '{"k": [1]}'], ['"blue"', "2"]),
    ({"const": "say \"hi\"\n"}, ['"say \\"hi\\"\\n"'], ['"say hi"']),
])
def test_schema_accepts_and_refuses_documents(schema, good, bad):
    g = schema_grammar(schema)
    for text in good:
        assert ok(g, text), text
    for text in bad:
        assert not ok(g, text), text


def test_json_object_and_whitespace_bound():
    g = json_object_grammar()
    assert ok(g, '{"a": [1, {"b": null}, -2.5e3]}') and ok(g, "{}")
    assert not ok(g, "[1]")
    assert not ok(g, "{" + " " * 2 + "}")             # one space at most, or newlines with up to 20 blanks
    assert ok(g, '{\n' + " " * 20 + '"a": 1\n}') and not ok(g, '{\n' + " " * 21 + '"a": 1}')


@pytest.mark.parametrize("schema,keyword,path", [
    ({"type": "object", "properties": {"not": {"type": "integer", "not": {"const": 1}}}}, "not",
     "#/properties/not/not"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems", "#/uniqueItems"),
    ({"type": "object", "properties": {"d": {"type": "string", "format": "zip-code"}}}, "format",
     "#/properties/d/format"),
    ({"items": {"type": "string", "pattern": "(?<=a)b"}}, "pattern", "#/items/pattern"),
    ({"$ref": "#/$defs/missing"}, "$ref", "#/$ref"),
    ({"type": "integer", "minimum": 5, "maximum": 3}, "minimum", "#/minimum"),
    ({"type": "object", "properties": {"price": {"type": "number", "multipleOf": 0.01}}}, "multipleOf",
     "#/properties/price/multipleOf"),
    (False, "false", "#"),
])
def test_schema_refused_by_keyword_and_path(schema, keyword, path):
    with pytest.raises(SchemaError) as e:
        schema_grammar(schema, "response_format")
    assert (e.value.keyword, e.value.path) == (keyword, path)
    assert keyword in str(e.value) and path in str(e.value)


@pytest.mark.parametrize("text,line,col", [
    ('root ::= "a" [0-9+\n', 2, 1),
    ('root ::= "a"\nitem ::= "b" missing-rule\n', 2, 14),
    ('x ::= "a"\n', 1, 1),
    ('root ::= "\\q"\n', 1, 12),
])
def test_gbnf_refused_with_line_and_column(text, line, col):
    with pytest.raises(GrammarSyntaxError) as e:
        gbnf_grammar(text)
    assert (e.value.line, e.value.column) == (line, col), str(e.value)
    assert f"line {line}, column {col}" in str(e.value)


def test_gbnf_grammar_constrains():
    g = gbnf_grammar('root ::= item ("," item)*\nitem ::= [a-c]+ | "\\"q\\""\n')
    assert ok(g, 'ab,"q",c') and not ok(g, "ab,,c") and not ok(g, "d")


def test_after_prefix_closes_a_think_span_first():
    g = after_prefix(schema_grammar({"type": "integer"}), "</think>\n\n")
    assert ok(g, "</think>\n\n42") and not ok(g, "42")


def test_greedy_pick_is_the_masked_argmax_and_the_stop_id_waits_for_a_whole_document():
    m = Matcher(schema_grammar({"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"],
                                "additionalProperties": False}), VOCAB, stop_ids=[EOS])
    rng = np.random.default_rng(1)
    text = b""
    for step in range(60):
        logits = rng.standard_normal(len(PIECES)).astype(np.float32)
        logits[EOS] = 50.0                           # the model wants to stop at once
        n_nl = text.count(b"\\n")
        logits[PIECES.index(b"\\n")] = 20.0 if n_nl < 3 else -50.0   # ... and to write newline escapes
        logits[[ord('"'), ord("}")]] += 0.0 if n_nl < 3 else 30.0        # ... then to close
        logits[PIECES.index(b'", "')] = -50.0
        allowed = m.allowed()
        t = m.pick_greedy(logits)
        assert t == int(np.argmax(np.where(allowed, logits, -np.inf)))
        assert allowed[EOS] == m.complete
        assert t != EOS
        m.accept(t)
        text += PIECES[t]
        if m.done:
            break
    assert m.done and json.loads(text)["name"].count("\n") == 3


def test_an_id_outside_the_mask_is_an_error():
    m = Matcher(schema_grammar({"type": "integer"}), VOCAB, stop_ids=[EOS])
    assert not m.allows(ord("x"))
    with pytest.raises(GrammarError):
        m.accept(ord("x"))
    with pytest.raises(GrammarError):
        Matcher(schema_grammar({"type": "integer"}), VOCAB, stop_ids=[EOS]).accept(EOS)   # nothing written yet


def test_done_once_nothing_may_follow():
    m = Matcher(schema_grammar({"const": 7}), VOCAB, stop_ids=[EOS])
    m.accept(ord("7"))
    assert m.complete and m.done

