"""Qwen3-MoE (llama.cpp arch `qwen3moe`): Qwen3's attention with a sparse MoE FFN
(src/models/qwen3moe.cpp + llm_graph_context::build_moe_ffn): router softmax
over all experts, top-k, the chosen weights renormalised to sum 1 (norm_w is
always on for qwen3moe), each expert a SwiGLU FFN, outputs weighted and added.

Legend: T = tokens, D = hidden, E = experts, A = experts used per token,
Fe = expert FFN size.
"""
from __future__ import annotations

from dataclasses import dataclass

from bloomery.engine.models.base import ModelError, meta
from bloomery.engine.models.qwen3 import LAYER as QWEN3_LAYER
from bloomery.engine.models.qwen3 import Qwen3


@dataclass(frozen=True)
class MoeParams:
    n_expert: int
    n_expert_used: int
    n_ff_exp: int

    @classmethod
    def from_gguf(cls, gf, arch: str = "qwen3moe") -> "MoeParams":
        p = cls(n_expert=int(meta(gf, f"{arch}.expert_count")),
                n_expert_used=int(meta(gf, f"{arch}.expert_used_count")),
                n_ff_exp=int(meta(gf, f"{arch}.expert_feed_forward_length", 0, required=False)))
        if p.n_expert < 1 or not 1 <= p.n_expert_used <= p.n_expert:
            raise ModelError(f"{gf.path}: expert_used_count {p.n_expert_used} must be in 1..expert_count ({p.n_expert})")
        return p


LAYER = {k: v for k, v in QWEN3_LAYER.items() if k not in ("ffn_gate", "ffn_up", "ffn_down")} | {
    "gate_inp": "blk.{i}.ffn_gate_inp.weight",        # router [D, E]
    "gate_exps": "blk.{i}.ffn_gate_exps.weight",      # [D, Fe, E]
    "up_exps": "blk.{i}.ffn_up_exps.weight",          # [D, Fe, E]
    "down_exps": "blk.{i}.ffn_down_exps.weight",      # [Fe, D, E]
}


class Qwen3Moe(Qwen3):
    arch = "qwen3moe"
    layer_names = LAYER

    def __init__(self, gf, ops, n_slots: int, n_ctx_slot: int):
        super().__init__(gf, ops, n_slots, n_ctx_slot)
        self.moe = MoeParams.from_gguf(gf, self.arch)

    def ffn(self, il: int, x):
        ly, ops, moe = self.layers[il], self.ops, self.moe
        h, (logits,) = ops.norm_matmuls(x, ly["ffn_norm"], self.hp.rms_eps, [ly["gate_inp"]], [None])  # [T, D], [T, E]
        ids, w = ops.moe_route(logits, moe.n_expert_used, norm_weights=True)   # [T, A], [T, A]
        return ops.moe_ffn(h, ids, w, ly["gate_exps"], ly["up_exps"], ly["down_exps"], x)   # [T, D] (+ residual)


MODEL = Qwen3Moe
