"""Tensor-core GEMMs for the prompt path: f16 operands, f32 accumulation, through cuBLAS.

All matrices are row-major CuPy arrays; cuBLAS is column-major, so each call computes the
transpose of what it is asked for with the operands swapped (a row-major [M, N] result is a
column-major N x M one).
"""
from __future__ import annotations

import cupy
import numpy as np
from cupy_backends.cuda.libs import cublas

R_16F, R_32F = 2, 0               # cudaDataType
COMPUTE_32F = 68                  # cublasComputeType_t
GEMM_DEFAULT = -1
_ONE, _ZERO = np.ones(1, np.float32), np.zeros(1, np.float32)
_DTYPE = {np.dtype(np.float16): R_16F, np.dtype(np.float32): R_32F}


def _handle():
    return cupy.cuda.device.get_cublas_handle()


def _dt(a) -> int:
    return _DTYPE[np.dtype(a.dtype)]


def gemm_nt(x, w, out, batch: int = 1, stride_x: int = 0, stride_w: int = 0, stride_out: int = 0,
            m: int | None = None, n: int | None = None, k: int | None = None, ldw: int | None = None):
    """out[b] [M, N] = x[b] [M, K] @ w[b] [N, K]^T for b < batch (strides in elements).

    w's rows may be `ldw` elements apart (a slice of the KV cache); x and out are dense.
    """
    m = x.shape[-2] if m is None else m
    k = x.shape[-1] if k is None else k
    n = w.shape[-2] if n is None else n
    ldw = k if ldw is None else ldw
    cublas.gemmStridedBatchedEx(
        _handle(), cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, n, m, k, _ONE.ctypes.data,
        w.data.ptr, _dt(w), ldw, stride_w, x.data.ptr, _dt(x), k, stride_x, _ZERO.ctypes.data,
        out.data.ptr, _dt(out), n, stride_out, batch, COMPUTE_32F, GEMM_DEFAULT)
    return out


def gemm_nn(p, v, out, batch: int, stride_p: int, stride_v: int, stride_out: int,
            m: int, n: int, k: int, ldv: int):
    """out[b] [M, N] = p[b] [M, K] @ v[b] [K, N] (v's rows `ldv` apart)."""
    cublas.gemmStridedBatchedEx(
        _handle(), cublas.CUBLAS_OP_N, cublas.CUBLAS_OP_N, n, m, k, _ONE.ctypes.data,
        v.data.ptr, _dt(v), ldv, stride_v, p.data.ptr, _dt(p), k, stride_p, _ZERO.ctypes.data,
        out.data.ptr, _dt(out), n, stride_out, batch, COMPUTE_32F, GEMM_DEFAULT)
    return out
