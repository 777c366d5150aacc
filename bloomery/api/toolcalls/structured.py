"""A chat request's structured output: response_format, llama-server's grammar field, forced tool
calls and the calls a tool_choice auto reply opens -> the grammar text SamplingParams.grammar
carries (route-independent: Anthropic's any/tool and Responses' text.format map onto the same
inputs).

Refusals name the field: a schema keyword the engine does not serve (response_format or
tools, with its JSON path), an invalid GBNF grammar (line and column), two structured
outputs at once, ignore_eos or reasoning_budget beside one. Under a schema, temperature
defaults to 0 (greedy over the allowed ids).
"""
from __future__ import annotations

from dataclasses import replace

from bloomery.api.params import GenParams, field_error
from bloomery.api.reasoning import ReasoningSettings
from bloomery.api.toolcalls.forced import auto_call_grammar, forced_call_grammar
from bloomery.api.toolcalls.request import ToolRequest
from bloomery import grammar as grammars       # its compilers (and llguidance) load with the first call
from bloomery.grammar import SchemaError


def response_format_grammar(rf: object) -> str | None:
    """OpenAI's response_format -> grammar text, None for text."""
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise field_error("response_format", "must be an object with a 'type'")
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        schema = rf.get("schema")      # llama-server also takes a schema here
        return grammars.json_object_grammar() if schema is None else grammars.schema_grammar(schema)
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or "schema" not in js:
            raise field_error("response_format", "json_schema needs {\"json_schema\": {\"schema\": {...}}}")
        return grammars.schema_grammar(js["schema"])
    raise field_error("response_format", f"type must be 'text', 'json_object' or 'json_schema', got {kind!r}")


def apply_structured(p: GenParams, body: dict, treq: ToolRequest, framing: str | None,
                     rs: ReasoningSettings, think_open: bool, temperature_set: bool) -> GenParams:
    """GenParams with the grammar set (or unchanged when the request asks for none)."""
    try:
        doc = response_format_grammar(body.get("response_format"))
    except SchemaError as e:
        raise field_error("response_format", str(e)) from None
    gbnf = p.sampling.grammar or None       # llama-server's grammar field, read with the sampling fields
    if doc is not None and gbnf is not None:
        raise field_error("grammar", "give grammar or response_format (json_schema), not both")
    doc = doc if doc is not None else gbnf
    forced = None
    if treq.forced:
        if doc is not None:
            raise field_error("response_format" if gbnf is None else "grammar",
                              "a structured output beside a forced tool_choice is not served")
        if rs.budget_set and rs.budget != -1:
            raise field_error("reasoning_budget", "a finite reasoning_budget beside a forced tool_choice is not served")
        try:
            forced = forced_call_grammar(framing, treq)
        except SchemaError as e:
            raise field_error("tools" if e.keyword != "tool_choice" else "tool_choice", str(e)) from None
    grammar = doc if doc is not None else forced
    if grammar is None:
        return _auto_calls(p, treq, framing, rs)
    if rs.budget_set and rs.budget != -1:
        raise field_error("reasoning_budget", "a finite reasoning_budget beside structured output is not served "
                                              "(the grammar closes an open think span at once)")
    if p.ignore_eos:
        raise field_error("ignore_eos", "ignore_eos beside structured output is not served (the grammar ends it)")
    if think_open:
        grammar = grammars.after_prefix(grammar, "</think>\n\n")
    sampling = replace(p.sampling, grammar=grammar)
    if not temperature_set:
        sampling = replace(sampling, temperature=0.0)
    return replace(p, sampling=sampling)


def _auto_calls(p: GenParams, treq: ToolRequest, framing: str | None, rs: ReasoningSettings) -> GenParams:
    """tool_choice auto: the calls the model opens are held to their tools' schemas (llama-server's lazy
    grammar); the text around them is free and the sampling is the request's. Left out beside a finite
    reasoning budget, the request's or the server's (its forced ids start a new leg), and ignore_eos."""
    if not treq.parsing or treq.forced or p.ignore_eos or rs.budget != -1:
        return p
    grammar = auto_call_grammar(framing, treq)
    return p if grammar is None else replace(p, sampling=replace(p.sampling, grammar=grammar))
