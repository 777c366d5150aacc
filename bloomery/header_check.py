"""Is a GGUF header one this server can load? Checked at plan time, before any allocation.

Pure functions over the parsed header (metadata dict and tensor table, no tensor data):
every hyperparameter the plan and the engine read is present, an integer or a finite
number, and in range; every tensor the architecture declares is present with the
shape its hyperparameters imply and a type whose blocks divide its rows; every string
is UTF-8. The first problem is a HeaderError naming the key or tensor, the value and
the bound; the plan stage refuses the start with it (exit 1, no restart).

The tensor names come from the architecture files' own declarations
(bloomery/engine/models/*.py: TOKEN_EMBD, OUTPUT_NORM, OUTPUT, LAYER, OPTIONAL); the
shapes are llama.cpp's (src/llama-model.cpp and src/models/*.cpp, create_tensor for qwen2,
qwen3, qwen3moe, qwen35, qwen35moe), in ne order. A hybrid architecture's file declares two
layer maps, LAYER (full attention) and RECURRENT_LAYER (linear attention); its `ssm.*` sizes
must agree with each other.
"""
from __future__ import annotations

import math
from typing import Mapping

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from bloomery.engine.models.registry import ARCHS
from bloomery.gguf_file import StringArray

MAX_LAYERS = 512                 # llama.cpp's LLAMA_MAX_LAYERS
MAX_EMBD = 1 << 17
MAX_HEADS = 1 << 12
MAX_HEAD_DIM = 1 << 12
MAX_FF = 1 << 20
MAX_EXPERTS = 1 << 12            # llama.cpp's LLAMA_MAX_EXPERTS is 512; a margin for what comes
MAX_CTX = 1 << 24
MAX_VOCAB = 1 << 22
VECTOR_TYPES = ("F32", "F16", "BF16")   # norms and biases


class HeaderError(ValueError):
    """The header cannot be served; the message names what and why."""


def check_header(path: str, metadata: Mapping[str, object], tensors: Mapping[str, object]) -> None:
    """Raises HeaderError for the first problem found; returns None for a header the plan may use."""
    check_strings(path, metadata, tensors)
    arch = metadata.get("general.architecture")
    if arch not in ARCHS:
        return                      # the seat check names an architecture without a seat
    hp = hyperparameters(path, arch, metadata, tensors)
    for name, shape, optional in expected_tensors(arch, hp):
        info = tensors.get(name)
        if info is None:
            if optional:
                continue
            raise HeaderError(f"{path}: tensor {name!r} is missing ({arch} with block_count {hp['n_layer']} "
                              "declares it)")
        check_tensor(path, info, shape)


def check_strings(path: str, metadata: Mapping[str, object], tensors: Mapping[str, object]) -> None:
    """Every metadata string (array items included) and tensor name is UTF-8 (the reader kept bad bytes as
    surrogate escapes)."""
    for key, value in metadata.items():
        _utf8(path, "metadata key", key, key)
        if isinstance(value, str):
            _utf8(path, f"metadata {key!r}", value, key)
        elif (not value.all_utf8()) if isinstance(value, StringArray) else \
                (isinstance(value, list) and value and isinstance(value[0], str) and not _all_utf8(value)):
            for i, item in enumerate(value):
                if isinstance(item, str):
                    _utf8(path, f"metadata {key!r}[{i}]", item, key)
    for name in tensors:
        _utf8(path, "tensor name", name, name)


def _all_utf8(items: list) -> bool:
    """One encode over the whole array (a vocabulary is 150,000 strings); the slow walk only on a failure."""
    try:
        try:
            joined = "".join(items)        # a list of str (every vocabulary): no per-item test
        except TypeError:
            joined = "".join(x for x in items if isinstance(x, str))
        joined.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _utf8(path: str, what: str, text: str, key: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise HeaderError(f"{path}: {what} is not valid UTF-8 (byte 0x{ord(text[e.start]) & 0xFF:02x} at "
                          f"character {e.start}); GGUF strings are UTF-8") from None


def _int(path: str, md: Mapping[str, object], key: str, lo: int, hi: int, default: int | None = None) -> int:
    v = md.get(key, default)
    if v is None:
        raise HeaderError(f"{path}: metadata key {key!r} is missing")
    if isinstance(v, bool) or not isinstance(v, int):
        raise HeaderError(f"{path}: metadata {key!r} = {v!r} must be an integer")
    if not lo <= v <= hi:
        raise HeaderError(f"{path}: metadata {key!r} = {v} is outside {lo}..{hi}")
    return v


def _float(path: str, md: Mapping[str, object], key: str, lo: float, hi: float, default: float | None = None) -> float:
    v = md.get(key, default)
    if v is None:
        raise HeaderError(f"{path}: metadata key {key!r} is missing")
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise HeaderError(f"{path}: metadata {key!r} = {v!r} must be a number")
    if not math.isfinite(v) or not lo < v <= hi:
        raise HeaderError(f"{path}: metadata {key!r} = {v} must be finite and in ({lo:g}, {hi:g}]")
    return float(v)


def hyperparameters(path: str, arch: str, md: Mapping[str, object], tensors: Mapping[str, object]) -> dict:
    """The hyperparameters the plan and the engine read, each checked for presence, type and range."""
    p = f"{arch}."
    n_layer = _int(path, md, p + "block_count", 1, MAX_LAYERS)
    n_embd = _int(path, md, p + "embedding_length", 1, MAX_EMBD)
    n_head = _int(path, md, p + "attention.head_count", 1, MAX_HEADS)
    kv = md.get(p + "attention.head_count_kv", n_head)
    if isinstance(kv, list):
        if len(kv) != n_layer or len(set(kv)) != 1:
            raise HeaderError(f"{path}: metadata {p}attention.head_count_kv per layer ({len(kv)} entries) is not "
                              f"served; one count for all {n_layer} layers is")
        kv = kv[0]
    n_head_kv = _int(path, {p + "attention.head_count_kv": kv}, p + "attention.head_count_kv", 1, n_head)
    if n_head % n_head_kv:
        raise HeaderError(f"{path}: metadata {p}attention.head_count {n_head} is not a multiple of "
                          f"head_count_kv {n_head_kv}")
    default_dim = n_embd // n_head if n_embd % n_head == 0 else None
    dk = _int(path, md, p + "attention.key_length", 1, MAX_HEAD_DIM, default_dim)
    dv = _int(path, md, p + "attention.value_length", 1, MAX_HEAD_DIM, dk)
    n_rot = _int(path, md, p + "rope.dimension_count", 2, dk, dk)
    if n_rot % 2:
        raise HeaderError(f"{path}: metadata {p}rope.dimension_count = {n_rot} must be even")
    _int(path, md, p + "context_length", 1, MAX_CTX)
    _float(path, md, p + "attention.layer_norm_rms_epsilon", 0.0, 1.0)
    _float(path, md, p + "rope.freq_base", 0.0, 1e12, 10000.0)
    for key, value in md.items():      # any other number of the architecture: finite
        if key.startswith(p) and isinstance(value, float) and not math.isfinite(value):
            raise HeaderError(f"{path}: metadata {key!r} = {value} must be finite")
    tokens = md.get("tokenizer.ggml.tokens")
    n_vocab = len(tokens) if isinstance(tokens, (list, StringArray)) else _int(path, md, p + "vocab_size", 1, MAX_VOCAB)
    if not 1 <= n_vocab <= MAX_VOCAB:
        raise HeaderError(f"{path}: the vocabulary has {n_vocab} tokens, outside 1..{MAX_VOCAB}")
    hp = dict(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv, dk=dk, dv=dv, n_vocab=n_vocab)
    if arch in ("qwen3moe", "qwen35moe"):
        hp["n_expert"] = _int(path, md, p + "expert_count", 1, MAX_EXPERTS)
        _int(path, md, p + "expert_used_count", 1, hp["n_expert"])
        hp["n_ff_exp"] = _int(path, md, p + "expert_feed_forward_length", 1, MAX_FF)
    else:
        hp["n_ff"] = _int(path, md, p + "feed_forward_length", 1, MAX_FF)
    if _recurrent_map(arch) is not None:
        hp |= _hybrid(path, arch, md, hp)
    return hp


def _hybrid(path: str, arch: str, md: Mapping[str, object], hp: dict) -> dict:
    """A hybrid file's linear-attention sizes, checked against each other, and which of its trunk
    layers are recurrent (the MTP layers past the trunk are not read)."""
    from bloomery.engine.models.base import ModelError
    from bloomery.engine.models.layers import DeltaNetParams, recurrent_layers
    p = f"{arch}."
    if hp["dk"] != hp["dv"]:
        raise HeaderError(f"{path}: metadata {p}attention.value_length {hp['dv']} differs from key_length {hp['dk']}; "
                          f"{arch} needs them equal")
    n_mtp = _int(path, md, p + "nextn_predict_layers", 0, hp["n_layer"] - 1, 0)
    n_trunk = hp["n_layer"] - n_mtp
    dn = DeltaNetParams(*(_int(path, md, f"{p}ssm.{k}", 1, MAX_FF) for k in
                          ("conv_kernel", "state_size", "group_count", "time_step_rank", "inner_size")))
    problem = dn.problem()
    if problem:
        raise HeaderError(f"{path}: inconsistent SSM sizes: {problem}")
    sections = md.get(p + "rope.dimension_sections")
    if (not isinstance(sections, list) or len(sections) < 4 or not all(isinstance(v, int) and v >= 0 for v in sections)
            or not 1 <= sum(sections[:4]) <= hp["dk"] // 2):
        raise HeaderError(f"{path}: metadata {p}rope.dimension_sections = {sections!r} must hold 4 section sizes "
                          f"summing to 1..{hp['dk'] // 2} (half the head size)")
    if p + "rope.dimension_count" not in md:
        raise HeaderError(f"{path}: metadata key {p + 'rope.dimension_count'!r} is missing ({arch} rotates part of each head)")
    try:
        recurrent = recurrent_layers(md.get, arch, n_trunk)
    except ModelError as e:
        raise HeaderError(f"{path}: {e}") from None
    if arch == "qwen35moe":
        hp["n_ff_shexp"] = _int(path, md, p + "expert_shared_feed_forward_length", 1, MAX_FF,
                                md.get(p + "feed_forward_length"))
    return dict(n_trunk=n_trunk, recurrent=recurrent, dn=dn)


def _declared(arch: str):
    """(TOKEN_EMBD, OUTPUT_NORM, OUTPUT, LAYER, OPTIONAL) as the model files declare them: the shared
    ones in models/base.py, the layer's in the architecture's own file (found through the registry)."""
    import sys

    from bloomery.engine.models import base
    from bloomery.engine.models.registry import model_class
    module = sys.modules[model_class(arch).__module__]
    return (base.TOKEN_EMBD, base.OUTPUT_NORM, base.OUTPUT, module.LAYER,
            getattr(module, "OPTIONAL", frozenset()))


def _recurrent_map(arch: str) -> dict | None:
    """A hybrid architecture's linear-attention layer map (RECURRENT_LAYER), None for the others."""
    import sys

    from bloomery.engine.models.registry import model_class
    return getattr(sys.modules[model_class(arch).__module__], "RECURRENT_LAYER", None)


def _layer_shapes(hp: dict) -> dict[str, tuple[int, ...]]:
    """Each LAYER role's shape (ne order) from the hyperparameters."""
    d, q, k, v = hp["n_embd"], hp["n_head"] * hp["dk"], hp["n_head_kv"] * hp["dk"], hp["n_head_kv"] * hp["dv"]
    shapes = {"attn_norm": (d,), "wq": (d, q), "bq": (q,), "wk": (d, k), "bk": (k,), "wv": (d, v), "bv": (v,),
              "wo": (hp["n_head"] * hp["dv"], d), "ffn_norm": (d,), "q_norm": (hp["dk"],), "k_norm": (hp["dk"],)}
    if "n_ff" in hp:
        f = hp["n_ff"]
        shapes |= {"ffn_gate": (d, f), "ffn_up": (d, f), "ffn_down": (f, d)}
    if "n_expert" in hp:
        e, fe = hp["n_expert"], hp["n_ff_exp"]
        shapes |= {"gate_inp": (d, e), "gate_exps": (d, fe, e), "up_exps": (d, fe, e), "down_exps": (fe, d, e)}
    if "n_ff_shexp" in hp:
        fs = hp["n_ff_shexp"]
        shapes |= {"gate_inp_shexp": (d,), "gate_shexp": (d, fs), "up_shexp": (d, fs), "down_shexp": (fs, d)}
    if "dn" in hp:
        dn = hp["dn"]
        shapes |= {"wqg": (d, 2 * q), "wqkv": (d, dn.conv_channels), "wz": (d, dn.d_inner),
                   "conv1d": (dn.d_conv, dn.conv_channels), "dt_bias": (dn.dt_rank,), "ssm_a": (dn.dt_rank,),
                   "ssm_beta": (d, dn.dt_rank), "ssm_alpha": (d, dn.dt_rank), "ssm_norm": (dn.d_state,),
                   "ssm_out": (dn.d_inner, d)}
    return shapes



def expected_tensors(arch: str, hp: dict) -> list[tuple[str, tuple[int, ...], bool]]:
    """(name, shape in ne order, optional) of every tensor the architecture reads."""
    token_embd, output_norm, output, layer, optional = _declared(arch)
    d, n_vocab = hp["n_embd"], hp["n_vocab"]
    out = [(token_embd, (d, n_vocab), False), (output_norm, (d,), False), (output, (d, n_vocab), True)]
    shapes = _layer_shapes(hp)
    recurrent, recurrent_layer = hp.get("recurrent"), _recurrent_map(arch)
    for i in range(hp.get("n_trunk", hp["n_layer"])):
        names = recurrent_layer if recurrent is not None and recurrent[i] else layer
        for role, pattern in names.items():
            out.append((pattern.format(i=i), shapes[role], role in optional))
    return out


def check_tensor(path: str, info, shape: tuple[int, ...]) -> None:
    """A tensor's shape is the expected one and its type is known, with blocks that divide its rows."""
    if tuple(info.shape) != shape:
        raise HeaderError(f"{path}: tensor {info.name!r} has shape {list(info.shape)}, the hyperparameters give "
                          f"{list(shape)}")
    try:
        qt = GGMLQuantizationType(info.ggml_type)
        block_elems, _ = GGML_QUANT_SIZES[qt]
    except (ValueError, KeyError):
        raise HeaderError(f"{path}: tensor {info.name!r} has ggml type {info.ggml_type}, which this server does "
                          "not know") from None
    if len(shape) == 1 and qt.name not in VECTOR_TYPES:
        raise HeaderError(f"{path}: tensor {info.name!r} is {qt.name}; a norm or bias must be one of "
                          f"{', '.join(VECTOR_TYPES)}")
    if shape[0] % block_elems:
        raise HeaderError(f"{path}: tensor {info.name!r} is {qt.name} with rows of {shape[0]}, not a multiple "
                          f"of its block size {block_elems}")
