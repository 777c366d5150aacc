"""A greedy pick under a schema read off each row's largest logits (Engine.greedy_top_k) gives the ids
the whole rows give: several schemas, rows whose largest logits the schema all refuses (the step runs
again with whole rows), tied logits, and batches mixing schema, free and sampled requests."""
from __future__ import annotations

import numpy as np
import pytest

from byte_vocab import EOS, PIECES, VOCAB
from bloomery.engine.core import Engine
from bloomery.engine.model_api import EngineModel
from bloomery.engine.sampler import sorted_top
from bloomery.engine.types import EngineRequest, SamplingParams
from bloomery.grammar import schema_grammar

SCHEMAS = [{"type": "object", "properties": {"n": {"type": "integer", "minimum": 10, "maximum": 99},
                                             "s": {"type": "string", "maxLength": 6}},
            "required": ["n", "s"], "additionalProperties": False},
           {"type": "array", "items": {"enum": ["x\ny", "q\"q"]}, "minItems": 2, "maxItems": 2},
           {"type": "object", "properties": {"ok": {"type": "boolean"}, "v": {"type": "number"}},
            "required": ["ok", "v"]}]


class RowModel(EngineModel):
    """Logits that depend only on (slot, position, id fed), so a step run twice gives the same rows.
    `refuse`: on even positions every id the slot's schema refuses is lifted above every id it allows.
    `ties`: logits rounded to integers (many equal values)."""

    def __init__(self, refuse: bool = False, ties: bool = False):
        self.n_vocab, self.n_ctx_train, self.arch = len(PIECES), 512, "bytes"
        self.refuse, self.ties = refuse, ties
        self.engine: Engine | None = None
        self.calls = {"decode": 0, "decode_topk": 0}

    topk_max = 64

    def _row(self, slot: int, pos: int, tok: int) -> np.ndarray:
        row = np.random.default_rng([slot, pos, tok]).standard_normal(self.n_vocab).astype(np.float32) * 3.0
        if self.ties:
            row = np.round(row)
        m = self.engine.scheduler.slots[slot].state
        m = m.sampler.matcher if m is not None else None
        if self.refuse and pos % 2 == 0 and m is not None and m._next is not None:
            row = np.where(m.allowed(), row, row + np.float32(100.0))
        return row

    def prefill(self, slot, ids, pos0):
        return np.random.default_rng([slot, 999]).standard_normal(self.n_vocab).astype(np.float32)

    def decode(self, slots, ids, positions):
        self.calls["decode"] += 1
        return np.stack([self._row(s, int(p), int(t)) for s, t, p in zip(slots, ids, positions)])   # [B, V]

    def decode_topk(self, slots, ids, positions, k):
        self.calls["decode_topk"] += 1
        rows = self.decode(slots, ids, positions)
        self.calls["decode"] -= 1
        top = np.stack([sorted_top(np.where(np.isnan(r), -np.inf, r), k) for r in rows]).astype(np.int32)   # [B, k]
        return top, np.take_along_axis(rows, top, axis=1), np.isnan(rows).sum(axis=1).astype(np.int32)


def _req(i: int, schema=None, temperature: float = 0.0, top_k: int = 40) -> EngineRequest:
    grammar = schema_grammar(schema) if schema is not None else None
    return EngineRequest(f"r{i}", [65 + i, 66], 40, SamplingParams(temperature=temperature, top_k=top_k, seed=11 + i,
                                                                   grammar=grammar), stop_ids=(EOS,))


def _run(reqs, top_k: int, gate: bool = True, **model_kw):
    model = RowModel(**model_kw)
    engine = Engine(model, n_slots=len(reqs), n_ctx_slot=512)
    engine.greedy_top_k = top_k
    if not gate:                       # every greedy step tries the largest logits first, however often they miss
        engine.TOP_MISS_MAX = 2.0
    model.engine = engine
    engine._grammar_vocab = VOCAB
    for r in reqs:
        engine.add(r)
    out = {r.req_id: [] for r in reqs}
    for _ in range(200):
        if not engine.has_work():
            break
        for o in engine.step():
            out[o.req_id].append((o.token, o.finish, o.error))
    assert not engine.has_work()
    return out, engine, model


def _same(reqs, **model_kw):
    whole, _, wm = _run(reqs, 0, **model_kw)
    gated, _, _ = _run(reqs, 64, **model_kw)
    assert gated == whole
    fast, engine, fm = _run(reqs, 64, gate=False, **model_kw)
    assert fast == whole
    assert wm.calls["decode_topk"] == 0 or all(r.sampling.temperature > 0 and r.sampling.top_k > 0 and
                                               r.sampling.grammar is None for r in reqs)
    assert engine.top_steps > 0 and fm.calls["decode_topk"] >= engine.top_steps
    for ids in fast.values():                       # the documents come out whole
        assert ids[-1][1] in ("stop", "length") and all(e is None for _, _, e in ids)
    return engine, fm


@pytest.mark.parametrize("schema", SCHEMAS)
def test_greedy_under_a_schema_matches_whole_rows(schema):
    engine, model = _same([_req(0, schema)])
    # random rows: where the schema allows one or two ids, the 64 largest of 263 often miss them
    assert model.calls["decode"] == engine.top_misses < engine.top_steps


def test_a_slot_that_keeps_missing_takes_whole_rows_mostly():
    class Refusing(RowModel):
        def _row(self, slot, pos, tok):
            m = self.engine.scheduler.slots[slot].state.sampler.matcher
            row = np.random.default_rng([slot, pos, tok]).standard_normal(self.n_vocab).astype(np.float32)
            return row if m._next is None else np.where(m.allowed(), row, row + np.float32(100.0))
    model = Refusing()
    engine = Engine(model, n_slots=1, n_ctx_slot=512)
    model.engine, engine._grammar_vocab = engine, VOCAB
    engine.add(_req(0, SCHEMAS[0]))
    n = 0
    while engine.has_work():
        n += len(engine.step())
    # every try misses: one try, then whole rows until the share eases below the bar (7 steps), again
    assert 0 < engine.top_misses == engine.top_steps <= n // 7 + 1, (engine.top_misses, n)


@pytest.mark.parametrize("schema", SCHEMAS)
def test_refused_candidates_run_the_step_again_with_whole_rows(schema):
    engine, model = _same([_req(0, schema), _req(1, None)], refuse=True)
    assert engine.top_misses > 0 and model.calls["decode"] == engine.top_misses


def test_tied_logits_resolve_as_whole_rows():
    _same([_req(i, s) for i, s in enumerate(SCHEMAS)], ties=True)


def test_mixed_batch_schema_free_and_sampled():
    reqs = [_req(0, SCHEMAS[0]), _req(1, None), _req(2, None, temperature=0.8), _req(3, SCHEMAS[1], temperature=0.8),
            _req(4, SCHEMAS[2])]
    _same(reqs, ties=True)
    _same(reqs, refuse=True)
    _same([_req(0, None), _req(1, None, temperature=0.8)], ties=True)     # free greedy beside sampled top_k


@pytest.mark.parametrize("bad", ["nan", "-inf"])
def test_nan_or_no_finite_allowed_logit_ends_as_whole_rows_end(bad):
    """A NaN in the row fails the request; allowed ids all at -inf: the masked row's argmax is id 0."""
    class BadModel(RowModel):
        def _row(self, slot, pos, tok):
            row = super()._row(slot, pos, tok)
            if pos != 5:
                return row
            allowed = self.engine.scheduler.slots[slot].state.sampler.matcher.allowed()
            if bad == "nan":                  # an allowed id on top, a NaN further down
                row[np.flatnonzero(allowed)[0]], row[np.flatnonzero(~allowed)[0]] = 50.0, np.nan
            else:                             # three refused ids finite, every other id -inf
                keep = np.flatnonzero(~allowed)[-3:]
                row[:] = -np.inf
                row[keep] = 0.0
            return row
    outs = []
    for k in (0, 64):
        model = BadModel()
        engine = Engine(model, n_slots=1, n_ctx_slot=512)
        engine.greedy_top_k, model.engine, engine._grammar_vocab = k, engine, VOCAB
        engine.add(_req(0, SCHEMAS[0]))
        got = []
        while engine.has_work():
            # the error's first line (llguidance's report after it carries timings)
            got += [(o.token, o.finish, o.error and o.error.splitlines()[0]) for o in engine.step()]
        outs.append(got)
    assert outs[0] == outs[1] and outs[1][-1][1] == "error", outs[1]


@pytest.mark.parametrize("schema", [None, SCHEMAS[0]], ids=["free", "schema"])
def test_greedy_with_bans_reads_the_largest_logits(schema):
    """A greedy request whose bias only bans ids (ignore_eos bans the stop ids so, at -inf) takes the row's
    largest logits, not the whole row: the first one not banned (and allowed by a schema) is the whole row's
    pick, also where the banned ids are the largest; a finite bias still takes whole rows."""
    class Banned(RowModel):
        def _row(self, slot, pos, tok):
            row = super()._row(slot, pos, tok)
            row[[3, 7, 70]] += np.float32(50.0)          # the banned ids on top of every row
            return row

    def run(bias, top_k):
        model = Banned()
        engine = Engine(model, n_slots=2, n_ctx_slot=512)
        engine.greedy_top_k, model.engine, engine._grammar_vocab = top_k, engine, VOCAB
        grammar = schema_grammar(schema) if schema is not None else None
        for i in range(2):
            engine.add(EngineRequest(f"r{i}", [65 + i, 66], 30, SamplingParams(temperature=0.0, logit_bias=bias,
                                                                               grammar=grammar)))
        out = {}
        while engine.has_work():
            for o in engine.step():
                out.setdefault(o.req_id, []).append((o.token, o.finish, o.error))
        return out, engine, model

    bans = [(3, -np.inf), (7, -np.inf), (70, -np.inf)]
    whole, _, _ = run(bans, 0)
    top, engine, model = run(bans, 64)
    assert top == whole
    assert not {t for ids in top.values() for t, _, _ in ids} & {3, 7, 70}
    assert engine.top_steps > 0
    if schema is None:        # (a schema allowing one or two ids may miss the 64, and then mostly takes whole rows)
        assert engine.top_misses == 0 and model.calls["decode"] == 0
    finite, engine, model = run(bans[:2] + [(70, -5.0)], 64)
    assert engine.top_steps == 0 and model.calls["decode_topk"] == 0 and model.calls["decode"] > 0



def test_bans_from_the_largest_logits_equal_the_whole_row():
    """Sampler.pick_from_top with bans against sample() on random rows (the banned ids often the largest,
    ties), and where it cannot settle: a banned id at +inf (the biased row holds a NaN there), every
    candidate banned, the first left at -inf."""
    from bloomery.engine.sampler import Sampler
    rng = np.random.default_rng(4)
    bans = [(5, -np.inf), (9, -np.inf), (5, -np.inf)]          # a duplicate adds -inf again
    s = Sampler(SamplingParams(temperature=0.0, logit_bias=bans), 64, 512)
    assert s.greedy_from_top and not s.plain_greedy and s.top_settles == 3
    for _ in range(200):
        row = np.round(rng.standard_normal(64).astype(np.float32) * 2)
        row[[5, 9]] = np.float32(rng.choice([9.0, 1.0, -9.0]))
        top = sorted_top(row, 8)
        assert s.pick_from_top(top, row[top]) == s.sample(row).token
    row = np.zeros(64, np.float32)
    row[5] = np.inf
    top = sorted_top(row, 8)
    assert s.pick_from_top(top, row[top]) is None
    row = np.full(64, -np.inf, np.float32)
    row[[5, 9]] = 1.0
    assert s.pick_from_top(np.array([5, 9]), row[[5, 9]]) is None
    top = sorted_top(row, 3)
    assert s.pick_from_top(top, row[top]) is None and s.sample(row).token == 0
    assert not Sampler(SamplingParams(temperature=0.0, logit_bias=[(5, -np.inf), (6, 2.0)]), 64, 512).greedy_from_top


def test_device_bans_are_the_argmax_after_the_bans_and_only_for_a_bans_only_greedy_pick():
    """Sampler.device_bans: () for a plain greedy pick, the sorted banned ids for a greedy pick whose bias only bans
    (the argmax of the row with those at -inf is then sample()'s pick, ties to the lower id), None for anything a
    banned argmax cannot make (a finite bias, penalties, probabilities asked, sampling)."""
    from bloomery.engine.sampler import Sampler
    plain = Sampler(SamplingParams(temperature=0.0), 64, 512)
    assert plain.device_bans == ()
    s = Sampler(SamplingParams(temperature=0.0, logit_bias=[(9, -np.inf), (5, -np.inf), (9, -np.inf)]), 64, 512)
    assert s.device_bans == (5, 9)
    rng = np.random.default_rng(5)
    for _ in range(200):
        row = np.round(rng.standard_normal(64).astype(np.float32) * 2)
        row[[5, 9]] = np.float32(rng.choice([9.0, 1.0, -9.0]))
        banned = row.copy()
        banned[list(s.device_bans)] = -np.inf
        assert int(np.argmax(banned)) == s.sample(row).token
    for params in (SamplingParams(temperature=0.0, logit_bias=[(5, -np.inf), (6, 2.0)]),
                   SamplingParams(temperature=0.0, logit_bias=[(5, -np.inf)], repeat_penalty=1.3),
                   SamplingParams(temperature=0.0, logit_bias=[(5, -np.inf)], n_probs=2),
                   SamplingParams(temperature=0.8, logit_bias=[(5, -np.inf)], seed=1)):
        assert Sampler(params, 64, 512).device_bans is None, params
