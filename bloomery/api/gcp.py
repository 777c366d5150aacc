"""Vertex AI (Google Cloud) prediction mode, as llama-server's: AIP_MODE=PREDICTION in the environment.

Vertex AI runs a custom container with these variables set: AIP_HTTP_PORT (the port to
listen on; it replaces --port, settings.py), AIP_PREDICT_ROUTE (default /predict) and
AIP_HEALTH_ROUTE (an extra path answering as /health). The predict route takes
{"instances": [...]} (at most 128), each instance a request body plus "@requestFormat": a
route of this server by path ("/v1/chat/completions") or by its camelCase name
("chatCompletions": the path without /v1/ and the leading slash, camel-cased at / - _).
Each instance runs through that route, all at once, never streamed, and its answer's body
is its prediction, an error object included: {"predictions": [...]} in instance order.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from bloomery.http.types import ApiError, Request, Response, StreamResponse

if TYPE_CHECKING:
    from bloomery.api.context import ApiContext as App

MAX_INSTANCES = 128


@dataclass(frozen=True)
class GcpMode:
    predict_path: str = "/predict"
    health_path: str = ""


def _route_var(env: dict, name: str, default: str) -> str:
    value = env.get(name) or default
    return value if not value or value.startswith("/") else "/" + value


def from_env(env: dict) -> GcpMode | None:
    """The mode AIP_MODE=PREDICTION asks for, or None."""
    if env.get("AIP_MODE") != "PREDICTION":
        return None
    return GcpMode(_route_var(env, "AIP_PREDICT_ROUTE", "/predict"), _route_var(env, "AIP_HEALTH_ROUTE", ""))


def camel_name(path: str) -> str:
    """/v1/chat/completions -> chatCompletions (llama-server's alias of a route for @requestFormat)."""
    s = path[3:] if path.startswith("/v1") and len(path) > 3 else path
    s = s[1:] if s.startswith("/") else s
    out, cap = [], False
    for c in s.split(":", 1)[0]:
        if c in "/-_":
            cap = True
        else:
            out.append(c.upper() if cap else c)
            cap = False
    return "".join(out)


def aliases(paths) -> dict[str, str]:
    """camelCase name -> path; the first path in order wins a shared name (as llama-server's map)."""
    out: dict[str, str] = {}
    for p in paths:
        out.setdefault(camel_name(p), p)
    return out


def _error(message: str, type_: str = "invalid_request_error", status: int = 400) -> dict:
    return ApiError(status, message, type_).body()


async def _one(app: "App", req: Request, names: dict[str, str], instance: object) -> object:
    if not isinstance(instance, dict):
        return _error("each instance must be a JSON object")
    fmt = instance.get("@requestFormat")
    if not isinstance(fmt, str):
        return _error("each instance must include a string @requestFormat")
    path = names.get(fmt) or (fmt if ("POST", fmt) in app.routes() else None)
    if path is None:
        return _error(f"no handler registered for @requestFormat: {fmt}")
    payload = {k: v for k, v in instance.items() if k != "@requestFormat"}
    if "stream" in payload:
        payload["stream"] = False        # the predict route never streams
    inner = Request("POST", path, {}, req.headers, json.dumps(payload).encode("utf-8"), req.peer, req.listen)
    res = await app.dispatch(inner)
    if isinstance(res, StreamResponse):
        return _error("predict route does not support streaming responses")
    if not res.body:
        return None
    try:
        return json.loads(res.body)
    except ValueError:
        return res.body.decode("utf-8", "replace")


async def handle_predict(app: "App", req: Request) -> Response:
    body = req.json()
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    instances = body.get("instances")
    if not isinstance(instances, list):
        raise ApiError(400, "request body must include an array field named instances")
    if len(instances) > MAX_INSTANCES:
        raise ApiError(400, f"instances array exceeds maximum size of {MAX_INSTANCES}")
    names = aliases(p for m, p in app.routes() if m == "POST")
    predictions = await asyncio.gather(*(_one(app, req, names, i) for i in instances))
    return Response.json({"predictions": list(predictions)})
