"""The tokenizer's one error type, in a file of its own so vocab.py and pretok.py both take it."""
from __future__ import annotations


class TokenizerError(ValueError):
    """Bad vocabulary or bad input; the message names the field, the value and the bound."""
