"""-cram/--cache-ram on the real bloomery-serve: prompts A, B, A on one slot restore A's saved state
(timings.cache_n, /metrics), with the ids of a cold run; -cram 0 turns the cache off; a budget
is kept; -cram -1 (llama-server's no limit) is refused by name."""
from __future__ import annotations

import subprocess
import sys

import pytest
import requests

from serve_proc import REPO, Served

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

A = "Write a Python function that returns the sum of the squares of the numbers in a list, with a docstring."
B = "List three prime numbers."
KV_BYTES_PER_POS = 24 * 2 * 64 * 2 * 2   # qwen2.5-0.5B: 24 layers x 2 KV heads x 64 x (K, V) x f16


def complete(url: str, prompt: str, **kw) -> dict:
    body = {"prompt": prompt, "n_predict": 8, "temperature": 0, "ignore_eos": True, "return_tokens": True, **kw}
    r = requests.post(url + "/completion", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def metrics(url: str) -> dict[str, float]:
    r = requests.get(url + "/metrics", timeout=30)
    return {ln.split()[0]: float(ln.split()[1]) for ln in r.text.splitlines()
            if ln.startswith(("llamacpp:", "bloomery:"))}


@pytest.fixture(scope="module")
def tiny_model(real_model_path, tmp_path_factory):
    from conftest import load_tool
    path = tmp_path_factory.mktemp("pcache") / "tiny_qwen2.gguf"
    load_tool("make_synthetic").write_synthetic(path, "qwen2", tokenizer_from=str(real_model_path))
    return path


def test_a_b_a_restores_a_with_the_ids_of_a_cold_run(real_model_path):
    with Served("-m", str(real_model_path), "-c", "1024", "-np", "1", "--metrics") as s:
        first = complete(s.url, A)
        second = complete(s.url, B)
        third = complete(s.url, A)
        cold = complete(s.url, A, cache_prompt=False)
        m = metrics(s.url)
    n_a, n_b = first["tokens_evaluated"], second["tokens_evaluated"]
    assert first["timings"]["cache_n"] == 0 and second["timings"]["cache_n"] == 0
    assert third["timings"]["cache_n"] == n_a - 1 and third["timings"]["prompt_n"] == 1   # restored, one id run
    assert third["tokens"] == first["tokens"] == cold["tokens"] and len(third["tokens"]) == 8
    # saved: A and its 7 fed ids (before B), then B and its 7 (before the third A); the arrays' bytes exactly
    assert m["llamacpp:prompt_cache_entries"] == 2
    assert m["llamacpp:prompt_cache_bytes"] == KV_BYTES_PER_POS * (n_a + 7 + n_b + 7)
    assert m["llamacpp:prompt_cache_seconds_total"] > 0
    assert m["llamacpp:prompt_cache_budget_bytes"] > 0       # the plan's default
    # bloomery's own: four requests of 8 ids, the first of each from its prompt pass, 7 decode steps each, each a
    # greedy pick under ignore_eos's bans taken from the row's largest logits; the CPU backend launches none ahead
    assert m["bloomery:decode_steps_total"] == m["bloomery:decode_steps_top_total"] == 4 * 7
    assert m["bloomery:decode_steps_ahead_total"] == m["bloomery:decode_steps_top_missed_total"] == 0
    # one prompt pass a request (the warm-up's not counted); the CPU backend captures none
    assert m["bloomery:prompt_passes_total"] == 4 and m["bloomery:prompt_passes_captured_total"] == 0


def test_cram_0_is_off_and_a_small_budget_is_kept(tiny_model):
    with Served("-m", str(tiny_model), "-c", "1024", "-np", "1", "--metrics", "-cram", "0") as s:
        thirds = [complete(s.url, p) for p in (A, B, A)][2]
        assert thirds["timings"]["cache_n"] == 0
        m = metrics(s.url)
        assert (m["llamacpp:prompt_cache_entries"], m["llamacpp:prompt_cache_bytes"],
                m["llamacpp:prompt_cache_budget_bytes"]) == (0, 0, 0)
    with Served("-m", str(tiny_model), "-c", "1024", "-np", "1", "--metrics", "-cram", "1") as s:
        n_a = complete(s.url, A)["tokens_evaluated"]
        complete(s.url, B)
        third = complete(s.url, A)
        assert third["timings"]["cache_n"] == n_a - 1
        m = metrics(s.url)
        assert m["llamacpp:prompt_cache_budget_bytes"] == 1 << 20
        assert 0 < m["llamacpp:prompt_cache_bytes"] <= 1 << 20


def test_cram_minus_1_is_refused_by_name(tiny_model):
    done = subprocess.run([sys.executable, "-m", "bloomery.supervisor", "-m", str(tiny_model), "-cram", "-1",
                           "--port", "0"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "--cache-ram -1: the prompt cache always has a budget" in done.stderr, done.stderr


def test_a_slot_is_saved_as_the_engine_turns_idle_not_on_the_next_requests_path(tiny_model):
    """--cache-idle-slots (the default): the state a request leaves is in the prompt cache as soon as the engine
    has nothing else to do, before any other request starts (what /metrics reads right after the reply); the next
    prompt in that slot then copies nothing out. --no-cache-idle-slots keeps each save for the next request's
    start, as before."""
    with Served("-m", str(tiny_model), "--backend", "cpu", "-c", "256", "-np", "1", "--metrics",
                "--no-warmup") as s:
        first = complete(s.url, A)
        m = metrics(s.url)
        assert m["llamacpp:prompt_cache_entries"] == 1
        second = complete(s.url, B)
        m2 = metrics(s.url)
        assert m2["llamacpp:prompt_cache_entries"] == 2                  # B's, saved as it ended; A's found saved
        # A and its 7 fed ids, then B and its 7: the same bytes a position
        per_a = m["llamacpp:prompt_cache_bytes"] / (first["tokens_evaluated"] + 7)
        per_b = (m2["llamacpp:prompt_cache_bytes"] - m["llamacpp:prompt_cache_bytes"]) / (second["tokens_evaluated"] + 7)
        assert per_a == per_b > 0
        third = complete(s.url, A)                                        # A again: restored, timed in cache_ms
        assert third["timings"]["cache_n"] == first["tokens_evaluated"] - 1 and third["timings"]["cache_ms"] > 0
        assert first["timings"]["cache_ms"] >= 0 and "cache_ms" in second["timings"]
    with Served("-m", str(tiny_model), "--backend", "cpu", "-c", "256", "-np", "1", "--metrics", "--no-warmup",
                "--no-cache-idle-slots") as s:
        complete(s.url, A)
        assert metrics(s.url)["llamacpp:prompt_cache_entries"] == 0
        complete(s.url, B)
        assert metrics(s.url)["llamacpp:prompt_cache_entries"] == 1     # A's, at B's start
