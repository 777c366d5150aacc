"""Run an HttpServer on uvloop in a background thread (tests and tools talk to it with blocking clients).

    with ServerThread(dispatch, idle_timeout_s=2) as st:
        http.client.HTTPConnection("127.0.0.1", st.port)
"""
from __future__ import annotations

import asyncio
import socket
import threading

import uvloop

from .server import HttpServer


class ServerThread:
    def __init__(self, dispatch, host: str = "127.0.0.1", **server_kwargs):
        self.server = HttpServer(dispatch, **server_kwargs)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, 0))
        self.sock.listen(128)
        self.host, self.port = self.sock.getsockname()[:2]
        self.loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="http-server", daemon=True)
        self._started = threading.Event()
        self.error: BaseException | None = None

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._main())
        except BaseException as e:  # surfaced by stop()
            self.error = e
        finally:
            self.loop.close()

    async def _main(self) -> None:
        self._started.set()
        await self.server.serve(self.sock)
        await self.server.wait_closed()

    def call(self, fn, *args):
        """Run fn(*args) on the server's loop thread (e.g. read its state)."""
        return asyncio.run_coroutine_threadsafe(_call(fn, *args), self.loop).result(10)

    def start(self) -> "ServerThread":
        self._thread.start()
        self._started.wait(10)
        return self

    def stop(self, timeout_s: float = 30) -> None:
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.server.close)
            self._thread.join(timeout_s)
        self.sock.close()
        if self._thread.is_alive():
            raise RuntimeError(f"HttpServer did not stop within {timeout_s} s")
        if self.error is not None:
            raise self.error

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


async def _call(fn, *args):
    return fn(*args)
