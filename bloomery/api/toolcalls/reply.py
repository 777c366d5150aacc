"""One reply's shaping, route-independent: think span -> reasoning, then content -> calls.

  reply = Reply(framing, treq, reasoning_settings, starts_open)
  deltas = reply.feed(text)          # OpenAI chat deltas: {"reasoning_content"}, {"content"}, {"tool_calls": [...]}
  deltas += reply.finish(cut)        # cut: the token limit ended it; CallError (a 500) on a call left open
  reply.message()                    # the whole assistant message (non-streamed shape)
  reply.finish_reason("stop")        # "tool_calls" when the reply made calls
Anthropic and Responses routes read reply.reasoning / reply.content / reply.calls, or the
events of reply.events (the parser's ContentDelta / CallStart / ArgsDelta / CallEnd).
"""
from __future__ import annotations

from bloomery.api.reasoning import ReasoningSettings, ThinkParser
from bloomery.api.toolcalls.parser import ArgsDelta, CallEnd, CallStart, ContentDelta, make_parser
from bloomery.api.toolcalls.request import ToolRequest


class Reply:
    def __init__(self, framing: str | None, treq: ToolRequest | None = None,
                 rs: ReasoningSettings | None = None, starts_open: bool = False):
        rs = rs or ReasoningSettings()
        self.think = ThinkParser(rs.extract, starts_open)
        self.calls_parser = make_parser(framing, treq or ToolRequest())
        self.events: list = []

    @property
    def calls(self):
        return self.calls_parser.calls

    @property
    def reasoning(self) -> str:
        return self.think.reasoning

    @property
    def content(self) -> str:
        return "".join(e.text for e in self.events if isinstance(e, ContentDelta))

    def _deltas(self, reasoning: str, events: list) -> list[dict]:
        self.events += events
        out = [{"reasoning_content": reasoning}] if reasoning else []
        for e in events:
            if isinstance(e, ContentDelta):
                out.append({"content": e.text})
            elif isinstance(e, CallStart):
                out.append({"tool_calls": [{"index": e.index, "id": e.id, "type": "function",
                                            "function": {"name": e.name, "arguments": ""}}]})
            elif isinstance(e, ArgsDelta) and e.text:
                out.append({"tool_calls": [{"index": e.index, "function": {"arguments": e.text}}]})
        return out

    def feed(self, text: str) -> list[dict]:
        r, c = self.think.feed(text)
        return self._deltas(r, self.calls_parser.feed(c) if c else [])

    def finish(self, cut: bool) -> list[dict]:
        r, c = self.think.finish()
        events = self.calls_parser.feed(c) if c else []
        return self._deltas(r, events + self.calls_parser.finish(cut))

    def message(self) -> dict:
        msg: dict = {"role": "assistant", "content": self.content if (self.content or not self.calls) else None}
        if self.reasoning:
            msg["reasoning_content"] = self.reasoning
        if self.calls:
            msg["tool_calls"] = [c.openai() for c in self.calls]
        return msg

    def finish_reason(self, base: str) -> str:
        return "tool_calls" if self.calls and base == "stop" else base


__all__ = ["Reply", "CallEnd"]
