"""Slot files (POST /slots/{id}?action=save|restore|erase) without a server: the file format, the checks a
restore makes before any byte reaches the slot, the engine-side actions on an Engine with a small model
that keeps its KV in numpy arrays, and the file names the front refuses."""
from __future__ import annotations

import numpy as np
import pytest

from bloomery.api.slot_actions import filename_problem
from bloomery.engine import slot_file
from bloomery.engine.core import Engine
from bloomery.engine.model_api import EngineModel
from bloomery.engine.types import EngineRequest, SamplingParams

N_VOCAB, N_CTX = 32, 64


class KVModel(EngineModel):
    """A model whose KV is one [slot, pos, 3] f16 array: each position holds (id, pos, slot);
    logits favour (last id + 1) so a run is deterministic."""
    arch = "toy"
    n_vocab = N_VOCAB
    n_ctx_train = N_CTX
    rewinds = True
    saves_kv = True

    def __init__(self, n_slots: int = 2):
        self.kv = np.zeros((n_slots, N_CTX, 3), np.float16)

    def _logits(self, last: int) -> np.ndarray:
        out = np.zeros(N_VOCAB, np.float32)
        out[(last + 1) % N_VOCAB] = 5.0
        return out

    def prefill(self, slot, ids, pos0):
        for i, t in enumerate(ids):
            self.kv[slot, pos0 + i] = (t, pos0 + i, slot)
        return self._logits(int(ids[-1]))

    def decode(self, slots, ids, positions):
        for s, t, p in zip(slots, ids, positions):
            self.kv[s, p] = (t, p, s)
        return np.stack([self._logits(int(t)) for t in ids])

    def save_kv(self, slot, n):
        return (self.kv[slot, :n].copy(),)

    def restore_kv(self, slot, state, n):
        self.kv[slot, :n] = state[0][:n]


def run(engine: Engine, prompt: list[int], id_slot: int, n_predict: int = 3, req_id: str = "r"):
    engine.add(EngineRequest(req_id, tuple(prompt), n_predict, SamplingParams(temperature=0.0), id_slot=id_slot))
    outs = []
    while engine.has_work():
        outs += engine.step()
    return outs


def test_save_erase_restore_moves_a_slots_ids_and_kv_through_a_file(tmp_path):
    model = KVModel()
    engine = Engine(model, 2, N_CTX)
    outs = run(engine, [1, 2, 3, 4], 1)
    cold = [o.token for o in outs if o.token is not None]
    path = str(tmp_path / "one.bin")
    saved = slot_file.answer(engine, "save", 1, path, "one.bin", "m.gguf")
    assert saved.status == 200, saved.error
    assert saved.body["n_saved"] == 4 + 2 and saved.body["filename"] == "one.bin"       # the prompt, 2 fed ids
    assert saved.body["n_written"] == (tmp_path / "one.bin").stat().st_size and "save_ms" in saved.body["timings"]
    kv1 = model.kv[1, :6].copy()
    erased = slot_file.answer(engine, "erase", 1, "", "", "m.gguf")
    assert erased.body == {"id_slot": 1, "n_erased": 6}
    assert engine.scheduler.slots[1].cached_ids == []
    got = slot_file.answer(engine, "restore", 0, path, "one.bin", "m.gguf")
    assert got.status == 200, got.error
    assert (got.body["n_restored"], got.body["n_read"]) == (6, saved.body["n_written"])
    assert np.array_equal(model.kv[0, :6], kv1)                       # slot 1's K/V, now in slot 0
    outs = run(engine, [1, 2, 3, 4], 0, req_id="again")
    assert outs[0].n_cached == 3                                    # the restored prefix, short of the last id
    assert [o.token for o in outs if o.token is not None] == cold


def test_a_restore_refuses_another_model_a_bad_file_and_a_busy_or_unknown_slot(tmp_path):
    model = KVModel()
    engine = Engine(model, 2, N_CTX)
    run(engine, [5, 6, 7], 0)
    path = str(tmp_path / "s.bin")
    assert slot_file.answer(engine, "save", 0, path, "s.bin", "a.gguf").status == 200
    other = slot_file.answer(engine, "restore", 1, path, "s.bin", "b.gguf")
    assert other.status == 400 and "saved from model 'a.gguf'" in other.error and "'b.gguf'" in other.error
    (tmp_path / "junk.bin").write_bytes(b"hello world")
    junk = slot_file.answer(engine, "restore", 1, str(tmp_path / "junk.bin"), "junk.bin", "a.gguf")
    assert junk.status == 400 and "not a bloomery slot file" in junk.error
    data = (tmp_path / "s.bin").read_bytes()
    (tmp_path / "cut.bin").write_bytes(data[:-2])
    cut = slot_file.answer(engine, "restore", 1, str(tmp_path / "cut.bin"), "cut.bin", "a.gguf")
    assert cut.status == 400 and "bytes where its header describes" in cut.error
    missing = slot_file.answer(engine, "restore", 1, str(tmp_path / "none.bin"), "none.bin", "a.gguf")
    assert missing.status == 400 and "no file 'none.bin'" in missing.error
    assert slot_file.answer(engine, "save", 2, path, "s.bin", "a.gguf").error == "Invalid slot ID"
    assert slot_file.answer(engine, "bogus", 0, path, "s.bin", "a.gguf").error == "Invalid action"
    engine.add(EngineRequest("busy", (1, 2), 50, SamplingParams(temperature=0.0), id_slot=1))
    engine.step()
    busy = slot_file.answer(engine, "restore", 1, path, "s.bin", "a.gguf")
    assert busy.status == 503 and "slot 1 is processing a request" in busy.error
    model.rewinds = False
    rec = slot_file.answer(engine, "save", 0, path, "s.bin", "a.gguf")
    assert rec.status == 501 and "recurrent layers" in rec.error


def test_a_file_of_another_shape_is_refused_before_the_slot_changes(tmp_path):
    model = KVModel()
    engine = Engine(model, 1, N_CTX)
    data = slot_file.encode("m.gguf", "toy", [1, 2], (np.zeros((2, 4), np.float16),))
    (tmp_path / "w.bin").write_bytes(data)
    engine.scheduler.slots[0].cached_ids[:] = [9]
    got = slot_file.answer(engine, "restore", 0, str(tmp_path / "w.bin"), "w.bin", "m.gguf")
    assert got.status == 400 and "does not match this model's float16[1, 3]" in got.error
    assert engine.scheduler.slots[0].cached_ids == [9]


@pytest.mark.parametrize("name", ["", "../x.bin", "a/b.bin", "a\\b.bin", "..", "x..y", ".hidden", "a\x00b", "é" * 200])
def test_names_outside_the_folder_or_odd_are_refused(name):
    assert filename_problem(name) is not None


def test_plain_names_are_taken():
    assert filename_problem("slot1.bin") is None and filename_problem("my slot-2_x.bin") is None
