"""bloomery/routing_skew.py: the share of the routing taken by the busiest fifth of the experts."""
from __future__ import annotations

import pytest

from bloomery.routing_skew import best_static_share, routing_skew, top_share


def test_even_routing_scores_the_fraction_itself():
    assert top_share([7] * 128) == pytest.approx(0.2)
    assert top_share([3] * 10) == pytest.approx(0.2)
    assert routing_skew([[5] * 32, [1] * 32]) == pytest.approx(0.2)


def test_the_last_expert_counts_in_part():
    # 20 % of 8 experts is 1.6: the busiest whole and 0.6 of the second
    assert top_share([10, 5, 1, 1, 1, 1, 1, 0]) == pytest.approx((10 + 0.6 * 5) / 20)
    assert top_share([0, 0, 0, 20, 0, 0, 0, 0]) == 1.0                  # one expert takes all
    assert top_share([4, 2, 2, 2], top=0.5) == pytest.approx(6 / 10)
    assert top_share([1, 2, 3, 4], top=1.0) == 1.0
    assert top_share([2.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5], top=0.1) == pytest.approx(2.5 / 7)


def test_layers_are_averaged_and_empty_layers_left_out():
    hot = [0, 0, 0, 20, 0, 0, 0, 0, 0, 0]        # 1.0
    even = [2] * 10                               # 0.2
    assert routing_skew([hot, even]) == pytest.approx(0.6)
    assert routing_skew([hot, [0] * 10, even]) == pytest.approx(0.6)


@pytest.mark.parametrize("call,words", [
    (lambda: routing_skew([[0, 0], [0, 0]]), "no layer routed any token"),
    (lambda: routing_skew([]), "no layer routed any token"),
    (lambda: top_share([0, 0]), "a layer that routed nothing"),
    (lambda: top_share([]), "a layer with no experts"),
    (lambda: top_share([3, -1]), "a negative count (-1)"),
    (lambda: top_share([1, 2], top=0), "top fraction 0 must be in (0, 1]"),
    (lambda: top_share([1, 2], top=1.5), "top fraction 1.5"),
])
def test_bad_counts_are_refused_by_name(call, words):
    with pytest.raises(ValueError) as e:
        call()
    assert words in str(e.value)


def test_the_best_fixed_placement_takes_each_layers_most_picked():
    assert best_static_share([[5, 1, 3, 1], [2, 2, 2, 2]], [2, 1]) == pytest.approx((5 + 3 + 2) / 18)
    assert best_static_share([[5, 1], [0, 0]], [0, 2]) == 0.0            # no slots in the layer that routed
    assert best_static_share([[1, 1]], [5]) == 1.0                       # more slots than experts
    with pytest.raises(ValueError, match="2 layers of counts and 1 of slots"):
        best_static_share([[1], [1]], [1])
    with pytest.raises(ValueError, match="no layer routed"):
        best_static_share([[0, 0]], [1])
    with pytest.raises(ValueError, match="negative count"):
        best_static_share([[1, -1]], [1])
