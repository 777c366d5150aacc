"""Incremental detokenization and stop strings, as llama-server's slot does them.

The engine sends ids; the front turns each id's bytes into text. Two things hold
text back from a streamed chunk: an incomplete UTF-8 sequence at the end (its
next bytes are in the next id), and a suffix that could still grow into a stop
string. A stop string found ends the generation; the content stops before it.
"""
from __future__ import annotations

import codecs


def partial_stop_len(text: str, stops: tuple[str, ...], start: int = 0) -> int:
    """The longest suffix of text[start:] that is a proper prefix of a stop string."""
    n_best = 0
    n_avail = len(text) - start
    for word in stops:
        for k in range(min(len(word) - 1, n_avail), n_best, -1):
            if text.endswith(word[:k]):
                n_best = k
                break
    return n_best


def find_stop(text: str, stops: tuple[str, ...], start: int = 0) -> tuple[int, str] | None:
    """The earliest full stop string in text[start:]: (its position, the word)."""
    best: tuple[int, str] | None = None
    for word in stops:
        pos = text.find(word, start)
        if pos >= 0 and (best is None or pos < best[0]):
            best = (pos, word)
    return best


class TextAssembler:
    """Feeds id bytes in, lets out the text that is safe to send."""

    def __init__(self, stops: tuple[str, ...] = ()):
        self.stops = stops
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""              # everything decoded so far (cut at the stop once found)
        self.n_sent = 0             # chars of self.text already let out
        self.stopping_word = ""     # the stop string found, "" while none

    def feed(self, piece: bytes) -> str:
        """Adds one id's bytes; returns the newly safe text ("" while held back)."""
        if self.stopping_word:
            return ""
        self.text += self._decoder.decode(piece)
        hit = find_stop(self.text, self.stops, self.n_sent)
        if hit is not None:
            pos, word = hit
            self.stopping_word = word
            self.text = self.text[:pos]
            return self._release(len(self.text))
        n_hold = partial_stop_len(self.text, self.stops, self.n_sent)
        return self._release(len(self.text) - n_hold)

    def finish(self) -> str:
        """The end of the generation: lets out whatever was held (a broken UTF-8 tail as U+FFFD)."""
        if not self.stopping_word:
            self.text += self._decoder.decode(b"", final=True)
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        if upto <= self.n_sent:
            return ""
        out = self.text[self.n_sent:upto]
        self.n_sent = upto
        return out
