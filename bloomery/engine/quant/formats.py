"""The block formats by ggml type: which family each type belongs to, and the entries that go
to it. A stored tensor read as float32 (dequantize) or split into integer planes
(decode_planes); its product with float activations in exact integer sums (dot_planes), in
llama.cpp's kernel order (dot_llama, where KERNEL_ORDER is on) or through the compiled kernels
(dot_c); the few largest rows of a head (top_llama).

The families: q8_0.py (Q8_0, Q5_0, Q4_0 against Q8_0 activations), k_quants.py (Q4_K, Q5_K,
Q6_K against Q8_K), floats.py (F32, F16); what they share is in common.py, the worker threads
in threads.py.

Legend: N = weight rows (outputs), K = row length (inputs), T = activation rows.
"""
from __future__ import annotations

import os

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import quants as gguf_quants

from bloomery.engine.quant import floats, k_quants, q8_0
from bloomery.engine.quant.common import (Planes, QuantError, check_raw, check_size, planes_to_float,
                                          split_planes)
from bloomery.engine.quant.floats import dot_f32_llama
from bloomery.engine.quant.k_quants import QK_K
from bloomery.engine.quant.q8_0 import QK8_0, TOP_TYPES, top_llama
from bloomery.engine.quant.threads import N_THREADS, OneBlasThread

__all__ = ["Planes", "QuantError", "planes_to_float", "dot_f32_llama", "TOP_TYPES", "top_llama"]

FAMILY = {qt: family for family in (q8_0, k_quants) for qt in family.VEC_DOT_TYPE}   # quantized type -> its module
# weight type -> the activation type its CPU vec_dot takes (ggml-cpu.c type_traits_cpu)
VEC_DOT_TYPE = {**floats.VEC_DOT_TYPE, **q8_0.VEC_DOT_TYPE, **k_quants.VEC_DOT_TYPE}
EXACT_TYPES = frozenset(VEC_DOT_TYPE)


def _family(ggml_type: int):
    family = FAMILY.get(QT(ggml_type))
    if family is None:
        raise QuantError(f"no exact integer path for {QT(ggml_type).name}")
    return family


def dequantize(ggml_type: int, raw: np.ndarray, n_rows: int, n_cols: int) -> np.ndarray:
    """Reference float32 [N, K] of a stored matrix (gguf's numpy dequantizers)."""
    check_size(ggml_type, raw, n_rows, n_cols)
    qt = QT(ggml_type)
    if qt in floats.VEC_DOT_TYPE:
        return floats.as_float32(qt, raw, n_rows, n_cols)
    return gguf_quants.dequantize(raw.reshape(n_rows, -1), qt).astype(np.float32, copy=False)


def decode_planes(ggml_type: int, raw: np.ndarray, n_rows: int, n_cols: int) -> Planes:
    """Split a stored [N, K] quantized matrix into integer planes and scales, with its family's
    block decoder (common.split_planes)."""
    family = _family(ggml_type)
    return split_planes(ggml_type, raw, n_rows, n_cols, family.int_plane, family.SUB_ELEMS[QT(ggml_type)])


def dot_planes(x: np.ndarray, p: Planes) -> np.ndarray:
    """x [T, K] float32 @ weight planes [N, K]^T -> [T, N] float32, as ggml_vec_dot_*.

    The activation is quantized to the weight's vec_dot partner, integer sums
    per (sub-)block come from one batched float32 matmul (exact: every partial
    sum is below 2^24), the sub-block scales combine in float64 (exact
    integers, as llama.cpp's int32 accumulators), and the block scales last in
    float32 as llama.cpp does.
    """
    return _family(p.ggml_type).dot_planes(x, p)


# --- llama.cpp's float order (x86 build with AVX2/AVX512, CPU_REPACK and llamafile on) ------
# Which kernel llama.cpp runs for each weight type, and so which order we mirror, is written
# out in each family: q8_0.py (Q8_0, Q5_0: lane sums and fma chains), k_quants.py (Q6_K's
# tiled and lane paths, the repacked Q4_K gemm/gemv; ggml_mul_mat_id's per-expert rows),
# floats.py (F32 weights: dot_f32_llama).
# How, in numpy, with no Python per row: every integer lane sum comes from one BLAS product
# (exact: every partial sum is an integer below 2^24), and the fma chain over blocks is one call
# per block over all rows at once. For Q5_0 (and Q4_0) the plane holds d_w*q (set_scaled), so
# BLAS gives d_w*lane exactly and each chain step is one fused saxpy from numpy's OpenBLAS with
# a = d_a (the same exact product as d_w*d_a times lane, rounded once); elsewhere a float32 fma
# is emulated in float64: the product is exact there (< 53 bits), only the sum rounds twice,
# which differs from one rounding in about 2^-29 of the inexact cases (common.fma_chain). Large
# products split their rows over N_THREADS threads.
LLAMA_ORDER_TYPES = q8_0.LLAMA_ORDER_TYPES | k_quants.LLAMA_ORDER_TYPES
# True (default; BLOOMERY_KERNEL_ORDER=off turns it off): the four types above, and F32
# weights (dot_f32_llama), sum in llama.cpp's kernel order, bit for bit, so the numpy backend's
# logits equal llama.cpp's CPU build's. False: every batch size takes dot_planes' one order
# (exact integer sums, float order our own; final logits within ~0.5 of llama.cpp's); tests that
# compare batch shapes use it, since llama.cpp's kernels, so ours, give a prompt's logits
# differently at T=1, T<8 and T>=8.
KERNEL_ORDER = os.environ.get("BLOOMERY_KERNEL_ORDER", "on").strip().lower() not in ("off", "0", "false", "no")


def dot_llama(x: np.ndarray, p: Planes, per_row: bool = False) -> np.ndarray:
    """x [T, K] float32 @ planes [N, K]^T -> [T, N] in llama.cpp's CPU float order.

    per_row: the product of ggml_mul_mat_id (an expert's rows): a repacked Q4_K weight runs its
    gemv row by row there, whatever the batch; Q6_K takes the tiled path from 8 rows per expert
    as in mul_mat, and the Q8_0 family has one order for any batch."""
    with OneBlasThread():
        return _family(p.ggml_type).dot_llama(x, p, per_row)


# --- the compiled kernels (kernels/cpu_lanes.c) --------------------------------------------
# The same float order as the numpy kernels (q8_0.py's lanes for Q8_0 and Q5_0, k_quants.py's
# Q6_K tiled and lane paths and repacked Q4_K), reading the stored blocks in place: nothing is
# decoded or kept beside them. cpu_kernels.lib() is None where they cannot be built.
C_TYPES = q8_0.C_TYPES | k_quants.C_TYPES


def c_takes(ggml_type: int, n_rows: int) -> bool:
    """The compiled kernels give this weight's llama-order product (Q4_K is repacked, so in
    llama.cpp's 8x8 order, only where its rows come in eights)."""
    family = FAMILY.get(QT(ggml_type))
    return family is not None and family.c_takes(ggml_type, n_rows)


def c_threads(macs: int) -> int:
    """Threads a compiled call spreads over: N_THREADS, or one where the work is too small to share."""
    return N_THREADS if macs >= C_PARALLEL_MIN_MACS else 1


C_PARALLEL_MIN_MACS = 1 << 16   # OpenMP's hand-off costs microseconds, not the pool's tens of them


class CAct:
    """x [T, K] quantized once for the compiled kernels: to Q8_0, and to Q8_K with t_gemm rows
    in the repacked gemm's tie rule, each made on first use (products of one input share them)."""

    def __init__(self, x: np.ndarray):
        x = np.ascontiguousarray(x, dtype=np.float32)
        self.bad = ~np.isfinite(x).all(axis=1)                          # such a row's quantized blocks are NaN:
        self.any_bad = bool(self.bad.any())                             # its whole output is NaN, as the numpy
        if self.any_bad:                                                # kernels' (no NaN cast to int8)
            x = np.where(self.bad[:, None], np.float32(0), x)
        self.x = x
        self.t, self.k = x.shape
        self._q8_0 = None
        self._q8_K: dict[int, tuple] = {}

    def q8_0(self, lib):
        if self._q8_0 is None:
            q, d = np.empty((self.t, self.k), np.int8), np.empty((self.t, self.k // QK8_0), np.float32)
            lib.quant_q8_0(self.x.ctypes.data, self.t, self.k, q.ctypes.data, d.ctypes.data)
            self._q8_0 = (q, d)
        return self._q8_0

    def q8_K(self, lib, t_gemm: int):
        if t_gemm not in self._q8_K:
            q, d = np.empty((self.t, self.k), np.int8), np.empty((self.t, self.k // QK_K), np.float32)
            bsums = np.empty((self.t, self.k // 16), np.int16)
            wins = (np.arange(self.t) < t_gemm).astype(np.uint8)
            lib.quant_q8_K(self.x.ctypes.data, self.t, self.k, wins.ctypes.data, q.ctypes.data, d.ctypes.data,
                           bsums.ctypes.data)
            self._q8_K[t_gemm] = (q, d, bsums)
        return self._q8_K[t_gemm]


_FAMILY_OF_INT = {int(qt): family for qt, family in FAMILY.items()}   # the same, keyed by the plain int


def c_raw(ggml_type: int, raw: np.ndarray, n_rows: int, n_cols: int) -> np.ndarray:
    """raw checked to hold exactly the blocks of an [N, K] matrix of this type (a QuantError if
    not), as one contiguous array: what dot_c takes with checked=True."""
    check_raw(ggml_type, raw, n_rows, n_cols)
    return np.ascontiguousarray(raw)


def dot_c(x, ggml_type: int, raw: np.ndarray, n_rows: int, n_cols: int, per_row: bool = False,
          checked: bool = False) -> np.ndarray:
    """x [T, K] float32 (or a CAct of it) @ w^T -> [T, N] in llama.cpp's order, through the compiled
    kernels, which read the stored blocks `raw` of the [N, K] weight in place (cpu_kernels.lib()
    must not be None; c_takes(ggml_type, n_rows) must hold); per_row as dot_llama's. checked: raw
    came from c_raw for this type and shape (a weight checks its blocks once, not every call)."""
    lib = _c_lib()
    if not checked:
        raw = c_raw(ggml_type, raw, n_rows, n_cols)
    act = x if isinstance(x, CAct) else CAct(x)
    if act.k != n_cols:
        raise ValueError(f"matmul: input has {act.k} columns, the weight's rows are {n_cols} long")
    out = np.empty((act.t, n_rows), np.float32)
    nth = c_threads(act.t * n_rows * act.k)
    _FAMILY_OF_INT[int(ggml_type)].c_mm(lib, act, ggml_type, raw, n_rows, per_row, out, nth)
    if act.any_bad:
        out[act.bad] = np.nan
    return out


_CPU_KERNELS = None


def _c_lib():
    global _CPU_KERNELS
    if _CPU_KERNELS is None:                                            # imported late: the cpu package imports this one
        from bloomery.engine.cpu import kernels
        _CPU_KERNELS = kernels
    return _CPU_KERNELS.lib()
