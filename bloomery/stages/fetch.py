"""fetch stage: the model source -> local files.

-m PATH: the file must exist, be a regular file and be readable; a split set's first
shard names every shard, and each one must be there. --hf-repo <repo>[@<rev>][:<quant>]
(bloomery/hf/): the quant's files from the hub into the download cache, resumed, hash
checked, never fetched twice; a record per second of download says bytes and rate (the
server answers 503 with phase fetch meanwhile). Emits FetchDone with the path and the shards.
"""
from __future__ import annotations

import os
import re

from bloomery import records
from bloomery.messages import stage as sm
from bloomery.stages.common import StageRefusal, run_stage

SPLIT_RE = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def _check_file(path: str, what: str) -> int:
    if not os.path.exists(path):
        raise StageRefusal(f"{what} {path}: no such file")
    if not os.path.isfile(path):
        raise StageRefusal(f"{what} {path}: not a regular file")
    if not os.access(path, os.R_OK):
        raise StageRefusal(f"{what} {path}: not readable by this user")
    return os.path.getsize(path)


def resolve(path: str) -> tuple[str, tuple[str, ...], int]:
    """(first shard, every shard, total bytes), or StageRefusal naming the missing piece."""
    path = os.path.abspath(path)
    n_bytes = _check_file(path, "model file")
    m = SPLIT_RE.match(os.path.basename(path))
    if not m:
        return path, (path,), n_bytes
    n_shards = int(m["count"])
    if int(m["no"]) != 1:
        raise StageRefusal(f"model file {path}: shard {int(m['no'])} of {n_shards}; name the first shard "
                           f"({m['prefix']}-00001-of-{m['count']}.gguf)")
    folder = os.path.dirname(path)
    shards = tuple(os.path.join(folder, f"{m['prefix']}-{i:05d}-of-{m['count']}.gguf") for i in range(1, n_shards + 1))
    n_bytes = sum(_check_file(s, f"shard {i} of {n_shards}") for i, s in enumerate(shards, 1))
    return path, shards, n_bytes


def _progress(path: str, n_done: int, n_total: int, rate_bytes_s: float) -> None:
    records.record("fetch", "download", file=path, bytes=n_done, total_bytes=n_total,
                   percent=round(100.0 * n_done / n_total, 1) if n_total else 100.0,
                   rate_bytes_s=int(rate_bytes_s))


def fetch_hf(args: dict) -> str:
    """--hf-repo: every shard into the cache; the first shard's path. A named refusal otherwise."""
    from bloomery.hf.errors import HfError
    from bloomery.hf.fetch import fetch
    from bloomery.hf.spec import parse_spec

    token = os.environ.get("HF_TOKEN") or None      # --hf-token reaches us here, never on argv
    if token:
        records.add_secret(token)
    try:
        spec = parse_spec(args["hf_repo"])
        got = fetch(spec, hf_file=args.get("hf_file") or "", token=token, offline=bool(args.get("offline")),
                    progress=_progress, note=lambda message, kv: records.record("fetch", message, **kv))
    except HfError as e:
        raise StageRefusal(str(e)) from None
    records.record("fetch", "hub files", repo=spec.repo, revision=spec.revision, commit=got.commit,
                   shards=len(got.paths), bytes=got.n_bytes, source=got.source)
    return got.paths[0]


def main(args: dict) -> int:
    source = "local"
    model_file = args.get("model_file")
    if args.get("hf_repo"):
        model_file, source = fetch_hf(args), "hf"
    path, shards, n_bytes = resolve(model_file)
    records.record("fetch", "model file", path=path, shards=len(shards), bytes=n_bytes, source=source)
    records.send(sm.FetchDone(path, shards, n_bytes))
    return 0


if __name__ == "__main__":
    run_stage("fetch", main)
