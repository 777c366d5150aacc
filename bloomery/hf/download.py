"""One file from the hub into the cache: ranged GET, resumed, hash checked before it is named.

The bytes go to blobs/<key>.part; a cut connection resumes with `Range: bytes=<have>-`
(in this run, and in the next run from the .part left behind). Only when the sha256
(LFS) or git blob sha1 matches the hub's is the .part renamed to blobs/<key>; a mismatch
removes the bytes, so a bad file is never served. An flock on blobs/<key>.lock keeps two
servers on one host from fetching the same blob at once (the second finds it done).
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import time
from dataclasses import dataclass, field
from typing import Callable

import httpx2

from bloomery.hf.cache import RepoCache
from bloomery.hf.errors import ChecksumMismatch, DownloadFailed, NetworkDown
from bloomery.hf.select import RepoFile

CHUNK_BYTES = 1 << 20
MAX_STALLS = 5            # attempts in a row that add no byte before the download gives up
TIMEOUT = httpx2.Timeout(60.0, connect=10.0)
Progress = Callable[[str, int, int, float], None]     # (repo path, bytes done, bytes total, rate bytes/s)


@dataclass
class Meter:
    """When to send a progress record, and the rate since the last one. Pure bookkeeping."""

    interval_s: float = 1.0
    last_s: float = field(default=0.0)
    last_bytes: int = 0

    def start(self, now_s: float, n_bytes: int) -> None:
        self.last_s, self.last_bytes = now_s, n_bytes

    def due(self, now_s: float, n_bytes: int, total: int) -> float | None:
        """The rate (bytes/s) when a record is due (every interval_s, and at the end), else None."""
        dt = now_s - self.last_s
        if dt < self.interval_s and n_bytes < total:
            return None
        rate = (n_bytes - self.last_bytes) / dt if dt > 0 else 0.0
        self.last_s, self.last_bytes = now_s, n_bytes
        return rate


def _hasher(f: RepoFile):
    if f.sha256:
        return hashlib.sha256()
    h = hashlib.sha1()
    h.update(b"blob %d\0" % f.size)          # git's blob id: sha1 over "blob <size>\0" + content
    return h


def _hash_prefix(path: str, f: RepoFile):
    h = _hasher(f)
    with open(path, "rb") as fp:
        while chunk := fp.read(CHUNK_BYTES):
            h.update(chunk)
    return h


def digest_of(path: str, f: RepoFile) -> str:
    """The file's sha256 (or git blob id, for a file the hub keeps in git): what the hub's is checked against."""
    return _hash_prefix(path, f).hexdigest()


def _raise_for_status(r) -> None:
    if r.status_code >= 400:
        from huggingface_hub.utils import hf_raise_for_status
        r.read()
        hf_raise_for_status(r)


def _one_attempt(session, url: str, headers: dict, f: RepoFile, part: str, state: dict,
                 progress: Progress | None, meter: Meter) -> None:
    have = os.path.getsize(part)
    req_headers = dict(headers, **{"Accept-Encoding": "identity"}, **({"Range": f"bytes={have}-"} if have else {}))
    with session.stream("GET", url, headers=req_headers, follow_redirects=True, timeout=TIMEOUT) as r:
        if r.status_code == 416 and have >= f.size:
            return                           # the hub has nothing past what we hold: check it
        _raise_for_status(r)
        if have and r.status_code != 206:    # the server ignored the range: start over
            have = 0
        elif have and not r.headers.get("Content-Range", "").startswith(f"bytes {have}-"):
            raise DownloadFailed(f"{f.path}: asked for bytes {have}- and the hub answered "
                                 f"Content-Range {r.headers.get('Content-Range')!r}")
        with open(part, "r+b" if have else "wb") as fp:
            fp.seek(have)
            fp.truncate()
            if have == 0:
                state["hash"] = _hasher(f)
            for chunk in r.iter_bytes():       # as they arrive: a cut keeps every byte received
                fp.write(chunk)
                state["hash"].update(chunk)
                have += len(chunk)
                if have > f.size:
                    break                     # more than the hub's own size: the check below fails it
                if progress is not None and (rate := meter.due(time.monotonic(), have, f.size)) is not None:
                    progress(f.path, have, f.size, rate)


def download(session, url: str, headers: dict, f: RepoFile, cache: RepoCache,
             progress: Progress | None = None, note=None, sleep=time.sleep) -> str:
    """The blob's path once its hash checked; the named HfError otherwise."""
    blob, part = str(cache.blob_path(f)), str(cache.part_path(f))
    os.makedirs(os.path.dirname(blob), exist_ok=True)
    note = note or (lambda message, kv: None)
    with open(cache.lock_path(f), "a") as lock:
        try:                                 # released when the file closes (or the process dies)
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            note("waiting for another process's download of this file", {"file": f.path, "blob": blob})
            fcntl.flock(lock, fcntl.LOCK_EX)
        if cache.has_blob(f):
            return blob
        if not os.path.exists(part) or os.path.getsize(part) > f.size:
            open(part, "wb").close()
        if os.path.getsize(part):
            note("download resumed", {"file": f.path, "from_bytes": os.path.getsize(part), "total_bytes": f.size})
        state = {"hash": _hash_prefix(part, f)}
        meter = Meter()
        meter.start(time.monotonic(), os.path.getsize(part))
        stalls = 0
        while os.path.getsize(part) < f.size:
            before = os.path.getsize(part)
            try:
                _one_attempt(session, url, headers, f, part, state, progress, meter)
            except httpx2.TransportError as e:
                if os.path.getsize(part) > before:
                    stalls = 0                # a cut after progress: resume at once
                    note("download cut; resuming", {"file": f.path, "at_bytes": os.path.getsize(part),
                                                    "total_bytes": f.size, "error": type(e).__name__})
                    continue
                stalls += 1
                if stalls >= MAX_STALLS:
                    raise NetworkDown(f"{f.path}: the hub stopped answering ({type(e).__name__}: {e}); "
                                      f"{before} of {f.size} bytes kept, the next start resumes from there") from None
                sleep(min(0.25 * 2 ** stalls, 4.0))
                continue
            if os.path.getsize(part) == before and before < f.size:
                stalls += 1
                if stalls >= MAX_STALLS:
                    raise DownloadFailed(f"{f.path}: the hub answered without bytes {MAX_STALLS} times at "
                                         f"offset {before} of {f.size}")
        digest = state["hash"].hexdigest()
        want = f.sha256 or f.blob_id
        if os.path.getsize(part) != f.size or digest != want:
            got_bytes = os.path.getsize(part)
            os.unlink(part)                   # never served, never resumed
            raise ChecksumMismatch(f"{f.path}: the downloaded bytes do not match the hub's "
                                   f"{'sha256' if f.sha256 else 'git blob id'} (want {want}, got {digest}, "
                                   f"{got_bytes} of {f.size} bytes); the bad file was removed")
        os.replace(part, blob)
        return blob
