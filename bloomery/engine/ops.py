"""The ops the architecture files call: the whole contract with a backend.

An architecture file only ever calls these, so a second backend (CUDA) is a
second class with the same methods. Arrays go in and out in the backend's own
array type; `to_host` is the one way back to numpy. Weights are opaque handles
made by `weight()` from the GGUF bytes, and stay quantized: each backend
decides how (and whether) to cache decoded forms.

Legend: T = tokens in the batch, D = hidden size, H = query heads,
Hkv = KV heads, Dh = head size, N = a weight's output rows, K = its input
length, E = experts, A = experts used per token, V = vocabulary.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ContextManager, Protocol, Sequence

Array = Any     # the backend's array type (numpy.ndarray for the numpy backend)
Weight = Any    # an opaque handle from Ops.weight


@dataclass(frozen=True)
class Caps:
    """Where the backends differ, said once by each (its `caps`), read by the model code instead
    of probing for methods."""
    n_ubatch: int              # prompt rows per pass
    decode_rows: int           # rows a pass runs on the decode path; more take the prompt path (0: one path)
    fused_head: bool           # matmul_topk / matmul_argmax: the head's product and its pick in one step
    decode_graphs: bool        # decode_runner(model): captured decode steps
    prompt_scratch: bool       # release_scratch(): prompt-pass buffers handed back after a prompt
    recurrent: bool = False    # recurrent_state / conv_step / delta_rule: linear-attention layers
    greedy_bans: int = 0       # ids a row's greedy pick on the backend may ban (ban before argmax; 0: none)


@dataclass(frozen=True)
class AttnSpan:
    """Rows [row0, row1) of a batch belong to `slot` at positions pos0 .. pos0+(row1-row0)-1."""
    slot: int
    pos0: int
    row0: int
    row1: int


@dataclass(frozen=True)
class Rows:
    """Where each row of a batch sits: its slot and position, as backend arrays [T] (what a
    device kernel reads, so a captured decode step needs no host values), and the same as
    host spans where the caller knows them (None inside a captured decode graph)."""
    spans: Sequence[AttnSpan] | None
    slots: Any
    positions: Any
    fresh: bool = False     # the rows are one slot's positions 0 .. T-1 in order (a captured prompt from its
                            # start): each attends only to the rows before it in the same pass


class Ops(Protocol):
    name: str
    caps: Caps

    # --- weights ---
    def loading(self) -> ContextManager[None]:
        """Open while a model's weights are handed over (weight, offloaded_weight): a backend may copy
        them in parallel, with buffers it frees when the load ends."""

    def weight(self, ggml_type: int, shape: Sequence[int], data: Any) -> Weight:
        """A handle for a stored tensor; shape in GGUF ne order (shape[0] is the row length)."""

    def offloaded_weight(self, name: str, ggml_type: int, shape: Sequence[int], data: Any,
                         host: tuple[int, int]) -> Weight:
        """A stacked routed-expert tensor [K, N, E] whose experts host[0] .. host[1]-1 the placement
        keeps in host RAM (after offload_experts); a backend without an offload tier refuses it."""

    def offload_experts(self, residency: bool, threads: int) -> None:
        """Before the load: routed experts will be split between the device and host RAM
        (adaptive residency on or off, `threads` host threads, 0: every core)."""

    def after_step(self, decode: bool) -> None:
        """Between steps (after a decode step or a prompt pass): the backend's bookkeeping that
        must not run inside one (the offload tier's residency moves)."""

    def get_rows(self, w: Weight, ids: Array) -> Array:
        """Rows `ids` [T] of a [N, K] table, dequantized -> [T, K] float32 (embedding lookup)."""

    def matmul(self, x: Array, w: Weight, residual: Array | None = None) -> Array:
        """x [T, K] @ w[N, K]^T (+ residual [T, N]) -> [T, N]."""

    def matmuls(self, x: Array, ws: Sequence[Weight], biases: Sequence[Weight | None]) -> list[Array]:
        """[x @ w^T (+ b) for each w]: one pass over x for several weights (Q, K and V)."""

    # --- elementwise and norms ---
    def add(self, a: Array, b: Array | Weight) -> Array:
        """a + b, b broadcast over leading axes (a bias handle is accepted)."""

    def take_rows(self, x: Array, rows: Array) -> Array:
        """Rows `rows` [n] (int32, on the backend) of x [T, D] -> [n, D] (the rows whose logits a pass wants)."""

    def rms_norm(self, x: Array, w: Weight, eps: float) -> Array:
        """x [..., D] / rms(x) * w [D]."""

    def norm_matmuls(self, x: Array, norm: Weight, eps: float, ws: Sequence[Weight],
                     biases: Sequence[Weight | None]) -> tuple[Array, list[Array]]:
        """(h, matmuls(h, ws, biases)) with h = rms_norm(x, norm, eps): one step, so a backend
        may fuse the norm into the products."""

    def swiglu(self, gate: Array, up: Array) -> Array:
        """silu(gate) * up, same shape."""

    def rope_neox(self, x: Array, positions: Array, n_rot: int, freq_base: float,
                  imrope_sections: Sequence[int] | None = None) -> Array:
        """x [T, H, Dh] rotated in NEOX layout (pairs i, i + n_rot/2) at positions [T]; with
        imrope_sections (4 counts), interleaved multi-section RoPE at a text position [p, p, p, 0]."""

    def sigmoid(self, x: Array) -> Array:
        """1 / (1 + e^-x), same shape."""

    def softplus(self, x: Array) -> Array:
        """log(1 + e^x), same shape."""

    def silu(self, x: Array) -> Array:
        """x / (1 + e^-x), same shape."""

    def mul(self, a: Array, b: Array | Weight) -> Array:
        """a * b, b broadcast over leading axes (a weight handle is accepted)."""

    def sigmoid_gate(self, x: Array, gate: Array, plus: Array | None = None,
                     residual: Array | None = None) -> Array:
        """x [T, N] * sigmoid(gate) (gate [T, N], or [T, 1]: one a row), then plus + that, then
        + residual, each step rounded as mul, add and add would: one step, so a backend may fuse it."""

    def l2_norm(self, x: Array, eps: float) -> Array:
        """x / sqrt(sum(x^2) + eps) over the last axis."""

    def rows(self, spans: Sequence[AttnSpan], positions: Array) -> Rows:
        """The Rows of a batch laid out by `spans` (positions already on the backend)."""

    def ban(self, logits: Array, bans: Array) -> None:
        """logits [B, V] in place: each row's ids in bans [NB, B] (-1: none) to -inf, as a -inf logit bias."""

    def argmax(self, logits: Array) -> Array:
        """logits [B, V] -> ids [B] int32, the first index of each row's largest value."""

    def topk_max(self, n_vocab: int) -> int:
        """The largest k topk takes over a vocabulary of n_vocab (0: whole rows leave the device)."""

    def topk(self, logits: Array, k: int) -> tuple[Array, Array, Array]:
        """logits [B, V] -> (ids [B, k], values [B, k], NaN count [B]), descending, ties to the lower id."""

    # --- by capability (caps) ---
    def matmul_topk(self, x: Array, w: Weight, k: int) -> tuple[Array, Array, Array]:
        """caps.fused_head: topk(matmul(x, w), k) in one step."""

    def matmul_argmax(self, x: Array, w: Weight) -> Array:
        """caps.fused_head: argmax(matmul(x, w)) in one step."""

    def decode_runner(self, model: Any) -> Any:
        """caps.decode_graphs: the model's captured decode steps (run, run_topk, max_batch), or None; its
        prompt(slot, ids, pos0) runs a prompt of one slot as a captured pass where it has one (the last
        id's logits [V]), else returns None."""

    def release_scratch(self) -> None:
        """caps.prompt_scratch: hand back the buffers a prompt pass grew."""

    # --- attention over the KV cache ---
    def kv_cache(self, n_layer: int, n_slots: int, n_ctx_slot: int, n_head_kv: int, head_dim: int) -> Any:
        """A per-slot F16 K/V store (llama.cpp's default cache type)."""

    def self_attention(self, cache: Any, layer: int, rows: Rows, q: Array, k: Array, v: Array, scale: float,
                       n_rot: int, freq_base: float, q_norm: Weight | None = None, k_norm: Weight | None = None,
                       eps: float = 0.0, imrope_sections: Sequence[int] | None = None) -> Array:
        """The attention core of a block: optional per-head RMSNorm of q and k, NEOX RoPE at each
        row's position (IMRoPE with imrope_sections), k and v written to the cache, causal
        attention within each row's slot.

        q [T, H, Dh], k and v [T, Hkv, Dh] -> [T, H*Dh].
        """

    # --- linear attention (caps.recurrent): a state per slot that only moves forward ---
    def recurrent_state(self, n_layer: int, n_slots: int, conv_window: int, conv_channels: int,
                        n_v_heads: int, head_size: int) -> Any:
        """Per layer and slot, a conv window [conv_window, conv_channels] and a delta-rule state
        [n_v_heads, head_size, head_size], float32, zeros. A span at position 0 starts from
        zeros; one at the end of what its slot holds carries on; any other is refused."""

    def conv_step(self, state: Any, layer: int, rows: Rows, x: Array, kernel: Weight, silu: bool = False) -> Array:
        """The causal depthwise conv over each slot's window then its rows: x [T, C], kernel
        [C, K] (GGUF ne {K, C}) -> [T, C], then SiLU where asked (as the silu op after it); the
        window keeps the last K-1 rows."""

    def delta_rule(self, state: Any, layer: int, rows: Rows, q: Array, k: Array, v: Array,
                   alpha: Array, b: Array, dt_bias: Weight, a: Weight) -> Array:
        """The gated delta rule over each slot's state, its gates made first as delta_gates makes
        them (g = softplus(alpha + dt_bias) * a, beta = sigmoid(b)): per value head, S <- S * exp(g);
        S <- S + k ((v - S^T k) * beta)^T; out = S^T q / sqrt(head size). Value head h reads key
        head h % Hk. q, k [T, Hk, S], v [T, H, S], alpha and b [T, H], dt_bias and a [H] -> [T, H, S].
        A long span may run in a chunked form (the same sums in another order:
        cpu/recurrent.delta_rule_chunked)."""

    # --- mixture of experts ---
    def moe_route(self, logits: Array, n_used: int, norm_weights: bool) -> tuple[Array, Array]:
        """logits [T, E] -> (expert ids [T, A], weights [T, A]): softmax, top-k, optional renorm."""

    def moe_ffn(self, x: Array, ids: Array, weights: Array,
                gate_exps: Weight, up_exps: Weight, down_exps: Weight, residual: Array | None = None) -> Array:
        """x [T, D] through each token's A experts (gate, up, SiLU, down), weighted sum
        (+ residual) -> [T, D]."""

    # --- host transfer ---
    def from_host(self, x: Any) -> Array: ...
    def to_host(self, x: Array) -> Any: ...


def delta_gates(ops: Ops, alpha: Array, b: Array, dt_bias: Weight, a: Weight) -> tuple[Array, Array]:
    """The gated delta rule's decay and write strength from their projections (llama.cpp's
    build_layer_attn_linear): g = softplus(alpha + dt_bias) * a, beta = sigmoid(b), [T, H] each,
    through the backend's own elementwise ops in this order (a backend that folds them into its
    kernel computes the same formulas)."""
    return ops.mul(ops.softplus(ops.add(alpha, dt_bias)), a), ops.sigmoid(b)
