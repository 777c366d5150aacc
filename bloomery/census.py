"""The census: what memory this start may use (host available RAM, each card's free bytes)."""
from __future__ import annotations

from pathlib import Path

import psutil

from bloomery.plan import Census


def _room(folder: Path, limit_name: str, usage_name: str) -> int | None:
    """limit - usage in one cgroup folder; None where it sets no limit."""
    try:
        raw = (folder / limit_name).read_text().strip()
    except OSError:
        return None
    if not raw.isdigit() or int(raw) >= 1 << 60:        # "max" (v2), ~2**63 (v1): no limit
        return None
    try:
        used = int((folder / usage_name).read_text().strip())
    except (OSError, ValueError):
        used = 0
    return max(0, int(raw) - used)


def cgroup_limit_bytes(root: Path = Path("/sys/fs/cgroup"),
                       proc_cgroup: Path = Path("/proc/self/cgroup")) -> int | None:
    """The least room any memory cgroup above this process leaves (v2 and v1); None if unlimited.

    A container's limit sits on its own cgroup (named in /proc/self/cgroup), or on the
    root of the mount when the container has its own cgroup namespace; every level counts."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    places = [(root, "memory.max", "memory.current"),
              (root / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes")]
    for line in lines:
        _, controllers, rel = (line.split(":", 2) + ["", ""])[:3]
        base = root if controllers == "" else root / "memory" if "memory" in controllers.split(",") else None
        if base is None:
            continue
        names = ("memory.max", "memory.current") if controllers == "" else \
            ("memory.limit_in_bytes", "memory.usage_in_bytes")
        folder = base / rel.strip("/")
        while folder != base and base in folder.parents:
            places.append((folder, *names))
            folder = folder.parent
    rooms = [r for r in (_room(*p) for p in places) if r is not None]
    return min(rooms) if rooms else None


def card_free_bytes() -> tuple[int, ...]:
    """Free bytes of each visible CUDA card, through CuPy when it is installed; () otherwise."""
    return tuple(free for _, _, free in cards())


def cards() -> list[tuple[str, int, int]]:
    """(name, total bytes, free bytes) of each visible CUDA card through CuPy; [] without CuPy or a card."""
    try:
        import cupy  # noqa: PLC0415 -- optional: the core runs without it
    except ImportError:
        return []
    out = []
    try:
        for i in range(cupy.cuda.runtime.getDeviceCount()):
            with cupy.cuda.Device(i):
                free, total = cupy.cuda.runtime.memGetInfo()
            name = cupy.cuda.runtime.getDeviceProperties(i)["name"]
            out.append((name.decode() if isinstance(name, bytes) else str(name), int(total), int(free)))
    except cupy.cuda.runtime.CUDARuntimeError:
        pass
    return out


def device_list(found: list[tuple[str, int, int]]) -> str:
    """--list-devices: llama-server's listing (CUDA<N>: name (total MiB, free MiB free); the CPU is not listed)."""
    mib = 1 << 20
    rows = [f"  CUDA{i}: {name} ({total // mib} MiB, {free // mib} MiB free)" for i, (name, total, free) in
            enumerate(found)]
    return "Available devices:\n" + "\n".join(rows or ["  (none)"]) + "\n"


def take_census() -> Census:
    host = int(psutil.virtual_memory().available)
    limit = cgroup_limit_bytes()
    if limit is not None:
        host = min(host, limit)
    return Census(host_avail_bytes=host, card_free_bytes=card_free_bytes())


if __name__ == "__main__":   # bloomery-serve --list-devices runs this in a child, so the front never imports CuPy
    import sys

    sys.stdout.write(device_list(cards()))
