"""One CUDA graph per decode batch size: the whole step captured once, replayed per token.

A step reads its ids, slots and positions from one device buffer the graph owns, so a replay
needs no host values and no Python per layer: one copy of B ids, slots and positions in (from
pinned memory), launch, copy B ids (or B rows of logits) out. Each graph allocates from its
own memory pool, which nothing else uses, so the buffers it captured stay its own.

The kernels are captured with programmatic dependent launch (cuda_kernels.Launcher), so each
one's blocks start, and read their weights, while the kernel before it drains.
BLOOMERY_CUDA_PDL=0 captures plain launches instead (the same kernels, serialized).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import cupy
import numpy as np

from bloomery.engine.cuda.sizes import DECODE_ROWS
from bloomery.engine.ops import Rows

MAX_BATCH = DECODE_ROWS


def pdl_enabled() -> bool:
    return os.environ.get("BLOOMERY_CUDA_PDL", "1") != "0"


@dataclass
class _Graph:
    graph: object
    stream: object
    pool: object
    io: object          # [3, B] int32 on the card: ids, slots, positions
    host_io: object     # the same in pinned host memory
    logits: object
    picked: object
    posts: int = 0      # host jobs the step posts to the offload's bell (armed before each launch)


def _capture_mode():
    rt = cupy.cuda.runtime
    return getattr(rt, "streamCaptureModeRelaxed", 2)


class DecodeGraphs:
    def __init__(self, model, max_batch: int = MAX_BATCH):
        self.model, self.max_batch = model, max_batch
        self._graphs: dict[int, _Graph] = {}

    def _dry_run(self, b: int) -> None:
        """The step of b rows once outside the capture, where something it meets would otherwise first be
        made inside it: a model with a recurrent state (cuda/recurrent.py's CuPy array code, whose kernels
        CuPy compiles per shape on first use, so each is compiled and loaded before it and a fault shows
        here), and host experts whose layers the offload has not met yet (it makes their tables and
        pinned buffers on first sight, copies a capture refuses). The step runs at position 0 of slots
        0 .. b-1: what it writes there (K and V at position 0, the recurrent state and its counts) is put
        back after."""
        model = self.model
        state = getattr(model, "state", None)
        recurrent = state is not None and hasattr(state, "held")
        offload = getattr(model.ops, "offload", None)
        if not recurrent and (offload is None or offload.layers):
            return
        cache = model.cache
        kept = [(a, (slice(None), slice(0, b), slice(None), 0), a[:, :b, :, 0].copy()) for a in (cache.k, cache.v)]
        if recurrent:
            kept += [(a, (slice(None), slice(0, b)), a[:, :b].copy()) for a in (state.conv, state.delta)]
            kept.append((state.held, (slice(None), slice(None), slice(0, b)), state.held[:, :, :b].copy()))
        zeros = cupy.zeros(b, cupy.int32)
        slots = cupy.arange(b, dtype=cupy.int32)
        model.head(model.layers_forward(model.embed(zeros), Rows(None, slots, zeros)))
        for a, where, saved in kept:
            a[where] = saved
        cupy.cuda.get_current_stream().synchronize()

    def _capture(self, b: int) -> _Graph:
        model, ops = self.model, self.model.ops
        ops.k.compile_all()                         # no module loads inside a capture
        self._dry_run(b)
        pool = cupy.cuda.MemoryPool()
        stream = cupy.cuda.Stream(non_blocking=True)
        mem = cupy.cuda.alloc_pinned_memory(3 * b * 4)
        host_io = np.frombuffer(mem, np.int32, 3 * b).reshape(3, b)
        offload = getattr(ops, "offload", None)
        posts0 = offload.posts if offload is not None else 0
        with cupy.cuda.using_allocator(pool.malloc), stream:
            io = cupy.zeros((3, b), cupy.int32)
            ids, slots, positions = io[0], io[1], io[2]
            stream.synchronize()
            ops.k.pdl = pdl_enabled()
            stream.begin_capture(_capture_mode())
            try:
                x = model.embed(ids)                                                # [B, D]
                x = model.layers_forward(x, Rows(None, slots, positions))
                logits = model.head(x)                                              # [B, V]
                picked = ops.argmax(logits)                                         # [B]
            finally:
                graph = stream.end_capture()
                ops.k.pdl = False
        posts = offload.posts - posts0 if offload is not None else 0
        return _Graph(graph, stream, pool, io, host_io, logits, picked, posts)

    def _launch(self, slots, ids, positions) -> _Graph:
        b = len(slots)
        g = self._graphs.get(b)
        if g is None:
            g = self._graphs[b] = self._capture(b)
        g.host_io[0], g.host_io[1], g.host_io[2] = ids, slots, positions
        g.io.set(g.host_io, stream=g.stream)
        if g.posts:
            self.model.ops.offload.arm(g.posts)
        g.graph.launch(g.stream)
        return g

    def run_topk(self, slots, ids, positions, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The step, then the k largest logits of each row on the card (ops.topk, after the graph
        on its stream): only k ids and values a row come back."""
        g = self._launch(slots, ids, positions)
        with g.stream:
            got = self.model.ops.topk(g.logits, k)
            out = tuple(a.get(stream=g.stream) for a in got)
        g.stream.synchronize()
        return out

    def run(self, slots, ids, positions, want_logits: bool) -> np.ndarray:
        g = self._launch(slots, ids, positions)
        out = (g.logits if want_logits else g.picked).get(stream=g.stream)
        g.stream.synchronize()
        return out
