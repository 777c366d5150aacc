"""The `prompt` field of /completion and /v1/completions as llama-server reads it: one prompt or several.

One prompt is a string, an array of token ids, an array mixing strings and ids, or an object
{"prompt_string": ...}. An array holding no number at its top level is several prompts, one each
element ([[ids], "text", {"prompt_string": ...}]), answered as an array of results. An object with
"multimodal_data" is refused by name: this server has no multimodal projector.
Pure: the tokenizer is passed in.
"""
from __future__ import annotations

from typing import Protocol

from bloomery.api.params import field_error
from bloomery.http.types import ApiError

PROMPT_STRING_KEY = "prompt_string"      # llama-server's names for the object form
MULTIMODAL_KEY = "multimodal_data"


class Tokenizer(Protocol):
    n_vocab: int

    def encode(self, text: str, add_special: bool, parse_special: bool) -> list[int]: ...


def _is_id(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def read_prompts(tok: Tokenizer, value: object) -> list[list[int]]:
    """The prompt field -> one id list per prompt (at least one)."""
    if value is None:
        raise ApiError(400, "'prompt' is required", param="prompt")
    if isinstance(value, list) and not any(_is_id(x) or isinstance(x, float) for x in value):
        if not value:
            raise field_error("prompt", "'prompt' must not be empty")
        return [_one(tok, x, f"prompt[{i}]") for i, x in enumerate(value)]
    return [_one(tok, value, "prompt")]


def _one(tok: Tokenizer, v: object, where: str) -> list[int]:
    if isinstance(v, dict):
        if MULTIMODAL_KEY in v:
            raise field_error("prompt", f"{where}.{MULTIMODAL_KEY}: multimodal data was provided, but this "
                                        "server has no multimodal projector (--mmproj is not served)")
        if PROMPT_STRING_KEY not in v:
            raise field_error("prompt", f"{where} is an object without {PROMPT_STRING_KEY!r}")
        return _one(tok, v[PROMPT_STRING_KEY], f"{where}.{PROMPT_STRING_KEY}")
    if isinstance(v, str):
        return tok.encode(v, add_special=True, parse_special=True)
    if isinstance(v, list):
        if v and set(map(type, v)) == {int} and 0 <= min(v) and max(v) < tok.n_vocab:
            return list(v)                  # ids alone, every one in range: the loop below would keep each
        ids: list[int] = []
        for i, x in enumerate(v):
            if isinstance(x, str):
                # as llama-server: only a string first in the array gets the special prefix (BOS)
                ids += tok.encode(x, add_special=i == 0, parse_special=True)
            elif _is_id(x):
                if not 0 <= x < tok.n_vocab:
                    raise field_error("prompt", f"{where}[{i}]: token id {x} is outside 0..{tok.n_vocab - 1}")
                ids.append(x)
            else:
                raise field_error("prompt", f"{where}[{i}] must be a string or a token id, but is {x!r}")
        return ids
    raise field_error("prompt", f"{where} must be a string, an array of strings and token ids, or an object "
                                f"with {PROMPT_STRING_KEY!r}, but is {type(v).__name__}")
