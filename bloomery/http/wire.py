"""Pure helpers of the transport: h11 events -> Request, error bodies, raw responses, body decoding.

Nothing here touches a socket, so each piece is tested on bytes alone.
"""
from __future__ import annotations

import zlib
from http import HTTPStatus
from urllib.parse import parse_qsl, unquote_to_bytes

import h11

from .types import ApiError, Request, Response, canonical

# Codings a body may arrive in (the serving guide's "Compressed bodies").
ACCEPTED_ENCODINGS = "gzip, deflate"


def reason_phrase(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode("ascii")
    except ValueError:
        return b""


def error_response(status: int, message: str, type_: str = "invalid_request_error",
                   headers: list[tuple[str, str]] | None = None) -> Response:
    """llama-server's error object {"error": {"code", "message", "type"}}."""
    return Response.json(ApiError(status, message, type_).body(), status, headers)


def raw_response(response: Response, *, server_header: str, head: bool = False) -> bytes:
    """A whole response, `Connection: close`, for when h11 has no request to answer
    (timeouts before a request line, the connection bound)."""
    headers = [(canonical(k), v) for k, v in response.headers if k.lower() not in ("content-length", "connection",
                                                                                 "transfer-encoding")]
    # h11 validates names and values (no CR/LF smuggled in by a handler).
    checked = h11.Response(status_code=response.status, reason=reason_phrase(response.status),
                           headers=[("Server", server_header), *headers,
                                    ("Content-Length", str(len(response.body))), ("Connection", "close")])
    lines = [b"HTTP/1.1 %d %s" % (checked.status_code, checked.reason)]
    lines += [k + b": " + v for k, v in checked.headers.raw_items()]
    return b"\r\n".join(lines) + b"\r\n\r\n" + (b"" if head else response.body)


def peer_text(peername: object) -> str:
    """"ip:port" ("[ip]:port" for IPv6); a Unix socket peer is "unix"."""
    if isinstance(peername, tuple) and len(peername) >= 2:
        host, port = peername[0], peername[1]
        return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
    return "unix"


def declared_length(event: h11.Request) -> int | None:
    """The Content-Length the client declared (h11 already checked it is one valid number)."""
    for name, value in event.headers:
        if name == b"content-length":
            return int(value)
    return None


def build_request(event: h11.Request, peer: str) -> Request:
    """The Request a handler sees, body still empty. Bad targets are ApiError 400."""
    target = bytes(event.target)
    if target.startswith((b"http://", b"https://")):
        # absolute-form (proxies send it): keep only the path and query
        rest = target.split(b"://", 1)[1]
        slash = rest.find(b"/")
        target = rest[slash:] if slash >= 0 else b"/"
    raw_path, _, raw_query = target.partition(b"?")
    raw_path = raw_path.partition(b"#")[0]
    try:
        path = unquote_to_bytes(raw_path).decode("utf-8")
    except UnicodeDecodeError:
        raise ApiError(400, f"Request path {raw_path.decode('latin-1')!r} is not valid UTF-8 after "
                            "percent-decoding") from None
    try:
        pairs = parse_qsl(raw_query.decode("latin-1"), keep_blank_values=True, encoding="utf-8",
                          errors="strict")
    except UnicodeDecodeError:
        raise ApiError(400, f"Query string {raw_query.decode('latin-1')!r} is not valid UTF-8 after "
                            "percent-decoding") from None
    headers: dict[str, str] = {}
    for name, value in event.headers:
        key, text = name.decode("latin-1"), value.decode("latin-1")
        headers[key] = f"{headers[key]}, {text}" if key in headers else text
    return Request(method=event.method.decode("ascii"), path=path, query=dict(pairs),
                   headers=headers, body=b"", peer=peer)


def decode_body(request: Request, max_body_bytes: int) -> None:
    """Undo Content-Encoding gzip/deflate in place; the body limit holds for the decoded body too."""
    coding = request.headers.get("content-encoding", "").strip().lower()
    if coding in ("", "identity"):
        return
    codings = [c.strip() for c in coding.split(",") if c.strip()]
    if len(codings) != 1 or codings[0] not in ("gzip", "x-gzip", "deflate"):
        raise ApiError(415, f"Content-Encoding {coding!r} is not supported: send one of {ACCEPTED_ENCODINGS}, "
                            "or none")
    if codings[0] == "deflate":
        # RFC 9110 deflate is the zlib format; some clients send raw deflate, so try both.
        wbits_options = (zlib.MAX_WBITS, -zlib.MAX_WBITS)
    else:
        wbits_options = (zlib.MAX_WBITS | 16,)
    last_error = ""
    for wbits in wbits_options:
        inflater = zlib.decompressobj(wbits)
        try:
            data = inflater.decompress(request.body, max_body_bytes + 1)
        except zlib.error as e:
            last_error = str(e)
            continue
        if len(data) > max_body_bytes:
            raise ApiError(413, f"Request body is too large: it decodes ({codings[0]}) to more than "
                                f"{max_body_bytes} bytes, the limit")
        if not inflater.eof:
            last_error = "the compressed stream ends early"
            continue
        request.body = data
        del request.headers["content-encoding"]  # handlers see the body as sent plain
        return
    raise ApiError(400, f"Request body does not decode as Content-Encoding {codings[0]}: {last_error}")


def client_of(writer) -> str:
    """The peer's address without its port: what max_per_client counts ("" for a Unix socket)."""
    peer = writer.get_extra_info("peername")
    return str(peer[0]) if isinstance(peer, tuple) and peer else ""
