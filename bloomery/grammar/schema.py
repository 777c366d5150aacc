"""JSON schema (the subset of the serving guide, 11.4) -> grammar program nodes.

The subset: an object (its required properties in the order `properties` lists
them, then each optional one in order, each of which may be left out), an array
of items, anyOf, a $ref into the schema itself (#/$defs/... or #/definitions/...),
string, integer and boolean enums, const, booleans, null, integers, numbers, and
free strings with an optional maxLength; {} is any JSON value. Annotations (title,
description, ...) are read and ignored. Any other keyword is refused by name
(SchemaError, a 400 naming the keyword and where it sits).

The text is compact JSON with one space after ':' and ','. A free string takes no
escape. `no_lt` (tool calls) keeps '<' out of free strings and writes a '<' inside a
constant, option or property name as \\u003c.
"""
from __future__ import annotations

import json

MAX_SCHEMAS = 4096
MAX_DEPTH = 128
ANNOTATIONS = frozenset({"title", "description", "$comment", "examples", "default", "$schema", "$id",
                         "$defs", "definitions", "deprecated", "readOnly", "writeOnly"})
BY_TYPE = {
    "object": frozenset({"properties", "required", "additionalProperties"}),
    "array": frozenset({"items"}),
    "string": frozenset({"maxLength", "enum", "const"}),
    "integer": frozenset({"enum", "const"}),
    "number": frozenset(),
    "boolean": frozenset({"enum", "const"}),
    "null": frozenset(),
}


class SchemaError(ValueError):
    """A schema outside the served subset; the message names the keyword and its place."""

    def __init__(self, message: str, keyword: str = ""):
        super().__init__(message)
        self.keyword = keyword


def dump_value(v: object, no_lt: bool) -> str:
    text = json.dumps(v, ensure_ascii=False, separators=(", ", ": "))
    return text.replace("<", "\\u003c") if no_lt else text


class Builder:
    """Appends nodes; index 0 is reserved for the root (filled by `finish`)."""

    def __init__(self, no_lt: bool = False):
        self.nodes: list = [None]
        self.no_lt = no_lt
        self._generic: int | None = None

    def add(self, node: tuple) -> int:
        self.nodes.append(node)
        return len(self.nodes) - 1

    def lit(self, text: str) -> int:
        return self.add(("lit", text))

    def seq(self, *items: int) -> int:
        return self.add(("seq", tuple(items)))

    def alt(self, *items: int) -> int:
        return items[0] if len(items) == 1 else self.add(("alt", tuple(items)))

    def opt(self, item: int) -> int:
        return self.alt(item, self.seq())

    def string(self, max_chars: int | None = None, raw: bool = False) -> int:
        return self.add(("str", max_chars, self.no_lt or raw, raw))

    def any_value(self) -> int:
        """Any JSON value (recursive: objects and arrays of any values)."""
        if self._generic is not None:
            return self._generic
        v = self.add(None)
        self._generic = v
        member = self.seq(self.string(), self.lit(": "), v)
        obj = self.alt(self.lit("{}"), self.seq(self.lit("{"), member,
                                                 self.add(("star", self.seq(self.lit(", "), member))), self.lit("}")))
        arr = self.alt(self.lit("[]"), self.seq(self.lit("["), v,
                                                self.add(("star", self.seq(self.lit(", "), v))), self.lit("]")))
        self.nodes[v] = ("alt", (obj, arr, self.string(), self.add(("num", False)),
                                 self.lit("true"), self.lit("false"), self.lit("null")))
        return v

    def any_object(self) -> int:
        """json_object: any JSON object with at least one member."""
        v = self.any_value()
        member = self.seq(self.string(), self.lit(": "), v)
        return self.seq(self.lit("{"), member, self.add(("star", self.seq(self.lit(", "), member))), self.lit("}"))

    def finish(self, root: int) -> list:
        self.nodes[0] = ("seq", (root,))
        return self.nodes


class SchemaCompiler:
    def __init__(self, builder: Builder, root_schema: object):
        self.b = builder
        self.root = root_schema
        self.n_schemas = 0
        self._refs: list[str] = []

    def compile(self, schema: object, where: str = "#", depth: int = 0) -> int:
        self.n_schemas += 1
        if self.n_schemas > MAX_SCHEMAS:
            raise SchemaError(f"the schema writes out to more than {MAX_SCHEMAS} schemas", "schemas")
        if depth > MAX_DEPTH:
            raise SchemaError(f"the schema nests past {MAX_DEPTH} levels at {where}", "depth")
        b = self.b
        if schema is True or schema == {}:
            return b.any_value()
        if not isinstance(schema, dict):
            raise SchemaError(f"a schema must be an object, but {where} is {json.dumps(schema)[:40]}", "schema")
        if "$ref" in schema:
            return self._ref(schema, where, depth)
        for bad in ("oneOf", "allOf", "not", "if", "then", "else", "patternProperties", "prefixItems"):
            if bad in schema:
                raise SchemaError(f"JSON schema keyword '{bad}' at {where} is not supported by this server", bad)
        if "anyOf" in schema:
            self._check_keys(schema, {"anyOf"}, where)
            opts = schema["anyOf"]
            if not isinstance(opts, list) or not opts:
                raise SchemaError(f"'anyOf' at {where} must be a non-empty array", "anyOf")
            return b.alt(*(self.compile(o, f"{where}/anyOf/{i}", depth + 1) for i, o in enumerate(opts)))
        kind = schema.get("type")
        if isinstance(kind, list):
            raise SchemaError(f"a list of types ('type': {json.dumps(kind)}) at {where} is not supported by this "
                              f"server; use anyOf", "type")
        if "const" in schema or "enum" in schema:
            return self._choices(schema, kind, where)
        if kind is None:
            extra = [k for k in schema if k not in ANNOTATIONS]
            if extra:
                raise SchemaError(f"JSON schema keyword '{extra[0]}' at {where} is not supported by this server "
                                  f"(without a 'type')", extra[0])
            return b.any_value()
        if kind not in BY_TYPE:
            raise SchemaError(f"type {kind!r} at {where} is not supported by this server", "type")
        self._check_keys(schema, BY_TYPE[kind] | {"type"}, where)
        if kind == "object":
            return self._object(schema, where, depth)
        if kind == "array":
            item = self.compile(schema.get("items", {}), f"{where}/items", depth + 1)
            return b.alt(b.lit("[]"), b.seq(b.lit("["), item, b.add(("star", b.seq(b.lit(", "), item))), b.lit("]")))
        if kind == "string":
            n = schema.get("maxLength")
            if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
                raise SchemaError(f"'maxLength' at {where} must be a non-negative integer", "maxLength")
            return b.string(n)
        if kind in ("integer", "number"):
            return b.add(("num", kind == "integer"))
        if kind == "boolean":
            return b.alt(b.lit("true"), b.lit("false"))
        return b.lit("null")

    def _check_keys(self, schema: dict, allowed: set, where: str) -> None:
        for k in schema:
            if k not in allowed and k not in ANNOTATIONS:
                raise SchemaError(f"JSON schema keyword '{k}' at {where} is not supported by this server", k)

    def _choices(self, schema: dict, kind, where: str) -> int:
        self._check_keys(schema, {"type", "const", "enum"}, where)
        values = [schema["const"]] if "const" in schema else schema["enum"]
        if not isinstance(values, list) or not values:
            raise SchemaError(f"'enum' at {where} must be a non-empty array", "enum")
        return self.b.alt(*(self.b.lit(dump_value(v, self.b.no_lt)) for v in values))

    def _object(self, schema: dict, where: str, depth: int) -> int:
        b = self.b
        props = schema.get("properties", {})
        if not isinstance(props, dict):
            raise SchemaError(f"'properties' at {where} must be an object", "properties")
        required = schema.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise SchemaError(f"'required' at {where} must be an array of names", "required")
        missing = [r for r in required if r not in props]
        if missing:
            raise SchemaError(f"required property {missing[0]!r} at {where} is not in 'properties'", "required")
        extra = schema.get("additionalProperties", False)
        if extra is not False:
            raise SchemaError(f"JSON schema keyword 'additionalProperties' at {where} is only supported as false",
                              "additionalProperties")
        parts = {k: b.seq(b.lit(dump_value(k, b.no_lt) + ": "),
                          self.compile(v, f"{where}/properties/{k}", depth + 1)) for k, v in props.items()}
        req = [k for k in props if k in required]
        optional = [k for k in props if k not in required]
        items = [b.lit("{")]
        for i, k in enumerate(req):
            items += ([b.lit(", ")] if i else []) + [parts[k]]
        if req:
            items += [b.opt(b.seq(b.lit(", "), parts[k])) for k in optional]
        elif optional:   # which optional one comes first decides where the commas go
            firsts = []
            for i, k in enumerate(optional):
                firsts.append(b.seq(parts[k], *(b.opt(b.seq(b.lit(", "), parts[o])) for o in optional[i + 1:])))
            items.append(b.opt(b.alt(*firsts)))
        items.append(b.lit("}"))
        return b.seq(*items)

    def _ref(self, schema: dict, where: str, depth: int) -> int:
        self._check_keys(schema, {"$ref"}, where)
        ref = schema["$ref"]
        if not isinstance(ref, str) or not ref.startswith("#/"):
            raise SchemaError(f"'$ref' {ref!r} at {where} points outside the schema; only '#/...' is served", "$ref")
        if ref in self._refs:
            raise SchemaError(f"'$ref' {ref!r} at {where} is recursive, which this server does not serve", "$ref")
        node = self.root
        for part in ref[2:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(node, dict) or part not in node:
                raise SchemaError(f"'$ref' {ref!r} at {where} names nothing in the schema", "$ref")
            node = node[part]
        self._refs.append(ref)
        try:
            return self.compile(node, ref, depth + 1)
        finally:
            self._refs.pop()


def schema_nodes(schema: object, no_lt: bool = False) -> list:
    """A whole program: the schema's document."""
    b = Builder(no_lt)
    return b.finish(SchemaCompiler(b, schema).compile(schema))


def json_object_nodes() -> list:
    b = Builder()
    return b.finish(b.any_object())
