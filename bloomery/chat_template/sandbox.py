"""The jinja2 sandbox with llama.cpp's settings, globals and filters, and the render limits."""
from __future__ import annotations

import time

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import TemplateError
from .guard import plain
from .tojson import to_json

MAX_OUTPUT_CHARS = 64 << 20                  # a rendered prompt larger than this is a runaway loop
MAX_RANGE_ITEMS = 1_000_000                  # range() items per render, all loops together


class _Sandbox(ImmutableSandboxedEnvironment):
    """llama.cpp's jinja settings; `*` and `**` checked so a template cannot build a huge value;
    `+` of a string and none/undefined is the string, as llama.cpp's runtime concatenates them
    (firefunction-v2's template adds `functions`, which llama.cpp leaves undefined)."""
    intercepted_binops = frozenset(["*", "**", "+"])

    def call_binop(self, context, operator, left, right):
        if operator == "+":
            if isinstance(left, str) and _null(right):
                return left
            if isinstance(right, str) and _null(left):
                return right
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_OUTPUT_CHARS:
                    raise TemplateError(f"the chat template repeats a value {n} times, past the "
                                        f"{MAX_OUTPUT_CHARS}-character output bound")
        if operator == "**" and isinstance(right, int) and abs(right) > 1024:
            raise TemplateError(f"the chat template raises to the power {right}, past the bound 1024")
        return super().call_binop(context, operator, left, right)


def _null(value) -> bool:
    return value is None or isinstance(value, jinja2.Undefined)


def _raise_exception(message="") -> None:
    raise TemplateError(f"Jinja Exception: {message}")


def _strftime_now(fmt) -> str:
    return time.strftime(plain(fmt) if isinstance(fmt, str) else str(fmt))


def _finalize(value):
    """What `{{ value }}` prints, as llama.cpp: none prints nothing, a list its items run together."""
    if value is None:
        return ""
    if isinstance(value, (list, tuple)):
        # list.__iter__, not iter(): printing is no array access for the capability probes
        items = list.__iter__(value) if isinstance(value, list) else iter(value)
        return "".join(str(_finalize(item)) for item in items)
    return value


def _join_filter(value, d="", attribute=None):
    items = [x[attribute] if attribute is not None else x for x in value]
    return str(d).join(str(x) for x in items)   # str() keeps each item's client mark


def make_env() -> _Sandbox:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=False,
                   extensions=["jinja2.ext.loopcontrols"], finalize=_finalize,
                   undefined=jinja2.ChainableUndefined)   # llama.cpp: undefined.x is undefined
    env.filters["tojson"] = to_json
    env.filters["join"] = _join_filter
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, tojson=to_json)
    return env


class _Budget:
    """range() with one item budget per render: nested loops cannot spin for hours."""

    def __init__(self) -> None:
        self.n_left = MAX_RANGE_ITEMS

    def range(self, *args):
        r = range(*args)
        self.n_left -= len(r)
        if self.n_left < 0:
            raise TemplateError(f"the chat template's loops ran past {MAX_RANGE_ITEMS} range items")
        return r


def run_template(template: jinja2.Template, variables: dict) -> str:
    """The template's text with the guard marks in; every failure is a TemplateError."""
    budget = _Budget()
    pieces: list[str] = []
    n_chars = 0
    try:
        for piece in template.generate(**variables, range=budget.range):
            n_chars += len(piece)
            if n_chars > MAX_OUTPUT_CHARS:
                raise TemplateError(f"the chat template wrote more than {MAX_OUTPUT_CHARS} characters")
            pieces.append(piece)
    except TemplateError:
        raise   # ours already names the problem; the catch-all below would rewrap it
    except jinja2.TemplateError as e:
        raise TemplateError(f"chat template error: {e.message or type(e).__name__}") from None
    except RecursionError:
        raise TemplateError("chat template error: recursion too deep") from None
    except Exception as e:  # a template can make Python raise anything (1/0, bad types)
        raise TemplateError(f"chat template error: {type(e).__name__}: {e}") from None
    return "".join(pieces)
