"""The recurrent state of linear-attention layers per slot, and the two ops that carry it,
as ggml-cpu computes them: the causal conv window (ggml_ssm_conv) and the gated delta rule
(ggml_gated_delta_net, the fused kernel llama.cpp's CPU build runs for prompts and decode), with
the delta rule's chunked form for long spans (delta_rule_chunked; delta_rule_spans picks).

A state holds what a slot's positions 0 .. n-1 left behind and cannot step back: a span that
starts at position 0 starts from zeros, one that starts at the end of what the slot holds
carries on, any other is refused by name (the scheduler keeps a recurrent slot only when the
new prompt extends what it holds, or from a checkpoint: a save_state copy taken at a message
start and put back with restore_state).

Legend: T = rows, C = conv channels, K = conv kernel width, H = value heads, Hk = key heads,
S = head size (keys and values alike).
"""
from __future__ import annotations

import os
from typing import Sequence

import numpy as np

from bloomery.engine.cpu.sizes import DELTA_CHUNK
from bloomery.engine.cpu.ops_math import expf_libm, vec_dot_f32
from bloomery.engine.quant.threads import OneBlasThread
from bloomery.engine.ops import AttnSpan


class RecurrentStateError(ValueError):
    """A step the state cannot take (a position it does not hold); names the slot and positions."""


class RecurrentState:
    """Per layer and slot: the conv window [K-1, C] and the delta-rule state [H, S, S] (float32,
    as llama.cpp's recurrent memory holds them). `delta[l, s, h, j, i]` is S[i][j] of head h:
    ggml's transposed layout, so a row is contiguous in both."""

    def __init__(self, n_layer: int, n_slots: int, conv_window: int, conv_channels: int, n_v_heads: int,
                 head_size: int):
        self.conv = np.zeros((n_layer, n_slots, conv_window, conv_channels), np.float32)
        self.delta = np.zeros((n_layer, n_slots, n_v_heads, head_size, head_size), np.float32)
        self.conv_pos = np.zeros((n_layer, n_slots), np.int64)       # positions each window holds
        self.delta_pos = np.zeros((n_layer, n_slots), np.int64)
        self.n_slots = n_slots

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.delta.nbytes

    def save_state(self, slot: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Host copies of what the slot holds after positions 0 .. n-1 (a checkpoint): the conv windows
        [layer, K-1, C] and the delta-rule states [layer, H, S, S]. Refused unless every layer holds
        exactly n positions (a state is the sum of its positions; it cannot be cut to fewer)."""
        self._check_slot(slot)
        for what, held in (("conv window", self.conv_pos), ("delta-rule state", self.delta_pos)):
            bad = np.flatnonzero(held[:, slot] != n)
            if bad.size:
                il = int(bad[0])
                raise RecurrentStateError(f"slot {slot}'s {what} of layer {il} holds {int(held[il, slot])} positions, "
                                          f"not the {n} asked to save")
        return self.conv[:, slot].copy(), self.delta[:, slot].copy()

    def restore_state(self, slot: int, state: tuple[np.ndarray, np.ndarray], n: int) -> None:
        """The slot's state from a save_state copy of n positions; the next span carries on at position n."""
        self._check_slot(slot)
        conv, delta = check_saved(state, n, self.conv.shape, self.delta.shape)
        self.conv[:, slot], self.delta[:, slot] = conv, delta
        self.conv_pos[:, slot] = self.delta_pos[:, slot] = n

    @property
    def slot_nbytes(self) -> int:
        """What save_state copies for one slot."""
        return self.nbytes // self.n_slots

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.n_slots:
            raise RecurrentStateError(f"slot {slot} is out of range: the state has {self.n_slots} slots")

    def _take(self, held: np.ndarray, state: np.ndarray, layer: int, sp: AttnSpan, what: str) -> None:
        self._check_slot(sp.slot)
        if sp.pos0 == 0:
            state[layer, sp.slot] = 0
        elif sp.pos0 != held[layer, sp.slot]:
            raise RecurrentStateError(
                f"slot {sp.slot}'s {what} holds positions 0..{int(held[layer, sp.slot]) - 1} of layer {layer}; "
                f"a step at position {sp.pos0} cannot follow it (a recurrent state cannot step back)")
        held[layer, sp.slot] = sp.pos0 + (sp.row1 - sp.row0)


def check_saved(state, n: int, conv_shape, delta_shape):
    """A save_state copy (conv, delta) of n positions that fits one slot of a state shaped conv_shape and
    delta_shape [layer, slot, ...], else refused by name (both backends' restore_state)."""
    conv, delta = state
    if conv.shape != conv_shape[:1] + conv_shape[2:] or delta.shape != delta_shape[:1] + delta_shape[2:]:
        raise RecurrentStateError(f"a saved state of shapes {conv.shape} and {delta.shape} does not fit a state "
                                  f"shaped {conv_shape} and {delta_shape}")
    if n < 1:
        raise RecurrentStateError(f"a saved state holds at least one position, not {n}")
    return conv, delta


def conv_step(st: RecurrentState, layer: int, spans: Sequence[AttnSpan], x: np.ndarray, kernel: np.ndarray) -> np.ndarray:
    """ggml_ssm_conv over each span's rows after its slot's window: out[t, c] = sum_j
    win[t + j, c] * kernel[c, j] summed in f32 in j order; the window keeps the last K-1 rows.
    x [T, C], kernel [C, K] -> [T, C]."""
    x = np.asarray(x, np.float32)
    width = kernel.shape[1]
    out = np.empty_like(x)
    for sp in spans:
        st._take(st.conv_pos, st.conv, layer, sp, "conv window")
        win = np.concatenate([st.conv[layer, sp.slot], x[sp.row0:sp.row1]], axis=0)    # [K-1+t, C]
        n = sp.row1 - sp.row0
        acc = np.zeros((n, x.shape[1]), np.float32)
        for j in range(width):
            acc = acc + win[j:j + n] * kernel[:, j]
        out[sp.row0:sp.row1] = acc
        st.conv[layer, sp.slot] = win[n:]
    return out


def delta_rule(st: RecurrentState, layer: int, spans: Sequence[AttnSpan], q: np.ndarray, k: np.ndarray,
               v: np.ndarray, g: np.ndarray, beta: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """The gated delta rule, one row after another (ggml_compute_forward_gated_delta_net): per
    head, S <- S * exp(g); d = (v - S^T k) * beta; S <- S + k d^T; out = S^T q / sqrt(S).
    Value head h reads key head h % Hk (ggml's broadcast). q, k [T, Hk, S], v [T, H, S],
    g and beta [T, H] -> [T, H, S]. In the kernel's float steps: expf, a scale, its dot products
    (ggml_vec_dot_f32's order) and the rank-1 update as one fma per element (ggml_vec_mad_f32).
    `out` (else a new array) takes the spans' rows."""
    q, k, v = (np.asarray(a, np.float32) for a in (q, k, v))
    g, beta = np.asarray(g, np.float32), np.asarray(beta, np.float32)
    n_v, size = v.shape[1], v.shape[2]
    heads = np.arange(n_v) % q.shape[1]
    scale = np.float32(1.0) / np.sqrt(np.float32(size))
    decay = expf_libm(g)                                                  # [T, H]
    out = np.empty_like(v) if out is None else out
    for sp in spans:
        st._take(st.delta_pos, st.delta, layer, sp, "delta-rule state")
        m = st.delta[layer, sp.slot]                                      # [H, S(j), S(i)] = S[i][j]
        for t in range(sp.row0, sp.row1):
            kt, qt = k[t, heads], q[t, heads]                             # [H, S]
            m = m * decay[t][:, None, None]
            d = (v[t] - vec_dot_f32(m, kt[:, None, :])) * beta[t][:, None]   # [H, S]
            m = (kt[:, None, :].astype(np.float64) * d[:, :, None] + m).astype(np.float32)
            out[t] = vec_dot_f32(m, qt[:, None, :]) * scale
        st.delta[layer, sp.slot] = m
    return out


CHUNK = DELTA_CHUNK   # rows of one chunk of the chunked form (llama.cpp's build_delta_net_chunking, scalar decay)
# A span of this many rows or more takes the chunked form (a prompt pass), shorter ones the step form (decode,
# short passes). BLOOMERY_DELTA_CHUNKED=off keeps the step form everywhere: llama.cpp's CPU build runs its
# fused step kernel (ggml_gated_delta_net) at every prompt size, so that is its float order exactly.
CHUNKED_MIN_ROWS = CHUNK
CHUNKED = os.environ.get("BLOOMERY_DELTA_CHUNKED", "on").strip().lower() not in ("off", "0", "false", "no")


def delta_rule_spans(st: RecurrentState, layer: int, spans: Sequence[AttnSpan], q: np.ndarray, k: np.ndarray,
                     v: np.ndarray, g: np.ndarray, beta: np.ndarray) -> np.ndarray:
    """The delta rule over a pass's spans, each in the form its length takes: chunked from CHUNKED_MIN_ROWS
    rows (unless BLOOMERY_DELTA_CHUNKED=off), else step by step. Shapes as delta_rule."""
    out = np.empty(np.shape(v), np.float32)
    chunked = [CHUNKED and sp.row1 - sp.row0 >= CHUNKED_MIN_ROWS for sp in spans]
    long = [sp for sp, c in zip(spans, chunked) if c]
    short = [sp for sp, c in zip(spans, chunked) if not c]
    if short:
        delta_rule(st, layer, short, q, k, v, g, beta, out)
    if long:
        with OneBlasThread():     # its products are small: OpenBLAS's hand-off to threads costs more than they do
            delta_rule_chunked(st, layer, long, q, k, v, g, beta, out)
    return out


def delta_rule_chunked(st: RecurrentState, layer: int, spans: Sequence[AttnSpan], q: np.ndarray, k: np.ndarray,
                       v: np.ndarray, g: np.ndarray, beta: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """The gated delta rule of delta_rule in chunks of CHUNK rows (the WY form): within a chunk every row's
    update is solved at once from the chunk's keys, and only the state between chunks is sequential.

    Per head, chunk rows t (a span padded to whole chunks with rows that leave the state as it is: k, v, q
    and beta zero, g zero), G = cumsum(g), gamma = exp(G), decay[t, j] = exp(G_t - G_j) for j <= t. The row
    updates d_t = beta_t (v_t - gamma_t S0^T k_t - sum_{j<t} decay[t, j] (k_t . k_j) d_j) are D = U - W S0
    with (I + A) U = beta v and (I + A) W = beta gamma k, A[t, j] = beta_t decay[t, j] (k_t . k_j) for j < t
    (unit lower triangular; numpy solves it in float64, one chunk at a time). Then
    out = scale (gamma q S0 + (decay * q k^T) D) and S <- gamma_last S0 + (exp(G_last - G) k)^T D.
    Shapes as delta_rule; float32 products (BLAS), so it agrees with the step form to rounding, not bit
    for bit."""
    q, k, v = (np.asarray(a, np.float32) for a in (q, k, v))
    g, beta = np.asarray(g, np.float32), np.asarray(beta, np.float32)
    n_v, size = v.shape[1], v.shape[2]
    heads = np.arange(n_v) % q.shape[1]
    scale = np.float32(1.0) / np.sqrt(np.float32(size))
    out = np.empty_like(v) if out is None else out
    lower = np.tril(np.ones((CHUNK, CHUNK), bool))                        # [C, C] j <= t
    strict = np.tril(np.ones((CHUNK, CHUNK), bool), -1)                   # [C, C] j < t
    eye = np.eye(CHUNK, dtype=np.float32)
    for sp in spans:
        st._take(st.delta_pos, st.delta, layer, sp, "delta-rule state")
        t = sp.row1 - sp.row0
        n = -(-t // CHUNK)
        pad = n * CHUNK - t

        def chunks(a: np.ndarray) -> np.ndarray:                          # [T, H, ...] -> [N, H, C, ...]
            a = np.concatenate([a, np.zeros((pad,) + a.shape[1:], np.float32)]) if pad else a
            return np.ascontiguousarray(np.moveaxis(a.reshape((n, CHUNK) + a.shape[1:]), 1, 2))

        rows = slice(sp.row0, sp.row1)
        qc, kc = chunks(q[rows][:, heads]), chunks(k[rows][:, heads])     # [N, H, C, S]
        vc = chunks(v[rows])                                              # [N, H, C, S]
        gc, bc = chunks(g[rows]), chunks(beta[rows])                      # [N, H, C]
        cum = np.cumsum(gc, axis=-1, dtype=np.float32)                    # [N, H, C] G
        decay = cum[..., :, None] - cum[..., None, :]                     # [N, H, C, C] G_t - G_j
        decay[..., ~lower] = -np.inf
        np.exp(decay, out=decay)                                          # 0 above the diagonal
        gamma = np.exp(cum)                                               # [N, H, C]
        lhs = kc @ np.swapaxes(kc, -1, -2)                                # [N, H, C, C] k_t . k_j
        lhs *= decay
        lhs *= bc[..., :, None]
        lhs[..., ~strict] = 0
        lhs += eye                                                        # I + A
        qk = qc @ np.swapaxes(kc, -1, -2)                                 # [N, H, C, C]
        qk *= decay
        qk *= scale
        del decay
        qc *= (gamma * scale)[..., None]                                  # gamma q scale
        vc *= bc[..., None]                                               # beta v
        kb = (bc * gamma)[..., None]                                      # [N, H, C, 1] beta gamma
        last = np.exp(cum[..., -1:] - cum)[..., None]                     # [N, H, C, 1] exp(G_last - G)
        g_last = np.exp(cum[..., -1])                                     # [N, H]
        s = np.ascontiguousarray(st.delta[layer, sp.slot].transpose(0, 2, 1))   # [H, S(k), S(v)] = S
        for c in range(n):
            # U and W of this chunk (numpy solves in float64); one chunk at a time keeps the solve's copies small
            uw = np.linalg.solve(lhs[c], np.concatenate([vc[c], kb[c] * kc[c]], axis=-1))   # [H, C, 2S]
            d = uw[..., :size] - uw[..., size:] @ s                       # [H, C, S]
            o = qc[c] @ s + qk[c] @ d                                     # [H, C, S]
            r0 = c * CHUNK
            out[sp.row0 + r0:sp.row0 + min(r0 + CHUNK, t)] = o.transpose(1, 0, 2)[:t - r0]
            s = g_last[c][:, None, None] * s + np.swapaxes(last[c] * kc[c], -1, -2) @ d
        st.delta[layer, sp.slot] = s.transpose(0, 2, 1)
    return out
