"""Structured output through the Engine on a stand-in model over the byte vocabulary: documents come
out whole and valid, batched slots keep their own grammars, and the mask for the next id is
computed while the model runs the current step (it is done before decode() returns)."""
from __future__ import annotations

import json
import time

import numpy as np

from byte_vocab import EOS, PIECES, VOCAB
from bloomery.engine.core import Engine
from bloomery.engine.model_api import EngineModel
from bloomery.engine.types import EngineRequest, SamplingParams
from bloomery.grammar import schema_grammar

SCHEMAS = [{"type": "object", "properties": {"n": {"type": "integer", "minimum": 10, "maximum": 99},
                                             "s": {"type": "string", "maxLength": 6}},
            "required": ["n", "s"], "additionalProperties": False},
           {"type": "array", "items": {"enum": ["x\ny", "q\"q"]}, "minItems": 2, "maxItems": 2}]


class ByteModel(EngineModel):
    """Random logits over the byte vocabulary; decode() waits (at most 2 s) for each grammar slot's
    next mask and records whether it was ready while the model ran."""

    def __init__(self, seed: int = 0):
        self.n_vocab, self.n_ctx_train, self.arch = len(PIECES), 512, "bytes"
        self.rng = np.random.default_rng(seed)
        self.engine: Engine | None = None
        self.ready_in_step: list[bool] = []

    def _row(self) -> np.ndarray:
        return self.rng.standard_normal(self.n_vocab).astype(np.float32) * 3.0

    def prefill(self, slot, ids, pos0):
        return self._row()

    def decode(self, slots, ids, positions):
        for s in slots:
            nxt = self.engine.scheduler.slots[s].state.sampler.matcher._next
            deadline = time.monotonic() + 2.0
            while nxt is not None and not nxt.done() and time.monotonic() < deadline:
                time.sleep(0.001)
            self.ready_in_step.append(nxt is not None and nxt.done())
        return np.stack([self._row() for _ in slots])                     # [B, V]


def run(engine: Engine, reqs: list[EngineRequest]) -> dict[str, list[int]]:
    for r in reqs:
        engine.add(r)
    out: dict[str, list[int]] = {r.req_id: [] for r in reqs}
    finish: dict[str, str] = {}
    for _ in range(400):
        for o in engine.step():
            assert o.error is None, o.error
            if o.token is not None:
                out[o.req_id].append(o.token)
            if o.finish:
                finish[o.req_id] = o.finish
        if len(finish) == len(reqs):
            break
    assert all(f == "stop" for f in finish.values()) and len(finish) == len(reqs), finish
    return out


def test_batched_slots_write_valid_documents_and_masks_are_ready_during_the_step():
    model = ByteModel()
    engine = Engine(model, n_slots=2, n_ctx_slot=512)
    model.engine = engine
    engine._grammar_vocab = VOCAB          # the stand-in has no GGUF to read a vocabulary from
    reqs = [EngineRequest(f"r{i}", [65, 66], 300, SamplingParams(temperature=t, seed=7, grammar=schema_grammar(s)),
                          stop_ids=(EOS,)) for i, (s, t) in enumerate(zip(SCHEMAS, (0.0, 1.0)))]
    out = run(engine, reqs)
    for r, schema in zip(reqs, SCHEMAS):
        ids = [t for t in out[r.req_id] if t != EOS]
        doc = json.loads(b"".join(PIECES[t] for t in ids))
        if schema["type"] == "object":
            assert 10 <= doc["n"] <= 99 and len(doc["s"]) <= 6
        else:
            assert len(doc) == 2 and set(doc) <= {"x\ny", 'q"q'}
    assert model.ready_in_step and all(model.ready_in_step)
