"""GET /residency, POST /residency/reset and /metrics' expert series, on the engine's side.

A load whose placement keeps routed experts in host RAM carries the backend's offload tier as
`model.ops.offload` (engine/cuda/experts.py's Offload); every other load has none. `answer` is
what the engine thread runs between steps (never while a step runs: a reset rewrites the
tables the kernels read): the reset first when asked, then the tier's report, with "offload"
saying whether the load has host experts at all. The engine stage (stages/engine.py) and the
in-process client (engine/inproc.py) both call it; neither looks for the tier itself.

No device code here: the tier does the work, this file only finds it and shapes the answer.
"""
from __future__ import annotations

from dataclasses import dataclass

# why a query could not be answered (ExpertsReply.kind; the front maps each to its HTTP status)
NO_OFFLOAD = "no_offload"       # a reset on a load with no host experts
ASLEEP = "asleep"               # --sleep-idle-seconds freed the model: there is no placement to show
FAILED = "failed"               # the tier raised (a copy failed on the card, ...)

NOTHING_TO_RESET = "no routed experts in host RAM: nothing to reset"
ASLEEP_MESSAGE = ("the engine is asleep (--sleep-idle-seconds): its weights and experts are freed; "
                  "a POST request wakes it")


def empty_report() -> dict:
    """The report of a load with no host experts: the same keys, nothing counted."""
    return {"offload": False, "residency": "off", "layers": [], "moved_experts": 0, "moved_bytes": 0,
            "host_wait_s": 0.0, "updates": 0}


def offload_of(model):
    """The load's offload tier, or None (a whole-card load, the CPU backend, a sleeping engine)."""
    if model is None:
        return None
    return getattr(getattr(model, "ops", None), "offload", None)


@dataclass(frozen=True)
class ExpertsAnswer:
    report: dict
    error: str = ""              # empty when answered
    kind: str = ""               # NO_OFFLOAD, ASLEEP or FAILED when not


def answer(model, reset: bool) -> ExpertsAnswer:
    """Reset (when asked) and report the host experts of `model` (the engine's current one, None asleep).
    Runs in the engine's thread between steps."""
    if model is None:
        return ExpertsAnswer(empty_report(), ASLEEP_MESSAGE, ASLEEP)
    tier = offload_of(model)
    if tier is None:
        if reset:
            return ExpertsAnswer(empty_report(), NOTHING_TO_RESET, NO_OFFLOAD)
        return ExpertsAnswer(empty_report())
    try:
        if reset:
            tier.reset()
        report = tier.report()
    except Exception as e:
        return ExpertsAnswer(empty_report() | {"offload": True}, f"{type(e).__name__}: {e}", FAILED)
    return ExpertsAnswer({"offload": True, **report})


class ExpertsError(RuntimeError):
    """An engine client's query_experts that the engine could not answer; `kind` says why."""

    def __init__(self, kind: str, message: str, report: dict | None = None):
        super().__init__(message)
        self.kind, self.report = kind, report or empty_report()


def result(ans: ExpertsAnswer) -> dict:
    """The report, or the ExpertsError the answer names (what both clients' query_experts return)."""
    if ans.error:
        raise ExpertsError(ans.kind or FAILED, ans.error, ans.report)
    return ans.report
