"""OpenAI Responses: POST /v1/responses, GET / DELETE /v1/responses/{id}, POST /v1/responses/{id}/cancel.

A request becomes the chat body llama-server would make of it (responses_convert),
runs as one generation, and answers OpenAI's response object; a stream sends
Responses' events (response.created ... response.completed), each with its
sequence_number. A response is kept (responses_store) unless store is false.
background: true answers "queued" at once and runs on; GET polls it, cancel ends it.
A reply cut by max_output_tokens is status "incomplete" (OpenAI's), where llama-server says "completed".
"""
from __future__ import annotations

import asyncio
import secrets
import string
import time
from contextlib import aclosing
from dataclasses import replace
from typing import TYPE_CHECKING

from bloomery import workpool
from bloomery.api.chat import read_chat_reasoning, with_think_watch
from bloomery.api.input_tokens import rendered_of
from bloomery.api.params import Fields, field_error, parse_gen_params
from bloomery.api.responses_calls import ReplyCalls, structured, tool_request
from bloomery.api.responses_convert import input_messages, to_chat_body
from bloomery.api.responses_store import ResponseStore, Stored
from bloomery.api.shapes import sse
from bloomery.api.toolcalls import framing_of
from bloomery.http.types import ApiError, Request, Response, StreamResponse

if TYPE_CHECKING:
    from bloomery.api.context import ApiContext as App

__all__ = ["ResponseStore", "handle_create", "handle_get", "handle_delete", "handle_cancel"]
_ALNUM = string.ascii_letters + string.digits


def new_id(prefix: str) -> str:
    return prefix + "".join(secrets.choice(_ALNUM) for _ in range(32))


def _id_from_path(path: str) -> str:
    return path.split("/responses/", 1)[1].split("/", 1)[0]


def _chat_tool_choice(tc: object) -> object:
    """Responses' named choice {"type": "function", "name": f} -> chat's {"type": "function", "function": {...}}."""
    if isinstance(tc, dict) and tc.get("type") == "function" and "function" not in tc:
        return {"type": "function", "function": {"name": tc.get("name")}}
    return tc


class Run:
    """One response being made: its object, its generation, its output items."""

    @classmethod
    async def make(cls, app: "App", body: dict, path: str, *, store: bool, background: bool) -> "Run":
        """The prompt rendered and tokenized off the loop (bloomery/workpool.py), then the Run."""
        chat = to_chat_body(body, app.responses)
        if "tool_choice" in chat:
            chat["tool_choice"] = _chat_tool_choice(chat["tool_choice"])
        return cls(app, body, path, chat, await workpool.run(rendered_of, app, chat), store=store,
                   background=background)

    def __init__(self, app: "App", body: dict, path: str, chat: dict, rendered_ids, *, store: bool,
                 background: bool):
        self.app, self.body, self.store, self.background = app, body, store, background
        self.treq = tool_request(app, chat, "/v1/responses")
        self.p = parse_gen_params(Fields(chat), **app.gen_defaults(), allow_n_probs=False)
        # the chat body never streams: return_progress and timings_per_token follow the Responses body's stream
        streamed = body.get("stream") is True
        self.p = replace(self.p, return_progress=streamed and body.get("return_progress") is True)
        rendered, ids = rendered_ids
        # reasoning_loop (and the server's --reasoning-budget) watch the think span as on chat
        rs = read_chat_reasoning(app, Fields(chat))
        self.p = structured(app, self.p, chat, self.treq, rs, rendered.text, route_format="text.format")
        self.p = with_think_watch(app, self.p, rs, rendered.text, framing_of(app.template.source))
        prev = body.get("previous_response_id")
        self.conversation_in = (app.responses.conversation(prev) if prev else []) + input_messages(body)
        self.gen = app.start(path, ids, self.p)
        self.id, self.msg_id = new_id("resp_"), new_id("msg_")
        self.created = int(time.time())
        self.calls = ReplyCalls(app, self.treq)
        self.obj = self.response("queued" if background else "in_progress", [])

    # --- shapes ---
    def response(self, status: str, output: list, *, usage: dict | None = None, error: dict | None = None,
                 incomplete: dict | None = None) -> dict:
        b, sp = self.body, self.p.sampling
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "background": self.background, "completed_at": int(time.time()) if status == "completed" else None,
            "error": error, "incomplete_details": incomplete, "instructions": b.get("instructions"),
            "max_output_tokens": b.get("max_output_tokens"), "model": self.app.model_name, "output": output,
            "parallel_tool_calls": b.get("parallel_tool_calls", True),
            "previous_response_id": b.get("previous_response_id"),
            "reasoning": {"effort": (b.get("reasoning") or {}).get("effort"), "summary": None},
            "store": self.store, "temperature": sp.temperature,
            "text": {"format": ((b.get("text") or {}).get("format") or {"type": "text"})},
            "tool_choice": b.get("tool_choice", "auto"), "tools": b.get("tools") or [], "top_p": sp.top_p,
            "truncation": "disabled", "usage": usage, "metadata": b.get("metadata") or {},
        }

    def message_item(self, text: str, status: str) -> dict:
        return {"id": self.msg_id, "type": "message", "status": status, "role": "assistant",
                "content": [{"type": "output_text", "annotations": [], "logprobs": [], "text": text}]}

    @staticmethod
    def call_item(call) -> dict:
        return {"id": "fc_" + call.id, "type": "function_call", "status": "completed", "call_id": call.id,
                "name": call.name, "arguments": call.arguments}

    def output_items(self) -> list[dict]:
        items = [self.message_item(self.calls.content, "completed")] if self.calls.content or not self.calls.calls \
            else []
        return items + [self.call_item(c) for c in self.calls.calls]

    def final(self) -> dict:
        out = self.gen.outcome
        usage = {"input_tokens": out.n_prompt, "input_tokens_details": {"cached_tokens": out.n_cached},
                 "output_tokens": out.n_gen, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": out.n_prompt + out.n_gen}
        cut = out.finish_reason == "length"
        status, incomplete = ("incomplete", {"reason": "max_output_tokens"}) if cut else ("completed", None)
        if out.stop_type == "reasoning_loop":     # the think span looped: ended with the reasoning so far
            status, incomplete = "incomplete", {"reason": "reasoning_loop"}
        return self.response(status, self.output_items(), usage=usage, incomplete=incomplete)

    def conversation_out(self) -> list[dict]:
        msg: dict = {"role": "assistant", "content": self.calls.content}
        if self.calls.calls:
            msg["tool_calls"] = [c.openai() for c in self.calls.calls]
        return self.conversation_in + [msg]

    def keep(self, finished: bool) -> None:
        if self.store:
            old = self.app.responses.get(self.id)
            self.app.responses.put(Stored(self.id, self.obj, self.conversation_out() if finished else [],
                                          finished=finished, background=self.background,
                                          task=old.task if old else None))

    async def run(self) -> dict:
        """To the end, without events (plain and background requests)."""
        async with aclosing(self.gen.pieces()) as pieces:
            async for piece in pieces:
                self.calls.feed(piece.text)
        self.calls.finish(cut=self.gen.outcome.finish_reason == "length")
        self.obj = self.final()
        self.keep(True)
        return self.obj


async def handle_create(app: "App", req: Request) -> Response | StreamResponse:
    f = Fields(req.json())
    stream, background, store = bool(f.bool("stream")), bool(f.bool("background")), f.bool("store")
    store = True if store is None else store
    if background and not store:
        raise field_error("background", "background: true needs store: true (a background response is polled)")
    if background and stream:
        raise field_error("background", "background: true with stream: true is not supported by this server")
    if background:
        full = app.responses.running_fill()
        if full:
            err = ApiError(503, f"too many background responses running: {full}; retry later", "unavailable_error")
            return Response.json(err.body(), status=503, headers=[("retry-after", "5")])
    run = await Run.make(app, f.body, req.path, store=store, background=background)
    if background:
        return _start_background(app, run)
    if not stream:
        run.keep(False)
        try:
            return Response.json(await run.run())
        except BaseException:
            if store:
                app.responses.delete(run.id)
            raise
    return StreamResponse(200, _events(run), app.sse_headers())


def _start_background(app: "App", run: Run) -> Response:
    async def work() -> None:
        run.obj = dict(run.obj, status="in_progress")
        run.keep(False)
        try:
            await run.run()
        except asyncio.CancelledError:
            run.obj = run.response("cancelled", [])
            run.keep(True)
        except ApiError as e:
            run.obj = run.response("failed", [], error={"code": e.type, "message": e.message})
            run.keep(True)
    run.keep(False)
    task = asyncio.ensure_future(work())
    app.responses.get(run.id).task = task
    return Response.json(run.obj)


async def _events(run: Run):
    seq = 0

    def ev(kind: str, **fields) -> bytes:
        nonlocal seq
        data = {"type": kind, "sequence_number": seq, **fields}
        seq += 1
        return b"event: " + kind.encode() + b"\n" + sse(data)

    item_open = False

    def open_item():
        nonlocal item_open
        item_open = True
        return [ev("response.output_item.added", output_index=0, item=dict(run.message_item("", "in_progress"),
                                                                           content=[])),
                ev("response.content_part.added", item_id=run.msg_id, output_index=0, content_index=0,
                   part={"type": "output_text", "annotations": [], "logprobs": [], "text": ""})]

    run.keep(False)
    try:
        yield ev("response.created", response=run.obj)
        yield ev("response.in_progress", response=run.obj)
        calls_done: list = []
        async with aclosing(run.gen.pieces()) as pieces:
            async for piece in pieces:
                timings = {"timings": run.gen.outcome.timings()} if run.p.timings_per_token else {}
                if piece.progress is not None:
                    yield ev("response.in_progress", response=run.obj, prompt_progress=piece.progress, **timings)
                    continue
                text, closed = run.calls.feed(piece.text)
                if text:
                    for b in ([] if item_open else open_item()):
                        yield b
                    yield ev("response.output_text.delta", item_id=run.msg_id, output_index=0, content_index=0,
                             delta=text, logprobs=[], **timings)
                calls_done += closed
        _, closed = run.calls.finish(cut=run.gen.outcome.finish_reason == "length")
        calls_done += closed
        run.obj = run.final()
        text = run.calls.content
        n_msg = 0
        if item_open or not calls_done:
            for b in ([] if item_open else open_item()):
                yield b
            part = {"type": "output_text", "annotations": [], "logprobs": [], "text": text}
            yield ev("response.output_text.done", item_id=run.msg_id, output_index=0, content_index=0, text=text,
                     logprobs=[])
            yield ev("response.content_part.done", item_id=run.msg_id, output_index=0, content_index=0, part=part)
            yield ev("response.output_item.done", output_index=0, item=run.message_item(text, "completed"))
            n_msg = 1
        for k, call in enumerate(calls_done):     # a call is sent whole once it closed
            item = run.call_item(call)
            yield ev("response.output_item.added", output_index=n_msg + k, item=dict(item, status="in_progress"))
            yield ev("response.function_call_arguments.done", item_id=item["id"], output_index=n_msg + k,
                     arguments=call.arguments)
            yield ev("response.output_item.done", output_index=n_msg + k, item=item)
        run.keep(True)
        kind = "response.completed" if run.obj["status"] == "completed" else "response.incomplete"
        yield ev(kind, response=run.obj, **({"timings": run.gen.outcome.timings()} if run.p.timings_per_token else {}))
    except ApiError as e:
        if run.store:
            run.app.responses.delete(run.id)
        yield ev("error", code=e.type, message=e.message, param=e.param)
    except BaseException:
        if run.store:
            run.app.responses.delete(run.id)
        raise


def _stored(app: "App", req: Request) -> Stored:
    rid = _id_from_path(req.path)
    s = app.responses.get(rid)
    if s is None:
        raise ApiError(404, f"Response with id {rid!r} not found (never stored, stored with store: false, deleted, "
                            f"or dropped from the bounded store)", "not_found_error")
    return s


async def handle_get(app: "App", req: Request) -> Response:
    return Response.json(_stored(app, req).obj)


async def handle_delete(app: "App", req: Request) -> Response:
    s = _stored(app, req)
    if s.task is not None and not s.task.done():
        s.task.cancel()
    app.responses.delete(s.id)
    return Response.json({"id": s.id, "object": "response.deleted", "deleted": True})


async def handle_cancel(app: "App", req: Request) -> Response:
    s = _stored(app, req)
    if not s.background:
        raise ApiError(400, f"Response {s.id!r} was not created with background: true; only background responses "
                            f"can be cancelled")
    if s.task is not None and not s.task.done():
        s.task.cancel()
        await asyncio.gather(s.task, return_exceptions=True)
    return Response.json(app.responses.get(s.id).obj if app.responses.get(s.id) else s.obj)
