"""The HTTP transport on real sockets: http.client, raw sockets for malformed or slow input, curl for SSE."""
from __future__ import annotations

import asyncio
import gzip
import http.client
import json
import shutil
import socket
import subprocess
import threading
import time

import pytest

from bloomery.http.threaded import ServerThread
from bloomery.http.types import ApiError, Request, Response, StreamResponse

LIMIT = 64 << 20


class App:
    """A handler set that records what the transport did to it."""

    def __init__(self):
        self.stream_closed = threading.Event()
        self.stream_started = threading.Event()
        self.n_dispatched = 0
        self.records: list[tuple[str, dict]] = []

    def log(self, event: str, **kv) -> None:
        self.records.append((event, kv))

    async def dispatch(self, req: Request):
        self.n_dispatched += 1
        if req.path == "/boom":
            raise RuntimeError("kaboom in the handler")
        if req.path == "/api-error":
            raise ApiError(400, "field 'n_predict' must be an integer", param="n_predict")
        if req.path == "/sleep":
            await asyncio.sleep(float(req.query["s"]))
        if req.path == "/hang":
            try:
                await asyncio.sleep(30)
            finally:
                self.stream_closed.set()
        if req.path == "/sse":
            return StreamResponse(200, self._ticks(int(req.query.get("n", "5")), float(req.query.get("gap_s", "0.2"))))
        if req.path == "/sse-forever":
            return StreamResponse(200, self._forever(float(req.query.get("gap_s", "0.05")),
                                                     int(req.query.get("n_pad_bytes", "0"))))
        if req.path == "/sse-fails-first":
            return StreamResponse(200, self._fails_first())
        if req.path == "/sse-breaks":
            return StreamResponse(200, self._breaks(int(req.query["after"])))
        if req.path == "/bad-header":
            return Response(200, b"x", [("x-evil", "a\r\nset-cookie: b")])
        return Response.json({"method": req.method, "path": req.path, "query": req.query, "headers": req.headers,
                              "n_body_bytes": len(req.body), "body_head": req.body[:32].decode("latin-1"),
                              "peer": req.peer})

    async def _ticks(self, n: int, gap_s: float):
        for i in range(n):
            if i:
                await asyncio.sleep(gap_s)
            yield f"data: {i}\n\n".encode()

    async def _forever(self, gap_s: float, n_pad_bytes: int):
        try:
            self.stream_started.set()
            i = 0
            while True:
                yield f"data: {i}{' ' * n_pad_bytes}\n\n".encode()
                i += 1
                await asyncio.sleep(gap_s)
        finally:
            self.stream_closed.set()

    async def _breaks(self, n_after: int):
        for i in range(n_after):
            yield f"data: {i}\n\n".encode()
        raise RuntimeError("the generation died")

    async def _fails_first(self):
        raise ApiError(400, "prompt is too long for the slot")
        yield b""  # an async generator


@pytest.fixture
def serve():
    started: list[ServerThread] = []

    def start(**kw) -> tuple[ServerThread, App]:
        app = App()
        st = ServerThread(app.dispatch, log=app.log, **kw).start()
        started.append(st)
        return st, app

    yield start
    for st in started:
        st.stop()


def get(st, method, path, body=None, headers=None, conn=None):
    """One request with http.client; an iterator body goes chunked."""
    c = conn or http.client.HTTPConnection(st.host, st.port, timeout=10)
    chunked = body is not None and not isinstance(body, bytes)
    c.request(method, path, body=body, headers=headers or {}, encode_chunked=chunked)
    r = c.getresponse()
    return r, r.read()


def raw(st, data: bytes, *, timeout_s: float = 10, shut: bool = True) -> bytes:
    """Send bytes, half-close, read until the server closes."""
    with socket.create_connection((st.host, st.port), timeout=timeout_s) as s:
        s.sendall(data)
        if shut:
            s.shutdown(socket.SHUT_WR)
        return read_all(s)


def read_all(s: socket.socket) -> bytes:
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def test_keep_alive_reuses_one_connection_and_connection_close_is_honoured(serve):
    st, app = serve()
    c = http.client.HTTPConnection(st.host, st.port, timeout=10)
    peers = {json.loads(get(st, "GET", f"/r{i}", conn=c)[1])["peer"] for i in range(3)}
    assert len(peers) == 1, peers
    assert st.call(lambda: st.server.n_open) == 1
    r, _ = get(st, "GET", "/last", headers={"Connection": "close"}, conn=c)
    assert r.getheader("connection") == "close"
    out = raw(st, b"GET /a HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", shut=False)
    assert out.startswith(b"HTTP/1.1 200 ") and out.count(b"HTTP/1.1") == 1


def test_http_1_0_closes_after_the_answer(serve):
    st, _ = serve()
    out = raw(st, b"GET /old HTTP/1.0\r\n\r\n", shut=False)   # no half-close: the server must close itself
    assert out.startswith(b"HTTP/1.1 200 ") and b'"path":"/old"' in out


def test_pipelined_requests_answered_in_order(serve):
    st, _ = serve()
    # the first request is the slowest: answers must still come in request order
    reqs = b"".join(f"GET /sleep?s={s} HTTP/1.1\r\nHost: x\r\nX-N: {i}\r\n\r\n".encode()
                    for i, s in enumerate((0.3, 0.0, 0.1)))
    out = raw(st, reqs + b"GET /end HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", shut=False)
    numbers = [json.loads(part.split(b"\r\n\r\n", 1)[1].split(b"HTTP/1.1")[0])["headers"].get("x-n")
               for part in out.split(b"HTTP/1.1 200 OK")[1:]]
    assert numbers == ["0", "1", "2", None]


def test_chunked_upload_is_read_whole(serve):
    st, _ = serve()
    parts = [b"a" * 1000, b"b" * 70000, b"c"]
    r, body = get(st, "POST", "/up", body=iter(parts))
    got = json.loads(body)
    assert r.status == 200 and got["n_body_bytes"] == 71001 and got["body_head"] == "a" * 32


def test_body_limit_is_exact(serve):
    st, _ = serve(max_body_bytes=1000)
    assert get(st, "POST", "/b", body=b"x" * 1000)[0].status == 200
    r, body = get(st, "POST", "/b", body=b"x" * 1001)
    assert r.status == 413 and "1000 bytes" in json.loads(body)["error"]["message"]
    r, body = get(st, "POST", "/b", body=iter([b"x" * 600, b"x" * 401]))
    assert r.status == 413 and json.loads(body)["error"]["code"] == 413


def test_413_on_declared_64mib_plus_one_before_the_body_is_sent(serve):
    st, app = serve()
    with socket.create_connection((st.host, st.port), timeout=10) as s:
        s.sendall(f"POST /big HTTP/1.1\r\nHost: x\r\nContent-Length: {LIMIT + 1}\r\n\r\n".encode())
        s.sendall(b"x" * 1000)  # only a little of the body: the answer must not wait for the rest
        out = read_all(s)
    head, _, body = out.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413 ") and b"connection: close" in head.lower()
    err = json.loads(body)["error"]
    assert err["type"] == "invalid_request_error" and str(LIMIT + 1) in err["message"] and str(LIMIT) in err["message"]
    assert app.n_dispatched == 0
    # a real client that sends the whole body still reads the 413 (the server discards, then closes)
    r, body = get(st, "POST", "/big", body=b"y" * (LIMIT + 1))
    assert r.status == 413 and json.loads(body)["error"]["code"] == 413


def test_413_on_chunked_64mib_plus_one(serve):
    st, app = serve()
    piece = b"z" * (1 << 20)
    chunks = [piece] * 64 + [b"!"]
    r, body = get(st, "POST", "/big", body=iter(chunks))
    assert r.status == 413 and str(LIMIT) in json.loads(body)["error"]["message"]
    assert app.n_dispatched == 0
    assert get(st, "GET", "/after")[0].status == 200


def test_431_on_oversized_headers(serve):
    st, app = serve(max_header_bytes=4096)
    ok, _ = get(st, "GET", "/h", headers={"X-Pad": "p" * 3000})
    assert ok.status == 200
    out = raw(st, b"GET /h HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"p" * 8000 + b"\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 431 ") and b"4096 bytes" in out


def test_slow_headers_are_cut_at_header_timeout(serve):
    st, _ = serve(header_timeout_s=0.5, idle_timeout_s=5)
    with socket.create_connection((st.host, st.port), timeout=10) as s:
        t0 = time.monotonic()
        s.sendall(b"GET /slow HTTP/1.1\r\n")
        out = b""
        for i in range(40):   # a byte every 0.05 s must not extend the deadline (slowloris)
            try:
                s.sendall(b"X-A: b\r\n"[i % 8:i % 8 + 1])
            except OSError:
                break
            time.sleep(0.05)
            s.setblocking(False)
            try:
                out += s.recv(65536)
            except BlockingIOError:
                pass
            s.setblocking(True)
            if out:
                break
        s.settimeout(5)
        out += read_all(s)
        elapsed_s = time.monotonic() - t0
    assert out.startswith(b"HTTP/1.1 408 ") and b"header_timeout_s=0.5" in out
    assert 0.4 < elapsed_s < 2.0


def test_idle_keep_alive_connection_is_closed(serve):
    st, _ = serve(idle_timeout_s=0.5)
    with socket.create_connection((st.host, st.port), timeout=10) as s:
        s.sendall(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n")
        first = s.recv(65536)
        t0 = time.monotonic()
        rest = read_all(s)   # returns once the server closes
        elapsed_s = time.monotonic() - t0
    assert first.startswith(b"HTTP/1.1 200 ") and rest == b""
    assert 0.3 < elapsed_s < 2.0


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_sse_chunks_reach_curl_one_by_one(serve):
    st, _ = serve()
    proc = subprocess.Popen(["curl", "-sN", f"http://{st.host}:{st.port}/sse?n=5&gap_s=0.3"], stdout=subprocess.PIPE)
    arrivals = []
    for line in proc.stdout:
        if line.startswith(b"data:"):
            arrivals.append(time.monotonic())
    assert proc.wait(10) == 0
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    assert len(arrivals) == 5 and all(g > 0.2 for g in gaps), gaps


@pytest.mark.parametrize("gap_s", [0.05, 30.0])
def test_client_disconnect_mid_stream_closes_the_iterator(serve, gap_s, caplog):
    # gap_s 30: the handler is silent (a long prefill), so no failed write can reveal the disconnect
    caplog.set_level("WARNING")
    st, app = serve()
    s = socket.create_connection((st.host, st.port), timeout=10)
    s.sendall(f"GET /sse-forever?gap_s={gap_s} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    assert b"data: 0" in s.recv(65536)
    s.close()
    assert app.stream_closed.wait(2), "the stream was not aclose()d after the client left"
    assert not [r for r in app.records if r[1].get("level") == "error"], app.records
    assert get(st, "GET", "/after")[0].status == 200
    time.sleep(0.2)   # a late "socket.send() raised exception" from asyncio would land here
    assert not caplog.records, [r.getMessage() for r in caplog.records]


def test_handler_exception_is_500_and_the_server_keeps_serving(serve):
    st, app = serve()
    c = http.client.HTTPConnection(st.host, st.port, timeout=10)
    r, body = get(st, "GET", "/boom", conn=c)
    assert r.status == 500
    assert json.loads(body) == {"error": {"code": 500, "message": "kaboom in the handler", "type": "server_error"}}
    assert get(st, "GET", "/fine", conn=c)[0].status == 200   # same connection
    assert get(st, "GET", "/fine")[0].status == 200          # a new one
    assert any(kv.get("level") == "error" for _, kv in app.records)


def test_api_error_status_and_body(serve):
    st, _ = serve()
    r, body = get(st, "POST", "/api-error", body=b"{}")
    assert r.status == 400
    assert json.loads(body) == {"error": {"code": 400, "message": "field 'n_predict' must be an integer",
                                          "type": "invalid_request_error", "param": "n_predict"}}
    r, body = get(st, "GET", "/sse-fails-first")   # raised before the first chunk: still a proper answer
    assert r.status == 400 and json.loads(body)["error"]["message"] == "prompt is too long for the slot"


def test_head_is_get_without_a_body(serve):
    st, _ = serve()
    c = http.client.HTTPConnection(st.host, st.port, timeout=10)
    g, gbody = get(st, "GET", "/h?x=1", conn=c)
    h, hbody = get(st, "HEAD", "/h?x=1", conn=c)
    assert h.status == 200 and hbody == b""
    assert h.getheader("content-length") == g.getheader("content-length") == str(len(gbody))
    assert json.loads(gbody)["method"] == "GET"
    s, sbody = get(st, "HEAD", "/sse", conn=c)
    assert s.status == 200 and sbody == b"" and s.getheader("content-type") == "text/event-stream"
    assert get(st, "GET", "/still", conn=c)[0].status == 200


def test_expect_100_continue_and_precheck_refusal(serve):
    def precheck(req: Request):
        if req.headers.get("authorization") != "Bearer k":
            return Response.json({"error": {"message": "Invalid API Key", "type": "authentication_error",
                                            "code": 401}}, 401)
        return None

    st, app = serve(precheck=precheck)
    with socket.create_connection((st.host, st.port), timeout=10) as s:
        s.sendall(b"POST /up HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\nExpect: 100-continue\r\n"
                  b"Content-Length: 5\r\n\r\n")
        assert s.recv(65536).startswith(b"HTTP/1.1 100 ")
        s.sendall(b"hello")
        out = s.recv(65536)
        assert out.startswith(b"HTTP/1.1 200 ") and b'"n_body_bytes":5' in out
    with socket.create_connection((st.host, st.port), timeout=10) as s:
        s.sendall(b"POST /up HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n")
        out = read_all(s)   # 401 without 100 Continue, then the server closes: the body is never read
    assert out.startswith(b"HTTP/1.1 401 ") and b"100 Continue" not in out and b"Invalid API Key" in out
    assert app.n_dispatched == 1
    # no body: the refused connection stays usable
    c = http.client.HTTPConnection(st.host, st.port, timeout=10)
    assert get(st, "GET", "/m", conn=c)[0].status == 401
    assert get(st, "GET", "/m", conn=c, headers={"Authorization": "Bearer k"})[0].status == 200


@pytest.mark.parametrize("data", [
    b"GARBAGE\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: nope\r\n\r\n",
    b"GET / HTTP/1.1\r\nBad Header\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
])
def test_malformed_http_is_400_then_close(serve, data):
    st, app = serve()
    out = raw(st, data, shut=False)
    assert out.startswith(b"HTTP/1.1 400 ") and b"connection: close" in out.lower()
    assert json.loads(out.split(b"\r\n\r\n", 1)[1])["error"]["code"] == 400
    assert app.n_dispatched == 0


def test_connection_bound_closes_the_longest_idle_connection_to_make_room(serve):
    st, _ = serve(max_connections=2)
    a = http.client.HTTPConnection(st.host, st.port, timeout=10)
    b = http.client.HTTPConnection(st.host, st.port, timeout=10)
    assert get(st, "GET", "/1", conn=a)[0].status == 200
    time.sleep(0.05)
    assert get(st, "GET", "/2", conn=b)[0].status == 200
    out = raw(st, b"GET /3 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", shut=False)
    assert out.startswith(b"HTTP/1.1 200 ")
    assert a.sock.recv(1) == b""        # a, idle longest, was closed; b still serves
    assert get(st, "GET", "/4", conn=b)[0].status == 200


def test_busy_connections_past_the_bound_get_503_but_health_is_answered(serve):
    st, _ = serve(max_connections=2, header_timeout_s=30)
    busy = [socket.create_connection((st.host, st.port), timeout=10) for _ in range(2)]
    for s in busy:                      # a head begun, not finished: not idle, not reclaimed
        s.sendall(b"GET /slow HTTP/1.1\r\n")
    time.sleep(0.2)
    out = raw(st, b"GET /3 HTTP/1.1\r\nHost: x\r\n\r\n", shut=False)
    assert out.startswith(b"HTTP/1.1 503 ") and b"max_connections=2" in out
    for path in (b"/health", b"/metrics"):
        out = raw(st, b"GET " + path + b" HTTP/1.1\r\nHost: x\r\n\r\n", shut=False)
        assert out.startswith(b"HTTP/1.1 200 "), out[:200]
    for s in busy:
        s.close()


def test_per_client_bound(serve):
    st, _ = serve(max_per_client=2)
    busy = [socket.create_connection((st.host, st.port), timeout=10) for _ in range(2)]
    for s in busy:
        s.sendall(b"GET /slow HTTP/1.1\r\n")
    time.sleep(0.2)
    out = raw(st, b"GET /3 HTTP/1.1\r\nHost: x\r\n\r\n", shut=False)
    assert out.startswith(b"HTTP/1.1 503 ") and b"max_per_client=2" in out
    for s in busy:
        s.close()


def test_query_path_and_repeated_headers(serve):
    st, _ = serve()
    out = raw(st, b"GET /v1/models/a%2Fb%20c?x=1&x=2&empty=&q=%C3%A9 HTTP/1.1\r\nHost: x\r\n"
                  b"X-Multi: a\r\nX-Multi: b\r\nConnection: close\r\n\r\n", shut=False)
    got = json.loads(out.split(b"\r\n\r\n", 1)[1])
    assert got["path"] == "/v1/models/a/b c"
    assert got["query"] == {"x": "2", "empty": "", "q": "é"}
    assert got["headers"]["x-multi"] == "a, b"
    assert got["peer"].startswith("127.0.0.1:") and int(got["peer"].split(":")[1]) > 0
    out = raw(st, b"GET /bad%FF HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", shut=False)
    assert out.startswith(b"HTTP/1.1 400 ") and b"not valid UTF-8" in out


def test_gzip_and_deflate_bodies_are_decoded(serve):
    import zlib
    st, _ = serve(max_body_bytes=10_000)
    payload = b'{"prompt": "' + b"a" * 5000 + b'"}'
    for coding, data in (("gzip", gzip.compress(payload)), ("deflate", zlib.compress(payload))):
        r, body = get(st, "POST", "/z", body=data, headers={"Content-Encoding": coding})
        got = json.loads(body)
        assert r.status == 200 and got["n_body_bytes"] == len(payload) and "content-encoding" not in got["headers"]
    r, body = get(st, "POST", "/z", body=gzip.compress(b"a" * 10_001), headers={"Content-Encoding": "gzip"})
    assert r.status == 413 and "decodes" in json.loads(body)["error"]["message"]
    r, body = get(st, "POST", "/z", body=b"not gzip", headers={"Content-Encoding": "gzip"})
    assert r.status == 400 and "gzip" in json.loads(body)["error"]["message"]
    r, body = get(st, "POST", "/z", body=b"x", headers={"Content-Encoding": "br"})
    assert r.status == 415 and "gzip, deflate" in json.loads(body)["error"]["message"]


def test_close_lets_an_inflight_stream_finish(serve):
    st, app = serve()
    proc = subprocess.Popen(["curl", "-sN", f"http://{st.host}:{st.port}/sse?n=4&gap_s=0.2"], stdout=subprocess.PIPE)
    idle = socket.create_connection((st.host, st.port), timeout=10)
    time.sleep(0.3)   # the stream is under way, the idle connection parked
    t0 = time.monotonic()
    st.stop()
    out, _ = proc.communicate(10)
    assert out.count(b"data:") == 4 and proc.returncode == 0
    assert read_all(idle) == b""   # the idle keep-alive connection was closed by the drain
    assert time.monotonic() - t0 < 5
    with pytest.raises(OSError):
        socket.create_connection((st.host, st.port), timeout=2).recv(1)


def test_accepted_sockets_have_tcp_nodelay(serve):
    st, _ = serve()
    c = http.client.HTTPConnection(st.host, st.port, timeout=10)
    get(st, "GET", "/a", conn=c)

    def flags():
        return [conn.writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
                for conn in st.server._conns]
    assert st.call(flags) == [1]


def test_stream_failures_before_and_after_the_first_chunk(serve):
    st, app = serve()
    r, body = get(st, "GET", "/sse-breaks?after=0")   # before the head: still a whole 500
    assert r.status == 500 and json.loads(body)["error"]["message"] == "the generation died"
    c = http.client.HTTPConnection(st.host, st.port, timeout=10)
    c.request("GET", "/sse-breaks?after=2")
    r = c.getresponse()
    assert r.status == 200
    with pytest.raises(http.client.IncompleteRead) as e:   # no last chunk: the client knows it broke
        r.read()
    assert e.value.partial == b"data: 0\n\ndata: 1\n\n"
    assert [kv["started"] for ev, kv in app.records if ev == "http stream error"] == [False, True]
    assert get(st, "GET", "/after")[0].status == 200


def test_handler_header_with_crlf_is_500_not_injected(serve):
    st, _ = serve()
    r, body = get(st, "GET", "/bad-header")
    assert r.status == 500 and r.getheader("set-cookie") is None and b"invalid" in body


def test_stalled_body_is_408_after_body_timeout(serve):
    st, app = serve(body_timeout_s=0.4)
    with socket.create_connection((st.host, st.port), timeout=10) as s:
        s.sendall(b"POST /up HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc")
        t0 = time.monotonic()
        out = read_all(s)
    assert out.startswith(b"HTTP/1.1 408 ") and b"after 3 bytes" in out and 0.3 < time.monotonic() - t0 < 3
    assert app.n_dispatched == 0


def test_expect_100_with_too_large_body_gets_413_not_100(serve):
    st, _ = serve(max_body_bytes=100)
    with socket.create_connection((st.host, st.port), timeout=10) as s:
        s.sendall(b"POST /up HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 101\r\n\r\n")
        out = read_all(s)
    assert out.startswith(b"HTTP/1.1 413 ") and b" 100 " not in out.split(b"\r\n")[0]


def test_http_1_0_stream_is_unframed_and_closed(serve):
    st, _ = serve()
    out = raw(st, b"GET /sse?n=2&gap_s=0 HTTP/1.0\r\n\r\n", shut=False)
    head, _, body = out.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and b"transfer-encoding" not in head.lower()
    assert body == b"data: 0\n\ndata: 1\n\n"


def test_many_idle_keep_alive_connections_do_not_block_service(serve):
    st, _ = serve(max_connections=1024, max_per_client=1024)
    idle = []
    try:
        for _ in range(300):
            s = socket.create_connection((st.host, st.port), timeout=10)
            s.sendall(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n")
            idle.append(s)
        for s in idle:
            assert s.recv(65536).startswith(b"HTTP/1.1 200 ")
        assert st.call(lambda: st.server.n_open) == 300
        t0 = time.monotonic()
        assert get(st, "GET", "/b")[0].status == 200
        assert time.monotonic() - t0 < 1.0
    finally:
        for s in idle:
            s.close()


def test_a_client_that_stops_reading_is_cut_at_write_timeout(serve):
    st, app = serve(write_timeout_s=0.5)
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect((st.host, st.port))
    try:
        s.sendall(b"GET /sse-forever?gap_s=0&n_pad_bytes=65536 HTTP/1.1\r\nHost: x\r\n\r\n")
        # never read: the server's buffers fill, drain() blocks, write_timeout_s ends it
        assert app.stream_closed.wait(10), "a stuck writer kept the stream open"
        # the record is written as the connection ends, which can come just after the stream closes
        deadline = time.monotonic() + 5
        while not any(ev == "http write timeout" for ev, _ in list(app.records)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert any(ev == "http write timeout" for ev, _ in app.records), app.records
    finally:
        s.close()


def test_client_disconnect_cancels_a_non_stream_dispatch(serve):
    st, app = serve()
    s = socket.create_connection((st.host, st.port), timeout=10)
    s.sendall(b"POST /hang HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
    time.sleep(0.2)
    s.close()
    assert app.stream_closed.wait(2), "the handler kept running after its client left"
    assert get(st, "GET", "/after")[0].status == 200
