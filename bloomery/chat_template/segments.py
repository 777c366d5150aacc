"""A rendered prompt cut at the guard marks, and its token ids."""
from __future__ import annotations

from dataclasses import dataclass

from .errors import TemplateError
from .guard import MARK_CLOSE, MARK_OPEN


@dataclass(frozen=True)
class RenderedPrompt:
    text: str                           # the prompt, no marks: what /apply-template answers
    segments: list[tuple[str, bool]]    # (text, is_client_text), in order, joined == text


def rendered_prompt(marked: str) -> RenderedPrompt:
    segments = split_segments(marked)
    return RenderedPrompt(text="".join(t for t, _ in segments), segments=segments)


def split_segments(marked: str) -> list[tuple[str, bool]]:
    """Cut rendered text at the marks; a mark left open or closed twice is a TemplateError."""
    segments: list[tuple[str, bool]] = []
    depth, start = 0, 0
    for i, ch in enumerate(marked):
        if ch != MARK_OPEN and ch != MARK_CLOSE:
            continue
        if i > start:
            _append(segments, marked[start:i], depth > 0)
        start = i + 1
        depth += 1 if ch == MARK_OPEN else -1
        if depth < 0:
            raise TemplateError(_cut_message(marked, i))
    if depth != 0:
        raise TemplateError(_cut_message(marked, marked.rfind(MARK_OPEN)))
    if start < len(marked):
        _append(segments, marked[start:], False)
    return segments


def _append(segments: list[tuple[str, bool]], text: str, is_client: bool) -> None:
    if segments and segments[-1][1] == is_client:
        segments[-1] = (segments[-1][0] + text, is_client)
    else:
        segments.append((text, is_client))


def _cut_message(marked: str, at: int) -> str:
    near = marked[max(0, at - 40): at + 40].replace(MARK_OPEN, "").replace(MARK_CLOSE, "")
    return (f"the chat template cut a client text through its guard mark (near {near!r}); "
            "it sliced or rebuilt a string the client sent")


def encode_segments(tokenizer, segments: list[tuple[str, bool]], add_special: bool) -> list[int]:
    """Token ids of a rendered prompt: special spellings parse only in the template's text.

    Client text without a special spelling is tokenized together with its neighbours, so the ids
    equal llama-server's whole-prompt tokenization; one with a spelling is cut out and
    tokenized as plain characters.
    """
    runs: list[tuple[str, bool]] = []   # (text, parse_special)
    pending = ""
    for text, is_client in segments:
        if is_client and _has_special(tokenizer, text):
            if pending:
                runs.append((pending, True))
            runs.append((text, False))
            pending = ""
        else:
            pending += text
    if pending or not runs:
        runs.append((pending, True))
    ids: list[int] = []
    for text, parse_special in runs:
        ids += tokenizer.encode(text, add_special=False, parse_special=parse_special)
    if add_special:
        if getattr(tokenizer, "add_bos", False) and _is_id(tokenizer.bos_id):
            ids.insert(0, tokenizer.bos_id)
        if getattr(tokenizer, "add_eos", False) and _is_id(tokenizer.eos_id):
            ids.append(tokenizer.eos_id)
    return ids


def _is_id(token_id) -> bool:
    return token_id is not None and token_id >= 0


def _has_special(tokenizer, text: str) -> bool:
    special_texts = getattr(tokenizer, "special_texts", None)
    if special_texts is not None:
        return any(s and s in text for s in special_texts)
    # a spelling shows as a difference between the two tokenizations
    return (tokenizer.encode(text, add_special=False, parse_special=True)
            != tokenizer.encode(text, add_special=False, parse_special=False))
