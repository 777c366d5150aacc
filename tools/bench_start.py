#!/usr/bin/env python3
"""Cold start of bloomery-serve: seconds from the process start to /health 200, with CuPy's
kernel cache empty (a fresh CUPY_CACHE_DIR each run), once with the prebuilt kernels
(BLOOMERY_CUDA_KERNELS=auto) and once compiling every module with NVRTC (=nvrtc); then the
first and the tenth request's time. The start's own records say where the time went: the
"cuda kernels" line (which modules came prebuilt, which compiled, how long the load waited)
and the "warmup" line (its parts). With --llama-server, llama-server's start on the same file
and the same -c/-np is timed the same way after bloomery's (mode "llama": `-ngl 99 -fa on`).

    python3 tools/bench_start.py --model FILE [--modes auto,nvrtc] [--work DIR] [--bloomery-args "-c 32768 -np 4"]
        [--llama-server PATH]
"""
from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_http import Server, free_port  # noqa: E402

RECORDS = ("cuda kernels", "warmup", "model loaded")


def records(log: str) -> dict[str, str]:
    """The named start records' fields, as printed (the text format: `[load] engine: MESSAGE k=v ...`)."""
    out = {}
    for line in log.splitlines():
        for name in RECORDS:
            m = re.search(rf"engine: {name} (.*)$", line)
            if m:
                out[name] = m.group(1)
    return out


def kernel_names(files) -> list[str]:
    """The kernels CuPy compiled into these files of its cache (the names each cubin's symbol strings hold:
    CuPy's own cupy_* kernels, the mangled _Z names of templates), sorted; NVRTC's time on a fresh machine."""
    names = set()
    for f in files:
        names.update(n.decode() for n in re.findall(rb"(?:cupy_|_Z)[A-Za-z0-9_]{4,}", Path(f).read_bytes()))
    return sorted(names)


def one_start(a, mode: str, work: Path) -> dict:
    cache = Path(tempfile.mkdtemp(prefix=f"cupy-{mode}-", dir=work))      # empty: nothing compiled yet
    port = free_port()
    if mode == "llama":      # the same file, context and slots; every layer on the card, as bench_serve starts it
        argv = [a.llama_server, "-m", a.model, "--port", str(port), "-ngl", "99", "-fa", "on",
                *shlex.split(a.bloomery_args)]
    else:
        argv = [sys.executable, "-m", "bloomery.supervisor", "-m", a.model, "--port", str(port),
                "--backend", a.backend, *shlex.split(a.bloomery_args)]
    log = work / f"start-{mode}.log"
    t0 = time.perf_counter()
    with Server(argv, port, log, a.ready_timeout_s, env={"CUPY_CACHE_DIR": str(cache), "BLOOMERY_CUDA_KERNELS": mode}) as srv:
        ready_s = time.perf_counter() - t0
        files_at_ready = sum(1 for _ in cache.iterdir())
        compiled_at_start = kernel_names(f for f in cache.rglob("*") if f.is_file())
        times, engine = [], []
        for _ in range(10):
            t = time.perf_counter()
            body = srv.completion({"prompt": "The cold start of a server", "n_predict": 16, "cache_prompt": False,
                                   "temperature": 0})
            times.append(time.perf_counter() - t)
            tm = body.get("timings") or {}
            engine.append((tm.get("prompt_ms"), tm.get("predicted_ms")))
    return {"mode": mode, "ready_s": round(ready_s, 2), "first_request_s": round(times[0], 3),
            "tenth_request_s": round(times[-1], 3), "first_engine_ms": engine[0], "tenth_engine_ms": engine[-1],
            **records(log.read_text(errors="replace")),
            "cupy_cache_files_at_ready": files_at_ready, "cupy_cache_files": sum(1 for _ in cache.iterdir()),
            "compiled_at_start": compiled_at_start}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, metavar="PATH")
    ap.add_argument("--backend", default="cuda", choices=("cuda", "cpu"), help="(cpu: to try the tool; the modes then change nothing)")
    ap.add_argument("--modes", default="auto,nvrtc", help="BLOOMERY_CUDA_KERNELS of each start, in order (default %(default)s)")
    ap.add_argument("--work", default=None, help="logs and the CuPy caches (default: a new temporary folder)")
    ap.add_argument("--bloomery-args", default="", help="more flags for bloomery-serve (one string)")
    ap.add_argument("--ready-timeout-s", type=float, default=600)
    ap.add_argument("--out", default=None, help="write the results here as JSON too")
    ap.add_argument("--llama-server", default=None, metavar="PATH",
                    help="also time llama-server's start (mode 'llama', after bloomery's modes)")
    a = ap.parse_args(argv)
    work = Path(a.work or tempfile.mkdtemp(prefix="bench-start-"))
    work.mkdir(parents=True, exist_ok=True)
    results = []
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    if a.llama_server:
        modes.append("llama")
    for mode in modes:
        r = one_start(a, mode, work)
        results.append(r)
        print(f"{mode:9s} ready {r['ready_s']:7.2f} s  first request {r['first_request_s']:.3f} s  "
              f"tenth {r['tenth_request_s']:.3f} s  (engine prompt/decode ms: first {r['first_engine_ms']}, tenth "
              f"{r['tenth_engine_ms']}; CuPy cache: {r['cupy_cache_files_at_ready']} files at ready, "
              f"{r['cupy_cache_files']} after)", flush=True)
        for name in RECORDS:
            if name in r:
                print(f"          {name}: {r[name]}", flush=True)
        if r["compiled_at_start"]:
            print(f"          compiled by NVRTC before ready: {', '.join(r['compiled_at_start'])}", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
