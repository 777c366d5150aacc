#!/usr/bin/env python3
"""bloomery-serve against llama-server on a MoE file larger than the card budget, through HTTP.

One engine at a time, on the same GGUF, the same card, the same card budget, the same
requests (streamed /completion, greedy, cache_prompt false, the same random prompt ids; one
warm-up, then the median of 3). The cells (name: model/engine/budget/test):

  tests    tg128   decode after a 512-id prompt, 128 ids (ignore_eos)
           pp512   a 512-id prompt (n_predict 1)
           pp4096  a 4096-id prompt (n_predict 1)
  budgets  whole   the whole card (bloomery: no flag; llama-server: -ngl 99)
           fit     the card acts as one of --usable-gb: -fitt MiB (the card's total less that) for both
           host    every routed expert on the host: --cpu-moe for both (llama-server with -ngl 99)
           ncmoe   llama-server only: -ngl 99 -ncmoe N, the smallest N whose card use fits --usable-gb
                   (searched by starting llama-server and reading the card's used memory, or --ncmoe N)

It measures the host's memory read bandwidth (threads reading one large buffer), the pinned
host-to-card copy bandwidth and the card's own copy bandwidth, and prints beside each cell the
floor they set (decode: the bytes a token reads on the host and on the card; prompt: every host
expert copied to the card once). After bloomery's cells of a budget it asks GET /residency for
the routing it counted and prints the skew (bloomery/routing_skew.py); where that route does not
answer, it says so. The JSON (--out) is rewritten after every cell, and a rerun with the same
--out skips the cells it holds, so a run cut short keeps what it measured and the next call goes on.

  # on the card: the files (tools/make_synthetic.py --shape qwen3-30b-a3b [--router-skew 0.6]), then
  python3 tools/bench_offload.py --model uniform=/tmp/bench/u.gguf --model skewed=/tmp/bench/s.gguf \\
      --llama-server <build>/bin/llama-server --out /tmp/bench/offload.json [--cells 'skewed/*/fit/*']
  # anywhere: the HTTP path on the CPU backend with a tiny file
  python3 tools/bench_offload.py --model tiny=/tmp/t.gguf --engines bloomery --backend cpu \\
      --cells '*/whole/pp512' --prompts 64 --n-gen 8 --out /tmp/offload.json
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))
from bench_cuda import FileFacts, PeakMemory, card_used_bytes, copy_bandwidth, file_facts  # noqa: E402
from bench_http import Server, free_port  # noqa: E402

from bloomery.routing_skew import best_static_share, routing_skew  # noqa: E402

ENGINES = ("bloomery", "llama")
BUDGETS = ("whole", "fit", "host", "ncmoe")
LLAMA_ONLY = ("ncmoe",)
USABLE_GB = 11.5
MIB = 1 << 20
H200_BYTES_S = 4.8e12              # the card's nominal memory bandwidth, where it was not measured
DEPTH = 512                        # the decode cell's prompt
N_GEN = 128
PROMPTS = (512, 4096)
RUNS = 3


class BenchError(ValueError):
    """A bad argument or an arithmetic that cannot be done; names the value and the bound."""


# --- the cells (pure) --------------------------------------------------------------------------

@dataclass(frozen=True)
class Cell:
    model: str
    engine: str
    budget: str
    test: str

    @property
    def name(self) -> str:
        return f"{self.model}/{self.engine}/{self.budget}/{self.test}"


def cell_tests(prompts: Sequence[int] = PROMPTS, n_gen: int = N_GEN) -> tuple[str, ...]:
    return (f"tg{n_gen}",) + tuple(f"pp{p}" for p in prompts)


def cell_list(models: Sequence[str], engines: Sequence[str], tests: Sequence[str],
              patterns: Sequence[str] = ()) -> list[Cell]:
    """Every cell, in run order (model, engine, budget, test), kept where a pattern matches its
    name (model/engine/budget/test) or its budget/test; no pattern keeps all. ncmoe is llama's only."""
    for e in engines:
        if e not in ENGINES:
            raise BenchError(f"--engines: {e!r} is not one of {', '.join(ENGINES)}")
    if not models:
        raise BenchError("--model NAME=PATH: at least one model")
    out = []
    for model in models:
        for engine in engines:
            for budget in BUDGETS:
                if budget in LLAMA_ONLY and engine != "llama":
                    continue
                for test in tests:
                    c = Cell(model, engine, budget, test)
                    if not patterns or any(fnmatch.fnmatchcase(c.name, p) or fnmatch.fnmatchcase(f"{budget}/{test}", p)
                                           for p in patterns):
                        out.append(c)
    if not out:
        raise BenchError(f"--cells {','.join(patterns)}: no cell matches (names are model/engine/budget/test, "
                         f"budgets {', '.join(BUDGETS)}, tests {', '.join(tests)})")
    return out


def fit_target_mib(card_total_bytes: int, usable_bytes: int) -> int:
    """-fitt: the MiB a card keeps free so that about usable_bytes of it stay usable."""
    if usable_bytes <= 0:
        raise BenchError(f"--usable-gb: {usable_bytes / 1e9:g} GB leaves the card nothing")
    if usable_bytes >= card_total_bytes:
        raise BenchError(f"--usable-gb {usable_bytes / 1e9:g} GB is not below the card's "
                         f"{card_total_bytes / 1e9:.1f} GB: no fit target makes it smaller")
    return (card_total_bytes - usable_bytes) // MIB


def engine_flags(engine: str, budget: str, fitt_mib: int | None = None, ncmoe: int | None = None) -> list[str]:
    """The placement flags of a budget, as each engine spells them."""
    if budget == "whole":
        return ["-ngl", "99"] if engine == "llama" else []
    if budget == "fit":
        if fitt_mib is None:
            raise BenchError("the fit budget needs the card's total (nvidia-smi) or --card-total-mib")
        return ["-fitt", str(fitt_mib)]
    if budget == "host":
        return (["-ngl", "99"] if engine == "llama" else []) + ["--cpu-moe"]
    if budget == "ncmoe" and engine == "llama":
        if ncmoe is None:
            raise BenchError("the ncmoe budget needs a count (--ncmoe N, or the card to search one on)")
        return ["-ngl", "99", "-ncmoe", str(ncmoe)]
    raise BenchError(f"no budget {budget!r} for {engine}")


def search_ncmoe(probe: Callable[[int], int], n_layer: int, budget_bytes: int, start: int,
                 max_probes: int = 6) -> tuple[int | None, list[tuple[int, int]]]:
    """The smallest -ncmoe N in 0..n_layer whose card use (probe(N), bytes; falling as N grows)
    is within budget_bytes, starting at `start` and stepping by one from the nearest known
    bound; (None, probes) if max_probes did not settle it. Probes are (N, bytes)."""
    seen: dict[int, int] = {}
    n = min(max(start, 0), n_layer)
    while len(seen) < max_probes:
        seen[n] = probe(n)
        fits = sorted(k for k, v in seen.items() if v <= budget_bytes)
        over = sorted(k for k, v in seen.items() if v > budget_bytes)
        if fits and (fits[0] == 0 or fits[0] - 1 in over):
            return fits[0], sorted(seen.items())
        if not fits:
            if over[-1] >= n_layer:
                return None, sorted(seen.items())        # every expert on the host still does not fit
            n = over[-1] + 1
        else:
            n = fits[0] - 1
    return None, sorted(seen.items())


def ncmoe_start(facts: FileFacts, budget_bytes: int, reserve_bytes: int = 3 << 30) -> int:
    """A first -ncmoe guess: the layers whose experts must leave the card for the file and a
    reserve (KV, compute buffers) to fit budget_bytes."""
    layer = facts.n_expert * facts.expert_bytes
    if layer <= 0:
        raise BenchError("the file has no routed experts: -ncmoe has nothing to move")
    over = facts.file_bytes + reserve_bytes - budget_bytes
    return min(facts.n_layer, max(0, -(-over // layer)))


# --- the floors (pure) ---------------------------------------------------------------------------

def decode_floor(facts: FileFacts, host_share: float, host_bytes_s: float, pcie_bytes_s: float | None,
                 card_bytes_s: float, depth: int = DEPTH) -> dict:
    """tok/s no decode can beat when host_share of the routed experts' reads come from host RAM:
    `host` where the host computes its experts (reading them at host_bytes_s), `split` where the
    card also streams a part of them over the copy link at the same time; the card reads the rest
    of the token (attention, head, its experts, the KV) at card_bytes_s."""
    if not 0 <= host_share <= 1:
        raise BenchError(f"host share {host_share} must be in [0, 1]")
    experts = facts.n_layer * facts.n_used * facts.expert_bytes
    host = host_share * experts
    card = facts.dense_token_bytes + (1 - host_share) * experts + facts.kv_bytes_per_pos * depth
    t_card = card / card_bytes_s
    out = {"host_bytes": int(host), "card_bytes": int(card),
           "host": 1 / max(t_card, host / host_bytes_s)}
    if pcie_bytes_s:
        out["split"] = 1 / max(t_card, host / (host_bytes_s + pcie_bytes_s))
    return out


def prompt_floor(facts: FileFacts, host_fraction: float, n_prompt: int, pcie_bytes_s: float | None,
                 card_bytes_s: float) -> dict:
    """tok/s no prompt of n_prompt ids can beat when host_fraction of the routed experts sit on
    the host and each is copied to the card once (a long prompt routes to every expert), while
    the card reads every weight once."""
    host = host_fraction * facts.n_layer * facts.n_expert * facts.expert_bytes
    t = facts.file_bytes / card_bytes_s
    if host and pcie_bytes_s:
        t = max(t, host / pcie_bytes_s)
    elif host:
        return {"host_bytes": int(host)}
    return {"host_bytes": int(host), "copy": n_prompt / t}


def host_fraction(budget: str, facts: FileFacts, ncmoe: int | None = None, card_fit: int | None = None,
                  card_host: int | None = None) -> float | None:
    """The share of the routed experts a budget leaves on the host: whole 0, host 1, ncmoe N/layers;
    fit from the card bytes it used over those of the host budget (the same engine and file, every
    expert on the host), None where either is unknown."""
    if budget == "whole":
        return 0.0
    if budget == "host":
        return 1.0
    if budget == "ncmoe":
        return None if ncmoe is None else min(ncmoe, facts.n_layer) / facts.n_layer
    if card_fit is None or card_host is None:
        return None
    experts = facts.n_layer * facts.n_expert * facts.expert_bytes
    return float(min(1.0, max(0.0, 1 - (card_fit - card_host) / experts)))


def residency_summary(body) -> dict:
    """GET /residency's JSON, reduced: the routing skew of its counts (per layer with host
    experts: a load with none counts nothing, and says so), hits, misses, moves."""
    layers = body.get("layers") if isinstance(body, dict) else None
    if not isinstance(layers, list):
        raise BenchError(f"GET /residency: no layers list in {str(body)[:200]}")
    counts = [ly.get("counts") or [] for ly in layers]
    hits = sum(int(ly.get("hits", 0)) for ly in layers)
    misses = sum(int(ly.get("misses", 0)) for ly in layers)
    out = {"offload": body.get("offload"), "residency": body.get("residency"), "layers": len(layers),
           "hits": hits, "misses": misses, "moved_experts": body.get("moved_experts"),
           "moved_bytes": body.get("moved_bytes"), "host_wait_s": body.get("host_wait_s")}
    slots = [len(ly.get("on_card") or []) for ly in layers]
    if any(sum(c) for c in counts):
        out["skew"] = routing_skew(counts)
        out["best_static"] = best_static_share(counts, slots)
    else:
        out["note"] = ("no host experts: /residency counts no routing, skew not measured" if body.get("offload") is False
                       else "no routing counted yet: skew not measured")
    out["_counts"], out["_slots"] = counts, slots            # for residency_delta; not written
    if hits + misses:
        out["host_share"] = misses / (hits + misses)
    return out


def residency_line(s: dict) -> str:
    """One line for people from residency_summary's dict (or its error)."""
    if "error" in s:
        return f"residency: {s['error']}"
    skew = f"skew {s['skew']:.3f} (the top fifth's share of the picks)" if "skew" in s else s["note"]
    if "best_static" in s:
        skew += f", the best fixed placement serves {100 * s['best_static']:.1f} % of them on the card"
    return (f"residency {s['residency']}: {skew}; {s['layers']} layers with host experts, hits {s['hits']}, "
            f"misses {s['misses']}, moved {s['moved_experts']} experts / {s['moved_bytes']} bytes")


def residency_delta(before: dict, after: dict, n_ids: int) -> dict:
    """What one cell cost the residency: residency_summary's counters after it less before it (hits, misses,
    experts and bytes moved, seconds waited on the host), and per id the cell generated or read (n_ids: its
    warm-up's and runs'), the host wait in ms and the misses; {} where either side has no counters."""
    keys = ("hits", "misses", "moved_experts", "moved_bytes", "host_wait_s")
    if any(not isinstance(d.get(k), (int, float)) for d in (before, after) for k in keys):
        return {}
    out = {k: after[k] - before[k] for k in keys}
    if n_ids > 0:
        out["host_wait_ms_per_id"] = 1e3 * out["host_wait_s"] / n_ids
        out["misses_per_id"] = out["misses"] / n_ids
    seen = out["hits"] + out["misses"]
    if seen:
        out["host_share"] = out["misses"] / seen
    a, b = before.get("_counts"), after.get("_counts")
    if a and b and len(a) == len(b) and all(len(x) == len(y) for x, y in zip(a, b)):
        cell = [[y - x for x, y in zip(ra, rb)] for ra, rb in zip(a, b)]
        if any(sum(r) for r in cell):
            out["best_static_host_share"] = 1 - best_static_share(cell, after["_slots"])
    return out


def public(s: dict) -> dict:
    """residency_summary's dict as written: without the counts it carries for residency_delta."""
    return {k: v for k, v in s.items() if not k.startswith("_")}


def delta_line(d: dict) -> str:
    if not d:
        return "residency in this cell: not counted"
    per = (f", {d['host_wait_ms_per_id']:.2f} ms a generated id waited on the host"
           if "host_wait_ms_per_id" in d else "")
    share = f", {100 * d['host_share']:.1f} % of the picks on the host" if "host_share" in d else ""
    if "best_static_host_share" in d:
        share += f" (the best fixed placement for these picks: {100 * d['best_static_host_share']:.1f} %)"
    return (f"residency in this cell: {d['host_wait_s']:.2f} s waited on the host{per}{share}; moved "
            f"{d['moved_experts']} experts / {d['moved_bytes'] / 1e9:.2f} GB")


# --- the JSON (pure but for the write) -----------------------------------------------------------

def write_json(path: Path, result: dict) -> None:
    """Whole or not at all: the new text goes to a side file, then takes the name."""
    part = path.with_name(path.name + ".part")
    part.write_text(json.dumps(result, indent=1, default=str))
    os.replace(part, path)


def load_json(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise BenchError(f"--out {path}: not JSON ({e}); move it away or pass --fresh") from None


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def median(xs: Sequence[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


# --- the machine's bandwidths (I/O) --------------------------------------------------------------

def host_read_bandwidth(threads: int | None = None, n_bytes: int = 2 << 30, repeats: int = 5) -> dict:
    """Bytes a second the host reads from RAM, two ways: the host expert kernel's own library (host_moe.c
    host_read_bw: `threads` threads sum 64-bit words with eight independent sums, the best of `repeats`),
    which sets the floors; and `threads` numpy float sums over slices of one buffer, which earlier runs
    reported (on the H200's host, in one call, numpy read 76.2 GB/s where the library read 120.0: numpy's float
    sums, not the memory, set its pace; session 25). Where the library cannot be built, numpy's alone."""
    threads = threads or os.cpu_count() or 1
    buf = np.ones(n_bytes // 8, np.float64)
    parts = np.array_split(buf, threads)
    times = []
    with ThreadPoolExecutor(threads) as ex:
        for _ in range(repeats + 1):
            t = time.perf_counter()
            list(ex.map(np.sum, parts))
            times.append(time.perf_counter() - t)
    del buf, parts
    numpy_bytes_s = n_bytes / min(times[1:])
    out = {"bytes_s": numpy_bytes_s, "numpy_bytes_s": numpy_bytes_s, "threads": threads, "buffer_bytes": n_bytes,
           "by": "numpy"}
    try:
        from bloomery.engine.cpu import host_moe
        gbs = host_moe.read_bandwidth_gbs(n_bytes, threads, repeats)
    except Exception as e:          # noqa: BLE001 (no compiler: the numpy figure stands, and says so)
        out["library_error"] = str(e)
        return out
    if gbs > 0:
        out.update(bytes_s=gbs * 1e9, by="host_moe.c host_read_bw")
    return out


def pinned_copy_bandwidth(n_bytes: int = 1 << 30, repeats: int = 6) -> float:
    """Host-to-card copy bytes a second from pinned memory (CuPy), the median after a first copy."""
    import cupy
    import cupyx
    src = cupyx.empty_pinned((n_bytes,), np.uint8)
    src[:] = 1
    dst = cupy.empty((n_bytes,), cupy.uint8)
    stream = cupy.cuda.Stream(non_blocking=True)
    times = []
    for _ in range(repeats + 1):
        e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
        e0.record(stream)
        dst.set(src, stream=stream)
        e1.record(stream)
        e1.synchronize()
        times.append(cupy.cuda.get_elapsed_time(e0, e1) / 1e3)
    del dst
    cupy.get_default_memory_pool().free_all_blocks()
    return n_bytes / statistics.median(times[1:])


def card_bandwidths_here() -> dict:
    out = {}
    try:
        out["pinned_h2d_bytes_s"] = pinned_copy_bandwidth()
    except Exception as e:
        out["pinned_h2d_error"] = f"{type(e).__name__}: {e}"
    try:
        out["card_bytes_s"] = copy_bandwidth()
    except Exception as e:
        out["card_bytes_s_error"] = f"{type(e).__name__}: {e}"
    return out


def card_bandwidths() -> dict:
    """card_bandwidths_here in a child process, so this one holds no CUDA context (and no card
    memory) while the servers load: -fitt and the plans see the card as they would alone."""
    code = "import json, bench_offload; print(json.dumps(bench_offload.card_bandwidths_here()))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
                           str(REPO / "tools"), str(REPO), os.environ.get("PYTHONPATH")]))})
    try:
        return json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        err = f"the measuring process failed ({r.returncode}): {r.stderr[-300:]}"
        return {"pinned_h2d_error": err, "card_bytes_s_error": err}


def card_total_bytes() -> int:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    return int(out.split()[0]) * MIB


def measure_machine(card_total_mib: int | None, threads: int | None) -> dict:
    """The bandwidths and the card's size; a part that cannot be measured here says why."""
    m: dict = {"host_read": host_read_bandwidth(threads)}
    print(f"host memory read: {m['host_read']['bytes_s'] / 1e9:.1f} GB/s ({m['host_read']['threads']} threads, "
          f"{m['host_read']['by']}; numpy's float sums {m['host_read']['numpy_bytes_s'] / 1e9:.1f})", flush=True)
    m.update(card_bandwidths())
    if "pinned_h2d_bytes_s" in m:
        print(f"pinned host-to-card copy: {m['pinned_h2d_bytes_s'] / 1e9:.1f} GB/s", flush=True)
    else:                           # no CuPy or no card: the split floor is left out
        print(f"pinned host-to-card copy: not measured ({m['pinned_h2d_error']})", flush=True)
    if "card_bytes_s" in m:
        print(f"card copy: {m['card_bytes_s'] / 1e12:.2f} TB/s", flush=True)
    else:
        print(f"card copy: not measured ({m['card_bytes_s_error']}); floors use the H200's nominal "
              f"{H200_BYTES_S / 1e12:.1f} TB/s", flush=True)
    if card_total_mib:
        m["card_total_bytes"], m["card_total_from"] = card_total_mib * MIB, "--card-total-mib"
    else:
        try:
            m["card_total_bytes"], m["card_total_from"] = card_total_bytes(), "nvidia-smi"
        except (OSError, subprocess.SubprocessError, ValueError) as e:
            m["card_total_error"] = f"{type(e).__name__}: {e}"
    return m


def card_used() -> int | None:
    try:
        return card_used_bytes()
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


class CardWatch:
    """PeakMemory where nvidia-smi answers; nothing (used None) where it does not."""

    def __enter__(self):
        self.mem = PeakMemory().__enter__() if card_used() is not None else None
        return self

    def __exit__(self, *exc):
        if self.mem is not None:
            self.mem.__exit__(*exc)

    @property
    def used(self) -> int | None:
        return None if self.mem is None else self.mem.used


# --- running the cells (I/O) ---------------------------------------------------------------------

def prompt_ids(n: int, seed: int = 0) -> list[int]:
    """Random ids below the special tokens of the Qwen vocabularies, the same for both engines."""
    return [int(i) for i in np.random.default_rng(seed).integers(100, 150000, n)]


def request(test: str, ids: list[int], sampled: bool, depth: int = DEPTH) -> dict:
    body = {"cache_prompt": False, "return_tokens": True, "temperature": 0}
    if sampled:
        body.update(temperature=1.0, seed=1)
    if test.startswith("tg"):
        return {**body, "prompt": ids[:depth], "n_predict": int(test[2:]), "ignore_eos": True}
    return {**body, "prompt": ids[:int(test[2:])], "n_predict": 1}


def run_test(srv: Server, test: str, ids: list[int], sampled: bool, runs: int = RUNS, depth: int = DEPTH) -> dict:
    """One warm-up, then `runs` requests: the server's timings and the client's clock, medians."""
    body = request(test, ids, sampled, depth)
    srv.stream(body)
    rows = []
    for _ in range(runs):
        s = srv.stream(body)
        t = s.final.get("timings") or {}
        rows.append({"server_prompt_tok_s": t.get("prompt_per_second"), "server_decode_tok_s": t.get("predicted_per_second"),
                     "prompt_n": t.get("prompt_n"), "predicted_n": t.get("predicted_n"),
                     "client_prompt_s": s.prompt_s, "client_decode_tok_s": s.decode_tok_s,
                     "n_ids": len(s.ids), "n_pieces": s.n_pieces, "distinct_ids": len(set(s.ids))})
    n_prompt = len(body["prompt"])
    out = {"runs": rows, "n_prompt": n_prompt}
    if test.startswith("tg"):
        out["server"] = median([r["server_decode_tok_s"] for r in rows])
        out["client"] = median([r["client_decode_tok_s"] for r in rows])
    else:
        out["server"] = median([r["server_prompt_tok_s"] for r in rows])
        out["client"] = median([n_prompt / r["client_prompt_s"] for r in rows if r["client_prompt_s"]])
    out["value"] = out["server"] if out["server"] is not None else out["client"]
    return out


def server_argv(engine: str, a, path: str, port: int, flags: list[str]) -> list[str]:
    common = ["-m", path, "--port", str(port), "-c", str(a.ctx_size), "-np", "1", *flags]
    if a.threads:
        common += ["-t", str(a.threads)]
    if engine == "llama":
        return [a.llama_server, *common, "-fa", "on"]
    return [sys.executable, "-m", "bloomery.supervisor", *common, "--backend", a.backend]


class Bench:
    def __init__(self, a, models: dict[str, str]):
        self.a, self.models = a, models
        self.out = Path(a.out)
        self.result = {} if a.fresh else load_json(self.out)
        self.result.setdefault("cells", {})
        self.result.setdefault("groups", {})
        self.result.setdefault("ncmoe_search", {})
        self.result["models"] = {k: {"path": v} for k, v in models.items()}
        self.ids = prompt_ids(max(list(a.prompts or PROMPTS) + [a.depth]))
        self.facts = {}
        for name, path in models.items():
            from bloomery.gguf_file import open_gguf
            with open_gguf(path) as gf:
                self.facts[name] = file_facts(gf)
            self.result["models"][name]["facts"] = asdict(self.facts[name])

    def save(self) -> None:
        self.result["floors"] = self.floors()
        write_json(self.out, self.result)

    def done(self, cell: Cell) -> bool:
        return self.result["cells"].get(cell.name, {}).get("value") is not None

    def budget_bytes(self) -> int:
        return int(self.a.usable_gb * 1e9)

    def fitt(self) -> int | None:
        total = self.result["machine"].get("card_total_bytes")
        return None if total is None else fit_target_mib(total, self.budget_bytes())

    def ncmoe_for(self, model: str) -> int | None:
        if self.a.ncmoe is not None:
            return self.a.ncmoe
        got = self.result["ncmoe_search"].get(model, {}).get("chosen")
        if got is not None:
            return got
        if card_used() is None:
            self.result["ncmoe_search"][model] = {"error": "no card to search on (nvidia-smi): pass --ncmoe N"}
            return None
        facts, budget = self.facts[model], self.budget_bytes()

        def probe(n: int) -> int:
            port = free_port()
            with CardWatch() as w:
                with Server(server_argv("llama", self.a, self.models[model], port, engine_flags("llama", "ncmoe", ncmoe=n)),
                            port, self.log(f"{model}-ncmoe-probe-{n}"), self.a.ready_timeout_s):
                    time.sleep(1.0)
            print(f"  -ncmoe {n}: card {w.used / 1e9:.2f} GB (budget {budget / 1e9:.2f})", flush=True)
            return w.used
        print(f"{model}: searching llama-server's -ncmoe for {budget / 1e9:.1f} GB", flush=True)
        chosen, probes = search_ncmoe(probe, facts.n_layer, budget, ncmoe_start(facts, budget))
        self.result["ncmoe_search"][model] = {"budget_bytes": budget, "probes": probes, "chosen": chosen}
        self.save()
        return chosen

    def log(self, name: str) -> Path:
        d = self.out.parent / "logs"
        d.mkdir(parents=True, exist_ok=True)
        return d / f"{name}.log"

    def run(self, cells: list[Cell]) -> None:
        if "machine" not in self.result or self.a.remeasure:
            self.result["machine"] = measure_machine(self.a.card_total_mib, self.a.host_threads)
            self.save()
        groups: dict[tuple[str, str, str], list[Cell]] = {}
        for c in cells:
            if not self.done(c):
                groups.setdefault((c.model, c.engine, c.budget), []).append(c)
        for c in cells:
            if self.done(c):
                print(f"{c.name}: in {self.out} already ({fmt(self.result['cells'][c.name]['value'])} tok/s)", flush=True)
        for (model, engine, budget), todo in groups.items():
            self.run_group(model, engine, budget, todo)

    def run_group(self, model: str, engine: str, budget: str, todo: list[Cell]) -> None:
        key = f"{model}/{engine}/{budget}"
        group = self.result["groups"].setdefault(key, {})
        try:
            ncmoe = self.ncmoe_for(model) if budget == "ncmoe" else None
            flags = engine_flags(engine, budget, self.fitt() if budget == "fit" else None, ncmoe)
        except BenchError as e:
            for c in todo:
                self.result["cells"][c.name] = {"error": str(e)}
            print(f"{key}: {e}", flush=True)
            self.save()
            return
        group["flags"] = flags
        port = free_port()
        argv = server_argv(engine, self.a, self.models[model], port, flags)
        group["command"] = " ".join(argv)
        print(f"{key}: {group['command']}", flush=True)
        try:
            with CardWatch() as w:
                t0 = time.perf_counter()
                with Server(argv, port, self.log(key.replace("/", "-")), self.a.ready_timeout_s) as srv:
                    group["ready_s"] = time.perf_counter() - t0
                    for c in todo:
                        t = time.perf_counter()
                        before = self.residency(srv, quiet=True) if engine == "bloomery" else {}
                        r = run_test(srv, c.test, self.ids, self.a.sampled, self.a.runs, self.a.depth)
                        r["wall_s"] = time.perf_counter() - t
                        self.result["cells"][c.name] = r
                        extra = f", {r['runs'][0]['distinct_ids']} distinct ids" if c.test.startswith("tg") else ""
                        print(f"{c.name}: {fmt(r['value'])} tok/s (server {fmt(r['server'])}, client "
                              f"{fmt(r['client'])}{extra})", flush=True)
                        if engine == "bloomery":     # where this cell's time went on the host side
                            n_ids = (self.a.runs + 1) * sum(int(x.get("predicted_n" if c.test.startswith("tg")
                                                                      else "prompt_n") or 0) for x in r["runs"][:1])
                            r["residency"] = residency_delta(before, self.residency(srv, quiet=True), n_ids)
                            print(f"  {delta_line(r['residency'])}", flush=True)
                        self.save()
                    if engine == "bloomery":
                        group["residency"] = public(self.residency(srv))
            group["card_bytes"] = w.used
        except SystemExit as e:     # a server that refused or died: its message, kept per cell
            for c in todo:
                self.result["cells"].setdefault(c.name, {})
                if self.result["cells"][c.name].get("value") is None:
                    self.result["cells"][c.name] = {"error": str(e)}
            print(f"{key}: {e}", flush=True)
        self.save()

    def residency(self, srv: Server, quiet: bool = False) -> dict:
        status, body = srv.get_json("/residency")
        if status != 200:
            msg = f"GET /residency answered {status or 'nothing'}: routing skew not measured"
            if not quiet:
                print(f"  {msg}", flush=True)
            return {"error": msg}
        try:
            s = residency_summary(body)
        except BenchError as e:
            if not quiet:
                print(f"  {e}", flush=True)
            return {"error": str(e)}
        if not quiet:
            print(f"  {residency_line(s)}", flush=True)
        return s

    def floors(self) -> dict:
        """The floor beside each measured cell, from the machine's bandwidths."""
        m = self.result.get("machine") or {}
        host_bw = (m.get("host_read") or {}).get("bytes_s")
        if not host_bw:
            return {}
        card_bw, pcie = m.get("card_bytes_s") or H200_BYTES_S, m.get("pinned_h2d_bytes_s")
        if self.a.backend == "cpu":             # no card: what the floors call the card is the host too
            card_bw, pcie = host_bw, None
        out = {}
        for name in self.result["cells"]:
            model, engine, budget, test = name.split("/")
            facts = self.facts.get(model)
            if facts is None or not facts.n_expert:
                continue
            groups = self.result["groups"]
            frac = host_fraction(budget, facts, self.result["ncmoe_search"].get(model, {}).get("chosen")
                                 if self.a.ncmoe is None else self.a.ncmoe,
                                 groups.get(f"{model}/{engine}/fit", {}).get("card_bytes"),
                                 groups.get(f"{model}/{engine}/host", {}).get("card_bytes"))
            if frac is None:
                out[name] = {"note": "host share unknown (the fit floor needs the host cell's card bytes)"}
                continue
            if test.startswith("tg"):
                share = (groups.get(f"{model}/{engine}/{budget}", {}).get("residency") or {}).get("host_share", frac)
                out[name] = {"host_share": share, **decode_floor(facts, share, host_bw, pcie, card_bw, self.a.depth)}
            else:
                out[name] = {"host_fraction": frac, **prompt_floor(facts, frac, int(test[2:]), pcie, card_bw)}
        return out


def print_table(result: dict) -> None:
    cells, floors, groups = result.get("cells", {}), result.get("floors", {}), result.get("groups", {})
    m = result.get("machine", {})
    def rate(key: str, unit: float, name: str) -> str:
        v = m.get(key)
        return f"{v / unit:.2f} {name}" if v else "not measured"
    host = (m.get("host_read") or {}).get("bytes_s")
    by = (m.get("host_read") or {}).get("by", "numpy")
    print(f"\nhost read {host / 1e9 if host else 0:.1f} GB/s ({by}), pinned copy {rate('pinned_h2d_bytes_s', 1e9, 'GB/s')}, "
          f"card copy {rate('card_bytes_s', 1e12, 'TB/s')}; floors: decode 'split' (the card streams a share of the host "
          f"experts while the host computes the rest) else 'host', prompt 'copy' (every host expert copied once)")
    rows = sorted({n.rsplit("/", 1)[0] for n in cells})
    tests = sorted({n.rsplit("/", 1)[1] for n in cells}, key=lambda t: (t[:2] != "tg", int(t[2:])))
    print(f"{'model/engine/budget':<28}{'card GB':>8}" + "".join(f"{t:>22}" for t in tests))
    for row in rows:
        card = groups.get(row, {}).get("card_bytes")
        line = f"{row:<28}{(f'{card / 1e9:.2f}' if card is not None else '-'):>8}"
        for t in tests:
            c, f = cells.get(f"{row}/{t}", {}), floors.get(f"{row}/{t}", {})
            v = c.get("value")
            fl = f.get("split", f.get("host", f.get("copy")))
            cell = ("error" if "error" in c else "-") if v is None else f"{v:.1f}"
            line += f"{cell + (f' (floor {fl:.0f})' if fl else ''):>22}"
        print(line)
        res = groups.get(row, {}).get("residency")
        if res:
            print(f"{'':<4}{residency_line(res)}")
    for name, c in cells.items():
        if "error" in c:
            print(f"{name}: {c['error'][:300]}")


def parse_models(specs: Sequence[str]) -> dict[str, str]:
    out = {}
    for s in specs:
        name, sep, path = s.partition("=")
        if not sep or not name or not path or "/" in name:
            raise BenchError(f"--model {s!r}: spell it NAME=PATH (a NAME without '/')")
        if not Path(path).is_file():
            raise BenchError(f"--model {s!r}: no file at {path}")
        if name in out:
            raise BenchError(f"--model: {name!r} given twice")
        out[name] = path
    return out


def parse_args(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[2:]))
    ap.add_argument("--model", action="append", default=[], metavar="NAME=PATH", help="a GGUF to run (repeat)")
    ap.add_argument("--engines", default="bloomery,llama", help="comma list of bloomery, llama")
    ap.add_argument("--cells", default="", help="comma list of patterns over model/engine/budget/test or budget/test "
                                              "(fnmatch: '*/fit/*', 'host/tg128'); default every cell")
    ap.add_argument("--llama-server", default=None, metavar="PATH", help="llama-server binary (for --engines llama)")
    ap.add_argument("--out", required=True, help="the JSON, rewritten after every cell; cells it holds are skipped")
    ap.add_argument("--fresh", action="store_true", help="start --out afresh instead of going on from it")
    ap.add_argument("--usable-gb", type=float, default=USABLE_GB, help="the fit budget: GB of the card left usable")
    ap.add_argument("--card-total-mib", type=int, default=None, help="the card's size, where nvidia-smi cannot say")
    ap.add_argument("--ncmoe", type=int, default=None, help="llama-server's -ncmoe for the ncmoe budget (no search)")
    ap.add_argument("--backend", default="cuda", choices=("auto", "cpu", "cuda"), help="bloomery-serve's --backend")
    ap.add_argument("--threads", type=int, default=None, help="-t for both servers (default: each its own)")
    ap.add_argument("--host-threads", type=int, default=None, help="threads of the host bandwidth read (default all)")
    ap.add_argument("--ctx-size", type=int, default=8192)
    ap.add_argument("--prompts", default=None, help="prompt sizes of the pp cells (default 512,4096)")
    ap.add_argument("--n-gen", type=int, default=N_GEN, help="ids the decode cell generates")
    ap.add_argument("--depth", type=int, default=DEPTH, help="the decode cell's prompt length")
    ap.add_argument("--runs", type=int, default=RUNS, help="timed requests a cell (after one warm-up)")
    ap.add_argument("--sampled", action="store_true", help="decode at temperature 1 (seed 1) instead of greedy")
    ap.add_argument("--remeasure", action="store_true", help="measure the bandwidths again though --out holds them")
    ap.add_argument("--ready-timeout-s", type=float, default=900)
    a = ap.parse_args(argv)
    try:
        a.models = parse_models(a.model)
        a.engine_list = [e for e in a.engines.split(",") if e]
        a.prompts = [int(p) for p in a.prompts.split(",")] if a.prompts else None
        a.tests = cell_tests(a.prompts or PROMPTS, a.n_gen)
        a.cell_list = cell_list(list(a.models), a.engine_list, a.tests, [p for p in a.cells.split(",") if p])
        if "llama" in a.engine_list and not (a.llama_server and os.access(a.llama_server, os.X_OK)):
            raise BenchError(f"--engines llama needs --llama-server PATH (an executable), got {a.llama_server!r}")
        if a.ncmoe is not None and a.ncmoe < 0:
            raise BenchError(f"--ncmoe {a.ncmoe} must be >= 0")
        if min(a.prompts or PROMPTS) < 1 or a.n_gen < 2 or a.runs < 1:
            raise BenchError("--prompts, --n-gen (>= 2) and --runs must be positive")
        if a.depth < 1:
            raise BenchError(f"--depth {a.depth} must be >= 1")
        if max((a.prompts or list(PROMPTS)) + [a.depth]) + a.n_gen > a.ctx_size:
            raise BenchError(f"--ctx-size {a.ctx_size} is below the longest prompt plus --n-gen")
    except (BenchError, ValueError) as e:
        ap.error(str(e))
    return a


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    bench = Bench(a, a.models)
    bench.run(a.cell_list)
    print_table(bench.result)


if __name__ == "__main__":
    main()
