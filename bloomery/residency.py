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


# The share of each decode step's host picks the card copies over PCIe and computes itself (the rest
# the host computes). Both lanes read the same host RAM, so the balance is not the bus's rate over the
# sum of the two rates: on the H200 host, with every expert on the host, a decode step took 13.2 ms
# at 0.35, 14.9 at 0.45 and 15.1 at 0.55 (in process, docs/performance.md run N). At the few host
# picks a layer of a fitted card (m of 1 to 3), 0.35 and 0.45 pick the same split.
STREAM_SHARE = 0.35


def stream_share() -> float:
    """BLOOMERY_STREAM_SHARE (a fraction in [0, 1]; 0: the host computes every host expert), else
    STREAM_SHARE."""
    raw = os.environ.get("BLOOMERY_STREAM_SHARE", "").strip()
    if not raw:
        return STREAM_SHARE
    try:
        share = float(raw)
    except ValueError:
        share = -1.0
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"BLOOMERY_STREAM_SHARE={raw!r}: give a fraction from 0 to 1 (the share of host experts "
                         f"the card reads over the bus in decode)")
    return share


def bus_picks(m: int, share: float) -> int:
    """Of the m distinct host experts a decode step picks in a layer, how many go over the bus (the
    first ones in pick order; kernels/moe.cu host_post computes this in float32): m * share rounded,
    halves up."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"the streamed share must lie in [0, 1], not {share}")
    import numpy as np
    return int(np.floor(np.float32(m) * np.float32(share) + np.float32(0.5)))


@dataclass(frozen=True)
class Move:
    layer: int
    into_card: int      # the host expert copied into the slot
    out_of_card: int    # the card expert whose slot it takes
    gain: int           # routing count of the one in minus the one out (> 0)
    nbytes: int         # bytes copied to the card


def _check(counts: Sequence[Sequence[int]], on_card: Sequence[frozenset[int]], expert_bytes: Sequence[int],
           budget: int) -> None:
    if len(on_card) != len(counts) or len(expert_bytes) != len(counts):
        raise ValueError(f"residency: {len(counts)} layers of counts, {len(on_card)} of card slots and "
                         f"{len(expert_bytes)} expert sizes; they must match")
    if budget < 0:
        raise ValueError(f"residency: a byte budget of {budget} (must be >= 0)")
    for layer, (row, held) in enumerate(zip(counts, on_card)):
        if any(c < 0 for c in row):
            raise ValueError(f"residency: layer {layer} has a negative routing count")
        bad = [e for e in held if not 0 <= e < len(row)]
        if bad:
            raise ValueError(f"residency: layer {layer} holds expert {bad[0]}, which is not one of its {len(row)}")


def layer_swaps(layer: int, row: Sequence[int], held: frozenset[int], nbytes: int) -> list[Move]:
    """One layer's useful swaps, the largest gain first: i-th hottest host expert for the i-th coldest card one."""
    hot = sorted((e for e in range(len(row)) if e not in held), key=lambda e: (-row[e], e))
    cold = sorted(held, key=lambda e: (row[e], e))
    out = []
    for h, c in zip(hot, cold):
        if row[h] <= row[c]:
            break
        out.append(Move(layer, h, c, row[h] - row[c], nbytes))
    return out


def moves(counts: Sequence[Sequence[int]], on_card: Sequence[frozenset[int]], expert_bytes: Sequence[int],
          budget: int) -> tuple[Move, ...]:
    """The swaps to make before the next step: counts[layer][expert] routed, on_card[layer] the experts
    in card slots, expert_bytes[layer] one expert's bytes, budget the bytes the step may copy."""
    _check(counts, on_card, expert_bytes, budget)
    every = [m for layer, (row, held) in enumerate(zip(counts, on_card))
             for m in layer_swaps(layer, row, frozenset(held), expert_bytes[layer])]
    every.sort(key=lambda m: (-m.gain, m.layer, m.into_card))
    chosen, spent = [], 0
    for m in every:
        if spent + m.nbytes <= budget:
            chosen.append(m)
            spent += m.nbytes
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


def decay(counts: Sequence[Sequence[int]], shift: int = 1) -> tuple[tuple[int, ...], ...]:
    """Halve (shift 1) every count, so old routing weighs less than new."""
    return tuple(tuple(c >> shift for c in row) for row in counts)
