"""Reasoning, route-independent: the request's reasoning fields, the <think> span parser
(whole answers and streamed deltas), the reasoning_loop detector and the think-span watch
a generation runs over its own ids (reasoning_budget, reasoning_loop).

  rs = read_reasoning(body_fields, default_format, default_budget)   # ReasoningSettings (errors name the field)
  kwargs = rs.template_kwargs(client_kwargs)     # enable_thinking / reasoning_effort for the template
  tp = ThinkParser(rs.extract, starts_open=prompt_opens_think(prompt_text))
  reasoning, content = tp.feed(text); ...; tp.finish()
  loop = LoopDetector(); loop.feed(id) -> True once an open span repeats a cycle
  spec = think_spec(tok, rs, prompt_text, template_thinks, ...)       # ThinkSpec or None (nothing to watch)
  watch = ThinkWatch(spec, piece_of); watch.accept(id); watch.forced_next; watch.looped

reasoning_format (llama-server's words): "none" keeps the tags in content; "deepseek"
and "auto" (the default) move the span into reasoning_content. reasoning_effort "none"
turns thinking off before the template (enable_thinking: false) and the whole output
is content; another word leaves the template's default unless it has a switch off by
default. A chat_template_kwargs enable_thinking in the same request wins.
reasoning_budget (also llama-server's reasoning_budget_tokens / thinking_budget_tokens;
default --reasoning-budget): -1 unrestricted; N >= 0 lets the think span run N generated
ids, then forces reasoning_budget_message + the end tag id by id (llama.cpp's
reasoning-budget sampler: the start and end tags are matched as id sequences, the count
waits for a whole UTF-8 character, a new <think> re-arms it). It is ignored when the
template already closed the span, and where the template has no think span at all.
reasoning_loop: true ends a generation whose open span repeats a cycle (LoopDetector),
with stop_type / finish_reason "reasoning_loop".
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
    budget: int = -1              # the request's, else the server's --reasoning-budget
    loop: bool = False
    budget_message: str = ""      # reasoning_budget_message, else --reasoning-budget-message
    budget_set: bool = False      # the request itself named a budget (not the server default)

    @property
    def extract(self) -> bool:
        return self.format != "none"

    def template_kwargs(self, client_kwargs: dict | None) -> dict:
        """chat_template_kwargs plus what reasoning_effort asks; the client's enable_thinking wins."""
        out = dict(client_kwargs or {})
        if self.effort == "none":
            out.setdefault("enable_thinking", False)
        return out


BUDGET_FIELDS = ("reasoning_budget", "reasoning_budget_tokens", "thinking_budget_tokens")   # ours, llama-server's


def read_reasoning(f: Fields, default_format: str = "auto", default_budget: int = -1,
                   default_message: str = "") -> ReasoningSettings:
    fmt = f.str("reasoning_format")
    if fmt is not None and fmt not in FORMATS:
        raise field_error("reasoning_format", f"must be one of {', '.join(FORMATS)}, got {fmt!r}")
    effort = f.str("reasoning_effort")
    if effort is not None and effort not in EFFORTS:
        raise field_error("reasoning_effort", f"must be one of {', '.join(EFFORTS)}, got {effort!r}")
    budget = f.int(*BUDGET_FIELDS, lo=-1)
    if budget == -1 and f.raw(*BUDGET_FIELDS) is not None:
        budget = None            # llama-server: -1 in the request means "the server's default"
    loop = f.bool("reasoning_loop")
    message = f.str("reasoning_budget_message")
    return ReasoningSettings(fmt or default_format, effort, default_budget if budget is None else budget, bool(loop),
                             default_message if message is None else message, budget is not None)


def prompt_opens_think(prompt: str) -> bool:
    """The template left a think span open at the end of the prompt (the reply starts inside it)."""
    tail = prompt.rstrip()
    return tail.rfind(THINK_OPEN) > tail.rfind(THINK_CLOSE) and tail.rfind(THINK_OPEN) >= 0


def prompt_closes_think(prompt: str) -> bool:
    """The template closed the span itself (thinking off): the prompt ends right after </think>."""
    return prompt.rstrip().endswith(THINK_CLOSE)


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


# --- the think-span watch a generation runs over its own ids -----------------------------------

@dataclass(frozen=True)
class ThinkSpec:
    """What one generation watches: the span's tags as id sequences and what to do in it."""

    start: tuple[int, ...]                    # the opening tag's ids (<think>)
    ends: tuple[tuple[int, ...], ...]         # sequences that close the span (</think>; a call opener)
    forced: tuple[int, ...]                   # forced when the budget runs out: message + the first end tag
    budget: int                               # ids the span may run; -1 unrestricted (watched for the loop only)
    starts_open: bool                         # the prompt opened the span: counting from the first id
    loop: bool = False                        # reasoning_loop: end the generation when the span loops


def think_spec(tok, rs: ReasoningSettings, prompt: str, template_thinks: bool,
               extra_ends: tuple[str, ...] = ()) -> ThinkSpec | None:
    """The watch a chat or completion request needs, or None when there is nothing to watch: no budget
    and no loop check, a span the template closed, or a template without a think span."""
    if rs.budget < 0 and not rs.loop:
        return None
    opens = prompt_opens_think(prompt)
    if not opens and (not template_thinks or prompt_closes_think(prompt)):
        return None

    def ids(text: str) -> tuple[int, ...]:
        return tuple(tok.encode(text, add_special=False, parse_special=True))
    end = ids(THINK_CLOSE)
    ends = (end, *(ids(t) for t in extra_ends))
    forced = (ids(rs.budget_message) if rs.budget_message else ()) + end
    return ThinkSpec(ids(THINK_OPEN), ends, forced, rs.budget, opens, rs.loop)


class _SeqMatcher:
    """Which of some id sequences ends at the id just seen (the longest; history cleared on a match),
    as llama.cpp's token_matcher over its Aho-Corasick automaton."""

    def __init__(self, seqs):
        self.seqs = [tuple(q) for q in dict.fromkeys(tuple(q) for q in seqs) if q]
        self.n_max = max((len(q) for q in self.seqs), default=0)
        self.hist: list[int] = []

    def advance(self, token: int) -> int:
        if not self.seqs:
            return -1
        self.hist.append(token)
        del self.hist[:-self.n_max]
        best, best_len = -1, 0
        for i, q in enumerate(self.seqs):
            if len(q) > best_len and len(q) <= len(self.hist) and tuple(self.hist[-len(q):]) == q:
                best, best_len = i, len(q)
        if best >= 0:
            self.hist.clear()
        return best

    def reset(self) -> None:
        self.hist.clear()


def utf8_complete(piece: bytes) -> bool:
    """The piece does not end inside a UTF-8 character (llama.cpp's common_utf8_is_complete)."""
    n = len(piece)
    for back in range(1, min(4, n) + 1):
        b = piece[n - back]
        if b & 0xC0 == 0x80:
            continue                       # a continuation byte: look further back
        return back >= (4 if b >= 0xF0 else 3 if b >= 0xE0 else 2 if b >= 0xC0 else 1)
    return n == 0                          # only continuation bytes: not whole


IDLE, COUNTING, WAITING_UTF8, FORCING, DONE = "idle", "counting", "waiting_utf8", "forcing", "done"


class ThinkWatch:
    """llama.cpp's reasoning-budget state machine over a generation's ids (idle -> counting ->
    waiting_utf8 -> forcing -> done; a new start tag re-arms it), plus the loop detector while the
    span is open. `piece_of(id) -> bytes` decides whether an id completes a UTF-8 character."""

    def __init__(self, spec: ThinkSpec, piece_of):
        self.spec, self.piece_of = spec, piece_of
        self.budget = spec.budget if spec.budget >= 0 else None      # None: unrestricted
        self.start, self.end = _SeqMatcher([spec.start]), _SeqMatcher(spec.ends)
        self.state, self.remaining, self.force_pos = IDLE, 0, 0
        self.loop = LoopDetector() if spec.loop else None
        self.looped = False
        self.n_forced = 0
        if spec.starts_open:
            self._arm()

    def _arm(self) -> None:
        self.state, self.remaining = COUNTING, self.budget
        self.end.reset()
        if self.loop is not None:
            self.loop.reset()
        if self.budget is not None and self.budget <= 0:
            self.state, self.force_pos = FORCING, 0

    @property
    def in_span(self) -> bool:
        return self.state in (COUNTING, WAITING_UTF8)

    @property
    def forced_next(self) -> int | None:
        """The id the next step must take (the budget ran out), or None: the model picks."""
        if self.state == FORCING and self.force_pos < len(self.spec.forced):
            return self.spec.forced[self.force_pos]
        return None

    def accept(self, token: int, forced: bool = False) -> None:
        st = self.state
        if st in (IDLE, DONE):
            if self.start.advance(token) >= 0:
                self._arm()
            return
        if st == FORCING:
            self.end.advance(token)
            self.force_pos += 1
            self.n_forced += int(forced)
            if self.force_pos >= len(self.spec.forced):
                self.state = DONE
                self.start.reset()
            return
        if self.end.advance(token) >= 0:          # the model closed the span itself
            self.state = DONE
            self.start.reset()
            return
        if self.loop is not None and self.loop.feed(token):
            self.looped = True
        if self.budget is None:
            return
        complete = utf8_complete(self.piece_of(token))
        if st == WAITING_UTF8:
            if complete:
                self.state, self.force_pos = FORCING, 0
                self.end.reset()
            return
        self.remaining -= 1
        if self.remaining <= 0:
            self.state, self.force_pos = (FORCING, 0) if complete else (WAITING_UTF8, 0)
            self.end.reset()
