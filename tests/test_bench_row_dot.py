"""tools/bench_row_dot.py: the one-row product's rate with and without reading ahead, built and run here; the
outputs' hash is the same for every setting (reading ahead never changes a product)."""
from __future__ import annotations

import shutil

import pytest

from tests.conftest import load_tool


@pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")), reason="no C compiler")
def test_rates_and_the_same_outputs_for_every_setting(capsys):
    load_tool("bench_row_dot").main(["--rows", "64", "--prefetch", "0,1024", "--hints", "3,0", "--copies", "1,2",
                                     "--reps", "2"])
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines()[1:]]
    assert len(rows) == 2 * 2 * 3                          # types x copies x (no prefetch, two hints)
    for kind in ("q4k", "q6k"):
        mine = [r for r in rows if r[0] == kind]
        assert all(float(r[5]) > 0 and float(r[6]) > 0 for r in mine)
        assert len({r[7] for r in mine}) == 1               # one hash: the same outputs


def test_bad_types_are_refused_by_name():
    with pytest.raises(SystemExit, match="--types takes q4k and q6k"):
        load_tool("bench_row_dot").main(["--types", "q5k"])
