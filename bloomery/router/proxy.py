"""One request forwarded to a child bloomery-serve on 127.0.0.1, over HTTP/1.1 (h11), one connection each.

The answer comes back as it came: a body with a length as one Response, anything else (SSE, chunked) as a
StreamResponse whose chunks are the child's own, passed on as they arrive. When the client goes, the
transport closes the stream, which closes the child connection, so the child cancels the generation as it
would for a client of its own. Headers the hop owns (framing, connection) and the CORS headers (the router's
Gate writes its own) are not passed on; Origin is not sent to the child for the same reason, and Host names
the child (its Host guard admits loopback names only).
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator
from urllib.parse import quote, urlencode

import h11

from bloomery.http.types import ApiError, Request, Response, StreamResponse

CHILD_HOST = "127.0.0.1"
READ_BYTES = 64 << 10
CONNECT_S = 10.0
HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "origin", "te", "trailer",
       "upgrade", "proxy-connection", "expect"}
NOT_BACK = {"connection", "keep-alive", "transfer-encoding", "content-length", "server", "date"}


def target(req: Request, query: dict[str, str] | None = None) -> str:
    q = req.query if query is None else query
    return quote(req.path, safe="/:@!$&'()*+,;=-._~") + (f"?{urlencode(q)}" if q else "")


async def _open(port: int):
    try:
        return await asyncio.wait_for(asyncio.open_connection(CHILD_HOST, port), CONNECT_S)
    except (OSError, asyncio.TimeoutError) as e:
        raise ApiError(503, f"the model's server on port {port} did not answer ({type(e).__name__}: {e})",
                       "unavailable_error") from None


async def _next_event(conn: h11.Connection, reader: asyncio.StreamReader):
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await reader.read(READ_BYTES))
            continue
        return event


async def get_json(port: int, path: str, timeout_s: float = 5.0) -> tuple[int, object]:
    """A GET of the child's own (its /health, its /v1/models): (status, parsed body or None)."""
    import json
    req = Request("GET", path, {}, {}, b"")
    res = await asyncio.wait_for(forward(port, req), timeout_s)
    body = res.body if isinstance(res, Response) else b""
    try:
        return res.status, json.loads(body) if body else None
    except ValueError:
        return res.status, None


async def forward(port: int, req: Request, query: dict[str, str] | None = None) -> Response | StreamResponse:
    reader, writer = await _open(port)
    done = False
    try:
        conn = h11.Connection(h11.CLIENT)
        headers = [(k, v) for k, v in req.headers.items() if k not in HOP]
        headers += [("host", f"{CHILD_HOST}:{port}"), ("content-length", str(len(req.body)))]
        data = conn.send(h11.Request(method=req.method, target=target(req, query), headers=headers))
        data += conn.send(h11.Data(data=req.body)) if req.body else b""
        data += conn.send(h11.EndOfMessage())
        writer.write(data)
        await writer.drain()
        head = await _next_event(conn, reader)
        while isinstance(head, h11.InformationalResponse):
            head = await _next_event(conn, reader)
        if not isinstance(head, h11.Response):
            raise ApiError(502, f"the model's server on port {port} closed without an answer", "server_error")
        back = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in head.headers
                if k.decode("latin-1") not in NOT_BACK and not k.startswith(b"access-control-")]
        sized = any(k == b"content-length" for k, _ in head.headers)
        if sized:
            body = bytearray()
            while isinstance(event := await _next_event(conn, reader), h11.Data):
                body += event.data
            return Response(head.status_code, bytes(body), back)
        done = True      # the stream owns the connection from here
        return StreamResponse(head.status_code, _chunks(conn, reader, writer), back)
    except (ConnectionError, h11.ProtocolError) as e:
        raise ApiError(502, f"the model's server on port {port} broke the answer off ({type(e).__name__}: {e})",
                       "server_error") from None
    finally:
        if not done:
            writer.close()


async def _chunks(conn: h11.Connection, reader: asyncio.StreamReader, writer) -> AsyncIterator[bytes]:
    try:
        while isinstance(event := await _next_event(conn, reader), h11.Data):
            yield bytes(event.data)
    finally:
        writer.close()
