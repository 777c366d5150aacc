"""GET /health, GET and POST /props in llama-server's shapes (/v1/models: api/models.py)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from bloomery.api.shapes import BUILD_INFO, default_settings
from bloomery.http.types import ApiError, Request, Response

if TYPE_CHECKING:
    from bloomery.api.context import ApiContext as App


async def handle_health(app: "App", req: Request) -> Response:
    # the supervisor answers 503 {phase} before the engine is ready; a handler runs only after
    return Response.json({"status": "ok"})


def _template_caps(template, source: str) -> dict:
    """llama-server's chat_template_caps: the template's probed caps where it has them, else read from its text."""
    caps = getattr(template, "caps", None)
    get = (lambda name, default: getattr(caps, name, default)) if caps is not None else (lambda name, default: default)
    return {
        "supports_object_arguments": bool(get("object_arguments", "arguments" in source)),
        "supports_parallel_tool_calls": bool(get("tool_calls", "tool_calls" in source)),
        "supports_preserve_reasoning": "reasoning_content" in source,
        "supports_reasoning_effort": "reasoning_effort" in source,
        "supports_string_content": bool(get("string_content", True)),
        "supports_system_role": bool(get("system_role", "system" in source)),
        "supports_tool_calls": bool(get("tool_calls", "tool_calls" in source)),
        "supports_tools": "tools" in source,
        "supports_typed_content": bool(get("typed_content", False)),
    }


def _token_text(tok, token_id: int | None) -> str:
    if token_id is None or token_id < 0:
        return ""
    return tok.token_to_piece(token_id, special=True).decode("utf-8", errors="replace")


async def handle_props(app: "App", req: Request) -> Response:
    source = getattr(app.template, "source", "") or ""
    if source.endswith("\n"):    # llama-server shows the template as its jinja lexer keeps it: one trailing newline off
        source = source[:-1]
    return Response.json({
        "default_generation_settings": {"params": default_settings(app.n_predict_default, app.sampling_defaults),
                                        "n_ctx": app.info.n_ctx_slot},
        "total_slots": app.info.n_slots,
        "model_alias": app.model_name,
        "model_ftype": app.info.ftype,
        "model_path": app.info.model_path,
        "modalities": {"vision": False, "video": False, "audio": False},
        "media_marker": app.media_marker,
        "endpoint_slots": app.endpoint_slots,
        "endpoint_props": app.endpoint_props,
        "endpoint_metrics": app.metrics_requested,
        "ui": False,          # bloomery serves no web UI
        "ui_settings": {},
        "chat_template": source,
        "chat_template_caps": _template_caps(app.template, source),
        "bos_token": _token_text(app.tok, getattr(app.tok, "bos_id", None)),
        "eos_token": _token_text(app.tok, getattr(app.tok, "eos_id", None)),
        "build_info": BUILD_INFO,
        "is_sleeping": app.residency.sleeping,
        "cors_proxy_enabled": False,
    })


async def handle_post_props(app: "App", req: Request) -> Response:
    """llama-server's POST /props: 501 without --props; with it, success (it has no property to change)."""
    if not app.endpoint_props:
        raise ApiError(501, "This server does not support changing global properties. Start it with `--props`",
                       "not_supported_error")
    return Response.json({"success": True})
