"""What the numpy backend holds beside the stored blocks: the decoded form each weight gets
(the numpy kernels' planes and their kernel-order layouts, or a float32 copy; none where the
compiled kernels read the stored blocks in place), counted for the plan before any weight is read.

The count is not a formula kept beside the backend: for each (type, row length, use) it builds
the forms of a few rows of zero blocks through NumpyOps itself, the way a load and its first
requests do, and scales the bytes by the tensor's rows (every form is row-major over the
weight's rows). So a change of the backend's choices changes the count with it.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

# how a tensor is used, by its GGUF name; the model files' names (models/layers.py)
EMBED, HEAD, VEC, MATRIX, EXPERTS = "embed", "head", "vec", "matrix", "experts"


def use_of(name: str, shape: tuple[int, ...], tied_head: bool) -> str:
    if name == "token_embd.weight":
        return HEAD if tied_head else EMBED          # get_rows decodes the rows it reads, keeps nothing
    if name == "output.weight":
        return HEAD
    if len(shape) == 1:
        return VEC
    return EXPERTS if len(shape) == 3 else MATRIX


def _root(a: np.ndarray):
    """The object that owns an array's memory (views followed down)."""
    while isinstance(a, np.ndarray) and a.base is not None:
        a = a.base
    return a


def _arrays(obj, seen: set[int]) -> int:
    """Bytes of the numpy arrays a form holds (arrays, tuples, dicts, dataclass fields), each once;
    a view of the stored bytes (an F32 weight read in place) holds nothing of its own."""
    if isinstance(obj, np.ndarray):
        base = _root(obj)
        if id(base) in seen or not isinstance(base, np.ndarray):
            return 0
        seen.add(id(base))
        return base.nbytes
    if isinstance(obj, (list, tuple)):
        return sum(_arrays(o, seen) for o in obj)
    if isinstance(obj, dict):
        return sum(_arrays(o, seen) for o in obj.values())
    if hasattr(obj, "__dataclass_fields__"):
        return sum(_arrays(getattr(obj, f), seen) for f in obj.__dataclass_fields__)
    return 0


def form_bytes(w) -> int:
    """Bytes of the decoded forms a NumpyWeight holds now (its stored bytes not counted)."""
    seen = {id(_root(w.data))}
    return sum(_arrays(getattr(w, attr), seen) for attr in ("_planes", "_dense"))


@lru_cache(maxsize=None)
def bytes_per_row(ggml_type: int, n_cols: int, use: str, rows_in_eights: bool) -> float:
    """Decoded bytes per weight row for this type, row length and use."""
    from bloomery.engine.cpu.backend import NumpyOps, NumpyWeight

    if use in (EMBED,):
        return 0.0
    qt = QT(ggml_type)
    block_elems, block_bytes = GGML_QUANT_SIZES[qt]
    n_rows = 8 if rows_in_eights else 7               # Q4_K's compiled path takes rows in eights only
    if use == VEC:
        n_rows, n_cols = 1, n_cols
    raw = np.zeros(n_rows * (n_cols // block_elems) * block_bytes, np.uint8)
    ops = NumpyOps()
    w = NumpyWeight(ggml_type, (n_cols, n_rows), raw)
    if use == VEC:
        ops.rms_norm(np.ones((1, n_cols), np.float32), w, 1e-6)
        return float(form_bytes(w))
    for t in (1, 8):                                   # a decode step's rows and a prompt pass's
        x = np.ones((t, n_cols), np.float32)
        if use == EXPERTS:
            ops._expert_matmul(x, w)
        else:
            ops.matmul(x, w)
    if use == HEAD:
        x = np.ones((1, n_cols), np.float32)
        ops.matmul_argmax(x, w)
        ops.matmul_topk(x, w, min(n_rows, ops.topk_max(n_rows)))
    return form_bytes(w) / n_rows


def decoded_bytes(tensors) -> int:
    """The decoded forms of a whole file's tensors: (name, ggml type, GGUF shape) triples."""
    tensors = list(tensors)
    tied = not any(name == "output.weight" for name, _, _ in tensors)
    total = 0.0
    for name, ggml_type, shape in tensors:
        shape = tuple(int(s) for s in shape)
        use = use_of(name, shape, tied)
        if use == VEC:
            total += bytes_per_row(ggml_type, shape[0], VEC, False)
            continue
        n_rows = shape[1] if len(shape) > 1 else 1
        n_stack = shape[2] if len(shape) > 2 else 1
        total += bytes_per_row(ggml_type, shape[0], use, n_rows % 8 == 0) * n_rows * n_stack
    return int(round(total))
