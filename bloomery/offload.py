"""Where each tensor of a CUDA start lives, across the cards and host RAM: pure arithmetic over the
GGUF facts, the census and the placement flags (bloomery/placement_flags.py). bloomery.plan calls it
and wraps the result in its Placement; no I/O here.

Cases (Placement.case):
  "whole"   the model fits the main card: every tensor there (today's load).
  "budget"  it does not, and no flag placed a tensor: the main card takes every tensor but the
            routed experts (attention, dense and shared tensors, the output head), the KV cache,
            scratch and the pinned staging, then as many routed experts as its remaining bytes
            hold, spread evenly over the layers (a layer's extra one goes to the later layers, as
            -ncmoe puts the first layers on the host); other cards (-sm layer) then hold routed
            experts, in the -ts shares; the rest stay in host RAM.
  "flags"   --cpu-moe, -ncmoe or -ot placed tensors: those rules decide the tensors they name,
            every other tensor is on the main card, and nothing is fitted around them.
The main card is -mg, else the one with the most free bytes. A card keeps -fitt MiB free (1024).
Host experts (bloomery/engine/cuda/experts.py): a layer with any routed expert on the host keeps
every one of its experts in pinned host RAM (the residency's home: an expert leaves the card by a
table write, never by a copy back), and the main card keeps one staging buffer of the largest
layer's host experts (a prompt pass streams the ones it uses there to compute them on the card).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from bloomery.placement import DeviceNeed, Terms, TensorPlace, gib
from bloomery.placement_flags import EXPS_PATTERN, PlacementAsk

_BLK = re.compile(r"blk\.(\d+)\.")


class OffloadError(Exception):
    """A placement that cannot be made; the message names the flag or every term and the bound."""


@dataclass(frozen=True)
class Layout:
    """The model split into what the plan moves: routed experts per layer, and the rest."""
    n_layer: int
    n_expert: int
    sizes: dict[str, int]                        # every tensor's stored bytes
    experts: tuple[tuple[str, ...], ...]         # per layer, its stacked routed expert tensors
    expert_bytes: tuple[int, ...]                # per layer, one routed expert's bytes (gate + up + down)

    @property
    def expert_names(self) -> frozenset[str]:
        return frozenset(n for names in self.experts for n in names)

    @property
    def total(self) -> int:
        return sum(self.sizes.values())


def layout(tensors: tuple[tuple[str, int, tuple[int, ...]], ...], sizes: tuple[int, ...], n_layer: int,
           n_expert: int) -> Layout:
    """From the facts' tensors (name, ggml type, GGUF shape) and their stored bytes, in the same order."""
    if len(sizes) != len(tensors):
        raise OffloadError(f"the facts list {len(tensors)} tensors and {len(sizes)} sizes")
    experts: list[list[str]] = [[] for _ in range(n_layer)]
    each = [0] * n_layer
    for (name, _, shape), n in zip(tensors, sizes):
        m = _BLK.match(name)
        if n_expert and m and re.search(EXPS_PATTERN, name) and int(m.group(1)) < n_layer:
            if not shape or shape[-1] != n_expert:
                raise OffloadError(f"tensor {name}: shape {shape} does not stack {n_expert} experts")
            experts[int(m.group(1))].append(name)
            each[int(m.group(1))] += n // n_expert
    return Layout(n_layer, n_expert, {name: n for (name, _, _), n in zip(tensors, sizes)},
                  tuple(tuple(x) for x in experts), tuple(each))


@dataclass(frozen=True)
class Result:
    case: str                                   # "whole", "budget" or "flags"
    main: int                                   # the card that runs every layer
    devices: tuple[DeviceNeed, ...]             # host first, then every card in census order
    tensors: tuple[TensorPlace, ...]            # tensors (or expert slices) away from the main card
    experts_on_card: tuple[int, ...]            # per layer, routed experts on any card
    layer_why: tuple[str, ...]                  # per layer, why its experts sit where they do
    host_pass: bool = False                     # the card counts scratch_host: prompt passes take the host rows


def _cards_checked(ask: PlacementAsk, cards: tuple[int, ...]) -> tuple[int, list[int]]:
    """(main card, the cards used) with the flags checked against the census."""
    n = len(cards)
    if not n:
        raise OffloadError("the CUDA backend needs a card, and the census lists none")
    names = ", ".join(f"CUDA{i}" for i in range(n))
    if ask.main_gpu is not None and ask.main_gpu >= n:
        raise OffloadError(f"-mg {ask.main_gpu}: no such card; the census lists {names}")
    if ask.tensor_split and len(ask.tensor_split) != n:
        raise OffloadError(f"-ts lists {len(ask.tensor_split)} shares; the census lists {n} card(s) ({names})")
    if len(ask.fit_target_mib) not in (1, n):
        raise OffloadError(f"-fitt lists {len(ask.fit_target_mib)} margins; give one (every card) or {n} ({names})")
    for o in ask.overrides:
        if o.buft != "CPU" and int(o.buft[4:]) >= n:
            raise OffloadError(f"-ot {o.pattern}={o.buft}: unknown buffer type {o.buft}; this host has CPU, {names}")
    main = ask.main_gpu if ask.main_gpu is not None else max(range(n), key=lambda i: (cards[i], -i))
    used = [main] if ask.split_mode == "none" else [main, *(i for i in range(n) if i != main)]
    if ask.tensor_split:
        used = [i for i in used if i == main or ask.tensor_split[i] > 0]
    for i in used:
        if ask.margin_bytes(i) >= cards[i]:
            raise OffloadError(f"-fitt {ask.fit_target_mib[0] if len(ask.fit_target_mib) == 1 else ask.fit_target_mib[i]}"
                               f" leaves no usable byte on CUDA{i}: it keeps {gib(ask.margin_bytes(i))} free of "
                               f"{gib(cards[i])} free there")
    return main, used


def _spread(total: int, n_layer: int, n_expert: int) -> list[int]:
    """`total` experts over the layers, evenly; a remainder goes to the last layers."""
    base, extra = divmod(total, n_layer) if n_layer else (0, 0)
    return [min(n_expert, base + (1 if i >= n_layer - extra else 0)) for i in range(n_layer)]


def _staging(lay: Layout, host_per_layer: list[int]) -> int:
    """The card's staging buffer, the largest layer's host experts, and the block of zero bytes a host
    expert's table entry points at (at most one expert's bytes); 0 where no expert is on the host."""
    most = max((h * b for h, b in zip(host_per_layer, lay.expert_bytes)), default=0)
    return most + max(lay.expert_bytes, default=0) if most else 0


def place(lay: Layout, cards: tuple[int, ...], host_avail: int, ask: PlacementAsk, kv: int, scratch: int,
          host_reserve: int, fit_experts: bool, scratch_host: int | None = None) -> Result:
    """The placement across cards and host, or OffloadError naming what does not fit (every term).
    fit_experts: the "budget" case may move routed experts off the card (the caller allows it once
    the context rule could not fit the whole model). scratch_host: the scratch of a prompt pass where
    routed experts live on the host (the caller's shorter pass; default `scratch`)."""
    scratch_host = scratch if scratch_host is None else scratch_host
    host_pass = False                               # the card counts scratch_host
    main, used = _cards_checked(ask, cards)
    n_layer, n_exp = lay.n_layer, lay.n_expert
    main_dev = f"cuda:{main}"
    flagged = {name: d for name in lay.sizes if (d := ask.device_of(name)) is not None} if ask.explicit else {}
    for name, (d, by) in flagged.items():
        if d != "host" and int(d[5:]) not in used:
            raise OffloadError(f"{name}: {by} puts it on CUDA{d[5:]}, which -sm none (or a -ts share of 0) "
                               f"leaves out")
    dev = {name: flagged.get(name, (main_dev, ""))[0] for name in lay.sizes}
    shared = sum(lay.sizes[n] for n in lay.sizes if n not in lay.expert_names and dev[n] == main_dev)
    margin = {i: ask.margin_bytes(i) for i in used}
    room_main = cards[main] - margin[main] - shared - kv - scratch
    tensors = [TensorPlace(n, dev[n]) for n in sorted(lay.sizes) if n not in lay.expert_names and dev[n] != main_dev]
    weights = {i: 0 for i in used}
    host_bytes = sum(lay.sizes[n] for n in lay.sizes if n not in lay.expert_names and dev[n] == "host")
    for n in lay.sizes:
        if n not in lay.expert_names and dev[n].startswith("cuda:") and dev[n] != main_dev:
            weights[int(dev[n][5:])] += lay.sizes[n]
    on = {i: [0] * n_layer for i in used}              # per card, per layer routed experts held

    def card_need(per_card: dict[int, list[int]]) -> tuple[int, int]:
        """(main card's expert + staging bytes, the staging) for these counts (no flags)."""
        host_layers = [n_exp - sum(per_card[i][l] for i in used) for l in range(n_layer)]
        stage = _staging(lay, host_layers)
        return sum(k * b for k, b in zip(per_card[main], lay.expert_bytes)) + stage, stage

    if ask.explicit:
        case = "flags"
        host_layer = [0] * n_layer
        for layer, names in enumerate(lay.experts):
            devs = {dev[n] for n in names}
            for n in names:
                if dev[n] == "host":
                    host_layer[layer] += lay.sizes[n]
                    host_bytes += lay.sizes[n]
                else:
                    weights[int(dev[n][5:])] += lay.sizes[n]
                if dev[n] != main_dev:
                    tensors.append(TensorPlace(n, dev[n]))
            if len(devs) == 1 and (d := devs.pop()) != "host":
                on[int(d[5:])][layer] = n_exp
        stage = max(host_layer, default=0) + (max(lay.expert_bytes, default=0) if any(host_layer) else 0)
        if any(host_layer):
            scratch, host_pass = scratch_host, True
        why = [next((flagged[n][1] for n in names if n in flagged), "on the main card") for names in lay.experts]
    else:
        case, why = "whole", ["the model fits the card"] * n_layer
        on[main] = [n_exp] * n_layer
        if card_need(on)[0] > room_main and fit_experts and n_exp and ask.fit:
            case = "budget"
            room_main += scratch - scratch_host
            scratch, host_pass = scratch_host, True
            on = _budget(lay, cards, ask, main, used, room_main, margin, card_need)
            why = ["budget: every expert fits" if sum(on[i][l] for i in used) == n_exp else
                   "budget: what the card bytes hold, spread evenly" for l in range(n_layer)]
        stage = card_need(on)[1]
        for layer, names in enumerate(lay.experts):
            first = 0
            for i in used:
                k = on[i][layer]
                weights[i] += k * lay.expert_bytes[layer]
                if i != main and k:
                    tensors += [TensorPlace(n, f"cuda:{i}", first, first + k) for n in names]
                first += k
            if first < n_exp:         # the host holds every expert of the layer (the residency's home)
                tensors += [TensorPlace(n, "host", first, n_exp) for n in names]
                host_bytes += n_exp * lay.expert_bytes[layer]
    devices = [DeviceNeed("host", host_avail, Terms(weights=host_bytes, margin=host_reserve))]
    for i, free in enumerate(cards):
        if i not in on or (i != main and not weights[i]):     # a card the plan leaves empty
            devices.append(DeviceNeed(f"cuda:{i}", free, Terms()))
            continue
        is_main = i == main
        t = Terms(weights=weights[i] + (shared if is_main else 0), kv=kv if is_main else 0,
                  scratch=scratch if is_main else 0, pinned=stage if is_main else 0, margin=margin[i])
        devices.append(DeviceNeed(f"cuda:{i}", free, t, tuple(on[i])))
    short = [f"{d.device} needs {d.terms.total} bytes ({_terms_words(d)}), {d.available} "
             f"{'available' if d.device == 'host' else 'free'}" for d in devices if d.terms.total > d.available]
    if short:
        what = {"whole": "the whole model on the card", "budget": "routed experts moved to the host by the budget",
                "flags": "the placement flags' rules"}[case]
        hint = "; -fit off keeps every expert on the card" if case == "whole" and not ask.fit else ""
        raise OffloadError(f"{what} does not fit: " + "; ".join(short) + hint)
    total_on = tuple(sum(on[i][l] for i in on) for l in range(n_layer))
    return Result(case, main, tuple(devices), tuple(tensors), total_on, tuple(why), host_pass)


def _budget(lay, cards, ask, main, used, room_main, margin, card_need) -> dict[int, list[int]]:
    """Per card, per layer, the routed experts each card holds: the main card first, as many as its room
    (with the staging the rest needs) holds, then the other cards in the -ts shares (default: their room)."""
    n_layer, n_exp = lay.n_layer, lay.n_expert
    on = {i: [0] * n_layer for i in used}
    top = n_layer * n_exp
    lo, hi = 0, top                              # the most whose expert bytes alone fit (monotone)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        on[main] = _spread(mid, n_layer, n_exp)
        lo, hi = (mid, hi) if card_need(on)[0] - card_need(on)[1] <= room_main else (lo, mid - 1)
    best = 0
    for total in range(lo, -1, -1):              # then down until the staging the rest needs fits too
        on[main] = _spread(total, n_layer, n_exp)
        if card_need(on)[0] <= room_main:
            best = total
            break
    on[main] = _spread(best, n_layer, n_exp)
    others = [i for i in used if i != main]
    if not others or best == top:
        return on
    left = top - best
    room = {i: cards[i] - margin[i] for i in others}
    shares = {i: (ask.tensor_split[i] if ask.tensor_split else room[i]) for i in others}
    weight = sum(shares.values()) or 1
    for i in others:                            # each card's share of what is left, cut to what it holds
        per = max(sum(lay.expert_bytes) // n_layer, 1)
        want = min(int(left * shares[i] / weight), room[i] // per)
        while want > 0:
            counts = [min(k, n_exp - sum(on[j][l] for j in used if j != i))
                      for l, k in enumerate(_spread(want, n_layer, n_exp))]
            on[i] = counts
            if sum(k * b for k, b in zip(counts, lay.expert_bytes)) <= room[i]:
                break
            want -= max(1, want // 64)
        else:
            on[i] = [0] * n_layer
    return on


def _terms_words(d: DeviceNeed) -> str:
    t = d.terms
    kept = "reserve" if d.device == "host" else "margin"
    parts = [("weights", t.weights), ("decoded", t.decoded), ("kv", t.kv), ("scratch", t.scratch),
             ("pinned staging", t.pinned), (kept, t.margin)]
    return " + ".join(f"{k} {v}" for k, v in parts if v or k in ("weights", kept))
