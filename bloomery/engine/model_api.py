"""What the engine core asks of a model, said once.

Every model answers prefill and decode. What a model may lack is declared by an attribute, never
found by probing for a method: `picks_on_device` (decode_greedy), `topk_max` (decode_topk; 0:
none), `saves_kv` (save_kv / restore_kv / kv_bytes_per_position, the prompt cache's calls),
`shares_passes` (prefill_slots), `embeds` (hidden_states, for embeddings), `rewinds`, `checkpoints`
(save_checkpoint / restore_checkpoint, for a state that cannot rewind), `n_ubatch` and `gf`. models/base.CausalLM is the real model; a stand-in (a test's)
subclasses EngineModel and declares what it has. Calling an ability the model declares it
lacks raises NotImplementedError naming the attribute.

Legend: T = ids of one pass, B = slots in a decode batch, V = vocabulary.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:
    from bloomery.gguf_file import GGUFFile


class EngineModel:
    """The model contract of engine/core.py; the defaults are a model with no optional ability."""

    n_vocab: int
    # a slot's state can be cut back to any earlier position (a KV cache): prefix reuse keeps any
    # common prefix. False for a recurrent state, which keeps only a prompt that extends it.
    rewinds: bool = True
    # save_checkpoint / restore_checkpoint: a copy of what cannot rewind (the recurrent state) at a position,
    # put back later so the slot carries on from there (the KV beside it is cut back as usual)
    checkpoints: bool = False
    checkpoint_bytes: int = 0        # what one checkpoint holds (a slot's recurrent state)
    picks_on_device: bool = False    # decode_greedy: each slot's argmax picked where the logits are
    # decode_greedy_begin: a greedy step launched now and waited for later (.wait() gives the ids [B]), so the
    # host's work between steps runs while the device computes; the model's state may take the step's write
    # though its ids are never used (a request that ended meanwhile), so only a state that rewinds may
    greedy_ahead: bool = False
    # decode_greedy_chain: the greedy step after a launched one, launched behind it with its picks as ids on the
    # device, so the device runs the two back to back while the host reads the first's ids
    greedy_chain: bool = False
    topk_max: int = 0                # decode_topk takes k in 1..topk_max; 0: whole rows of logits only
    greedy_bans: int = 0             # decode_greedy(bans=...): ids a row's pick may ban (0: bans take decode_topk)
    saves_kv: bool = False           # save_kv / restore_kv copy a slot's state out and back (the prompt cache)
    kv_bytes_per_position: int = 0   # what a saved state costs per id (0: not known)
    n_ubatch: int = 0                # the most ids one prompt pass computes at once (0: no bound of its own)
    shares_passes: bool = False      # prefill_slots: several slots' prompt ids in one pass
    embeds: bool = False             # hidden_states: every position's final-norm output (embeddings)
    gf: GGUFFile | None = None       # the model's file, whose vocabulary structured output runs against

    @property
    def saves_state(self) -> bool:
        """The prompt cache can keep a slot's whole state: its KV (save_kv) and, where the model cannot rewind, what
        cannot at the positions a restore picks up from (save_checkpoint)."""
        return self.saves_kv and (self.rewinds or self.checkpoints)

    def prefill(self, slot: int, ids, pos0: int) -> np.ndarray:
        """The last position's logits [V]; fills the slot's state at pos0 .. pos0+T-1."""
        raise NotImplementedError(f"{type(self).__name__} has no prefill")

    def decode(self, slots: Sequence[int], ids, positions) -> np.ndarray:
        """One id per slot, batched: logits [B, V]."""
        raise NotImplementedError(f"{type(self).__name__} has no decode")

    def decode_greedy(self, slots: Sequence[int], ids, positions, bans=None) -> np.ndarray:
        """One id per slot, each slot's next id by argmax (the first largest logit): ids [B]. bans (given only to a
        model whose greedy_bans > 0): per row, up to greedy_bans ids its pick skips, as a -inf logit bias."""
        raise self._lacks("decode_greedy", "picks_on_device", self.picks_on_device)

    def decode_greedy_begin(self, slots: Sequence[int], ids, positions, bans=None):
        """decode_greedy launched (bans as there): a handle whose wait() gives the ids [B] (None: this batch cannot
        be launched ahead). Nothing else may touch the device before wait() returns."""
        raise self._lacks("decode_greedy_begin", "greedy_ahead", self.greedy_ahead)

    def decode_greedy_chain(self, after, slots: Sequence[int], positions, bans=None):
        """The greedy step after the launched `after` (decode_greedy_begin's or this one's handle for the same slots,
        not yet waited for), whose ids are after's picks, launched now (positions: after's, each one on; bans as
        decode_greedy's): a handle as decode_greedy_begin's, waited for after `after` (None: not here)."""
        raise self._lacks("decode_greedy_chain", "greedy_chain", self.greedy_chain)

    def decode_topk(self, slots: Sequence[int], ids, positions, k: int):
        """One id per slot; of each row only the k largest logits (descending, ties to the lower
        id): (ids [B, k] int32, values [B, k] float32, NaN count [B])."""
        raise self._lacks("decode_topk", "topk_max", self.topk_max)

    def decode_topk_begin(self, slots: Sequence[int], ids, positions, k: int):
        """decode_topk launched, as decode_greedy_begin: a handle whose wait() gives its three arrays (None: this
        batch cannot be launched ahead). Needs greedy_ahead and topk_max."""
        raise self._lacks("decode_topk_begin", "greedy_ahead", self.greedy_ahead and self.topk_max > 0)

    def prefill_slots(self, parts: Sequence[tuple[int, object, int]]) -> np.ndarray:
        """Several slots' prompt ids (slot, ids, pos0) in shared passes: each part's last logits [n, V]."""
        raise self._lacks("prefill_slots", "shares_passes", self.shares_passes)

    def hidden_states(self, slot: int, ids) -> np.ndarray:
        """Every position's hidden state after the final norm (what the output head reads), float32 [T, D]
        on the host; fills the slot's state from position 0 (the prompt runs whole)."""
        raise self._lacks("hidden_states", "embeds", self.embeds)

    def save_kv(self, slot: int, n: int, start: int = 0) -> tuple:
        """The slot's state at positions start .. n-1 as host arrays (a piece of the prompt cache's entry)."""
        raise self._lacks("save_kv", "saves_kv", self.saves_kv)

    def restore_kv(self, slot: int, state: tuple, n: int, keep: int = 0, offset: int = 0) -> None:
        """Positions keep .. n-1 of the slot from a save_kv copy whose first position is `offset` (the slot
        holds 0 .. keep-1 already)."""
        raise self._lacks("restore_kv", "saves_kv", self.saves_kv)

    def pass_counts(self) -> dict[str, int]:
        """Prompt passes by the path they took, for /metrics: passes_prompt (every prefill_slots call) and
        passes_prompt_captured (of those, replayed from a captured graph); {} where the model keeps none."""
        return {}

    def prompt_cache_budget(self, n_bytes: int) -> None:
        """The prompt cache's budget: the most host bytes its saved states take. A backend that makes their
        memory ahead of need (the card's page-locked arena, host_arena.py) keeps that memory within it; others
        have nothing to do."""

    def host_idle(self, idle: bool) -> None:
        """The engine runs no request (True) or runs some (False). A backend keeps host work that holds the
        driver (page-locking memory made ahead for saved states) to the engine's quiet; others have nothing to
        do."""

    def save_checkpoint(self, slot: int, n: int) -> object:
        """A copy of the slot's state that cannot rewind, as it stands after positions 0 .. n-1."""
        raise self._lacks("save_checkpoint", "checkpoints", self.checkpoints)

    def restore_checkpoint(self, slot: int, state: object, n: int) -> None:
        """The slot as after positions 0 .. n-1 from a save_checkpoint copy (its KV at 0 .. n-1 is still the
        same ids'); the next pass runs from position n."""
        raise self._lacks("restore_checkpoint", "checkpoints", self.checkpoints)

    def _lacks(self, call: str, attr: str, value) -> NotImplementedError:
        return NotImplementedError(f"{type(self).__name__} has no {call}: it declares {attr} = {value!r}")
