"""Tensor-core GEMMs for the prompt path: f16 operands, f32 accumulation, through cuBLAS.

All matrices are row-major CuPy arrays; cuBLAS is column-major, so each call computes the
transpose of what it is asked for with the operands swapped (a row-major [M, N] result is a
column-major N x M one).

Inside a stream capture (the captured prompt passes, graph.py) CuPy's cuBLAS wrapper refuses to run
(it sets the handle's stream through a call it does not allow there), though cuBLAS itself may be
captured: there the same two C calls (cublasSetStream, cublasGemmStridedBatchedEx) go through ctypes
to the library CuPy loaded, with the same handle.
"""
from __future__ import annotations

import ctypes

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
    _gemm_ex(cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, n, m, k, w.data.ptr, _dt(w), ldw, stride_w,
             x.data.ptr, _dt(x), k, stride_x, out.data.ptr, _dt(out), n, stride_out, batch)
    return out


def gemm_nn(p, v, out, batch: int, stride_p: int, stride_v: int, stride_out: int,
            m: int, n: int, k: int, ldv: int):
    """out[b] [M, N] = p[b] [M, K] @ v[b] [K, N] (v's rows `ldv` apart)."""
    _gemm_ex(cublas.CUBLAS_OP_N, cublas.CUBLAS_OP_N, n, m, k, v.data.ptr, _dt(v), ldv, stride_v,
             p.data.ptr, _dt(p), k, stride_p, out.data.ptr, _dt(out), n, stride_out, batch)
    return out


def _gemm_ex(op_a: int, op_b: int, m: int, n: int, k: int, a: int, a_type: int, lda: int, stride_a: int,
             b: int, b_type: int, ldb: int, stride_b: int, c: int, c_type: int, ldc: int, stride_c: int,
             batch: int) -> None:
    """cublasGemmStridedBatchedEx (alpha 1, beta 0, f32 compute) on the current stream."""
    stream = cupy.cuda.get_current_stream()
    if not stream.is_capturing():
        cublas.gemmStridedBatchedEx(_handle(), op_a, op_b, m, n, k, _ONE.ctypes.data, a, a_type, lda, stride_a,
                                    b, b_type, ldb, stride_b, _ZERO.ctypes.data, c, c_type, ldc, stride_c, batch,
                                    COMPUTE_32F, GEMM_DEFAULT)
        return
    lib = _captured_lib()
    handle = ctypes.c_void_p(_handle())
    _status("cublasSetStream", lib.cublasSetStream_v2(handle, ctypes.c_void_p(stream.ptr)))
    _status("cublasGemmStridedBatchedEx", lib.cublasGemmStridedBatchedEx(
        handle, op_a, op_b, m, n, k, ctypes.c_void_p(_ONE.ctypes.data), ctypes.c_void_p(a), a_type, lda, stride_a,
        ctypes.c_void_p(b), b_type, ldb, stride_b, ctypes.c_void_p(_ZERO.ctypes.data), ctypes.c_void_p(c), c_type,
        ldc, stride_c, batch, COMPUTE_32F, GEMM_DEFAULT))


_LIB = None


def _captured_lib():
    """The cuBLAS library CuPy's wrapper is linked against (found among this process's mappings, so the
    handle CuPy made is one of its own), with the two calls' argument types."""
    global _LIB
    if _LIB is None:
        _handle()                                       # CuPy has loaded cuBLAS and made this card's handle
        with open("/proc/self/maps") as f:
            paths = sorted({line.split()[-1] for line in f if "/libcublas.so" in line})
        if not paths:
            raise RuntimeError("a captured GEMM needs cuBLAS's library, and this process maps none: "
                               "run the pass uncaptured (BLOOMERY_CUDA_PROMPT_GRAPHS=0)")
        lib = ctypes.CDLL(paths[0])
        lib.cublasSetStream_v2.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        i32, i64, ptr = ctypes.c_int, ctypes.c_longlong, ctypes.c_void_p
        lib.cublasGemmStridedBatchedEx.argtypes = [ptr, i32, i32, i32, i32, i32, ptr, ptr, i32, i32, i64,
                                                   ptr, i32, i32, i64, ptr, ptr, i32, i32, i64, i32, i32, i32]
        _LIB = lib
    return _LIB


def _status(call: str, code: int) -> None:
    if code != 0:
        raise RuntimeError(f"{call} returned cuBLAS status {code}")
