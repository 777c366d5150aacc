"""One client connection: h11's state machine fed from an asyncio stream, one request at a time.

Pipelined requests wait in h11's buffer and are answered in order. While a
request is being answered a watcher reads the socket: end of file means the
client left, and the connection's task is cancelled so a handler's stream is
closed (its finally-block cancels the generation) at once, not at the next write.
"""
from __future__ import annotations

import asyncio
import inspect
import socket
import time
from typing import Awaitable, Protocol

import h11

from .respond import PeerGone, ResponseWriter, where
from .types import ApiError, Request, Response, StreamResponse
from .wire import ACCEPTED_ENCODINGS, build_request, client_of, declared_length, decode_body, error_response, peer_text

READ_BYTES = 64 << 10
LINGER_S = 5.0          # after an early answer, how long the unread rest of a request is discarded


class Host(Protocol):
    """What a connection uses of the server that accepted it (server.py's HttpServer), so this
    file does not import server.py back."""
    closing: bool
    listen_host: str
    max_header_bytes: int
    max_body_bytes: int
    header_timeout_s: float
    body_timeout_s: float
    idle_timeout_s: float
    write_timeout_s: float

    def log(self, event: str, **kv) -> None: ...
    def precheck(self, req: Request) -> Response | None: ...
    def dispatch(self, req: Request) -> Awaitable[Response | StreamResponse]: ...


class Reject(Exception):
    """Answer this response, then close without reading the rest of the request."""

    def __init__(self, response: Response):
        super().__init__(response.status)
        self.response = response


class Connection(ResponseWriter):
    def __init__(self, server: Host, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.server = server
        self.reader, self.writer = reader, writer
        self.peer = peer_text(writer.get_extra_info("peername"))
        self.client = client_of(writer)   # the address without the port (the per-client bound counts it)
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=server.max_header_bytes)
        self.idle = False            # waiting for a request with nothing buffered: close() may end it
        self.idle_since = 0.0        # when it last became idle (the server reclaims the longest idle first)
        self.peer_gone = False
        self.task: asyncio.Task | None = None
        sock = writer.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            # SSE: each token leaves at once, not after Nagle's wait for an ACK
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    # ---- the loop ----

    async def run(self) -> None:
        self.task = asyncio.current_task()
        linger = False
        try:
            while not self.server.closing:
                event = await self._next_request()
                if event is None:
                    break
                if not await self._answer(event):
                    linger = True
                    break
                if self.h11.our_state is not h11.DONE or self.h11.their_state is not h11.DONE:
                    break
                self.h11.start_next_cycle()
        except asyncio.CancelledError:
            if not self.peer_gone:
                raise
            self.task.uncancel()
        except (PeerGone, ConnectionError):
            pass
        except TimeoutError:   # only a write may time out here (reads return None): a client that stopped reading
            self.server.log("http write timeout", peer=self.peer, timeout_s=self.server.write_timeout_s)
        finally:
            await self._close(linger and not self.peer_gone)

    async def _read(self, timeout_s: float) -> bytes | None:
        """Some bytes, b"" at end of file, None when timeout_s passes first."""
        try:
            async with asyncio.timeout(max(timeout_s, 0.0)):
                return await self.reader.read(READ_BYTES)
        except TimeoutError:
            return None
        except ConnectionError:
            return b""

    async def _next_request(self) -> h11.Request | None:
        """The next request's head, or None when the connection should just close."""
        srv = self.server
        now = time.monotonic()
        idle_deadline = now + srv.idle_timeout_s
        # the header clock starts at a request's first byte (maybe already buffered by pipelining)
        header_deadline = now + srv.header_timeout_s if self.h11.trailing_data[0] else None
        while True:
            n_buffered = len(self.h11.trailing_data[0])
            try:
                event = self.h11.next_event()
                # h11 bounds only an incomplete head; one that arrived whole in one read is measured here
                if isinstance(event, h11.Request) and \
                        n_buffered - len(self.h11.trailing_data[0]) > srv.max_header_bytes:
                    raise h11.RemoteProtocolError("head too long", error_status_hint=431)
            except h11.RemoteProtocolError as e:
                status = e.error_status_hint
                message = (f"Request header section is larger than the limit of {srv.max_header_bytes} bytes"
                           if status == 431 else f"Malformed HTTP request: {e}")
                srv.log("http bad request", peer=self.peer, status=status, error=str(e))
                # 501: a transfer coding other than chunked (RFC 9112 6.1), llama-server's type for it
                type_ = "not_supported_error" if status == 501 else "invalid_request_error"
                await self._send_response(error_response(status, message, type_), head=False, close=True)
                return None
            if isinstance(event, h11.Request):
                return event
            if event is not h11.NEED_DATA:   # ConnectionClosed
                return None
            deadline = header_deadline or idle_deadline
            self.idle = header_deadline is None
            self.idle_since = time.monotonic()
            if self.idle and srv.closing:
                return None
            data = await self._read(deadline - time.monotonic())
            self.idle = False
            if data is None:
                if header_deadline is not None:
                    srv.log("http header timeout", peer=self.peer, timeout_s=srv.header_timeout_s)
                    await self._write_raw(error_response(
                        408, f"Request headers did not arrive within header_timeout_s={srv.header_timeout_s}"))
                return None
            if data and header_deadline is None:
                header_deadline = time.monotonic() + srv.header_timeout_s
            self.h11.receive_data(data)

    # ---- one request ----

    async def _answer(self, event: h11.Request) -> bool:
        """Answer one request. False when its body was left unread (the caller lingers, then closes)."""
        srv = self.server
        head = event.method == b"HEAD"
        try:
            request = build_request(event, self.peer)
            request.listen = getattr(self, "listen_host", "") or srv.listen_host
            if head:
                request.method = "GET"   # answered like GET, the body left out
            n_declared = declared_length(event)
            if n_declared is not None and n_declared > srv.max_body_bytes:
                raise Reject(_too_large(srv.max_body_bytes, f"Content-Length {n_declared} is"))
            if srv.precheck is not None:
                early = await self._precheck(request)
                if early is not None:
                    raise Reject(early)
            if self.h11.they_are_waiting_for_100_continue:
                await self._write(self.h11.send(h11.InformationalResponse(status_code=100, headers=[])))
            request.body = await self._read_body()
            decode_body(request, srv.max_body_bytes)
        except ApiError as e:
            # 415 names the codings it takes in Accept-Encoding (RFC 7694)
            extra = [("accept-encoding", ACCEPTED_ENCODINGS)] if e.status == 415 else []
            return await self._answer_early(Response.json(e.body(), e.status, extra), head)
        except Reject as r:
            return await self._answer_early(r.response, head)

        watcher = asyncio.create_task(self._watch_peer())
        try:
            response = await self._dispatch(request)
            if isinstance(response, StreamResponse):
                await self._send_stream(response, head)
            else:
                await self._send_response(response, head, close=srv.closing)
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
        return True

    async def _precheck(self, request: Request) -> Response | None:
        """The auth hook, run on the head alone so a refusal never waits for (or reads) the body."""
        try:
            early = self.server.precheck(request)
            if inspect.isawaitable(early):
                early = await early
        except ApiError:
            raise
        except Exception as e:
            self.server.log("http precheck error", level="error", peer=self.peer, error=repr(e), where=where(e))
            return error_response(500, str(e) or type(e).__name__, "server_error")
        return early

    async def _answer_early(self, response: Response, head: bool) -> bool:
        """Answer before (all of) the body was read; keep the connection only if nothing is left unread."""
        unread = not self._body_fully_buffered()
        await self._send_response(response, head, close=unread or self.server.closing)
        return not unread

    def _body_fully_buffered(self) -> bool:
        """Pull body events already in h11's buffer; True when the request ended without reading more."""
        try:
            while self.h11.their_state is h11.SEND_BODY:
                event = self.h11.next_event()
                if event is h11.NEED_DATA or event is h11.PAUSED:
                    return False
                if isinstance(event, h11.Data) and len(event.data) > 0:
                    return False   # a body was sent: the handler never saw it, close rather than guess
        except h11.RemoteProtocolError:
            return False
        return self.h11.their_state is h11.DONE

    async def _read_body(self) -> bytes:
        srv = self.server
        parts: list[bytes] = []
        n_bytes = 0
        while True:
            try:
                event = self.h11.next_event()
            except h11.RemoteProtocolError as e:
                raise Reject(error_response(400, f"Malformed HTTP request body: {e}")) from None
            if isinstance(event, h11.Data):
                n_bytes += len(event.data)
                if n_bytes > srv.max_body_bytes:
                    raise Reject(_too_large(srv.max_body_bytes, "the chunked body is"))
                parts.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                return b"".join(parts)
            elif event is h11.NEED_DATA:
                data = await self._read(srv.body_timeout_s)
                if data is None:
                    raise Reject(error_response(
                        408, f"Request body stalled: no bytes for body_timeout_s={srv.body_timeout_s} "
                             f"after {n_bytes} bytes"))
                self.h11.receive_data(data)
            else:   # ConnectionClosed
                raise PeerGone()

    async def _dispatch(self, request: Request) -> Response | StreamResponse:
        try:
            response = await self.server.dispatch(request)
        except ApiError as e:
            return Response.json(e.body(), e.status)
        except Exception as e:  # a handler bug: answer 500 and keep serving
            self.server.log("http handler error", level="error", peer=self.peer, method=request.method,
                            path=request.path, error=repr(e), where=where(e))
            return error_response(500, str(e) or type(e).__name__, "server_error")
        if not isinstance(response, (Response, StreamResponse)) or not 200 <= response.status <= 599:
            self.server.log("http handler error", level="error", path=request.path, error=f"bad answer {response!r}")
            return error_response(500, f"The handler of {request.method} {request.path} returned "
                                       f"{type(response).__name__}, not a Response", "server_error")
        return response

    async def _watch_peer(self) -> None:
        """Read while a request is answered: end of file cancels the answer; pipelined bytes wait in h11."""
        try:
            while len(self.h11.trailing_data[0]) <= self.server.max_header_bytes:
                data = await self.reader.read(READ_BYTES)
                if not data:
                    break
                self.h11.receive_data(data)
            else:
                return   # a full pipeline: stop reading (backpressure); a write error will tell
        except ConnectionError:
            pass
        self.peer_gone = True
        if self.task is not None:
            self.task.cancel()

    async def _close(self, linger: bool) -> None:
        """Close; after an early answer, first discard what the client still sends (bounded) so that
        closing with unread bytes does not reset the connection before the answer is read."""
        writer = self.writer
        try:
            if linger and not writer.transport.is_closing():
                async with asyncio.timeout(LINGER_S):
                    await writer.drain()
                    if writer.can_write_eof():
                        writer.write_eof()
                    while await self.reader.read(READ_BYTES):
                        pass
        except (TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()


def _too_large(max_body_bytes: int, what: str) -> Response:
    return error_response(413, f"Request body is too large: {what} more than the limit of {max_body_bytes} "
                               f"bytes")
