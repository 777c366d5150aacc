"""Which models a router serves: --models-dir and the download cache, read as llama-server reads them
(common/preset.cpp load_from_models_dir; server-models.cpp).

--models-dir DIR: a GGUF file in DIR is a model named after the file without ".gguf"; a folder in DIR is a
model named after the folder, served from its first shard (-00001-of-) or its one model file. Projector
(mmproj) and draft sidecars are never models of their own.
The caches, each model file (first shards) whose name carries a quant tag, named "owner/name:QUANT" as
llama-server names its cached models (common_list_cached_models): bloomery's ($BLOOMERY_CACHE/hf,
bloomery/hf/cache.py; its child fetches it again with --hf-repo, from the cache, sha256 checked) and
huggingface_hub's layout where llama-server keeps its cache (LLAMA_CACHE, else HF_HUB_CACHE, HF_HOME/hub or
~/.cache/huggingface/hub: what llama-server's -hf and `hf download` fill, the one llama-server's router
lists; its child gets the snapshot's file as -m).
A name in several: the --models-dir model wins (the user pointed at it), then bloomery's cache.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from bloomery.hf.cache import RepoCache, cache_root
from bloomery.hf.fetch import hf_hub_cache
from bloomery.hf.select import is_model, quant_tag, split_info

MODELS_DIR, CACHE = "models_dir", "cache"     # llama-server's source words in GET /models


class CatalogError(Exception):
    """A --models-dir the router cannot read: the start is refused naming it."""


@dataclass(frozen=True)
class Entry:
    name: str
    source: str                 # MODELS_DIR or CACHE
    path: str = ""              # the file a child gets as -m (--models-dir, huggingface_hub's cache)
    hf_repo: str = ""           # bloomery's cache: the spec a child gets as --hf-repo

    def model_args(self) -> list[str]:
        """The flags that name this model on a child's command line."""
        if self.path:
            return ["--model", self.path]
        return ["--hf-repo", self.hf_repo, "--offline"]     # from the cache the router listed it from


def _is_model_file(name: str) -> bool:
    return is_model(name) and "mmproj" not in name


def scan_models_dir(models_dir: str) -> list[Entry]:
    root = Path(models_dir)
    if not root.is_dir():
        raise CatalogError(f"--models-dir {models_dir}: does not exist or is not a directory")
    out: list[Entry] = []
    for item in sorted(root.iterdir()):
        if item.is_dir():
            files = sorted(p for p in item.iterdir() if p.is_file() and _is_model_file(p.name))
            first = [p for p in files if split_info(p.name).count > 1 and split_info(p.name).index == 1]
            whole = [p for p in files if split_info(p.name).count == 1]
            chosen = (first or whole)[:1]
            out.extend(Entry(item.name, MODELS_DIR, path=str(p)) for p in chosen)
        elif item.is_file() and _is_model_file(item.name):
            out.append(Entry(item.name[: -len(".gguf")], MODELS_DIR, path=str(item)))
    return out


def scan_cache(root: Path) -> list[Entry]:
    """Every model file a cached commit (one a ref names) holds in full, first shards only."""
    out: list[Entry] = []
    if not root.is_dir():
        return out
    for repo_dir in sorted(root.glob("models--*--*")):
        repo = repo_dir.name[len("models--"):].replace("--", "/", 1)
        cache = RepoCache(root, repo)
        refs = repo_dir / "refs"
        commits = {cache.read_ref(r.name) for r in sorted(refs.iterdir())} if refs.is_dir() else set()
        for commit in sorted(c for c in commits if c):
            files = cache.read_manifest(commit) or []
            for f in files:
                info = split_info(f.path.rsplit("/", 1)[-1])
                if not _is_model_file(f.path) or info.index != 1 or not cache.has_blob(f):
                    continue
                tag = quant_tag(f.path)
                if tag:
                    out.append(Entry(f"{repo}:{tag}", CACHE, hf_repo=f"{repo}@{commit}:{tag}"))
    return out


def scan_hf_hub(env: dict) -> list[Entry]:
    """huggingface_hub's cache (its own scan): every complete first shard with a quant tag, as a file path."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound
    try:
        info = scan_cache_dir(env.get("LLAMA_CACHE") or hf_hub_cache(env))   # llama-server's order (hf-cache.cpp)
    except CacheNotFound:
        return []
    out: list[Entry] = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        for rev in sorted(repo.revisions, key=lambda r: r.commit_hash):
            for f in sorted(rev.files, key=lambda f: str(f.file_path)):
                rel = f.file_path.relative_to(rev.snapshot_path).as_posix()
                tag = quant_tag(rel)
                if tag and _is_model_file(rel) and split_info(f.file_name).index == 1 and f.blob_path.is_file():
                    out.append(Entry(f"{repo.repo_id}:{tag}", CACHE, path=str(f.file_path)))
    return out


def catalog(models_dir: str | None, env: dict | None = None) -> dict[str, Entry]:
    """name -> Entry over every source, sorted by name."""
    env = dict(os.environ if env is None else env)
    found = {e.name: e for e in scan_hf_hub(env)}
    found.update({e.name: e for e in scan_cache(cache_root(env))})
    if models_dir:
        found.update({e.name: e for e in scan_models_dir(models_dir)})
    return dict(sorted(found.items()))
