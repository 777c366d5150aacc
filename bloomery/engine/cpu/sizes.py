"""The numpy backend's fixed sizes, device-free: the backend uses them, and bloomery.plan reads
them to count what the backend will hold."""
from __future__ import annotations

UBATCH = 512                   # prompt rows per pass: llama-server's default -ub
KV_BYTES = 2                   # bytes per K or V element: f16, as kv_cache.KVCache allocates it
DELTA_CHUNK = 64               # rows of one chunk of the delta rule's chunked form (llama.cpp's, for a scalar decay)
MOE_CALL_MAX_ROWS = 16        # decode_layers' one call takes a MoE file's steps of up to this many rows
MOE_CHUNK_ROWS = 64           # an expert's rows a worker of the compiled MoE call holds at once (MOE_CHUNK_ROWS in
                              # kernels/cpu_lanes.c)


def moe_call_bytes(rows: int, n_embd: int, n_ff_exp: int) -> int:
    """kernels/cpu_lanes.c moe_chunk's buffers for one expert routed by `rows` rows: the rows' pair indices,
    and for a chunk of at most MOE_CHUNK_ROWS of them the input, gate, up, swiglu and output, and the codes
    of one input (with the non-finite rows' zeroed copy, per-row flags, scales and sums)."""
    kmax = max(n_embd, n_ff_exp)
    m = min(rows, MOE_CHUNK_ROWS)
    return 8 * rows + m * (4 * (2 * n_embd + 3 * n_ff_exp) + 5 * kmax + 2 + 4 * (kmax // 32 + 1) + 2 * (kmax // 16 + 1))
