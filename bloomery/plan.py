"""Plan arithmetic: bytes by ggml type, KV, slots, scratch, host and card need.

Pure functions, no I/O: the header facts come from an already-open GGUFFile and
the census is passed in. Context rules follow the serving guide, section 3:
  - no ctx_size: each slot asks the model's trained limit ("target"); if that plan
    does not fit, the largest multiple of 1024 under it, down to 4096, that fits
    ("fitted");
  - ctx_size C with n_parallel N: N slots sharing C, as llama-server's -np N
    without -kvu, which pads C up to 256 and each slot's C/N up to 256 ("set");
    a set context is never cut: one that does not fit is a PlanError naming every
    term and the largest context that fits;
  - slot_ctx S: N slots of S each ("set"); beside ctx_size it is refused;
  - n_parallel "auto": the most slots, up to 8, whose plan holds one request's
    context (slot_ctx, else the trained limit); one slot where that had to be fitted.
Byte terms, per device, as the backend allocates them: weights as stored, the numpy
backend's decoded forms of them (engine/cpu/forms.py builds a few rows of each to count
them), KV for every slot (f16 on both backends; the same K+V count llama.cpp allocates;
a hybrid file's KV only for its full-attention layers, plus each slot's float32 recurrent
state of its linear-attention layers, counted in the kv term), scratch (the transient peak of a prompt pass or
decode step: scratch_bytes_for), then the host reserve or the card margin. The result is a
Placement (bloomery/placement.py), which the engine stage's load carries out.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from functools import lru_cache

from bloomery.engine.cpu import sizes as cpu_sizes
from bloomery.engine.cuda import sizes as cuda_sizes
from bloomery.engine.cuda.sizes import DECODE_ROWS as CUDA_DECODE_ROWS, SCORE_BYTES as CUDA_SCORE_BYTES, UBATCH as CUDA_UBATCH
from bloomery.engine.cuda.sizes import HOST_PASS_PAIRS, PLANNED_BK, PLANNED_MAX_EXPERTS, PLANNED_MAX_PAIRS, PLANNED_TYPES
from bloomery.engine.cuda.sizes import PROMPT_BUCKETS as CUDA_PROMPT_BUCKETS
from bloomery.engine.cuda.sizes import PROMPT_FROM_START as CUDA_PROMPT_FROM_START
from bloomery import offload
from bloomery.engine.limits import CTX_CHECKPOINTS
from bloomery.gguf_file import StringArray
from bloomery.placement import GIB, DeviceNeed, Placement, Terms, gib
from bloomery.placement_flags import FIT_CTX, FIT_TARGET_MIB, PlacementAsk


MIB = 1024 * 1024
KV_BYTES_PER_ELEM = {"numpy": cpu_sizes.KV_BYTES, "cuda": cuda_sizes.KV_BYTES}   # as each backend allocates
N_UBATCH = cpu_sizes.UBATCH                      # positions in one numpy prompt pass (scratch sizing)
CARD_MARGIN_BYTES = FIT_TARGET_MIB * MIB         # kept free on the card (llama-server's -fitt default)
HOST_RESERVE_BYTES = 256 * MIB                   # interpreter, tokenizer tables, sockets beside the plan
PROMPT_CACHE_MAX_BYTES = 8 * GIB                 # the prompt cache's default budget: at most this, ...
PROMPT_CACHE_SHARE = 2                           # ... and at most 1/this of the host RAM the plan leaves
CTX_PAD = 256                                    # llama.cpp pads n_ctx and each slot's share to 256
FIT_STEP, FIT_FLOOR = 1024, FIT_CTX              # the fitted rule's grid and its floor (-fitc sets it)
NO_ASK = PlacementAsk()


class PlanError(Exception):
    """A plan that cannot be made; the message names the setting, every term and the bound."""


@dataclass(frozen=True)
class Census:
    host_avail_bytes: int
    card_free_bytes: tuple[int, ...] = ()


@dataclass(frozen=True)
class ModelFacts:
    arch: str
    n_layer: int
    n_ctx_train: int
    n_embd: int
    n_head: int
    n_head_kv: tuple[int, ...]      # one per layer (GGUF may store a scalar or a per-layer array)
    head_dim_k: int
    head_dim_v: int
    n_ff: int                       # dense FFN width, or n_ff_exp * n_expert_used for MoE
    n_vocab: int
    tensor_bytes: dict[str, int]    # ggml type name -> bytes in the file
    n_weights: int                  # elements of every tensor
    max_tensor_elems: int = 0       # elements of the largest tensor (a stacked expert tensor in MoE files)
    # every tensor as (name, ggml type, GGUF shape): what the numpy backend's decoded forms are counted from
    tensors: tuple[tuple[str, int, tuple[int, ...]], ...] = field(default=(), compare=False, repr=False)
    sizes: tuple[int, ...] = field(default=(), compare=False, repr=False)   # each tensor's stored bytes, same order
    n_expert: int = 0               # routed experts per layer (0: dense)
    state_bytes: int = 0            # a slot's recurrent state (linear-attention layers), float32 as held
    n_expert_used: int = 0          # routed experts each row takes (0: dense)
    n_rot: int = 0                  # rotated dims of a head (0: the key length, the file's default)
    n_ff_shexp: int = 0             # a shared expert's FFN width (qwen35moe; 0: none)
    # a linear-attention layer's conv channels, value width and value heads (hybrid files)
    ssm_widths: tuple[int, int, int] = (0, 0, 0)
    message_starts: bool = False    # the vocabulary and the chat template carry <|im_start|> (checkpoints are kept)
    # copies of a slot's recurrent state the engine keeps at message starts (--ctx-checkpoints, set by make_plan
    # where the file has a recurrent state and message starts), each state_bytes, counted with the state
    n_checkpoints: int = 0
    # -ub: the most ids one prompt pass computes, set by make_plan where given (0: the backend's own pass)
    ubatch: int = 0


def _pad(n: int, to: int) -> int:
    return -(-n // to) * to


def _int_key(meta: dict, key: str, default=None, allow_list: bool = False):
    v = meta.get(key, default)
    ok = isinstance(v, int) and not isinstance(v, bool) and v >= 1
    if allow_list and isinstance(v, list):
        ok = bool(v) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)
    if not ok:
        got = "missing" if v is None else repr(v if not isinstance(v, list) else v[:8])
        raise PlanError(f"model key {key} is {got}; it must be a positive integer")
    return v


def _int_or_0(meta: dict, key: str) -> int:
    """An optional positive integer key (a scratch term's size), 0 where it is absent or not one."""
    v = meta.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 0


def model_facts(gguf_file) -> ModelFacts:
    """The facts a plan needs, from an open GGUFFile's header (no tensor data read)."""
    meta = gguf_file.metadata
    arch = gguf_file.arch()
    n_layer = _int_key(meta, f"{arch}.block_count")
    n_embd = _int_key(meta, f"{arch}.embedding_length")
    n_head = _int_key(meta, f"{arch}.attention.head_count")
    kv = _int_key(meta, f"{arch}.attention.head_count_kv", n_head, allow_list=True)
    n_head_kv = tuple(kv) if isinstance(kv, list) else (kv,) * n_layer
    if len(n_head_kv) != n_layer:
        raise PlanError(f"model key {arch}.attention.head_count_kv has {len(n_head_kv)} entries, "
                        f"{arch}.block_count is {n_layer}")
    if n_embd % n_head and (f"{arch}.attention.key_length" not in meta):
        raise PlanError(f"{arch}.embedding_length {n_embd} is not a multiple of head_count {n_head} "
                        f"and {arch}.attention.key_length is missing")
    dk = _int_key(meta, f"{arch}.attention.key_length", n_embd // n_head)
    dv = _int_key(meta, f"{arch}.attention.value_length", n_embd // n_head)
    n_expert = meta.get(f"{arch}.expert_count", 0) or 0
    if n_expert:
        n_ff = (_int_key(meta, f"{arch}.expert_feed_forward_length")
                * _int_key(meta, f"{arch}.expert_used_count"))
    else:
        n_ff = _int_key(meta, f"{arch}.feed_forward_length")
    tokens = meta.get("tokenizer.ggml.tokens")
    n_vocab = len(tokens) if isinstance(tokens, (list, StringArray)) else _int_key(meta, f"{arch}.vocab_size")
    by_type: dict[str, int] = {}
    n_weights = max_elems = 0
    for t in gguf_file.tensors.values():
        by_type[t.type_name] = by_type.get(t.type_name, 0) + t.n_bytes
        n = math.prod(t.shape)
        n_weights += n
        max_elems = max(max_elems, n)
    tensors = tuple((name, int(t.ggml_type), tuple(int(s) for s in t.shape)) for name, t in gguf_file.tensors.items())
    sizes = tuple(int(t.n_bytes) for t in gguf_file.tensors.values())
    n_head_kv, state_bytes, ssm_widths = _recurrent_terms(meta, arch, n_layer, n_head_kv)
    from bloomery.engine.scheduler import message_start_id
    starts = bool(state_bytes) and message_start_id(meta) is not None
    return ModelFacts(arch, n_layer, _int_key(meta, f"{arch}.context_length"), n_embd, n_head,
                      n_head_kv, dk, dv, n_ff, n_vocab, dict(sorted(by_type.items())), n_weights, max_elems,
                      tensors, sizes, int(n_expert), state_bytes,
                      _int_or_0(meta, f"{arch}.expert_used_count") if n_expert else 0,
                      _int_or_0(meta, f"{arch}.rope.dimension_count"),
                      _int_or_0(meta, f"{arch}.expert_shared_feed_forward_length") if n_expert else 0, ssm_widths,
                      starts)


def _recurrent_terms(meta: dict, arch: str, n_layer: int,
                     n_head_kv: tuple[int, ...]) -> tuple[tuple[int, ...], int, tuple[int, int, int]]:
    """A hybrid file's (KV heads per layer, recurrent state bytes per slot, a linear-attention layer's conv
    channels, value width and value heads): its linear-attention
    layers and its MTP layers hold no KV (llama.cpp's hybrid memory keeps KV for the trunk's
    full-attention layers), each linear-attention layer a float32 conv window and delta-rule state
    per slot. Other files: unchanged, 0, (0, 0, 0)."""
    if f"{arch}.ssm.state_size" not in meta:
        return n_head_kv, 0, (0, 0, 0)
    from bloomery.engine.models.base import ModelError
    from bloomery.engine.models.layers import DeltaNetParams, recurrent_layers
    try:
        n_trunk = n_layer - int(meta.get(f"{arch}.nextn_predict_layers", 0))
        recurrent = recurrent_layers(meta.get, arch, n_trunk)
        dn = DeltaNetParams(*(int(meta[f"{arch}.ssm.{k}"]) for k in
                              ("conv_kernel", "state_size", "group_count", "time_step_rank", "inner_size")))
    except (KeyError, TypeError, ValueError, ModelError) as e:
        raise PlanError(f"model keys {arch}.ssm.*: {e}") from None
    if dn.problem():
        raise PlanError(f"model keys {arch}.ssm.*: {dn.problem()}")
    kv = tuple(0 if il >= n_trunk or recurrent[il] else h for il, h in enumerate(n_head_kv))
    return kv, 4 * dn.state_floats * sum(recurrent), (dn.conv_channels, dn.d_inner, dn.dt_rank)


def checkpoint_bytes_for(facts: ModelFacts) -> int:
    """One slot's checkpoints at their most: n_checkpoints copies of its recurrent state."""
    return max(facts.n_checkpoints, 0) * facts.state_bytes


def layout_of(facts: ModelFacts) -> offload.Layout:
    """The facts as the offload arithmetic reads them; facts built without their tensors are one block."""
    if facts.tensors and len(facts.sizes) == len(facts.tensors):
        return offload.layout(facts.tensors, facts.sizes, facts.n_layer, facts.n_expert)
    return offload.Layout(facts.n_layer, 0, {"weights": sum(facts.tensor_bytes.values())},
                          ((),) * facts.n_layer, (0,) * facts.n_layer)


def rope_bytes_for(facts: ModelFacts, n_ctx_slot: int, backend: str) -> int:
    """numpy: RoPE's cos and sin table, kept for every position seen (engine/cpu/backend.rope_table),
    counted with the KV cache since it grows with the positions the slots reach. cuda: none."""
    if backend != "numpy" or not facts.n_head:
        return 0
    from bloomery.engine.cpu.backend import rope_table_bytes
    return rope_table_bytes(n_ctx_slot, facts.n_rot or facts.head_dim_k)


@lru_cache(maxsize=8)
def _numpy_decoded(tensors: tuple) -> int:
    from bloomery.engine.cpu.forms import decoded_bytes
    return decoded_bytes(tensors)


def decoded_bytes_for(facts: ModelFacts, backend: str) -> int:
    """The backend's decoded forms of the weights, as it will hold them after its first requests
    (numpy: int rows, planes, float copies; cuda: none, it computes from the stored blocks)."""
    return _numpy_decoded(facts.tensors) if backend == "numpy" and facts.tensors else 0


def kv_bytes_for(facts: ModelFacts, n_ctx: int, bytes_per_elem: int) -> int:
    """K and V for n_ctx positions (all slots together) over every layer."""
    per_pos = sum(h * (facts.head_dim_k + facts.head_dim_v) for h in facts.n_head_kv)
    return n_ctx * per_pos * bytes_per_elem


def scratch_bytes_for(facts: ModelFacts, n_ctx_slot: int, backend: str = "numpy", n_slots: int = 1,
                      rows: int = 0, graphs: bool = False) -> int:
    """Transient bytes at the peak of one prompt pass or decode step (what is allocated during it and
    handed back after).

    numpy: _numpy_scratch, counted from the backend's own arrays.
    cuda (an estimate; the card tests hold it above the measured peak): float32/f16 activations of a
    `rows`-row pass (default CUDA_UBATCH) with MoE rows padded by half for the grouping, the attention's
    score chunk (CUDA_SCORE_BYTES f32 + its f16 probabilities), one row of logits, and the f16 copies
    of up to three weights at once that the GEMM path makes: the largest tensor where the pass may take
    the grouped expert path (MoE gate, up and down stacks) or the head; where every routed layer takes
    the planned path at `rows` rows and at most DECODE_ROWS slots finish in a pass (so the head stays on
    the mat-vec kernels), the largest other tensor (cuda_host_pass_rows). With `graphs` (the whole card:
    no host experts), also the pools of the captured short prompts (_cuda_prompt_graph_bytes), which the
    warm-up makes and which stay.
    """
    if backend == "cuda":
        rows = min(rows or CUDA_UBATCH, facts.ubatch or CUDA_UBATCH)
        kv_width = 2 * max(facts.n_head_kv) * facts.head_dim_k
        q_width = (facts.n_head + kv_width // facts.head_dim_k) * facts.head_dim_k
        per_row = 6 * facts.n_embd + 2 * q_width + 6 * facts.n_ff
        copied = facts.max_tensor_elems
        if _planned_experts(facts) and rows * facts.n_expert_used <= PLANNED_MAX_PAIRS and n_slots <= CUDA_DECODE_ROWS:
            copied = _largest_dense_elems(facts)
        return (3 * 2 * copied + 4 * rows * per_row + CUDA_SCORE_BYTES * 3 // 2 + 4 * facts.n_vocab
                + _cuda_delta_scratch(facts, rows) + (_cuda_prompt_graph_bytes(facts, per_row, n_ctx_slot) if graphs else 0))
    return _numpy_scratch(facts, n_ctx_slot, n_slots)


def _planned_experts(facts: ModelFacts) -> bool:
    """Whether every routed layer's experts take the cuda prompt path's planned kernels (cuda/moe.py
    planned_fits: gate and up of one type, every type one moe_mm.cu reads, inner sizes whole steps)."""
    if not facts.n_expert or not facts.n_expert_used or not facts.tensors or facts.n_expert > PLANNED_MAX_EXPERTS:
        return False
    by_layer: dict[str, dict[str, tuple[int, tuple]]] = {}
    for name, ggml_type, shape in facts.tensors:
        for part in ("gate", "up", "down"):
            if name.endswith(f".ffn_{part}_exps.weight"):
                by_layer.setdefault(name.rsplit(".ffn_", 1)[0], {})[part] = (ggml_type, shape)
    if not by_layer:
        return False
    for got in by_layer.values():
        if set(got) != {"gate", "up", "down"}:
            return False
        (tg, sg), (tu, _), (td, sd) = got["gate"], got["up"], got["down"]
        if tg != tu or tg not in PLANNED_TYPES or td not in PLANNED_TYPES:
            return False
        if len(sg) != 3 or sg[0] % PLANNED_BK or sg[1] % PLANNED_BK:
            return False
    return True


def cuda_host_pass_rows(facts: ModelFacts) -> int:
    """Rows of a cuda prompt pass when routed experts live in host RAM: as many as keep every routed
    layer on the planned expert path and its activations small (HOST_PASS_PAIRS (token, expert) pairs; 2,048
    ids at 8 experts a token), so the pass makes no f16 copy of an expert stack; the card bytes this frees
    hold routed experts instead. CUDA_UBATCH where the planned path does not apply."""
    own = min(CUDA_UBATCH, facts.ubatch or CUDA_UBATCH)
    if not _planned_experts(facts):
        return own
    return min(own, max(CUDA_DECODE_ROWS + 1, HOST_PASS_PAIRS // facts.n_expert_used))


def _cuda_prompt_graph_bytes(facts: ModelFacts, per_row: int, n_ctx_slot: int) -> int:
    """The pool the captured passes of short prompts share (engine/cuda/graph.py), one graph a bucket of rows:
    the most one pass allocates, past DECODE_ROWS rows the f16 copies of two dense weights at once
    (cuBLAS's operands), its rows' activations and 4 MiB beside (the head's row, the int8 forms), and each
    graph's own inputs and logits row; the buckets a slot of n_ctx_slot positions holds (graph.py captures
    no other), and the buckets from position 0 their own attention's buffers. Measured on the H200 (the 30B-shaped
    file): session 18, a pool a graph, 3.6, 32.6, 33.2 and 34.4 MiB for 8, 16, 32 and 64 rows; session 19, one pool
    for 8-128 rows, 52 MiB where this counts 77. 0 for a
    model with a recurrent state, whose prompts are not captured."""
    if facts.ssm_widths[0]:
        return 0
    buckets = [b for b in CUDA_PROMPT_BUCKETS if b <= n_ctx_slot]
    if not buckets:
        return 0
    dense = _largest_dense_elems(facts)
    widest = max((2 * 2 * dense if b > CUDA_DECODE_ROWS else 0) + 4 * b * per_row + 4 * MIB
                 + (_cuda_own_attention_bytes(facts, b) if b in CUDA_PROMPT_FROM_START else 0) for b in buckets)
    return widest + len(buckets) * (4 * facts.n_vocab + 2 * MIB)


def _cuda_own_attention_bytes(facts: ModelFacts, rows: int) -> int:
    """A captured prompt from position 0 attending over its own rows (cuda/attention.py _gemm_path, Rows.fresh): the
    f32 scores and f16 probabilities of every head's rows x rows (a power of two of elements), the scaled queries
    in f32 and f16, the output chunk (a power of two), and the pass's own K and V in f16."""
    dh = facts.head_dim_k
    pow2 = lambda n: 1 << max(0, n - 1).bit_length()    # noqa: E731
    return (6 * pow2(facts.n_head * rows * rows) + 6 * rows * facts.n_head * dh
            + 4 * pow2(rows * facts.n_head * dh) + 4 * rows * max(facts.n_head_kv) * dh)


def _largest_dense_elems(facts: ModelFacts) -> int:
    """Elements of the largest tensor that is neither a routed expert stack, the embedding nor the head: the
    largest weight a pass past DECODE_ROWS rows copies to f16 when its experts take the planned kernels."""
    return max((math.prod(shape) for name, _, shape in facts.tensors
                if "_exps." not in name and not name.startswith(("token_embd.", "output."))), default=0)


def _cuda_delta_scratch(facts: ModelFacts, rows: int = CUDA_UBATCH) -> int:
    """A hybrid file's linear-attention layer in a cuda prompt pass (an estimate, not yet checked against the
    card): the projections and the conv's output a row (q, k, v fused, z, the window's concatenation, q and
    k normalised, the delta rule's output, its norm and gate). The delta rule itself runs in place on the
    state (kernels/recurrent.cu delta_scan); the chunked form of the array code, whose group of chunks took
    about as much again, runs only where BLOOMERY_CUDA_RECURRENT=array asks for it. 0 for other files."""
    channels, inner, n_v = facts.ssm_widths
    if not channels:
        return 0
    return 4 * rows * (3 * channels + 5 * inner)


F32 = 4                          # bytes of one float32 activation
ACT_CODES = 1 + 4 / 256 + 2 / 16  # bytes per element of an input quantized for the compiled kernels (formats.CAct):
                                 # q8_K's int8 code, f32 scale per 256 and int16 sum per 16 (q8_0's 1 + 4/32 is less)
SIGMOID_BYTES = 72               # per element of NumpyOps.sigmoid: the negated input, ops_math.expf_libm's seven
                                 # float64/int64 locals and its polynomial's products, 1 + e and the result


def _compiled_attention(head_dim: int) -> bool:
    """The numpy backend's attention runs in the compiled kernels (cpu/kv_cache.py: head sizes up to 1024)."""
    from bloomery.engine.cpu import kernels as cpu_kernels
    return head_dim <= 1024 and cpu_kernels.lib() is not None


def _compiled_products() -> bool:
    """The numpy backend's quantized products run in the compiled kernels (cpu/backend._compiled)."""
    from bloomery.engine.cpu import kernels as cpu_kernels
    from bloomery.engine.quant import formats
    return formats.KERNEL_ORDER and cpu_kernels.lib() is not None


def _row_chunks(n_rows: int, nc: int, macs: int, multiple: int = 1) -> tuple[int, int]:
    """quant/threads.row_chunks' split: (rows a chunk, chunks alive at once: one per worker thread)."""
    from bloomery.engine.quant.threads import N_THREADS, PARALLEL_MIN_MACS
    parallel = N_THREADS > 1 and macs >= PARALLEL_MIN_MACS
    if parallel:
        nc = min(nc, -(-n_rows // N_THREADS))
    nc = min(n_rows, max(multiple, nc - nc % multiple))
    return nc, (min(N_THREADS, -(-n_rows // nc)) if parallel else 1)


def _chunk_bytes(per_row_bytes: int, n: int, n_rows: int) -> tuple[int, int]:
    """A chunked product's first chunk of n rows in bytes, and the next one's (0 where there is none)."""
    return per_row_bytes * n, per_row_bytes * min(n, max(0, n_rows - n))


def _numpy_product_temps(ggml_type: int, t: int, k: int, n_rows: int, per_row: bool = False) -> int:
    """Bytes the numpy fallback kernels (no compiled kernels) allocate inside one [T, K] @ [N, K]^T
    weight product beyond its output [T, N], at their peak, from their chunking (quant/*.py); per_row
    as dot_llama's (an expert's rows). X = T K 4, the activation's bytes in f32. Upper bounds: every
    `a.astype(..) * b` counted as two arrays (numpy may reuse the first in place, not here, measured),
    chunks on the worker threads counted at the size of the first."""
    from gguf import GGMLQuantizationType as QT
    from bloomery.engine.quant import common, formats, q8_0
    qt, x = QT(ggml_type), t * k * F32
    if qt == QT.F32:       # floats.dot_f32_llama: x in f64 (2X); per chunk of rows the accumulator [T, n, 16 or 64]
        width = 16 if t >= 2 and n_rows % 4 == 0 else 64   # f32 (A), x*w and x*w + acc in f64 (2A each)
        n = min(n_rows, max(1, common.MAX_TMP_ELEMS // (t * width)))
        return 2 * x + 5 * t * n * width * F32
    if qt == QT.F16:       # the input cut to f16 and widened back
        return x // 2 + x
    if qt not in formats.EXACT_TYPES:
        return 0           # the float fallback: x @ the kept dense form
    kernel_order = formats.KERNEL_ORDER
    if kernel_order and qt == QT.Q6_K and t >= 8:
        # k_quants._dot_q6_K_tiled: quantize_q8_K's peak, then its codes qa and their block-major copy (2X);
        # per chunk of n rows (E = S T n 4, S = K/16 sub-blocks): the block sums isum [S, T, n] f32 (E),
        # isum times the sub-block scales in f64 (2E) and its sum per super-block s1 [Bs, T, n] f64 (E/8);
        # from the second chunk on the previous chunk's s1, r (E/16, f32) and f64 products (E/8) beside them
        s = k // 16
        n = min(n_rows, max(8, common.MAX_TMP_ELEMS // (s * t)))
        e, e2 = _chunk_bytes(s * t * F32, n, n_rows)
        return 2 * x + max(e * 25 // 8, e2 * 25 // 8 + e * 5 // 16)
    if kernel_order and qt == QT.Q6_K:
        # k_quants._dot_q6_K_lanes (T < 8): qa and its lane-ordered copy (2X); per chunk (E = S n T 4 bytes of
        # the half sums [Bs, 2, 8, n, T] f32): half (E), corr [Bs, 8, n, T] f32 (E/2), lanes in f64 (E), then
        # lanes cut to f32 (E/2) and widened again (E) beside the old lanes
        s = k // 16
        n = min(n_rows, max(8, common.MAX_TMP_ELEMS // (s * t)))
        return 2 * x + 4 * s * n * t * F32
    if kernel_order and qt == QT.Q4_K and n_rows % 8 == 0:
        # k_quants._dot_q4_K_repacked: qa and qa_b (2X; the tie rule's mask, X/4, before them); per chunk
        # (E = S T n 4, S = K/32): isum (E), sums per 64 and the mins' sums [Bs, 4, T, n] f32 (E/2 each),
        # d_w d_a and dmin d_a [Bs, T, n] f64 (E/4 each), then per row group the products in f64: the
        # gemm's rows (T - T%4, none per_row) [Bs, 4, T, n] f64 (E) for the sums, the mins' f64 copy and
        # their product (E each); from the second chunk on the previous chunk's mins product (E) and its
        # two accumulators [T, n] f32 are still bound. Where every row is a gemv row (T < 4, or per_row) the
        # sums per super-block come first (E/8 each, their f64 products E/4 each and the mins' f64 copy E/4):
        # 7E/2 and the accumulators; the previous chunk's products (E/4) beside the next. A gemm with T%4
        # gemv rows after it stays under 5.5E: the gemv's arrays are those few rows'.
        s = k // 32
        n = min(n_rows, max(8, common.MAX_TMP_ELEMS // (s * t)))
        e, e2 = _chunk_bytes(s * t * F32, n, n_rows)
        accs = 2 * t * n * F32
        if per_row or t < 4:
            return 2 * x + max(e * 7 // 2, e2 * 7 // 2 + e // 4) + accs
        return 2 * x + max(e * 11 // 2, e2 * 11 // 2 + e + accs)
    if kernel_order and qt in (QT.Q8_0, QT.Q5_0) and not (
            qt in q8_0.AXPY_TYPES and q8_0.USE_SAXPY and q8_0._saxpy_rows(n_rows)):
        # q8_0._dot_q8_0_lanes: qa (X) and the block-diagonal lanes [B, 32, 8T] f32 (8X); per chunk of n rows
        # (L = B n 8T 4, B = K/32), on each worker thread: the lane sums (L), d_w d_a [B, n, 1, T] f64 (L/4),
        # the products in f64 (2L), the accumulator [n, 8, T] f32 (L/B) and hsum8's four [T, n] sums (L/2B)
        b = k // 32
        nc = max(1, min(n_rows, max(64, common.CHUNK_BYTES // (b * 8 * t * 8))))
        n, threads = _row_chunks(n_rows, nc, t * n_rows * b * 32)
        lanes = b * n * 8 * t * F32
        return 9 * x + threads * (lanes * 13 // 4 + lanes * 3 // (2 * b))
    if kernel_order and qt in q8_0.AXPY_TYPES:
        # q8_0._dot_q8_0_axpy: qa (X) and the lanes [B, 32, 8T] (8X), for T > 1 copied in (T, lane) order
        # beside the first (17X at once, before the chunks); per chunk of n rows on each worker thread: the lane sums
        # [B, 8T, n] f32 (L), the accumulator (L/B) and hsum8's four [T, n] sums (L/2B)
        b = k // 32
        nc = n_rows if n_rows <= 1024 else max(256, q8_0.AXPY_CHUNK_BYTES // (b * 8 * t * 4))
        n, threads = _row_chunks(n_rows, nc, t * n_rows * b * 32, q8_0._saxpy_rows(n_rows))
        lanes = b * 8 * t * n * F32
        return max(17 * x if t > 1 else 0, 9 * x + threads * (lanes + lanes * 3 // (2 * b)))
    # common.exact_dot (dot_planes: every other exact type, and every type where BLOOMERY_KERNEL_ORDER=off):
    # the codes (quantize's peak 2X) and their block-major copy; per chunk (E = S T n 4) the sums isum (E)
    # and the family's combine: scales times sums in f64 (2E) and their partial sums beside them, bounded
    # here by 2E more; the previous chunk's isum is freed only once the next is made (E). Not measured.
    s = k // (32 if qt in q8_0.VEC_DOT_TYPE else 16 if qt == QT.Q6_K else 32)
    n = min(n_rows, max(1, common.MAX_TMP_ELEMS // (s * t)))
    e = s * t * n * F32
    return 2 * x + 5 * e + (e if n < n_rows else 0)

def _chunked_delta_rule(t: int, channels: int, inner: int, n_v: int) -> int:
    """A linear-attention layer's peak in the chunked delta rule (cpu/recurrent.delta_rule_chunked) over a span
    of t rows padded to P (whole chunks of DELTA_CHUNK = c rows): beside the layer's fused q, k, v, its conv
    output, the gate z and the normed q and k (3 [t, channels] in all), the output [t, inner]; the chunked q,
    k and v [P, inner] each; the decay mask, the system I + A and q k^T [P, H, c] each; and one chunk's solve,
    which numpy runs in float64: its right-hand side in f32 and f64, the f64 solution and its f32 copy
    (measured 10-12 [c, inner] in all), and the system in f64 [H, c, c]."""
    c = cpu_sizes.DELTA_CHUNK
    p = -(-t // c) * c
    return (3 * t * channels + t * inner + 3 * p * inner + 3 * p * n_v * c + 11 * c * inner + 2 * n_v * c * c) * F32


def _numpy_scratch(facts: ModelFacts, n_ctx_slot: int, n_slots: int) -> int:
    """The numpy backend's transient peak: the largest of the moments below, each the arrays alive at
    once (models/layers.py over cpu/backend.py, the compiled kernels on). T = rows of the largest
    prompt pass, L = a slot's positions; D, H, Hkv, Dh, F as the legend of models/layers.py.

    Alive through the whole pass: the embedded rows (the model's _run keeps them) and the block's
    input, 2 x [T, D] (the same array in a one-layer model). On top of them, whichever is largest:
      attention: the norm's output [T, D] and q, k, v [T, (H + 2 Hkv) Dh], then
        - Q/K/V's products: the input's codes (2 sets: Q4_K's gemm rows and Q6_K's are quantized
          apart) and, with biases, q, k, v before the bias add;
        - RoPE of q (then of k, q's result beside it), after the per-head norms where the model has
          them (qwen3 and later: normed copies of q and k, each dropped once rotated): the cos and
          sin tables, x0 and x1 widened to f64, the output copy, x0*cos and x1*sin in f64 and one of
          them cast to f32: (18 n_rot + 4 Dh) bytes per head and row;
        - the attention: rotated q and k, the span's output and the backend's [T, H, Dh] beside it,
          K widened to f32 for the tiled path [L, Hkv, Dh] and each thread's row of scores [L];
        - the output projection: its input, the input's codes, the product and the residual sum;
        - without the compiled kernels (BLOOMERY_CPU_KERNELS=off, or no C compiler), the numpy
          attention's tiled path instead: q grouped in f32 and f64, K and V widened to f32 [L, Hkv,
          Dh], and the scores [H, T, L] in f32 with each FMA step's f64 product and f32 result
          beside them (16 bytes a score); the numpy kernels' own chunk temporaries in the products
          are in _numpy_fallback_moments;
        - a hybrid's gated attention: the output beside a copy of the gate [T, H Dh] each, and the
          gate's sigmoid (SIGMOID_BYTES per element);
        - a hybrid's linear-attention layer (in its place): the norm's output, the output gate z
          [T, d_inner], the fused q, k, v [T, C] and, in the conv step, its output, the window, the
          running sum and one tap's product [T, C] each; or the chunked delta rule's solve
          (_chunked_delta_rule);
      dense FFN (the down projection): the attention half's output, the norm's output, gate, up
        and their SwiGLU [T, F] each, the SwiGLU's codes and the product [T, D];
      routed FFN: the attention half's and norm's outputs, router logits [T, E], ids (int64) and
        weights [T, A], the outputs per rank [T, A, D], and the experts: with the compiled products
        the one call's buffers (engine/cpu/sizes.moe_call_bytes), an expert in flight on each thread,
        counted at T rows (a router may send every row of a pass to one expert) of which a worker
        holds at most MOE_CHUNK_ROWS at once; without them the per-expert loop's, for one expert at T
        rows: its rows' ids, its input [T, D], and the larger of gate + up + SwiGLU [T, Fe] each with
        the previous expert's SwiGLU still bound to the loop's name (its T rows too where rows take
        two or more experts), and SwiGLU + its codes + the down product;
        beside them a shared expert's gate and up [T, Fs] and its gate logit [T] (qwen35moe);
      a decode step's head: logits [B, V] with their NaN mask for B = every slot, and for one row its
        copy, negation and argpartition's int64 order (top-k picks); with routed experts and the compiled
        products, beside it the one-call MoE layer's buffers (engine/cpu/sizes.moe_call_bytes) for an
        expert in flight on each thread and its outputs per rank twice, at its most rows (MOE_CALL_MAX_ROWS).
    Without the compiled products (BLOOMERY_CPU_KERNELS=off, no C compiler, or BLOOMERY_KERNEL_ORDER=off)
    each weight product's own temporaries in the numpy kernels as well (_numpy_fallback_moments): tens to
    hundreds of MB, set by the kernels' chunk sizes and the worker threads more than by the model.
    """
    from bloomery.engine.quant.threads import N_THREADS          # the attention's score rows, one per thread
    t = min(N_UBATCH, facts.ubatch or N_UBATCH, n_slots * n_ctx_slot)
    d, h, dh, v = facts.n_embd, facts.n_head, facts.head_dim_k, facts.n_vocab
    hkv = max(facts.n_head_kv) or h
    rot = facts.n_rot or dh
    names = {name.split(".", 2)[-1] for name, _, _ in facts.tensors}
    biased = "attn_q.bias" in names if names else facts.arch == "qwen2"
    qk_norm = "attn_q_norm.weight" in names if names else facts.arch != "qwen2"
    channels, inner, n_v = facts.ssm_widths                    # hybrid files: (0, 0, 0) in others
    row = t * d * F32                                          # one [T, D] activation
    held = (2 if facts.n_layer > 1 else 1) * row
    qkv = t * ((2 if channels else 1) * h + 2 * hkv) * dh * F32   # a hybrid's Q projection holds each head's gate
    norm = F32 if qk_norm else 0                               # bytes per element of a normed copy
    tables = 12 * t * rot                                      # RoPE's cos and sin [T, n_rot/2] in f32 and f64
    attention = row + qkv + max(
        (qkv if biased else 0) + 2 * ACT_CODES * t * d,
        t * (h + hkv) * dh * norm + tables + t * h * (18 * rot + 4 * dh),
        t * hkv * dh * norm + t * h * dh * F32 + tables + t * hkv * (18 * rot + 4 * dh),
        t * (h + hkv) * dh * F32 + 2 * t * h * dh * F32 + n_ctx_slot * (hkv * dh + N_THREADS) * F32,
        t * h * dh * (F32 + ACT_CODES) + 2 * row,
        (2 * F32 + SIGMOID_BYTES) * t * h * dh if channels else 0)
    if not _compiled_attention(dh):                              # the numpy attention's tiled path over L positions
        attention = max(attention, row + qkv + t * (h + hkv) * dh * F32 + t * h * dh * (2 * F32 + 8)
                        + 8 * hkv * dh * n_ctx_slot + 16 * t * h * n_ctx_slot)
    if channels:                                               # a linear-attention layer's conv step
        attention = max(attention, row + t * inner * F32 + 5 * t * channels * F32,
                        _chunked_delta_rule(t, channels, inner, n_v))
    if facts.n_expert:
        a = facts.n_expert_used or 1
        fe = facts.n_ff // a
        if _compiled_products():             # the experts in one compiled call: its buffers, a worker each
            experts = min(N_THREADS, facts.n_expert) * cpu_sizes.moe_call_bytes(t, d, fe)
        else:                                # the per-expert loop's arrays
            experts = 16 * t + row + max((4 if a > 1 else 3) * t * fe * F32, 2 * t * fe * F32 + ACT_CODES * t * d,
                                         t * fe * (F32 + ACT_CODES) + row, t * fe * F32 + 2 * row)
        ffn = (2 * row + t * facts.n_expert * F32 + t * a * (8 + F32) + t * a * d * F32
               + t * (2 * facts.n_ff_shexp + 1) * F32 + experts)
    else:
        ffn = 3 * row + t * facts.n_ff * (3 * F32 + ACT_CODES)
    decode = n_slots * v * (F32 + 1) + v * 16
    if facts.n_expert and _compiled_products():                 # a decode step's experts in one call (moe_ffn_rows)
        b, a = cpu_sizes.MOE_CALL_MAX_ROWS, facts.n_expert_used or 1       # a short prompt pass takes it too
        decode += (min(N_THREADS, facts.n_expert) * cpu_sizes.moe_call_bytes(b, d, facts.n_ff // a)
                   + 2 * b * a * d * F32)
    if not _compiled_products():
        attention, ffn, decode = (max(a, b) for a, b in zip(
            (attention, ffn, decode), _numpy_fallback_moments(facts, t, n_slots, row, qkv)))
    return int(max(held + attention, held + ffn, decode))


def _numpy_fallback_moments(facts: ModelFacts, t: int, n_slots: int, row: int, qkv: int) -> tuple[int, int, int]:
    """_numpy_scratch's product moments without the compiled kernels: (attention, FFN, decode head), each
    the arrays alive beside the product (as _numpy_scratch's legend) plus the largest product's own
    temporaries (_numpy_product_temps) over the weights that run there; T rows for every product of a
    prompt pass (an expert's too: a router may send it every row), B = every slot for the head."""
    by_name: dict[str, list] = {}
    for name, ggml_type, shape in facts.tensors:
        if len(shape) >= 2:
            by_name.setdefault(name.split(".", 2)[-1] if name.startswith("blk.") else name, []).append((ggml_type, shape))

    def temps(names, rows: int, per_row: bool = False) -> int:
        return max((_numpy_product_temps(ty, rows, shape[0], shape[1], per_row)
                    for n in names for ty, shape in by_name.get(n, ())), default=0)
    d, h, dh = facts.n_embd, facts.n_head, facts.head_dim_k
    channels, inner, _ = facts.ssm_widths
    attention = max(
        # the input projections: the norm's output and their outputs (q, k, v; a linear-attention layer's q, k, v
        # fused and z, its beta and alpha [T, H] left out: a few KB)
        row + max(qkv, t * (channels + inner) * F32)
        + temps(("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_qkv.weight", "attn_gate.weight",
                 "ssm_alpha.weight", "ssm_beta.weight"), t),
        # the output projection: its input, the product and the residual sum beside q, k, v
        row + qkv + t * max(h * dh, inner) * F32 + 2 * row + temps(("attn_output.weight", "ssm_out.weight"), t))
    if facts.n_expert:
        a = facts.n_expert_used or 1
        fe, fs, e = facts.n_ff // a, facts.n_ff_shexp, facts.n_expert
        routed = (2 * row + t * e * F32 + t * a * (8 + F32) + t * a * d * F32 + 16 * t + row
                  + t * (2 * fs + 1) * F32)                             # as _numpy_scratch's routed FFN
        ffn = max(
            # the router and a shared expert's gate and up: the norm's output and their outputs
            2 * row + t * (e + 2 * fs + 1) * F32
            + temps(("ffn_gate_inp.weight", "ffn_gate_shexp.weight", "ffn_up_shexp.weight"), t),
            # one expert's gate or up (the previous expert's SwiGLU still bound where rows take two or more)
            routed + (3 if a > 1 else 2) * t * fe * F32 + temps(("ffn_gate_exps.weight", "ffn_up_exps.weight"), t, True),
            # its down projection: the SwiGLU and the product
            routed + t * fe * F32 + row + temps(("ffn_down_exps.weight",), t, True),
            # the shared expert's down projection: the routed output beside its gate, up, SwiGLU and product
            3 * row + 3 * t * fs * F32 + row + temps(("ffn_down_shexp.weight",), t))
    else:
        ffn = max(2 * row + 2 * t * facts.n_ff * F32 + temps(("ffn_gate.weight", "ffn_up.weight"), t),   # gate or up
                  3 * row + 3 * t * facts.n_ff * F32 + temps(("ffn_down.weight",), t))                 # down
    head = "output.weight" if "output.weight" in by_name else "token_embd.weight"
    b, v = n_slots, facts.n_vocab
    decode = b * v * F32 + temps((head,), b)                            # the whole head's product [B, V]
    if any(ty == 8 for ty, _ in by_name.get(head, ())):                 # a Q8_0 head's picks: q8_0._estimate
        from bloomery.engine.quant.threads import N_THREADS
        blocks = d // 32                                                # est and bound [B, V] f64, and per chunk of
        nc = min(8192, -(-v // N_THREADS))                              # 8192 rows on each thread the block sums
        decode = max(decode, 16 * b * v + N_THREADS * blocks * nc * b * (F32 + 8))   # [B, n, T] f32, in f64
    return attention, ffn, decode


CASES = {"whole": "the model fits the card: every tensor there",
         "budget": "the model does not fit the card: it holds every tensor but the routed experts, the KV cache, "
                   "scratch and the pinned staging, then as many routed experts as its bytes hold, spread over the "
                   "layers; the rest are in host RAM",
         "flags": "the placement flags place the tensors they name; every other tensor is on the main card"}


def _expert_bytes(p: Placement, plan: "Plan") -> tuple[int, ...]:
    return plan.expert_bytes if p.n_expert else ()


def placement_lines(p: Placement) -> list[tuple[str, str, dict]]:
    """The placement case, and per run of layers alike how many routed experts sit on a card, and why."""
    off = sum(1 for t in p.tensors if t.device == "host")
    lines = [("info", f"placement \"{p.case}\": {CASES[p.case]}", {"case": p.case, "host_tensors": off})]
    runs: list[list] = []
    for layer, (k, why) in enumerate(zip(p.experts_on_card, p.layer_why)):
        if runs and runs[-1][2:] == [k, why]:
            runs[-1][1] = layer
        else:
            runs.append([layer, layer, k, why])
    for a, b, k, why in runs:
        span = f"layer {a}" if a == b else f"layers {a}-{b}"
        lines.append(("info", f"{span}: {k} of {p.n_expert} routed experts on a card ({why})",
                      {"layers": f"{a}-{b}", "experts_on_card": k, "why": why}))
    return lines


@dataclass(frozen=True)
class Plan:
    backend: str
    arch: str
    n_ctx: int                      # total positions, every slot together
    n_ctx_slot: int
    n_slots: int
    ctx_rule: str                   # "set", "target" or "fitted"
    n_ctx_train: int
    tensor_bytes: dict[str, int]    # ggml type name -> bytes
    weights_bytes: int              # the weights as stored
    kv_bytes: int
    scratch_bytes: int
    host_bytes: int
    card_bytes: tuple[int, ...]     # per card in the census (0 for a card the plan leaves off)
    terms: dict[str, int] = field(default_factory=dict)
    parallel_from: str = "set"      # "set" (a count, default 1) or "auto"
    decoded_bytes: int = 0          # the backend's decoded forms of the weights
    placement: Placement | None = None
    ctx_size: int = 0               # what was asked: -c (0: not given) and --slot-ctx
    slot_ctx: int = 0
    expert_bytes: tuple[int, ...] = ()   # per layer, one routed expert's stored bytes (MoE)
    prompt_cache_bytes: int = 0     # the prompt cache's budget on the host (beside host_bytes)
    prompt_cache_from: str = "default"   # "set" (-cram) or "default"
    checkpoint_bytes: int = 0       # every slot's checkpoints of its recurrent state at their most (in kv_bytes)
    pass_why: str = ""              # why prompt passes are shorter than the backend's own (placement.n_ubatch)

    def explain(self) -> list[tuple[str, str, dict]]:
        """The plan in words, for people (--plan prints these): (level, sentence, fields) per line.
        One line per device that holds something, "needs X of Y available" and each term in GiB;
        the context rule as it applied to this start; a warning when a slot's context passes the
        model's trained context."""
        lines: list[tuple[str, str, dict]] = []
        p = self.placement
        for d in (p.devices if p else ()):
            t = d.terms
            if not t.total:
                continue
            kept = "reserve" if d.device == "host" else "margin kept free"
            need = t.total if d.device == "host" else t.total - t.margin
            dense = t.weights - sum(k * b for k, b in zip(d.experts, _expert_bytes(p, self)))
            weights = ([f"dense weights {gib(dense)}", f"routed experts {gib(t.weights - dense)}"] if d.experts
                       else [f"weights {gib(t.weights)}"])
            parts = [*weights, *([f"decoded forms {gib(t.decoded)}"] if t.decoded else []),
                     f"KV {gib(t.kv)}", f"scratch {gib(t.scratch)}", f"pinned staging {gib(t.pinned)}",
                     f"{kept} {gib(t.margin)}"]
            parts = [s for s in parts if not s.endswith(" 0.000 GiB")]
            have = f"{gib(d.available)} available" if d.device == "host" else f"{gib(d.available)} free"
            fits = t.total + t.prompt_cache <= d.available
            beside = f", and the prompt cache up to {gib(t.prompt_cache)} beside it" if t.prompt_cache else ""
            lines.append(("info" if fits else "warning",
                          f"{d.device} needs {gib(need)} of {have}: {' + '.join(parts)}{beside}",
                          {"device": d.device, "need_bytes": need, "available_bytes": d.available}))
        if p and p.backend == "cuda":
            lines += placement_lines(p)
        if p and p.n_ubatch:
            lines.append(("info", f"prompt passes of at most {p.n_ubatch} ids: {self.pass_why}; the scratch is that "
                                  f"pass's", {"n_ubatch": p.n_ubatch}))
        slots = f"{self.n_slots} slot{'s' if self.n_slots != 1 else ''}"
        if self.ctx_rule == "target":
            why = (f"no -c given: each slot gets the model's trained context, {self.n_ctx_train} positions, "
                   f"and that fits")
        elif self.ctx_rule == "fitted":
            verb = "does" if self.n_slots == 1 else "do"
            why = (f"no -c given, and {slots} of the trained context ({self.n_ctx_train}) {verb} not fit: each slot "
                   f"gets the largest multiple of {FIT_STEP} that does, {self.n_ctx_slot} (never below {FIT_FLOOR})")
        elif self.slot_ctx:
            why = (f"--slot-ctx {self.slot_ctx} set it: each of {slots} gets {self.n_ctx_slot} "
                   f"(padded to {CTX_PAD}); a set context is never cut, one that does not fit is refused")
        else:
            share = (f"the one slot takes all of it, {self.n_ctx_slot}" if self.n_slots == 1 else
                     f"{slots} share it as llama-server's -np without -kvu, {self.n_ctx_slot} each")
            why = (f"-c {self.ctx_size} set it: {share} (padded to {CTX_PAD}); a set context is never cut, "
                   f"one that does not fit is refused")
        lines.append(("info", f"context rule \"{self.ctx_rule}\": {why}",
                      {"rule": self.ctx_rule, "n_ctx_slot": self.n_ctx_slot, "n_ctx": self.n_ctx}))
        lines.append(self._cache_line())
        if self.checkpoint_bytes:
            lines.append(("info", f"checkpoints at message starts: up to {gib(self.checkpoint_bytes)} of host RAM for "
                                  f"{slots}, counted in the host's KV term", {"checkpoint_bytes": self.checkpoint_bytes}))
        if self.parallel_from == "auto":
            lines.append(("info", f"--parallel auto: {slots}, the most (up to {MAX_AUTO_SLOTS}) whose plan holds one "
                                  f"request's context", {"slots": self.n_slots}))
        if self.n_ctx_slot > self.n_ctx_train:
            lines.append(("warning", f"a slot's context, {self.n_ctx_slot}, exceeds the model's trained context, "
                                     f"{self.n_ctx_train}: positions past {self.n_ctx_train} were never trained, and "
                                     f"answers that reach them may degrade", {"n_ctx_slot": self.n_ctx_slot,
                                                                             "n_ctx_train": self.n_ctx_train}))
        return lines

    def _cache_line(self) -> tuple[str, str, dict]:
        n = self.prompt_cache_bytes
        if self.prompt_cache_from == "set":
            why = f"-cram {n // MIB} set it" if n else "-cram 0 turned it off"
        else:
            why = (f"the default: the lesser of {gib(PROMPT_CACHE_MAX_BYTES)} and 1/{PROMPT_CACHE_SHARE} of the "
                   f"host RAM the plan leaves")
        return ("info", f"prompt cache {gib(n)} of host RAM: {why}", {"prompt_cache_bytes": n,
                                                                      "from": self.prompt_cache_from})

    def records(self) -> list[tuple[str, dict]]:
        plan = {"backend": self.backend, "arch": self.arch, "weights_bytes": self.weights_bytes,
                **{f"{k}_bytes": v for k, v in self.tensor_bytes.items()},
                "decoded_bytes": self.decoded_bytes, "kv_bytes": self.kv_bytes, "scratch_bytes": self.scratch_bytes,
                "prompt_cache_bytes": self.prompt_cache_bytes, "host_bytes": self.host_bytes,
                "cards": list(self.card_bytes)}
        ctx = {"n_ctx_slot": self.n_ctx_slot, "n_ctx": self.n_ctx, "rule": self.ctx_rule,
               "n_ctx_train": self.n_ctx_train}
        return [("plan", plan), ("ctx", ctx), ("parallel", {"slots": self.n_slots, "from": self.parallel_from}),
                ("need", {"bytes": self.host_bytes, "cards": list(self.card_bytes)})]


def _terms(facts: ModelFacts, backend: str, n_slots: int, n_ctx_slot: int) -> dict[str, int]:
    return {"weights": sum(facts.tensor_bytes.values()),
            "decoded": decoded_bytes_for(facts, backend),
            "kv": (kv_bytes_for(facts, n_slots * n_ctx_slot, KV_BYTES_PER_ELEM[backend])
                   + n_slots * facts.state_bytes + host_checkpoint_bytes(facts, backend, n_slots, "numpy")
                   + rope_bytes_for(facts, n_ctx_slot, backend)),
            "scratch": scratch_bytes_for(facts, n_ctx_slot, backend, n_slots, graphs=backend == "cuda")}


def host_checkpoint_bytes(facts: ModelFacts, backend: str, n_slots: int, where: str) -> int:
    """Every slot's checkpoints of its recurrent state at their most, counted where `where` ("numpy": the
    KV term of the numpy backend, whose state is on the host too; "cuda": beside the card's plan, in host
    RAM, where save_state copies them): 0 for the other backend."""
    return n_slots * checkpoint_bytes_for(facts) if backend == where else 0


def _place(facts, census, n_slots, n_ctx_slot, ask, fit_experts) -> offload.Result:
    """The card plan; the checkpoints of a recurrent state (host copies) in the host's KV term."""
    t = _terms(facts, "cuda", n_slots, n_ctx_slot)
    ck = host_checkpoint_bytes(facts, "cuda", n_slots, "cuda")
    short = scratch_bytes_for(facts, n_ctx_slot, "cuda", n_slots, rows=cuda_host_pass_rows(facts))
    r = offload.place(layout_of(facts), census.card_free_bytes, census.host_avail_bytes, ask, t["kv"],
                      t["scratch"], HOST_RESERVE_BYTES + ck, fit_experts, scratch_host=min(short, t["scratch"]))
    if not ck:
        return r
    host = r.devices[0]
    host = dataclasses.replace(host, terms=dataclasses.replace(host.terms, margin=host.terms.margin - ck,
                                                               kv=host.terms.kv + ck))
    return dataclasses.replace(r, devices=(host, *r.devices[1:]))


def _shortfall(facts, backend, census, n_slots, n_ctx_slot, ask=NO_ASK, fit_experts=False) -> str | None:
    """None when the plan fits; else the sentence naming what it needs and what is there."""
    t = _terms(facts, backend, n_slots, n_ctx_slot)
    need = t["weights"] + t["decoded"] + t["kv"] + t["scratch"]
    terms = f"weights {t['weights']} + kv {t['kv']} + scratch {t['scratch']}"
    if t["decoded"]:
        terms = f"weights {t['weights']} + decoded {t['decoded']} + kv {t['kv']} + scratch {t['scratch']}"
    if backend == "numpy":
        host = need + HOST_RESERVE_BYTES
        if host > census.host_avail_bytes:
            return (f"host needs {host} bytes ({terms} + reserve {HOST_RESERVE_BYTES}), "
                    f"{census.host_avail_bytes} available")
        return None
    try:
        _place(facts, census, n_slots, n_ctx_slot, ask, fit_experts)
    except offload.OffloadError as e:
        return str(e)
    return None


def _largest_slot(facts, backend, census, n_slots, hi: int, step: int, ask=NO_ASK) -> int:
    """The largest multiple of `step` <= hi whose plan fits (0 if none); the need grows with it."""
    lo, hi = 0, hi // step
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _shortfall(facts, backend, census, n_slots, mid * step, ask) is None:
            lo = mid
        else:
            hi = mid - 1
    return lo * step


# --parallel auto: the most slots it counts. 8: one decode step of all on the mat-vec path while a captured step took
# 8 rows; the cuda steps take CUDA_DECODE_ROWS = 16 in one graph now, but 16 slots' KV is only worth it once a step
# of 16 rows is measured to pay (left at 8 until then)
MAX_AUTO_SLOTS = 8


def _check_settings(facts, census, backend, ctx_size, n_parallel, slot_ctx) -> None:
    if backend not in KV_BYTES_PER_ELEM:
        raise PlanError(f"backend {backend!r} is not one of {sorted(KV_BYTES_PER_ELEM)}")
    if backend == "cuda" and not census.card_free_bytes:
        raise PlanError("backend 'cuda' needs a card, and the census lists none")
    if n_parallel == "auto":
        if ctx_size:
            raise PlanError(f"--parallel auto beside --ctx-size {ctx_size} is refused: auto counts "
                            f"slots of one request's context (--slot-ctx)")
    elif not isinstance(n_parallel, int) or isinstance(n_parallel, bool) or n_parallel < 1:
        raise PlanError(f"--parallel {n_parallel!r} must be an integer >= 1 or 'auto'")
    for name, v in (("--ctx-size", ctx_size), ("--slot-ctx", slot_ctx)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise PlanError(f"{name} {v!r} must be an integer >= 0 (0: the model's trained limit)")
    if ctx_size and slot_ctx:
        raise PlanError(f"--slot-ctx {slot_ctx} beside --ctx-size {ctx_size} is refused: one names "
                        f"the total, the other a slot's share")


def _choose_ctx(facts, census, backend, n: int, ctx_size: int, slot_ctx: int,
                ask=NO_ASK) -> tuple[int, str, bool]:
    """(n_ctx_slot, rule, experts moved off the card) for n slots, or a PlanError naming every term.
    As llama-server's fit: the context shrinks first (down to the floor, -fitc); only a model that
    does not fit the card even then has routed experts moved to the host (the "budget" case)."""
    try:
        return (*_choose_fixed_ctx(facts, census, backend, n, ctx_size, slot_ctx, ask), False)
    except PlanError as e:
        if backend != "cuda" or ask.explicit or not ask.fit or not facts.n_expert:
            raise
        first = e
    n_ctx_slot = (_pad(slot_ctx, CTX_PAD) if slot_ctx else _pad(_pad(ctx_size, CTX_PAD) // n, CTX_PAD)
                  if ctx_size else min(ask.fit_ctx or FIT_FLOOR, facts.n_ctx_train))
    why = _shortfall(facts, backend, census, n, n_ctx_slot, ask, fit_experts=True)
    if why:
        raise PlanError(f"{first}; with routed experts moved to the host at {n} slot(s) x {n_ctx_slot}: {why}")
    return n_ctx_slot, "set" if ctx_size or slot_ctx else "fitted", True


def _choose_fixed_ctx(facts, census, backend, n: int, ctx_size: int, slot_ctx: int, ask) -> tuple[int, str]:
    if ctx_size or slot_ctx:
        n_ctx_slot = _pad(slot_ctx, CTX_PAD) if slot_ctx else _pad(_pad(ctx_size, CTX_PAD) // n, CTX_PAD)
        if n_ctx_slot == 0:
            raise PlanError(f"--ctx-size {ctx_size} gives {n} slots no position each")
        why = _shortfall(facts, backend, census, n, n_ctx_slot, ask)
        if why:
            best = _largest_slot(facts, backend, census, n, n_ctx_slot, CTX_PAD, ask)
            asked = f"--slot-ctx {slot_ctx}" if slot_ctx else f"--ctx-size {ctx_size}"
            fits = (f"the largest context that fits is {best * n} ({n} slots x {best})" if best
                    else "no context fits")
            raise PlanError(f"{asked} ({n} slots x {n_ctx_slot}) does not fit: {why}; {fits}")
        return n_ctx_slot, "set"
    if _shortfall(facts, backend, census, n, facts.n_ctx_train, ask) is None:
        return facts.n_ctx_train, "target"
    top = facts.n_ctx_train - 1 if facts.n_ctx_train % FIT_STEP == 0 else facts.n_ctx_train
    best = _largest_slot(facts, backend, census, n, top, FIT_STEP, ask)
    floor_ctx = ask.fit_ctx or FIT_FLOOR
    if best < floor_ctx or best == 0:
        floor = min(floor_ctx, facts.n_ctx_train)
        why = _shortfall(facts, backend, census, n, floor, ask)
        raise PlanError(f"no context fits {n} slot(s): the trained limit {facts.n_ctx_train} "
                        f"and the floor {floor} do not ({why})")
    return best, "fitted"


def _auto_slots(facts, census, backend, slot_ctx: int, ask=NO_ASK) -> int:
    """--parallel auto: the most slots, up to 8, whose plan holds one request's context;
    one slot where that context already had to be fitted under the model's limit."""
    n_ctx_slot, rule, moved = _choose_ctx(facts, census, backend, 1, 0, slot_ctx, ask)
    if rule == "fitted" or moved:
        return 1
    return max(n for n in range(1, MAX_AUTO_SLOTS + 1)
               if n == 1 or _shortfall(facts, backend, census, n, n_ctx_slot, ask) is None)


def prompt_cache_budget(cache_ram_mib: int | None, host_left: int) -> int:
    """-cram in bytes; unset: the lesser of PROMPT_CACHE_MAX_BYTES and a share of what the host has left."""
    if cache_ram_mib is None:
        return min(PROMPT_CACHE_MAX_BYTES, max(host_left, 0) // PROMPT_CACHE_SHARE)
    if isinstance(cache_ram_mib, bool) or not isinstance(cache_ram_mib, int) or cache_ram_mib < 0:
        raise PlanError(f"--cache-ram {cache_ram_mib!r}: the prompt cache always has a budget here "
                        f"(llama-server's -1, no limit, is refused); give MiB >= 1, or 0 to turn it off")
    return cache_ram_mib * MIB


def _with_prompt_cache(devices: tuple[DeviceNeed, ...], cache_ram_mib: int | None) -> tuple[DeviceNeed, ...]:
    """The host's terms with the prompt cache's budget counted in."""
    host = devices[0]
    budget = prompt_cache_budget(cache_ram_mib, host.available - host.terms.total)
    return (dataclasses.replace(host, terms=dataclasses.replace(host.terms, prompt_cache=budget)), *devices[1:])


def make_plan(facts: ModelFacts, census: Census, backend: str = "numpy", ctx_size: int = 0,
              n_parallel: int | str = 1, slot_ctx: int = 0, ask: PlacementAsk = NO_ASK,
              cache_ram_mib: int | None = None, n_ctx_checkpoints: int = CTX_CHECKPOINTS,
              n_ubatch: int | None = None) -> Plan:
    """The plan for these settings; n_parallel is a count or "auto"; ask: the placement flags; cache_ram_mib:
    -cram (None: the default budget, counted from what the rest of the plan leaves on the host);
    n_ctx_checkpoints: --ctx-checkpoints, the copies of a recurrent state a slot keeps (a file with one and
    with message starts); n_ubatch: -ub, the most ids one prompt pass computes (None: the backend's own)."""
    _check_settings(facts, census, backend, ctx_size, n_parallel, slot_ctx)
    if isinstance(n_ctx_checkpoints, bool) or not isinstance(n_ctx_checkpoints, int):
        raise PlanError(f"--ctx-checkpoints {n_ctx_checkpoints!r} must be an integer (0 or less: none)")
    if facts.state_bytes and facts.message_starts:
        facts = dataclasses.replace(facts, n_checkpoints=max(n_ctx_checkpoints, 0))
    if n_ubatch is not None:
        if isinstance(n_ubatch, bool) or not isinstance(n_ubatch, int) or n_ubatch < 1:
            raise PlanError(f"--ubatch-size {n_ubatch!r}: give a whole number of ids, at least 1")
        facts = dataclasses.replace(facts, ubatch=n_ubatch)
    prompt_cache_budget(cache_ram_mib, 0)     # a refused -cram before any arithmetic
    if backend == "numpy":
        on_card = [f"-ot {o.pattern}={o.buft}" for o in ask.overrides if o.buft != "CPU"]
        if on_card:
            raise PlanError(f"{on_card[0]}: the CPU backend holds every tensor on the host; no card is used")
    n = _auto_slots(facts, census, backend, slot_ctx, ask) if n_parallel == "auto" else n_parallel
    n_ctx_slot, rule, moved = _choose_ctx(facts, census, backend, n, ctx_size, slot_ctx, ask)
    t = _terms(facts, backend, n, n_ctx_slot)
    need = t["weights"] + t["decoded"] + t["kv"] + t["scratch"]
    placed = Terms(weights=t["weights"], decoded=t["decoded"], kv=t["kv"], scratch=t["scratch"])
    if backend == "numpy":
        devices = _with_prompt_cache(
            (DeviceNeed("host", census.host_avail_bytes, dataclasses.replace(placed, margin=HOST_RESERVE_BYTES)),
             *(DeviceNeed(f"cuda:{i}", free, Terms()) for i, free in enumerate(census.card_free_bytes))), cache_ram_mib)
        host, cards = need + HOST_RESERVE_BYTES, tuple(0 for _ in census.card_free_bytes)
        placement = Placement(backend, n, n_ctx_slot, "host", devices=devices, n_expert=facts.n_expert,
                              n_ubatch=min(N_UBATCH, facts.ubatch) if facts.ubatch else 0)
    else:
        try:
            r = _place(facts, census, n, n_ctx_slot, ask, moved)
        except offload.OffloadError as e:        # _choose_ctx checked it fits; kept for a plain error all the same
            raise PlanError(str(e)) from None
        devices = _with_prompt_cache(tuple(r.devices), cache_ram_mib)
        host = devices[0].terms.total
        cards = tuple(d.terms.total - d.terms.margin for d in devices[1:])
        if r.host_pass:                          # prompt passes of the host rows, and their scratch
            t = {**t, "scratch": devices[1 + r.main].terms.scratch}
        placement = Placement(backend, n, n_ctx_slot, f"cuda:{r.main}", devices=devices, tensors=r.tensors,
                              experts_on_card=r.experts_on_card if facts.n_expert else (), case=r.case,
                              layer_why=r.layer_why if facts.n_expert else (), n_expert=facts.n_expert,
                              n_ubatch=(cuda_host_pass_rows(facts) if r.host_pass
                                        else min(CUDA_UBATCH, facts.ubatch) if facts.ubatch else 0))
    why_pass = ""
    if placement.n_ubatch:
        host_rows = backend == "cuda" and placement.n_ubatch < min(CUDA_UBATCH, facts.ubatch or CUDA_UBATCH)
        why_pass = ("with routed experts in host RAM every layer takes the planned expert kernels, which copy no "
                    "expert stack to f16" if host_rows else f"-ub {facts.ubatch} set it")
    return Plan(backend, facts.arch, n * n_ctx_slot, n_ctx_slot, n, rule, facts.n_ctx_train,
                dict(facts.tensor_bytes), t["weights"], t["kv"], t["scratch"], host, cards, t,
                parallel_from="auto" if n_parallel == "auto" else "set", decoded_bytes=t["decoded"],
                placement=placement, ctx_size=ctx_size, slot_ctx=slot_ctx,
                expert_bytes=layout_of(facts).expert_bytes if facts.n_expert else (),
                prompt_cache_bytes=devices[0].terms.prompt_cache,
                prompt_cache_from="default" if cache_ram_mib is None else "set",
                checkpoint_bytes=n * checkpoint_bytes_for(facts), pass_why=why_pass)
