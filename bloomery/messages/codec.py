"""JSON codec for the typed messages that cross a process boundary (never pickle).

A message is a frozen dataclass; on the wire it is one JSON object
{"type": TAG, field: value, ...}. Decoding goes through an explicit table
TAG -> class and checks every field against the class's type hints, so an
unknown tag, a missing or extra field, or a value of the wrong type is refused
with a MessageError that names the message, the field path and the value.
"""
from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from functools import lru_cache


_NONFINITE_OUT = {"inf": "Infinity", "-inf": "-Infinity", "nan": "NaN"}
_NONFINITE_IN = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}


class MessageError(ValueError):
    """A message that does not decode; the text names the tag, the field and the value."""


def _all_ints(seq) -> bool:
    """Every item a plain int (not a bool, not a subclass): a list of ids, checked at C speed."""
    return set(map(type, seq)) <= {int}


_PLAIN = frozenset({str, int, bool, type(None)})     # passed through as they are


@lru_cache(maxsize=None)
def _names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def to_plain(obj: object) -> object:
    """Dataclasses -> dicts, tuples -> lists; JSON scalars pass through."""
    t = type(obj)
    if t in _PLAIN:                       # most values: checked first (a step's outputs cross every step)
        return obj
    if t is float:
        return obj if math.isfinite(obj) else _NONFINITE_OUT[str(obj)]   # JSON has no inf: "-Infinity"
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {name: to_plain(getattr(obj, name)) for name in _names(t)}
    if isinstance(obj, (list, tuple)):
        if _all_ints(obj):                # a prompt's ids: thousands of them, each already plain
            return list(obj)
        return [to_plain(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): to_plain(v) for k, v in obj.items()}
    if isinstance(obj, float) and not math.isfinite(obj):
        return _NONFINITE_OUT[str(obj)]       # JSON has no inf: a -inf logit bias travels as "-Infinity"
    return obj


def encode(msg: object, tag: str) -> bytes:
    body = to_plain(msg)
    assert isinstance(body, dict) and "type" not in body
    # allow_nan=False: a NaN or inf is no JSON; refuse it here rather than on the other side
    return json.dumps({"type": tag, **body}, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


@lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, object]:
    return typing.get_type_hints(cls)


def _short(v: object) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


@lru_cache(maxsize=None)
def _shape(hint: object) -> tuple[object, tuple]:
    return typing.get_origin(hint), typing.get_args(hint)


def from_plain(value: object, hint: object, where: str) -> object:
    """Check `value` against the type `hint` and build it; MessageError names `where`."""
    t = type(value)
    if hint is t and t in _PLAIN:        # the common case first: an int for an int, a str for a str
        return value
    origin, args = _shape(hint)
    if hint is object or hint is typing.Any:
        return value                               # free JSON (facts); already plain
    if origin in (typing.Union, types.UnionType):
        for a in args:                             # first arm that accepts the value
            try:
                return from_plain(value, a, where)
            except MessageError:
                continue
        names = " or ".join(getattr(a, "__name__", str(a)) for a in args)
        raise MessageError(f"{where}: want {names}, got {type(value).__name__} {_short(value)}")
    if hint is type(None):
        if value is None:
            return None
        raise MessageError(f"{where}: want null, got {_short(value)}")
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise MessageError(f"{where}: want bool, got {type(value).__name__} {_short(value)}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise MessageError(f"{where}: want int, got {type(value).__name__} {_short(value)}")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and value in _NONFINITE_IN:
            return _NONFINITE_IN[value]
        raise MessageError(f"{where}: want float, got {type(value).__name__} {_short(value)}")
    if hint is str:
        if isinstance(value, str):
            return value
        raise MessageError(f"{where}: want str, got {type(value).__name__} {_short(value)}")
    if origin in (tuple, list):
        if not isinstance(value, list):
            raise MessageError(f"{where}: want a list, got {type(value).__name__} {_short(value)}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise MessageError(f"{where}: want {len(args)} items, got {len(value)}")
            items = [from_plain(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args))]
        else:
            item = args[0] if args else object
            if item is int and _all_ints(value):     # a prompt's ids: each is what the check below would keep
                return tuple(value) if origin is tuple else list(value)
            items = [from_plain(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise MessageError(f"{where}: want an object, got {type(value).__name__} {_short(value)}")
        vh = args[1] if args else object
        return {k: from_plain(v, vh, f"{where}.{k}") for k, v in value.items()}
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise MessageError(f"{where}: want a {hint.__name__} object, got {type(value).__name__} {_short(value)}")
        return build(hint, value, where)
    raise MessageError(f"{where}: no decoder for {hint!r}")   # a message declared a type we do not carry


@lru_cache(maxsize=None)
def _fields(cls: type) -> tuple[frozenset, tuple[tuple[str, object, bool], ...]]:
    """The class's field names, and per field (name, type hint, whether it must be given)."""
    hints = _hints(cls)
    fs = dataclasses.fields(cls)
    return frozenset(f.name for f in fs), tuple(
        (f.name, hints[f.name], f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
        for f in fs)


def build(cls: type, obj: dict, where: str) -> object:
    names, fields = _fields(cls)
    if not names.issuperset(obj):
        raise MessageError(f"{where}: unknown field {sorted(set(obj) - names)[0]!r}")
    kwargs = {}
    for name, hint, required in fields:
        if name not in obj:
            if required:
                raise MessageError(f"{where}: missing field {name!r}")
            continue
        kwargs[name] = from_plain(obj[name], hint, f"{where}.{name}")
    return cls(**kwargs)


def decode(data: bytes, table: dict[str, type]) -> object:
    """Bytes -> the message class the tag names in `table`."""
    try:
        obj = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MessageError(f"message is not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise MessageError(f"message must be a JSON object, got {type(obj).__name__}")
    tag = obj.pop("type", None)
    if not isinstance(tag, str) or tag not in table:
        raise MessageError(f"unknown message type {tag!r} (this boundary takes {', '.join(sorted(table))})")
    return build(table[tag], obj, tag)
