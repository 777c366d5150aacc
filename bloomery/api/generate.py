"""One generation request through the engine: ids in, text pieces and a summary out.

Shared by /completion, /v1/completions and /v1/chat/completions, which differ
only in the shapes they write. The engine iterator is closed (which cancels the
request in the engine) when a stop string ends the text, when the front's own
n_predict bound is reached, or when the consumer stops iterating (the client left).
"""
from __future__ import annotations

import math
import secrets
import time
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import AsyncIterator, Callable

from bloomery import workpool
from bloomery.api.params import GenParams
from bloomery.api.reasoning import ThinkWatch
from bloomery.api.stops import TextAssembler
from bloomery.engine.limits import finish_reason
from bloomery.engine.sampler import FLOAT32_LOWEST, LLAMA_DEFAULT_SEED
from bloomery.engine.types import EngineRequest, TokenOut
from bloomery.http.types import ApiError

HEAVY_TOP = 256     # a longer candidate table is rendered off the loop (bloomery/workpool.py)

# llama-server's stop_type -> the reason word of the request log line (serving guide 8.2)
LOG_REASON = {"eos": "eos", "word": "stop", "limit": "length", "none": "stop", "cancel": "cancel", "error": "error",
              "shutdown": "shutdown", "reasoning_loop": "reasoning_loop"}


@dataclass
class Piece:
    """Text that became safe to send, and the ids generated since the last piece."""

    text: str
    ids: list[int]
    probs: list[dict]
    progress: dict | None = None    # a prompt-progress piece (no text): llama-server's prompt_progress object
    timings: dict | None = None     # the outcome's timings as this piece was made (timings_per_token): a reader
                                    # that runs behind (choices.merge_pieces' queue) must not see later ones


@dataclass
class Outcome:
    n_prompt: int = 0
    n_cached: int = 0
    ids: list[int] = field(default_factory=list)       # every generated id, stop ids included
    probs: list[dict] = field(default_factory=list)    # completion_probabilities entries
    content: str = ""
    stop_type: str = "none"                             # none, eos, limit, word (llama-server's words),
                                                        # reasoning_loop (the think span looped: reasoning_loop)
    stopping_word: str = ""
    prompt_ms: float = 0.0
    predicted_ms: float = 0.0
    cache_ms: float = 0.0                               # the prompt cache's work before the prompt (bloomery's)
    cancelled: bool = False
    slot: int = -1                                      # the slot that ran it (llama-server's id_slot)
    progress_n: int | None = None                       # prompt ids processed so far, while the prompt runs

    @property
    def n_gen(self) -> int:
        return len(self.ids)

    @property
    def finish_reason(self) -> str:
        if self.stop_type == "reasoning_loop":
            return "reasoning_loop"
        return "stop" if self.stop_type in ("eos", "word") else "length"

    @property
    def n_past(self) -> int:
        """Positions the slot holds after the request (llama-server's tokens_cached)."""
        return self.n_prompt + max(self.n_gen - 1, 0)

    def timings(self) -> dict:
        n_prompt_done = self.n_prompt - self.n_cached if self.progress_n is None else self.progress_n
        n_steps = max(self.n_gen - 1, 0)      # the first id comes from the prompt pass, as llama-server counts
        return {
            "cache_n": self.n_cached,
            "prompt_n": n_prompt_done,
            "prompt_ms": self.prompt_ms,
            "prompt_per_token_ms": self.prompt_ms / n_prompt_done if n_prompt_done else 0.0,
            "prompt_per_second": 1e3 / self.prompt_ms * n_prompt_done if self.prompt_ms > 0 else 0.0,
            "predicted_n": self.n_gen,
            "predicted_ms": self.predicted_ms,
            "predicted_per_token_ms": self.predicted_ms / n_steps if n_steps else 0.0,
            "predicted_per_second": 1e3 / self.predicted_ms * n_steps if self.predicted_ms > 0 else 0.0,
            "cache_ms": self.cache_ms,
        }


def prob_entry(tok, token_id: int, logprob: float, top, post: bool = False) -> dict:
    """A completion_probabilities entry; post (post_sampling_probs): "prob" / "top_probs", as llama-server."""
    def one(i: int, lp: float, p: float) -> dict:
        b = tok.token_to_piece(i, special=False)
        return {"id": i, "token": b.decode("utf-8", errors="replace"), "bytes": list(b),
                **({"prob": p} if post else {"logprob": lp})}
    entry = one(token_id, logprob, math.exp(logprob) if logprob > FLOAT32_LOWEST else 0.0)
    entry["top_probs" if post else "top_logprobs"] = [one(p.token, p.logprob, p.prob) for p in top]
    return entry


class Generation:
    """Runs one EngineRequest; iterate `pieces()`, then read `outcome`."""

    def __init__(self, *, tok, client, req_id: str, task_id: int, path: str, prompt_ids: list[int],
                 params: GenParams, n_ctx_slot: int, log: Callable[[str], None], metrics=None):
        self.tok, self.client, self.params = tok, client, params
        self.metrics = metrics          # api/metrics.Metrics (or None): told of each id and of the end
        self.state = "new"              # new -> queued (sent to the engine) -> running (first id) -> done
        self.req_id, self.task_id, self.path = req_id, task_id, path
        self.prompt_ids = prompt_ids
        self.n_ctx_slot = n_ctx_slot
        self.log = log
        self.outcome = Outcome(n_prompt=len(prompt_ids))
        self._text = TextAssembler(params.stop)

    def current_text(self) -> str:
        """The text generated so far (what /slots' has_new_line looks at)."""
        return self._text.text

    async def pieces(self) -> AsyncIterator[Piece]:
        """The generation's text as it becomes safe to send. It runs as one engine request, or, under a
        reasoning_budget that runs out, as legs: the forced ids (message + end tag) are taken as generated
        ids and the next leg goes on from prompt + every id so far (the slot's cache holds the prefix, so
        only the forced ids are a prompt pass). The first leg's counts are the request's."""
        out = self.outcome
        p = self.params
        if not self.prompt_ids:   # llama-server answers an empty prompt with an empty result, no engine work
            self.state = "done"
            self._log("stop")
            return
        self.state = "queued"
        stop_ids = () if p.ignore_eos else tuple(sorted(self.tok.eog_ids))
        watch = ThinkWatch(p.think, self._piece_bytes) if p.think is not None else None
        t_first: float | None = None
        pending_ids: list[int] = []
        pending_probs: list[dict] = []
        finished = False
        reason = "cancel"
        n_legs = 0
        stream = None
        sampling = p.sampling
        if watch is not None and sampling.temperature > 0 and sampling.seed == LLAMA_DEFAULT_SEED:
            # legs share one random stream, as llama-server's one sampler: fix the random seed here
            sampling = replace(sampling, seed=secrets.randbelow(LLAMA_DEFAULT_SEED))
        try:
            while True:
                if watch is not None and watch.forced_next is not None:
                    # the budget ran out (or was 0 on a prompt that opens the span): the forced ids
                    text = ""
                    while watch.forced_next is not None and out.stop_type == "none":
                        if self._full():
                            out.stop_type = "limit"
                            break
                        tid = watch.forced_next
                        pending_ids.append(tid)
                        text += self._take(tid, watch, forced=True)
                    if out.stop_type == "none" and self._full():
                        out.stop_type = "limit"
                    if out.stop_type != "none":
                        text += self._text.finish()
                    if text or pending_ids:
                        yield Piece(text, pending_ids, pending_probs, timings=out.timings() if p.timings_per_token else None)
                        pending_ids, pending_probs = [], []
                    if out.stop_type != "none":
                        finished = True
                        reason = LOG_REASON[out.stop_type]
                        break
                n_left = -1 if p.n_predict < 0 else p.n_predict - out.n_gen
                req_id = self.req_id if n_legs == 0 else f"{self.req_id}+{n_legs}"
                # a later leg's seeded stream goes on past the draws of every id so far: llama.cpp's dist
                # sampler draws once per generated id, a forced one included
                leg_sampling = sampling if n_legs == 0 else replace(sampling, n_drawn=out.n_gen)
                req = EngineRequest(req_id, tuple(self.prompt_ids) + tuple(out.ids), n_left, leg_sampling, stop_ids,
                                    p.cache_prompt or n_legs > 0, id_task=self.task_id,
                                    return_progress=p.return_progress and n_legs == 0, id_slot=p.id_slot)
                n_legs += 1
                stream = self.client.generate(req)
                force = False
                async for o in stream:
                    o: TokenOut
                    if o.is_progress:   # the prompt pass so far (asked by return_progress on a stream)
                        out.n_cached, out.prompt_ms = o.n_cached, o.prompt_ms
                        out.progress_n = o.n_processed - o.n_cached
                        if o.slot >= 0:
                            out.slot = o.slot
                        yield Piece("", [], [], progress={"total": o.n_prompt, "cache": o.n_cached,
                                                          "processed": o.n_processed, "time_ms": int(o.prompt_ms)},
                                    timings=out.timings() if p.timings_per_token else None)
                        continue
                    now = time.perf_counter()
                    if t_first is None:
                        t_first = now
                        self.state = "running"
                        if self.metrics is not None:
                            self.metrics.on_first(self)
                        out.n_prompt = len(self.prompt_ids) if o.n_prompt else out.n_prompt
                        out.n_cached, out.prompt_ms = min(o.n_cached, len(self.prompt_ids)), o.prompt_ms
                        out.cache_ms = o.cache_ms
                        out.progress_n = None
                    elif o.prompt_ms and o.n_prompt:
                        out.prompt_ms += o.prompt_ms       # a later leg's prompt pass (the forced ids)
                    if o.slot >= 0:
                        out.slot = o.slot
                    if o.finish == "error":
                        reason = "error"
                        raise ApiError(500, f"generation failed: {o.error or 'unknown engine error'}", "server_error")
                    if o.finish == "shutdown":   # the server is stopping: a clean error answer, not a cut connection
                        reason = "shutdown"
                        raise ApiError(503, f"{o.error or 'the server is shutting down'}; this generation was ended "
                                            f"after {out.n_gen} ids", "unavailable_error")
                    text = ""
                    if o.token is not None and not (p.n_predict >= 0 and out.n_gen >= p.n_predict):
                        pending_ids.append(o.token)
                        if p.n_probs > 0 and o.logprob is not None:
                            entry = prob_entry(self.tok, o.token, o.logprob, o.top, p.sampling.post_sampling_probs) \
                                if len(o.top) <= HEAVY_TOP else await workpool.run(
                                    prob_entry, self.tok, o.token, o.logprob, o.top, p.sampling.post_sampling_probs)
                            out.probs.append(entry)
                            pending_probs.append(entry)
                        out.predicted_ms = (now - t_first) * 1e3
                        if o.finish == "stop" and o.token in stop_ids:
                            out.ids.append(o.token)
                            if self.metrics is not None:
                                self.metrics.on_token()
                            out.stop_type = "eos"      # a stop id ends the text and is never rendered
                        else:
                            text = self._take(o.token, watch)
                            if out.stop_type == "none" and o.finish == "stop":   # structured output is whole
                                out.stop_type = "eos"
                    if out.stop_type == "none" and (o.finish == "length" or (p.n_predict >= 0 and out.n_gen >= p.n_predict)):
                        out.stop_type = "limit"
                    if o.finish == "cancel" and out.stop_type == "none":
                        reason, out.cancelled = "cancel", True
                    done = out.stop_type != "none" or o.finish is not None
                    force = not done and watch is not None and watch.forced_next is not None
                    if done:
                        text += self._text.finish()
                    if text or (done and (pending_ids or text)):
                        yield Piece(text, pending_ids, pending_probs, timings=out.timings() if p.timings_per_token else None)
                        pending_ids, pending_probs = [], []
                    if done:
                        finished = True
                        reason = LOG_REASON["cancel" if out.cancelled else out.stop_type]
                        break
                    if force:
                        break                   # the budget ran out: this leg ends here (it is cancelled)
                if not force:
                    break
                aclose = getattr(stream, "aclose", None)
                if aclose is not None:
                    await aclose()
        except ApiError:
            raise
        except Exception as e:   # the engine client failed (queue full, engine gone): the client sees why
            reason = "error"
            raise ApiError(500, f"generation failed: {type(e).__name__}: {e}", "server_error") from None
        finally:
            # leaving early (stop string, our bound, the client gone) cancels the request in the engine
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()
            out.content = self._text.text
            if not finished and reason == "cancel":
                out.cancelled = True
            self.state = "done"
            if self.metrics is not None:
                self.metrics.on_end(self)
            self._log(reason)

    def _full(self) -> bool:
        """No id may follow: n_predict reached, or the slot's context is full."""
        return finish_reason(len(self.prompt_ids), self.outcome.n_gen, self.n_ctx_slot, self.params.n_predict,
                             stopped=False) is not None

    def _piece_bytes(self, token: int) -> bytes:
        return self.tok.token_to_piece(token, special=False)

    def _take(self, token: int, watch: "ThinkWatch | None", forced: bool = False) -> str:
        """One generated id that is text (not a stop id): counted, rendered, checked for stop strings,
        and seen by the think-span watch; returns the text that became safe to send."""
        out = self.outcome
        out.ids.append(token)
        if self.metrics is not None:
            self.metrics.on_token()
        text = self._text.feed(self._piece_bytes(token))
        if self._text.stopping_word:
            out.stop_type, out.stopping_word = "word", self._text.stopping_word
        if watch is not None:
            watch.accept(token, forced=forced)
            if watch.looped and out.stop_type == "none":
                out.stop_type = "reasoning_loop"    # the span repeats itself: it ends with the reasoning so far
        return text

    def _log(self, reason: str) -> None:
        out = self.outcome
        n_done = out.n_prompt - out.n_cached
        p_s = out.prompt_ms / 1e3
        g_s = out.predicted_ms / 1e3
        p_rate = n_done / p_s if p_s > 0 else 0.0
        g_rate = max(out.n_gen - 1, 0) / g_s if g_s > 0 else 0.0
        self.log(f"request {self.task_id} {self.path}: prompt {out.n_prompt} ids "
                 f"({out.n_cached} reused) in {p_s:.3f} s, {p_rate:.1f} ids/s; generated {out.n_gen} ids "
                 f"in {g_s:.3f} s, {g_rate:.1f} ids/s; stop {reason}; ctx {out.n_past}/{self.n_ctx_slot}")

    async def run(self) -> Outcome:
        async with aclosing(self.pieces()) as pieces:
            async for _ in pieces:
                pass
        return self.outcome
