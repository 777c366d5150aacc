"""The Responses store's bounds (pure bookkeeping): count, bytes, oldest finished first, running never dropped."""
from __future__ import annotations

import pytest

from bloomery.api.responses_store import ResponseStore, Stored
from bloomery.http.types import ApiError


def stored(rid: str, *, finished: bool = True, text: str = "x") -> Stored:
    return Stored(rid, {"id": rid, "text": text}, [{"role": "user", "content": text}], finished=finished)


def test_count_bound_drops_oldest_finished():
    store = ResponseStore(max_count=3, max_bytes=10**9)
    for i in range(5):
        store.put(stored(f"r{i}"))
    assert list(store.items) == ["r2", "r3", "r4"]


def test_byte_bound_drops_oldest_finished_and_keeps_the_sum():
    store = ResponseStore(max_count=100, max_bytes=600)
    for i in range(5):
        store.put(stored(f"r{i}", text="a" * 100))
    assert store.n_bytes <= 600
    assert "r4" in store.items and "r0" not in store.items
    assert store.n_bytes == sum(s.n_bytes for s in store.items.values())


def test_running_responses_are_never_dropped_and_fill_reports_it():
    store = ResponseStore(max_count=2, max_bytes=10**9)
    store.put(stored("run0", finished=False))
    store.put(stored("run1", finished=False))
    store.put(stored("done", finished=True))
    assert "run0" in store.items and "run1" in store.items   # the finished one went instead
    assert store.running_fill() is not None


def test_previous_response_must_exist_and_be_finished():
    store = ResponseStore()
    with pytest.raises(ApiError) as e:
        store.conversation("resp_nope")
    assert e.value.param == "previous_response_id" and "resp_nope" in e.value.message
    store.put(stored("r", finished=False))
    with pytest.raises(ApiError):
        store.conversation("r")
    store.put(stored("r", finished=True))
    assert store.conversation("r") == [{"role": "user", "content": "x"}]
