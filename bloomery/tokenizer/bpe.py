"""Byte-level BPE as llama.cpp's llm_tokenizer_bpe_session does it.

Each pre-tokenized word is written in GPT-2's byte alphabet (every UTF-8 byte is
one printable code point), then the adjacent pair with the lowest merge rank is
merged, leftmost first on ties, until no pair has a rank. A final symbol missing
from the vocab falls back to single-byte tokens. Words repeat a lot in real text,
so the ids of each word are cached.
"""
from __future__ import annotations

import heapq

from .pretok import PreType, split_words


def _byte_alphabet() -> list[str]:
    """GPT-2's byte -> code point table: printable Latin-1 bytes keep their value."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table: dict[int, str] = {b: chr(b) for b in keep}
    n_moved = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n_moved)
            n_moved += 1
    return [table[b] for b in range(256)]


BYTE_TO_CHAR = _byte_alphabet()
CHAR_TO_BYTE = {c: b for b, c in enumerate(BYTE_TO_CHAR)}
_LATIN1_TO_ALPHABET = {b: ord(c) for b, c in enumerate(BYTE_TO_CHAR)}
_SHORT_WORD_N_SYMBOLS = 128  # above this the heap merge beats the quadratic scan
_NO_RANK = 1 << 62
_CACHE_MAX_WORDS = 200_000


def parse_merges(merges: list[str]) -> dict[str, int]:
    """Each merge's rank, keyed by the merge as stored, "LEFT RIGHT"; a repeated merge keeps its first rank.
    The encoder looks a pair up as left + " " + right. Its symbols are spelled in the byte alphabet, which
    has no space (0x20 is "Ġ"), so that key is the merge whose cut at the first space after its first
    character gives that pair, and no other (a merge with another space can never match a pair). Keying
    by the stored string builds the table in one C call: a table of pairs took about 0.15 s of each start."""
    n = len(merges)
    return dict(zip(reversed(merges), range(n - 1, -1, -1)))


class BytePairEncoder:
    def __init__(self, text_to_id: dict[str, int], merges: list[str], pre: PreType):
        self.text_to_id = text_to_id
        self.ranks = parse_merges(merges)
        self.pre = pre
        self._cache: dict[str, tuple[int, ...]] = {}

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        cache = self._cache
        for word in split_words(text, self.pre):
            ids = cache.get(word)
            if ids is None:
                if len(cache) >= _CACHE_MAX_WORDS:
                    cache.clear()
                ids = cache[word] = self._encode_word(word)
            out.extend(ids)
        return out

    def _encode_word(self, word: str) -> tuple[int, ...]:
        encoded = word.encode("utf-8").decode("latin-1").translate(_LATIN1_TO_ALPHABET)
        t2i = self.text_to_id
        if self.pre.ignore_merges:
            tid = t2i.get(encoded)
            if tid is not None:
                return (tid,)
        symbols = list(encoded)
        if len(symbols) <= _SHORT_WORD_N_SYMBOLS:
            symbols = self._merge_short(symbols)
        else:
            symbols = self._merge_long(symbols)
        out: list[int] = []
        for s in symbols:
            tid = t2i.get(s)
            if tid is not None:
                out.append(tid)
                continue
            for b in s.encode("utf-8"):   # llama.cpp looks each raw byte up as a token
                tid = t2i.get(chr(b)) if b < 0x80 else None
                if tid is not None:
                    out.append(tid)
        return tuple(out)

    def _merge_short(self, symbols: list[str]) -> list[str]:
        # pair ranks kept in a list beside the symbols: after a merge only the two
        # neighbouring pairs change, and min()/index() find the leftmost best in C
        get = self.ranks.get
        ranks = [get(left + " " + right, _NO_RANK) for left, right in zip(symbols, symbols[1:])]
        while ranks:
            best = min(ranks)
            if best == _NO_RANK:
                break
            i = ranks.index(best)
            merged = symbols[i] + symbols[i + 1]
            symbols[i:i + 2] = [merged]
            del ranks[i]
            if i < len(ranks):
                ranks[i] = get(merged + " " + symbols[i + 1], _NO_RANK)
            if i > 0:
                ranks[i - 1] = get(symbols[i - 1] + " " + merged, _NO_RANK)
        return symbols

    def _merge_long(self, symbols: list[str]) -> list[str]:
        # linked list of symbols + a heap of (rank, left index): the same order as the scan
        ranks = self.ranks
        n = len(symbols)
        text: list[str | None] = list(symbols)
        nxt = [*range(1, n), -1]
        prv = [*range(-1, n - 1)]
        heap: list[tuple[int, int, int, str]] = []

        def push(left: int, right: int) -> None:
            r = ranks.get(text[left] + " " + text[right])
            if r is not None:
                heapq.heappush(heap, (r, left, right, text[left] + text[right]))

        for i in range(n - 1):
            push(i, i + 1)
        while heap:
            _, left, right, joined = heapq.heappop(heap)
            if text[left] is None or text[right] is None or nxt[left] != right \
                    or text[left] + text[right] != joined:
                continue   # stale: one side was merged since
            text[left], text[right] = joined, None
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prv[nxt[right]] = left
            if prv[left] >= 0:
                push(prv[left], left)
            if nxt[left] >= 0:
                push(left, nxt[left])
        out, i = [], 0
        while i >= 0:
            out.append(text[i])
            i = nxt[i]
        return out
