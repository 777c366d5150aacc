"""The /slots memory of past generations (api/recent.py): memos in a byte budget, generations in flight whole."""
from __future__ import annotations

from dataclasses import dataclass, field

from bloomery.api.recent import Memo, Recent


@dataclass
class Out:
    slot: int = 0


@dataclass
class Gen:
    req_id: str
    task_id: int
    params: dict
    state: str = "running"
    text: str = ""
    outcome: Out = field(default_factory=Out)
    probs: list = field(default_factory=list)    # what a done generation must not keep alive

    def current_text(self) -> str:
        return self.text


def test_done_generations_become_memos_and_in_flight_ones_stay_whole():
    r = Recent(lambda p: dict(p))
    a = Gen("a", 0, {"n_probs": 5}, text="x\ny", probs=[0] * 1000)
    r.add(a)
    assert r.get("a") is a
    a.state = "done"
    memo = r.get("a")
    assert isinstance(memo, Memo) and memo.params == {"n_probs": 5} and memo.has_new_line and memo.slot == 0
    assert r.n_in_flight() == 0
    b = Gen("b", 1, {})
    r.add(b)
    assert r.n_in_flight() == 1 and r.get("b") is b


def test_the_memos_stay_within_the_byte_budget_and_each_slot_keeps_its_last():
    r = Recent(lambda p: dict(p), max_recent=1000, budget_bytes=100_000)
    for i in range(200):
        g = Gen(f"g{i}", i, {"stop": ["x" * 5000]}, outcome=Out(slot=i % 2))
        r.add(g)
        g.state = "done"
    r.get("g0")
    assert r.n_bytes <= 100_000
    assert r.get("g199").params is not None and r.get("g0") is None
    assert len(r.entries) < 30
    # a slot whose last request fell out still shows it
    r2 = Recent(lambda p: dict(p), max_recent=2)
    for i, slot in enumerate([0, 1, 1, 1]):
        g = Gen(f"h{i}", i, {}, outcome=Out(slot=slot))
        r2.add(g)
        g.state = "done"
    r2.get("x")
    assert r2.get("h0").slot == 0


def test_a_memo_over_a_quarter_of_the_budget_keeps_no_params():
    r = Recent(lambda p: dict(p), budget_bytes=40_000)
    g = Gen("big", 0, {"logit_bias": ["x" * 20_000]})
    r.add(g)
    g.state = "done"
    assert r.get("big").params is None


def test_a_count_bound_holds_too():
    r = Recent(lambda p: {}, max_recent=64)
    for i in range(100):
        g = Gen(f"g{i}", i, {})
        r.add(g)
        g.state = "done"
    r.get("x")
    assert len(r.entries) <= 64
