"""The numpy backend's compiled kernels: kernels/cpu_lanes.c, built once per machine.

The C source is compiled by the system's C compiler (`cc`, or $CC) with -O3 -march=native
-ffp-contract=off into `$BLOOMERY_CACHE/kernels/cpu_lanes-<key>.so` (default ~/.cache/bloomery),
the key covering the source and the header it shares with kernels/host_moe.c (lanes_dot.h: the
activation quantizers, swiglu and the per-type products), the compiler and the CPU's flags, and
loaded through ctypes. One call spreads its rows over `nth` threads itself (the library's own
pool, the GIL released).

Where no compiler is found or the build fails, `lib()` is None and the numpy backend keeps its
numpy kernels (same bits, slower); BLOOMERY_CPU_KERNELS=off chooses that on purpose, and
BLOOMERY_CPU_KERNELS=portable builds the plain C loops instead of the SIMD ones, and
BLOOMERY_CPU_KERNELS=avx2 the AVX2 loops where the CPU has AVX-512 VNNI too. `status()` says
which, for the engine's start record.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from bloomery.kernels import cache_dir, kernel_dir

SOURCE = "cpu_lanes.c"
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared", "-pthread"]
ISA_NAMES = {0: "portable C", 1: "avx2+fma", 2: "avx2+fma, avx512-vnni"}   # lanes_isa()
_LOCK = threading.Lock()
_LIB: ctypes.CDLL | None = None
_STATUS: str | None = None


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return os.uname().machine


def _compiler() -> str | None:
    cc = os.environ.get("CC") or "cc"
    return shutil.which(cc) or shutil.which("gcc") or shutil.which("clang")


def _build(cc: str, src: Path, dest: Path, flags: list[str]) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".tmp-", suffix=".so")
    os.close(fd)
    try:
        res = subprocess.run([cc, *flags, "-o", tmp, str(src), "-lm"], capture_output=True, text=True, timeout=120)
        if res.returncode != 0:
            raise OSError(f"{cc} failed on {src.name}: {res.stderr.strip()[-400:]}")
        os.replace(tmp, dest)                      # a whole library or none: another process may load it
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.M)


def _sources(src: Path) -> list[bytes]:
    """The source's bytes, then those of each kernels/ header it includes (`#include "x.h"`, and
    theirs in turn), each once: what the build reads, so a changed header changes the key."""
    seen, out, todo = set(), [], [src]
    while todo:
        p = todo.pop(0)
        if p in seen:
            continue
        seen.add(p)
        data = p.read_bytes()
        out.append(data)
        todo += [p.parent / m.decode() for m in _INCLUDE.findall(data)]
    return out


def compiled(source: str, flags: list[str]) -> Path:
    """kernels/<source> built with `flags` by the system's C compiler into the cache, once per
    source (and the headers it includes: lanes_dot.h), compiler, flags and CPU. Raises
    FileNotFoundError where no compiler is found or a header is missing, OSError or
    subprocess.SubprocessError where the build fails."""
    src = kernel_dir() / source
    cc = _compiler()
    if cc is None:
        raise FileNotFoundError("no C compiler found (cc, gcc, clang)")
    key = hashlib.sha256(b"\0".join([*_sources(src), cc.encode(), " ".join(flags).encode(),
                                     _cpu_flags().encode()])).hexdigest()[:16]
    so = cache_dir() / f"{Path(source).stem}-{key}.so"
    if not so.exists():
        _build(cc, src, so, flags)
    return so


def _load() -> tuple[ctypes.CDLL | None, str]:
    choice = os.environ.get("BLOOMERY_CPU_KERNELS", "on").strip().lower()
    if choice in ("off", "0", "false", "no"):
        return None, "off (BLOOMERY_CPU_KERNELS=off): numpy kernels"
    # portable: the plain C loops, not the AVX2 ones (what a non-x86 machine builds; tests use it);
    # avx2: the AVX2 loops where the CPU also has AVX-512 (tests use it too)
    x86 = os.uname().machine in ("x86_64", "AMD64")
    flags = FLAGS + (["-mno-avx2", "-mno-fma"] if choice == "portable" and x86 else
                     ["-mno-avx512f"] if choice == "avx2" and x86 else [])
    if _compiler() is None:
        return None, "no C compiler found (cc, gcc, clang): numpy kernels"
    try:
        so = compiled(SOURCE, flags)
        lib = ctypes.CDLL(str(so))
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"the C kernels did not build ({e}): numpy kernels"
    i64, p = ctypes.c_int64, ctypes.c_void_p
    f, c_int = ctypes.c_float, ctypes.c_int
    lib.lanes_isa.restype = c_int
    lib.quant_q8_0.argtypes = [p, i64, i64, p, p]
    lib.quant_q8_K.argtypes = [p, i64, i64, p, p, p, p]
    lib.q80_mm.argtypes = [p, c_int, i64, i64, p, p, i64, p, i64, c_int]
    lib.q6k_mm.argtypes = [p, i64, i64, p, p, p, i64, c_int, p, i64, c_int]
    lib.q5k_mm.argtypes = [p, i64, i64, p, p, p, i64, c_int, p, i64, c_int]
    lib.q4k_mm.argtypes = [p, i64, i64, p, p, p, i64, i64, p, i64, c_int]
    lib.swiglu.argtypes = [p, p, p, i64, i64, c_int]
    lib.attn_f16.argtypes = [p, p, p, i64, i64, i64, i64, f, p, i64, c_int]
    lib.attn_f32.argtypes = [p, p, p, i64, i64, i64, i64, i64, f, p, i64, p, p, c_int]
    lib.rms_norm.argtypes = [p, p, p, i64, i64, f]
    lib.f32_mm.argtypes = [p, i64, i64, p, i64, p, c_int]
    lib.f32_mm.restype = None
    lib.lanes_set_spin.argtypes = [c_int]
    lib.rope_neox.argtypes = [p, i64, i64, i64, i64, p, p]
    lib.decode_layers.argtypes = [p, i64, ctypes.POINTER(DStep), p]
    lib.decode_layers.restype = c_int
    lib.moe_ffn_rows.argtypes = [p, p, p, i64, i64, p, i64, p, p, i64, p, i64, p, c_int]
    lib.moe_ffn_rows.restype = c_int
    lib.moe_scratch_peak.argtypes = [c_int]
    lib.moe_scratch_peak.restype = i64
    for fn in (lib.quant_q8_0, lib.quant_q8_K, lib.q80_mm, lib.q6k_mm, lib.q5k_mm, lib.q4k_mm, lib.swiglu, lib.attn_f16, lib.attn_f32,
               lib.rms_norm, lib.rope_neox, lib.lanes_set_spin):
        fn.restype = None
    lib.lanes_set_spin(spin_rounds())
    return lib, f"{so.name} ({ISA_NAMES[lib.lanes_isa()]})"


DL_N = 7                                # decode_layers' products: Q, K, V, O, gate, up, down


class DLayer(ctypes.Structure):
    """kernels/cpu_lanes.c dlayer_t: one layer's weights and its KV (slot 0) for decode_layers: a dense
    FFN (w's gate, up, down) or a routed one (router, exps), q/k norms or none."""
    _fields_ = [("attn_norm", ctypes.c_void_p), ("ffn_norm", ctypes.c_void_p), ("bias", ctypes.c_void_p * 3),
                ("w", ctypes.c_void_p * DL_N), ("wtype", ctypes.c_int64 * DL_N),
                ("kc", ctypes.c_void_p), ("vc", ctypes.c_void_p),
                ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p),
                ("router", ctypes.c_void_p), ("n_expert", ctypes.c_int64), ("n_used", ctypes.c_int64),
                ("norm_weights", ctypes.c_int64), ("n_ff_exp", ctypes.c_int64),
                ("exps", ctypes.c_void_p * 3), ("exps_type", ctypes.c_int64 * 3), ("exps_bytes", ctypes.c_int64 * 3)]


class DStep(ctypes.Structure):
    """kernels/cpu_lanes.c dstep_t: the shape of a decode step and its rows' positions and slots
    (pos, kv_slot: [n_rows] int64; cos, sin: [n_rows, n_rot / 2] f32)."""
    _fields_ = [("n_embd", ctypes.c_int64), ("n_head", ctypes.c_int64), ("n_head_kv", ctypes.c_int64),
                ("head_dim", ctypes.c_int64), ("n_rot", ctypes.c_int64), ("n_ff", ctypes.c_int64),
                ("n_rows", ctypes.c_int64), ("pos", ctypes.c_void_p), ("kv_slot", ctypes.c_void_p),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float),
                ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p), ("nth", ctypes.c_int)]


def spin_rounds() -> int:
    """BLOOMERY_CPU_SPIN: pause rounds a pool worker spins after a job before it sleeps (default
    500, tens of microseconds). Measured on the shared 2-core machine (load ~9, decode, -t 2): 20000
    rounds cost 83 ms of CPU a token, 500 rounds 55, 0 rounds 48-56, and the wall time fell with them."""
    raw = os.environ.get("BLOOMERY_CPU_SPIN", "500").strip()
    try:
        n = int(raw)
    except ValueError:
        raise ValueError(f"BLOOMERY_CPU_SPIN={raw!r}: expected a whole number of pause rounds (0 or more)") from None
    if n < 0:
        raise ValueError(f"BLOOMERY_CPU_SPIN={raw!r}: expected a whole number of pause rounds (0 or more)")
    return n


def lib() -> ctypes.CDLL | None:
    """The loaded kernels, or None where the numpy kernels are to be used."""
    global _LIB, _STATUS
    if _STATUS is None:
        with _LOCK:
            if _STATUS is None:
                _LIB, _STATUS = _load()
    return _LIB


def status() -> str:
    lib()
    return _STATUS or ""
