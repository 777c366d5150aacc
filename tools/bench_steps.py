#!/usr/bin/env python3
"""The engine's own step times, in process (no HTTP, no server): prompt passes and decode steps.

  prompt   P random ids into slot 0 at position 0 (model.prefill), the median of --reps, for each of
           --prompts; on the cuda backend, of a file with routed experts, once for each prompt path of
           the experts (BLOOMERY_CUDA_MOE_PROMPT=planned, then grouped: engine/cuda/moe.py)
  decode   B slots each holding --depth ids, one id a slot a step (model.decode_greedy: the captured
           steps where the backend has them), the mean over --steps steps, for each of --batches
  engine   (--engine) B requests at once through the engine itself (core.Engine.step, as the engine process
           runs them, without its socket): each a --prompts-long random prompt, then --steps greedy ids,
           with the stop ids banned (as ignore_eos does, the way tools/bench_serve.py asks) and without
           bans, and with the step launched ahead and without (BLOOMERY_GREEDY_AHEAD=0): the ids a second
           once every slot decodes, and how the engine's steps went (launched ahead, from the largest
           logits, whole rows)
  (--prompt-at D: each pass at position D of a slot holding D ids, as a chat's later turn; with
           BLOOMERY_CUDA_PROMPT_ATTN=tc, the default, its captured passes take any depth)
  captured (--captured, cuda) the prompts again as the warm-up's captured passes (each --prompts size that
           has a bucket at position 0: engine/cuda/graph.py), after the uncaptured ones
  kernels  (--kernels, cuda) each kernel's time a decode step at the smallest and the largest batch (the
           25 largest), and a pass of the smallest prompt (with its launches), through torch's profiler
           (bench_cuda.kernel_profile, prompt_kernels), with programmatic dependent launch off so that
           a kernel's time is its own (with it on, a kernel starts early and its time holds the wait
           for the one before)

It prints one line a measurement and writes them all to --out (JSON). What it says of a decode step
is the engine's alone: through HTTP the server adds its own path (tools/bench_serve.py).

    python3 tools/bench_steps.py -m FILE [--backend cuda] [--prompts 64,512,4096] [--batches 1,2,4,8,16] \\
        [--depth 512] [--kernels] [--prompt-at D] [--captured] [--cpu-moe | -ncmoe N | -fitt MIB] [-t N] [--ops] [--out steps.json]

--ops (numpy backend) runs every decode step op by op instead of in decode_layers' one compiled call.

With a placement flag the model is placed as bloomery-serve's plan places it for that flag on this
machine, and each decode line adds the offload tier's own account: the host function's time a step,
the share of routed picks the card served and the experts residency moved.
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

from bloomery.routing_skew import best_static_share  # noqa: E402


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


def sizes(prompts: list[int], batches: list[int], depth: int, steps: int, prompt_at: int = 0) -> tuple[int, int]:
    """(slots, context a slot) that the measurements need (prompts at prompt_at: room for the widest bucket's
    padding past them, 512 ids)."""
    return max(batches), max(max(prompts) + (prompt_at + 512 if prompt_at else 0), depth + steps + 1)


def _sync(model) -> None:
    if model.ops.name == "cuda":
        import cupy
        cupy.cuda.Device().synchronize()


def prompt_rate(model, ids: np.ndarray, reps: int, pos0: int = 0) -> float:
    """tok/s of one prompt pass of len(ids) ids into slot 0 at position pos0 (the slot holding pos0 ids before
    it), the median of reps."""
    times = []
    for _ in range(reps):
        _sync(model)
        t = time.perf_counter()
        model.prefill(0, ids, pos0)
        _sync(model)
        times.append(time.perf_counter() - t)
    return ids.size / float(np.median(times))


def prompt_kernels(model, ids: np.ndarray, reps: int = 3) -> dict:
    """Per-kernel card time of a prompt pass of len(ids) ids into slot 0 through torch's profiler: {name: [ms a
    pass, launches a pass]} for the 25 largest, and "all" (every kernel's ms and launches together)."""
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        return {}
    torch.cuda.init()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            model.prefill(0, ids, 0)
        _sync(model)
    got, ms_all, n_all = {}, 0.0, 0
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t:
            got[ev.key[:60]] = [round(t / 1e3 / reps, 4), round(ev.count / reps, 1)]
            ms_all, n_all = ms_all + t / 1e3 / reps, n_all + ev.count / reps
    top = dict(sorted(got.items(), key=lambda kv: -kv[1][0])[:25])
    return {**top, "all": [round(ms_all, 3), round(n_all, 1)]}


def fill_slots(model, n_slots: int, depth: int, rng) -> None:
    for s in range(n_slots):
        model.prefill(s, rng.integers(100, model.n_vocab - 1, depth, dtype=np.int32), 0)


def step_ms(model, b: int, depth: int, steps: int) -> tuple[float, float]:
    """(ms of one decode step of b rows, ms of it spent between steps in ops.after_step: the offload's
    residency updates): slots 0..b-1, each at depth, then the next positions, each step fed the ids
    the last one picked (a greedy generation, so the routing moves as a served decode's does); the
    first step (where the batch size's step is captured) is not counted."""
    slots = list(range(b))
    ids = model.decode_greedy(slots, [7] * b, [depth] * b)
    _sync(model)
    ops, spent = model.ops, [0.0]
    own = ops.after_step

    def timed(decode: bool) -> None:
        t0 = time.perf_counter()
        own(decode)
        spent[0] += time.perf_counter() - t0

    ops.after_step = timed
    try:
        t = time.perf_counter()
        for i in range(steps):
            ids = model.decode_greedy(slots, [int(x) for x in ids], [depth + 1 + i] * b)
        _sync(model)
        took = time.perf_counter() - t
    finally:
        del ops.after_step
    return took / steps * 1e3, spent[0] / steps * 1e3


STOP_BANS = (151643, 151645)      # what ignore_eos bans on the Qwen vocabularies (<|endoftext|>, <|im_end|>)


def engine_rate(model, b: int, prompt: int, n_gen: int, bans: bool, ahead: bool, rng) -> dict:
    """b requests through core.Engine at once (n_gen greedy ids each after a prompt of `prompt` random ids):
    the ids a second from the round every slot decodes to the last, and the engine's step counters."""
    from bloomery.engine.core import Engine
    from bloomery.engine.types import EngineRequest, SamplingParams
    bias = tuple((i, float("-inf")) for i in STOP_BANS if i < model.n_vocab) if bans else ()
    sampling = SamplingParams(temperature=0.0, logit_bias=bias)
    saved = os.environ.get("BLOOMERY_GREEDY_AHEAD")
    os.environ["BLOOMERY_GREEDY_AHEAD"] = "1" if ahead else "0"
    try:
        eng = Engine(model, b, model.n_ctx_slot)
        for r in range(b):
            ids = rng.integers(100, model.n_vocab - 1, prompt, dtype=np.int32)
            eng.add(EngineRequest(f"r{r}", tuple(int(i) for i in ids), n_gen, sampling=sampling))
        t0, n_ids, started = None, 0, set()
        while eng.has_work():
            outs = eng.step()
            if t0 is None:
                started.update(o.req_id for o in outs if o.token is not None)
                if len(started) == b:
                    _sync(model)
                    t0 = time.perf_counter()
            else:
                n_ids += sum(1 for o in outs if o.token is not None)
        took = time.perf_counter() - t0
    finally:
        if saved is None:
            os.environ.pop("BLOOMERY_GREEDY_AHEAD", None)
        else:
            os.environ["BLOOMERY_GREEDY_AHEAD"] = saved
    return {"tok_s": round(n_ids / took, 1), "ids": n_ids, "ahead_steps": eng.ahead_steps,
            "ahead_dropped": eng.ahead_dropped, "chained": eng.chained_steps, "top_steps": eng.top_steps,
            "top_misses": eng.top_misses}


def placing(a) -> bool:
    return bool(a.cpu_moe or a.n_cpu_moe is not None or a.fit_target is not None)


def planned(a, n_slots: int, n_ctx: int):
    """The placement bloomery-serve's plan makes for these flags (llama-server's meanings) on this
    machine's census, as a server started with them would load."""
    from bloomery import placement_flags
    from bloomery.census import take_census
    from bloomery.gguf_file import open_gguf
    from bloomery.plan import make_plan, model_facts
    given = {}
    if a.cpu_moe:
        given["--cpu-moe"] = ("--cpu-moe", True)
    if a.n_cpu_moe is not None:
        given["--n-cpu-moe"] = ("-ncmoe", str(a.n_cpu_moe))
    if a.fit_target is not None:
        given["--fit-target"] = ("-fitt", a.fit_target)
    ask, _ = placement_flags.read(given)
    plan = make_plan(model_facts(open_gguf(a.model)), take_census(), a.backend, n_slots * n_ctx, n_slots, ask=ask)
    return plan.placement


def host_share(before: dict, after: dict, steps: int) -> dict:
    """What the offload report says of the steps between two reports: the host function's ms a step,
    the share of routed picks the card served, the experts residency moved."""
    hits = sum(x["hits"] for x in after["layers"]) - sum(x["hits"] for x in before["layers"])
    misses = sum(x["misses"] for x in after["layers"]) - sum(x["misses"] for x in before["layers"])
    out = {"host_ms_step": round((after["host_wait_s"] - before["host_wait_s"]) / steps * 1e3, 3),
           "hits": hits / max(1, hits + misses),
           "moved_experts": after["moved_experts"] - before["moved_experts"]}
    picked = [[y - x for x, y in zip(a.get("counts", ()), b.get("counts", ()))]
              for a, b in zip(before["layers"], after["layers"])]
    if any(sum(r) for r in picked):       # the ceiling: the best fixed placement for these very picks
        out["best_static_hits"] = best_static_share(picked, [len(ly["on_card"]) for ly in after["layers"]])
    return out


def has_experts(model) -> bool:
    return bool(model.gf.get(f"{model.gf.arch()}.expert_count"))


def run(a) -> dict:
    from bloomery.engine.loader import load_model
    from bloomery.placement import whole
    prompts, batches = counts("--prompts", a.prompts), counts("--batches", a.batches)
    if a.kernels and a.backend != "cuda":
        raise BenchError("--kernels: the per-kernel times come from the card's profiler (--backend cuda)")
    if a.ops and a.backend != "numpy":
        raise BenchError("--ops: the one-call decode is the numpy backend's (--backend numpy)")
    if a.kernels:
        os.environ["BLOOMERY_CUDA_PDL"] = "0"          # read when each step is captured
    if a.prompt_at < 0:
        raise BenchError(f"--prompt-at {a.prompt_at}: a position, 0 or more")
    n_slots, n_ctx = sizes(prompts, batches, a.depth, a.steps, a.prompt_at)
    rng = np.random.default_rng(0)
    t = time.perf_counter()
    placement = planned(a, n_slots, n_ctx) if placing(a) else whole(a.backend, n_slots=n_slots, n_ctx_slot=n_ctx)
    model = load_model(a.model, placement, threads=a.threads)
    res = {"model": a.model, "backend": a.backend, "load_s": round(time.perf_counter() - t, 2),
           "depth": a.depth, "prompt_tok_s": {}, "decode_step_ms": {}}
    off = getattr(model.ops, "offload", None)
    if off is not None:
        res["placement"] = {"case": placement.case, "experts_on_card": sum(placement.experts_on_card),
                            "experts": placement.n_expert * len(placement.experts_on_card),
                            "share": off.share, "threads": off.threads, "residency": off.residency}
        print(f"placement {placement.case}: {res['placement']['experts_on_card']} of {res['placement']['experts']} "
              f"routed experts on the card; bus share {off.share}, {off.threads} host threads, "
              f"residency {'on' if off.residency else 'off'}", flush=True)
    ids = rng.integers(100, model.n_vocab - 1, max(prompts), dtype=np.int32)
    model.prefill(0, ids[:min(64, ids.size)], 0)     # first-use costs (handles, pools) out of the figures
    at = a.prompt_at
    head = rng.integers(100, model.n_vocab - 1, at, dtype=np.int32)
    if at:
        model.prefill(0, head, 0)                    # what the slot holds before each prompt pass
    tag = f" at {at}" if at else ""
    paths = ("planned", "grouped") if a.backend == "cuda" and has_experts(model) else ("",)
    saved = os.environ.get("BLOOMERY_CUDA_MOE_PROMPT")
    try:
        for path in paths:
            if path:
                os.environ["BLOOMERY_CUDA_MOE_PROMPT"] = path
            for p in prompts:
                rate = prompt_rate(model, ids[:p], a.reps, at)
                res["prompt_tok_s"][f"{p}{tag}" + (f" {path}" if path else "")] = round(rate, 1)
                print(f"prompt {p:>6} ids{tag}{' (' + path + ')' if path else ''}: {rate:,.1f} tok/s", flush=True)
    finally:
        if saved is None:
            os.environ.pop("BLOOMERY_CUDA_MOE_PROMPT", None)
        else:
            os.environ["BLOOMERY_CUDA_MOE_PROMPT"] = saved
    runner = model.ops.decode_runner(model) if a.captured and a.backend == "cuda" else None
    if runner is not None and runner.prompt_capturable():
        t = time.perf_counter()
        buckets = runner.capture_prompts()
        print(f"prompt graphs ({', '.join(map(str, buckets))} rows) captured in {time.perf_counter() - t:.2f} s",
              flush=True)
        if at:
            model.prefill(0, head, 0)                # the captures wrote slot 0 from position 0
        for p in prompts:
            if runner.prompt_bucket(p, at) is not None:
                rate = prompt_rate(model, ids[:p], a.reps, at)
                res["prompt_tok_s"][f"{p}{tag} captured"] = round(rate, 1)
                print(f"prompt {p:>6} ids{tag} (captured, bucket {runner.prompt_bucket(p, at)}): {rate:,.1f} tok/s "
                      f"({1e3 * p / rate:.2f} ms)", flush=True)
    if a.kernels:
        p = min(prompts)
        got = prompt_kernels(model, ids[:p])
        res["prompt_kernels_ms"] = {str(p): got}
        if got:
            top = ", ".join(f"{k} {v[0]:.2f} ({v[1]:.0f})" for k, v in list(got.items())[:10])
            rate = res["prompt_tok_s"].get(str(p)) or res["prompt_tok_s"].get(f"{p} planned")
            wall = f"; the pass takes {1e3 * p / rate:.2f} ms unprofiled" if rate else ""
            print(f"kernels of a {p}-id prompt pass (ms (launches) a pass; all {got['all'][0]:.2f} ms in "
                  f"{got['all'][1]:.0f} launches{wall}): {top}", flush=True)
    if a.ops:
        model.ops.decode_layers = lambda *args: None                 # every step takes the ops
        res["ops"] = True
    fill_slots(model, n_slots, a.depth, rng)
    if a.threads_sweep:
        if off is None:
            raise BenchError("--threads-sweep: the model keeps no expert on the host (give -fitt, -ncmoe or --cpu-moe)")
        res["threads_sweep"] = {}
        for n in counts("--threads-sweep", a.threads_sweep):
            off.set_threads(n)
            before = off.report()
            ms, between = step_ms(model, min(batches), a.depth, a.steps)
            got = host_share(before, off.report(), a.steps + 1)
            res["threads_sweep"][str(n)] = {"step_ms": round(ms, 3), "after_step_ms": round(between, 3), **got}
            print(f"{n:>3} host threads, {min(batches)} rows: {ms:.3f} ms a step ({between:.3f} between steps); host "
                  f"function {got['host_ms_step']:.3f} ms a step, card hits {got['hits']:.1%}", flush=True)
        off.set_threads(a.threads if a.threads > 0 else res["placement"]["threads"])
    for b in batches:
        before = off.report() if off is not None else None
        ms, between = step_ms(model, b, a.depth, a.steps)
        res["decode_step_ms"][str(b)] = round(ms, 3)
        res.setdefault("after_step_ms", {})[str(b)] = round(between, 3)
        line = (f"decode {b:>3} rows at depth {a.depth}: {ms:.3f} ms a step, {b / ms * 1e3:,.1f} tok/s "
                f"({between:.3f} ms of it between steps)")
        if off is not None:
            got = host_share(before, off.report(), a.steps + 1)
            res.setdefault("host", {})[str(b)] = got
            line += (f"; host function {got['host_ms_step']:.3f} ms a step, card hits {got['hits']:.1%}"
                     + (f" (the best fixed placement: {got['best_static_hits']:.1%})" if "best_static_hits" in got else "")
                     + f", {got['moved_experts']} experts moved")
        print(line, flush=True)
    if a.engine:
        res["engine"] = {}
        for b in batches:
            for bans, ahead in ((True, True), (True, False), (False, True), (False, False)):
                name = f"{b} {'bans' if bans else 'plain'} {'ahead' if ahead else 'no-ahead'}"
                got = engine_rate(model, b, min(prompts), a.steps, bans, ahead, rng)
                res["engine"][name] = got
                print(f"engine, {b:>3} requests, greedy{' with bans' if bans else ''}, "
                      f"{'launched ahead' if ahead else 'BLOOMERY_GREEDY_AHEAD=0'}: {got['tok_s']:,.1f} tok/s "
                      f"({b * 1e3 / got['tok_s']:.3f} ms a step); {got['ahead_steps']} steps launched ahead, "
                      f"{got['ahead_dropped']} dropped, {got['chained']} chained, {got['top_steps']} from the largest "
                      "logits", flush=True)
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
    ap.add_argument("--prompt-at", type=int, default=0, metavar="D",
                    help="each prompt pass starts at position D of a slot holding D ids (a chat's later turn)")
    ap.add_argument("--captured", action="store_true",
                    help="cuda: also each prompt that has a bucket as the warm-up's captured pass (graph.py)")
    ap.add_argument("--engine", action="store_true",
                    help="also B requests at once through core.Engine (bans or not, launched ahead or not)")
    ap.add_argument("--threads-sweep", default="", metavar="N,N,...",
                    help="with host experts: the decode step of the fewest rows again at each of these host thread counts")
    ap.add_argument("--out", default=None, help="the JSON")
    ap.add_argument("--cpu-moe", action="store_true", help="placement as llama-server's --cpu-moe (the plan's)")
    ap.add_argument("-ncmoe", "--n-cpu-moe", type=int, default=None, help="placement as llama-server's -ncmoe N")
    ap.add_argument("-fitt", "--fit-target", default=None, metavar="MIB", help="placement as llama-server's -fitt MIB")
    ap.add_argument("-t", "--threads", type=int, default=0, help="host threads of the offload tier (0: the default)")
    ap.add_argument("--ops", action="store_true", help="numpy backend: decode op by op, not in decode_layers' one call")
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
