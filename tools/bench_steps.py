#!/usr/bin/env python3
"""The engine's own step times, in process (no HTTP, no server): prompt passes and decode steps.

  prompt   P random ids into slot 0 at position 0 (model.prefill), the median of --reps, for each of
           --prompts; on the cuda backend, of a file with routed experts, once for each prompt path of
           the experts (BLOOMERY_CUDA_MOE_PROMPT=planned, then grouped: engine/cuda/moe.py)
  decode   B slots each holding --depth ids, one id a slot a step (model.decode_greedy: the captured
           steps where the backend has them), the mean over --steps steps, for each of --batches
  kernels  (--kernels, cuda) each kernel's time a decode step at the smallest and the largest batch (the
           25 largest), through torch's profiler (bench_cuda.kernel_profile), with programmatic
           dependent launch off so that a kernel's time is its own (with it on, a kernel starts early
           and its time holds the wait for the one before)

It prints one line a measurement and writes them all to --out (JSON). What it says of a decode step
is the engine's alone: through HTTP the server adds its own path (tools/bench_serve.py).

    python3 tools/bench_steps.py -m FILE [--backend cuda] [--prompts 64,512,4096] [--batches 1,2,4,8,16] \\
        [--depth 512] [--kernels] [--out steps.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))


class BenchError(ValueError):
    """A bad argument, named."""


def counts(flag: str, text: str) -> list[int]:
    """A comma list of positive ints, in the order given, each once."""
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < 1:
            raise BenchError(f"{flag}: {part!r} is not a positive whole number (a comma list like 1,4,8)")
        if int(part) not in out:
            out.append(int(part))
    return out


def sizes(prompts: list[int], batches: list[int], depth: int, steps: int) -> tuple[int, int]:
    """(slots, context a slot) that the measurements need."""
    return max(batches), max(max(prompts), depth + steps + 1)


def _sync(model) -> None:
    if model.ops.name == "cuda":
        import cupy
        cupy.cuda.Device().synchronize()


def prompt_rate(model, ids: np.ndarray, reps: int) -> float:
    """tok/s of one prompt pass of len(ids) ids into slot 0, the median of reps."""
    times = []
    for _ in range(reps):
        _sync(model)
        t = time.perf_counter()
        model.prefill(0, ids, 0)
        _sync(model)
        times.append(time.perf_counter() - t)
    return ids.size / float(np.median(times))


def fill_slots(model, n_slots: int, depth: int, rng) -> None:
    for s in range(n_slots):
        model.prefill(s, rng.integers(100, model.n_vocab - 1, depth, dtype=np.int32), 0)


def step_ms(model, b: int, depth: int, steps: int) -> float:
    """ms of one decode step of b rows (slots 0..b-1, each at depth, then the next positions); the
    first step (where the batch size's step is captured) is not counted."""
    slots = list(range(b))
    model.decode_greedy(slots, [7] * b, [depth] * b)
    _sync(model)
    t = time.perf_counter()
    for i in range(steps):
        model.decode_greedy(slots, [7] * b, [depth + 1 + i] * b)
    _sync(model)
    return (time.perf_counter() - t) / steps * 1e3


def has_experts(model) -> bool:
    return bool(model.gf.get(f"{model.gf.arch()}.expert_count"))


def run(a) -> dict:
    from bloomery.engine.loader import load_model
    from bloomery.placement import whole
    prompts, batches = counts("--prompts", a.prompts), counts("--batches", a.batches)
    if a.kernels and a.backend != "cuda":
        raise BenchError("--kernels: the per-kernel times come from the card's profiler (--backend cuda)")
    if a.kernels:
        os.environ["BLOOMERY_CUDA_PDL"] = "0"          # read when each step is captured
    n_slots, n_ctx = sizes(prompts, batches, a.depth, a.steps)
    rng = np.random.default_rng(0)
    t = time.perf_counter()
    model = load_model(a.model, whole(a.backend, n_slots=n_slots, n_ctx_slot=n_ctx))
    res = {"model": a.model, "backend": a.backend, "load_s": round(time.perf_counter() - t, 2),
           "depth": a.depth, "prompt_tok_s": {}, "decode_step_ms": {}}
    ids = rng.integers(100, model.n_vocab - 1, max(prompts), dtype=np.int32)
    model.prefill(0, ids[:min(64, ids.size)], 0)     # first-use costs (handles, pools) out of the figures
    paths = ("planned", "grouped") if a.backend == "cuda" and has_experts(model) else ("",)
    saved = os.environ.get("BLOOMERY_CUDA_MOE_PROMPT")
    try:
        for path in paths:
            if path:
                os.environ["BLOOMERY_CUDA_MOE_PROMPT"] = path
            for p in prompts:
                rate = prompt_rate(model, ids[:p], a.reps)
                res["prompt_tok_s"][f"{p}" + (f" {path}" if path else "")] = round(rate, 1)
                print(f"prompt {p:>6} ids{' (' + path + ')' if path else ''}: {rate:,.1f} tok/s", flush=True)
    finally:
        if saved is None:
            os.environ.pop("BLOOMERY_CUDA_MOE_PROMPT", None)
        else:
            os.environ["BLOOMERY_CUDA_MOE_PROMPT"] = saved
    fill_slots(model, n_slots, a.depth, rng)
    for b in batches:
        ms = step_ms(model, b, a.depth, a.steps)
        res["decode_step_ms"][str(b)] = round(ms, 3)
        print(f"decode {b:>3} rows at depth {a.depth}: {ms:.3f} ms a step, {b / ms * 1e3:,.1f} tok/s", flush=True)
    if a.kernels:
        res["kernels_ms"] = {}
        from bench_cuda import kernel_profile
        for b in sorted({min(batches), max(batches)}):
            model.decode_greedy(list(range(b)), [7] * b, [a.depth] * b)      # the step of b rows captured first
            got = kernel_profile(model, a.depth + 1, rows=b)
            res["kernels_ms"][str(b)] = got
            top = ", ".join(f"{k} {v:.3f}" for k, v in list(got.items())[:8])
            print(f"kernels at {b} rows (ms a step, {sum(got.values()):.3f} in all): {top}", flush=True)
    return res


def parse_args(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True, metavar="FILE")
    ap.add_argument("--backend", default="cuda", choices=("cuda", "numpy"))
    ap.add_argument("--prompts", default="64,512,4096", help="prompt ids a pass (comma list)")
    ap.add_argument("--batches", default="1,2,4,8,16", help="rows a decode step (comma list)")
    ap.add_argument("--depth", type=int, default=512, help="ids each slot holds before its decode steps")
    ap.add_argument("--steps", type=int, default=40, help="decode steps timed a batch size")
    ap.add_argument("--reps", type=int, default=3, help="prompt passes a size (the median is kept)")
    ap.add_argument("--kernels", action="store_true", help="each kernel's time a step (cuda, torch's profiler)")
    ap.add_argument("--out", default=None, help="the JSON")
    a = ap.parse_args(argv)
    for flag, v in (("--depth", a.depth), ("--steps", a.steps), ("--reps", a.reps)):
        if v < 1:
            ap.error(f"{flag}: {v} is not a positive whole number")
    return a


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    try:
        res = run(a)
    except BenchError as e:
        sys.exit(f"bench_steps: {e}")
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
