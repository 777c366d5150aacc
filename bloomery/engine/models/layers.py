"""The layers the architecture files are built from: hyperparameters read from the GGUF,
the attention half of a block, a dense SwiGLU FFN and a routed (MoE) FFN, each a function
over the ops interface. An architecture file picks among them; none inherits another.

Legend: T = tokens, D = hidden (n_embd), H = query heads, Hkv = KV heads, Dh = head size,
F = FFN size, E = experts, A = experts used per token.
"""
from __future__ import annotations

from dataclasses import dataclass

from bloomery.engine.models.base import ModelError, meta


@dataclass(frozen=True)
class Hparams:
    """A decoder's shape, from `<arch>.*` keys (llama.cpp's llm_load_hparams names)."""
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
    def from_gguf(cls, gf, arch: str) -> "Hparams":
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


@dataclass(frozen=True)
class MoeParams:
    n_expert: int
    n_expert_used: int
    n_ff_exp: int

    @classmethod
    def from_gguf(cls, gf, arch: str) -> "MoeParams":
        p = cls(n_expert=int(meta(gf, f"{arch}.expert_count")),
                n_expert_used=int(meta(gf, f"{arch}.expert_used_count")),
                n_ff_exp=int(meta(gf, f"{arch}.expert_feed_forward_length", 0, required=False)))
        if p.n_expert < 1 or not 1 <= p.n_expert_used <= p.n_expert:
            raise ModelError(f"{gf.path}: expert_used_count {p.n_expert_used} must be in 1..expert_count ({p.n_expert})")
        return p


# The GGUF tensors each layer function reads (llama.cpp's LLM_TENSOR_* names, {i} the layer):
# an architecture's per-layer map is the union of those of the functions its block calls.
ATTN = {
    "attn_norm": "blk.{i}.attn_norm.weight",
    "wq": "blk.{i}.attn_q.weight",
    "wk": "blk.{i}.attn_k.weight",
    "wv": "blk.{i}.attn_v.weight",
    "wo": "blk.{i}.attn_output.weight",
}
QKV_BIAS = {"bq": "blk.{i}.attn_q.bias", "bk": "blk.{i}.attn_k.bias", "bv": "blk.{i}.attn_v.bias"}
QK_NORM = {"q_norm": "blk.{i}.attn_q_norm.weight", "k_norm": "blk.{i}.attn_k_norm.weight"}
DENSE_FFN = {
    "ffn_norm": "blk.{i}.ffn_norm.weight",
    "ffn_gate": "blk.{i}.ffn_gate.weight",
    "ffn_up": "blk.{i}.ffn_up.weight",
    "ffn_down": "blk.{i}.ffn_down.weight",
}
MOE_FFN = {
    "ffn_norm": "blk.{i}.ffn_norm.weight",
    "gate_inp": "blk.{i}.ffn_gate_inp.weight",        # router [D, E]
    "gate_exps": "blk.{i}.ffn_gate_exps.weight",      # [D, Fe, E]
    "up_exps": "blk.{i}.ffn_up_exps.weight",          # [D, Fe, E]
    "down_exps": "blk.{i}.ffn_down_exps.weight",      # [Fe, D, E]
}


def attention(m, il: int, x, rows, qk_norm: bool = False):
    """The attention half of block il over the residual x, the residual added: [T, D].
    RMSNorm, then Q, K and V (with their biases where the layer has them) in one step (a backend
    may fuse the norm in), optional per-head RMSNorm of q and k (qk_norm), NEOX RoPE, causal
    attention over the slot's KV, the output projection."""
    hp, ly, ops = m.hp, m.layers[il], m.ops
    _, (q, k, v) = ops.norm_matmuls(x, ly["attn_norm"], hp.rms_eps, [ly["wq"], ly["wk"], ly["wv"]],
                                    [ly.get("bq"), ly.get("bk"), ly.get("bv")])      # [T, (H|Hkv)*Dh]
    t = q.shape[0]
    q = q.reshape(t, hp.n_head, hp.head_dim)
    k, v = k.reshape(t, hp.n_head_kv, hp.head_dim), v.reshape(t, hp.n_head_kv, hp.head_dim)
    norms = dict(q_norm=ly["q_norm"], k_norm=ly["k_norm"], eps=hp.rms_eps) if qk_norm else {}
    a = ops.self_attention(m.cache, il, rows, q, k, v, m.kq_scale, hp.n_rot, hp.freq_base, **norms)  # [T, H*Dh]
    return ops.matmul(a, ly["wo"], x)                                                   # [T, D]


def swiglu_ffn(m, il: int, x):
    """A dense FFN half over the residual x (its RMSNorm first), the residual added: [T, D]."""
    ly, ops = m.layers[il], m.ops
    _, (g, u) = ops.norm_matmuls(x, ly["ffn_norm"], m.hp.rms_eps, [ly["ffn_gate"], ly["ffn_up"]], [None, None])  # [T, F]
    return ops.matmul(ops.swiglu(g, u), ly["ffn_down"], x)                              # [T, D]


def moe_ffn(m, il: int, x, norm_weights: bool):
    """A routed FFN half (llm_graph_context::build_moe_ffn): the router's softmax over all experts,
    top A, optionally renormalised to sum 1, each expert a SwiGLU FFN, outputs weighted and
    added, the residual added: [T, D]."""
    ly, ops = m.layers[il], m.ops
    h, (logits,) = ops.norm_matmuls(x, ly["ffn_norm"], m.hp.rms_eps, [ly["gate_inp"]], [None])   # [T, D], [T, E]
    ids, w = ops.moe_route(logits, m.moe.n_expert_used, norm_weights=norm_weights)     # [T, A], [T, A]
    return ops.moe_ffn(h, ids, w, ly["gate_exps"], ly["up_exps"], ly["down_exps"], x)  # [T, D]
