"""Checkpoints at message starts for a slot whose state cannot rewind (the qwen35 family's recurrent
layers; the serving guide, section 6; llama-server's --ctx-checkpoints): the scheduler's bookkeeping
alone, then the engine over a synthetic qwen35moe file, against cold runs, and the plan's bytes."""
from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
from conftest import load_tool

from bloomery.engine.core import Engine
from bloomery.engine.cpu.backend import NumpyOps
from bloomery.engine.limits import CTX_CHECKPOINTS
from bloomery.engine.models.registry import model_class
from bloomery.engine.scheduler import Scheduler, SchedulerError, message_start_id
from bloomery.engine.types import EngineRequest, SamplingParams
from bloomery.gguf_file import open_gguf
from bloomery.plan import Census, make_plan, model_facts

ms = load_tool("make_synthetic")

S, E, NL = 151644, 151645, 198          # <|im_start|>, <|im_end|>, "\n" in the Qwen vocabulary
SMALL = dict(n_layer=4, n_embd=64, n_head=4, n_head_kv=2, head_dim=32, n_expert=4, n_expert_used=2, n_ff_exp=64,
             n_ff_shexp=64, ssm_d_state=16, ssm_n_group=2, ssm_dt_rank=4)
GREEDY = SamplingParams(temperature=0.0, n_probs=1)     # each pick's log-probability too: the check is on the logits


def message(role: int, *text: int) -> list[int]:
    """A ChatML message as the template renders it: <|im_start|>role\\n text <|im_end|>\\n."""
    return [S, role, NL, *text, E, NL]


SYSTEM = message(8948, *range(1000, 1030))                        # "system" and a 30-id system prompt
ASSISTANT = [S, 77091, NL]                                          # the assistant's turn begins


# --- the scheduler alone ---------------------------------------------------------------------

def _req(name: str, ids, cache_prompt: bool = True) -> EngineRequest:
    return EngineRequest(req_id=name, prompt_ids=tuple(ids), n_predict=4, cache_prompt=cache_prompt)


_N = itertools.count()


def _ran(sch: Scheduler, prompt) -> object:
    """Admit a prompt and read it as the engine does: passes cut at message starts, a checkpoint after each
    (the state stands for its position), then the whole prompt held."""
    sch.add(_req(f"r{next(_N)}", prompt))
    (slot,) = sch.schedule()
    n_done = slot.n_cached
    while n_done < len(prompt):
        n_done += sch.cut(slot, n_done, 1000)
        sch.progressed(slot, n_done)
        if sch.at_checkpoint(slot, n_done):
            sch.checkpointed(slot, n_done, f"state@{n_done}")
    sch.prefilled(slot)
    sch.release(slot)
    return slot


def test_passes_end_at_message_starts_and_each_leaves_a_checkpoint():
    sch = Scheduler(1, 256, rewinds=False, n_checkpoints=8, checkpoint_id=S)
    prompt = SYSTEM + message(872, 5, 6, 7) + ASSISTANT
    slot = _ran(sch, prompt)
    starts = [i for i, t in enumerate(prompt) if t == S and i > 0]
    assert [n for n, _ in slot.checkpoints] == starts == [len(SYSTEM), len(SYSTEM) + 8]
    assert [s for _, s in slot.checkpoints] == [f"state@{n}" for n in starts]
    sch.add(_req("cut", prompt))
    (slot,) = sch.schedule()                         # the same prompt: the last checkpoint, its ids re-read
    assert slot.n_cached == starts[-1] and slot.restore == (starts[-1], f"state@{starts[-1]}")
    assert sch.cut(slot, starts[1], 1000) == 1000     # no message start after the last
    assert sch.cut(slot, starts[1], 5) == 5           # a pass never longer than asked
    fresh = Scheduler(1, 256, rewinds=False, n_checkpoints=8, checkpoint_id=S)
    fresh.add(_req("fresh", prompt))
    (slot,) = fresh.schedule()
    assert [fresh.cut(slot, 0, 1000), fresh.cut(slot, 0, 5)] == [starts[0], 5]


def test_a_second_question_keeps_the_checkpoint_after_the_shared_system_prompt():
    sch = Scheduler(1, 256, rewinds=False, n_checkpoints=8, checkpoint_id=S)
    _ran(sch, SYSTEM + message(872, 5, 6, 7) + ASSISTANT)
    sch.add(_req("b", SYSTEM + message(872, 9, 9) + ASSISTANT))
    (slot,) = sch.schedule()
    assert slot.n_cached == len(SYSTEM) and slot.restore[0] == len(SYSTEM)
    assert slot.cached_ids == SYSTEM and [n for n, _ in slot.checkpoints] == [len(SYSTEM)]   # later ones dropped


@pytest.mark.parametrize("checkpoints, rewinds, cache_prompt", [(8, False, True), (0, False, True),
                                                               (8, False, False)])
def test_no_checkpoint_to_keep_reads_the_prompt_whole(checkpoints, rewinds, cache_prompt):
    """A prompt parting before the first checkpoint, checkpoints off, or cache_prompt false: from 0."""
    sch = Scheduler(1, 256, rewinds=rewinds, n_checkpoints=checkpoints, checkpoint_id=S)
    _ran(sch, SYSTEM + message(872, 5) + ASSISTANT)
    assert len(sch.slots[0].checkpoints) == (2 if checkpoints else 0)
    other = SYSTEM[:10] + [4242] + SYSTEM[11:] + message(872, 5) + ASSISTANT    # parts inside the system prompt
    sch.add(_req("b", other if cache_prompt else SYSTEM + message(872, 6), cache_prompt=cache_prompt))
    (slot,) = sch.schedule()
    assert slot.n_cached == 0 and slot.restore is None and slot.checkpoints == []


def test_an_extending_prompt_carries_on_live_and_the_oldest_checkpoint_goes_first():
    sch = Scheduler(1, 512, rewinds=False, n_checkpoints=3, checkpoint_id=S)
    turns, held = SYSTEM, 0
    for q in range(5):
        turns = turns + message(872, 100 + q) + ASSISTANT
        slot = _ran(sch, turns)
        assert slot.restore is None and slot.n_cached == held
        held = len(turns)
        turns = turns + [300 + q, E, NL]             # the answer, as the next turn's prompt carries it
    starts = [i for i, t in enumerate(turns) if t == S and i > 0]
    assert [n for n, _ in slot.checkpoints] == starts[-3:]    # 3 kept of the 10 made, the latest
    assert len(Scheduler(1, 64, rewinds=True, n_checkpoints=3, checkpoint_id=S).slots[0].checkpoints) == 0
    assert Scheduler(1, 64, rewinds=True, n_checkpoints=3, checkpoint_id=S).n_checkpoints == 0   # a KV cache rewinds
    assert Scheduler(1, 64, rewinds=False, n_checkpoints=3, checkpoint_id=None).n_checkpoints == 0
    with pytest.raises(SchedulerError, match="n_checkpoints must be an integer >= 0"):
        Scheduler(1, 64, rewinds=False, n_checkpoints=-1, checkpoint_id=S)


def _spaced(starts: list[int], min_step: int) -> list[int]:
    """llama-server's placement, written out for a prompt read from 0: the first message start, each one more
    than min_step past the last kept, and the last."""
    kept = []
    for p in starts:
        if not kept or p == starts[-1] or p > kept[-1] + min_step:
            kept.append(p)
    return kept


@pytest.mark.parametrize("min_step", [0, 9, 10, 25, 1000])
def test_checkpoints_keep_min_step_apart_but_the_prompts_last_message_start(min_step):
    """--checkpoint-min-step: a message start within min_step ids of the slot's latest checkpoint is passed over
    (its pass does not end there), unless it is the prompt's last; the first is always kept."""
    sch = Scheduler(1, 512, rewinds=False, n_checkpoints=32, checkpoint_id=S, checkpoint_min_step=min_step)
    prompt = SYSTEM + sum((message(872, *range(50, 50 + i % 4)) for i in range(12)), []) + ASSISTANT
    starts = [i for i, t in enumerate(prompt) if t == S and i > 0]
    slot = _ran(sch, prompt)
    got = [n for n, _ in slot.checkpoints]
    assert got == _spaced(starts, min_step)
    assert all(b - a > min_step for a, b in zip(got, got[1:-1]))        # none closer, the last aside
    assert got[0] == starts[0] and got[-1] == starts[-1]
    if min_step == 0:
        assert got == starts                                             # every message start
    if min_step >= 1000:
        assert got == [starts[0], starts[-1]]
    # the passes end only where a checkpoint is taken
    fresh = Scheduler(1, 512, rewinds=False, n_checkpoints=32, checkpoint_id=S, checkpoint_min_step=min_step)
    fresh.add(_req("p", prompt))
    (slot,) = fresh.schedule()
    ends, n_done = [], 0
    while n_done < len(prompt):
        n_done += fresh.cut(slot, n_done, len(prompt) - n_done)
        ends.append(n_done)
        if fresh.at_checkpoint(slot, n_done):
            fresh.checkpointed(slot, n_done, None)
    assert ends == got + [len(prompt)]


def test_a_full_slot_drops_an_earlier_requests_checkpoints_too_close_together_first():
    """llama-server's create_checkpoint: when a new checkpoint fills the slot, those of earlier requests within
    min_step of the one before them go first, then the oldest."""
    sch = Scheduler(1, 512, rewinds=False, n_checkpoints=4, checkpoint_id=S, checkpoint_min_step=8)
    turn = SYSTEM + message(872, 1) + ASSISTANT
    slot = _ran(sch, turn)
    assert [n for n, _ in slot.checkpoints] == [35, 41]          # the first and the prompt's last: 6 apart
    turn = turn + [300, E, NL] + message(872, *range(20)) + ASSISTANT          # extends: carries on live
    slot = _ran(sch, turn)
    starts = [i for i, t in enumerate(turn) if t == S and i > 0]
    assert starts == [35, 41, 47, 72] and [n for n, _ in slot.checkpoints] == [35, 41, 72]   # 47: 6 past 41
    turn = turn + [301, E, NL] + message(872, *range(20)) + ASSISTANT
    slot = _ran(sch, turn)
    # 78 is 6 past 72: passed over; 103 (the last) fills the slot: 41, within 8 of 35 and an earlier request's, goes
    assert [n for n, _ in slot.checkpoints] == [35, 72, 103]
    turn = turn + [302, E, NL] + message(872, 1) + ASSISTANT
    slot = _ran(sch, turn)
    # 109 (6 past 103) passed over, 115 the last
    assert [n for n, _ in slot.checkpoints] == [35, 72, 103, 115]
    turn = turn + [303, E, NL] + message(872, *range(20)) + ASSISTANT
    slot = _ran(sch, turn)
    # 146 fills the slot past its 4, none of the earlier ones within 8 of the one before: the oldest goes
    assert [n for n, _ in slot.checkpoints] == [72, 103, 115, 146]
    with pytest.raises(SchedulerError, match="checkpoint_min_step must be an integer >= 0"):
        Scheduler(1, 64, rewinds=False, n_checkpoints=3, checkpoint_id=S, checkpoint_min_step=-1)


def test_the_message_start_comes_from_the_vocabulary_and_the_template():
    md = {"tokenizer.ggml.tokens": ["a", "<|im_start|>", "b"], "tokenizer.chat_template": "{{'<|im_start|>'}}"}
    assert message_start_id(md) == 1
    assert message_start_id({**md, "tokenizer.chat_template": "{{ bos }}"}) is None
    assert message_start_id({**md, "tokenizer.ggml.tokens": ["a", "b"]}) is None
    assert message_start_id({"tokenizer.ggml.tokens": ["<|im_start|>"]}) is None


# --- the engine over a synthetic qwen35moe file -------------------------------------------------

@pytest.fixture(scope="module")
def small(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "q35_ckpt.gguf"
    ms.write_synthetic(path, arch="qwen35moe", **SMALL)
    return path


def engine(path, n_checkpoints: int = CTX_CHECKPOINTS, n_slots: int = 1, **kw) -> Engine:
    gf = open_gguf(str(path))
    model = model_class(gf.arch())(gf, NumpyOps(), n_slots, 512)
    return Engine(model, n_slots, 512, n_ctx_checkpoints=n_checkpoints, message_start_id=message_start_id(gf.metadata),
                  **kw)


def run(eng: Engine, prompt, n: int = 8, cache_prompt: bool = True) -> tuple[list[tuple[int, float]], int]:
    """((greedy id, its log-probability) per step, cache_n) of one request."""
    rid = f"r{next(_N)}"
    eng.add(EngineRequest(rid, tuple(prompt), n, sampling=GREEDY, cache_prompt=cache_prompt))
    outs = []
    while eng.has_work():
        outs += [o for o in eng.step() if o.req_id == rid]
    assert outs and outs[-1].finish == "length", outs[-1:]
    toks = [o for o in outs if o.token is not None]
    return [(o.token, o.logprob) for o in toks], toks[0].n_cached


def test_the_file_keeps_checkpoints_at_im_start(small):
    eng = engine(small)
    assert eng.scheduler.n_checkpoints == CTX_CHECKPOINTS and eng.scheduler.checkpoint_id == S
    assert engine(small, 0).scheduler.n_checkpoints == 0


def test_a_multi_turn_chat_reusing_a_checkpoint_gives_the_cold_runs_ids(small):
    warm = engine(small)
    turn1 = SYSTEM + message(872, *range(2000, 2012)) + ASSISTANT
    answer, cached = run(warm, turn1)
    assert cached == 0
    # the next turn carries the answer as the template renders it back: not the ids the slot holds
    # (here one differs), so the live state cannot carry on; the assistant turn's start is the checkpoint
    rendered = [answer[0][0] + 1, *(t for t, _ in answer[1:])]
    turn2 = turn1 + rendered + [E, NL] + message(872, *range(3000, 3009)) + ASSISTANT
    ids, cached = run(warm, turn2, 16)
    assert cached == len(turn1) - len(ASSISTANT)
    cold_ids, cold_cached = run(engine(small), turn2, 16)
    assert cold_cached == 0 and ids == cold_ids
    # read in one pass with no checkpoint at all: the same ids; the log-probabilities a few ulps apart (a pass
    # of other length adds some products in another order)
    whole = run(engine(small, 0), turn2, 16)[0]
    assert [t for t, _ in whole] == [t for t, _ in cold_ids]
    np.testing.assert_allclose([p for _, p in whole], [p for _, p in cold_ids], atol=1e-3)
    # and a third turn that does extend what the slot holds (the answer's last id was never fed) carries on live
    turn3 = turn2 + [t for t, _ in ids] + [E, NL] + message(872, 5000) + ASSISTANT
    assert run(warm, turn3, 4)[1] == len(turn2) + len(ids) - 1


def test_a_second_question_after_the_system_prompt_reads_only_past_it(small):
    eng = engine(small)
    run(eng, SYSTEM + message(872, *range(2000, 2010)) + ASSISTANT)
    second = SYSTEM + message(872, *range(4000, 4015)) + ASSISTANT
    ids, cached = run(eng, second)
    assert cached == len(SYSTEM) > 0
    assert ids == run(engine(small), second)[0]


def test_a_prompt_parting_before_any_checkpoint_reads_everything(small):
    eng = engine(small)
    run(eng, SYSTEM + message(872, 7, 8, 9) + ASSISTANT)
    other = [S, 8948, NL, 1000, 999] + SYSTEM[5:] + message(872, 7, 8, 9) + ASSISTANT   # parts at position 4
    ids, cached = run(eng, other)
    assert cached == 0 and ids == run(engine(small), other)[0]


def test_the_plan_counts_the_checkpoints_a_slot_keeps(small):
    gf = open_gguf(str(small))
    facts = model_facts(gf)
    census = Census(host_avail_bytes=64 << 30, card_free_bytes=())
    plans = {n: make_plan(facts, census, "numpy", 1024, 2, n_ctx_checkpoints=n) for n in (0, 4, CTX_CHECKPOINTS)}
    assert facts.message_starts and facts.state_bytes > 0
    for n, plan in plans.items():
        assert plan.checkpoint_bytes == 2 * n * facts.state_bytes
        assert plan.kv_bytes - plans[0].kv_bytes == plan.checkpoint_bytes
    assert make_plan(facts, census, "numpy", 1024, 2).checkpoint_bytes == plans[CTX_CHECKPOINTS].checkpoint_bytes
    # what one checkpoint holds in the engine is what the plan counts for it; a slot keeps at most n
    eng = engine(small, 4)
    prompt = SYSTEM + sum((message(872, 50 + i) for i in range(6)), []) + ASSISTANT
    run(eng, prompt, 2)
    cps = eng.scheduler.slots[0].checkpoints
    assert len(cps) == 4 and [n for n, _ in cps] == [i for i, t in enumerate(prompt) if t == S][-4:]
    assert all(sum(a.nbytes for a in st) == facts.state_bytes == eng.model.checkpoint_bytes for _, st in cps)
    # a file without message starts keeps none, and its plan counts none
    plain = dataclasses.replace(facts, message_starts=False)
    assert make_plan(plain, census, "numpy", 1024, 2).checkpoint_bytes == 0


def test_a_prompt_cancelled_between_its_passes_leaves_the_slot_as_its_state_stands(small):
    """Beside a busy slot a prompt runs a pass a round; its passes end at message starts. Cancelled after one,
    the slot holds what its recurrent state holds (not only the prefix it was admitted with), so the same
    prompt again carries on from there, with a cold run's ids."""
    eng = engine(small, n_slots=2)
    first = SYSTEM + message(872, *range(2000, 2010)) + ASSISTANT
    eng.add(EngineRequest("p1", tuple(first), 4, sampling=GREEDY, id_slot=1))
    while eng.has_work():
        eng.step()
    held = list(eng.scheduler.slots[1].cached_ids)
    again = held + [E, NL] + message(872, *range(6000, 6010)) + ASSISTANT
    eng.add(EngineRequest("busy", (5, 6, 7), 30, sampling=GREEDY, id_slot=0))
    eng.step()
    eng.add(EngineRequest("b", tuple(again), 4, sampling=GREEDY, id_slot=1))
    eng.step()                                        # b's first pass: up to its next message start
    cut = len(held) + 2
    assert eng.scheduler.slots[1].cached_ids == again[:cut]
    eng.cancel("b")
    eng.cancel("busy")
    eng.step()
    ids, cached = run(eng, again, 4)
    cold = run(engine(small), again, 4)[0]
    # the slot read the first answer's ids one decode step at a time, the cold run in a prompt pass: the same
    # ids, log-probabilities a rounding apart
    assert cached == cut and [t for t, _ in ids] == [t for t, _ in cold]
    np.testing.assert_allclose([p for _, p in ids], [p for _, p in cold], atol=1e-3)


# --- the prompt cache of a model that cannot rewind -------------------------------------------------

def test_the_prompt_cache_saves_the_recurrent_state_and_checkpoints_and_restores_at_one(small):
    """Prompts A (system prompt + question 1), B (unrelated) and A' (the system prompt + question 2) on one slot:
    B overwrites the slot, so A' finds the system prompt only in the prompt cache, which keeps A's KV with the
    recurrent state at its end and at its checkpoints; A' restores the checkpoint after the system prompt and
    gives a cold run's ids. A continuation of A then restores A's end state."""
    eng = engine(small, prompt_cache_bytes=64 << 20)
    model = eng.model
    a = SYSTEM + message(872, *range(2000, 2012)) + ASSISTANT
    b = message(8948, *range(5000, 5020)) + ASSISTANT
    a2 = SYSTEM + message(872, *range(4000, 4015)) + ASSISTANT
    answer, cached = run(eng, a)
    assert cached == 0 and eng.prompt_cache.n_entries == 0
    assert run(eng, b)[1] == 0
    (entry,) = eng.prompt_cache.entries()
    held = len(a) + len(answer) - 1                       # the last answer id was never fed
    assert entry.ids == tuple(a + [t for t, _ in answer[:-1]]) and len(entry.ids) == held
    assert [n for n, _ in entry.marks] == [len(SYSTEM), len(a) - len(ASSISTANT), held]
    assert entry.n_bytes == held * model.kv_bytes_per_position + 3 * model.checkpoint_bytes == eng.prompt_cache.n_bytes
    ids, cached = run(eng, a2)
    assert cached == len(SYSTEM) and eng.prompt_cache.n_restored == 1
    assert ids == run(engine(small), a2)[0]
    assert eng.engine_stats()["restore_seconds"] > 0
    # A continued (its answer and a next question): restored at A's end, after a2 and then b's save
    more = list(entry.ids) + [E, NL] + message(872, 7000, 7001) + ASSISTANT
    ids, cached = run(eng, more)
    cold = run(engine(small), more)[0]
    # the answer's ids went through decode steps in the warm slot, a prompt pass in the cold run: the same ids,
    # log-probabilities a rounding apart
    assert cached == held and [t for t, _ in ids] == [t for t, _ in cold]
    np.testing.assert_allclose([p for _, p in ids], [p for _, p in cold], atol=1e-3)


def test_the_recurrent_prompt_cache_keeps_its_budget_oldest_first_and_0_is_off(small):
    model = engine(small).model
    per_pos, per_state = model.kv_bytes_per_position, model.checkpoint_bytes
    # a 25-id first message, a question, the assistant's turn: checkpoints at 25 and 31, the end state at 35
    prompts = [message(8948, *range(1000 * k, 1000 * k + 20)) + message(872, 7) + ASSISTANT for k in (1, 2, 3)]
    b = [S, 8948, NL, 9, 9, 9]
    n_held = len(prompts[0]) + 2 - 1
    one = n_held * per_pos + 3 * per_state                    # one entry's bytes: room for two, not three
    budget = 2 * one + one // 2
    eng = engine(small, prompt_cache_bytes=budget)
    for p in prompts + [b]:
        run(eng, p, 2)
    assert [e.ids[3] for e in eng.prompt_cache.entries()] == [2000, 3000] and eng.prompt_cache.n_evicted == 1
    assert eng.prompt_cache.n_bytes == 2 * one <= budget
    second = prompts[1][:25] + message(872, 8) + ASSISTANT   # the second's first message, another question
    assert run(eng, second, 2)[1] == 25
    assert run(eng, prompts[0][:25] + message(872, 8) + ASSISTANT, 2)[1] == 0   # the oldest went
    off = engine(small, prompt_cache_bytes=0)
    for p in (prompts[1], b):
        run(off, p, 2)
    assert run(off, second, 2)[1] == 0 and off.prompt_cache.n_entries == 0
