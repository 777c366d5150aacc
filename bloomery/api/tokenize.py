"""POST /tokenize and POST /detokenize, as llama-server answers them."""
from __future__ import annotations

from typing import TYPE_CHECKING

from bloomery import workpool
from bloomery.api.params import Fields, field_error
from bloomery.http.types import ApiError, Request, Response

if TYPE_CHECKING:
    from bloomery.api.context import ApiContext as App


def _piece_json(piece: bytes) -> str | list[int]:
    """A piece that is not whole UTF-8 (one byte of a multi-byte character) is sent as its byte values."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return list(piece)


async def handle_tokenize(app: "App", req: Request) -> Response:
    f = Fields(req.json())
    got = f.raw("content")
    if got is None:
        raise ApiError(400, "'content' is required", param="content")
    if not isinstance(got[1], str):
        raise field_error("content", f"type must be string, but is {type(got[1]).__name__}")
    add_special = f.bool("add_special")
    parse_special = f.bool("parse_special")
    with_pieces = f.bool("with_pieces")

    def work() -> Response:      # off the loop: a long content is seconds of tokenizer work
        ids = app.tok.encode(got[1], add_special=bool(add_special),
                             parse_special=True if parse_special is None else parse_special)
        if with_pieces:
            tokens: list = [{"id": i, "piece": _piece_json(app.tok.token_to_piece(i, special=True))} for i in ids]
        else:
            tokens = list(ids)
        body = workpool.json_text({"tokens": tokens}).encode("utf-8")
        return Response(200, body, [("content-type", "application/json; charset=utf-8")])
    return await workpool.run(work)


async def handle_detokenize(app: "App", req: Request) -> Response:
    f = Fields(req.json())
    got = f.raw("tokens")
    return await workpool.run(_detokenize, app, got)


def _detokenize(app: "App", got) -> Response:
    ids: list[int] = []
    if got is not None:
        if not isinstance(got[1], list):
            raise field_error("tokens", "must be an array of token ids")
        for i, t in enumerate(got[1]):
            if isinstance(t, bool) or not isinstance(t, int):
                raise field_error("tokens", f"element [{i}] must be a token id, but is {t!r}")
            if not 0 <= t < app.tok.n_vocab:
                raise field_error("tokens", f"token id {t} at [{i}] is outside 0..{app.tok.n_vocab - 1}")
            ids.append(t)
    return Response.json({"content": app.tok.decode(ids) if ids else ""})
