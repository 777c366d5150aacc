"""The vocabulary as the constraint engine sees it: every id's bytes, from bloomery's own tokenizer.

Control (and unknown) ids get a 0xFF lead byte, which no grammar text can hold, so they are
never allowed inside a document (llguidance's convention for special tokens); user-defined
ids (Qwen's <tool_call>) keep their text, so the model may write a call tag as the one id
it was trained on. Built once per engine (about a second for a 150k vocabulary).
"""
from __future__ import annotations

from collections.abc import Callable


SPECIAL = b"\xff"


def token_bytes(tok) -> list[bytes]:
    """Each id's bytes as the engine matches them (bloomery.tokenizer.Tokenizer)."""
    from bloomery.tokenizer.vocab import ATTR_CONTROL, ATTR_UNKNOWN
    out = []
    for i in range(tok.n_vocab):
        piece = tok.token_to_piece(i, special=True)
        if tok.vocab.attrs[i] & (ATTR_CONTROL | ATTR_UNKNOWN):
            piece = SPECIAL + piece
        out.append(piece)
    return out


class _Wrapper:
    """What llg.TokenizerWrapper reads: tokens, eos/bos, special ids, and text -> ids."""

    def __init__(self, pieces: list[bytes], eos: int, encode: Callable[[str], list[int]]):
        self._encode = encode
        self.tokens = pieces
        self.eos_token_id = eos
        self.bos_token_id = None
        self.special_token_ids = [i for i, p in enumerate(pieces) if p[:1] == SPECIAL]

    def __call__(self, text):
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._encode(text)


class Vocab:
    def __init__(self, pieces: list[bytes], eog_ids, encode: Callable[[str], list[int]], n_vocab: int | None = None):
        self.n_vocab = int(n_vocab or len(pieces))
        pieces = list(pieces) + [SPECIAL] * (self.n_vocab - len(pieces))    # ids past the tokenizer's: never
        self.token_bytes = pieces
        self.eog_ids = frozenset(int(i) for i in eog_ids)
        eos = sorted(self.eog_ids)
        import llguidance as llg     # with the first grammar: no server pays for its import at start
        self.lltok = llg.LLTokenizer(llg.TokenizerWrapper(_Wrapper(pieces, eos[0] if eos else 0, encode)),
                                     n_vocab=self.n_vocab, eos_token=eos or None)

    @classmethod
    def from_tokenizer(cls, tok, n_vocab: int | None = None) -> "Vocab":
        return cls(token_bytes(tok), tok.eog_ids,
                   lambda text: tok.encode(text, add_special=False, parse_special=False), n_vocab)
