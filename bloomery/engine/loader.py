"""load_model(path, backend, n_slots, n_ctx_slot) -> Model: the backend's ops, the file, and
the architecture's class from the registry (models/registry.py)."""
from __future__ import annotations

from bloomery.engine.models.base import CausalLM, ModelError
from bloomery.engine.models.registry import ARCHS, model_class
from bloomery.engine.ops import Ops
from bloomery.gguf_file import open_gguf


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


def load_model(path: str, backend: str = "numpy", n_slots: int = 1, n_ctx_slot: int = 4096) -> CausalLM:
    ops = make_ops(backend)
    gf = open_gguf(str(path))
    arch = gf.arch()
    if arch not in ARCHS:
        gf.close()
        raise ModelError(f"{path}: architecture {arch!r} is not supported: supported are {', '.join(ARCHS)}")
    return model_class(arch)(gf, ops, n_slots, n_ctx_slot)
