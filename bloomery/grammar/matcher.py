"""The token-level mask: which vocabulary ids a program allows next, fast.

Vocab holds every id's bytes (control tokens are empty and never allowed; the
stop ids are allowed only where the document is complete) and indexes the ids by
first byte. Matcher is one request's position in its program:

  pick_greedy(logits)  checks the ids in descending logit order among those whose
                       first byte the state allows, and takes the first allowed one
                       (exact argmax of the masked row; ties keep the lower id);
  mask(logits, top_k)  the masked row for a sampled pick: with top_k > 0 only the
                       top_k allowed ids are needed, else every allowed id (cached
                       per state, since free-string states repeat);
  accept(token)        advances the state.

Programs are cached by their JSON text (LRU), so their lazily built DFA is shared
by every request that sends the same schema.
"""
from __future__ import annotations

import collections

import numpy as np

from bloomery.grammar.program import Program

NEG_INF = np.float32(-np.inf)
CHUNKS = (8, 64, 512, 4096)
MASK_CACHE_STATES = 64


class GrammarError(ValueError):
    """The program cannot go on with this vocabulary (no id allowed), or a token it did not allow."""


class Vocab:
    def __init__(self, token_bytes: list[bytes], stop_ids=()):
        self.token_bytes = token_bytes
        self.n_vocab = len(token_bytes)
        first = np.full(self.n_vocab, 256, dtype=np.int16)        # 256: empty (control) ids
        for i, t in enumerate(token_bytes):
            if t:
                first[i] = t[0]
        self.first_byte = first                                    # [V]

    @classmethod
    def from_tokenizer(cls, tok) -> "Vocab":
        return cls([tok.token_to_piece(i, special=False) for i in range(tok.n_vocab)])


class ProgramCache:
    def __init__(self, size: int = 16):
        self.size = size
        self._lru: collections.OrderedDict[str, Program] = collections.OrderedDict()

    def get(self, text: str) -> Program:
        prog = self._lru.get(text)
        if prog is None:
            prog = Program.from_json(text)
            self._lru[text] = prog
            while len(self._lru) > self.size:
                self._lru.popitem(last=False)
        else:
            self._lru.move_to_end(text)
        return prog


class _StateIndex:
    """Per (program, vocab) caches: first-byte lookup tables and full masks per state."""

    def __init__(self):
        self.first_ok: dict[int, np.ndarray] = {}
        self.masks: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()


class Matcher:
    def __init__(self, program: Program, vocab: Vocab, stop_ids=()):
        self.prog, self.vocab = program, vocab
        self.stop_ids = np.array(sorted(stop_ids), dtype=np.int64)
        self._stop_set = frozenset(int(i) for i in stop_ids)
        idx = getattr(program, "_bloomery_index", None)
        if idx is None or idx[0] is not vocab:
            idx = (vocab, _StateIndex())
            program._bloomery_index = idx
        self._idx = idx[1]
        self.state = program.start
        self.n_checks = 0          # ids walked (what a step cost; the benchmark reads it)

    # -- queries -----------------------------------------------------------
    @property
    def complete(self) -> bool:
        return self.prog.complete(self.state)

    @property
    def done(self) -> bool:
        return self.prog.done(self.state)

    def allows(self, token: int) -> bool:
        if token in self._stop_set:
            return self.complete
        data = self.vocab.token_bytes[token]
        self.n_checks += 1
        return bool(data) and self.prog.walk(self.state, data) >= 0

    def _candidates(self) -> np.ndarray:
        """[V] bool: ids whose first byte the state allows, and the stop ids when complete."""
        ok = self._idx.first_ok.get(self.state)
        if ok is None:
            ok = np.zeros(257, dtype=bool)
            for b in range(256):
                ok[b] = self.prog.step(self.state, b) >= 0
            self._idx.first_ok[self.state] = ok
        cand = ok[self.vocab.first_byte]
        if self.stop_ids.shape[0]:
            cand[self.stop_ids] = self.complete
        return cand

    def _ordered(self, logits: np.ndarray):
        """Candidate ids in descending logit order (ties: lower id first), chunk by chunk."""
        row = np.where(self._candidates(), logits, NEG_INF)
        n_live = int(np.count_nonzero(row > NEG_INF))
        done = 0
        for k in CHUNKS + (n_live,):
            k = min(k, n_live)
            if k <= done:
                continue
            if k >= row.shape[0]:
                order = np.argsort(-row, kind="stable")[:k]
            else:
                part = np.argpartition(-row, k - 1)[:k]
                part = np.sort(part)
                order = part[np.argsort(-row[part], kind="stable")]
            for t in order[done:k]:
                yield int(t)
            done = k
            if done >= n_live:
                return

    def pick_greedy(self, logits: np.ndarray) -> int:
        for t in self._ordered(logits):
            if self.allows(t):
                return t
        raise GrammarError("no id of the vocabulary can continue the structured output here")

    def mask(self, logits: np.ndarray, top_k: int) -> np.ndarray:
        """logits with every id the program does not allow at -inf ([V] float32, a copy)."""
        if top_k > 0:
            keep = []
            for t in self._ordered(logits):
                if self.allows(t):
                    keep.append(t)
                    if len(keep) >= top_k:
                        break
            allowed = np.zeros(logits.shape[0], dtype=bool)
            allowed[keep] = True
        else:
            allowed = self._full_mask()
        if not allowed.any():
            raise GrammarError("no id of the vocabulary can continue the structured output here")
        return np.where(allowed, logits, NEG_INF).astype(np.float32)

    def _full_mask(self) -> np.ndarray:
        masks = self._idx.masks
        got = masks.get(self.state)
        if got is None:
            cand = np.flatnonzero(self._candidates())
            got = np.zeros(self.vocab.n_vocab, dtype=bool)
            for t in cand:
                if self.allows(int(t)):
                    got[t] = True
            masks[self.state] = got
            while len(masks) > MASK_CACHE_STATES:
                masks.popitem(last=False)
        else:
            masks.move_to_end(self.state)
        return got.copy() if self.stop_ids.shape[0] == 0 else got

    # -- progress ----------------------------------------------------------
    def accept(self, token: int) -> None:
        if token in self._stop_set:
            if not self.complete:
                raise GrammarError(f"stop id {token} before the structured output is complete")
            return
        nxt = self.prog.walk(self.state, self.vocab.token_bytes[token])
        if nxt < 0 or not self.vocab.token_bytes[token]:
            raise GrammarError(f"id {token} is not allowed by the structured output here")
        self.state = nxt
