"""Ollama's GET /api/tags and POST /api/show, for Ollama clients listing and inspecting the model.

Ollama's other routes (/api/chat, /api/generate, ...) are not served: they are 404 as any unknown route.
"""
from __future__ import annotations

import datetime
from typing import TYPE_CHECKING

from bloomery.api.params import Fields, field_error
from bloomery.http.types import ApiError, Request, Response

if TYPE_CHECKING:
    from bloomery.api.context import ApiContext as App

# llama_ftype_name -> Ollama's quantization words
_QUANT_WORDS = {"Small": "S", "Medium": "M", "Large": "L", "Extra Small": "XS", "Extra Extra Small": "XXS"}


def quantization_level(ftype: str) -> str:
    """"Q4_K - Medium" -> "Q4_K_M", "Q8_0" -> "Q8_0"; a guessed type keeps its name without the mark."""
    name = ftype.replace("(guessed)", "").strip()
    if " - " in name:
        base, size = name.split(" - ", 1)
        return f"{base}_{_QUANT_WORDS.get(size, size.replace(' ', '_'))}"
    return name


def parameter_size(n_params: int) -> str:
    if n_params >= 1e9:
        return f"{n_params / 1e9:.2f}B"
    if n_params >= 1e6:
        return f"{n_params / 1e6:.2f}M"
    return str(n_params)


def _details(app: "App") -> dict:
    info = app.info
    return {"parent_model": "", "format": "gguf", "family": info.arch, "families": [info.arch],
            "parameter_size": parameter_size(info.n_params), "quantization_level": quantization_level(info.ftype)}


def _modified_at(app: "App") -> str:
    return datetime.datetime.fromtimestamp(app.created, datetime.timezone.utc).isoformat()


def capabilities(app: "App") -> list[str]:
    source = getattr(app.template, "source", "") or ""
    caps = ["completion"]
    if "tools" in source:       # the template renders a tools list
        caps.append("tools")
    return caps


async def handle_tags(app: "App", req: Request) -> Response:
    name = app.model_name
    return Response.json({"models": [{
        "name": name, "model": name, "modified_at": _modified_at(app), "size": app.info.size_bytes,
        "digest": "", "details": _details(app),
    }]})


async def handle_show(app: "App", req: Request) -> Response:
    f = Fields(req.json())
    got = f.raw("model", "name")      # "name" is Ollama's older spelling
    if got is None:
        raise ApiError(400, "'model' is required", param="model")
    if not isinstance(got[1], str):
        raise field_error(got[0], "must be a model name (a string)")
    if got[1] != app.model_name:
        raise ApiError(404, f"model {got[1]!r} is not served here; this server serves {app.model_name!r}",
                       "not_found_error", param="model")
    info = app.info
    return Response.json({
        "modelfile": "", "parameters": "",
        "template": getattr(app.template, "source", "") or "",
        "details": _details(app),
        "model_info": {
            "general.architecture": info.arch,
            "general.name": app.model_name,
            "general.parameter_count": info.n_params,
            f"{info.arch}.context_length": info.n_ctx_slot,       # the served context, not the trained one
            f"{info.arch}.embedding_length": info.n_embd,
        },
        "capabilities": capabilities(app),
        "modified_at": _modified_at(app),
    })
