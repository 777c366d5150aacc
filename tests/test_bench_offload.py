"""tools/bench_offload.py: the cells, the -fitt and -ncmoe arithmetic, the floors, the skew from
/residency, the JSON, the arguments; and the HTTP path end to end on the CPU backend."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO, load_tool

bo = load_tool("bench_offload")
bc = load_tool("bench_cuda")
MIB = 1 << 20

# the Qwen3-30B-A3B-shaped Q4_K_M file's facts as tools/bench_cuda.file_facts reads them (rounded)
FACTS = bc.FileFacts(file_bytes=19_810_000_000, n_layer=48, n_expert=128, n_used=8, expert_bytes=3_000_000,
                     dense_token_bytes=850_000_000, kv_bytes_per_pos=98_304)


def test_every_cell_once_in_run_order_and_ncmoe_is_llamas_only():
    cells = bo.cell_list(["uniform", "skewed"], ["bloomery", "llama"], bo.cell_tests())
    assert len(cells) == 2 * (3 + 4) * 3 == len({c.name for c in cells})
    assert cells[0].name == "uniform/bloomery/whole/tg128" and cells[-1].name == "skewed/llama/ncmoe/pp4096"
    assert not [c for c in cells if c.budget == "ncmoe" and c.engine == "bloomery"]
    assert [c.model for c in cells] == sorted((c.model for c in cells), key=["uniform", "skewed"].index)


def test_cells_are_picked_by_pattern():
    pick = bo.cell_list(["u", "s"], ["bloomery", "llama"], bo.cell_tests(), ["s/*/fit/*", "host/tg128"])
    assert [c.name for c in pick] == ["u/bloomery/host/tg128", "u/llama/host/tg128", "s/bloomery/fit/tg128",
                                      "s/bloomery/fit/pp512", "s/bloomery/fit/pp4096", "s/bloomery/host/tg128",
                                      "s/llama/fit/tg128", "s/llama/fit/pp512", "s/llama/fit/pp4096",
                                      "s/llama/host/tg128"]
    assert [c.name for c in bo.cell_list(["u"], ["bloomery"], bo.cell_tests([64], 8), ["*/whole/pp*"])] == \
        ["u/bloomery/whole/pp64"]


@pytest.mark.parametrize("call,words", [
    (lambda: bo.cell_list(["u"], ["vllm"], bo.cell_tests()), "--engines: 'vllm' is not one of bloomery, llama"),
    (lambda: bo.cell_list([], ["llama"], bo.cell_tests()), "at least one model"),
    (lambda: bo.cell_list(["u"], ["bloomery"], bo.cell_tests(), ["*/ncmoe/*"]), "--cells */ncmoe/*: no cell matches"),
    (lambda: bo.fit_target_mib(143771 * MIB, 160_000_000_000), "--usable-gb 160 GB is not below the card's 150.8 GB"),
    (lambda: bo.fit_target_mib(143771 * MIB, 0), "leaves the card nothing"),
    (lambda: bo.engine_flags("bloomery", "ncmoe", ncmoe=3), "no budget 'ncmoe' for bloomery"),
    (lambda: bo.engine_flags("llama", "ncmoe"), "needs a count"),
    (lambda: bo.engine_flags("llama", "fit"), "needs the card's total"),
    (lambda: bo.decode_floor(FACTS, 1.5, 1e9, None, 1e12), "host share 1.5 must be in [0, 1]"),
    (lambda: bo.residency_summary({"experts": []}), "GET /residency: no layers list"),
])
def test_bad_values_are_refused_by_name(call, words):
    with pytest.raises(bo.BenchError) as e:
        call()
    assert words in str(e.value)


def test_fit_target_leaves_the_usable_bytes():
    total = 143771 * MIB                                        # an H200 as nvidia-smi counts it
    fitt = bo.fit_target_mib(total, 11_500_000_000)
    assert fitt == 132803
    assert 0 <= total - fitt * MIB - 11_500_000_000 < MIB       # usable: 11.5 GB, less than a MiB over


def test_engine_flags_spell_each_budget():
    assert bo.engine_flags("bloomery", "whole") == [] and bo.engine_flags("llama", "whole") == ["-ngl", "99"]
    assert bo.engine_flags("bloomery", "fit", 132803) == bo.engine_flags("llama", "fit", 132803) == ["-fitt", "132803"]
    assert bo.engine_flags("bloomery", "host") == ["--cpu-moe"]
    assert bo.engine_flags("llama", "host") == ["-ngl", "99", "--cpu-moe"]
    assert bo.engine_flags("llama", "ncmoe", ncmoe=22) == ["-ngl", "99", "-ncmoe", "22"]


@pytest.mark.parametrize("start", [0, 18, 22, 30, 48])
def test_ncmoe_search_finds_the_smallest_count_that_fits(start):
    probed = []

    def probe(n):               # the card's use falls 0.4 GB for each layer whose experts leave it
        probed.append(n)
        return int(20e9 - n * 0.4e9)
    chosen, probes = bo.search_ncmoe(probe, 48, 11_500_000_000, start, max_probes=40)
    assert chosen == 22                                         # 20 - 22 * 0.4 = 11.2 <= 11.5 < 11.6
    assert dict(probes) == {n: int(20e9 - n * 0.4e9) for n in probed} and len(probed) == len(set(probed))
    assert 21 in probed and 22 in probed


def test_ncmoe_search_gives_up_by_name():
    assert bo.search_ncmoe(lambda n: int(30e9 - n * 0.1e9), 48, 11_500_000_000, 40)[0] is None   # 48 still over
    chosen, probes = bo.search_ncmoe(lambda n: int(20e9 - n * 0.4e9), 48, 11_500_000_000, 0, max_probes=3)
    assert chosen is None and [n for n, _ in probes] == [0, 1, 2]


def test_ncmoe_start_counts_the_layers_to_move():
    layer = FACTS.n_expert * FACTS.expert_bytes                 # 384 MB a layer
    start = bo.ncmoe_start(FACTS, 11_500_000_000)
    assert start == -(-(FACTS.file_bytes + (3 << 30) - 11_500_000_000) // layer) == 31
    assert bo.ncmoe_start(FACTS, 40_000_000_000) == 0


def test_decode_floor_is_the_issues_arithmetic():
    # every expert on the host: 48 x 8 x 3.0 MB = 1.15 GB a token; 82 GB/s reads it 71 times a second,
    # with 55 GB/s of copy beside it 119 (issue 14's figures)
    f = bo.decode_floor(FACTS, 1.0, 82e9, 55e9, 4.2e12)
    assert f["host_bytes"] == 48 * 8 * 3_000_000
    assert f["host"] == pytest.approx(82e9 / 1.152e9) and round(f["host"]) == 71
    assert f["split"] == pytest.approx(137e9 / 1.152e9) and round(f["split"]) == 119
    whole = bo.decode_floor(FACTS, 0.0, 82e9, 55e9, 4.2e12)      # the card reads it all
    card = FACTS.dense_token_bytes + 1.152e9 + FACTS.kv_bytes_per_pos * 512
    assert whole["card_bytes"] == int(card) and whole["host"] == whole["split"] == pytest.approx(4.2e12 / card)
    assert "split" not in bo.decode_floor(FACTS, 0.5, 82e9, None, 4.2e12)


def test_prompt_floor_copies_each_host_expert_once():
    f = bo.prompt_floor(FACTS, 1.0, 4096, 55e9, 4.2e12)
    assert f["host_bytes"] == 48 * 128 * 3_000_000
    assert f["copy"] == pytest.approx(4096 / (18.432e9 / 55e9))
    assert bo.prompt_floor(FACTS, 0.0, 512, 55e9, 4.2e12)["copy"] == pytest.approx(512 / (FACTS.file_bytes / 4.2e12))
    assert "copy" not in bo.prompt_floor(FACTS, 0.5, 512, None, 4.2e12)


def test_host_fraction_of_each_budget():
    experts = 48 * 128 * 3_000_000
    assert bo.host_fraction("whole", FACTS) == 0 and bo.host_fraction("host", FACTS) == 1
    assert bo.host_fraction("ncmoe", FACTS, ncmoe=24) == 0.5 and bo.host_fraction("ncmoe", FACTS, ncmoe=60) == 1
    assert bo.host_fraction("fit", FACTS, card_fit=3_000_000_000 + experts // 4,
                            card_host=3_000_000_000) == pytest.approx(0.75)
    assert bo.host_fraction("fit", FACTS, card_fit=9_000_000_000) is None


def test_residency_summary_measures_the_skew_of_the_counts():
    from bloomery.routing_skew import routing_skew
    layers = [{"layer": 0, "counts": [10, 0, 0, 0, 0, 0, 0, 0, 0, 0], "on_card": [0], "hits": 10, "misses": 0},
              {"layer": 1, "counts": [2] * 10, "on_card": [1, 2], "hits": 4, "misses": 16}]
    s = bo.residency_summary({"offload": True, "residency": "on", "layers": layers, "moved_experts": 3,
                              "moved_bytes": 9_000_000, "host_wait_s": 0.5, "updates": 7})
    assert s["skew"] == pytest.approx(routing_skew([ly["counts"] for ly in layers])) == pytest.approx(0.6)
    assert (s["hits"], s["misses"], s["host_share"], s["moved_experts"]) == (14, 16, 16 / 30, 3)
    assert s["best_static"] == pytest.approx(14 / 30)          # layer 0's one slot takes 10, layer 1's two take 4
    assert bo.residency_line(s).startswith("residency on: skew 0.600 (the top fifth's share of the picks), the best "
                                           "fixed placement serves 46.7 % of them on the card; 2 layers")
    assert "_counts" not in bo.public(s) and bo.public(s)["best_static"] == s["best_static"]
    # a cell's own picks: the counts after it less before it, against the slots after it
    later = [dict(layers[0], counts=[10, 0, 0, 0, 0, 0, 0, 0, 0, 30], hits=10, misses=30),
             dict(layers[1], counts=[2] * 10, hits=4, misses=16)]
    after = bo.residency_summary({"offload": True, "residency": "on", "layers": later, "moved_experts": 3,
                                  "moved_bytes": 9_000_000, "host_wait_s": 0.75})
    d = bo.residency_delta(s, after, 30)
    assert d["misses"] == 30 and d["best_static_host_share"] == 0.0   # all 30 on expert 9, which one slot holds
    assert "(the best fixed placement for these picks: 0.0 %)" in bo.delta_line(d)
    # a load with no host experts (the whole card, the CPU backend) counts nothing, and says so
    none = bo.residency_summary({"offload": False, "residency": "off", "layers": [], "moved_experts": 0,
                                 "moved_bytes": 0, "host_wait_s": 0.0, "updates": 0})
    assert "skew" not in none and "host_share" not in none
    assert "no host experts: /residency counts no routing, skew not measured" in bo.residency_line(none)
    assert "no routing counted yet" in bo.residency_summary({"offload": True, "layers": [{"counts": [0, 0]}]})["note"]


def test_json_is_written_whole_and_read_back(tmp_path):
    out = tmp_path / "r.json"
    bo.write_json(out, {"cells": {"a/b/c/d": {"value": 1.5}}})
    assert bo.load_json(out) == {"cells": {"a/b/c/d": {"value": 1.5}}}
    assert not list(tmp_path.glob("*.part"))
    assert bo.load_json(tmp_path / "none.json") == {}
    out.write_text('{"cells": {')                               # a file cut short some other way
    with pytest.raises(bo.BenchError, match="not JSON"):
        bo.load_json(out)


def test_arguments(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    a = bo.parse_args(["--model", f"u={model}", "--engines", "bloomery", "--out", str(tmp_path / "o.json"),
                       "--cells", "*/whole/*,host/tg128"])
    assert a.models == {"u": str(model)} and [c.name for c in a.cell_list] == [
        "u/bloomery/whole/tg128", "u/bloomery/whole/pp512", "u/bloomery/whole/pp4096", "u/bloomery/host/tg128"]
    assert a.tests == ("tg128", "pp512", "pp4096") and a.usable_gb == 11.5 and a.backend == "cuda"


@pytest.mark.parametrize("args,words", [
    (["--model", "u"], "spell it NAME=PATH"),
    (["--model", "u=/nonexistent.gguf"], "no file at /nonexistent.gguf"),
    (["--engines", "llama"], "--engines llama needs --llama-server PATH"),
    (["--engines", "bloomery", "--ncmoe", "-1"], "--ncmoe -1 must be >= 0"),
    (["--engines", "bloomery", "--prompts", "9000"], "--ctx-size 8192 is below"),
    (["--engines", "bloomery", "--cells", "*/nope/*"], "no cell matches"),
])
def test_bad_arguments_are_refused_by_name(tmp_path, capsys, args, words):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    argv = ["--out", str(tmp_path / "o.json")] + (args if args[0] == "--model" else ["--model", f"u={model}", *args])
    with pytest.raises(SystemExit):
        bo.parse_args(argv)
    assert words in capsys.readouterr().err


@pytest.mark.slow
def test_http_path_end_to_end_on_the_cpu_backend(tmp_path, tokenizer_source):
    """bloomery-serve on a tiny qwen3moe file: the cell measured through the stream, the JSON
    written, /residency's absence said, and a rerun skipping the cell it holds."""
    ms = load_tool("make_synthetic")
    path = ms.write_synthetic(tmp_path / "tiny.gguf", "qwen3moe", tokenizer_from=str(tokenizer_source),
                              router_skew=0.6, n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_expert=8,
                              n_expert_used=2, n_ff_exp=32)
    out = tmp_path / "bench" / "o.json"
    out.parent.mkdir()
    cmd = [sys.executable, str(REPO / "tools" / "bench_offload.py"), "--model", f"tiny={path}", "--engines", "bloomery",
           "--backend", "cpu", "--cells", "*/whole/*", "--prompts", "32", "--depth", "16", "--n-gen", "4", "--runs", "1",
           "--ctx-size", "256", "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    pp, tg = res["cells"]["tiny/bloomery/whole/pp32"], res["cells"]["tiny/bloomery/whole/tg4"]
    assert pp["value"] > 0 and pp["runs"][0]["prompt_n"] == 32 and pp["runs"][0]["n_ids"] == 1
    assert tg["value"] > 0 and tg["runs"][0]["predicted_n"] == 4 and tg["runs"][0]["n_ids"] == 4
    assert pp["client"] > 0 and tg["runs"][0]["n_pieces"] >= 1
    assert tg["client"] is None or tg["client"] > 0       # None: a loaded machine read every piece at once
    group = res["groups"]["tiny/bloomery/whole"]
    # a CPU-backend load has no host experts (every tensor is in host RAM): /residency, where the
    # server has it, counts nothing; where it has none, the 404 is said; a skew is never made up
    said = group["residency"].get("error") or group["residency"].get("note")
    assert "skew" not in group["residency"] and "skew not measured" in said and "--backend cpu" in group["command"]
    read = res["machine"]["host_read"]
    assert read["bytes_s"] > 1e8 and read["numpy_bytes_s"] > 1e8
    # the floors take the host kernel's own read where its library builds (here it does), numpy's beside it
    assert read["by"] == "host_moe.c host_read_bw" and "numpy's float sums" in r.stdout
    assert res["floors"]["tiny/bloomery/whole/tg4"]["host"] > 0
    assert "skew not measured" in r.stdout
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert again.returncode == 0 and "tiny/bloomery/whole/pp32: in " in again.stdout
    assert json.loads(out.read_text())["cells"]["tiny/bloomery/whole/pp32"] == pp


def test_residency_delta_is_one_cells_share_of_the_counters():
    before = {"hits": 100, "misses": 50, "moved_experts": 10, "moved_bytes": 3_000_000, "host_wait_s": 1.0}
    after = {"hits": 400, "misses": 150, "moved_experts": 30, "moved_bytes": 9_000_000, "host_wait_s": 2.5}
    d = bo.residency_delta(before, after, 500)
    assert d == {"hits": 300, "misses": 100, "moved_experts": 20, "moved_bytes": 6_000_000, "host_wait_s": 1.5,
                 "host_wait_ms_per_id": 3.0, "misses_per_id": 0.2, "host_share": 0.25}
    assert bo.delta_line(d) == ("residency in this cell: 1.50 s waited on the host, 3.00 ms a generated id waited "
                                "on the host, 25.0 % of the picks on the host; moved 20 experts / 0.01 GB")
    assert bo.residency_delta({"error": "GET /residency answered 404"}, after, 500) == {}   # llama-server, or none
    assert bo.delta_line({}) == "residency in this cell: not counted"
