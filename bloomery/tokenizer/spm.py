"""SentencePiece-style tokenization as llama.cpp's llm_tokenizer_spm_session does it.

Start from single characters; repeatedly merge the adjacent pair whose joined text
is a vocab token with the highest score (leftmost on ties). A final symbol not in
the vocab is emitted as byte tokens <0xXX>.
"""
from __future__ import annotations

import heapq

from .errors import TokenizerError
from .vocab import Vocab


def byte_token(vocab: Vocab, byte: int) -> int:
    tid = vocab.text_to_id.get(f"<0x{byte:02X}>")
    if tid is None and byte < 0x80:
        tid = vocab.text_to_id.get(chr(byte))   # llama.cpp's fallback: the byte itself
    if tid is None:
        raise TokenizerError(f"the SPM vocab has no token for byte 0x{byte:02X} "
                             f"(neither '<0x{byte:02X}>' nor the raw byte)")
    return tid


def spm_tokenize(vocab: Vocab, text: str) -> list[int]:
    """`text` already has its spaces escaped as U+2581."""
    n = len(text)
    if n == 0:
        return []
    t2i, scores = vocab.text_to_id, vocab.scores
    start = list(range(n))
    size = [1] * n                    # symbol length in characters; 0 once merged away
    nxt = [*range(1, n), -1]
    prv = [*range(-1, n - 1)]
    heap: list[tuple[float, int, int, int]] = []
    rev_merge: dict[str, tuple[int, int]] = {}

    def try_add(left: int, right: int) -> None:
        if left < 0 or right < 0:
            return
        joined_len = size[left] + size[right]
        piece = text[start[left]:start[left] + joined_len]
        tid = t2i.get(piece)
        if tid is None:
            return
        heapq.heappush(heap, (-scores[tid], left, right, joined_len))
        rev_merge[piece] = (left, right)

    for i in range(1, n):
        try_add(i - 1, i)
    while heap:
        _, left, right, joined_len = heapq.heappop(heap)
        if size[left] == 0 or size[right] == 0 or size[left] + size[right] != joined_len:
            continue   # stale bigram
        size[left] += size[right]
        size[right] = 0
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prv[nxt[right]] = left
        try_add(prv[left], left)
        try_add(left, nxt[left])

    out: list[int] = []

    def resegment(i: int, depth: int) -> None:
        piece = text[start[i]:start[i] + size[i]]
        tid = t2i.get(piece)
        if tid is not None:
            out.append(tid)
            return
        pair = rev_merge.get(piece)
        if pair is None or depth > 64:
            out.extend(byte_token(vocab, b) for b in piece.encode("utf-8"))
            return
        resegment(pair[0], depth + 1)
        resegment(pair[1], depth + 1)

    i = 0
    while i >= 0:
        resegment(i, 0)
        i = nxt[i]
    return out
