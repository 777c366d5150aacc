"""Activations as llama.cpp's CPU quantizes them for a weight's vec_dot partner type: a float
row rounded the way ggml-cpu's x86 quantize_row_q8_0 / quantize_row_q8_K do.

Legend: T = activation rows, K = row length.
"""
from __future__ import annotations

import numpy as np

from bloomery.engine.quant.blocks import QK8_0, QK_K

def quantize_q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [T, K] float32 -> (q [T, K] float32 ints, d [T, K/32] float32).

    As ggml-cpu's x86 quantize_row_q8_0: d = amax/127 stored as f16,
    multiplier 127/amax in f32, round half to even (_mm256_round_ps).
    """
    t, k = x.shape
    xb = x.reshape(t, k // QK8_0, QK8_0)                                # [T, B, 32]
    amax = np.abs(xb).max(axis=2)                                       # [T, B]
    with np.errstate(divide="ignore"):
        mult = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    d = (amax / np.float32(127)).astype(np.float16).astype(np.float32)  # [T, B]
    q = np.rint(xb * mult[:, :, None])                                  # [T, B, 32]
    return q.reshape(t, k).astype(np.float32), d


def quantize_q8_K(x: np.ndarray, positive_wins: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x [T, K] float32 -> (q [T, K] float32 ints, d [T, K/256], bsums [T, K/16]).

    As quantize_row_q8_K_ref: the element of largest magnitude (first one on a
    tie) maps to -127, iscale = -127/max, nearest_int rounds half to even,
    values capped at 127; d = 1/iscale kept in f32. Rows where positive_wins [T]
    is set follow x86 ggml_quantize_mat_q8_K_4x8 instead (the repacked gemm's
    rows): on a +max / -max tie the positive one maps to -127, wherever it is.
    """
    t, k = x.shape
    xb = x.reshape(t, k // QK_K, QK_K)                                  # [T, B, 256]
    idx = np.abs(xb).argmax(axis=2)                                     # first max, as the ref's strict '>'
    vmax = np.take_along_axis(xb, idx[:, :, None], axis=2)[:, :, 0]     # [T, B] signed
    if positive_wins is not None and positive_wins.any():
        amax = np.abs(vmax)
        has_pos = (xb == amax[:, :, None]).any(axis=2) & positive_wins[:, None]   # [T, B]
        vmax = np.where(has_pos, amax, vmax)
    zero = vmax == 0
    safe = np.where(zero, np.float32(1), vmax).astype(np.float32)
    iscale = (np.float32(-127) / safe).astype(np.float32)               # [T, B]
    q = np.minimum(np.rint(iscale[:, :, None] * xb), 127)               # [T, B, 256]
    q[zero] = 0
    d = np.where(zero, np.float32(0), np.float32(1) / iscale).astype(np.float32)
    q = q.reshape(t, k).astype(np.float32)
    bsums = q.reshape(t, k // 16, 16).sum(axis=2)                       # [T, K/16] exact ints
    return q, d, bsums
