"""Adaptive residency: which routed experts hold the card's expert slots, as pure functions.

The host keeps every routed expert; the card holds a fixed number of slots per layer (the plan's
experts_on_card). Between steps the engine counts how often each expert was routed, per layer, and
asks `moves` which experts to copy in: the hottest host experts swap with the coldest card
experts of the same layer, the largest gains first, while the bytes copied to the card stay within
a per-step budget (a step never waits on copies; what does not fit waits for the next step). An
evicted expert costs nothing to move (its slot is overwritten; the host copy stays).

Ties never move: an expert swaps in only when routed strictly more often than the one it replaces,
so equal counts leave the residency as it is, and the same counts always give the same moves.
No device code here; the engine carries the moves out and rewrites the table the kernels read.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np


# The share of each decode step's host picks the card copies over PCIe and computes itself (the rest
# the host computes). Both lanes read the same host RAM, so the balance is not the bus's rate over the
# sum of the two rates: on the H200 host, with every expert on the host, a decode step took 13.2 ms
# at 0.35, 14.9 at 0.45 and 15.1 at 0.55 (in process, docs/performance.md run N). At the few host
# picks a layer of a fitted card (m of 1 to 3), 0.35 and 0.45 pick the same split.
STREAM_SHARE = 0.35


def _env_fraction(name: str, default: float, what: str) -> float:
    """A lever that is a fraction in [0, 1]: the variable's value, else default; anything else is refused by
    name, saying what it sets."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name}={raw!r}: give a fraction from 0 to 1 ({what})")
    return value


def stream_share() -> float:
    """BLOOMERY_STREAM_SHARE (a fraction in [0, 1]; 0: the host computes every host expert), else
    STREAM_SHARE."""
    return _env_fraction("BLOOMERY_STREAM_SHARE", STREAM_SHARE,
                         "the share of host experts the card reads over the bus in decode")


def bus_picks(m: int, share: float) -> int:
    """Of the m distinct host experts a decode step picks in a layer, how many go over the bus (the
    first ones in pick order; kernels/moe.cu host_post computes this in float32): m * share rounded,
    halves up."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"the streamed share must lie in [0, 1], not {share}")
    return int(np.floor(np.float32(m) * np.float32(share) + np.float32(0.5)))


def prompt_weight() -> float:
    """BLOOMERY_RESIDENCY_PROMPT_WEIGHT (a fraction in [0, 1], default 1): how much a prompt pass's routing
    counts in the ranking beside the decode steps'. A 512-id prompt adds 4,096 picks a layer against a decode
    update's 128, so at 1 the ranking follows the prompt for about 80 decode steps (five halvings). A lever to
    measure against served decode (session 23: served offload decode lags the engine in process, which
    measures after hundreds of decode steps); the prompt's most-used experts still take card slots at once
    (adopt), whatever this weight."""
    return _env_fraction("BLOOMERY_RESIDENCY_PROMPT_WEIGHT", 1.0,
                         "how much a prompt pass's routing counts in the residency's ranking")


def weigh_prompt(recent: np.ndarray, weight: float) -> np.ndarray:
    """A prompt pass's counts [L, E] (and the few decode steps' since the last update) as the ranking takes
    them: times weight, rounded down, so 1 leaves them as they are and 0 drops them."""
    if weight >= 1.0:
        return recent
    return np.floor(recent * weight).astype(recent.dtype)


# The ranking's memory: a pick this many decode steps old weighs half as much as a new one. 16 (one update's
# steps) chases the last few dozen steps; a longer memory ranks by the steady popularity of the experts.
HALF_LIFE = 16
SCORE_BITS = 8          # the ranking holds counts times 2**8, so a slow decay keeps their fractions


def half_life() -> int:
    """BLOOMERY_RESIDENCY_HALF_LIFE (decode steps, >= 1), else HALF_LIFE."""
    raw = os.environ.get("BLOOMERY_RESIDENCY_HALF_LIFE", "").strip()
    if not raw:
        return HALF_LIFE
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"BLOOMERY_RESIDENCY_HALF_LIFE={raw!r}: give a whole number of decode steps >= 1 (after how "
                         f"many steps a pick weighs half in the residency's ranking)")
    return value


def keep_per_update(half_life_steps: int, every: int) -> int:
    """What an update keeps of the ranking, in 1/65536: 0.5 ** (every / half_life_steps), rounded."""
    if half_life_steps < 1 or every < 1:
        raise ValueError(f"residency: a half-life of {half_life_steps} steps and updates every {every}: both must be >= 1")
    return int(round(65536 * 0.5 ** (every / half_life_steps)))


def rank(score: np.ndarray, recent: np.ndarray, keep: int) -> np.ndarray:
    """The ranking after an update: the old one times keep/65536 (rounded down), plus the counts since the last
    update times 2**SCORE_BITS. Integers in, integers out, so the same routing always ranks the same."""
    return ((score * keep) >> 16) + (recent.astype(np.int64) << SCORE_BITS)


@dataclass(frozen=True)
class Move:
    layer: int
    into_card: int      # the host expert copied into the slot
    out_of_card: int    # the card expert whose slot it takes
    gain: int           # routing count of the one in minus the one out (> 0)
    nbytes: int         # bytes copied to the card


def _held(counts: np.ndarray, on_card, expert_bytes: Sequence[int], budget: int) -> np.ndarray:
    """The checked input's card slots as a mask [L, E] (on_card: a sequence of expert sets, or the mask)."""
    if len(on_card) != len(counts) or len(expert_bytes) != len(counts):
        raise ValueError(f"residency: {len(counts)} layers of counts, {len(on_card)} of card slots and "
                         f"{len(expert_bytes)} expert sizes; they must match")
    if budget < 0:
        raise ValueError(f"residency: a byte budget of {budget} (must be >= 0)")
    if counts.size and counts.min() < 0:
        raise ValueError(f"residency: layer {int(np.nonzero((counts < 0).any(axis=1))[0][0])} has a negative "
                         f"routing count")
    if isinstance(on_card, np.ndarray):
        if on_card.shape != counts.shape or on_card.dtype != bool:
            raise ValueError(f"residency: a card mask of shape {on_card.shape}, {on_card.dtype}; the counts are "
                             f"{counts.shape}")
        return on_card
    held = np.zeros(counts.shape, bool)
    for layer, got in enumerate(on_card):
        got = np.fromiter(got, np.int64, len(got))
        bad = got[(got < 0) | (got >= counts.shape[1])]
        if bad.size:
            raise ValueError(f"residency: layer {layer} holds expert {int(bad[0])}, which is not one of its "
                             f"{counts.shape[1]}")
        held[layer, got] = True
    return held


def _swaps(counts: np.ndarray, held: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every layer's useful swaps at once, counts and held [L, E]: (hot, cold, n) where hot[l] lists layer
    l's host experts hottest first (ties: the lower id first), cold[l] its card experts coldest first, and
    the first n[l] pairs swap: the i-th hottest host expert for the i-th coldest card one, while the first
    is routed strictly more (the gains fall as i grows, so the useful pairs are a prefix)."""
    n_layer, n_expert = counts.shape
    ids = np.arange(n_expert, dtype=np.int64)
    top = (int(counts.max(initial=0)) + 1) * n_expert
    hot = np.argsort(np.where(held, 2 * top, top - counts * n_expert + ids), axis=1)
    cold = np.argsort(np.where(held, counts * n_expert + ids, 2 * top), axis=1)
    k = np.minimum((~held).sum(axis=1), held.sum(axis=1))
    gain = np.take_along_axis(counts, hot, 1) - np.take_along_axis(counts, cold, 1)
    useful = (gain > 0) & (ids[None, :] < k[:, None])
    n = np.where(useful.all(axis=1), n_expert, np.argmin(useful, axis=1))
    return hot, cold, n


def layer_swaps(layer: int, row: Sequence[int], held: frozenset[int], nbytes: int) -> list[Move]:
    """One layer's useful swaps, the largest gain first: i-th hottest host expert for the i-th coldest card one."""
    r = np.asarray(row, np.int64).reshape(1, -1)
    hot, cold, n = _swaps(r, _held(r, [held], [nbytes], 0))
    return [Move(layer, int(h), int(c), int(r[0, h] - r[0, c]), nbytes) for h, c in zip(hot[0, :n[0]], cold[0, :n[0]])]


def moves(counts, on_card: Sequence[frozenset[int]], expert_bytes: Sequence[int], budget: int) -> tuple[Move, ...]:
    """The swaps to make before the next step: counts[layer][expert] routed (a sequence of rows or an
    [L, E] array), on_card[layer] the experts in card slots (or a mask [L, E]), expert_bytes[layer] one expert's bytes,
    budget the bytes the step may copy. The largest gains first (ties: the lower layer, then the lower
    expert id), each taken while the bytes so far and its own stay within the budget."""
    c = np.asarray(counts, np.int64).reshape(len(counts), -1)
    held = _held(c, on_card, expert_bytes, budget)
    if not c.size:
        return ()
    hot, cold, n = _swaps(c, held)
    pick = np.arange(c.shape[1])[None, :] < n[:, None]                 # [L, E] the useful pairs
    layer = np.nonzero(pick)[0]
    into, out = hot[pick], cold[pick]
    if not into.size:
        return ()
    gain = c[layer, into] - c[layer, out]
    nbytes = np.asarray(expert_bytes, np.int64)[layer]
    order = np.lexsort((into, layer, -gain))
    chosen, spent, least = [], 0, int(nbytes.min())
    for i in order.tolist():
        if spent + nbytes[i] <= budget:
            chosen.append(Move(int(layer[i]), int(into[i]), int(out[i]), int(gain[i]), int(nbytes[i])))
            spent += int(nbytes[i])
            if budget - spent < least:
                break
    return tuple(chosen)


def apply(on_card: Sequence[frozenset[int]], chosen: Sequence[Move]) -> tuple[frozenset[int], ...]:
    """The card slots after the moves."""
    out = [set(s) for s in on_card]
    for m in chosen:
        if m.out_of_card not in out[m.layer] or m.into_card in out[m.layer]:
            raise ValueError(f"residency: move {m} does not fit layer {m.layer}'s slots")
        out[m.layer].remove(m.out_of_card)
        out[m.layer].add(m.into_card)
    return tuple(frozenset(s) for s in out)
