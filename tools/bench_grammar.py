#!/usr/bin/env python3
"""Decode speed under a JSON schema against unconstrained decode, through HTTP.

Starts bloomery-serve on a file (a synthetic one made with tools/make_synthetic.py, or any GGUF),
sends the same /completion prompt twice per round, greedy, once free and once under a JSON schema
that cannot end early (an array of at least 200 records), and reads each answer's
timings.predicted_per_second. With --llama-server, runs llama-server on the same file and the same
requests, so the table also holds llama-server's constrained decode.

  # on the card: the Qwen3-30B-A3B-shaped file (as tools/bench_cuda.py makes it)
  python3 tools/bench_grammar.py --synthetic 30b --work /tmp/bench --backend cuda \\
      [--llama-server <bin>/llama-server] [--out result.json]
  # anywhere: a tiny synthetic file on the CPU (checks the tool, not a speed)
  python3 tools/bench_grammar.py --synthetic tiny --work /tmp/bench-tiny --backend cpu --n-predict 16 --rounds 1
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))
from bench_http import Server, free_port  # noqa: E402

# 30b: the file tools/bench_cuda.py (and tools/gpu_run.sh) writes, reused when it is there
SHAPES = {
    "30b": ("qwen3moe-30b-a3b-shape-q4_k_m-L48.gguf", "qwen3moe", None),
    "tiny": ("bench-grammar-tiny.gguf", "qwen2", dict(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, seed=1)),
}
SCHEMA = {"type": "array", "minItems": 200, "items": {
    "type": "object", "additionalProperties": False, "required": ["id", "name", "email", "tags", "score"],
    "properties": {"id": {"type": "integer", "minimum": 1}, "name": {"type": "string", "maxLength": 24},
                   "email": {"type": "string", "format": "email"},
                   "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
                   "score": {"type": "number", "minimum": 0, "maximum": 100}}}}
PROMPT = "Here is the customer table of the shop, as a JSON array of records:\n"


def make_file(kind: str, work: Path) -> Path:
    from make_synthetic import write_synthetic
    name, arch, shape = SHAPES[kind]
    if shape is None:
        from bench_cuda import SHAPE as shape
    path = work / name
    if not path.exists():
        work.mkdir(parents=True, exist_ok=True)
        part = work / (name + ".part")
        write_synthetic(part, arch, tokenizer_from=os.environ.get("BLOOMERY_TOKENIZER_GGUF"), **shape)
        part.rename(path)
    return path


def measure(server: Server, n_predict: int, rounds: int) -> dict:
    """Best-of-rounds decode rate, free and under the schema; the constrained text must parse as far as it got."""
    base = {"prompt": PROMPT, "n_predict": n_predict, "temperature": 0, "cache_prompt": False}
    server.completion({**base, "n_predict": 4})            # warm both paths once
    server.completion({**base, "n_predict": 4, "json_schema": SCHEMA})
    out = {"free": [], "schema": []}
    for _ in range(rounds):
        for kind, extra in (("free", {"ignore_eos": True}), ("schema", {"json_schema": SCHEMA})):
            j = server.completion({**base, **extra})
            t = j["timings"]
            out[kind].append({"tok_s": t["predicted_per_second"], "n": t["predicted_n"]})
            if kind == "schema" and not j["content"].lstrip().startswith("["):
                raise SystemExit(f"the constrained answer does not start a JSON array: {j['content'][:80]!r}")
    res = {kind: max(runs, key=lambda r: r["tok_s"]) for kind, runs in out.items()}
    res["ratio"] = res["schema"]["tok_s"] / res["free"]["tok_s"]
    res["runs"] = out
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--synthetic", choices=sorted(SHAPES), help="make (once) and use a synthetic file of this shape")
    src.add_argument("--model", help="a GGUF file to use instead")
    ap.add_argument("--work", default="/tmp/bench-grammar", help="folder for the synthetic file and the logs")
    ap.add_argument("--backend", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--n-predict", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ctx-size", type=int, default=4096)
    ap.add_argument("--llama-server", help="llama-server binary: measure it on the same file and requests")
    ap.add_argument("--ready-timeout-s", type=float, default=1800)
    ap.add_argument("--out", help="write the result as JSON here")
    a = ap.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    path = Path(a.model) if a.model else make_file(a.synthetic, work)
    result = {"file": str(path), "schema": SCHEMA, "n_predict": a.n_predict, "backend": a.backend}
    port = free_port()
    srv = Server([sys.executable, "-m", "bloomery.supervisor", "-m", str(path), "--port", str(port), "--backend",
                  a.backend, "-c", str(a.ctx_size), "-np", "1"], port, work / "bloomery.log", a.ready_timeout_s)
    try:
        result["bloomery"] = measure(srv, a.n_predict, a.rounds)
    finally:
        srv.stop()
    if a.llama_server:
        port = free_port()
        srv = Server([a.llama_server, "-m", str(path), "--port", str(port), "-c", str(a.ctx_size), "-np", "1",
                      "-ngl", "99" if a.backend != "cpu" else "0", "-fa", "on"], port, work / "llama.log",
                     a.ready_timeout_s)
        try:
            result["llama_server"] = measure(srv, a.n_predict, a.rounds)
        finally:
            srv.stop()
        result["schema_vs_llama"] = result["bloomery"]["schema"]["tok_s"] / result["llama_server"]["schema"]["tok_s"]
    print_table(result)
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2))


def print_table(r: dict) -> None:
    print(f"file {r['file']}  n_predict {r['n_predict']}  backend {r['backend']}")
    print(f"{'server':<14}{'free tok/s':>12}{'schema tok/s':>14}{'schema/free':>13}")
    for name in ("bloomery", "llama_server"):
        if name in r:
            x = r[name]
            print(f"{name:<14}{x['free']['tok_s']:>12.1f}{x['schema']['tok_s']:>14.1f}{x['ratio']:>13.3f}")
    if "schema_vs_llama" in r:
        print(f"bloomery schema decode / llama-server schema decode: {r['schema_vs_llama']:.3f}")


if __name__ == "__main__":
    main()
