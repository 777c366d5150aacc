"""Start the real bloomery-serve as a subprocess for black-box tests."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


class Served:
    """`bloomery-serve ARGS --port 0`; reads the bound port from its stderr records."""

    def __init__(self, *args: str, env: dict | None = None, ready_timeout_s: float = 600):
        self.args = [sys.executable, "-m", "bloomery.supervisor", "--port", "0", *args]
        self.env = {**os.environ, **(env or {})}
        self.ready_timeout_s = ready_timeout_s
        self.lines: list[str] = []
        self.port: int | None = None

    def _pump(self) -> None:
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            self.lines.append(line)
            if self.port is None:
                m = re.search(r"\bport=(\d+)", line)
                if m and "listen" in line:
                    self.port = int(m.group(1))

    def start(self, wait_ready: bool = True) -> "Served":
        self.proc = subprocess.Popen(self.args, cwd=REPO, env=self.env, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE)
        threading.Thread(target=self._pump, daemon=True).start()
        deadline = time.monotonic() + 60
        while self.port is None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("bloomery-serve printed no listen record:\n" + "\n".join(self.lines))
            time.sleep(0.05)
        if wait_ready:
            self.wait_ready()
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"bloomery-serve exited {self.proc.returncode}:\n" + "\n".join(self.lines))
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.05)       # a start is 3-5 s: polled finely, no test waits past its ready
        raise RuntimeError("bloomery-serve not ready:\n" + "\n".join(self.lines))

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> "Served":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
