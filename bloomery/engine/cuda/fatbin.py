"""Prebuilt kernels: each kernels/*.cu module compiled by nvcc into one fatbin, shipped in the
wheel (bloomery/engine/cuda/prebuilt/), so a card they cover loads its kernels without compiling.

Stdlib only: setup.py loads this file by its path while a wheel builds, where neither bloomery's
dependencies nor CuPy are installed.

A fatbin holds a cubin for each of ARCHS and the PTX of the newest (for cards after it), built
from the same text NVRTC gets (source(): the includes inlined) with the same options: OPTIONS,
which kernels.py hands NVRTC, and -ftz=true, which CuPy adds to every NVRTC compile
(cupy/cuda/compiler.py). Beside each, <module>.json names the sha256 of that source, the options,
the archs and the fatbin's own sha256; the loader takes a fatbin only when all of them match, so an
edited .cu file never runs a stale binary.

    python3 -m bloomery.engine.cuda.fatbin [--out DIR] [--arch 80,86,89,90] [--ptx 90] [--nvcc PATH]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MODULES = ("matvec", "moe", "moe_mm", "attention", "layers", "recurrent")
OPTIONS = ("--std=c++17",)            # NVRTC's options in kernels.py
NVCC_OPTIONS = OPTIONS + ("-ftz=true",)
ARCHS = ("80", "86", "89", "90")      # A100, A10/3090, L4/4090, H100/H200
PTX = "90"                            # the PTX kept for newer cards (the driver compiles it there)
HERE = Path(__file__).resolve().parent
PREBUILT = HERE / "prebuilt"
KERNELS = HERE.parents[1] / "kernels"   # bloomery/kernels: the tree's kernels/ through a link, or the wheel's copy
_INCLUDE = re.compile(r'^#include "([^"]+)"\s*$', re.M)


def source(name: str, kdir: Path | None = None) -> str:
    """kernels/<name>.cu with its includes inlined (each header once)."""
    kdir = kdir or KERNELS
    seen: set[str] = set()

    def inline(fname: str) -> str:
        text = (kdir / fname).read_text()

        def sub(m: re.Match) -> str:
            inc = m.group(1)
            if inc in seen:
                return ""
            seen.add(inc)
            return inline(inc)
        return _INCLUDE.sub(sub, text)
    return inline(f"{name}.cu")


def source_sha256(name: str, kdir: Path | None = None) -> str:
    return hashlib.sha256(source(name, kdir).encode()).hexdigest()


def _sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --- what the loader takes --------------------------------------------------------------------

def manifest(name: str, folder: Path | None = None) -> dict | None:
    """<folder>/<name>.json, or None where there is none (or it does not parse)."""
    try:
        return json.loads(((folder or PREBUILT) / f"{name}.json").read_text())
    except (OSError, ValueError):
        return None


def _covers(cubins, cc: str) -> bool:
    """A cubin for X.y runs on X.z for z >= y (the same major)."""
    major, minor = int(cc) // 10, int(cc) % 10
    return any(int(a) // 10 == major and int(a) % 10 <= minor for a in cubins)


def check(name: str, cc: str, folder: Path | None = None, kdir: Path | None = None) -> tuple[str | None, str]:
    """Whether <folder>/<name>.fatbin runs on a card of compute capability cc ("90") as the
    source stands: ("cubin", path), ("ptx", path) where only its PTX does (the driver compiles
    it), or (None, why not)."""
    folder = folder or PREBUILT
    m = manifest(name, folder)
    path = folder / f"{name}.fatbin"
    if m is None or not path.is_file():
        return None, "no prebuilt fatbin"
    if m.get("source_sha256") != source_sha256(name, kdir):
        return None, "the prebuilt fatbin is of another source"
    if tuple(m.get("options", ())) != NVCC_OPTIONS:
        return None, f"the prebuilt fatbin was built with {' '.join(m.get('options', ()))}"
    if m.get("fatbin_sha256") != _sha256_file(path):
        return None, "the prebuilt fatbin does not match its manifest"
    if _covers(m.get("cubins", ()), cc):
        return "cubin", str(path)
    if m.get("ptx") and int(m["ptx"]) <= int(cc):
        return "ptx", str(path)
    return None, f"no cubin for sm_{cc} (the fatbin has sm_{', sm_'.join(m.get('cubins', ()))})"


MODES = ("auto", "nvrtc", "prebuilt")


def plan(cc: str, mode: str = "auto", folder: Path | None = None, kdir: Path | None = None) -> dict[str, tuple]:
    """Each module's way in on a card of compute capability cc: ("prebuilt", path, why) or
    ("nvrtc", None, why). mode (BLOOMERY_CUDA_KERNELS): auto takes a cubin that covers the card and
    compiles the rest with NVRTC; nvrtc compiles everything; prebuilt compiles nothing, taking
    the fatbin's PTX where no cubin covers the card, and refuses a module with neither."""
    if mode not in MODES:
        raise ValueError(f"BLOOMERY_CUDA_KERNELS={mode!r}: one of {', '.join(MODES)}")
    out = {}
    for name in MODULES:
        if mode == "nvrtc":
            out[name] = ("nvrtc", None, "BLOOMERY_CUDA_KERNELS=nvrtc")
            continue
        kind, got = check(name, cc, folder, kdir)
        if kind == "cubin" or (kind == "ptx" and mode == "prebuilt"):
            out[name] = ("prebuilt", got, "cubin" if kind == "cubin" else f"PTX of sm_{PTX}, compiled by the driver")
        elif mode == "prebuilt":
            why = got if kind is None else f"no cubin for sm_{cc}"
            raise ValueError(f"BLOOMERY_CUDA_KERNELS=prebuilt: kernels/{name}.cu has no usable prebuilt fatbin "
                             f"for sm_{cc} in {folder or PREBUILT} ({why}); build it with "
                             f"`python3 -m bloomery.engine.cuda.fatbin` or set BLOOMERY_CUDA_KERNELS=auto")
        else:
            out[name] = ("nvrtc", None, got if kind is None else f"no cubin for sm_{cc}")
    return out


# --- the build --------------------------------------------------------------------------------

def find_nvcc() -> str | None:
    """BLOOMERY_NVCC, else nvcc on PATH, else the toolkit's usual place."""
    if os.environ.get("BLOOMERY_NVCC"):
        return os.environ["BLOOMERY_NVCC"]
    for cand in (shutil.which("nvcc"), os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")):
        if cand and os.access(cand, os.X_OK):
            return cand
    return None


def nvcc_command(nvcc: str, src: Path, out: Path, archs=ARCHS, ptx: str | None = PTX) -> list[str]:
    cmd = [nvcc, *NVCC_OPTIONS, "-fatbin", "--threads", "0"]
    for a in archs:
        code = f"[sm_{a},compute_{a}]" if a == ptx else f"sm_{a}"
        cmd += ["-gencode", f"arch=compute_{a},code={code}"]
    if ptx and ptx not in archs:
        cmd += ["-gencode", f"arch=compute_{ptx},code=compute_{ptx}"]
    return cmd + ["-o", str(out), str(src)]


def fresh(name: str, folder: Path, archs=ARCHS, ptx: str | None = PTX, kdir: Path | None = None) -> bool:
    """<folder>/<name>.fatbin is built from today's source for archs and ptx."""
    m = manifest(name, folder)
    path = folder / f"{name}.fatbin"
    return (m is not None and path.is_file() and m.get("source_sha256") == source_sha256(name, kdir)
            and tuple(m.get("options", ())) == NVCC_OPTIONS and tuple(m.get("cubins", ())) == tuple(archs)
            and m.get("ptx") == ptx and m.get("fatbin_sha256") == _sha256_file(path))


def build_one(name: str, out_dir: Path, nvcc: str, archs=ARCHS, ptx: str | None = PTX,
              kdir: Path | None = None) -> Path:
    """nvcc on the inlined source, then <name>.fatbin and <name>.json (the manifest written last,
    so a build cut short leaves no manifest naming a half-written file)."""
    text = source(name, kdir)
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / f"{name}.cu", Path(tmp) / f"{name}.fatbin"
        src.write_text(text)
        run = subprocess.run(nvcc_command(nvcc, src, out, archs, ptx), capture_output=True, text=True)
        if run.returncode != 0 or not out.is_file():
            raise RuntimeError(f"nvcc failed on kernels/{name}.cu (exit {run.returncode}):\n{run.stderr[-4000:]}")
        version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip().splitlines()
        (out_dir / f"{name}.json").unlink(missing_ok=True)
        shutil.copyfile(out, out_dir / f"{name}.fatbin")
    meta = {"module": name, "source_sha256": hashlib.sha256(text.encode()).hexdigest(),
            "options": list(NVCC_OPTIONS), "cubins": list(archs), "ptx": ptx,
            "fatbin_sha256": _sha256_file(out_dir / f"{name}.fatbin"),
            "nvcc": version[-1] if version else ""}
    (out_dir / f"{name}.json").write_text(json.dumps(meta, indent=1) + "\n")
    return out_dir / f"{name}.fatbin"


def build(out_dir: Path | None = None, nvcc: str | None = None, archs=ARCHS, ptx: str | None = PTX,
          modules=MODULES, kdir: Path | None = None, jobs: int | None = None, log=print) -> dict[str, str]:
    """Every module not already fresh in out_dir, built in parallel. Returns each module's
    "fresh" or "built"; raises on a failed build (naming the module) or with no nvcc."""
    out_dir = Path(out_dir or PREBUILT)
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise FileNotFoundError("nvcc not found (set BLOOMERY_NVCC, or put the CUDA toolkit's bin on PATH)")
    out_dir.mkdir(parents=True, exist_ok=True)
    done = {m: "fresh" for m in modules if fresh(m, out_dir, archs, ptx, kdir)}
    todo = [m for m in modules if m not in done]
    if todo:
        log(f"fatbin: building {', '.join(todo)} for sm_{', sm_'.join(archs)} (+ PTX {ptx}) with {nvcc}")
        with ThreadPoolExecutor(max_workers=jobs or len(todo)) as pool:
            for m, fut in [(m, pool.submit(build_one, m, out_dir, nvcc, archs, ptx, kdir)) for m in todo]:
                fut.result()
                done[m] = "built"
                log(f"fatbin: {out_dir / (m + '.fatbin')}")
    return {m: done[m] for m in modules}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m bloomery.engine.cuda.fatbin",
                                description="Build kernels/*.cu into one fatbin per module (nvcc), with its manifest.")
    p.add_argument("--out", type=Path, default=PREBUILT, help=f"where (default {PREBUILT})")
    p.add_argument("--arch", default=",".join(ARCHS), help="the cubins' compute capabilities, comma-separated (default %(default)s)")
    p.add_argument("--ptx", default=PTX, help="the PTX kept for newer cards ('' for none; default %(default)s)")
    p.add_argument("--nvcc", default=None, help="the compiler (default: BLOOMERY_NVCC, nvcc on PATH, /usr/local/cuda/bin/nvcc)")
    p.add_argument("--module", action="append", choices=MODULES, help="only these (default: all)")
    a = p.parse_args(argv)
    archs = tuple(x.strip() for x in a.arch.split(",") if x.strip())
    bad = [x for x in archs + ((a.ptx,) if a.ptx else ()) if not re.fullmatch(r"\d{2,3}", x)]
    if bad:
        p.error(f"--arch/--ptx {', '.join(bad)}: compute capabilities as digits, like 80 or 90")
    try:
        got = build(a.out, a.nvcc, archs, a.ptx or None, tuple(a.module or MODULES))
    except (FileNotFoundError, RuntimeError) as e:
        print(f"fatbin: {e}", file=sys.stderr)
        return 1
    for m, how in got.items():
        print(f"{m}: {how}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
