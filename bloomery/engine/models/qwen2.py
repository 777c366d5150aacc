"""Qwen2 (llama.cpp arch `qwen2`): RMSNorm, GQA attention with Q/K/V biases and
NEOX RoPE, SwiGLU FFN. Follows llama.cpp's src/models/qwen2.cpp graph.

Legend: T = tokens, D = hidden (n_embd).
"""
from __future__ import annotations

from bloomery.engine.models import layers
from bloomery.engine.models.base import CausalLM

# per layer: attention with Q/K/V biases (optional in the file), a dense SwiGLU FFN
LAYER = layers.ATTN | layers.QKV_BIAS | layers.DENSE_FFN
OPTIONAL = frozenset(layers.QKV_BIAS)


class Qwen2(CausalLM):
    arch = "qwen2"

    def __init__(self, gf, ops, n_slots: int, n_ctx_slot: int, progress=None, host_experts=None):
        super().__init__(gf, ops, n_slots, n_ctx_slot, progress, host_experts)
        self.load_decoder(layers.Hparams.from_gguf(gf, self.arch), LAYER, OPTIONAL)

    def block(self, il: int, x, rows):
        return layers.swiglu_ffn(self, il, layers.attention(self, il, x, rows))     # [T, D]

    def layers_forward(self, x, rows):
        return layers.plain_layers(self, x, rows)                                    # [T, D]


MODEL = Qwen2
