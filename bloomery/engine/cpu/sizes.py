"""The numpy backend's fixed sizes, device-free: the backend uses them, and bloomery.plan reads
them to count what the backend will hold."""
from __future__ import annotations

UBATCH = 512                   # prompt rows per pass: llama-server's default -ub
KV_BYTES = 2                   # bytes per K or V element: f16, as kv_cache.KVCache allocates it
DELTA_CHUNK = 64               # rows of one chunk of the delta rule's chunked form (llama.cpp's, for a scalar decay)
MOE_CALL_MAX_ROWS = 16        # a MoE layer's experts in one compiled call for steps of up to this many rows


def moe_call_bytes(rows: int, n_embd: int, n_ff_exp: int) -> int:
    """kernels/cpu_lanes.c moe_chunk's buffers for one expert of `rows` routed rows: the rows' pair
    indices, its input, gate, up, swiglu and output, and the codes of one input (with the non-finite
    rows' zeroed copy, per-row flags, scales and sums)."""
    kmax = max(n_embd, n_ff_exp)
    return rows * (8 + 4 * (2 * n_embd + 3 * n_ff_exp) + 5 * kmax + 2 + 4 * (kmax // 32 + 1) + 2 * (kmax // 16 + 1))
