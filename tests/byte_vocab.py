"""A byte-level vocabulary for the constraint engine's CPU tests: one id per byte, a few
multi-byte ids, and a control id as the stop id."""
from __future__ import annotations

from bloomery.grammar import Matcher, Vocab

EOS = 256
PIECES = [bytes([b]) for b in range(256)] + [b"\xff<eos>", b'{"', b'": "', b'", "', b"name", b"\\n", b"</tool_call>"]
VOCAB = Vocab(PIECES, [EOS], lambda text: list(text.encode("utf-8")))


def feed(grammar: str, text: str) -> tuple[int, bool]:
    """(bytes accepted one id per byte, whole document)."""
    m = Matcher(grammar, VOCAB, stop_ids=[EOS])
    data = text.encode("utf-8")
    for i, b in enumerate(data):
        if m.done or not m.allowed()[b]:
            return i, False
        m.accept(b)
    return len(data), m.complete


def ok(grammar: str, text: str) -> bool:
    n, whole = feed(grammar, text)
    return whole and n == len(text.encode("utf-8"))
