#!/usr/bin/env python3
"""A prompt pass on a qwen35 / qwen35moe file on the CPU backend, with the delta rule step by step
(BLOOMERY_DELTA_CHUNKED=off: llama.cpp's CPU kernel's form) and in its chunked form (on), side by side:
the median wall time of a pass of P ids from position 0 over R runs each, and the largest difference
of the last position's log-probabilities between the two.

    python3 tools/bench_delta_rule.py FILE [-p 1024] [-r 3]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ONE = """
import json, sys, time
import numpy as np
from bloomery.engine.cpu.backend import NumpyOps
from bloomery.engine.models.registry import model_class
from bloomery.gguf_file import open_gguf
path, p, runs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
gf = open_gguf(path)
m = model_class(gf.arch())(gf, NumpyOps(), 1, p + 16)
ids = np.random.default_rng(0).integers(100, 150000, p)
times = []
for _ in range(runs):
    t0 = time.perf_counter()
    logits = m.prefill(0, ids, 0)
    times.append(time.perf_counter() - t0)
z = logits.astype(np.float64)
print(json.dumps({"times": times, "logp": (z - z.max() - np.log(np.exp(z - z.max()).sum())).tolist()}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file")
    ap.add_argument("-p", type=int, default=1024, help="prompt ids (default 1024)")
    ap.add_argument("-r", type=int, default=3, help="runs of each form (default 3)")
    a = ap.parse_args()
    got = {}
    for form in ("off", "on"):
        env = {**os.environ, "BLOOMERY_DELTA_CHUNKED": form}
        r = subprocess.run([sys.executable, "-c", ONE, a.file, str(a.p), str(a.r)], env=env, capture_output=True,
                           text=True, check=True)
        got[form] = json.loads(r.stdout.strip().splitlines()[-1])
    import numpy as np
    med = {f: float(np.median(g["times"])) for f, g in got.items()}
    gap = float(np.max(np.abs(np.array(got["on"]["logp"]) - np.array(got["off"]["logp"]))))
    print(f"| P | step form (s) | chunked form (s) | speedup | max |logp diff| |")
    print(f"| {a.p} | {med['off']:.2f} | {med['on']:.2f} | {med['off'] / med['on']:.2f}x | {gap:.2e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
