"""tojson as llama.cpp's jinja writes it: Python's json.dumps spacing, floats as C++ streams."""
from __future__ import annotations

import json

import jinja2

from .guard import MARK_CLOSE, MARK_OPEN, ClientStr, plain


def to_json(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    indent_n = indent if isinstance(indent, int) and not isinstance(indent, bool) else None
    seps = list(separators) if isinstance(separators, (list, tuple)) else []
    item_sep = plain(seps[0]) if seps else (", " if indent_n is None else ",")
    key_sep = plain(seps[1]) if len(seps) > 1 else ": "
    ensure_ascii, sort_keys = bool(ensure_ascii), bool(sort_keys)
    nl = "\n" if indent_n is not None else ""
    out: list[str] = []

    def write(v, level: int) -> None:
        if v is None or isinstance(v, jinja2.Undefined):
            out.append("null")
        elif isinstance(v, bool):
            out.append("true" if v else "false")
        elif isinstance(v, int):
            out.append(str(v))
        elif isinstance(v, float):
            out.append("%g" % v)   # llama.cpp writes doubles with ostream's default 6 digits
        elif isinstance(v, str):
            out.append(_json_string(v, ensure_ascii))
        elif isinstance(v, (list, tuple, dict)):
            is_dict = isinstance(v, dict)
            entries = _pairs(v, sort_keys) if is_dict else [(None, item) for item in v]
            pad_in = " " * (indent_n * (level + 1)) if indent_n else ""
            out.append("{" if is_dict else "[")
            for i, (key, item) in enumerate(entries):
                out.append(nl + pad_in if i == 0 else item_sep + nl + pad_in)
                if is_dict:
                    out.append(_json_string(key, ensure_ascii) + key_sep)
                write(item, level + 1)
            pad_out = " " * (indent_n * level) if indent_n else ""
            out.append((nl + pad_out if entries else "") + ("}" if is_dict else "]"))
        else:
            out.append("null")

    write(value, 0)
    return "".join(out)


def _pairs(d: dict, sort_keys: bool) -> list[tuple[str, object]]:
    pairs = [(k if isinstance(k, str) else str(k), v) for k, v in d.items()]
    # by the characters, as json.dumps: a client key's marks must not move it
    return sorted(pairs, key=lambda kv: plain(kv[0])) if sort_keys else pairs


def _json_string(s: str, ensure_ascii: bool) -> str:
    raw = json.dumps(plain(s), ensure_ascii=ensure_ascii)
    if isinstance(s, ClientStr):
        return '"' + MARK_OPEN + raw[1:-1] + MARK_CLOSE + '"'
    return raw
