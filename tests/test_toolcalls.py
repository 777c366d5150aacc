"""Tool-call framing, the forced-call grammar and the incremental parser (pure, CPU)."""
from __future__ import annotations

import json

import pytest

from byte_vocab import feed, ok
from bloomery.api.toolcalls import (ArgsDelta, CallError, CallStart, ContentDelta, auto_call_grammar,
                                    forced_call_grammar, framing_of, make_parser, read_tool_request)
from bloomery.api.toolcalls.reply import Reply
from bloomery.http.types import ApiError
import captures

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}, "required": ["city"]}}}]
HERMES = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
CODER = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis, FR\n</parameter>\n</function>\n</tool_call>"


def treq(**kw):
    return read_tool_request({"tools": TOOLS, **kw})


def test_framing_read_from_the_template():
    assert framing_of("... <tool_call>\n{\"name\": ...") == "hermes"
    assert framing_of("<tool_call>\n<function={{ name }}>\n<parameter=x>") == "qwen3_coder"
    assert framing_of("{{ messages }}") is None


@pytest.mark.parametrize("framing,text", [("hermes", HERMES), ("qwen3_coder", CODER)])
def test_forced_grammar_accepts_the_framed_call(framing, text):
    g = forced_call_grammar(framing, treq(tool_choice="required", parallel_tool_calls=False))
    assert ok(g, text)
    assert not ok(g, text.replace("get_weather", "other"))


CODE = 'if a < b:\n    print("x\\ty")\n'      # two lines of Python with '<', quotes and a backslash


@pytest.mark.parametrize("framing,text", [
    ("hermes", '<tool_call>\n{"name": "write", "arguments": {"path": "a.py", "code": ' + json.dumps(CODE) + '}}\n'
               '</tool_call>'),
    ("qwen3_coder", "<tool_call>\n<function=write>\n<parameter=path>\na.py\n</parameter>\n<parameter=code>\n"
                    + CODE + "\n</parameter>\n</function>\n</tool_call>"),
])
def test_forced_call_arguments_keep_newlines_quotes_and_escapes(framing, text):
    tools = [{"type": "function", "function": {"name": "write", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}, "code": {"type": "string"}},
        "required": ["path", "code"]}}}]
    g = forced_call_grammar(framing, read_tool_request({"tools": tools, "tool_choice": "required",
                                                        "parallel_tool_calls": False}))
    assert ok(g, text)


def test_parallel_calls_may_follow():
    g = forced_call_grammar("hermes", treq(tool_choice="required"))
    n, whole = feed(g, HERMES + "\n" + HERMES)
    assert whole and n == len(HERMES) * 2 + 1


@pytest.mark.parametrize("framing,text,args", [
    ("hermes", "Sure." + "\n" + HERMES + "\n", {"city": "Paris", "unit": "c"}),
    ("qwen3_coder", "Sure. " + CODER, {"city": "Paris, FR"}),
])
def test_stream_equals_whole(framing, text, args):
    whole = make_parser(framing, treq())
    ev = whole.feed(text) + whole.finish(False)
    assert [e.text for e in ev if isinstance(e, ContentDelta)] == ["Sure."]
    assert [json.loads(c.arguments) for c in whole.calls] == [args]
    streamed = make_parser(framing, treq())
    events = []
    for ch in text:
        events += streamed.feed(ch)
    events += streamed.finish(False)
    starts = [e for e in events if isinstance(e, CallStart)]
    assert [(s.index, s.name) for s in starts] == [(0, "get_weather")]
    assert json.loads("".join(e.text for e in events if isinstance(e, ArgsDelta))) == args
    assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == "Sure."


def test_cut_call_before_and_after_its_name():
    before = make_parser("hermes", treq())
    ev = before.feed(HERMES[:20]) + before.finish(cut=True)
    assert not before.calls and "".join(e.text for e in ev if isinstance(e, ContentDelta)) == HERMES[:20]
    after = make_parser("hermes", treq())
    after.feed(HERMES[:60])
    after.finish(cut=True)
    assert after.calls[0].name == "get_weather" and after.calls[0].arguments == HERMES[49:60]


def test_call_left_open_without_the_limit_is_an_error():
    p = make_parser("hermes", treq())
    p.feed(HERMES[:60])
    with pytest.raises(CallError, match="tool call 0 \\(get_weather\\)"):
        p.finish(cut=False)


def test_tool_choice_none_keeps_content():
    p = make_parser("hermes", treq(tool_choice="none"))
    ev = p.feed(HERMES) + p.finish(False)
    assert not p.calls and "".join(e.text for e in ev) == HERMES


def test_reply_message_shape():
    r = Reply("hermes", treq())
    r.feed(HERMES)
    r.finish(False)
    msg = r.message()
    assert msg["content"] is None and msg["tool_calls"][0]["function"]["name"] == "get_weather"
    assert r.finish_reason("stop") == "tool_calls"


@pytest.mark.parametrize("body,word", [
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]}, "strict"),
])
def test_bad_tool_fields_named(body, word):
    with pytest.raises(ApiError) as e:
        read_tool_request({"tools": TOOLS, **body})
    assert word in str(e.value.body())


@pytest.mark.real_model
def test_tools_render_as_llama_servers_apply_template(real_model_path):
    """The tools request's prompt equals llama-server's /apply-template answer on the same file
    (the recorded answer in tests/golden/llama_server)."""
    from bloomery.chat_template import ChatTemplate
    from bloomery.gguf_file import open_gguf
    req = captures.request("apply_template_tools_fewshot")["body_json"]
    want = captures.response("apply_template_tools_fewshot")["prompt"]
    source = open_gguf(str(real_model_path)).get("tokenizer.chat_template")
    got = ChatTemplate(source).render(req["messages"], tools=req["tools"], add_generation_prompt=True).text
    assert got == want
    assert framing_of(source) == "hermes"


@pytest.mark.parametrize("parallel", [True, False])
def test_auto_calls_are_held_to_the_schema_once_opened(parallel):
    """tool_choice auto with a strict tool: free text, or text then a call whose arguments follow the
    tool's schema."""
    assert auto_call_grammar("hermes", treq(parallel_tool_calls=parallel)) is None    # no strict tool: free
    strict = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": True}}]
    g = auto_call_grammar("hermes", read_tool_request({"tools": strict, "parallel_tool_calls": parallel}))
    assert ok(g, "Hello, <b>no call</b> here") and ok(g, "Let me check.\n" + HERMES) and ok(g, HERMES)
    assert ok(g, HERMES + "\n" + HERMES) is parallel
    n, whole = feed(g, "x" + HERMES.replace('"c"', '"k"'))
    assert not whole and n == len("x" + HERMES[:HERMES.index('"c"')]) + 1       # stops at the k
    assert not ok(g, '<tool_call>\n{"name": "other"')
    assert ok(auto_call_grammar("qwen3_coder", read_tool_request({"tools": strict})), "Sure. " + CODER)
    assert auto_call_grammar(None, read_tool_request({"tools": strict})) is None
    loose = strict + [{"type": "function", "function": {"name": "g", "parameters": {"type": "object"}}}]
    assert ok(auto_call_grammar("hermes", read_tool_request({"tools": loose})),
              '<tool_call>\n{"name": "g", "arguments": {"any": [1]}}\n</tool_call>')
    bad = [{"type": "function", "function": {"name": "f", "strict": True,
                                             "parameters": {"type": "object", "not": {}}}}]
    assert auto_call_grammar("hermes", read_tool_request({"tools": bad})) is None    # read as before, unheld
