"""The writing half of a connection: response heads through h11, Content-Length or chunked bodies.

A StreamResponse's head waits for its first chunk, so an error the handler
raises before it is still a whole answer (ApiError -> its object, anything else
-> 500); after it, the connection is cut without the last chunk, so the client
sees a broken stream rather than a clean end.
"""
from __future__ import annotations

import asyncio
import traceback

import h11

from .types import ApiError, Response, StreamResponse, canonical
from .wire import error_response, raw_response, reason_phrase


class PeerGone(Exception):
    """The client closed or reset the connection."""


def where(e: BaseException) -> str:
    """"file:line in function" of the innermost frame, for a one-line record."""
    frames = traceback.extract_tb(e.__traceback__)
    if not frames:
        return ""
    f = frames[-1]
    return f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} in {f.name}"


class ResponseWriter:
    """Mixed into Connection: needs self.h11, self.writer, self.server, self.peer."""

    def _h11_head(self, status: int, headers: list[tuple[str, str]], close: bool,
                  n_body_bytes: int | None = None) -> h11.Response:
        """Validated response head; framing is ours (Content-Length, or h11's chunked when None)."""
        hop = ("content-length", "transfer-encoding", "connection")
        kept = [(canonical(k), v) for k, v in headers if k.lower() not in hop]
        if not any(k.lower() == "server" for k, _ in kept):
            kept.insert(0, ("Server", self.server.server_header))
        if n_body_bytes is not None:
            kept.append(("Content-Length", str(n_body_bytes)))
        if close:
            kept.append(("Connection", "close"))
        return h11.Response(status_code=status, reason=reason_phrase(status), headers=kept)

    async def _send_response(self, response: Response, head: bool, close: bool) -> None:
        try:
            start = self._h11_head(response.status, response.headers, close, len(response.body))
        except h11.LocalProtocolError as e:   # a header a handler built with CR/LF or a bad name
            response = error_response(500, f"The handler's response headers are invalid: {e}", "server_error")
            start = self._h11_head(500, response.headers, close, len(response.body))
        data = self.h11.send(start)
        if not head and response.body:
            data += self.h11.send(h11.Data(data=response.body))
        data += self.h11.send(h11.EndOfMessage())
        await self._write(data)

    async def _send_stream(self, response: StreamResponse, head: bool) -> None:
        chunks = response.chunks
        closing = self.server.closing
        try:
            try:
                first = b"" if head else await anext(chunks, b"")
            except ApiError as e:
                await self._send_response(Response.json(e.body(), e.status), head, close=closing)
                return
            except Exception as e:
                self._stream_failed(e, started=False)
                await self._send_response(error_response(500, str(e) or type(e).__name__, "server_error"),
                                          head, close=closing)
                return
            try:
                start = self._h11_head(response.status, response.headers, closing)
            except h11.LocalProtocolError as e:
                await self._send_response(error_response(500, f"The handler's stream headers are invalid: {e}",
                                                         "server_error"), head, close=closing)
                return
            await self._write(self.h11.send(start))
            if head:
                await self._write(self.h11.send(h11.EndOfMessage()))
                return
            chunk = first
            while True:
                if chunk:
                    # written and drained one by one: SSE reaches the client token by token
                    await self._write(self.h11.send(h11.Data(data=chunk)))
                try:
                    chunk = await anext(chunks)
                except StopAsyncIteration:
                    break
                except Exception as e:
                    self._stream_failed(e, started=True)
                    raise PeerGone() from None   # cut: no last chunk, the client sees the stream broke
            await self._write(self.h11.send(h11.EndOfMessage()))
        finally:
            aclose = getattr(chunks, "aclose", None)
            if aclose is not None:
                await aclose()

    def _stream_failed(self, e: Exception, started: bool) -> None:
        level = "warning" if isinstance(e, ApiError) else "error"
        self.server.log("http stream error", level=level, peer=self.peer, started=started, error=repr(e),
                        where=where(e))

    async def _write(self, data: bytes) -> None:
        if self.writer.transport.is_closing():
            raise PeerGone()
        self.writer.write(data)
        async with asyncio.timeout(self.server.write_timeout_s):
            await self.writer.drain()

    async def _write_raw(self, response: Response) -> None:
        try:
            await self._write(raw_response(response, server_header=self.server.server_header))
        except (PeerGone, ConnectionError, TimeoutError):
            pass

