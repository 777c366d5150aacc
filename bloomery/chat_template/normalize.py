"""llama-server's message, tool and argument normalisation (common/chat.cpp's oaicompat parsing).

parse_messages and parse_tools check a request's shape and name the field that is wrong;
apply_caps then rewrites the messages into what the template can read.
"""
from __future__ import annotations

import json

from .caps import Caps
from .errors import TemplateError


def parse_messages(messages) -> list[dict]:
    """Client messages -> the dicts llama-server hands its templates (before the caps fixes)."""
    if not isinstance(messages, list):
        raise TemplateError(f"'messages' must be an array, got {type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise TemplateError(f"{where} must be an object, got {type(m).__name__}")
        role = m.get("role")
        if not isinstance(role, str):
            raise TemplateError(f"{where}.role must be a string, got {json.dumps(role)}")
        has_content, has_calls = "content" in m, "tool_calls" in m
        if role != "assistant" and not has_content:
            raise TemplateError(f"{where}: all non-assistant messages must contain 'content'")
        if not has_content and not has_calls:
            raise TemplateError(f"{where}: an assistant message must contain either 'content' or 'tool_calls'")
        msg: dict = {"role": role, "content": _parse_content(m.get("content"), where)}
        for key in ("reasoning_content", "name", "tool_call_id"):
            val = m.get(key)
            if val is not None and not isinstance(val, str):
                raise TemplateError(f"{where}.{key} must be a string, got {json.dumps(val)}")
            if val:
                msg[key] = val
        if has_calls and m["tool_calls"] is not None:
            where_calls = f"{where}.tool_calls"
            calls = [_parse_call(c, f"{where_calls}[{j}]") for j, c in enumerate(_list(m["tool_calls"], where_calls))]
            if calls:
                msg["tool_calls"] = calls
        out.append(msg)
    return out


def _list(v, where: str) -> list:
    if not isinstance(v, list):
        raise TemplateError(f"{where} must be an array, got {type(v).__name__}")
    return v


def _parse_content(content, where: str):
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise TemplateError(f"{where}.content must be a string or an array of parts, got {type(content).__name__}")
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or "type" not in part:
            raise TemplateError(f"{where}.content[{j}]: missing content part type")
        if part["type"] != "text":
            raise TemplateError(f"{where}.content[{j}]: unsupported content part type {json.dumps(part['type'])} "
                                "(this server takes \"text\" parts only)")
        if not isinstance(part.get("text"), str):
            raise TemplateError(f"{where}.content[{j}].text must be a string")
        parts.append({"type": "text", "text": part["text"]})
    return parts or ""


def _function_name(fn, where: str) -> str:
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise TemplateError(f"{where}.function.name is missing or not a string")
    return fn["name"]


def _parse_call(c, where: str) -> dict:
    if not isinstance(c, dict) or c.get("type") != "function":
        raise TemplateError(f"{where}: unsupported tool call type (expected \"function\")")
    fn = c.get("function")
    name = _function_name(fn, where)
    if "arguments" not in fn:
        raise TemplateError(f"{where}.function.arguments is missing")
    args = fn["arguments"]
    if not isinstance(args, str):   # llama.cpp keeps arguments as compact JSON text
        args = json.dumps(args, ensure_ascii=False, separators=(",", ":"))
    call = {"type": "function", "function": {"name": name, "arguments": args}}
    if c.get("id"):
        call["id"] = str(c["id"])
    return call


def parse_tools(tools) -> list[dict]:
    if tools is None:
        return []
    out = []
    for i, t in enumerate(_list(tools, "tools")):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function":
            raise TemplateError(f"{where}: unsupported tool type (expected \"function\")")
        fn = t.get("function")
        name = _function_name(fn, where)
        desc = fn.get("description", "")
        if not isinstance(desc, str):
            raise TemplateError(f"{where}.function.description must be a string")
        out.append({"type": "function", "function": {"name": name, "description": desc,
                                                       "parameters": fn.get("parameters", {})}})
    return out


def _text_of(content) -> str:
    """Content parts joined by newlines, as llama-server flattens them."""
    return content if isinstance(content, str) else "\n".join(p["text"] for p in content)


def apply_caps(msgs: list[dict], caps: Caps, source: str) -> list[dict]:
    """llama-server's fixes for what the template cannot read, in place."""
    only_string = caps.string_content and not caps.typed_content
    only_typed = caps.typed_content and not caps.string_content
    for m in msgs:
        c = m["content"]
        if only_string and isinstance(c, list):
            m["content"] = _text_of(c)
        elif only_typed and isinstance(c, str):
            m["content"] = [{"type": "text", "text": c}]
    if "<|channel|>" not in source:   # GPT-OSS keeps its developer role
        for m in msgs:
            if m["role"] == "developer":
                m["role"] = "system"
    if not caps.system_role and msgs and msgs[0]["role"] == "system":
        first = msgs.pop(0)
        if msgs:
            msgs[0]["content"] = _text_of(first["content"]) + "\n" + _text_of(msgs[0]["content"])
    if caps.object_arguments:
        for i, m in enumerate(msgs):
            for j, call in enumerate(m.get("tool_calls", [])):
                fn = call["function"]
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except ValueError as e:
                    raise TemplateError(f"messages[{i}].tool_calls[{j}].function.arguments "
                                        f"is not valid JSON: {e}") from None
    return msgs


def template_args(chat_template_kwargs=None, reasoning_effort=None,
                  default_enable_thinking: bool | None = None) -> dict:
    """A request's chat_template_kwargs and reasoning_effort -> render()'s keyword arguments.

    As llama-server: "none" turns thinking off and drops reasoning_effort, another word is
    passed as reasoning_effort; an enable_thinking in chat_template_kwargs wins over both.
    """
    if chat_template_kwargs is None:
        chat_template_kwargs = {}
    if not isinstance(chat_template_kwargs, dict):
        raise TemplateError(f"chat_template_kwargs must be an object, got {type(chat_template_kwargs).__name__}")
    kwargs = dict(chat_template_kwargs)
    enable_thinking = default_enable_thinking
    if reasoning_effort is not None:
        if not isinstance(reasoning_effort, str):
            raise TemplateError(f"reasoning_effort must be a string, got {json.dumps(reasoning_effort)}")
        if reasoning_effort == "none":
            enable_thinking = False
            kwargs.pop("reasoning_effort", None)
        elif reasoning_effort:
            kwargs["reasoning_effort"] = reasoning_effort
    if "enable_thinking" in kwargs:
        value = kwargs.pop("enable_thinking")
        if isinstance(value, str):
            raise TemplateError("invalid type for \"enable_thinking\" (expected boolean, got string)")
        enable_thinking = value
    return {"enable_thinking": enable_thinking, **kwargs}
