"""Engine side: one request's position in its grammar, and the token mask for its next id.

The mask for the next id is computed on a worker thread as soon as an id is accepted
(llguidance releases the GIL while it computes), so it is ready when the model's next
row of logits is: the engine's batched model step runs in between. `allowed()` waits for
it (no wait when the step took longer than the mask, the usual case).

The request's stop ids are allowed exactly where the document is complete; other
end-of-generation ids never are. `done`: complete and nothing else may follow (the
request ends with "stop", as the engine does on a stop id).
"""
from __future__ import annotations

import concurrent.futures

import numpy as np

from bloomery.grammar.errors import GrammarError

NEG_INF = np.float32(-np.inf)
_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar-mask")


class Matcher:
    def __init__(self, grammar: str, vocab, stop_ids=()):
        import llguidance as llg     # with the first grammar: no server pays for its import at start

        self.vocab = vocab
        self.m = llg.LLMatcher(vocab.lltok, grammar, log_level=0)
        if self.m.is_error():
            raise GrammarError(f"grammar does not compile: {self.m.get_error()}")
        self.stop_ids = np.array(sorted(stop_ids), dtype=np.int64)
        self._stop_set = frozenset(int(i) for i in stop_ids)
        self._eog = np.array(sorted(vocab.eog_ids), dtype=np.int64)
        self._next: concurrent.futures.Future | None = None
        self._prefetch()

    # the matcher is not to be touched while a worker computes its mask: its state is read here,
    # before the worker starts (the engine asks `done` right after accept, while the mask computes)

    # -- the mask ------------------------------------------------------------------
    def _compute(self) -> np.ndarray:
        bits = np.frombuffer(self.m.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[:self.vocab.n_vocab].astype(bool)    # [V]
        if self._eog.shape[0]:
            allowed[self._eog] = False
        if self.stop_ids.shape[0]:
            allowed[self.stop_ids] = self.m.is_accepting()
        return allowed

    def _prefetch(self) -> None:
        self._complete, self._done, self._error = self.m.is_accepting(), self.m.is_stopped(), self.m.get_error()
        self._next = None if self._error or self._done else _POOL.submit(self._compute)

    def _settle(self) -> None:
        if self._next is not None:
            self._next.result()

    def allowed(self) -> np.ndarray:
        """[V] bool: the ids the grammar allows next."""
        if self._next is None:
            raise GrammarError(f"the grammar allows no further id ({self._error or 'its document is whole'})")
        allowed = self._next.result()
        if not allowed.any():
            raise GrammarError("no id of the vocabulary can continue the structured output here")
        return allowed

    def mask(self, logits: np.ndarray, top_k: int = 0) -> np.ndarray:
        """logits with every id the grammar does not allow at -inf ([V] float32, a copy)."""
        return np.where(self.allowed(), np.asarray(logits, dtype=np.float32), NEG_INF)

    def pick_greedy(self, logits: np.ndarray) -> int:
        """The largest allowed logit (ties: the lower id)."""
        return int(np.argmax(self.mask(logits)))

    # -- progress -------------------------------------------------------------------
    @property
    def complete(self) -> bool:
        return self._complete

    @property
    def done(self) -> bool:
        return self._done

    def allows(self, token: int) -> bool:
        if token in self._stop_set:
            return self.complete
        self._settle()
        return self.m.validate_tokens([int(token)]) == 1

    def accept(self, token: int) -> None:
        self._settle()
        if token in self._stop_set:
            if not self.complete:
                raise GrammarError(f"stop id {token} before the structured output is complete")
            self._next, self._done = None, True
            return
        if not self.m.consume_token(int(token)):
            raise GrammarError(f"id {token} is not allowed by the structured output here: {self.m.get_error()}")
        self._prefetch()
