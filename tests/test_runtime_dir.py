"""A runtime folder left by a killed supervisor is removed at the next start: only ours, only dead owners."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

from bloomery.stage_runner import clean_stale_runtime_dirs, runtime_dir


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def folder(base, name, mode=0o700, with_socket=True, extra_file=False):
    path = base / name
    path.mkdir()
    os.chmod(path, mode)
    if with_socket:
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(path / "req"))
        s.close()
    if extra_file:
        (path / "notes.txt").write_text("not ours to remove")
    return path


def test_only_our_folders_of_dead_pids_holding_only_sockets_are_removed(tmp_path, monkeypatch):
    pid = dead_pid()
    stale = folder(tmp_path, f"bloomery-{pid}")
    stale_tmp = folder(tmp_path, f"bloomery-{pid}-abc_12")
    live = folder(tmp_path, f"bloomery-{os.getppid()}")
    other_name = folder(tmp_path, f"bloomery-x{pid}")
    with_file = folder(tmp_path, f"bloomery-{pid}-f", extra_file=True)
    open_mode = folder(tmp_path, f"bloomery-{pid}-m", mode=0o755)
    (tmp_path / f"bloomery-{pid}-link").symlink_to(stale)
    removed = clean_stale_runtime_dirs(str(tmp_path))
    assert sorted(removed) == sorted([str(stale), str(stale_tmp)])
    assert not stale.exists() and not stale_tmp.exists()
    for kept in (live, other_name, with_file, open_mode, tmp_path / f"bloomery-{pid}-link"):
        assert os.path.lexists(kept)


def test_runtime_dir_cleans_before_it_makes_its_own(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    stale = folder(tmp_path, f"bloomery-{dead_pid()}")
    mine = runtime_dir()
    assert not stale.exists() and os.path.isdir(mine) and mine.startswith(str(tmp_path))
