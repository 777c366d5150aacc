"""Tool calls for the Responses and Anthropic routes, through the route-independent parser (api/toolcalls).

These routes read a finished reply: content plus the calls the model wrote
(function_call items, tool_use blocks); their streams send a call when it closes.
A call can only be watched for where the template has a framing; a forced call
(tool_choice required / named, Anthropic any / tool) and a JSON output format
(Responses' text.format) run through the chat route's grammar path (structured()).
"""
from __future__ import annotations

from bloomery.api.params import field_error
from bloomery.http.types import ApiError


def _toolcalls():
    try:
        import bloomery.api.toolcalls as tc
        return tc
    except ImportError:
        return None


def tool_request(app, chat_body: dict, route: str):
    """The request's ToolRequest when it sends tools (None without), or a 400 naming what is not served."""
    if not chat_body.get("tools"):
        return None
    tc = _toolcalls()
    if tc is None:
        raise field_error("tools", f"tool calls are not served on {route} in this version")
    return tc.read_tool_request(chat_body)


def structured(app, p, chat_body: dict, treq, rs, prompt_text: str, route_format: str = ""):
    """GenParams with the request's grammar (forced call, response_format), as the chat route sets it;
    a refusal of the format names the route's own field (route_format: Responses' text.format)."""
    from bloomery.api.reasoning import prompt_opens_think
    from bloomery.api.toolcalls.structured import apply_structured
    tc = _toolcalls()
    if tc is None:
        return p
    treq = treq if treq is not None else tc.read_tool_request({})
    think_open = rs.extract and prompt_opens_think(prompt_text)
    try:
        return apply_structured(p, chat_body, treq, tc.framing_of(getattr(app.template, "source", "") or ""), rs,
                                think_open, chat_body.get("temperature") is not None)
    except ApiError as e:
        if e.param != "response_format" or not route_format:
            raise
        # the route's own field: Responses' text.format
        raise field_error(route_format, e.message.split(": ", 1)[-1]) from None


class ReplyCalls:
    """Splits a reply into content and calls, incrementally (feed text pieces, then finish)."""

    def __init__(self, app, treq):
        tc = _toolcalls()
        self.tc = tc
        source = getattr(app.template, "source", "") or ""
        framing = tc.framing_of(source) if treq is not None else None
        self.parser = tc.make_parser(framing, treq) if treq is not None else None
        self.content = ""

    def feed(self, text: str) -> tuple[str, list]:
        """(content released, calls closed) by this piece."""
        if self.parser is None:
            self.content += text
            return text, []
        return self._take(self.parser.feed(text))

    def finish(self, cut: bool) -> tuple[str, list]:
        if self.parser is None:
            return "", []
        try:
            return self._take(self.parser.finish(cut=cut))
        except self.tc.CallError as e:
            from bloomery.http.types import ApiError
            raise ApiError(500, f"tool call parsing failed: {e}", "server_error") from None

    def _take(self, events: list) -> tuple[str, list]:
        text, closed = "", []
        for ev in events:
            if isinstance(ev, self.tc.ContentDelta):
                text += ev.text
            elif isinstance(ev, self.tc.CallEnd):
                closed.append(self.parser.calls[ev.index])
        self.content += text
        return text, closed

    @property
    def calls(self) -> list:
        return list(self.parser.calls) if self.parser is not None else []
