"""The engine: admit requests to slots, run the model, sample, finish.

step() is one round: cancels, admissions, prompt passes, then one batched model.decode over
every slot that has a sampled id to feed. A prompt runs whole in the round it was admitted
when no other slot is busy; beside busy slots it runs in chunked prefill: one pass of at most
min(n_batch, the model's n_ubatch) ids a round, so the other slots' streams keep stepping
between its passes. Several slots with prompt ids to read share that round's pass: its ids are
filled from each prompt in slot order and run as one model call (model.prefill_slots). A
prompt's first id is sampled after its last pass.
Finishing follows llama-server's process_token: the context check (prompt ids +
sampled ids reach n_ctx_slot -> "length"), then n_predict ("length"), then a stop
id ("stop", reported in the same output, winning over the other two).

Greedy steps launched ahead (a model with greedy_ahead: captured steps on a card): when every slot of
a decode step goes on with a greedy pick the device can make (a plain one: the argmax; one whose bias only
bans ids, as ignore_eos's: the argmax after the bans where the model takes them (greedy_bans), else from the row's
largest logits), the next step is launched before the round returns, so
the card computes it while the host sends this round's ids and reads its inbox; the next round waits
for it first, before anything else touches the card, and takes its ids when it decodes the same slots
with the same ids at the same positions (else it runs its own step; the launched one's write at each
slot's next position is past what the slot holds, and the next id written there replaces it).
settle() waits for it where something outside step() touches the model (a slot's file, a swap).
Where the model chains steps (greedy_chain: a plain greedy or banning pick, on the card), the step after the one
launched ahead is launched too, behind it, its ids that step's picks on the card: the card runs the two back to
back while the host reads the first's ids, so the host's work between steps (the wait's wake, the sampling, the
launch) leaves the card's path. The next round promotes it to the step launched ahead when every slot goes on,
and chains another behind it; any other round (a slot ends or joins, a cancel, a prompt) waits for it and drops
it (its write, one past the launched-ahead step's, is past what the slot holds, as that step's may be).

add / cancel / slots / has_work may be called from another thread while step()
runs: the bookkeeping sits behind a lock that is never held across a model call.
Every TokenOut names the slot that ran its request (-1 for one that never had one).

The prompt cache (engine/prompt_cache.py, -cram): before an admitted prompt that does not
extend what its slot holds overwrites it, the slot's state is saved there; a prompt sharing a
longer prefix with a saved state than with its live slot has that prefix restored into the
slot and runs only the rest (n_cached counts the restored ids). For a model that cannot rewind
the saved state is the KV of its attention layers with the recurrent state at the slot's end and
at its checkpoints; a restore goes to the latest of those positions within the shared prefix.

Checkpoints (a model that cannot rewind, with --ctx-checkpoints above 0 and a message-start id): a
prompt's passes end at its message starts, and after each such pass the model's state that cannot
rewind is copied into the slot's checkpoints; a later prompt sharing the prefix up to one of them has
it put back and reads only the rest (n_cached counts the ids before it).

Idle slots (llama-server's --cache-idle-slots, on by default with the prompt cache): when a request
starts in a slot, every other idle slot's state is saved there too (unless an entry already holds
it), so a later prompt sharing its prefix finds it whichever slot it lands in; with `clear_idle`
(--kv-unified) the idle slot is then emptied, as llama-server empties it to free room in its one
shared buffer. Here each slot keeps its own KV region, so emptying frees nothing: the next prompt
for that text restores it from the prompt cache instead of reusing the live slot. The copy itself is
made earlier where it can be: as the engine turns idle (save_idle_now), so the next request's start
finds it done (a restore of the saved state is 8 ms for 4,255 positions on the H200, the save of a
turn 6 ms, both were on that request's path); the request start still announces it.
"""
from __future__ import annotations

import base64
import threading
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from bloomery import records
from bloomery.engine.limits import finish_reason
from bloomery.engine.model_api import EngineModel
from bloomery.engine.prompt_cache import PromptCache
from bloomery.engine.sampler import Sample, Sampler, SamplerError
from bloomery.engine.scheduler import Scheduler, Slot
from bloomery.engine.types import EngineRequest, TokenOut
from bloomery.grammar import GrammarError


# llama.cpp's pooling types over the final-norm rows [T, D] of one prompt -> [R, D] (rank is not served: it needs
# a reranker's classification head)
POOLINGS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "none": lambda rows: rows,
    "mean": lambda rows: rows.mean(axis=0, dtype=np.float64, keepdims=True).astype(np.float32),
    "cls": lambda rows: rows[:1],
    "last": lambda rows: rows[-1:],
}


@dataclass
class _ReqState:
    sampler: Sampler
    stop_ids: frozenset[int]
    prompt_ms: float = 0.0
    top_miss: float = 0.0     # running share of greedy picks each row's largest logits did not settle
    n_done: int = 0           # prompt ids in the slot's KV so far (cached, restored and run)
    t0: float = 0.0           # when the prompt's first pass began (perf_counter)
    cache_ms: float = 0.0     # the prompt cache's work at admission: the held state saved, a saved prefix restored


class Engine:
    greedy_top_k = 64      # a greedy slot under a mask picks from this many largest logits a row (0: whole rows)
    # a rerun costs a whole step: a slot whose running miss share is above this takes whole rows, the share
    # easing a little each such step until the slot tries its largest logits again
    TOP_MISS_MAX, TOP_MISS_RATE, TOP_MISS_EASE = 0.125, 0.25, 0.9
    top_steps = 0          # decode steps that fetched each row's largest logits for a greedy pick
    top_misses = 0         # ... of which ran again with whole rows (no candidate settled a pick)

    def __init__(self, model: EngineModel, n_slots: int, n_ctx_slot: int, max_queue: int | None = None,
                 n_batch: int = 2048, prompt_cache_bytes: int = 0, cache_idle_slots: bool = False,
                 clear_idle: bool = False, test_tags: bool = False, n_ctx_checkpoints: int = 0,
                 message_start_id: int | None = None, checkpoint_min_step: int = 0):
        if not isinstance(model, EngineModel):
            raise TypeError(f"the engine runs an EngineModel (engine/model_api.py), not a {type(model).__name__}")
        self.model = model
        # saved slot states in host RAM, within this budget (0: off); only a model with save_kv / restore_kv (and,
        # when it cannot rewind, save_checkpoint / restore_checkpoint)
        self.prompt_cache = PromptCache(prompt_cache_bytes)
        model.prompt_cache_budget(prompt_cache_bytes)    # what memory the model may keep ahead for saved states
        self._asleep_stats: dict | None = None       # engine_stats() as the engine fell asleep (swap_model)
        self._passes_before: dict[str, int] = {}     # the prompt passes of the models swapped out (swap_model)
        self._passes_at = model.pass_counts()        # ... and the model's own before the engine took it (warm-up)
        self._host_idle = True                       # no request runs (model.host_idle, step / save_idle_now)
        # --cache-idle-slots: save the idle slots as the engine turns idle (save_idle_now) or else when a request
        # starts, which announces them (clear_idle: and empties them)
        self.cache_idle_slots, self.clear_idle = cache_idle_slots, clear_idle
        # --verbose: the records also carry llama-server's test tags (its suite reads them from the log)
        self.test_tags = test_tags
        # a prompt asking for progress runs in passes of n_batch ids (llama-server's -b), each reported at once
        # through `emit` when set (the engine process sends it on the socket), else with the step's outputs
        self.n_batch = n_batch
        self.emit: Callable[[list[TokenOut]], None] | None = None
        self.n_vocab = int(model.n_vocab)
        self.n_ctx_slot = n_ctx_slot
        # a model whose slot state cannot step back (recurrent layers) keeps a slot only for a prompt that extends
        # it, or from a checkpoint it saved at a message start (--ctx-checkpoints a slot; message_start_id: the
        # vocabulary's <|im_start|> where the template carries it too; checkpoint_min_step: --checkpoint-min-step)
        self.scheduler = Scheduler(n_slots, n_ctx_slot, max_queue, rewinds=model.rewinds,
                                   n_checkpoints=n_ctx_checkpoints if model.checkpoints else 0,
                                   checkpoint_id=message_start_id, checkpoint_min_step=checkpoint_min_step)
        self._lock = threading.Lock()
        self._cancels: list[str] = []
        # per slot, its current or last request's counts (llama-server's /slots keeps task_prev too)
        self._last: dict[int, dict] = {}
        self._grammar_vocab: Vocab | None = None     # the vocabulary's bytes, built on the first grammar request
        # the next greedy step, launched at the end of a step whose slots all go on (model.greedy_ahead): ((slot
        # ids, ids, positions) it ran, its handle, k: 0 for its ids, else its rows' k largest logits, the rows'
        # bans it ran with when k is 0); the next step takes it when its slots are those
        self._ahead: tuple[tuple, object, int, list | None] | None = None
        # the step chained behind it (model.greedy_chain): ((slot ids, positions) it runs at, its rows' bans, its
        # handle); its ids are the launched-ahead step's picks, so the next round takes it as that round's step
        # launched ahead when its slots all go on at those positions with those bans
        self._chained: tuple[tuple, list | None, object] | None = None
        self.decode_steps = 0       # batched decode steps run (each one row a decoding slot)
        self.ahead_steps = 0        # decode steps whose ids came from a step launched ahead
        self.ahead_dropped = 0      # ... launched and not used (the batch changed)
        self.chained_steps = 0      # of the steps launched ahead, those chained behind the one before

    # -- called from any thread ------------------------------------------------
    def add(self, req: EngineRequest) -> None:
        """Queue a request; raises SchedulerError (queue full, prompt too long, ...)."""
        with self._lock:
            self.scheduler.add(req)

    def cancel(self, req_id: str) -> None:
        with self._lock:
            self._cancels.append(req_id)

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._cancels) or self.scheduler.has_work()

    def slots(self) -> list[dict]:
        """llama-server's /slots entries as far as the engine knows them: id, n_ctx, speculative,
        is_processing; with id_task, req_id, n_prompt_tokens*, next_token once a request ran there."""
        with self._lock:
            out = []
            for slot in self.scheduler.slots:
                entry = {"id": slot.id, "n_ctx": slot.n_ctx_slot, "speculative": False,
                         "is_processing": slot.is_processing}
                last = self._last.get(slot.id)
                if last is not None:
                    running = slot.is_processing and slot.req.req_id == last["req_id"]
                    n_decoded = slot.n_decoded if running else last["n_decoded"]
                    n_remain = -1 if last["n_predict"] < 0 else max(last["n_predict"] - n_decoded, 0)
                    # has_new_line is text: the front fills it in (the engine sees ids only)
                    entry.update(id_task=last["id_task"], req_id=last["req_id"],
                                 n_prompt_tokens=last["n_prompt"], n_prompt_tokens_processed=last["n_processed"],
                                 n_prompt_tokens_cache=last["n_cached"],
                                 next_token=[{"has_next_token": running, "n_remain": n_remain,
                                              "n_decoded": n_decoded}])
                out.append(entry)
            return out

    def settle(self) -> None:
        """Wait for a step launched ahead, its ids kept for the next step: called on the engine thread before
        anything touches the model's device state outside step() (a slot's file, a residency change, a swap)."""
        if self._ahead is not None:
            try:
                self._ahead[1].wait()
            except Exception:        # the next step runs its own, which says what failed
                self._ahead = None
        if self._chained is not None:
            try:
                self._chained[2].wait()
            except Exception:
                self._chained = None
            if self._ahead is None:  # it followed a step that failed: nothing to take it for
                self._chained = self._drop_chained(self._chained)

    def _drop_chained(self, chained) -> None:
        """A chained step not taken: waited for (nothing else may touch the device before) and counted dropped."""
        if chained is not None:
            try:
                chained[2].wait()
            except Exception:
                pass
            self.ahead_dropped += 1
        return None

    def swap_model(self, model: EngineModel | None) -> None:
        """--sleep-idle-seconds: None frees the model (its weights and KV) while the engine is idle; a freshly
        loaded model wakes it. Either way the slots' cached prompts are gone with the old KV."""
        self.settle()
        self._ahead = self._chained = None
        asleep = self.engine_stats() if model is None and self.model is not None else None
        with self._lock:
            if model is None and self.scheduler.has_work():
                raise RuntimeError("the engine has work: it cannot sleep now")
            self._asleep_stats = asleep
            self._passes_before = self._pass_counts()
            self._passes_at = model.pass_counts() if model is not None else {}
            old, self.model = self.model, model
            for slot in self.scheduler.slots:
                self.scheduler.forget(slot)
            self.prompt_cache.clear()     # its host RAM is freed with the rest
        if old is not None and old is not model:
            old.prompt_cache_budget(0)    # and what the old model kept ahead for saved states
        if model is not None:
            model.prompt_cache_budget(self.prompt_cache.budget_bytes)

    def engine_stats(self) -> dict[str, float]:
        """What /metrics shows of the engine: the prompt cache's bytes, entries, budget and restore time, and its
        decode steps by path (launched ahead, dropped, from the largest logits, of those run again). Asleep
        (--sleep-idle-seconds), the figures of the moment it fell asleep, as llama-server serves its metrics from
        the snapshot taken on entering sleep (the prompt cache's entries went with the weights)."""
        with self._lock:
            if self.model is None and self._asleep_stats is not None:
                return dict(self._asleep_stats)
            return {**self.prompt_cache.stats(), **self._pass_counts(),
                    "steps_decode": self.decode_steps, "steps_ahead": self.ahead_steps,
                    "steps_ahead_dropped": self.ahead_dropped, "steps_chained": self.chained_steps,
                    "steps_top": self.top_steps,
                    "steps_top_missed": self.top_misses}

    def _pass_counts(self) -> dict[str, int]:
        """The model's prompt passes by path since the engine took it (not its warm-up's), counted on across the
        models a sleep swaps in (counters)."""
        now = self.model.pass_counts() if self.model is not None else {}
        return {k: self._passes_before.get(k, 0) + now.get(k, 0) - self._passes_at.get(k, 0)
                for k in {*now, *self._passes_before}}

    def abort_all(self, message: str) -> list[TokenOut]:
        """Finish every queued and running request with "error" (after a fault in step)."""
        self.settle()
        self._ahead = self._chained = None
        with self._lock:
            outs = [TokenOut(r.req_id, None, "error", error=message) for r in self.scheduler.waiting]
            for req in list(self.scheduler.waiting):
                self.scheduler.cancel(req.req_id)
            for slot in self.scheduler.busy():
                outs.append(TokenOut(slot.req.req_id, None, "error", error=message, slot=slot.id))
                self._note_done(slot.id, slot.req.req_id, slot.n_decoded)
                self.scheduler.forget(slot)
                self.scheduler.release(slot)
            self._cancels.clear()
            return outs

    # -- the engine thread -----------------------------------------------------
    def step(self) -> list[TokenOut]:
        outs: list[TokenOut] = []
        if self._host_idle and self.model is not None:     # requests run: host work that holds the driver waits
            self._host_idle = False
            self.model.host_idle(False)
        ahead, self._ahead = self._ahead, None
        chained, self._chained = self._chained, None
        if ahead is not None:        # ended before this round touches the device (admissions, prompts, copies)
            try:
                ahead = (ahead[0], ahead[1].wait(), *ahead[2:])
            except Exception:
                ahead = None
        if ahead is None:
            chained = self._drop_chained(chained)
        with self._lock:
            prompts_before = any(s.next_id is None for s in self.scheduler.busy())
            cancels, self._cancels = self._cancels, []
            for req_id in cancels:
                got = self.scheduler.cancel(req_id)
                if got is not False:   # True: it was waiting (no slot); a Slot: it ran there (now released)
                    if got is not True:
                        self._note_done(got.id, req_id, got.n_decoded)
                    outs.append(TokenOut(req_id, None, "cancel", slot=got.id if got is not True else -1))
            decoding = [s for s in self.scheduler.busy() if s.next_id is not None]
            admitted = self.scheduler.schedule()
            for slot in admitted:
                req = slot.req
                self._last[slot.id] = {"req_id": req.req_id, "id_task": req.id_task, "n_predict": req.n_predict,
                                       "n_prompt": len(req.prompt_ids), "n_cached": slot.n_cached,
                                       "n_processed": len(req.prompt_ids) - slot.n_cached,
                                       "n_decoded": 0}
        if chained is not None and (cancels or admitted or prompts_before or not decoding):
            chained = self._drop_chained(chained)      # this round touches the device beside a decode step
        saved_ms: dict[int, float] = {}
        for slot in admitted:    # every save before any restore: a slot admitted now may restore another's
            t0 = time.perf_counter()
            try:
                self._save_held(slot)
            except Exception as e:   # the slot's KV is as it was; this request alone fails
                outs.append(self._fail(slot, e, len(slot.req.prompt_ids)))
            saved_ms[slot.id] = (time.perf_counter() - t0) * 1000.0
        if admitted and self.cache_idle_slots:
            self._save_idle()
        admitted = [s for s in admitted if s.req is not None]
        for slot in admitted:
            if slot.req.pooling:      # an embedding request: its whole prompt now, then the slot is free
                outs.append(self._embed(slot))
                continue
            failed = self._start(slot, outs, saved_ms.get(slot.id, 0.0))
            if failed is not None:
                outs.append(failed)
        with self._lock:
            prefilling = [s for s in self.scheduler.busy() if s.next_id is None]
        if len(prefilling) == 1:
            # alone, a prompt runs whole; beside other busy slots, one chunk a round (chunked prefill)
            out = self._prefill(prefilling[0], outs, whole=not decoding)
            if out is not None:
                outs.append(out)                  # progress outputs (when not emitted) go first
        elif prefilling:
            outs.extend(self._prefill_round(prefilling, outs))
        if decoding:
            outs.extend(self._decode(decoding, ahead, chained))
        elif ahead is not None:
            self.ahead_dropped += 1
        return outs

    def _report(self, slot: Slot, progress: list[TokenOut]) -> None:
        """A prompt-progress output (llama-server's prompt_progress: processed counts the cached ids
        too; prompt_ms: the passes so far, 0 before the first)."""
        req, st = slot.req, slot.state
        ms = (time.perf_counter() - st.t0) * 1000.0 if st.n_done > slot.n_cached else 0.0
        out = TokenOut(req.req_id, None, n_prompt=len(req.prompt_ids), n_cached=slot.n_cached, slot=slot.id,
                       prompt_ms=ms, n_processed=st.n_done)
        if self.emit is not None:
            self.emit([out])
        else:
            progress.append(out)

    def _caching(self) -> bool:
        """The prompt cache is on and the model saves its state: its KV (save_kv / restore_kv) and, when it cannot
        rewind, what cannot (save_checkpoint / restore_checkpoint) at the positions it may restore to."""
        return self.prompt_cache.enabled and self.model.saves_state

    def _save_slot(self, slot: Slot, held: tuple[int, ...], checkpoints=()) -> bool:
        """The slot's state of these ids into the prompt cache (False: covered already, or past the budget). A
        model that cannot rewind adds its recurrent state at the end, and the slot's checkpoints, as marks."""
        m = self.model
        points = () if m.rewinds else (len(held), *(n for n, _ in checkpoints if n < len(held)))
        with self._lock:
            if self.prompt_cache.covers(held, points):
                return False
            # a held entry sharing a long prefix with these ids gives those positions: only the rest is copied
            base = self.prompt_cache.prefix_source(held)
        start = base[1] if base is not None else 0
        cost = m.kv_bytes_per_position * (len(held) - start) + m.checkpoint_bytes * len(points)
        if m.kv_bytes_per_position and not self.prompt_cache.fits(cost):
            return False             # it alone passes the budget: not copied at all
        t0 = time.perf_counter()
        state = m.save_kv(slot.id, len(held), start)
        marks = () if m.rewinds else (*((n, st) for n, st in checkpoints if n < len(held)),
                                      (len(held), m.save_checkpoint(slot.id, len(held))))
        with self._lock:
            saved = self.prompt_cache.save(held, state, marks, base)
        records.record("serve", "updating prompt cache: the slot's state saved", component="engine", slot=slot.id,
                       n_ids=len(held), from_cache=start, kept=saved,
                       took_ms=round((time.perf_counter() - t0) * 1000.0, 2))
        return saved

    def _save_held(self, slot: Slot) -> None:
        """Keep what the slot held in the prompt cache before its new prompt overwrites it."""
        slot.saved_idle = None
        held, slot.held_ids = slot.held_ids, ()
        checkpoints, slot.held_checkpoints = slot.held_checkpoints, ()
        if held and self._caching():
            self._save_slot(slot, held, checkpoints)

    def _save_idle(self) -> None:
        """--cache-idle-slots: a request started, so every idle slot holding ids goes to the prompt cache
        (unless an entry holds them already); with clear_idle the slot is emptied after."""
        if not self._caching():
            return
        for slot, held, checkpoints in self._idle_held():
            saved = self._save_slot(slot, held, checkpoints)
            early, slot.saved_idle = slot.saved_idle == held, None       # saved while the engine idled
            if saved or early:
                tag = {"tag": "__TEST_TAG_CACHE_IDLE_SLOT__"} if self.test_tags else {}
                records.record("serve", "idle slot saved to the prompt cache", component="engine", slot=slot.id,
                               n_ids=len(held), cleared=self.clear_idle, **tag)
            if self.clear_idle:
                with self._lock:
                    if not slot.is_processing:
                        self.scheduler.forget(slot)

    def save_idle_now(self) -> int:
        """--cache-idle-slots, as the engine turns idle (stages/engine calls this after the step that ended the last
        request, before it reads another message): every idle slot's
        state into the prompt cache now, unless an entry holds it already, so the copy off the card is not on
        the next request's path (the save a new prompt in that slot, or --cache-idle-slots at a request start,
        would make then finds it done). The slots keep their KV; the next request start still announces the idle
        slots as --cache-idle-slots does (and empties them with --kv-unified). Returns the slots saved. A copy
        that fails is logged and leaves the slot and the cache as they were. Then, with no request left, the model
        hears the engine is quiet (model.host_idle; step() says when requests run again)."""
        try:
            return self._save_idle_now()
        finally:
            if self.model is not None and not self.has_work():      # quiet now (model.host_idle)
                self._host_idle = True
                self.model.host_idle(True)

    def _save_idle_now(self) -> int:
        if not self.cache_idle_slots or not self._caching() or self.model is None:
            return 0
        self.settle()
        n = 0
        for slot, held, checkpoints in self._idle_held():
            if slot.saved_idle == held:
                continue
            try:
                saved = self._save_slot(slot, held, checkpoints)
            except Exception as e:   # noqa: BLE001 (nothing was kept; the request start tries again)
                records.record("serve", "saving an idle slot failed", component="engine", slot=slot.id,
                               error=f"{type(e).__name__}: {e}")
                continue
            if saved:
                with self._lock:
                    if not slot.is_processing and tuple(slot.cached_ids) == held:
                        slot.saved_idle = held
            n += saved
        return n

    def _idle_held(self) -> list[tuple[Slot, tuple[int, ...], tuple]]:
        """(slot, its ids, its checkpoints) of every idle slot holding ids."""
        with self._lock:
            return [(s, tuple(s.cached_ids), tuple(s.checkpoints)) for s in self.scheduler.slots
                    if not s.is_processing and s.cached_ids]

    def _restore_saved(self, slot: Slot) -> None:
        """A saved state restoring a longer prefix of the prompt than the live slot keeps: that prefix into
        the slot (at least one prompt id is left to run, for the logits); a model that cannot rewind also gets
        its recurrent state at that position and the saved checkpoints up to it."""
        req = slot.req
        if not self._caching() or not req.cache_prompt:
            return
        with self._lock:
            got = self.prompt_cache.best(req.prompt_ids, slot.n_cached)
        if got is None:
            return
        entry, n = got
        t0 = time.perf_counter()
        # the live prefix the slot keeps for this prompt (its KV at 0 .. keep-1 is that of the same ids, which the
        # entry holds too): only positions keep .. n-1 are copied in. A model that cannot rewind keeps its KV there
        # as well; its recurrent state comes whole from the entry's mark at n.
        keep = slot.n_cached if 0 < slot.n_cached < n else 0
        with self._lock:
            del slot.cached_ids[keep:]           # the copy overwrites what lies past it: nothing there counts till done
            slot.checkpoints[:] = [c for c in slot.checkpoints if c[0] <= keep]
            slot.restore = None
            slot.n_cached = keep
        for piece in entry.pieces:           # each piece's positions past what the slot keeps
            lo, hi = max(piece.start, keep), min(piece.end, n)
            if lo < hi:
                self.model.restore_kv(slot.id, piece.arrays, hi, lo, piece.offset)
        if entry.marks:
            self.model.restore_checkpoint(slot.id, entry.mark(n), n)
        with self._lock:
            self.prompt_cache.restore_s += time.perf_counter() - t0
            self.prompt_cache.n_restored += 1
            self.scheduler.restored(slot, n, entry.marks)
            last = self._last.get(slot.id)
            if last is not None and last["req_id"] == req.req_id:
                last["n_cached"], last["n_processed"] = n, len(req.prompt_ids) - n
        records.record("serve", "updating prompt cache: a saved prefix restored into the slot", component="engine",
                       slot=slot.id, n_ids=n, took_ms=round((time.perf_counter() - t0) * 1000.0, 2))

    def _restore_checkpoint(self, slot: Slot) -> None:
        """A slot that cannot rewind, admitted at a checkpoint short of what it holds: that state back, so the
        prompt reads on from the checkpoint's position (n_cached)."""
        got, slot.restore = slot.restore, None
        if got is None:
            return
        n, state = got
        t0 = time.perf_counter()
        self.model.restore_checkpoint(slot.id, state, n)
        records.record("serve", "restored a checkpoint: the prompt reads on from its position", component="engine",
                       slot=slot.id, n_ids=n, took_ms=round((time.perf_counter() - t0) * 1000.0, 2))

    def _start(self, slot: Slot, progress: list[TokenOut], saved_ms: float = 0.0) -> TokenOut | None:
        """An admitted request: a restore from the prompt cache, its sampler; None when it may run its
        prompt, else the output that failed it. saved_ms: the save of what the slot held, before (cache_ms)."""
        req = slot.req
        t0 = time.perf_counter()
        try:
            self._restore_saved(slot)
            self._restore_checkpoint(slot)
        except Exception as e:   # the slot holds nothing trustworthy now (forgotten); this request fails
            return self._fail(slot, e, len(req.prompt_ids))
        cache_ms = saved_ms + (time.perf_counter() - t0) * 1000.0
        try:
            sampler = Sampler(req.sampling, self.n_vocab, self.n_ctx_slot, req.prompt_ids,
                              matcher=self._matcher(req))
        except Exception as e:
            return self._fail(slot, e, len(req.prompt_ids), slot.n_cached)
        slot.state = _ReqState(sampler, frozenset(req.stop_ids), n_done=slot.n_cached, t0=time.perf_counter(),
                               cache_ms=cache_ms)
        if req.return_progress:
            self._report(slot, progress)
        return None

    def _chunk(self) -> int:
        """The ids of one chunked-prefill pass, all slots' together: min(n_batch, the model's n_ubatch)."""
        return max(min(self.n_batch, self.model.n_ubatch or self.n_batch), 1)

    def _prefill(self, slot: Slot, progress: list[TokenOut], whole: bool) -> TokenOut | None:
        """The slot's prompt from where it stands: whole (in passes of n_batch ids when it reports its
        progress, else one call), or one chunk of at most min(n_batch, n_ubatch) ids. After its last
        pass the first id is sampled; None while the prompt is not done."""
        req, st = slot.req, slot.state
        n_prompt = len(req.prompt_ids)
        if whole:
            step = max(self.n_batch, 1) if req.return_progress else n_prompt
        else:
            step = self._chunk()
        while True:
            n = self.scheduler.cut(slot, st.n_done, step)                 # a pass ends at a message start
            ids = np.asarray(req.prompt_ids[st.n_done:st.n_done + n], dtype=np.int32)   # [T]
            logits = self._prompt_pass([(slot, ids)])[0]                   # [V] of the pass's last id
            if isinstance(logits, Exception) or not whole or st.n_done + len(ids) >= n_prompt:
                return self._passed(slot, len(ids), logits, progress)
            failed = self._passed(slot, len(ids), None, progress)
            if failed is not None:
                return failed

    def _prefill_round(self, slots: list[Slot], progress: list[TokenOut]) -> list[TokenOut]:
        """Several slots with prompt ids to read: one chunk of min(n_batch, n_ubatch) ids in all,
        filled from each slot's prompt in slot order (as llama-server fills its batch), run as one
        model call where the model takes several slots (prefill_slots), else one call a slot."""
        parts, room = [], self._chunk()
        shared = self.model.shares_passes
        for slot in slots:
            st = slot.state
            n = self.scheduler.cut(slot, st.n_done, min(len(slot.req.prompt_ids) - st.n_done, room))
            parts.append((slot, np.asarray(slot.req.prompt_ids[st.n_done:st.n_done + n], dtype=np.int32)))
            room = room - n if shared else room
            if room <= 0:
                break
        got = self._prompt_pass(parts)
        outs = [self._passed(slot, len(ids), logits, progress) for (slot, ids), logits in zip(parts, got)]
        return [o for o in outs if o is not None]

    def _prompt_pass(self, parts: list[tuple[Slot, np.ndarray]]) -> list:
        """Each part's ids into its slot from where its prompt stands, in one model call when there
        are several and the model takes them (prefill_slots); per part, the logits [V] of its last
        id or the exception that failed it."""
        if len(parts) > 1 and self.model.shares_passes:
            try:
                logits = np.asarray(self.model.prefill_slots([(s.id, ids, s.state.n_done) for s, ids in parts]))
                if logits.shape != (len(parts), self.n_vocab):
                    raise ValueError(f"model.prefill_slots returned shape {logits.shape}, "
                                     f"expected ({len(parts)}, {self.n_vocab})")
                return list(logits)
            except Exception:
                pass      # which request failed is unknown: each alone below, so only the faulty one fails
        out = []
        for slot, ids in parts:
            try:
                out.append(self.model.prefill(slot.id, ids, slot.state.n_done))
            except Exception as e:   # one request's failure must not stop the others
                out.append(e)
        return out

    def _passed(self, slot: Slot, n: int, logits, progress: list[TokenOut]) -> TokenOut | None:
        """n more prompt ids of the slot went through the model (logits: of the last, or the exception
        that failed the pass): its progress, and after the prompt's last pass its first id."""
        req, st = slot.req, slot.state
        n_prompt = len(req.prompt_ids)
        if isinstance(logits, Exception):
            return self._fail(slot, logits, n_prompt, slot.n_cached)
        st.n_done += n
        with self._lock:
            self.scheduler.progressed(slot, st.n_done)
            save = self.scheduler.at_checkpoint(slot, st.n_done)
        if save:
            try:
                state = self.model.save_checkpoint(slot.id, st.n_done)
            except Exception as e:
                return self._fail(slot, e, n_prompt, slot.n_cached)
            with self._lock:
                self.scheduler.checkpointed(slot, st.n_done, state)
        if req.return_progress:
            self._report(slot, progress)
        if st.n_done < n_prompt or logits is None:
            return None
        st.prompt_ms = (time.perf_counter() - st.t0) * 1000.0
        with self._lock:
            self.scheduler.prefilled(slot)
        return self._sample(slot, logits, first=True)

    def _decode(self, slots: list[Slot], ahead: tuple | None = None, chained: tuple | None = None) -> list[TokenOut]:
        ids = np.array([s.next_id for s in slots], dtype=np.int32)               # [B]
        positions = np.array([s.n_past for s in slots], dtype=np.int32)          # [B]
        key = self._step_key(slots, ids, positions)
        self.decode_steps += 1
        picks = self._ahead_picks(slots, ahead) if ahead is not None and ahead[0] == key else None
        if picks is not None:
            self.ahead_steps += 1
        else:
            chained = self._drop_chained(chained)
            if ahead is not None:
                self.ahead_dropped += 1
            try:
                picks = self._model_step(slots, ids, positions)
            except Exception as e:
                if len(slots) == 1:
                    return [self._fail(slots[0], e)]
                # the batch failed: run each slot alone so only the faulty request fails
                return [out for s in slots for out in self._decode([s])]
        with self._lock:
            for slot in slots:
                self.scheduler.fed(slot)
        outs = [self._sample(slot, first=False, **pick) for slot, pick in zip(slots, picks)]
        self._launch_ahead(slots, outs, chained)
        return outs

    @staticmethod
    def _step_key(slots: list[Slot], ids, positions) -> tuple:
        return tuple(s.id for s in slots), tuple(int(i) for i in ids), tuple(int(p) for p in positions)

    def _ahead_top_k(self, slots: list[Slot]) -> int:
        """The k of a step launched ahead through decode_topk_begin: every slot greedy with no schema, no bias but
        bans and not missing often (greedy_from_top), so that a row's largest logits settle each pick (one more
        than its bans); 0 where they cannot."""
        k_greedy = min(self.greedy_top_k, getattr(self.model, "topk_max", 0))
        if k_greedy <= 0 or not all(s.state.sampler.greedy_from_top and s.state.sampler.matcher is None
                                    and s.state.top_miss < self.TOP_MISS_MAX for s in slots):
            return 0
        return min(k_greedy, max(s.state.sampler.top_settles for s in slots))

    def _device_bans(self, slots: list[Slot]) -> list[tuple[int, ...]] | None:
        """Each slot's bans when every slot's greedy pick can be made on the model's device (decode_greedy: ()
        for a plain argmax, else the ids it bans, as many as the model takes); None where not."""
        if not self.model.picks_on_device:
            return None
        bans = [s.state.sampler.device_bans for s in slots]
        most = getattr(self.model, "greedy_bans", 0)
        if any(b is None or len(b) > most for b in bans):
            return None
        return bans

    def _ahead_picks(self, slots: list[Slot], ahead: tuple) -> list[dict] | None:
        """The step launched ahead for these slots as their picks: its ids, or each row's pick from its largest
        logits; None where the slots' samplers no longer take it or a row's largest cannot settle its pick (a
        miss, as in _model_step: the step runs again in place)."""
        _, got, k, bans = ahead
        if k == 0:
            if self._device_bans(slots) != bans:
                return None
            return [dict(token=int(t)) for t in np.asarray(got).reshape(-1)]
        if self._ahead_top_k(slots) == 0:
            return None
        c_ids, c_vals, n_nan = (np.asarray(a) for a in got)
        picks = []
        for b, slot in enumerate(slots):
            token = self._top_pick(slot, c_ids[b], c_vals[b], n_nan[b])
            if token is None:
                self.top_misses += 1
                return None
            picks.append(dict(token=token))
        self.top_steps += 1
        return picks

    def _top_pick(self, slot: Slot, c_ids, c_vals, n_nan) -> int | None:
        """A greedy slot's pick from its row's largest logits (None: they cannot settle it), kept in its
        running miss share."""
        token = slot.state.sampler.pick_from_top(c_ids, c_vals, int(n_nan))
        slot.state.top_miss += self.TOP_MISS_RATE * ((token is None) - slot.state.top_miss)
        return token

    def _launch_ahead(self, slots: list[Slot], outs: list[TokenOut], chained: tuple | None = None) -> None:
        """Every slot of this step goes on, each a greedy pick the device can make (plain: its argmax; with bans:
        from its largest logits), no other slot joins, nothing to cancel: the next step launched now
        (model.decode_greedy_begin, decode_topk_begin), so the device computes it while this step's ids travel
        to their clients; the next round takes it when it decodes the same slots (step()). `chained`, the step
        chained behind this one, is that next step where the slots go on as it assumed; else it is dropped."""
        if not self._launch_next(slots, outs, chained):
            self._drop_chained(chained)

    def _launch_next(self, slots: list[Slot], outs: list[TokenOut], chained: tuple | None) -> bool:
        """_launch_ahead's work; True where it dealt with `chained` (took it as the step ahead, or dropped it)."""
        if not getattr(self.model, "greedy_ahead", False) or any(o.finish is not None or o.token is None for o in outs):
            return False
        with self._lock:
            if self._cancels or any(s.req is None or s.next_id is None for s in slots):
                return False
            # a slot whose prompt ended this round decodes next round too: a step without it would be dropped
            if {s.id for s in self.scheduler.busy() if s.next_id is not None} != {s.id for s in slots}:
                return False
            ids = np.array([s.next_id for s in slots], dtype=np.int32)
            positions = np.array([s.n_past for s in slots], dtype=np.int32)
            left = [s.req.n_predict - s.n_decoded if s.req.n_predict >= 0 else None for s in slots]
        bans = self._device_bans(slots)
        k = 0 if bans is not None else self._ahead_top_k(slots)
        if bans is None and k == 0:
            return False
        if any(p >= self.n_ctx_slot for p in positions):
            return False
        b_ids = [s.id for s in slots]
        key = self._step_key(slots, ids, positions)
        if chained is not None and k == 0 and chained[:2] == ((tuple(b_ids), tuple(int(p) for p in positions)), bans):
            # its ids are the picks this round took from the step before it on the device: these ids
            self._ahead = (key, chained[2], 0, bans)
            self.chained_steps += 1
            self._chain_behind(b_ids, positions, bans, left)
            return True
        self._drop_chained(chained)
        try:
            handle = (self._greedy_call(self.model.decode_greedy_begin, b_ids, ids, positions, bans) if k == 0
                      else self.model.decode_topk_begin(b_ids, ids, positions, k))
        except Exception:            # the next step runs its own, which says what failed
            return True
        if handle is not None:
            self._ahead = (key, handle, k, bans)
            if k == 0:
                self._chain_behind(b_ids, positions, bans, left)
        return True

    def _chain_behind(self, b_ids: list[int], positions, bans, left) -> None:
        """The step after the one just launched ahead (at `positions`) chained behind it, where the model chains,
        the slots have room one position on, and each has at least two ids left to make (left: None for no
        bound), so that a step whose slot must end is not made for nothing."""
        if not getattr(self.model, "greedy_chain", False):
            return
        nxt = np.asarray(positions, dtype=np.int32) + 1
        if any(p >= self.n_ctx_slot for p in nxt) or any(n is not None and n < 2 for n in left):
            return
        try:
            handle = self.model.decode_greedy_chain(self._ahead[1], b_ids, nxt, bans=bans if any(bans) else None)
        except Exception:            # the next step runs its own, which says what failed
            return
        if handle is not None:
            self._chained = ((tuple(b_ids), tuple(int(p) for p in nxt)), bans, handle)

    @staticmethod
    def _greedy_call(call, b_ids, ids, positions, bans):
        """model.decode_greedy(_begin) with the rows' bans, given only where a row bans anything (a model that
        takes none is never asked)."""
        return call(b_ids, ids, positions, bans=bans) if any(bans) else call(b_ids, ids, positions)

    def _model_step(self, slots: list[Slot], ids: np.ndarray, positions: np.ndarray) -> list[dict]:
        """One batched step through the narrowest model call the slots' samplers allow, as each
        slot's _sample arguments: the model's own greedy ids (every slot plain greedy), each row's
        top_k candidates (every slot's chain needs no more), or whole rows of logits."""
        b_ids, n = [s.id for s in slots], len(slots)
        bans = self._device_bans(slots)
        if bans is not None:
            picks = np.asarray(self._greedy_call(self.model.decode_greedy, b_ids, ids, positions, bans)).reshape(-1)
            if picks.shape != (n,):
                raise ValueError(f"model.decode_greedy returned shape {picks.shape}, expected ({n},)")
            return [dict(token=int(t)) for t in picks]
        ks = [s.state.sampler.candidates_k for s in slots]
        k_max = self.model.topk_max
        k_greedy = min(self.greedy_top_k, k_max)
        from_top = [k_greedy > 0 and s.state.sampler.greedy_from_top and s.state.top_miss < self.TOP_MISS_MAX
                    for s in slots]
        for s, g in zip(slots, from_top):
            if not g:
                s.state.top_miss *= self.TOP_MISS_EASE
        if k_max and all(0 < kb <= k_max or g for kb, g in zip(ks, from_top)):
            # a greedy slot with no mask needs the largest alone, or one more than its bans
            k = max(ks + [k_greedy if s.state.sampler.matcher is not None else min(k_greedy, s.state.sampler.top_settles)
                          for s, g in zip(slots, from_top) if g])
            top = self.model.decode_topk(b_ids, ids, positions, k)
            c_ids, c_vals, n_nan = (np.asarray(a) for a in top)                  # [B, k] x2, [B]
            if c_ids.shape != (n, k) or c_vals.shape != c_ids.shape or n_nan.shape != (n,):
                raise ValueError(f"model.decode_topk returned shapes {c_ids.shape}, {c_vals.shape}, {n_nan.shape}, "
                                 f"expected ({n}, {k}) twice and ({n},)")
            picks = []
            for b, (slot, kb, g) in enumerate(zip(slots, ks, from_top)):
                token = self._top_pick(slot, c_ids[b], c_vals[b], n_nan[b]) if g else None
                if g and token is None:
                    break
                picks.append(dict(token=token) if g else dict(candidates=(c_ids[b, :kb], c_vals[b, :kb], int(n_nan[b]))))
            if any(from_top):
                self.top_steps += 1
            if len(picks) == n:
                return picks
            # a greedy pick the k largest cannot settle: the step again with whole rows (the same ids
            # at the same positions write the same K/V again), every slot picking from those
            self.top_misses += 1
        logits = self.model.decode(b_ids, ids, positions)                      # [B, V]
        if np.shape(logits) != (n, self.n_vocab):
            raise ValueError(f"model.decode returned shape {np.shape(logits)}, expected ({n}, {self.n_vocab})")
        return [dict(logits=logits[b]) for b in range(n)]

    def _sample(self, slot: Slot, logits: np.ndarray | None = None, first: bool = False, token: int | None = None,
                candidates: tuple | None = None) -> TokenOut:
        """Pick from logits (the sampler chain), from the row's top_k candidates (ids, values, NaN
        count), or take the id the model picked (plain greedy)."""
        req, st = slot.req, slot.state
        n_prompt = len(req.prompt_ids)
        try:
            if candidates is not None:
                s = st.sampler.sample_candidates(*candidates)
            elif token is None:
                s = st.sampler.sample(logits)
            elif 0 <= token < self.n_vocab:
                s = Sample(token)
            else:
                raise SamplerError(f"the model's greedy pick {token} is not a token id (0..{self.n_vocab - 1}): "
                                   f"its logits had no finite largest value")
        except SamplerError as e:
            return self._fail(slot, e, n_prompt, slot.n_cached if first else 0)
        try:
            st.sampler.accept_generated(s.token)
        except SamplerError as e:
            return self._fail(slot, e, n_prompt, slot.n_cached if first else 0)
        with self._lock:
            self.scheduler.sampled(slot, s.token)
            finish = finish_reason(n_prompt, slot.n_decoded, self.n_ctx_slot, req.n_predict,
                                   stopped=s.token in st.stop_ids or st.sampler.grammar_done)
            if finish is not None:
                self._note_done(slot.id, req.req_id, slot.n_decoded)
                self.scheduler.release(slot)
        return TokenOut(req.req_id, s.token, finish, logprob=s.logprob, top=s.top,
                        n_prompt=n_prompt if first else 0,
                        n_cached=slot.n_cached if first else 0,
                        prompt_ms=st.prompt_ms if first else 0.0, cache_ms=st.cache_ms if first else 0.0,
                        slot=slot.id)

    def _matcher(self, req: EngineRequest) -> Matcher | None:
        """The request's structured-output state: its grammar against the vocabulary's token bytes (the
        first mask is computed while the prompt runs)."""
        if not req.sampling.grammar:
            return None
        if self._grammar_vocab is None:
            gf = self.model.gf
            if gf is None:
                raise GrammarError("this model carries no vocabulary to run structured output against")
            from bloomery.grammar import Vocab
            from bloomery.tokenizer import Tokenizer
            self._grammar_vocab = Vocab.from_tokenizer(Tokenizer.from_gguf(gf.metadata), self.n_vocab)
        from bloomery.grammar import Matcher       # llguidance: with the first grammar, not at the start
        return Matcher(req.sampling.grammar, self._grammar_vocab, req.stop_ids)

    def _embed(self, slot: Slot) -> TokenOut:
        """An embedding request: the prompt run whole from position 0 (model.hidden_states), its final-norm rows
        pooled as the request says (none: every row; mean; cls: the first; last), as float32 bytes in base64.
        The slot then holds the prompt, as after a prompt pass."""
        req = slot.req
        t0 = time.perf_counter()
        try:
            if req.pooling not in POOLINGS:
                raise ValueError(f"pooling {req.pooling!r} is not one of {', '.join(POOLINGS)}")
            with self._lock:
                self.scheduler.forget(slot)
            rows = np.asarray(self.model.hidden_states(slot.id, req.prompt_ids), dtype=np.float32)   # [T, D]
            pooled = POOLINGS[req.pooling](rows)
        except Exception as e:
            return self._fail(slot, e, len(req.prompt_ids))
        ms = (time.perf_counter() - t0) * 1000.0
        with self._lock:
            self.scheduler.prefilled(slot)
            last = self._last.get(slot.id)
            if last is not None and last["req_id"] == req.req_id:
                last["n_cached"], last["n_processed"] = 0, len(req.prompt_ids)
            self._note_done(slot.id, req.req_id, 0)
            self.scheduler.release(slot)
        return TokenOut(req.req_id, None, "stop", n_prompt=len(req.prompt_ids), prompt_ms=ms, slot=slot.id,
                        embedding=base64.b64encode(np.ascontiguousarray(pooled, "<f4").tobytes()).decode("ascii"),
                        embd_rows=int(pooled.shape[0]))

    def _note_done(self, slot_id: int, req_id: str, n_decoded: int) -> None:
        """Keep the finished request's counts for /slots (the lock is held)."""
        last = self._last.get(slot_id)
        if last is not None and last["req_id"] == req_id:
            last["n_decoded"] = n_decoded

    def _fail(self, slot: Slot, err: Exception, n_prompt: int = 0, n_cached: int = 0) -> TokenOut:
        req_id = slot.req.req_id
        with self._lock:
            self._note_done(slot.id, req_id, slot.n_decoded)
            self.scheduler.forget(slot)
            self.scheduler.release(slot)
        message = f"{type(err).__name__}: {err}" if not isinstance(err, SamplerError) else str(err)
        return TokenOut(req_id, None, "error", n_prompt=n_prompt, n_cached=n_cached, error=message, slot=slot.id)
