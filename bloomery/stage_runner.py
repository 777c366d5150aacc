"""The supervisor's stage processes: start one, read what the stages send, wait for an outcome.

A stage runs as `python -m bloomery.stages.NAME RECORDS_ADDR ARGS_JSON` in its own
process group (so a terminal's Ctrl-C reaches the supervisor only). Every stage PUSHes
records and one outcome (FetchDone, PlanDone, Ready) or Dead to the supervisor's PULL
socket at RECORDS_ADDR, in a private 0700 runtime folder.
"""
from __future__ import annotations

import asyncio
import json
import re
import os
import shutil
import signal
import stat
import sys
import tempfile

from bloomery import records
from bloomery.messages import stage as sm
from bloomery.records import record

# A stage that exits 0 has sent its outcome before exiting; on a loaded machine the supervisor may read it
# well after the exit. Wait this long for it (a status other than 0: a short grace for a Dead on its way).
OUTCOME_AFTER_EXIT_S = 120.0
OUTCOME_AFTER_FAILURE_S = 1.0


class StageFailed(Exception):
    exit_code: int | None = None     # the server's exit status when it is not the supervisor's default

    def __init__(self, stage: str, reason: str):
        super().__init__(f"{stage}: {reason}")
        self.stage, self.reason = stage, reason


RUNTIME_NAME = re.compile(r"bloomery-(\d+)(-[A-Za-z0-9_]+)?")


def clean_stale_runtime_dirs(base: str) -> list[str]:
    """Removes the runtime folders a killed supervisor (kill -9: no cleanup ran) left in `base`; returns them.
    Only a folder named as ours, owned by this user, mode 0700, holding nothing but sockets, whose pid is
    not running; anything else is left alone."""
    removed = []
    try:
        names = os.listdir(base)
    except OSError:
        return removed
    for name in names:
        m = RUNTIME_NAME.fullmatch(name)
        if m is None or int(m.group(1)) == os.getpid():
            continue
        path = os.path.join(base, name)
        try:
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) != 0o700:
                continue
            if not all(stat.S_ISSOCK(os.lstat(os.path.join(path, e)).st_mode) for e in os.listdir(path)):
                continue
        except OSError:
            continue
        if _pid_running(int(m.group(1))):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:          # EPERM: another user's process
        return True
    return True


def runtime_dir() -> str:
    """A private 0700 folder for the ipc sockets: $XDG_RUNTIME_DIR/bloomery-<pid>, else a tempdir. Folders a
    killed supervisor left there are removed first (clean_stale_runtime_dirs)."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    for stale in clean_stale_runtime_dirs(base if base and os.path.isdir(base) else tempfile.gettempdir()):
        record("start", "removed the runtime folder of a supervisor no longer running", path=stale)
    if base and os.path.isdir(base) and os.access(base, os.W_OK):
        path = os.path.join(base, f"bloomery-{os.getpid()}")
        shutil.rmtree(path, ignore_errors=True)   # a stale folder of a dead process with our pid
        os.mkdir(path, 0o700)
    else:
        path = tempfile.mkdtemp(prefix=f"bloomery-{os.getpid()}-")
    os.chmod(path, 0o700)
    return path


def signal_name(returncode: int | None) -> str:
    if returncode is not None and returncode < 0:
        try:
            return signal.Signals(-returncode).name
        except ValueError:
            pass
    return f"exit {returncode}"


class StageRunner:
    """Starts stages and hands their outcomes over; `stop` (set on SIGINT/SIGTERM) ends any wait."""

    def __init__(self, stage_addr: str, stop: asyncio.Event, phase=lambda: "-"):
        self.stage_addr = stage_addr
        self.stop = stop
        self.phase = phase                     # the current phase's name, for the records
        self.procs: dict[str, asyncio.subprocess.Process] = {}
        self.outcomes: asyncio.Queue = asyncio.Queue()

    async def read_messages(self, pull) -> None:
        """Relay records to stderr, queue outcomes; runs as a task until cancelled."""
        while True:
            data = await pull.recv()
            try:
                msg = sm.decode(data)
            except Exception as e:   # MessageError: a stage bug; say so and go on
                record("serve", "stage message refused", level="error", error=str(e))
                continue
            if isinstance(msg, sm.Record):
                records.emit(msg)
            elif isinstance(msg, sm.Progress):
                record(msg.phase, "progress", component=msg.component, done=msg.done, total=msg.total, unit=msg.unit,
                       percent=round(100 * msg.done / msg.total, 1) if msg.total else None)
            else:
                self.outcomes.put_nowait(msg)

    async def start(self, name: str, args: dict) -> asyncio.subprocess.Process:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", f"bloomery.stages.{name}", self.stage_addr, json.dumps(args),
            stdin=asyncio.subprocess.DEVNULL, start_new_session=True)   # own group: Ctrl-C reaches us only
        self.procs[name] = proc
        record(self.phase(), "stage started", stage=name, pid=proc.pid)
        return proc

    async def next_outcome(self, name: str, proc) -> object:
        """The stage's next outcome message; StageFailed when it dies or sends Dead; None on stop."""
        waits = {asyncio.ensure_future(self.outcomes.get()), asyncio.ensure_future(proc.wait()),
                 asyncio.ensure_future(self.stop.wait())}
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        got = [w.result() for w in done if w.done() and not w.cancelled()]
        msg = next((g for g in got if isinstance(g, (sm.FetchDone, sm.PlanDone, sm.Ready, sm.Dead))), None)
        if msg is None and proc.returncode is not None and not self.stop.is_set():
            msg = await self._outcome_after_exit(name, proc.returncode)
        if msg is None:
            return None           # stop requested
        if isinstance(msg, sm.Dead):
            raise StageFailed(msg.stage, msg.reason)
        return msg

    async def _outcome_after_exit(self, name: str, returncode: int) -> object:
        """The outcome still on its way behind the stage's exit (None: a stop came first)."""
        bound_s = OUTCOME_AFTER_EXIT_S if returncode == 0 else OUTCOME_AFTER_FAILURE_S
        got = asyncio.ensure_future(self.outcomes.get())
        stop = asyncio.ensure_future(self.stop.wait())
        try:
            await asyncio.wait({got, stop}, timeout=bound_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            if not got.done():
                got.cancel()
        if got.done() and not got.cancelled():
            return got.result()
        if self.stop.is_set():
            return None
        if returncode == 0:
            raise StageFailed(name, f"exited with status 0 but its outcome never arrived "
                              f"(waited {bound_s:g} s after the exit)")
        raise StageFailed(name, f"exited with status {returncode} ({signal_name(returncode)}) before it finished")

    def kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.returncode is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)   # each stage leads its own process group
                except ProcessLookupError:
                    pass

    async def reap(self) -> None:
        for proc in self.procs.values():
            if proc.returncode is None:
                await proc.wait()
