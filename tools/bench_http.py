"""A server process for the HTTP benchmarks (tools/bench_grammar.py, tools/bench_offload.py):
bloomery-serve or llama-server on a free port, /health awaited, /completion asked plain or
streamed (the stream timed as it arrives), stopped with its process group."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Streamed:
    """One streamed /completion: client clock times (perf_counter seconds) of the request, the
    first and the last piece that carried ids, the ids in arrival order, and the final chunk
    (which holds the server's own `timings`)."""
    t_sent: float
    t_first: float | None = None
    t_last: float | None = None
    ids: list[int] = field(default_factory=list)
    n_pieces: int = 0
    final: dict = field(default_factory=dict)

    @property
    def prompt_s(self) -> float | None:
        """Request to first piece: the prompt and the first id, and the HTTP round trip."""
        return None if self.t_first is None else self.t_first - self.t_sent

    @property
    def decode_tok_s(self) -> float | None:
        """Ids after the first over the time from the first piece to the last."""
        if self.t_first is None or self.t_last is None or self.t_last <= self.t_first or len(self.ids) < 2:
            return None
        return (len(self.ids) - 1) / (self.t_last - self.t_first)


class Server:
    """One server process on a free port; waits for /health, stopped on exit."""

    def __init__(self, argv: list[str], port: int, log: Path, ready_timeout_s: float, env: dict | None = None):
        self.argv, self.url = argv, f"http://127.0.0.1:{port}"
        self.log_path, self.log = log, open(log, "wb")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
                                     env=None if env is None else {**os.environ, **env})
        deadline = time.monotonic() + ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.close()
                raise SystemExit(f"{argv[0]} exited with {self.proc.returncode} before it was ready; "
                                 f"see {log}: {self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        self.stop()
        raise SystemExit(f"{argv[0]} not ready after {ready_timeout_s:.0f} s; see {log}: {self.log_tail()}")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    def log_tail(self, n: int = 600) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode("utf-8", "replace")
        except OSError:
            return ""

    def _request(self, path: str, body: dict | None):
        data = None if body is None else json.dumps(body).encode()
        return urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})

    def completion(self, body: dict) -> dict:
        try:
            with urllib.request.urlopen(self._request("/completion", body), timeout=3600) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise SystemExit(f"{self.url}/completion answered {e.code}: {e.read()[:400]!r}") from None

    def stream(self, body: dict) -> Streamed:
        """POST /completion with stream on; each server-sent `data:` chunk read as it arrives."""
        out = Streamed(t_sent=time.perf_counter())
        try:
            with urllib.request.urlopen(self._request("/completion", {**body, "stream": True}), timeout=3600) as r:
                for raw in r:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    chunk = json.loads(line[5:])
                    now = time.perf_counter()
                    if "error" in chunk:
                        raise SystemExit(f"{self.url}/completion streamed an error: {chunk['error']}")
                    ids = chunk.get("tokens") or []
                    if ids or chunk.get("content"):
                        out.ids += [int(i) for i in ids]
                        out.n_pieces += 1
                        out.t_first = now if out.t_first is None else out.t_first
                        out.t_last = now
                    if chunk.get("stop"):
                        out.final = chunk
        except urllib.error.HTTPError as e:
            raise SystemExit(f"{self.url}/completion answered {e.code}: {e.read()[:400]!r}") from None
        return out

    def get_json(self, path: str) -> tuple[int, object]:
        """GET path: (status, parsed body or the raw text); status 0 where nothing answered."""
        try:
            with urllib.request.urlopen(self._request(path, None), timeout=60) as r:
                text = r.read()
                status = r.status
        except urllib.error.HTTPError as e:
            return e.code, e.read()[:400].decode("utf-8", "replace")
        except (urllib.error.URLError, OSError) as e:
            return 0, str(e)
        try:
            return status, json.loads(text)
        except ValueError:
            return status, text[:400].decode("utf-8", "replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if not self.log.closed:
            self.log.close()
