"""Qwen2 (llama.cpp arch `qwen2`): RMSNorm, GQA attention with Q/K/V biases and
NEOX RoPE, SwiGLU FFN. Follows llama.cpp's src/models/qwen2.cpp graph.

Legend: T = tokens, D = hidden (n_embd), H = query heads, Hkv = KV heads,
Dh = head size, F = FFN size, V = vocabulary.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from bloomery.engine.models.base import CausalLM, ModelError, meta


@dataclass(frozen=True)
class Qwen2Params:
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    n_ff: int
    n_ctx_train: int
    rms_eps: float
    freq_base: float

    @classmethod
    def from_gguf(cls, gf, arch: str = "qwen2") -> "Qwen2Params":
        n_embd = int(meta(gf, f"{arch}.embedding_length"))
        n_head = int(meta(gf, f"{arch}.attention.head_count"))
        head_dim = int(meta(gf, f"{arch}.attention.key_length", n_embd // max(n_head, 1)))
        p = cls(
            n_embd=n_embd,
            n_layer=int(meta(gf, f"{arch}.block_count")),
            n_head=n_head,
            n_head_kv=int(meta(gf, f"{arch}.attention.head_count_kv", n_head)),
            head_dim=head_dim,
            n_rot=int(meta(gf, f"{arch}.rope.dimension_count", head_dim)),
            n_ff=int(meta(gf, f"{arch}.feed_forward_length", 0, required=False)),   # 0 in MoE files
            n_ctx_train=int(meta(gf, f"{arch}.context_length")),
            rms_eps=float(meta(gf, f"{arch}.attention.layer_norm_rms_epsilon")),
            freq_base=float(meta(gf, f"{arch}.rope.freq_base", 10000.0)),
        )
        p.check(gf.path)
        return p

    def check(self, path: str) -> None:
        for name in ("n_embd", "n_layer", "n_head", "n_head_kv", "head_dim"):
            if getattr(self, name) < 1:
                raise ModelError(f"{path}: {name} = {getattr(self, name)} must be at least 1")
        if self.n_head % self.n_head_kv:
            raise ModelError(f"{path}: head_count {self.n_head} is not a multiple of head_count_kv {self.n_head_kv}")
        if self.n_rot % 2 or self.n_rot > self.head_dim:
            raise ModelError(f"{path}: rope dimension {self.n_rot} must be even and at most head_dim {self.head_dim}")


# GGUF tensor names (llama.cpp's LLM_TENSOR_* for qwen2)
TOKEN_EMBD, OUTPUT_NORM, OUTPUT = "token_embd.weight", "output_norm.weight", "output.weight"
LAYER = {
    "attn_norm": "blk.{i}.attn_norm.weight",
    "wq": "blk.{i}.attn_q.weight", "bq": "blk.{i}.attn_q.bias",
    "wk": "blk.{i}.attn_k.weight", "bk": "blk.{i}.attn_k.bias",
    "wv": "blk.{i}.attn_v.weight", "bv": "blk.{i}.attn_v.bias",
    "wo": "blk.{i}.attn_output.weight",
    "ffn_norm": "blk.{i}.ffn_norm.weight",
    "ffn_gate": "blk.{i}.ffn_gate.weight",
    "ffn_up": "blk.{i}.ffn_up.weight",
    "ffn_down": "blk.{i}.ffn_down.weight",
}
OPTIONAL = frozenset({"bq", "bk", "bv"})


class Qwen2(CausalLM):
    arch = "qwen2"
    layer_names = LAYER

    def __init__(self, gf, ops, n_slots: int, n_ctx_slot: int):
        super().__init__(gf, ops, n_slots, n_ctx_slot)
        hp = self.hp = Qwen2Params.from_gguf(gf, self.arch)
        self.n_layer, self.n_ctx_train = hp.n_layer, hp.n_ctx_train
        self.tok_embd = self.tensor(TOKEN_EMBD)
        self.n_vocab = int(gf.tensors[TOKEN_EMBD].shape[1])
        self.output_norm = self.tensor(OUTPUT_NORM)
        self.output = self.tensor(OUTPUT, required=False) or self.tok_embd   # tied head when absent
        self.layers = [{k: self.tensor(n.format(i=i), required=k not in OPTIONAL)
                        for k, n in self.layer_names.items()}
                       for i in range(hp.n_layer)]
        self.kq_scale = float(np.float32(1.0) / np.float32(math.sqrt(hp.head_dim)))
        self.cache = ops.kv_cache(hp.n_layer, n_slots, n_ctx_slot, hp.n_head_kv, hp.head_dim)

    def embed(self, ids):
        return self.ops.get_rows(self.tok_embd, ids)                       # [T, D]

    def qkv(self, il: int, x):
        """RMSNorm of the residual x, then the Q, K and V projections, in one step (a backend may
        fuse the norm in): [T, H, Dh], [T, Hkv, Dh], [T, Hkv, Dh]."""
        hp, ly = self.hp, self.layers[il]
        _, (q, k, v) = self.ops.norm_matmuls(x, ly["attn_norm"], hp.rms_eps, [ly["wq"], ly["wk"], ly["wv"]],
                                             [ly.get("bq"), ly.get("bk"), ly.get("bv")])   # [T, (H|Hkv)*Dh]
        t = q.shape[0]
        return (q.reshape(t, hp.n_head, hp.head_dim), k.reshape(t, hp.n_head_kv, hp.head_dim),
                v.reshape(t, hp.n_head_kv, hp.head_dim))

    def attention(self, il: int, x, rows):
        """The attention half of a block over the residual x, the residual added: [T, D]."""
        hp, ly, ops = self.hp, self.layers[il], self.ops
        q, k, v = self.qkv(il, x)
        a = ops.self_attention(self.cache, il, rows, q, k, v, self.kq_scale, hp.n_rot, hp.freq_base)  # [T, H*Dh]
        return ops.matmul(a, ly["wo"], x)                                  # [T, D]

    def ffn(self, il: int, x):
        """The FFN half over the residual x (its RMSNorm first), the residual added: [T, D]."""
        ly, ops = self.layers[il], self.ops
        _, (g, u) = ops.norm_matmuls(x, ly["ffn_norm"], self.hp.rms_eps, [ly["ffn_gate"], ly["ffn_up"]],
                                     [None, None])                        # [T, F] each
        return ops.matmul(ops.swiglu(g, u), ly["ffn_down"], x)            # [T, D]

    def block(self, il: int, x, rows):
        return self.ffn(il, self.attention(il, x, rows))                  # [T, D]

    def head(self, x):
        return self.ops.matmul(self._final_norm(x), self.output)         # [T, V]

    def _final_norm(self, x):
        return self.ops.rms_norm(x, self.output_norm, self.hp.rms_eps)     # [T, D]

    def head_topk(self, x, k: int):
        """ops.topk(head(x), k), through the backend's matmul_topk where it has one."""
        top = getattr(self.ops, "matmul_topk", None)
        return self.ops.topk(self.head(x), k) if top is None else top(self._final_norm(x), self.output, k)

    def head_argmax(self, x):
        """ops.argmax(head(x)), through the backend's matmul_argmax where it has one."""
        pick = getattr(self.ops, "matmul_argmax", None)
        return self.ops.argmax(self.head(x)) if pick is None else pick(self._final_norm(x), self.output)


MODEL = Qwen2
