"""The numpy backend of the ops: llama.cpp's CPU numerics on the host.

Each op mirrors the ggml-cpu kernel llama.cpp runs for it (named in its
docstring), including where it rounds: activations quantized to the weight's
vec_dot partner type, F16 where ggml uses F16, float64 where ggml sums in
ggml_float. Weights stay as the GGUF's bytes: the compiled kernels read the
stored blocks in place (Q8_0, Q5_0, Q4_K, Q6_K); only the numpy kernels, where
the compiled ones are off or cannot take a type, decode a weight's planes once
and keep them (about 4 bytes per parameter).

Legend: T = tokens, D = hidden, N = weight rows, K = weight row length,
E = experts, A = experts used per token, H = heads, Dh = head size.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import weakref
from contextlib import nullcontext
from typing import Sequence

import numpy as np
from gguf import GGMLQuantizationType as QT

from bloomery.engine.cpu import kernels as cpu_kernels
from bloomery.engine.cpu import recurrent
from bloomery.engine.quant import formats, threads
from bloomery.engine.cpu.kv_cache import KVCache
from bloomery.engine.cpu.sizes import MOE_CALL_MAX_ROWS, UBATCH
from bloomery.engine.ops import AttnSpan, Caps, Rows, delta_gates
from bloomery.engine.cpu.ops_math import expf_libm, v_expf, vec_soft_max
from bloomery.engine.sampler import sorted_top


class NumpyWeight:
    """A stored tensor: raw bytes (an mmap view) plus lazily decoded forms."""

    def __init__(self, ggml_type: int, shape: Sequence[int], data: np.ndarray, cache_planes: bool = True):
        self.ggml_type = int(ggml_type)
        self.shape = tuple(int(s) for s in shape)                      # ne order: shape[0] = row length
        self.n_cols = self.shape[0]
        self.n_rows = int(np.prod(self.shape[1:2])) if len(self.shape) > 1 else 1
        self.compiled: bool | None = None                               # formats.c_takes, once known
        self.data = data
        self.cache_planes = cache_planes
        self._planes: formats.Planes | None = None
        self._dense: np.ndarray | None = None
        self._c_raw: np.ndarray | None = None
        self._experts: list[NumpyWeight] | None = None

    def expert(self, e: int) -> "NumpyWeight":
        """Expert e of a [K, N, E] stack: its bytes are one contiguous slice."""
        if self._experts is None:
            n_exp = self.shape[2]
            per = self.data.size // n_exp
            self._experts = [NumpyWeight(self.ggml_type, self.shape[:2], self.data[i * per:(i + 1) * per],
                                         self.cache_planes) for i in range(n_exp)]
        return self._experts[e]

    def _form(self, attr: str, make):
        """A decoded form, made on first use and kept when cache_planes."""
        out = getattr(self, attr)
        if out is None:
            out = make(self.ggml_type, self.data, self.n_rows, self.n_cols)
            if self.cache_planes:
                setattr(self, attr, out)
        return out

    def dense(self) -> np.ndarray:
        """Float32 [N, K] (F32 / F16 weights, and types with no exact integer path)."""
        return self._form("_dense", formats.dequantize)

    def planes(self) -> formats.Planes:
        return self._form("_planes", formats.decode_planes)

    def dot_c(self, x, per_row: bool = False) -> np.ndarray:
        """x (array or formats.CAct) @ this weight^T through the compiled kernels; the blocks are
        checked on the first call only (a view of the stored bytes, nothing copied)."""
        if self._c_raw is None:
            self._c_raw = formats.c_raw(self.ggml_type, self.data, self.n_rows, self.n_cols)
        return formats.dot_c(x, self.ggml_type, self._c_raw, self.n_rows, self.n_cols, per_row=per_row, checked=True)


def _compiled(w: NumpyWeight) -> bool:
    """The compiled kernels compute this weight's llama-order product."""
    if not formats.KERNEL_ORDER:
        return False
    if w.compiled is None:
        w.compiled = formats.c_takes(w.ggml_type, w.n_rows)
    return w.compiled and cpu_kernels.lib() is not None


def _f32(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32)


def _expert_stacks(stacks, d: int):
    """A routed FFN's gate, up and down stacks as kernels/cpu_lanes.c moe_chunk reads them: (their
    contiguous bytes, the expert width Fe, the experts E), or None where some stack is not one the
    compiled call takes (for hidden size d)."""
    n_exp = stacks[0].shape[2] if len(stacks[0].shape) == 3 else -1
    if any(not isinstance(w, NumpyWeight) or len(w.shape) != 3 or w.shape[2] != n_exp or not _compiled(w.expert(0))
           for w in stacks):
        return None
    fe = stacks[0].shape[1]
    if stacks[0].shape[:2] != (d, fe) or stacks[1].shape[:2] != (d, fe) or stacks[2].shape[:2] != (fe, d):
        return None
    return [np.ascontiguousarray(w.data) for w in stacks], fe, n_exp


def _vec(w) -> np.ndarray:
    """A 1-D weight handle (norm weights, biases) or array as float32."""
    if isinstance(w, NumpyWeight):
        return w.dense().reshape(-1)
    return _f32(w)


_LIBM = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
for _fn in ("cosf", "sinf", "powf"):
    getattr(_LIBM, _fn).restype = ctypes.c_float
_LIBM.cosf.argtypes = _LIBM.sinf.argtypes = [ctypes.c_float]
_LIBM.powf.argtypes = [ctypes.c_float, ctypes.c_float]
_ROPE_TABLES: dict[tuple[int, float], tuple[np.ndarray, np.ndarray, int]] = {}
ROPE_GROW = 256                      # positions a RoPE table grows by


def rope_table_bytes(n_ctx_slot: int, n_rot: int) -> int:
    """What rope_table holds once positions up to n_ctx_slot - 1 were seen (the plan counts it):
    cos and sin [positions rounded up to ROPE_GROW, n_rot/2] in f32."""
    return -(-max(1, n_ctx_slot) // ROPE_GROW) * ROPE_GROW * (n_rot // 2) * 4 * 2


_ROPE_LAST: list = [None, None]                                         # the last call's key and tables


def rope_table(positions: np.ndarray, n_rot: int, freq_base: float) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [T, n_rot/2] as ggml_rope_cache_init builds them: theta starts at the
    position and is multiplied by powf(base, -2/n_rot) in f32 per pair; libm's cosf and
    sinf (not always correctly rounded, so we call the same ones). Rows are kept in one table per
    (n_rot, base), grown ROPE_GROW positions at a time up to the largest position seen."""
    key_all = (positions.dtype.str, positions.tobytes(), n_rot, float(freq_base))
    if _ROPE_LAST[0] == key_all:                                        # every layer asks for the same rows
        return _ROPE_LAST[1]
    half = n_rot // 2
    key = (n_rot, float(freq_base))
    cos_t, sin_t, filled = _ROPE_TABLES.get(key, (np.empty((0, half), np.float32), np.empty((0, half), np.float32), 0))
    top = int(positions.max()) + 1 if len(positions) else 0
    if top > filled:
        size = -(-top // ROPE_GROW) * ROPE_GROW
        if size > len(cos_t):
            cos_t = np.concatenate([cos_t, np.empty((size - len(cos_t), half), np.float32)])
            sin_t = np.concatenate([sin_t, np.empty((size - len(sin_t), half), np.float32)])
        theta_scale = np.float32(_LIBM.powf(np.float32(freq_base), np.float32(-2.0) / np.float32(n_rot)))
        for p in range(filled, size):
            theta = np.float32(p)
            for i in range(half):
                cos_t[p, i], sin_t[p, i] = _LIBM.cosf(theta), _LIBM.sinf(theta)
                theta = np.float32(theta * theta_scale)
        filled = size
        _ROPE_TABLES[key] = (cos_t, sin_t, filled)
    idx = positions.astype(np.int64)
    cos, sin = cos_t[idx], sin_t[idx]
    cos.flags.writeable = sin.flags.writeable = False                   # shared by the callers that follow
    _ROPE_LAST[:] = [key_all, (cos, sin)]
    return cos, sin


def imrope_text_pairs(half: int, sections) -> np.ndarray:
    """Which of the half rotated pairs turn with a text position under IMRoPE (ggml_mrope_cache_init
    with is_imrope: sector i % sum(sections); sectors 0, 1, 2 mod 3 take sections 0, 1, 2 while
    under 3x each, the rest the fourth, which a text token's position [p, p, p, 0] leaves at 0)."""
    s0, s1, s2, s3 = (int(v) for v in sections)
    sector = np.arange(half) % (s0 + s1 + s2 + s3)
    return (((sector % 3 == 0) & (sector < 3 * s0)) | ((sector % 3 == 1) & (sector < 3 * s1))
            | ((sector % 3 == 2) & (sector < 3 * s2)))


class _DecodePlan:
    """decode_layers' arguments for one model, made once: each layer's stored blocks, norms,
    biases and KV (slot 0); per call only the position, the RoPE row and the slot. A layer is
    layers.attention (biases or per-head q/k norms or neither) then layers.swiglu_ffn, or then
    layers.moe_ffn with an F32 router (the model says norm_weights)."""

    TYPES = frozenset({int(QT.Q8_0), int(QT.Q5_0), int(QT.Q4_K), int(QT.Q5_K), int(QT.Q6_K)})
    NAMES = ("wq", "wk", "wv", "wo", "ffn_gate", "ffn_up", "ffn_down")
    MOE = ("gate_inp", "gate_exps", "up_exps", "down_exps")
    VECS = ("attn_norm", "ffn_norm", "bq", "bk", "bv", "q_norm", "k_norm")

    def __init__(self, m, descs, keep: list, n_ff: int):
        hp = m.hp
        self.hp, self.cache, self.descs, self.keep = hp, m.cache, descs, keep   # keep: what the pointers point into
        self.n_layer = len(descs)
        self.step = cpu_kernels.DStep(n_embd=hp.n_embd, n_head=hp.n_head, n_head_kv=hp.n_head_kv,
                                      head_dim=hp.head_dim, n_rot=hp.n_rot, n_ff=n_ff, n_rows=0,
                                      eps=float(np.float32(hp.rms_eps)), scale=float(np.float32(m.kq_scale)),
                                      nth=threads.N_THREADS)
        self.slot_elems = m.cache.k.strides[1] // m.cache.k.itemsize
        self.moe = any(d.router for d in descs)                      # steps over MOE_CALL_MAX_ROWS rows: the ops

    @classmethod
    def make(cls, m):
        """The plan, or None where some layer is not one decode_layers takes."""
        hp, cache = getattr(m, "hp", None), getattr(m, "cache", None)
        if hp is None or not isinstance(cache, KVCache) or not formats.KERNEL_ORDER:
            return None
        if hp.head_dim > 1024 or hp.n_rot % 2 or hp.n_rot > hp.head_dim:
            return None
        if (cache.k.shape[0] != hp.n_layer or cache.k.shape[3:] != (hp.n_head_kv, hp.head_dim)
                or not (cache.k.flags.c_contiguous and cache.v.flags.c_contiguous)):
            return None
        d, nq, nkv, f = hp.n_embd, hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim, hp.n_ff
        shapes = {"wq": (d, nq), "wk": (d, nkv), "wv": (d, nkv), "wo": (nq, d), "ffn_gate": (d, f),
                  "ffn_up": (d, f), "ffn_down": (f, d)}
        sizes = {"attn_norm": d, "ffn_norm": d, "bq": nq, "bk": nkv, "bv": nkv, "q_norm": hp.head_dim,
                 "k_norm": hp.head_dim}
        descs, keep = (cpu_kernels.DLayer * hp.n_layer)(), []
        any_dense = False
        for il, ly in enumerate(m.layers):
            if set(ly) - set(cls.NAMES) - set(cls.MOE) - set(cls.VECS):
                return None                                             # shared experts, recurrent, ...
            moe = "gate_inp" in ly
            names = cls.NAMES[:4] if moe else cls.NAMES
            if moe and set(ly) & set(cls.NAMES[4:]):
                return None
            any_dense |= not moe
            if not moe and f < 1:
                return None
            ws = [ly.get(n) for n in names]
            if any(not isinstance(w, NumpyWeight) or w.ggml_type not in cls.TYPES or not _compiled(w)
                   or w.shape != shapes[n] for n, w in zip(names, ws)):
                return None
            vecs = {}
            for name in cls.VECS:
                w = ly.get(name)
                if w is None:
                    if name in ("attn_norm", "ffn_norm"):
                        return None
                    continue
                if not isinstance(w, NumpyWeight) or w.ggml_type != int(QT.F32) or w.shape != (sizes[name],):
                    return None
                vecs[name] = np.ascontiguousarray(_vec(w))
            if ("q_norm" in vecs) != ("k_norm" in vecs):
                return None
            raws = []
            for w in ws:
                if w._c_raw is None:
                    w._c_raw = formats.c_raw(w.ggml_type, w.data, w.n_rows, w.n_cols)
                raws.append(w._c_raw)
            desc = descs[il]
            desc.attn_norm, desc.ffn_norm = vecs["attn_norm"].ctypes.data, vecs["ffn_norm"].ctypes.data
            for i, b in enumerate(("bq", "bk", "bv")):
                desc.bias[i] = vecs[b].ctypes.data if b in vecs else None
            if "q_norm" in vecs:
                desc.q_norm, desc.k_norm = vecs["q_norm"].ctypes.data, vecs["k_norm"].ctypes.data
            for i, (w, raw) in enumerate(zip(ws, raws)):
                desc.w[i], desc.wtype[i] = raw.ctypes.data, w.ggml_type
            if moe:
                got = cls._moe(m, ly, desc, d)
                if got is None:
                    return None
                raws.extend(got)
            keep.append((vecs, raws))
            kv = m.kv_of[il]
            desc.kc = cache.k[kv, 0].ctypes.data
            desc.vc = cache.v[kv, 0].ctypes.data
        return cls(m, descs, keep, f if any_dense else 0)

    @staticmethod
    def _moe(m, ly, desc, d: int):
        """A routed FFN half into desc (what NumpyOps.moe_ffn's compiled call takes), or None; returns
        the arrays desc points into."""
        norm_weights, moe = getattr(m, "norm_weights", None), getattr(m, "moe", None)
        router = ly["gate_inp"]
        if norm_weights is None or moe is None or not isinstance(router, NumpyWeight):
            return None
        n_exp = router.shape[1] if len(router.shape) == 2 else -1
        if router.ggml_type != int(QT.F32) or router.shape != (d, n_exp) or not 1 <= moe.n_expert_used <= n_exp:
            return None
        stacks = [ly[n] for n in ("gate_exps", "up_exps", "down_exps")]
        got = _expert_stacks(stacks, d)
        if got is None or got[2] != n_exp:
            return None
        raws, fe, _ = got
        rw = np.ascontiguousarray(router.dense(), np.float32)             # [E, D]
        desc.router, desc.n_expert, desc.n_used = rw.ctypes.data, n_exp, moe.n_expert_used
        desc.norm_weights, desc.n_ff_exp = int(bool(norm_weights)), fe
        for i, (w, raw) in enumerate(zip(stacks, raws)):
            desc.exps[i], desc.exps_type[i], desc.exps_bytes[i] = raw.ctypes.data, w.ggml_type, raw.size // n_exp
        return [rw, *raws]

    def run(self, lib, slots: np.ndarray, positions: np.ndarray, x: np.ndarray) -> np.ndarray:
        """x [T, D]: row r is the next position positions[r] of slot slots[r] (distinct slots)."""
        hp, step = self.hp, self.step
        pos = np.ascontiguousarray(positions, dtype=np.int64)
        kv_slot = np.ascontiguousarray(slots, dtype=np.int64) * self.slot_elems
        cos, sin = rope_table(pos.astype(np.int32), hp.n_rot, hp.freq_base)   # [T, n_rot/2]
        step.n_rows, step.pos, step.kv_slot = len(pos), pos.ctypes.data, kv_slot.ctypes.data
        step.cos, step.sin = cos.ctypes.data, sin.ctypes.data
        out = np.array(x, dtype=np.float32, order="C")                 # [T, D], through the layers in place
        if lib.decode_layers(ctypes.addressof(self.descs), self.n_layer, ctypes.byref(step), out.ctypes.data) != 0:
            raise MemoryError("decode_layers could not allocate its scratch")
        return out


# glibc's mallopt parameters: the heap keeps up to this many freed bytes at its top instead of handing
# them back, and blocks up to the mmap ceiling come from the heap. A prompt pass frees and takes again
# the same tens of MB of products each layer; given back, each came again as fresh pages the kernel
# zeroed (clear_page was 3 % of a 512-id prompt's CPU time on the 0.5B file, 2 threads). What stays
# is at most the pass's own peak, the plan's scratch term.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
KEEP_FREED_BYTES = 1 << 30
MMAP_CEILING_BYTES = 32 << 20      # glibc refuses more (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)


def keep_freed_pages() -> bool:
    """Set the process's glibc malloc to keep freed memory (see above); False where the C library is
    not glibc or refuses (the process then runs as before, only slower)."""
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_TRIM_THRESHOLD, KEEP_FREED_BYTES)) and bool(mallopt(M_MMAP_THRESHOLD, MMAP_CEILING_BYTES))


class NumpyOps:
    name = "numpy"
    caps = Caps(n_ubatch=UBATCH, decode_rows=0, fused_head=True, decode_graphs=False, prompt_scratch=False,
                recurrent=True)

    def __init__(self, cache_planes: bool = True):
        self.cache_planes = cache_planes
        self.keeps_freed_pages = keep_freed_pages()
        self._decode_plans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # model -> _DecodePlan | None

    # --- weights ---
    def loading(self):
        """The weights stay where the file's mapping has them: nothing to set up for a load."""
        return nullcontext()

    def weight(self, ggml_type: int, shape: Sequence[int], data) -> NumpyWeight:
        return NumpyWeight(ggml_type, shape, np.asarray(data), self.cache_planes)

    def offloaded_weight(self, name, ggml_type, shape, data, host):
        raise ValueError("the numpy backend holds every tensor on the host: it has no offload tier")

    def offload_experts(self, residency: bool, threads: int) -> None:
        raise ValueError("the numpy backend holds every tensor on the host: it has no offload tier")

    def after_step(self, decode: bool) -> None:
        """Nothing to do between steps on the host."""

    def get_rows(self, w: NumpyWeight, ids) -> np.ndarray:
        """ggml_get_rows: dequantize_row_* of just the rows asked for."""
        ids = np.asarray(ids, dtype=np.int64)
        n_rows = w.n_rows
        if ids.size and (ids.min() < 0 or ids.max() >= n_rows):
            bad = int(ids[(ids < 0) | (ids >= n_rows)][0])
            raise ValueError(f"token id {bad} is out of range: the vocabulary has {n_rows} entries (0..{n_rows - 1})")
        rows = w.data.reshape(n_rows, -1)[ids]                          # [T, row_bytes]
        return formats.dequantize(w.ggml_type, rows.reshape(-1), len(ids), w.n_cols).copy()

    def matmul(self, x, w: NumpyWeight, residual=None) -> np.ndarray:
        y = self._matmul(x, w)
        return y if residual is None else y + _f32(residual)           # ggml_add after the mul_mat

    def matmuls(self, x, ws, biases) -> list[np.ndarray]:
        """Products of one input: where the compiled kernels take them, x is quantized once."""
        if any(_compiled(w) for w in ws):
            x = _f32(x)
            if x.shape[-1] != ws[0].n_cols:
                raise ValueError(f"matmul: input has {x.shape[-1]} columns, the weight's rows are {ws[0].n_cols} long")
            act = formats.CAct(x)
            ys = [w.dot_c(act) if _compiled(w) else self._matmul(x, w) for w in ws]
        else:
            ys = [self._matmul(x, w) for w in ws]
        return [y if b is None else self.add(y, b) for y, b in zip(ys, biases)]

    def rows(self, spans, positions) -> Rows:
        return Rows(list(spans), None, np.asarray(positions))

    def ban(self, logits, bans) -> None:
        """Each row's banned ids to -inf in place: logits [B, V], bans [NB, B] int (-1: none)."""
        bans = np.asarray(bans)
        if bans.ndim != 2 or bans.shape[1] != logits.shape[0]:
            raise ValueError(f"bans of shape {bans.shape} for {logits.shape[0]} rows: [NB, {logits.shape[0]}] ids")
        for j, b in zip(*np.nonzero((bans >= 0) & (bans < logits.shape[1]))):
            logits[b, bans[j, b]] = -np.inf

    def argmax(self, logits) -> np.ndarray:
        return np.argmax(_f32(logits), axis=-1).astype(np.int32)

    # --- the head's largest logits only (greedy and top-k picks) ---
    TOPK_MAX = 64

    def topk_max(self, n_vocab: int) -> int:
        return min(self.TOPK_MAX, n_vocab)

    def topk(self, logits, k: int):
        """The k largest of each row [B, V] in the sampler chain's order (descending, ties to the
        lower id): (ids [B, k] int32, values [B, k] f32, NaN count [B] int32), as CudaOps.topk."""
        logits = _f32(logits)
        b, n = logits.shape
        if not 1 <= k <= self.topk_max(n):
            raise ValueError(f"topk takes 1..{self.topk_max(n)} of {n} logits, not {k}")
        n_nan = np.isnan(logits).sum(axis=1).astype(np.int32)
        ids = np.empty((b, k), np.int32)
        for r in range(b):
            row = np.where(np.isnan(logits[r]), -np.inf, logits[r])
            ids[r] = sorted_top(row, k)
        return ids, np.take_along_axis(logits, ids, axis=1), n_nan

    def matmul_topk(self, x, w: NumpyWeight, k: int):
        """topk(matmul(x, w), k), computing the exact sums only of the rows that can be among the k
        largest where the weight's type allows (formats.top_llama); else the whole batch's product,
        whose float order may depend on the batch size (Q6_K's tiled path from 8 rows)."""
        x = _f32(x)
        tops = self._tops(x, w, k)
        if tops is None:
            return self.topk(self._matmul(x, w), k)
        ids = np.stack([i for i, _ in tops]).astype(np.int32)
        vals = np.stack([v for _, v in tops]).astype(np.float32)
        return ids, vals, np.zeros(x.shape[0], np.int32)

    def matmul_argmax(self, x, w: NumpyWeight) -> np.ndarray:
        """argmax(matmul(x, w)): the first largest of each row, as argmax() of the full product."""
        x = _f32(x)
        tops = self._tops(x, w, 1)
        if tops is None:
            return self.argmax(self._matmul(x, w))
        return np.array([i[0] for i, _ in tops], np.int32)

    def _tops(self, x, w: NumpyWeight, k: int):
        """formats.top_llama's answer for every row, or None where any row needs the full product."""
        if not self._top_exact(w):
            return None
        tops = formats.top_llama(x, w.planes(), k)
        return None if any(t is None for t in tops) else tops

    @staticmethod
    def _top_exact(w: NumpyWeight) -> bool:
        """top_llama reproduces _matmul's values: the llama-order kernel of a type it covers
        (where the C kernel takes the type, its whole product is quicker than the estimate)."""
        return formats.KERNEL_ORDER and QT(w.ggml_type) in formats.TOP_TYPES and not _compiled(w)

    def _expert_matmul(self, x, w: NumpyWeight) -> np.ndarray:
        """ggml_compute_forward_mul_mat_id for one expert's routed rows: as mul_mat, except that
        a repacked Q4_K weight runs its gemv row by row (repack.cpp forward_mul_mat_id)."""
        if _compiled(w):
            return w.dot_c(_f32(x), per_row=True)
        if formats.KERNEL_ORDER and QT(w.ggml_type) in formats.LLAMA_ORDER_TYPES:
            return formats.dot_llama(_f32(x), w.planes(), per_row=True)
        return self._matmul(x, w)

    def _matmul(self, x, w: NumpyWeight) -> np.ndarray:
        """ggml_compute_forward_mul_mat: src1 converted to the weight's vec_dot type first."""
        x = _f32(x)                                                     # [T, K]
        if x.shape[-1] != w.n_cols:
            raise ValueError(f"matmul: input has {x.shape[-1]} columns, the weight's rows are {w.n_cols} long")
        qt = QT(w.ggml_type)
        if qt == QT.F32:
            if formats.KERNEL_ORDER:
                lib = cpu_kernels.lib()
                if lib is None or x.ndim != 2:
                    return formats.dot_f32_llama(x, w.dense())         # [T, N] llama.cpp's float order
                x, wd = np.ascontiguousarray(x), np.ascontiguousarray(w.dense())
                out = np.empty((x.shape[0], wd.shape[0]), np.float32)  # [T, N] the same order, compiled
                lib.f32_mm(x.ctypes.data, x.shape[0], x.shape[1], wd.ctypes.data, wd.shape[0], out.ctypes.data,
                           threads.N_THREADS)
                return out
            return x @ w.dense().T                                      # [T, N]
        if qt == QT.F16:
            return x.astype(np.float16).astype(np.float32) @ w.dense().T   # [T, N] f16 x f16 in f32
        if _compiled(w):
            return w.dot_c(x)                                           # [T, N] the same order, compiled
        if qt in formats.LLAMA_ORDER_TYPES and formats.KERNEL_ORDER:
            return formats.dot_llama(x, w.planes())                    # [T, N] llama.cpp's float order
        if qt in formats.EXACT_TYPES:
            return formats.dot_planes(x, w.planes())                   # [T, N]
        return x @ w.dense().T                                          # float fallback: no exact path

    # --- elementwise and norms ---
    def add(self, a, b) -> np.ndarray:
        return _f32(a) + (_vec(b) if isinstance(b, NumpyWeight) else _f32(b))

    def take_rows(self, x, rows) -> np.ndarray:
        return x[np.asarray(rows)]

    def norm_matmuls(self, x, norm, eps: float, ws, biases):
        h = self.rms_norm(x, norm, eps)
        return h, self.matmuls(h, ws, biases)

    def rms_norm(self, x, w, eps: float) -> np.ndarray:
        """ggml_compute_forward_rms_norm_f32 (+ the fused mul): squares in f32, summed in double
        (in order in the compiled kernel, as ggml; numpy's pairwise sum gives the same f32 mean
        but for a last-bit tie of the double sum)."""
        x = _f32(x)                                                     # [..., D]
        lib = cpu_kernels.lib()
        if lib is not None and x.ndim >= 1 and x.size:
            x = np.ascontiguousarray(x)
            wv = np.ascontiguousarray(_vec(w))
            n = x.shape[-1]
            if wv.shape == (n,):
                out = np.empty_like(x)
                lib.rms_norm(x.ctypes.data, wv.ctypes.data, out.ctypes.data, x.size // n, n, float(np.float32(eps)))
                return out
        sq_sum = (x * x).sum(axis=-1, keepdims=True, dtype=np.float64)  # [..., 1] ggml_float
        mean = (sq_sum / x.shape[-1]).astype(np.float32)
        scale = np.float32(1) / np.sqrt(mean + np.float32(eps))         # [..., 1] f32
        return (x * scale) * _vec(w)

    def swiglu(self, gate, up) -> np.ndarray:
        """ggml_vec_swiglu_f32: x / (1 + e^-x) * g in f32, with ggml_v_expf on each row's
        16-wide chunks and the C library's expf on the tail (as its AVX512 loop does)."""
        g, up = _f32(gate), _f32(up)
        lib = cpu_kernels.lib()
        if lib is not None and g.shape == up.shape:
            g, up = np.ascontiguousarray(g), np.ascontiguousarray(up)
            out = np.empty_like(g)
            n = g.shape[-1]
            rows = g.size // max(1, n)
            lib.swiglu(g.ctypes.data, up.ctypes.data, out.ctypes.data, n, rows, threads.N_THREADS)
            return out
        n_vec = g.shape[-1] - g.shape[-1] % 16
        e = np.empty_like(g)
        e[..., :n_vec] = v_expf(np.float32(0) - g[..., :n_vec])
        e[..., n_vec:] = expf_libm(-g[..., n_vec:])
        return (g / (np.float32(1) + e)) * up

    def sigmoid(self, x) -> np.ndarray:
        """ggml_vec_sigmoid_f32: 1 / (1 + expf(-x))."""
        x = _f32(x)
        return np.float32(1) / (np.float32(1) + expf_libm(-x))

    def softplus(self, x) -> np.ndarray:
        """ggml's op_softplus: x above 20, else logf(1 + expf(x))."""
        x = _f32(x)
        return np.where(x > 20, x, np.log(np.float32(1) + expf_libm(np.minimum(x, 20)))).astype(np.float32)

    def silu(self, x) -> np.ndarray:
        """ggml_vec_silu_f32: x / (1 + e^-x), the same expf per lane as swiglu's."""
        x = _f32(x)
        return self.swiglu(x, np.ones_like(x))

    def mul(self, a, b) -> np.ndarray:
        return _f32(a) * (_vec(b) if isinstance(b, NumpyWeight) else _f32(b))

    def sigmoid_gate(self, x, gate, plus=None, residual=None) -> np.ndarray:
        """mul(x, sigmoid(gate)), then add(plus, it), then add(it, residual): the ops one by one."""
        y = self.mul(x, self.sigmoid(gate))
        if plus is not None:
            y = self.add(plus, y)
        return y if residual is None else self.add(y, residual)

    def l2_norm(self, x, eps: float) -> np.ndarray:
        """x / sqrt(sum x^2 + eps) over the last axis, as llama.cpp builds it for the delta rule:
        rms_norm with eps/n, then a scale by 1/sqrt(n)."""
        x = _f32(x)
        n = x.shape[-1]
        sq_sum = (x * x).sum(axis=-1, keepdims=True, dtype=np.float64)
        mean = (sq_sum / n).astype(np.float32)
        scale = np.float32(1) / np.sqrt(mean + np.float32(np.float32(eps) / np.float32(n)))
        return (x * scale) * (np.float32(1) / np.sqrt(np.float32(n)))

    def rope_neox(self, x, positions, n_rot: int, freq_base: float, imrope_sections=None) -> np.ndarray:
        """ggml rope, NEOX mode (pairs i, i + n_rot/2), with ggml's cos/sin table and FMA. With
        imrope_sections, ggml's IMRoPE over a text position [p, p, p, 0]: a pair whose sector
        takes the fourth section turns by angle 0 (left as it is), the others as NEOX."""
        x = _f32(x)                                                     # [T, H, Dh]
        half = n_rot // 2
        cos, sin = rope_table(np.asarray(positions), n_rot, freq_base)  # [T, n_rot/2] each
        if imrope_sections is not None:
            still = ~imrope_text_pairs(half, imrope_sections)
            cos, sin = cos.copy(), sin.copy()
            cos[:, still], sin[:, still] = 1, 0
        lib = cpu_kernels.lib()
        if lib is not None and x.ndim == 3 and x.shape[0] == cos.shape[0]:
            out = np.array(x, dtype=np.float32, order="C")              # a copy, turned in place
            t, h, dh = out.shape
            lib.rope_neox(out.ctypes.data, t, h, dh, n_rot, cos.ctypes.data, sin.ctypes.data)
            return out
        c, s = cos[:, None, :].astype(np.float64), sin[:, None, :].astype(np.float64)
        x0 = x[..., :half].astype(np.float64)                           # [T, H, n_rot/2]
        x1 = x[..., half:n_rot].astype(np.float64)
        out = x.copy()
        # rotate_pairs compiles to fma(x0, cos, -(x1*sin)) and fma(x0, sin, x1*cos) at -O3:
        # the second product rounds to f32, the first stays exact inside the FMA
        out[..., :half] = x0 * c - (x1 * s).astype(np.float32)
        out[..., half:n_rot] = x0 * s + (x1 * c).astype(np.float32)
        return out

    # --- one decode row through every dense layer ---
    def decode_layers(self, m, x, rows: Rows):
        """layers.attention then layers.swiglu_ffn or layers.moe_ffn over every layer for the decode
        rows of a step, one row a slot (each the next position of its own), in one compiled call (the
        same kernels in the same order as the ops for these rows: the same bits), or None where that
        call does not take this step (a prompt's rows, a layer or weight it lacks, the numpy kernels)
        and the ops run one by one."""
        lib = cpu_kernels.lib()
        if lib is None or not rows.spans:
            return None
        x = _f32(x)
        if x.ndim != 2 or x.shape[0] != len(rows.spans):
            return None
        plan = self._decode_plans.get(m, False)
        if plan is False:
            plan = _DecodePlan.make(m)
            self._decode_plans[m] = plan
        if plan is None or (plan.moe and len(rows.spans) > MOE_CALL_MAX_ROWS):
            return None                                                 # (the plan counts that many rows' buffers)
        positions = np.asarray(rows.positions).reshape(-1)
        slots = [sp.slot for sp in rows.spans]
        if len(set(slots)) != len(slots) or len(positions) != len(slots):
            return None
        for r, sp in enumerate(rows.spans):
            if not (0 <= sp.slot < m.cache.n_slots and 0 <= sp.pos0 < m.cache.n_ctx_slot
                    and (sp.row0, sp.row1) == (r, r + 1) and int(positions[r]) == sp.pos0):
                return None                                             # the op-by-op path names the problem
        return plan.run(lib, np.array(slots, np.int64), np.array([sp.pos0 for sp in rows.spans], np.int64), x)

    # --- attention ---
    def kv_cache(self, n_layer: int, n_slots: int, n_ctx_slot: int, n_head_kv: int, head_dim: int) -> KVCache:
        return KVCache(n_layer, n_slots, n_ctx_slot, n_head_kv, head_dim)

    def self_attention(self, cache: KVCache, layer: int, rows: Rows, q, k, v, scale: float, n_rot: int,
                       freq_base: float, q_norm=None, k_norm=None, eps: float = 0.0,
                       imrope_sections=None) -> np.ndarray:
        if q_norm is not None:
            q = self.rms_norm(q, q_norm, eps)                          # [T, H, Dh] per head
        if k_norm is not None:
            k = self.rms_norm(k, k_norm, eps)                          # [T, Hkv, Dh]
        q = self.rope_neox(q, rows.positions, n_rot, freq_base, imrope_sections)   # [T, H, Dh]
        k = self.rope_neox(k, rows.positions, n_rot, freq_base, imrope_sections)   # [T, Hkv, Dh]
        return self.attention(cache, layer, rows.spans, q, k, v, scale)

    # --- linear attention: the recurrent state per slot ---
    def recurrent_state(self, n_layer: int, n_slots: int, conv_window: int, conv_channels: int,
                        n_v_heads: int, head_size: int) -> recurrent.RecurrentState:
        return recurrent.RecurrentState(n_layer, n_slots, conv_window, conv_channels, n_v_heads, head_size)

    def conv_step(self, state: recurrent.RecurrentState, layer: int, rows: Rows, x, kernel: NumpyWeight,
                  silu: bool = False) -> np.ndarray:
        out = recurrent.conv_step(state, layer, rows.spans, x, kernel.dense())
        return self.silu(out) if silu else out

    def delta_rule(self, state: recurrent.RecurrentState, layer: int, rows: Rows, q, k, v, alpha, b, dt_bias, a
                   ) -> np.ndarray:
        g, beta = delta_gates(self, alpha, b, dt_bias, a)
        return recurrent.delta_rule_spans(state, layer, rows.spans, q, k, v, g, beta)

    def attention(self, cache: KVCache, layer: int, spans: Sequence[AttnSpan], q, k, v, scale: float) -> np.ndarray:
        """ggml_compute_forward_flash_attn_ext_f16 per span (each span is one sequence)."""
        t, h, dh = q.shape
        out = np.empty((t, h, dh), np.float32)                          # [T, H, Dh]
        for sp in spans:
            rows = slice(sp.row0, sp.row1)
            cache.write(layer, sp.slot, sp.pos0, k[rows], v[rows])
            out[rows] = cache.attend(layer, sp.slot, sp.pos0, q[rows], scale)
        return out.reshape(t, h * dh)

    # --- mixture of experts ---
    def moe_route(self, logits, n_used: int, norm_weights: bool):
        """ggml_soft_max (ggml_vec_soft_max_f32, then a scale by 1/sum rounded to f32),
        ggml_argsort_top_k, then (qwen3moe) weights / clamp(sum, 2^-14)."""
        z = _f32(logits)                                                # [T, E]
        p, total = vec_soft_max(z, z.max(axis=-1))
        p = p * (1.0 / total).astype(np.float32)[:, None]               # [T, E]
        ids = np.argsort(-p, axis=-1, kind="stable")[:, :n_used]        # [T, A]
        w = np.take_along_axis(p, ids, axis=-1)                         # [T, A]
        if norm_weights:
            total = w.sum(axis=-1, keepdims=True, dtype=np.float64).astype(np.float32)
            w = w / np.maximum(total, np.float32(6.103515625e-5))
        return ids, w.astype(np.float32)

    def moe_ffn(self, x, ids, weights, gate_exps: NumpyWeight, up_exps: NumpyWeight,
                down_exps: NumpyWeight, residual=None) -> np.ndarray:
        """ggml_mul_mat_id per expert, weighted, then the A outputs added in rank order."""
        x = _f32(x)                                                     # [T, D]
        t, n_used = ids.shape
        out = self._experts_c(x, ids, weights, (gate_exps, up_exps, down_exps))
        if out is None:
            out = self._experts_py(x, ids, weights, gate_exps, up_exps, down_exps)
        acc = out[:, 0]
        for a in range(1, n_used):
            acc = acc + out[:, a]                                       # [T, D]
        return acc if residual is None else acc + _f32(residual)

    @staticmethod
    def _experts_c(x, ids, weights, stacks) -> np.ndarray | None:
        """Every routed expert's weighted output [T, A, D] in one compiled call (kernels/cpu_lanes.c
        moe_ffn_rows: the loop below, the experts spread over the threads; the same bits), or None
        where that call does not take these rows or weights and the loop runs. Its buffers are the C
        library's, an expert in flight on each thread with at most sizes.MOE_CHUNK_ROWS of its rows at
        once, which the plan counts (sizes.moe_call_bytes: in the decode moment, and in the routed FFN's
        for a prompt pass)."""
        lib = cpu_kernels.lib()
        if lib is None or not formats.KERNEL_ORDER or x.ndim != 2:
            return None
        got = _expert_stacks(stacks, x.shape[1])
        if got is None:
            return None
        raws, f, n_exp = got
        d = x.shape[1]
        ids32 = np.ascontiguousarray(ids, dtype=np.int32)
        if ids32.size and (ids32.min() < 0 or ids32.max() >= n_exp):
            return None                                                 # the loop names the problem
        wts = np.ascontiguousarray(weights, dtype=np.float32)
        ptrs = (ctypes.c_void_p * 3)(*(r.ctypes.data for r in raws))
        types = (ctypes.c_int64 * 3)(*(w.ggml_type for w in stacks))
        per = (ctypes.c_int64 * 3)(*(r.size // n_exp for r in raws))
        experts = np.unique(ids32).astype(np.int32)
        x = np.ascontiguousarray(x)
        t, n_used = ids32.shape
        out = np.empty((t, n_used, d), np.float32)                      # [T, A, D]: every pair is written
        if lib.moe_ffn_rows(ptrs, types, per, d, f, x.ctypes.data, t, ids32.ctypes.data, wts.ctypes.data, n_used,
                            experts.ctypes.data, len(experts), out.ctypes.data, threads.N_THREADS) != 0:
            raise MemoryError("moe_ffn_rows could not allocate its scratch")
        return out

    def _experts_py(self, x, ids, weights, gate_exps, up_exps, down_exps) -> np.ndarray:
        t, n_used = ids.shape
        out = np.zeros((t, n_used, down_exps.shape[1]), np.float32)     # [T, A, D]
        for e in np.unique(ids):
            tok, rank = np.nonzero(ids == e)                            # rows routed to e
            xe = x[tok]                                                 # [t_e, D]
            h = self.swiglu(self._expert_matmul(xe, gate_exps.expert(e)), self._expert_matmul(xe, up_exps.expert(e)))
            out[tok, rank] = self._expert_matmul(h, down_exps.expert(e)) * weights[tok, rank][:, None]
        return out

    # --- host transfer ---
    def from_host(self, x) -> np.ndarray:
        return np.asarray(x)

    def to_host(self, x) -> np.ndarray:
        return np.asarray(x)
