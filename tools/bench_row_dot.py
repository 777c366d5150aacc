"""The one-row product of kernels/lanes_dot.h on one thread, and on N processes at once: how fast a core reads a
stack of Q4_K or Q6_K weight rows against one activation row, with and without asking for the bytes ahead.

This is the measurement behind the host expert kernel's reading ahead (kernels/host_moe.c prefetch_bytes;
docs/performance.md run Y): on the H200's Xeon host one thread read 6-7.5 GB/s from memory without it and 8-10
with 2 KiB ahead, 14 at once 72-77 GB/s against 104-109. Built with the host kernels' flags (-O3 -march=native
-ffp-contract=off) into a temporary folder; the hash printed beside each rate is of the outputs, which no setting
changes.

    python3 tools/bench_row_dot.py [--types q4k,q6k] [--rows 768,40000] [--prefetch 0,1024,2048,4096]
        [--hints 3] [--copies 1,14] [--reps 5]
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
KERNELS = HERE.parent / "kernels"
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno"]


def build(out_dir: Path) -> Path:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise SystemExit("bench_row_dot: no C compiler found (cc, gcc, clang)")
    exe = out_dir / "row_dot"
    r = subprocess.run([cc, *FLAGS, "-I", str(KERNELS), "-o", str(exe), str(HERE / "bench_row_dot.c"), "-lm"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"bench_row_dot: the build failed: {r.stderr.strip()[-600:]}")
    return exe


def run(exe: Path, kind: str, rows: int, reps: int, pf: int, hint: int, copies: int) -> tuple[float, float, str]:
    """(GB/s summed over the copies, ns a block of the first, the first's output hash)."""
    procs = [subprocess.Popen([str(exe), kind, str(rows), str(reps), str(pf), str(hint)], stdout=subprocess.PIPE,
                              text=True) for _ in range(copies)]
    outs = [p.communicate()[0].split() for p in procs]
    if any(p.returncode != 0 or len(o) != 3 for p, o in zip(procs, outs)):
        raise SystemExit(f"bench_row_dot: a run failed ({kind} {rows} rows)")
    return sum(float(o[0]) for o in outs), float(outs[0][1]), outs[0][2]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", default="q4k,q6k")
    ap.add_argument("--rows", default="768,40000", help="rows a stack (768: in the cache; 40000: from memory)")
    ap.add_argument("--prefetch", default="0,1024,2048,4096", help="bytes asked for ahead of each row")
    ap.add_argument("--hints", default="3", help="__builtin_prefetch locality: 3 every level ... 0 non-temporal")
    ap.add_argument("--copies", default="1", help="processes at once (each its own stack)")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args(argv)
    ints = lambda raw: [int(v) for v in raw.split(",") if v.strip()]      # noqa: E731
    kinds = [k for k in a.types.split(",") if k]
    if any(k not in ("q4k", "q6k") for k in kinds):
        raise SystemExit(f"--types takes q4k and q6k, not {a.types!r}")
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(Path(tmp))
        print("type | rows | prefetch | hint | copies | GB/s | ns a block (first) | outputs")
        for kind in kinds:
            for rows in ints(a.rows):
                for copies in ints(a.copies):
                    for pf in ints(a.prefetch):
                        for hint in (ints(a.hints) if pf else [3]):
                            gbs, ns, h = run(exe, kind, rows, a.reps, pf, hint, copies)
                            print(f"{kind} | {rows} | {pf} | {hint} | {copies} | {gbs:.2f} | {ns:.2f} | {h}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
