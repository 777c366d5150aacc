"""Stage process -> supervisor: the whole conversation on the records socket.

Every stage (fetch, plan, engine) PUSHes these to the supervisor's PULL socket:
records as it works, then one outcome (FetchDone, PlanDone, Ready) or Dead.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from bloomery.engine.types import ModelInfo
from bloomery.messages import codec
from bloomery.placement import Placement

Scalar = str | int | float | bool | None


@dataclass(frozen=True)
class Record:
    """One log line: `[phase] component: message k=v ...`."""

    phase: str
    component: str
    message: str
    fields: dict[str, Scalar] = field(default_factory=dict)
    level: str = "info"
    time: str = ""               # UTC, ISO 8601, set where the record was made ("": when it is printed)


@dataclass(frozen=True)
class Progress:
    phase: str
    component: str
    done: int
    total: int
    unit: str = "bytes"


@dataclass(frozen=True)
class FetchDone:
    path: str                      # the file to open (first shard of a split set)
    shards: tuple[str, ...] = ()   # every shard, in order
    n_bytes: int = 0


@dataclass(frozen=True)
class PlanDone:
    records: tuple[Record, ...]    # the plan records (--plan prints these)
    facts: dict[str, object] = field(default_factory=dict)   # the model's facts (stages/meta.py), arch, backend, ...
    placement: Placement | None = None   # what the load carries out (bloomery/placement.py)


@dataclass(frozen=True)
class Ready:
    info: ModelInfo
    facts: dict[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class Dead:
    stage: str
    reason: str


TABLE: dict[str, type] = {c.__name__: c for c in (Record, Progress, FetchDone, PlanDone, Ready, Dead)}
StageMessage = Record | Progress | FetchDone | PlanDone | Ready | Dead


def encode(msg: StageMessage) -> bytes:
    return codec.encode(msg, type(msg).__name__)


def decode(data: bytes) -> StageMessage:
    return codec.decode(data, TABLE)
