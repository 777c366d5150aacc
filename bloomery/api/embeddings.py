"""POST /embedding, /embeddings (llama-server's own shape) and /v1/embeddings (OpenAI's), with --embeddings.

As llama-server (tools/server/server-context.cpp, handle_embeddings_impl): the body's `input` (or
`content`, which always answers llama-server's own shape) is one prompt or several: a string, an
array of token ids, an array mixing strings and ids, {"prompt_string": ...}, or {"content": [parts]}
whose text parts are joined (an image, audio or video part is refused: no encoder is loaded); an
array holding no number at its top level is several prompts. Each prompt runs whole in a slot
(engine/core.py's _embed): the model's hidden states after its final norm, pooled as --pooling
says. A pooled vector is normalised (--embd-normalize, or the request's embd_normalize: -1 none,
0 max absolute scaled to int16, 1 taxicab, 2 euclidean, p > 2 p-norm), as common_embd_normalize;
pooling none gives every prompt id's row, unnormalised, and is refused on /v1/embeddings.
llama-server's shape: [{"index", "embedding": [[...], ...]}]; OpenAI's: {"model", "object": "list",
"usage", "data": [{"embedding", "index", "object": "embedding"}]}, with `encoding_format` base64
the vector's float32 bytes (little-endian) in base64.
"""
from __future__ import annotations

import asyncio
import base64
import itertools
import math
from typing import TYPE_CHECKING

import numpy as np

from bloomery import workpool
from bloomery.api.prompts import PROMPT_STRING_KEY, _is_id, _one
from bloomery.engine.types import EngineRequest
from bloomery.http.types import ApiError, Request, Response

if TYPE_CHECKING:
    from bloomery.api.context import ApiContext as App

MEDIA_PARTS = {"image_url": "image", "input_audio": "audio", "input_video": "video", "video_url": "video"}
_ids = itertools.count()


def bad(message: str, param: str = "input") -> ApiError:
    return ApiError(400, message, "invalid_request_error", param=param)


def normalize(v: np.ndarray, how: int) -> np.ndarray:
    """common_embd_normalize: -1 none, 0 max absolute to the int16 range, 2 euclidean, else the how-norm."""
    x = v.astype(np.float64)
    if how == -1:
        total = 1.0
    elif how == 0:
        total = float(np.max(np.abs(x), initial=0.0)) / 32760.0
    elif how == 2:
        total = math.sqrt(float(np.sum(x * x)))
    else:
        total = float(np.sum(np.abs(x) ** how)) ** (1.0 / how)
    scale = 1.0 / total if total > 0.0 else 0.0
    return (v * np.float32(scale)).astype(np.float32)


def content_text(parts: object, where: str) -> str:
    """An OpenAI content array's text parts joined; a media part is refused (no encoder is loaded)."""
    if not isinstance(parts, list):
        raise bad(f"{where}: \"content\" must be an array of content parts")
    text = []
    for i, p in enumerate(parts):
        kind = p.get("type") if isinstance(p, dict) else None
        if kind in MEDIA_PARTS:
            raise bad(f"{where}[{i}]: {MEDIA_PARTS[kind]} input is not supported: this server loads no "
                      f"{MEDIA_PARTS[kind]} encoder (--mmproj is not served)")
        if kind != "text" or not isinstance(p.get("text", ""), str):
            raise bad(f"{where}[{i}]: unsupported content part {kind!r} (text parts only)")
        text.append(p.get("text", ""))
    return "".join(text)


def read_inputs(tok, value: object) -> list[list[int]]:
    """The input field -> one id list per prompt, as llama-server's tokenize_input_prompts plus content arrays."""
    def entry(v: object, where: str) -> list[int]:
        if isinstance(v, dict) and "content" in v:
            return tok.encode(content_text(v["content"], f"{where}.content"), add_special=True, parse_special=True)
        if isinstance(v, dict) and PROMPT_STRING_KEY not in v:
            raise bad(f"{where} is an object without {PROMPT_STRING_KEY!r} or \"content\"")
        if not isinstance(v, (str, list, dict)):
            raise bad(f"{where} must be a string, an array of token ids (or of strings and ids), an object with "
                      f"{PROMPT_STRING_KEY!r} or \"content\", or an array of these; got {type(v).__name__}")
        try:
            return _one(tok, v, where)
        except ApiError as e:        # prompts.py names the `prompt` field; here it is `input`
            raise bad(str(e.message).replace("'prompt'", "'input'")) from None

    if isinstance(value, list) and not any(_is_id(x) or isinstance(x, float) for x in value):
        if not value:
            raise bad("\"input\" must not be empty")
        return [entry(v, f"input[{i}]") for i, v in enumerate(value)]
    return [entry(value, "input")]


def _vectors(out, n_embd_hint: int = 0) -> np.ndarray:
    rows = np.frombuffer(base64.b64decode(out.embedding), dtype="<f4")
    return rows.reshape(out.embd_rows, -1) if out.embd_rows else rows.reshape(0, n_embd_hint)


async def _run_one(app: "App", ids: list[int]) -> np.ndarray:
    req = EngineRequest(f"embd-{next(_ids)}", tuple(ids), 0, cache_prompt=False, pooling=app.info.pooling)
    last = None
    async for out in app.client.generate(req):
        if out.finish is not None:
            last = out
    if last is None or last.finish != "stop" or not last.embd_rows:
        why = last.error if last is not None and last.error else "the engine gave no embedding"
        raise ApiError(500, f"embedding failed: {why}", "server_error")
    return _vectors(last)


async def handle_embeddings(app: "App", req: Request) -> Response:
    """/embedding and /embeddings: llama-server's own shape."""
    return await _embeddings(app, req, oai=False)


async def handle_v1_embeddings(app: "App", req: Request) -> Response:
    """/v1/embeddings: OpenAI's shape."""
    return await _embeddings(app, req, oai=True)


async def _embeddings(app: "App", req: Request, oai: bool) -> Response:
    if not app.embeddings:
        raise ApiError(501, "This server does not support embeddings. Start it with `--embeddings`",
                       "not_supported_error")
    pooling = app.info.pooling
    if pooling == "rank":
        raise ApiError(501, "This model pools by rank (a reranker): its embeddings are not served", "not_supported_error")
    if oai and pooling == "none":
        raise bad("Pooling type 'none' is not OAI compatible. Please use a different pooling type", "pooling")
    body = req.json()
    if not isinstance(body, dict):
        raise bad("the body must be a JSON object", "body")
    if "input" in body:
        value = body["input"]
    elif "content" in body:
        oai, value = False, body["content"]          # "content" is llama-server's field: its own shape
    else:
        raise bad("\"input\" or \"content\" must be provided")
    fmt = body.get("encoding_format", "float")
    if not isinstance(fmt, str) or fmt not in ("float", "base64"):
        raise bad("The format to return the embeddings in. Can be either float or base64 (encoding_format: "
                  f"{fmt!r})", "encoding_format")
    how = body.get("embd_normalize", app.embd_normalize)
    if not _is_id(how):
        raise bad(f"embd_normalize must be an integer (-1 none, 0 max absolute, 1 taxicab, 2 euclidean, >2 p-norm), "
                  f"got {how!r}", "embd_normalize")
    prompts = await workpool.run(read_inputs, app.tok, value)
    limit = app.info.n_ctx_slot - 1
    for ids in prompts:
        if not ids:
            raise bad("Input content cannot be empty")
        if len(ids) > limit:
            raise ApiError(400, f"input ({len(ids)} tokens) is too large to process: a slot holds at most {limit} "
                                f"(-c / -np)", "exceed_context_size_error")
    got = await asyncio.gather(*(_run_one(app, ids) for ids in prompts))
    if pooling != "none":
        got = [normalize(v[0], how)[None, :] for v in got]
    n_tokens = sum(len(ids) for ids in prompts)
    if not oai:
        return Response.json([{"index": i, "embedding": v.tolist()} for i, v in enumerate(got)])
    data = []
    for i, v in enumerate(got):
        if fmt == "base64":
            data.append({"embedding": base64.b64encode(v[0].astype("<f4").tobytes()).decode("ascii"), "index": i,
                         "object": "embedding", "encoding_format": "base64"})
        else:
            data.append({"embedding": v[0].tolist(), "index": i, "object": "embedding"})
    model = body.get("model") if isinstance(body.get("model"), str) else app.model_name
    return Response.json({"model": model, "object": "list",
                          "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}, "data": data})
