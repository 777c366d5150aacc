"""The numpy backend's fixed sizes, device-free: the backend uses them, and bloomery.plan reads
them to count what the backend will hold."""
from __future__ import annotations

UBATCH = 512                   # prompt rows per pass: llama-server's default -ub
KV_BYTES = 2                   # bytes per K or V element: f16, as kv_cache.KVCache allocates it
DELTA_CHUNK = 64               # rows of one chunk of the delta rule's chunked form (llama.cpp's, for a scalar decay)
