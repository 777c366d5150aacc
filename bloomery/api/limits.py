"""What one request body may hold, checked before any tokenizing or rendering (docs/security.md).

The HTTP body limit (64 MiB) bounds what is read; these bound what is worked on. A
prompt of 4 Mi characters is about a million tokens of text, more than any slot here
holds, and the tokenizer takes seconds on it; past these, a request is refused by name
(400) before the tokenizer, the chat template or the engine sees it. Pure: no I/O.
"""
from __future__ import annotations

from bloomery.http.types import ApiError, Request

MAX_PROMPT_CHARS = 4 << 20      # characters of text in one body (every string: prompt, messages, tools, ...)
MAX_MESSAGES = 16384            # entries of one messages / input array
MAX_IDS = 1 << 20               # numbers in one array (a prompt or /detokenize's tokens as ids)
MAX_N_PROBS = 1024              # candidates a generated id (llama-server's only bound is the vocabulary; here
                                # each candidate is rendered by the Python front, and the whole table of
                                # 151,936 took about 1 s a token on the engine and the front together)
MESSAGE_KEYS = ("messages", "input")


def _refuse(what: str, n: int, limit: int, name: str) -> ApiError:
    return ApiError(400, f"the request's {what} is {n:,}, over this server's limit of {limit:,} "
                         f"(bloomery.api.limits.{name}; docs/security.md)", "invalid_request_error")


def check_body(obj: object) -> None:
    """Walks a parsed JSON body once; ApiError 400 naming the first limit it passes."""
    n_chars = 0
    stack: list[tuple[object, str]] = [(obj, "")]
    while stack:
        v, key = stack.pop()
        if isinstance(v, str):
            n_chars += len(v)
            if n_chars > MAX_PROMPT_CHARS:
                raise _refuse("text (characters in all its strings)", n_chars, MAX_PROMPT_CHARS, "MAX_PROMPT_CHARS")
        elif isinstance(v, dict):
            for k, x in v.items():
                n_chars += len(k)
                if isinstance(x, (str, dict, list)):
                    stack.append((x, k))
        elif isinstance(v, list):
            if key in MESSAGE_KEYS and len(v) > MAX_MESSAGES:
                raise _refuse(f"'{key}' array length", len(v), MAX_MESSAGES, "MAX_MESSAGES")
            if len(v) > MAX_IDS:
                raise _refuse(f"'{key or 'body'}' array length", len(v), MAX_IDS, "MAX_IDS")
            stack.extend((x, key) for x in v if isinstance(x, (str, dict, list)))
    if n_chars > MAX_PROMPT_CHARS:
        raise _refuse("text (characters in all its strings)", n_chars, MAX_PROMPT_CHARS, "MAX_PROMPT_CHARS")


def parse_checked(body: bytes) -> tuple[str, object]:
    """A body -> ("ok", its JSON within the limits) | ("bad", why it is not JSON) | ("limit", the refusal);
    runs in the parser process (bloomery/workpool.py), so the answer is plain data."""
    req = Request("POST", "", {}, {}, body)
    try:
        obj = req.json()
    except ApiError as e:
        return "bad", e.message
    try:
        check_body(obj)
    except ApiError as e:
        return "limit", e.message
    return "ok", obj
