"""tool_choice required / named: grammar nodes that write the call in the template's framing.

Hermes:      <tool_call>\\n{"name": "f", "arguments": ARGS}\\n</tool_call>
Qwen3-Coder: <tool_call>\\n<function=f>\\n<parameter=p>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>
             (a string parameter raw on one line, any other value as JSON)
With parallel_tool_calls, more calls may follow, each after a newline; the model ends
the reply (a stop id) once at least one call is whole. Free strings in a call take no
'<' (the reply is scanned for call tags). SchemaError names a parameters keyword
outside the served subset.
"""
from __future__ import annotations

import json

from bloomery.api.toolcalls.request import Tool, ToolRequest
from bloomery.grammar.schema import Builder, SchemaCompiler, SchemaError, dump_value


def _hermes_call(b: Builder, tool: Tool) -> int:
    args = SchemaCompiler(b, tool.parameters).compile(tool.parameters, f"tools.{tool.name}.parameters")
    head = '<tool_call>\n{"name": ' + dump_value(tool.name, True) + ', "arguments": '
    return b.seq(b.lit(head), args, b.lit("}\n</tool_call>"))


def _coder_call(b: Builder, tool: Tool) -> int:
    params = tool.parameters
    if "anyOf" in params or "$ref" in params:
        raise SchemaError(f"tool {tool.name!r}: parameters with a root anyOf or $ref cannot be forced", "anyOf")
    props = params.get("properties", {}) if isinstance(params, dict) else {}
    required = params.get("required", [])
    comp = SchemaCompiler(b, params)
    comp.compile(params, f"tools.{tool.name}.parameters")     # checks the whole schema against the subset
    items = [b.lit(f"<tool_call>\n<function={tool.name}>\n")]
    for name in [k for k in props if k in required] + [k for k in props if k not in required]:
        sub = props[name]
        if isinstance(sub, dict) and sub.get("type") == "string" and not ({"enum", "const"} & set(sub)):
            value = b.string(sub.get("maxLength"), raw=True)
        else:
            value = comp.compile(sub, f"tools.{tool.name}.parameters/properties/{name}")
        part = b.seq(b.lit(f"<parameter={name}>\n"), value, b.lit("\n</parameter>\n"))
        items.append(part if name in required else b.opt(part))
    items.append(b.lit("</function>\n</tool_call>"))
    return b.seq(*items)


def forced_call_nodes(framing: str | None, treq: ToolRequest) -> list:
    """The program of a forced reply: one call (or several with parallel_tool_calls) of the allowed tools."""
    if framing is None:
        raise SchemaError("this model's chat template writes no tool-call markup this server knows, so "
                          "tool_choice cannot force a call", "tool_choice")
    b = Builder(no_lt=True)
    one = _hermes_call if framing == "hermes" else _coder_call
    call = b.alt(*(one(b, t) for t in treq.forced_tools()))
    if treq.parallel:
        call = b.seq(call, b.add(("star", b.seq(b.lit("\n"), call))))
    return b.finish(call)


__all__ = ["forced_call_nodes", "json"]
