"""What the front remembers of past generations for /slots and /metrics, in a byte budget.

A generation in flight is kept whole (its handler and the engine need it). Once it is
done, only what /slots shows of it stays: its params as /slots renders them, whether its
text held a new line, its slot and ids; the prompt ids, the generated ids and the
probability tables go with the handler. The memos of the last MAX_RECENT generations
are kept while their rendered size stays within BUDGET_BYTES (a memo that is larger
alone keeps no params); each slot's last request is kept past that, so an idle slot
still shows it (as llama-server does). Pure bookkeeping, no I/O.
"""
from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

MAX_RECENT = 64                 # generations remembered (a slot's last request may be this far back)
BUDGET_BYTES = 4 << 20          # what the memos of done generations may hold together


@dataclass(frozen=True)
class Memo:
    """A done generation, as /slots sees it."""

    req_id: str
    task_id: int
    slot: int
    params: dict | None         # slot_params of its GenParams; None when it alone was over the budget
    has_new_line: bool
    n_bytes: int
    state: str = "done"


class Recent:
    def __init__(self, render_params: Callable[[object], dict], max_recent: int = MAX_RECENT,
                 budget_bytes: int = BUDGET_BYTES):
        self.render_params = render_params          # GenParams -> /slots' params object
        self.max_recent, self.budget_bytes = max_recent, budget_bytes
        self.entries: OrderedDict[str, object] = OrderedDict()   # req_id -> Generation (in flight) or Memo
        self.last_of_slot: dict[int, Memo] = {}     # what fell out of `entries`, per slot
        self.n_bytes = 0                            # the memos' bytes in `entries`

    def add(self, gen) -> None:
        self.compact()
        self.entries[gen.req_id] = gen
        self._trim()

    def memo_of(self, gen) -> Memo:
        params = self.render_params(gen.params)
        n_bytes = len(json.dumps(params, ensure_ascii=False)) + 200
        if n_bytes > self.budget_bytes // 4:
            params, n_bytes = None, 200
        return Memo(gen.req_id, gen.task_id, gen.outcome.slot, params, "\n" in gen.current_text(), n_bytes)

    def compact(self) -> None:
        """Every done generation becomes its memo."""
        for req_id, g in list(self.entries.items()):
            if not isinstance(g, Memo) and g.state == "done":
                memo = self.memo_of(g)
                self.entries[req_id] = memo
                self.n_bytes += memo.n_bytes

    def _trim(self) -> None:
        while len(self.entries) > self.max_recent or self.n_bytes > self.budget_bytes:
            old_id = next((k for k, g in self.entries.items() if isinstance(g, Memo)), None)
            if old_id is None:
                break                       # only generations in flight: they stay
            old = self.entries.pop(old_id)
            self.n_bytes -= old.n_bytes
            kept = self.last_of_slot.get(old.slot)
            if old.slot >= 0 and (kept is None or kept.task_id < old.task_id):
                self.last_of_slot[old.slot] = old     # a slot idle since keeps its last request

    def get(self, req_id: str):
        """A recent generation (or its memo) by its engine req_id."""
        self.compact()
        self._trim()
        got = self.entries.get(req_id)
        if got is None:
            got = next((m for m in self.last_of_slot.values() if m.req_id == req_id), None)
        return got

    def n_in_flight(self) -> int:
        return sum(1 for g in list(self.entries.values()) if g.state in ("queued", "running"))
