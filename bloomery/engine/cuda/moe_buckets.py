"""How a prompt's MoE rows are laid out for the grouped GEMMs (pure bookkeeping, no card).

The prompt path sorts the (token, expert) pairs by expert and runs one strided-batched GEMM
per *bucket*: the experts whose row counts round up to the same padded size M. Each
expert's rows start at its own base row in one padded buffer; experts no token chose get
no rows and are never dequantized. The sizes step by about 1.4x (16, 24, 32, 48, ...), so
the padded rows stay under 1.5x the rows held however the router spreads the tokens (a
single [E, max count] batch computes E x max rows: 16x the work when a few experts take
every token).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MIN_ROWS = 16


def padded(count: int) -> int:
    """The bucket size for an expert with `count` rows: the smallest 16 * 2^k or 24 * 2^k >= count."""
    m = MIN_ROWS
    while True:
        if count <= m:
            return m
        if count <= m * 3 // 2:
            return m * 3 // 2
        m *= 2


@dataclass(frozen=True)
class Bucket:
    rows: int                 # M: rows per expert in this bucket (padded)
    row0: int                 # the bucket's first row in the padded buffer
    experts: tuple[int, ...]  # expert ids, in buffer order


@dataclass(frozen=True)
class Layout:
    buckets: tuple[Bucket, ...]
    base: np.ndarray          # [E] int32: first padded row of each expert (-1: no rows)
    n_rows: int               # rows of the padded buffer

    @property
    def n_experts_used(self) -> int:
        return sum(len(b.experts) for b in self.buckets)


def layout(counts) -> Layout:
    """counts [E]: rows per expert -> the buckets, largest first, and each expert's base row."""
    counts = np.asarray(counts, np.int64)
    if counts.ndim != 1 or (counts < 0).any():
        raise ValueError("expert row counts must be a 1-D array of non-negative integers")
    by_size: dict[int, list[int]] = {}
    for e in np.flatnonzero(counts):
        by_size.setdefault(padded(int(counts[e])), []).append(int(e))
    base = np.full(counts.size, -1, np.int32)
    buckets, row = [], 0
    for m in sorted(by_size, reverse=True):
        experts = tuple(by_size[m])
        for j, e in enumerate(experts):
            base[e] = row + j * m
        buckets.append(Bucket(m, row, experts))
        row += m * len(experts)
    return Layout(tuple(buckets), base, row)
