"""A chat request's structured output: response_format and forced tool calls -> the grammar
text SamplingParams.grammar carries (route-independent: Anthropic's any/tool and Responses'
text.format map onto the same two inputs).

Refusals name the field: a schema keyword outside the subset (response_format or tools),
a JSON response_format beside a forced call, ignore_eos or reasoning_budget beside a
schema. Under a schema, temperature defaults to 0 (greedy over the allowed ids).
"""
from __future__ import annotations

from dataclasses import replace

from bloomery.api.params import GenParams, field_error
from bloomery.api.reasoning import ReasoningSettings
from bloomery.api.toolcalls.forced import forced_call_nodes
from bloomery.api.toolcalls.request import ToolRequest
from bloomery.grammar import Program, SchemaError, json_object_nodes, schema_nodes
from bloomery.grammar.schema import Builder


def response_format_nodes(rf: object, no_lt: bool) -> list | None:
    """OpenAI's response_format -> nodes, None for text."""
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise field_error("response_format", "must be an object with a 'type'")
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        schema = rf.get("schema")      # llama-server also takes a schema here
        return json_object_nodes() if schema is None else schema_nodes(schema, no_lt)
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or "schema" not in js:
            raise field_error("response_format", "json_schema needs {\"json_schema\": {\"schema\": {...}}}")
        return schema_nodes(js["schema"], no_lt)
    raise field_error("response_format", f"type must be 'text', 'json_object' or 'json_schema', got {kind!r}")


def close_think_first(nodes: list) -> list:
    """The prompt left a think span open: close it at once and write the document after it."""
    b = Builder()
    shift = 1     # every node moves up one: index 0 is the new root

    def moved(n):
        kind = n[0]
        if kind in ("seq", "alt"):
            return (kind, tuple(c + shift for c in n[1]))
        if kind == "star":
            return (kind, n[1] + shift)
        return n
    b.nodes = [None] + [moved(n) for n in nodes]
    return b.finish(b.seq(b.lit("</think>\n\n"), 1))


def apply_structured(p: GenParams, body: dict, treq: ToolRequest, framing: str | None,
                     rs: ReasoningSettings, think_open: bool, temperature_set: bool) -> GenParams:
    """GenParams with the grammar set (or unchanged when the request asks for none)."""
    rf = body.get("response_format")
    try:
        doc = response_format_nodes(rf, no_lt=treq.parsing)
    except SchemaError as e:
        raise field_error("response_format", str(e)) from None
    forced = None
    if treq.forced:
        if doc is not None:
            raise field_error("response_format", "a JSON response_format beside a forced tool_choice is not served")
        if rs.budget_set and rs.budget != -1:
            raise field_error("reasoning_budget", "a finite reasoning_budget beside a forced tool_choice is not served")
        try:
            forced = forced_call_nodes(framing, treq)
        except SchemaError as e:
            raise field_error("tools" if e.keyword != "tool_choice" else "tool_choice", str(e)) from None
    nodes = doc if doc is not None else forced
    if nodes is None:
        return p
    if rs.budget_set and rs.budget != -1:
        raise field_error("reasoning_budget", "a finite reasoning_budget beside structured output is not served "
                                              "(the schema closes an open think span at once)")
    if p.ignore_eos:
        raise field_error("ignore_eos", "ignore_eos beside structured output is not served (the schema ends it)")
    if think_open:
        nodes = close_think_first(nodes)
    sampling = replace(p.sampling, grammar=Program(nodes).to_json())
    if not temperature_set:
        sampling = replace(sampling, temperature=0.0)
    return replace(p, sampling=sampling)
