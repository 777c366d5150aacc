"""How unevenly a MoE model routes: the share of the routing taken by its busiest experts.

`counts` is per layer the number of times each expert was picked (a token picks n_expert_used
experts a layer, so a layer's counts sum to tokens x n_expert_used; decayed, fractional counts
are taken as they are). The top fraction (20 % by
default) of a layer's experts is counted exactly, the last one in part where the fraction falls
between two experts (20 % of 128 experts is 25.6: the 25 busiest whole and 0.6 of the 26th), so a
layer routed evenly scores the fraction itself (0.2) and one routed to a single expert scores 1.
Layers that routed nothing are left out of the mean. Pure: numbers in, a number out.
"""
from __future__ import annotations

from typing import Sequence

TOP = 0.2


def top_share(counts: Sequence[int], top: float = TOP) -> float:
    """The share of one layer's routing taken by its busiest `top` fraction of experts."""
    if not 0 < top <= 1:
        raise ValueError(f"routing skew: top fraction {top!r} must be in (0, 1]")
    row = sorted((float(c) for c in counts), reverse=True)
    if not row:
        raise ValueError("routing skew: a layer with no experts")
    if row[-1] < 0:
        raise ValueError(f"routing skew: a negative count ({row[-1]:g})")
    total = sum(row)
    if total == 0:
        raise ValueError("routing skew: a layer that routed nothing")
    q = top * len(row)
    whole = int(q)
    taken = sum(row[:whole]) + (q - whole) * (row[whole] if whole < len(row) else 0)
    return taken / total


def routing_skew(counts: Sequence[Sequence[int]], top: float = TOP) -> float:
    """The mean over layers of top_share: the share of the routing mass taken by the top `top`
    fraction of each layer's experts. Layers with no routing are left out; none at all is an error."""
    shares = [top_share(row, top) for row in counts if sum(float(c) for c in row) > 0]
    if not shares:
        raise ValueError("routing skew: no layer routed any token")
    return sum(shares) / len(shares)


def best_static_share(counts: Sequence[Sequence[int]], slots: Sequence[int]) -> float:
    """The share of all the picks a fixed placement would have served had it known the counts ahead: per layer,
    the slots[layer] most-picked experts on the card. The ceiling for a residency that holds slots[layer] experts
    of each layer; where routing drifts (a conversation's subject), a moving residency can beat it. Layers that
    routed nothing add nothing; none at all is an error."""
    if len(slots) != len(counts):
        raise ValueError(f"best static share: {len(counts)} layers of counts and {len(slots)} of slots")
    served = total = 0.0
    for row, n in zip(counts, slots):
        if n < 0:
            raise ValueError(f"best static share: a layer with {n} slots")
        vals = sorted((float(c) for c in row), reverse=True)
        if vals and vals[-1] < 0:
            raise ValueError(f"best static share: a negative count ({vals[-1]:g})")
        served += sum(vals[:n])
        total += sum(vals)
    if total == 0:
        raise ValueError("best static share: no layer routed any token")
    return served / total
