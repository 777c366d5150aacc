"""Which files of a repo a quant names. Pure: a list of RepoFile in, the shards out.

llama-server's rule (common/download.cpp find_best_model): among the model GGUFs (not
mmproj / imatrix / draft sidecars), the first whose path holds `<quant>` followed by '.'
or '-' (case-insensitive), the first shard of a split set; with no quant: Q4_K_M, then
Q8_0, then the first model GGUF. bloomery prefers a file whose own quant tag equals the
asked one before that substring rule, so `Q4_K_M` does not pick `UD-Q4_K_M` when both exist.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from bloomery.hf.errors import NoSuchFile, NoSuchQuant

DEFAULT_QUANTS = ("Q4_K_M", "Q8_0")
_SIDECARS = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")
_SPLIT_RE = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})$", re.I)
_TAG_RE = re.compile(r"(?:^|[-._])((?:UD-)?(?:I?Q\d[A-Z0-9_]*|[BM]?F\d+|MXFP\d[A-Z0-9_]*|TQ\d[A-Z0-9_]*))$", re.I)
_LLAMA_TAG_RE = re.compile(r"[-.]([A-Z0-9_]+)$", re.I)


@dataclass(frozen=True)
class RepoFile:
    path: str                 # relative to the repo root
    size: int                 # bytes
    sha256: str = ""          # LFS sha256 (hex); "" for a file stored in git itself
    blob_id: str = ""         # git blob sha1 (checks a non-LFS file)

    @property
    def key(self) -> str:
        """The content's name in the cache: its sha256, else its git blob id."""
        return self.sha256 or f"gitsha1-{self.blob_id}"


@dataclass(frozen=True)
class SplitInfo:
    prefix: str               # the path without `-0000k-of-0000n.gguf` (folders included)
    index: int
    count: int


def split_info(path: str) -> SplitInfo:
    stem = path[:-5] if path.lower().endswith(".gguf") else path
    m = _SPLIT_RE.match(stem)
    return SplitInfo(m["prefix"], int(m["no"]), int(m["count"])) if m else SplitInfo(stem, 1, 1)


def quant_tag(path: str) -> str:
    """`Qwen-0.5B-Instruct-Q4_K_M-00001-of-00002.gguf` -> `Q4_K_M`; '' when the name shows none."""
    stem = split_info(path.rsplit("/", 1)[-1]).prefix
    m = _TAG_RE.search(stem) or _LLAMA_TAG_RE.search(stem)
    return m[1].upper() if m else ""


def is_model(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return name.lower().endswith(".gguf") and not any(s in name for s in _SIDECARS)


def list_quants(files: list[RepoFile]) -> list[str]:
    """Every quant tag of the repo's model GGUFs, in file order, once each."""
    return list(dict.fromkeys(t for f in files if is_model(f.path) and (t := quant_tag(f.path))))


def _first_shards(files: list[RepoFile]) -> list[RepoFile]:
    return [f for f in files if is_model(f.path) and split_info(f.path).index == 1]


def _find(files: list[RepoFile], quant: str) -> RepoFile | None:
    candidates = _first_shards(files)
    exact = [f for f in candidates if quant_tag(f.path) == quant.upper()]
    if exact:
        return exact[0]
    pattern = re.compile(re.escape(quant) + r"[.-]", re.I)     # llama-server's substring rule
    return next((f for f in candidates if pattern.search(f.path)), None)


def shards_of(files: list[RepoFile], primary: RepoFile, repo: str) -> list[RepoFile]:
    """Every shard of primary's split set, in order; NoSuchFile when the hub lacks one."""
    info = split_info(primary.path)
    if info.count <= 1:
        return [primary]
    by_index = {}
    for f in files:
        s = split_info(f.path)
        if s.prefix == info.prefix and s.count == info.count:
            by_index[s.index] = f
    missing = [i for i in range(1, info.count + 1) if i not in by_index]
    if missing:
        raise NoSuchFile(f"--hf-repo {repo}: split set {info.prefix}-*-of-{info.count:05d}.gguf lacks shard(s) "
                         f"{', '.join(map(str, missing))} on the hub")
    return [by_index[i] for i in range(1, info.count + 1)]


def pick(files: list[RepoFile], repo: str, quant: str = "", hf_file: str = "") -> list[RepoFile]:
    """The files to fetch for (quant | hf_file): every shard, first shard first; a named refusal otherwise."""
    if hf_file:
        primary = next((f for f in files if f.path == hf_file), None)
        if primary is None:
            ggufs = [f.path for f in files if f.path.lower().endswith(".gguf")]
            raise NoSuchFile(f"--hf-file {hf_file!r}: repo {repo} has no such file; its GGUF files: "
                             f"{', '.join(ggufs) or 'none'}")
        if split_info(primary.path).index != 1:
            primary = shards_of(files, primary, repo)[0]
        return shards_of(files, primary, repo)
    quants = list_quants(files)
    if quant:
        primary = _find(files, quant)
        if primary is None:
            raise NoSuchQuant(f"--hf-repo {repo}:{quant}: the repo has no GGUF of quant {quant}; "
                              f"its quants: {', '.join(quants) or 'none'}")
        return shards_of(files, primary, repo)
    for q in DEFAULT_QUANTS:
        primary = _find(files, q)
        if primary is not None:
            return shards_of(files, primary, repo)
    firsts = _first_shards(files)
    if not firsts:
        names = [f.path for f in files][:20]
        raise NoSuchQuant(f"--hf-repo {repo}: the repo holds no GGUF model file (files: {', '.join(names) or 'none'})")
    return shards_of(files, firsts[0], repo)
