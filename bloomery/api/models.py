"""GET /v1/models (and /models) in llama-server's shape, and GET /v1/models/{model}: one entry by name."""
from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import unquote

from bloomery.http.types import ApiError, Request, Response

if TYPE_CHECKING:
    from bloomery.api.context import ApiContext as App


def model_entry(app: "App") -> dict:
    """The OpenAI `data` entry of the one model served (llama-server's fields, meta from the GGUF)."""
    name, info = app.model_name, app.info
    return {
        "id": name, "aliases": list(getattr(app, "aliases", [name])), "tags": list(getattr(app, "tags", [])),
        "object": "model",
        "architecture": {"input_modalities": ["text"], "output_modalities": ["text"]},
        "created": app.created, "owned_by": "llamacpp",
        "meta": {"vocab_type": info.vocab_type, "n_vocab": info.n_vocab, "n_ctx": info.n_ctx_slot,
                 "n_ctx_train": info.n_ctx_train, "n_embd": info.n_embd,
                 "n_params": info.n_params, "size": info.size_bytes, "ftype": info.ftype},
    }


async def handle_models(app: "App", req: Request) -> Response:
    name = app.model_name
    return Response.json({
        "models": [{
            "name": name, "model": name, "modified_at": "", "size": "", "digest": "", "type": "model",
            "description": "", "tags": [""], "capabilities": ["completion"], "parameters": "",
            "details": {"parent_model": "", "format": "gguf", "family": "", "families": [""],
                        "parameter_size": "", "quantization_level": ""},
        }],
        "object": "list",
        "data": [model_entry(app)],
    })


async def handle_model(app: "App", req: Request) -> Response:
    """GET /v1/models/{model}: the entry whose id or alias is {model}; any other name is a 404 naming ours.
    The name may hold slashes (a path-like alias), so everything after /models/ is the name."""
    name = unquote(req.path.split("/models/", 1)[1])
    entry = model_entry(app)
    if name != entry["id"] and name not in entry["aliases"]:
        raise ApiError(404, f"model {name!r} is not served here; this server serves {entry['id']!r}",
                       "not_found_error", param="model")
    return Response.json(entry)
