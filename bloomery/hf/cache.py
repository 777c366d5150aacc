"""The download cache: `$BLOOMERY_CACHE/hf` (default `~/.cache/bloomery/hf`).

    models--<owner>--<name>/
      refs/<rev>                  the commit a branch or tag named when last resolved online
      manifests/<commit>.json     that commit's files: path, size, sha256, blob id
      blobs/<sha256>              a file whose hash was checked (the name is the proof)
      blobs/<sha256>.part         bytes of a download in progress (resumed from its length)
      snapshots/<commit>/<path>   symlink to the blob, under the file's own name: a split
                                  set's shards sit side by side, as open_gguf looks for them
A blob shared by two commits is fetched once. Writes are atomic (temp file + rename).
"""
from __future__ import annotations

import json
import os
import re
import secrets
import tempfile
import threading
from pathlib import Path
from urllib.parse import quote

from bloomery.hf.errors import HfError
from bloomery.hf.select import RepoFile

_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")


def cache_root(env: dict | None = None) -> Path:
    env = os.environ if env is None else env
    base = env.get("BLOOMERY_CACHE") or str(Path.home() / ".cache" / "bloomery")
    return Path(base) / "hf"


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def safe_relpath(path: str) -> str:
    """A repo path the hub sent, refused when it would leave the snapshot folder."""
    parts = path.split("/")
    if not path or path.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\\" in path or "\0" in path:
        raise HfError(f"the hub named a file {path!r}, which is no safe relative path; refused")
    return path


class RepoCache:
    def __init__(self, root: Path, repo: str):
        self.repo = repo
        self.dir = Path(root) / ("models--" + repo.replace("/", "--"))

    # -- refs and manifests --------------------------------------------------------------------
    def _ref_path(self, revision: str) -> Path:
        return self.dir / "refs" / quote(revision, safe="")

    def write_ref(self, revision: str, commit: str) -> None:
        if revision != commit:
            _atomic_write(self._ref_path(revision), commit)

    def read_ref(self, revision: str) -> str | None:
        """The commit this revision resolved to last time online (a commit names itself)."""
        if _COMMIT_RE.match(revision):
            return revision
        try:
            commit = self._ref_path(revision).read_text(encoding="utf-8").strip()
        except OSError:
            return None
        return commit if _COMMIT_RE.match(commit) else None

    def write_manifest(self, commit: str, files: list[RepoFile]) -> None:
        rows = [{"path": f.path, "size": f.size, "sha256": f.sha256, "blob_id": f.blob_id} for f in files]
        _atomic_write(self.dir / "manifests" / f"{commit}.json", json.dumps({"files": rows}))

    def read_manifest(self, commit: str) -> list[RepoFile] | None:
        try:
            rows = json.loads((self.dir / "manifests" / f"{commit}.json").read_text(encoding="utf-8"))["files"]
            return [RepoFile(r["path"], int(r["size"]), r["sha256"], r["blob_id"]) for r in rows]
        except (OSError, ValueError, KeyError, TypeError):
            return None       # no manifest, or a damaged one: as good as none

    # -- blobs ---------------------------------------------------------------------------------
    def blob_path(self, f: RepoFile) -> Path:
        return self.dir / "blobs" / f.key

    def part_path(self, f: RepoFile) -> Path:
        return self.dir / "blobs" / f"{f.key}.part"

    def lock_path(self, f: RepoFile) -> Path:
        return self.dir / "blobs" / f"{f.key}.lock"

    def has_blob(self, f: RepoFile) -> bool:
        """A checked blob of the right size (it is only ever named after its hash was checked)."""
        try:
            return self.blob_path(f).stat().st_size == f.size
        except OSError:
            return False

    def link(self, commit: str, f: RepoFile) -> Path:
        """snapshots/<commit>/<path> -> the blob; the path open_gguf and the plan read."""
        rel = safe_relpath(f.path)
        dest = self.dir / "snapshots" / commit / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        target = os.path.relpath(self.blob_path(f), dest.parent)
        if dest.is_symlink() and os.readlink(dest) == target:
            return dest
        # A name no other caller can hold: two fetches of one file in one process (threads) or in
        # two processes each make their own link and rename it over dest; the last rename wins and
        # both point at the same blob.
        tmp = dest.with_name(f".tmp-{os.getpid()}-{threading.get_ident()}-{secrets.token_hex(4)}-{dest.name}")
        os.symlink(target, tmp)
        try:
            os.replace(tmp, dest)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        return dest
