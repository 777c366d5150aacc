"""The broker's state file: leases and queue, written atomically (temp file + fsync + rename + fsync dir).

A reader sees the old state or the new one, never half of one, whatever kills the
broker (SIGKILL, power loss after the rename's fsync).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

STATE_NAME = "state.json"


def state_dir(env: dict | None = None) -> Path:
    env = os.environ if env is None else env
    return Path(env.get("BLOOMERY_BROKER_STATE") or env.get("STATE_DIRECTORY", "").split(":")[0]
                or "/var/lib/bloomery-broker")


def write_state(folder: Path, state: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / STATE_NAME
    tmp = folder / f".{STATE_NAME}.{os.getpid()}.tmp"
    data = json.dumps(state, indent=1).encode()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o640)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dfd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dfd)        # the rename itself survives a crash
    finally:
        os.close(dfd)


def read_state(folder: Path) -> dict | None:
    """The saved state, None when there is none; ValueError naming the file when it is unreadable."""
    path = folder / STATE_NAME
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"broker state {path}: not JSON ({e})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"broker state {path}: expected a JSON object")
    return obj
