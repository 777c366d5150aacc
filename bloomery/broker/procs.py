"""Process identity for leases: (pid, start time) through psutil, checked on every poll.

A pid alone is not an identity: once the process exits the kernel may hand the
same number to another. The broker stores the start time it read when the need
arrived and treats the lease's process as gone when the pid is free, a zombie,
or now belongs to a process that started at another time.

A lease also waits for the descendants it has seen (the server's engine stage
holds the memory; it dies with the supervisor through PDEATHSIG, a moment later).
"""
from __future__ import annotations

import os

import psutil

START_TOLERANCE_S = 0.005     # psutil derives start times from clock ticks (10 ms); one process reads the same


def start_time(pid: int) -> float | None:
    """The process's start time, None when there is no live process with that pid."""
    try:
        p = psutil.Process(pid)
        if p.status() == psutil.STATUS_ZOMBIE:      # exited, not reaped: holds no memory
            return None
        return p.create_time()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None
    except psutil.AccessDenied:                     # alive; another user's (hidepid): identity unknown
        return None


def same_process(pid: int, started: float) -> bool:
    t = start_time(pid)
    return t is not None and abs(t - started) <= START_TOLERANCE_S


def descendants(pid: int, started: float) -> list[tuple[int, float]]:
    """Every live descendant of the process (pid, start time); [] when the process is gone."""
    if not same_process(pid, started):
        return []
    try:
        kids = psutil.Process(pid).children(recursive=True)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []
    out = []
    for k in kids:
        try:
            out.append((k.pid, k.create_time()))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


def entry_alive(entry) -> bool:
    """A lease lives while its process or any descendant seen so far lives (a queued need: its process)."""
    if same_process(entry.need.pid, entry.start_time):
        return True
    return any(same_process(p, t) for p, t in entry.kids)


def same_session(pid_a: int, pid_b: int) -> bool:
    """Both processes live and in one session (os.getsid)."""
    try:
        return os.getsid(pid_a) == os.getsid(pid_b)
    except OSError:
        return False
