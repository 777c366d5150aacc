"""Front <-> engine process: the whole conversation on the request and output sockets.

front ROUTER -> engine DEALER: Generate, Cancel, SlotsQuery, Shutdown
engine DEALER -> front ROUTER: Hello (once, so the ROUTER knows the engine's id)
engine PUSH  -> front PULL:    Tokens (one message per engine step), SlotsReply
"""
from __future__ import annotations

from dataclasses import dataclass

from bloomery.engine.types import EngineRequest, TokenOut
from bloomery.messages import codec


@dataclass(frozen=True)
class Generate:
    req: EngineRequest


@dataclass(frozen=True)
class Cancel:
    req_id: str


@dataclass(frozen=True)
class SlotsQuery:
    query_id: str


@dataclass(frozen=True)
class Shutdown:
    """End the engine between its calls (SIGINT/SIGTERM on the supervisor)."""

    reason: str = ""


@dataclass(frozen=True)
class Hello:
    pid: int


@dataclass(frozen=True)
class Tokens:
    outs: tuple[TokenOut, ...]    # every request's output of one engine step


@dataclass(frozen=True)
class SlotsReply:
    query_id: str                 # "" when the engine sends it unasked (a slot changed)
    slots: tuple[dict[str, object], ...]


TO_ENGINE: dict[str, type] = {c.__name__: c for c in (Generate, Cancel, SlotsQuery, Shutdown)}
FROM_ENGINE: dict[str, type] = {c.__name__: c for c in (Hello, Tokens, SlotsReply)}


def encode(msg: object) -> bytes:
    return codec.encode(msg, type(msg).__name__)


def decode_to_engine(data: bytes) -> Generate | Cancel | SlotsQuery | Shutdown:
    return codec.decode(data, TO_ENGINE)


def decode_from_engine(data: bytes) -> Hello | Tokens | SlotsReply:
    return codec.decode(data, FROM_ENGINE)
