"""systemd socket activation on the stdlib: the listening socket passed as LISTEN_FDS (fd 3 on).

sd_listen_fds(3): systemd passes N sockets at fds 3 .. 3+N-1 and sets LISTEN_FDS=N,
LISTEN_PID=<the pid meant> and, optionally, LISTEN_FDNAMES=name:name:... (FileDescriptorName=).
bloomery serves one HTTP port, so it takes exactly one listening stream socket (IPv4 or
IPv6; bloomery@.socket's ListenStream=). Anything else is refused by name rather than
guessed at: a LISTEN_PID that is not ours, counts that disagree, an fd that is not open,
not a socket, not a stream, not listening (Accept=yes passes connections), or not IP.
The variables are removed once read, so the stage processes never think they were passed
anything; the fd is made close-on-exec, so they do not inherit the port either.
"""
from __future__ import annotations

import os
import socket
import stat
from collections.abc import Mapping, MutableMapping

from bloomery.records import record
from bloomery.settings import SettingsError

LISTEN_FDS_START = 3
VARIABLES = ("LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES")


class ActivationError(SettingsError):
    """The socket-activation environment is inconsistent; the start is refused naming it."""


def passed_fds(env: Mapping[str, str], pid: int) -> list[tuple[int, str]] | None:
    """The (fd, name) pairs systemd passed to this process, None when it passed nothing (pure)."""
    raw_n = env.get("LISTEN_FDS")
    if raw_n is None:
        if "LISTEN_PID" in env or "LISTEN_FDNAMES" in env:
            raise ActivationError("LISTEN_PID/LISTEN_FDNAMES are set without LISTEN_FDS: "
                                  "an incomplete socket-activation environment")
        return None
    try:
        n_fds = int(raw_n)
    except ValueError:
        n_fds = -1
    if n_fds < 1:
        raise ActivationError(f"LISTEN_FDS={raw_n!r}: must be a count of passed sockets >= 1")
    raw_pid = env.get("LISTEN_PID")
    if raw_pid is None:
        raise ActivationError(f"LISTEN_FDS={raw_n} without LISTEN_PID: cannot tell the sockets are ours")
    try:
        listen_pid = int(raw_pid)
    except ValueError:
        raise ActivationError(f"LISTEN_PID={raw_pid!r}: must be a process id") from None
    if listen_pid != pid:
        raise ActivationError(f"LISTEN_PID={listen_pid}: the sockets were passed to another process "
                              f"(this one is {pid}); start bloomery-serve directly from the unit")
    raw_names = env.get("LISTEN_FDNAMES")
    names = raw_names.split(":") if raw_names else ["unknown"] * n_fds
    if len(names) != n_fds:
        raise ActivationError(f"LISTEN_FDNAMES={raw_names!r} names {len(names)} sockets, "
                              f"LISTEN_FDS={n_fds} passes {n_fds}")
    return [(LISTEN_FDS_START + i, names[i]) for i in range(n_fds)]


def _adopt(fd: int, name: str) -> socket.socket:
    """The passed fd as a listening IP stream socket, or ActivationError naming what it is."""
    where = f"LISTEN_FDS socket fd {fd} ({name})"
    try:
        mode = os.fstat(fd).st_mode
    except OSError as e:
        raise ActivationError(f"{where}: not open ({e.strerror})") from None
    if not stat.S_ISSOCK(mode):
        raise ActivationError(f"{where}: not a socket (a {_kind(mode)})")
    sock = socket.socket(fileno=fd)     # family and type are read from the fd
    try:
        if sock.type != socket.SOCK_STREAM:
            raise ActivationError(f"{where}: a {sock.type.name} socket; bloomery@.socket must use ListenStream=")
        if sock.family not in (socket.AF_INET, socket.AF_INET6):
            raise ActivationError(f"{where}: a {sock.family.name} socket; ListenStream= must be an IP "
                                  "address and port (or a port)")
        if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            raise ActivationError(f"{where}: not listening (Accept=yes passes one connection); "
                                  "the socket unit must use Accept=no")
    except ActivationError:
        sock.detach()                   # the fd stays systemd's; we only refuse it
        raise
    sock.set_inheritable(False)         # systemd passes it inheritable; stages must not hold the port
    return sock


def _kind(mode: int) -> str:
    for test, word in ((stat.S_ISREG, "regular file"), (stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "pipe"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device")):
        if test(mode):
            return word
    return "file of another kind"


def listening_socket(env: MutableMapping[str, str] | None = None, pid: int | None = None) -> socket.socket | None:
    """The one listening socket systemd passed, None when not socket-activated; ActivationError else."""
    env = os.environ if env is None else env
    fds = passed_fds(env, os.getpid() if pid is None else pid)
    for var in VARIABLES:               # read once; children must not see them (sd_listen_fds(unset=1))
        env.pop(var, None)
    if fds is None:
        return None
    if len(fds) != 1:
        raise ActivationError(f"LISTEN_FDS={len(fds)}: bloomery serves one port; the socket unit passes "
                              f"{', '.join(f'fd {fd} ({name})' for fd, name in fds)}; give it one ListenStream=")
    sock = _adopt(*fds[0])
    record("fetch", "socket passed by the service manager; --host/--port not used", component="systemd",
           fd=fds[0][0], name=fds[0][1])
    return sock
