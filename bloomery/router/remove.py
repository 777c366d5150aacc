"""Removing a cached model from disk (the router's DELETE /models), as llama-server's common_download_remove.

A cache model is "owner/name:QUANT" (catalog.py). Its files are, in each cache the router lists (huggingface_hub's
layout where llama-server keeps its cache, and bloomery's), under that repo's folder only:
- every snapshot entry (any commit) that is a model file of that quant tag, every shard of a split set;
- the blob each such entry links to, unless an entry that stays (any snapshot of any repo in that cache) links to
  it too; in bloomery's cache also the blob a manifest row of that tag names, unless a row of another file names
  it. A blob that is itself a link is unlinked; what it points to is never touched.
Projector (mmproj) and draft sidecars stay (llama-server removes a projector whose name carries the same tag).
Manifests and refs stay: they describe the repo, not what is held of it.

The plan is made before anything is removed: an entry or a link target that would leave the repo's folder (a
snapshot link pointing outside its blobs, a snapshot folder that is a link elsewhere) refuses the whole removal
(RemoveRefused, naming the path); nothing is removed then.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from bloomery.hf.cache import cache_root
from bloomery.hf.fetch import hf_hub_cache
from bloomery.hf.select import is_model, quant_tag


class RemoveRefused(Exception):
    """A path of the removal would leave the model's cache folder: nothing was removed."""


@dataclass
class Plan:
    files: list[Path] = field(default_factory=list)     # snapshot entries, then blobs, each inside its repo folder


def _inside(path: Path, folder: Path) -> bool:
    """Whether `path` (its folder resolved, its own name not followed) lies in `folder` (resolved)."""
    parent = Path(os.path.realpath(path.parent))
    return parent == folder or folder in parent.parents


def _target(link: Path) -> Path:
    """Where a link points, lexically (as llama-server reads it): not followed further."""
    return Path(os.path.normpath(link.parent / os.readlink(link)))


def _key(path: Path) -> tuple[str, str]:
    """A path's identity for comparing blobs: its resolved folder and its own name."""
    return os.path.realpath(path.parent), path.name


def _snapshot_entries(repo_dir: Path) -> list[Path]:
    """Every file or link under the repo's snapshots (links to folders are not entered)."""
    out: list[Path] = []
    for top, dirs, files in os.walk(repo_dir / "snapshots"):
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(top, d))]
        out.extend(Path(top) / f for f in files)
    return out


def _matches(rel: str, tag: str) -> bool:
    return is_model(rel) and quant_tag(rel) == tag


def _repo_dir(root: Path, repo: str) -> Path | None:
    owner, _, name = repo.partition("/")
    if not owner or not name or any(p in ("", ".", "..") or os.sep in p or "\0" in p for p in (owner, name)):
        raise RemoveRefused(f"{repo!r} is no owner/name repo id")
    folder = root / ("models--" + repo.replace("/", "--"))
    return folder if folder.is_dir() else None


def _plan_root(root: Path, repo: str, tag: str, manifests: bool) -> list[Path]:
    """The files of repo:tag under one cache root; RemoveRefused when one would leave the repo's folder."""
    repo_dir = _repo_dir(root, repo)
    if repo_dir is None:
        return []
    real_repo = Path(os.path.realpath(repo_dir))
    snapshots, blobs_dir = real_repo / "snapshots", real_repo / "blobs"
    entries = [p for p in _snapshot_entries(repo_dir) if _matches(p.relative_to(repo_dir / "snapshots").as_posix()
                                                                 .split("/", 1)[-1], tag)]
    blobs: list[tuple[Path, str]] = []        # (the blob, what names it)
    for p in entries:
        if not _inside(p, snapshots):
            raise RemoveRefused(f"{p} lies outside the cache folder {repo_dir / 'snapshots'}; nothing was removed")
        if p.is_symlink():
            blobs.append((_target(p), f"{p} links to"))
    kept_keys: set[str] = set()
    if manifests:           # bloomery's cache: the blobs its manifests name for this tag, and those they keep
        for m in sorted((repo_dir / "manifests").glob("*.json")):
            try:
                rows = json.loads(m.read_text(encoding="utf-8"))["files"]
                named = [(str(r["path"]), str(r.get("sha256") or f"gitsha1-{r['blob_id']}")) for r in rows]
            except (OSError, ValueError, KeyError, TypeError):
                continue        # a damaged manifest names nothing (as the cache reads it)
            for path, key in named:
                if _matches(path, tag):
                    blobs.append((repo_dir / "blobs" / key, f"{m} names"))   # no plain name: refused below
                else:
                    kept_keys.add(key)
    leaving = {_key(p) for p in entries}
    kept = {_key(b) for b in _links_elsewhere(root, leaving)} | {_key(repo_dir / "blobs" / k) for k in kept_keys}
    out, seen = list(entries), set()
    for b, source in blobs:
        if Path(os.path.realpath(b.parent)) != blobs_dir or b.name in ("", ".", ".."):
            raise RemoveRefused(f"{source} {b}, outside the cache folder {repo_dir / 'blobs'}; "
                                "nothing was removed")
        k = _key(b)
        if k in kept or k in seen or not (b.is_symlink() or b.exists()):
            continue
        seen.add(k)
        out.append(b)
    return out


def _links_elsewhere(root: Path, leaving: set[tuple[str, str]]) -> list[Path]:
    """What every snapshot link of every repo under `root` that stays points to."""
    out: list[Path] = []
    for repo_dir in sorted(root.glob("models--*")):
        for p in _snapshot_entries(repo_dir):
            if p.is_symlink() and _key(p) not in leaving:
                out.append(_target(p))
    return out


def cache_roots(env: dict) -> list[Path]:
    """The two caches the router lists (catalog.py): llama-server's (huggingface_hub's layout), bloomery's."""
    from huggingface_hub import constants
    hub = Path(env.get("LLAMA_CACHE") or hf_hub_cache(env) or constants.HF_HUB_CACHE)
    return [hub, cache_root(env)]


def plan(name: str, env: dict) -> Plan:
    """The files that hold the cache model `name` ("owner/name:QUANT"), over every cache; RemoveRefused when
    one would leave its repo's folder."""
    repo, _, tag = name.rpartition(":")
    if not repo or not tag:
        raise RemoveRefused(f"{name!r} is no cache model name (owner/name:QUANT)")
    hub, own = cache_roots(env)
    files = _plan_root(hub, repo, tag.upper(), manifests=False)
    if os.path.realpath(own) != os.path.realpath(hub):
        files += _plan_root(own, repo, tag.upper(), manifests=True)
    return Plan(files)


def apply(p: Plan) -> list[str]:
    """Remove the plan's files (a link itself, never what it points to); the ones that could not be, with why."""
    failed = []
    for f in p.files:
        try:
            f.unlink()
        except FileNotFoundError:
            pass
        except OSError as e:
            failed.append(f"{f}: {e.strerror or e}")
    return failed
