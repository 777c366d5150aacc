"""POST /v1/chat/completions (and /chat/completions) in OpenAI's shape, and POST /apply-template.

Tools reach the template (the prompt renders them); the reply is shaped by
api/toolcalls/reply.py (think span -> reasoning_content, call markup -> tool_calls,
streamed as OpenAI's deltas); response_format and a forced tool_choice set the
request's grammar (api/toolcalls/structured.py). n choices and logprobs: api/choices.py.
"""
from __future__ import annotations

import time
from contextlib import aclosing
from dataclasses import replace
from typing import TYPE_CHECKING

from bloomery import workpool
from bloomery.api import choices
from bloomery.api.completion import llama_final
from bloomery.api.params import Fields, GenParams, field_error, parse_gen_params
from bloomery.api.reasoning import prompt_opens_think, read_reasoning, think_spec
from bloomery.api.toolcalls import CallError, framing_of, read_tool_request
from bloomery.api.toolcalls.reply import Reply
from bloomery.api.toolcalls.structured import apply_structured
from bloomery.api.shapes import BUILD_INFO, SSE_DONE, completion_id, sse
from bloomery.chat_template import template_args
from bloomery.http.types import ApiError, Request, Response, StreamResponse

if TYPE_CHECKING:
    from bloomery.api.context import ApiContext as App


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
    if _continues_final_message(f):
        # vLLM's explicit name for the prefill the template does anyway when the last message is the assistant's
        if add_gen is None or add_gen:
            raise field_error("continue_final_message", "Cannot set both add_generation_prompt and "
                                                        "continue_final_message to true.")
    try:
        return app.template.render(messages, tools=tools[1] if tools else None,
                                   add_generation_prompt=True if add_gen is None else add_gen,
                                   **template_args(kwargs[1] if kwargs else None, effort[1] if effort else None,
                                                   default_enable_thinking=app.enable_thinking_default))
    except ApiError:
        raise
    except Exception as e:   # TemplateError names the message or tool at fault; a request made it fail
        param = "tools" if str(e).startswith("tools") else "messages"
        raise ApiError(400, f"The chat template could not render this request: {e}", param=param) from None


def _continues_final_message(f: Fields) -> bool:
    """continue_final_message: true or "content" continue the last message; "reasoning_content" (continuing
    a reasoning span) is refused by name; anything else is off, as llama-server reads it."""
    got = f.raw("continue_final_message")
    v = None if got is None else got[1]
    if v == "reasoning_content":
        raise field_error("continue_final_message", "continuing the reasoning of the last message is not "
                                                    "supported by this server (true or 'content' are)")
    return v is True or v == "content"


def _refuse_chat_fields(f: Fields) -> None:
    so = f.raw("stream_options")
    if so is not None and not isinstance(so[1], dict):
        raise field_error("stream_options", "must be an object")


def _json_schema_as_response_format(body: object) -> object:
    """llama-server's top-level json_schema on a chat request is response_format json_schema by another name."""
    if not isinstance(body, dict) or body.get("json_schema") is None:
        return body
    if body.get("response_format") is not None:
        raise field_error("json_schema", "give json_schema or response_format, not both")
    rest = {k: v for k, v in body.items() if k != "json_schema"}
    return {**rest, "response_format": {"type": "json_schema", "json_schema": {"schema": body["json_schema"]}}}


async def handle_chat(app: "App", req: Request) -> Response | StreamResponse:
    f = Fields(_json_schema_as_response_format(req.json()))
    _refuse_chat_fields(f)
    n_top = choices.read_chat_logprobs(f)     # -1: no logprobs; the engine reports at least the chosen id's
    p = parse_gen_params(f, **app.gen_defaults(), allow_n_probs=False, n_max=choices.MAX_CHOICES,
                         n_probs_set=max(n_top, 1) if n_top >= 0 else 0)
    n = choices.read_n(f)
    rendered, ids = await workpool.run(render_and_encode, app, f)
    treq, rs = read_tool_request(f.body), read_chat_reasoning(app, f)
    framing = framing_of(app.template.source)
    think_open = rs.extract and prompt_opens_think(rendered.text)
    p = apply_structured(p, f.body, treq, framing, rs, think_open, f.raw("temperature") is not None)
    p = with_think_watch(app, p, rs, rendered.text, framing)
    replies = [Reply(framing, treq, rs, think_open) for _ in range(n)]
    include_usage = False
    so = f.raw("stream_options")
    if so is not None:
        include_usage = bool(Fields(so[1], "stream_options").bool("include_usage"))
    gens = [app.start(req.path, ids, choices.choice_params(p, i)) for i in range(n)]
    gen = gens[0]
    cid, created = completion_id(), int(time.time())
    verbose = f.bool("verbose")
    verbose = app.verbose_default if verbose is None else verbose

    def verbose_of(out) -> dict:
        """llama-server's debug field: the /completion answer of the first choice, the rendered prompt in it."""
        return {"__verbose": llama_final(app, out, p, rendered.text, streamed=False)} if verbose else {}

    def logprobs_of(probs: list[dict]) -> dict:
        return {"logprobs": {"content": choices.logprobs_content(probs, n_top)}} if n_top >= 0 else {}

    if not p.stream:
        outs = await choices.run_all(gens)
        for reply, out in zip(replies, outs):
            reply.feed(out.content)
            _finish_reply(reply, out.finish_reason)
        return Response.json({
            "choices": [{"finish_reason": replies[i].finish_reason(out.finish_reason), "index": i,
                         "message": replies[i].message(), **logprobs_of(out.probs)}
                        for i, out in enumerate(outs)],
            "created": created, "model": app.model_name, "system_fingerprint": BUILD_INFO,
            "object": "chat.completion", "usage": choices.usage_of(outs),
            "id": cid, "timings": outs[0].timings(), **verbose_of(outs[0])})

    def chunk(choices: list, **extra) -> bytes:
        return sse({"choices": choices, "created": created, "id": cid, "model": app.model_name,
                    "system_fingerprint": BUILD_INFO, "object": "chat.completion.chunk", **extra})

    async def chunks():
        try:
            for i in range(n):
                yield chunk([{"finish_reason": None, "index": i, "delta": {"role": "assistant", "content": None}}])
            async with aclosing(choices.merge_pieces(gens)) as pieces:
                async for i, piece in pieces:
                    if piece.progress is not None:    # as llama-server: the opening delta again, with the progress
                        extra = {"timings": piece.timings} if piece.timings is not None else {}
                        yield chunk([{"finish_reason": None, "index": i, "delta": {"role": "assistant",
                                      "content": None}}], prompt_progress=piece.progress, **extra)
                        continue
                    deltas = replies[i].feed(piece.text) if piece.text else []
                    if not deltas and n_top >= 0 and piece.probs:
                        deltas = [{}]
                    for k, delta in enumerate(deltas):
                        extra = {"timings": piece.timings} if piece.timings is not None else {}
                        yield chunk([{"finish_reason": None, "index": i, "delta": delta,
                                      **(logprobs_of(piece.probs) if k == 0 else {})}], **extra)
            for i, g in enumerate(gens):
                for delta in _finish_reply(replies[i], g.outcome.finish_reason):
                    yield chunk([{"finish_reason": None, "index": i, "delta": delta}])
            out = gen.outcome
            last = [{"finish_reason": replies[i].finish_reason(g.outcome.finish_reason), "index": i, "delta": {}}
                    for i, g in enumerate(gens)]
            if include_usage:   # the usage chunk carries the timings then, as llama-server's stream does
                yield chunk(last, **verbose_of(out))
                yield chunk([], usage=choices.usage_of([g.outcome for g in gens]), timings=out.timings())
            else:
                yield chunk(last, timings=out.timings(), **verbose_of(out))
            yield SSE_DONE
        except ApiError as e:
            yield sse(e.body())
    return StreamResponse(200, chunks(), app.sse_headers())


def read_chat_reasoning(app: "App", f: Fields):
    """The request's reasoning fields over the server's --reasoning-format / --reasoning-budget defaults."""
    return read_reasoning(f, app.reasoning_format_default, app.reasoning_budget_default, app.reasoning_budget_message)


def with_think_watch(app: "App", p: GenParams, rs, prompt: str, framing: str | None) -> GenParams:
    """reasoning_budget / reasoning_loop: the think-span watch the generation runs (none when there is
    nothing to watch). Under structured output the grammar owns the span, so a server default budget is
    left out there (a request's own budget beside a schema was refused by apply_structured)."""
    if p.sampling.grammar:
        rs = replace(rs, budget=-1)
    extra = ("<tool_call>",) if framing == "qwen3_coder" else ()   # a Qwen3-Coder call ends the span too
    spec = think_spec(app.tok, rs, prompt, app.template.caps.thinking, extra)
    return p if spec is None else replace(p, think=spec)


def _finish_reply(reply: Reply, finish_reason: str) -> list[dict]:
    """The reply's last deltas; a call the model left open on its own is a 500 naming it."""
    try:
        return reply.finish(cut=finish_reason == "length")
    except CallError as e:
        raise ApiError(500, f"the model's reply is not a whole tool call: {e}", "server_error") from None


async def handle_apply_template(app: "App", req: Request) -> Response:
    f = Fields(req.json())

    def work() -> Response:
        rendered = render_chat(app, f)
        body: dict = {"prompt": rendered.text}
        if f.bool("return_prompt_ids"):
            body["prompt_ids"] = app.encode_chat(rendered)
        return Response.json(body)
    return await workpool.run(work)


def render_and_encode(app: "App", f: Fields):
    """(the rendered prompt, its guarded ids): the heavy part of a chat request, run off the loop."""
    rendered = render_chat(app, f)
    return rendered, app.encode_chat(rendered)
