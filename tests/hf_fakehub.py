"""A local stand-in for the Hugging Face hub's HTTP endpoints, for the --hf tests.

It answers what huggingface_hub and bloomery's downloader ask (HF_ENDPOINT points here):
  GET /api/models/<repo>[/revision/<rev>]   model info; ?blobs=true adds size, blobId, lfs
  GET /api/models/<repo>/tree/<rev>          the file list
  HEAD|GET /<repo>/resolve/<rev>/<path>      the bytes: ETag, X-Repo-Commit, X-Linked-Etag,
                                             X-Linked-Size, Accept-Ranges, Range -> 206
Errors as the hub spells them (X-Error-Code RepoNotFound / RevisionNotFound / GatedRepo).
Faults for the tests: `cut_once[path] = n` drops the connection after n bytes of that file
once; `corrupt.add(path)` serves bytes that differ from the advertised sha256;
`rate_bytes_s` throttles every body. Every request is logged in `requests`.
"""
from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


@dataclass
class Blob:
    data: bytes | Path
    sha256: str = ""
    lfs: bool = True              # False: a file stored in git itself (the hub lists its blob id, no sha256)

    def __post_init__(self):
        if not self.sha256:
            h = hashlib.sha256()
            if isinstance(self.data, Path):
                with open(self.data, "rb") as f:
                    while chunk := f.read(1 << 22):
                        h.update(chunk)
            else:
                h.update(self.data)
            self.sha256 = h.hexdigest()

    @property
    def size(self) -> int:
        return self.data.stat().st_size if isinstance(self.data, Path) else len(self.data)

    def git_blob_id(self) -> str:
        data = self.read(0, self.size)
        return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()

    def read(self, start: int, end: int) -> bytes:
        if isinstance(self.data, Path):
            with open(self.data, "rb") as f:
                f.seek(start)
                return f.read(end - start)
        return self.data[start:end]


@dataclass
class Repo:
    commits: dict[str, dict[str, Blob]]                 # commit sha -> path -> blob
    refs: dict[str, str] = field(default_factory=dict)  # branch / tag -> commit
    token: str = ""                                     # non-empty: gated, this bearer token reaches it

    def commit_of(self, rev: str) -> str | None:
        return rev if rev in self.commits else self.refs.get(rev)


def commit_sha(name: str) -> str:
    return hashlib.sha1(name.encode()).hexdigest()


class FakeHub:
    def __init__(self):
        self.repos: dict[str, Repo] = {}
        self.requests: list[dict] = []
        self.cut_once: dict[str, int] = {}
        self.corrupt: set[str] = set()
        self.rate_bytes_s = 0.0
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def add(self, repo: str, files: dict[str, bytes | Path], branch: str = "main", tags: tuple[str, ...] = (),
            token: str = "", blobs: dict[str, Blob] | None = None) -> str:
        """A commit of these files on `branch` (and tags); its sha."""
        r = self.repos.setdefault(repo, Repo({}, token=token))
        r.token = token or r.token
        commit = commit_sha(f"{repo}@{branch}#{len(r.commits)}")
        r.commits[commit] = {p: (blobs or {}).get(p) or Blob(d) for p, d in files.items()}
        for ref in (branch, *tags):
            r.refs[ref] = commit
        return commit

    def resolves(self) -> list[dict]:
        return [q for q in self.requests if "/resolve/" in q["path"] and q["method"] == "GET"]

    def __enter__(self) -> "FakeHub":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def _handler(hub: FakeHub):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def _error(self, code: int, error_code: str = "", message: str = "") -> None:
            body = json.dumps({"error": message or error_code}).encode()
            self.send_response(code)
            if error_code:
                self.send_header("X-Error-Code", error_code)
            if message:
                self.send_header("X-Error-Message", message)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _json(self, obj) -> None:
            body = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _repo(self, repo_id: str) -> Repo | None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                self._error(404, "RepoNotFound", "Repository not found")
            return repo

        def _authorized(self, repo: Repo) -> bool:
            if repo.token and self.headers.get("Authorization") != f"Bearer {repo.token}":
                self._error(401, "GatedRepo", "Access to this model is restricted")
                return False
            return True

        def do_HEAD(self) -> None:
            self.do_GET(head=True)

        def do_GET(self, head: bool = False) -> None:
            url = urlsplit(self.path)
            path = url.path
            hub.requests.append({"method": "HEAD" if head else "GET", "path": path, "query": url.query,
                                 "range": self.headers.get("Range"), "auth": self.headers.get("Authorization")})
            m = re.match(r"^/api/models/(.+?)(?:/(revision|tree)/([^/]+)(?:/.*)?)?$", path)
            if m:
                return self._api(unquote(m[1]), m[2], unquote(m[3] or "main"), url.query)
            m = re.match(r"^/(.+?)/resolve/([^/]+)/(.+)$", path)
            if m:
                return self._resolve(unquote(m[1]), unquote(m[2]), unquote(m[3]), head)
            self._error(404, "", f"no route {path}")

        def _api(self, repo_id: str, kind: str | None, rev: str, query: str) -> None:
            repo = self._repo(repo_id)
            if repo is None:
                return
            commit = repo.commit_of(rev)
            if commit is None:
                return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
            files = repo.commits[commit]
            if kind == "tree":
                return self._json([{"type": "file", "path": p, "size": b.size, "oid": commit_sha(p),
                                    "lfs": {"oid": b.sha256, "size": b.size, "pointerSize": 134}}
                                   for p, b in files.items()])
            blobs = "blobs=true" in query.lower() or "blobs=True" in query
            siblings = [{"rfilename": p, **({"size": b.size, "blobId": commit_sha(p),
                                              "lfs": {"size": b.size, "sha256": b.sha256, "pointerSize": 134}}
                                             if blobs and b.lfs else {}),
                         **({"size": b.size, "blobId": b.git_blob_id()} if blobs and not b.lfs else {})}
                        for p, b in files.items()]
            self._json({"_id": commit[:24], "id": repo_id, "modelId": repo_id, "sha": commit, "private": False,
                        "gated": "manual" if repo.token else False, "disabled": False, "siblings": siblings,
                        "tags": ["gguf"]})

        def _resolve(self, repo_id: str, rev: str, file: str, head: bool) -> None:
            repo = self._repo(repo_id)
            if repo is None or not self._authorized(repo):
                return
            commit = repo.commit_of(rev)
            if commit is None:
                return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
            blob = repo.commits[commit].get(file)
            if blob is None:
                return self._error(404, "EntryNotFound", f"{file} does not exist on {rev}")
            start, end = 0, blob.size
            rng = re.match(r"^bytes=(\d+)-(\d*)$", self.headers.get("Range") or "")
            if rng:
                start, end = int(rng[1]), int(rng[2]) + 1 if rng[2] else blob.size
                if start >= blob.size:
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{blob.size}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
            self.send_response(206 if rng else 200)
            for k, v in (("ETag", f'"{blob.sha256}"'), ("X-Linked-Etag", f'"{blob.sha256}"'),
                         ("X-Linked-Size", str(blob.size)), ("X-Repo-Commit", commit), ("Accept-Ranges", "bytes"),
                         ("Content-Length", str(end - start)), ("Content-Type", "application/octet-stream")):
                self.send_header(k, v)
            if rng:
                self.send_header("Content-Range", f"bytes {start}-{end - 1}/{blob.size}")
            self.end_headers()
            if not head:
                self._body(file, blob, start, end)

        def _body(self, file: str, blob: Blob, start: int, end: int) -> None:
            cut = hub.cut_once.pop(file, None)
            pos, step = start, 1 << 16
            while pos < end:
                n = min(step, end - pos)
                if cut is not None and pos + n > cut:
                    n = max(cut - pos, 0)
                chunk = blob.read(pos, pos + n)
                if file in hub.corrupt and pos == start and chunk:
                    chunk = bytes([chunk[0] ^ 0xFF]) + chunk[1:]
                self.wfile.write(chunk)
                pos += n
                if cut is not None and pos >= cut:
                    self.wfile.flush()
                    self.connection.shutdown(socket.SHUT_RDWR)   # a cut connection mid-body
                    self.close_connection = True
                    return
                if hub.rate_bytes_s:
                    time.sleep(n / hub.rate_bytes_s)
    return Handler
