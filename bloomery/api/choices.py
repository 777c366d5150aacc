"""Several choices of one prompt (`n`), and OpenAI's logprobs shape.

Choice i is its own generation of the same prompt ids, sampled with the
request's seed plus i (choice 0 is what n 1 answers). The choices go to the
engine together, so n is bounded by what the engine holds at once: its slots
plus its queue (scheduler.MAX_QUEUE_TOTAL). usage counts the prompt once.
"""
from __future__ import annotations

import asyncio
from contextlib import aclosing
from dataclasses import replace
from typing import AsyncIterator

from bloomery.api.generate import Generation, Outcome, Piece
from bloomery.api.params import UINT32_MAX, DEFAULT_SEED, Fields, GenParams, field_error
from bloomery.engine.scheduler import MAX_QUEUE_TOTAL

MAX_CHOICES = MAX_QUEUE_TOTAL          # slots plus queue depth: what one request may put in the engine at once
MAX_TOP_LOGPROBS = 20                  # OpenAI's bound; llama-server's default when logprobs is true
LOWEST_LOGPROB = -3.4028234663852886e38  # float32 lowest: llama-server's stand-in for log(0) (JSON has no -inf)


def read_n(f: Fields) -> int:
    return f.int("n", lo=1, hi=MAX_CHOICES) or 1


def read_chat_logprobs(f: Fields) -> int:
    """/v1/chat/completions' logprobs (bool) and top_logprobs (0..20) -> the candidates to report per id,
    or -1 for none. As llama-server: logprobs true alone reports 20; top_logprobs without it is a 400."""
    on = f.bool("logprobs")
    top = f.int("top_logprobs", lo=0, hi=MAX_TOP_LOGPROBS)
    if not on:
        if top is not None:
            raise field_error("top_logprobs", "top_logprobs requires logprobs to be set to true")
        return -1
    return MAX_TOP_LOGPROBS if top is None else top


def choice_params(p: GenParams, i: int) -> GenParams:
    """Choice i's params: the seed plus i (a random seed stays random)."""
    if i == 0 or p.sampling.seed == DEFAULT_SEED:
        return p
    seed = (p.sampling.seed + i) % (UINT32_MAX + 1)
    if seed == DEFAULT_SEED:       # would read as "random"; step past it
        seed = (seed + 1) % (UINT32_MAX + 1)
    return replace(p, sampling=replace(p.sampling, seed=seed))


def logprob_value(lp: float) -> float:
    return LOWEST_LOGPROB if lp == float("-inf") else lp


def logprobs_content(entries: list[dict], n_top: int) -> list[dict]:
    """Generation.outcome.probs entries -> OpenAI's logprobs.content (llama-server keeps the id beside)."""
    out = []
    for e in entries:
        out.append({"id": e["id"], "token": e["token"], "bytes": e["bytes"], "logprob": logprob_value(e["logprob"]),
                    "top_logprobs": [{"id": t["id"], "token": t["token"], "bytes": t["bytes"],
                                      "logprob": logprob_value(t["logprob"])} for t in e["top_logprobs"][:n_top]]})
    return out


def usage_of(outs: list[Outcome]) -> dict:
    """OpenAI usage over every choice: the prompt once, the generated ids of all choices."""
    n_prompt = outs[0].n_prompt
    n_gen = sum(o.n_gen for o in outs)
    return {"completion_tokens": n_gen, "prompt_tokens": n_prompt, "total_tokens": n_prompt + n_gen,
            "prompt_tokens_details": {"cached_tokens": outs[0].n_cached}}


async def run_all(gens: list[Generation]) -> list[Outcome]:
    """Every choice to its end; the first failure cancels the others and is raised."""
    tasks = [asyncio.ensure_future(g.run()) for g in gens]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def merge_pieces(gens: list[Generation]) -> AsyncIterator[tuple[int, Piece]]:
    """The pieces of every choice as they come, tagged with the choice index; a failure ends it all."""
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, g: Generation) -> None:
        try:
            async with aclosing(g.pieces()) as pieces:
                async for piece in pieces:
                    q.put_nowait((i, piece, None))
            q.put_nowait((i, None, None))
        except Exception as e:   # handed to the reader, who raises it
            q.put_nowait((i, None, e))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    try:
        n_left = len(gens)
        while n_left:
            i, piece, err = await q.get()
            if err is not None:
                raise err
            if piece is None:
                n_left -= 1
                continue
            yield i, piece
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
