"""HttpServer: our HTTP/1.1 server on h11 and asyncio (the supervisor runs it on uvloop's loop).

    server = HttpServer(app.dispatch, precheck=app.precheck, log=log)
    serving = asyncio.create_task(server.serve(sock))   # returns once close() is called
    ...
    server.close(); await server.wait_closed()           # in-flight answers finish, up to drain_timeout_s

One task per connection (connection.py); an idle keep-alive connection is a
task parked on a read. Past max_connections a new connection closes the
connection idle longest (so idle connections never lock anyone out); when none
is idle, or past max_per_client connections from one address, the new one gets
503, except a GET of a RESERVED_PATHS route (/health, /metrics), which is still
answered, on up to n_reserved connections at once.
The log hook is called as log(event, level=..., **kv) (level: "error" for handler
bugs, "warning", else left out = info), e.g. functools.partial(record, phase).

What handlers see: HEAD arrives as GET (the transport drops the body); a body
sent with Content-Encoding gzip/deflate arrives decoded (that header removed);
precheck(request-without-body) runs before 100 Continue and before any body
byte is read, and a Response from it is the answer. A client that closes its
sending side while a request is answered counts as gone (as llama-server's
connection check does): the dispatch or stream is cancelled.
"""
from __future__ import annotations

import asyncio
import socket
from typing import Awaitable, Callable

from .connection import LINGER_S, Connection
from .types import Request, Response, StreamResponse
from .wire import client_of, error_response, peer_text, raw_response

RESERVED_PATHS = ("/health", "/v1/health", "/metrics")
Dispatch = Callable[[Request], Awaitable["Response | StreamResponse"]]
Precheck = Callable[[Request], "Response | None | Awaitable[Response | None]"]


class HttpServer:
    def __init__(self, dispatch: Dispatch, *, max_body_bytes: int = 64 << 20, max_header_bytes: int = 64 << 10,
                 header_timeout_s: float = 30, idle_timeout_s: float = 60, body_timeout_s: float = 60,
                 write_timeout_s: float = 60, max_connections: int = 1024, drain_timeout_s: float = 30,
                 max_per_client: int = 256, n_reserved: int = 64, precheck: Precheck | None = None, server_header: str = "llama.cpp",
                 log: Callable[..., None] | None = None):
        for name, value in (("max_body_bytes", max_body_bytes), ("max_header_bytes", max_header_bytes),
                            ("header_timeout_s", header_timeout_s), ("idle_timeout_s", idle_timeout_s),
                            ("body_timeout_s", body_timeout_s), ("write_timeout_s", write_timeout_s),
                            ("max_connections", max_connections), ("drain_timeout_s", drain_timeout_s),
                            ("max_per_client", max_per_client), ("n_reserved", n_reserved)):
            if not value > 0:
                raise ValueError(f"HttpServer {name}={value!r}: it must be above 0")
        self.dispatch = dispatch
        self.precheck = precheck
        self.max_body_bytes = max_body_bytes
        self.max_header_bytes = max_header_bytes
        self.header_timeout_s = header_timeout_s
        self.idle_timeout_s = idle_timeout_s
        # body_timeout_s bounds the silence between body reads, not the whole upload (64 MiB on a slow link)
        self.body_timeout_s = body_timeout_s
        self.write_timeout_s = write_timeout_s
        self.max_connections = max_connections
        self.max_per_client = max_per_client
        self.n_reserved = n_reserved
        self._n_reserved_open = 0
        self._per_client: dict[str, int] = {}
        self.drain_timeout_s = drain_timeout_s
        self.server_header = server_header
        self._log = log
        self.closing = False
        self._conns: set[Connection] = set()
        self._tasks: set[asyncio.Task] = set()
        self._server: asyncio.base_events.Server | None = None
        self._closed: asyncio.Event | None = None
        self.listen_host = ""           # the listening socket's address, given to each Request

    @property
    def n_open(self) -> int:
        """Open connections, the refused ones still closing included."""
        return len(self._tasks)

    def log(self, event: str, **kv) -> None:
        if self._log is not None:
            try:
                self._log(event, **kv)
            except Exception:   # a broken log sink must not take a connection down
                pass

    async def serve(self, sock: "socket.socket | list[socket.socket]") -> None:
        """Accept on already-bound sockets (listen() is called if it was not) until close(); each
        connection's Request.listen is the address of the socket it came in on."""
        if self._server is not None:
            raise RuntimeError("HttpServer.serve() was already called; one server serves one set of sockets")
        socks = sock if isinstance(sock, list) else [sock]
        self._closed = asyncio.Event()
        self._servers = []
        for one in socks:
            one.setblocking(False)
            host = str(one.getsockname()[0]) if one.family in (socket.AF_INET, socket.AF_INET6) else ""
            self.listen_host = self.listen_host or host
            accept = (lambda r, w, host=host: self._accept(r, w, host))
            self._servers.append(await asyncio.start_server(accept, sock=one, backlog=min(self.max_connections, 4096),
                                                            limit=1 << 16))
        self._server = self._servers[0]
        if self.closing:  # close() came while starting
            for one in self._servers:
                one.close()
        await self._closed.wait()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, listen: str = "") -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        client = client_of(writer)
        self._per_client[client] = self._per_client.get(client, 0) + 1
        try:
            over = self._over_bound(client)
            if over or self.closing:
                await self._refuse(reader, writer, over)
                return
            conn = Connection(self, reader, writer)
            conn.listen_host = listen or self.listen_host
            self._conns.add(conn)
            try:
                await conn.run()
            finally:
                self._conns.discard(conn)
        except asyncio.CancelledError:
            # the connection's own task, ended (close(), the drain bound): it ends here. Raising on would have
            # asyncio's start_server callback print the CancelledError as a traceback at every shutdown.
            writer.close()
        except Exception as e:   # a transport bug: this connection ends, the server keeps serving
            self.log("http connection error", level="error", error=repr(e), exc_info=e)
            writer.close()
        finally:
            self._tasks.discard(task)
            self._per_client[client] -= 1
            if not self._per_client[client]:
                del self._per_client[client]

    def _over_bound(self, client: str) -> str:
        """Which bound a new connection from `client` is over ("" when none), once the connection idle
        longest (of this client, when it is over its own bound) was closed to make room."""
        if self._per_client[client] > self.max_per_client:
            if self._reclaim_idle(client):
                return ""
            return f"max_per_client={self.max_per_client} (connections from one address)"
        if len(self._tasks) > self.max_connections + self._n_reserved_open:
            if self._reclaim_idle(None):
                return ""
            return f"max_connections={self.max_connections}"
        return ""

    def _reclaim_idle(self, client: str | None) -> bool:
        idle = [c for c in self._conns if c.idle and c.task is not None and not c.task.done()
                and (client is None or c.client == client)]
        if not idle:
            return False
        oldest = min(idle, key=lambda c: c.idle_since)
        oldest.idle = False
        oldest.writer.close()           # its read sees the end of the stream; the connection ends as usual
        self.log("http idle connection closed to make room", peer=oldest.peer, n_open=len(self._tasks))
        return True

    async def _refuse(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, over: str = "") -> None:
        if self.closing:
            response = error_response(503, "Server is shutting down", "unavailable_error")
        else:
            if self._n_reserved_open < self.n_reserved and await self._answer_reserved(reader, writer):
                return
            response = error_response(503, f"Too many open connections: the bound is {over}",
                                      "unavailable_error", [("retry-after", "1")])
            self.log("http connection refused", n_open=len(self._tasks) - 1, bound=over)
        try:
            async with asyncio.timeout(LINGER_S):
                writer.write(raw_response(response, server_header=self.server_header))
                await writer.drain()
                if writer.can_write_eof():
                    writer.write_eof()
                while await reader.read(1 << 16):   # discard the request so the close is not a reset
                    pass
        except (TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _answer_reserved(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Past the bounds, a GET of a RESERVED_PATHS route is still answered (then the connection closes);
        False when the request is another (its head is then refused with the 503)."""
        self._n_reserved_open += 1
        try:
            head = b""
            async with asyncio.timeout(LINGER_S):
                while b"\r\n\r\n" not in head and len(head) < 8192:
                    data = await reader.read(8192)
                    if not data:
                        break
                    head += data
            request = parse_reserved(head, peer_text(writer.get_extra_info("peername")), self.listen_host)
            if request is None:
                return False
            response = None
            if self.precheck is not None:
                response = self.precheck(request)
                if asyncio.iscoroutine(response):
                    response = await response
            if response is None:
                response = await self.dispatch(request)
            if not isinstance(response, Response):
                return False
            async with asyncio.timeout(LINGER_S):
                writer.write(raw_response(response, server_header=self.server_header))
                await writer.drain()
            writer.close()
            return True
        except (TimeoutError, ConnectionError):
            writer.close()
            return True
        finally:
            self._n_reserved_open -= 1

    def close(self) -> None:
        """Stop accepting; idle keep-alive connections close now, busy ones after their answer."""
        self.closing = True
        for one in getattr(self, "_servers", []):
            one.close()
        for conn in list(self._conns):
            if conn.idle and conn.task is not None:
                conn.task.cancel()
        if self._closed is not None:
            self._closed.set()

    async def wait_closed(self) -> None:
        """Wait for in-flight answers up to drain_timeout_s, then cancel what is left (streams are aclose()d)."""
        if not self.closing:
            raise RuntimeError("HttpServer.wait_closed() before close()")
        tasks = set(self._tasks)
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=self.drain_timeout_s)
            for task in pending:
                task.cancel()
            if pending:
                self.log("http drain timeout", n_cancelled=len(pending), drain_timeout_s=self.drain_timeout_s)
                await asyncio.wait(pending)
        for one in getattr(self, "_servers", []):
            await one.wait_closed()


def parse_reserved(head: bytes, peer: str, listen: str) -> Request | None:
    """A request head that is a GET of a RESERVED_PATHS route -> its Request (no body); else None."""
    lines = head.split(b"\r\n\r\n", 1)[0].split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or parts[0] not in (b"GET", b"HEAD"):
        return None
    path = parts[1].decode("latin-1").split("?", 1)[0]
    if path not in RESERVED_PATHS:
        return None
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if sep:
            headers[name.decode("latin-1").strip().lower()] = value.decode("latin-1").strip()
    return Request("GET", path, {}, headers, b"", peer=peer, listen=listen)
