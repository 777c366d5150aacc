"""Anthropic Messages: POST /v1/messages and POST /v1/messages/count_tokens.

The body becomes llama-server's chat body (anthropic_convert) and runs as one
generation. A think span becomes a thinking block (first, with an empty signature, as
llama-server: streamed as thinking_delta, then a signature_delta before its stop);
thinking.budget_tokens is the span's budget; reasoning_loop ends as stop_reason "reasoning_loop". Answers and stream events are Anthropic's (message_start, ping,
content_block_start / delta / stop, message_delta, message_stop); every error on
these routes is Anthropic's own object {"type": "error", "error": {"type", "message"}}.
usage.input_tokens counts the prompt ids not read from the cache, which are
cache_read_input_tokens (as llama-server reports them).
"""
from __future__ import annotations

import functools
import json
from contextlib import aclosing
from typing import TYPE_CHECKING

from bloomery import workpool
from bloomery.api.anthropic_convert import to_chat_body
from bloomery.api.chat import read_chat_reasoning, with_think_watch
from bloomery.api.input_tokens import prompt_ids_of, rendered_of
from bloomery.api.params import Fields, field_error, parse_gen_params
from bloomery.api.reasoning import ThinkParser, prompt_opens_think
from bloomery.api.responses import new_id
from bloomery.api.responses_calls import ReplyCalls, structured, tool_request
from bloomery.api.toolcalls import framing_of
from bloomery.http.types import ApiError, Request, Response, StreamResponse

if TYPE_CHECKING:
    from bloomery.api.context import ApiContext as App

# HTTP status -> Anthropic's error type
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               501: "invalid_request_error", 503: "overloaded_error", 529: "overloaded_error"}


def error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def anthropic_errors(handler):
    """Anthropic's error object for anything the handler raises (App.dispatch would write llama-server's)."""
    @functools.wraps(handler)
    async def wrapped(app: "App", req: Request):
        try:
            return await handler(app, req)
        except ApiError as e:
            return Response.json(error_body(e.status, e.message), status=e.status)
        except Exception as e:   # a bug of ours still answers the route's own error object
            return Response.json(error_body(500, f"internal error in {req.method} {req.path}: "
                                                 f"{type(e).__name__}: {e}"), status=500)
    return wrapped


def _event(kind: str, data: dict) -> bytes:
    return (f"event: {kind}\ndata: " + json.dumps({"type": kind, **data}, ensure_ascii=False,
                                                  separators=(",", ":")) + "\n\n").encode("utf-8")


def _read(app: "App", body: dict, *, count_only: bool = False):
    chat = to_chat_body(body, need_max_tokens=not count_only)
    if not count_only:
        f = Fields(body)
        f.int("max_tokens", lo=1)
        stops = body.get("stop_sequences")
        if stops is not None and (not isinstance(stops, list) or not all(isinstance(s, str) for s in stops)):
            raise field_error("stop_sequences", "must be an array of strings")
    return chat


def _stop_reason(out, calls: list) -> tuple[str, str | None]:
    if out.stop_type == "reasoning_loop":
        return "reasoning_loop", None
    if calls:
        return "tool_use", None
    if out.stop_type == "word":
        return "stop_sequence", out.stopping_word
    if out.stop_type == "eos":
        return "end_turn", None
    return "max_tokens", None


def _usage(out, n_out: int | None = None) -> dict:
    return {"cache_creation_input_tokens": 0, "cache_read_input_tokens": out.n_cached,
            "input_tokens": max(out.n_prompt - out.n_cached, 0), "output_tokens": out.n_gen if n_out is None else n_out}


def _tool_use(call) -> dict:
    try:
        args = json.loads(call.arguments) if call.arguments.strip() else {}
    except json.JSONDecodeError:
        args = {}        # a call cut by max_tokens keeps its name; its arguments were not whole
    return {"type": "tool_use", "id": "toolu_" + call.id, "name": call.name, "input": args}


@anthropic_errors
async def handle_count_tokens(app: "App", req: Request) -> Response:
    body = Fields(req.json()).body
    return Response.json({"input_tokens": len(await prompt_ids_of(app, _read(app, body, count_only=True)))})


@anthropic_errors
async def handle_messages(app: "App", req: Request) -> Response | StreamResponse:
    body = Fields(req.json()).body
    chat = _read(app, body)
    treq = tool_request(app, chat, "/v1/messages")
    p = parse_gen_params(Fields(chat), **app.gen_defaults(), allow_n_probs=False)
    rendered, ids = await workpool.run(rendered_of, app, chat)
    rs = read_chat_reasoning(app, Fields(chat))
    p = structured(app, p, chat, treq, rs, rendered.text)
    p = with_think_watch(app, p, rs, rendered.text, framing_of(app.template.source))
    think = ThinkParser(rs.extract, rs.extract and prompt_opens_think(rendered.text))
    gen = app.start(req.path, ids, p)
    mid = new_id("msg_")
    calls = ReplyCalls(app, treq)
    stream = bool(Fields(body).bool("stream"))

    def message(content: list, stop_reason, stop_seq, usage: dict) -> dict:
        return {"id": mid, "type": "message", "role": "assistant", "content": content, "model": app.model_name,
                "stop_reason": stop_reason, "stop_sequence": stop_seq, "usage": usage}

    if not stream:
        async with aclosing(gen.pieces()) as pieces:
            async for piece in pieces:
                calls.feed(think.feed(piece.text)[1])
        out = gen.outcome
        calls.feed(think.finish()[1])
        calls.finish(cut=out.finish_reason == "length")
        # as llama-server: the thinking block first (an empty signature: no cryptographic one here)
        content = ([{"type": "thinking", "thinking": think.reasoning, "signature": ""}] if think.reasoning else []) + \
            ([{"type": "text", "text": calls.content}] if calls.content or not calls.calls else []) + \
            [_tool_use(c) for c in calls.calls]
        reason, seq = _stop_reason(out, calls.calls)
        return Response.json(message(content, reason, seq, _usage(out)))

    # the open text / thinking block's index (-1: none open), blocks sent so far
    st = {"block": -1, "think": -1, "n_blocks": 0}

    async def events():
        try:
            async with aclosing(gen.pieces()) as pieces:
                first = True
                async for piece in pieces:
                    if first:   # the prompt's counts are known once the first id came
                        yield _event("message_start", {"message": message([], None, None, _usage(gen.outcome, 0))})
                        yield _event("ping", {})
                        first = False
                    for b in _piece_blocks(*think.feed(piece.text)):
                        yield b
            out = gen.outcome
            if first:
                yield _event("message_start", {"message": message([], None, None, _usage(out, 0))})
                yield _event("ping", {})
            for b in _piece_blocks(*think.finish()):
                yield b
            for b in _close_thinking():
                yield b
            text, closed = calls.finish(cut=out.finish_reason == "length")
            for b in _blocks(text, closed):
                yield b
            if st["block"] >= 0:
                yield _event("content_block_stop", {"index": st["block"]})
            elif st["n_blocks"] == 0:    # an empty reply still has its (empty) text block, as Anthropic's API
                yield _event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
                yield _event("content_block_stop", {"index": 0})
            reason, seq = _stop_reason(out, calls.calls)
            yield _event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": seq},
                                           "usage": {"output_tokens": out.n_gen}})
            yield _event("message_stop", {})
        except ApiError as e:
            yield _event("error", {"error": error_body(e.status, e.message)["error"]})

    def _piece_blocks(reasoning: str, content: str) -> list:
        out = []
        if reasoning:
            out += _delta("think", "thinking", reasoning)
        if content:
            out += _close_thinking()
            out += _blocks(*calls.feed(content))
        return out

    def _delta(key: str, kind: str, piece: str) -> list:
        """A delta of a thinking or text block (kind), the block opened first where st[key] has none."""
        out = []
        if st[key] < 0:
            st[key] = st["n_blocks"]
            st["n_blocks"] += 1
            out.append(_event("content_block_start", {"index": st[key], "content_block": {"type": kind, kind: ""}}))
        out.append(_event("content_block_delta", {"index": st[key], "delta": {"type": f"{kind}_delta", kind: piece}}))
        return out

    def _close_thinking() -> list:
        """The thinking block ends with an (empty) signature_delta, as Anthropic's API requires."""
        if st["think"] < 0:
            return []
        k, st["think"] = st["think"], -1
        return [_event("content_block_delta", {"index": k, "delta": {"type": "signature_delta", "signature": ""}}),
                _event("content_block_stop", {"index": k})]

    def _blocks(text: str, closed: list):
        out = []
        if text:
            out += _delta("block", "text", text)
        for call in closed:          # a call is sent whole once it closed
            if st["block"] >= 0:
                out.append(_event("content_block_stop", {"index": st["block"]}))
                st["block"] = -1
            k = st["n_blocks"]
            st["n_blocks"] += 1
            use = _tool_use(call)
            out.append(_event("content_block_start", {"index": k, "content_block": dict(use, input={})}))
            out.append(_event("content_block_delta", {"index": k, "delta": {
                "type": "input_json_delta", "partial_json": json.dumps(use["input"], ensure_ascii=False)}}))
            out.append(_event("content_block_stop", {"index": k}))
        return out

    return StreamResponse(200, events(), app.sse_headers())
