"""The MoE router and expert FFN for the cuda backend.

Decode-sized batches (<= MMV_ROWS tokens) run two kernels that read each chosen expert's
blocks in place through the tensor's device table of expert addresses (moe_gate_up, then
moe_down with the weighted sum and the residual). Prompt batches take the planned path where
the experts are of a block format moe_mm.cu reads (_planned: the rows grouped by expert on the
card, gate and up fused, four launches and no host sync; a layer with host experts first streams
the ones the pass uses to the card, after one sync for the counts); else
they sort their rows by expert into a padded buffer laid out by moe_buckets (experts of one
padded size side by side) and run three strided-batched tensor-core GEMMs per size over the
chosen experts, dequantized (_grouped: one sync a layer for the counts).
Above PLANNED_MAX_PAIRS (token, expert) pairs the grouped path takes them; BLOOMERY_CUDA_MOE_PROMPT
=planned or =grouped takes one everywhere (for comparison).

Legend: T = tokens, A = experts per token, E = experts, F = expert FFN size, D = hidden.
"""
from __future__ import annotations

import os

import cupy
import numpy as np

from bloomery.engine.cuda import moe_buckets
from bloomery.engine.cuda.gemm import gemm_nt
from bloomery.engine.cuda.sizes import (DECODE_ROWS, MMT_ROWS, MMT_TYPES, PLANNED_BK, PLANNED_MAX_EXPERTS,
                                       PLANNED_MAX_PAIRS)

_NULL = np.uint64(0)
DOWN_R = 8                          # rows per block in moe_down (DOWN_R in moe.cu)
MM_BM, MM_BN, MM_BK = 64, 128, PLANNED_BK   # moe_mm.cu's tile: rows, weight rows, inner step
MM_TYPES = {12: "q4_k", 13: "q5_k", 14: "q6_k", 8: "q8_0", 2: "q4_0", 6: "q5_0"}   # ggml type -> kernel suffix
PLAN_MAX_EXPERTS = PLANNED_MAX_EXPERTS   # moe_plan keeps two ints an expert in shared memory
# PLANNED_MAX_PAIRS (sizes.py): the planned path up to this many (token, expert) pairs (H200, 30B-A3B shape,
# planned / grouped tok/s: 2026-12-02, run M, 8,514 / 3,466 at 512 ids, 13,087 / 13,927 at 4096; 2026-12-03,
# session 19's kernels, 16,760 / 10,179 at 2,048, 16,272 / 13,782 at 4,096)
SMEM_MAX = 227 << 10                # shared memory one block may opt in to (sm_90)
# Decode rows from which the experts take moe_mt_* (grouped by expert on the tensor cores): none yet, they
# measured slower than the per-pair kernels (same lease as sizes.MMT_MIN_ROWS, ms a step at 2 / 4 / 8
# rows: per-pair 4.04 / 5.97 / 9.60, moe_mt 4.87 / 7.16 / 11.20; with mmt too 4.83 / 6.36 / 9.33 against
# mmt alone 4.30 / 5.47 / 8.14). BLOOMERY_CUDA_MOE_MT_MIN=n turns them on from n rows, for measuring.
MT_MIN_ROWS = 17
MT_G = 18                           # moe_dplan's group: expert, rows, up to 16 pairs (MT_G in moe_mm.cu)
DPLAN_MAX_PAIRS = 1024              # moe_dplan: a thread a pair, one block


def staged() -> bool:
    """The decode expert kernels that stage their bytes in shared memory (moe_gate_up_s,
    moe_down_s); BLOOMERY_CUDA_MOE=direct takes the ones that load into registers."""
    return os.environ.get("BLOOMERY_CUDA_MOE", "staged") != "direct"


def stage_cap(n: int) -> int:
    """STAGE_CAP(n) in common.cuh: shared bytes that hold n bytes staged with their alignment."""
    return ((n + 15) & ~15) + 32


def gate_up_smem(gate, up, d: int) -> int:
    return stage_cap(32 * gate.row_bytes) + stage_cap(32 * up.row_bytes) + stage_cap(d) + 2 * stage_cap(d // 8)


def down_smem(down, f: int, n_warps: int) -> int:
    return n_warps * (stage_cap(DOWN_R * down.row_bytes) + stage_cap(f) + 2 * stage_cap(f // 8))


def route(ops, logits, n_used: int, norm: bool):
    logits = cupy.ascontiguousarray(logits, dtype=cupy.float32)           # [T, E]
    t, n_expert = logits.shape
    ids = cupy.empty((t, n_used), cupy.int32)                             # [T, A]
    wts = cupy.empty((t, n_used), cupy.float32)
    args = (logits, np.int32(n_expert), np.int32(n_used), np.int32(int(norm)), ids, wts)
    vpl = next((v for v in (4, 8, 16, 32) if 32 * v >= n_expert), None)
    if vpl is not None and n_used <= 32:            # one warp per token
        getattr(ops.k, f"moe_route_w{vpl}")((t,), (32,), args)
    else:
        threads = min(1024, max(32, -(-n_expert // 32) * 32))
        ops.k.moe_route((t,), (threads,), args, shared_mem=4 * n_expert)
    return ids, wts


def _check(gate, up, down, d: int):
    for w in (gate, up, down):
        if w.table is None or not w.quantized:
            raise ValueError("the cuda MoE path reads quantized stacked expert tensors")
    if gate.n_rows % 32 or d % DOWN_R or gate.n_cols != d or down.n_cols != gate.n_rows:
        raise ValueError(f"expert shapes gate {gate.shape} down {down.shape} do not fit hidden size {d} "
                         f"(the expert width must be a multiple of 32, the hidden size of {DOWN_R})")


def ffn(ops, x, ids, wts, gate, up, down, residual=None):
    x = cupy.ascontiguousarray(x, dtype=cupy.float32)                     # [T, D]
    t, d = x.shape
    _check(gate, up, down, d)
    if t > DECODE_ROWS:
        if planned_fits(gate, up, down, d) and _planned_wanted(t * ids.shape[1]):
            layer = ops.offload.layer(gate, up, down, ids.shape[1]) if ops.offload is not None else None
            if layer is None:
                return _planned(ops, x, ids, wts, gate, up, down, residual)
            return _planned_streamed(ops, x, ids, wts, gate, up, down, residual, layer)
        return _grouped(ops, x, ids, wts, gate, up, down, residual)
    n_used, f = ids.shape[1], gate.n_rows
    if n_used > 32:
        raise ValueError(f"the cuda MoE kernels take at most 32 experts per token, the file uses {n_used}")
    ids = cupy.ascontiguousarray(ids, dtype=cupy.int32)
    wts = cupy.ascontiguousarray(wts, dtype=cupy.float32)
    layer = ops.offload.layer(gate, up, down, n_used) if ops.offload is not None else None
    if layer is None and mt_fits(ops, t, n_used, gate, up, down, d):
        return _decode_mt(ops, x, ids, wts, gate, up, down, residual)
    host = None
    if layer is not None:          # host experts: summed on the host meanwhile (experts.py), added below
        ops.offload.count(layer, ids)
        host = ops.offload.host_start(layer, x, ids, wts)      # also picks the step's bus lane
        if layer.streams:          # the bus lane: copied into staging, computed below with the card's own
            ops.offload.stream_in(layer, ids)
    xq, xd, xs = ops.q8(x)
    aq = cupy.empty((t * n_used, f), cupy.int8)                           # [T*A, F]
    ad = cupy.empty((t * n_used, f // 32), cupy.float32)
    as_ = cupy.empty((t * n_used, f // 32), cupy.float32)
    n_warps = min(n_used, 8)
    smem_gu, smem_d = gate_up_smem(gate, up, d), down_smem(down, f, n_warps)
    stage = staged() and max(smem_gu, smem_d) <= SMEM_MAX
    gate_up_args = (gate.table, up.table, np.int32(gate.ggml_type), np.int32(up.ggml_type), np.int64(gate.row_bytes),
                    np.int64(up.row_bytes), np.int32(f), np.int32(d), xq, xd, xs, ids, np.int32(n_used), aq, ad, as_)
    if stage:
        ops.k.moe_gate_up_s((f // 32, t * n_used), (256,), gate_up_args, shared_mem=smem_gu)
    else:
        ops.k.moe_gate_up((f // 32, t * n_used), (256,), gate_up_args)
    out = cupy.empty((t, d), cupy.float32)                                # [T, D]
    res = cupy.ascontiguousarray(residual, dtype=cupy.float32) if residual is not None else _NULL
    down_args = (down.table, np.int32(down.ggml_type), np.int64(down.row_bytes), np.int32(d), np.int32(f),
                 aq, ad, as_, ids, wts, np.int32(n_used), res, out)
    if stage:
        ops.k.moe_down_s((d // DOWN_R, t), (32 * n_warps,), down_args, shared_mem=smem_d)
    else:
        ops.k.moe_down((d // DOWN_R, t), (32 * n_warps,), down_args)
    if host is not None:
        ops.offload.host_finish(host, out)
    return out


def mt_fits(ops, t: int, n_used: int, gate, up, down, d: int) -> bool:
    """Whether a decode step's experts take the tensor cores (moe_mt_*): ops.moe_mt_min (none by default) to 16
    rows, gate and up of one type, every type one mt.cuh expands, whole super-blocks, the pairs one moe_dplan
    block."""
    return (ops.mmt and ops.moe_mt_min <= t <= MMT_ROWS and t * n_used <= DPLAN_MAX_PAIRS
            and gate.ggml_type == up.ggml_type and gate.ggml_type in MMT_TYPES and down.ggml_type in MMT_TYPES
            and d % 256 == 0 and gate.n_rows % 256 == 0)


def _decode_mt(ops, x, ids, wts, gate, up, down, residual):
    """A decode step's experts grouped on the card (moe_mm.cu, moe_dplan then moe_mt_gu, moe_mt_dn): each chosen
    expert's weights read once for all the rows that chose it, then each token's pairs added in rank order."""
    t, d = x.shape
    n_used, n_expert, f = ids.shape[1], gate.n_expert, gate.n_rows
    n_pairs = t * n_used
    n_groups_max = min(n_expert, n_pairs)
    groups = cupy.empty((n_groups_max, MT_G), cupy.int32)                # expert, rows, pairs
    n_groups = cupy.empty(1, cupy.int32)
    ops.k.moe_dplan((1,), (-(-n_pairs // 32) * 32,), (ids, np.int32(n_pairs), np.int32(n_expert), groups, n_groups),
                    shared_mem=8 * n_expert)
    x16 = ops.f16(x)                                                      # the norm's own f16 form, where it made one
    act = cupy.empty((n_pairs, f), cupy.float16)                          # [T*A, F]
    ops.k.moe_mt_gu((f // 8, n_groups_max), (32 * min(4, d // 256),), (
        gate.table, up.table, np.int32(gate.ggml_type), np.int64(gate.row_bytes), np.int64(up.row_bytes),
        np.int32(f), np.int32(d), x16, groups, n_groups, np.int32(n_used), act))
    y = cupy.empty((n_pairs, d), cupy.float32)                            # [T*A, D]
    ops.k.moe_mt_dn((-(-d // 16), n_groups_max), (32 * min(4, f // 256),), (
        down.table, np.int32(down.ggml_type), np.int64(down.row_bytes), np.int32(d), np.int32(f), act, groups,
        n_groups, y))
    return _combine(ops, y, None, wts, residual, t)


def planned_fits(gate, up, down, d: int) -> bool:
    """Whether moe_mm.cu takes these experts: gate and up of one block format, every format one it
    reads, both inner sizes whole MM_BK steps, at most PLAN_MAX_EXPERTS experts."""
    return (gate.ggml_type == up.ggml_type and gate.ggml_type in MM_TYPES and down.ggml_type in MM_TYPES
            and d % MM_BK == 0 and gate.n_rows % MM_BK == 0 and gate.n_expert <= PLAN_MAX_EXPERTS)


def _planned_wanted(n_pairs: int) -> bool:
    """BLOOMERY_CUDA_MOE_PROMPT: planned or grouped everywhere; unset, planned up to PLANNED_MAX_PAIRS."""
    how = os.environ.get("BLOOMERY_CUDA_MOE_PROMPT", "")
    if how not in ("", "planned", "grouped"):
        raise ValueError(f"BLOOMERY_CUDA_MOE_PROMPT={how!r}: one of planned, grouped")
    return how == "planned" or (how == "" and n_pairs <= PLANNED_MAX_PAIRS)


def _planned_streamed(ops, x, ids, wts, gate, up, down, residual, layer):
    """A layer with host experts: the ones this pass uses are streamed into the card's staging buffer
    first (the counts read on the host, one sync, as the grouped path does), the planned kernels read
    them there through the staged tables, and residency may adopt the most used after."""
    flat = cupy.ascontiguousarray(ids, dtype=cupy.int32).reshape(-1)
    counts_host = cupy.asnumpy(cupy.bincount(flat, minlength=gate.n_expert))
    ops.offload.count(layer, flat)
    tables, streamed = ops.offload.stage_tables(layer, counts_host > 0)
    out = _planned(ops, x, ids, wts, gate, up, down, residual, tables)
    ops.offload.adopt(layer, counts_host, streamed)
    return out


def _planned(ops, x, ids, wts, gate, up, down, residual, tables=None):
    """The prompt's expert FFN grouped on the card (moe_mm.cu): the plan, gate and up fused with
    silu, down, then each token's rows weighted and added in rank order (combine_rows). tables: the
    experts' device address tables (gate, up, down), the stacks' own by default."""
    tab_g, tab_u, tab_d = tables if tables is not None else (gate.table, up.table, down.table)
    t, d = x.shape
    n_used, n_expert, f = ids.shape[1], gate.n_expert, gate.n_rows
    n_pairs = t * n_used
    flat = cupy.ascontiguousarray(ids, dtype=cupy.int32).reshape(-1)     # [T*A]
    max_tiles = -(-n_pairs // MM_BM) + min(n_expert, n_pairs)            # sum over experts of ceil(rows / BM)
    pos_of = cupy.empty(n_pairs, cupy.int32)                              # pair -> row in expert order
    sorted_tok = cupy.empty(n_pairs, cupy.int32)                          # row -> token
    tiles = cupy.empty((3, max_tiles), cupy.int32)                        # expert, first row, rows
    n_tiles = cupy.empty(1, cupy.int32)
    ops.k.moe_plan((1,), (1024,), (flat, np.int32(n_pairs), np.int32(n_used), np.int32(n_expert), pos_of,
                                   sorted_tok, tiles, np.int32(max_tiles), n_tiles), shared_mem=8 * n_expert)
    x16 = ops.f16(x)                                                      # [T, D]: read by every block of a row
    h = cupy.empty((n_pairs, f), cupy.float16)                            # [T*A, F], expert order
    getattr(ops.k, f"moe_mm_gu_{MM_TYPES[gate.ggml_type]}")(
        (-(-f // MM_BN), max_tiles), (256,),
        (tab_g, tab_u, np.int64(gate.row_bytes), np.int64(up.row_bytes), np.int32(f), np.int32(d), x16,
         sorted_tok, tiles, np.int32(max_tiles), n_tiles, h))
    y = cupy.empty((n_pairs, d), cupy.float32)                            # [T*A, D], expert order
    getattr(ops.k, f"moe_mm_dn_{MM_TYPES[down.ggml_type]}")(
        (-(-d // MM_BN), max_tiles), (256,),
        (tab_d, np.int64(down.row_bytes), np.int32(d), np.int32(f), h, tiles, np.int32(max_tiles), n_tiles, y))
    del h, x16
    return _combine(ops, y, pos_of, wts, residual, t)


def _combine(ops, y, pos_of, wts, residual, t: int):
    """out [T, D] = residual + each token's rows of y (in expert order, pos_of; None: y's rows are the pairs)
    weighted and added in rank order."""
    d, n_used = y.shape[1], wts.shape[1]
    out = cupy.empty((t, d), cupy.float32)
    res = cupy.ascontiguousarray(residual, dtype=cupy.float32) if residual is not None else _NULL
    ops.k.combine_rows((t,), (256,), (y, _NULL if pos_of is None else pos_of, cupy.ascontiguousarray(wts, dtype=cupy.float32),
                                      np.int32(n_used), np.int32(d), res, out))
    return out


def _dequant_sel(ops, w, sel, table):
    """Experts sel (device int32) of a stacked expert tensor, read through `table`, as f16 [len(sel) * N, K]."""
    n_rows = int(sel.size) * w.n_rows
    out = cupy.empty((n_rows, w.n_cols), cupy.float16)
    n_items = n_rows * w.n_cols // 32                                     # an upper bound
    ops.k.dequant_f16_sel((max(1, min(-(-n_items // 256), 16384)),), (256,), (
        table, sel, np.int32(sel.size), np.int32(w.ggml_type), np.int64(w.row_bytes), np.int64(w.n_rows),
        np.int32(w.n_cols), out))
    return out


def _grouped(ops, x, ids, wts, gate, up, down, residual):
    t, d = x.shape
    n_used, n_expert, f = ids.shape[1], gate.n_expert, gate.n_rows
    flat = cupy.ascontiguousarray(ids, dtype=cupy.int32).reshape(-1)     # [T*A]
    counts = cupy.bincount(flat, minlength=n_expert)                      # [E]
    counts_host = cupy.asnumpy(counts)                                    # one sync per layer
    lay = moe_buckets.layout(counts_host)
    layer = ops.offload.layer(gate, up, down, n_used) if ops.offload is not None else None
    tables, streamed = (gate.table, up.table, down.table), {}
    if layer is not None:          # host experts this pass uses: streamed to the card's staging buffer
        ops.offload.count(layer, flat)
        tables, streamed = ops.offload.stage_tables(layer, counts_host > 0)
    order = cupy.argsort(flat).astype(cupy.int32)                         # pairs grouped by expert
    sorted_e = flat[order]
    offsets = cupy.cumsum(counts) - counts
    rank = cupy.arange(flat.size, dtype=cupy.int32) - offsets[sorted_e].astype(cupy.int32)
    dst = (cupy.asarray(lay.base)[sorted_e] + rank).astype(cupy.int32)    # row in the padded buffer
    pos_of = cupy.empty_like(dst)
    pos_of[order] = dst
    src_tok = (order // n_used).astype(cupy.int32)
    n = lay.n_rows
    xp = cupy.empty((n, d), cupy.float16)            # [n, D]; padding rows are computed, never read
    ops.k.gather_rows((flat.size,), (256,), (x, src_tok, dst, np.int32(flat.size), np.int32(d), xp))
    sels = [cupy.asarray(np.array(b.experts, np.int32)) for b in lay.buckets]
    g = cupy.empty((n, f), cupy.float32)                                  # [n, F]
    u = cupy.empty((n, f), cupy.float32)
    for b, sel in zip(lay.buckets, sels):
        for w, table, out in ((gate, tables[0], g), (up, tables[1], u)):
            gemm_nt(xp[b.row0:], _dequant_sel(ops, w, sel, table), out[b.row0:], batch=len(b.experts),
                    stride_x=b.rows * d, stride_w=f * d, stride_out=b.rows * f, m=b.rows, n=f, k=d)
    h = cupy.empty((n, f), cupy.float16)
    ops.k.swiglu_f((4096,), (256,), (g, u, np.int64(g.size), _NULL, h))
    del g, u
    y = cupy.empty((n, d), cupy.float32)                                  # [n, D]
    for b, sel in zip(lay.buckets, sels):
        gemm_nt(h[b.row0:], _dequant_sel(ops, down, sel, tables[2]), y[b.row0:], batch=len(b.experts),
                stride_x=b.rows * f, stride_w=d * f, stride_out=b.rows * d, m=b.rows, n=d, k=f)
    out = _combine(ops, y, pos_of, wts, residual, t)
    if layer is not None:
        ops.offload.adopt(layer, counts_host, streamed)
    return out
