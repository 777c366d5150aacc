"""The request's tools, tool_choice and parallel_tool_calls, checked, with errors naming the field."""
from __future__ import annotations

from dataclasses import dataclass, field

from bloomery.http.types import ApiError


def _err(name: str, problem: str) -> ApiError:
    return ApiError(400, f"Field '{name}': {problem}", "invalid_request_error", param=name.split(".")[0].split("[")[0])


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict
    strict: bool = False              # OpenAI's function.strict: its calls follow the schema under tool_choice auto too


@dataclass(frozen=True)
class ToolRequest:
    tools: tuple[Tool, ...] = ()
    choice: str = "auto"              # "auto" | "none" | "required" | "named"
    named: str = ""                   # the function tool_choice names
    parallel: bool = True
    raw_tools: list = field(default_factory=list)   # as sent (the template renders these)

    @property
    def forced(self) -> bool:
        return bool(self.tools) and self.choice in ("required", "named")

    @property
    def parsing(self) -> bool:
        """The reply is scanned for calls (tool_choice none keeps it all content, as llama-server)."""
        return bool(self.tools) and self.choice != "none"

    def forced_tools(self) -> tuple[Tool, ...]:
        return tuple(t for t in self.tools if t.name == self.named) if self.choice == "named" else self.tools


def read_tools(raw: object) -> tuple[Tool, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise _err("tools", "must be an array of tool objects")
    out = []
    for i, t in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(t, dict):
            raise _err(where, "must be an object")
        if t.get("type", "function") != "function":
            raise _err(f"{where}.type", f"only 'function' tools are served, got {t.get('type')!r}")
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise _err(f"{where}.function", "must be an object with a name")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise _err(f"{where}.function.name", "must be a non-empty string")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise _err(f"{where}.function.parameters", "must be a JSON schema object")
        strict = fn.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise _err(f"{where}.function.strict", "type must be boolean")
        out.append(Tool(name, params, bool(strict)))
    return tuple(out)


def read_tool_request(body: dict) -> ToolRequest:
    tools = read_tools(body.get("tools"))
    choice_raw = body.get("tool_choice")
    named = ""
    if choice_raw is None:
        choice = "auto"
    elif isinstance(choice_raw, str):
        if choice_raw not in ("auto", "none", "required"):
            raise _err("tool_choice", f"must be 'auto', 'none', 'required' or a named function, got {choice_raw!r}")
        choice = choice_raw
    elif isinstance(choice_raw, dict):
        fn = choice_raw.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice_raw.get("type") != "function" or not isinstance(name, str):
            raise _err("tool_choice", "a named choice is {\"type\": \"function\", \"function\": {\"name\": ...}}")
        if name not in {t.name for t in tools}:
            raise _err("tool_choice", f"names function {name!r}, which is not among the request's tools")
        choice, named = "named", name
    else:
        raise _err("tool_choice", "must be a string or an object")
    if choice in ("required", "named") and not tools:
        raise _err("tool_choice", f"{choice_raw!r} needs at least one tool in 'tools'")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise _err("parallel_tool_calls", "type must be boolean")
    return ToolRequest(tools, choice, named, True if parallel is None else parallel,
                       body.get("tools") if isinstance(body.get("tools"), list) else [])
