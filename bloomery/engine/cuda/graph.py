"""One CUDA graph per decode batch size: the whole step captured once, replayed per token.

A step reads its ids, slots and positions from one device buffer the graph owns, so a replay
needs no host values and no Python per layer: one copy of B ids, slots and positions in (from
pinned memory), launch, copy B ids (or B rows of logits) out. Each decode graph allocates from its
own memory pool, which nothing else uses, so the buffers it captured stay its own. The prompt
graphs share one pool and one stream: they never run at once, each launch waits for its logits,
and each one's inputs and logits stay held, so only their scratch is shared.

The kernels are captured with programmatic dependent launch (cuda_kernels.Launcher), so each
one's blocks start, and read their weights, while the kernel before it drains.
BLOOMERY_CUDA_PDL=0 captures plain launches instead (the same kernels, serialized).

Prompts of up to 512 ids in one slot are captured too, one graph per bucket of rows (PROMPT_BUCKETS). Uncaptured, a
pass launches some 770 kernels, 290 cuBLAS calls and 1,500 allocations from Python: on the H200 (session
18, the 30B-shaped file) 6 ids took 14 ms and 16 ids 37 ms; captured, 9 and 25 ms (what is left is the
card's own time, most of it the expert kernels at few rows an expert). A prompt of n ids runs in the smallest
bucket b >= n: its ids, then b - n rows of padding at the positions after it in the same slot, whose
K and V land past the prompt's end (each row attends only to positions up to its own, and a later id
writes its own position before it reads it), and only the last real row's logits come out. The
rows carry their own slots and positions, as a decode step's do, so attention takes the decode
kernels (a row over the keys up to its position), except in the buckets of PROMPT_FROM_START (256
and 512 rows), which take only prompts from position 0: their rows attend to each other through
the GEMM path, over the pass's own K and V (at 512 rows the decode kernels made the captured pass
slower than the uncaptured one, session 19); the products of more than DECODE_ROWS rows take
cuBLAS (gemm.py calls it through ctypes while capturing). Since DECODE_ROWS is 16 the buckets of 8 and 16
rows both run the decode step's own kernels (mmt / mmv3, the per-pair expert kernels): the timings above
for 16 ids are of the GEMM path, the 16-row bucket on the decode kernels is not yet measured. The warm-up
captures them; not captured: a
model with a recurrent state (padding would advance it), host experts (the offload counts and streams
what a pass routes), a prompt whose bucket would run past the slot's end or, for the wider buckets,
past PROMPT_DEPTH, a prompt of more than 128 ids that does not start at position 0 (a chat's later
turn: its pass stays launch-bound, about 1.3 ms a layer on the H200's host, session 22), a pass of
several slots' prompts, a start without the warm-up, and BLOOMERY_CUDA_PROMPT_GRAPHS=0. Measured
(session 22, the 30B-shaped file, in process): 512 ids 39.6 ms captured against 61.5 uncaptured,
256 ids 32.2 against 59.8.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import cupy
import numpy as np

from bloomery.engine.cuda.sizes import DECODE_ROWS, GREEDY_BANS, PROMPT_BUCKETS, PROMPT_FROM_START, tc_prompt_fits
from bloomery.engine.ops import Rows

MAX_BATCH = DECODE_ROWS            # one graph takes a step of up to 16 rows (models/base.py _in_graphs splits wider)
# The deepest position the wider buckets' last row may reach. A captured row attends through the decode kernels
# over every key up to its position: on the H200 (session 18, the 30B-shaped file) 40 ids took 34 ms captured
# against 44 ms uncaptured at position 0, but 52 against 39 at position 4,000, and 64 ids 37 against 40 at 0,
# 54 against 43 at 4,000; 16 ids won at both (25 against 37, 29 against 37).
PROMPT_DEPTH = {32: 512, 64: 512, 128: 512}


def pdl_enabled() -> bool:
    return os.environ.get("BLOOMERY_CUDA_PDL", "1") != "0"


@dataclass
class _Graph:
    graph: object
    stream: object
    pool: object
    io: object          # int32 on the card: ids, slots, positions [3, B], then a decode step's banned ids
                        # [GREEDY_BANS, B] (-1: none); a prompt's: ids, slots, positions and its last row at [3, 0]
    host_io: object     # the same in pinned host memory
    logits: object      # [B, V] (a prompt's: [1, V])
    picked: object = None   # [B] (decode steps)
    posts: int = 0      # host jobs the step posts to the offload's bell (armed before each launch)
    ring: list = None   # decode steps: LAUNCH_RING (inputs, picks) pairs in pinned host memory, one a launch in turn
    turn: int = 0       # the ring's next pair


# A decode graph's launches in flight at once, at most: one waited for, one chained behind it (begin_chain), one
# being made. Each launch copies its inputs from, and its picks to, a pinned pair of its own, so a launch made
# while earlier ones have not yet run leaves their copies' bytes alone.
LAUNCH_RING = 4


class _Picks:
    """A launched greedy step's ids: copied to pinned memory behind the step on its stream (so a step chained after
    it may overwrite the graph's own), handed over by wait(). g: the graph it launched, which a chained step must be."""

    def __init__(self, g: _Graph, out: np.ndarray, event):
        self.g, self._out, self._event = g, out, event

    def wait(self) -> np.ndarray:
        self._event.synchronize()
        return self._out.copy()


def prompt_graphs_enabled() -> bool:
    return os.environ.get("BLOOMERY_CUDA_PROMPT_GRAPHS", "1") != "0"


def _capture_mode():
    rt = cupy.cuda.runtime
    return getattr(rt, "streamCaptureModeRelaxed", 2)


def _recurrent_state(model):
    """The model's recurrent state (cuda/recurrent.py), or None for a model without one."""
    state = getattr(model, "state", None)
    return state if state is not None and hasattr(state, "held") else None


def _pinned_io(rows: int, b: int) -> np.ndarray:
    """[rows, b] int32 zeros in pinned host memory: a graph's inputs, copied in before each launch."""
    io = np.frombuffer(cupy.cuda.alloc_pinned_memory(rows * b * 4), np.int32, rows * b).reshape(rows, b)
    io[:] = 0
    return io


def _record(ops, host_io: np.ndarray, body, pool=None, stream=None):
    """body(io) captured as one graph on a stream and a memory pool of its own (or the ones given, which graphs
    that never run at once may share), io being host_io's copy on the card (from that pool): (graph, stream,
    pool, io, what body returned)."""
    pool = pool if pool is not None else cupy.cuda.MemoryPool()
    stream = stream if stream is not None else cupy.cuda.Stream(non_blocking=True)
    with cupy.cuda.using_allocator(pool.malloc), stream:
        io = cupy.asarray(host_io)
        stream.synchronize()
        ops.k.pdl = pdl_enabled()
        stream.begin_capture(_capture_mode())
        try:
            out = body(io)
        finally:
            graph = stream.end_capture()
            ops.k.pdl = False
    return graph, stream, pool, io, out


class DecodeGraphs:
    def __init__(self, model, max_batch: int = MAX_BATCH):
        self.model, self.max_batch = model, max_batch
        self._graphs: dict[int, _Graph] = {}
        self._prompts: dict[int, _Graph] = {}
        self._any_depth = False      # the buckets past DECODE_ROWS take any depth (attn_prompt, capture_prompts)
        self._prompt_pool = self._prompt_stream = None     # shared by the prompt graphs (capture_prompts)

    def _dry_run(self, b: int) -> None:
        """The step of b rows once outside the capture, where something it meets would otherwise first be
        made inside it: a model with a recurrent state (cuda/recurrent.py's CuPy array code, whose kernels
        CuPy compiles per shape on first use, so each is compiled and loaded before it and a fault shows
        here), and host experts whose layers the offload has not met yet (it makes their tables and
        pinned buffers on first sight, copies a capture refuses). The step runs at position 0 of slots
        0 .. b-1: what it writes there (K and V at position 0, the recurrent state and its counts) is put
        back after."""
        model = self.model
        state = _recurrent_state(model)
        recurrent = state is not None
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
        offload = getattr(ops, "offload", None)
        posts0 = offload.posts if offload is not None else 0

        def step(io):
            x = model.embed(io[0])                                                  # [B, D]
            x = model.layers_forward(x, Rows(None, io[1], io[2]))
            logits = model.head(x)                                                  # [B, V]
            ops.ban(logits, io[3:])               # a greedy request's bans (ignore_eos's): none (-1) but in begin/run
            return logits, ops.argmax(logits)                                       # [B]
        host_io = _pinned_io(3 + GREEDY_BANS, b)
        graph, stream, pool, io, (logits, picked) = _record(ops, host_io, step)
        posts = offload.posts - posts0 if offload is not None else 0
        ring = [(_pinned_io(3 + GREEDY_BANS, b), _pinned_io(1, b)[0]) for _ in range(LAUNCH_RING)]
        return _Graph(graph, stream, pool, io, host_io, logits, picked, posts, ring)

    def _launch(self, slots, ids, positions, bans=None, after: _Picks | None = None) -> tuple[_Graph, np.ndarray]:
        """The step of these rows launched; bans: [GREEDY_BANS, B] ids each row's greedy pick skips (their logits
        set to -inf, so the logits handed over carry them too), -1 for none; None: no bans. after: a launch of the
        same graph this one follows on its stream, whose picks on the card are this step's ids (ids unused). Gives
        the graph and the pinned [B] its picks may be copied to."""
        b = len(slots)
        g = self._graphs.get(b)
        if g is None:
            g = self._graphs[b] = self._capture(b)
        host_io, out = g.ring[g.turn % LAUNCH_RING]
        g.turn += 1
        if after is None:
            host_io[0] = ids
        host_io[1], host_io[2] = slots, positions
        host_io[3:] = -1 if bans is None else bans
        g.io.set(host_io, stream=g.stream)
        if after is not None:        # the step before's picks, on the card, as this step's ids
            if after.g is not g:
                raise ValueError("a chained step follows a launch of the same batch's graph")
            cupy.cuda.runtime.memcpyAsync(g.io.data.ptr, g.picked.data.ptr, b * 4,
                                          cupy.cuda.runtime.memcpyDeviceToDevice, g.stream.ptr)
        if g.posts:
            self.model.ops.offload.arm(g.posts)
        g.graph.launch(g.stream)
        return g, out

    def _picks_behind(self, g: _Graph, out: np.ndarray) -> _Picks:
        """The launch's picks copied to `out` behind it on its stream, and an event after the copy."""
        cupy.cuda.runtime.memcpyAsync(out.ctypes.data, g.picked.data.ptr, out.nbytes,
                                      cupy.cuda.runtime.memcpyDeviceToHost, g.stream.ptr)
        event = cupy.cuda.Event(block=False, disable_timing=True)
        event.record(g.stream)
        return _Picks(g, out, event)

    def run_topk(self, slots, ids, positions, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The step, then the k largest logits of each row on the card (ops.topk, after the graph
        on its stream): only k ids and values a row come back."""
        return self.begin_topk(slots, ids, positions, k)()

    @staticmethod
    def _fetch(g: _Graph, a) -> np.ndarray:
        """a (the graph's logits or picks) on the host once the step has run."""
        out = a.get(stream=g.stream)
        g.stream.synchronize()
        return out

    def begin(self, slots, ids, positions, bans=None) -> _Picks:
        """The greedy step launched (at most max_batch rows; bans as _launch's): a handle whose wait() waits for it
        and returns its ids."""
        return self._picks_behind(*self._launch(slots, ids, positions, bans))

    def chains(self, b: int) -> bool:
        """Whether a step of b rows may be chained behind another (begin_chain): its graph posts no host jobs,
        which are armed per launch and run as the step reaches them."""
        g = self._graphs.get(b)
        return g is not None and not g.posts

    def begin_chain(self, after: _Picks, slots, positions, bans=None) -> _Picks:
        """The greedy step after `after` (a launch of the same rows not yet waited for, or waited for) launched
        behind it on the card: its ids are after's picks there, so the host launches it before it knows them and
        the card runs the two back to back. A handle as begin's."""
        if not self.chains(len(slots)):
            raise ValueError(f"a step of {len(slots)} rows cannot be chained (no graph yet, or it has host experts)")
        return self._picks_behind(*self._launch(slots, None, positions, bans, after=after))

    def begin_topk(self, slots, ids, positions, k: int):
        """The step and its rows' k largest logits launched (run_topk's work, not waited for): a function that
        waits for them and returns them."""
        g, _ = self._launch(slots, ids, positions)
        with g.stream:
            got = self.model.ops.topk(g.logits, k)

        def fetch():
            out = tuple(a.get(stream=g.stream) for a in got)
            g.stream.synchronize()
            return out
        return fetch

    def run(self, slots, ids, positions, want_logits: bool, bans=None) -> np.ndarray:
        g, _ = self._launch(slots, ids, positions, bans)
        return self._fetch(g, g.logits if want_logits else g.picked)

    # --- short prompts of one slot ---
    def prompt_capturable(self) -> bool:
        """Whether this model's short prompts may be captured (the module's legend says when not)."""
        return (prompt_graphs_enabled() and _recurrent_state(self.model) is None
                and getattr(self.model.ops, "offload", None) is None)

    def prompt_bucket(self, n: int, pos0: int) -> int | None:
        """The bucket a prompt of n ids at pos0 runs in, or None (the uncaptured path). Where the graphs were
        captured with attn_prompt (BLOOMERY_CUDA_PROMPT_ATTN=tc, the default: sizes.prompt_attn) the buckets past
        DECODE_ROWS rows take any depth."""
        if n < 1 or not self.prompt_capturable():
            return None
        m, any_depth = self.model, self._any_depth
        for b in PROMPT_BUCKETS:
            if n <= b:
                end = pos0 + b
                if end > m.n_ctx_slot:
                    return None
                if any_depth and b > DECODE_ROWS:
                    return b
                if b in PROMPT_FROM_START and pos0:
                    return None
                return b if end <= PROMPT_DEPTH.get(b, end) else None
        return None

    def capture_prompts(self) -> list[int]:
        """Every bucket's graph that fits the slot, in order; [] where none may be. The warm-up calls this
        last: its own prompts before took the uncaptured paths, which passes of several slots still take."""
        hp = getattr(self.model, "hp", None)
        # how these graphs attend is fixed as they are captured (BLOOMERY_CUDA_PROMPT_ATTN then), so are the
        # depths their buckets take
        self._any_depth = hp is not None and tc_prompt_fits(hp.n_head, hp.n_head_kv, hp.head_dim)
        done = []
        for b in sorted(PROMPT_BUCKETS, reverse=True):     # the widest first: the smaller ones reuse its blocks
            if self.prompt_bucket(b, 0) == b:       # fits the slot
                if b not in self._prompts:
                    self._prompts[b] = self._capture_prompt(b)
                done.append(b)
        return sorted(done)

    def _prompt_pass(self, io):
        model = self.model
        x = model.embed(io[0])                                                  # [B, D]
        x = model.layers_forward(x, Rows(None, io[1], io[2], fresh=io.shape[1] in PROMPT_FROM_START))
        return model.head(model.ops.take_rows(x, io[3, :1]))                    # [1, V]

    def _capture_prompt(self, b: int) -> _Graph:
        """The bucket's graph, after one uncaptured pass of it (cuBLAS loads its kernels for these shapes outside
        the capture), which writes slot 0's K and V at positions 0 .. b-1: the warm-up's, before any request."""
        ops = self.model.ops
        ops.k.compile_all()                         # no module loads inside a capture
        host_io = _pinned_io(4, b)
        host_io[2] = np.arange(b)
        host_io[3, 0] = b - 1
        self._prompt_pass(cupy.asarray(host_io))
        cupy.cuda.get_current_stream().synchronize()
        if self._prompt_pool is None:
            self._prompt_pool, self._prompt_stream = cupy.cuda.MemoryPool(), cupy.cuda.Stream(non_blocking=True)
        graph, stream, pool, io, logits = _record(ops, host_io, self._prompt_pass, self._prompt_pool,
                                                  self._prompt_stream)
        return _Graph(graph, stream, pool, io, host_io, logits)

    def prompt(self, slot: int, ids, pos0: int) -> np.ndarray | None:
        """The last id's logits [V] of a prompt of one slot run as its bucket's graph (the slot's KV filled at
        pos0 .. pos0+n-1, and padding past it), or None where it is not captured (prompt_bucket)."""
        n = len(ids)
        b = self.prompt_bucket(n, pos0)
        if b is None:
            return None
        g = self._prompts.get(b)
        if g is None:                               # the warm-up captures them; without it (--no-warmup), none
            return None
        g.host_io[0, :n] = ids
        # the padding repeats the prompt's ids, so its rows route as the prompt's do: rows of one id all go to
        # the same experts, and the grouped MoE then waits on those (H200, session 23: 129 ids in the bucket of
        # 256 at a depth of 4,255 took 43.7 ms padded with id 0, 256 ids 38.8 ms)
        g.host_io[0, n:] = np.resize(np.asarray(ids, np.int32), b - n)
        g.host_io[1] = slot
        g.host_io[2] = np.arange(pos0, pos0 + b)
        g.host_io[3, 0] = n - 1
        g.io.set(g.host_io, stream=g.stream)
        g.graph.launch(g.stream)
        out = g.logits.get(stream=g.stream)
        g.stream.synchronize()
        return out[0]
