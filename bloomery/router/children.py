"""The child processes: one bloomery-serve per loaded model, on a free local port.

A child is `python -m bloomery.supervisor` with the router's own flags (the router-only ones taken out:
settings.argv_without), its preset's options that those do not set, then the model, --host 127.0.0.1, --port
and --alias with the model's name, as llama-server's router writes its children's command lines (server-
models.cpp). It inherits the router's environment, so LLAMA_ARG_* reach it as they reach the router; its
records go to the router's stderr. Ready is its /health answering 200; a child that exits first failed to
load.
"""
from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import socket
import sys

from bloomery.router import proxy

STOP_S = 10.0           # llama-server's stop-timeout: after the asked stop, how long before the kill
HEALTH_POLL_S = 0.1
PR_SET_PDEATHSIG = 1


def _term_with_parent() -> None:
    """In the child before exec: PR_SET_PDEATHSIG, SIGTERM (Linux; elsewhere nothing)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def free_port(host: str = proxy.CHILD_HOST) -> int:
    """A port free now (the child binds it a moment later, as llama-server's common_http_get_free_port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def child_argv(args: list[str], name: str, port: int) -> list[str]:
    return [sys.executable, "-m", "bloomery.supervisor", *args,
            "--host", proxy.CHILD_HOST, "--port", str(port), "--alias", name]


class Child:
    def __init__(self, argv: list[str], port: int, env: dict[str, str], stop_s: float = STOP_S):
        self.argv = argv
        self.port = port
        self.env = env
        self.stop_s = stop_s        # a preset's stop-timeout, else llama-server's 10 s
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        # its own process group (a terminal's Ctrl-C reaches the router, which stops each child in order), and
        # SIGTERM when the router dies without stopping it (Linux's parent-death signal), so none outlives it
        self.proc = await asyncio.create_subprocess_exec(*self.argv, env=self.env, stdin=asyncio.subprocess.DEVNULL,
                                                         start_new_session=True, preexec_fn=_term_with_parent)

    async def ready(self) -> dict:
        """Wait until the child's /health says ok; its /v1/models entry (the listing merges it). RuntimeError
        naming the exit status when the child ends first."""
        while True:
            if self.proc.returncode is not None:
                raise RuntimeError(f"the model's server exited with status {self.proc.returncode} before it was ready")
            try:
                status, _ = await proxy.get_json(self.port, "/health")
            except Exception:
                status = 0
            if status == 200:
                break
            try:
                await asyncio.wait_for(self.proc.wait(), HEALTH_POLL_S)
            except asyncio.TimeoutError:
                pass
        try:
            _, models = await proxy.get_json(self.port, "/v1/models")
            return dict((models or {}).get("data", [{}])[0])
        except Exception:
            return {}

    async def wait(self) -> int:
        return await self.proc.wait()

    async def stop(self) -> int:
        """SIGTERM (the child drains, as under systemd), then SIGKILL after stop_s."""
        if self.proc is None:
            return 0
        if self.proc.returncode is None:
            try:
                self.proc.send_signal(signal.SIGTERM)
                await asyncio.wait_for(self.proc.wait(), self.stop_s)
            except asyncio.TimeoutError:
                self.kill()
            except ProcessLookupError:
                pass
        return await self.proc.wait()

    def kill(self) -> None:
        """SIGKILL to the child's whole group: its stage processes cannot outlive a supervisor that had no time
        to end them."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
