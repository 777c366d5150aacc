#!/usr/bin/env python3
"""Write a synthetic GGUF (qwen2, qwen3, qwen3moe, qwen35 or qwen35moe) of any shape with random weights.

The tokenizer keys (tokenizer.ggml.*, tokenizer.chat_template) are copied from the
real Qwen2.5 file, so llama.cpp and bloomery load the result as they load an upload.
Tensor names, shapes and keys follow llama.cpp's loader (src/models/qwen2.cpp,
qwen3.cpp, qwen3moe.cpp, qwen35.cpp, qwen35moe.cpp). The qwen35 family is hybrid: of
every --full-attn-interval layers the last is gated full attention, the others Gated
DeltaNet (linear attention with a conv window and a recurrent state, --ssm-* sizes);
qwen35moe adds a shared expert (--n-ff-shexp) beside the routed ones. Two modes:
  float  -- F32 or F16 matrices ~ N(0, 1/sqrt(fan_in)), norms near 1;
  blocks -- quantized blocks written directly (random codes, scale fields set so a
            row's values have std ~ 1/sqrt(fan_in)), tensor by tensor, never a float
            copy of the model. Mix q4_k_m (attn_v / ffn_down Q6_K, other matrices and
            the embedding Q4_K, output Q6_K), q5_k_m (the same with Q5_K for Q4_K) or
            q8_0; norms and the router stay F32. A row whose length is not a multiple
            of 256 takes llama-quantize's fallback (Q4_K -> Q5_0, Q6_K -> Q8_0), as the
            real 0.5B file does; q5_k_m refuses such rows (its fallback, Q5_1, is not a
            type bloomery reads), and --router-skew.

--router-skew SHARE (qwen3moe) makes the running model's routing follow a stated skew: the
busiest fifth of each layer's experts takes about SHARE of the routing (0.2: even).

Usage: tools/make_synthetic.py --arch qwen3moe --n-layer 2 --n-embd 64 ... -o out.gguf
       tools/make_synthetic.py --shape qwen3-30b-a3b [--router-skew 0.6] -o 30b.gguf
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import struct
import sys
from pathlib import Path

import gguf
import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bloomery.gguf_file import open_gguf  # noqa: E402

Q = gguf.GGMLQuantizationType
ARCHS = ("qwen2", "qwen3", "qwen3moe", "qwen35", "qwen35moe")
HYBRID = ("qwen35", "qwen35moe")                                # Gated DeltaNet + gated full attention
MOE = ("qwen3moe", "qwen35moe")
DEFAULTS = dict(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, head_dim=0, n_ff=128, n_expert=4,
                n_expert_used=2, n_ff_exp=64, vocab="full", ctx_train=4096, seed=0, mode="float",
                ftype="f32", mix="q4_k_m",
                # the qwen35 family only: rotated dims (0: a quarter of the head), IMRoPE sections
                # ("": thirds of the rotated pairs), shared expert width, the DeltaNet sizes
                n_rot=0, rope_sections="", n_ff_shexp=64, full_attn_interval=4, ssm_d_conv=4,
                ssm_d_state=16, ssm_n_group=2, ssm_dt_rank=4)
# named shapes (--shape): arch and shape keys; flags given beside --shape override its keys
PRESETS = {
    # Qwen3-30B-A3B at the Q4_K_M mix (19.8 GB): the file of the card benchmarks (docs/performance.md)
    "qwen3-30b-a3b": ("qwen3moe", dict(n_layer=48, n_embd=2048, n_head=32, n_head_kv=4, head_dim=128, n_ff=6144,
                                       n_expert=128, n_expert_used=8, n_ff_exp=768, ctx_train=40960, mode="blocks",
                                       mix="q4_k_m", seed=1)),
    # Qwen3.6-35B-A3B (the Qwen3.5-35B-A3B shape: transformers' Qwen3_5MoeTextConfig defaults): 40 layers,
    # a full-attention layer every 4th, 256 experts of 512 (8 used) and a shared one of 512, attention
    # 16 x 256 over 2 KV heads rotating a quarter (sections 11/11/10), DeltaNet 16 key and 32 value heads
    # of 128. The vocab is the tokenizer's (--tokenizer-from), not the real 248,320.
    "qwen3.6-35b-a3b": ("qwen35moe", dict(n_layer=40, n_embd=2048, n_head=16, n_head_kv=2, head_dim=256, n_ff=512,
                                          n_expert=256, n_expert_used=8, n_ff_exp=512, n_ff_shexp=512,
                                          full_attn_interval=4, ssm_d_conv=4, ssm_d_state=128, ssm_n_group=16,
                                          ssm_dt_rank=32, n_rot=64, rope_sections="11,11,10,0", ctx_train=262144,
                                          mode="blocks", mix="q4_k_m", seed=1)),
}
FILE_TYPE = {"f32": 0, "f16": 1, "q8_0": 7, "q4_k_m": 15, "q5_k_m": 17}      # llama_ftype values
FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q6_K: Q.Q8_0}                    # llama-quantize, rows not /256
# std of one block code as stored (uniform random bits), to set the block scale from
CODE_STD = {Q.Q4_K: 32 * np.sqrt((16**2 - 1) / 12), Q.Q5_K: 32 * np.sqrt((32**2 - 1) / 12),
            Q.Q6_K: 16 * np.sqrt((64**2 - 1) / 12),
            Q.Q5_0: np.sqrt((32**2 - 1) / 12), Q.Q8_0: np.sqrt((256**2 - 1) / 12)}


class ShapeError(ValueError):
    """A flag value that cannot make a model llama.cpp loads; names the flag and the bound."""


def fetch_model_path() -> Path:
    spec = importlib.util.spec_from_file_location("fetch_model", REPO / "tools" / "fetch_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return Path(mod.fetch())


class Packed(bytes):
    """A metadata value already packed as GGUF bytes (array subtype, count, elements)."""


class _Writer(gguf.GGUFWriter):
    # packing the 300k tokenizer strings one by one costs ~1.5 s; they are packed once per process
    def _pack_val(self, val, vtype, add_vtype, sub_type=None):
        if isinstance(val, Packed):
            return (struct.pack("<I", vtype) if add_vtype else b"") + bytes(val)
        return super()._pack_val(val, vtype, add_vtype, sub_type=sub_type)


_NP_CODE = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
            10: "<u8", 11: "<i8", 12: "<f8"}


def _pack_array(vals: list, sub: int) -> Packed:
    head = struct.pack("<IQ", sub, len(vals))
    if sub == gguf.GGUFValueType.STRING:
        raw = [v.encode("utf-8", "surrogateescape") for v in vals]   # keep non-UTF-8 bytes as they were
        return Packed(head + b"".join(struct.pack("<Q", len(b)) + b for b in raw))
    return Packed(head + np.asarray(vals, dtype=_NP_CODE[sub]).tobytes())


@functools.lru_cache(maxsize=2)
def tokenizer_keys(source: str) -> tuple[tuple[str, object, int, int | None, int], ...]:
    """(key, value, type, array subtype, n elements) of every tokenizer.* key of `source`."""
    with open_gguf(source) as g:
        out = []
        for key, val in g.metadata.items():
            if key.startswith("tokenizer."):
                vtype, sub = g.value_types[key]
                n = len(val) if sub is not None else 1
                out.append((key, _pack_array(val, sub) if sub is not None else val, vtype, sub, n))
        return tuple(out)


def tensor_plan(arch: str, s: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, ne shape, role) for every tensor, in llama.cpp's order; role picks the init and type."""
    d, n_vocab = s["n_embd"], s["n_vocab"]
    out = [("token_embd.weight", (d, n_vocab), "embd"), ("output_norm.weight", (d,), "norm"),
           ("output.weight", (d, n_vocab), "output")]
    for i in range(s["n_layer"]):
        b = f"blk.{i}."
        if arch in HYBRID:
            out += _hybrid_mixer(b, i, s)
        else:
            out += _attention(b, arch, s)
        out.append((b + ("post_attention_norm.weight" if arch in HYBRID else "ffn_norm.weight"), (d,), "norm"))
        if arch in MOE:
            e, f = s["n_expert"], s["n_ff_exp"]
            out += [(b + "ffn_gate_inp.weight", (d, e), "router"),
                    (b + "ffn_gate_exps.weight", (d, f, e), "mat"), (b + "ffn_up_exps.weight", (d, f, e), "mat"),
                    (b + "ffn_down_exps.weight", (f, d, e), "mat6")]
        if arch == "qwen35moe":
            f = s["n_ff_shexp"]
            out += [(b + "ffn_gate_inp_shexp.weight", (d,), "router"),
                    (b + "ffn_gate_shexp.weight", (d, f), "mat"), (b + "ffn_up_shexp.weight", (d, f), "mat"),
                    (b + "ffn_down_shexp.weight", (f, d), "mat6")]
        elif arch not in MOE:
            f = s["n_ff"]
            out += [(b + "ffn_gate.weight", (d, f), "mat"), (b + "ffn_up.weight", (d, f), "mat"),
                    (b + "ffn_down.weight", (f, d), "mat6")]
    return out


def _attention(b: str, arch: str, s: dict) -> list[tuple[str, tuple[int, ...], str]]:
    d, hd = s["n_embd"], s["head_dim"]
    q_dim, kv_dim = hd * s["n_head"], hd * s["n_head_kv"]
    out = [(b + "attn_norm.weight", (d,), "norm"), (b + "attn_q.weight", (d, q_dim), "mat"),
           (b + "attn_k.weight", (d, kv_dim), "mat"), (b + "attn_v.weight", (d, kv_dim), "mat6")]
    if arch == "qwen2":
        out += [(b + "attn_q.bias", (q_dim,), "bias"), (b + "attn_k.bias", (kv_dim,), "bias"),
                (b + "attn_v.bias", (kv_dim,), "bias")]
    out.append((b + "attn_output.weight", (q_dim, d), "mat"))
    if arch != "qwen2":
        out += [(b + "attn_q_norm.weight", (hd,), "norm"), (b + "attn_k_norm.weight", (hd,), "norm")]
    return out


def is_full_attention(i: int, s: dict) -> bool:
    """llama.cpp's rule without attention.recurrent_layers: every full_attention_interval-th layer."""
    return (i + 1) % s["full_attn_interval"] == 0


def _hybrid_mixer(b: str, i: int, s: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """A qwen35 layer's mixer: gated full attention (Q twice as wide: each head's query then its
    gate) or Gated DeltaNet (fused QKV through a conv window, the output gate z, beta and the decay)."""
    d, hd = s["n_embd"], s["head_dim"]
    if is_full_attention(i, s):
        q_dim, kv_dim = hd * s["n_head"], hd * s["n_head_kv"]
        return [(b + "attn_norm.weight", (d,), "norm"), (b + "attn_q.weight", (d, 2 * q_dim), "mat"),
                (b + "attn_k.weight", (d, kv_dim), "mat"), (b + "attn_v.weight", (d, kv_dim), "mat6"),
                (b + "attn_output.weight", (q_dim, d), "mat"),
                (b + "attn_q_norm.weight", (hd,), "norm"), (b + "attn_k_norm.weight", (hd,), "norm")]
    key_dim, value_dim = s["ssm_d_state"] * s["ssm_n_group"], s["ssm_d_state"] * s["ssm_dt_rank"]
    h_v = s["ssm_dt_rank"]
    return [(b + "attn_norm.weight", (d,), "norm"), (b + "attn_qkv.weight", (d, 2 * key_dim + value_dim), "mat"),
            (b + "attn_gate.weight", (d, value_dim), "mat"),
            (b + "ssm_conv1d.weight", (s["ssm_d_conv"], 2 * key_dim + value_dim), "conv"),
            (b + "ssm_dt.bias", (h_v,), "bias"), (b + "ssm_a", (h_v,), "decay"),
            (b + "ssm_beta.weight", (d, h_v), "router"), (b + "ssm_alpha.weight", (d, h_v), "router"),
            (b + "ssm_norm.weight", (s["ssm_d_state"],), "norm"), (b + "ssm_out.weight", (value_dim, d), "mat")]


def ggml_type_for(role: str, ne0: int, s: dict) -> int:
    if role in ("norm", "bias", "router", "conv", "decay"):
        return Q.F32
    if s["mode"] == "float":
        return Q.F16 if s["ftype"] == "f16" else Q.F32
    if s["mix"] == "q8_0":
        return Q.Q8_0
    qt = Q.Q6_K if role in ("mat6", "output") else Q.Q5_K if s["mix"] == "q5_k_m" else Q.Q4_K
    if ne0 % 256 and qt == Q.Q5_K:
        raise ShapeError(f"--mix q5_k_m: rows of {ne0} are not a multiple of 256 (llama-quantize's fallback "
                         f"for Q5_K, Q5_1, is not a type bloomery reads)")
    return qt if ne0 % 256 == 0 else FALLBACK[qt]


def float_values(role: str, ne: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    shape = ne[::-1]                                       # numpy order: rows last-dim first
    if role == "norm":
        return (1.0 + 0.1 * rng.standard_normal(shape, np.float32)).astype(np.float32)
    if role == "bias":
        return (0.1 * rng.standard_normal(shape, np.float32)).astype(np.float32)
    if role == "decay":     # ssm_a = -exp(A_log): negative, so each step's decay exp(g) is below 1
        return (-np.exp(rng.uniform(-1.0, 1.0, shape))).astype(np.float32)
    return rng.standard_normal(shape, np.float32) * np.float32(1 / np.sqrt(ne[0]))   # fan_in = ne[0]


def block_bytes(qt: int, ne: tuple[int, ...], rng: np.random.Generator, std: float | None = None) -> np.ndarray:
    """Random codes; each block's scale fields set so values have std `std` (default
    1/sqrt(ne[0])), mean ~0."""
    block, type_size = gguf.GGML_QUANT_SIZES[Q(qt)]
    n_blocks = int(np.prod(ne)) // block
    raw = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)   # [B, type_size]
    d = np.float16((1 / np.sqrt(ne[0]) if std is None else std) / CODE_STD[qt])
    if qt in (Q.Q4_K, Q.Q5_K):   # d, dmin, 12 packed 6-bit scales/mins (all 32), (32 high bits,) the nibbles
        raw[:, 0:2] = np.frombuffer(d.tobytes(), np.uint8)
        centre = 7.5 if qt == Q.Q4_K else 15.5                                  # the codes' mean
        raw[:, 2:4] = np.frombuffer(np.float16(centre * d).tobytes(), np.uint8)
        raw[:, 4:12] = 0xA0
        raw[:, 12:16] = 0x00
    elif qt == Q.Q6_K:    # 128 low nibbles, 64 high pairs, 16 int8 scales, d
        raw[:, 192:208] = 16
        raw[:, 208:210] = np.frombuffer(d.tobytes(), np.uint8)
    else:                 # Q5_0 and Q8_0 both start with d
        raw[:, 0:2] = np.frombuffer(d.tobytes(), np.uint8)
    return raw.reshape(-1)                                                    # [B * type_size]


# --- --router-skew: routing that follows a stated skew in the running model ---------------------
#
# With today's weights the layers' outputs soon outweigh the token embedding (whose rows have norm
# ~1), and what they add is largely the same for every token (attention averages the values of
# many positions), so the routers see nearly the same vector for every token and a few experts take
# most of the routing, by accident (the busiest fifth took 0.978 of the picks on a file of the
# qwen3-30b-a3b shape, down to 17 of 128 experts picked in a layer; docs/performance.md). A file
# written with --router-skew SHARE is built so routing follows SHARE instead:
#   * the token embedding's elements have std SKEW_EMBD_STD (not 1/sqrt(n_embd)), so each token's
#     own row outweighs what 48 layers add and every token routes on its own vector;
#   * the first SKEW_CHANNEL coordinates of every embedding row hold one constant (the same codes
#     in every row): a persistent component of the residual stream, the same for every token;
#   * each layer's router row e is random (std 1/sqrt(n_embd)) on the other coordinates, and
#     reads the constant ones with a weight that adds beta_e times the spread of the random part
#     to expert e's logit; beta follows a Zipf-like profile over a random order of the experts
#     (beta of rank r = -s * ln(r + 1)), s set by simulation (top-k of beta + N(0, 1) per token)
#     so the busiest fifth of the experts takes SHARE of the routing (bloomery/routing_skew.py).
# SHARE 0.2 is even routing (s = 0). Only the embedding and the routers differ from a file written
# without the option: same tensors, types and sizes, so the two cost the same to run.
SKEW_EMBD_STD = 4.0
SKEW_CHANNEL = 32
SKEW_SIM_TOKENS = 16384


def skew_scale(n_expert: int, n_used: int, share: float, seed: int = 0) -> float:
    """The profile scale s at which the top fifth of the experts takes `share` of the routing,
    by bisection over a simulation (the same normal draws at every s); a share the profile
    cannot reach with n_expert / n_used is a ShapeError naming the bound."""
    from bloomery.routing_skew import TOP, top_share
    even = TOP                              # the share of even routing: the fraction itself
    if share < even or share >= 1:
        raise ShapeError(f"--router-skew {share}: the top fifth's share must be in [{even:.2f}, 1)")
    if share == even:
        return 0.0
    z = np.random.default_rng(seed).standard_normal((SKEW_SIM_TOKENS, n_expert)).astype(np.float32)
    base = -np.log1p(np.arange(n_expert, dtype=np.float32))

    def measured(s: float) -> float:
        top = np.argpartition(-(z + np.float32(s) * base), n_used - 1, axis=1)[:, :n_used]
        return top_share(np.bincount(top.ravel(), minlength=n_expert))
    lo, hi = 0.0, 64.0
    if measured(hi) < share:
        raise ShapeError(f"--router-skew {share}: {n_expert} experts, {n_used} used a token, reach at most "
                         f"{measured(hi):.2f} (the top fifth holds {TOP * n_expert:.1f} experts)")
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if measured(mid) < share else (lo, mid)
    return (lo + hi) / 2


def skew_channel(raw: np.ndarray, qt: int, n_embd: int, n_rows: int) -> float:
    """Set the first SKEW_CHANNEL coordinates of every row of a block-coded embedding to one
    constant (in place); returns that value as the file's dequantizer reads it."""
    block, type_size = gguf.GGML_QUANT_SIZES[Q(qt)]
    rows = raw.reshape(n_rows, n_embd // block, type_size)
    first = rows[:, 0]                                 # [rows, type_size]: coordinates 0 .. block-1
    if qt == Q.Q4_K:      # sub-block 0 (coordinates 0..31): min 0 (its top bits are sub-block 4's), codes 9
        first[:, 8] &= 0xC0
        first[:, 16:48] = (first[:, 16:48] & 0xF0) | 9
    elif qt == Q.Q5_0:    # every code 31 (high bits all set)
        first[:, 2:22] = 0xFF
    elif qt == Q.Q8_0:    # every code 127
        first[:, 2:34] = 127
    else:
        raise ShapeError(f"--router-skew: no constant channel for embedding type {Q(qt).name}")
    value = gguf.quants.dequantize(first[:1].copy(), Q(qt)).reshape(-1)[:SKEW_CHANNEL]
    assert np.all(value == value[0]) and value[0] > 0, value
    return float(value[0])


def skew_router(rng: np.random.Generator, n_embd: int, n_expert: int, scale: float, ffn_norm: np.ndarray,
                channel: float) -> np.ndarray:
    """One layer's router [E, D]: random on the coordinates past the channel; on the channel a
    weight per expert so its logit gains beta_e (profile rank of e, times scale) times the spread
    of the random part, as the layer's ffn_norm weighs both."""
    c = SKEW_CHANNEL
    r = rng.standard_normal((n_expert, n_embd), np.float32) * np.float32(1 / np.sqrt(n_embd))
    beta = -scale * np.log1p(np.arange(n_expert, dtype=np.float64))
    beta = (beta - beta.mean())[np.argsort(rng.permutation(n_expert))]   # expert e has rank perm^-1(e)
    spread = SKEW_EMBD_STD / np.sqrt(n_embd) * np.sqrt(np.sum(ffn_norm[c:].astype(np.float64) ** 2))
    r[:, :c] = (beta * spread / (channel * np.sum(ffn_norm[:c], dtype=np.float64)))[:, None]
    return r


# the tensors that read the residual (their input coordinates) or write it (their output rows):
# in a --router-skew file they neither read nor write the constant channel, so it stays constant
SKEW_READERS = (".attn_q.weight", ".attn_k.weight", ".attn_v.weight", ".ffn_gate_exps.weight",
                ".ffn_up_exps.weight")       # and the head, output.weight
SKEW_WRITERS = (".attn_output.weight", ".ffn_down_exps.weight")


def skew_zero(data: np.ndarray, qt: int, ne: tuple[int, ...], side: str) -> np.ndarray:
    """Zero (in place) a tensor's weights on the channel: side "in", the first SKEW_CHANNEL
    elements of every row; "out", the first SKEW_CHANNEL rows (of every expert). `data` is the
    float values [.., ne1, ne0] or the raw blocks [n_blocks, type_size]."""
    c = SKEW_CHANNEL
    if qt in (Q.F32, Q.F16):
        if side == "in":
            data[..., :c] = 0
        else:
            data[..., :c, :] = 0
        return data
    block, type_size = gguf.GGML_QUANT_SIZES[Q(qt)]
    rows = data.reshape(-1, ne[1], ne[0] // block, type_size)          # [experts, rows, blocks, bytes]
    if side == "out":                   # every block of the row: its scale fields zero
        target = rows[:, :c]
        if qt == Q.Q4_K:
            target[..., 0:4] = 0        # d, dmin
        elif qt == Q.Q6_K:
            target[..., 208:210] = 0    # d
        else:
            target[..., 0:2] = 0        # Q5_0, Q8_0: d
        return data
    first = rows[:, :, 0]               # the block holding coordinates 0 .. block-1
    if qt == Q.Q4_K:                    # sub-block 0: scale and min 0 (top bits: sub-block 4's)
        first[..., 4] &= 0xC0
        first[..., 8] &= 0xC0
    elif qt == Q.Q6_K:                  # int8 scales 0 and 1 cover coordinates 0..31
        first[..., 192:194] = 0
    else:                               # Q5_0, Q8_0: the block is the channel
        first[..., 0:2] = 0
    return data


def skew_tensor(skew: dict, name: str, role: str, ne: tuple[int, ...], qt: int, rng: np.random.Generator):
    """A tensor of a --router-skew file as stored, or None where it is today's (norms, biases).
    skew carries the profile scale, the channel's value once the embedding is written, and the
    layer's ffn_norm once written (the router reads it)."""
    d = ne[0]
    if role == "router":
        return skew_router(rng, d, ne[1], skew["scale"], skew.pop("ffn_norm"), skew["channel"])
    side = ("in" if name.endswith(SKEW_READERS) or name == "output.weight" else
            "out" if name.endswith(SKEW_WRITERS) else None)
    if role != "embd" and side is None:
        return None
    floats = qt in (Q.F32, Q.F16)
    if role == "embd":
        if floats:
            vals = float_values(role, ne, rng) * np.float32(SKEW_EMBD_STD * np.sqrt(d))
            vals[:, :SKEW_CHANNEL] = 2 * SKEW_EMBD_STD
            vals = vals.astype(np.float16 if qt == Q.F16 else np.float32)
            skew["channel"] = float(vals[0, 0])
            return vals
        raw = block_bytes(qt, ne, rng, std=SKEW_EMBD_STD)
        skew["channel"] = skew_channel(raw, qt, d, ne[1])
        return raw
    data = (float_values(role, ne, rng).astype(np.float16 if qt == Q.F16 else np.float32) if floats
            else block_bytes(qt, ne, rng))
    return skew_zero(data, qt, ne, side)


def check_shape(arch: str, s: dict) -> None:
    if arch not in ARCHS:
        raise ShapeError(f"--arch {arch!r} must be one of {', '.join(ARCHS)}")
    for key in ("n_layer", "n_embd", "n_head", "n_head_kv", "n_ff", "ctx_train"):
        if not isinstance(s[key], int) or s[key] < 1:
            raise ShapeError(f"--{key.replace('_', '-')} {s[key]!r} must be an integer >= 1")
    if s["vocab"] != "full":
        raise ShapeError(f"--vocab {s['vocab']!r}: only 'full' (the real tokenizer's vocab) loads in llama.cpp")
    if s["n_head"] % s["n_head_kv"]:
        raise ShapeError(f"--n-head {s['n_head']} must be a multiple of --n-head-kv {s['n_head_kv']}")
    if arch == "qwen2" and s["head_dim"] not in (0, s["n_embd"] // s["n_head"]):
        raise ShapeError(f"--head-dim {s['head_dim']}: qwen2 takes n_embd / n_head = {s['n_embd'] // s['n_head']}")
    head_dim = s["head_dim"] or s["n_embd"] // s["n_head"]
    if head_dim < 2 or head_dim % 2 or (arch == "qwen2" and s["n_embd"] % s["n_head"]):
        raise ShapeError(f"head dim {head_dim} (--head-dim, or --n-embd / --n-head) must be even, >= 2, exact")
    if arch in MOE and not 1 <= s["n_expert_used"] <= s["n_expert"]:
        raise ShapeError(f"--n-expert-used {s['n_expert_used']} must be 1..--n-expert {s['n_expert']}")
    if arch in MOE and s["n_ff_exp"] < 1:
        raise ShapeError(f"--n-ff-exp {s['n_ff_exp']} must be >= 1")
    if arch in HYBRID:
        _check_hybrid(arch, s, head_dim)
    if (s["mode"] not in ("float", "blocks") or s["ftype"] not in ("f32", "f16")
            or s["mix"] not in ("q4_k_m", "q5_k_m", "q8_0")):
        raise ShapeError(f"--mode {s['mode']!r} / --ftype {s['ftype']!r} / --mix {s['mix']!r}: "
                         f"float|blocks, f32|f16, q4_k_m|q5_k_m|q8_0")
    if s["mode"] == "blocks":
        rows = {"--n-embd": s["n_embd"], "--n-ff": s["n_ff"], "--head-dim x --n-head": head_dim * s["n_head"]}
        if arch in MOE:
            rows["--n-ff-exp"] = s["n_ff_exp"]
        if arch == "qwen35moe":
            rows["--n-ff-shexp"] = s["n_ff_shexp"]
        if arch in HYBRID:
            rows["--ssm-d-state x --ssm-dt-rank"] = s["ssm_d_state"] * s["ssm_dt_rank"]
        for flag, n in rows.items():
            if n % 32:
                raise ShapeError(f"{flag} = {n}: blocks mode needs rows that are a multiple of 32")


def _check_hybrid(arch: str, s: dict, head_dim: int) -> None:
    for key in ("n_ff_shexp", "full_attn_interval", "ssm_d_conv", "ssm_d_state", "ssm_n_group", "ssm_dt_rank"):
        if not isinstance(s[key], int) or s[key] < 1:
            raise ShapeError(f"--{key.replace('_', '-')} {s[key]!r} must be an integer >= 1")
    if s["ssm_d_conv"] < 2:
        raise ShapeError(f"--ssm-d-conv {s['ssm_d_conv']} must be >= 2 (the window carries d_conv - 1 steps)")
    if s["ssm_dt_rank"] % s["ssm_n_group"]:
        raise ShapeError(f"--ssm-dt-rank {s['ssm_dt_rank']} (value heads) must be a multiple of "
                         f"--ssm-n-group {s['ssm_n_group']} (key heads)")
    n_rot = s["n_rot"] or head_dim // 4
    if n_rot < 2 or n_rot % 2 or n_rot > head_dim:
        raise ShapeError(f"--n-rot {n_rot} must be even, >= 2 and at most the head dim {head_dim}")
    sections = rope_sections(s, n_rot)
    if len(sections) != 4 or min(sections) < 0 or not 0 < sum(sections) <= head_dim // 2:
        raise ShapeError(f"--rope-sections {s['rope_sections']!r} must be 4 counts >= 0 summing to 1..head_dim/2")


def rope_sections(s: dict, n_rot: int) -> list[int]:
    """IMRoPE's sections: as given, or the rotated pairs in thirds (Qwen3.6: 64 dims -> 11, 11, 10, 0)."""
    if s["rope_sections"]:
        try:
            return [int(x) for x in str(s["rope_sections"]).split(",")]
        except ValueError:
            raise ShapeError(f"--rope-sections {s['rope_sections']!r} must be 4 integers, comma separated") from None
    pairs = n_rot // 2
    third = (pairs + 2) // 3
    return [third, third, pairs - 2 * third, 0]


def write_synthetic(path, arch: str = "qwen2", tokenizer_from: str | None = None, router_skew: float | None = None,
                    **shape) -> Path:
    """Write the file; returns its path. Shape keys as DEFAULTS (n_layer, n_embd, ...).
    router_skew: the share of the routing the busiest fifth of each layer's experts takes in
    the running model (qwen3moe; 0.2 is even routing; see --router-skew); None: today's weights."""
    unknown = set(shape) - set(DEFAULTS)
    if unknown:
        raise ShapeError(f"unknown shape keys {sorted(unknown)}; known: {sorted(DEFAULTS)}")
    s = {**DEFAULTS, **shape}
    check_shape(arch, s)
    skew = None
    if router_skew is not None:
        if arch != "qwen3moe":
            raise ShapeError(f"--router-skew needs --arch qwen3moe (routed experts), not {arch}")
        if s["mix"] == "q5_k_m":
            raise ShapeError("--router-skew writes q4_k_m or q8_0 blocks, not --mix q5_k_m")
        if s["n_embd"] < 2 * SKEW_CHANNEL:
            raise ShapeError(f"--router-skew needs --n-embd >= {2 * SKEW_CHANNEL} (the constant channel takes "
                             f"{SKEW_CHANNEL} coordinates), got {s['n_embd']}")
        skew = {"scale": skew_scale(s["n_expert"], s["n_expert_used"], float(router_skew), s["seed"])}
    s["head_dim"] = s["head_dim"] or s["n_embd"] // s["n_head"]
    tok = tokenizer_keys(str(tokenizer_from or fetch_model_path()))
    s["n_vocab"] = next(n for k, _, _, _, n in tok if k == "tokenizer.ggml.tokens")
    w = _Writer(str(path), arch)
    w.add_name(f"bloomery synthetic {arch}")
    w.add_uint32(f"{arch}.block_count", s["n_layer"])
    w.add_uint32(f"{arch}.context_length", s["ctx_train"])
    w.add_uint32(f"{arch}.embedding_length", s["n_embd"])
    w.add_uint32(f"{arch}.feed_forward_length", s["n_ff"])
    w.add_uint32(f"{arch}.attention.head_count", s["n_head"])
    w.add_uint32(f"{arch}.attention.head_count_kv", s["n_head_kv"])
    if arch != "qwen2":
        w.add_uint32(f"{arch}.attention.key_length", s["head_dim"])
        w.add_uint32(f"{arch}.attention.value_length", s["head_dim"])
    w.add_float32(f"{arch}.rope.freq_base", 1_000_000.0)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    if arch in MOE:
        w.add_uint32(f"{arch}.expert_count", s["n_expert"])
        w.add_uint32(f"{arch}.expert_used_count", s["n_expert_used"])
        w.add_uint32(f"{arch}.expert_feed_forward_length", s["n_ff_exp"])
    if arch == "qwen35moe":
        w.add_uint32(f"{arch}.expert_shared_feed_forward_length", s["n_ff_shexp"])
    if arch in HYBRID:
        n_rot = s["n_rot"] or s["head_dim"] // 4
        w.add_uint32(f"{arch}.rope.dimension_count", n_rot)
        w.add_array(f"{arch}.rope.dimension_sections", rope_sections(s, n_rot))
        w.add_uint32(f"{arch}.full_attention_interval", s["full_attn_interval"])
        w.add_uint32(f"{arch}.ssm.conv_kernel", s["ssm_d_conv"])
        w.add_uint32(f"{arch}.ssm.state_size", s["ssm_d_state"])
        w.add_uint32(f"{arch}.ssm.group_count", s["ssm_n_group"])
        w.add_uint32(f"{arch}.ssm.time_step_rank", s["ssm_dt_rank"])
        w.add_uint32(f"{arch}.ssm.inner_size", s["ssm_d_state"] * s["ssm_dt_rank"])
    w.add_uint32("general.file_type", FILE_TYPE[s["ftype"] if s["mode"] == "float" else s["mix"]])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, val, vtype, sub, _ in tok:
        w.add_key_value(key, val, gguf.GGUFValueType(vtype), sub_type=None if sub is None else gguf.GGUFValueType(sub))
    tensors = [(name, ne, role, ggml_type_for(role, ne[0], s)) for name, ne, role in tensor_plan(arch, s)]
    for name, ne, role, qt in tensors:
        block, type_size = gguf.GGML_QUANT_SIZES[Q(qt)]
        w.add_tensor_info(name, ne[::-1], np.dtype(np.float32), int(np.prod(ne)) // block * type_size, raw_dtype=Q(qt))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for i, (name, ne, role, qt) in enumerate(tensors):   # one tensor in memory at a time
        rng = np.random.default_rng([s["seed"], i])
        special = skew_tensor(skew, name, role, ne, qt, rng) if skew is not None else None
        if special is not None:
            w.write_tensor_data(special)
        elif qt in (Q.F32, Q.F16):
            vals = float_values(role, ne, rng)
            if skew is not None and name.endswith("ffn_norm.weight"):
                skew["ffn_norm"] = vals
            w.write_tensor_data(vals.astype(np.float16 if qt == Q.F16 else np.float32))
        else:
            w.write_tensor_data(block_bytes(qt, ne, rng))
    w.close()
    return Path(path)


def write_tokenizer_only(path, tokenizer_from: str | None = None) -> Path:
    """A GGUF holding only the tokenizer keys of `tokenizer_from` (a few MB): what a machine
    without the real model (the GPU device) needs to make synthetic files with its tokenizer."""
    w = _Writer(str(path), "qwen2")
    w.add_name("bloomery tokenizer keys")
    for key, val, vtype, sub, _ in tokenizer_keys(str(tokenizer_from or fetch_model_path())):
        w.add_key_value(key, val, gguf.GGUFValueType(vtype), sub_type=None if sub is None else gguf.GGUFValueType(sub))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    return Path(path)


def write_float_twin(src, path) -> Path:
    """The same file with every tensor dequantized to F32 (gguf-py's dequantize) and its keys as they are
    (general.file_type set to all F32): the model's exact arithmetic, with no quantized activation, for a
    reference that neither backend's rounding of activations touches (tests/test_cuda_qwen35.py)."""
    r = gguf.GGUFReader(str(src))
    w = _Writer(str(path), str(r.fields["general.architecture"].contents()))
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if key == "general.file_type":
            w.add_key_value(key, FILE_TYPE["f32"], gguf.GGUFValueType.UINT32)
            continue
        vtype = gguf.GGUFValueType(f.types[0])
        sub = gguf.GGUFValueType(f.types[1]) if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, f.contents(), vtype, sub_type=sub)
    for t in r.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w.add_tensor(t.name, data.reshape([int(n) for n in reversed(t.shape)]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(PRESETS), default=None,
                    help="a named shape (arch and every shape flag; flags given beside it override): "
                         + "; ".join(f"{k}: --arch {a} " + " ".join(f"--{n.replace('_', '-')} {v}" for n, v in kw.items())
                                     for k, (a, kw) in PRESETS.items()))
    ap.add_argument("--arch", default=None, choices=ARCHS, help="default qwen2")
    for key, default in DEFAULTS.items():
        flag = "--" + key.replace("_", "-")
        ap.add_argument(flag, dest=key, default=None, type=type(default), help=f"default {default}")
    ap.add_argument("--router-skew", type=float, default=None, metavar="SHARE",
                    help="qwen3moe: build the embedding and routers so that, in the running model, the busiest "
                         "fifth of each layer's experts takes about SHARE of the routing (0.2: even routing; "
                         "0.6: a skew like real routers'); without it the weights are today's, whose routing "
                         "is not controlled (see the comment above SKEW_EMBD_STD)")
    ap.add_argument("--tokenizer-from", default=None, help="GGUF to copy tokenizer keys from (default: the real model)")
    ap.add_argument("--tokenizer-only", action="store_true", help="write only the tokenizer keys")
    ap.add_argument("-o", "--output", required=True)
    args = vars(ap.parse_args(argv))
    out, tok, skew, preset = args.pop("output"), args.pop("tokenizer_from"), args.pop("router_skew"), args.pop("shape")
    if args.pop("tokenizer_only"):
        print(write_tokenizer_only(out, tok))
        return
    arch, shape = PRESETS[preset] if preset else ("qwen2", {})
    arch = args.pop("arch") or arch
    shape = {**shape, **{k: v for k, v in args.items() if v is not None}}
    try:
        print(write_synthetic(out, arch=arch, tokenizer_from=tok, router_skew=skew, **shape))
    except ShapeError as e:
        ap.error(str(e))


if __name__ == "__main__":
    main()
