"""POST /completion (llama-server's shape) and POST /v1/completions (OpenAI's text_completion)."""
from __future__ import annotations

import time
from contextlib import aclosing
from typing import TYPE_CHECKING

from bloomery.api import choices
from bloomery.api.generate import Outcome
from bloomery.api.params import Fields, GenParams, field_error, parse_gen_params
from bloomery.api.shapes import BUILD_INFO, SSE_DONE, completion_id, generation_settings, sse
from bloomery.http.types import ApiError, Request, Response, StreamResponse

if TYPE_CHECKING:
    from bloomery.api.app import App


def prompt_ids(app: "App", f: Fields) -> list[int]:
    """A prompt as llama-server takes it: a string, an array of ids, or an array mixing strings and ids.
    Special-token spellings in a /completion prompt parse (it is the client's own tokenization)."""
    got = f.raw("prompt")
    if got is None:
        raise ApiError(400, "'prompt' is required", param="prompt")
    v = got[1]
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
        v = v[0]          # one prompt wrapped in an array
    if isinstance(v, str):
        return app.tok.encode(v, add_special=True, parse_special=True)
    if isinstance(v, list):
        if v and all(isinstance(x, str) for x in v):
            raise field_error("prompt", f"{len(v)} prompts in one request are not supported; send one prompt a request")
        ids: list[int] = []
        for i, x in enumerate(v):
            if isinstance(x, str):
                ids += app.tok.encode(x, add_special=not ids, parse_special=True)
            elif isinstance(x, int) and not isinstance(x, bool):
                if not 0 <= x < app.tok.n_vocab:
                    raise field_error("prompt", f"token id {x} at [{i}] is outside 0..{app.tok.n_vocab - 1}")
                ids.append(x)
            else:
                raise field_error("prompt", f"element [{i}] must be a string or a token id, but is {x!r}")
        return ids
    raise field_error("prompt", f"must be a string or an array of strings and token ids, but is {type(v).__name__}")


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


async def handle_completion(app: "App", req: Request) -> Response | StreamResponse:
    f = Fields(req.json())
    ids = prompt_ids(app, f)
    p = parse_gen_params(f, **app.gen_defaults())
    prompt = f.raw("prompt")[1]
    prompt_text = prompt if isinstance(prompt, str) else app.tok.decode(ids)
    gen = app.start(req.path, ids, p)
    if not p.stream:
        out = await gen.run()
        return Response.json(llama_final(app, out, p, prompt_text, streamed=False))

    async def chunks():
        try:
            n_sent = 0
            async with aclosing(gen.pieces()) as pieces:
                async for piece in pieces:
                    n_sent += len(piece.ids)
                    # llama-server's partial chunks say -1; the final one names the slot
                    chunk = {"index": 0, "content": piece.text, "tokens": piece.ids, "stop": False, "id_slot": -1,
                             "tokens_predicted": n_sent, "tokens_evaluated": gen.outcome.n_prompt}
                    if p.n_probs > 0:
                        chunk["completion_probabilities"] = piece.probs
                    if p.timings_per_token:
                        chunk["timings"] = gen.outcome.timings()
                    yield sse(chunk)
            yield sse(llama_final(app, gen.outcome, p, prompt_text, streamed=True))
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
    ids = prompt_ids(app, f)
    p = parse_gen_params(f, **app.gen_defaults(), allow_n_probs=False, n_max=choices.MAX_CHOICES)
    n = choices.read_n(f)
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
                    if piece.text:
                        extra = {"timings": gens[i].outcome.timings()} if p.timings_per_token else {}
                        yield sse({"choices": [choice(piece.text, None, i)], **head, "id": cid, **extra})
            outs = [g.outcome for g in gens]
            yield sse({"choices": [choice("", o.finish_reason, i) for i, o in enumerate(outs)], **head,
                       "usage": choices.usage_of(outs), "id": cid, "timings": outs[0].timings()})
            yield SSE_DONE
        except ApiError as e:
            yield sse(e.body())
    return StreamResponse(200, chunks(), app.sse_headers())
