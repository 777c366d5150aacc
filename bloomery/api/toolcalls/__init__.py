"""Tool calls, route-independent: which framing a chat template uses, the request's
tools and tool_choice, the parser of the model's text into content + calls, and the
grammar that forces a call.

  framing = framing_of(template_source)          # "hermes" | "qwen3_coder" | None
  treq = read_tool_request(body_fields)          # ToolRequest: tools, choice, parallel
  grammar = forced_call_grammar(framing, treq)   # tool_choice required / named -> grammar text
  grammar = auto_call_grammar(framing, treq)     # auto + strict tools: the calls opened held to their schemas
  parser = make_parser(framing, treq)            # CallParser (None framing: content only)
  events = parser.feed(text) + parser.finish(cut=finish_reason == "length")
    # ContentDelta(text) | CallStart(index, id, name) | ArgsDelta(index, text) | CallEnd(index)
  calls = parser.calls                            # [ToolCall(id, name, arguments)] so far

Frames (what the model writes):
  hermes (Qwen2.5, Qwen3):  <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>
  qwen3_coder:              <tool_call>\\n<function=f>\\n<parameter=p>\\nvalue\\n</parameter>\\n</function>\\n</tool_call>

The events map one to one onto OpenAI's streamed tool_call deltas (index, id, type and
function.name first, then function.arguments pieces), onto Anthropic's tool_use blocks and
onto Responses' function_call items. A call cut by the token limit (finish(cut=True)) stays
a call once its name is whole (arguments so far) and turns back into content before; a
generation that ends on its own inside a call raises CallError naming it (a 500).
"""
from bloomery.api.toolcalls.forced import auto_call_grammar, forced_call_grammar
from bloomery.api.toolcalls.framing import framing_of
from bloomery.api.toolcalls.parser import (ArgsDelta, CallEnd, CallError, CallParser, CallStart, ContentDelta,
                                           ToolCall, make_parser)
from bloomery.api.toolcalls.request import ToolRequest, read_tool_request

__all__ = ["ArgsDelta", "CallEnd", "CallError", "CallParser", "CallStart", "ContentDelta", "ToolCall",
           "ToolRequest", "auto_call_grammar", "forced_call_grammar", "framing_of", "make_parser", "read_tool_request"]
