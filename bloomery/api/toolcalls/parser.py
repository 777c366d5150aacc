"""The model's text -> content and tool calls, incrementally (a stream) or at once (feed all, finish).

Content is released as it arrives except a tail that could still become the call
opener, and whitespace that may only separate calls. Inside a call (framing-specific
body parsers below) a Hermes call's arguments are released as the model writes them
once its name is whole; a Qwen3-Coder parameter is released when it closes.
"""
from __future__ import annotations

import json
import random
import re
import string
from dataclasses import dataclass, field

from bloomery.api.toolcalls.request import ToolRequest

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_ID_CHARS = string.ascii_letters + string.digits


def call_id() -> str:
    """32 random letters and digits, as llama-server's gen_tool_call_id."""
    return "".join(random.SystemRandom().choice(_ID_CHARS) for _ in range(32))


@dataclass
class ContentDelta:
    text: str


@dataclass
class CallStart:
    index: int
    id: str
    name: str


@dataclass
class ArgsDelta:
    index: int
    text: str


@dataclass
class CallEnd:
    index: int


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""
    closed: bool = False

    def openai(self) -> dict:
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}, "id": self.id}


class CallError(ValueError):
    """Markup that is not a call after its name went out, or a generation that ended inside a call."""


def _tail_prefix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def json_value_end(text: str, start: int) -> int | None:
    """Index just past the JSON value that starts at text[start:] (after spaces); None while incomplete."""
    i = start
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    if i >= len(text):
        return None
    depth, in_str, esc = 0, False, False
    c0 = text[i]
    if c0 not in "{[\"":
        m = re.compile(r"[^,}\]\s]*").match(text, i)
        return m.end() if m.end() < len(text) else None   # a bare value ends at a delimiter
    for j in range(i, len(text)):
        c = text[j]
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
                if depth == 0:
                    return j + 1
        elif c == '"':
            in_str = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
    return None


_HERMES_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\S)')


class _HermesBody:
    """{"name": "f", "arguments": {...}} inside the call tags."""

    def __init__(self, parser: "CallParser"):
        self.p = parser
        self.args_at: int | None = None     # where the arguments value starts in the body
        self.sent = 0                       # arguments characters already released

    def progress(self, body: str) -> list:
        ev = []
        if self.args_at is None:
            m = _HERMES_HEAD.match(body)
            if m is None:
                return ev
            self.args_at = m.end()
            ev.append(self.p.start_call(json.loads(f'"{m.group(1)}"')))
        end = json_value_end(body, self.args_at)
        args = body[self.args_at:end if end is not None else len(body)]
        if end is None:
            args = args.rstrip()
        if len(args) > self.sent:
            ev.append(self.p.args(args[self.sent:]))
            self.sent = len(args)
        return ev

    def close(self, body: str) -> list:
        ev = self.progress(body)
        if self.args_at is None:            # not the head we stream: read the whole object
            try:
                obj = json.loads(body)
                name, args = obj["name"], obj.get("arguments", {})
                if not isinstance(name, str):
                    raise TypeError("name is not a string")
            except (ValueError, KeyError, TypeError):
                return []                   # not a call: the caller keeps its text as content
            ev.append(self.p.start_call(name))
            ev.append(self.p.args(args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)))
        elif json_value_end(body, self.args_at) is None:
            raise CallError(f"tool call {self.p.index} ({self.p.current.name}) has arguments that are not "
                            f"whole JSON before {CLOSE}")
        return ev

    def cut(self, body: str) -> list:
        ev = self.progress(body)
        rest = body[self.args_at:].rstrip()[self.sent:]
        if rest:
            ev.append(self.p.args(rest))
        return ev


_FN = re.compile(r"\s*<function=([^>\n]+)>")
_PARAM = re.compile(r"\s*<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


class _CoderBody:
    """<function=f><parameter=p>value</parameter>...</function> inside the call tags."""

    def __init__(self, parser: "CallParser"):
        self.p = parser
        self.at = 0                          # body characters consumed
        self.n_params = 0

    def _value(self, fn: str, name: str, raw: str) -> str:
        kind = None
        for t in self.p.treq.tools:
            if t.name == fn:
                kind = (t.parameters.get("properties", {}).get(name) or {}).get("type")
        if kind != "string":
            try:
                return json.dumps(json.loads(raw), ensure_ascii=False)
            except ValueError:
                pass
        return json.dumps(raw, ensure_ascii=False)

    def progress(self, body: str) -> list:
        ev = []
        if self.p.current is None:
            m = _FN.match(body)
            if m is None:
                return ev
            ev.append(self.p.start_call(m.group(1).strip()))
            self.at = m.end()
        while True:
            m = _PARAM.match(body, self.at)
            if m is None:
                return ev
            text = ("{" if self.n_params == 0 else ", ") + json.dumps(m.group(1).strip(), ensure_ascii=False) + ": "
            ev.append(self.p.args(text + self._value(self.p.current.name, m.group(1).strip(), m.group(2))))
            self.n_params += 1
            self.at = m.end()

    def close(self, body: str) -> list:
        ev = self.progress(body)
        if self.p.current is None:
            return []
        if not re.match(r"\s*</function>\s*$", body[self.at:]):
            raise CallError(f"tool call {self.p.index} ({self.p.current.name}) is not closed by </function>")
        ev.append(self.p.args("}" if self.n_params else "{}"))
        return ev

    def cut(self, body: str) -> list:
        ev = self.progress(body)
        return ev + [self.p.args("}" if self.n_params else "{}")]


@dataclass
class CallParser:
    framing: str | None
    treq: ToolRequest = field(default_factory=ToolRequest)
    calls: list[ToolCall] = field(default_factory=list)

    def __post_init__(self):
        self._buf = ""            # text not yet released (content mode) or the call's body (call mode)
        self._in_call = False
        self._body = None
        self._ws = ""             # whitespace held back: it may only separate calls
        self.current: ToolCall | None = None
        self.index = -1

    # -- helpers the body parsers call ---------------------------------------
    def start_call(self, name: str) -> CallStart:
        self.current = ToolCall(call_id(), name)
        self.calls.append(self.current)
        self.index = len(self.calls) - 1
        return CallStart(self.index, self.current.id, name)

    def args(self, text: str) -> ArgsDelta:
        self.current.arguments += text
        return ArgsDelta(self.index, text)

    # -- the stream ------------------------------------------------------------
    def _content(self, text: str) -> list:
        # trailing whitespace waits: before a call, or at the end after calls, it is dropped
        text = self._ws + text
        body = text.rstrip()
        self._ws = text[len(body):]
        return [ContentDelta(body)] if body else []

    def feed(self, text: str) -> list:
        if self.framing is None:
            return [ContentDelta(text)] if text else []
        self._buf += text
        ev: list = []
        while True:
            if not self._in_call:
                at = self._buf.find(OPEN)
                if at < 0:
                    keep = _tail_prefix(self._buf, OPEN)
                    ev += self._content(self._buf[:len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    return ev
                ev += self._content(self._buf[:at])
                self._buf = self._buf[at + len(OPEN):]
                self._in_call, self.current = True, None
                self._body = _HermesBody(self) if self.framing == "hermes" else _CoderBody(self)
                continue
            at = self._buf.find(CLOSE)
            if at < 0:
                keep = _tail_prefix(self._buf, CLOSE)
                ev += self._body.progress(self._buf[:len(self._buf) - keep])
                return ev
            body, self._buf = self._buf[:at], self._buf[at + len(CLOSE):]
            got = self._body.close(body)
            if not got and self.current is None:           # not a call after all: its text is content
                ev += self._content(OPEN + body + CLOSE)
            else:
                ev += got + [CallEnd(self.index)]
                self.current.closed = True
            self._in_call, self.current = False, None

    def finish(self, cut: bool) -> list:
        """The generation ended (cut: by the token limit). The last events, or CallError."""
        ev: list = []
        if self.framing is not None and self._in_call:
            if not cut:
                name = f" ({self.current.name})" if self.current else ""
                raise CallError(f"the generation ended inside tool call {len(self.calls) - 1 + (self.current is None)}"
                                f"{name} before its closing {CLOSE}")
            if self.current is None:       # the held tail may make the name whole
                ev += self._body.progress(self._buf)
            if self.current is None:       # the name is not whole: the call's text is content
                ev += self._content(OPEN + self._buf)
            else:
                ev += self._body.cut(self._buf) + [CallEnd(self.index)]
            self._buf, self._in_call = "", False
        elif self._buf:
            ev += self._content(self._buf)
            self._buf = ""
        if self._ws and not self.calls:
            ev.append(ContentDelta(self._ws))
        self._ws = ""
        return ev


def make_parser(framing: str | None, treq: ToolRequest) -> CallParser:
    """A parser for the reply; content only when the request does not scan for calls."""
    return CallParser(framing if treq.parsing else None, treq)
