"""Prompt and decode speed of a CPU server through HTTP, bloomery beside llama-server.

Starts each server command given (the model path, threads and port are filled in), waits for
/health, then for each prompt length P sends a streamed /completion of P token ids (the same
ids for every server) with cache_prompt false and ignore_eos, n_predict N, REPS times, and
prints per server and P the best and the median of: prompt tok/s (P over the time to the first
streamed token) and decode tok/s (the tokens after the first over the time after it). Beside
each, the server's CPU time per token: user + system seconds of the server's whole process tree
(psutil), read when the request is sent, when the first token arrives and when the last does, so
prompt CPU ms per token is the first span over P and decode CPU ms per token the second over the
tokens after the first. On a shared machine CPU time is the steadier figure (a thread waiting
for the core costs wall time, not CPU time; a spinning one costs both). The 1-minute load
average is printed with each row.

    python3 tools/bench_cpu.py -m MODEL.gguf --llama /path/to/llama-server -t 2 [--json out.json]

The machine may be shared: the best of REPS is the figure least disturbed by other work.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import statistics
import subprocess
import sys
import time

import psutil


def wait_health(port: int, proc: subprocess.Popen, limit: float = 300.0) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before /health answered")
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"/health did not answer 200 within {limit:.0f} s")


def tree_cpu(proc: psutil.Process) -> float:
    """User + system CPU seconds of proc and every descendant alive now."""
    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def one(port: int, ids: list[int], n_predict: int, proc: psutil.Process | None = None):
    """(seconds to the first token, seconds after it, tokens streamed, CPU seconds of the server
    to the first token, CPU seconds after it; the last two 0 without proc)."""
    body = json.dumps({"prompt": ids, "n_predict": n_predict, "stream": True, "cache_prompt": False,
                       "ignore_eos": True, "temperature": 0.0, "seed": 1})
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    cpu0 = tree_cpu(proc) if proc else 0.0
    cpu_first = cpu0
    t0 = time.perf_counter()
    c.request("POST", "/completion", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"/completion answered {r.status}: {r.read()[:300]!r}")
    first = last = None
    n = 0
    for line in r:
        if not line.startswith(b"data: "):
            continue
        msg = json.loads(line[6:])
        if msg.get("content") or msg.get("tokens"):
            now = time.perf_counter()
            n += 1
            if first is None:
                first = now
                cpu_first = tree_cpu(proc) if proc else 0.0
            last = now
        if msg.get("stop"):
            break
    cpu_end = tree_cpu(proc) if proc else 0.0
    c.close()
    return first - t0, last - first, n, cpu_first - cpu0, cpu_end - cpu_first


def run_server(name: str, argv: list[str], port: int, lengths: list[int], n_predict: int, reps: int) -> dict:
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    out = {}
    try:
        wait_health(port, proc)
        ps = psutil.Process(proc.pid)
        one(port, list(range(1000, 1016)), 4)                          # warm: first-use costs out of the figures
        for p in lengths:
            ids = [(1000 + 7919 * i) % 30000 + 200 for i in range(p)]
            pp, dd, pc, dc, loads = [], [], [], [], []
            for _ in range(reps):
                t_first, t_rest, n, cpu_p, cpu_d = one(port, ids, n_predict, ps)
                pp.append(p / t_first)
                dd.append((n - 1) / t_rest)
                pc.append(1e3 * cpu_p / p)
                dc.append(1e3 * cpu_d / max(1, n - 1))
                loads.append(os.getloadavg()[0])
            out[p] = {"prompt_tok_s": pp, "decode_tok_s": dd, "prompt_cpu_ms_per_tok": pc,
                      "decode_cpu_ms_per_tok": dc, "load1": loads}
            print(f"{name:10s} P={p:4d}: prompt best {max(pp):6.1f} median {statistics.median(pp):6.1f} tok/s, "
                  f"CPU {min(pc):6.2f} / {statistics.median(pc):6.2f} ms/tok | decode best {max(dd):6.1f} "
                  f"median {statistics.median(dd):6.1f} tok/s, CPU {min(dc):6.2f} / {statistics.median(dc):6.2f} "
                  f"ms/tok  (n={reps}, load {min(loads):.1f}-{max(loads):.1f})", flush=True)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except ProcessLookupError:                                      # it had exited: its error is raised above
            pass
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--llama", help="a llama-server binary (CPU build) to measure beside bloomery")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--lengths", default="128,512")
    ap.add_argument("-n", "--n-predict", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--port", type=int, default=18431)
    ap.add_argument("--only", choices=["bloomery", "llama"], help="measure one server only")
    ap.add_argument("--json", help="write every figure (per repeat) and the conditions here")
    a = ap.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    servers = []
    if a.only != "llama":
        servers.append(("bloomery", [sys.executable, "-m", "bloomery.supervisor", "-m", a.model, "--backend", "cpu",
                                     "-t", str(a.threads), "--port", str(a.port), "-c", "4096"]))
    if a.llama and a.only != "bloomery":
        servers.append(("llama", [a.llama, "-m", a.model, "-t", str(a.threads), "--port", str(a.port + 1),
                                  "-c", "4096", "-np", "1"]))
    results = {"threads": a.threads, "n_predict": a.n_predict, "reps": a.reps, "cpus": os.cpu_count(),
               "servers": {}}
    for name, argv in servers:
        results["servers"][name] = run_server(name, argv, a.port + (name == "llama"), lengths, a.n_predict, a.reps)
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
