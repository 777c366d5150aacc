"""Which models a router serves: --models-dir and the download cache, read as llama-server reads them
(common/preset.cpp load_from_models_dir; server-models.cpp).

--models-dir DIR: a GGUF file in DIR is a model named after the file without ".gguf"; a folder in DIR is a
model named after the folder, served from its first shard (-00001-of-) or its one model file. Projector
(mmproj) and draft sidecars are never models of their own.
The cache ($BLOOMERY_CACHE/hf, bloomery/hf/cache.py): each model file a fetched commit holds, named
"owner/name:QUANT" as llama-server names its cached models; its child fetches it again with --hf-repo
(from the cache, sha256 checked). A name in both: the folder's model wins (it is the one the user pointed at).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from bloomery.hf.cache import RepoCache, cache_root
from bloomery.hf.select import is_model, quant_tag, split_info

MODELS_DIR, CACHE = "models_dir", "cache"     # llama-server's source words in GET /models


class CatalogError(Exception):
    """A --models-dir the router cannot read: the start is refused naming it."""


@dataclass(frozen=True)
class Entry:
    name: str
    source: str                 # MODELS_DIR or CACHE
    path: str = ""              # MODELS_DIR: the file a child gets as -m
    hf_repo: str = ""           # CACHE: the spec a child gets as --hf-repo
    hf_file: str = ""           # CACHE: the repo's file, when its name carries no quant tag

    def model_args(self) -> list[str]:
        """The flags that name this model on a child's command line."""
        if self.path:
            return ["--model", self.path]
        return ["--hf-repo", self.hf_repo, *(["--hf-file", self.hf_file] if self.hf_file else [])]


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
                name = f"{repo}:{tag}" if tag else f"{repo}:{f.path}"
                out.append(Entry(name, CACHE, hf_repo=f"{repo}@{commit}:{tag}" if tag else f"{repo}@{commit}",
                                 hf_file="" if tag else f.path))
    return out


def catalog(models_dir: str | None, env: dict | None = None) -> dict[str, Entry]:
    """name -> Entry over both sources; a --models-dir model shadows a cached one of the same name."""
    env = dict(os.environ if env is None else env)
    found = {e.name: e for e in scan_cache(cache_root(env))}
    if models_dir:
        found.update({e.name: e for e in scan_models_dir(models_dir)})
    return dict(sorted(found.items()))
