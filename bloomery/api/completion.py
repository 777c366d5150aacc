"""POST /completion (llama-server's shape) and POST /v1/completions (OpenAI's text_completion)."""
from __future__ import annotations

import asyncio
import time
from contextlib import aclosing
from dataclasses import replace
from typing import TYPE_CHECKING

from bloomery import workpool
from bloomery.api import choices
from bloomery.api.generate import HEAVY_TOP, Outcome
from bloomery.api.params import Fields, GenParams, field_error, parse_gen_params
from bloomery.api.prompts import read_prompts
from bloomery.api.reasoning import read_reasoning, think_spec
from bloomery.api.shapes import BUILD_INFO, SSE_DONE, completion_id, generation_settings, sse
from bloomery.http.types import ApiError, Request, Response, StreamResponse

if TYPE_CHECKING:
    from bloomery.api.context import ApiContext as App


async def prompt_ids(app: "App", f: Fields) -> list[int]:
    """The one prompt of a route that takes one (several are refused by name); tokenized off the loop."""
    got = await workpool.run(read_prompts, app.tok, f.raw("prompt")[1] if f.raw("prompt") else None)
    if len(got) > 1:
        raise field_error("prompt", f"{len(got)} prompts in one request are not supported here; "
                                    "send one prompt a request")
    return got[0]


async def heavy_sse(obj: dict, n_probs: int) -> bytes:
    """An SSE event; one carrying long probability tables is encoded off the loop, a slice at a time."""
    if n_probs <= HEAVY_TOP:
        return sse(obj)
    return b"data: " + (await workpool.run(workpool.json_text, obj)).encode("utf-8") + b"\n\n"


def response_fields(f: Fields) -> list[str]:
    """llama-server's response_fields: the final /completion body keeps only these ("a/b" reaches into
    objects); an empty list keeps everything."""
    got = f.raw("response_fields")
    if got is None or got[1] is None:
        return []
    v = got[1]
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise field_error("response_fields", f"must be an array of strings, but is {v!r}")
    return v


def pick_fields(paths: list[str], body: dict) -> dict:
    """The fields named by paths, each under its path; a path that reaches nothing is left out."""
    if not paths:
        return body
    picked = {}
    for path in paths:
        cur: object = body
        for key in path.split("/"):
            if not isinstance(cur, dict) or key not in cur:
                break
            cur = cur[key]
        else:
            picked[path] = cur
    return picked


def llama_final(app: "App", out: Outcome, p: GenParams, prompt: object, *, streamed: bool) -> dict:
    body = {
        "index": 0, "content": "" if streamed else out.content,
        "tokens": [] if streamed or not p.return_tokens else out.ids,
        "id_slot": out.slot, "stop": True, "model": app.model_name,
        "tokens_predicted": out.n_gen, "tokens_evaluated": out.n_prompt,
        "generation_settings": generation_settings(p), "prompt": prompt,
        "has_new_line": "\n" in out.content, "truncated": False,
        "stop_type": out.stop_type, "stopping_word": out.stopping_word,
        "tokens_cached": out.n_past, "timings": out.timings(),
    }
    if p.n_probs > 0 and not streamed:
        body["completion_probabilities"] = out.probs
    return body


def with_think(app: "App", p: GenParams, rs, prompt_text: str) -> GenParams:
    """A raw prompt's think-span watch: the request's reasoning_budget counts from a <think> the prompt
    leaves open (or the model writes); reasoning_loop watches the same span. The server's
    --reasoning-budget is a chat default and is not applied here (as llama-server's /completion)."""
    spec = think_spec(app.tok, rs, prompt_text, True)
    return p if spec is None else replace(p, think=spec)


async def handle_completion(app: "App", req: Request) -> Response | StreamResponse:
    f = Fields(req.json())
    raw = f.raw("prompt")
    all_ids = await workpool.run(read_prompts, app.tok, raw[1] if raw else None)
    if len(all_ids) > choices.MAX_CHOICES:   # they go to the engine together, as n choices do
        raise field_error("prompt", f"{len(all_ids)} prompts in one request; at most {choices.MAX_CHOICES}")
    prompt = raw[1]
    # the prompt echoed back: the string as sent, else the ids decoded (one per prompt; answer_llama decodes them)
    return await answer_llama(app, req, f, all_ids, [prompt] * len(all_ids) if isinstance(prompt, str) else None)


async def answer_llama(app: "App", req: Request, f: Fields, all_ids: list[list[int]],
                       texts: list[str] | None) -> Response | StreamResponse:
    """/completion's answer (also /infill's) for prompts already made into ids; texts are echoed as `prompt`
    (None: the ids decoded, after the engine has the request unless a think-span watch reads the text first)."""
    p = parse_gen_params(f, **app.gen_defaults())
    fields = response_fields(f)
    rs = read_reasoning(f)       # reasoning_budget / reasoning_loop over the raw prompt's <think> span

    def decode() -> list[str]:
        return [app.tok.decode(ids) for ids in all_ids]
    if texts is None and (rs.budget >= 0 or rs.loop):
        texts = await workpool.run(decode)
    gens = [app.start(req.path, ids, with_think(app, p, rs, texts[i]) if texts is not None else p)
            for i, ids in enumerate(all_ids)]
    # with_think answers p without a budget or loop check (think_spec), so the text waits: decoded beside the
    # engine's work, needed only by the last chunk
    echo = asyncio.ensure_future(workpool.run(decode)) if texts is None else None
    several = len(gens) > 1
    if not p.stream:
        try:
            outs = await choices.run_all(gens)
        finally:
            texts = texts if echo is None else await echo
        bodies = [pick_fields(fields, {**llama_final(app, o, p, texts[i], streamed=False), "index": i})
                  for i, o in enumerate(outs)]
        # as llama-server: one prompt answers an object, several an array in prompt order
        if p.n_probs <= HEAVY_TOP:
            return Response.json(bodies if several else bodies[0])
        text = await workpool.run(workpool.json_text, bodies if several else bodies[0])
        return Response(200, text.encode("utf-8"), [("content-type", "application/json; charset=utf-8")])

    async def chunks():
        try:
            n_sent = [0] * len(gens)
            async with aclosing(choices.merge_pieces(gens)) as pieces:
                async for i, piece in pieces:
                    n_sent[i] += len(piece.ids)
                    # llama-server's partial chunks say -1; the final one names the slot
                    chunk = {"index": i, "content": piece.text, "tokens": piece.ids, "stop": False, "id_slot": -1,
                             "tokens_predicted": n_sent[i], "tokens_evaluated": gens[i].outcome.n_prompt}
                    if p.n_probs > 0 and piece.progress is None:
                        chunk["completion_probabilities"] = piece.probs
                    if piece.timings is not None:
                        chunk["timings"] = piece.timings
                    if piece.progress is not None:
                        chunk["prompt_progress"] = piece.progress
                    yield await heavy_sse(chunk, p.n_probs)
            said = texts if echo is None else await echo
            for i, g in enumerate(gens):
                yield await heavy_sse(pick_fields(fields, {**llama_final(app, g.outcome, p, said[i], streamed=True),
                                                           "index": i}), p.n_probs)
        except ApiError as e:
            yield sse(e.body())
    return StreamResponse(200, chunks(), app.sse_headers())


def _refuse_oai_completion_fields(f: Fields) -> None:
    if f.bool("echo"):
        raise field_error("echo", "echo is not supported by this server")
    suffix = f.str("suffix")
    if suffix:
        raise field_error("suffix", "a non-empty suffix is not supported by this server")
    best_of = f.int("best_of", lo=1)
    if best_of is not None and best_of > 1:
        raise field_error("best_of", f"best_of > 1 is not supported by this server, but got {best_of}")
    if f.raw("logprobs") is not None:
        raise field_error("logprobs", "logprobs on /v1/completions are not supported by this server yet")


async def handle_v1_completions(app: "App", req: Request) -> Response | StreamResponse:
    f = Fields(req.json())
    _refuse_oai_completion_fields(f)
    ids = await prompt_ids(app, f)
    p = parse_gen_params(f, **app.gen_defaults(), allow_n_probs=False, n_max=choices.MAX_CHOICES)
    n = choices.read_n(f)
    p = with_think(app, p, read_reasoning(f), await workpool.run(app.tok.decode, ids))
    gens = [app.start(req.path, ids, choices.choice_params(p, i)) for i in range(n)]
    cid, created = completion_id(), int(time.time())
    head = {"created": created, "model": app.model_name, "system_fingerprint": BUILD_INFO,
            "object": "text_completion"}

    def choice(text: str, finish: str | None, i: int = 0) -> dict:
        return {"text": text, "index": i, "logprobs": None, "finish_reason": finish}

    if not p.stream:
        outs = await choices.run_all(gens)
        return Response.json({"choices": [choice(o.content, o.finish_reason, i) for i, o in enumerate(outs)], **head,
                              "usage": choices.usage_of(outs), "id": cid, "timings": outs[0].timings()})

    async def chunks():
        try:
            async with aclosing(choices.merge_pieces(gens)) as pieces:
                async for i, piece in pieces:
                    if piece.text or piece.progress is not None:
                        extra = {"timings": gens[i].outcome.timings()} if p.timings_per_token else {}
                        if piece.progress is not None:
                            extra["prompt_progress"] = piece.progress
                        yield sse({"choices": [choice(piece.text, None, i)], **head, "id": cid, **extra})
            outs = [g.outcome for g in gens]
            yield sse({"choices": [choice("", o.finish_reason, i) for i, o in enumerate(outs)], **head,
                       "usage": choices.usage_of(outs), "id": cid, "timings": outs[0].timings()})
            yield SSE_DONE
        except ApiError as e:
            yield sse(e.body())
    return StreamResponse(200, chunks(), app.sse_headers())
