"""GET /residency, POST /residency/reset and /metrics' bloomery: expert series on a real bloomery-serve whose
load keeps routed experts in host RAM (the cuda backend's offload tier, engine/cuda/experts.py). Runs where
CuPy sees a card; skips elsewhere (tests/test_residency_api.py covers the CPU side).

The server holds the synthetic qwen3moe file of tests/test_cuda_offload.py's shape with --n-cpu-moe 2: the
routed experts of layers 0 and 1 in host RAM, a fixed placement (placement flags turn residency off), so
every routed pick of those layers is a miss and the report repeats from one start to the next.
"""
from __future__ import annotations

import json
import re
import subprocess

import pytest
import requests

from tests.conftest import load_tool

pytestmark = pytest.mark.slow

SHAPE = dict(n_layer=4, n_embd=512, n_head=8, n_head_kv=2, head_dim=128, n_expert=16, n_expert_used=4, n_ff_exp=256)
HOST_LAYERS = 2
PROMPTS = ["Write a Python function that adds two numbers.", "def fibonacci(n):", "The capital of France is"]
N_PREDICT = 8


@pytest.fixture(scope="module")
def server(gpu, tokenizer_source, synthetic_dir):
    from tests.serve_proc import Served
    path = load_tool("make_synthetic").write_synthetic(
        synthetic_dir / "residency-api-qwen3moe.gguf", arch="qwen3moe", mode="blocks", mix="q4_k_m", seed=12,
        tokenizer_from=str(tokenizer_source), **SHAPE)
    with Served("-m", str(path), "--backend", "cuda", "--n-cpu-moe", str(HOST_LAYERS), "-c", "1024",
                "--metrics", "--temp", "0") as s:
        yield s


def complete(url: str, prompt: str) -> str:
    # no prompt cache: a repeated prompt runs its whole prompt pass again, so the same path computes it
    r = requests.post(url + "/completion", json={"prompt": prompt, "n_predict": N_PREDICT, "ignore_eos": True,
                                                 "cache_prompt": False}, timeout=300)
    assert r.status_code == 200, r.text
    assert r.json()["tokens_predicted"] == N_PREDICT
    return r.json()["content"]


def test_residency_report_metrics_and_reset_on_host_experts(server):
    url = server.url
    first = [complete(url, p) for p in PROMPTS]

    r = requests.get(url + "/residency", timeout=60)
    assert r.status_code == 200, r.text
    rep = r.json()
    assert rep["offload"] is True and rep["residency"] == "off", rep          # placement flags: a fixed placement
    assert [ly["layer"] for ly in rep["layers"]] == list(range(HOST_LAYERS)), rep["layers"]
    for ly in rep["layers"]:
        assert ly["hits"] + ly["misses"] > 0 and ly["misses"] > 0, ly
        assert ly["hits"] + ly["misses"] == sum(ly["counts"]), ly           # every routed pick counted once
        assert len(ly["counts"]) == SHAPE["n_expert"], ly
    assert rep["moved_experts"] == 0 and rep["moved_bytes"] == 0, rep          # residency off: nothing moved
    assert rep["host_wait_s"] >= 0.0

    text = requests.get(url + "/metrics", timeout=60).text
    assert "llamacpp:tokens_predicted_total" in text
    for ly in rep["layers"]:
        misses = re.search(rf'^bloomery:expert_misses_total{{layer="{ly["layer"]}"}} (\d+)$', text, re.M)
        hits = re.search(rf'^bloomery:expert_hits_total{{layer="{ly["layer"]}"}} (\d+)$', text, re.M)
        assert misses and hits, text
        assert int(misses.group(1)) >= ly["misses"] > 0                     # counters only grow
    for name in ("experts_moved_total", "expert_bytes_moved_total", "host_wait_seconds_total"):
        assert re.search(rf"^bloomery:{name} [0-9.e+-]+$", text, re.M), (name, text)
        assert f"# TYPE bloomery:{name} counter" in text

    out = subprocess.run(["curl", "-s", "-w", "\n%{http_code}", "-X", "POST", url + "/residency/reset"],
                         capture_output=True, text=True, timeout=120).stdout
    body, code = out.rsplit("\n", 1)
    assert code == "200", out
    assert json.loads(body)["offload"] is True
    after = requests.get(url + "/residency", timeout=60).json()
    assert [ly["on_card"] for ly in after["layers"]] == [ly["on_card"] for ly in rep["layers"]]
    assert any("routed experts back to the load's placement" in line for line in server.lines)
    # a fixed placement: the same prompts give the same text after the reset
    assert [complete(url, p) for p in PROMPTS] == first
