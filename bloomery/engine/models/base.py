"""The plumbing every architecture shares: batches in, logits out, the KV cache per slot.

An architecture file subclasses CausalLM, declares its tensors (one name map per layer) and
supplies `block` over models/layers.py; the embedding, the output head, prefill / decode /
forward_all live here once. Where the backends differ, the ops' `caps` says so.

Legend: T = tokens, B = slots in a decode batch, D = hidden, V = vocabulary.
"""
from __future__ import annotations

import math
import os
from typing import Callable, Sequence

import numpy as np

from bloomery.engine.model_api import EngineModel
from bloomery.engine.ops import AttnSpan, Ops, Rows
from bloomery.gguf_file import GGUFFile

# the tensors outside the layers, as every architecture here names them (llama.cpp's LLM_TENSOR_*)
TOKEN_EMBD, OUTPUT_NORM, OUTPUT = "token_embd.weight", "output_norm.weight", "output.weight"

class ModelError(ValueError):
    """A model file or a call the model cannot take; the message names the value and the bound."""


def meta(gf: GGUFFile, key: str, default=None, required: bool = True):
    """A GGUF metadata value, or a ModelError naming the missing key."""
    value = gf.get(key, default)
    if value is None and required:
        raise ModelError(f"{gf.path}: metadata key {key!r} is missing")
    return value


class CausalLM(EngineModel):
    """A decoder-only model over an Ops backend; subclasses fill in the architecture. Of the
    engine's optional calls (model_api.EngineModel) it has decode_greedy, save_kv / restore_kv,
    and decode_topk where the backend hands over a row's largest (topk_max > 0); a recurrent
    architecture sets rewinds = False."""

    arch: str = ""
    picks_on_device = True
    saves_kv = True
    shares_passes = True
    embeds = True

    def __init__(self, gf: GGUFFile, ops: Ops, n_slots: int, n_ctx_slot: int,
                 progress: Callable[[int, int], None] | None = None,
                 host_experts: dict[str, tuple[int, int]] | None = None):
        if n_slots < 1:
            raise ModelError(f"n_slots must be at least 1, got {n_slots}")
        if n_ctx_slot < 1:
            raise ModelError(f"n_ctx_slot must be at least 1, got {n_ctx_slot}")
        self.gf, self.ops = gf, ops
        self.n_slots, self.n_ctx_slot = n_slots, n_ctx_slot
        self.n_params = sum(int(np.prod(t.shape)) for t in gf.tensors.values())
        self.n_ubatch = ops.caps.n_ubatch                                # rows per prompt batch
        self.progress = progress                                         # (bytes read, bytes in the file)
        self.bytes_read, self.bytes_total = 0, sum(t.n_bytes for t in gf.tensors.values())
        self.host_experts = dict(host_experts or {})                     # name -> (first, stop) experts on the host

    # --- what an architecture provides ---
    n_vocab: int
    n_ctx_train: int
    n_layer: int

    def block(self, il: int, x, rows: Rows):                # [T, D] -> [T, D]
        raise NotImplementedError

    # --- helpers for architecture files ---
    def load_decoder(self, hp, layer_names: dict[str, str] | Sequence[dict[str, str]],
                     optional: frozenset[str] = frozenset(), kv_layers: Sequence[int] | None = None) -> None:
        """The shared decoder state from hyperparameters hp (models/layers.Hparams): the token
        embedding, each layer's tensors by `layer_names` (key -> GGUF name with {i}, one map for
        every layer or one per layer; those in `optional` may be absent), the output norm and head
        (tied to the embedding when the file has no output.weight), the attention scale and the KV
        cache of the layers in `kv_layers` (all when None; `kv_of[il]` is layer il's place in it)."""
        self.hp = hp
        self.n_layer, self.n_ctx_train = hp.n_layer, hp.n_ctx_train
        self.tok_embd = self.tensor(TOKEN_EMBD)
        self.n_vocab = int(self.gf.tensors[TOKEN_EMBD].shape[1])
        self.output_norm = self.tensor(OUTPUT_NORM)
        self.output = self.tensor(OUTPUT, required=False) or self.tok_embd
        maps = [layer_names] * hp.n_layer if isinstance(layer_names, dict) else list(layer_names)
        self.layers = [{k: self.tensor(n.format(i=i), required=k not in optional) for k, n in maps[i].items()}
                       for i in range(hp.n_layer)]
        self.kq_scale = float(np.float32(1.0) / np.float32(math.sqrt(hp.head_dim)))
        kv_layers = list(range(hp.n_layer)) if kv_layers is None else list(kv_layers)
        self.kv_of = {il: n for n, il in enumerate(kv_layers)}
        self.cache = self.ops.kv_cache(len(kv_layers), self.n_slots, self.n_ctx_slot, hp.n_head_kv, hp.head_dim)
        self._passes = [0, 0]          # prompt passes, of which captured (pass_counts)

    def embed(self, ids):                                   # [T] -> [T, D]
        return self.ops.get_rows(self.tok_embd, ids)

    def final_norm(self, x):                                # [T, D] -> [T, D]
        return self.ops.rms_norm(x, self.output_norm, self.hp.rms_eps)

    def head(self, x):                                      # [T, D] -> [T, V]
        return self.ops.matmul(self.final_norm(x), self.output)

    def head_topk(self, x, k: int):                         # [T, D] -> ids, values [T, k], NaN count [T]
        if self.ops.caps.fused_head:
            return self.ops.matmul_topk(self.final_norm(x), self.output, k)
        return self.ops.topk(self.head(x), k)

    def head_argmax(self, x):                               # [T, D] -> [T]
        if self.ops.caps.fused_head:
            return self.ops.matmul_argmax(self.final_norm(x), self.output)
        return self.ops.argmax(self.head(x))

    def tensor(self, name: str, required: bool = True):
        """A weight handle for GGUF tensor `name` (None if optional and absent)."""
        info = self.gf.tensors.get(name)
        if info is None:
            if required:
                raise ModelError(f"{self.gf.path}: tensor {name!r} is missing ({self.arch})")
            return None
        host = self.host_experts.get(name)
        if host is not None:            # routed experts partly in host RAM: the backend's offload tier
            w = self.ops.offloaded_weight(name, info.ggml_type, info.shape, self.gf.tensor_data(name), host)
        else:
            w = self.ops.weight(info.ggml_type, info.shape, self.gf.tensor_data(name))
        self.bytes_read += info.n_bytes
        if self.progress is not None:
            self.progress(self.bytes_read, self.bytes_total)
        return w

    # --- the Model contract ---
    def _run(self, ids: np.ndarray, positions: np.ndarray, spans: Sequence[AttnSpan]):
        x = self.embed(self.ops.from_host(ids))                          # [T, D]
        rows = self.ops.rows(spans, self.ops.from_host(positions))
        return self.layers_forward(x, rows)

    def layers_forward(self, x, rows: Rows):
        for il in range(self.n_layer):
            x = self.block(il, x, rows)                                  # [T, D]
        return x

    def _check(self, slot: int, ids, pos0: int) -> np.ndarray:
        if not 0 <= slot < self.n_slots:
            raise ModelError(f"slot {slot} is out of range: the model has {self.n_slots} slots (0..{self.n_slots - 1})")
        ids = np.asarray(ids, dtype=np.int32).reshape(-1)                # [T]
        if ids.size == 0:
            raise ModelError("ids is empty: at least one token is needed")
        if ids.min() < 0 or ids.max() >= self.n_vocab:
            bad = int(ids[(ids < 0) | (ids >= self.n_vocab)][0])
            raise ModelError(f"token id {bad} is out of range: n_vocab = {self.n_vocab}")
        if pos0 < 0 or pos0 + ids.size > self.n_ctx_slot:
            raise ModelError(f"positions {pos0}..{pos0 + ids.size - 1} do not fit the slot: n_ctx_slot = {self.n_ctx_slot}")
        return ids

    def forward_all(self, slot: int, ids, pos0: int) -> np.ndarray:
        """Every position's logits [T, V]; fills the slot's KV at pos0 .. pos0+T-1."""
        ids = self._check(slot, ids, pos0)
        outs = []
        for c0 in range(0, ids.size, self.n_ubatch):
            chunk = ids[c0:c0 + self.n_ubatch]                                # [t]
            p0 = pos0 + c0
            pos = np.arange(p0, p0 + chunk.size, dtype=np.int32)
            x = self._run(chunk, pos, [AttnSpan(slot, p0, 0, chunk.size)])
            outs.append(self.ops.to_host(self.head(x)))                 # [t, V]
        return np.concatenate(outs, axis=0)

    def hidden_states(self, slot: int, ids) -> np.ndarray:
        """Every position's final-norm output [T, D] (float32, host), in passes of n_ubatch ids from position 0;
        fills the slot's KV as a prompt pass does (llama.cpp's t_embd, what its pooling reads)."""
        ids = self._check(slot, ids, 0)
        outs = []
        for c0 in range(0, ids.size, self.n_ubatch):
            chunk = ids[c0:c0 + self.n_ubatch]                                # [t]
            pos = np.arange(c0, c0 + chunk.size, dtype=np.int32)
            x = self._run(chunk, pos, [AttnSpan(slot, c0, 0, chunk.size)])
            outs.append(np.asarray(self.ops.to_host(self.final_norm(x)), dtype=np.float32))   # [t, D]
        return np.concatenate(outs, axis=0)

    def prefill(self, slot: int, ids, pos0: int) -> np.ndarray:
        """The last position's logits [V]; fills the slot's KV at pos0 .. pos0+T-1."""
        return self.prefill_slots([(slot, ids, pos0)])[0]

    def prefill_slots(self, parts: Sequence[tuple[int, object, int]]) -> np.ndarray:
        """Several slots' prompt ids in shared passes: parts are (slot, ids [T], pos0), each slot at
        most once; the rows of all parts fill passes of up to n_ubatch rows in order, one span per
        part in a pass. Each part's last position's logits [n_parts, V]; fills each slot's KV at
        pos0 .. pos0+T-1."""
        checked = [(slot, self._check(slot, ids, pos0), pos0) for slot, ids, pos0 in parts]
        if not checked:
            raise ModelError("prefill_slots needs at least one (slot, ids, pos0)")
        slots = [slot for slot, _, _ in checked]
        if len(set(slots)) != len(slots):
            raise ModelError(f"prefill_slots got slot(s) more than once: {slots}")
        self._passes[0] += 1
        if len(checked) == 1:                   # a short prompt of one slot: its bucket's captured pass
            runner = self._graphs()
            got = runner.prompt(*checked[0]) if runner is not None else None
            if got is not None:
                self._passes[1] += 1
                self.ops.after_step(decode=False)
                return got[None]
        out = [None] * len(checked)
        ids_p, pos_p, spans, lasts = [], [], [], []                       # the pass being filled
        n_rows, big = 0, False

        def flush() -> None:
            nonlocal n_rows, big
            ids = np.concatenate(ids_p)                                   # [t]
            x = self._run(ids, np.concatenate(pos_p), spans)              # [t, D]
            if lasts:
                rows = self.ops.from_host(np.array([r for _, r in lasts], np.int32))
                logits = self.ops.to_host(self.head(self.ops.take_rows(x, rows)))   # [n, V]
                for j, (i, _) in enumerate(lasts):
                    out[i] = logits[j]
            big = big or ids.size > self.ops.caps.decode_rows
            ids_p.clear(), pos_p.clear(), spans.clear(), lasts.clear()
            n_rows = 0

        for i, (slot, ids, pos0) in enumerate(checked):
            off = 0
            while off < ids.size:
                take = min(self.n_ubatch - n_rows, ids.size - off)
                p0 = pos0 + off
                ids_p.append(ids[off:off + take])
                pos_p.append(np.arange(p0, p0 + take, dtype=np.int32))
                spans.append(AttnSpan(slot, p0, n_rows, n_rows + take))
                n_rows, off = n_rows + take, off + take
                if off == ids.size:
                    lasts.append((i, n_rows - 1))
                if n_rows == self.n_ubatch:
                    flush()
        if n_rows:
            flush()
        if self.ops.caps.prompt_scratch and big:                          # a prompt-path pass ran
            self.ops.release_scratch()
        self.ops.after_step(decode=False)
        return np.stack(out)

    @property
    def kv_bytes_per_position(self) -> int:
        """K and V bytes of one position of one slot (what a saved state costs per id)."""
        return int(self.cache.k.nbytes + self.cache.v.nbytes) // (self.n_slots * self.n_ctx_slot)

    def save_kv(self, slot: int, n: int, start: int = 0) -> tuple:
        """The slot's K and V at positions start .. n-1 as host arrays (a piece of the prompt cache's entry)."""
        return self.cache.save_state(slot, n, start)

    def pass_counts(self) -> dict[str, int]:
        return {"passes_prompt": self._passes[0], "passes_prompt_captured": self._passes[1]}

    def prompt_cache_budget(self, n_bytes: int) -> None:
        arena = getattr(self.cache, "arena", None)          # the card's KV cache keeps page-locked memory ahead
        if arena is not None:
            arena.set_limit(n_bytes)

    def host_idle(self, idle: bool) -> None:
        arena = getattr(self.cache, "arena", None)
        if arena is not None:
            arena.set_idle(idle)

    def restore_kv(self, slot: int, state: tuple, n: int, keep: int = 0, offset: int = 0) -> None:
        """Positions keep .. n-1 of the slot from a save_kv copy whose first position is `offset` (0 .. keep-1:
        the slot holds the same ids' KV already); later positions are rewritten by the prompt."""
        self.cache.restore_state(slot, state, n, keep, offset)

    def _decode_args(self, slots, ids, positions):
        slots = [int(s) for s in slots]
        ids = np.asarray(ids, dtype=np.int32).reshape(-1)                # [B]
        positions = np.asarray(positions, dtype=np.int32).reshape(-1)    # [B]
        if not (len(slots) == ids.size == positions.size) or not slots:
            raise ModelError(f"decode needs one id and one position per slot: got {len(slots)} slots, "
                             f"{ids.size} ids, {positions.size} positions")
        if len(set(slots)) != len(slots):
            raise ModelError(f"decode got slot(s) more than once: {slots}")
        for s, i, p in zip(slots, ids, positions):
            self._check(s, [i], int(p))
        return slots, ids, positions

    def _graphs(self):
        """The backend's captured decode steps, where it has them (None: the uncaptured path)."""
        return self.ops.decode_runner(self) if self.ops.caps.decode_graphs else None

    @staticmethod
    def _in_graphs(runner, slots, ids, positions, step):
        """step(slots, ids, positions, first row) over captured graphs of at most runner.max_batch rows: a batch
        wider than the widest graph runs as several replays (each row is its own slot, so the
        pieces are independent), not on the prompt path, whose fixed costs a decode step cannot
        carry. The pieces' outputs joined in row order (a tuple of arrays joined member by member)."""
        mb = runner.max_batch
        outs = [step(slots[i:i + mb], ids[i:i + mb], positions[i:i + mb], i) for i in range(0, len(slots), mb)]
        if len(outs) == 1:
            return outs[0]
        if isinstance(outs[0], tuple):
            return tuple(np.concatenate(parts) for parts in zip(*outs))
        return np.concatenate(outs)

    def decode(self, slots: Sequence[int], ids, positions) -> np.ndarray:
        """One token per slot, batched: logits [B, V]."""
        return self._step(slots, ids, positions, want_logits=True)

    def decode_greedy(self, slots: Sequence[int], ids, positions, bans=None) -> np.ndarray:
        """One token per slot, each slot's next id by argmax (the first largest logit): ids [B]; bans: per row,
        the ids its pick skips (at most greedy_bans; as a -inf logit bias). On a backend with captured steps
        only the ids leave the card."""
        return self._step(slots, ids, positions, want_logits=False, bans=self._ban_rows(bans, len(slots)))

    @property
    def greedy_bans(self) -> int:
        """The most ids a row of decode_greedy may ban (0: none; such picks take decode_topk)."""
        return self.ops.caps.greedy_bans

    def _ban_rows(self, bans, n: int) -> np.ndarray | None:
        """bans (per row, a sequence of ids) as the backend's [greedy_bans, n] int32 rows, -1 for none; None: no
        row bans anything."""
        if bans is None or not any(len(r) for r in bans):
            return None
        if len(bans) != n:
            raise ModelError(f"decode_greedy got bans for {len(bans)} rows, expected {n}")
        out = np.full((self.greedy_bans, n), -1, np.int32)
        for b, row in enumerate(bans):
            if len(row) > self.greedy_bans:
                raise ModelError(f"decode_greedy bans at most {self.greedy_bans} ids a row on the "
                                 f"{self.ops.name} backend, not {len(row)}")
            if any(not 0 <= int(i) < self.n_vocab for i in row):
                raise ModelError(f"decode_greedy: banned ids {list(row)} outside the vocabulary of {self.n_vocab}")
            out[:len(row), b] = row
        return out

    @property
    def greedy_ahead(self) -> bool:
        """Whether decode_greedy_begin launches a step and returns before it ends: captured steps, a state that
        rewinds (a step whose ids go unused leaves a write past the slot's end, which the next id overwrites;
        a recurrent state would keep it), and no host experts, unless BLOOMERY_OFFLOAD_AHEAD=1 (the offload's
        residency runs between steps, in the wait that ends a step, before the next is launched; with host
        experts launched ahead is not yet measured on a card, session 22). BLOOMERY_GREEDY_AHEAD=0 turns it off
        (for comparison)."""
        offload_ok = (getattr(self.ops, "offload", None) is None
                      or os.environ.get("BLOOMERY_OFFLOAD_AHEAD", "0") == "1")
        return (self.rewinds and offload_ok
                and os.environ.get("BLOOMERY_GREEDY_AHEAD", "1") != "0" and self._graphs() is not None)

    def decode_greedy_begin(self, slots: Sequence[int], ids, positions, bans=None):
        """decode_greedy launched on the captured step of its batch (bans as there), the ids fetched by the
        handle's wait(); None where it cannot be (greedy_ahead false, or more slots than one graph takes: the
        pieces of a wider batch replay one graph in turn)."""
        slots, ids, positions = self._decode_args(slots, ids, positions)
        ban_rows = self._ban_rows(bans, len(slots))
        if not self.greedy_ahead or len(slots) > self._graphs().max_batch:
            return None
        launch = self._graphs().begin(slots, ids, positions, ban_rows)
        return _Ahead(launch.wait, self.ops, launch)

    @property
    def greedy_chain(self) -> bool:
        """Whether decode_greedy_chain may be asked: greedy_ahead's steps, unless BLOOMERY_GREEDY_CHAIN=0 (for
        comparison)."""
        return self.greedy_ahead and os.environ.get("BLOOMERY_GREEDY_CHAIN", "1") != "0"

    def decode_greedy_chain(self, after, slots: Sequence[int], positions, bans=None):
        """The greedy step after `after` (a handle of decode_greedy_begin or of this, for the same slots, not yet
        waited for) launched behind it: its ids are after's picks on the device, so it is launched before the host
        knows them (positions: after's, each one on; bans as decode_greedy's). A handle as decode_greedy_begin's,
        waited for after `after`; None where it cannot be (greedy_chain false, a step with host experts)."""
        launch = getattr(after, "launch", None)
        if not self.greedy_chain or launch is None or not self._graphs().chains(len(slots)):
            return None
        slots, _, positions = self._decode_args(slots, np.zeros(len(slots), np.int32), positions)
        launch = self._graphs().begin_chain(launch, slots, positions, self._ban_rows(bans, len(slots)))
        return _Ahead(launch.wait, self.ops, launch)

    def decode_topk_begin(self, slots: Sequence[int], ids, positions, k: int):
        """decode_topk launched on the captured step of its batch, as decode_greedy_begin (None where that
        cannot be, or k is out of range); the handle's wait() gives (ids, values, NaN count)."""
        slots, ids, positions = self._decode_args(slots, ids, positions)
        if not self.greedy_ahead or len(slots) > self._graphs().max_batch or not 1 <= k <= self.topk_max:
            return None
        return _Ahead(self._graphs().begin_topk(slots, ids, positions, k), self.ops)

    @property
    def topk_max(self) -> int:
        """The largest k decode_topk takes (0: this backend hands over whole rows of logits)."""
        return self.ops.topk_max(self.n_vocab)

    def decode_topk(self, slots: Sequence[int], ids, positions, k: int):
        """One token per slot; of each slot's logits only the k largest leave the device, in the
        sampler chain's order (descending, ties to the lower id): (ids [B, k] int32, values
        [B, k] float32, NaN count [B]). For a sampled pick whose chain after top_k needs no more."""
        if not 1 <= k <= self.topk_max:
            raise ModelError(f"decode_topk takes k in 1..{self.topk_max} on the {self.ops.name} backend, not {k}")
        slots, ids, positions = self._decode_args(slots, ids, positions)
        runner = self._graphs()
        if runner is not None:
            out = self._in_graphs(runner, slots, ids, positions, lambda s, i, p, _: runner.run_topk(s, i, p, k))
        else:
            spans = [AttnSpan(s, int(p), b, b + 1) for b, (s, p) in enumerate(zip(slots, positions))]
            out = tuple(self.ops.to_host(a) for a in self.head_topk(self._run(ids, positions, spans), k))
        self.ops.after_step(decode=True)
        return out

    def _step(self, slots, ids, positions, want_logits: bool, bans: np.ndarray | None = None) -> np.ndarray:
        """A decode step's logits [B, V], or its greedy ids [B] (bans: _ban_rows', greedy only)."""
        slots, ids, positions = self._decode_args(slots, ids, positions)
        runner = self._graphs()
        if runner is not None:
            mb = runner.max_batch
            out = self._in_graphs(runner, slots, ids, positions, lambda s, i, p, at: runner.run(
                s, i, p, want_logits=want_logits, **({} if bans is None else {"bans": bans[:, at:at + mb]})))
        else:
            spans = [AttnSpan(s, int(p), b, b + 1) for b, (s, p) in enumerate(zip(slots, positions))]
            x = self._run(ids, positions, spans)
            if want_logits:
                out = self.ops.to_host(self.head(x))                                          # [B, V]
            elif bans is not None:
                logits = self.head(x)
                self.ops.ban(logits, bans)
                out = self.ops.to_host(self.ops.argmax(logits))                               # [B]
            else:
                out = self.ops.to_host(self.head_argmax(x))                                   # [B]
        self.ops.after_step(decode=True)
        return out


class _Ahead:
    """A captured step launched and not waited for: wait() fetches what it hands over (once: its ids, or its rows'
    largest logits) and ends the step as _step does."""

    def __init__(self, fetch, ops, launch=None):
        self._fetch, self._ops, self._got = fetch, ops, None
        self.launch = launch        # the graph's launch (a greedy step's), which a step may be chained behind

    def wait(self):
        if self._got is None:
            self._got = self._fetch()
            self._ops.after_step(decode=True)
        return self._got


class RecurrentLM(CausalLM):
    """A CausalLM with a recurrent state per slot (`self.state`, the backend's recurrent_state) beside the KV
    of its attention layers. The state cannot step back, so the slot does not rewind; a checkpoint is a
    copy of that state at a position, and restoring one (the attention layers' KV cut back to the same
    position, as any prefix reuse does) lets a prompt sharing the prefix up to it read only the rest."""

    rewinds = False
    checkpoints = True

    @property
    def checkpoint_bytes(self) -> int:
        return self.state.slot_nbytes

    def save_checkpoint(self, slot: int, n: int) -> tuple:
        self._check_held(slot, n)
        return self.state.save_state(slot, n)

    def restore_checkpoint(self, slot: int, state: tuple, n: int) -> None:
        self._check_held(slot, n)
        self.state.restore_state(slot, state, n)

    def _check_held(self, slot: int, n: int) -> None:
        if not 0 <= slot < self.n_slots:
            raise ModelError(f"slot {slot} is out of range: the model has {self.n_slots} slots (0..{self.n_slots - 1})")
        if not 0 < n <= self.n_ctx_slot:
            raise ModelError(f"a checkpoint of {n} positions does not fit the slot: n_ctx_slot = {self.n_ctx_slot}")
