"""Reasoning, route-independent: the request's reasoning fields, the <think> span parser
(whole answers and streamed deltas) and the reasoning_loop detector.

  rs = read_reasoning(body_fields)               # ReasoningSettings (errors name the field)
  kwargs = rs.template_kwargs(client_kwargs)     # enable_thinking / reasoning_effort for the template
  tp = ThinkParser(rs.extract, starts_open=prompt_opens_think(prompt_text))
  reasoning, content = tp.feed(text); ...; tp.finish()
  loop = LoopDetector(); loop.feed(id) -> True once an open span repeats a cycle

reasoning_format (llama-server's words): "none" keeps the tags in content; "deepseek"
and "auto" (the default) move the span into reasoning_content. reasoning_effort "none"
turns thinking off before the template (enable_thinking: false) and the whole output
is content; another word leaves the template's default unless it has a switch off by
default. A chat_template_kwargs enable_thinking in the same request wins.
reasoning_budget: -1 unrestricted; a finite budget needs the engine to close the span
(not served yet: a budget other than -1 is refused by name, except on a reply that
does not think).
"""
from __future__ import annotations

from dataclasses import dataclass

from bloomery.api.params import Fields, field_error

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
FORMATS = ("none", "deepseek", "deepseek-legacy", "auto")
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
LOOP_MAX_CYCLE = 1024
LOOP_MIN_IDS = 256


@dataclass(frozen=True)
class ReasoningSettings:
    format: str = "auto"
    effort: str | None = None
    budget: int = -1
    loop: bool = False

    @property
    def extract(self) -> bool:
        return self.format != "none"

    def template_kwargs(self, client_kwargs: dict | None) -> dict:
        """chat_template_kwargs plus what reasoning_effort asks; the client's enable_thinking wins."""
        out = dict(client_kwargs or {})
        if self.effort == "none":
            out.setdefault("enable_thinking", False)
        return out


def read_reasoning(f: Fields, default_format: str = "auto") -> ReasoningSettings:
    fmt = f.str("reasoning_format")
    if fmt is not None and fmt not in FORMATS:
        raise field_error("reasoning_format", f"must be one of {', '.join(FORMATS)}, got {fmt!r}")
    effort = f.str("reasoning_effort")
    if effort is not None and effort not in EFFORTS:
        raise field_error("reasoning_effort", f"must be one of {', '.join(EFFORTS)}, got {effort!r}")
    budget = f.int("reasoning_budget", lo=-1)
    loop = f.bool("reasoning_loop")
    return ReasoningSettings(fmt or default_format, effort, -1 if budget is None else budget, bool(loop))


def prompt_opens_think(prompt: str) -> bool:
    """The template left a think span open at the end of the prompt (the reply starts inside it)."""
    tail = prompt.rstrip()
    return tail.rfind(THINK_OPEN) > tail.rfind(THINK_CLOSE) and tail.rfind(THINK_OPEN) >= 0


def _held(text: str, tag: str) -> int:
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ThinkParser:
    """Splits the reply into reasoning and content. A span counts only at the start of the reply
    (after spaces): <think>...</think> there, or a reply that starts inside an open span."""

    def __init__(self, extract: bool = True, starts_open: bool = False):
        self.extract = extract
        self.mode = "think" if starts_open else "start"   # start -> think -> content
        self._buf = ""
        self.reasoning = ""
        self.content = ""

    @property
    def in_think(self) -> bool:
        return self.extract and self.mode == "think"

    def feed(self, text: str) -> tuple[str, str]:
        if not self.extract:
            self.content += text
            return "", text
        self._buf += text
        r, c = "", ""
        while True:
            if self.mode == "start":
                stripped = self._buf.lstrip()
                if not stripped or (THINK_OPEN.startswith(stripped) and stripped != THINK_OPEN):
                    break                             # could still become <think>
                if stripped.startswith(THINK_OPEN):
                    self._buf, self.mode = stripped[len(THINK_OPEN):], "think"
                    continue
                self.mode = "content"
                continue
            if self.mode == "think":
                at = self._buf.find(THINK_CLOSE)
                if at < 0:
                    keep = _held(self._buf, THINK_CLOSE)
                    body = self._buf[:len(self._buf) - keep].rstrip()   # trailing spaces wait for what follows
                    piece = body.lstrip() if not self.reasoning else body
                    r += piece
                    self.reasoning += piece
                    self._buf = self._buf[len(body):]
                    break
                piece = self._buf[:at].rstrip()
                if not self.reasoning:
                    piece = piece.lstrip()
                r += piece
                self.reasoning += piece
                self._buf, self.mode = self._buf[at + len(THINK_CLOSE):].lstrip(), "content_start"
                continue
            if self.mode == "content_start":
                if not self._buf.strip():
                    break                              # spaces after </think> are dropped
                self._buf, self.mode = self._buf.lstrip(), "content"
                continue
            c += self._buf
            self.content += self._buf
            self._buf = ""
            break
        return r, c

    def finish(self) -> tuple[str, str]:
        """The end of the reply: release what was held (a span never closed stays reasoning)."""
        r, c = "", ""
        if self.extract and self.mode == "think":
            r = self._buf.rstrip()
            self.reasoning += r
        elif self.mode in ("start", "content"):
            c = self._buf
            self.content += c
        self._buf = ""
        return r, c


class LoopDetector:
    """reasoning_loop: an open think span whose last ids repeat a cycle of p <= 1024 ids, over at
    least max(256, p) ids (so one whole cycle has repeated). run[p] counts ids equal to the id p back."""

    def __init__(self):
        self.ids: list[int] = []
        self.run = [0] * (LOOP_MAX_CYCLE + 1)

    def feed(self, token: int) -> bool:
        ids = self.ids
        ids.append(token)
        n = len(ids)
        hit = False
        for p in range(1, min(LOOP_MAX_CYCLE, n - 1) + 1):
            if ids[n - 1 - p] == token:
                self.run[p] += 1
                if self.run[p] >= max(LOOP_MIN_IDS, p):
                    hit = True
            else:
                self.run[p] = 0
        return hit

    def reset(self) -> None:
        self.ids.clear()
        self.run = [0] * (LOOP_MAX_CYCLE + 1)
