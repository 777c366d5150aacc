#!/usr/bin/env python3
"""Serving many at once: K concurrent streamed clients against bloomery-serve and llama-server.

Each engine in turn on the same GGUF, through HTTP, with the same requests (streamed /completion,
greedy, the same random prompt ids). The cells (name: engine/test):

  k{K}/p{P}      K clients at once (the server started with -np K), each a different P-id prompt,
                 cache_prompt false, n_predict --n-gen (ignore_eos); one warm-up round, then --runs
                 rounds. Per round: the aggregate decode rate (every stream's ids after its first,
                 over the time from the first stream's first id to the last stream's last), the
                 per-stream decode rate (each stream's ids after the first over its own first-to-last
                 time, the median stream) and the time to first token of every request; the cell
                 reports the median round and the TTFT p50 and p99 over every request of its rounds.
  replay/cram0   a multi-turn replay: --users users sharing a --system-ids system prompt, each turn
  replay/cram    a --user-ids message after the user's earlier messages and the replies the server
                 gave them (--n-gen ids each), the users' turns interleaved (turn 0 of every user, then turn 1, ...), one request
                 at a time, cache_prompt true, -np --replay-np; run once with --cache-ram 0 and once
                 with the server's default prompt cache. Reports the median time to first token of
                 every turn and of the turns after the first (where a user's own history helps), and
                 the ids the server took from its caches (timings.cache_n).

The JSON (--out) is rewritten after every cell; a rerun with the same --out skips the cells it holds,
so each call of a cut run keeps what it measured and the next goes on (--cells picks a part).

  # on the card (tools/make_synthetic.py --shape qwen3-30b-a3b -o /tmp/bench/30b.gguf), in calls
  # under 10 minutes, e.g. one engine's K cells, then the other's, then the replays:
  python3 tools/bench_serve.py --model /tmp/bench/30b.gguf --llama-server <build>/bin/llama-server \\
      --out /tmp/bench/serve.json --cells 'bloomery/k*'
  # anywhere: the HTTP path on the CPU backend with a tiny file
  python3 tools/bench_serve.py --model /tmp/t.gguf --backend cpu --engines bloomery --ks 1,4 \\
      --prompts 64 --n-gen 16 --system-ids 256 --out /tmp/serve.json
"""
from __future__ import annotations

import argparse
import fnmatch
import math
import os
import shlex
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))
from bench_http import Server, Streamed, free_port  # noqa: E402
from bench_offload import BenchError, fmt, load_json, median, write_json  # noqa: E402

ENGINES = ("bloomery", "llama")
KS = (1, 4, 8, 16)
PROMPTS = (512, 4096)
N_GEN = 128
RUNS = 3
REPLAYS = ("cram0", "cram")            # --cache-ram 0, the default cache
USERS, SYSTEM_IDS, USER_IDS, TURNS, REPLAY_NP = 8, 4000, 128, 4, 1


# --- pure parts ----------------------------------------------------------------------------------

def percentile(xs: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) of xs, linear between the closest ranks (numpy's default)."""
    vals = sorted(x for x in xs if x is not None)
    if not vals:
        return None
    if not 0 <= q <= 100:
        raise BenchError(f"percentile {q} is not in 0..100")
    pos = (len(vals) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(vals) - 1)
    return vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)


@dataclass(frozen=True)
class Cell:
    engine: str
    test: str              # k{K}/p{P} or replay/{cram0|cram}

    @property
    def name(self) -> str:
        return f"{self.engine}/{self.test}"

    @property
    def group(self) -> str:
        """Cells of a group share one server start: k cells by K, each replay alone."""
        return f"{self.engine}/{self.test.split('/')[0] if self.test.startswith('k') else self.test}"

    @property
    def k(self) -> int:
        return int(self.test.split("/")[0][1:]) if self.test.startswith("k") else 0

    @property
    def p(self) -> int:
        return int(self.test.split("/")[1][1:]) if self.test.startswith("k") else 0


def cell_list(engines: Sequence[str], ks: Sequence[int] = KS, prompts: Sequence[int] = PROMPTS,
              patterns: Sequence[str] = (), replay: bool = True) -> list[Cell]:
    """Every cell in run order (engine, then K and P, then the replays), kept where a pattern
    (fnmatch) matches its name (engine/test) or its test; no pattern keeps all."""
    for e in engines:
        if e not in ENGINES:
            raise BenchError(f"--engines: {e!r} is not one of {', '.join(ENGINES)}")
    if not engines:
        raise BenchError("--engines: at least one engine")
    if not ks or min(ks) < 1 or not prompts or min(prompts) < 1:
        raise BenchError(f"--ks {list(ks)} and --prompts {list(prompts)} must be positive counts")
    tests = [f"k{k}/p{p}" for k in ks for p in prompts] + ([f"replay/{r}" for r in REPLAYS] if replay else [])
    out = [Cell(e, t) for e in engines for t in tests]
    if patterns:
        out = [c for c in out if any(fnmatch.fnmatchcase(c.name, p) or fnmatch.fnmatchcase(c.test, p)
                                     for p in patterns)]
    if not out:
        raise BenchError(f"--cells {','.join(patterns)}: no cell matches (names are engine/test: "
                         f"{', '.join(tests)})")
    return out


def replay_schedule(users: int, turns: int, system_ids: int, user_ids: int, seed: int = 1,
                    own: bool = False) -> tuple[list[list[int]], list[tuple[int, int, list[int]]]]:
    """The replay: each user's system ids (one list shared by all; own: a document of each user's own, so
    no user's prompt shares a prefix with another's), and its requests in order as (user, turn, the
    message's ids); the turns interleave, turn 0 of every user, then turn 1, ... . A turn's prompt is
    the user's system ids, then the user's earlier messages each followed by the reply the server gave
    it (replay_prompt), then the message."""
    if min(users, turns, system_ids, user_ids) < 1:
        raise BenchError(f"the replay needs users, turns, system and user ids >= 1 (got {users}, {turns}, "
                         f"{system_ids}, {user_ids})")
    rng = np.random.default_rng(seed)
    draw = lambda n: [int(i) for i in rng.integers(100, 150000, n)]   # noqa: E731
    shared = draw(system_ids)
    systems = [draw(system_ids) for _ in range(users)] if own else [shared] * users
    return systems, [(u, turn, draw(user_ids)) for turn in range(turns) for u in range(users)]


def replay_prompt(system: list[int], history: Sequence[tuple[list[int], list[int]]], message: list[int]) -> list[int]:
    """A turn's prompt: the system ids, each earlier (message, reply), the new message."""
    out = list(system)
    for m, r in history:
        out += m + r
    return out + list(message)


def replay_longest(system_ids: int, turns: int, user_ids: int, n_gen: int) -> int:
    """The longest prompt of the replay: the last turn's, after turns-1 messages and replies."""
    return system_ids + turns * user_ids + (turns - 1) * n_gen


def slot_ctx(cells: Sequence[Cell], n_gen: int, replay_ids: int) -> int:
    """The context a slot needs for the group's cells: the longest prompt and the ids generated,
    rounded up to 256."""
    need = max(c.p if c.k else replay_ids for c in cells) + n_gen + 1
    return -(-need // 256) * 256


def round_stats(streams: Sequence[Streamed]) -> dict:
    """One round of concurrent streams: the aggregate decode rate, the median stream's, the TTFTs."""
    decoded = [s for s in streams if s.t_first is not None and s.t_last is not None]
    n_after_first = sum(max(len(s.ids) - 1, 0) for s in decoded)
    window = (max(s.t_last for s in decoded) - min(s.t_first for s in decoded)) if decoded else 0.0
    return {"aggregate_decode_tok_s": n_after_first / window if window > 0 else None,
            "stream_decode_tok_s": median([s.decode_tok_s for s in streams]),
            "server_decode_tok_s": median([(s.final.get("timings") or {}).get("predicted_per_second")
                                           for s in streams]),
            "ttft_s": [s.prompt_s for s in streams],
            "n_ids": [len(s.ids) for s in streams],
            "wall_s": max((s.t_last or s.t_sent) for s in streams) - min(s.t_sent for s in streams)}


def cell_summary(rounds: Sequence[dict]) -> dict:
    ttft = [t for r in rounds for t in r["ttft_s"]]
    return {"rounds": list(rounds),
            "aggregate_decode_tok_s": median([r["aggregate_decode_tok_s"] for r in rounds]),
            "stream_decode_tok_s": median([r["stream_decode_tok_s"] for r in rounds]),
            "server_decode_tok_s": median([r["server_decode_tok_s"] for r in rounds]),
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99)}


def replay_summary(turns: Sequence[dict]) -> dict:
    return {"turns": list(turns),
            "ttft_median_s": median([t["ttft_s"] for t in turns]),
            "ttft_median_later_s": median([t["ttft_s"] for t in turns if t["turn"] > 0]),
            "cache_n_median": median([t["cache_n"] for t in turns if t["turn"] > 0]),
            # the server's own split of a later turn: its prompt pass and the prompt cache's work before it
            "prompt_ms_median_later": median([t["prompt_ms"] for t in turns
                                              if t["turn"] > 0 and t.get("prompt_ms") is not None]),
            "cache_ms_median_later": median([t["cache_ms"] for t in turns
                                             if t["turn"] > 0 and t.get("cache_ms") is not None])}


# --- running (I/O) -------------------------------------------------------------------------------

def body(ids: list[int], n_gen: int, cache_prompt: bool) -> dict:
    return {"prompt": ids, "n_predict": n_gen, "ignore_eos": True, "temperature": 0, "return_tokens": True,
            "cache_prompt": cache_prompt}


def own_metrics(url: str) -> dict[str, float]:
    """bloomery's own counters on /metrics (bloomery:*_total; llama-server has none: {})."""
    import urllib.request
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return {}
    return {ln.split()[0].removeprefix("bloomery:"): float(ln.split()[1]) for ln in text.splitlines()
            if ln.startswith("bloomery:") and ln.split()[0].endswith("_total")}


def concurrent_round(srv: Server, bodies: Sequence[dict]) -> list[Streamed]:
    """Every body streamed at once, one client thread each, released together."""
    gate = threading.Barrier(len(bodies))

    def one(b: dict) -> Streamed:
        gate.wait()
        return srv.stream(b)
    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(one, bodies))


class Bench:
    def __init__(self, a):
        self.a = a
        self.out = Path(a.out)
        self.result = {} if a.fresh else load_json(self.out)
        self.result.setdefault("cells", {})
        self.result.setdefault("groups", {})
        self.result["model"] = a.model
        self.systems, self.schedule = replay_schedule(a.users, a.turns, a.system_ids, a.user_ids,
                                                      own=a.replay_own_documents)
        self.replay_ids = replay_longest(a.system_ids, a.turns, a.user_ids, a.n_gen)

    def done(self, c: Cell) -> bool:
        got = self.result["cells"].get(c.name, {})
        return "error" not in got and bool(got)

    def log(self, name: str) -> Path:
        d = self.out.parent / "logs"
        d.mkdir(parents=True, exist_ok=True)
        return d / f"{name.replace('/', '-')}.log"

    def argv(self, engine: str, port: int, n_par: int, ctx: int, cram0: bool) -> list[str]:
        common = ["-m", self.a.model, "--port", str(port), "-c", str(ctx * n_par), "-np", str(n_par), "--metrics"]
        if self.a.threads:
            common += ["-t", str(self.a.threads)]
        if cram0:
            common += ["--cache-ram", "0"]
        if engine == "llama":
            dev = ["-ngl", "99"] if self.a.backend == "cuda" else ["-ngl", "0"]
            return [self.a.llama_server, *common, *dev, "-fa", "on", *shlex.split(self.a.llama_args)]
        return [sys.executable, "-m", "bloomery.supervisor", *common, "--backend", self.a.backend,
                *shlex.split(self.a.bloomery_args)]

    def run(self, cells: list[Cell]) -> None:
        groups: dict[str, list[Cell]] = {}
        for c in cells:
            if self.done(c):
                print(f"{c.name}: in {self.out} already", flush=True)
            else:
                groups.setdefault(c.group, []).append(c)
        for key, todo in groups.items():
            self.run_group(key, todo)

    def run_group(self, key: str, todo: list[Cell]) -> None:
        engine, replay = todo[0].engine, not todo[0].k
        n_par = self.a.replay_np if replay else todo[0].k
        ctx = slot_ctx(todo, self.a.n_gen, self.replay_ids)
        port = free_port()
        argv = self.argv(engine, port, n_par, ctx, cram0=replay and todo[0].test.endswith("cram0"))
        group = self.result["groups"].setdefault(key, {})
        group["command"] = " ".join(argv)
        print(f"{key}: {group['command']}", flush=True)
        try:
            t0 = time.perf_counter()
            with Server(argv, port, self.log(key), self.a.ready_timeout_s) as srv:
                group["ready_s"] = time.perf_counter() - t0
                for c in todo:
                    t = time.perf_counter()
                    before = own_metrics(srv.url)
                    r = self.replay(srv) if replay else self.concurrent(srv, c)
                    r["wall_s"] = time.perf_counter() - t
                    after = own_metrics(srv.url)
                    if after:                # bloomery's: how its decode steps went in this cell
                        r["steps"] = {k: v - before.get(k, 0.0) for k, v in after.items()}
                    self.result["cells"][c.name] = r
                    print(f"{c.name}: {cell_line(r)}", flush=True)
                    write_json(self.out, self.result)
        except SystemExit as e:      # a server that refused or died: its message, kept per cell
            for c in todo:
                if not self.done(c):
                    self.result["cells"][c.name] = {"error": str(e)}
            print(f"{key}: {e}", flush=True)
        write_json(self.out, self.result)

    def concurrent(self, srv: Server, c: Cell) -> dict:
        rng = np.random.default_rng(c.p)
        prompts = [[int(i) for i in rng.integers(100, 150000, c.p)] for _ in range(c.k * (self.a.runs + 1))]
        bodies = [body(p, self.a.n_gen, cache_prompt=False) for p in prompts]
        concurrent_round(srv, bodies[:c.k])                                       # the warm-up round
        rounds = [round_stats(concurrent_round(srv, bodies[c.k * (i + 1):c.k * (i + 2)])) for i in range(self.a.runs)]
        return {"k": c.k, "p": c.p, "n_gen": self.a.n_gen, **cell_summary(rounds)}

    def replay(self, srv: Server) -> dict:
        srv.stream(body(self.systems[0][:16], 2, cache_prompt=False))            # the first request's own costs
        turns, history = [], {}
        for user, turn, message in self.schedule:
            ids = replay_prompt(self.systems[user], history.get(user, []), message)
            s = srv.stream(body(ids, self.a.n_gen, cache_prompt=True))
            history.setdefault(user, []).append((message, s.ids))                # the reply it gave, as a chat goes on
            t = s.final.get("timings") or {}
            turns.append({"user": user, "turn": turn, "n_prompt": len(ids), "ttft_s": s.prompt_s,
                          "cache_n": t.get("cache_n"), "prompt_n": t.get("prompt_n"),
                          "prompt_ms": t.get("prompt_ms"), "cache_ms": t.get("cache_ms")})
        return {"users": self.a.users, "turns_each": self.a.turns, "system_ids": self.a.system_ids,
                "own_documents": self.a.replay_own_documents, "n_par": self.a.replay_np, **replay_summary(turns)}


def passes(r: dict) -> str:
    """bloomery's prompt passes in the cell, and how many were replayed from a captured graph."""
    st = r.get("steps") or {}
    if "prompt_passes_total" not in st:
        return "prompt passes -"
    return f"{st['prompt_passes_total']:.0f} prompt passes, {st.get('prompt_passes_captured_total', 0):.0f} captured"


def cell_line(r: dict) -> str:
    if "error" in r:
        return f"error: {r['error'][:300]}"
    if "turns" in r:
        return (f"median TTFT {fmt_s(r['ttft_median_s'])} (turns after the first {fmt_s(r['ttft_median_later_s'])}, "
                f"cache_n {fmt(r['cache_n_median'])}; server prompt_ms {fmt(r.get('prompt_ms_median_later'))}, "
                f"cache_ms {fmt(r.get('cache_ms_median_later'))}; {passes(r)})")
    st = r.get("steps") or {}
    steps = (f"; {st['decode_steps_total']:.0f} decode steps, {st.get('decode_steps_ahead_total', 0):.0f} launched "
             f"ahead ({st.get('decode_steps_ahead_dropped_total', 0):.0f} dropped, "
             f"{st.get('decode_steps_chained_total', 0):.0f} chained), "
             f"{st.get('decode_steps_top_total', 0):.0f} from the largest logits") if st.get("decode_steps_total") else ""
    return (f"aggregate {fmt(r['aggregate_decode_tok_s'])} tok/s, per stream {fmt(r['stream_decode_tok_s'])}, "
            f"TTFT p50 {fmt_s(r['ttft_p50_s'])} p99 {fmt_s(r['ttft_p99_s'])}{steps}")


def fmt_s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f} s"


def print_table(result: dict) -> None:
    cells = result.get("cells", {})
    def order(t: str):
        return (1, [REPLAYS.index(t.split("/")[1])]) if t.startswith("replay") else (0, [int(x[1:]) for x in t.split("/")])
    tests = sorted({n.split("/", 1)[1] for n in cells}, key=order)
    engines = [e for e in ENGINES if any(n.startswith(e + "/") for n in cells)]
    print(f"\n{'cell':<16}" + "".join(f"{e + ' agg':>14}{'stream':>9}{'ttft50':>9}{'ttft99':>9}" for e in engines)
          + ("  agg b/l" if len(engines) == 2 else ""))
    for t in [t for t in tests if t.startswith("k")]:
        line, agg = f"{t:<16}", []
        for e in engines:
            r = cells.get(f"{e}/{t}", {})
            agg.append(r.get("aggregate_decode_tok_s"))
            line += (f"{fmt(r.get('aggregate_decode_tok_s')):>14}{fmt(r.get('stream_decode_tok_s')):>9}"
                     f"{fmt3(r.get('ttft_p50_s')):>9}{fmt3(r.get('ttft_p99_s')):>9}")
        if len(engines) == 2 and all(agg):
            line += f"{agg[0] / agg[1]:>9.2f}"
        print(line)
    for t in [t for t in tests if t.startswith("replay")]:
        line = f"{t:<16}"
        for e in engines:
            r = cells.get(f"{e}/{t}", {})
            line += f"{'TTFT med':>14}{fmt3(r.get('ttft_median_s')):>9}{'later':>9}{fmt3(r.get('ttft_median_later_s')):>9}"
        print(line)
    for e in engines:
        a, b = (cells.get(f"{e}/replay/{r}", {}).get("ttft_median_s") for r in REPLAYS)
        if a and b:
            print(f"{e}: the replay's median TTFT is {a / b:.2f}x shorter with the prompt cache")
    for name, r in cells.items():
        if "error" in r:
            print(f"{name}: {r['error'][:300]}")


def fmt3(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def parse_counts(flag: str, text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise BenchError(f"{flag} {text!r}: a comma list of counts") from None
    if not out or min(out) < 1:
        raise BenchError(f"{flag} {text!r}: counts >= 1")
    return out


def check_context(a) -> None:
    """llama-server cuts a slot's context to the file's training context: a cell needing more is
    refused here, before any server starts, rather than failed by one engine alone."""
    from bloomery.gguf_file import GGUFError, open_gguf
    try:
        with open_gguf(a.model) as gf:
            arch = gf.get("general.architecture")
            train = gf.get(f"{arch}.context_length")
    except (GGUFError, OSError) as e:
        raise BenchError(f"--model {a.model}: {e}") from None
    cells = a.cell_list
    longest = max(c.p if c.k else replay_longest(a.system_ids, a.turns, a.user_ids, a.n_gen) for c in cells)
    if train and longest + a.n_gen > int(train):
        raise BenchError(f"--model {a.model}: a slot needs {longest + a.n_gen} positions (the longest prompt "
                         f"and --n-gen), above the file's {arch}.context_length {train}, which llama-server "
                         f"keeps to")


def parse_args(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[2:]))
    ap.add_argument("--model", required=True, metavar="PATH", help="the GGUF both engines serve")
    ap.add_argument("--engines", default="bloomery,llama", help="comma list of bloomery, llama")
    ap.add_argument("--llama-server", default=None, metavar="PATH", help="llama-server binary (for --engines llama)")
    ap.add_argument("--backend", default="cuda", choices=("cpu", "cuda"),
                    help="bloomery-serve's --backend; llama-server gets -ngl 99 on cuda, -ngl 0 on cpu")
    ap.add_argument("--cells", default="", help="comma list of patterns over engine/test or test (fnmatch: "
                                              "'bloomery/k*', 'k16/*', 'replay/*'); default every cell")
    ap.add_argument("--out", required=True, help="the JSON, rewritten after every cell; cells it holds are skipped")
    ap.add_argument("--fresh", action="store_true", help="start --out afresh instead of going on from it")
    ap.add_argument("--ks", default=",".join(map(str, KS)), help="concurrent clients (-np) of the k cells")
    ap.add_argument("--prompts", default=",".join(map(str, PROMPTS)), help="prompt ids of the k cells")
    ap.add_argument("--n-gen", type=int, default=N_GEN, help="ids each request generates (the replay's replies too)")
    ap.add_argument("--runs", type=int, default=RUNS, help="timed rounds a k cell (after one warm-up round)")
    ap.add_argument("--users", type=int, default=USERS)
    ap.add_argument("--turns", type=int, default=TURNS, help="turns of each replay user")
    ap.add_argument("--system-ids", type=int, default=SYSTEM_IDS, help="the replay's shared system prompt")
    ap.add_argument("--user-ids", type=int, default=USER_IDS, help="each replay message")
    ap.add_argument("--replay-np", type=int, default=REPLAY_NP, help="-np of the replay's server")
    ap.add_argument("--replay-own-documents", action="store_true",
                    help="each replay user's --system-ids are a document of its own, not one shared prompt (so a "
                         "slot's live prefix holds none of the next user's turn and only a prompt cache can)")
    ap.add_argument("--threads", type=int, default=None, help="-t for both servers (default: each its own)")
    ap.add_argument("--bloomery-args", default="", help="more flags for bloomery-serve (one string)")
    ap.add_argument("--llama-args", default="", help="more flags for llama-server (one string)")
    ap.add_argument("--ready-timeout-s", type=float, default=900)
    a = ap.parse_args(argv)
    try:
        if not Path(a.model).is_file():
            raise BenchError(f"--model {a.model}: no such file")
        a.engine_list = [e for e in a.engines.split(",") if e]
        a.ks, a.prompt_list = parse_counts("--ks", a.ks), parse_counts("--prompts", a.prompts)
        a.cell_list = cell_list(a.engine_list, a.ks, a.prompt_list, [p for p in a.cells.split(",") if p])
        if "llama" in {c.engine for c in a.cell_list} and not (a.llama_server and os.access(a.llama_server, os.X_OK)):
            raise BenchError(f"--engines llama needs --llama-server PATH (an executable), got {a.llama_server!r}")
        if a.n_gen < 2 or a.runs < 1 or a.replay_np < 1:
            raise BenchError("--n-gen (>= 2), --runs and --replay-np must be positive")
        replay_schedule(a.users, a.turns, a.system_ids, a.user_ids)
        check_context(a)
    except BenchError as e:
        ap.error(str(e))
    return a


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    bench = Bench(a)
    bench.run(a.cell_list)
    print_table(bench.result)


if __name__ == "__main__":
    main()
