"""The prompt path's MoE layout (bloomery/engine/cuda/moe_buckets.py), on the CPU."""
from __future__ import annotations

import numpy as np
import pytest

from bloomery.engine.cuda.moe_buckets import layout, padded


def test_padded_sizes_step_by_at_most_one_and_a_half():
    assert [padded(c) for c in (1, 16, 17, 24, 25, 32, 33, 48, 49, 4096, 4097)] == \
        [16, 16, 24, 24, 32, 32, 48, 48, 64, 4096, 6144]
    for c in range(17, 9000, 7):
        assert c <= padded(c) <= 1.5 * c, c


@pytest.mark.parametrize("seed", range(5))
def test_every_expert_gets_its_own_rows_and_the_buffer_stays_small(seed):
    rng = np.random.default_rng(seed)
    e = 128
    # skewed like a random router: a few experts take most tokens, some none
    counts = rng.zipf(1.6, e).clip(0, 4096) * rng.integers(0, 2, e)
    lay = layout(counts)
    used = np.flatnonzero(counts)
    assert (lay.base[counts == 0] == -1).all()
    spans = sorted((int(lay.base[x]), int(lay.base[x]) + int(counts[x])) for x in used)
    for (a0, a1), (b0, _) in zip(spans, spans[1:]):
        assert a1 <= b0                                        # no two experts share a row
    assert spans[-1][1] <= lay.n_rows
    assert lay.n_rows <= 1.5 * counts.sum() + 16 * len(used)
    assert lay.n_experts_used == len(used)
    for b in lay.buckets:                                      # each bucket: uniform stride M
        for j, x in enumerate(b.experts):
            assert lay.base[x] == b.row0 + j * b.rows and counts[x] <= b.rows


def test_one_hot_expert_and_empty_and_bad_input():
    lay = layout([0, 4096, 0, 1])
    assert [(b.rows, b.experts) for b in lay.buckets] == [(4096, (1,)), (16, (3,))]
    assert lay.base.tolist() == [-1, 0, -1, 4096] and lay.n_rows == 4112
    assert layout([0, 0]).n_rows == 0
    with pytest.raises(ValueError, match="non-negative"):
        layout([1, -1])
