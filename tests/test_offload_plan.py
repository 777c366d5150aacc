"""The plan across card and host (bloomery/offload.py through bloomery.plan.make_plan), with a fake census.

A qwen3moe-shaped model built as facts: 4 layers of 8 routed experts, each expert 3 MiB (gate, up and
down stacks of 8 MiB each), 4 MiB of attention and norms a layer, 16 MiB embedding and output head.
"""
from __future__ import annotations

import dataclasses
import json
import sys
import types

import pytest

from bloomery.engine.loader import host_experts, load_model, residency_on
from bloomery.engine.models.base import ModelError
from bloomery.messages import codec
from bloomery.placement import Placement
from bloomery.placement_flags import Override, PlacementAsk
from bloomery.plan import (HOST_RESERVE_BYTES, Census, ModelFacts, PlanError, cuda_host_pass_rows, kv_bytes_for,
                           make_plan, scratch_bytes_for)

MIB = 1 << 20
GIB = 1 << 30
L, E = 4, 8
EXPERT = 3 * MIB                          # one routed expert: 1 MiB in each of gate, up, down


def moe_facts() -> ModelFacts:
    tensors, sizes = [("token_embd.weight", 12, (64, 1000)), ("output.weight", 14, (64, 1000))], [16 * MIB, 16 * MIB]
    for i in range(L):
        tensors.append((f"blk.{i}.attn_q.weight", 12, (64, 64)))
        sizes.append(4 * MIB)
        tensors.append((f"blk.{i}.ffn_gate_inp.weight", 0, (64, E)))
        sizes.append(0)
        for part in ("gate", "up", "down"):
            tensors.append((f"blk.{i}.ffn_{part}_exps.weight", 12, (64, 32, E)))
            sizes.append(E * MIB)
    return ModelFacts("qwen3moe", L, 4096, 64, 4, (2,) * L, 16, 16, 64, 1000,
                      {"Q4_K": sum(sizes)}, 10**6, 64 * 32 * E, tuple(tensors), tuple(sizes), E)


FACTS = moe_facts()
DENSE = 32 * MIB + L * 4 * MIB            # everything but the routed experts
EXPERTS = L * E * EXPERT
KV = kv_bytes_for(FACTS, 4096, 2)
SCRATCH = scratch_bytes_for(FACTS, 4096, "cuda")                      # with host experts
SCRATCH_WHOLE = scratch_bytes_for(FACTS, 4096, "cuda", graphs=True)     # the whole card's: captured short prompts too
MARGIN = 1024 * MIB
HOST = 64 * GIB


def plan(card_free, ask=PlacementAsk(), host=HOST, **kw):
    cards = card_free if isinstance(card_free, tuple) else (card_free,)
    return make_plan(FACTS, Census(host, cards), "cuda", ask=ask, **kw)


def card(p, i=0):
    return p.placement.device(f"cuda:{i}")


def test_a_model_that_fits_goes_whole_on_the_card():
    p = plan(DENSE + EXPERTS + KV + SCRATCH_WHOLE + MARGIN)
    pl = p.placement
    assert (pl.case, pl.tensors, pl.experts_on_card, p.ctx_rule) == ("whole", (), (E,) * L, "target")
    assert card(p).terms.scratch == SCRATCH_WHOLE > SCRATCH
    assert card(p).terms.weights == DENSE + EXPERTS and card(p).terms.pinned == 0
    assert pl.device("host").terms.weights == 0


def test_over_the_card_the_context_shrinks_first_as_llama_server_fits():
    """At the trained 4096 it does not fit; at the 1024-step below it, with -fitc 2048 as the floor, it does."""
    need_at = {c: DENSE + EXPERTS + kv_bytes_for(FACTS, c, 2) + scratch_bytes_for(FACTS, c, "cuda", graphs=True)
               + MARGIN for c in (3072, 4096)}
    p = plan(need_at[3072], PlacementAsk(fit_ctx=2048))
    assert (p.placement.case, p.n_ctx_slot, p.ctx_rule) == ("whole", 3072, "fitted")


@pytest.mark.parametrize("room_experts", [0, 1, 5, 13, 29])
def test_budget_puts_as_many_experts_as_the_card_holds_spread_evenly(room_experts):
    """The card holds dense, KV, scratch, margin and staging, then as many experts as fit; the rest on the host."""
    host_layer = E - room_experts // L          # the most host experts in any layer
    stage = (host_layer + 1) * EXPERT          # the largest layer's host experts + the zero block
    free = DENSE + KV + SCRATCH + MARGIN + room_experts * EXPERT + stage
    p = plan(free)
    pl = p.placement
    assert pl.case == "budget" and p.ctx_rule == "fitted" and p.n_ctx_slot == 4096
    on = pl.experts_on_card
    assert sum(on) == room_experts and max(on) - min(on) <= 1 and list(on) == sorted(on)   # extras: later layers
    t = card(p).terms
    assert (t.weights, t.kv, t.scratch, t.pinned, t.margin) == (DENSE + room_experts * EXPERT, KV, SCRATCH,
                                                                (E - min(on) + 1) * EXPERT, MARGIN)
    assert t.total <= free
    h = pl.device("host").terms
    # the host keeps every expert of a layer with any on the host, pinned (the residency's home)
    assert (h.weights, h.pinned, h.margin) == (sum(E for k in on if k < E) * EXPERT, 0, HOST_RESERVE_BYTES)
    host_slices = [x for x in pl.tensors if x.device == "host"]
    assert len(host_slices) == 3 * sum(k < E for k in on) and all((x.first, x.stop) == (on[int(x.name.split(".")[1])], E)
                                             for x in host_slices)
    assert set(pl.layer_why) <= {"budget: what the card bytes hold, spread evenly", "budget: every expert fits"}
    assert p.card_bytes == (t.total - t.margin,) and p.host_bytes == h.total


def test_budget_is_the_largest_that_fits():
    free = DENSE + KV + SCRATCH + MARGIN + 13 * EXPERT + 6 * EXPERT   # 13 on the card + 5 host a layer staged + zero
    p = plan(free)
    assert sum(p.placement.experts_on_card) == 13 and card(p).terms.total == free
    assert sum(plan(free - 1).placement.experts_on_card) == 12   # 12 on the card need only 5 staged too
    assert card(p).terms.total <= free < card(p).terms.total + EXPERT


def planned_facts(gate_type: int = 12, n_used: int = 8) -> ModelFacts:
    """FACTS with experts the cuda prompt path's planned kernels read (inner sizes whole 64-steps) and
    n_used experts a token; the attention's largest weight is 128 x 64."""
    tensors = [(n, t, (128, 64, E) if "_exps." in n else (128, 64) if ".attn_q." in n else shape)
               for n, t, shape in FACTS.tensors]
    tensors = [(n, gate_type if n.endswith("ffn_gate_exps.weight") else t, shape) for n, t, shape in tensors]
    return dataclasses.replace(FACTS, tensors=tuple(tensors), n_expert_used=n_used, n_ff=64 * n_used,
                               max_tensor_elems=128 * 64 * E)


def test_with_host_experts_prompt_passes_shorten_and_the_freed_scratch_holds_experts():
    """Experts on the host: a prompt pass takes at most 16,384 (token, expert) pairs (2,048 ids at 8 a token):
    smaller activations (a whole-card pass of 4,096 ids takes the planned kernels too, 32,768 pairs, so neither
    counts an f16 copy of an expert stack). The card counts that pass's scratch, and the bytes it frees hold
    routed experts."""
    facts = planned_facts()
    full = scratch_bytes_for(facts, 4096, "cuda")
    short = scratch_bytes_for(facts, 4096, "cuda", rows=2048)
    assert cuda_host_pass_rows(facts) == 2048
    # activations of 2,048 rows fewer (a row: 6 x 64 hidden, 2 x 128 q/k/v, 6 x 512 FFN, f32)
    assert full - short == 4 * 2048 * (6 * 64 + 2 * 128 + 6 * 512)
    # past PLANNED_MAX_PAIRS (a ubatch of 8,192 here) a pass takes the grouped path: f16 copies of three expert
    # stacks (128 x 64 x 8) instead of the largest non-expert, non-head weight (128 x 64)
    wide = scratch_bytes_for(dataclasses.replace(facts, ubatch=8192), 8192, "cuda", rows=8192)
    assert wide - full == 4 * 4096 * (6 * 64 + 2 * 128 + 6 * 512) + 3 * 2 * (128 * 64 * E - 128 * 64)
    kv = kv_bytes_for(facts, 4096, 2)
    stage = (E - 3 + 1) * EXPERT
    free = DENSE + kv + short + MARGIN + 3 * L * EXPERT + stage
    p = make_plan(facts, Census(HOST, (free,)), "cuda")
    pl = p.placement
    assert (pl.case, pl.n_ubatch, pl.experts_on_card) == ("budget", 2048, (3,) * L)
    assert (card(p).terms.scratch, p.scratch_bytes) == (short, short)
    assert any("prompt passes of at most 2048 ids" in text for _, text, _ in p.explain())
    # counted with the full pass's scratch, the same card would hold fewer experts
    assert sum(plan_full(facts, free)) < 3 * L
    # a model that fits keeps the full pass, and captures its short prompts
    whole = make_plan(facts, Census(HOST, (100 * GIB,)), "cuda")
    assert (whole.placement.case, whole.placement.n_ubatch, whole.scratch_bytes) == (
        "whole", 0, scratch_bytes_for(facts, 4096, "cuda", graphs=True))
    # flags that put experts on the host take the short pass too
    flags = make_plan(facts, Census(HOST, (100 * GIB,)), "cuda", ask=PlacementAsk(n_cpu_moe=1))
    assert (flags.placement.n_ubatch, card(flags).terms.scratch) == (2048, short)


def plan_full(facts, free) -> tuple[int, ...]:
    from bloomery import offload
    from bloomery.plan import layout_of
    t_kv = kv_bytes_for(facts, 4096, 2)
    try:
        r = offload.place(layout_of(facts), (free,), HOST, PlacementAsk(), t_kv, scratch_bytes_for(facts, 4096, "cuda"),
                          HOST_RESERVE_BYTES, True)
    except offload.OffloadError:
        return ()
    return r.experts_on_card


@pytest.mark.parametrize("change", ["q3_k gate", "odd width", "dense"])
def test_the_full_pass_stays_where_the_planned_kernels_do_not_apply(change):
    """A Q3_K gate (no planned kernel), an expert width that is not whole 64-steps, or a dense file: the pass
    keeps CUDA_UBATCH rows, and the scratch term is the full one."""
    from bloomery.engine.cuda.sizes import UBATCH
    facts = {"q3_k gate": planned_facts(gate_type=11), "odd width": FACTS,
             "dense": dataclasses.replace(planned_facts(), n_expert=0, n_expert_used=0)}[change]
    assert cuda_host_pass_rows(facts) == UBATCH
    assert scratch_bytes_for(facts, 4096, "cuda", rows=UBATCH) == scratch_bytes_for(facts, 4096, "cuda")


def test_the_planned_kernels_types_are_one_list():
    """plan.py decides the pass from sizes.PLANNED_TYPES; cuda/moe.py launches a kernel per MM_TYPES entry."""
    import ast
    from pathlib import Path
    from bloomery.engine.cuda.sizes import PLANNED_TYPES
    tree = ast.parse(Path(__file__).parent.parent.joinpath("bloomery/engine/cuda/moe.py").read_text())
    mm = next(node.value for node in ast.walk(tree) if isinstance(node, ast.Assign)
              and any(isinstance(t, ast.Name) and t.id == "MM_TYPES" for t in node.targets))
    assert {k.value for k in mm.keys} == set(PLANNED_TYPES)


def test_the_load_takes_the_plans_pass_rows(tokenizer_source, synthetic_dir):
    """load_model reads Placement.n_ubatch: the model's prompt passes are no longer than the plan counted,
    and a prompt longer than one pass gives the logits of the passes the backend would run on its own."""
    from bloomery.placement import whole
    from tests.conftest import load_tool
    path = synthetic_dir / "pass-rows-qwen3moe.gguf"
    if not path.exists():
        load_tool("make_synthetic").write_synthetic(path, "qwen3moe", tokenizer_from=str(tokenizer_source), n_layer=2,
                                                    n_embd=64, n_head=4, n_head_kv=2, n_ff=128, n_expert=8,
                                                    n_expert_used=2, n_ff_exp=64, mode="blocks")
    ids = list(range(100, 180))
    own = load_model(str(path), whole("numpy", 1, 256))
    from bloomery.gguf_file import open_gguf
    from bloomery.plan import model_facts
    facts = model_facts(open_gguf(str(path)))
    planned = make_plan(facts, Census(HOST), "numpy", ctx_size=256, n_ubatch=32)     # -ub 32 on the CPU backend
    assert planned.placement.n_ubatch == 32
    assert planned.scratch_bytes <= make_plan(facts, Census(HOST), "numpy", ctx_size=256).scratch_bytes
    short = load_model(str(path), planned.placement)
    assert (own.n_ubatch, short.n_ubatch) == (512, 32)
    passes = []
    run = short._run
    short._run = lambda chunk, *a: passes.append(len(chunk)) or run(chunk, *a)
    got = short.prefill(0, ids, 0)
    assert passes == [32, 32, 16]
    ref = own.prefill(0, ids, 0)          # one pass of 80: other kernels, so other roundings
    assert got.argmax() == ref.argmax() and abs(got - ref).max() < 0.01 * (ref.max() - ref.min())


@pytest.mark.parametrize("n,host_layers", [(0, 0), (1, 1), (3, 3), (4, 4), (100, 4)])
def test_ncmoe_puts_the_first_layers_experts_on_the_host(n, host_layers):
    p = plan(100 * GIB, PlacementAsk(n_cpu_moe=n))
    pl = p.placement
    assert pl.case == "flags"
    assert pl.experts_on_card == (0,) * host_layers + (E,) * (L - host_layers)
    assert pl.layer_why[:host_layers] == (f"-ncmoe {n}",) * host_layers
    assert pl.device("host").terms.weights == host_layers * E * EXPERT
    assert card(p).terms.weights == DENSE + (L - host_layers) * E * EXPERT
    assert card(p).terms.pinned == ((E + 1) * EXPERT if host_layers else 0)
    assert {t.name for t in pl.tensors} == {f"blk.{i}.ffn_{x}_exps.weight" for i in range(host_layers)
                                            for x in ("gate", "up", "down")}


def test_cpu_moe_puts_every_routed_expert_on_the_host():
    p = plan(100 * GIB, PlacementAsk(cpu_moe=True))
    assert p.placement.experts_on_card == (0,) * L and card(p).terms.weights == DENSE
    assert p.placement.device("host").terms.weights == EXPERTS
    assert plan(100 * GIB, PlacementAsk(n_cpu_moe=L)).placement.devices == p.placement.devices


def test_override_tensor_places_single_tensors():
    ask = PlacementAsk(overrides=(Override(r"blk\.1\.ffn_down_exps", "CPU"), Override("output", "CPU")))
    p = plan(100 * GIB, ask)
    pl = p.placement
    assert {(t.name, t.device) for t in pl.tensors} == {("blk.1.ffn_down_exps.weight", "host"),
                                                         ("output.weight", "host")}
    assert pl.experts_on_card == (E, 0, E, E)          # layer 1's experts are not whole on a card
    assert pl.device("host").terms.weights == E * MIB + 16 * MIB
    assert card(p).terms.weights == DENSE - 16 * MIB + EXPERTS - E * MIB
    assert pl.layer_why[1] == r"-ot blk\.1\.ffn_down_exps=CPU"


def test_flags_are_not_fitted_around():
    small = DENSE + KV + SCRATCH + MARGIN + EXPERT
    with pytest.raises(PlanError, match="the placement flags' rules does not fit: cuda:0 needs"):
        plan(small, PlacementAsk(n_cpu_moe=1), ctx_size=4096)


def test_fit_off_refuses_a_model_over_the_card():
    with pytest.raises(PlanError, match="the whole model on the card does not fit.*-fit off keeps every expert"):
        plan(DENSE + KV + SCRATCH + MARGIN + 5 * EXPERT, PlacementAsk(fit=False), ctx_size=4096)


def test_a_start_that_fits_neither_card_nor_host_names_every_term():
    with pytest.raises(PlanError) as e:
        plan(DENSE + KV + SCRATCH + MARGIN + 2 * 8 * EXPERT, host=100 * MIB)
    msg = str(e.value)
    for part in ("with routed experts moved to the host", "host needs", "weights",
                 f"reserve {HOST_RESERVE_BYTES}", f"{100 * MIB} available"):
        assert part in msg, (part, msg)
    with pytest.raises(PlanError, match="cuda:0 needs .*kv .*scratch .*pinned staging .*margin"):
        plan(MARGIN + DENSE, host=HOST)


def test_several_cards_the_largest_runs_every_layer_the_others_hold_experts():
    main_free = DENSE + KV + SCRATCH + MARGIN + 24 * EXPERT   # 16 experts + staging of 4 host experts a layer
    p = plan((MARGIN + 8 * EXPERT, main_free))
    pl = p.placement
    assert pl.default_device == "cuda:1" and pl.case == "budget"
    c0, c1 = card(p, 0), card(p, 1)
    assert c1.terms.kv == KV and c0.terms.kv == 0 and c0.terms.scratch == 0
    assert sum(c0.experts) == 8 and c0.terms.weights == 8 * EXPERT and c0.terms.total <= MARGIN + 8 * EXPERT
    assert [a + b for a, b in zip(c0.experts, c1.experts)] == list(pl.experts_on_card)
    slices = [t for t in pl.tensors if t.device == "cuda:0"]
    assert slices and all(t.first == c1.experts[int(t.name.split(".")[1])] for t in slices)
    host = pl.device("host").terms.weights
    assert host == sum(E for k in pl.experts_on_card if k < E) * EXPERT   # every expert of a layer with host ones


def test_tensor_split_shares_and_split_mode_none():
    room = MARGIN + 32 * EXPERT
    main_free = DENSE + KV + SCRATCH + MARGIN + (E + 1) * EXPERT
    big = plan((room, room, main_free), PlacementAsk(tensor_split=(3, 1, 1)))
    assert sum(card(big, 0).experts) == 3 * sum(card(big, 1).experts) > 0
    one = plan((room, main_free), PlacementAsk(split_mode="none"))
    assert card(one, 0).terms.total == 0 and sum(card(one, 1).experts) == sum(one.placement.experts_on_card)
    assert plan((main_free, 100 * GIB), PlacementAsk(main_gpu=0)).placement.default_device == "cuda:0"
    assert plan((main_free, 100 * GIB)).placement.default_device == "cuda:1"


@pytest.mark.parametrize("cards,ask,match", [
    ((10 * GIB,), PlacementAsk(tensor_split=(1, 1)), r"-ts lists 2 shares; the census lists 1 card\(s\) \(CUDA0\)"),
    ((10 * GIB, 10 * GIB), PlacementAsk(tensor_split=(1, 1, 1)), "-ts lists 3 shares"),
    ((10 * GIB,), PlacementAsk(main_gpu=1), "-mg 1: no such card"),
    ((10 * GIB,), PlacementAsk(overrides=(Override("exps", "CUDA1"),)), "unknown buffer type CUDA1; this host has CPU, CUDA0"),
    ((2 * GIB,), PlacementAsk(fit_target_mib=(2048,)), "-fitt 2048 leaves no usable byte on CUDA0"),
    ((10 * GIB, 2 * GIB), PlacementAsk(fit_target_mib=(100, 4096)), "-fitt 4096 leaves no usable byte on CUDA1"),
    ((10 * GIB,), PlacementAsk(fit_target_mib=(1, 2)), "-fitt lists 2 margins; give one"),
])
def test_bad_placement_input_is_refused_by_name(cards, ask, match):
    with pytest.raises(PlanError, match=match):
        plan(cards, ask)


def test_fitt_sets_the_margin():
    p = plan(100 * GIB, PlacementAsk(fit_target_mib=(5000,)))
    assert card(p).terms.margin == 5000 * MIB


def test_cpu_backend_refuses_a_card_buffer_type():
    with pytest.raises(PlanError, match="-ot exps=CUDA0: the CPU backend holds every tensor on the host"):
        make_plan(FACTS, Census(HOST), "numpy", ask=PlacementAsk(overrides=(Override("exps", "CUDA0"),)))


def test_plan_prints_case_terms_and_layers():
    p = plan(DENSE + KV + SCRATCH + MARGIN + 22 * EXPERT)     # 17 on the card, 4 host a layer staged, the zero block
    text = [t for _, t, _ in p.explain()]
    assert any(t.startswith('placement "budget": the model does not fit the card') for t in text)
    line = next(t for t in text if t.startswith("cuda:0 needs"))
    for part in ("dense weights", "routed experts 0.050 GiB", "KV", "scratch", "pinned staging", "margin kept free"):
        assert part in line, (part, line)
    assert "layers 0-2: 4 of 8 routed experts on a card (budget: what the card bytes hold, spread evenly)" in text
    assert "layer 3: 5 of 8 routed experts on a card (budget: what the card bytes hold, spread evenly)" in text
    flags = [t for _, t, _ in plan(100 * GIB, PlacementAsk(n_cpu_moe=1)).explain()]
    assert "layer 0: 0 of 8 routed experts on a card (-ncmoe 1)" in flags


def test_the_placement_travels_typed_and_the_load_reads_its_host_experts():
    pl = plan(100 * GIB, PlacementAsk(n_cpu_moe=2)).placement
    back = codec.build(Placement, json.loads(json.dumps(codec.to_plain(pl))), "placement")
    assert back == pl and back.tensors[0].device == "host"
    assert host_experts(pl) == {f"blk.{i}.ffn_{x}_exps.weight": (0, E) for i in (0, 1) for x in ("gate", "up", "down")}
    assert not residency_on(pl)                           # a placement flag: fixed placement, repeatable tokens
    budget = plan(DENSE + KV + SCRATCH + MARGIN + 22 * EXPERT).placement
    assert host_experts(budget)["blk.3.ffn_up_exps.weight"] == (5, E) and residency_on(budget)
    whole = plan(100 * GIB).placement
    assert not whole.off_card and host_experts(whole) == {}


def test_a_load_refuses_what_this_build_cannot_carry_out_before_reading():
    dense_away = plan(100 * GIB, PlacementAsk(overrides=(Override("attn_q", "CPU"),))).placement
    with pytest.raises(ModelError, match=r"this build runs only routed experts away from cuda:0 \(on the host\); "
                                         r"the placement also puts blk\.0\.attn_q\.weight on host"):
        load_model("/nonexistent/never-read.gguf", dense_away)
    half = plan(100 * GIB, PlacementAsk(overrides=(Override(r"blk\.0\.ffn_gate_exps", "CPU"),))).placement
    with pytest.raises(ModelError, match=r"layer blk\.0: its gate, up and down experts must sit together"):
        load_model("/nonexistent/never-read.gguf", half)


def test_residency_is_off_by_env(monkeypatch):
    budget = plan(DENSE + KV + SCRATCH + MARGIN + 22 * EXPERT).placement
    monkeypatch.setenv("BLOOMERY_RESIDENCY", "off")
    assert not residency_on(budget)


@pytest.mark.slow
@pytest.mark.real_model
def test_plan_run_reads_each_placement_flag_and_refuses_a_card_buffer_on_cpu(real_model_path, synthetic_dir):
    """bloomery-serve --plan on a synthetic qwen3moe file: one record per placement flag, no weight read."""
    import subprocess
    import sys

    from conftest import load_tool
    path = synthetic_dir / "offload_moe.gguf"
    if not path.exists():
        load_tool("make_synthetic").write_synthetic(path, arch="qwen3moe", tokenizer_from=str(real_model_path))
    run = [sys.executable, "-m", "bloomery.supervisor", "-m", str(path), "--plan", "--backend", "cpu", "-c", "512"]
    r = subprocess.run([*run, "-ncmoe", "1", "-ot", r"blk\.1\.ffn_up_exps=CPU", "-fitt", "512", "-sm", "layer"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    read = [line for line in r.stderr.splitlines() if "placement flag read" in line]
    assert len(read) == 4 and "layer 0's routed experts on the host" in read[0], read
    assert "every card keeps 512 MiB free" in r.stderr and "loading weights" not in r.stderr
    r = subprocess.run([*run, "-ot", "exps=CUDA0"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "-ot exps=CUDA0: the CPU backend holds every tensor on the host" in r.stderr


def test_the_plan_stage_reads_the_ask_and_refuses_another_main_card(monkeypatch):
    """stages/plan.make: the supervisor's plain PlacementAsk is rebuilt and planned; -mg 1 is refused by name."""
    import bloomery.plan as plan_mod
    from bloomery.stages.common import StageRefusal
    from bloomery.stages.plan import make as stage_make

    import bloomery.header_check as header_check
    monkeypatch.setattr(plan_mod, "model_facts", lambda gf: FACTS)     # the facts above stand for the file
    monkeypatch.setattr(header_check, "check_header", lambda *a: None)  # (no file: its checks have tests of their own)
    gf = types.SimpleNamespace(path="stand-in.gguf", metadata={}, tensors={})
    args = {"device": "cuda", "placement_ask": codec.to_plain(PlacementAsk(main_gpu=1))}
    with pytest.raises(StageRefusal, match=r"-mg 1: this build runs every layer on the first card \(CUDA0\)"):
        stage_make(args, gf, Census(HOST, (100 * GIB, 100 * GIB)))
    args["placement_ask"] = codec.to_plain(PlacementAsk(n_cpu_moe=2))
    p, _ = stage_make(args, gf, Census(HOST, (100 * GIB,)))
    assert p.placement.case == "flags" and p.placement.experts_on_card == (0, 0, E, E)


def test_a_bad_cuda_wait_mode_is_refused_by_name(monkeypatch):
    from bloomery.engine import loader
    monkeypatch.setenv("BLOOMERY_CUDA_SYNC", "sometimes")
    with pytest.raises(ModelError, match=r"BLOOMERY_CUDA_SYNC='sometimes': choose one of auto, spin, yield, blocking"):
        loader._sync_flags()
    monkeypatch.setenv("BLOOMERY_CUDA_SYNC", "auto")
    loader._sync_flags()                                  # CUDA's default: nothing is set, no card needed


def test_a_wait_mode_this_cupy_cannot_set_is_refused_by_name(monkeypatch):
    """CuPy 14's runtime module has no setDeviceFlags (the engine died of an AttributeError on the H200, run O):
    the start is refused with the reason, not crashed."""
    from bloomery.engine import loader
    fake = types.ModuleType("cupy")
    fake.__version__ = "14.0.0"
    fake.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace())
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setenv("BLOOMERY_CUDA_SYNC", "blocking")
    with pytest.raises(ModelError, match=r"BLOOMERY_CUDA_SYNC=blocking: this CuPy \(14.0.0\) cannot set the card's wait"):
        loader._sync_flags()


def test_ubatch_size_sets_the_pass_the_plan_counts():
    """-ub N: a pass of at most N ids on either backend; the scratch is that pass's, --plan names it, and on a card
    with host experts the shorter of -ub and the planned kernels' pass wins."""
    facts = planned_facts()
    big = make_plan(facts, Census(HOST, (100 * GIB,)), "cuda")
    small = make_plan(facts, Census(HOST, (100 * GIB,)), "cuda", n_ubatch=512)
    assert (big.placement.n_ubatch, small.placement.n_ubatch) == (0, 512)
    assert small.scratch_bytes == scratch_bytes_for(facts, 4096, "cuda", rows=512, graphs=True) < big.scratch_bytes
    assert any("prompt passes of at most 512 ids: -ub 512 set it" in text for _, text, _ in small.explain())
    host = make_plan(facts, Census(HOST, (100 * GIB,)), "cuda", ask=PlacementAsk(n_cpu_moe=1), n_ubatch=1024)
    assert host.placement.n_ubatch == 1024
    with pytest.raises(PlanError, match=r"--ubatch-size 0: give a whole number of ids"):
        make_plan(facts, Census(HOST, (100 * GIB,)), "cuda", n_ubatch=0)
