"""Front side: a request's structured output -> the grammar text SamplingParams.grammar carries.

Every input (a JSON schema, llama-server's GBNF `grammar` field, a forced tool call written
as Lark with embedded schemas) becomes one llguidance grammar (its JSON "top-level grammar"
text), checked here before the request reaches the engine, so a grammar the engine cannot
serve is a 400 that names the problem:

  SchemaError         a schema keyword the engine does not serve, or a schema that nothing
                      satisfies: the keyword and its JSON path (#/properties/x/not);
  GrammarSyntaxError  an invalid GBNF grammar: the line and column.

JSON is written as llama.cpp's converter lets a model write it: every string escape
(\\uXXXX included; llguidance has no '\\/'), and between tokens no space, one space, or one
or two newlines and up to 20 spaces or tabs (common/json-schema-to-grammar's SPACE_RULE).
"""
from __future__ import annotations

import copy
import json
import re

import llguidance as llg
from llguidance import gbnf_to_lark as _g2l
from llguidance.gbnf_to_lark import GbnfToLarkError

from bloomery.grammar.errors import GrammarSyntaxError, SchemaError

JSON_OPTIONS = {"whitespace_pattern": r"(?: |\n{1,2}[ \t]{0,20})?", "json_allow_general_unicode_escapes": True}
MAX_GRAMMAR_CHARS = 1 << 20
# the maps whose keys are names, not keywords (a property called "not" is no keyword)
_NAME_MAPS = frozenset({"properties", "$defs", "definitions", "patternProperties", "dependentSchemas"})


# -- schemas -----------------------------------------------------------------------------
def _paths(node: object, path: str = "#"):
    """Every (path, schema object) in a schema, names in name maps skipped as keywords."""
    if isinstance(node, dict):
        yield path, node
        for k, v in node.items():
            sub = f"{path}/{k.replace('~', '~0').replace('/', '~1')}"
            if k in _NAME_MAPS and isinstance(v, dict):
                for name, s in v.items():
                    yield from _paths(s, f"{sub}/{name.replace('~', '~0').replace('/', '~1')}")
            elif k not in ("enum", "const", "default", "examples"):
                yield from _paths(v, sub)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, f"{path}/{i}")


def _locate(schema: object, keyword: str, value: object = None) -> str:
    for path, node in _paths(schema):
        if keyword in node and (value is None or node[keyword] == value):
            return f"{path}/{keyword}"
    return "#"


def _at(where: str) -> str:
    """The message's lead: where the schema came from (a tool's parameters), or nothing (the field says)."""
    return f"{where}: " if where else ""


def _schema_refusal(schema: object, message: str, where: str) -> SchemaError:
    """llguidance's message -> a SchemaError naming the keyword and its JSON path."""
    first = message.strip().splitlines()[0] if message.strip() else message
    first = re.sub(r"^at \d+\(\d+\): (failed to compile JSON schema: )?", "", first)
    m = re.search(r'Unimplemented keys: \[([^\]]*)\]', message)
    if m:
        keys = [k.strip().strip('"') for k in m.group(1).split(",")]
        path = _locate(schema, keys[0])
        return SchemaError(f"{_at(where)}JSON schema keyword '{keys[0]}' at {path} is not supported by this server",
                           keys[0], path)
    m = re.search(r"Unknown format: (\S+)", message)
    if m:
        path = _locate(schema, "format", m.group(1))
        return SchemaError(f"{_at(where)}JSON schema format {m.group(1)!r} at {path} is not supported by this server",
                           "format", path)
    m = re.search(r"Pointer '([^']*)' does not exist", message)
    if m:
        path = _locate(schema, "$ref", "#" + m.group(1))
        return SchemaError(f"{_at(where)}'$ref' at {path} names nothing in the schema ({m.group(1)})", "$ref", path)
    if "regex" in message:
        for path, node in _paths(schema):
            p = node.get("pattern")
            if isinstance(p, str) and llg.LLMatcher.validate_grammar(llg.LLMatcher.grammar_from_json_schema(
                    {"type": "string", "pattern": p})):
                why = re.search(r"(?m)^error: (.*)$", message)
                reason = why.group(1) if why else first
                return SchemaError(f"{_at(where)}'pattern' at {path}/pattern is not a regex this server serves: "
                                   f"{reason}", "pattern", f"{path}/pattern")
    m = re.search(r"\b(minimum|maximum|exclusiveMinimum|exclusiveMaximum|minLength|maxLength|minItems|maxItems|"
                  r"multipleOf|minProperties|maxProperties|required|allOf|anyOf|oneOf|enum|const|type)\b", first)
    keyword = m.group(1) if m else "multipleOf" if "multiple of" in first else ""
    path = _locate(schema, keyword) if keyword else "#"
    return SchemaError(f"{_at(where)}the schema at {path} cannot be served: {first}", keyword, path)


def _closed_objects(schema: dict) -> dict:
    """A copy where an object schema that lists `properties` and says nothing of additionalProperties takes
    no other property: llama-server's converter writes such objects so ("additional properties default
    to false for generation"), where JSON Schema allows any. Not inside allOf, whose parts add up."""
    schema = copy.deepcopy(schema)
    for path, node in _paths(schema):
        if ("properties" in node and "additionalProperties" not in node and "unevaluatedProperties" not in node
                and "patternProperties" not in node and not re.search(r"/allOf/\d+$", path)):
            node["additionalProperties"] = False
    return schema


def schema_rule(schema: object, where: str = "") -> str:
    """A Lark right-hand side that writes one document of the schema (`%json {...}`)."""
    if schema is True or schema is None:
        schema = {}
    if schema is False:
        raise SchemaError(f"{_at(where)}the schema false (at #) admits no document", "false", "#")
    if not isinstance(schema, dict):
        raise SchemaError(f"{_at(where)}a schema must be an object, got {json.dumps(schema)[:40]}", "schema", "#")
    for path, node in _paths(schema):
        step = node.get("multipleOf")
        if isinstance(step, (int, float)) and not isinstance(step, bool) and step != int(step):
            # llguidance writes a fractional step with a fixed number of decimals ("0.50", never "0.5")
            raise SchemaError(f"{_at(where)}'multipleOf' {step} at {path}/multipleOf is not served (only whole-number "
                              f"steps are)", "multipleOf", f"{path}/multipleOf")
    schema = _closed_objects(schema)
    opts = dict(JSON_OPTIONS, **(schema.get("x-guidance") or {}))
    text = json.dumps({**schema, "x-guidance": opts}, ensure_ascii=False)
    err = llg.LLMatcher.validate_grammar(llg.LLMatcher.grammar_from_lark(f"start: %json {text}\n"))
    if err:
        raise _schema_refusal(schema, err, where)
    return f"%json {text}"


def schema_grammar(schema: object, where: str = "") -> str:
    return lark_grammar(f"start: {schema_rule(schema, where)}\n", where)


def json_object_grammar() -> str:
    """response_format json_object: any JSON object."""
    return schema_grammar({"type": "object"})


# -- Lark and GBNF -----------------------------------------------------------------------------
def lark_grammar(lark: str, where: str) -> str:
    if len(lark) > MAX_GRAMMAR_CHARS:
        raise SchemaError(f"{_at(where)}the grammar is {len(lark)} characters, over this server's "
                          f"{MAX_GRAMMAR_CHARS}", "grammar", "#")
    g = _top(lark)
    err = llg.LLMatcher.validate_grammar(g)
    if err:
        raise SchemaError(f"{_at(where)}{err.strip().splitlines()[0]}", "grammar", "#")
    return g


def _top(lark: str) -> str:
    """llguidance's top-level grammar (JSON), so that grammars compose (after_prefix)."""
    return json.dumps({"grammars": [{"lark_grammar": lark}]}, ensure_ascii=False)


def _line_col(text: str, pos: int) -> tuple[int, int]:
    line = text.count("\n", 0, pos) + 1
    return line, pos - (text.rfind("\n", 0, pos) + 1) + 1


class _NonTerminal(_g2l.ASTNode):
    """A GBNF rule's body kept a Lark rule: llguidance's converter turns a rule made of terminals alone
    into one greedy lexeme (`num ::= [0-9]+ ws` eats the newline a later literal needs), where GBNF
    is a plain grammar over characters with no lexer."""

    def __init__(self, inner):
        self.inner = inner

    def __str__(self) -> str:
        return str(self.inner)

    def top_str(self) -> str:
        return self.inner.top_str()

    def is_atomic(self) -> bool:
        return self.inner.is_atomic()

    def is_terminal(self) -> bool:
        return False

    def simplify(self):
        self.inner = self.inner.simplify()
        return self

    def children(self):
        return [self.inner]


def gbnf_to_lark(text: str) -> str:
    """GBNF -> Lark through llguidance's parser, every rule a Lark rule (llama.cpp's semantics)."""
    rules = _g2l.GrammarParser().parse(text)
    for r in rules.values():
        r.alternatives = _NonTerminal(r.alternatives)
    _g2l.resolve(rules)

    def bracket_nested(node) -> None:      # ([x]*)* would be written /[x]/**, which Lark does not read
        for c in node.children():
            bracket_nested(c)
        if isinstance(node, _g2l.RepetitionNode) and isinstance(node.node, _g2l.RepetitionNode):
            node.node = _g2l.SequenceNode([node.node])
    for r in rules.values():
        bracket_nested(r)
    return "%llguidance {}\n\n" + "\n".join(str(r) for r in sorted(rules.values(), key=lambda r: r.order)) + "\n"


def _undefined(text: str, name: str) -> None:
    """A rule used but never defined: its first use in the GBNF text."""
    hit = re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text)
    line, col = _line_col(text, hit.start()) if hit else (1, 1)
    raise GrammarSyntaxError(f"rule {name!r} is used but not defined", line, col)


def gbnf_grammar(text: str) -> str:
    """llama-server's `grammar` field (GBNF, root rule `root`) -> grammar text, or GrammarSyntaxError."""
    if not isinstance(text, str) or not text.strip():
        raise GrammarSyntaxError("the grammar is empty", 1, 1)
    if len(text) > MAX_GRAMMAR_CHARS:
        raise GrammarSyntaxError(f"the grammar is {len(text)} characters, over this server's {MAX_GRAMMAR_CHARS}",
                                 1, 1)
    try:
        lark = gbnf_to_lark(text)
    except GbnfToLarkError as e:
        line, col = _line_col(text, e.pos.pos)
        raise GrammarSyntaxError(str(e).rsplit(" at line ", 1)[0], line, col) from None
    except Exception as e:   # the converter raises a bare Exception for an undefined rule
        m = re.search(r"Rule '([^']+)' not found", str(e))
        if m is None:
            raise GrammarSyntaxError(f"{type(e).__name__}: {e}", 1, 1) from None
        _undefined(text, m.group(1))
    if not re.search(r"(?m)^\s*root\s*::=", text):
        raise GrammarSyntaxError("the grammar has no 'root' rule", 1, 1)
    g = _top(lark)
    err = llg.LLMatcher.validate_grammar(g)
    if err:
        first = err.strip().splitlines()[0]
        m = re.search(r'unknown name: "?([\w-]+)', err)
        if m:
            _undefined(text, m.group(1))
        raise GrammarSyntaxError(first, 1, 1)
    return g


# -- composition -------------------------------------------------------------------------------
def after_prefix(grammar: str, prefix: str) -> str:
    """The grammar's document after a fixed text (a think span closed at once)."""
    top = json.loads(grammar)
    subs = top["grammars"]
    name = "after_prefix_doc"
    first = dict(subs[0], name=name)
    lead = {"lark_grammar": f"start: {json.dumps(prefix, ensure_ascii=False)} @{name}\n"}
    return json.dumps({**top, "grammars": [lead, first] + subs[1:]}, ensure_ascii=False)


def lark_literal(text: str) -> str:
    """A Lark string literal holding text exactly."""
    return json.dumps(text, ensure_ascii=False)
