"""tools/bench_serve.py: the percentiles, the cells, the replay's requests, the per-round figures, the
JSON and the arguments; and the whole tool end to end on the CPU backend (a tiny file, K = 1 and 2)."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO, load_tool

bs = load_tool("bench_serve")
bh = load_tool("bench_http")


@pytest.mark.parametrize("n", [1, 2, 5, 48, 101])
def test_percentiles_are_numpys_linear_ones(n):
    xs = list(np.random.default_rng(n).exponential(size=n))
    for q in (0, 50, 90, 99, 100):
        assert bs.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12)
    assert bs.percentile([3.0, None, 1.0], 50) == 2.0 and bs.percentile([], 50) is None
    with pytest.raises(bs.BenchError, match="percentile 101 is not in 0..100"):
        bs.percentile([1.0], 101)


def test_every_cell_once_in_run_order():
    cells = bs.cell_list(["bloomery", "llama"])
    assert len(cells) == len({c.name for c in cells}) == 2 * (4 * 2 + 2)
    assert [c.name for c in cells[:3]] == ["bloomery/k1/p512", "bloomery/k1/p4096", "bloomery/k4/p512"]
    assert [c.name for c in cells[8:10]] == ["bloomery/replay/cram0", "bloomery/replay/cram"]
    assert cells[-1].name == "llama/replay/cram"
    c = cells[7]
    assert (c.name, c.k, c.p, c.group) == ("bloomery/k16/p4096", 16, 4096, "bloomery/k16")
    assert cells[8].group == "bloomery/replay/cram0" and cells[8].k == 0      # each replay its own server


def test_cells_are_picked_by_pattern_and_bad_ones_refused():
    pick = bs.cell_list(["bloomery", "llama"], patterns=["llama/k1*", "replay/cram0"])
    assert [c.name for c in pick] == ["bloomery/replay/cram0", "llama/k1/p512", "llama/k1/p4096",
                                      "llama/k16/p512", "llama/k16/p4096", "llama/replay/cram0"]
    assert [c.name for c in bs.cell_list(["bloomery"], [1, 4], [64], replay=False)] == ["bloomery/k1/p64",
                                                                                        "bloomery/k4/p64"]
    with pytest.raises(bs.BenchError, match="--engines: 'vllm' is not one of bloomery, llama"):
        bs.cell_list(["vllm"])
    with pytest.raises(bs.BenchError, match="--cells k3/\\*: no cell matches"):
        bs.cell_list(["bloomery"], patterns=["k3/*"])
    with pytest.raises(bs.BenchError, match="must be positive"):
        bs.cell_list(["bloomery"], [0])


def test_the_replay_interleaves_the_users_turns_over_one_system_prompt():
    systems, sched = bs.replay_schedule(8, 3, 4000, 100)
    system = systems[0]
    assert len(system) == 4000 and len(sched) == 24 and all(s == system for s in systems)
    assert [(u, t) for u, t, _ in sched[:9]] == [(u, 0) for u in range(8)] + [(0, 1)]
    assert [(u, t) for u, t, _ in sched[-2:]] == [(6, 2), (7, 2)]
    assert all(len(m) == 100 for _, _, m in sched) and len({tuple(m) for _, _, m in sched}) == 24
    assert bs.replay_schedule(8, 3, 4000, 100) == (systems, sched)       # the same for both engines
    # a user's turn extends its last prompt and the reply it got: what a prompt cache can restore
    history = {}
    prompts = {}
    for u, t, m in sched:
        p = bs.replay_prompt(system, history.get(u, []), m)
        if t:
            last, reply = prompts[u], history[u][-1][1]
            assert p[:len(last) + len(reply)] == last + reply
        assert p[:4000] == system
        prompts[u] = p
        history.setdefault(u, []).append((m, [7] * 16))
    assert max(len(p) for p in prompts.values()) == bs.replay_longest(4000, 3, 100, 16) == 4000 + 300 + 32
    with pytest.raises(bs.BenchError, match="the replay needs users, turns, system and user ids >= 1"):
        bs.replay_schedule(8, 0, 4000, 100)


def test_with_own_documents_no_two_users_share_a_prefix():
    systems, sched = bs.replay_schedule(4, 2, 500, 50, own=True)
    assert len(systems) == 4 and all(len(s) == 500 for s in systems)
    assert len({tuple(s[:8]) for s in systems}) == 4
    prompts = [bs.replay_prompt(systems[u], [], m) for u, _, m in sched[:4]]
    assert all(a[:8] != b[:8] for i, a in enumerate(prompts) for b in prompts[i + 1:])
    assert bs.replay_schedule(4, 2, 500, 50, own=True) == (systems, sched)


def test_a_slot_holds_the_longest_prompt_and_the_generated_ids():
    cells = bs.cell_list(["bloomery"], [4], [512, 4096], replay=False)
    assert bs.slot_ctx(cells, 128, 0) == 4352
    assert bs.slot_ctx(cells[:1], 128, 0) == 768
    assert bs.slot_ctx([bs.Cell("llama", "replay/cram")], 128, 4700) == 4864      # 4700 + 128 + 1, up to 256s


def stream(t_sent, t_first, t_last, n, rate=None):
    s = bh.Streamed(t_sent=t_sent, t_first=t_first, t_last=t_last, ids=list(range(n)))
    s.final = {"timings": {"predicted_per_second": rate}}
    return s


def test_a_rounds_figures_and_a_cells():
    # two streams: ids after the first 9 + 19 over the window 1.0 .. 3.0
    r = bs.round_stats([stream(0.0, 1.0, 2.0, 10, 9.0), stream(0.5, 1.5, 3.0, 20, 12.0)])
    assert r["aggregate_decode_tok_s"] == pytest.approx(28 / 2.0)
    assert r["stream_decode_tok_s"] == pytest.approx((9 / 1.0 + 19 / 1.5) / 2)
    assert r["server_decode_tok_s"] == pytest.approx(10.5)
    assert r["ttft_s"] == [1.0, 1.0] and r["n_ids"] == [10, 20] and r["wall_s"] == 3.0
    nothing = bs.round_stats([bh.Streamed(t_sent=0.0)])
    assert nothing["aggregate_decode_tok_s"] is None and nothing["ttft_s"] == [None]
    rounds = [dict(r, aggregate_decode_tok_s=a, ttft_s=t) for a, t in ((10.0, [0.1, 0.2]), (30.0, [0.3, 0.4]),
                                                                       (20.0, [0.5, 0.6]))]
    c = bs.cell_summary(rounds)
    assert c["aggregate_decode_tok_s"] == 20.0 and c["ttft_p50_s"] == pytest.approx(0.35)
    assert c["ttft_p99_s"] == pytest.approx(float(np.percentile([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], 99)))
    turns = [{"turn": 0, "ttft_s": 2.0, "cache_n": 0}, {"turn": 1, "ttft_s": 0.2, "cache_n": 4100},
             {"turn": 1, "ttft_s": 0.4, "cache_n": 4000}]
    rs = bs.replay_summary(turns)
    assert (rs["ttft_median_s"], rs["ttft_median_later_s"], rs["cache_n_median"]) == (0.4, pytest.approx(0.3), 4050)


@pytest.mark.parametrize("args,words", [
    (["--engines", "llama"], "--engines llama needs --llama-server PATH"),
    (["--ks", "1,x"], "--ks '1,x': a comma list of counts"),
    (["--prompts", "0"], "--prompts '0': counts >= 1"),
    (["--cells", "nothing"], "--cells nothing: no cell matches"),
    (["--n-gen", "1"], "--n-gen (>= 2)"),
    (["--turns", "0"], "the replay needs users, turns"),
])
def test_bad_arguments_are_refused_by_name(tmp_path, capsys, args, words):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    with pytest.raises(SystemExit):
        bs.parse_args(["--model", str(model), "--engines", "bloomery", "--out", str(tmp_path / "o.json"), *args])
    assert words in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bs.parse_args(["--model", str(tmp_path / "none.gguf"), "--out", str(tmp_path / "o.json")])
    assert "no such file" in capsys.readouterr().err


@pytest.mark.slow
def test_the_tool_end_to_end_on_the_cpu_backend(tmp_path, tokenizer_source):
    """bloomery-serve on a tiny qwen3moe file: K = 1 and 2 concurrent streams and both replays measured
    through HTTP, the JSON written after each cell, a rerun skipping what it holds."""
    path = load_tool("make_synthetic").write_synthetic(
        tmp_path / "tiny.gguf", "qwen3moe", tokenizer_from=str(tokenizer_source), n_layer=2, n_embd=64,
        n_head=4, n_head_kv=2, n_expert=8, n_expert_used=2, n_ff_exp=32)
    out = tmp_path / "bench" / "o.json"
    out.parent.mkdir()
    cmd = [sys.executable, str(REPO / "tools" / "bench_serve.py"), "--model", str(path), "--engines", "bloomery",
           "--backend", "cpu", "--ks", "1,2", "--prompts", "24", "--n-gen", "4", "--runs", "1", "--users", "2",
           "--turns", "2", "--system-ids", "40", "--user-ids", "8", "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    k2 = res["cells"]["bloomery/k2/p24"]
    assert k2["rounds"][0]["n_ids"] == [4, 4] and len(k2["rounds"][0]["ttft_s"]) == 2
    assert k2["ttft_p50_s"] > 0 and k2["ttft_p99_s"] >= k2["ttft_p50_s"]
    assert k2["aggregate_decode_tok_s"] is None or k2["aggregate_decode_tok_s"] > 0   # None: every piece at once
    assert "-np 2" in res["groups"]["bloomery/k2"]["command"]
    cold, warm = res["cells"]["bloomery/replay/cram0"], res["cells"]["bloomery/replay/cram"]
    assert "--cache-ram 0" in res["groups"]["bloomery/replay/cram0"]["command"]
    assert "--cache-ram" not in res["groups"]["bloomery/replay/cram"]["command"]
    assert [t["n_prompt"] for t in cold["turns"]] == [48, 48, 60, 60] == [t["n_prompt"] for t in warm["turns"]]
    # one slot, users interleaved: without the cache only the system prompt is kept, with it the user's own turn
    assert [t["cache_n"] for t in cold["turns"][2:]] == [40, 40]
    assert [t["cache_n"] for t in warm["turns"][2:]] == [48 + 3, 48 + 3]
    assert "bloomery: the replay's median TTFT is" in r.stdout
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert again.returncode == 0 and "bloomery/k1/p24: in " in again.stdout
    assert json.loads(out.read_text())["cells"]["bloomery/k2/p24"] == k2


def test_a_cell_longer_than_the_files_training_context_is_refused_before_any_server(tmp_path, capsys,
                                                                                   tokenizer_source):
    path = load_tool("make_synthetic").write_synthetic(tmp_path / "short.gguf", "qwen3", ctx_train=1024,
                                                       tokenizer_from=str(tokenizer_source))
    base = ["--model", str(path), "--engines", "bloomery", "--out", str(tmp_path / "o.json"), "--n-gen", "16"]
    a = bs.parse_args(base + ["--prompts", "512", "--system-ids", "600", "--turns", "2", "--user-ids", "64"])
    assert [c.name for c in a.cell_list][-1] == "bloomery/replay/cram"          # 600 + 128 + 16 + 16 fits
    with pytest.raises(SystemExit):
        bs.parse_args(base + ["--prompts", "1024", "--cells", "k1/*"])
    assert "a slot needs 1040 positions" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bs.parse_args(base + ["--prompts", "64", "--system-ids", "1000"])
    assert "above the file's qwen3.context_length 1024" in capsys.readouterr().err
