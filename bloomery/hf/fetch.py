"""--hf-repo -> local paths of every shard: the hub's file list (or the cache's, offline), the
quant's files (select.py), each one downloaded once and hash checked (download.py).

Online: model_info(files_metadata=True) names the commit and every file's size and
sha256; the ref and the manifest go to the cache, so a later offline start (HF_HUB_OFFLINE=1
or --offline) resolves the same spec with no network. When the hub cannot be reached
the cache serves what it holds (a record says so); with nothing cached the start is
refused by name. A file that huggingface_hub's own cache already holds (`hf download`,
vLLM, transformers: HF_HUB_CACHE, default ~/.cache/huggingface/hub) is not downloaded
again: found there by huggingface_hub's lookup, checked by its hash and hard-linked
(a symlink across file systems) into ours.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
from dataclasses import dataclass
from typing import Callable

from bloomery.hf import errors as E
from bloomery.hf.cache import RepoCache, cache_root
from bloomery.hf.download import Progress, digest_of, download
from bloomery.hf.select import RepoFile, pick
from bloomery.hf.spec import HfSpec

Note = Callable[[str, dict], None]      # (message, k=v): a record the caller prints
_TRUE = {"1", "ON", "YES", "TRUE"}      # huggingface_hub's reading of HF_HUB_OFFLINE
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_SHA1_RE = re.compile(r"^[0-9a-f]{40}$")


@dataclass(frozen=True)
class Fetched:
    paths: tuple[str, ...]     # snapshot paths, first shard first
    files: tuple[RepoFile, ...]
    commit: str
    source: str                # "hub" (at least one file downloaded), "cache"
    n_bytes: int


def offline_mode(env: dict | None = None, flag: bool = False) -> bool:
    env = os.environ if env is None else env
    return flag or (env.get("HF_HUB_OFFLINE") or env.get("TRANSFORMERS_OFFLINE") or "").upper() in _TRUE


@contextlib.contextmanager
def hub_errors(spec: HfSpec, what: str):
    """huggingface_hub's and httpx's exceptions -> the named refusals."""
    import httpx2
    from huggingface_hub import errors as H
    try:
        yield
    except H.GatedRepoError:
        raise E.Gated(f"--hf-repo {spec}: {spec.repo} is gated; accept its terms on the hub and give a token "
                      f"(--hf-token or HF_TOKEN) ({what})") from None
    except H.RevisionNotFoundError:
        raise E.UnknownRevision(f"--hf-repo {spec}: revision {spec.revision!r} is no branch, tag or commit of "
                                f"{spec.repo}") from None
    except H.RepositoryNotFoundError:
        raise E.UnknownRepo(f"--hf-repo {spec}: the hub has no repo {spec.repo!r} (or it is private and the "
                            f"token does not reach it)") from None
    except H.HfHubHTTPError as e:
        code = e.response.status_code if e.response is not None else 0
        if code in (401, 403):
            raise E.Gated(f"--hf-repo {spec}: the hub answered {code} for {what}; give a token with access "
                          f"(--hf-token or HF_TOKEN)") from None
        raise E.DownloadFailed(f"--hf-repo {spec}: the hub answered {code} for {what}") from None
    except (httpx2.TransportError, H.OfflineModeIsEnabled) as e:
        raise E.NetworkDown(f"--hf-repo {spec}: cannot reach the hub for {what} ({type(e).__name__}: {e})") from None


def _hub_files(spec: HfSpec, token: str | None, endpoint: str | None) -> tuple[str, list[RepoFile]]:
    from huggingface_hub import HfApi
    with hub_errors(spec, "the file list"):
        api = HfApi(endpoint=endpoint, token=token or None)
        info = api.model_info(spec.repo, revision=spec.revision, files_metadata=True)
    files = []
    for s in info.siblings or ():
        lfs = s.lfs
        f = RepoFile(s.rfilename, int(lfs.size if lfs else s.size or 0), (lfs.sha256 if lfs else "").lower(),
                     (s.blob_id or "").lower())
        # the hash names the cache file: anything but hex would be a path, and nothing could check the bytes
        if not (_SHA256_RE.match(f.sha256) or not f.sha256 and _SHA1_RE.match(f.blob_id)) or f.size < 0:
            if f.path.lower().endswith(".gguf"):
                raise E.DownloadFailed(f"--hf-repo {spec}: the hub's metadata for {f.path} holds no usable hash "
                                       f"(sha256 {f.sha256!r}, blob id {f.blob_id!r}); nothing to check it against")
            continue
        files.append(f)
    if not info.sha:
        raise E.DownloadFailed(f"--hf-repo {spec}: the hub's answer names no commit")
    return info.sha, files


def _cached(spec: HfSpec, cache: RepoCache) -> tuple[str, list[RepoFile]] | None:
    commit = cache.read_ref(spec.revision)
    files = cache.read_manifest(commit) if commit else None
    return (commit, files) if files is not None else None


def _check_disk(spec: HfSpec, cache: RepoCache, missing: list[RepoFile]) -> None:
    """Refuse by name a download the cache's disk cannot hold (the .part bytes already there count)."""
    if not missing:
        return
    blobs = cache.dir / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    have = sum(cache.part_path(f).stat().st_size for f in missing if cache.part_path(f).exists())
    need = sum(f.size for f in missing) - have
    free = shutil.disk_usage(blobs).free
    if need > free:
        raise E.DiskFull(f"--hf-repo {spec}: {need} more bytes to download, {free} bytes free under {blobs}")


def hf_hub_cache(env: dict) -> str | None:
    """huggingface_hub's cache folder as `env` names it; None: huggingface_hub's own default (its
    reading of this process's environment)."""
    if env.get("HF_HUB_CACHE"):
        return env["HF_HUB_CACHE"]
    return os.path.join(env["HF_HOME"], "hub") if env.get("HF_HOME") else None


def _adopt_hf_cached(spec: HfSpec, commit: str, f: RepoFile, cache: RepoCache, env: dict, note: Note) -> bool:
    """Link the copy of `f` in huggingface_hub's cache into ours when its hash is the hub's; False when
    that cache has no copy at this commit or branch, or a copy with other bytes (then it is downloaded)."""
    from huggingface_hub import try_to_load_from_cache
    where = hf_hub_cache(env)
    for revision in dict.fromkeys((commit, spec.revision)):
        found = try_to_load_from_cache(spec.repo, f.path, cache_dir=where, revision=revision)
        if isinstance(found, str) and os.path.isfile(found):
            break
    else:
        return False
    real = os.path.realpath(found)
    note("checking the Hugging Face cache's copy", {"file": f.path, "path": found, "bytes": f.size})
    if os.path.getsize(real) != f.size or digest_of(real, f) != (f.sha256 or f.blob_id):
        note("the Hugging Face cache's copy does not match the hub's hash: downloading", {"file": f.path,
                                                                                        "path": found})
        return False
    blob = cache.blob_path(f)
    blob.parent.mkdir(parents=True, exist_ok=True)
    tmp = blob.with_name(f".tmp-{os.getpid()}-{blob.name}")
    tmp.unlink(missing_ok=True)
    try:
        os.link(real, tmp)
    except OSError:                        # another file system (or no hard links there): point at it
        os.symlink(real, tmp)
    os.replace(tmp, blob)
    note("found in the Hugging Face cache", {"file": f.path, "path": found, "bytes": f.size})
    return True


def fetch(spec: HfSpec, hf_file: str = "", token: str | None = None, offline: bool = False,
          progress: Progress | None = None, note: Note | None = None, env: dict | None = None) -> Fetched:
    """Every shard of the spec's GGUF in the cache, checked; the named HfError otherwise."""
    note = note or (lambda message, kv: None)
    env = os.environ if env is None else env
    endpoint = (env.get("HF_ENDPOINT") or "").rstrip("/") or None     # None: huggingface_hub's default
    cache = RepoCache(cache_root(env), spec.repo)
    offline = offline_mode(env, offline)
    listing, reached = None, not offline
    if not offline:
        try:
            listing = _hub_files(spec, token, endpoint)
        except E.NetworkDown as e:
            listing, reached = _cached(spec, cache), False
            if listing is None:
                raise E.NetworkDown(f"{e}; nothing cached for it under {cache.dir}") from None
            note("hub unreachable: using the cached copy", {"repo": spec.repo, "revision": spec.revision,
                                                             "commit": listing[0], "error": str(e)})
        else:
            cache.write_manifest(*listing)
            cache.write_ref(spec.revision, listing[0])
    else:
        listing = _cached(spec, cache)
        if listing is None:
            raise E.NotCached(f"--hf-repo {spec}: offline (HF_HUB_OFFLINE / --offline) and the cache holds no "
                              f"{spec.repo}@{spec.revision} under {cache.dir}; start once online")
    commit, files = listing
    chosen = pick(files, spec.repo, spec.quant, hf_file)
    for f in chosen:
        if not cache.has_blob(f):
            _adopt_hf_cached(spec, commit, f, cache, env, note)
    _check_disk(spec, cache, [f for f in chosen if not cache.has_blob(f)])
    source = "cache"
    for f in chosen:
        if cache.has_blob(f):
            note("cached file", {"file": f.path, "bytes": f.size, "commit": commit})
        elif offline:
            raise E.NotCached(f"--hf-repo {spec}: offline and {f.path} ({f.size} bytes) is not in the cache "
                              f"under {cache.dir}; start once online")
        elif not reached:
            raise E.NetworkDown(f"--hf-repo {spec}: the hub cannot be reached and {f.path} ({f.size} bytes) "
                                f"is not in the cache under {cache.dir}")
        else:
            from huggingface_hub import hf_hub_url
            from huggingface_hub.utils import build_hf_headers, get_session
            url = hf_hub_url(spec.repo, f.path, revision=commit, endpoint=endpoint)
            note("downloading", {"file": f.path, "bytes": f.size, "commit": commit})
            try:
                with hub_errors(spec, f.path):
                    download(get_session(), url, build_hf_headers(token=token or None), f, cache, progress,
                             note)
            except (E.ChecksumMismatch, E.DownloadFailed) as e:
                raise type(e)(f"--hf-repo {spec}: {e}") from None
            source = "hub"
    paths = tuple(str(cache.link(commit, f)) for f in chosen)
    return Fetched(paths, tuple(chosen), commit, source, sum(f.size for f in chosen))
