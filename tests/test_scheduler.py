"""Slots and the queue: admission order, prefix reuse, slot choice, bounds, cancel."""
from __future__ import annotations

import pytest

from bloomery.engine.scheduler import (QueueFullError, Scheduler, SchedulerError,
                                       common_prefix_len)
from bloomery.engine.types import EngineRequest


def req(rid: str, ids, cache_prompt: bool = True) -> EngineRequest:
    return EngineRequest(rid, tuple(ids), n_predict=8, cache_prompt=cache_prompt)


def run_to_end(sched: Scheduler, slot, generated=()):
    """What the engine does for a request: prompt in, each fed id appended, release."""
    sched.prefilled(slot)
    for tok in generated:
        sched.sampled(slot, tok)
        sched.fed(slot)
    sched.release(slot)


def test_fifo_admission_into_free_slots():
    s = Scheduler(2, 32)
    for rid in "abc":
        s.add(req(rid, [1, 2, 3]))
    first = s.schedule()
    assert [sl.req.req_id for sl in first] == ["a", "b"]
    assert [r.req_id for r in s.waiting] == ["c"]
    assert s.schedule() == []            # no free slot: c waits
    run_to_end(s, first[0])
    again = s.schedule()
    assert [sl.req.req_id for sl in again] == ["c"] and again[0] is first[0]


def test_prefix_reuse_cuts_cache_to_the_common_part():
    s = Scheduler(1, 64)
    s.add(req("a", range(10)))
    slot = s.schedule()[0]
    assert slot.n_cached == 0
    run_to_end(s, slot, generated=[50, 51])
    assert slot.cached_ids == list(range(10)) + [50, 51]
    s.add(req("b", [0, 1, 2, 3, 4, 99]))
    slot = s.schedule()[0]
    assert slot.n_cached == 5 and slot.cached_ids == [0, 1, 2, 3, 4]


def test_whole_prompt_cached_still_evaluates_one_id():
    s = Scheduler(1, 64)
    s.add(req("a", [5, 6, 7]))
    run_to_end(s, s.schedule()[0])
    s.add(req("b", [5, 6, 7]))
    slot = s.schedule()[0]
    assert slot.n_cached == 2 and slot.cached_ids == [5, 6]


def test_cache_prompt_false_reuses_nothing():
    s = Scheduler(1, 64)
    s.add(req("a", [5, 6, 7, 8]))
    run_to_end(s, s.schedule()[0])
    s.add(req("b", [5, 6, 7, 9], cache_prompt=False))
    slot = s.schedule()[0]
    assert slot.n_cached == 0 and slot.cached_ids == []


def test_slot_choice_by_prefix_then_lru():
    s = Scheduler(3, 64)
    for rid, ids in (("a", [1] * 10), ("b", [2] * 10), ("c", [3] * 10)):
        s.add(req(rid, ids))
    slots = s.schedule()
    assert [sl.id for sl in slots] == [2, 1, 0]   # all fresh: llama.cpp's `<=` picks the last
    for sl in (slots[1], slots[2], slots[0]):      # released in the order b, c, a
        run_to_end(s, sl)
    s.add(req("d", [2] * 6 + [7]))                 # shares 6 of 7 with slot 1 (b)
    assert s.schedule()[0].id == 1
    s.add(req("e", [9, 9, 9]))                     # shares nothing: least recently used is slot 0 (c)
    assert s.schedule()[0].id == 0


def test_similarity_must_exceed_threshold():
    s = Scheduler(2, 512)
    s.add(req("a", [4] * 100))
    s.add(req("z", [8] * 100))
    a, z = s.schedule()
    run_to_end(s, z)
    run_to_end(s, a)          # a released last: LRU would pick the other slot
    # 10 of 100 ids shared with a's slot: 0.10 is not > 0.1, so LRU decides
    s.add(req("b", [4] * 10 + [5] * 90))
    assert s.schedule()[0] is z


def test_queue_bound_refuses_by_name():
    s = Scheduler(1, 32, max_queue=1)
    s.add(req("a", [1]))     # takes the free slot at the next schedule
    s.add(req("b", [1]))     # waits: queue depth 1
    with pytest.raises(QueueFullError, match=r"max_queue=1"):
        s.add(req("c", [1]))
    assert Scheduler(4, 32).max_queue == 60   # default: 64 - n_slots


@pytest.mark.parametrize("ids, words", [
    ([], "prompt_ids is empty"),
    (list(range(32)), "prompt of 32 ids does not fit a slot of n_ctx_slot=32 (at most 31)"),
])
def test_bad_prompts_are_named(ids, words):
    s = Scheduler(1, 32)
    with pytest.raises(SchedulerError) as e:
        s.add(req("a", ids))
    assert words in str(e.value)


def test_duplicate_request_id_is_refused():
    s = Scheduler(1, 32)
    s.add(req("a", [1]))
    with pytest.raises(SchedulerError, match="'a' is already queued or running"):
        s.add(req("a", [2]))


def test_cancel_in_queue_and_in_slot():
    s = Scheduler(1, 32)
    s.add(req("a", [1, 2]))
    s.add(req("b", [1, 2]))
    slot = s.schedule()[0]
    s.prefilled(slot)
    assert s.cancel("b") is True and not s.waiting
    assert s.cancel("a") is slot and not slot.is_processing
    assert slot.cached_ids == [1, 2]          # the KV stays reusable
    assert s.cancel("a") is False             # already gone
    assert not s.has_work()
    s.add(req("a", [3]))                      # the id is free again


def test_table_reports_each_slot():
    s = Scheduler(2, 16)
    s.add(req("x", [1]))
    s.schedule()
    assert s.table() == [{"id": 0, "n_ctx": 16, "is_processing": False, "id_task": -1},
                         {"id": 1, "n_ctx": 16, "is_processing": True, "id_task": "x"}]


def test_common_prefix_len():
    assert common_prefix_len([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_len([], [1]) == 0
    assert common_prefix_len([1, 2], [1, 2, 3]) == 2
