"""llama.cpp's sampler chain, as llama-server builds it, over one row of logits.

Chain (common/sampling.cpp, default `samplers`): logit_bias -> penalties -> dry ->
top_n_sigma -> top_k -> typical -> top_p -> min_p -> xtc -> temperature -> dist.
dry, top_n_sigma, typical and xtc are off at llama-server's defaults and have no
field in SamplingParams, so they are not stages here (min_keep is 0 likewise).

The candidate order matters: `dist` walks the candidates in their current order
and picks the first whose running probability sum reaches u * total, so every
stage keeps llama.cpp's order (the vocab order until a stage sorts, then logits
descending). Ties in a sort are broken by the earlier position; llama.cpp's
std::partial_sort leaves them unspecified, so a seeded draw can differ from
llama.cpp only where two candidate logits are bit-equal.

Floats follow llama.cpp: float32 logits, expf, float32 running sums in top_p and
the n_probs softmax, a float64 running sum in dist, and std::mt19937 with
libstdc++'s uniform_real_distribution<double> for the draw.

Structured output (SamplingParams.grammar): the engine hands the Sampler a
bloomery.grammar Matcher; after the bias and the penalties the row is masked to
the ids the grammar allows (the mask was computed while the model ran), and
accept_generated() advances it (and starts the next mask).

V = vocab size, C = candidates left.
"""
from __future__ import annotations

import collections
import math
import secrets
from dataclasses import dataclass

import numpy as np

from bloomery.engine.types import SamplingParams, TokenProb
from bloomery.grammar import GrammarError

LLAMA_DEFAULT_SEED = 0xFFFFFFFF
FLOAT32_LOWEST = float(np.finfo(np.float32).min)   # llama-server's logprob of a 0 probability


class SamplerError(ValueError):
    """A sampling setting the chain cannot run with; the message names it."""


class MT19937:
    """std::mt19937: the 32-bit Mersenne Twister, seeded as the C++ standard says."""

    def __init__(self, seed: int):
        mt = [seed & 0xFFFFFFFF]
        for i in range(1, 624):
            mt.append((1812433253 * (mt[-1] ^ (mt[-1] >> 30)) + i) & 0xFFFFFFFF)
        self._mt = mt
        self._index = 624

    def _twist(self) -> None:
        mt = self._mt
        for i in range(624):
            y = (mt[i] & 0x80000000) | (mt[(i + 1) % 624] & 0x7FFFFFFF)
            mt[i] = mt[(i + 397) % 624] ^ (y >> 1) ^ (0x9908B0DF if y & 1 else 0)
        self._index = 0

    def next_u32(self) -> int:
        if self._index >= 624:
            self._twist()
        y = self._mt[self._index]
        self._index += 1
        y ^= y >> 11
        y ^= (y << 7) & 0x9D2C5680
        y ^= (y << 15) & 0xEFC60000
        y ^= y >> 18
        return y

    def skip_uniforms(self, n: int) -> None:
        """Advance past n uniform_double draws (two words each)."""
        for _ in range(2 * max(0, n)):
            self.next_u32()

    def uniform_double(self) -> float:
        """std::uniform_real_distribution<double>(0, 1) as libstdc++ draws it:
        generate_canonical<double, 53> takes two 32-bit words, low word first."""
        lo = float(self.next_u32())
        hi = float(self.next_u32())
        u = (lo + hi * 4294967296.0) / 18446744073709551616.0
        return u if u < 1.0 else math.nextafter(1.0, 0.0)


@dataclass(frozen=True)
class Sample:
    token: int
    logprob: float | None = None          # log of the chosen id's softmax probability (n_probs > 0)
    top: tuple[TokenProb, ...] = ()       # top n_probs of the raw row, most likely first


def _logf(x: float) -> np.float32:
    return np.float32(math.log(float(np.float32(x))))


def _expf(x: np.ndarray) -> np.ndarray:
    # float64 exp rounded once to float32: what a correctly rounded expf gives
    return np.exp(x.astype(np.float64)).astype(np.float32)


def sorted_top(logits: np.ndarray, k: int) -> np.ndarray:
    """Positions of the k largest logits, descending; ties keep the earlier position."""
    n = logits.shape[0]
    if k >= n:
        return np.argsort(-logits, kind="stable")
    part = np.argpartition(-logits, k - 1)[:k]
    threshold = logits[part].min()
    above = np.flatnonzero(logits > threshold)
    ties = np.flatnonzero(logits == threshold)[: k - above.shape[0]]
    chosen = np.sort(np.concatenate([above, ties]))
    return chosen[np.argsort(-logits[chosen], kind="stable")]


def _logprob(p: np.float32) -> float:
    return FLOAT32_LOWEST if p == 0.0 else float(np.float32(math.log(float(p))))


def top_probs(logits: np.ndarray, n_probs: int) -> tuple[np.ndarray, np.ndarray]:
    """llama-server's get_token_probabilities: softmax of the raw row (float32 sums).
    Returns (probabilities [V], the top n_probs positions, most likely first)."""
    order = sorted_top(logits, min(n_probs, logits.shape[0]))   # [n]
    max_l = logits[order[0]]
    p = _expf(logits - max_l)                                     # [V]
    total = np.cumsum(p, dtype=np.float32)[-1]                    # sequential float32 sum
    return p / total, order


class Sampler:
    """One request's chain: its penalty window and its random stream."""

    def __init__(self, params: SamplingParams, n_vocab: int, n_ctx_slot: int,
                 prompt_ids: tuple[int, ...] | list[int] = (), matcher=None):
        _check(params, n_vocab)
        self.params = params
        self.matcher = matcher            # structured output (bloomery.grammar.Matcher), or None
        self.n_vocab = n_vocab
        self.greedy = params.temperature <= 0.0
        self.seed = params.seed & 0xFFFFFFFF
        if self.seed == LLAMA_DEFAULT_SEED:
            self.seed = secrets.randbits(32)
        self._rng: MT19937 | None = None  # made on the first draw (a greedy chain never draws)
        self._post: tuple[np.ndarray, np.ndarray] | None = None   # (ids, p) the chain's dist stage saw last
        if not self.greedy:
            self.rng.skip_uniforms(params.n_drawn)
        n_last = params.repeat_last_n if params.repeat_last_n >= 0 else n_ctx_slot
        self.penalty_last_n = n_last
        self.penalties_on = n_last != 0 and not (
            np.float32(params.repeat_penalty) == 1.0 and params.frequency_penalty == 0.0
            and params.presence_penalty == 0.0)
        # llama-server feeds the prompt to the penalty window too: what that leaves is its last n_last ids
        tail = list(prompt_ids[-n_last:]) if n_last > 0 else []
        self._window: collections.deque[int] = collections.deque(tail)
        self._counts: collections.Counter[int] = collections.Counter(tail)
        if params.logit_bias:
            self._bias_ids = np.array([i for i, _ in params.logit_bias], dtype=np.int64)
            self._bias = np.array([b for _, b in params.logit_bias], dtype=np.float32)
        else:
            self._bias_ids = None
        # a bias of only bans (-inf: ignore_eos's stop ids, or a client's): a greedy pick is then the first
        # largest logit not banned, which a row's largest logits can settle (pick_from_top)
        self._bans = (np.unique(self._bias_ids) if self._bias_ids is not None and bool(np.all(self._bias == -np.inf))
                      else None)
        # a greedy pick the model can make where the logits are: () for the plain argmax, or the ids a -inf bias
        # bans (the first largest logit not banned: what the biased row's argmax is, ties to the lower id); None
        # where it cannot (another bias, penalties, a schema mask or probabilities asked). The request's settings
        # do not change, so it is read once here, not per step.
        self.device_bans: tuple[int, ...] | None = None
        if self.greedy and not self.penalties_on and self.matcher is None and params.n_probs <= 0:
            if self._bias_ids is None:
                self.device_bans = ()
            elif self._bans is not None:          # (the ids are in the vocabulary: refused above otherwise)
                self.device_bans = tuple(int(i) for i in self._bans)

    @property
    def rng(self) -> MT19937:
        """The request's random stream, seeded on first use (624 words made in Python: 0.4 ms a request)."""
        if self._rng is None:
            self._rng = MT19937(self.seed)
        return self._rng

    def accept(self, token: int) -> None:
        if self.penalty_last_n == 0:
            return
        self._counts[token] += 1
        if len(self._window) >= self.penalty_last_n:
            old = self._window.popleft()
            self._counts[old] -= 1
            if self._counts[old] == 0:
                del self._counts[old]
        self._window.append(token)

    def accept_generated(self, token: int) -> None:
        """A sampled id: the penalty window, and the structured-output state."""
        self.accept(token)
        if self.matcher is not None:
            try:
                self.matcher.accept(token)
            except GrammarError as e:
                raise SamplerError(str(e)) from None

    @property
    def plain_greedy(self) -> bool:
        """The pick is the argmax of the raw logits (no bias, penalties, mask or probabilities asked):
        the model may then pick on its own device and hand over only the id."""
        return self.device_bans == ()

    @property
    def candidates_k(self) -> int:
        """top_k, when everything after the chain's top_k stage can run on the top_k largest
        logits alone (sampled, top_k set, no bias, penalties, schema mask or probabilities asked):
        the model may then hand over only those (sample_candidates); 0 otherwise."""
        prm = self.params
        if (self.greedy or prm.top_k <= 0 or self._bias_ids is not None or self.penalties_on
                or self.matcher is not None or prm.n_probs > 0):
            return 0
        return min(prm.top_k, self.n_vocab)

    def sample_candidates(self, ids: np.ndarray, values: np.ndarray, n_nan: int = 0) -> Sample:
        """The pick from a row's candidates_k largest logits, in the chain's order (descending,
        ties to the lower id): the same id sample() takes from the whole row."""
        k = self.candidates_k
        if not k:
            raise SamplerError("this request's sampler needs the whole row of logits")
        if n_nan:
            raise SamplerError(f"model produced NaN logits ({int(n_nan)} of {self.n_vocab})")
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        values = np.asarray(values, dtype=np.float32).reshape(-1)
        if ids.shape != (k,) or values.shape != (k,) or ids.min() < 0 or ids.max() >= self.n_vocab:
            raise SamplerError(f"expected the {k} largest logits as ids in 0..{self.n_vocab - 1}, got {ids.shape[0]}")
        return Sample(self._after_top_k(ids, values.copy(), True))

    @property
    def greedy_from_top(self) -> bool:
        """A greedy pick that a row's largest logits can settle (no penalties or probabilities asked, no
        bias but bans; a schema mask may be): pick_from_top, else the whole row."""
        return (self.greedy and (self._bias_ids is None or self._bans is not None) and not self.penalties_on
                and self.params.n_probs <= 0)

    @property
    def top_settles(self) -> int:
        """Without a schema: how many of a row's largest logits always settle a greedy pick (one more than
        the bans: one of them is not banned)."""
        return 1 + (0 if self._bans is None else int(self._bans.shape[0]))

    def pick_from_top(self, ids: np.ndarray, values: np.ndarray, n_nan: int = 0) -> int | None:
        """The id sample() takes from the whole row, read off the row's k largest logits (descending,
        ties to the lower id): the first neither banned nor refused by the schema (the biased, masked
        row's first largest). None where they cannot settle it: no candidate left, a NaN in the row
        (sample() refuses it), a banned candidate at +inf (the biased row holds a NaN there), or the
        pick's logit is -inf (the row's argmax is then id 0, allowed or not)."""
        if n_nan:
            return None
        ids = np.asarray(ids).reshape(-1)
        values = np.asarray(values, dtype=np.float32).reshape(-1)
        if not ids.shape[0] or ids.shape != values.shape or ids.min() < 0 or ids.max() >= self.n_vocab:
            return None
        ok = np.ones(ids.shape[0], dtype=bool)
        if self._bans is not None:
            banned = np.isin(ids, self._bans)
            if np.any(values[banned] == np.inf):
                return None
            ok &= ~banned
        if self.matcher is not None:
            try:
                ok &= self.matcher.allowed()[ids]
            except GrammarError:
                return None            # the whole row's pick raises it, by name
        hit = np.flatnonzero(ok)
        if not hit.shape[0]:
            return None
        first = int(hit[0])
        if values[first] == -np.inf:
            return None
        return int(ids[first])

    @property
    def grammar_done(self) -> bool:
        """The structured output is whole and nothing may follow: the request ends with "stop"."""
        return self.matcher is not None and self.matcher.done

    def sample(self, logits: np.ndarray) -> Sample:
        """Pick the next id from one row of raw logits [V]; accept() it after."""
        if logits.shape != (self.n_vocab,):
            raise SamplerError(f"logits row has shape {logits.shape}, expected ({self.n_vocab},)")
        raw = np.asarray(logits, dtype=np.float32)                # [V]
        if np.isnan(raw).any():
            raise SamplerError(f"model produced NaN logits ({int(np.isnan(raw).sum())} of {raw.shape[0]})")
        try:
            token = self._chain(raw.copy())
        except GrammarError as e:
            raise SamplerError(str(e)) from None
        n_probs = self.params.n_probs
        if n_probs <= 0:
            return Sample(token)
        if self.params.post_sampling_probs:
            return self._post_sample(token, n_probs)
        p, order = top_probs(raw, n_probs)
        top = tuple(TokenProb(int(i), _logprob(p[i]), float(p[i])) for i in order)
        return Sample(token, _logprob(p[token]), top)

    def _post_sample(self, token: int, n_probs: int) -> Sample:
        """llama-server's post_sampling_probs: the candidates the chain left, by their pick probability
        (the dist stage's softmax over them; greedy leaves one at 1), the top n_probs with p > 0."""
        ids, p = self._post if self._post is not None else (np.array([token]), np.array([1.0], np.float32))
        order = np.argsort(-p, kind="stable")
        chosen = p[ids == token]
        top = tuple(TokenProb(int(ids[i]), _logprob(p[i]), float(p[i])) for i in order[:n_probs] if p[i] > 0)
        return Sample(token, _logprob(chosen[0] if chosen.shape[0] else np.float32(0.0)), top)

    # -- the chain ---------------------------------------------------------
    def _chain(self, logits: np.ndarray) -> int:
        self._post = None
        prm = self.params
        if self._bias_ids is not None:
            np.add.at(logits, self._bias_ids, self._bias)        # duplicates add, as llama.cpp's loop
        if self.penalties_on and self._counts:
            self._penalize(logits)
        if self.matcher is not None:
            # the schema's mask: greedy walks the ids in descending order and takes the first allowed;
            # a sampled pick runs the chain over the masked row (top_k allowed ids are enough when set)
            if self.greedy:
                return self.matcher.pick_greedy(logits)
            logits = self.matcher.mask(logits, prm.top_k)
        if self.greedy:
            # temperature <= 0 keeps only the first maximum; dist then always picks it
            return int(np.argmax(logits))
        ids = np.arange(logits.shape[0], dtype=np.int64)          # [C] vocab order, unsorted
        is_sorted = False
        if prm.top_k > 0:
            order = sorted_top(logits, min(prm.top_k, logits.shape[0]))
            ids, logits, is_sorted = ids[order], logits[order], True
        return self._after_top_k(ids, logits, is_sorted)

    def _after_top_k(self, ids: np.ndarray, logits: np.ndarray, is_sorted: bool) -> int:
        """top_p -> min_p -> temperature -> dist over the candidates left after top_k."""
        prm = self.params
        if np.float32(prm.top_p) < 1.0:
            ids, logits = self._top_p(ids, logits, is_sorted)
            is_sorted = True
        if prm.min_p > 0.0:
            ids, logits = self._min_p(ids, logits, is_sorted)
        logits = logits / np.float32(prm.temperature)             # [C]
        if prm.post_sampling_probs and prm.n_probs > 0:
            p = _expf(logits - logits.max())
            self._post = (ids, p / np.cumsum(p, dtype=np.float32)[-1])
        return int(ids[self._dist(logits, is_sorted)])

    def _penalize(self, logits: np.ndarray) -> None:
        prm = self.params
        seen = np.fromiter(self._counts.keys(), dtype=np.int64)   # [S]
        count = np.fromiter(self._counts.values(), dtype=np.float32)
        val = logits[seen]
        rep = np.float32(prm.repeat_penalty)
        val = np.where(val <= 0, val * rep, val / rep)
        val = val - (count * np.float32(prm.frequency_penalty) + np.float32(prm.presence_penalty))
        logits[seen] = val

    def _top_p(self, ids, logits, is_sorted):
        max_l = logits[0] if is_sorted else logits.max()
        p = _expf(logits - max_l)                                 # [C]
        p = p / np.cumsum(p, dtype=np.float32)[-1]
        top_p = np.float32(self.params.top_p)
        n = logits.shape[0]
        # llama.cpp first tries the best 256 when unsorted and large; same result, less sorting
        k_try = n if is_sorted or n <= 1024 else 256
        for k in (k_try, n):
            order = np.arange(n) if is_sorted else sorted_top(logits, k)
            cum = np.cumsum(p[order], dtype=np.float32)           # [k] float32 running sum
            hit = np.flatnonzero(cum >= top_p)
            if hit.shape[0] or k == n:
                last = int(hit[0]) + 1 if hit.shape[0] else n
                return ids[order[:last]], logits[order[:last]]
        raise AssertionError("unreachable")

    def _min_p(self, ids, logits, is_sorted):
        log_p = _logf(self.params.min_p)
        if not is_sorted:
            keep = logits >= np.float32(logits.max() + log_p)     # vocab order kept
            if keep.any():
                return ids[keep], logits[keep]
        min_logit = np.float32(logits[0] + log_p)
        below = np.flatnonzero(logits[1:] < min_logit)
        last = int(below[0]) + 1 if below.shape[0] else logits.shape[0]
        return ids[:last], logits[:last]

    def _dist(self, logits: np.ndarray, is_sorted: bool) -> int:
        u = self.rng.uniform_double()       # drawn even for one candidate, as llama.cpp
        if logits.shape[0] == 1:
            return 0
        max_l = logits[0] if is_sorted else logits.max()
        p = _expf(logits - max_l).astype(np.float64)              # [C]
        run = np.cumsum(p)                                        # sequential float64 sum
        target = run[-1] * u
        return min(int(np.searchsorted(run, target, side="left")), logits.shape[0] - 1)


def _check(params: SamplingParams, n_vocab: int) -> None:
    rep = params.repeat_penalty
    if not math.isfinite(rep) or rep <= 0.0 or not math.isfinite(1.0 / rep):
        raise SamplerError(f"penalty_repeat must be finite and greater than 0 (got {rep})")
    for name in ("frequency_penalty", "presence_penalty", "temperature", "top_p", "min_p"):
        value = getattr(params, name)
        if not math.isfinite(value):
            raise SamplerError(f"{name} must be finite (got {value})")
    if params.repeat_last_n < -1:
        raise SamplerError(f"repeat_last_n must be >= -1 (got {params.repeat_last_n})")
    for tok, _bias in params.logit_bias:
        if not 0 <= tok < n_vocab:
            raise SamplerError(f"logit_bias token {tok} is outside the vocab [0, {n_vocab})")
