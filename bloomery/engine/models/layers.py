"""The layers the architecture files are built from: hyperparameters read from the GGUF,
the attention half of a block, a dense SwiGLU FFN and a routed (MoE) FFN, each a function
over the ops interface. An architecture file picks among them; none inherits another.

Legend: T = tokens, D = hidden (n_embd), H = query heads, Hkv = KV heads, Dh = head size,
F = FFN size, E = experts, A = experts used per token.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from bloomery.engine.models.base import ModelError, meta


@dataclass(frozen=True)
class Hparams:
    """A decoder's shape, from `<arch>.*` keys (llama.cpp's llm_load_hparams names)."""
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    n_ff: int
    n_ctx_train: int
    rms_eps: float
    freq_base: float

    @classmethod
    def from_gguf(cls, gf, arch: str) -> "Hparams":
        n_embd = int(meta(gf, f"{arch}.embedding_length"))
        n_head = int(meta(gf, f"{arch}.attention.head_count"))
        head_dim = int(meta(gf, f"{arch}.attention.key_length", n_embd // max(n_head, 1)))
        p = cls(
            n_embd=n_embd,
            n_layer=int(meta(gf, f"{arch}.block_count")),
            n_head=n_head,
            n_head_kv=int(meta(gf, f"{arch}.attention.head_count_kv", n_head)),
            head_dim=head_dim,
            n_rot=int(meta(gf, f"{arch}.rope.dimension_count", head_dim)),
            n_ff=int(meta(gf, f"{arch}.feed_forward_length", 0, required=False)),   # 0 in MoE files
            n_ctx_train=int(meta(gf, f"{arch}.context_length")),
            rms_eps=float(meta(gf, f"{arch}.attention.layer_norm_rms_epsilon")),
            freq_base=float(meta(gf, f"{arch}.rope.freq_base", 10000.0)),
        )
        p.check(gf.path)
        return p

    def check(self, path: str) -> None:
        for name in ("n_embd", "n_layer", "n_head", "n_head_kv", "head_dim"):
            if getattr(self, name) < 1:
                raise ModelError(f"{path}: {name} = {getattr(self, name)} must be at least 1")
        if self.n_head % self.n_head_kv:
            raise ModelError(f"{path}: head_count {self.n_head} is not a multiple of head_count_kv {self.n_head_kv}")
        if self.n_rot % 2 or self.n_rot > self.head_dim:
            raise ModelError(f"{path}: rope dimension {self.n_rot} must be even and at most head_dim {self.head_dim}")


@dataclass(frozen=True)
class MoeParams:
    n_expert: int
    n_expert_used: int
    n_ff_exp: int

    @classmethod
    def from_gguf(cls, gf, arch: str) -> "MoeParams":
        p = cls(n_expert=int(meta(gf, f"{arch}.expert_count")),
                n_expert_used=int(meta(gf, f"{arch}.expert_used_count")),
                n_ff_exp=int(meta(gf, f"{arch}.expert_feed_forward_length", 0, required=False)))
        if p.n_expert < 1 or not 1 <= p.n_expert_used <= p.n_expert:
            raise ModelError(f"{gf.path}: expert_used_count {p.n_expert_used} must be in 1..expert_count ({p.n_expert})")
        return p


# The GGUF tensors each layer function reads (llama.cpp's LLM_TENSOR_* names, {i} the layer):
# an architecture's per-layer map is the union of those of the functions its block calls.
ATTN = {
    "attn_norm": "blk.{i}.attn_norm.weight",
    "wq": "blk.{i}.attn_q.weight",
    "wk": "blk.{i}.attn_k.weight",
    "wv": "blk.{i}.attn_v.weight",
    "wo": "blk.{i}.attn_output.weight",
}
QKV_BIAS = {"bq": "blk.{i}.attn_q.bias", "bk": "blk.{i}.attn_k.bias", "bv": "blk.{i}.attn_v.bias"}
QK_NORM = {"q_norm": "blk.{i}.attn_q_norm.weight", "k_norm": "blk.{i}.attn_k_norm.weight"}
DENSE_FFN = {
    "ffn_norm": "blk.{i}.ffn_norm.weight",
    "ffn_gate": "blk.{i}.ffn_gate.weight",
    "ffn_up": "blk.{i}.ffn_up.weight",
    "ffn_down": "blk.{i}.ffn_down.weight",
}
MOE_FFN = {
    "ffn_norm": "blk.{i}.ffn_norm.weight",
    "gate_inp": "blk.{i}.ffn_gate_inp.weight",        # router [D, E]
    "gate_exps": "blk.{i}.ffn_gate_exps.weight",      # [D, Fe, E]
    "up_exps": "blk.{i}.ffn_up_exps.weight",          # [D, Fe, E]
    "down_exps": "blk.{i}.ffn_down_exps.weight",      # [Fe, D, E]
}


def attention(m, il: int, x, rows, qk_norm: bool = False):
    """The attention half of block il over the residual x, the residual added: [T, D].
    RMSNorm, then Q, K and V (with their biases where the layer has them) in one step (a backend
    may fuse the norm in), optional per-head RMSNorm of q and k (qk_norm), NEOX RoPE, causal
    attention over the slot's KV, the output projection."""
    hp, ly, ops = m.hp, m.layers[il], m.ops
    _, (q, k, v) = ops.norm_matmuls(x, ly["attn_norm"], hp.rms_eps, [ly["wq"], ly["wk"], ly["wv"]],
                                    [ly.get("bq"), ly.get("bk"), ly.get("bv")])      # [T, (H|Hkv)*Dh]
    t = q.shape[0]
    q = q.reshape(t, hp.n_head, hp.head_dim)
    k, v = k.reshape(t, hp.n_head_kv, hp.head_dim), v.reshape(t, hp.n_head_kv, hp.head_dim)
    norms = dict(q_norm=ly["q_norm"], k_norm=ly["k_norm"], eps=hp.rms_eps) if qk_norm else {}
    a = ops.self_attention(m.cache, m.kv_of[il], rows, q, k, v, m.kq_scale, hp.n_rot, hp.freq_base, **norms)  # [T, H*Dh]
    return ops.matmul(a, ly["wo"], x)                                                   # [T, D]


def swiglu_ffn(m, il: int, x):
    """A dense FFN half over the residual x (its RMSNorm first), the residual added: [T, D]."""
    ly, ops = m.layers[il], m.ops
    _, (g, u) = ops.norm_matmuls(x, ly["ffn_norm"], m.hp.rms_eps, [ly["ffn_gate"], ly["ffn_up"]], [None, None])  # [T, F]
    return ops.matmul(ops.swiglu(g, u), ly["ffn_down"], x)                              # [T, D]


def plain_layers(m, x, rows):
    """Every layer of a model whose blocks are attention then swiglu_ffn or moe_ffn, over the residual
    x: [T, D]. A backend with `decode_layers` may run a decode row through all of them in one step
    (the same ops in the same order); else (None) m.block one after another."""
    fused = getattr(m.ops, "decode_layers", None)
    y = fused(m, x, rows) if fused is not None else None
    if y is not None:
        return y
    for il in range(m.n_layer):
        x = m.block(il, x, rows)
    return x


def moe_ffn(m, il: int, x, norm_weights: bool):
    """A routed FFN half (llm_graph_context::build_moe_ffn): the router's softmax over all experts,
    top A, optionally renormalised to sum 1, each expert a SwiGLU FFN, outputs weighted and
    added, the residual added: [T, D]."""
    ly, ops = m.layers[il], m.ops
    h, (logits,) = ops.norm_matmuls(x, ly["ffn_norm"], m.hp.rms_eps, [ly["gate_inp"]], [None])   # [T, D], [T, E]
    ids, w = ops.moe_route(logits, m.moe.n_expert_used, norm_weights=norm_weights)     # [T, A], [T, A]
    return ops.moe_ffn(h, ids, w, ly["gate_exps"], ly["up_exps"], ly["down_exps"], x)  # [T, D]


# --- hybrid linear + full attention (Qwen3.5 / Qwen3.6: llama.cpp's qwen35, qwen35moe) ---

def recurrent_layers(get, arch: str, n_layer: int) -> list[bool]:
    """Which of the n_layer trunk layers are linear attention (llama.cpp's is_recr): the
    `attention.recurrent_layers` array where the file has one, else all but every
    `full_attention_interval`-th layer (default 4). `get(key, default)` reads the metadata."""
    flags = get(f"{arch}.attention.recurrent_layers", None)
    if isinstance(flags, list):
        if len(flags) < n_layer:
            raise ModelError(f"metadata {arch}.attention.recurrent_layers has {len(flags)} entries, "
                             f"the model has {n_layer} layers")
        return [bool(f) for f in flags[:n_layer]]
    interval = get(f"{arch}.full_attention_interval", 4)
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
        raise ModelError(f"metadata {arch}.full_attention_interval = {interval!r} must be an integer >= 1")
    return [(i + 1) % interval != 0 for i in range(n_layer)]


@dataclass(frozen=True)
class DeltaNetParams:
    """A Gated DeltaNet layer's sizes (llama.cpp's ssm_* hparams): Hk key heads (group_count) and
    H value heads (time_step_rank), each of size S (state_size); the conv window of K taps runs
    over the fused q, k, v channels (2 * Hk * S + H * S)."""
    d_conv: int
    d_state: int
    n_group: int
    dt_rank: int
    d_inner: int

    @classmethod
    def from_gguf(cls, gf, arch: str) -> "DeltaNetParams":
        p = cls(*(int(meta(gf, f"{arch}.ssm.{k}")) for k in
                  ("conv_kernel", "state_size", "group_count", "time_step_rank", "inner_size")))
        problem = p.problem()
        if problem:
            raise ModelError(f"{gf.path}: {problem}")
        return p

    def problem(self) -> str:
        """The first inconsistency among the sizes, or ''."""
        for name in ("d_conv", "d_state", "n_group", "dt_rank", "d_inner"):
            if getattr(self, name) < 1:
                return f"ssm {name} = {getattr(self, name)} must be at least 1"
        if self.d_inner != self.d_state * self.dt_rank:
            return (f"ssm.inner_size {self.d_inner} is not ssm.state_size {self.d_state} x ssm.time_step_rank "
                    f"{self.dt_rank} (each value head is one state wide)")
        if self.dt_rank % self.n_group:
            return (f"ssm.time_step_rank {self.dt_rank} (value heads) is not a multiple of ssm.group_count "
                    f"{self.n_group} (key heads)")
        return ""

    @property
    def key_dim(self) -> int:
        return self.d_state * self.n_group

    @property
    def conv_channels(self) -> int:
        return 2 * self.key_dim + self.d_inner

    @property
    def state_floats(self) -> int:
        """Float32 values one slot holds for one layer: the conv window and the delta-rule state."""
        return (self.d_conv - 1) * self.conv_channels + self.dt_rank * self.d_state * self.d_state


GATED_ATTN = {
    "attn_norm": "blk.{i}.attn_norm.weight",
    "wqg": "blk.{i}.attn_q.weight",                  # [D, 2*H*Dh]: each head's query, then its gate
    "wk": "blk.{i}.attn_k.weight",
    "wv": "blk.{i}.attn_v.weight",
    "wo": "blk.{i}.attn_output.weight",
}
DELTA_NET = {
    "attn_norm": "blk.{i}.attn_norm.weight",
    "wqkv": "blk.{i}.attn_qkv.weight",               # [D, 2*Hk*S + H*S], into the conv window
    "wz": "blk.{i}.attn_gate.weight",                # [D, H*S], the output gate
    "conv1d": "blk.{i}.ssm_conv1d.weight",           # [K, C]
    "dt_bias": "blk.{i}.ssm_dt.bias",                # [H]
    "ssm_a": "blk.{i}.ssm_a",                        # [H], -exp(A_log)
    "ssm_beta": "blk.{i}.ssm_beta.weight",           # [D, H]
    "ssm_alpha": "blk.{i}.ssm_alpha.weight",         # [D, H]
    "ssm_norm": "blk.{i}.ssm_norm.weight",           # [S]
    "ssm_out": "blk.{i}.ssm_out.weight",             # [H*S, D]
}
POST_NORM = {"ffn_norm": "blk.{i}.post_attention_norm.weight"}    # the FFN half's RMSNorm
SHARED_EXPERT = {
    "gate_inp_shexp": "blk.{i}.ffn_gate_inp_shexp.weight",          # [D]: one gate logit per token
    "gate_shexp": "blk.{i}.ffn_gate_shexp.weight",
    "up_shexp": "blk.{i}.ffn_up_shexp.weight",
    "down_shexp": "blk.{i}.ffn_down_shexp.weight",
}


def gated_attention(m, il: int, x, rows, imrope_sections):
    """Qwen3.5's full-attention half over the residual x, the residual added: [T, D]. One Q
    projection gives each head's query and its gate; per-head RMSNorm of q and k, (IM)RoPE,
    causal attention over the slot's KV, the output times sigmoid(gate), the output projection."""
    hp, ly, ops = m.hp, m.layers[il], m.ops
    _, (qg, k, v) = ops.norm_matmuls(x, ly["attn_norm"], hp.rms_eps, [ly["wqg"], ly["wk"], ly["wv"]],
                                     [None, None, None])                          # [T, 2*H*Dh], [T, Hkv*Dh]
    t = qg.shape[0]
    qg = qg.reshape(t, hp.n_head, 2, hp.head_dim)
    q, gate = qg[:, :, 0], qg[:, :, 1].reshape(t, hp.n_head * hp.head_dim)      # [T, H, Dh], [T, H*Dh]
    k, v = k.reshape(t, hp.n_head_kv, hp.head_dim), v.reshape(t, hp.n_head_kv, hp.head_dim)
    a = ops.self_attention(m.cache, m.kv_of[il], rows, q, k, v, m.kq_scale, hp.n_rot, hp.freq_base,
                           q_norm=ly["q_norm"], k_norm=ly["k_norm"], eps=hp.rms_eps,
                           imrope_sections=imrope_sections)                      # [T, H*Dh]
    return ops.matmul(ops.sigmoid_gate(a, gate), ly["wo"], x)                    # [T, D]


def delta_net(m, il: int, x, rows):
    """A Gated DeltaNet half over the residual x, the residual added: [T, D] (llama.cpp's
    build_layer_attn_linear). The fused q, k, v projection runs through the slot's causal conv
    window and SiLU; q and k are L2-normalised; beta = sigmoid(x W_beta); the decay
    g = softplus(x W_alpha + dt_bias) * a; the delta rule over the slot's state; a per-head
    RMSNorm gated by SiLU(z); the output projection."""
    hp, dn, ly, ops = m.hp, m.dn, m.layers[il], m.ops
    _, (qkv, z, b, al) = ops.norm_matmuls(x, ly["attn_norm"], hp.rms_eps,
                                          [ly["wqkv"], ly["wz"], ly["ssm_beta"], ly["ssm_alpha"]],
                                          [None] * 4)                           # [T, C], [T, H*S], [T, H] x2
    t, s, kd = qkv.shape[0], dn.d_state, dn.key_dim
    conv = ops.conv_step(m.state, m.state_of[il], rows, qkv, ly["conv1d"], silu=True)   # [T, C]
    qk = ops.l2_norm(conv[:, :2 * kd].reshape(t, 2 * dn.n_group, s), hp.rms_eps)   # [T, 2*Hk, S]: q's heads, k's
    q, k = qk[:, :dn.n_group], qk[:, dn.n_group:]                               # [T, Hk, S] each
    v = conv[:, 2 * kd:].reshape(t, dn.dt_rank, s)                               # [T, H, S]
    o = ops.delta_rule(m.state, m.state_of[il], rows, q, k, v, al, b, ly["dt_bias"], ly["ssm_a"])   # [T, H, S]
    o = ops.swiglu(z.reshape(t, dn.dt_rank, s), ops.rms_norm(o, ly["ssm_norm"], hp.rms_eps))   # norm * silu(z)
    return ops.matmul(o.reshape(t, dn.d_inner), ly["ssm_out"], x)               # [T, D]


def shared_expert_moe_ffn(m, il: int, x):
    """A routed FFN half with a shared expert beside it (qwen35moe's build_layer_ffn): the
    routed experts as moe_ffn (weights renormalised), plus the shared SwiGLU expert scaled by
    sigmoid(x . gate_inp_shexp); the residual added: [T, D]."""
    ly, ops = m.layers[il], m.ops
    h, (logits, g, u, gs) = ops.norm_matmuls(x, ly["ffn_norm"], m.hp.rms_eps,
                                             [ly["gate_inp"], ly["gate_shexp"], ly["up_shexp"],
                                              ly["gate_inp_shexp"]], [None] * 4)   # [T, E], [T, Fs] x2, [T, 1]
    ids, w = ops.moe_route(logits, m.moe.n_expert_used, norm_weights=True)       # [T, A]
    routed = ops.moe_ffn(h, ids, w, ly["gate_exps"], ly["up_exps"], ly["down_exps"])   # [T, D]
    shared = ops.matmul(ops.swiglu(g, u), ly["down_shexp"])                      # [T, D]
    return ops.sigmoid_gate(shared, gs, plus=routed, residual=x)                 # routed + shared * gate + x


def load_hybrid(m, attn_layer: dict, recurrent_layer: dict) -> None:
    """The hybrid decoder's state: hyperparameters (the trunk's layers, without MTP ones), which
    layers are recurrent, each layer's tensors, the KV cache of the full-attention layers and the
    recurrent state of the others. Shared by the qwen35 family's files."""
    gf, arch = m.gf, m.arch
    if not m.ops.caps.recurrent:
        raise ModelError(f"{gf.path}: {arch} needs linear-attention ops (recurrent_state, conv_step, delta_rule), "
                         f"which the {m.ops.name} backend lacks; the numpy (CPU) and cuda backends have them")
    hp = Hparams.from_gguf(gf, arch)
    n_mtp = int(meta(gf, f"{arch}.nextn_predict_layers", 0, required=False))
    if not 0 <= n_mtp < hp.n_layer:
        raise ModelError(f"{gf.path}: {arch}.nextn_predict_layers {n_mtp} leaves no trunk of block_count {hp.n_layer}")
    hp = dataclasses.replace(hp, n_layer=hp.n_layer - n_mtp)
    if int(meta(gf, f"{arch}.attention.value_length", hp.head_dim)) != hp.head_dim:
        raise ModelError(f"{gf.path}: {arch}.attention.value_length differs from key_length {hp.head_dim}")
    sections = meta(gf, f"{arch}.rope.dimension_sections")
    if not isinstance(sections, list) or len(sections) < 4 or sum(int(v) for v in sections[:4]) < 1:
        raise ModelError(f"{gf.path}: {arch}.rope.dimension_sections = {sections!r} must hold 4 section sizes")
    m.imrope_sections = tuple(int(v) for v in sections[:4])
    m.dn = DeltaNetParams.from_gguf(gf, arch)
    m.recurrent = recurrent_layers(gf.get, arch, hp.n_layer)
    m.load_decoder(hp, [recurrent_layer if r else attn_layer for r in m.recurrent],
                   kv_layers=[il for il, r in enumerate(m.recurrent) if not r])
    rec = [il for il, r in enumerate(m.recurrent) if r]
    m.state_of = {il: n for n, il in enumerate(rec)}
    m.state = m.ops.recurrent_state(len(rec), m.n_slots, m.dn.d_conv - 1, m.dn.conv_channels, m.dn.dt_rank,
                                    m.dn.d_state)


def hybrid_mixer(m, il: int, x, rows):
    """Layer il's attention half: Gated DeltaNet or gated full attention, the residual added."""
    if m.recurrent[il]:
        return delta_net(m, il, x, rows)
    return gated_attention(m, il, x, rows, m.imrope_sections)
