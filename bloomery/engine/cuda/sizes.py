"""The cuda backend's fixed sizes, device-free (no CuPy import): the backend uses them, and
bloomery.plan reads them to count what the backend will hold."""
from __future__ import annotations

UBATCH = 4096                  # prompt rows per pass (CudaOps.n_ubatch): the GEMM paths' fixed costs spread wide
SCORE_BYTES = 256 << 20        # the prompt path's attention score matrix per chunk (attention.py)
DECODE_ROWS = 8                # rows a pass runs on the mat-vec (decode) kernels, the largest MMV3(n) of
                               # matvec.cu and the captured steps' batch; more rows take the prompt (GEMM) path
KV_BYTES = 2                   # bytes per K or V element: f16 (attention.KVCacheF16)
DELTA_GROUP_CHUNKS = 16        # chunks of the delta rule's chunked form prepared at once (recurrent.py): its scratch
                               # grows with them, its count of small launches shrinks
