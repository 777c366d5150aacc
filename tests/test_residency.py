"""The adaptive residency policy (bloomery/residency.py): counts in, moves out, budget kept."""
import numpy as np
import pytest

from bloomery.residency import Move, apply, keep_per_update, moves, rank

MB = 1 << 20


def test_hottest_host_expert_swaps_with_coldest_card_expert():
    counts = [[9, 0, 1, 7]]                   # expert 0 and 3 hot; 1 and 2 on the card
    got = moves(counts, [frozenset({1, 2})], [3 * MB], budget=10 * MB)
    assert got == (Move(0, 0, 1, 9, 3 * MB), Move(0, 3, 2, 6, 3 * MB))
    assert apply([frozenset({1, 2})], got) == (frozenset({0, 3}),)


def test_budget_is_kept_and_largest_gains_go_first():
    counts = [[10, 0, 0, 0], [0, 0, 50, 0], [0, 5, 0, 0]]
    held = [frozenset({3}), frozenset({0}), frozenset({0})]
    got = moves(counts, held, [2 * MB, 2 * MB, 2 * MB], budget=4 * MB)
    assert [(m.layer, m.into_card) for m in got] == [(1, 2), (0, 0)]
    assert sum(m.nbytes for m in got) <= 4 * MB
    assert moves(counts, held, [2 * MB] * 3, budget=2 * MB - 1) == ()


def test_a_smaller_expert_that_fits_is_still_moved():
    counts = [[9, 0], [0, 3]]
    got = moves(counts, [frozenset({1}), frozenset({0})], [5 * MB, 1 * MB], budget=2 * MB)
    assert [(m.layer, m.into_card) for m in got] == [(1, 1)]


def test_no_move_when_the_card_holds_the_hottest():
    counts = [[0, 8, 8, 1], [4, 4, 4, 4]]
    assert moves(counts, [frozenset({1, 2}), frozenset({0, 3})], [MB, MB], budget=100 * MB) == ()


def test_ties_are_stable_and_repeatable():
    counts = [[3, 3, 3, 3, 3]]
    assert moves(counts, [frozenset({4})], [MB], 10 * MB) == ()
    counts = [[5, 5, 1, 1]]                    # two equally hot host experts, two equally cold card ones
    a = moves(counts, [frozenset({2, 3})], [MB], 1 * MB)
    assert a == moves(counts, [frozenset({3, 2})], [MB], 1 * MB) == (Move(0, 0, 2, 4, MB),)


def test_the_ranking_forgets_at_the_half_life():
    assert keep_per_update(16, 16) == 32768                                # one update's steps: older routing halves
    assert keep_per_update(256, 16) == round(65536 * 0.5 ** (1 / 16))
    old = np.array([[9 << 8, 4 << 8, 1 << 8]], np.int64)
    assert rank(old, np.zeros((1, 3), np.int32), keep_per_update(16, 16)).tolist() == [[9 << 7, 4 << 7, 1 << 7]]
    # new picks enter times 2**8, so a slow decay keeps the fractions and the order of close counts
    slow = rank(old, np.array([[0, 1, 0]]), keep_per_update(256, 16))
    assert slow.dtype == np.int64 and slow[0, 0] > slow[0, 1] > slow[0, 2]
    assert slow[0, 1] == (((4 << 8) * keep_per_update(256, 16)) >> 16) + 256
    # after 256 steps of no routing (16 updates) a count weighs about half
    s = old
    for _ in range(16):
        s = rank(s, np.zeros((1, 3), np.int64), keep_per_update(256, 16))
    assert s[0, 0] == pytest.approx((9 << 8) / 2, rel=0.01)
    with pytest.raises(ValueError, match="half-life of 0 steps"):
        keep_per_update(0, 16)


@pytest.mark.parametrize("args,match", [
    (([[1, 2]], [frozenset(), frozenset()], [MB], MB), "must match"),
    (([[1, -2]], [frozenset()], [MB], MB), "negative routing count"),
    (([[1, 2]], [frozenset({5})], [MB], MB), "holds expert 5"),
    (([[1, 2]], [frozenset({0})], [MB], -1), "byte budget of -1"),
])
def test_bad_input_is_refused(args, match):
    with pytest.raises(ValueError, match=match):
        moves(*args)


def test_the_bus_takes_the_rounded_share_of_a_steps_host_picks():
    from bloomery.residency import STREAM_SHARE, bus_picks
    assert [bus_picks(m, 0.45) for m in range(9)] == [0, 0, 1, 1, 2, 2, 3, 3, 4]
    assert [bus_picks(m, 0.5) for m in range(5)] == [0, 1, 1, 2, 2]       # halves go to the bus
    assert all(bus_picks(m, 0.0) == 0 and bus_picks(m, 1.0) == m for m in range(65))
    assert all(0 <= bus_picks(m, STREAM_SHARE) <= m for m in range(257))
    with pytest.raises(ValueError, match="share"):
        bus_picks(8, 1.5)

@pytest.mark.parametrize("name,reader,default,good,value,bads", [
    ("BLOOMERY_RESIDENCY_HALF_LIFE", "half_life", "HALF_LIFE", "512", 512, ("0", "-3", "1.5", "long")),
    ("BLOOMERY_STREAM_SHARE", "stream_share", "STREAM_SHARE", "0.25", 0.25, ("half", "-0.1", "2")),
    ("BLOOMERY_RESIDENCY_PROMPT_WEIGHT", "prompt_weight", None, "0.03", 0.03, ("some", "-0.5", "1.5")),
])
def test_each_lever_comes_from_the_environment_and_a_bad_value_is_named(monkeypatch, name, reader, default, good,
                                                                         value, bads):
    import bloomery.residency as res
    read = getattr(res, reader)
    monkeypatch.delenv(name, raising=False)
    assert read() == (getattr(res, default) if default else 1.0)
    monkeypatch.setenv(name, good)
    assert read() == value
    for bad in bads:
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=name):
            read()


def test_a_prompts_counts_weigh_as_the_lever_says():
    from bloomery.residency import weigh_prompt
    recent = np.array([[4096, 7, 0], [3, 1, 512]], np.int64)
    assert weigh_prompt(recent, 1.0) is recent                             # the default: the counts as they are
    assert weigh_prompt(recent, 0.03).tolist() == [[122, 0, 0], [0, 0, 15]]   # rounded down
    assert weigh_prompt(recent, 0.0).tolist() == [[0, 0, 0], [0, 0, 0]]


def _reference_moves(counts, on_card, expert_bytes, budget):
    """The policy as first written, one layer and one pair at a time (what the array form must equal)."""
    every = []
    for layer, (row, held) in enumerate(zip(counts, on_card)):
        hot = sorted((e for e in range(len(row)) if e not in held), key=lambda e: (-row[e], e))
        cold = sorted(held, key=lambda e: (row[e], e))
        for h, c in zip(hot, cold):
            if row[h] <= row[c]:
                break
            every.append(Move(layer, h, c, row[h] - row[c], expert_bytes[layer]))
    every.sort(key=lambda m: (-m.gain, m.layer, m.into_card))
    chosen, spent = [], 0
    for m in every:
        if spent + m.nbytes <= budget:
            chosen.append(m)
            spent += m.nbytes
    return tuple(chosen)


@pytest.mark.parametrize("seed", range(40))
def test_the_array_policy_equals_the_pair_by_pair_one(seed):
    """Random layers (ties frequent: counts drawn from a few values), slots from none to all, sizes that differ
    by layer, budgets from nothing to everything; the card mask gives the same moves as the expert sets."""
    import numpy as np
    rng = np.random.default_rng(seed)
    n_layer, n_expert = int(rng.integers(1, 7)), int(rng.integers(1, 20))
    counts = rng.integers(0, int(rng.choice([3, 10, 1000])), (n_layer, n_expert))
    held = [frozenset(rng.choice(n_expert, int(rng.integers(0, n_expert + 1)), replace=False).tolist())
            for _ in range(n_layer)]
    sizes = [int(rng.choice([3, 5, 8])) for _ in range(n_layer)]
    budget = int(rng.integers(0, 3 * sum(sizes) + 1))
    want = _reference_moves(counts.tolist(), held, sizes, budget)
    assert moves(counts.tolist(), held, sizes, budget) == want
    mask = np.zeros((n_layer, n_expert), bool)
    for layer, h in enumerate(held):
        mask[layer, list(h)] = True
    assert moves(counts, mask, sizes, budget) == want
