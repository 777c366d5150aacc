"""The client-text guard: client strings print wrapped in two marks.

Every string a client sent (except an assistant's own content and reasoning) reaches the
template as a `ClientStr`: it compares as its characters but prints wrapped in two Unicode
noncharacters. After rendering, the marks split the prompt into segments (segments.py), so
client text never parses special tokens while the template's own tokens do (serving guide 11.2).
"""
from __future__ import annotations

from .errors import TemplateError

MARK_OPEN, MARK_CLOSE = "\ufdd0", "\ufdd1"  # noncharacters: reserved for internal use by Unicode


def plain(s: str) -> str:
    """The characters of a string, without the marks a ClientStr prints."""
    return str.__str__(s)


class ClientStr(str):
    """Client text: equal to its characters, printed inside the guard marks."""
    __slots__ = ()

    def __str__(self) -> str:
        return MARK_OPEN + plain(self) + MARK_CLOSE

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)

    def __add__(self, other):
        # str + ClientStr would drop the other's marks: print it first
        return str(self) + (str(other) if isinstance(other, ClientStr) else other)

    def __radd__(self, other):
        return other + str(self)

    def __mod__(self, args):
        return str(self) % args

    def __getitem__(self, key):
        return ClientStr(str.__getitem__(self, key))

    def join(self, items):
        return str(self).join(str(x) for x in items)


def _keep_client(name: str):
    method = getattr(str, name)

    def wrapped(self, *args, **kwargs):
        out = method(self, *args, **kwargs)
        if isinstance(out, list):
            return [ClientStr(x) for x in out]
        if isinstance(out, tuple):
            return tuple(ClientStr(x) for x in out)
        return ClientStr(out)
    wrapped.__name__ = name
    return wrapped


# one-to-one and one-to-many string operations keep the client mark, as llama.cpp's jinja::string
for _name in ("strip", "lstrip", "rstrip", "upper", "lower", "title", "capitalize", "swapcase",
              "replace", "split", "rsplit", "splitlines", "partition", "rpartition",
              "removeprefix", "removesuffix", "center", "ljust", "rjust", "zfill", "casefold",
              "expandtabs"):
    setattr(ClientStr, _name, _keep_client(_name))


def mark_client(value, path: str = "client text"):
    """Deep copy of a JSON value whose strings (keys too) are ClientStr."""
    if isinstance(value, str):
        if MARK_OPEN in value or MARK_CLOSE in value:
            raise TemplateError(f"{path} holds U+FDD0 or U+FDD1, characters this server reserves")
        return ClientStr(value)
    if isinstance(value, dict):
        return {mark_client(k, path): mark_client(v, f"{path}.{k}") for k, v in value.items()}
    if isinstance(value, list):
        return [mark_client(v, f"{path}[{i}]") for i, v in enumerate(value)]
    return value


def mark_messages(msgs: list[dict]) -> list[dict]:
    """Mark every client string; an assistant's content and reasoning keep the model's ids.

    The structural strings normalize.py wrote (a call's or a part's "type") stay unmarked.
    """
    out = []
    for i, m in enumerate(msgs):
        own = m["role"] == "assistant"
        marked = {}
        for k, v in m.items():
            where = f"messages[{i}].{k}"
            if own and k in ("content", "reasoning_content"):
                marked[k] = v
            elif k == "tool_calls":
                marked[k] = [{"type": c["type"], "function": mark_client(c["function"], f"{where}[{j}].function"),
                              **({"id": mark_client(c["id"], f"{where}[{j}].id")} if "id" in c else {})}
                             for j, c in enumerate(v)]
            elif k == "content" and isinstance(v, list):
                marked[k] = [{"type": p["type"], "text": mark_client(p["text"], f"{where}[{j}].text")}
                             for j, p in enumerate(v)]
            else:
                marked[k] = mark_client(v, where)
        out.append(marked)
    return out


def mark_tools(tools: list[dict]) -> list[dict]:
    return [{"type": t["type"], "function": mark_client(t["function"], f"tools[{i}].function")}
            for i, t in enumerate(tools)]
