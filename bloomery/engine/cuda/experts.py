"""Routed experts split between the card and host RAM: the offload tier of the cuda backend.

A layer whose placement keeps routed experts on the host holds every one of its experts in pinned
host RAM (the residency's home: an expert leaves the card by a table write, never by a copy) and a
fixed number of card slots. Each stacked tensor (gate, up, down) has a device table of expert
addresses that the MoE kernels read: a resident expert points at its card slot, a host expert at a
block of zero bytes, whose product is exactly zero. So the card kernels run unchanged and add
nothing for host experts, and moving an expert is a table rewrite: no graph is recaptured.

Decode-sized batches (moe.ffn's mat-vec path) split the step's host picks in two lanes, chosen
on the card in each step (kernels/moe.cu host_post, residency.bus_picks: of the m distinct host
experts the step picks, the first round(m * share) in pick order go over the bus):
- computed on the host, in the same step: host_post writes the rows, ids, weights and the lane
  flags into the layer's pinned buffers, which the card maps, then a job word; the bell thread of
  kernels/host_moe.c, spinning while a step is in flight, runs the host kernel on them and writes
  an answer word; host_take, after the card's own experts, waits for that word and adds the sum.
  No copy, event or host node a layer (they cost some 50 µs a layer, docs/performance.md run N);
- streamed to the card: the pick's table entries point at its slot in the card staging buffer,
  and a copy kernel (moe_stream_in) fills it from pinned host RAM over the bus while the host
  computes the other lane; the card's expert kernels then read it there. Both lanes read the same
  host RAM; the share is measured (residency.STREAM_SHARE). Chosen per step, the split is even in
  every layer whatever the picks; a lane fixed per expert split a layer's picks binomially, and a
  step waited on the longer lane.
  A direct read of host RAM by the expert kernels themselves was measured slower (docs/verify.md).
Prompt batches stream the used host experts' bytes to a card staging buffer and compute every
expert on the card (stage_tables); the prompt's most-used ones then take card slots from the
staging copy (adopt), so decode starts warm.

Residency (bloomery/residency.py decides, this file carries out): each step's routing is counted
per expert on the card; between steps, every RESIDENCY_EVERY steps, the hottest host experts swap
with the coldest resident ones within a byte budget per update; the copies run on a copy stream
while the next steps compute, and an expert's table entry points at its slot once its copy is done.

Legend: E = experts, S = card slots of a layer, T = rows, A = experts per token, D = hidden size.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import cupy
import numpy as np

from bloomery import residency as policy
from bloomery.engine.cuda.pinned import huge_pinned, pinned
from bloomery.engine.cuda.sizes import DECODE_ROWS

H2D, D2D = 1, 3                         # cudaMemcpyKind
RESIDENCY_EVERY = 16                     # decode steps between residency updates
STREAM_CHUNKS = 48                       # blocks per picked expert of the streamed lane's copy
BELL_LAYERS = 4096                       # layers with host experts a model may have (the bell's words)


def _block(name: str) -> int:
    """The block number of a GGUF tensor name (blk.N....), -1 for others."""
    parts = name.split(".")
    return int(parts[1]) if len(parts) > 2 and parts[0] == "blk" and parts[1].isdigit() else -1


def _memcpy(dst: int, src: int, nbytes: int, kind: int, stream) -> None:
    cupy.cuda.runtime.memcpyAsync(dst, src, nbytes, kind, stream.ptr)


class ExpertStack:
    """One stacked expert tensor [K, N, E] of a layer with host experts: every expert in pinned host
    RAM, `n_slots` card slots, and the device table the card kernels read. Looks like a CudaWeight
    to moe.py (ggml_type, shape, n_cols, n_rows, n_expert, row_bytes, table, quantized)."""

    def __init__(self, name: str, ggml_type: int, shape, data: np.ndarray, row_bytes: int, on_card: list[int],
                 zero_ptr: int):
        self.name, self.block = name, _block(name)
        self.ggml_type, self.shape = int(ggml_type), tuple(int(s) for s in shape)
        self.n_cols, self.n_rows, self.n_expert = self.shape[0], self.shape[1], self.shape[2]
        self.row_bytes = row_bytes
        self.expert_bytes = row_bytes * self.n_rows
        raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        if raw.size != self.expert_bytes * self.n_expert:
            raise ValueError(f"an expert stack of shape {self.shape} holds {raw.size} bytes, "
                             f"not {self.expert_bytes * self.n_expert}")
        self.host = huge_pinned(raw.size)                                      # huge pages: quick to page-lock
        self.host[:] = raw                                                   # every expert, host side
        self.host_ptrs = (self.host.ctypes.data + self.expert_bytes * np.arange(self.n_expert, dtype=np.uint64)
                          ).astype(np.uint64)                                 # [E] the host function reads these
        self.slots = cupy.empty(len(on_card) * self.expert_bytes, cupy.uint8)   # [S * expert bytes]
        self.zero_ptr = zero_ptr
        self.mirror = np.full(self.n_expert, zero_ptr, np.uint64)           # [E] what `table` holds
        for s, e in enumerate(on_card):
            self.slots[s * self.expert_bytes:(s + 1) * self.expert_bytes].set(raw[e * self.expert_bytes:
                                                                                  (e + 1) * self.expert_bytes])
            self.mirror[e] = self.slot_ptr(s)
        self.table = cupy.asarray(self.mirror)                               # [E] device addresses
        self.on_card = list(on_card)

    quantized = True

    @property
    def n_bytes(self) -> int:
        return int(self.slots.size)

    def slot_ptr(self, s: int) -> int:
        return int(self.slots.data.ptr) + s * self.expert_bytes

    def host_ptr(self, e: int) -> int:
        return int(self.host_ptrs[e])


@dataclass
class _HostCall:
    """One layer's pinned buffers and argument block for calls of T rows."""
    x: np.ndarray
    ids: np.ndarray
    wts: np.ndarray
    out: np.ndarray
    args: object


class ExpertLayer:
    """A layer's three stacks moved together: which expert holds which slot, the host function's
    skip flags (1: on the card), and the layer's routing counts on the card."""

    def __init__(self, index: int, gate: ExpertStack, up: ExpertStack, down: ExpertStack, counts,
                 share: float = 0.0, lanes=None):
        if not (gate.on_card == up.on_card == down.on_card):
            raise ValueError(f"layer {index}: gate, up and down hold different experts on the card")
        self.index, self.stacks = index, (gate, up, down)
        self.block = gate.block                                               # the model's block number
        self.n_expert = gate.n_expert
        self.slot_of = np.full(self.n_expert, -1, np.int64)
        for s, e in enumerate(gate.on_card):
            self.slot_of[e] = s
        self.n_slots = len(gate.on_card)
        self.skip = pinned(self.n_expert)                                     # [E] read by the host function
        self.home = frozenset(gate.on_card)                                   # the load's placement
        self.counts = counts                                                  # [E] int32 view on the card
        self.calls: dict[int, _HostCall] = {}
        self._io = None                                                       # the calls' pinned x, ids, wts, out
        self.expert_bytes = sum(s.expert_bytes for s in self.stacks)
        self.pending: list[tuple[int, int, object]] = []                      # (expert, slot, copy done event)
        # the streamed lane: [3, E] each stack's host address of every expert (fixed); [E] the staging
        # buffer's address for each host expert (0: on the card); [E] the slots of the current step's
        # bus picks (host_post writes it, moe_stream_in reads it)
        self.src = cupy.asarray(np.stack([st.host_ptrs for st in self.stacks]))
        if lanes is None:                  # (host mirror, device) of dst, and dst_step: rows of the Offload's arrays
            lanes = (np.zeros(self.n_expert, np.uint64), cupy.zeros(self.n_expert, cupy.uint64),
                     cupy.zeros(self.n_expert, cupy.uint64))
        self.dst_mirror, self.dst, self.dst_step = lanes
        self.dst_mirror[:] = 0
        self.stream_base = 0                                                  # the staging buffer (Offload sets it)
        self.can_stream = all(st.expert_bytes % 16 == 0 for st in self.stacks)   # the copy moves 16 bytes a load
        self.share = share if self.can_stream else 0.0
        self._relane()

    @property
    def on_card(self) -> frozenset[int]:
        return frozenset(int(e) for e in np.nonzero(self.slot_of >= 0)[0])

    @property
    def host_count(self) -> int:
        return int(self.n_expert - (self.slot_of >= 0).sum())

    @property
    def streams(self) -> bool:
        """Whether a decode step sends host picks over the bus: a share, and staging to copy into
        (fixed once the layers are seen, so a captured step never lacks the copy a later step needs)."""
        return self.share > 0 and bool(self.stream_base)

    # --- table writes (between steps only: nothing in flight reads them) ---
    def _upload(self) -> None:
        for st in self.stacks:
            st.table.set(st.mirror)
        self.dst.set(self.dst_mirror)
        self.dst_step.fill(0)

    def _relane(self) -> None:
        """Every host expert's lane entry (the staging buffer's address: host_post gives a step's bus
        picks its slots in pick order), table entries (the zero block: a step's host_post points its
        bus picks at their slots) and skip flag (0: the host computes it unless host_post says it
        went over the bus). Card experts point at their slots (seat) and are skipped by the host."""
        host = self.slot_of < 0
        self.skip[:] = ~host
        self.dst_mirror[:] = 0
        if self.stream_base:
            self.dst_mirror[host] = self.stream_base
        for st in self.stacks:
            st.mirror[host] = st.zero_ptr

    def evict(self, e: int, relane: bool = True) -> int:
        s = int(self.slot_of[e])
        self.slot_of[e] = -1
        if relane:
            self._relane()
        return s

    def seat(self, e: int, s: int, relane: bool = True) -> None:
        self.slot_of[e] = s
        for st in self.stacks:
            st.mirror[e] = st.slot_ptr(s)
        if relane:
            self._relane()

    # --- host calls ---
    def host_call(self, t: int, d: int, n_used: int, threads: int) -> _HostCall:
        """The host call of t rows: its args over the first t rows of the layer's one set of pinned buffers
        (DECODE_ROWS rows: a layer has one job in flight at a time, whatever its rows; host_take waits for
        it before the step goes on)."""
        c = self.calls.get(t)
        if c is None:
            from bloomery.engine.cpu.host_moe import HostMoeArgs
            io = self._io
            if io is None or io[0].shape[0] < t or io[0].shape[1] != d or io[1].shape[1] != n_used:
                r = max(t, DECODE_ROWS)
                io = self._io = (pinned(4 * r * d, np.float32, (r, d)), pinned(4 * r * n_used, np.int32, (r, n_used)),
                                 pinned(4 * r * n_used, np.float32, (r, n_used)), pinned(4 * r * d, np.float32, (r, d)))
            c = _HostCall(*(a[:t] for a in io), None)
            gate, up, down = self.stacks
            c.args = HostMoeArgs(
                n_rows=t, n_used=n_used, d=d, f=gate.n_rows, gate_type=gate.ggml_type, up_type=up.ggml_type,
                down_type=down.ggml_type, n_threads=threads, gate_row_bytes=gate.row_bytes,
                up_row_bytes=up.row_bytes, down_row_bytes=down.row_bytes, ids=c.ids.ctypes.data,
                wts=c.wts.ctypes.data, x=c.x.ctypes.data, out=c.out.ctypes.data, gate=gate.host_ptrs.ctypes.data,
                up=up.host_ptrs.ctypes.data, down=down.host_ptrs.ctypes.data, skip=self.skip.ctypes.data,
                busy_ns=0)
            self.calls[t] = c
        return c


class Offload:
    """Every offloaded layer of one model on the card, the side streams, the counts and residency."""

    def __init__(self, ops, residency: bool, threads: int, budget: int | None = None):
        # -t (0: every core but two: one for the engine's thread, which spins while it waits on the card,
        # one for the server's other threads; a host worker preempted inside a call holds up its phase. On
        # the H200 host, 16 cores: in-process with 14 threads a token took 26 ms, served with 15 it took 55).
        # The bell thread that takes the card's jobs runs each one with the pool, so it is one of them.
        self.ops, self.residency = ops, residency
        self.threads = threads if threads > 0 else max(1, len(os.sched_getaffinity(0)) - 2)
        self.layers: list[ExpertLayer] = []
        self._by_gate: dict[int, ExpertLayer] = {}
        self._stacks: list[ExpertStack] = []
        self.copy = cupy.cuda.Stream(non_blocking=True)                      # residency copies
        self.counts = None                                                    # [L, E] int32 on the card
        self.seen = None                                                      # [L, E] counts at the last update
        self.score = None                                                     # [L, E] decayed routing (the ranking)
        self.prompt_weight = policy.prompt_weight()                           # BLOOMERY_RESIDENCY_PROMPT_WEIGHT
        self.keep = policy.keep_per_update(policy.half_life(), RESIDENCY_EVERY)  # BLOOMERY_RESIDENCY_HALF_LIFE
        self.recent = None                                                    # [L, E] routing since the last update
        self.steps = 0
        self.budget = budget if budget is not None else int(os.environ.get("BLOOMERY_RESIDENCY_MIB", "256")) << 20
        self.share = policy.stream_share()
        self.stats = {"moved_experts": 0, "moved_bytes": 0, "host_wait_s": 0.0, "updates": 0}
        self.hits = self.misses = None
        self._zero = None
        self.staging = None                                                   # card buffer for streamed prompts
        self.bell = None                                                      # made with the first layer
        self.posts = 0                                                        # bell posts captured so far
        # every stack's table and every layer's lanes in one array each (made with the first layer, once the
        # load has made every stack), so that a residency update rewrites them in one copy each
        self.mirrors = self.tables = None                                     # [stacks, E]
        self.lane_mirrors = self.lane_dst = self.lane_step = None             # [layers, E]

    def _open_bell(self) -> None:
        from bloomery.engine.cpu.host_moe import Bell
        self.bell_post = pinned(8 * BELL_LAYERS, np.int64)                    # [L] job words, the card's
        self.bell_done = pinned(8 * BELL_LAYERS, np.int64)                    # [L] answers, the host's
        self.bell_post[:] = 0
        self.bell_done[:] = 0
        self.bell_seq = cupy.zeros(BELL_LAYERS, cupy.int64)                   # [L] jobs posted, on the card
        self.bell = Bell(BELL_LAYERS, DECODE_ROWS, self.bell_post, self.bell_done)

    def _gather(self, n_exp: int) -> None:
        """Every stack's table into one [stacks, E] array (each stack's table and mirror become its row),
        and the lanes of as many layers as the stacks make: a residency update then writes every
        table with one copy. Stacks of another expert count keep their own arrays."""
        same = [st for st in self._stacks if st.n_expert == n_exp]
        if not same:
            return
        self.mirrors = np.stack([st.mirror for st in same])
        self.tables = cupy.asarray(self.mirrors)
        for i, st in enumerate(same):
            st.mirror, st.table = self.mirrors[i], self.tables[i]
        n_layers = len({st.block for st in same}) or len(same) // 3
        self.lane_mirrors = np.zeros((n_layers, n_exp), np.uint64)
        self.lane_dst = cupy.zeros((n_layers, n_exp), cupy.uint64)
        self.lane_step = cupy.zeros((n_layers, n_exp), cupy.uint64)

    def _upload_all(self) -> None:
        """Every layer's tables and lanes to the card (between steps), then wait for the copies on this
        stream: the captured steps run on their own streams."""
        if self.tables is None:
            for ly in self.layers:
                ly._upload()
        else:
            self.tables.set(self.mirrors)
            self.lane_dst.set(self.lane_mirrors)
            self.lane_step.fill(0)
            for ly in self.layers:                           # a layer past the gathered ones (none in practice)
                if ly.index >= len(self.lane_mirrors):
                    ly._upload()
        cupy.cuda.get_current_stream().synchronize()

    def set_threads(self, threads: int) -> None:
        """Host threads for every later host call (the bell reads each call's args as it runs it)."""
        if threads < 1:
            raise ValueError(f"host threads must be at least 1, not {threads}")
        self.threads = threads
        for ly in self.layers:
            for c in ly.calls.values():
                c.args.n_threads = threads

    def arm(self, jobs: int) -> None:
        """A captured step that posts `jobs` bell jobs is about to be launched."""
        if self.bell is not None and jobs:
            self.bell.arm(jobs)

    def zero_ptr(self, nbytes: int) -> int:
        """A block of zero bytes at least `nbytes` long: a host expert's table entry."""
        if self._zero is None or self._zero.size < nbytes:
            self._zero = cupy.zeros(nbytes, cupy.uint8)
            for st in self._stacks:                                   # re-point what was made before
                st.mirror[st.mirror == st.zero_ptr] = int(self._zero.data.ptr)
                st.zero_ptr = int(self._zero.data.ptr)
                st.table.set(st.mirror)
        return int(self._zero.data.ptr)

    def stack(self, name: str, ggml_type, shape, data, row_bytes: int, host: tuple[int, int]) -> ExpertStack:
        first, stop = host
        n_exp = int(shape[2])
        on_card = [e for e in range(n_exp) if not first <= e < stop]
        st = ExpertStack(name, ggml_type, shape, data, row_bytes, on_card, self.zero_ptr(row_bytes * int(shape[1])))
        self._stacks.append(st)
        return st

    def layer(self, gate, up, down, n_used: int) -> ExpertLayer | None:
        """The ExpertLayer of these stacks (made on first sight, in layer order, with the host calls of
        every decode batch size, so no pinned buffer is made inside a captured step), or None for
        card-only ones."""
        if not isinstance(gate, ExpertStack):
            return None
        got = self._by_gate.get(id(gate))
        if got is None:
            i = len(self.layers)
            n_exp = gate.n_expert
            if self.counts is None or self.counts.shape[1] != n_exp:
                self.counts = cupy.zeros((0, n_exp), cupy.int32)
            # grow the [L, E] count matrix by one row: rows are views, so re-point the earlier layers
            grown = cupy.zeros((i + 1, n_exp), cupy.int32)
            grown[:i] = self.counts[:i]
            self.counts = grown
            for j, ly in enumerate(self.layers):
                ly.counts = grown[j]
            if self.bell is None:
                self._open_bell()
                self._gather(n_exp)
            lanes = ((self.lane_mirrors[i], self.lane_dst[i], self.lane_step[i])
                     if self.lane_mirrors is not None and i < len(self.lane_mirrors) else None)
            got = ExpertLayer(i, gate, up, down, grown[i], self.share, lanes)
            if i >= BELL_LAYERS:
                raise ValueError(f"{i + 1} layers with host experts: the bell has words for {BELL_LAYERS}")
            for t in range(1, DECODE_ROWS + 1):
                self.bell.set_args(i, t, got.host_call(t, gate.n_cols, n_used, self.threads).args)
            self.layers.append(got)
            self._by_gate[id(gate)] = got
            self._ensure_staging(self.staging_bytes(0))
            self.seen = np.zeros((i + 1, n_exp), np.int64)
            self.score = np.zeros((i + 1, n_exp), np.int64)
            self.recent = np.zeros((i + 1, n_exp), np.int64)
            self.hits, self.misses = np.zeros(i + 1, np.int64), np.zeros(i + 1, np.int64)
        return got

    # --- the decode path: host experts computed on the host, in the step ---
    def host_start(self, layer: ExpertLayer, x, ids, wts):
        """Hand the host part of a decode-sized batch over (on the current stream): host_post picks
        the step's bus lane (table entries, dst_step, skip flags), writes the rows, ids and weights
        into the layer's pinned buffers and posts the job word. The bell is armed here for an eager
        step; a captured one counts its posts in self.posts and its launcher arms them (graph.py).
        Returns what host_finish takes."""
        t, d = x.shape
        c = layer.host_call(t, d, ids.shape[1], self.threads)
        if cupy.cuda.get_current_stream().is_capturing():
            self.posts += 1
        else:
            self.bell.arm(1)
        g, u, dn = layer.stacks
        self.ops.k.host_post((1,), (512,), (
            x, ids, wts, np.int32(t * d), np.int32(ids.size), np.uint64(c.x.ctypes.data),
            np.uint64(c.ids.ctypes.data), np.uint64(c.wts.ctypes.data), self.bell_seq,
            np.uint64(self.bell_post.ctypes.data), np.int32(layer.index), np.int32(t),
            layer.dst, np.float32(layer.share if layer.streams else 0.0), np.int64(layer.expert_bytes),
            np.int32(self.staging_slots(layer)), g.table, u.table, dn.table,
            np.uint64(g.zero_ptr), np.int64(g.expert_bytes), np.int64(g.expert_bytes + u.expert_bytes),
            np.uint64(layer.skip.ctypes.data), layer.dst_step))
        return layer, c

    def host_finish(self, host, out) -> None:
        """out [T, D] += the host's sum for the job host_start posted, once its answer word is in
        (host_take, on the current stream)."""
        layer, c = host
        t, d = out.shape
        self.ops.k.host_take((t,), (256,), (out, np.uint64(c.out.ctypes.data), np.int32(d), self.bell_seq,
                                           np.uint64(self.bell_done.ctypes.data), np.int32(layer.index), np.int32(t)))

    # --- the prompt path: used host experts streamed to the card ---
    def stage_tables(self, layer: ExpertLayer, used: np.ndarray):
        """Device tables (gate, up, down) in which the used host experts point at copies streamed into
        the staging buffer (on the current stream, so the pass's kernels see them)."""
        if layer.pending:          # the update's copies land first, so the host experts are the plan's count (the staging's)
            self._finish(block=True)
        want = [int(e) for e in np.nonzero(used)[0] if layer.slot_of[e] < 0]
        if not want:
            return tuple(st.table for st in layer.stacks), {}
        need = len(want) * layer.expert_bytes
        self._ensure_staging(self.staging_bytes(need))
        main = cupy.cuda.get_current_stream()
        base, at, tables = int(self.staging.data.ptr), 0, []
        where = {}
        for st in layer.stacks:
            mirror = st.mirror.copy()
            for e in want:
                _memcpy(base + at, st.host_ptr(e), st.expert_bytes, H2D, main)
                mirror[e] = base + at
                where.setdefault(e, []).append(base + at)
                at += st.expert_bytes
            tables.append(cupy.asarray(mirror))
        return tuple(tables), where

    def _ensure_staging(self, need: int) -> None:
        """The card staging buffer at `need` bytes at least (made while the layers are first seen,
        before any step is captured), and every layer's streamed lane pointed into it."""
        if need > 0 and (self.staging is None or self.staging.size < need):
            self.staging = None
            self.staging = cupy.empty(need, cupy.uint8)
        base = int(self.staging.data.ptr) if self.staging is not None else 0
        for ly in self.layers:
            if ly.stream_base != base:
                ly.stream_base = base
                ly._relane()
                ly._upload()

    # --- the decode path's streamed lane ---
    def stream_in(self, layer: ExpertLayer, ids) -> None:
        """Copy the step's bus picks (dst_step, host_post's choice) from host RAM into their staging
        slots, on the current stream, before the layer's expert kernels (kernels/moe.cu moe_stream_in)."""
        g, u, d = layer.stacks
        self.ops.k.moe_stream_in((STREAM_CHUNKS, int(ids.size)), (256,), (
            layer.src, layer.dst_step, np.int32(layer.n_expert), ids, np.int32(ids.size), np.int64(g.expert_bytes),
            np.int64(u.expert_bytes), np.int64(d.expert_bytes)))

    def staging_slots(self, layer: ExpertLayer) -> int:
        """Experts of `layer` the staging buffer holds: a step's bus lane takes at most these (the buffer
        only grows, so a captured step's count stays a bound)."""
        return int(self.staging.size // layer.expert_bytes) if self.staging is not None else 0

    def staging_bytes(self, need: int) -> int:
        """The staging buffer holds the largest layer's host experts (what the plan counts)."""
        most = max((ly.host_count * ly.expert_bytes for ly in self.layers), default=need)
        return max(need, most)

    def adopt(self, layer: ExpertLayer, counts: np.ndarray, where: dict[int, list[int]]) -> None:
        """After a prompt pass: its most-used streamed experts take the coldest slots (a copy on the
        card from the staging buffer), when residency is on."""
        if not self.residency or not where or layer.n_slots == 0:
            return
        row = [int(c) for c in counts]
        coming = {e for e, _, _ in layer.pending}                             # already being copied in
        moves = [m for m in policy.layer_swaps(layer.index, row, layer.on_card, layer.expert_bytes)
                 if m.into_card in where and m.into_card not in coming]
        if not moves:
            return
        main = cupy.cuda.get_current_stream()
        for m in moves:
            s = layer.evict(m.out_of_card)
            for st, src in zip(layer.stacks, where[m.into_card]):
                _memcpy(st.slot_ptr(s), src, st.expert_bytes, D2D, main)
            layer.seat(m.into_card, s)
        layer._upload()
        self.stats["moved_experts"] += len(moves)

    # --- counting and residency between steps ---
    def count(self, layer: ExpertLayer, ids) -> None:
        _count_kernel()(ids.reshape(-1), layer.counts)

    def after_step(self, decode: bool) -> None:
        """Between steps: finish the copies that are done, and every RESIDENCY_EVERY decode steps (and
        after every prompt pass) read the counts and start the moves the policy picks."""
        if not self.layers:
            return
        self._finish(block=False)
        self.steps += 1
        if decode and self.steps % RESIDENCY_EVERY:
            return
        self._account()
        if not decode:                                                        # a prompt's counts, weighed
            self.recent = policy.weigh_prompt(self.recent, self.prompt_weight)
        self.score = policy.rank(self.score, self.recent, self.keep)          # older routing weighs less
        self.recent[:] = 0
        self.stats["updates"] += 1
        if not self.residency:
            return
        held = np.stack([ly.slot_of >= 0 for ly in self.layers])             # [L, E]
        chosen = policy.moves(self.score, held, [ly.expert_bytes for ly in self.layers], self.budget)
        if not chosen:
            return
        landed = cupy.cuda.Event(disable_timing=True)                        # recorded after the update's copies
        touched = {}
        for m in chosen:
            ly = self.layers[m.layer]
            if self._start_move(ly, m.into_card, m.out_of_card, landed):
                touched[ly.index] = ly
        landed.record(self.copy)
        if touched:
            for ly in touched.values():
                ly._relane()
            self._upload_all()

    def _account(self) -> None:
        """Routing since the last look: hits (a card expert) and misses (a host one) per layer, and the
        recent counts the next residency update ranks by (reading them changes no decision)."""
        now = cupy.asnumpy(self.counts).astype(np.int64)                      # [L, E] since load
        delta = now - self.seen
        self.seen = now
        on = np.stack([ly.slot_of >= 0 for ly in self.layers])               # [L, E]
        self.hits += (delta * on).sum(axis=1)
        self.misses += (delta * ~on).sum(axis=1)
        self.recent += delta

    def _start_move(self, layer: ExpertLayer, into: int, out: int, landed) -> bool:
        """Start copying `into` over `out`'s slot on the copy stream; `landed`, recorded by the caller
        after every copy of the update, says when it is there (the caller relanes and uploads)."""
        if any(e == into for e, _, _ in layer.pending):
            return False
        s = layer.evict(out, relane=False)
        for st in layer.stacks:
            _memcpy(st.slot_ptr(s), st.host_ptr(into), st.expert_bytes, H2D, self.copy)
        layer.pending.append((into, s, landed))
        self.stats["moved_experts"] += 1
        self.stats["moved_bytes"] += layer.expert_bytes
        return True

    def _finish(self, block: bool) -> None:
        changed, done = False, {}
        for ly in self.layers:
            if not ly.pending:
                continue
            left = []
            for e, s, ev in ly.pending:
                if id(ev) not in done:                   # one query an update's event
                    if block:
                        ev.synchronize()
                    done[id(ev)] = block or ev.done
                if done[id(ev)]:
                    ly.seat(e, s, relane=False)
                else:
                    left.append((e, s, ev))
            if len(left) != len(ly.pending):
                ly.pending = left
                ly._relane()
                changed = True
        if changed:
            self._upload_all()

    def reset(self) -> None:
        """Back to the load's placement (POST /residency/reset): copies on the copy stream, waited for."""
        self._finish(block=True)
        for ly in self.layers:
            extra = sorted(ly.on_card - ly.home)
            missing = sorted(ly.home - ly.on_card)
            for into, out in zip(missing, extra):
                s = ly.evict(out)
                for st in ly.stacks:
                    _memcpy(st.slot_ptr(s), st.host_ptr(into), st.expert_bytes, H2D, self.copy)
                ly.seat(into, s)
            ly._upload()
        self.copy.synchronize()
        cupy.cuda.Device().synchronize()
        if self.score is not None:                                            # layers seen (a step ran)
            self.score[:] = 0
            self.recent[:] = 0

    def report(self) -> dict:
        """What GET /residency and /metrics show (between steps)."""
        if self.layers:
            self._account()
        counts = self.seen if self.seen is not None else np.zeros((0, 0), np.int64)
        self.stats["host_wait_s"] = sum(c.args.busy_ns for ly in self.layers for c in ly.calls.values()) / 1e9
        return {"residency": "on" if self.residency else "off",
                "layers": [{"layer": ly.block, "counts": counts[ly.index].tolist(), "on_card": sorted(ly.on_card),
                            "hits": int(self.hits[ly.index]), "misses": int(self.misses[ly.index])}
                           for ly in self.layers],
                **{k: (round(v, 6) if isinstance(v, float) else v) for k, v in self.stats.items()}}


_COUNT = None


def _count_kernel():
    global _COUNT
    if _COUNT is None:
        _COUNT = cupy.ElementwiseKernel("int32 e", "raw int32 counts", "atomicAdd(&counts[e], 1)", "bloomery_count_routes")
    return _COUNT
