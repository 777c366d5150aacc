"""An Anthropic Messages body -> the chat body the chat route renders, as llama-server converts it.

system (a string or text blocks) -> a system message; content blocks: text ->
text parts, thinking -> reasoning_content, tool_use -> the assistant's tool_calls,
tool_result -> tool messages after the turn's own message; tools (input_schema)
-> function tools; tool_choice auto / any / tool / none; stop_sequences -> stop;
thinking {"type": "enabled", "budget_tokens": N} -> the think span's budget (thinking_budget_tokens).
Unlike llama-server (which defaults it to 4096), max_tokens is required, as Anthropic's API has it.
Images are refused by name: this server reads no images.
"""
from __future__ import annotations

import json

from bloomery.api.params import field_error
from bloomery.http.types import ApiError


def _system_text(system: object) -> str:
    if isinstance(system, str):
        return system
    if isinstance(system, list):
        out = ""
        for i, block in enumerate(system):
            if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
                raise field_error("system", f"system[{i}] must be a text block {{\"type\": \"text\", \"text\": ...}}")
            out += block["text"]
        return out
    raise field_error("system", "must be a string or an array of text blocks")


def _tool_result(block: dict, where: str) -> dict:
    content = block.get("content")
    if isinstance(content, list):
        text = ""
        for j, c in enumerate(content):
            kind = c.get("type") if isinstance(c, dict) else None
            if kind in ("image", "document"):
                raise field_error("messages", f"{where}.content[{j}]: {kind} input is not supported by this server "
                                              f"(it reads text only: no vision model is loaded)")
            if kind != "text":
                raise field_error("messages", f"{where}.content[{j}]: type {kind!r} is not supported in a tool_result "
                                              f"(only text)")
            text += str(c.get("text", ""))
        content = text
    elif content is None:
        content = ""
    elif not isinstance(content, str):
        raise field_error("messages", f"{where}.content must be a string or an array of text blocks")
    return {"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")), "content": content}


def messages_to_chat(messages: object) -> list[dict]:
    if not isinstance(messages, list):
        raise field_error("messages", "must be an array of message objects")
    out: list[dict] = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise field_error("messages", f"{where} must be an object")
        role, content = msg.get("role"), msg.get("content")
        if role not in ("user", "assistant"):
            raise field_error("messages", f"{where}.role must be 'user' or 'assistant', got {role!r}")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise field_error("messages", f"{where}.content must be a string or an array of content blocks")
        parts, calls, results, reasoning = [], [], [], ""
        for j, block in enumerate(content):
            bwhere = f"{where}.content[{j}]"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                if not isinstance(block.get("text"), str):
                    raise field_error("messages", f"{bwhere} (text) requires 'text' (a string)")
                parts.append({"type": "text", "text": block["text"]})
            elif kind in ("thinking", "redacted_thinking"):
                reasoning += str(block.get("thinking", ""))
            elif kind == "tool_use":
                if not isinstance(block.get("name"), str):
                    raise field_error("messages", f"{bwhere} (tool_use) requires 'name' (a string)")
                args = block.get("input", {})
                calls.append({"id": str(block.get("id", "")), "type": "function",
                              "function": {"name": block["name"],
                                           "arguments": json.dumps(args, ensure_ascii=False)}})
            elif kind == "tool_result":
                results.append(_tool_result(block, bwhere))
            elif kind in ("image", "document"):
                raise field_error("messages", f"{bwhere}: {kind} input is not supported by this server "
                                              f"(it reads text only: no vision model is loaded)")
            else:
                raise field_error("messages", f"{bwhere}: unknown content block type {kind!r}")
        if parts or calls or reasoning:
            m: dict = {"role": role, "content": parts if parts else ""}
            if calls:
                m["tool_calls"] = calls
            if reasoning:
                m["reasoning_content"] = reasoning
            out.append(m)
        out += results
    return out


def _tool_choice(tc: object) -> object:
    if tc is None:
        return None
    kind = tc.get("type") if isinstance(tc, dict) else None
    if kind == "auto":
        return "auto"
    if kind == "none":
        return "none"
    if kind == "any":
        return "required"
    if kind == "tool":
        return {"type": "function", "function": {"name": tc.get("name")}}
    raise field_error("tool_choice", f"type must be one of auto, any, tool, none, got {kind!r}")


def to_chat_body(body: dict, *, need_max_tokens: bool = True) -> dict:
    if "messages" not in body or body["messages"] is None:
        raise ApiError(400, "messages: Field required", param="messages")
    chat: dict = {"messages": []}
    if body.get("system") is not None:
        chat["messages"].append({"role": "system", "content": _system_text(body["system"])})
    chat["messages"] += messages_to_chat(body["messages"])
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise field_error("tools", "must be an array of tool objects")
        chat["tools"] = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or not isinstance(t.get("name"), str):
                raise field_error("tools", f"tools[{i}] requires 'name' (a string)")
            if t.get("type") not in (None, "custom"):
                raise field_error("tools", f"tools[{i}]: server tool type {t.get('type')!r} is not supported "
                                           f"by this server")
            chat["tools"].append({"type": "function", "function": {
                "name": t["name"], "description": t.get("description", ""),
                "parameters": t.get("input_schema") or {"type": "object", "properties": {}},
                **({"strict": t["strict"]} if "strict" in t else {})}})
    tc = _tool_choice(body.get("tool_choice"))
    if tc is not None:
        chat["tool_choice"] = tc
    if need_max_tokens and body.get("max_tokens") is None:
        raise ApiError(400, "max_tokens: Field required", param="max_tokens")
    if body.get("max_tokens") is not None:
        chat["max_tokens"] = body["max_tokens"]
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    for key in ("temperature", "top_p", "top_k", "chat_template_kwargs", "reasoning_loop"):
        if key in body:
            chat[key] = body[key]
    thinking = body.get("thinking")
    if thinking is not None:
        if not isinstance(thinking, dict):
            raise field_error("thinking", "must be an object such as {\"type\": \"enabled\", \"budget_tokens\": N}")
        if thinking.get("type") == "enabled":     # as llama-server: the think span's budget (default 10000)
            budget = thinking.get("budget_tokens", 10000)
            if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
                raise field_error("thinking", f"budget_tokens must be an integer >= 0, got {budget!r}")
            chat["thinking_budget_tokens"] = budget
    return chat
