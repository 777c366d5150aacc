"""The supervisor's wait for a stage's outcome: a stage that exits 0 has sent it, however late it is read."""
from __future__ import annotations

import asyncio
import sys

import pytest

from bloomery import stage_runner
from bloomery.messages import stage as sm
from bloomery.stage_runner import StageFailed, StageRunner


async def _exited(code: int):
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", f"raise SystemExit({code})")
    await proc.wait()
    return proc


def _late(runner: StageRunner, msg, delay_s: float) -> None:
    asyncio.get_running_loop().call_later(delay_s, runner.outcomes.put_nowait, msg)


def test_an_outcome_read_seconds_after_a_clean_exit_is_taken():
    async def go():
        runner = StageRunner("ipc:///nowhere", asyncio.Event())
        proc = await _exited(0)
        _late(runner, sm.FetchDone("/m.gguf"), 2.5)          # a loaded machine: read long after the exit
        return await runner.next_outcome("fetch", proc)
    assert asyncio.run(go()) == sm.FetchDone("/m.gguf")


def test_an_outcome_that_never_comes_is_a_named_error(monkeypatch):
    monkeypatch.setattr(stage_runner, "OUTCOME_AFTER_EXIT_S", 0.3)

    async def go():
        runner = StageRunner("ipc:///nowhere", asyncio.Event())
        await runner.next_outcome("plan", await _exited(0))
    with pytest.raises(StageFailed, match=r"plan: exited with status 0 but its outcome never arrived "
                                          r"\(waited 0.3 s after the exit\)"):
        asyncio.run(go())


def test_a_failed_exit_without_an_outcome_names_its_status():
    async def go():
        runner = StageRunner("ipc:///nowhere", asyncio.Event())
        await runner.next_outcome("engine", await _exited(3))
    with pytest.raises(StageFailed, match=r"engine: exited with status 3 \(exit 3\) before it finished"):
        asyncio.run(go())


def test_a_stop_while_waiting_after_the_exit_ends_the_wait():
    async def go():
        stop = asyncio.Event()
        runner = StageRunner("ipc:///nowhere", stop)
        proc = await _exited(0)
        asyncio.get_running_loop().call_later(0.3, stop.set)
        return await asyncio.wait_for(runner.next_outcome("fetch", proc), 5)
    assert asyncio.run(go()) is None
