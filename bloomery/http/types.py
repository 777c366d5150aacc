"""The contract between the HTTP transport (bloomery/http/server.py) and the handlers (bloomery/api/).

The transport parses bytes into a Request and writes a Response or a
StreamResponse back; handlers never see sockets. A handler raises ApiError for
any failure a client should see; the transport turns it into llama-server's
error object {"error": {"code", "message", "type"}}.
"""
from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable


# \uD800-\uDFFF escapes: JSON lets them through unpaired, Python keeps them, and they are not text
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _refuse_lone_surrogates(obj: object) -> None:
    """A lone surrogate is a 400 as in llama-server's JSON parser (a pair was already joined by json)."""
    stack = [obj]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ApiError(400, "Failed to parse the request body as JSON: a string holds a lone UTF-16 "
                                    f"surrogate U+{ord(v[e.start]):04X} (\\u escapes must pair)") from None
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)


@dataclass
class Request:
    method: str                         # "GET", "POST", ...
    path: str                           # without the query string, e.g. "/v1/chat/completions"
    query: dict[str, str]
    headers: dict[str, str]             # lower-case names; repeated headers joined with ", "
    body: bytes
    peer: str = ""                      # client address, for logs and loopback checks
    listen: str = ""                    # the address the server listens on (the Host guard's "bound to loopback")
    parsed: object = field(default=None, repr=False)   # the body's JSON once parsed (bloomery/workpool.py)
    parse_error: str | None = field(default=None, repr=False)   # why it is not JSON, once that is known

    def json(self) -> object:
        """The body as JSON, or ApiError 400 naming the problem."""
        if self.parsed is not None:
            return self.parsed
        if self.parse_error is not None:
            raise ApiError(400, self.parse_error, "invalid_request_error")
        try:
            obj = json.loads(self.body.decode("utf-8") if self.body else "")
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ApiError(400, f"Failed to parse the request body as JSON: {e}", "invalid_request_error") from None
        except RecursionError:   # the decoder recurses per level: a deep body must not be a 500
            raise ApiError(400, "Failed to parse the request body as JSON: it nests arrays or objects deeper "
                                f"than this server reads (about {sys.getrecursionlimit() - 100} levels)",
                           "invalid_request_error") from None
        except ValueError as e:  # an integer literal past sys.get_int_max_str_digits() (4,300 digits)
            raise ApiError(400, f"Failed to parse the request body as JSON: {e}", "invalid_request_error") from None
        if _SURROGATE_ESCAPE.search(self.body):
            _refuse_lone_surrogates(obj)
        self.parsed = obj
        return obj


@dataclass
class Response:
    status: int
    body: bytes = b""
    headers: list[tuple[str, str]] = field(default_factory=list)

    @classmethod
    def json(cls, obj: object, status: int = 200, headers: list[tuple[str, str]] | None = None) -> "Response":
        data = json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        return cls(status, data, [("content-type", "application/json; charset=utf-8"), *(headers or [])])


@dataclass
class StreamResponse:
    """A chunked response (SSE). The transport writes each chunk as it comes and
    closes the iterator (aclose) when the client goes away, so the handler's
    finally-block cancels the generation."""

    status: int
    chunks: AsyncIterator[bytes]
    headers: list[tuple[str, str]] = field(default_factory=lambda: [("content-type", "text/event-stream")])


class ApiError(Exception):
    """A failure the client sees as llama-server's error object."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param

    def body(self) -> dict:
        err: dict = {"code": self.status, "message": self.message, "type": self.type}
        if self.param is not None:
            err["param"] = self.param
        return {"error": err}


Handler = Callable[[Request], Awaitable["Response | StreamResponse"]]


def canonical(name: str) -> str:
    """A header name as llama-server writes it (Content-Type, Access-Control-Allow-Origin): HTTP
    names are case-insensitive, but some clients (llama.cpp's own tests) look them up in a dict."""
    return "-".join(part[:1].upper() + part[1:].lower() for part in name.split("-"))
