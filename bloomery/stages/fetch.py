"""fetch stage: the model source -> local files.

This slice serves local files only (-m PATH): the file must exist, be a regular
file and be readable; a split set's first shard names every shard, and each one
must be there. Emits FetchDone with the path and the shards.
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


def main(args: dict) -> int:
    path, shards, n_bytes = resolve(args["model_file"])
    records.record("fetch", "model file", path=path, shards=len(shards), bytes=n_bytes, source="local")
    records.send(sm.FetchDone(path, shards, n_bytes))
    return 0


if __name__ == "__main__":
    run_stage("fetch", main)
