"""A piece carries the timings of the moment it was made: choices.merge_pieces reads a generation ahead into
its queue, so a reader that asked the outcome instead saw a later pass's counts (llama.cpp's
test_metrics_timings_on_prompt_progress caught a first progress chunk reporting prompt_n 64, not 0)."""
from __future__ import annotations

import asyncio

from bloomery.api.choices import merge_pieces
from bloomery.api.generate import Outcome, Piece


class RunsAhead:
    """Three prompt passes of 8 ids, each piece made with the outcome's timings as generate.py makes them."""

    def __init__(self):
        self.outcome = Outcome(n_prompt=24)

    async def pieces(self):
        for done in (0, 8, 16):
            self.outcome.progress_n = done
            yield Piece("", [], [], progress={"processed": done}, timings=self.outcome.timings())
        self.outcome.progress_n = None


def test_pieces_keep_their_own_timings_behind_the_queue():
    async def read():
        g = RunsAhead()
        got = []
        async for _, piece in merge_pieces([g]):
            await asyncio.sleep(0.01)                     # the reader runs behind: the pump has moved on
            got.append((piece.progress["processed"], piece.timings["prompt_n"], g.outcome.timings()["prompt_n"]))
        return got
    got = asyncio.run(read())
    assert [(p, n) for p, n, _ in got] == [(0, 0), (8, 8), (16, 16)]
    assert got[0][2] != 0                                 # what asking the outcome would have said
