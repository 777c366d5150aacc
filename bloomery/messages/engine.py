"""Front <-> engine process: the whole conversation on the request and output sockets.

front ROUTER -> engine DEALER: Generate, Cancel, SlotsQuery, Shutdown, Residency, ExpertsQuery, SlotAction
engine DEALER -> front ROUTER: Hello (once, so the ROUTER knows the engine's id)
engine PUSH  -> front PULL:    Tokens (one message per engine step), SlotsReply, ResidencyReply, ExpertsReply,
                               SlotActionReply

Residency / ResidencyReply are --sleep-idle-seconds' sleep and wake (the weights held or freed);
ExpertsQuery / ExpertsReply are the routed experts' residency between card and host RAM
(GET /residency, POST /residency/reset, /metrics). SlotAction / SlotActionReply are POST /slots/{id}'s
save, restore and erase (--slot-save-path; engine/slot_file.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

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
class Residency:
    """Sleep (sleep=True: free the weights and KV) or wake (load them again); the engine answers with a
    ResidencyReply of the same query_id once done (--sleep-idle-seconds)."""

    query_id: str
    sleep: bool


@dataclass(frozen=True)
class ResidencyReply:
    query_id: str
    sleeping: bool
    took_s: float = 0.0
    error: str = ""               # the change failed (the weights could not be loaded again): why


@dataclass(frozen=True)
class ExpertsQuery:
    """The host experts' report (GET /residency, /metrics); reset=True first returns the card's expert
    slots to the load's placement (POST /residency/reset). Answered between steps with an ExpertsReply."""

    query_id: str
    reset: bool = False


@dataclass(frozen=True)
class ExpertsReply:
    query_id: str
    report: dict[str, object]     # engine/experts_query.py's report: "offload", "residency", "layers", counters
    error: str = ""               # not answered: why (the report then says only what is known)
    kind: str = ""                # with error: engine/experts_query.py's NO_OFFLOAD, ASLEEP or FAILED


@dataclass(frozen=True)
class SlotAction:
    """Save, restore or erase one slot between steps (engine/slot_file.py); path: the file, already checked
    to lie in --slot-save-path; model_name: the served file's name, written in and checked against."""

    query_id: str
    action: str
    id_slot: int
    path: str = ""
    filename: str = ""
    model_name: str = ""


@dataclass(frozen=True)
class SlotActionReply:
    query_id: str
    status: int                   # the HTTP status of the answer
    body: dict[str, object]       # llama-server's answer (status 200)
    error: str = ""               # why not (status != 200)


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
    # Engine.engine_stats(): the prompt cache's (-cram) bytes, entries, budget_bytes, restore_seconds, and the
    # decode steps' counts by path (what /metrics shows)
    stats: dict[str, int | float] = field(default_factory=dict)


TO_ENGINE: dict[str, type] = {c.__name__: c for c in (Generate, Cancel, SlotsQuery, Shutdown, Residency,
                                                      ExpertsQuery, SlotAction)}
FROM_ENGINE: dict[str, type] = {c.__name__: c for c in (Hello, Tokens, SlotsReply, ResidencyReply, ExpertsReply,
                                                        SlotActionReply)}


def encode(msg: object) -> bytes:
    return codec.encode(msg, type(msg).__name__)


def decode_to_engine(data: bytes) -> Generate | Cancel | SlotsQuery | Shutdown | Residency | ExpertsQuery | SlotAction:
    return codec.decode(data, TO_ENGINE)


def decode_from_engine(data: bytes) -> Hello | Tokens | SlotsReply | ResidencyReply | ExpertsReply | SlotActionReply:
    return codec.decode(data, FROM_ENGINE)
