"""The host-RAM prompt cache: its bookkeeping alone (engine/prompt_cache.py), then the engine over a
stand-in model whose KV is its ids: a state saved before another prompt overwrites the slot comes back."""
from __future__ import annotations

import time

import numpy as np
import pytest

from bloomery.engine.core import Engine
from bloomery.engine.prompt_cache import PromptCache
from test_engine_core import StandInModel, drain, greq


def state(n_pos: int, width: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """K and V of n_pos positions, `width` f16 values each: 2 * n_pos * width * 2 bytes."""
    return np.zeros((n_pos, width), np.float16), np.ones((n_pos, width), np.float16)


def test_bytes_are_the_arrays_nbytes_and_the_oldest_is_evicted_first():
    cache = PromptCache(budget_bytes=3 * 64)            # three states of 4 positions (64 bytes each)
    for first in (10, 20, 30):
        assert cache.save([first, 1, 2, 3], state(4))
    assert cache.n_bytes == 3 * 64 == sum(e.n_bytes for e in cache.entries()) and cache.n_entries == 3
    assert cache.best([10, 1, 9], more_than=0)[1] == 2   # using 10.. makes 20.. the oldest
    assert cache.save([40, 1, 2, 3], state(4))
    assert [e.ids[0] for e in cache.entries()] == [30, 10, 40] and cache.n_evicted == 1
    assert cache.save([50, 1, 2, 3, 4, 5, 6, 7], state(8))   # 128 bytes: the two oldest go
    assert [e.ids[0] for e in cache.entries()] == [40, 50] and cache.n_bytes == 64 + 128 <= cache.budget_bytes


def test_a_state_larger_than_the_budget_is_not_kept_and_evicts_nothing():
    cache = PromptCache(budget_bytes=100)
    assert cache.save([1, 2], state(2))
    assert not cache.save(list(range(10)), state(10))    # 160 bytes
    assert [e.ids for e in cache.entries()] == [(1, 2)] and cache.n_bytes == 32


def test_a_longer_state_replaces_its_prefixes_and_a_covered_one_is_not_saved_again():
    cache = PromptCache(budget_bytes=1000)
    cache.save([1, 2], state(2))
    cache.save([1, 2, 3, 4], state(4))
    assert [e.ids for e in cache.entries()] == [(1, 2, 3, 4)] and cache.n_bytes == 64
    assert cache.covers([1, 2, 3]) and not cache.covers([1, 2, 5])


def test_best_takes_the_longest_shared_prefix_above_what_the_slot_reuses():
    cache = PromptCache(budget_bytes=1000)
    cache.save([1, 2, 3, 4], state(4))
    cache.save([1, 2, 7, 8, 9], state(5))
    entry, n = cache.best([1, 2, 3, 4, 5], more_than=0)
    assert entry.ids == (1, 2, 3, 4) and n == 4
    assert cache.best([1, 2, 3, 4, 5], more_than=4) is None
    assert cache.best([9, 9], more_than=0) is None


def test_budget_zero_is_off_and_a_negative_budget_is_refused():
    assert not PromptCache(0).enabled and not PromptCache(0).save([1], state(1))
    with pytest.raises(ValueError, match="budget"):
        PromptCache(-1)


def rec(tag: int) -> tuple[np.ndarray]:
    """A recurrent state of 40 bytes, told apart by its tag."""
    return (np.full(10, tag, np.float32),)


def test_a_state_that_cannot_rewind_restores_only_at_its_marks():
    """An entry with marks (a recurrent state at its end and at checkpoints) restores the latest mark within the
    shared prefix, short of the whole prompt; its bytes count the marks."""
    cache = PromptCache(budget_bytes=10_000)
    ids = list(range(100, 110))
    assert cache.save(ids, state(10), marks=[(10, rec(10)), (4, rec(4))])
    (entry,) = cache.entries()
    assert entry.n_bytes == 160 + 2 * 40 == cache.n_bytes and [n for n, _ in entry.marks] == [4, 10]
    assert entry.mark(4)[0][0] == 4 and entry.mark(10)[0][0] == 10
    assert cache.best(ids + [7, 8], more_than=0)[1] == 10      # extends the entry: its end
    assert cache.best(ids, more_than=0)[1] == 4                # the same ids: not the end (one id must run)
    assert cache.best(ids[:7] + [1, 2], more_than=0)[1] == 4    # parts at 7: the mark before
    assert cache.best(ids[:7] + [1, 2], more_than=4) is None   # the live slot keeps as much
    assert cache.best(ids[:3] + [1, 2], more_than=0) is None   # parts before any mark
    # a KV cache alone (no marks) restores any shared prefix
    kv = PromptCache(budget_bytes=10_000)
    kv.save(ids, state(10))
    assert kv.best(ids[:7] + [1, 2], more_than=0)[1] == 7
    with pytest.raises(ValueError, match="one at its end"):
        cache.save([1, 2, 3], state(3), marks=[(2, rec(2))])


def test_marks_decide_what_an_entry_covers_and_replaces():
    cache = PromptCache(budget_bytes=10_000)
    ids = list(range(100, 110))
    cache.save(ids[:4], state(4), marks=[(4, rec(4))])
    cache.save(ids[:6], state(6), marks=[(6, rec(6))])
    cache.save(ids, state(10), marks=[(4, rec(4)), (10, rec(10))])
    # the third holds all the first restores (its ids and a mark at 4), not the second (no mark at 6)
    assert [e.ids for e in cache.entries()] == [tuple(ids[:6]), tuple(ids)]
    assert cache.covers(ids[:4], [4]) and cache.covers(ids, [4, 10]) and not cache.covers(ids[:8], [8])
    assert cache.covers(ids[:6], [6]) and not cache.covers(ids[:6], [4, 6])   # no one entry has marks at 4 and 6
    assert not cache.covers(ids[:5], [5])


class SavingModel(StandInModel):
    """The stand-in with save_kv / restore_kv: its "KV" is the ids, saved as an int32 array."""

    saves_kv = True
    kv_bytes_per_position = 4

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.kept: list[int] = []            # each restore's positions the slot held already

    def save_kv(self, slot, n, start=0):
        self.calls.append(("save", slot, n) if not start else ("save", slot, n, start))
        return (np.array(self.kv[slot][start:n], np.int32),)

    def restore_kv(self, slot, st, n, keep=0, offset=0):
        self.calls.append(("restore", slot, n))
        self.kept.append(keep)
        assert len(self.kv[slot]) >= keep, "kept positions the slot does not hold"
        self.kv[slot] = self.kv[slot][:keep] + [int(i) for i in st[0][keep - offset:n - offset]]


def test_prompts_a_b_a_on_one_slot_restore_a_and_give_the_same_ids():
    model = SavingModel(1, 64)
    engine = Engine(model, 1, 64, prompt_cache_bytes=1024)
    a, b = [1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11]
    engine.add(greq("a1", a))
    first = drain(engine)["a1"]
    engine.add(greq("b", b))
    assert drain(engine)["b"][0].n_cached == 0
    assert engine.prompt_cache.n_entries == 1 and engine.prompt_cache.n_bytes == 4 * (len(a) + 5)
    engine.add(greq("a2", a))
    again = drain(engine)["a2"]
    assert again[0].n_cached == len(a) - 1                     # all but the one id run for the logits
    assert ("restore", 0, len(a) - 1) in model.calls and model.calls[-6] == ("prefill", 0, 1, len(a) - 1)
    assert [o.token for o in again] == [o.token for o in first] == model.reference(a, 6)
    assert engine.engine_stats()["restore_seconds"] > 0
    assert engine.slots()[0]["n_prompt_tokens_cache"] == len(a) - 1


def test_a_restore_copies_only_what_the_slot_does_not_hold_already():
    """A, then B sharing A's first ids (the system prompt), then A again on one slot: the slot keeps the
    shared prefix live, so the restore copies only the positions after it (the multi-turn replay's case:
    the 4,000-id system prompt stays on the card, the user's own turns come from host RAM)."""
    model = SavingModel(1, 64)
    engine = Engine(model, 1, 64, prompt_cache_bytes=4096)
    system = list(range(20, 40))
    a, b = system + [1, 2, 3, 4, 5, 6], system + [7, 8, 9]
    engine.add(greq("a1", a))
    first = drain(engine)["a1"]
    engine.add(greq("b", b))
    assert drain(engine)["b"][0].n_cached == len(system)
    engine.add(greq("a2", a))
    again = drain(engine)["a2"]
    assert again[0].n_cached == len(a) - 1
    assert ("restore", 0, len(a) - 1) in model.calls and model.kept == [len(system)]
    assert [o.token for o in again] == [o.token for o in first] == model.reference(a, 6)


def test_an_entry_sharing_a_long_prefix_with_a_held_one_copies_only_the_rest():
    """Three users' turns after one 70-id system prompt on one slot: the first saved state is copied whole,
    later ones take the system prompt's positions from it and copy only their own (the multi-turn replay's
    saves on the card were the whole 5,023 ids each turn). A restore into a slot that holds none of it reads
    the shared positions from the first entry's arrays and the rest from its own; the ids are a cold run's."""
    model = SavingModel(1, 256)
    engine = Engine(model, 1, 256, prompt_cache_bytes=1 << 20)
    system = [(7 * i) % 60 + 1 for i in range(70)]                    # ids of the stand-in's vocabulary
    a, b, c, other = system + [1, 2, 3], system + [4, 5, 6, 7], system + [8, 9], [50, 51, 52]
    outs = {}
    for rid, p in (("a", a), ("b", b), ("c", c), ("other", other), ("b2", b)):
        n_calls = len(model.calls)
        engine.add(greq(rid, p))
        outs[rid] = drain(engine)[rid]
        outs[rid].append([x for x in model.calls[n_calls:] if x[0] in ("save", "restore")])
    n_a, n_b = len(a) + 5, len(b) + 5                    # each held its prompt and 5 generated ids
    assert outs["b"][-1] == [("save", 0, n_a)]                          # nothing held yet: copied whole
    assert outs["c"][-1] == [("save", 0, n_b, len(system))]             # the system prompt's positions from a's
    ea, eb, ec, eo = (next(e for e in engine.prompt_cache.entries() if e.ids[:len(p)] == tuple(p))
                      for p in (a, b, c, other))
    assert [(x.start, x.end) for x in eb.pieces] == [(0, len(system)), (len(system), n_b)]
    assert eb.pieces[0].arrays is ea.pieces[0].arrays is ec.pieces[0].arrays
    per_id = SavingModel.kv_bytes_per_position
    assert engine.prompt_cache.n_bytes == per_id * (n_a + (n_b - len(system)) + (len(c) + 5 - len(system))
                                                    + len(other) + 5)
    assert outs["b2"][0].n_cached == len(b) - 1 and model.kept[-2:] == [0, len(system)]   # two pieces, from 0
    assert [o.token for o in outs["b2"][:-1]] == [o.token for o in outs["b"][:-1]] == model.reference(b, 6)


def test_shared_arrays_count_once_and_outlive_the_entry_that_saved_them():
    cache = PromptCache(budget_bytes=1000)
    a = tuple(range(100))
    assert cache.save(a, state(100)[:1])                           # 100 positions x 8 bytes (one array)
    (ea,) = cache.entries()
    b = a[:80] + (7, 8, 9)
    assert cache.save(b, state(3)[:1], base=cache.prefix_source(b))
    assert cache.n_bytes == 800 + 24 and [e.n_bytes for e in cache.entries()] == [800, 824]
    # 200 bytes more: a (the oldest) would free nothing (its array lives on in b), so b goes, freeing its 24
    assert cache.save(tuple(range(500, 525)), state(25)[:1])
    assert [e.ids for e in cache.entries()] == [a, tuple(range(500, 525))] and cache.n_bytes == 800 + 200
    with pytest.raises(ValueError, match="a base of 90 positions"):
        cache.save(tuple(range(200, 300)), state(10)[:1], base=(cache.entries()[0], 90))
    assert cache.prefix_source((0, 1, 2)) is None                   # shorter than SHARE_MIN: copied whole


def test_the_same_ids_again_with_other_marks_take_all_but_the_last_position_from_the_held_entry():
    """A state that cannot rewind: the slot held the same ids again, its checkpoints elsewhere. The held entry
    does not cover it (another mark), so the new entry takes the shared positions from it, all but the last
    (its own piece is never empty; on the card a save starting at the end was refused and failed the request)."""
    cache = PromptCache(budget_bytes=10_000)
    a = tuple(range(100))
    assert cache.save(a, state(100)[:1], marks=[(100, state(1)[:1])])
    assert not cache.covers(a, (40, 100))
    (ea,) = cache.entries()
    assert cache.prefix_source(a) == (ea, 99)
    assert cache.save(a, state(1)[:1], marks=[(40, state(1)[:1]), (100, state(1)[:1])], base=cache.prefix_source(a))
    (eb,) = cache.entries()                                       # it holds all of the first: that one went
    assert [(x.start, x.end) for x in eb.pieces] == [(0, 99), (99, 100)] and eb.points == {40, 100}


def test_the_cache_off_restores_nothing():
    model = SavingModel(1, 64)
    engine = Engine(model, 1, 64, prompt_cache_bytes=0)
    for rid, p in (("a1", [1, 2, 3, 4]), ("b", [9, 10]), ("a2", [1, 2, 3, 4])):
        engine.add(greq(rid, p))
        out = drain(engine)[rid]
    assert out[0].n_cached == 0 and not [c for c in model.calls if c[0] in ("save", "restore")]


def idle_run(clear: bool):
    """The llama.cpp suite's sequence (unit/test_kv_keep_only_active.py): a on slot 0, b on slot 1, a again
    on any slot, then a continued."""
    model = SavingModel(2, 64)
    engine = Engine(model, 2, 64, prompt_cache_bytes=4096, cache_idle_slots=True, clear_idle=clear)
    a, b = [1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11]
    outs = []
    for rid, p, kw in (("a1", a, {"id_slot": 0}), ("b", b, {"id_slot": 1}), ("a2", a, {}), ("a3", a + [12, 13], {})):
        n_calls = len(model.calls)
        engine.add(greq(rid, p, **kw))
        outs.append(drain(engine)[rid])
        outs[-1].append([c for c in model.calls[n_calls:] if c[0] in ("save", "restore")])
    return model, engine, outs


def test_idle_slots_are_saved_when_a_request_starts_and_cleared_with_kv_unified():
    model, engine, (a1, b, a2, a3) = idle_run(clear=True)
    assert a1[-1] == []                                   # slot 1 idle but empty: nothing saved
    assert b[-1] == [("save", 0, 8 + 5)]                  # slot 0 idle with a and its 5 fed ids: saved, emptied
    # a again: slot 0 (empty, least recently used) restores a from the cache; idle slot 1 (b) saved, emptied
    assert a2[-1] == [("save", 1, 3 + 5), ("restore", 0, 7)] and a2[0].n_cached == 7 and a2[0].slot == 0
    assert [o.token for o in a2[:-1]] == [o.token for o in a1[:-1]]
    assert a3[-1] == [] and a3[0].slot == 0 and a3[0].n_cached == 8   # slot 0 kept a: nothing saved or cleared
    assert engine.prompt_cache.n_entries == 2


def test_idle_slots_without_kv_unified_are_saved_and_kept():
    model, engine, (a1, b, a2, a3) = idle_run(clear=False)
    assert b[-1] == [("save", 0, 8 + 5)]
    assert a2[-1] == [("save", 1, 3 + 5)] and a2[0].slot == 0 and a2[0].n_cached == 7   # the live slot holds a
    off = Engine(SavingModel(2, 64), 2, 64, prompt_cache_bytes=4096, cache_idle_slots=False)
    off.add(greq("a", [1, 2, 3], id_slot=0)); drain(off)
    off.add(greq("b", [4, 5], id_slot=1)); drain(off)
    assert off.prompt_cache.n_entries == 0


def test_the_cpu_kv_cache_saves_and_restores_a_slots_positions():
    from bloomery.engine.cpu.kv_cache import KVCache, KVCacheError
    kv = KVCache(n_layer=3, n_slots=2, n_ctx_slot=32, n_head_kv=2, head_dim=8)
    rng = np.random.default_rng(0)
    kv.k[...] = rng.standard_normal(kv.k.shape)
    kv.v[...] = rng.standard_normal(kv.v.shape)
    k_state, v_state = kv.save_state(1, 7)
    assert k_state.shape == (3, 7, 2, 8) and k_state.nbytes == 3 * 7 * 2 * 8 * 2
    before_k, before_v = kv.k.copy(), kv.v.copy()
    kv.k[:, 1] = 0
    kv.v[:, 1] = 0
    kv.restore_state(1, (k_state, v_state), 5)
    np.testing.assert_array_equal(kv.k[:, 1, :5], before_k[:, 1, :5])
    np.testing.assert_array_equal(kv.v[:, 1, :5], before_v[:, 1, :5])
    assert not kv.k[:, 1, 5:].any() and (kv.k[:, 0] == before_k[:, 0]).all()
    with pytest.raises(KVCacheError, match="cannot fill 8 positions"):
        kv.restore_state(1, (k_state, v_state), 8)
    kv.k[:, 1] = 1                                        # keep=3: positions 0..2 are the slot's own, left alone
    kv.restore_state(1, (k_state, v_state), 7, keep=3)
    assert (kv.k[:, 1, :3] == 1).all() and (kv.k[:, 1, 7:] == 1).all()
    np.testing.assert_array_equal(kv.k[:, 1, 3:7], k_state[:, 3:7])
    with pytest.raises(KVCacheError, match="keep 7"):
        kv.restore_state(1, (k_state, v_state), 7, keep=7)
    tail = kv.save_state(0, 9, start=4)                    # positions 4..8 of slot 0, put back from offset 4
    assert tail[0].shape == (3, 5, 2, 8)
    kv.k[:, 0, 4:9] = 0
    kv.restore_state(0, tail, 9, keep=4, offset=4)
    np.testing.assert_array_equal(kv.k[:, 0, 4:9], tail[0])
    with pytest.raises(KVCacheError, match="offset 5"):
        kv.restore_state(0, tail, 9, keep=4, offset=5)
    with pytest.raises(KVCacheError, match="slot 2 is out of range"):
        kv.save_state(2, 1)


def test_an_idle_engine_saves_its_slots_before_the_next_request_needs_it(monkeypatch):
    """save_idle_now (what the engine stage calls as it turns idle): each idle slot's state goes to the cache
    then, once; the next request in that slot finds it saved (no copy on its path), and a request start still
    announces the idle slot it saved (llama.cpp's test_kv_keep_only_active reads that record's tag)."""
    from bloomery.engine import core
    seen = []
    monkeypatch.setattr(core.records, "record", lambda *a, **kw: seen.append((a[1], kw.get("tag"))))
    model = SavingModel(2, 64)
    engine = Engine(model, 2, 64, prompt_cache_bytes=4096, cache_idle_slots=True, test_tags=True)
    a, b = [1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11]
    engine.add(greq("a", a, id_slot=0))
    drain(engine)
    n_calls = len(model.calls)
    assert engine.save_idle_now() == 1 and model.calls[n_calls:] == [("save", 0, 8 + 5)]
    assert engine.save_idle_now() == 0 and len(model.calls) == n_calls + 1         # once
    assert not [t for _, t in seen if t]
    n_calls = len(model.calls)
    engine.add(greq("b", b, id_slot=1))                                              # slot 0 idle: announced
    drain(engine)
    assert [c for c in model.calls[n_calls:] if c[0] in ("save", "restore")] == []    # saved already
    assert [t for _, t in seen if t] == ["__TEST_TAG_CACHE_IDLE_SLOT__"]
    engine.add(greq("b2", b + [30], id_slot=1))                                     # slot 0 announced once
    drain(engine)
    assert [t for _, t in seen if t] == ["__TEST_TAG_CACHE_IDLE_SLOT__"]
    engine.add(greq("a2", a + [12], id_slot=0))                                     # slot 0's own prefix
    out = drain(engine)["a2"]
    assert out[0].n_cached == 8
    n_calls = len(model.calls)
    engine.add(greq("c", [20, 21, 22], id_slot=0))                                  # a new text in slot 0
    drain(engine)
    saves = [c for c in model.calls[n_calls:] if c[0] == "save"]
    assert ("save", 0, 8 + 1 + 5) in saves                                          # what a2 left, on this path


def test_an_idle_save_that_fails_keeps_the_slot_and_the_cache():
    class Failing(SavingModel):
        def save_kv(self, slot, n, start=0):
            raise RuntimeError("the copy failed")
    model = Failing(1, 64)
    engine = Engine(model, 1, 64, prompt_cache_bytes=4096)
    engine.add(greq("a", [1, 2, 3], id_slot=0))
    drain(engine)
    assert engine.save_idle_now() == 0 and engine.prompt_cache.n_entries == 0
    assert engine.scheduler.slots[0].cached_ids[:3] == [1, 2, 3]


def test_asleep_the_engine_reports_the_figures_of_the_moment_it_fell_asleep():
    """--sleep-idle-seconds frees the prompt cache with the weights; /metrics then shows what it showed on entering
    sleep (llama-server's snapshot; its suite's test_server_sleep_read_only_endpoints compares the two), and the
    live figures again once awake."""
    model = SavingModel(1, 64)
    engine = Engine(model, 1, 64, prompt_cache_bytes=4096, cache_idle_slots=True)
    engine.add(greq("a", [1, 2, 3, 4], id_slot=0))
    drain(engine)
    engine.save_idle_now()
    awake = engine.engine_stats()
    assert awake["entries"] == 1
    engine.swap_model(None)
    assert engine.prompt_cache.n_entries == 0 and engine.engine_stats() == awake
    engine.swap_model(model)
    assert engine.engine_stats()["entries"] == 0


def test_the_first_output_carries_the_prompt_caches_work_before_the_prompt():
    """cache_ms (timings.cache_ms): what the request's admission spent saving the slot's held state and restoring a
    saved prefix; 0 where it did neither, and only on the first output."""
    class Slow(SavingModel):
        def restore_kv(self, *a, **kw):
            time.sleep(0.02)
            return super().restore_kv(*a, **kw)
    model = Slow(1, 64)
    engine = Engine(model, 1, 64, prompt_cache_bytes=4096)
    a, b = [1, 2, 3, 4, 5, 6], [9, 10]
    outs = {}
    for rid, p in (("a", a), ("b", b), ("a2", a)):
        engine.add(greq(rid, p, id_slot=0))
        outs[rid] = drain(engine)[rid]
    assert outs["a"][0].cache_ms < 5                                          # nothing held, nothing saved
    assert outs["a2"][0].n_cached == len(a) - 1 and outs["a2"][0].cache_ms >= 20   # a restore of 20 ms at least
    assert all(o.cache_ms == 0.0 for o in outs["a2"][1:])


def test_the_model_hears_when_requests_run_and_when_the_engine_is_quiet():
    """model.host_idle: False as a step runs requests, True once save_idle_now finds none left (the card's arena
    page-locks memory only in that quiet), said once each way."""
    class Listening(SavingModel):
        def host_idle(self, idle):
            self.calls.append(("idle", idle))

    model = Listening(2, 64)
    engine = Engine(model, 2, 64, prompt_cache_bytes=4096, cache_idle_slots=True)
    engine.add(greq("a", [1, 2, 3, 4], id_slot=0))
    drain(engine)
    engine.save_idle_now()
    engine.add(greq("b", [5, 6, 7], id_slot=1))
    drain(engine)
    engine.save_idle_now()
    said = [c[1] for c in model.calls if c[0] == "idle"]
    assert said == [False, True, False, True]
