"""Fuzz the transport: random and mutated request bytes never crash it (only 1xx/2xx/4xx, 501 or a close),
and it answers a good request afterwards. The h11 rule, on a live socket."""
from __future__ import annotations

import asyncio
import gzip
import http.client
import re
import socket

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st_

from bloomery.http.threaded import ServerThread
from bloomery.http.types import ApiError, Response, StreamResponse

GOOD = [
    b"GET /v1/models?x=1 HTTP/1.1\r\nHost: a\r\nAccept: */*\r\n\r\n",
    b"POST /completion HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\nContent-Length: 16\r\n\r\n"
    b'{"prompt": "hi"}',
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"5\r\n{\"a\":\r\n3\r\n 1}\r\n0\r\n\r\n",
    b"POST /up HTTP/1.1\r\nHost: a\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\nok",
    b"GET /sse HTTP/1.1\r\nHost: a\r\n\r\nGET /a HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
    b"HEAD /x HTTP/1.0\r\n\r\n",
    b"POST /z HTTP/1.1\r\nHost: a\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n%s"
    % (len(gzip.compress(b'{"a": 1}', mtime=0)), gzip.compress(b'{"a": 1}', mtime=0)),
]
STATUS_LINE = re.compile(rb"HTTP/1\.1 (\d{3}) ")


class FuzzApp:
    def __init__(self):
        self.errors: list[tuple[str, dict]] = []

    def log(self, event: str, **kv) -> None:
        if kv.get("level") == "error":
            self.errors.append((event, kv))

    async def dispatch(self, req):
        # constant bodies: a status line found in the output is always the transport's own
        if req.path == "/sse":
            async def ticks():
                for _ in range(3):
                    yield b"data: tick\n\n"
                    await asyncio.sleep(0)
            return StreamResponse(200, ticks())
        if req.path == "/refuse":
            raise ApiError(400, "refused")
        return Response.json({"ok": True})


@pytest.fixture(scope="module")
def fuzz_server():
    app = FuzzApp()
    with ServerThread(app.dispatch, log=app.log, max_body_bytes=4096, max_header_bytes=2048,
                      header_timeout_s=2, idle_timeout_s=2, body_timeout_s=2) as st:
        yield st, app


@st_.composite
def mutated(draw):
    data = bytearray(draw(st_.sampled_from(GOOD)))
    for _ in range(draw(st_.integers(1, 4))):
        kind = draw(st_.sampled_from(["flip", "insert", "delete", "truncate", "repeat"]))
        pos = draw(st_.integers(0, max(len(data) - 1, 0)))
        if kind == "flip" and data:
            data[pos] = draw(st_.integers(0, 255))
        elif kind == "insert":
            data[pos:pos] = draw(st_.binary(min_size=1, max_size=40))
        elif kind == "delete":
            del data[pos:pos + draw(st_.integers(1, 20))]
        elif kind == "truncate":
            del data[pos:]
        else:
            data[pos:pos] = data[pos:pos + draw(st_.integers(1, 60))] * draw(st_.integers(2, 80))
    return bytes(data)


def exchange(st, data: bytes) -> bytes:
    with socket.create_connection((st.host, st.port), timeout=10) as s:
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)   # end of input now, so no case waits for a timeout
        except OSError:
            pass   # the server may answer and close before all was sent
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except ConnectionResetError:
            pass
        return out


def check_survived(st, app, data: bytes, out: bytes) -> None:
    statuses = [int(m) for m in STATUS_LINE.findall(out)]
    # 501 is h11's answer to a transfer coding other than chunked (RFC 9112 6.1), never a handler's
    assert all(s in (100, 200, 501) or 400 <= s < 500 for s in statuses), (data, out[:300])
    assert not app.errors, app.errors
    c = http.client.HTTPConnection(st.host, st.port, timeout=10)
    c.request("GET", "/health")
    r = c.getresponse()
    assert r.status == 200 and r.read() == b'{"ok":true}'
    c.close()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st_.binary(max_size=3000))
def test_random_bytes_never_crash_the_server(fuzz_server, data):
    st, app = fuzz_server
    check_survived(st, app, data, exchange(st, data))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=mutated())
def test_mutated_requests_never_crash_the_server(fuzz_server, data):
    st, app = fuzz_server
    check_survived(st, app, data, exchange(st, data))


@pytest.mark.parametrize("data", GOOD)
def test_the_seed_requests_are_answered(fuzz_server, data):
    st, app = fuzz_server
    out = exchange(st, data)
    assert STATUS_LINE.match(out) and all(s in (b"100", b"200") for s in STATUS_LINE.findall(out)), out
    check_survived(st, app, data, out)
