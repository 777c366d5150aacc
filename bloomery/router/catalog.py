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
--models-preset FILE (preset.py reads it): each section is a model of that name (source "preset"), a section
named as a listed model gives that model its options; [*]'s options go to every model. A preset's model is its
`model` file, or its `hf-repo` (+ `hf-file`) resolved in the caches above as llama-server resolves it offline
(common_download_resolve_path), else fetched by its child. With dedup-cache-models on, the cache entries a
preset's hf-repo and spec-draft-hf resolve to are hidden from GET /models, still served by name.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

from bloomery.hf.cache import RepoCache, cache_root
from bloomery.hf.errors import HfError
from bloomery.hf.fetch import hf_hub_cache
from bloomery.hf.select import DEFAULT_QUANTS, is_model, quant_tag, split_info
from bloomery.hf.spec import parse_spec
from bloomery.router.preset import (DEDUP, RESERVED, STOP_TIMEOUT, Option, Options, PresetError, read_file,
                                    refusal, truthy)
from bloomery.settings import argv_flags

MODELS_DIR, CACHE, PRESET = "models_dir", "cache", "preset"     # llama-server's source words in GET /models
MODEL_FLAGS = {"--model", "--hf-repo", "--hf-file"}     # a preset's model source: resolved into path / hf_repo


class CatalogError(Exception):
    """A --models-dir the router cannot read: the start is refused naming it."""


@dataclass(frozen=True)
class Entry:
    name: str
    source: str                 # MODELS_DIR, CACHE or PRESET
    path: str = ""              # the file a child gets as -m (--models-dir, huggingface_hub's cache)
    hf_repo: str = ""           # bloomery's cache: the spec a child gets as --hf-repo
    repo: str = ""              # a cache entry: its repo and the file's path in it (a preset's hf-repo finds it)
    file: str = ""
    options: tuple[Option, ...] = ()    # a preset's options ([*] and the model's section), in the file's order
    hidden: bool = False        # a cache entry a preset with dedup-cache-models stands for: usable, not listed
    hf_file: str = ""           # a preset's hf-file beside an hf-repo the caches do not hold
    online: bool = False        # a preset's hf-repo the caches do not hold: the child fetches it
    problem: str = ""           # why the preset's model cannot start (refused when it is loaded)

    def model_args(self) -> list[str]:
        """The flags that name this model on a child's command line."""
        if self.path:
            return ["--model", self.path]
        if self.hf_repo and self.online:
            return ["--hf-repo", self.hf_repo, *(["--hf-file", self.hf_file] if self.hf_file else [])]
        if self.hf_repo:
            return ["--hf-repo", self.hf_repo, "--offline"]     # from the cache the router listed it from
        return []

    def args(self, base: list[str]) -> list[str]:
        """A child's flags before its --host/--port/--alias: the router's own (`base`, which win, as in
        llama-server), then the preset's options the router does not own and `base` does not set, then the model."""
        given = argv_flags(base)
        extra = [w for o in self.options if o.flag is not None and o.flag.long not in RESERVED | given
                 | MODEL_FLAGS for w in o.argv()]
        return [*base, *extra, *self.model_args()]

    def refusal(self) -> str | None:
        """A flag bloomery refuses among its preset's options (the model is refused by name), or None."""
        return refusal({o.ident: o for o in self.options})

    def unfit(self) -> str | None:
        """Why its preset cannot start a model (it names none, or two), or None."""
        if self.problem:
            return self.problem
        return None if self.model_args() else "its preset names no model (give model = FILE or hf-repo = REPO)"

    def option(self, key: str) -> str | None:
        return next((o.value for o in self.options if o.ident == key), None)

    def stop_s(self, default: float) -> float:
        value = self.option(STOP_TIMEOUT)
        return float(value) if value is not None else default


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
                    out.append(Entry(f"{repo}:{tag}", CACHE, hf_repo=f"{repo}@{commit}:{tag}", repo=repo,
                                     file=f.path))
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
                    out.append(Entry(f"{repo.repo_id}:{tag}", CACHE, path=str(f.file_path), repo=repo.repo_id,
                                     file=rel))
    return out


def catalog(models_dir: str | None, env: dict | None = None, preset: str | None = None) -> dict[str, Entry]:
    """name -> Entry over every source, sorted by name (read again at each GET /models?reload=1)."""
    env = dict(os.environ if env is None else env)
    cached = {e.name: e for e in scan_hf_hub(env)}
    cached.update({e.name: e for e in scan_cache(cache_root(env))})
    local = {e.name: e for e in scan_models_dir(models_dir)} if models_dir else {}
    found = {**cached, **local}
    if preset:
        try:
            glob, sections = read_file(preset)
        except PresetError as e:
            raise CatalogError(str(e)) from None
        found = {n: replace(e, options=tuple(glob.values())) for n, e in found.items()}
        for name, own in sections.items():
            found[name] = _preset_entry(name, {**glob, **own}, found.get(name), cached)
        for name in _deduped(glob, sections, cached) - set(local) - set(sections):
            found[name] = replace(found[name], hidden=True)
    return dict(sorted(found.items()))


def _preset_entry(name: str, opts: Options, base: Entry | None, cached: dict[str, Entry]) -> Entry:
    """A preset's model: its section over [*] over the model of that name listed elsewhere (if any). Its model
    is `model` (a file), or `hf-repo` (+ `hf-file`) found in a cache as the router lists it, else fetched by
    the child."""
    model, repo, hf_file = (opts[k].value if k in opts else "" for k in ("--model", "--hf-repo", "--hf-file"))
    entry = Entry(name, PRESET, options=tuple(opts.values()))
    if model and repo:
        return replace(entry, problem=f"its preset gives both model ({model}) and hf-repo ({repo}): give one")
    if model:
        return replace(entry, path=model)
    if repo:
        hit = resolve(cached, repo, hf_file)
        if hit is None:
            return replace(entry, hf_repo=repo, hf_file=hf_file, online=True)
        return replace(entry, path=hit.path, hf_repo=hit.hf_repo)
    if base is not None:
        return replace(entry, path=base.path, hf_repo=base.hf_repo)
    return entry


def resolve(cached: dict[str, Entry], spec_text: str, hf_file: str = "") -> Entry | None:
    """The cache entry an hf-repo value (+ hf-file) names, as llama-server resolves it from its cache
    (common_download_resolve_path): the file named, else the quant named, else Q4_K_M, Q8_0, the first."""
    try:
        spec = parse_spec(spec_text)
    except HfError:
        return None
    entries = sorted((e for e in cached.values() if e.repo == spec.repo), key=lambda e: e.file)
    if hf_file:
        return next((e for e in entries if e.file == hf_file), None)
    by_tag: dict[str, Entry] = {}
    for e in entries:
        by_tag.setdefault(quant_tag(e.file), e)
    if spec.quant:
        return by_tag.get(spec.quant.upper())
    return next((by_tag[q] for q in DEFAULT_QUANTS if q in by_tag), entries[0] if entries else None)


def _deduped(glob: Options, sections: dict[str, Options], cached: dict[str, Entry]) -> set[str]:
    """The cache entries a preset with dedup-cache-models on stands for: its hf-repo's and its draft's."""
    out: set[str] = set()
    for own in sections.values():
        opts = {**glob, **own}
        if DEDUP not in opts or not truthy(opts[DEDUP].value):
            continue
        for repo_key, file_key in (("--hf-repo", "--hf-file"), ("--spec-draft-hf", "--model-draft")):
            if repo_key in opts:
                hit = resolve(cached, opts[repo_key].value, opts[file_key].value if file_key in opts else "")
                if hit is not None:
                    out.add(hit.name)
    return out
