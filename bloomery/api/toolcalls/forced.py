"""Tool calls under a grammar, in the template's framing, as one Lark grammar with each tool's
parameters embedded as a JSON schema (bloomery.grammar):

  forced_call_grammar   tool_choice required / named (Anthropic any / tool): the reply is the call(s);
  auto_call_grammar     tool_choice auto with a strict tool (OpenAI's function.strict): free text,
                        and once the model opens a call (`<tool_call>`), the call's name is one of
                        the tools and a strict tool's arguments follow its schema (llama-server's
                        lazy grammar, which it applies to every tool). Without a strict tool the
                        reply is not held (the model's own greedy pick stays the fast path).

Hermes:      <tool_call>\\n{"name": "f", "arguments": ARGS}\\n</tool_call>
Qwen3-Coder: <tool_call>\\n<function=f>\\n<parameter=p>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>
             (a string parameter as raw text, newlines included, up to the first
             "\\n</parameter>"; any other value as JSON)
With parallel_tool_calls, more calls may follow, each after a newline; the model ends
the reply (a stop id) once at least one call is whole. Arguments are JSON as the model
writes it, every string escape allowed. SchemaError names a parameters keyword the
engine does not serve, with its JSON path.
"""
from __future__ import annotations

import json

from bloomery.api.toolcalls.request import Tool, ToolRequest
from bloomery import grammar as grammars       # its compilers (and llguidance) load with the first call
from bloomery.grammar import SchemaError


OPENER = "<tool_call>"


def _hermes_call(i: int, tool: Tool, loose: bool = False) -> list[str]:
    """Rule call_i: one call of the tool, after its opener (loose: any JSON object as its arguments)."""
    args = grammars.schema_rule({"type": "object"} if loose else tool.parameters, f"tools[{tool.name}].parameters")
    head = '\n{"name": ' + json.dumps(tool.name, ensure_ascii=False) + ', "arguments": '
    tail = grammars.lark_literal(chr(125) + chr(10) + '</tool_call>')
    return [f"call_{i}: {grammars.lark_literal(head)} args_{i} {tail}",
            f"args_{i}: {args}"]


def _coder_call(i: int, tool: Tool, loose: bool = False) -> list[str]:
    params = tool.parameters
    where = f"tools[{tool.name}].parameters"
    grammars.schema_rule(params, where)        # the whole schema, checked once
    if not isinstance(params, dict) or params.get("type", "object") != "object" or \
            {"anyOf", "oneOf", "allOf", "$ref"} & set(params):
        raise SchemaError(f"{where}: parameters that are not a plain object schema cannot be forced in the "
                          f"Qwen3-Coder framing", "type", "#")
    props = params.get("properties", {}) or {}
    required = params.get("required", []) or []
    rules, parts = [], []
    names = [k for k in props if k in required] + [k for k in props if k not in required]
    for j, name in enumerate(names):
        sub = props[name]
        head = grammars.lark_literal(f"<parameter={name}>\n")
        if isinstance(sub, dict) and sub.get("type") == "string" and not ({"enum", "const"} & set(sub)):
            rules.append(f"p_{i}_{j}: {head} v_{i}_{j} \"\\n\"")
            rules.append(f"v_{i}_{j}[lazy]: /(?s:.*)\\n<\\/parameter>/")
        else:
            defs = {k: params[k] for k in ("$defs", "definitions") if k in params}
            rules.append(f"p_{i}_{j}: {head} {grammars.schema_rule({**sub, **defs}, f'{where}/properties/{name}')} "
                         f"{grammars.lark_literal(chr(10) + '</parameter>' + chr(10))}")
        parts.append(f"p_{i}_{j}" + ("" if name in required else "?"))
    opener = grammars.lark_literal(f"\n<function={tool.name}>\n")
    closer = grammars.lark_literal('</function>' + chr(10) + '</tool_call>')
    rules.insert(0, f"call_{i}: {opener} {' '.join(parts)} {closer}")
    return rules


def _call_rules(framing: str, tools, loose_unless_strict: bool = False) -> list[str]:
    """Rule call: one call of any of the tools, after its opener (a Hermes call of a tool that is not
    strict takes any object as its arguments when loose_unless_strict)."""
    one = _hermes_call if framing == "hermes" else _coder_call
    rules = [r for i, t in enumerate(tools) for r in one(i, t, loose_unless_strict and not t.strict)]
    return ["call: " + " | ".join(f"call_{i}" for i in range(len(tools)))] + rules


def forced_call_grammar(framing: str | None, treq: ToolRequest) -> str:
    """The grammar of a forced reply: one call (or several with parallel_tool_calls) of the allowed tools."""
    if framing is None:
        raise SchemaError("this model's chat template writes no tool-call markup this server knows, so "
                          "tool_choice cannot force a call", "tool_choice")
    op = grammars.lark_literal(OPENER)
    start = f'start: {op} call ("\\n" {op} call)*' if treq.parallel else f"start: {op} call"
    return grammars.lark_grammar("\n".join([start] + _call_rules(framing, treq.forced_tools())) + "\n", "tools")


def auto_call_grammar(framing: str | None, treq: ToolRequest) -> str | None:
    """tool_choice auto: text without a call opener, or text up to the first opener and then the call(s).
    None where there is nothing to hold (no framing) or a tool's schema is one the engine does not serve
    (the reply is then read as before, unconstrained)."""
    if framing is None or not any(t.strict for t in treq.tools):
        return None
    more = f' ("\\n" {grammars.lark_literal(OPENER)} call)*' if treq.parallel else ""
    rules = ["start: FREE | before call" + more,
             f"FREE: /(?s:.*)/ & ~/(?s:.*){OPENER}(?s:.*)/",
             f"before[lazy]: /(?s:.*){OPENER}/"]
    try:
        return grammars.lark_grammar("\n".join(rules + _call_rules(framing, treq.tools, True)) + "\n", "tools")
    except SchemaError:
        return None
