"""Qwen3.5 / Qwen3.6 MoE (llama.cpp arch `qwen35moe`, e.g. Qwen3.6-35B-A3B): a hybrid of
Gated DeltaNet layers (linear attention over a recurrent state per slot) and, every
`full_attention_interval`-th layer, gated full attention with per-head Q/K RMSNorm and IMRoPE
over the KV cache; each layer's FFN half (after `post_attention_norm`) is routed experts plus a
sigmoid-gated shared expert (src/models/qwen35moe.cpp, delta-net-base.cpp). MTP layers past the
trunk (`nextn_predict_layers`) are not read.

Legend: T = tokens, D = hidden.
"""
from __future__ import annotations

from bloomery.engine.models import layers
from bloomery.engine.models.base import RecurrentLM

FFN = layers.MOE_FFN | layers.POST_NORM | layers.SHARED_EXPERT   # the FFN's norm is post_attention_norm
LAYER = layers.GATED_ATTN | layers.QK_NORM | FFN                 # a full-attention layer
RECURRENT_LAYER = layers.DELTA_NET | FFN                         # a Gated DeltaNet layer


class Qwen35Moe(RecurrentLM):
    arch = "qwen35moe"

    def __init__(self, gf, ops, n_slots: int, n_ctx_slot: int, progress=None, host_experts=None):
        super().__init__(gf, ops, n_slots, n_ctx_slot, progress, host_experts)
        layers.load_hybrid(self, LAYER, RECURRENT_LAYER)
        self.moe = layers.MoeParams.from_gguf(gf, self.arch)

    def block(self, il: int, x, rows):
        return layers.shared_expert_moe_ffn(self, il, layers.hybrid_mixer(self, il, x, rows))     # [T, D]


MODEL = Qwen35Moe
