"""Incremental detokenization for streaming: only whole UTF-8 characters go out."""
from __future__ import annotations


def complete_utf8_len(data: bytes) -> int:
    """Length of `data` without a trailing, still incomplete multi-byte sequence."""
    n = len(data)
    # look back at most 3 bytes for the lead byte of the last sequence
    for back in range(1, min(4, n) + 1):
        b = data[n - back]
        if b & 0xC0 == 0x80:
            continue   # continuation byte: keep looking for the lead
        if b & 0xE0 == 0xC0:
            need = 2
        elif b & 0xF0 == 0xE0:
            need = 3
        elif b & 0xF8 == 0xF0:
            need = 4
        else:
            return n   # ASCII or an invalid lead: nothing to wait for
        return n - back if back < need else n
    return n


class StreamDecoder:
    """Feed ids one at a time; get back the text that is complete so far.

    Pieces are joined as llama-server does when streaming (token_to_piece each, no
    clean-up pass). A multi-byte character split across tokens is held until its
    last byte arrives; flush() gives what is left (broken bytes as U+FFFD).
    """

    def __init__(self, tokenizer, special: bool = True):
        self._tok = tokenizer
        self._special = special
        self._pending = b""

    def feed(self, token_id: int) -> str:
        data = self._pending + self._tok.token_to_piece(token_id, self._special)
        cut = complete_utf8_len(data)
        self._pending = data[cut:]
        return data[:cut].decode("utf-8", errors="replace")

    def feed_many(self, ids) -> str:
        return "".join(self.feed(t) for t in ids)

    @property
    def pending_bytes(self) -> bytes:
        return self._pending

    def flush(self) -> str:
        data, self._pending = self._pending, b""
        return data.decode("utf-8", errors="replace")
