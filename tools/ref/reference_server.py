"""Start llama.cpp's llama-server (the reference) on a model and talk to it.

Used by the golden-file scripts and by the opt-in live comparison tests.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def reference_bin() -> Path:
    """The folder of the CPU reference build, building it first if needed."""
    out = subprocess.run(["bash", str(REPO / "tools/ref/build-llama.sh")], check=True,
                         capture_output=True, text=True).stdout.strip().splitlines()
    return Path(out[-1])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url: str, body: object | None = None, timeout_s: float = 600) -> tuple[int, object]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


class ReferenceServer:
    """llama-server on `model` at a free port; a context manager. `binary`: a llama-server already
    built (default: the reference build, built first if needed)."""

    def __init__(self, model: str | Path, *extra: str, ctx_size: int = 4096, binary: str | Path | None = None):
        self.model = str(model)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [str(binary or reference_bin() / "llama-server"), "-m", self.model, "--host", "127.0.0.1",
                     "--port", str(self.port), "-c", str(ctx_size), "-np", "1", "--jinja", *extra]
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "ReferenceServer":
        self.log = open(os.environ.get("BLOOMERY_REF_LOG", os.devnull), "wb")
        self.proc = subprocess.Popen(self.args, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}: {' '.join(self.args)}")
            try:
                status, _ = http_json(self.url + "/health", timeout_s=2)
                if status == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError("llama-server did not become healthy in 300 s")

    def post(self, path: str, body: object) -> tuple[int, object]:
        return http_json(self.url + path, body)

    def __exit__(self, *exc) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()
