"""The host's capacity for leases: cards through CuPy, host RAM through psutil and cgroups, a TOML config.

Cards are probed in a short-lived child process: CuPy's first call creates a CUDA
context on each card (hundreds of MiB) that a long-running broker must not hold.
Host RAM is the smaller of the machine's total and every cgroup memory limit above
the broker (v2 memory.max, v1 memory.limit_in_bytes). The config caps a term
(cap_bytes) or keeps bytes out of it (reserve_bytes):

    [host]
    cap_bytes = "48GiB"        # leases together never hold more host RAM than this
    reserve_bytes = "4GiB"     # kept for the system, out of every lease
    [cards]
    reserve_bytes = "1GiB"     # on every card
    [cards.0]                  # one card by CUDA ordinal (as CUDA_VISIBLE_DEVICES shows them to the servers)
    cap_bytes = "70GiB"
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import psutil

from bloomery.broker.book import Capacity

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_CARD_PROBE = """
import json
try:
    import cupy
except ImportError:
    print("[]"); raise SystemExit(0)
out = []
try:
    for i in range(cupy.cuda.runtime.getDeviceCount()):
        with cupy.cuda.Device(i):
            free, total = cupy.cuda.runtime.memGetInfo()
            out.append([int(free), int(total)])
except cupy.cuda.runtime.CUDARuntimeError:
    pass
print(json.dumps(out))
"""


class ConfigError(Exception):
    """The broker config refused: names the file, the key and the value."""


def parse_size(v: object, where: str) -> int:
    """An int of bytes, or a string like "12GiB" / "500 MB"."""
    if isinstance(v, bool):
        raise ConfigError(f"{where}: expected bytes (an integer or a string like \"8GiB\"), got {v!r}")
    if isinstance(v, int):
        if v < 0:
            raise ConfigError(f"{where}: {v} is negative")
        return v
    m = _SIZE.match(v) if isinstance(v, str) else None
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"{where}: expected bytes (an integer or a string like \"8GiB\"), got {v!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _terms(table: object, where: str) -> dict[str, int]:
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: expected a table, got {table!r}")
    out = {}
    for k, v in table.items():
        if k in ("cap_bytes", "reserve_bytes"):
            out[k] = parse_size(v, f"{where}.{k}")
        elif not (where == "cards" and k.isdigit()):
            raise ConfigError(f"{where}: unknown key {k!r} (known: cap_bytes, reserve_bytes"
                              + (", and one table per card ordinal" if where == "cards" else "") + ")")
    return out


def read_config(path: str | None) -> dict:
    """{"host": {...}, "cards": {...}, "card": {ordinal: {...}}} from the TOML file ({} when path is None)."""
    if path is None:
        return {"host": {}, "cards": {}, "card": {}}
    try:
        raw = tomllib.loads(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"broker config {path}: cannot read it ({e.strerror})") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"broker config {path}: not TOML ({e})") from None
    unknown = sorted(set(raw) - {"host", "cards"})
    if unknown:
        raise ConfigError(f"broker config {path}: unknown table(s) {', '.join(unknown)} (known: host, cards)")
    cards = raw.get("cards", {})
    try:
        return {"host": _terms(raw.get("host", {}), "host"), "cards": _terms(cards, "cards"),
                "card": {int(k): _terms(v, f"cards.{k}") for k, v in cards.items() if k.isdigit()}}
    except ConfigError as e:
        raise ConfigError(f"broker config {path}: {e}") from None


def _limit(path: Path) -> int | None:
    try:
        raw = path.read_text().strip()
    except OSError:
        return None
    return int(raw) if raw.isdigit() and int(raw) < 1 << 60 else None   # "max" / ~2**63: no limit


def cgroup_limit_bytes(root: Path = Path("/sys/fs/cgroup"),
                       proc_cgroup: Path = Path("/proc/self/cgroup")) -> int | None:
    """The least memory limit of any cgroup level above this process (v2 and v1); None when unlimited."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    files = [root / "memory.max", root / "memory" / "memory.limit_in_bytes"]
    for line in lines:
        _, controllers, rel = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":
            base, name = root, "memory.max"
        elif "memory" in controllers.split(","):
            base, name = root / "memory", "memory.limit_in_bytes"
        else:
            continue
        folder = base / rel.strip("/")
        while folder != base and base in folder.parents:
            files.append(folder / name)
            folder = folder.parent
    limits = [n for n in map(_limit, files) if n is not None]
    return min(limits) if limits else None


def probe_cards(timeout_s: float = 120.0) -> list[tuple[int, int]]:
    """[(free, total)] per card through CuPy in a child process; [] without CuPy or a card."""
    import importlib.util
    if importlib.util.find_spec("cupy") is None:
        return []
    try:
        out = subprocess.run([sys.executable, "-c", _CARD_PROBE], capture_output=True, timeout=timeout_s, check=True)
        return [(int(f), int(t)) for f, t in json.loads(out.stdout)]
    except (subprocess.SubprocessError, ValueError, OSError):
        return []


def host_total_bytes() -> tuple[int, int | None]:
    """(the machine's RAM, the cgroup limit or None)."""
    return int(psutil.virtual_memory().total), cgroup_limit_bytes()


def capacity_from(host_total: int, cgroup_limit: int | None, cards: list[tuple[int, int]], cfg: dict) -> Capacity:
    """Pure: what leases may hold, after caps and reserves."""
    host = host_total if cgroup_limit is None else min(host_total, cgroup_limit)
    h = cfg.get("host", {})
    host = min(host, h.get("cap_bytes", host)) - h.get("reserve_bytes", 0)
    card_caps = []
    for i, (_free, total) in enumerate(cards):
        c = {**cfg.get("cards", {}), **cfg.get("card", {}).get(i, {})}
        card_caps.append(max(0, min(total, c.get("cap_bytes", total)) - c.get("reserve_bytes", 0)))
    return Capacity(max(0, host), tuple(card_caps))
