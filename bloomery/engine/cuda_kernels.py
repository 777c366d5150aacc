"""The one loader of kernels/*.cu: NVRTC through CuPy RawModule, compiled once per card.

CuPy caches each compiled module on disk keyed by its source, options and the card's
architecture; we point that cache at ~/.cache/bloomery/kernels (BLOOMERY_CACHE moves it)
unless CUPY_CACHE_DIR is set. `#include "x.cuh"` lines are inlined here, so NVRTC needs no
include path and the cache key covers the headers too.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

MODULES = ("matvec", "moe", "attention", "layers")
_INCLUDE = re.compile(r'^#include "([^"]+)"\s*$', re.M)


def kernel_dir() -> Path:
    """bloomery/kernels: a link to the tree's top-level kernels/, a copy in an installed wheel."""
    return Path(__file__).resolve().parent.parent / "kernels"


def source(name: str, kdir: Path | None = None) -> str:
    """kernels/<name>.cu with its includes inlined (each header once)."""
    kdir = kdir or kernel_dir()
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


class Kernels:
    """Functions by name across the modules; compiled on first use."""

    def __init__(self):
        import cupy
        cache = Path(os.environ.get("BLOOMERY_CACHE", Path.home() / ".cache" / "bloomery")) / "kernels"
        os.environ.setdefault("CUPY_CACHE_DIR", str(cache))
        self._cupy = cupy
        self._mods: dict[str, object] = {}
        self._fns: dict[str, object] = {}
        self._where = {}
        for mod in MODULES:
            src = source(mod)
            names = re.findall(r'extern "C" __global__ void (?:__launch_bounds__\([^)]*\)\s+)?(\w+)\(', src)
            names += [f"mmv3_b{n}" for n in re.findall(r"^MMV3\((\d+)\)", src, re.M)]
            names += [f"mmv3n_b{n}" for n in re.findall(r"^MMV3N\((\d+)\)", src, re.M)]
            names += [f"attn_dec_{a}_{b}" for a, b in re.findall(r"^ATTN_DEC\((\d+), (\d+)\)", src, re.M)]
            names += [f"moe_route_w{n}" for n in re.findall(r"^MOE_ROUTE_W\((\d+)\)", src, re.M)]
            for fn in names:
                self._where[fn] = mod

    def compile_all(self) -> None:
        for fn in self._where:
            getattr(self, fn)

    def __getattr__(self, fn: str):
        if fn.startswith("_"):
            raise AttributeError(fn)
        if fn not in self._fns:
            mod = self._where.get(fn)
            if mod is None:
                raise AttributeError(f"no kernel {fn!r} in kernels/ ({', '.join(MODULES)})")
            if mod not in self._mods:
                self._mods[mod] = self._cupy.RawModule(code=source(mod), options=("--std=c++17",))
            self._fns[fn] = self._mods[mod].get_function(fn)
        return self._fns[fn]
