"""The recurrent state of linear-attention layers per slot, and the two ops that carry it,
as ggml-cpu computes them: the causal conv window (ggml_ssm_conv) and the gated delta rule
(ggml_gated_delta_net, the fused kernel llama.cpp's CPU build runs for prompts and decode).

A state holds what a slot's positions 0 .. n-1 left behind and cannot step back: a span that
starts at position 0 starts from zeros, one that starts at the end of what the slot holds
carries on, any other is refused by name (the scheduler keeps a recurrent slot only when the
new prompt extends what it holds, or from a checkpoint: a save_state copy taken at a message
start and put back with restore_state).

Legend: T = rows, C = conv channels, K = conv kernel width, H = value heads, Hk = key heads,
S = head size (keys and values alike).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from bloomery.engine.cpu.ops_math import expf_libm, vec_dot_f32
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
        conv, delta = state
        if conv.shape != self.conv.shape[:1] + self.conv.shape[2:] or delta.shape != self.delta.shape[:1] + self.delta.shape[2:]:
            raise RecurrentStateError(f"a saved state of shapes {conv.shape} and {delta.shape} does not fit a state "
                                      f"shaped {self.conv.shape} and {self.delta.shape}")
        if n < 1:
            raise RecurrentStateError(f"a saved state holds at least one position, not {n}")
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
               v: np.ndarray, g: np.ndarray, beta: np.ndarray) -> np.ndarray:
    """The gated delta rule, one row after another (ggml_compute_forward_gated_delta_net): per
    head, S <- S * exp(g); d = (v - S^T k) * beta; S <- S + k d^T; out = S^T q / sqrt(S).
    Value head h reads key head h % Hk (ggml's broadcast). q, k [T, Hk, S], v [T, H, S],
    g and beta [T, H] -> [T, H, S]. In the kernel's float steps: expf, a scale, its dot products
    (ggml_vec_dot_f32's order) and the rank-1 update as one fma per element (ggml_vec_mad_f32)."""
    q, k, v = (np.asarray(a, np.float32) for a in (q, k, v))
    g, beta = np.asarray(g, np.float32), np.asarray(beta, np.float32)
    n_v, size = v.shape[1], v.shape[2]
    heads = np.arange(n_v) % q.shape[1]
    scale = np.float32(1.0) / np.sqrt(np.float32(size))
    decay = expf_libm(g)                                                  # [T, H]
    out = np.empty_like(v)
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
