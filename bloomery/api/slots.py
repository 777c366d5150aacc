"""GET /slots and GET /metrics in llama-server's shapes.

/slots: one object per slot (id, n_ctx, speculative, is_processing; once a request
ran there: id_task, the prompt counts, params, next_token), from the engine's own
table; the params are the generation's, which the front remembers by req_id.
--no-slots: 501 as llama-server. /metrics: llama-server's Prometheus text with --metrics
(api/metrics.py keeps the counts), then bloomery's expert series on a load with host experts
(api/experts.py), 501 with llama-server's message without it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from bloomery.api import experts
from bloomery.api.recent import Memo
from bloomery.api.shapes import slot_params
from bloomery.http.types import ApiError, Request, Response

if TYPE_CHECKING:
    from bloomery.api.context import ApiContext as App


async def _slot_table(app: "App") -> list[dict]:
    query = getattr(app.client, "query_slots", None)
    if query is not None:
        try:
            return list(await query())
        except Exception as e:   # the engine did not answer: say so rather than print a stale table
            raise ApiError(503, f"the engine did not answer the slots query: {type(e).__name__}: {e}",
                           "unavailable_error") from None
    return list(app.client.slots())


def render_slot(app: "App", entry: dict) -> dict:
    out = {"id": entry["id"], "n_ctx": entry["n_ctx"], "speculative": bool(entry.get("speculative", False)),
           "is_processing": entry["is_processing"]}
    if "id_task" not in entry:
        return out                           # no request ran on this slot yet
    gen = app.generation(str(entry.get("req_id", "")))
    out.update(id_task=entry["id_task"], n_prompt_tokens=entry["n_prompt_tokens"],
               n_prompt_tokens_processed=entry["n_prompt_tokens_processed"],
               n_prompt_tokens_cache=entry["n_prompt_tokens_cache"])
    if isinstance(gen, Memo):                # done: what the front kept of it (api/recent.py)
        params, has_new_line = gen.params, gen.has_new_line
    elif gen is not None:
        params, has_new_line = slot_params(gen.params), "\n" in gen.current_text()
    else:                                    # the front forgot it (long gone): no params rather than made-up ones
        params, has_new_line = None, False
    if params is not None:
        out["params"] = params
    nxt = dict(entry["next_token"][0]) if entry.get("next_token") else {}
    # an idle slot shows no budget: llama-server resets it when the task ends (its captured slots_after)
    busy = bool(entry["is_processing"])
    out["next_token"] = [{"has_next_token": bool(nxt.get("has_next_token", False)), "has_new_line": has_new_line,
                          "n_remain": nxt.get("n_remain", -1) if busy else -1,
                          "n_decoded": nxt.get("n_decoded", 0) if busy else 0}]
    return out


async def handle_slots(app: "App", req: Request) -> Response:
    if not app.endpoint_slots:
        raise ApiError(501, "This server does not support slots endpoint. Start it with `--slots`",
                       "not_supported_error")
    table = await _slot_table(app)
    if req.query.get("fail_on_no_slot") and not any(not e["is_processing"] for e in table):
        raise ApiError(503, "no slot available", "unavailable_error")
    return Response.json([render_slot(app, e) for e in table])


async def handle_metrics(app: "App", req: Request) -> Response:
    if not app.metrics_requested:
        raise ApiError(501, "This server does not support metrics endpoint. Start it with `--metrics`",
                       "not_supported_error")
    table = await _slot_table(app)
    n_processing = sum(1 for e in table if e.get("is_processing"))
    # requests sent to the engine that no slot holds yet wait in its queue (llama-server's deferred)
    n_in_flight = app.recent.n_in_flight()
    stats = getattr(app.client, "engine_stats", None)
    body = (app.metrics.render(n_processing, max(n_in_flight - n_processing, 0), stats() if stats else {})
            + await experts.metrics_text(app))
    return Response(200, body.encode("utf-8"), [("content-type", "text/plain; version=0.0.4"),
                                                 ("process-start-time-unix", str(app.metrics.t_start))])
