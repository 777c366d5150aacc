"""Tokenizer: text <-> llama.cpp's token ids, from a GGUF file's own vocabulary."""
from __future__ import annotations

from .bpe import CHAR_TO_BYTE, BytePairEncoder
from .spm import byte_token, spm_tokenize
from .errors import TokenizerError
from .vocab import (ATTR_BYTE, ATTR_CONTROL, ATTR_LSTRIP, ATTR_NORMAL, ATTR_RSTRIP,
                    ATTR_UNKNOWN, ATTR_USER_DEFINED, Vocab, load_vocab)

_C_SPACE = " \t\n\x0b\x0c\r"   # C isspace(): what LSTRIP/RSTRIP strip next to a special token
_SPM_SPACE = "\u2581"


class Tokenizer:
    def __init__(self, vocab: Vocab):
        self.vocab = vocab
        self._bpe = BytePairEncoder(vocab.text_to_id, vocab.merges, vocab.pre) \
            if vocab.model == "gpt2" else None
        self._pieces: list[bytes | None] = [None] * vocab.n_vocab   # special=True pieces, lazily

    @classmethod
    def from_gguf(cls, metadata: dict) -> "Tokenizer":
        return cls(load_vocab(metadata))

    # --- facts ------------------------------------------------------------------------
    @property
    def n_vocab(self) -> int:
        return self.vocab.n_vocab

    @property
    def bos_id(self) -> int | None:
        return self.vocab.bos_id

    @property
    def eos_id(self) -> int | None:
        return self.vocab.eos_id

    @property
    def eot_id(self) -> int | None:
        return self.vocab.eot_id

    @property
    def eog_ids(self) -> frozenset:
        return self.vocab.eog_ids

    def fim_id(self, name: str) -> int | None:
        """A fill-in-the-middle token: "pre", "suf", "mid", "pad", "rep" or "sep"; None where the vocab has none."""
        return self.vocab.fim.get(name)

    @property
    def add_bos(self) -> bool:
        return self.vocab.add_bos

    @property
    def add_eos(self) -> bool:
        return self.vocab.add_eos

    def piece(self, token_id: int) -> str:
        """The vocab string of a token (as stored in the GGUF)."""
        self._check_id(token_id)
        return self.vocab.texts[token_id]

    def is_control(self, token_id: int) -> bool:
        self._check_id(token_id)
        return bool(self.vocab.attrs[token_id] & ATTR_CONTROL)

    def is_eog(self, token_id: int) -> bool:
        return token_id in self.vocab.eog_ids

    # --- encode -----------------------------------------------------------------------
    def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise TokenizerError(f"text to tokenize must be a string, got {type(text).__name__}")
        _check_encodable(text)
        v = self.vocab
        out: list[int] = []
        fragments = self._partition(text, parse_special) if text else []
        if add_special and v.add_bos:
            if v.bos_id is None:
                raise TokenizerError("the vocab asks for a BOS token (add_bos_token) "
                                     "but has no bos_token_id")
            out.append(v.bos_id)
        if self._bpe is not None:
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                else:
                    out.extend(self._bpe.encode(frag))
        else:
            prev_special = True   # SPM puts a space before the text that starts the prompt
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                    prev_special = True
                    continue
                if v.add_space_prefix and prev_special:
                    frag = " " + frag
                out.extend(spm_tokenize(v, frag.replace(" ", _SPM_SPACE)))
                prev_special = False
        if add_special and v.add_eos:
            if v.eos_id is None:
                raise TokenizerError("the vocab asks for an EOS token (add_eos_token) "
                                     "but has no eos_token_id")
            out.append(v.eos_id)
        return out

    def _partition(self, text: str, parse_special: bool) -> list:
        """Split out special-token spellings, longest token first (tokenizer_st_partition)."""
        v = self.vocab
        fragments: list = [text]
        for tid in v.special_ids:
            attr = v.attrs[tid]
            if not parse_special and attr & (ATTR_CONTROL | ATTR_UNKNOWN):
                continue   # user-defined tokens split out even without special parsing
            spelling = v.texts[tid]
            if spelling not in text:
                continue
            new: list = []
            for frag in fragments:
                if isinstance(frag, int) or spelling not in frag:
                    new.append(frag)
                    continue
                parts = frag.split(spelling)
                for j, part in enumerate(parts):
                    if j > 0:
                        new.append(tid)
                        if attr & ATTR_RSTRIP:
                            part = part.lstrip(_C_SPACE)
                    if j < len(parts) - 1 and attr & ATTR_LSTRIP:
                        part = part.rstrip(_C_SPACE)
                    if part:
                        new.append(part)
            fragments = new
        return fragments

    # --- decode -----------------------------------------------------------------------
    def token_to_piece(self, token_id: int, special: bool = True) -> bytes:
        """The bytes one token renders to (llama_token_to_piece, no lstrip)."""
        self._check_id(token_id)
        attr = self.vocab.attrs[token_id]
        if not special and attr & (ATTR_UNKNOWN | ATTR_CONTROL):
            return b""
        piece = self._pieces[token_id]
        if piece is None:
            piece = self._pieces[token_id] = self._render(token_id, attr)
        return piece

    def _render(self, token_id: int, attr: int) -> bytes:
        v = self.vocab
        text = v.texts[token_id]
        if attr & (ATTR_UNKNOWN | ATTR_CONTROL | ATTR_USER_DEFINED):
            return text.encode("utf-8")
        if attr & ATTR_NORMAL:
            if v.model == "llama":
                return text.replace(_SPM_SPACE, " ").encode("utf-8")
            return _undo_byte_alphabet(text)
        if attr & ATTR_BYTE:
            return bytes([int(text[3:5], 16)])
        return b""   # unused / undefined tokens render to nothing

    def decode_bytes(self, ids, special: bool = True) -> bytes:
        """llama_detokenize(remove_special=False): pieces joined, SPM's leading space
        dropped, and the clean-up passes of vocabs that ask for them."""
        v = self.vocab
        parts = []
        for i, tid in enumerate(ids):
            piece = self.token_to_piece(tid, special)
            if i == 0 and v.add_space_prefix and piece.startswith(b" "):
                piece = piece[1:]
            parts.append(piece)
        data = b"".join(parts)
        return _clean_spaces(data) if v.clean_spaces else data

    def decode(self, ids, special: bool = True) -> str:
        return self.decode_bytes(ids, special).decode("utf-8", errors="replace")

    def _check_id(self, token_id) -> None:
        if not isinstance(token_id, int) or isinstance(token_id, bool) \
                or not 0 <= token_id < self.vocab.n_vocab:
            raise TokenizerError(f"token id {token_id!r} is out of range: the vocab has "
                                 f"{self.vocab.n_vocab} tokens (0 .. {self.vocab.n_vocab - 1})")


def _check_encodable(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        cp = ord(text[e.start])
        raise TokenizerError(f"text has a lone surrogate U+{cp:04X} at index {e.start}; "
                             f"it cannot be written as UTF-8") from None


def _undo_byte_alphabet(text: str) -> bytes:
    out = bytearray()
    for ch in text:
        b = CHAR_TO_BYTE.get(ch)
        if b is not None:
            out.append(b)
        else:   # llama.cpp's marker for a code point outside the byte alphabet
            out += b"[UNK_BYTE_0x" + ch.encode("utf-8").hex().encode() + text.encode("utf-8") + b"]"
    return bytes(out)


def _clean_spaces(data: bytes) -> bytes:
    """llama.cpp's clean_up_tokenization_spaces: three passes compacting one buffer in
    place (so a skipped byte reads as NUL to the next step, as it does there)."""
    buf = bytearray(data)
    n = len(buf)
    # pass 1: " ?" " !" " ." " ," lose the space
    total = 1 if n else 0
    for i in range(1, n):
        x = buf[i]
        if buf[i - 1] == 0x20 and x in b"?!.,":
            total -= 1
        buf[total] = x
        total += 1
    # pass 2: " ' " keeps only the apostrophe
    n, total, i = total, 1 if total else 0, 1
    while i < n:
        x = buf[i]
        if x == 0x27 and i + 1 < n and buf[i - 1] == 0x20 and buf[i + 1] == 0x20:
            total -= 1
            i += 1
            buf[i] = 0
        buf[total] = x
        total += 1
        i += 1
    # pass 3: " 's" " 'm" " 're" " 've" lose the space
    n, total = total, 1 if total else 0
    for i in range(1, n):
        x = buf[i]
        if buf[i - 1] == 0x20 and x == 0x27 and i + 1 < n:
            x1 = buf[i + 1]
            if x1 in b"sm":
                total -= 1
            elif x1 not in b"td" and i + 2 < n and (x1, buf[i + 2]) in ((0x72, 0x65), (0x76, 0x65)):
                total -= 1
        buf[total] = x
        total += 1
    return bytes(buf[:total])
