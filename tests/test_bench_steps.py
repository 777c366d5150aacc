"""tools/bench_steps.py: its arguments, and the whole tool on the numpy backend with a tiny file."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO, load_tool

st = load_tool("bench_steps")


def test_counts_keep_order_drop_repeats_and_refuse_by_name():
    assert st.counts("--batches", "1, 8,4,8") == [1, 8, 4]
    for bad in ("0", "-2", "x", "4,,8", ""):
        with pytest.raises(st.BenchError, match="--batches: .* is not a positive whole number"):
            st.counts("--batches", bad)


def test_the_slots_and_context_cover_every_measurement():
    assert st.sizes([64, 4096], [1, 16], 512, 40) == (16, 4096)
    assert st.sizes([64], [2, 3], 512, 40) == (3, 553)


def test_kernel_times_are_refused_off_the_card(tmp_path):
    a = st.parse_args(["-m", str(tmp_path / "x.gguf"), "--backend", "numpy", "--kernels"])
    with pytest.raises(st.BenchError, match="--kernels: .*--backend cuda"):
        st.run(a)


def test_the_tool_end_to_end_on_the_numpy_backend(tmp_path, tokenizer_source):
    path = load_tool("make_synthetic").write_synthetic(
        tmp_path / "tiny.gguf", "qwen3moe", tokenizer_from=str(tokenizer_source), n_layer=2, n_embd=64,
        n_head=4, n_head_kv=2, n_expert=8, n_expert_used=2, n_ff_exp=32)
    out = tmp_path / "steps.json"
    r = subprocess.run([sys.executable, str(REPO / "tools" / "bench_steps.py"), "-m", str(path), "--backend", "numpy",
                        "--prompts", "16,40", "--batches", "1,3", "--depth", "20", "--steps", "3", "--reps", "1",
                        "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert set(res["prompt_tok_s"]) == {"16", "40"} and all(v > 0 for v in res["prompt_tok_s"].values())
    assert set(res["decode_step_ms"]) == {"1", "3"} and all(v > 0 for v in res["decode_step_ms"].values())
    assert "decode   3 rows at depth 20:" in r.stdout


def test_prompts_at_a_depth_on_the_numpy_backend(tmp_path, tokenizer_source):
    """--prompt-at D: each pass at position D of a slot holding D ids (a chat's later turn); the slot's context
    leaves room for it; a negative position is refused by name."""
    path = load_tool("make_synthetic").write_synthetic(
        tmp_path / "tiny.gguf", "qwen3", tokenizer_from=str(tokenizer_source), n_layer=1, n_embd=64, n_head=4,
        n_head_kv=2, n_ff=64)
    out = tmp_path / "steps.json"
    base = [sys.executable, str(REPO / "tools" / "bench_steps.py"), "-m", str(path), "--backend", "numpy",
            "--prompts", "8", "--batches", "1", "--depth", "4", "--steps", "2", "--reps", "1"]
    r = subprocess.run(base + ["--prompt-at", "30", "--out", str(out)], capture_output=True, text=True,
                       timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert set(json.loads(out.read_text())["prompt_tok_s"]) == {"8 at 30"}
    assert st.sizes([8], [1], 4, 2, 30) == (1, 8 + 30 + 512)
    r = subprocess.run(base + ["--prompt-at", "-1"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode != 0 and "--prompt-at -1: a position, 0 or more" in r.stdout + r.stderr


def test_placement_flags_read_as_llama_server_and_the_host_account():
    a = st.parse_args(["-m", "x.gguf", "-ncmoe", "24", "-t", "6"])
    assert st.placing(a) and a.n_cpu_moe == 24 and a.threads == 6
    assert st.placing(st.parse_args(["-m", "x.gguf", "--cpu-moe"]))
    assert st.placing(st.parse_args(["-m", "x.gguf", "-fitt", "132803"]))
    assert not st.placing(st.parse_args(["-m", "x.gguf"]))
    before = {"host_wait_s": 1.0, "moved_experts": 3, "layers": [{"hits": 10, "misses": 5}, {"hits": 0, "misses": 1}]}
    after = {"host_wait_s": 1.5, "moved_experts": 7, "layers": [{"hits": 40, "misses": 15}, {"hits": 20, "misses": 1}]}
    assert st.host_share(before, after, 10) == {"host_ms_step": 50.0, "hits": 50 / 60, "moved_experts": 4}
    # with the counts (GET /residency's, the engine's report): the best fixed placement for the picks between
    before["layers"][0].update(counts=[5, 10, 0], on_card=[1]); before["layers"][1].update(counts=[0, 1, 0], on_card=[0])
    after["layers"][0].update(counts=[35, 25, 0], on_card=[1]); after["layers"][1].update(counts=[20, 2, 0], on_card=[2])
    got = st.host_share(before, after, 10)
    assert got["best_static_hits"] == (30 + 20) / (30 + 15 + 20 + 1)


def test_a_placement_flag_is_the_plans_placement(tmp_path, tokenizer_source):
    path = load_tool("make_synthetic").write_synthetic(
        tmp_path / "tiny.gguf", "qwen3moe", tokenizer_from=str(tokenizer_source), n_layer=2, n_embd=64,
        n_head=4, n_head_kv=2, n_expert=8, n_expert_used=2, n_ff_exp=32)
    a = st.parse_args(["-m", str(path), "--backend", "numpy", "-ncmoe", "1"])
    p = st.planned(a, 2, 64)
    assert (p.backend, p.n_slots) == ("numpy", 2) and p.n_ctx_slot >= 64      # the plan rounds the context up


def test_ops_is_the_numpy_backends(tmp_path):
    a = st.parse_args(["-m", str(tmp_path / "x.gguf"), "--backend", "cuda", "--ops"])
    with pytest.raises(st.BenchError, match="--ops: .*--backend numpy"):
        st.run(a)
