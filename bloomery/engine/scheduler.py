"""Slots and the waiting queue: pure bookkeeping, no I/O, no model.

A slot holds one request at a time and remembers which ids its KV region holds
(`cached_ids`, in position order), so the next request can reuse a common prefix.
Slot choice follows llama-server's get_available_slot: among free slots with
cached ids, the one whose longest common prefix covers the largest fraction of
the new prompt (above --slot-prompt-similarity, 0.1); otherwise the least
recently used free slot (llama.cpp's `<=` makes the last of equals win).

A model whose slot state cannot be cut back (`rewinds=False`: a recurrent state, as in
linear-attention layers) keeps what a slot holds only when the new prompt extends it, longer
by at least one id, or from a checkpoint: a copy of that state at a message start of an earlier
prompt (`checkpoint_id`, the vocabulary's <|im_start|>). With checkpoints on, a prompt's passes end
at the message starts it checkpoints and the engine saves the state there (`checkpointed`, at most
`n_checkpoints` a slot, the oldest dropped first, as llama-server's --ctx-checkpoints). Which message
starts are checkpointed is decided here alone (`_checkpoints_at`, llama-server's rule with
--checkpoint-min-step): the first of a slot, the prompt's last, and any other more than `min_step` ids
past the slot's latest. A prompt that parts from what the slot holds keeps the nearest checkpoint at or
before the common prefix (`Slot.restore`, for the engine to put back), and without one is read whole
from position 0 (the model then starts the slot's state from zeros). Only the reusable part counts as
similar when a slot is picked. Where a saved recurrent state may be picked up again (a live slot's end,
a checkpoint, a prompt cache entry's marks) is `reuse_point`'s rule, here once.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field

from bloomery.engine.limits import prompt_fits
from bloomery.engine.types import EngineRequest

SLOT_PROMPT_SIMILARITY = 0.1   # llama-server's --slot-prompt-similarity default
MAX_QUEUE_TOTAL = 64           # default max_queue is this minus n_slots


class SchedulerError(ValueError):
    """A request the scheduler refuses; the message names the field, value and bound."""


class QueueFullError(SchedulerError):
    pass


MESSAGE_START = "<|im_start|>"   # ChatML's message start (the Qwen families' templates)


def message_start_id(metadata: dict) -> int | None:
    """The id checkpoints are kept at: <|im_start|> where the file's vocabulary and its chat template both
    carry it (the serving guide, section 6), else None."""
    tokens = metadata.get("tokenizer.ggml.tokens")
    template = metadata.get("tokenizer.chat_template")
    if not isinstance(template, str) or MESSAGE_START not in template:
        return None
    if not isinstance(tokens, list):          # gguf_file.StringArray, the header's packed form: its find()
        find = getattr(tokens, "find", None)  # looks without decoding the vocabulary
        return find(MESSAGE_START) if callable(find) and not isinstance(tokens, (str, bytes)) else None
    try:
        return tokens.index(MESSAGE_START)
    except ValueError:
        return None


def reuse_point(n_common: int, n_prompt: int, points) -> int:
    """Where a prompt can pick up a state that cannot rewind: the largest of the positions a state was saved
    at (`points`) that is within the prefix the prompt shares with what was saved (n_common) and short of
    the whole prompt (at least one id runs, for the logits); 0 when there is none."""
    return max((p for p in points if 0 < p <= n_common and p < n_prompt), default=0)


def common_prefix_len(a: list[int] | tuple[int, ...], b: list[int] | tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@dataclass
class Slot:
    id: int
    n_ctx_slot: int
    cached_ids: list[int] = field(default_factory=list)   # ids whose KV the slot holds, by position
    req: EngineRequest | None = None
    n_cached: int = 0            # prompt ids reused from cached_ids at admission
    n_decoded: int = 0           # ids sampled for the current request
    next_id: int | None = None   # sampled, not yet fed to the model
    t_last_used: int = -1        # release counter, for LRU choice
    state: object = None         # the engine's per-request state (its sampler, timings)
    held_ids: tuple[int, ...] = ()   # at admission: what the slot held when the prompt does not extend it
                                     # (the prompt cache saves it before the prompt overwrites it), else ()
    # without rewinds: (n, state) copies of what cannot rewind after cached_ids[:n], oldest first
    checkpoints: list[tuple[int, object]] = field(default_factory=list)
    restore: tuple[int, object] | None = None   # at admission: the checkpoint the engine puts back first
    held_checkpoints: tuple[tuple[int, object], ...] = ()   # at admission, with held_ids: the checkpoints then
    own_checkpoints: set[int] = field(default_factory=set)  # positions checkpointed for the current request
    last_start: int = -1         # the current prompt's last message start (-1: none)
    saved_idle: tuple[int, ...] | None = None   # ids the engine saved while it idled (Engine.save_idle_now), until
                                                # the next request start announces them or the slot is reused

    @property
    def n_past(self) -> int:
        """Positions of the slot's KV region that hold valid ids."""
        return len(self.cached_ids)

    @property
    def is_processing(self) -> bool:
        return self.req is not None


class Scheduler:
    def __init__(self, n_slots: int, n_ctx_slot: int, max_queue: int | None = None, rewinds: bool = True,
                 n_checkpoints: int = 0, checkpoint_id: int | None = None, checkpoint_min_step: int = 0):
        if n_slots < 1:
            raise SchedulerError(f"n_slots must be >= 1 (got {n_slots})")
        if n_ctx_slot < 2:
            raise SchedulerError(f"n_ctx_slot must be >= 2 (got {n_ctx_slot})")
        self.n_ctx_slot = n_ctx_slot
        self.max_queue = max(MAX_QUEUE_TOTAL - n_slots, 0) if max_queue is None else max_queue
        if self.max_queue < 0:
            raise SchedulerError(f"max_queue must be >= 0 (got {self.max_queue})")
        self.slots = [Slot(i, n_ctx_slot) for i in range(n_slots)]
        self.rewinds = rewinds
        if isinstance(n_checkpoints, bool) or not isinstance(n_checkpoints, int) or n_checkpoints < 0:
            raise SchedulerError(f"n_checkpoints must be an integer >= 0 (got {n_checkpoints!r})")
        # checkpoints at message starts: only for a slot that cannot rewind, with a message-start id
        self.n_checkpoints = n_checkpoints if not rewinds and checkpoint_id is not None else 0
        self.checkpoint_id = checkpoint_id
        if isinstance(checkpoint_min_step, bool) or not isinstance(checkpoint_min_step, int) or checkpoint_min_step < 0:
            raise SchedulerError(f"checkpoint_min_step must be an integer >= 0 (got {checkpoint_min_step!r})")
        # --checkpoint-min-step: a message start within this many ids of the slot's latest checkpoint is passed over
        self.min_step = checkpoint_min_step
        self.waiting: collections.deque[EngineRequest] = collections.deque()
        self._known: set[str] = set()   # req_ids queued or in a slot
        self._n_released = 0

    # -- requests in ---------------------------------------------------------
    def add(self, req: EngineRequest) -> None:
        n_prompt = len(req.prompt_ids)
        if req.req_id in self._known:
            raise SchedulerError(f"req_id {req.req_id!r} is already queued or running")
        if n_prompt == 0:
            raise SchedulerError("prompt_ids is empty: at least 1 id is needed to compute logits")
        if not -1 <= req.id_slot < len(self.slots):
            raise SchedulerError(f"id_slot {req.id_slot} is not a slot: this server has slots 0..{len(self.slots) - 1}")
        if not prompt_fits(n_prompt, self.n_ctx_slot):
            raise SchedulerError(
                f"prompt of {n_prompt} ids does not fit a slot of n_ctx_slot={self.n_ctx_slot} "
                f"(at most {self.n_ctx_slot - 1})")
        n_free = sum(1 for s in self.slots if not s.is_processing)
        if len(self.waiting) >= n_free + self.max_queue:
            raise QueueFullError(
                f"queue full: {len(self.waiting) - n_free} requests wait for a slot, "
                f"max_queue={self.max_queue}")
        self.waiting.append(req)
        self._known.add(req.req_id)

    def cancel(self, req_id: str) -> Slot | bool:
        """Drop a request: True if it was waiting, its Slot (now free) if running,
        False if unknown (already finished)."""
        for req in self.waiting:
            if req.req_id == req_id:
                self.waiting.remove(req)
                self._known.discard(req_id)
                return True
        for slot in self.slots:
            if slot.req is not None and slot.req.req_id == req_id:
                self.release(slot)
                return slot
        return False

    # -- slots ---------------------------------------------------------------
    def schedule(self) -> list[Slot]:
        """Move waiting requests into free slots, FIFO (a request naming its slot, id_slot, waits for that
        one while later requests go ahead, as llama-server defers it). Each admitted slot's
        cached_ids is cut to the reused prefix (n_cached); the engine must run
        prompt_ids[n_cached:] from position n_cached."""
        admitted = []
        for req in list(self.waiting):
            if req.id_slot >= 0:     # its own slot or nothing; it waits without holding up the others
                chosen = self.slots[req.id_slot]
                slot = None if chosen.is_processing else chosen
                if slot is None:
                    continue
            else:
                slot = self._pick_slot(req.prompt_ids)
                if slot is None:
                    break
            self.waiting.remove(req)
            n_common = common_prefix_len(slot.cached_ids, req.prompt_ids)
            n_cached = self._reusable(slot, req.prompt_ids) if req.cache_prompt else 0
            live = n_cached == len(slot.cached_ids)
            # what the slot holds and this prompt overwrites (a KV cache: past the common prefix; a state that
            # cannot rewind: unless the prompt carries on from its end), with the slot's checkpoints then: the
            # prompt cache may save them first
            lost = n_common < len(slot.cached_ids) if self.rewinds else not live
            slot.held_ids = tuple(slot.cached_ids) if lost else ()
            slot.held_checkpoints = tuple(slot.checkpoints) if lost and not self.rewinds else ()
            del slot.cached_ids[n_cached:]
            # a checkpoint past the kept prefix no longer matches the KV the prompt rewrites there
            slot.checkpoints[:] = [c for c in slot.checkpoints if c[0] <= n_cached]
            slot.restore = None if self.rewinds or live or n_cached == 0 else next(
                c for c in slot.checkpoints if c[0] == n_cached)
            slot.req, slot.n_cached, slot.n_decoded, slot.next_id = req, n_cached, 0, None
            slot.own_checkpoints = set()
            slot.last_start = self._last_start(req.prompt_ids)
            admitted.append(slot)
        return admitted

    def _reusable(self, slot: Slot, prompt_ids) -> int:
        """How many of the slot's cached ids the prompt keeps: the common prefix, short of the whole
        prompt (at least one id is evaluated, so there are logits to sample); without rewinds, all of
        them when the prompt extends them, else the nearest checkpoint's within that bound (0: none)."""
        n = common_prefix_len(slot.cached_ids, prompt_ids)
        if not self.rewinds:
            return reuse_point(n, len(prompt_ids), [len(slot.cached_ids), *(c for c, _ in slot.checkpoints)])
        return n - 1 if n == len(prompt_ids) else n

    def _pick_slot(self, prompt_ids: tuple[int, ...]) -> Slot | None:
        free = [s for s in self.slots if not s.is_processing]
        best, best_sim = None, 0.0
        for slot in free:
            if not slot.cached_ids:
                continue
            kept = common_prefix_len(slot.cached_ids, prompt_ids) if self.rewinds else self._reusable(slot, prompt_ids)
            sim = kept / len(prompt_ids)
            if sim > best_sim and sim > SLOT_PROMPT_SIMILARITY:
                best, best_sim = slot, sim
        if best is not None:
            return best
        lru = None
        for slot in free:
            if lru is None or slot.t_last_used <= lru.t_last_used:
                lru = slot
        return lru

    def restored(self, slot: Slot, n: int, checkpoints=()) -> None:
        """The prompt cache put the prompt's first n ids into the slot's state: the prompt runs from n. A state
        that cannot rewind comes with the saved checkpoints at or before n (the latest n_checkpoints)."""
        slot.cached_ids[:] = slot.req.prompt_ids[:n]
        slot.n_cached = n
        if self.n_checkpoints:
            slot.checkpoints[:] = sorted((c for c in checkpoints if c[0] <= n), key=lambda c: c[0])[-self.n_checkpoints:]

    def _last_start(self, ids) -> int:
        if not self.n_checkpoints:
            return -1
        return next((i for i in range(len(ids) - 1, 0, -1) if ids[i] == self.checkpoint_id), -1)

    def _checkpoints_at(self, slot: Slot, p: int) -> bool:
        """The placement rule, owned here: whether the slot's state after its prompt's first p ids is checkpointed.
        p must be a message start inside the prompt (the id at p starts a message; never position 0, nor past the
        last id, which the live slot holds). As llama-server places them (server-context.cpp, with
        --checkpoint-min-step): the slot's first checkpoint, the prompt's last message start, and a message start
        more than min_step ids past the slot's latest checkpoint; the others are passed over."""
        ids = slot.req.prompt_ids
        if not (self.n_checkpoints and 0 < p < len(ids) and ids[p] == self.checkpoint_id):
            return False
        latest = max((c for c, _ in slot.checkpoints), default=None)
        return latest is None or p == slot.last_start or p > latest + self.min_step

    def cut(self, slot: Slot, n_done: int, n: int) -> int:
        """How many of the next n prompt ids (from n_done) one pass reads: with checkpoints on, the
        pass ends at the next message start to be checkpointed, so the state there can be saved; else n."""
        if not self.n_checkpoints:
            return n
        for i in range(n_done + 1, min(n_done + n, len(slot.req.prompt_ids))):
            if self._checkpoints_at(slot, i):
                return i - n_done
        return n

    def at_checkpoint(self, slot: Slot, n_done: int) -> bool:
        """With checkpoints on, whether the slot's state after its prompt's first n_done ids is one to save."""
        return self._checkpoints_at(slot, n_done)

    def checkpointed(self, slot: Slot, n: int, state: object) -> None:
        """The engine saved the slot's state after its prompt's first n ids. A slot keeps n_checkpoints at most:
        when the new one fills them, those of earlier requests within min_step ids of the checkpoint before
        them go first (llama-server's create_checkpoint), then the oldest; one at the same position is replaced."""
        cps = [c for c in slot.checkpoints if c[0] != n]
        if len(cps) + 1 >= self.n_checkpoints:
            kept, last = [], None
            for c in cps:
                if c[0] not in slot.own_checkpoints and last is not None and c[0] <= last + self.min_step:
                    continue
                kept.append(c)
                last = c[0]
            cps = kept
        cps.append((n, state))
        slot.checkpoints[:] = cps[-self.n_checkpoints:]
        slot.own_checkpoints.add(n)

    def progressed(self, slot: Slot, n_done: int) -> None:
        """A prompt pass ran. Without rewinds the slot's state now stands after the prompt's first n_done ids,
        so cached_ids says so (a cancel between passes leaves them, and its checkpoints, consistent); a KV
        cache counts a prompt's ids only once it is read whole."""
        if not self.rewinds:
            slot.cached_ids[:] = slot.req.prompt_ids[:n_done]

    def prefilled(self, slot: Slot) -> None:
        """The model now holds the whole prompt in the slot."""
        slot.cached_ids[:] = slot.req.prompt_ids

    def sampled(self, slot: Slot, token: int) -> None:
        slot.n_decoded += 1
        slot.next_id = token

    def fed(self, slot: Slot) -> None:
        """The pending id went through model.decode at position n_past."""
        slot.cached_ids.append(slot.next_id)
        slot.next_id = None

    def release(self, slot: Slot) -> None:
        """The request is done; the slot keeps its cached ids for prefix reuse."""
        if slot.req is not None:
            self._known.discard(slot.req.req_id)
        self._n_released += 1
        slot.req, slot.next_id, slot.state = None, None, None
        slot.t_last_used = self._n_released

    def forget(self, slot: Slot) -> None:
        """The slot's KV is not trustworthy (a model error): reuse nothing from it."""
        slot.cached_ids.clear()
        slot.checkpoints.clear()
        slot.restore = None
        slot.held_checkpoints = ()

    # -- views ---------------------------------------------------------------
    def busy(self) -> list[Slot]:
        return [s for s in self.slots if s.is_processing]

    def has_work(self) -> bool:
        return bool(self.waiting) or any(s.is_processing for s in self.slots)

    def table(self) -> list[dict]:
        return [{"id": s.id, "n_ctx": s.n_ctx_slot, "is_processing": s.is_processing,
                 "id_task": s.req.req_id if s.req is not None else -1} for s in self.slots]
