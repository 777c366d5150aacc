"""Host experts: kernels/host_moe.c, one MoE layer's routed experts computed on the host from
their stored GGUF blocks, spread over a pool of threads; its loader and its ctypes side.

The C function `host_moe(void *args)` reads a `host_moe_args` struct (mirrored by HostMoeArgs)
and writes out[T, D] = sum over the (token, slot) pairs whose expert is not flagged skip of
wts * down_e(silu(gate_e x) * up_e x). The cuda backend gives a persistent args_struct() per
layer and row count to a Bell, whose thread runs host_moe on it when a decode step's card kernel
posts a job (kernels/host_moe.c, "the doorbell"); tests and tools call host_moe_layer() with
numpy arrays. Calls from several threads are taken one at a time. BLOOMERY_HOST_SPIN_US (default
2000), or set_spin_us(), is how long idle workers spin for the next call before they sleep.

Its products are the CPU backend's: host_moe.c and kernels/cpu_lanes.c include the one
kernels/lanes_dot.h (the activations rounded as ggml's Q8_0 / Q8_K, each weight type's product in
llama.cpp's float order, swiglu with ggml_v_expf), so each (token, slot)'s down output has the bits
of the CPU backend's expert loop, and out those outputs times their weights added in slot order
(tests/test_host_moe.py says what is equal bit for bit). A row whose input is not finite comes
out NaN, as there.

Built like kernels/cpu_lanes.c (engine/cpu/kernels.py: `compiled`, the key covering lanes_dot.h
too), with -ffp-contract=off (the float steps as written, no fma of the compiler's own) and
-pthread, into `$BLOOMERY_CACHE/kernels/host_moe-<key>.so`. There is no slower fallback: where no
compiler is found or the build fails, lib() raises HostKernelError. isa "native" (the default;
BLOOMERY_HOST_ISA overrides it) builds the widest path the CPU has (AVX-512 VNNI, AVX2, or the
portable C loops, all with the same bits); "avx2" and "portable" build the narrower ones on an
x86 host (the tests check all three).

Legend: T = rows (tokens), A = experts per token, E = experts, D = hidden size,
F = expert FFN width.
"""
from __future__ import annotations

import ctypes
import os
import subprocess
import threading
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

from bloomery.engine.cpu.kernels import _compiler, _cpu_flags, compiled

SOURCE = "host_moe.c"
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-pthread", "-fPIC", "-shared"]
ISA_FLAGS = {"native": [], "avx2": ["-mno-avx512f"], "portable": ["-mno-avx2", "-mno-fma", "-mno-f16c"]}
ISA_NAMES = {0: "portable C", 1: "avx2", 2: "avx512-vnni"}
TYPES = frozenset({QT.Q4_0, QT.Q5_0, QT.Q8_0, QT.Q4_K, QT.Q5_K, QT.Q6_K})   # what host_moe.c reads

_X86 = os.uname().machine in ("x86_64", "AMD64")
_LOCK = threading.Lock()
_LIBS: dict[str, ctypes.CDLL] = {}


class HostKernelError(RuntimeError):
    """The host expert kernels cannot be built or loaded here (no C compiler, a failed build)."""


_p = ctypes.c_void_p


class HostMoeArgs(ctypes.Structure):
    """host_moe_args of kernels/host_moe.c, field for field."""
    _fields_ = [
        ("n_rows", ctypes.c_int32), ("n_used", ctypes.c_int32), ("d", ctypes.c_int32), ("f", ctypes.c_int32),
        ("gate_type", ctypes.c_int32), ("up_type", ctypes.c_int32), ("down_type", ctypes.c_int32),
        ("n_threads", ctypes.c_int32),
        ("gate_row_bytes", ctypes.c_int64), ("up_row_bytes", ctypes.c_int64), ("down_row_bytes", ctypes.c_int64),
        ("ids", _p), ("wts", _p), ("x", _p), ("out", _p),
        ("gate", _p), ("up", _p), ("down", _p), ("skip", _p),
        ("busy_ns", ctypes.c_int64),
    ]


def _isa_flags(isa: str) -> list[str]:
    if isa not in ISA_FLAGS:
        raise HostKernelError(f"host kernel isa {isa!r}: expected one of {', '.join(ISA_FLAGS)}")
    if not _X86:
        if isa == "avx2":
            raise HostKernelError(f"host kernel isa 'avx2' needs an x86 host, this one is {os.uname().machine}")
        return FLAGS                                # off x86 the native build is the portable C
    return FLAGS + ISA_FLAGS[isa]


def _load(isa: str) -> ctypes.CDLL:
    flags = _isa_flags(isa)
    cc = _compiler()
    if cc is None:
        raise HostKernelError("no C compiler found (cc, gcc, clang): the host expert kernels "
                              f"(kernels/{SOURCE}) need one; install gcc")
    try:
        so = compiled(SOURCE, flags)
        lib = ctypes.CDLL(str(so))
    except (OSError, subprocess.SubprocessError) as e:
        raise HostKernelError(f"the host expert kernels (kernels/{SOURCE}) did not build with {cc}: {e}") from e
    i32, i64 = ctypes.c_int, ctypes.c_int64
    lib.host_moe.argtypes, lib.host_moe.restype = [_p], None
    lib.host_moe_check.argtypes, lib.host_moe_check.restype = [_p], i32
    lib.host_moe_error.argtypes, lib.host_moe_error.restype = [i32], ctypes.c_char_p
    lib.host_moe_isa.restype = lib.host_moe_max_threads.restype = i32
    lib.host_moe_args_size.restype = i64
    lib.host_read_bw.argtypes, lib.host_read_bw.restype = [i64, i32, i32], ctypes.c_double
    lib.host_moe_last_phases.argtypes, lib.host_moe_last_phases.restype = [_p], i32
    lib.host_moe_set_spin_us.argtypes, lib.host_moe_set_spin_us.restype = [i64], None
    lib.host_moe_set_tuning.argtypes, lib.host_moe_set_tuning.restype = [i32, i32], i64
    lib.host_moe_bell_open.argtypes, lib.host_moe_bell_open.restype = [i32, i32, _p, _p, _p], _p
    lib.host_moe_bell_layers.argtypes, lib.host_moe_bell_layers.restype = [_p, i32], i32
    lib.host_moe_bell_arm.argtypes, lib.host_moe_bell_arm.restype = [_p, i64], None
    lib.host_moe_bell_served.argtypes, lib.host_moe_bell_served.restype = [_p], i64
    lib.host_moe_bell_close.argtypes, lib.host_moe_bell_close.restype = [_p], None
    if lib.host_moe_args_size() != ctypes.sizeof(HostMoeArgs):
        raise HostKernelError(f"kernels/{SOURCE}: host_moe_args is {lib.host_moe_args_size()} bytes, "
                              f"the Python mirror {ctypes.sizeof(HostMoeArgs)}")
    return lib


def _isa(isa: str | None) -> str:
    return isa or os.environ.get("BLOOMERY_HOST_ISA", "native").strip().lower() or "native"


def lib(isa: str | None = None) -> ctypes.CDLL:
    """The loaded host kernels for `isa` (default BLOOMERY_HOST_ISA, else "native"), built once.
    Each isa is its own library with its own pool of workers."""
    isa = _isa(isa)
    if isa not in _LIBS:
        with _LOCK:
            if isa not in _LIBS:
                _LIBS[isa] = _load(isa)
    return _LIBS[isa]


def status(isa: str | None = None) -> str:
    """One line for the start record: which path runs, and whether the CPU offers a wider one."""
    got = lib(isa).host_moe_isa()
    line = f"{SOURCE}: {ISA_NAMES.get(got, got)}, {lib(isa).host_moe_max_threads()} cpus"
    if got < 2 and "avx512_vnni" in _cpu_flags().split() and _isa(isa) == "native":
        line += " (the CPU has AVX-512 VNNI; this compiler did not use it)"
    return line


def read_bandwidth_gbs(n_bytes: int = 1 << 30, n_threads: int = 0, reps: int = 5, isa: str | None = None) -> float:
    """The host's memory read bandwidth (GB/s, best of reps): n_threads threads sum an n_bytes buffer."""
    return lib(isa).host_read_bw(n_bytes, n_threads, reps)


def set_spin_us(us: int, isa: str | None = None) -> None:
    """How long idle workers spin for the next call before they sleep (default 2000 µs, or
    BLOOMERY_HOST_SPIN_US): keep it long where calls come every layer while the card works, make
    it short (or 0) where the caller's other threads need the cores between calls."""
    lib(isa).host_moe_set_spin_us(us)


def set_tuning(units: int = -1, prefetch: int = -1, isa: str | None = None) -> tuple[int, int]:
    """How host_moe cuts a call and reads ahead (below 0: unchanged): a gate/up or down phase takes units of fewer
    rows until it has `units` units a thread (0, the default: the fixed 16 and 32 rows; or BLOOMERY_HOST_UNITS),
    and a one-row product asks for the bytes `prefetch` ahead of each row it reads (default 2048, or
    BLOOMERY_HOST_PREFETCH; 0: none). For tools/bench_host_moe.py's sweeps; no setting changes a result's bits.
    Returns the settings before (units, prefetch)."""
    was = int(lib(isa).host_moe_set_tuning(units, prefetch))
    return was >> 32, was & 0xFFFFFFFF


def last_phases_us(isa: str | None = None) -> list[float]:
    """The last host_moe call: µs from its start to the end of each phase (quantize, gate/up,
    swiglu, down, sum), as the pool's clock saw them."""
    out = (ctypes.c_double * 8)()
    return list(out[:lib(isa).host_moe_last_phases(out)])


BELL_WORD = 64                 # the job word is BELL_WORD n + T (BELL_WORD in kernels/host_moe.c and moe.cu)


class Bell:
    """The doorbell of kernels/host_moe.c: a thread that serves host_moe jobs the card posts.

    post and done: int64 [max_layers] arrays the card maps (pinned; plain numpy in the CPU tests),
    all zero; the card writes post[l] = BELL_WORD n + T for its n-th job of layer l with T rows, the
    thread runs host_moe on args `set_args(l, T, ...)` gave, then stores the word in done[l].
    arm(n) before a step that will post n jobs (the thread sleeps when none is due)."""

    def __init__(self, max_layers: int, rows: int, post: np.ndarray, done: np.ndarray, isa: str | None = None):
        for name, a in (("post", post), ("done", done)):
            if a.dtype != np.int64 or a.shape != (max_layers,) or not a.flags.c_contiguous:
                raise ValueError(f"Bell: {name} must be int64 [{max_layers}], contiguous; got {a.dtype} {a.shape}")
        if not 1 <= rows < BELL_WORD:
            raise ValueError(f"Bell: rows {rows} must lie in 1 .. {BELL_WORD - 1} (the job word keeps T in 6 bits)")
        self.max_layers, self.rows, self.post, self.done = max_layers, rows, post, done
        self.table = np.zeros(max_layers * (rows + 1), np.uint64)          # [L, T + 1] host_moe_args addresses
        self._args: dict[tuple[int, int], HostMoeArgs] = {}
        self._lib = lib(isa)
        self._h = self._lib.host_moe_bell_open(max_layers, rows, self.table.ctypes.data, post.ctypes.data,
                                               done.ctypes.data)
        if not self._h:
            raise HostKernelError("host_moe_bell_open: the bell thread could not be started")
        self.n_layers = 0

    def set_args(self, layer: int, t: int, args: HostMoeArgs) -> None:
        """The args of layer `layer`'s jobs of t rows (kept alive here); layers 0 .. layer may post after."""
        if not (0 <= layer < self.max_layers and 1 <= t <= self.rows):
            raise ValueError(f"Bell.set_args: layer {layer} of {self.max_layers}, rows {t} of 1 .. {self.rows}")
        self._args[(layer, t)] = args
        self.table[layer * (self.rows + 1) + t] = ctypes.addressof(args)
        if layer + 1 > self.n_layers:
            self.n_layers = layer + 1
            self._lib.host_moe_bell_layers(self._h, self.n_layers)

    def arm(self, jobs: int) -> None:
        self._lib.host_moe_bell_arm(self._h, jobs)

    @property
    def served(self) -> int:
        return int(self._lib.host_moe_bell_served(self._h))

    def close(self) -> None:
        if self._h:
            self._lib.host_moe_bell_close(self._h)
            self._h = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


# ---------------------------------------------------------------- the Python side

def row_bytes(ggml_type: int, row_len: int) -> int:
    elems, nbytes = GGML_QUANT_SIZES[QT(ggml_type)]
    return row_len // elems * nbytes


def _check_type(what: str, ggml_type: int, row_len: int) -> None:
    qt = QT(ggml_type)
    if qt not in TYPES:
        raise ValueError(f"{what}: {qt.name} has no host kernel; the host computes "
                         f"{', '.join(sorted(t.name for t in TYPES))}")
    elems = GGML_QUANT_SIZES[qt][0]
    if row_len % elems:
        raise ValueError(f"{what}: {qt.name} rows of {row_len} are not a whole number of {elems}-element blocks")


@dataclass(frozen=True)
class ExpertStack:
    """A stacked GGUF expert tensor (ne = [row_len, n_rows, n_experts]): expert e's n_rows rows
    of row_bytes each start at data + e * n_rows * row_bytes, as stored in the file."""
    data: np.ndarray        # uint8, n_experts * n_rows * row_bytes bytes, contiguous
    ggml_type: int
    n_rows: int             # N: output rows of each expert's matrix
    row_len: int            # K: elements per row

    @property
    def row_bytes(self) -> int:
        return row_bytes(self.ggml_type, self.row_len)

    @property
    def n_experts(self) -> int:
        return self.data.nbytes // (self.n_rows * self.row_bytes)

    def pointers(self) -> np.ndarray:
        """[E] uint64: the address of each expert's first row."""
        if not self.data.flags.c_contiguous or self.data.nbytes % (self.n_rows * self.row_bytes):
            raise ValueError(f"{QT(self.ggml_type).name} expert stack: {self.data.nbytes} bytes are not whole "
                             f"experts of {self.n_rows} rows x {self.row_bytes} bytes, or not contiguous")
        base = self.data.ctypes.data
        return base + np.arange(self.n_experts, dtype=np.uint64) * np.uint64(self.n_rows * self.row_bytes)


def _addr(v) -> int:
    return v.ctypes.data if isinstance(v, np.ndarray) else int(v or 0)


def args_struct(*, d: int, f: int, n_used: int, gate_type: int, up_type: int, down_type: int,
                gate, up, down, skip, n_rows: int = 1, n_threads: int = 0,
                ids=0, wts=0, x=0, out=0) -> HostMoeArgs:
    """A persistent host_moe_args (for Bell.set_args, or host_moe through its address). gate / up /
    down: the [E] expert address tables, a uint64 numpy array (used in place: rewriting an entry moves that expert) or a sequence of ints (copied into one,
    kept as .gate_ptrs / .up_ptrs / .down_ptrs); skip: [E] uint8 numpy array (used in place) or
    an address; ids, wts, x, out: numpy arrays or addresses (pinned buffers), settable later
    through the struct's fields, as is n_rows."""
    _check_type("gate", gate_type, d)
    _check_type("up", up_type, d)
    _check_type("down", down_type, f)
    tables = []
    for name, t in (("gate", gate), ("up", up), ("down", down)):
        arr = t if isinstance(t, np.ndarray) and t.dtype == np.uint64 else np.asarray(list(t), dtype=np.uint64)
        tables.append(arr)
    if len({len(t) for t in tables}) != 1:
        raise ValueError(f"expert tables differ in length: gate {len(tables[0])}, up {len(tables[1])}, down {len(tables[2])}")
    if isinstance(skip, np.ndarray) and (skip.dtype != np.uint8 or skip.size != len(tables[0])):
        raise ValueError(f"skip: expected uint8 [{len(tables[0])}], got {skip.dtype} {skip.shape}")
    a = HostMoeArgs(n_rows=n_rows, n_used=n_used, d=d, f=f, gate_type=int(gate_type), up_type=int(up_type),
                    down_type=int(down_type), n_threads=n_threads,
                    gate_row_bytes=row_bytes(gate_type, d), up_row_bytes=row_bytes(up_type, d),
                    down_row_bytes=row_bytes(down_type, f),
                    ids=_addr(ids), wts=_addr(wts), x=_addr(x), out=_addr(out),
                    gate=tables[0].ctypes.data, up=tables[1].ctypes.data, down=tables[2].ctypes.data,
                    skip=_addr(skip), busy_ns=0)
    a.gate_ptrs, a.up_ptrs, a.down_ptrs = tables
    a._keep = (skip, ids, wts, x, out)               # the arrays the struct points into stay alive
    return a


def check_args(args: HostMoeArgs, isa: str | None = None) -> None:
    """Raise ValueError naming what host_moe would refuse in `args` (it writes NaN instead)."""
    code = lib(isa).host_moe_check(ctypes.addressof(args))
    if code:
        raise ValueError(f"host_moe_args: {lib(isa).host_moe_error(code).decode()}")


def host_moe_layer(x: np.ndarray, ids: np.ndarray, wts: np.ndarray, gate: ExpertStack, up: ExpertStack,
                   down: ExpertStack, skip: np.ndarray | None = None, n_threads: int = 0,
                   isa: str | None = None) -> np.ndarray:
    """out [T, D] f32 = sum over slots a with skip[ids[t, a]] == 0, in slot order, of
    wts[t, a] * down_e(silu(gate_e x_t) * up_e x_t), e = ids[t, a]; computed by host_moe."""
    x = np.ascontiguousarray(x, dtype=np.float32)                        # [T, D]
    ids = np.ascontiguousarray(ids, dtype=np.int32)                      # [T, A]
    wts = np.ascontiguousarray(wts, dtype=np.float32)                    # [T, A]
    if x.ndim != 2 or ids.ndim != 2 or ids.shape != wts.shape or ids.shape[0] != x.shape[0] or x.shape[0] < 1:
        raise ValueError(f"host_moe_layer: x {x.shape}, ids {ids.shape}, wts {wts.shape}: expected [T, D], [T, A], [T, A]")
    n_tok, d = x.shape
    f = gate.n_rows
    for name, st, rows, cols in (("gate", gate, f, d), ("up", up, f, d), ("down", down, d, f)):
        if (st.n_rows, st.row_len) != (rows, cols):
            raise ValueError(f"host_moe_layer: {name} experts are [{st.n_rows}, {st.row_len}], expected [{rows}, {cols}]")
    n_exp = gate.n_experts
    if up.n_experts != n_exp or down.n_experts != n_exp:
        raise ValueError(f"host_moe_layer: expert counts differ: gate {n_exp}, up {up.n_experts}, down {down.n_experts}")
    if ids.size and (ids.min() < 0 or ids.max() >= n_exp):
        raise ValueError(f"host_moe_layer: expert ids must lie in [0, {n_exp}), got {ids.min()}..{ids.max()}")
    skip = np.zeros(n_exp, np.uint8) if skip is None else np.ascontiguousarray(skip, dtype=np.uint8)
    if skip.shape != (n_exp,):
        raise ValueError(f"host_moe_layer: skip is {skip.shape}, expected [{n_exp}]")
    out = np.empty((n_tok, d), np.float32)                               # [T, D]
    args = args_struct(d=d, f=f, n_used=ids.shape[1], gate_type=gate.ggml_type, up_type=up.ggml_type,
                       down_type=down.ggml_type, gate=gate.pointers(), up=up.pointers(), down=down.pointers(),
                       skip=skip, n_rows=n_tok, n_threads=n_threads, ids=ids, wts=wts, x=x, out=out)
    check_args(args, isa)
    lib(isa).host_moe(ctypes.addressof(args))                            # ctypes lets the GIL go
    return out
