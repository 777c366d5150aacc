"""load_model(gguf, placement, backend) -> Model: carries out a Placement (bloomery/placement.py):
the backend's ops, the file, and the architecture's class from the registry
(models/registry.py), with the placement's slots and context."""
from __future__ import annotations

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
        return CudaOps()
    raise ModelError(f"backend {backend!r} is not available: choose 'numpy' or 'cuda'")


def load_model(gguf: "str | GGUFFile", placement: Placement, backend: Ops | None = None,
               progress: Callable[[int, int], None] | None = None) -> CausalLM:
    """The model of `gguf` (a path or an open file) placed as `placement` says, on `backend`
    (default: the ops of placement.backend). A placement this load cannot carry out (tensors
    away from the default device: the offload tier) is refused by name. `progress(done, total)`
    is called with the stored bytes handed to the backend after each tensor, and once at the end
    with done == total (the file's tensors the architecture does not read count as done)."""
    if placement.off_card:
        raise ModelError(f"host experts are not served yet: {placement.summary()}")
    ops = backend if backend is not None else make_ops(placement.backend)
    gf = gguf if isinstance(gguf, GGUFFile) else open_gguf(str(gguf))
    arch = gf.arch()
    if arch not in ARCHS:
        gf.close()
        raise ModelError(f"{gf.path}: architecture {arch!r} is not supported: supported are {', '.join(ARCHS)}")
    model = model_class(arch)(gf, ops, placement.n_slots, placement.n_ctx_slot, progress)
    if progress is not None:
        progress(model.bytes_total, model.bytes_total)
    return model
