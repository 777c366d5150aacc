"""What a request costs beside its prompt pass, through HTTP: a streamed /completion of P random prompt ids
(n_predict 1, greedy, cache_prompt false, the ids sent as a JSON array as tools/bench_offload.py sends them),
its first piece's time on the client's clock less the server's own prompt_ms. What is left is the front (the
JSON, the ids' checks, the message to the engine), the engine's work before and after the pass (the message
read back, the admission, the sampler) and the way back. Run it beside llama-server with the same file to see
both servers' costs; the model's own speed does not enter.

    python3 tools/bench_overhead.py -m FILE [--prompts 16,512,4096] [--runs 7] [--llama-server PATH] [--args "..."]
"""
from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_http import Server, free_port  # noqa: E402


def measure(srv: Server, n_vocab: int, prompts: list[int], runs: int) -> dict:
    """{P: {"first_ms", "prompt_ms", "overhead_ms"}}: medians of `runs` requests after one warm-up."""
    out = {}
    for p in prompts:
        ids = np.random.default_rng(p).integers(100, n_vocab - 1, p).tolist()
        body = {"prompt": ids, "n_predict": 1, "cache_prompt": False, "return_tokens": True, "temperature": 0}
        rows = []
        for i in range(runs + 1):
            s = srv.stream(body)
            if i and s.prompt_s is not None and "timings" in s.final:
                rows.append((s.prompt_s * 1e3, float(s.final["timings"]["prompt_ms"])))
        if not rows:
            raise SystemExit(f"{srv.url}: no timed answer for a {p}-id prompt")
        first, pm = statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows)
        over = statistics.median(a - b for a, b in rows)
        out[p] = {"first_ms": round(first, 2), "prompt_ms": round(pm, 2), "overhead_ms": round(over, 2)}
        print(f"{p:>6} ids: first piece {first:.1f} ms, server prompt {pm:.1f} ms, the rest {over:.1f} ms", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--prompts", default="16,512,4096")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--n-vocab", type=int, default=150_000, help="random ids are drawn below this")
    ap.add_argument("--llama-server", default=None, help="also measure this llama-server binary")
    ap.add_argument("--args", default="-c 8192 -np 1", help="both servers' other flags")
    ap.add_argument("--ready-timeout-s", type=float, default=600.0)
    a = ap.parse_args(argv)
    prompts = [int(x) for x in a.prompts.split(",")]
    extra = shlex.split(a.args)
    engines = [("bloomery", [sys.executable, "-m", "bloomery.supervisor", "-m", a.model, *extra])]
    if a.llama_server:
        engines.append(("llama-server", [a.llama_server, "-m", a.model, *extra]))
    work = Path(tempfile.mkdtemp(prefix="bench-overhead-"))
    for name, argv_ in engines:
        port = free_port()
        print(f"== {name}", flush=True)
        with Server([*argv_, "--port", str(port)], port, work / f"{name}.log", a.ready_timeout_s) as srv:
            measure(srv, a.n_vocab, prompts, a.runs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
