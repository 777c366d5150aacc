"""The Placement: where a start puts the model and what each device holds, in bytes by term.

bloomery.plan makes it (make_plan), the plan stage sends it inside PlanDone (a typed message,
checked field by field by messages/codec.py), the supervisor hands it to the engine stage, and
bloomery.engine.loader.load_model(gguf, placement, backend) carries it out. `--plan` prints it
and the need hook's record is read from it.

bloomery/offload.py decides where each tensor of a CUDA start lives (case "whole", "budget" or
"flags"): a TensorPlace per tensor (or stacked expert slice) away from `default_device`, per-layer
counts of routed experts on a card in `experts_on_card` (and per card in DeviceNeed.experts), and
one DeviceNeed per card, each with its own terms. The engine loads only placements with no
TensorPlace yet (every tensor on one device); any other is refused by name at load start.
"""
from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30


@dataclass(frozen=True)
class Terms:
    """Bytes one device holds, by what they are for."""
    weights: int = 0        # the stored tensors placed here, as stored
    decoded: int = 0        # the backend's decoded forms of them (numpy: int rows, planes, dense copies)
    kv: int = 0             # the KV cache of every slot, as the backend allocates it
    scratch: int = 0        # the peak of a prompt pass or decode step (transient: not held between requests)
    pinned: int = 0         # staging buffers for host experts streamed to a card (host: pinned; card: receive)
    margin: int = 0         # kept free on a card, or reserved on the host (interpreter, tables, sockets)
    # the host: the prompt cache's budget (-cram), filled by saved slot states as requests come; counted
    # beside the load's need (total), as the need record carries it beside bytes
    prompt_cache: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.decoded + self.kv + self.scratch + self.pinned + self.margin

    @property
    def held(self) -> int:
        """What stays allocated after the load: every term but the transient scratch and the margin."""
        return self.weights + self.decoded + self.kv + self.pinned


@dataclass(frozen=True)
class DeviceNeed:
    device: str             # "host", "cuda:0", ...
    available: int          # what the census saw free there (0: not counted)
    terms: Terms
    experts: tuple[int, ...] = ()   # a card: per layer, the routed experts it holds (empty: not counted)


@dataclass(frozen=True)
class TensorPlace:
    """One tensor (or a slice of a stacked expert tensor) away from the default device."""
    name: str
    device: str
    first: int = 0          # a stacked expert tensor: experts first .. stop-1 (stop 0: the whole tensor)
    stop: int = 0


@dataclass(frozen=True)
class Placement:
    backend: str                            # "numpy" or "cuda"
    n_slots: int
    n_ctx_slot: int
    default_device: str                     # where every tensor not in `tensors` lives
    kv_type: str = "f16"                    # the KV cache's element type on every backend
    devices: tuple[DeviceNeed, ...] = ()    # what each device holds (empty: an unplanned load, tests and tools)
    tensors: tuple[TensorPlace, ...] = ()   # per-tensor exceptions to default_device (the offload tier's)
    experts_on_card: tuple[int, ...] = ()   # per layer, routed experts on any card (the offload tier's)
    case: str = "whole"                     # how the plan placed it: whole, budget, flags (bloomery/offload.py)
    layer_why: tuple[str, ...] = ()         # per layer, why its routed experts sit where they do
    n_expert: int = 0                       # routed experts per layer (0: a dense model)
    n_ubatch: int = 0                       # prompt rows per pass the plan counted (0: the backend's own)

    @property
    def off_card(self) -> bool:
        """Some tensor (or expert slice) lives away from the main device: the offload tier's work."""
        return bool(self.tensors)

    @property
    def n_ctx(self) -> int:
        return self.n_slots * self.n_ctx_slot

    def summary(self) -> str:
        """One sentence of what this placement would have been (the refusal of a load that cannot carry it out)."""
        held = [f"{d.device} {gib(d.terms.total)}" for d in self.devices if d.terms.total]
        away = sorted({t.device for t in self.tensors})
        experts = sum(self.experts_on_card)
        routed = (f"; {experts} of {self.n_expert * len(self.experts_on_card)} routed experts on a card"
                  if self.n_expert else "")
        return (f"the plan placed it \"{self.case}\" with {len(self.tensors)} tensor(s) or expert slices on "
                f"{', '.join(away) or self.default_device}, away from {self.default_device}{routed} "
                f"(needs: {', '.join(held)}); the engine computes every tensor on one device in this build")

    def device(self, name: str) -> DeviceNeed | None:
        return next((d for d in self.devices if d.device == name), None)

    def need(self) -> tuple[int, list[int]]:
        """(host bytes, bytes per card in census order) to ask a broker for: the host counts its
        reserve (the process uses it), a card's margin is kept free and not asked for."""
        host = self.device("host")
        cards = [d.terms.total - d.terms.margin for d in self.devices if d.device.startswith("cuda:")]
        return (host.terms.total if host else 0), cards


def whole(backend: str, n_slots: int = 1, n_ctx_slot: int = 4096) -> Placement:
    """An unplanned placement: the whole model on the backend's one device (tests, tools)."""
    return Placement(backend, n_slots, n_ctx_slot, "host" if backend == "numpy" else "cuda:0")


def gib(n: int) -> str:
    """Bytes as GiB for people: 2 decimals, 3 below 0.1 GiB."""
    g = n / GIB
    return f"{g:.3f} GiB" if g < 0.1 else f"{g:.2f} GiB"
