"""Prompt and decode speed of a CPU server through HTTP, bloomery beside llama-server.

Starts each server command given (the model path, threads and port are filled in), waits for
/health, then for each prompt length P sends a streamed /completion of P token ids (the same
ids for every server) with cache_prompt false and ignore_eos, n_predict N, REPS times, and
prints per server and P the best and the median of: prompt tok/s (P over the time to the first
streamed token) and decode tok/s (the tokens after the first over the time after it).

    python3 tools/bench_cpu.py -m MODEL.gguf --llama /path/to/llama-server -t 2

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


def one(port: int, ids: list[int], n_predict: int) -> tuple[float, float, int]:
    """(seconds to the first token, seconds after it, tokens streamed)."""
    body = json.dumps({"prompt": ids, "n_predict": n_predict, "stream": True, "cache_prompt": False,
                       "ignore_eos": True, "temperature": 0.0, "seed": 1})
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
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
            first = first or now
            last = now
        if msg.get("stop"):
            break
    c.close()
    return first - t0, last - first, n


def run_server(name: str, argv: list[str], port: int, lengths: list[int], n_predict: int, reps: int) -> dict:
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    out = {}
    try:
        wait_health(port, proc)
        one(port, list(range(1000, 1016)), 4)                          # warm: first-use costs out of the figures
        for p in lengths:
            ids = [(1000 + 7919 * i) % 30000 + 200 for i in range(p)]
            pp, dd = [], []
            for _ in range(reps):
                t_first, t_rest, n = one(port, ids, n_predict)
                pp.append(p / t_first)
                dd.append((n - 1) / t_rest)
            out[p] = (pp, dd)
            print(f"{name:10s} P={p:4d}: prompt best {max(pp):6.1f} median {statistics.median(pp):6.1f} tok/s | "
                  f"decode best {max(dd):6.1f} median {statistics.median(dd):6.1f} tok/s  (n={reps})", flush=True)
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
    a = ap.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    servers = []
    if a.only != "llama":
        servers.append(("bloomery", [sys.executable, "-m", "bloomery.supervisor", "-m", a.model, "--backend", "cpu",
                                     "-t", str(a.threads), "--port", str(a.port), "-c", "4096"]))
    if a.llama and a.only != "bloomery":
        servers.append(("llama", [a.llama, "-m", a.model, "-t", str(a.threads), "--port", str(a.port + 1),
                                  "-c", "4096", "-np", "1"]))
    for name, argv in servers:
        run_server(name, argv, a.port + (name == "llama"), lengths, a.n_predict, a.reps)


if __name__ == "__main__":
    main()
