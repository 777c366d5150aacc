"""Progress records while the weights are read: about one an interval, bytes done, total and
percent, through the stage's records path (a PUSH socket to the supervisor's PULL, whose
StageRunner prints them)."""
from __future__ import annotations

import asyncio
import io

import zmq
import zmq.asyncio

from conftest import load_tool


def _drain(pull) -> list:
    from bloomery.messages import stage as sm
    out = []
    while pull.poll(500):
        out.append(sm.decode(pull.recv()))
    return out


def test_loading_sends_progress_through_the_records_path(synthetic_dir, tmp_path):
    from bloomery import records
    from bloomery.engine.loader import load_model
    from bloomery.messages import stage as sm
    from bloomery.placement import whole
    from bloomery.stage_runner import StageRunner
    from bloomery.stages.engine import LoadProgress

    path = load_tool("make_synthetic").write_synthetic(synthetic_dir / "progress-qwen2.gguf", arch="qwen2", n_layer=6)
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(f"ipc://{tmp_path}/stage")
    ticks = iter(range(10**6))
    try:
        records.configure(component="engine", push_addr=f"ipc://{tmp_path}/stage", ctx=ctx)   # as a stage does
        # a clock one second further at each tensor, and a 3 s interval: a record about every third tensor
        model = load_model(str(path), whole("numpy", 1, 64), progress=LoadProgress(3.0, clock=lambda: next(ticks)))
        records.push_socket().close(linger=2000)
        sent = _drain(pull)
    finally:
        records._state["push"] = None               # this process is no stage after the test
        pull.close(linger=0)
        ctx.term()
    total, n_tensors = model.bytes_total, len(model.gf.tensors)
    assert sent and all(isinstance(m, sm.Progress) and (m.phase, m.component, m.unit, m.total) ==
                        ("load", "engine", "bytes", total) for m in sent)
    done = [m.done for m in sent]
    assert done == sorted(done) and done[-1] == total and 0 < done[0] < total
    assert n_tensors // 4 <= len(sent) <= n_tensors // 2 + 2, (len(sent), n_tensors)

    # the supervisor's side: each becomes a record with the percent
    stream = io.StringIO()
    records.configure(component="bloomery-serve", stream=stream)

    async def relay():
        actx = zmq.asyncio.Context()
        apull, push = actx.socket(zmq.PULL), actx.socket(zmq.PUSH)
        apull.bind(f"ipc://{tmp_path}/sup")
        push.connect(f"ipc://{tmp_path}/sup")
        for m in sent:
            await push.send(sm.encode(m))
        task = asyncio.ensure_future(StageRunner("", asyncio.Event()).read_messages(apull))
        await asyncio.sleep(0.5)
        task.cancel()
        push.close(linger=0)
        apull.close(linger=0)
        actx.term()
    asyncio.run(relay())
    lines = [line for line in stream.getvalue().splitlines() if "progress" in line]
    assert len(lines) == len(sent)
    # each record starts with its time and level (records.py), then the phase and the text
    assert lines[-1].endswith(f" [load] engine: progress done={total} total={total} unit=bytes percent=100.0")
    assert f"percent={round(100 * done[0] / total, 1)}" in lines[0]


def test_load_progress_paces_itself():
    from bloomery.stages.engine import LoadProgress
    sent, now = [], [0.0]
    p = LoadProgress(1.0, send=sent.append, clock=lambda: now[0])
    for done in range(0, 100, 10):                   # ten calls in 0.45 s: the first one only
        p(done, 100)
        now[0] += 0.05
    assert [m.done for m in sent] == [0]
    now[0] += 1.0
    p(95, 100)
    p(100, 100)
    p(100, 100)                                      # the end goes once, whatever the interval
    assert [m.done for m in sent] == [0, 95, 100]
