"""Float weights: F32 and F16 (and BF16 through gguf's dequantizer), read as float32, and
llama.cpp's float order for an F32 weight's product (dot_f32_llama).

Legend: N = weight rows (outputs), K = row length (inputs), T = activation rows.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as QT

from bloomery.engine.quant.common import MAX_TMP_ELEMS

VEC_DOT_TYPE = {QT.F32: QT.F32, QT.F16: QT.F16}   # ggml-cpu.c type_traits_cpu: no activation rounding


def as_float32(ggml_type: int, raw: np.ndarray, n_rows: int, n_cols: int) -> np.ndarray:
    """float32 [N, K] of a stored F32 or F16 matrix (its size already checked)."""
    if QT(ggml_type) == QT.F32:
        return np.frombuffer(raw, dtype=np.float32).reshape(n_rows, n_cols)
    return np.frombuffer(raw, dtype=np.float16).reshape(n_rows, n_cols).astype(np.float32)


def dot_f32_llama(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x [T, K] float32 @ w [N, K]^T in llama.cpp's order for F32 weights (AVX-512 build).

    T >= 2 with N % 4 == 0 goes to llamafile's tinyBLAS<16, __m512>: per output one 16-lane
    accumulator, fma over the row in 16-wide steps (a partial last step reads zeros), then
    _mm512_reduce_add_ps. Otherwise ggml_vec_dot_f32: four 16-lane accumulators over 64-wide
    steps, (acc0 + acc2) + (acc1 + acc3), _mm512_reduce_add_ps, then the tail one fma at a time."""
    from bloomery.engine.cpu.ops_math import reduce_add16
    t, k = x.shape
    n = w.shape[0]
    out = np.empty((t, n), np.float32)
    tiny = t >= 2 and n % 4 == 0
    width = 16 if tiny else 64
    x64 = x.astype(np.float64)
    step = max(1, MAX_TMP_ELEMS // max(1, t * width))
    for n0 in range(0, n, step):
        n1 = min(n, n0 + step)
        wc = w[n0:n1]
        acc = np.zeros((t, n1 - n0, width), np.float32)
        k_main = k if tiny else k - k % 64
        for c in range(0, k_main, width):
            xs, ws = x64[:, None, c:c + width], wc[None, :, c:c + width]
            if xs.shape[-1] < width:                                    # tinyBLAS's partial load: zeros
                xs = np.concatenate([xs, np.zeros(xs.shape[:-1] + (width - xs.shape[-1],))], axis=-1)
                ws = np.concatenate([ws, np.zeros(ws.shape[:-1] + (width - ws.shape[-1],), np.float32)], axis=-1)
            acc = (xs * ws + acc).astype(np.float32)
        if tiny:
            out[:, n0:n1] = reduce_add16(acc)
            continue
        a4 = acc.reshape(t, n1 - n0, 4, 16)
        res = reduce_add16((a4[:, :, 0] + a4[:, :, 2]) + (a4[:, :, 1] + a4[:, :, 3]))
        for i in range(k_main, k):                                      # sumf += x[i]*y[i], contracted
            res = (x64[:, None, i] * wc[None, :, i] + res).astype(np.float32)
        out[:, n0:n1] = res
    return out
