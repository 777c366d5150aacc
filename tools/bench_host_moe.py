"""Time the host expert kernel (kernels/host_moe.c) on a Qwen3-30B-A3B-shaped layer against the
host's memory read bandwidth.

Random Q4_K gate/up and Q6_K down stacks of E experts ([F, D] and [D, F]) are built in numpy;
each call routes every row to A random experts (fresh ones each call, so the weights come from
memory, not cache) and is timed through the same function pointer the cuda backend launches.
Printed per thread count: µs per call, the weight bytes one call reads, and those bytes per
second next to the host's read bandwidth measured by the same library (host_read_bw: threads
summing a 1 GiB buffer), which is the floor the kernel is meant to reach. A last line times a
tiny call (one 256x256 expert): the per-call cost of waking the workers and the phase hand-offs.
A table of when each phase ended (median over the calls) shows where a call's time goes.

    python3 tools/bench_host_moe.py [--threads 1,2,4,8,16] [--used 1,2,8] [--rows 1] [--calls 200] [--spin-us 2000]
        [--units 0,8] [--prefetch 0,2048] [--pages huge,4k] [--rounds 2]

--units, --prefetch and --pages sweep how a call is cut, how many bytes ahead of each row a one-row product
asks for, and whether the stacks lie in huge pages (every combination, --rounds times in turn).
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
from bloomery.engine.cpu import host_moe as hm  # noqa: E402

F16_FIELDS = {QT.Q4_K: (0, 2), QT.Q6_K: (208,)}


def random_stack(qt: QT, n_exp: int, n_rows: int, row_len: int, rng) -> hm.ExpertStack:
    """Random blocks with finite, modest f16 scales (the bench times bytes, not values)."""
    elems, nbytes = GGML_QUANT_SIZES[qt]
    raw = rng.integers(0, 256, size=(n_exp * n_rows * row_len // elems, nbytes), dtype=np.uint8)
    for off in F16_FIELDS[qt]:
        raw[:, off:off + 2] = np.full(raw.shape[0], 0.01, np.float16).view(np.uint8).reshape(-1, 2)
    return hm.ExpertStack(raw.reshape(-1), qt, n_rows, row_len)


def time_calls(args: hm.HostMoeArgs, ids: np.ndarray, n_exp: int, n_calls: int, rng,
               isa: str | None) -> tuple[float, float]:
    """Median wall seconds per call, and mean CPU seconds per call of all threads (spinning
    included: on a busy machine the wall time also counts other processes' turns); the routing
    of every call drawn beforehand."""
    fn = hm.lib(isa).host_moe
    n_tok, n_used = ids.shape
    routes = [np.stack([rng.permutation(n_exp)[:n_used] for _ in range(n_tok)]) for _ in range(n_calls)]
    addr = ctypes.addressof(args)
    for r in routes[:5]:                                   # warm the threads and the scratch
        ids[:] = r
        fn(addr)
    times, phases = [], []
    c0 = time.process_time()
    for r in routes:
        ids[:] = r
        t0 = time.perf_counter()
        fn(addr)
        times.append(time.perf_counter() - t0)
        phases.append(hm.last_phases_us(isa))
    time_calls.phases_us = np.median(np.array(phases), axis=0)
    return float(np.median(times)), (time.process_time() - c0) / n_calls


def _ints(raw: str) -> list[int]:
    return [int(v) for v in raw.split(",") if v.strip()]


def build_stacks(e: int, d: int, f: int, huge: bool, rng):
    """Random gate, up (Q4_K) and down (Q6_K) stacks, their memory in transparent huge pages or not (numpy asks
    for them on its large arrays; the served tier's pinned memory asks too: bloomery/engine/cuda/pinned.py)."""
    madvise = getattr(getattr(np, "_core", getattr(np, "core", None)).multiarray, "_set_madvise_hugepage", None)
    was = madvise(huge) if madvise is not None else None
    try:
        return (random_stack(QT.Q4_K, e, f, d, rng), random_stack(QT.Q4_K, e, f, d, rng),
                random_stack(QT.Q6_K, e, d, f, rng))
    finally:
        if madvise is not None:
            madvise(was)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("--used", default="8", help="experts a row, a comma list")
    ap.add_argument("--rows", type=int, default=1, help="tokens per call (1: decode)")
    ap.add_argument("--threads", default="", help="comma list; default 1, 2, 4, ... up to the CPU count")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--isa", default=None, help="native (default), avx2 or portable")
    ap.add_argument("--spin-us", type=int, default=None, help="idle workers' spin before they sleep (default 2000)")
    ap.add_argument("--units", default="", help="comma list of units a thread (host_moe.set_tuning; 0: fixed rows); "
                                                 "default: the library's")
    ap.add_argument("--prefetch", default="", help="comma list of bytes asked for ahead of each row (0: none); "
                                                    "default: the library's")
    ap.add_argument("--pages", default="huge", help="comma list of huge, 4k: the stacks' pages")
    ap.add_argument("--rounds", type=int, default=1, help="every setting this many times, in turn (hosts drift)")
    a = ap.parse_args()
    if a.spin_us is not None:
        hm.set_spin_us(a.spin_us, a.isa)
    n_cpu = hm.lib(a.isa).host_moe_max_threads()
    threads = _ints(a.threads) if a.threads else sorted(
        {1 << i for i in range(n_cpu.bit_length()) if 1 << i <= n_cpu} | {n_cpu})
    useds, units, prefetch = _ints(a.used), _ints(a.units) or [-1], _ints(a.prefetch) or [-1]
    pages = [p.strip() for p in a.pages.split(",") if p.strip()]
    if any(p not in ("huge", "4k") for p in pages):
        raise SystemExit(f"--pages takes huge and 4k, not {a.pages!r}")
    rng = np.random.default_rng(0)
    e, d, f, n_tok = a.experts, a.hidden, a.ffn, a.rows
    stacks = {p: build_stacks(e, d, f, p == "huge", rng) for p in pages}
    gate, up, down = stacks[pages[0]]
    expert_bytes = f * (gate.row_bytes + up.row_bytes) + d * down.row_bytes
    print(f"# {hm.status(a.isa)}; E={e} D={d} F={f} T={n_tok}: {expert_bytes / 1e6:.2f} MB per expert, "
          f"{(gate.data.nbytes + up.data.nbytes + down.data.nbytes) / 1e9:.2f} GB a set of stacks")
    floor = {nt: hm.read_bandwidth_gbs(1 << 30, nt, 5, a.isa) for nt in threads}
    print("round | pages | used | units | prefetch | threads | read GB/s (floor) | µs/call | cpu µs/call | MB/call | GB/s | "
          "of floor")
    phase_lines = []
    for rnd in range(a.rounds):
        for pg in pages:
            gate, up, down = stacks[pg]
            for n_used in useds:
                x = rng.standard_normal((n_tok, d)).astype(np.float32)                  # [T, D]
                ids = np.zeros((n_tok, n_used), np.int32)                               # [T, A]
                wts = np.full((n_tok, n_used), 1.0 / n_used, np.float32)                # [T, A]
                out = np.zeros((n_tok, d), np.float32)                                  # [T, D]
                args = hm.args_struct(d=d, f=f, n_used=n_used, gate_type=QT.Q4_K, up_type=QT.Q4_K,
                                      down_type=QT.Q6_K, gate=gate.pointers(), up=up.pointers(),
                                      down=down.pointers(), skip=np.zeros(e, np.uint8), n_rows=n_tok, ids=ids,
                                      wts=wts, x=x, out=out)
                hm.check_args(args, a.isa)
                for un, pf in ((u, p) for u in units for p in prefetch):
                    hm.set_tuning(un, pf, a.isa)
                    un, pf = hm.set_tuning(isa=a.isa)                         # the settings in force
                    for nt in threads:
                        args.n_threads = nt
                        s, cpu = time_calls(args, ids, e, a.calls, rng, a.isa)
                        n_distinct = e * (1 - (1 - n_used / e) ** n_tok)    # expected distinct experts a call
                        mb = n_distinct * expert_bytes / 1e6
                        bw = floor[nt]
                        print(f"{rnd:5d} | {pg:5s} | {n_used:4d} | {un:5d} | {pf:8d} | {nt:7d} | {bw:17.1f} | "
                              f"{s * 1e6:7.0f} | {cpu * 1e6:11.0f} | {mb:7.1f} | {mb / 1e3 / s:4.1f} | "
                              f"{mb / 1e3 / s / bw:7.0%}")
                        phase_lines.append(f"{rnd:5d} | {pg:5s} | {n_used:4d} | {un:5d} | {pf:8d} | {nt:7d} | "
                                           + " | ".join(f"{v:6.0f}" for v in time_calls.phases_us))
    print("round | pages | used | units | prefetch | threads | median µs from the call's start to the end of: "
          "quantize | gate/up | swiglu | down | sum")
    print("\n".join(phase_lines))
    tiny_g, tiny_u = random_stack(QT.Q4_K, 1, 256, 256, rng), random_stack(QT.Q4_K, 1, 256, 256, rng)
    tiny_d = random_stack(QT.Q6_K, 1, 256, 256, rng)
    tx, tids, twts, tout = np.ones((1, 256), np.float32), np.zeros((1, 1), np.int32), np.ones((1, 1), np.float32), \
        np.zeros((1, 256), np.float32)
    tiny = hm.args_struct(d=256, f=256, n_used=1, gate_type=QT.Q4_K, up_type=QT.Q4_K, down_type=QT.Q6_K,
                          gate=tiny_g.pointers(), up=tiny_u.pointers(), down=tiny_d.pointers(),
                          skip=np.zeros(1, np.uint8), ids=tids, wts=twts, x=tx, out=tout)
    for nt in threads:
        tiny.n_threads = nt
        s, cpu = time_calls(tiny, tids, 1, a.calls, rng, a.isa)
        print(f"tiny call (one 256x256 expert), {nt} threads: {s * 1e6:.1f} µs, {cpu * 1e6:.1f} cpu µs")


if __name__ == "__main__":
    main()
