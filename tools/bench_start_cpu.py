#!/usr/bin/env python3
"""CPU seconds of one bloomery-serve start, request and stop, per process: the supervisor (HTTP
front) and every process it starts (the fetch, plan and engine stages, the helper processes).

Each run starts `python -m bloomery.supervisor -m MODEL --port N --backend cpu ARGS` (the way
tests/serve_proc.py and the llama.cpp suite's wrapper.py start it), waits for /health 200, sends one
/completion (n_predict 8), stops it with SIGTERM and waits for its exit. A sampler thread reads every
descendant's cpu_times (psutil) every few milliseconds, so a process that ends between two samples
loses at most one interval; the total of the whole tree is exact (getrusage(RUSAGE_CHILDREN) around
the run: the supervisor reaps its stages, this tool reaps the supervisor). Median of N runs.

    python3 tools/bench_start_cpu.py [--model FILE] [--runs 5] [--bloomery-args "-c 4096 -np 1"] [--out FILE]
        [--against DIR]

--against DIR: another checkout's tree (`git archive REV | tar -x -C DIR`), started from DIR so its
`bloomery` is imported; its runs alternate with this tree's, so both see the same machine load.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_http import REPO, free_port  # noqa: E402
from fetch_model import NAME, cache_dir  # noqa: E402

SAMPLE_S = 0.01


def label(cmdline: list[str]) -> str:
    """A process's part in the start, from its command line."""
    text = " ".join(cmdline)
    if "bloomery.supervisor" in text:
        return "supervisor"
    for word in cmdline:
        if word.startswith("bloomery.stages."):
            return "stage " + word.rsplit(".", 1)[1]
    if "resource_tracker" in text:
        return "mp resource tracker"
    if "multiprocessing" in text:
        return "mp helper"
    return Path(cmdline[0]).name if cmdline else "?"


class Sampler(threading.Thread):
    """Every descendant of `root`'s last seen cpu_times (user + sys seconds), by pid."""

    def __init__(self, root: psutil.Process):
        super().__init__(daemon=True)
        self.root = root
        self.seen: dict[int, list] = {}         # pid -> [label, cpu_s]
        self.done = threading.Event()
        self.lock = threading.Lock()

    def _sample(self, proc: psutil.Process) -> None:
        try:
            with proc.oneshot():
                t = proc.cpu_times()
                cpu = t.user + t.system
                entry = self.seen.setdefault(proc.pid, ["?", 0.0])
                # read each time: a child seen between its fork and its exec still shows the parent's line
                name = "supervisor" if proc.pid == self.root.pid else label(proc.cmdline())
                if name not in ("?", "supervisor") or proc.pid == self.root.pid:
                    entry[0] = name
                entry[1] = max(entry[1], cpu)
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            pass

    def sample_all(self) -> None:
        with self.lock:
            try:
                procs = [self.root, *self.root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            for p in procs:
                self._sample(p)

    def run(self) -> None:
        while not self.done.is_set():
            self.sample_all()
            time.sleep(SAMPLE_S)

    def by_label(self) -> dict[str, float]:
        with self.lock:
            out: dict[str, float] = {}
            for name, cpu in self.seen.values():
                out[name] = out.get(name, 0.0) + cpu
            return out


def children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def get(url: str, body: dict | None = None, timeout: float = 5):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, r.read()


def one_run(a, log: Path, repo: Path = REPO) -> dict:
    port = free_port()
    argv = [sys.executable, "-m", "bloomery.supervisor", "-m", a.model, "--port", str(port),
            "--backend", "cpu", *shlex.split(a.bloomery_args)]
    url = f"http://127.0.0.1:{port}"
    before = children_cpu()
    t0 = time.perf_counter()
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=repo, start_new_session=True)
    sampler = Sampler(psutil.Process(proc.pid))
    sampler.start()
    ready_s = None
    try:
        deadline = time.monotonic() + a.ready_timeout_s
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if get(url + "/health", timeout=2)[0] == 200:
                    ready_s = time.perf_counter() - t0
                    break
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.05)        # as tests/serve_proc.py polls
        if ready_s is None:
            raise SystemExit(f"not ready (exit {proc.poll()}); see {log}")
        sampler.sample_all()
        at_ready = sampler.by_label()
        t = time.perf_counter()
        status, body = get(url + "/completion", {"prompt": "def fib(n):", "n_predict": 8, "temperature": 0},
                           timeout=600)
        request_s = time.perf_counter() - t
        n_out = len(json.loads(body).get("content", ""))
        t = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
        stop_s = time.perf_counter() - t
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        sampler.done.set()
        sampler.join()
    total = children_cpu() - before
    per = sampler.by_label()
    return {"ready_s": ready_s, "request_s": request_s, "stop_s": stop_s, "exit": code, "total_cpu_s": total,
            "sampled_cpu_s": sum(per.values()), "per_process_cpu_s": per,
            "supervisor_cpu_at_ready_s": at_ready.get("supervisor", 0.0), "content_chars": n_out}


def median_of(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(cache_dir() / NAME), metavar="PATH")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--bloomery-args", default="-c 4096 -np 1", help="more flags (one string; default %(default)r)")
    ap.add_argument("--ready-timeout-s", type=float, default=300)
    ap.add_argument("--log", default="/tmp/bench_start_cpu.log", help="the last run's server output")
    ap.add_argument("--out", default=None, help="write every run as JSON here too")
    ap.add_argument("--against", default=None, metavar="DIR", help="another tree to compare, run alternately")
    a = ap.parse_args(argv)
    trees = [("this tree", REPO)] + ([("against", Path(a.against).resolve())] if a.against else [])
    runs: dict[str, list[dict]] = {name: [] for name, _ in trees}
    for i in range(a.runs):
        for name, repo in trees:
            r = one_run(a, Path(a.log), repo)
            runs[name].append(r)
            parts = "  ".join(f"{k} {v:.2f}" for k, v in sorted(r["per_process_cpu_s"].items()))
            print(f"{name} run {i + 1}: ready {r['ready_s']:.2f} s, request {r['request_s']:.2f} s, "
                  f"stop {r['stop_s']:.2f} s, exit {r['exit']}; cpu {r['total_cpu_s']:.2f} s "
                  f"(sampled {r['sampled_cpu_s']:.2f}): {parts}", flush=True)
    command = ' '.join(shlex.quote(x) for x in ['bloomery-serve', '-m', a.model, '--backend', 'cpu',
                                                 *shlex.split(a.bloomery_args)])
    for name, repo in trees:
        report(f"{name} ({repo})", command, runs[name])
    if a.out:
        Path(a.out).write_text(json.dumps(runs, indent=1) + "\n")
    return 0


def report(title: str, command: str, runs: list[dict]) -> None:
    names = sorted({n for r in runs for n in r["per_process_cpu_s"]})
    print(f"{title}, median of {len(runs)}: {command}")
    print(f"  wall to ready     {median_of(runs, 'ready_s'):6.2f} s")
    print(f"  wall of request   {median_of(runs, 'request_s'):6.2f} s")
    print(f"  wall of stop      {median_of(runs, 'stop_s'):6.2f} s")
    print(f"  cpu, whole tree   {median_of(runs, 'total_cpu_s'):6.2f} s (user+sys)")
    print(f"  cpu, supervisor at ready {median_of(runs, 'supervisor_cpu_at_ready_s'):6.2f} s")
    for n in names:
        print(f"  cpu, {n:18s} {statistics.median(r['per_process_cpu_s'].get(n, 0.0) for r in runs):6.2f} s"
              f"  (in {sum(n in r['per_process_cpu_s'] for r in runs)}/{len(runs)} runs)")


if __name__ == "__main__":
    sys.exit(main())
