"""GET /metrics: llama-server's Prometheus counters and gauges, kept by the front.

The front sees every generation's prompt and generated counts and times (the
engine's first TokenOut carries the prompt's), so the counters are the sums of
what the requests reported. The throughput gauges are averaged over the window
since the previous scrape, as llama-server resets its bucket at each scrape.
requests_processing / requests_deferred come from the engine's slot table.

n_decode_total is counted per request (its prompt pass and one step per later
id), so requests batched into one engine step count once each; the average of
busy slots per decode is measured where each id arrives (how many generations
were producing ids then). Both are documented in docs/serving.md.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

# name, type, help: llama-server's order and words
METRICS = (
    ("prompt_tokens_total", "counter", "Number of prompt tokens processed, excluding cached tokens"),
    ("prompt_tokens_cached_total", "counter", "Number of prompt tokens reused from the cache"),
    ("prompt_seconds_total", "counter", "Total time spent processing prompts"),
    ("tokens_predicted_total", "counter", "Number of generation tokens processed"),
    ("tokens_predicted_seconds_total", "counter", "Total time spent generating tokens"),
    ("n_decode_total", "counter",
     "Total number of llama_decode() calls, excluding speculative decoding and multimodal decoding"),
    ("n_tokens_max", "counter", "Largest observed sequence length (prompt + generation)"),
    ("spec_decode_num_draft_tokens_total", "counter", "Speculative: Total draft tokens generated"),
    ("spec_decode_num_accepted_tokens_total", "counter", "Speculative: Total draft tokens accepted by the target model"),
    ("spec_decode_num_drafts_total", "counter", "Speculative: Total speculative decoding verification steps"),
    ("prompt_tokens_seconds", "gauge", "Average prompt throughput in tokens/s"),
    ("predicted_tokens_seconds", "gauge", "Average generation throughput in tokens/s"),
    ("requests_processing", "gauge", "Number of requests processing"),
    ("requests_deferred", "gauge", "Number of requests deferred"),
    ("n_busy_slots_per_decode", "gauge", "Average number of busy slots per llama_decode() call"),
)
# bloomery's own, after llama-server's: the host-RAM prompt cache (-cram), as the engine reports it
PROMPT_CACHE_METRICS = (
    ("prompt_cache_seconds_total", "counter", "Total time spent restoring saved prompt states from the prompt cache",
     "restore_seconds"),
    ("prompt_cache_bytes", "gauge", "Bytes of saved prompt states the prompt cache holds", "bytes"),
    ("prompt_cache_entries", "gauge", "Saved prompt states the prompt cache holds", "entries"),
    ("prompt_cache_budget_bytes", "gauge", "The prompt cache's budget in bytes (--cache-ram; 0: off)", "budget_bytes"),
)

# bloomery's own (llama-server has none of these): the engine's decode steps by the path they took
ENGINE_STEP_METRICS = (
    ("decode_steps_total", "counter", "Batched decode steps run", "steps_decode"),
    ("decode_steps_ahead_total", "counter",
     "Decode steps whose ids came from a step launched before the last step's ids went out", "steps_ahead"),
    ("decode_steps_ahead_dropped_total", "counter",
     "Steps launched ahead and not used (a slot ended or joined)", "steps_ahead_dropped"),
    ("decode_steps_chained_total", "counter",
     "Of the steps launched ahead, those launched behind the step before, its picks their ids on the card",
     "steps_chained"),
    ("decode_steps_top_total", "counter",
     "Decode steps whose greedy picks came from each row's largest logits on the card", "steps_top"),
    ("decode_steps_top_missed_total", "counter",
     "Of those, steps run again with whole rows (no candidate settled a pick)", "steps_top_missed"),
    ("prompt_passes_total", "counter", "Prompt passes run (one model call over some slots' prompt ids)",
     "passes_prompt"),
    ("prompt_passes_captured_total", "counter",
     "Of those, passes replayed from a captured graph (a short prompt of one slot, in its bucket)",
     "passes_prompt_captured"),
)


@dataclass
class _Bucket:
    """What the throughput gauges average over: the requests ended since the last scrape."""

    n_prompt: int = 0
    prompt_s: float = 0.0
    n_gen: int = 0
    gen_s: float = 0.0
    n_busy_sum: int = 0
    n_ids: int = 0


class Metrics:
    """Pure bookkeeping: generations report here (api/generate.py), /metrics renders it."""

    def __init__(self) -> None:
        self.t_start = int(time.time())
        self.totals = {name: 0 for name, _, _ in METRICS if name.endswith("_total")}
        self.totals["prompt_seconds_total"] = 0.0
        self.totals["tokens_predicted_seconds_total"] = 0.0
        self.n_tokens_max = 0
        self.running: set[str] = set()   # req_ids of generations that produced an id and did not end yet
        self.bucket = _Bucket()

    def on_token(self) -> None:
        self.bucket.n_busy_sum += max(len(self.running), 1)
        self.bucket.n_ids += 1

    def on_first(self, gen) -> None:
        self.running.add(gen.req_id)

    def on_end(self, gen) -> None:
        out = gen.outcome
        self.running.discard(gen.req_id)
        n_done = max(out.n_prompt - out.n_cached, 0)
        t = self.totals
        t["prompt_tokens_total"] += n_done
        t["prompt_tokens_cached_total"] += out.n_cached
        t["prompt_seconds_total"] += out.prompt_ms / 1e3
        t["tokens_predicted_total"] += out.n_gen
        t["tokens_predicted_seconds_total"] += out.predicted_ms / 1e3
        t["n_decode_total"] += out.n_gen
        self.n_tokens_max = max(self.n_tokens_max, out.n_prompt + out.n_gen)
        b = self.bucket
        b.n_prompt += n_done
        b.prompt_s += out.prompt_ms / 1e3
        b.n_gen += out.n_gen
        b.gen_s += out.predicted_ms / 1e3

    def render(self, n_processing: int, n_deferred: int, stats: dict | None = None) -> str:
        """The Prometheus text; reads and resets the gauges' window. stats: Engine.engine_stats() (the prompt
        cache's bytes, entries, budget_bytes, restore_seconds; the decode steps by path); none known reads as 0."""
        b, self.bucket = self.bucket, _Bucket()
        values = dict(self.totals)
        values["n_tokens_max"] = self.n_tokens_max
        values["prompt_tokens_seconds"] = b.n_prompt / b.prompt_s if b.prompt_s > 0 else 0.0
        values["predicted_tokens_seconds"] = b.n_gen / b.gen_s if b.gen_s > 0 else 0.0
        values["requests_processing"] = n_processing
        values["requests_deferred"] = n_deferred
        values["n_busy_slots_per_decode"] = b.n_busy_sum / b.n_ids if b.n_ids else 0.0
        pc = stats or {}
        values.update({name: pc.get(key, 0) for name, _, _, key in PROMPT_CACHE_METRICS})
        lines = []
        for name, kind, help_ in (*METRICS, *((n, k, h) for n, k, h, _ in PROMPT_CACHE_METRICS)):
            lines += [f"# HELP llamacpp:{name} {help_}", f"# TYPE llamacpp:{name} {kind}",
                      f"llamacpp:{name} {_num(values[name])}"]
        for name, kind, help_, key in ENGINE_STEP_METRICS:
            lines += [f"# HELP bloomery:{name} {help_}", f"# TYPE bloomery:{name} {kind}",
                      f"bloomery:{name} {_num(pc.get(key, 0))}"]
        return "\n".join(lines) + "\n"


def _num(v) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)
