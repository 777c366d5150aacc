"""One CUDA graph per decode batch size: the whole step captured once, replayed per token.

A step reads its ids, slots and positions from device buffers the graph owns, so a replay
needs no host values and no Python per layer: copy B ids and positions in, launch, copy B
ids (or B rows of logits) out. Each graph allocates from its own memory pool, which nothing
else uses, so the buffers it captured stay its own.
"""
from __future__ import annotations

from dataclasses import dataclass

import cupy
import numpy as np

from bloomery.engine.ops import Rows

MAX_BATCH = 8


@dataclass
class _Graph:
    graph: object
    stream: object
    pool: object
    ids: object
    slots: object
    positions: object
    logits: object
    picked: object


def _capture_mode():
    rt = cupy.cuda.runtime
    return getattr(rt, "streamCaptureModeRelaxed", 2)


class DecodeGraphs:
    def __init__(self, model, max_batch: int = MAX_BATCH):
        self.model, self.max_batch = model, max_batch
        self._graphs: dict[int, _Graph] = {}

    def _capture(self, b: int) -> _Graph:
        model, ops = self.model, self.model.ops
        ops.k.compile_all()                         # no module loads inside a capture
        pool = cupy.cuda.MemoryPool()
        stream = cupy.cuda.Stream(non_blocking=True)
        with cupy.cuda.using_allocator(pool.malloc), stream:
            ids = cupy.zeros(b, cupy.int32)
            slots = cupy.zeros(b, cupy.int32)
            positions = cupy.zeros(b, cupy.int32)
            stream.synchronize()
            stream.begin_capture(_capture_mode())
            try:
                x = model.embed(ids)                                                # [B, D]
                x = model.layers_forward(x, Rows(None, slots, positions))
                logits = model.head(x)                                              # [B, V]
                picked = ops.argmax(logits)                                         # [B]
            finally:
                graph = stream.end_capture()
        return _Graph(graph, stream, pool, ids, slots, positions, logits, picked)

    def run(self, slots, ids, positions, want_logits: bool) -> np.ndarray:
        b = len(slots)
        g = self._graphs.get(b)
        if g is None:
            g = self._graphs[b] = self._capture(b)
        g.ids.set(np.ascontiguousarray(ids, np.int32), stream=g.stream)
        g.slots.set(np.ascontiguousarray(slots, np.int32), stream=g.stream)
        g.positions.set(np.ascontiguousarray(positions, np.int32), stream=g.stream)
        g.graph.launch(g.stream)
        out = (g.logits if want_logits else g.picked).get(stream=g.stream)
        g.stream.synchronize()
        return out
