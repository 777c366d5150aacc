"""GET /residency, POST /residency/reset and /metrics' bloomery: expert series (bloomery's own routes:
llama-server has none).

A load whose placement keeps routed experts in host RAM moves the hot ones into the card's expert
slots as it runs (adaptive residency). GET /residency answers the engine's report as JSON:
"offload" (whether the load has host experts at all), "residency" (on/off), per layer with host
experts its routing counts per expert, the experts on the card, hits (routed picks a card expert
served) and misses (a host expert), and the moved experts and bytes and the seconds waited on the
host. POST /residency/reset first returns the card's slots to the load's placement. A load with no
host experts answers "offload": false, and a reset there is a 409 that says so. The engine answers
between its steps (engine/experts_query.py); this file asks it and shapes the answers.
"""
from __future__ import annotations

import asyncio
import weakref
from typing import TYPE_CHECKING

from bloomery.engine.experts_query import ASLEEP, NO_OFFLOAD, ExpertsError
from bloomery.http.types import ApiError, Request, Response

if TYPE_CHECKING:
    from bloomery.api.context import ApiContext as App

QUERY_TIMEOUT_S = 30.0      # a route waits this long for the engine's step to end (a long prompt's pass)
METRICS_TIMEOUT_S = 2.0     # a scrape waits this long; past it the expert series sit that scrape out

# per App, the expert series of its last awake scrape: what /metrics shows while the engine sleeps
# (llama-server serves its metrics from the snapshot taken on entering sleep)
_LAST_AWAKE: "weakref.WeakKeyDictionary[object, str]" = weakref.WeakKeyDictionary()

_STATUS = {NO_OFFLOAD: (409, "invalid_request_error"), ASLEEP: (503, "unavailable_error")}

# report key, Prometheus name, help; the per-layer ones carry a layer label
LAYER_SERIES = (
    ("hits", "expert_hits_total", "Routed expert picks served by an expert held on the card, per layer with host experts"),
    ("misses", "expert_misses_total", "Routed expert picks served by an expert in host RAM, per layer with host experts"),
)
TOTAL_SERIES = (
    ("moved_experts", "experts_moved_total", "Routed experts copied into the card's expert slots by residency"),
    ("moved_bytes", "expert_bytes_moved_total", "Bytes copied into the card's expert slots by residency"),
    ("host_wait_s", "host_wait_seconds_total", "Time the card waited on the host's experts"),
)


async def _report(app: "App", reset: bool) -> dict:
    try:
        return await app.client.query_experts(reset=reset, timeout_s=QUERY_TIMEOUT_S)
    except ExpertsError as e:
        status, kind = _STATUS.get(e.kind, (500, "server_error"))
        raise ApiError(status, str(e), kind) from None
    except asyncio.TimeoutError:
        raise ApiError(503, f"the engine did not answer the residency query within {QUERY_TIMEOUT_S:g} s "
                            "(a step still running)", "unavailable_error") from None
    except Exception as e:   # the engine is gone
        raise ApiError(503, f"the engine did not answer the residency query: {type(e).__name__}: {e}",
                       "unavailable_error") from None


async def handle_residency(app: "App", req: Request) -> Response:
    return Response.json(await _report(app, reset=False))


async def handle_reset(app: "App", req: Request) -> Response:
    return Response.json(await _report(app, reset=True))     # the engine stage records the reset


def render(report: dict) -> str:
    """The bloomery: expert series of one report in Prometheus text; "" for a load with no host experts."""
    if not report.get("offload"):
        return ""
    lines = []
    for key, name, help_ in LAYER_SERIES:
        lines += [f"# HELP bloomery:{name} {help_}", f"# TYPE bloomery:{name} counter"]
        lines += [f'bloomery:{name}{{layer="{int(ly["layer"])}"}} {int(ly[key])}' for ly in report["layers"]]
    for key, name, help_ in TOTAL_SERIES:
        v = report[key]
        lines += [f"# HELP bloomery:{name} {help_}", f"# TYPE bloomery:{name} counter",
                  f"bloomery:{name} {f'{v:.6g}' if isinstance(v, float) else int(v)}"]
    return "\n".join(lines) + "\n"


async def metrics_text(app: "App") -> str:
    """/metrics' expert series, asked of the engine with a short timeout: a scrape the engine does not
    answer in time leaves them out with a comment saying why, and never fails; a sleeping engine's are
    those of the last awake scrape, so /metrics reads the same asleep as just before."""
    query = getattr(app.client, "query_experts", None)
    if query is None:        # a client that cannot ask has no host experts to show
        return ""
    try:
        text = render(await query(timeout_s=METRICS_TIMEOUT_S))
    except asyncio.TimeoutError:
        return f"# bloomery: expert series left out: the engine did not answer within {METRICS_TIMEOUT_S:g} s\n"
    except ExpertsError as e:
        if e.kind == ASLEEP:      # asleep: the last awake scrape's series (none for a load without host experts)
            return _LAST_AWAKE.get(app, "")
        return f"# bloomery: expert series left out: {e}\n"
    _LAST_AWAKE[app] = text
    return text
