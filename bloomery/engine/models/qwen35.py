"""Qwen3.5 dense (llama.cpp arch `qwen35`): qwen35moe's hybrid of Gated DeltaNet and gated
full-attention layers (models/layers.py's load_hybrid and hybrid_mixer, as qwen35moe) with a dense SwiGLU FFN
after `post_attention_norm` (src/models/qwen35.cpp).

Legend: T = tokens, D = hidden.
"""
from __future__ import annotations

from bloomery.engine.models import layers
from bloomery.engine.models.base import RecurrentLM

FFN = layers.DENSE_FFN | layers.POST_NORM                        # the FFN's norm is post_attention_norm
LAYER = layers.GATED_ATTN | layers.QK_NORM | FFN
RECURRENT_LAYER = layers.DELTA_NET | FFN


class Qwen35(RecurrentLM):
    arch = "qwen35"

    def __init__(self, gf, ops, n_slots: int, n_ctx_slot: int, progress=None, host_experts=None):
        super().__init__(gf, ops, n_slots, n_ctx_slot, progress, host_experts)
        layers.load_hybrid(self, LAYER, RECURRENT_LAYER)

    def block(self, il: int, x, rows):
        return layers.swiglu_ffn(self, il, layers.hybrid_mixer(self, il, x, rows))                # [T, D]


MODEL = Qwen35
