"""The cuda backend of the ops (CuPy arrays, kernels/*.cu), chosen where CuPy sees a card.

Weights stay in their GGUF blocks on the card. Batches of up to MMV_ROWS rows (decode, and
short prompts) go through the mat-vec kernels, which read the blocks in place against an
int8-per-32 form of the activation (from MMT_MIN_ROWS rows Q4_K / Q6_K weights take mmt, the
tensor cores, against its f16 form); longer batches dequantize to f16 and run cuBLAS
tensor-core GEMMs. The attention and MoE steps live in cuda_attention.py and cuda_moe.py;
the captured decode step in cuda_graph.py.

Legend: T = rows in the batch, K = a weight's row length, N = its rows, D = hidden size.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from contextlib import contextmanager
from typing import Sequence

import cupy
import numpy as np

from bloomery.engine.cuda import attention as cuda_attention
from bloomery.engine.cuda import moe as cuda_moe
from bloomery.engine.cuda import recurrent as cuda_recurrent
from bloomery.engine.cuda.gemm import gemm_nt
from bloomery.engine.cuda.kernels import Kernels
from bloomery.engine.ops import Caps, Rows, delta_gates
from bloomery.engine.cuda.sizes import (DECODE_ROWS as MMV_ROWS, GREEDY_BANS, MMT_MIN_ROWS, MMT_ROWS, MMT_TYPES,
                                       MMV3N_ROWS, MMV_SIZES, UBATCH)

TOPK_MAX, TOPK_SPAN = 64, 4096     # topk's largest k, and the values one block sorts (matvec.cu)
F32, F16, BF16 = 0, 1, 30
BLOCKS = {0: (1, 4), 1: (1, 2), 30: (1, 2), 2: (32, 18), 6: (32, 22), 8: (32, 34),
          12: (256, 144), 13: (256, 176), 14: (256, 210)}    # ggml type -> (values, bytes) per block
NAMES = {0: "F32", 1: "F16", 30: "BF16", 2: "Q4_0", 6: "Q5_0", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}
FLOAT_TYPES = (F32, F16, BF16)
_NULL = np.uint64(0)
MMV_MATS = 4                 # weights one mmv3 / mmv3n / mmt launch takes (MAT_PARAMS in matvec.cu)


def _i32(v) -> np.int32:
    return np.int32(v)


def _grid(n: int, per: int) -> int:
    return max(1, (n + per - 1) // per)


class CudaWeight:
    """A tensor on the card: its bytes as stored, plus its 1-D form as f32 for vectors, and a
    device table of each expert's address for stacked [K, N, E] expert tensors."""

    def __init__(self, ggml_type: int, shape: Sequence[int], data: np.ndarray, to_card=None):
        if ggml_type not in BLOCKS:
            raise ValueError(f"ggml type {ggml_type} is not served by the cuda backend "
                             f"(it reads {', '.join(NAMES.values())})")
        self.ggml_type, self.shape = ggml_type, tuple(int(s) for s in shape)
        self.n_cols = self.shape[0]
        self.n_rows = self.shape[1] if len(self.shape) > 1 else 1
        self.n_expert = self.shape[2] if len(self.shape) > 2 else 1
        qk, nb = BLOCKS[ggml_type]
        if self.n_cols % qk:
            raise ValueError(f"a {NAMES[ggml_type]} row of {self.n_cols} values is not whole blocks of {qk}")
        self.row_bytes = self.n_cols // qk * nb
        raw = np.ascontiguousarray(data).view(np.uint8)
        self.data = to_card(raw) if to_card is not None else cupy.asarray(raw)   # [n_bytes]
        self.vec = None
        if len(self.shape) == 1:        # norms and biases: f32 on the card
            self.vec = cupy.asarray(_host_vector(ggml_type, np.asarray(data)))
        self.expert_bytes = self.row_bytes * self.n_rows
        self.table = None
        if self.n_expert > 1:
            base = self.data.data.ptr
            self.table = cupy.asarray(np.array([base + e * self.expert_bytes for e in range(self.n_expert)],
                                               np.uint64))                       # [E]

    @property
    def quantized(self) -> bool:
        return self.ggml_type not in FLOAT_TYPES

    @property
    def n_bytes(self) -> int:
        return int(self.data.size)


def _fused_recurrent() -> bool:
    """BLOOMERY_CUDA_RECURRENT: fused (the default: the recurrent layers' delta rule, and their conv's decode rows,
    in one kernel each, kernels/recurrent.cu) or array (the array code of recurrent.py; for comparison)."""
    how = os.environ.get("BLOOMERY_CUDA_RECURRENT", "fused")
    if how not in ("fused", "array"):
        raise ValueError(f"BLOOMERY_CUDA_RECURRENT={how!r}: one of fused, array")
    return how == "fused"


def _rows_f32(a):
    """a [B, ...] as f32 whose rows may lie apart but whose row is contiguous (a view where it is)."""
    a = a.astype(cupy.float32, copy=False)
    if a.ndim >= 2 and a.shape[0] and a[0].flags.c_contiguous and a.strides[0] > 0:
        return a
    return cupy.ascontiguousarray(a)


def _dense_f32(w: CudaWeight):
    """A float weight as f32 [N, K] on the card: a view of an F32 tensor's bytes, else a conversion made per
    call (nothing cached: a call inside a captured decode step must not leave an array the graph's pool owns)."""
    if w.ggml_type == F32:
        return w.data.view(cupy.float32).reshape(w.n_rows * w.n_expert, w.n_cols)
    if w.ggml_type == F16:
        return w.data.view(cupy.float16).reshape(w.n_rows * w.n_expert, w.n_cols).astype(cupy.float32)
    if w.ggml_type == BF16:
        bits = w.data.view(cupy.uint16).reshape(w.n_rows * w.n_expert, w.n_cols).astype(cupy.uint32)
        return (bits << 16).view(cupy.float32)
    raise ValueError(f"a {NAMES.get(w.ggml_type, w.ggml_type)} tensor of shape {w.shape}: the cuda backend reads "
                     f"this one as floats only (F32, F16 or BF16)")


_ELEMENTWISE: dict[str, object] = {}


def _elementwise(name: str, body: str):
    """A float32 -> float32 cupy.ElementwiseKernel, made once (CuPy compiles it per layout on first use)."""
    fn = _ELEMENTWISE.get(name)
    if fn is None:
        fn = _ELEMENTWISE[name] = cupy.ElementwiseKernel("float32 x", "float32 y", body, f"bloomery_{name}")
    return fn


def _sigmoid():
    return _elementwise("sigmoid", "y = 1.0f / (1.0f + expf(-x))")


def _softplus():
    return _elementwise("softplus", "y = x > 20.0f ? x : logf(1.0f + expf(x))")


def _silu():
    return _elementwise("silu", "y = x / (1.0f + expf(-x))")


def _host_vector(ggml_type: int, data: np.ndarray) -> np.ndarray:
    if ggml_type == F32:
        return data.view(np.float32).copy()
    if ggml_type == F16:
        return data.view(np.float16).astype(np.float32)
    if ggml_type == BF16:
        return (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    raise ValueError(f"a 1-D tensor of type {NAMES.get(ggml_type, ggml_type)} is not served")


class CudaOps:
    name = "cuda"
    caps = Caps(n_ubatch=UBATCH, decode_rows=MMV_ROWS, fused_head=False, decode_graphs=True, prompt_scratch=True,
                recurrent=True, greedy_bans=GREEDY_BANS)

    def __init__(self):
        self.k = Kernels()
        self.n_sm = int(cupy.cuda.Device().attributes["MultiProcessorCount"])
        self._q8: OrderedDict[tuple, tuple] = OrderedDict()  # (address, size) -> (x, xq, xd, xs)
        self._h: OrderedDict[tuple, tuple] = OrderedDict()   # (address, size) -> (x, its f16 form)
        self._runners: dict[int, object] = {}
        self.offload = None                                  # experts.Offload once host experts are loaded
        self._occupancy: dict[tuple, int] = {}
        self._uploader = None                                # upload.Uploader while a model loads
        # decode-sized products of Q4_K / Q6_K weights on the tensor cores (mmt); BLOOMERY_MMT=0 keeps
        # them on the int8 mat-vec kernels (mmv3, mmv3n), for comparing the two
        self.mmt = os.environ.get("BLOOMERY_MMT", "1") != "0"
        self.mmt_min = int(os.environ.get("BLOOMERY_MMT_MIN", MMT_MIN_ROWS))    # for measuring where mmt starts to pay
        # decode rows from which the experts take moe_mt_* (moe.MT_MIN_ROWS: none by default), for measuring
        self.moe_mt_min = int(os.environ.get("BLOOMERY_CUDA_MOE_MT_MIN", cuda_moe.MT_MIN_ROWS))

    def decode_runner(self, model):
        """The model's captured decode steps (cuda_graph.DecodeGraphs), made on first use."""
        from bloomery.engine.cuda.graph import DecodeGraphs
        if id(model) not in self._runners:
            self._runners[id(model)] = DecodeGraphs(model)
        return self._runners[id(model)]

    # --- weights ---
    @contextmanager
    def loading(self):
        """While a model loads: its weights reach the card through several reader threads (upload.py)."""
        from bloomery.engine.cuda.upload import Uploader
        with Uploader() as self._uploader:
            try:
                yield
            finally:
                self._uploader = None

    def weight(self, ggml_type: int, shape: Sequence[int], data) -> CudaWeight:
        return CudaWeight(ggml_type, shape, data, self._uploader.to_card if self._uploader is not None else None)

    def offload_experts(self, residency: bool, threads: int) -> None:
        from bloomery.engine.cuda.experts import Offload
        self.offload = Offload(self, residency, threads)

    def offloaded_weight(self, name: str, ggml_type: int, shape: Sequence[int], data, host: tuple[int, int]):
        if self.offload is None:
            raise ValueError("offloaded_weight before offload_experts")
        if ggml_type not in BLOCKS or ggml_type in FLOAT_TYPES or len(shape) != 3:
            raise ValueError(f"host experts are quantized stacked tensors [K, N, E]; got {NAMES.get(ggml_type, ggml_type)} "
                             f"of shape {tuple(shape)}")
        from bloomery.engine.cpu.host_moe import TYPES
        if ggml_type not in TYPES:
            raise ValueError(f"host experts of type {NAMES.get(ggml_type, ggml_type)} have no host kernel "
                             f"(kernels/host_moe.c reads {', '.join(sorted(NAMES.get(int(t), str(t)) for t in TYPES))})")
        qk, nb = BLOCKS[ggml_type]
        return self.offload.stack(name, ggml_type, shape, np.asarray(data), int(shape[0]) // qk * nb, host)

    def after_step(self, decode: bool) -> None:
        if self.offload is not None:
            self.offload.after_step(decode)

    def get_rows(self, w: CudaWeight, ids):
        ids = self.from_host(ids).astype(cupy.int32, copy=False)
        out = cupy.empty((ids.size, w.n_cols), cupy.float32)                     # [T, K]
        self.k.get_rows((ids.size,), (128,), (w.data, _i32(w.ggml_type), np.int64(w.row_bytes),
                                             _i32(w.n_cols), ids, out))
        return out

    # --- the activation's int8 form, made once per activation ---
    def remember_q8(self, x, xq, xd, xs) -> None:
        """x's int8-per-32 form, made by the kernel that wrote x. It is found again for x and for any
        contiguous view of x's bytes (a reshape of [T, H, S] to [T, H*S]: its blocks of 32 are the same
        values in the same order); the entry holds x, so its memory is not reused while remembered."""
        self._q8[(x.data.ptr, x.size)] = (x, xq, xd, xs)
        while len(self._q8) > 8:
            self._q8.popitem(last=False)

    def remember_f16(self, x, xh) -> None:
        """x's f16 form, made by the kernel that wrote x; found again by f16() as remember_q8's are by q8()."""
        self._h[(x.data.ptr, x.size)] = (x, xh)
        while len(self._h) > 8:
            self._h.popitem(last=False)

    def q8(self, x):
        t, k = x.shape
        if k % 32:
            raise ValueError(f"a row of {k} values cannot be quantized in blocks of 32")
        got = self._q8.get((x.data.ptr, x.size)) if x.flags.c_contiguous and x.dtype == cupy.float32 else None
        if got is not None:
            return got[1:]
        xq = cupy.empty((t, k), cupy.int8)
        xd = cupy.empty((t, k // 32), cupy.float32)
        xs = cupy.empty((t, k // 32), cupy.float32)
        n_blocks = t * k // 32
        self.k.quantize_q8((_grid(n_blocks, 8),), (256,), (x, _i32(k), _i32(n_blocks), xq, xd, xs))
        self.remember_q8(x, xq, xd, xs)
        return xq, xd, xs

    # --- matrix products ---
    def matmul(self, x, w: CudaWeight, residual=None):
        return self._products(x, [w], [None], [residual])[0]

    def matmuls(self, x, ws, biases):
        return self._products(x, list(ws), list(biases), [None] * len(ws))

    def _products(self, x, ws, biases, residuals):
        x = cupy.ascontiguousarray(x, dtype=cupy.float32)                         # [T, K]
        for w in ws:
            if x.shape[-1] != w.n_cols:
                raise ValueError(f"matmul: input has {x.shape[-1]} columns, the weight's rows are {w.n_cols} long")
        if x.shape[0] > MMV_ROWS:
            x16 = self.f16(x) if any(w.ggml_type != F32 for w in ws) else None        # once for every weight
            outs = [self._gemm(x, w, x16) for w in ws]
            outs = [o if b is None else self._add(o, b.vec) for o, b in zip(outs, biases)]
            return [o if r is None else self._add(o, r) for o, r in zip(outs, residuals)]
        return self._mat_vecs(x, ws, biases, residuals)

    def _mmt_takes(self, w: CudaWeight, t: int) -> bool:
        """Whether mmt (the tensor cores) makes w's products with t rows, rather than mmv3."""
        return (self.mmt and self.mmt_min <= t <= MMT_ROWS and w.ggml_type in MMT_TYPES and w.n_expert == 1
                and w.n_cols % 256 == 0)

    def _mat_vecs(self, x, ws, biases, residuals, x16=None):
        """Decode-sized products, four weights a launch: the weights mmt takes from x's f16 form (x16, or
        made here once), the others through mmv3 from its int8 form."""
        t = x.shape[0]
        tc = [i for i, w in enumerate(ws) if self._mmt_takes(w, t)]
        rest = [i for i in range(len(ws)) if i not in tc]
        outs = [None] * len(ws)
        if tc and x16 is None:
            x16 = self.f16(x)
        for idx, run in ((tc, lambda *a: self._mmt(x16, *a)), (rest, lambda *a: self._mmv(x, *a))):
            for j in range(0, len(idx), MMV_MATS):
                part = idx[j:j + MMV_MATS]
                got = run([ws[i] for i in part], [biases[i] for i in part], [residuals[i] for i in part])
                for i, o in zip(part, got):
                    outs[i] = o
        return outs

    def _mmt(self, x16, ws, biases, residuals):
        t, k = x16.shape
        outs, params = self._mat_params(t, ws, biases, residuals)
        n_tiles = sum(-(-w.n_rows // MMT_ROWS) for w in ws)
        self.k.mmt((n_tiles,), (32 * min(4, k // 256),), (*params, _i32(len(ws)), _i32(k), x16, _i32(t)))
        return outs

    def norm_matmuls(self, x, norm: CudaWeight, eps: float, ws, biases):
        """(RMSNorm(x) * norm, [its products with ws (+ biases)]): for decode-sized batches in
        one launch (mmv3n: the norm in each block's prologue) of the first four weights, the rest
        reading its int8 form after; else rms_norm, then matmuls."""
        x = cupy.ascontiguousarray(x, dtype=cupy.float32)                         # [T, K]
        t, k = x.shape
        smem = t * k + 8 * t * (k // 32) + 4 * MMV3N_ROWS                         # mmv3n's (matvec.cu)
        if t > MMV_ROWS or k % 32 or k > 8 * 4 * 256 or (t <= MMV3N_ROWS and smem > 48 << 10):   # NORM_IT
            h = self.rms_norm(x, norm, eps)
            return h, self.matmuls(h, ws, biases)
        for w in ws:
            if w.n_cols != k:
                raise ValueError(f"matmul: input has {k} columns, the weight's rows are {w.n_cols} long")
        mmt = self.mmt and t >= self.mmt_min
        if mmt or t > MMV3N_ROWS:
            # the norm on its own (mmv3n's prologue normalizes every row in every block: at 8 rows its
            # launch of the router alone took 21 us), leaving y's int8 and f16 forms for the products;
            # past MMV3N_ROWS rows (no mmv3n instance) too, then mmt / mmv3
            y, yh = self._rms_norm(x, norm, eps, f16=mmt)
            return y, self._mat_vecs(y, ws, biases, [None] * len(ws), x16=yh)
        if len(ws) > MMV_MATS:
            y, outs = self.norm_matmuls(x, norm, eps, ws[:MMV_MATS], biases[:MMV_MATS])
            return y, outs + self.matmuls(y, ws[MMV_MATS:], biases[MMV_MATS:])
        y = cupy.empty((t, k), cupy.float32)
        yq = cupy.empty((t, k), cupy.int8)
        yd = cupy.empty((t, k // 32), cupy.float32)
        ys = cupy.empty((t, k // 32), cupy.float32)
        outs, params = self._mat_params(t, ws, biases, [None] * len(ws))
        nb = next(b for b in MMV_SIZES if b >= t)                                 # t <= MMV3N_ROWS here
        fn = getattr(self.k, f"mmv3n_b{nb}")
        n_warps = sum(w.n_rows for w in ws)                 # a warp a row, 8 warps a block
        rpw = min(2, self._rows_per_warp(fn, _grid(n_warps, 8), 256, smem))     # mmv3n takes 1 or 2
        fn((_grid(n_warps, 8 * rpw),), (256,), (
            *params, _i32(len(ws)), _i32(k), x, norm.vec, np.float32(eps), y, yq, yd, ys, _i32(t), _i32(rpw)),
            shared_mem=smem)
        self.remember_q8(y, yq, yd, ys)
        return y, outs

    def blocks_that_fit(self, fn, threads: int, smem: int) -> int:
        """Blocks of fn (threads each, smem bytes of dynamic shared memory) an SM holds at once, by
        the driver's count (registers, shared memory)."""
        key = (id(fn), threads, smem)
        per_sm = self._occupancy.get(key)
        if per_sm is None:
            per_sm = self._occupancy[key] = max(1, fn.occupancy(threads, smem))
        return per_sm

    def _rows_per_warp(self, fn, n_blocks: int, threads: int, smem: int) -> int:
        """Rows each warp of a one-row-per-warp kernel takes in turn so that its grid fits the
        card at once (one wave), from the driver's count of blocks per SM."""
        return max(1, -(-n_blocks // (self.blocks_that_fit(fn, threads, smem) * self.n_sm)))

    def _mat_params(self, t, ws, biases, residuals):
        outs, params = [], []
        for w, b, r in zip(ws, biases, residuals):
            o = cupy.empty((t, w.n_rows), cupy.float32)                           # [T, N]
            outs.append(o)
            params += [w.data, np.int64(w.row_bytes), _i32(w.ggml_type), _i32(w.n_rows), o,
                       b.vec if b is not None else _NULL,
                       cupy.ascontiguousarray(r, dtype=cupy.float32) if r is not None else _NULL]
        for _ in range(MMV_MATS - len(ws)):
            params += [_NULL, np.int64(0), _i32(0), _i32(0), _NULL, _NULL, _NULL]
        return outs, params

    def _mmv(self, x, ws, biases, residuals):
        t, k = x.shape
        xq = xd = xs = _NULL
        if any(w.quantized for w in ws):
            xq, xd, xs = self.q8(x)
        outs, params = self._mat_params(t, ws, biases, residuals)
        nb = next(b for b in MMV_SIZES if b >= t)
        rows_per_warp = 1                                                          # MMV_R in matvec.cu
        n_groups = sum(-(-w.n_rows // rows_per_warp) for w in ws)
        getattr(self.k, f"mmv3_b{nb}")((_grid(n_groups, 4),), (128,),
                                       (*params, _i32(len(ws)), _i32(k), xq, xd, xs, x, _i32(t)))
        return outs

    def dequant_f16(self, w: CudaWeight):
        """All of w's rows as f16 [n_expert * N, K] (a transient copy for the GEMM path)."""
        if w.ggml_type == F16:
            return w.data.view(cupy.float16).reshape(-1, w.n_cols)
        n_rows = w.n_rows * w.n_expert
        out = cupy.empty((n_rows, w.n_cols), cupy.float16)
        n_items = n_rows * w.n_cols // 32                                         # an upper bound
        self.k.dequant_f16((min(_grid(n_items, 256), 16384),), (256,), (w.data, _i32(w.ggml_type), np.int64(w.row_bytes),
                                             np.int64(n_rows), _i32(w.n_cols), out))
        return out

    def f16(self, x):
        """x as f16: the form the kernel that wrote x also made (remember_f16), else converted now."""
        x = cupy.ascontiguousarray(x, dtype=cupy.float32)
        got = self._h.get((x.data.ptr, x.size))
        if got is not None:
            return got[1].reshape(x.shape)
        out = cupy.empty(x.shape, cupy.float16)
        self.k.f32_to_f16((min(_grid(x.size, 256), 4096),), (256,), (x, np.int64(x.size), out))
        return out

    def _gemm(self, x, w: CudaWeight, x16=None):
        """x [T, K] f32 against w: an F32 weight as f32 (the routers), else through f16 copies of both (x16: x's,
        made once by the caller for several weights)."""
        out = cupy.empty((x.shape[0], w.n_rows), cupy.float32)                    # [T, N]
        if w.ggml_type == F32:                                                    # small (routers): f32 through
            return gemm_nt(cupy.ascontiguousarray(x), w.data.view(cupy.float32).reshape(w.n_rows, w.n_cols), out)
        return gemm_nt(self.f16(x) if x16 is None else x16, self.dequant_f16(w), out)

    # --- elementwise and norms ---
    def add(self, a, b):
        return self._add(a, b.vec if isinstance(b, CudaWeight) else b)

    def _add(self, a, b):
        """a + b through add_f32 (no CuPy elementwise kernel, which NVRTC would compile on a machine's first start):
        b of a's shape, or a row broadcast over a's leading axes; other shapes or types as CuPy adds them."""
        if (a.dtype == b.dtype == cupy.float32 and a.flags.c_contiguous and b.flags.c_contiguous
                and (b.shape == a.shape or (b.ndim == 1 and a.ndim >= 1 and b.shape[0] == a.shape[-1]))):
            out = cupy.empty(a.shape, cupy.float32)
            if a.size:
                self.k.add_f32((min(_grid(a.size, 256), 4096),), (256,), (a, b, np.int64(a.size), np.int64(b.size), out))
            return out
        return a + b

    def take_rows(self, x, rows):
        """Rows `rows` of x [T, D] f32 (take_rows: no CuPy gather kernel for NVRTC to compile)."""
        x = cupy.ascontiguousarray(x, dtype=cupy.float32)
        idx = cupy.asarray(rows, dtype=cupy.int32).reshape(-1)
        out = cupy.empty((idx.size, x.shape[1]), cupy.float32)
        if idx.size:
            self.k.take_rows((idx.size,), (256,), (x, np.int64(x.shape[1]), idx, _i32(x.shape[1]), out))
        return out

    def rms_norm(self, x, w: CudaWeight, eps: float):
        return self._rms_norm(x, w, eps)[0]

    def _rms_norm(self, x, w: CudaWeight, eps: float, f16: bool = False):
        """(RMSNorm(x) * w, its f16 form when f16 is set (2-D x), else None)."""
        shape = x.shape
        x2 = cupy.ascontiguousarray(x, dtype=cupy.float32).reshape(-1, shape[-1])  # [R, K]
        r, k = x2.shape
        y = cupy.empty_like(x2)
        quant = k % 32 == 0 and len(shape) == 2
        yq = cupy.empty((r, k), cupy.int8) if quant else None
        yd = cupy.empty((r, k // 32), cupy.float32) if quant else None
        ys = cupy.empty((r, k // 32), cupy.float32) if quant else None
        if k > 8192:
            raise ValueError(f"rms_norm: rows of {k} values are longer than the kernel's 8192")
        threads = min(1024, max(32, -(-k // 4 // 32) * 32))
        yh = cupy.empty((r, k), cupy.float16) if f16 else None
        self.k.rms_norm_q8((r,), (threads,), (x2, w.vec, _i32(k), np.float32(eps), y,
                                          yq if quant else _NULL, yd if quant else _NULL, ys if quant else _NULL,
                                          yh if f16 else _NULL))
        y = y.reshape(shape)
        if quant:
            self.remember_q8(y, yq, yd, ys)
        if f16:
            self.remember_f16(y, yh)
        return y, yh

    def swiglu(self, gate, up):
        """silu(gate) * up; decode-sized rows also get their int8-per-32 form (the next product's input)."""
        out = cupy.empty(gate.shape, cupy.float32)
        g, u = cupy.ascontiguousarray(gate), cupy.ascontiguousarray(up)
        grid = (min(_grid(gate.size, 256), 4096),)
        if gate.ndim >= 2 and gate.shape[0] <= MMV_ROWS and gate.size % 32 == 0:
            oq, od, os_ = self._q8_arrays(gate.size)
            self.k.swiglu_q8(grid, (256,), (g, u, np.int64(gate.size), out, oq, od, os_))
            self.remember_q8(out, oq, od, os_)
        else:
            self.k.swiglu_f(grid, (256,), (g, u, np.int64(gate.size), out, _NULL))
        return out

    def sigmoid_gate(self, x, gate, plus=None, residual=None):
        """x * sigmoid(gate) (+ plus) (+ residual) in one launch, each step rounded as the numpy
        backend's ops; gate [T, N] or [T, 1]. Decode-sized rows also get their int8-per-32 form."""
        x = cupy.ascontiguousarray(x, dtype=cupy.float32)
        t, n = x.shape
        gate = cupy.ascontiguousarray(gate, dtype=cupy.float32).reshape(t, -1)
        ng = gate.shape[1]
        if ng not in (1, n):
            raise ValueError(f"sigmoid_gate: a gate of {ng} values a row for rows of {n}: it takes 1 or {n}")
        out = cupy.empty((t, n), cupy.float32)
        quant = t <= MMV_ROWS and n % 32 == 0
        oq, od, os_ = self._q8_arrays(x.size) if quant else (_NULL, _NULL, _NULL)
        self.k.sigmoid_gate((min(_grid(x.size, 256), 4096),), (256,), (
            x, gate, _i32(ng), _NULL if plus is None else cupy.ascontiguousarray(plus, dtype=cupy.float32),
            _NULL if residual is None else cupy.ascontiguousarray(residual, dtype=cupy.float32),
            _i32(n), np.int64(x.size), out, oq, od, os_))
        if quant:
            self.remember_q8(out, oq, od, os_)
        return out

    @staticmethod
    def _q8_arrays(size: int):
        return cupy.empty(size, cupy.int8), cupy.empty(size // 32, cupy.float32), cupy.empty(size // 32, cupy.float32)

    def sigmoid(self, x):
        """1 / (1 + e^-x) in f32 (expf), as ggml_vec_sigmoid_f32."""
        return _sigmoid()(cupy.ascontiguousarray(x, dtype=cupy.float32))

    def softplus(self, x):
        """x above 20, else log(1 + e^x) (ggml's op_softplus)."""
        return _softplus()(cupy.ascontiguousarray(x, dtype=cupy.float32))

    def silu(self, x):
        """x / (1 + e^-x) in f32."""
        return _silu()(cupy.ascontiguousarray(x, dtype=cupy.float32))

    def mul(self, a, b):
        """a * b, b broadcast over leading axes (a weight handle: its f32 vector)."""
        return a * (b.vec if isinstance(b, CudaWeight) else b)

    def l2_norm(self, x, eps: float):
        """x / sqrt(sum x^2 + eps) over the last axis, as llama.cpp builds it for the delta rule (the CPU
        backend's l2_norm): rms_norm with eps / n, then a scale by 1 / sqrt(n); the sum in f32. One launch
        (kernels/recurrent.cu l2_norm_rows)."""
        x = cupy.ascontiguousarray(x, dtype=cupy.float32)                        # [..., n]
        n = x.shape[-1]
        rows = x.size // n
        out = cupy.empty(x.shape, cupy.float32)
        if rows:
            self.k.l2_norm_rows((rows,), (32,), (x, np.int64(n), _i32(n), np.float32(np.float32(eps) / np.float32(n)),
                                                 np.float32(1) / np.sqrt(np.float32(n)), out))
        return out

    def rows(self, spans, positions) -> Rows:
        slots = np.empty(int(positions.shape[0]), np.int32)
        for sp in spans:
            slots[sp.row0:sp.row1] = sp.slot
        return Rows(list(spans), cupy.asarray(slots), self.from_host(positions).astype(cupy.int32, copy=False))

    def ban(self, logits, bans) -> None:
        """Each row's banned ids to -inf in place, as a -inf logit bias makes them: logits [B, V] f32 on the card,
        bans [NB, B] int32 (-1: none; a captured step's input rows)."""
        b, n = logits.shape
        bans = cupy.asarray(bans, dtype=cupy.int32)
        if bans.ndim != 2 or bans.shape[1] != b:
            raise ValueError(f"bans of shape {bans.shape} for {b} rows: [NB, {b}] ids")
        self.k.ban_ids((b,), (32,), (logits, _i32(n), bans, _i32(bans.shape[0])))

    def argmax(self, logits):
        logits = cupy.ascontiguousarray(logits, dtype=cupy.float32)
        b, n = logits.shape
        n_part = _grid(n, 256 * 8)                                                # AMX_PER in matvec.cu
        part_v = cupy.empty((b, n_part), cupy.float32)
        part_i = cupy.empty((b, n_part), cupy.int32)
        self.k.argmax_part((n_part, b), (256,), (logits, _i32(n), part_v, part_i))
        out = cupy.empty(b, cupy.int32)
        self.k.argmax_final((b,), (32,), (part_v, part_i, _i32(n_part), out))
        return out

    def topk_max(self, n_vocab: int) -> int:
        """The largest k topk takes for rows of n_vocab logits (TOPK_MAX, TOPK_SPAN in matvec.cu)."""
        return min(TOPK_MAX, TOPK_SPAN // _grid(n_vocab, TOPK_SPAN))

    def topk(self, logits, k: int):
        """The k largest logits of each row [B, V] in the sampler chain's order (descending, ties to
        the lower id): (ids [B, k] int32, values [B, k] f32, NaN count [B] int32)."""
        logits = cupy.ascontiguousarray(logits, dtype=cupy.float32)
        b, n = logits.shape
        if not 1 <= k <= self.topk_max(n):
            raise ValueError(f"topk takes 1..{self.topk_max(n)} of {n} logits, not {k}")
        n_part = _grid(n, TOPK_SPAN)
        part = cupy.empty((b, n_part, k), cupy.uint64)
        nan = cupy.zeros(b, cupy.int32)
        self.k.topk_part((n_part, b), (512,), (logits, _i32(n), _i32(k), part, nan))
        ids = cupy.empty((b, k), cupy.int32)
        vals = cupy.empty((b, k), cupy.float32)
        self.k.topk_final((b,), (1024,), (part, _i32(n_part), _i32(k), logits, _i32(n), ids, vals))
        return ids, vals, nan

    # --- attention and MoE (their own modules) ---
    def kv_cache(self, n_layer, n_slots, n_ctx_slot, n_head_kv, head_dim):
        return cuda_attention.KVCacheF16(n_layer, n_slots, n_ctx_slot, n_head_kv, head_dim)

    def self_attention(self, cache, layer, rows, q, k, v, scale, n_rot, freq_base, q_norm=None, k_norm=None,
                       eps=0.0, imrope_sections=None):
        return cuda_attention.self_attention(self, cache, layer, rows, q, k, v, scale, n_rot, freq_base,
                                             q_norm, k_norm, eps, imrope_sections)

    # --- linear attention: the recurrent state per slot (recurrent.py, CuPy array code) ---
    def recurrent_state(self, n_layer: int, n_slots: int, conv_window: int, conv_channels: int,
                        n_v_heads: int, head_size: int) -> cuda_recurrent.RecurrentState:
        return cuda_recurrent.RecurrentState(cupy, n_layer, n_slots, conv_window, conv_channels, n_v_heads, head_size)

    def conv_step(self, state, layer: int, rows: Rows, x, kernel: CudaWeight, silu: bool = False):
        w = _dense_f32(kernel)                                                    # [C, K]
        if not (_fused_recurrent() and cuda_recurrent.decode_rows(rows)):
            x = cupy.ascontiguousarray(x, dtype=cupy.float32)                    # [T, C]
            out = cuda_recurrent.conv_step(state, layer, rows, x, w)
            return self.silu(out) if silu else out
        x = _rows_f32(x)                                                         # [B, C] rows apart
        b, c = x.shape
        if w.shape[1] > 8:
            raise ValueError(f"conv_step: a conv kernel of width {w.shape[1]}; the card's decode form takes up to 8")
        counts = cuda_recurrent.claim(state, cuda_recurrent.CONV, layer, rows)
        out = cupy.empty((b, c), cupy.float32)
        self.k.conv_dec((_grid(c, 256), b), (256,), (
            state.conv[layer], x, np.int64(x.strides[0] // 4), cupy.ascontiguousarray(w), _i32(c), _i32(w.shape[1]),
            rows.slots, rows.positions, state.held[cuda_recurrent.CONV, layer] if counts else _NULL, _i32(silu), out))
        return out

    def delta_rule(self, state, layer: int, rows: Rows, q, k, v, alpha, b, dt_bias: CudaWeight, a: CudaWeight):
        """Every form in one kernel (kernels/recurrent.cu delta_scan, the gates made in it): decode rows as
        segments of one row, prompt spans as a segment each, row after row within it;
        BLOOMERY_CUDA_RECURRENT=array: the gates by the elementwise ops, then the array code."""
        f32 = cupy.float32
        spans = rows.spans
        distinct = spans is None or len({sp.slot for sp in spans}) == len(spans)
        if not (_fused_recurrent() and distinct):
            g, beta = delta_gates(self, alpha, b, dt_bias, a)
            return cuda_recurrent.delta_rule(state, layer, rows, *(cupy.ascontiguousarray(x, dtype=f32)
                                                                   for x in (q, k, v, g, beta)))
        q, k, v = (_rows_f32(x) for x in (q, k, v))                              # [T, Hk, S] x2, [T, H, S]
        alpha, b = (cupy.ascontiguousarray(x, dtype=f32) for x in (alpha, b))   # [T, H]
        t, n_v, size = v.shape
        if size > 256 or (size > 32 and size % 32):
            raise ValueError(f"delta_rule: heads of {size}; the card takes up to 32, or multiples of 32 up to 256")
        scale = np.float32(1) / np.sqrt(np.float32(size))                        # as ggml: in float32
        out = cupy.empty((t, n_v, size), f32)
        counts = cuda_recurrent.claim(state, cuda_recurrent.DELTA, layer, rows)  # host spans checked and counted
        if cuda_recurrent.decode_rows(rows):                                     # segment b: row b, one step
            segs, n_seg = (rows.slots, rows.positions, _NULL, _NULL), t
        else:
            segs = tuple(cupy.asarray(np.array(col, np.int32)) for col in zip(*(
                (sp.slot, sp.pos0, sp.row0, sp.row1 - sp.row0) for sp in spans)))
            n_seg = len(spans)
        if t:
            self.k.delta_scan((n_v, _grid(size, 8), n_seg), (128,), (
                state.delta[layer], q, np.int64(q.strides[0] // 4), k, np.int64(k.strides[0] // 4), v,
                np.int64(v.strides[0] // 4), alpha, b, dt_bias.vec, a.vec, _i32(n_v), _i32(q.shape[1]), _i32(size),
                scale, *segs,
                state.held[cuda_recurrent.DELTA, layer] if counts else _NULL, out))
        return out

    def moe_route(self, logits, n_used: int, norm_weights: bool):
        return cuda_moe.route(self, logits, n_used, norm_weights)

    def moe_ffn(self, x, ids, weights, gate_exps, up_exps, down_exps, residual=None):
        return cuda_moe.ffn(self, x, ids, weights, gate_exps, up_exps, down_exps, residual)

    def release_scratch(self) -> None:
        """After a prompt: hand the pool's cached blocks (the prompt path's transient f16 weight
        copies and activations) back to the card, so between prompts the card holds weights, KV
        and the captured decode steps (their own pools) only."""
        cupy.get_default_memory_pool().free_all_blocks()

    # --- host transfer ---
    def from_host(self, x):
        return x if isinstance(x, cupy.ndarray) else cupy.asarray(x)

    def to_host(self, x) -> np.ndarray:
        return cupy.asnumpy(x)
