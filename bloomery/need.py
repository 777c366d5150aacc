"""After plan, before load: hand the plan's need record to the need hook and wait for its grant.

The hook (--need-hook PATH, else $BLOOMERY_NEED_HOOK, else the shipped
hooks/bloomery-need when a broker socket exists, else none) reads the need record
as JSON on stdin; exit 0 grants the start, any other exit refuses it with the
hook's reason (hooks/README.md is the contract); exit 75 (EX_TEMPFAIL: not now, ask again)
ends the server with 75 and the hook's last stdout line as the reason, so a broker or systemd
can start it again later. While it runs the phase is
`queued` (every route answers 503 with phase queued) and each stderr line of the
hook becomes a record. The record's pid is this bloomery-serve process: the lease
lives as long as the server does, not as long as the hook.
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sys
from pathlib import Path

from bloomery.lifecycle import Phase
from bloomery.records import record
from bloomery.settings import SettingsError
from bloomery.stage_runner import StageFailed

SHIPPED_HOOK = Path(__file__).resolve().parents[1] / "hooks" / "bloomery-need"
DEFAULT_BROKER_DIR = "/run/bloomery-broker"
OFF_WORDS = ("", "none", "off")
HOOK_STOP_S = 3.0           # a hook told to stop (SIGTERM) gets this long to withdraw its need
EXIT_TEMPFAIL = 75          # the hook's "not now": the server ends with the same status


class NeedDeferred(StageFailed):
    """The hook answered 75: the server exits 75 so that whoever started it asks again later."""
    exit_code = EXIT_TEMPFAIL

    def __init__(self, reason: str):
        super().__init__("need", reason)


def broker_socket(env: dict) -> Path:
    if env.get("BLOOMERY_BROKER_SOCKET"):
        return Path(env["BLOOMERY_BROKER_SOCKET"])
    return Path(env.get("BLOOMERY_BROKER_DIR") or DEFAULT_BROKER_DIR) / "broker.sock"


def resolve_hook(flag_value: str | None, env: dict) -> list[str] | None:
    """The hook's argv, None when no hook runs; SettingsError when a named hook cannot run."""
    value, name = (flag_value, "--need-hook") if flag_value is not None else \
        (env.get("BLOOMERY_NEED_HOOK"), "BLOOMERY_NEED_HOOK")
    if value is not None:
        if value.strip().lower() in OFF_WORDS:
            return None
        if not os.path.isfile(value):
            raise SettingsError(f"{name} {value}: no such file")
        if not os.access(value, os.X_OK):
            raise SettingsError(f"{name} {value}: not executable")
        return [os.path.abspath(value)]
    if not broker_socket(env).exists():
        return None
    if SHIPPED_HOOK.is_file():       # the source tree: run it with this interpreter (it has pyzmq)
        return [sys.executable, str(SHIPPED_HOOK)]
    installed = shutil.which("bloomery-need")
    return [installed] if installed else None


def unit_name(env: dict, proc_cgroup: Path = Path("/proc/self/cgroup")) -> str | None:
    """$BLOOMERY_UNIT, else under systemd ($INVOCATION_ID) the .service our cgroup is named after."""
    if env.get("BLOOMERY_UNIT"):
        return env["BLOOMERY_UNIT"]
    if not env.get("INVOCATION_ID"):
        return None
    try:
        for line in proc_cgroup.read_text().splitlines():
            for part in reversed(line.split(":", 2)[-1].split("/")):
                if part.endswith(".service"):
                    return part
    except OSError:
        pass
    return None


def need_terms(planned) -> tuple[int, list[int]]:
    """(host bytes, card bytes per device) from the plan's Placement (Placement.need)."""
    if planned.placement is None:
        raise StageFailed("need", "the plan sent no placement")
    return planned.placement.need()


def need_record(planned, fetched, model_name: str, env: dict) -> dict:
    host_bytes, card_bytes = need_terms(planned)
    disk = fetched.n_bytes or sum(os.path.getsize(p) for p in (fetched.shards or (fetched.path,)) if os.path.exists(p))
    return {"version": 1, "pid": os.getpid(), "unit": unit_name(env), "model": model_name,
            "host_bytes": host_bytes, "card_bytes": card_bytes, "disk_bytes": int(disk)}


def _relay(line: str, last: dict) -> None:
    """One hook stderr line -> one record; remember the last reason it gave."""
    try:
        obj = json.loads(line)
    except ValueError:
        obj = None
    if isinstance(obj, dict):
        event = str(obj.pop("event", "hook"))
        if "reason" in obj:
            last["reason"] = str(obj["reason"])
        record("queued", event, component="need-hook", **obj)
    else:
        last["text"] = line
        record("queued", line, component="need-hook")


async def _read_lines(stream, last: dict, on_line=_relay) -> None:
    while True:
        raw = await stream.readline()
        if not raw:
            return
        line = raw.decode("utf-8", "replace").rstrip("\n")
        if line.strip():
            on_line(line[:4000], last)


def _keep_stdout(line: str, last: dict) -> None:
    last["stdout"] = line.strip()


async def negotiate(argv: list[str], need: dict, life, stop: asyncio.Event) -> bool:
    """Run the hook: True granted; False a stop signal came first; StageFailed names a refusal."""
    life.advance(Phase.QUEUED)
    record("queued", "need sent to the hook", hook=argv[-1], host_bytes=need["host_bytes"],
           card_bytes=need["card_bytes"], pid=need["pid"], unit=need["unit"])
    try:
        proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.PIPE,
                                                    stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE)
    except OSError as e:
        raise StageFailed("need", f"need hook {argv[-1]}: cannot run it ({e.strerror})") from None
    try:
        proc.stdin.write(json.dumps(need).encode())
        await proc.stdin.drain()
        proc.stdin.close()
    except (BrokenPipeError, ConnectionResetError):
        pass                         # a hook that reads nothing: its exit status still decides
    last: dict = {}
    reader = asyncio.ensure_future(asyncio.gather(_read_lines(proc.stderr, last),
                                                  _read_lines(proc.stdout, last, _keep_stdout)))
    done = asyncio.ensure_future(proc.wait())
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({done, stopped}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if not done.done():              # a stop signal while queued: the hook withdraws the need
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(done, HOOK_STOP_S)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()
        await reader
        return False
    await reader
    if proc.returncode == 0:
        record("queued", "granted", component="need-hook")
        return True
    if proc.returncode == EXIT_TEMPFAIL:
        reason = last.get("stdout") or last.get("reason") or last.get("text") or "no reason given"
        raise NeedDeferred(f"the need hook deferred the start (exit {EXIT_TEMPFAIL}): {reason}")
    reason = last.get("reason") or last.get("text") or "no reason given"
    raise StageFailed("need", f"the need hook refused the start (exit {proc.returncode}): {reason}")
