#!/usr/bin/env python3
"""Benchmark bloomery's cuda backend against llama.cpp's CUDA build on one file, in one run.

Makes (with tools/make_synthetic.py) a file of the Qwen3-30B-A3B shape at the Q4_K_M mix
(qwen3moe, 48 layers, n_embd 2048, 32/4 heads of 128, 128 experts top 8, width 768, vocab
151936), runs llama-bench (-ngl 99 -fa 1) and bloomery on it, and prints one table: prompt
tok/s at P=512 and P=4096, decode tok/s at depth 512 and 4096 (n=128, greedy), card bytes
used, and the ratio; plus the decode's fraction of the memory-bandwidth floor.

  python3 tools/bench_cuda.py --work /tmp/bench --llama-bench <bin>/llama-bench [--out result.json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

from make_synthetic import PRESETS, write_synthetic  # noqa: E402

SHAPE = PRESETS["qwen3-30b-a3b"][1]
PROMPTS = (512, 4096)
DEPTHS = (512, 4096)
N_GEN = 128


def card_used_bytes() -> int:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    return int(out.split()[0]) << 20


class PeakMemory:
    """The card's peak used memory while a block runs (nvidia-smi every 0.2 s), less the start."""

    def __enter__(self):
        self.base, self.peak, self._stop = card_used_bytes(), 0, threading.Event()
        self._t = threading.Thread(target=self._poll, daemon=True)
        self._t.start()
        return self

    def _poll(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, card_used_bytes())
            time.sleep(0.2)

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.used = max(self.peak - self.base, 0)


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (median of 10 over 4 GiB)."""
    import cupy
    a = cupy.ones(1 << 30, cupy.float32)
    b = cupy.empty_like(a)
    times = []
    for _ in range(12):
        e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
        e0.record()
        b[...] = a
        e1.record()
        e1.synchronize()
        times.append(cupy.cuda.get_elapsed_time(e0, e1) / 1e3)
    rate = 2 * a.nbytes / float(np.median(times[2:]))
    del a, b
    cupy.get_default_memory_pool().free_all_blocks()
    return rate


def llama_bench(exe: str, path: Path) -> dict:
    rows = {}
    runs = [["-p", ",".join(map(str, PROMPTS)), "-n", "0"],
            ["-p", "0", "-n", str(N_GEN), "-d", ",".join(map(str, DEPTHS))]]
    with PeakMemory() as mem:
        for extra in runs:
            cmd = [exe, "-m", str(path), "-ngl", "99", "-fa", "1", "-r", "3", "-o", "json", *extra]
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            if out.returncode:
                raise SystemExit(f"llama-bench failed ({out.returncode}): {out.stderr[-2000:]}")
            for r in json.loads(out.stdout):
                if r["n_prompt"] and not r["n_gen"]:
                    rows[f"pp{r['n_prompt']}"] = r["avg_ts"]
                elif r["n_gen"]:
                    rows[f"tg{r['n_gen']}@d{r.get('n_depth', 0)}"] = r["avg_ts"]
    rows["card_bytes"] = mem.used
    return rows


def decode_rate(model, tok: int, depth: int, n: int = N_GEN) -> float:
    """Greedy decode tok/s: median of 3 runs of n steps from depth (the step captured first)."""
    model.decode_greedy([0], [tok], [depth])
    ts = []
    for _ in range(3):
        t0, cur = time.perf_counter(), tok
        for i in range(n):
            cur = int(model.decode_greedy([0], [cur], [depth + i])[0])
        ts.append(time.perf_counter() - t0)
    return n / float(np.median(ts))


def sampled_rate(model, tok: int, depth: int, top_k: bool, n: int = N_GEN) -> float:
    """Sampled decode tok/s (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05: llama-server's
    defaults, seed 1): the top_k handed over by the card (decode_topk), or whole rows (decode)."""
    from bloomery.engine.sampler import Sampler
    from bloomery.engine.types import SamplingParams
    sampler = Sampler(SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=1,
                                     repeat_penalty=1.0), model.n_vocab, depth + n + 8)
    k = sampler.candidates_k

    def step(cur: int, i: int) -> int:
        if top_k:
            ids, vals, nan = model.decode_topk([0], [cur], [depth + i], k)
            return sampler.sample_candidates(ids[0], vals[0], int(nan[0])).token
        return sampler.sample(model.decode([0], [cur], [depth + i])[0]).token
    step(tok, 0)
    ts = []
    for _ in range(3):
        t0, cur = time.perf_counter(), tok
        for i in range(n):
            cur = step(cur, i)
        ts.append(time.perf_counter() - t0)
    return n / float(np.median(ts))


# the decode step's switches (BLOOMERY_CUDA_PDL, BLOOMERY_CUDA_MOE), each captured afresh
VARIANTS = [{"BLOOMERY_CUDA_PDL": pdl, "BLOOMERY_CUDA_MOE": moe} for pdl in ("1", "0") for moe in ("staged", "direct")]


def variant_rates(model, ids, depth: int) -> dict:
    """Decode tok/s at depth for each switch setting, the step recaptured for each."""
    saved = {k: os.environ.get(k) for k in VARIANTS[0]}
    out = {}
    try:
        for v in VARIANTS:
            os.environ.update(v)
            model.ops._runners.clear()
            name = ",".join(f"{k.split('_')[-1].lower()}={x}" for k, x in v.items())
            try:
                out[name] = decode_rate(model, int(ids[depth - 1]), depth)
            except Exception as e:
                print(f"variant {name} failed: {type(e).__name__}: {e}", flush=True)
    finally:
        for k, x in saved.items():
            if x is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = x
        model.ops._runners.clear()
    return out


def bloomery_bench(path: Path, profile: bool, variants: bool = False) -> dict:
    import cupy
    from bloomery.engine.loader import load_model
    from bloomery.placement import whole
    rows = {}
    with PeakMemory() as mem:
        t0 = time.perf_counter()
        model = load_model(str(path), whole("cuda", n_slots=1, n_ctx_slot=max(DEPTHS) + N_GEN + 64))
        cupy.cuda.Device().synchronize()
        rows["load_s"] = time.perf_counter() - t0
        rng = np.random.default_rng(0)
        ids = rng.integers(100, 150000, max(PROMPTS + DEPTHS), dtype=np.int32)
        model.prefill(0, ids[:16], 0)                          # compile, cuBLAS handles
        for p in PROMPTS:
            ts = []
            for _ in range(3):
                t = time.perf_counter()
                model.prefill(0, ids[:p], 0)
                ts.append(time.perf_counter() - t)
            rows[f"pp{p}"] = p / float(np.median(ts))
        for d in DEPTHS:
            model.prefill(0, ids[:d], 0)
            try:
                rows[f"tg{N_GEN}@d{d}"] = decode_rate(model, int(ids[d - 1]), d)
            except Exception as e:          # the capture with programmatic launch refused: say so, go on without
                if os.environ.get("BLOOMERY_CUDA_PDL") == "0":
                    raise
                rows["pdl_error"] = f"{type(e).__name__}: {e}"
                print("decode with programmatic dependent launch failed:", rows["pdl_error"], flush=True)
                os.environ["BLOOMERY_CUDA_PDL"] = "0"
                model.ops._runners.clear()
                rows[f"tg{N_GEN}@d{d}"] = decode_rate(model, int(ids[d - 1]), d)
        model.prefill(0, ids[:DEPTHS[0]], 0)
        for mode in ("topk", "logits"):
            rows[f"tg{N_GEN}@d{DEPTHS[0]} sampled {mode}"] = sampled_rate(model, int(ids[DEPTHS[0] - 1]), DEPTHS[0],
                                                                        mode == "topk")
        if variants:
            model.prefill(0, ids[:DEPTHS[0]], 0)
            rows["variants"] = variant_rates(model, ids, DEPTHS[0])
        if profile:
            model.prefill(0, ids[:DEPTHS[0]], 0)
            rows["kernels_ms"] = kernel_profile(model, DEPTHS[0])
            try:
                rows["step_kernels"] = step_profile(model, DEPTHS[0])
            except Exception as e:              # the profiler's event fields differ across torch versions
                print(f"step profile: {type(e).__name__}: {e}", flush=True)
            rows["prompt_kernels_ms"] = prompt_profile(model, ids[:PROMPTS[-1]])
    rows["card_bytes"] = mem.used
    rows["bytes_per_token"] = {d: decode_bytes(model, d) for d in DEPTHS}
    return rows


@dataclass(frozen=True)
class FileFacts:
    """What a decode token must read, from a MoE (or dense) GGUF's tensors and keys."""
    file_bytes: int
    n_layer: int
    n_expert: int                # 0 in a dense file
    n_used: int
    expert_bytes: int            # one routed expert of one layer: its gate, up and down rows
    dense_token_bytes: int       # every other weight but the embedding table, plus one embedding row
    kv_bytes_per_pos: int        # f16 K and V of one position, every layer


def file_facts(gf) -> FileFacts:
    from bloomery.engine.models.layers import Hparams, MoeParams
    arch = gf.arch()
    hp = Hparams.from_gguf(gf, arch)
    moe = MoeParams.from_gguf(gf, arch) if gf.get(f"{arch}.expert_count") else None
    dense, experts = 0, 0
    for name, t in gf.tensors.items():
        if name == "token_embd.weight":
            dense += t.n_bytes // t.shape[1]
        elif "_exps." in name:
            experts += t.n_bytes
        else:
            dense += t.n_bytes
    n_expert = moe.n_expert if moe else 0
    return FileFacts(file_bytes=Path(gf.path).stat().st_size, n_layer=hp.n_layer, n_expert=n_expert,
                     n_used=moe.n_expert_used if moe else 0,
                     expert_bytes=experts // (hp.n_layer * n_expert) if n_expert else 0,
                     dense_token_bytes=dense, kv_bytes_per_pos=2 * hp.n_layer * hp.n_head_kv * hp.head_dim * 2)


def decode_bytes(model, depth: int) -> int:
    """Bytes a decode step must read: every weight but the embedding table, the chosen
    experts' share of the stacked expert tensors, one embedding row, the KV up to depth."""
    f = file_facts(model.gf)
    return f.dense_token_bytes + f.n_layer * f.n_used * f.expert_bytes + f.kv_bytes_per_pos * depth


def kernel_profile(model, depth: int, rows: int = 1) -> dict:
    """Per-kernel GPU time (ms per decode step of `rows` slots, 0 .. rows-1) of the captured step, through
    torch's CUPTI profiler; the 25 largest. Each step is fed the ids the last one picked, from distinct ids, so
    the rows route as a served decode's do (the same id in every row, as before session 20, made every row
    pick the same experts)."""
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        return {}
    torch.cuda.init()
    n, slots = 20, list(range(rows))
    ids = [1 + 101 * r for r in slots]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(n):
            ids = [int(x) for x in model.decode_greedy(slots, ids, [depth + i] * rows)]
    out = {}
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t:
            out[ev.key[:60]] = round(t / 1e3 / n, 4)
    return dict(sorted(out.items(), key=lambda kv: -kv[1])[:25])


def step_profile(model, depth: int) -> list:
    """One captured decode step's kernels in order, each position of a layer averaged over the
    middle layers: [name, us running, us from the previous kernel's end to its start] (a
    negative gap: it started before the one before ended, as programmatic launch allows)."""
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        return []
    torch.cuda.init()
    n = 5
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(n):
            model.decode_greedy([0], [1], [depth + i])
    evs = sorted(((e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                  if getattr(e.device_type, "name", "") == "CUDA" and not e.name.startswith("Memcpy")),
                 key=lambda e: e[1])
    starts = [i for i, e in enumerate(evs) if e[0] == "get_rows"]
    if len(starts) < 3:
        return []
    step = evs[starts[1]:starts[2]]                       # a middle step, from its embedding lookup
    n_layer = model.n_layer
    per = (len(step) - 1) // n_layer                      # kernels a layer (the head has fewer)
    rows = []
    for j in range(per):
        durs, gaps = [], []
        for il in range(2, n_layer - 2):
            k = 1 + il * per + j
            durs.append(step[k][2] - step[k][1])
            gaps.append(step[k][1] - step[k - 1][2])
        rows.append([step[1 + 2 * per + j][0][:40], round(float(np.mean(durs)), 2), round(float(np.mean(gaps)), 2)])
    for k in range(1 + n_layer * per, len(step)):
        rows.append([step[k][0][:40], round(step[k][2] - step[k][1], 2), round(step[k][1] - step[k - 1][2], 2)])
    rows.append(["step", round(step[-1][2] - step[0][1], 1), 0.0])
    return rows


def prompt_profile(model, ids) -> dict:
    """Per-kernel GPU time (ms) of one prompt of len(ids), plus the wall time and the sum of
    the kernels' times (their difference is time the card waits on the host)."""
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        return {}
    import cupy
    torch.cuda.init()
    cupy.cuda.Device().synchronize()
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        model.prefill(0, ids, 0)
        cupy.cuda.Device().synchronize()
    wall = time.perf_counter() - t
    out, total = {}, 0.0
    for ev in prof.key_averages():
        t_us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t_us:
            out[f"{ev.key[:50]} x{ev.count}"] = round(t_us / 1e3, 3)
            total += t_us / 1e3
    top = dict(sorted(out.items(), key=lambda kv: -kv[1])[:25])
    return {"wall_ms": round(wall * 1e3, 1), "kernels_sum_ms": round(total, 1), **top}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/bloomery-bench")
    ap.add_argument("--llama-bench", default=None, help="llama.cpp's CUDA llama-bench (omit to skip it)")
    ap.add_argument("--tokenizer-from", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--variants", action="store_true", help="decode at depth 512 for each decode-step switch")
    ap.add_argument("--layers", type=int, default=SHAPE["n_layer"], help="fewer layers for a quick run")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    path = work / f"qwen3moe-30b-a3b-shape-q4_k_m-L{args.layers}.gguf"
    if not path.exists():
        t = time.perf_counter()
        write_synthetic(path, "qwen3moe", tokenizer_from=args.tokenizer_from, **{**SHAPE, "n_layer": args.layers})
        print(f"wrote {path} ({path.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - t:.0f} s", flush=True)
    result = {"file": str(path), "file_bytes": path.stat().st_size, "copy_bytes_s": copy_bandwidth()}
    result["bloomery"] = bloomery_bench(path, args.profile, args.variants)
    print("bloomery:", json.dumps(result["bloomery"]), flush=True)
    if args.llama_bench:
        try:
            result["llama.cpp"] = llama_bench(args.llama_bench, path)
            print("llama.cpp:", json.dumps(result["llama.cpp"]), flush=True)
        except (SystemExit, OSError, subprocess.SubprocessError) as e:   # keep bloomery's numbers
            result["llama.cpp_error"] = str(e)
            print("llama-bench:", e, flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    print_table(result)


def print_table(r: dict) -> None:
    b, lc = r["bloomery"], r.get("llama.cpp", {})
    keys = [f"pp{p}" for p in PROMPTS] + [f"tg{N_GEN}@d{d}" for d in DEPTHS]
    print(f"\n{'test':<14}{'llama.cpp':>12}{'bloomery':>12}{'ratio':>8}")
    for k in keys:
        lv, bv = lc.get(k), b.get(k)
        ratio = f"{bv / lv:.2f}" if lv and bv else "-"
        print(f"{k:<14}{(f'{lv:.1f}' if lv else '-'):>12}{(f'{bv:.1f}' if bv else '-'):>12}{ratio:>8}")
    cb = lc.get("card_bytes")
    print(f"{'card GiB':<14}{(f'{cb / 2**30:.2f}' if cb else '-'):>12}{b['card_bytes'] / 2**30:>12.2f}")
    for mode in ("topk", "logits"):
        rate = b.get(f"tg{N_GEN}@d{DEPTHS[0]} sampled {mode}")
        if rate:
            print(f"decode d{DEPTHS[0]} sampled (llama-server's defaults), {mode} to the host: {rate:.1f} tok/s")
    for name, rate in b.get("variants", {}).items():
        print(f"decode d{DEPTHS[0]} {name}: {rate:.1f} tok/s")
    if b.get("step_kernels"):
        print("a decode step, a layer's kernels (us running, us since the previous ended):")
        for name, dur, gap in b["step_kernels"]:
            print(f"  {name:<40}{dur:>9.2f}{gap:>9.2f}")
    bw = r["copy_bytes_s"]
    for d in DEPTHS:
        per_tok = b["bytes_per_token"][d]
        floor = bw / per_tok
        got = b.get(f"tg{N_GEN}@d{d}", 0)
        print(f"decode d{d}: {per_tok / 1e9:.3f} GB/token, copy {bw / 1e12:.2f} TB/s -> floor {floor:.0f} tok/s, "
              f"reached {got / floor:.1%}")


if __name__ == "__main__":
    main()
