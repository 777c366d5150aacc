"""An OpenAI Responses body -> the chat body the chat route renders, as llama-server converts it.

instructions -> a system message first; input (a string, or items: messages,
function_call, function_call_output, reasoning) -> messages; function tools ->
chat tools; max_output_tokens -> max_tokens; reasoning.effort -> reasoning_effort.
previous_response_id puts the stored conversation (its input and output, not its
instructions) before the new input. Every shape we cannot read is a 400 naming it.
"""
from __future__ import annotations

from bloomery.api.params import field_error
from bloomery.http.types import ApiError

_INPUT_ROLES = ("user", "system", "developer")


def _text_parts(content: list, where: str, kinds: tuple[str, ...]) -> list[dict]:
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds:
            raise field_error("input", f"{where}.content[{j}]: type must be one of {', '.join(kinds)}, got {kind!r}"
                              + (" (this server reads no images or files)" if kind in ("input_image", "input_file")
                                 else ""))
        if not isinstance(part.get("text"), str):
            raise field_error("input", f"{where}.content[{j}] ({kind}) requires 'text' (a string)")
        parts.append({"type": "text", "text": part["text"]})
    return parts


def items_to_messages(items: list) -> list[dict]:
    """Responses input items -> chat messages; an assistant item after an assistant message merges into it."""
    msgs: list[dict] = []

    def assistant() -> dict:
        if msgs and msgs[-1]["role"] == "assistant":
            return msgs[-1]
        msgs.append({"role": "assistant", "content": []})
        return msgs[-1]

    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise field_error("input", f"{where} must be an object, but is {type(item).__name__}")
        kind, role, content = item.get("type"), item.get("role"), item.get("content")
        if kind == "item_reference":
            raise field_error("input", f"{where}: item_reference items are not supported by this server")
        if kind in (None, "message") and role in _INPUT_ROLES:
            if isinstance(content, str):
                content = [{"type": "input_text", "text": content}]
            if not isinstance(content, list):
                raise field_error("input", f"{where}.content must be a string or an array of content parts")
            msgs.append({"role": role, "content": _text_parts(content, where, ("input_text",))})
        elif kind in (None, "message") and role == "assistant":
            if isinstance(content, str):
                content = [{"type": "output_text", "text": content}]
            if not isinstance(content, list):
                raise field_error("input", f"{where}.content must be a string or an array of content parts")
            parts = _text_parts(content, where, ("output_text", "input_text"))
            msg = assistant()
            msg["content"] = (msg["content"] if isinstance(msg["content"], list) else []) + parts
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise field_error("input", f"{where} (function_call) requires '{key}' (a string)")
            assistant().setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function",
                 "function": {"name": item["name"], "arguments": item["arguments"]}})
        elif kind == "function_call_output":
            out = item.get("output")
            if not isinstance(item.get("call_id"), str):
                raise field_error("input", f"{where} (function_call_output) requires 'call_id' (a string)")
            if isinstance(out, list):
                out = "".join(p["text"] for p in _text_parts(out, where + ".output", ("input_text",)))
            if not isinstance(out, str):
                raise field_error("input", f"{where} (function_call_output) requires 'output' (a string or parts)")
            msgs.append({"role": "tool", "tool_call_id": item["call_id"], "content": out})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            text = "".join(p.get("text", "") for p in parts if isinstance(p, dict))
            assistant()["reasoning_content"] = text
        else:
            raise field_error("input", f"{where}: cannot read an item of type {kind!r} with role {role!r}")
    for m in msgs:     # an assistant turn of tool calls only has no content parts
        if m["role"] == "assistant" and m["content"] == []:
            m["content"] = ""
    return msgs


def read_tools(tools: object) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise field_error("tools", "must be an array of tool objects")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else type(t).__name__
            raise field_error("tools", f"tools[{i}]: type {kind!r} is not supported by this server (only 'function')")
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise field_error("tools", f"tools[{i}] requires 'name' (a non-empty string)")
        fn = {k: v for k, v in t.items() if k != "type"}
        out.append({"type": "function", "function": fn})
    return out or None


def input_messages(body: dict) -> list[dict]:
    """The messages of this request's own input (not instructions, not the previous response's)."""
    if "input" not in body or body["input"] is None:
        raise ApiError(400, "'input' is required", param="input")
    v = body["input"]
    if isinstance(v, str):
        return [{"role": "user", "content": v}]
    if isinstance(v, list):
        return items_to_messages(v)
    raise field_error("input", f"must be a string or an array of items, but is {type(v).__name__}")


def to_chat_body(body: dict, store, *, for_count: bool = False) -> dict:
    """The chat body of a Responses request; `store` gives previous_response_id's conversation."""
    if body.get("conversation") is not None:
        raise field_error("conversation", "conversations are not supported by this server; "
                                          "use previous_response_id or send the items")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise field_error("instructions", "must be a string")
    msgs: list[dict] = []
    if instructions is not None:
        msgs.append({"role": "system", "content": instructions})
    prev_id = body.get("previous_response_id")
    if prev_id is not None:
        if not isinstance(prev_id, str):
            raise field_error("previous_response_id", "must be a string")
        msgs += store.conversation(prev_id)
    msgs += input_messages(body)
    chat = {k: v for k, v in body.items()
            if k not in ("input", "instructions", "tools", "max_output_tokens", "reasoning", "text", "stream")}
    chat["messages"] = msgs
    tools = read_tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise field_error("reasoning", "must be an object")
        if reasoning.get("effort") is not None:
            chat["reasoning_effort"] = reasoning["effort"]
    text = body.get("text")
    if text is not None and not for_count:
        fmt = text.get("format") if isinstance(text, dict) else None
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_schema":
            if "schema" not in fmt:
                raise field_error("text", "text.format json_schema needs a 'schema'")
            chat["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": fmt.get("name", ""), "schema": fmt["schema"]}}
        elif kind == "json_object":
            chat["response_format"] = {"type": "json_object"}
        elif fmt is not None and kind != "text":
            raise field_error("text", f"text.format type must be 'text', 'json_schema' or 'json_object', got {kind!r}")
    top = body.get("top_logprobs")
    if top not in (None, 0) and not for_count:
        raise field_error("top_logprobs", "logprobs are not rendered on /v1/responses by this server")
    return chat
