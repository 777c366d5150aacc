"""load_model(gguf, placement, backend) -> Model: carries out a Placement (bloomery/placement.py):
the backend's ops, the file, and the architecture's class from the registry
(models/registry.py), with the placement's slots and context."""
from __future__ import annotations

import os
from typing import Callable

from bloomery.engine.models.base import CausalLM, ModelError
from bloomery.engine.models.registry import ARCHS, model_class
from bloomery.engine.ops import Ops
from bloomery.gguf_file import GGUFFile, open_gguf
from bloomery.placement import Placement


def make_ops(backend: str) -> Ops:
    if backend == "numpy":
        from bloomery.engine.cpu.backend import NumpyOps
        return NumpyOps()
    if backend == "cuda":
        try:
            from bloomery.engine.cuda.backend import CudaOps
        except ImportError as e:
            raise ModelError(f"backend 'cuda' needs CuPy (pip install bloomery[cuda13] or [cuda12]): {e}") from None
        _sync_flags()
        return CudaOps()
    raise ModelError(f"backend {backend!r} is not available: choose 'numpy' or 'cuda'")


SYNC_FLAGS = {"auto": 0, "spin": 1, "yield": 2, "blocking": 4}     # cudaDeviceSchedule*


def _sync_flags() -> None:
    """BLOOMERY_CUDA_SYNC=spin|yield|blocking: how this process's thread waits on the card (CUDA's
    default, auto, spins while there are more cores than contexts). A thread that spins holds a core
    the offload tier's host workers could use; blocking frees it at some wake-up latency. Set before
    the process's first CUDA call; a later one is refused by the driver and named here."""
    choice = os.environ.get("BLOOMERY_CUDA_SYNC", "auto").strip().lower()
    if choice not in SYNC_FLAGS:
        raise ModelError(f"BLOOMERY_CUDA_SYNC={choice!r}: choose one of {', '.join(SYNC_FLAGS)}")
    if choice == "auto":
        return
    import cupy
    set_flags = getattr(cupy.cuda.runtime, "setDeviceFlags", None)
    if set_flags is None:          # CuPy 14 does not wrap cudaSetDeviceFlags (seen on the H200 host, run O)
        raise ModelError(f"BLOOMERY_CUDA_SYNC={choice}: this CuPy ({cupy.__version__}) cannot set the card's wait mode "
                         f"(its runtime module has no setDeviceFlags); leave BLOOMERY_CUDA_SYNC unset")
    try:
        set_flags(SYNC_FLAGS[choice])
    except cupy.cuda.runtime.CUDARuntimeError as e:
        raise ModelError(f"BLOOMERY_CUDA_SYNC={choice}: the card's wait mode could not be set ({e}); it must be "
                         f"set before this process's first CUDA call") from None


def host_experts(placement: Placement) -> dict[str, tuple[int, int]]:
    """The routed expert slices the placement keeps in host RAM: tensor name -> (first, stop) experts.
    What this build cannot carry out is refused by name: a whole tensor on the host (-ot naming a
    non-expert tensor), a tensor on a second card, host experts on a backend other than cuda."""
    host, other = {}, []
    for t in placement.tensors:
        if t.device == "host" and (t.stop > t.first or t.name.endswith("_exps.weight")):
            host[t.name] = (t.first, t.stop or placement.n_expert)
        else:
            other.append(t)
    if other:
        what = ", ".join(f"{t.name} on {t.device}" for t in other[:3]) + (" ..." if len(other) > 3 else "")
        raise ModelError(f"this build runs only routed experts away from {placement.default_device} "
                         f"(on the host); the placement also puts {what}: {placement.summary()}")
    layers: dict[str, set] = {}
    for name, rng in host.items():
        layers.setdefault(name.rsplit(".ffn_", 1)[0], set()).add((name.rsplit("_exps", 1)[0].rsplit("_", 1)[-1], rng))
    for layer, got in sorted(layers.items()):
        if {r for _, r in got} != {next(iter(got))[1]} or len(got) != 3:
            raise ModelError(f"layer {layer}: its gate, up and down experts must sit together (the host computes an "
                             f"expert whole); the placement puts {', '.join(sorted(f'{k} {r}' for k, r in got))} "
                             f"on the host")
    if host and placement.backend != "cuda":
        raise ModelError(f"host experts are the cuda backend's offload tier; the {placement.backend} backend "
                         f"holds every tensor on the host already")
    return host


def residency_on(placement: Placement) -> bool:
    """Adaptive residency: on under the automatic placement ("budget"), off for placement flags
    (a fixed placement, repeatable tokens) or with BLOOMERY_RESIDENCY=off."""
    env = os.environ.get("BLOOMERY_RESIDENCY", "on").strip().lower()
    return placement.case == "budget" and env not in ("off", "0", "false", "no")


def load_model(gguf: "str | GGUFFile", placement: Placement, backend: Ops | None = None,
               progress: Callable[[int, int], None] | None = None, threads: int = 0) -> CausalLM:
    """The model of `gguf` (a path or an open file) placed as `placement` says, on `backend`
    (default: the ops of placement.backend). Routed experts the placement keeps on the host run
    through the backend's offload tier (cuda: engine/cuda/experts.py) with `threads` host threads
    (-t; 0: every core); what this build cannot carry out is refused by name (host_experts).
    `progress(done, total)` is called with the stored bytes handed to the backend after each
    tensor, and once at the end with done == total (the file's tensors the architecture does not
    read count as done)."""
    away = host_experts(placement)
    ops = backend if backend is not None else make_ops(placement.backend)
    if away:
        ops.offload_experts(residency=residency_on(placement), threads=threads)
    gf = gguf if isinstance(gguf, GGUFFile) else open_gguf(str(gguf))
    arch = gf.arch()
    if arch not in ARCHS:
        gf.close()
        raise ModelError(f"{gf.path}: architecture {arch!r} is not supported: supported are {', '.join(ARCHS)}")
    with ops.loading():
        model = model_class(arch)(gf, ops, placement.n_slots, placement.n_ctx_slot, progress, away)
    if placement.n_ubatch:              # the plan counted shorter prompt passes (experts on the host)
        model.n_ubatch = min(model.n_ubatch, placement.n_ubatch)
    if progress is not None:
        progress(model.bytes_total, model.bytes_total)
    return model
