"""engine/cuda/kv_copies.py: the 2-D copies that save and restore one slot's K or V move exactly the bytes
numpy's slicing names, and nothing else, in both directions (checked here with numpy standing for the card:
each Copy2D applied as cudaMemcpy2D would, row by row)."""
from __future__ import annotations

import numpy as np
import pytest

from bloomery.engine.cuda.kv_copies import span_copies

SHAPE = (3, 4, 2, 40, 8)        # L, S, Hkv, C, Dh


def _apply(copies, dst: np.ndarray, src: np.ndarray, to_host: bool) -> None:
    """cudaMemcpy2D on byte views: height rows of width bytes, each pitch apart."""
    d, s = dst.reshape(-1).view(np.uint8), src.reshape(-1).view(np.uint8)
    for c in copies:
        (d_off, d_pitch, s_off, s_pitch) = ((c.host, c.host_pitch, c.dev, c.dev_pitch) if to_host
                                            else (c.dev, c.dev_pitch, c.host, c.host_pitch))
        for r in range(c.height):
            d[d_off + r * d_pitch:d_off + r * d_pitch + c.width] = s[s_off + r * s_pitch:s_off + r * s_pitch + c.width]


@pytest.mark.parametrize("slot,start,n", [(0, 0, 1), (1, 5, 17), (3, 0, 40), (2, 39, 40)])
def test_a_save_copies_the_slots_positions(slot, start, n):
    cache = np.random.default_rng(slot).standard_normal(SHAPE).astype(np.float16)
    host = np.zeros((SHAPE[0], SHAPE[2], n - start, SHAPE[4]), np.float16)
    _apply(span_copies(SHAPE, 2, slot, start, n - start, 0, n - start), host, cache, to_host=True)
    np.testing.assert_array_equal(host, cache[:, slot, :, start:n])


@pytest.mark.parametrize("keep,offset,n,held", [(0, 0, 10, 10), (4, 0, 12, 20), (7, 3, 15, 12), (39, 0, 40, 40)])
def test_a_restore_writes_those_positions_and_nothing_else(keep, offset, n, held):
    """Positions keep .. n-1 of slot 2 from a host copy whose first position is `offset` and which holds `held`."""
    rng = np.random.default_rng(keep + n)
    cache = rng.standard_normal(SHAPE).astype(np.float16)
    before = cache.copy()
    host = rng.standard_normal((SHAPE[0], SHAPE[2], held, SHAPE[4])).astype(np.float16)
    _apply(span_copies(SHAPE, 2, 2, keep, held, keep - offset, n - keep), cache, host, to_host=False)
    want = before.copy()
    want[:, 2, :, keep:n] = host[:, :, keep - offset:n - offset]
    np.testing.assert_array_equal(cache, want)


def test_out_of_range_spans_are_refused_by_name():
    with pytest.raises(ValueError, match="slot 4 is out of range"):
        span_copies(SHAPE, 2, 4, 0, 1, 0, 1)
    with pytest.raises(ValueError, match="not within the slot's 40"):
        span_copies(SHAPE, 2, 0, 35, 10, 0, 10)
    with pytest.raises(ValueError, match="not within the host copy's 5"):
        span_copies(SHAPE, 2, 0, 0, 5, 1, 5)
    with pytest.raises(ValueError, match="not within the slot's"):
        span_copies(SHAPE, 2, 0, 0, 5, 0, 0)
