"""The recurrent state of linear-attention layers on the card, and the two ops that carry it (the
causal conv window and the gated delta rule), written over an array module `xp`: CuPy on the card,
numpy in the tests, which run these very functions against cpu/recurrent.py on the host.

The same state as cpu/recurrent.RecurrentState (its layout, its rule, its checkpoints): a span that
starts at position 0 starts from zeros, one that starts at the end of what the slot holds carries
on, any other is refused by name. Where the rows' spans are known on the host (prompt passes, an
uncaptured decode step) that rule is checked before anything moves. A captured decode step
(rows.spans None) knows its slots and positions only on the card: each row is one step of its own
slot, gathered, stepped and scattered back with no host value read; a row at position 0 starts
from zeros, and a row at a position its slot does not hold leaves the slot marked as holding
nothing (-1), so the next span that would carry on from it is refused by name.

Only array operations both modules have are used, and none that syncs or copies from the host in
the decode form (no .get(), no int() of a device value, no index array made from host values, no
cuBLAS, which CuPy keeps out of a stream capture): broadcasting products and sums. The prompt
form (host spans) uses matmul: the chunked form of cpu/recurrent.delta_rule_chunked, its
triangular solve done as a block inverse (log2(CHUNK) rounds of batched products), GROUP_CHUNKS
chunks at a time to bound the scratch.

Legend: T = rows, B = decode rows, C = conv channels, K = conv kernel width, H = value heads,
Hk = key heads, S = head size, N = chunks of a group, L = CHUNK rows of a chunk.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from bloomery.engine.cpu.recurrent import RecurrentStateError, check_saved
from bloomery.engine.cpu.sizes import DELTA_CHUNK
from bloomery.engine.cuda.sizes import DELTA_GROUP_CHUNKS as GROUP_CHUNKS
from bloomery.engine.ops import AttnSpan

CHUNK = DELTA_CHUNK             # rows of one chunk of the chunked form (a power of two: the block inverse halves it)
CONV, DELTA = 0, 1              # the two parts of a layer's state, in the order a layer steps them
WHAT = ("conv window", "delta-rule state")


def _to_host(xp, a) -> np.ndarray:
    """A host copy of a (never a view of the state)."""
    return np.array(a) if xp is np else xp.asnumpy(a)


class RecurrentState:
    """Per layer and slot: the conv window [K-1, C] and the delta-rule state [H, S, S] (float32, ggml's
    layout as cpu/recurrent.RecurrentState: `delta[l, s, h, j, i]` is S[i][j] of head h), on `xp`'s
    device. `held[part, layer, slot]` (int32 on the device) counts the positions each part holds, -1
    where a captured step ran at a position the slot did not hold. The arrays are made once and only
    ever written in place: a captured decode step holds their addresses."""

    def __init__(self, xp, n_layer: int, n_slots: int, conv_window: int, conv_channels: int, n_v_heads: int,
                 head_size: int):
        self.xp = xp
        self.conv = xp.zeros((n_layer, n_slots, conv_window, conv_channels), xp.float32)
        self.delta = xp.zeros((n_layer, n_slots, n_v_heads, head_size, head_size), xp.float32)
        self.held = xp.zeros((2, n_layer, n_slots), xp.int32)
        self.n_slots = n_slots
        # a host copy of `held` for the checks of host spans: read from the device once per pass (at the
        # pass's first call, whose (layer, part) does not follow the last one checked), kept in step after
        self._mirror: np.ndarray | None = None
        self._last = -1

    @property
    def nbytes(self) -> int:
        return int(self.conv.nbytes + self.delta.nbytes)

    @property
    def slot_nbytes(self) -> int:
        """What save_state copies for one slot."""
        return self.nbytes // self.n_slots

    def positions_held(self) -> np.ndarray:
        """held on the host: [part (conv, delta), layer, slot]."""
        return _to_host(self.xp, self.held)

    def save_state(self, slot: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Host copies of what the slot holds after positions 0 .. n-1 (a checkpoint): the conv windows
        [layer, K-1, C] and the delta-rule states [layer, H, S, S]. Refused unless every layer holds
        exactly n positions."""
        self._check_slot(slot)
        held = self.positions_held()
        for part in (CONV, DELTA):
            bad = np.flatnonzero(held[part, :, slot] != n)
            if bad.size:
                il = int(bad[0])
                raise RecurrentStateError(f"slot {slot}'s {WHAT[part]} of layer {il} holds "
                                          f"{self._held_words(int(held[part, il, slot]))}, not the {n} asked to save")
        return _to_host(self.xp, self.conv[:, slot]), _to_host(self.xp, self.delta[:, slot])

    def restore_state(self, slot: int, state: tuple[np.ndarray, np.ndarray], n: int) -> None:
        """The slot's state from a save_state copy of n positions; the next span carries on at position n."""
        self._check_slot(slot)
        conv, delta = check_saved(state, n, self.conv.shape, self.delta.shape)
        xp = self.xp
        self.conv[:, slot] = xp.asarray(conv, dtype=xp.float32)
        self.delta[:, slot] = xp.asarray(delta, dtype=xp.float32)
        self.held[:, :, slot] = n
        self._mirror = None
        if xp is not np:       # the captured decode steps run on their own non-blocking stream: done before any
            xp.cuda.get_current_stream().synchronize()

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.n_slots:
            raise RecurrentStateError(f"slot {slot} is out of range: the state has {self.n_slots} slots")

    @staticmethod
    def _held_words(h: int) -> str:
        return (f"{h} positions" if h >= 0 else
                "no position a step can follow (a captured decode step ran at a position it did not hold)")

    def take(self, part: int, layer: int, spans: Sequence[AttnSpan]) -> None:
        """Host spans about to step `part` of `layer`: each checked against what its slot holds (every
        span before any moves), then counted as held, on the host copy and on the device."""
        order = 2 * layer + part
        if self._mirror is None or order <= self._last:
            self._mirror = self.positions_held()
        self._last = order
        held = self._mirror[part, layer].copy()
        for sp in spans:
            self._check_slot(sp.slot)
            h = int(held[sp.slot])
            if sp.pos0 != 0 and sp.pos0 != h:
                if h < 0:
                    raise RecurrentStateError(
                        f"slot {sp.slot}'s {WHAT[part]} of layer {layer} holds {self._held_words(h)}; a step at "
                        f"position {sp.pos0} cannot follow it (a recurrent state cannot step back; a span at "
                        f"position 0 starts afresh)")
                raise RecurrentStateError(
                    f"slot {sp.slot}'s {WHAT[part]} holds positions 0..{h - 1} of layer {layer}; "
                    f"a step at position {sp.pos0} cannot follow it (a recurrent state cannot step back)")
            held[sp.slot] = sp.pos0 + (sp.row1 - sp.row0)
        for sp in spans:
            self.held[part, layer, sp.slot] = int(held[sp.slot])
        self._mirror[part, layer] = held

    def take_on_device(self, part: int, layer: int, slots, positions) -> None:
        """A captured step's rows (device slots and positions [B], one row a slot): each slot now holds
        position + 1, or -1 where the row's position was neither 0 nor what the slot held."""
        xp = self.xp
        held = self.held[part, layer]                                        # [n_slots] a view
        old = held[slots]                                                    # [B]
        ok = (positions == 0) | (positions == old)
        held[slots] = xp.where(ok, positions + 1, positions.dtype.type(-1)).astype(xp.int32)
        self._mirror = None


def decode_rows(rows) -> bool:
    """The rows take the decode form: a captured step, or every span one row of its own slot."""
    return rows.spans is None or _single_rows(rows.spans)


def claim(st: RecurrentState, part: int, layer: int, rows) -> bool:
    """Before a kernel steps `part` of `layer` over these rows: host spans are checked and counted here (False),
    a captured step's rows are left to the kernel (True: it counts them as take_on_device does)."""
    if rows.spans is not None:
        st.take(part, layer, rows.spans)
        return False
    st._mirror = None
    return True


def _single_rows(spans: Sequence[AttnSpan]) -> bool:
    """Every span one row of its own slot, row b the b-th span: the decode form takes them."""
    return (all(sp.row1 - sp.row0 == 1 and sp.row0 == b for b, sp in enumerate(spans))
            and len({sp.slot for sp in spans}) == len(spans))


def expand_heads(xp, a, n_heads: int):
    """[T, Hk, S] -> [T, H, S]: value head h reads key head h % Hk (ggml's broadcast)."""
    t, hk, s = a.shape
    if n_heads == hk:
        return a
    # copies side by side (heads 0..Hk-1, then again); checked against numpy on the card
    return xp.concatenate([a] * (n_heads // hk), axis=1)


# --- the conv window ----------------------------------------------------------------------------

def conv_rows(xp, win, x, kernel):
    """ggml_ssm_conv over one slot's rows after its window: win [K-1, C], x [T, C], kernel [C, K] ->
    (out [T, C], the new window [K-1, C]); out[t, c] = sum_j full[t + j, c] kernel[c, j] in j order."""
    n, width = x.shape[0], kernel.shape[1]
    full = xp.concatenate([win, x], axis=0)                                  # [K-1+T, C]
    acc = xp.zeros(x.shape, xp.float32)                                      # [T, C]
    for j in range(width):
        acc = acc + full[j:j + n] * kernel[:, j]
    return acc, full[n:]


def conv_decode(xp, win, x, kernel):
    """One step of B slots at once: win [B, K-1, C], x [B, C], kernel [C, K] -> (out [B, C], the new
    windows [B, K-1, C]); the same sums in the same order as conv_rows."""
    width = kernel.shape[1]
    full = xp.concatenate([win, x[:, None]], axis=1)                         # [B, K, C]
    acc = xp.zeros(x.shape, xp.float32)                                      # [B, C]
    for j in range(width):
        acc = acc + full[:, j] * kernel[:, j]
    return acc, full[:, 1:]


def conv_step(st: RecurrentState, layer: int, rows, x, kernel):
    """The causal depthwise conv over each slot's window then its rows: x [T, C], kernel [C, K] -> [T, C]."""
    xp = st.xp
    win_all = st.conv[layer]                                                 # [n_slots, K-1, C] a view
    if rows.spans is None or _single_rows(rows.spans):
        if rows.spans is None:
            st.take_on_device(CONV, layer, rows.slots, rows.positions)
        else:
            st.take(CONV, layer, rows.spans)
        win = win_all[rows.slots]                                            # [B, K-1, C]
        win = xp.where((rows.positions == 0)[:, None, None], win.dtype.type(0), win)
        out, new = conv_decode(xp, win, x, kernel)
        win_all[rows.slots] = new
        return out
    st.take(CONV, layer, rows.spans)
    out = xp.empty(x.shape, xp.float32)                                      # [T, C]
    for sp in rows.spans:
        win = xp.zeros(win_all.shape[1:], xp.float32) if sp.pos0 == 0 else win_all[sp.slot]
        out[sp.row0:sp.row1], new = conv_rows(xp, win, x[sp.row0:sp.row1], kernel)
        win_all[sp.slot] = new
    return out


# --- the gated delta rule -----------------------------------------------------------------------

def delta_decode(xp, m, q, k, v, g, beta, scale):
    """One step of B states at once (ggml_gated_delta_net's step): m [B, H, S(j), S(i)] = S[i][j],
    q, k, v [B, H, S] (heads expanded), g, beta [B, H] -> (out [B, H, S], the new m). Per head
    S <- S exp(g); d = (v - S^T k) beta; S <- S + k d^T; out = S^T q scale."""
    m = m * xp.exp(g)[:, :, None, None]
    sk = (m * k[:, :, None, :]).sum(axis=-1)                                 # [B, H, S(j)] S^T k
    d = (v - sk) * beta[:, :, None]                                          # [B, H, S]
    m = m + d[:, :, :, None] * k[:, :, None, :]
    out = (m * q[:, :, None, :]).sum(axis=-1) * m.dtype.type(scale)          # [B, H, S]
    return out, m


def unit_lower_inverse(xp, a):
    """(I + a)^-1 for a strictly lower triangular a [..., L, L] (L a power of two), by blocks: the
    inverses of the diagonal blocks of size b give those of size 2b as [[X11, 0], [-X22 A21 X11, X22]],
    so log2(L) rounds of batched products."""
    size = a.shape[-1]
    lead = a.shape[:-2]
    x = xp.ones(lead + (size, 1, 1), a.dtype)                                # [..., L, 1, 1] unit diagonal
    b = 1
    while b < size:
        nb = size // (2 * b)
        blocks = a.reshape(lead + (size // b, b, size // b, b))              # [..., L/b, b, L/b, b]
        pairs = blocks[..., 1::2, :, 0::2, :]                                # row blocks 2p+1, column blocks 2q
        a21 = xp.moveaxis(xp.diagonal(pairs, axis1=-4, axis2=-2), -1, -3)   # [..., nb, b, b] block (2p+1, 2p)
        x11, x22 = x[..., 0::2, :, :], x[..., 1::2, :, :]                    # [..., nb, b, b]
        new = xp.zeros(lead + (nb, 2 * b, 2 * b), a.dtype)
        new[..., :b, :b] = x11
        new[..., b:, b:] = x22
        new[..., b:, :b] = -((x22 @ a21) @ x11)
        x, b = new, 2 * b
    return x[..., 0, :, :]


def delta_chunked(xp, s, q, k, v, g, beta, scale):
    """One slot's span in the chunked (WY) form of cpu/recurrent.delta_rule_chunked: s [H, S(k), S(v)]
    (S itself, not ggml's transposed layout), q, k, v [T, H, S] (heads expanded), g, beta [T, H] ->
    (out [T, H, S], the new s). Per chunk of L rows (padded with rows that leave the state as it is),
    G = cumsum(g), decay[t, j] = exp(G_t - G_j) for j <= t; D = (I + A)^-1 (beta v - beta gamma k S0)
    with A[t, j] = beta_t decay[t, j] (k_t . k_j), j < t; out = scale (gamma q S0 + (decay q k^T) D);
    S <- exp(G_last) S0 + (exp(G_last - G) k)^T D. GROUP_CHUNKS chunks are prepared at once; only the
    state between chunks is sequential."""
    f32 = xp.float32
    t_all = q.shape[0]
    lower = xp.tril(xp.ones((CHUNK, CHUNK), dtype=bool))                     # [L, L] j <= t
    strict = xp.tril(xp.ones((CHUNK, CHUNK), dtype=bool), -1)                # [L, L] j < t
    scale = np.float32(scale)
    out = xp.empty(v.shape, f32)                                             # [T, H, S]
    group = GROUP_CHUNKS * CHUNK
    for r0 in range(0, t_all, group):
        r1 = min(r0 + group, t_all)
        t = r1 - r0
        n = -(-t // CHUNK)
        pad = n * CHUNK - t

        def chunks(a):                                                       # [t, H, ...] -> [N, H, L, ...]
            a = a[r0:r1]
            if pad:
                a = xp.concatenate([a, xp.zeros((pad,) + a.shape[1:], f32)])
            return xp.ascontiguousarray(xp.moveaxis(a.reshape((n, CHUNK) + a.shape[1:]), 1, 2))

        qc, kc, vc = chunks(q), chunks(k), chunks(v)                         # [N, H, L, S]
        gc, bc = chunks(g), chunks(beta)                                     # [N, H, L]
        cum = xp.cumsum(gc, axis=-1, dtype=f32)                              # [N, H, L] G
        diff = cum[..., :, None] - cum[..., None, :]                         # [N, H, L, L] G_t - G_j
        decay = xp.exp(xp.where(lower, diff, f32(-np.inf)))                  # 0 above the diagonal
        gamma = xp.exp(cum)                                                  # [N, H, L]
        kt = xp.swapaxes(kc, -1, -2)                                         # [N, H, S, L]
        a = xp.where(strict, (kc @ kt) * decay * bc[..., :, None], f32(0))   # [N, H, L, L] A
        qk = (qc @ kt) * decay * scale                                       # [N, H, L, L]
        inv = unit_lower_inverse(xp, a)                                      # [N, H, L, L] (I + A)^-1
        u = inv @ (vc * bc[..., None])                                       # [N, H, L, S] U
        w = inv @ (kc * (bc * gamma)[..., None])                             # [N, H, L, S] W
        qg = qc * (gamma * scale)[..., None]                                 # [N, H, L, S]
        kl = kc * xp.exp(cum[..., -1:] - cum)[..., None]                     # [N, H, L, S] exp(G_last - G) k
        g_last = xp.exp(cum[..., -1])                                        # [N, H]
        del diff, decay, a, inv
        for c in range(n):
            d = u[c] - w[c] @ s                                              # [H, L, S]
            o = qg[c] @ s + qk[c] @ d                                        # [H, L, S]
            c0 = r0 + c * CHUNK
            c1 = min(c0 + CHUNK, r1)
            out[c0:c1] = xp.swapaxes(o, 0, 1)[:c1 - c0]
            s = g_last[c][:, None, None] * s + xp.swapaxes(kl[c], -1, -2) @ d
    return out, s


def delta_rule(st: RecurrentState, layer: int, rows, q, k, v, g, beta):
    """The gated delta rule over each slot's state: q, k [T, Hk, S], v [T, H, S], g, beta [T, H] ->
    [T, H, S]. Decode rows (a captured step, or every span one row) step in one batch; a span of
    several rows takes the chunked form, one row the step."""
    xp = st.xp
    n_v, size = v.shape[1], v.shape[2]
    scale = np.float32(1) / np.sqrt(np.float32(size))                        # as ggml: in float32
    q, k = expand_heads(xp, q, n_v), expand_heads(xp, k, n_v)                # [T, H, S]
    states = st.delta[layer]                                                 # [n_slots, H, S, S] a view
    if rows.spans is None or _single_rows(rows.spans):
        if rows.spans is None:
            st.take_on_device(DELTA, layer, rows.slots, rows.positions)
        else:
            st.take(DELTA, layer, rows.spans)
        m = states[rows.slots]                                               # [B, H, S, S]
        m = xp.where((rows.positions == 0)[:, None, None, None], m.dtype.type(0), m)
        out, m = delta_decode(xp, m, q, k, v, g, beta, scale)
        states[rows.slots] = m
        return out
    st.take(DELTA, layer, rows.spans)
    out = xp.empty(v.shape, xp.float32)                                      # [T, H, S]
    for sp in rows.spans:
        r = slice(sp.row0, sp.row1)
        m = xp.zeros(states.shape[1:], xp.float32) if sp.pos0 == 0 else states[sp.slot]   # [H, S(j), S(i)]
        if sp.row1 - sp.row0 == 1:
            o, m = delta_decode(xp, m[None], q[r], k[r], v[r], g[r], beta[r], scale)
            states[sp.slot] = m[0]
        else:
            o, s = delta_chunked(xp, xp.swapaxes(m, -1, -2), q[r], k[r], v[r], g[r], beta[r], scale)
            states[sp.slot] = xp.swapaxes(s, -1, -2)
        out[r] = o
    return out
