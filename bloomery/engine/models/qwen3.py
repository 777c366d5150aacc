"""Qwen3 (llama.cpp arch `qwen3`): Qwen2's block without Q/K/V biases and with a
per-head RMSNorm on Q and K before RoPE (src/models/qwen3.cpp). The head size
comes from `qwen3.attention.key_length` (it is not n_embd / n_head).

Legend: T = tokens, D = hidden, H = query heads, Hkv = KV heads, Dh = head size.
"""
from __future__ import annotations

from bloomery.engine.models.qwen2 import LAYER as QWEN2_LAYER
from bloomery.engine.models.qwen2 import Qwen2

LAYER = {k: v for k, v in QWEN2_LAYER.items() if k not in ("bq", "bk", "bv")} | {
    "q_norm": "blk.{i}.attn_q_norm.weight",
    "k_norm": "blk.{i}.attn_k_norm.weight",
}


class Qwen3(Qwen2):
    arch = "qwen3"
    layer_names = LAYER

    def attention(self, il: int, x, rows):
        hp, ly, ops = self.hp, self.layers[il], self.ops
        q, k, v = self.qkv(il, x)                                          # [T, H|Hkv, Dh]
        a = ops.self_attention(self.cache, il, rows, q, k, v, self.kq_scale, hp.n_rot, hp.freq_base,
                               q_norm=ly["q_norm"], k_norm=ly["k_norm"], eps=hp.rms_eps)   # [T, H*Dh]
        return ops.matmul(a, ly["wo"], x)                                  # [T, D] (+ residual)


MODEL = Qwen3
