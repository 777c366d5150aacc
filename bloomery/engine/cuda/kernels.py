"""The one loader of kernels/*.cu: each module from its prebuilt fatbin where one covers the card,
else compiled by NVRTC through CuPy RawModule, once per card.

The fatbins ship in the wheel (fatbin.py builds them with nvcc; bloomery/engine/cuda/prebuilt/)
and are taken only when built from today's source. The modules without one compile in parallel,
one thread each, from the moment the backend is made, so they compile while the weights load;
wait() joins them before the warm-up and says how each module came. BLOOMERY_CUDA_KERNELS
chooses: auto (the default), nvrtc (compile every module), prebuilt (compile none: fatbin.plan).

CuPy caches each compiled module on disk keyed by its source, options and the card's
architecture; we point that cache at ~/.cache/bloomery/kernels (BLOOMERY_CACHE moves it)
unless CUPY_CACHE_DIR is set. `#include "x.cuh"` lines are inlined (fatbin.source), so NVRTC
needs no include path and the cache key covers the headers too.

Every kernel is launched through one Launcher: CuPy's own launch, or, while `Kernels.pdl` is
set (a decode step being captured, cuda_graph.py), the driver's cuLaunchKernelEx with the
programmatic-stream-serialization attribute, so each kernel of the captured step starts while
the one before drains (every kernel waits for it in pdl_wait(), common.cuh). CuPy cannot set
launch attributes, so that launch goes through ctypes.
"""
from __future__ import annotations

import ctypes
import os
import re
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from bloomery.engine.cuda import fatbin
from bloomery.engine.cuda.fatbin import MODULES, OPTIONS, source
from bloomery.kernels import cache_dir, kernel_dir  # noqa: F401  (kernel_dir: the tests' way to the sources)

BIG_SMEM = frozenset({"moe_gate_up_s", "moe_down_s"})    # kernels whose shared memory may pass 48 KiB


_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION = 6       # CUlaunchAttributeID (cuda.h)
_SMEM_DEFAULT = 48 << 10                           # dynamic shared memory without the opt-in


class _LaunchAttr(ctypes.Structure):               # CUlaunchAttribute: id, pad to 8, a 64-byte union
    _fields_ = [("id", ctypes.c_uint), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _LaunchConfig(ctypes.Structure):             # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttr)), ("n_attrs", ctypes.c_uint)]


_ARG_TYPES = {np.int32: ctypes.c_int32, np.int64: ctypes.c_int64, np.uint64: ctypes.c_uint64,
              np.float32: ctypes.c_float, np.uint32: ctypes.c_uint32}


def c_args(args) -> list:
    """Kernel arguments as ctypes values, the way CuPy passes them: an array as its device
    address, a numpy scalar as its own C type. Other Python values are refused by name."""
    import cupy
    out = []
    for i, a in enumerate(args):
        if isinstance(a, cupy.ndarray):
            out.append(ctypes.c_uint64(a.data.ptr))
        elif type(a) in _ARG_TYPES:
            out.append(_ARG_TYPES[type(a)](a.item()))
        else:
            raise TypeError(f"kernel argument {i} is a {type(a).__name__}: pass a CuPy array or a numpy "
                            f"int32/int64/uint32/uint64/float32")
    return out


def _dims(d) -> tuple:
    d = (d,) if isinstance(d, int) else tuple(int(v) for v in d)
    return d + (1,) * (3 - len(d))


class _Driver:
    """cuLaunchKernelEx from libcuda, loaded on first use."""
    _lib = None

    @classmethod
    def launch_pdl(cls, func_ptr: int, grid, block, args, shared_mem: int, stream_ptr: int) -> None:
        if cls._lib is None:
            lib = ctypes.CDLL("libcuda.so.1")
            lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p,
                                             ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
            lib.cuLaunchKernelEx.restype = ctypes.c_int
            lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
            cls._lib = lib
        attr = _LaunchAttr(id=_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION)
        attr.value[0] = 1
        cfg = _LaunchConfig(grid=(ctypes.c_uint * 3)(*_dims(grid)), block=(ctypes.c_uint * 3)(*_dims(block)),
                            shared=shared_mem, stream=stream_ptr, attrs=ctypes.pointer(attr), n_attrs=1)
        vals = c_args(args)
        params = (ctypes.c_void_p * max(1, len(vals)))(*[ctypes.addressof(v) for v in vals])
        rc = cls._lib.cuLaunchKernelEx(ctypes.byref(cfg), func_ptr, params, None)
        if rc:
            msg = ctypes.c_char_p()
            cls._lib.cuGetErrorString(rc, ctypes.byref(msg))
            raise RuntimeError(f"cuLaunchKernelEx failed ({rc}): {(msg.value or b'').decode()}")


class Launcher:
    """One kernel: fn(grid, block, args, shared_mem=0) as CuPy's RawKernel call, through the
    PDL launch while the owning Kernels has pdl set."""

    def __init__(self, owner: "Kernels", fn, big_smem: bool = False):
        self._owner, self.fn, self._smem_ok = owner, fn, _SMEM_DEFAULT
        if big_smem:                              # opted in at load, never inside a graph capture
            import cupy
            optin = int(cupy.cuda.Device().attributes["MaxSharedMemoryPerBlockOptin"])
            self._smem_ok = optin - int(fn.shared_size_bytes)
            fn.max_dynamic_shared_size_bytes = self._smem_ok

    def __call__(self, grid, block, args, shared_mem: int = 0):
        if shared_mem > self._smem_ok:            # the opt-in for more than 48 KiB, once per size
            self.fn.max_dynamic_shared_size_bytes = shared_mem
            self._smem_ok = shared_mem
        if self._owner.pdl:
            import cupy
            _Driver.launch_pdl(self.fn.kernel.ptr, grid, block, args, shared_mem,
                               cupy.cuda.get_current_stream().ptr)
        else:
            self.fn(grid, block, args, shared_mem=shared_mem)

    def occupancy(self, block: int, shared_mem: int = 0) -> int:
        """Blocks of `block` threads one SM holds at once (the driver's occupancy count)."""
        from cupy.cuda import driver
        return int(driver.occupancyMaxActiveBlocksPerMultiprocessor(self.fn.kernel.ptr, block, shared_mem))


def kernel_names(src: str) -> list[str]:
    """The kernels a module's source defines: its extern "C" __global__ functions and the ones its
    macros make (one per macro line)."""
    names = re.findall(r'extern "C" __global__ void (?:__launch_bounds__\([^)]*\)\s+)?(?!__launch_bounds__)(\w+)\(', src)
    names += [f"mmv3_b{n}" for n in re.findall(r"^MMV3\((\d+)\)", src, re.M)]
    names += [f"mmv3n_b{n}" for n in re.findall(r"^MMV3N\((\d+)\)", src, re.M)]
    names += [f"attn_dec_{a}_{b}" for a, b in re.findall(r"^ATTN_DEC\((\d+), (\d+)\)", src, re.M)]
    names += [f"moe_route_w{n}" for n in re.findall(r"^MOE_ROUTE_W\((\d+)\)", src, re.M)]
    names += [f"moe_mm_{k}_{n}" for n in re.findall(r"^MOE_MM\(\w+, (\w+)\)", src, re.M) for k in ("gu", "dn")]
    return names


def _compile(cupy, name: str, device: int):
    """One module through NVRTC (CuPy's disk cache first), in a worker thread: the card made
    current there, since a new thread has none. Returns the loaded module and its seconds."""
    t = time.monotonic()
    cupy.cuda.Device(device).use()
    mod = cupy.RawModule(code=source(name), options=OPTIONS)
    try:
        mod.compile()
    except Exception as e:
        raise RuntimeError(f"compiling kernels/{name}.cu with NVRTC failed: {type(e).__name__}: {e}") from e
    return mod, time.monotonic() - t


class Kernels:
    """Functions by name across the modules. Made: the prebuilt modules load and the rest start
    compiling (fatbin.plan); wait() joins them. `pdl`: launch with programmatic dependent launch
    (set while a decode step is captured)."""

    def __init__(self):
        self.pdl = False
        import cupy
        os.environ.setdefault("CUPY_CACHE_DIR", str(cache_dir()))
        self._cupy = cupy
        self._mods: dict[str, object] = {}
        self._fns: dict[str, object] = {}
        self._where = {fn: mod for mod in MODULES for fn in kernel_names(source(mod))}
        dev = cupy.cuda.Device()
        self.arch = f"sm_{dev.compute_capability}"
        self.mode = os.environ.get("BLOOMERY_CUDA_KERNELS", "auto")
        plan = fatbin.plan(dev.compute_capability, self.mode)
        self.report: dict[str, tuple[str, float, str]] = {}   # module -> (how it came, seconds, why)
        self._why = {m: why for m, (how, _, why) in plan.items() if how == "nvrtc"}
        for m, (how, path, why) in plan.items():
            if how != "prebuilt":
                continue
            t = time.monotonic()
            mod = cupy.RawModule(path=path)
            try:
                mod.compile()                 # cuModuleLoad: the driver takes the card's cubin
            except Exception as e:            # e.g. a driver older than the nvcc that built it: compile instead
                why = f"the fatbin did not load: {type(e).__name__}: {e}"
                if self.mode == "prebuilt":
                    raise RuntimeError(f"BLOOMERY_CUDA_KERNELS=prebuilt: {path}: {why}") from e
                self._why[m] = why
                continue
            self._mods[m] = mod
            self.report[m] = ("prebuilt", time.monotonic() - t, why)
        self._pending: dict[str, Future] = {}
        if self._why:
            pool = ThreadPoolExecutor(max_workers=len(self._why), thread_name_prefix="nvrtc")
            self._pending = {m: pool.submit(_compile, cupy, m, dev.id) for m in self._why}
            pool.shutdown(wait=False)         # the threads end with their compile

    def _join(self, mod: str) -> None:
        fut = self._pending.pop(mod, None)
        if fut is not None:
            self._mods[mod], took = fut.result()
            self.report[mod] = ("compiled", took, self._why[mod])

    def wait(self) -> dict[str, str]:
        """Every module loaded (the compiles joined); how each came, for the start record:
        arch, mode, and `prebuilt` / `compiled` as "module seconds s (why)" lists."""
        for mod in list(self._pending):
            self._join(mod)
        out = {"arch": self.arch, "mode": self.mode}
        for how in ("prebuilt", "compiled"):
            got = [f"{m} {took:.3f} s" + ("" if how == "prebuilt" and why == "cubin" else f" ({why})")
                   for m, (h, took, why) in self.report.items() if h == how]
            if got:
                out[how] = ", ".join(got)
        return out

    def compile_all(self) -> None:
        self.wait()
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
                self._join(mod)
            self._fns[fn] = Launcher(self, self._mods[mod].get_function(fn), big_smem=fn in BIG_SMEM)
        return self._fns[fn]
