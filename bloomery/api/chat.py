"""POST /v1/chat/completions (and /chat/completions) in OpenAI's shape, and POST /apply-template.

Tools reach the template (the prompt renders them), but in this slice a call the
model writes comes back as plain content: tool-call parsing is the next issue's
work. Reasoning, logprobs and n > 1 are not served yet and are refused by name.
"""
from __future__ import annotations

import time
from contextlib import aclosing
from typing import TYPE_CHECKING

from bloomery.api.params import Fields, field_error, parse_gen_params
from bloomery.api.shapes import BUILD_INFO, SSE_DONE, completion_id, sse, usage
from bloomery.chat_template import template_args
from bloomery.http.types import ApiError, Request, Response, StreamResponse

if TYPE_CHECKING:
    from bloomery.api.app import App


def read_messages(f: Fields) -> list:
    """The client's messages, as sent: the chat-template module checks and normalises them
    (content parts, developer role, tool calls) as llama-server does, and names what is wrong."""
    got = f.raw("messages")
    if got is None:
        raise ApiError(400, "'messages' is required", param="messages")
    if not isinstance(got[1], list):
        raise field_error("messages", "must be an array of message objects")
    return got[1]


# OpenAI's words, and "max" (the serving guide, 11.3); "none" turns thinking off.
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


def render_chat(app: "App", f: Fields):
    """The template's rendering of a chat request (messages, tools, chat_template_kwargs)."""
    messages = read_messages(f)
    tools = f.raw("tools")
    if tools is not None and not isinstance(tools[1], list):
        raise field_error("tools", "must be an array of tool objects")
    kwargs = f.raw("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs[1], dict):
        raise field_error("chat_template_kwargs", "must be an object")
    effort = f.raw("reasoning_effort")
    if effort is not None and effort[1] not in REASONING_EFFORTS:
        raise field_error("reasoning_effort", f"must be one of {', '.join(REASONING_EFFORTS)}, got {effort[1]!r}")
    add_gen = f.bool("add_generation_prompt")
    try:
        return app.template.render(messages, tools=tools[1] if tools else None,
                                   add_generation_prompt=True if add_gen is None else add_gen,
                                   **template_args(kwargs[1] if kwargs else None, effort[1] if effort else None))
    except ApiError:
        raise
    except Exception as e:   # TemplateError names the message or tool at fault; a request made it fail
        param = "tools" if str(e).startswith("tools") else "messages"
        raise ApiError(400, f"The chat template could not render this request: {e}", param=param) from None


def _refuse_chat_fields(f: Fields) -> None:
    if f.raw("logprobs") not in (None, ("logprobs", False)):
        raise field_error("logprobs", "logprobs on /v1/chat/completions are not supported by this server yet")
    if f.raw("top_logprobs") is not None:
        raise field_error("top_logprobs", "top_logprobs on /v1/chat/completions are not supported by this server yet")
    rf = f.raw("response_format")
    if rf is not None:
        kind = rf[1].get("type") if isinstance(rf[1], dict) else None
        if kind != "text":
            raise field_error("response_format", f"type {kind!r} is not supported by this server yet (only 'text')")
    so = f.raw("stream_options")
    if so is not None and not isinstance(so[1], dict):
        raise field_error("stream_options", "must be an object")


async def handle_chat(app: "App", req: Request) -> Response | StreamResponse:
    f = Fields(req.json())
    _refuse_chat_fields(f)
    p = parse_gen_params(f, **app.gen_defaults(), allow_n_probs=False)
    rendered = render_chat(app, f)
    ids = app.encode_chat(rendered)
    include_usage = False
    so = f.raw("stream_options")
    if so is not None:
        include_usage = bool(Fields(so[1], "stream_options").bool("include_usage"))
    gen = app.start(req.path, ids, p)
    cid, created = completion_id(), int(time.time())

    if not p.stream:
        out = await gen.run()
        return Response.json({
            "choices": [{"finish_reason": out.finish_reason, "index": 0,
                         "message": {"role": "assistant", "content": out.content}}],
            "created": created, "model": app.model_name, "system_fingerprint": BUILD_INFO,
            "object": "chat.completion", "usage": usage(out.n_prompt, out.n_gen, out.n_cached),
            "id": cid, "timings": out.timings()})

    def chunk(choices: list, **extra) -> bytes:
        return sse({"choices": choices, "created": created, "id": cid, "model": app.model_name,
                    "system_fingerprint": BUILD_INFO, "object": "chat.completion.chunk", **extra})

    async def chunks():
        try:
            yield chunk([{"finish_reason": None, "index": 0, "delta": {"role": "assistant", "content": None}}])
            async with aclosing(gen.pieces()) as pieces:
                async for piece in pieces:
                    if piece.text:
                        extra = {"timings": gen.outcome.timings()} if p.timings_per_token else {}
                        yield chunk([{"finish_reason": None, "index": 0, "delta": {"content": piece.text}}], **extra)
            out = gen.outcome
            last = [{"finish_reason": out.finish_reason, "index": 0, "delta": {}}]
            if include_usage:   # the usage chunk carries the timings then, as llama-server's stream does
                yield chunk(last)
                yield chunk([], usage=usage(out.n_prompt, out.n_gen, out.n_cached), timings=out.timings())
            else:
                yield chunk(last, timings=out.timings())
            yield SSE_DONE
        except ApiError as e:
            yield sse(e.body())
    return StreamResponse(200, chunks(), app.sse_headers())


async def handle_apply_template(app: "App", req: Request) -> Response:
    f = Fields(req.json())
    rendered = render_chat(app, f)
    body: dict = {"prompt": rendered.text}
    if f.bool("return_prompt_ids"):
        body["prompt_ids"] = app.encode_chat(rendered)
    return Response.json(body)
