"""The schema subset -> program, the byte automaton, and the token mask (pure, CPU)."""
from __future__ import annotations

import numpy as np
import pytest

from bloomery.grammar import Matcher, Program, SchemaError, Vocab, json_object_nodes, schema_nodes

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5}, "age": {"type": "integer"},
                                          "tags": {"type": "array", "items": {"enum": ["a", "b"]}}},
          "required": ["name", "age"], "additionalProperties": False}


def accepts(prog: Program, text: str) -> bool:
    sid = prog.walk(prog.start, text.encode())
    return sid >= 0 and prog.complete(sid)


@pytest.mark.parametrize("text,ok", [
    ('{"name": "bob", "age": 12}', True),
    ('{"name": "bob", "age": 12, "tags": ["a", "b"]}', True),
    ('{"name": "bob", "age": 12, "tags": []}', True),
    ('{"name": "bobbyx", "age": 1}', False),         # maxLength 5
    ('{"name": "b", "age": 012}', False),            # JSON integers have no leading zero
    ('{"name": "b","age": 1}', False),               # one space after ','
    ('{"age": 1, "name": "b"}', False),              # required properties in order
    ('{"name": "b\\n", "age": 1}', False),           # a free string takes no escape
])
def test_schema_texts(text, ok):
    assert accepts(Program(schema_nodes(PERSON)), text) is ok


def test_optional_only_object_places_commas():
    prog = Program(schema_nodes({"type": "object", "properties": {"a": {"type": "null"}, "b": {"type": "boolean"}}}))
    for text in ("{}", '{"a": null}', '{"b": true}', '{"a": null, "b": false}'):
        assert accepts(prog, text), text
    assert not accepts(prog, '{, "b": true}')


def test_json_object_needs_a_member_and_nests():
    prog = Program(json_object_nodes())
    assert not accepts(prog, "{}")
    assert accepts(prog, '{"a": [1, {"b": null}, -2.5e3]}')


def test_refs_and_anyof():
    schema = {"$defs": {"p": {"type": "integer"}}, "anyOf": [{"$ref": "#/$defs/p"}, {"const": "x"}]}
    prog = Program(schema_nodes(schema))
    assert accepts(prog, "7") and accepts(prog, '"x"') and not accepts(prog, '"y"')


@pytest.mark.parametrize("schema,word", [
    ({"type": "string", "minLength": 2}, "minLength"),
    ({"oneOf": [{"type": "string"}]}, "oneOf"),
    ({"type": ["string", "null"]}, "list of types"),
    ({"type": "integer", "minimum": 0}, "minimum"),
    ({"type": "string", "pattern": "a+"}, "pattern"),
    ({"$ref": "https://x/y"}, "outside"),
    ({"$defs": {"n": {"$ref": "#/$defs/n"}}, "$ref": "#/$defs/n"}, "recursive"),
])
def test_refused_by_name(schema, word):
    with pytest.raises(SchemaError) as e:
        schema_nodes(schema)
    assert word in str(e.value)


def test_program_round_trips_as_json():
    prog = Program(schema_nodes(PERSON))
    again = Program.from_json(prog.to_json())
    assert accepts(again, '{"name": "x", "age": 3}')


TOKENS = [b"{", b'{"', b"name", b'"', b'": "', b"bob", b'", "', b"age", b'": ', b"1", b"2", b"}", b" ", b"", b"hello"]
TOKENS += [bytes([c]) for c in range(0x20, 0x7F) if bytes([c]) not in TOKENS]   # every byte, as a BPE vocab has
EOS = TOKENS.index(b"")        # an empty (control) id used as the stop id


def test_greedy_takes_the_first_allowed_in_descending_order_and_ends():
    prog = Program(schema_nodes({"type": "object", "properties": {"name": {"type": "string"},
                                                                  "age": {"type": "integer"}},
                                 "required": ["name", "age"]}))
    m = Matcher(prog, Vocab(TOKENS), stop_ids=[EOS])
    rng = np.random.default_rng(1)
    text = b""
    for _ in range(200):
        logits = rng.standard_normal(len(TOKENS)).astype(np.float32)
        logits[TOKENS.index(b"x")] = 10.0          # the model's favourite is allowed only inside a string
        logits[TOKENS.index(b'", "')] += 11.0       # ... until the string may end
        logits[TOKENS.index(b"}")] += 3.0
        t = m.pick_greedy(logits)
        allowed = [i for i in range(len(TOKENS)) if m.allows(i)]
        assert t == max(allowed, key=lambda i: (logits[i], -i))   # the masked row's argmax
        m.accept(t)
        text += TOKENS[t]
        if m.done:
            break
    assert m.done and text.startswith(b'{"name": "') and text.endswith(b"}")


def test_sampled_mask_keeps_only_allowed_ids():
    m = Matcher(Program(json_object_nodes()), Vocab(TOKENS), stop_ids=[EOS])
    logits = np.zeros(len(TOKENS), dtype=np.float32)
    row = m.mask(logits, top_k=0)
    assert {TOKENS[i] for i in range(len(TOKENS)) if np.isfinite(row[i])} == {b"{", b'{"'}
    assert np.isfinite(m.mask(logits, top_k=1)).sum() == 1
