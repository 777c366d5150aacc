"""The cuda backend's fixed sizes, device-free (no CuPy import): the backend uses them, and
bloomery.plan reads them to count what the backend will hold."""
from __future__ import annotations

import os

UBATCH = 4096                  # prompt rows per pass (CudaOps.n_ubatch): the GEMM paths' fixed costs spread wide
SCORE_BYTES = 256 << 20        # the prompt path's attention score matrix per chunk (attention.py)
DECODE_ROWS = 16               # rows a pass runs on the mat-vec (decode) kernels, the largest MMV3(n) of
                               # matvec.cu and the captured steps' batch; more rows take the prompt (GEMM) path.
                               # (It was 8 to session 20: a 16-row step ran as two 8-row graphs, 16.0 ms
                               # against 8.0 ms for 8 rows on the H200, the 30B-A3B-shaped file.)
MMV_SIZES = (1, 2, 4, 8, 16)   # the mmv3_bN instances (MMV3(N) in matvec.cu): a batch takes the smallest N >= its rows
MMV3N_ROWS = 8                 # the largest mmv3n_bN (MMV3N(N), the norm fused in): past it norm_matmuls runs
                               # rms_norm_q8 on its own, then mmt / mmv3 (16 rows' accumulators would spill at
                               # mmv3n's 3 blocks of 256 threads an SM)
GREEDY_BANS = 8                # ids a captured decode step bans per row before its greedy pick (ignore_eos bans the
                               # vocabulary's end-of-generation ids: 2-6 on the Qwen vocabularies); more take the top-k path
PROMPT_BUCKETS = (8, 16, 32, 64, 128, 256, 512)   # rows of the captured prompt passes (graph.py), one pool for all
PROMPT_FROM_START = (256, 512) # the buckets that take only prompts from position 0: their rows attend to each other
                               # on the GEMM path (attention.py, Rows.fresh), not row by row on the decode kernels
KV_BYTES = 2                   # bytes per K or V element: f16 (attention.KVCacheF16)
# The prompt's planned expert path (kernels/moe_mm.cu, cuda/moe.py _planned): up to this many (token, expert)
# pairs a pass, for experts of these ggml types (q4_0, q5_0, q8_0, q4_k, q5_k, q6_k) whose inner sizes are whole
# PLANNED_BK steps, at most PLANNED_MAX_EXPERTS a layer. Above it the grouped path dequantizes the experts to f16.
PLANNED_MAX_PAIRS = 32768      # a whole UBATCH pass at 8 experts a token (H200, session 19: 16.3k tok/s at 4,096 ids,
                               # the grouped path 13.8k)
HOST_PASS_PAIRS = 16384        # pairs of a prompt pass where routed experts live in host RAM (plan.cuda_host_pass_rows)
PLANNED_TYPES = frozenset({2, 6, 8, 12, 13, 14})
PLANNED_BK = 64
PLANNED_MAX_EXPERTS = 4096
DELTA_GROUP_CHUNKS = 16        # chunks of the delta rule's chunked form prepared at once (recurrent.py): its scratch
                               # grows with them, its count of small launches shrinks
# The decode products on the tensor cores (kernels/mt.cuh; backend.py mmt, moe.py moe_mt_*):
MMT_TYPES = (12, 14)         # Q4_K, Q6_K: the dense weights mmt expands onto the tensor cores (matvec.cu)
MMT_ROWS = 16                # mmt's most rows (an mma's 16), and the weight rows of its block (MMT_NT * 8)
# Fewer rows stay on mmv3 / mmv3n, where mmt measured slower. H200, 2026-12-03 (session 20), the
# 30B-A3B-shaped file, a decode step of B greedy rows (tools/bench_steps.py), in one lease, ms:
#   B            1     2     4     8
#   int8 only    -   4.04  5.97  9.60   (BLOOMERY_MMT=0; again 4.09 6.04 9.77)
#   mmt from 2   -   4.30  5.47  8.14
#   (an earlier lease: mmt at 1 row too, 3.27 against 2.50)
# So a row's results are the same bits in any batch of MMT_MIN_ROWS to 16 rows, and in any batch of fewer
# (mmv3n's own rows are batch-independent), but differ between the two in the last places, as llama.cpp's
# CUDA backend switches kernels by batch size too.
MMT_MIN_ROWS = 4
PA_DH = 128                    # attn_prompt's head size (attention.cu), its query heads per KV head at most PA_MAXG
PA_MAXG = 8
PROMPT_ATTN = ("gemm", "tc")


def prompt_attn() -> str:
    """BLOOMERY_CUDA_PROMPT_ATTN: how a captured prompt pass of more than DECODE_ROWS rows attends. tc (the
    default, session 23): through attn_prompt, the tensor cores over the slot's keys, at any depth, so passes
    that start past position 0 (a chat's later turns) are captured too; gemm: from position 0 over its own rows
    through the GEMM path, at a depth (32-128 rows) row by row on the decode kernels, else uncaptured. Heads
    attn_prompt does not take (tc_prompt_fits) go the gemm way. On the H200 (session 23, bench_steps --captured,
    512 ids): 37.2 ms at position 0 against gemm's 38.7; at position 4,000 42.5 ms captured against 80.3 ms
    uncaptured (gemm)."""
    got = os.environ.get("BLOOMERY_CUDA_PROMPT_ATTN", "tc")
    if got not in PROMPT_ATTN:
        raise ValueError(f"BLOOMERY_CUDA_PROMPT_ATTN={got!r}: one of {', '.join(PROMPT_ATTN)}")
    return got


def tc_prompt_fits(n_head: int, n_head_kv: int, head_dim: int) -> bool:
    """Whether captured prompt passes attend through attn_prompt: BLOOMERY_CUDA_PROMPT_ATTN=tc (the default), and
    heads it takes."""
    return (prompt_attn() == "tc" and head_dim == PA_DH and n_head % n_head_kv == 0
            and n_head // n_head_kv <= PA_MAXG)


PA_MAX_SPLITS = 8              # attn_prompt's key splits at most (attn_prompt_merge adds them)


def prompt_splits(n_blocks: int, n_sm: int) -> int:
    """attn_prompt's key splits for a grid of n_blocks (T/16 x Hkv): enough for two blocks an SM, at most
    PA_MAX_SPLITS. A captured pass of 256 rows at a depth of 4,255 over 4 KV heads was 64 blocks on the H200's
    132 SMs, each walking every key: 45-50 ms, against 31 ms at position 0 (session 23)."""
    return max(1, min(PA_MAX_SPLITS, -(-2 * n_sm // max(1, n_blocks))))


assert MMV_SIZES[-1] == DECODE_ROWS and MMV3N_ROWS <= DECODE_ROWS <= MMT_ROWS
