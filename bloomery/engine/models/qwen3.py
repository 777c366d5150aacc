"""Qwen3 (llama.cpp arch `qwen3`): GQA attention without Q/K/V biases and with a
per-head RMSNorm on Q and K before NEOX RoPE, SwiGLU FFN (src/models/qwen3.cpp). The
head size comes from `qwen3.attention.key_length` (it is not n_embd / n_head).

Legend: T = tokens, D = hidden.
"""
from __future__ import annotations

from bloomery.engine.models import layers
from bloomery.engine.models.base import CausalLM

# per layer: attention with per-head Q/K norms, a dense SwiGLU FFN
LAYER = layers.ATTN | layers.QK_NORM | layers.DENSE_FFN


class Qwen3(CausalLM):
    arch = "qwen3"

    def __init__(self, gf, ops, n_slots: int, n_ctx_slot: int, progress=None, host_experts=None):
        super().__init__(gf, ops, n_slots, n_ctx_slot, progress, host_experts)
        self.load_decoder(layers.Hparams.from_gguf(gf, self.arch), LAYER)

    def block(self, il: int, x, rows):
        return layers.swiglu_ffn(self, il, layers.attention(self, il, x, rows, qk_norm=True))   # [T, D]

    def layers_forward(self, x, rows):
        return layers.plain_layers(self, x, rows)                                    # [T, D]


MODEL = Qwen3
