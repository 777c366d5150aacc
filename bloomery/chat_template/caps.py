"""What a template reads, probed with the same questions llama.cpp's jinja::caps_get asks."""
from __future__ import annotations

from dataclasses import dataclass

import jinja2

from .errors import TemplateError
from .sandbox import run_template

# reasoning span openers llama.cpp's autoparser finds in templates that always think
THINK_TAGS = ("<think>", "[THINK]", "<|channel|>", "<seed:think>", "<|START_THINKING|>")


@dataclass(frozen=True)
class Caps:
    string_content: bool = True
    typed_content: bool = False
    system_role: bool = True
    tool_calls: bool = True
    object_arguments: bool = False
    thinking: bool = False   # the template writes a reasoning span (enable_thinking's default)


def _tracking(base: type, method_names: tuple[str, ...]) -> type:
    """A subclass of `base` whose `used` turns true when the template calls one of the methods."""
    def track(name: str):
        method = getattr(base, name)

        def wrapped(self, *args, **kwargs):
            self.used = True
            return method(self, *args, **kwargs)
        wrapped.__name__ = name
        return wrapped
    return type(f"_Track{base.__name__.title()}", (base,),
                {"used": False, **{name: track(name) for name in method_names}})


_TrackList = _tracking(list, ("__iter__", "__getitem__"))
_TrackDict = _tracking(dict, ("__getitem__", "get", "items", "values"))


class _TrackStr(str):
    """Content that notes when the template treats it as an array (iterates or indexes it)."""
    used = False

    def __iter__(self):
        self.used = True
        return str.__iter__(self)

    def __getitem__(self, key):
        if isinstance(key, int):   # a slice is string use
            self.used = True
        return str.__getitem__(self, key)


def _probe(template, messages, tools=None, **extra) -> tuple[bool, str]:
    try:
        return True, run_template(template, {"messages": messages, "tools": tools or [],
                                             "bos_token": "", "eos_token": "",
                                             "add_generation_prompt": True, **extra})
    except TemplateError:
        return False, ""


_PROBE_TOOLS = [{"name": "tool", "type": "function", "function": {
    "name": "tool1", "description": "Tool description", "parameters": {
        "type": "object", "properties": {"arg": {"type": "string", "description": "Arg description"}},
        "required": ["arg"]}}}]


def _call_messages(args) -> tuple[list, list[dict]]:
    calls = _TrackList([{"id": "call00001", "type": "function",
                         "function": {"name": "tool1", "arguments": args}}])
    return calls, [
        {"role": "user", "content": "User message"},
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "content": "Tool response", "tool_call_id": "call00001"},
        {"role": "assistant", "content": "The tool response was 'tool response'"},
        {"role": "user", "content": "User message"}]


def probe_caps(template: jinja2.Template, source: str) -> Caps:
    marker = "STRING_MARKER"
    content = _TrackStr(marker)
    ok, text = _probe(template, [{"role": "user", "content": content}])
    typed = content.used
    string = ok and not (typed and marker not in text)
    parts = _TrackList([])
    ok, _ = _probe(template, [{"role": "user", "content": parts}])
    typed = typed or (ok and parts.used)

    ok, text = _probe(template, [{"role": "system", "content": "SYSTEM_MARKER"},
                                 {"role": "user", "content": "User message"}])
    system_role = "SYSTEM_MARKER" in text

    args = _TrackDict({"arg": "value"})
    calls, msgs = _call_messages(args)
    ok, _ = _probe(template, msgs, _PROBE_TOOLS)
    object_arguments = ok and calls.used and args.used
    tool_calls = ok and calls.used
    if not object_arguments:
        calls, msgs = _call_messages('{"arg": "value"}')
        ok, _ = _probe(template, msgs, _PROBE_TOOLS)
        tool_calls = ok and calls.used

    user = [{"role": "user", "content": "test"}]
    _, on = _probe(template, user, enable_thinking=True)
    _, off = _probe(template, user, enable_thinking=False)
    # llama.cpp's autoparser looks for a reasoning span, not merely a use of the variable
    thinking = any(tag in text for text in (source, on, off) for tag in THINK_TAGS)
    return Caps(string_content=string, typed_content=typed, system_role=system_role,
                tool_calls=tool_calls, object_arguments=object_arguments, thinking=thinking)
