"""What every stage process does first: die with its parent, send records to the supervisor.

A stage runs as `python -m bloomery.stages.NAME RECORDS_ADDR ARGS_JSON`; RECORDS_ADDR
is the supervisor's PULL socket (ipc:// in its 0700 runtime folder) and ARGS_JSON
the few settings the stage needs. Any failure ends the stage with a Dead message
naming it (never a silent exit).
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import traceback
from typing import Callable

from bloomery import records
from bloomery.messages import stage as sm

PR_SET_PDEATHSIG = 1
BLAS_THREADS_VAR = "OPENBLAS_NUM_THREADS"


class StageRefusal(Exception):
    """A named refusal (bad file, plan does not fit): Dead with this text, exit 1, no traceback."""


def die_with_parent() -> None:
    """The kernel sends SIGKILL when the supervisor dies, so no stage outlives it."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass                               # not Linux: the engine loop also polls getppid()


def import_numpy_one_blas_thread() -> None:
    """numpy imported with its OpenBLAS on one thread, in a process that multiplies no matrix worth more
    (the supervisor, the plan stage, the tokenizer process): as it loads, OpenBLAS starts a thread per core,
    about 0.1 s of CPU of every such process's start. The variable is set for the import only, so the
    processes this one starts later (the engine, whose kernels use those threads: engine/quant/threads.py;
    a router's servers) see the environment as it was. A value the user set is kept."""
    if "numpy" in sys.modules or BLAS_THREADS_VAR in os.environ:
        return
    os.environ[BLAS_THREADS_VAR] = "1"
    try:
        import numpy  # noqa: F401
    finally:
        del os.environ[BLAS_THREADS_VAR]


def parent_alive(ppid: int) -> bool:
    return os.getppid() == ppid


def run_stage(name: str, main: Callable[[dict], int | None]) -> None:
    """Entry point of `python -m bloomery.stages.NAME`."""
    die_with_parent()
    if len(sys.argv) != 3:
        sys.stderr.write(f"usage: python -m bloomery.stages.{name} RECORDS_ADDR ARGS_JSON\n")
        sys.exit(2)
    # the supervisor handles Ctrl-C and tells us to stop; a terminal's SIGINT must not kill us mid-call
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    records.configure(component=name, push_addr=sys.argv[1])
    for key in json.loads(os.environ.get("BLOOMERY_SECRETS", "[]")):
        records.add_secret(key)
    code = 1
    try:
        args = json.loads(sys.argv[2])
        code = main(args) or 0
    except StageRefusal as e:
        records.send(sm.Dead(name, str(e)))
    except Exception as e:   # a crash still names itself to the supervisor
        tb = traceback.format_exc(limit=6)
        records.record("dead", f"{type(e).__name__}: {e}", component=name, level="error", traceback=tb)
        records.send(sm.Dead(name, f"{type(e).__name__}: {e}"))
    finally:
        sock = records.push_socket()
        if sock is not None:
            sock.close(linger=2000)        # flush queued records before the process ends
    end(code)


def end(code: int) -> None:
    """The stage's exit once its work is done: every queued message delivered (the context's term waits for
    each socket's linger; pyzmq leaves the context unterminated at an interpreter exit), the streams flushed,
    then no interpreter teardown, which freed the engine's model and modules one object at a time on every
    stop (the supervisor waits for the engine's exit)."""
    import zmq
    zmq.Context.instance().destroy(linger=2000)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
