"""Qwen3-MoE (llama.cpp arch `qwen3moe`): Qwen3's attention (per-head Q/K RMSNorm, no
biases) with a sparse MoE FFN (src/models/qwen3moe.cpp + llm_graph_context::build_moe_ffn):
router softmax over all experts, top-k, the chosen weights renormalised to sum 1 (norm_w is
always on for qwen3moe), each expert a SwiGLU FFN, outputs weighted and added.

Legend: T = tokens, D = hidden, E = experts, Fe = expert FFN size.
"""
from __future__ import annotations

from bloomery.engine.models import layers
from bloomery.engine.models.base import CausalLM

# per layer: attention with per-head Q/K norms, a routed FFN
LAYER = layers.ATTN | layers.QK_NORM | layers.MOE_FFN


class Qwen3Moe(CausalLM):
    arch = "qwen3moe"
    norm_weights = True                     # the chosen experts' weights renormalised (decode_layers reads it)

    def __init__(self, gf, ops, n_slots: int, n_ctx_slot: int, progress=None, host_experts=None):
        super().__init__(gf, ops, n_slots, n_ctx_slot, progress, host_experts)
        self.load_decoder(layers.Hparams.from_gguf(gf, self.arch), LAYER)
        self.moe = layers.MoeParams.from_gguf(gf, self.arch)

    def block(self, il: int, x, rows):
        x = layers.attention(self, il, x, rows, qk_norm=True)                        # [T, D]
        return layers.moe_ffn(self, il, x, norm_weights=self.norm_weights)           # [T, D]

    def layers_forward(self, x, rows):
        return layers.plain_layers(self, x, rows)                                    # [T, D]


MODEL = Qwen3Moe
