"""The prompt cache (-cram) and --checkpoint-min-step for the qwen35 family through a real bloomery-serve, on a
small synthetic qwen35moe file: an entry keeps the KV of the attention layers with the recurrent state at the
slot's end and at its checkpoints, so prompts A, B, A' on one slot restore the system prompt A and A' share,
with a cold run's ids; a small budget evicts the oldest first; -cram 0 is off; -cms spaces the checkpoints."""
from __future__ import annotations

import json
import urllib.request

import pytest
from conftest import load_tool

from serve_proc import Served

pytestmark = [pytest.mark.slow]

ms = load_tool("make_synthetic")

S, E, NL = 151644, 151645, 198          # <|im_start|>, <|im_end|>, "\n" in the Qwen vocabulary
# 3 Gated DeltaNet layers of 16 value heads of 64: a recurrent state of 0.79 MiB, so -cram in MiB tells entries apart
SHAPE = dict(n_layer=4, n_embd=64, n_head=4, n_head_kv=2, head_dim=32, n_expert=4, n_expert_used=2, n_ff_exp=64,
             n_ff_shexp=64, ssm_d_state=64, ssm_n_group=2, ssm_dt_rank=16)
STATE_BYTES = 3 * (16 * 64 * 64 + 3 * (2 * 2 * 64 + 16 * 64)) * 4    # delta-rule states and conv windows, f32
KV_BYTES_PER_POS = 1 * 2 * 32 * 2 * 2                                 # 1 attention layer, 2 KV heads of 32, K and V f16


def message(role: int, *text: int) -> list[int]:
    return [S, role, NL, *text, E, NL]


SYSTEM = message(8948, *range(1000, 1040))      # a 45-id system message
ASSISTANT = [S, 77091, NL]


def ask(question: list[int]) -> list[int]:
    return SYSTEM + message(872, *question) + ASSISTANT


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("q35pc") / "q35_pcache.gguf"
    ms.write_synthetic(path, arch="qwen35moe", **SHAPE)
    return path


def completion(url: str, prompt: list[int], n: int = 8, cache_prompt: bool = True) -> dict:
    body = json.dumps({"prompt": prompt, "n_predict": n, "temperature": 0, "return_tokens": True,
                       "ignore_eos": True, "cache_prompt": cache_prompt}).encode()
    req = urllib.request.Request(url + "/completion", data=body, headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines() if ln.startswith("llamacpp:")}


def serve(path, *flags):
    return Served("-m", str(path), "--backend", "cpu", "-c", "512", "-np", "1", "--no-warmup", "--metrics", *flags)


def test_a_b_a2_restores_the_shared_system_prompt_with_a_cold_runs_ids(model):
    a, a2 = ask(range(2000, 2012)), ask(range(4000, 4015))
    b = message(8948, *range(5000, 5030)) + ASSISTANT
    with serve(model, "--no-cache-idle-slots") as s:    # each save at the next request's start: A, then B
        first = completion(s.url, a)
        assert completion(s.url, b)["timings"]["cache_n"] == 0      # B overwrote the slot; A was saved first
        warm = completion(s.url, a2)
        m = metrics(s.url)
        cold = completion(s.url, a2, cache_prompt=False)
    assert first["timings"]["cache_n"] == 0
    # A' restores A's checkpoint after the system prompt (the recurrent state there and the KV up to it)
    assert warm["timings"]["cache_n"] == len(SYSTEM) and warm["timings"]["prompt_n"] == len(a2) - len(SYSTEM)
    assert cold["timings"]["cache_n"] == 0 and warm["tokens"] == cold["tokens"] and len(warm["tokens"]) == 8
    assert m["llamacpp:prompt_cache_seconds_total"] > 0
    # saved: A with 7 fed ids (the state at its end and at its two checkpoints), then B (at its end and at the
    # assistant turn's start); the arrays' bytes exactly
    assert m["llamacpp:prompt_cache_entries"] == 2
    assert m["llamacpp:prompt_cache_bytes"] == 5 * STATE_BYTES + (len(a) + 7 + len(b) + 7) * KV_BYTES_PER_POS


def test_a_small_budget_evicts_the_oldest_and_cram_0_is_off(model):
    firsts = [message(8948, *range(1000 * k, 1000 * k + 40)) for k in (1, 2, 3)]
    probe = message(872, 7, 8) + ASSISTANT
    with serve(model, "-cram", "5") as s:         # 5 MiB: two entries of three states (2.4 MiB each), not three
        for first in firsts:
            completion(s.url, first + message(872, 5) + ASSISTANT, 2)
        completion(s.url, [S, 8948, NL, 9, 9, 9], 2)   # the third saved: the first evicted
        m = metrics(s.url)
        assert m["llamacpp:prompt_cache_budget_bytes"] == 5 << 20
        assert m["llamacpp:prompt_cache_entries"] == 2 and 0 < m["llamacpp:prompt_cache_bytes"] <= 5 << 20
        assert completion(s.url, firsts[2] + probe, 2)["timings"]["cache_n"] == len(firsts[2])
        assert completion(s.url, firsts[0] + probe, 2)["timings"]["cache_n"] == 0
        assert metrics(s.url)["llamacpp:prompt_cache_bytes"] <= 5 << 20
    with serve(model, "-cram", "0") as s:
        a = ask(range(2000, 2012))
        completion(s.url, a)
        completion(s.url, message(8948, *range(5000, 5030)) + ASSISTANT)
        assert completion(s.url, ask(range(4000, 4015)))["timings"]["cache_n"] == 0
        m = metrics(s.url)
        assert (m["llamacpp:prompt_cache_entries"], m["llamacpp:prompt_cache_bytes"],
                m["llamacpp:prompt_cache_budget_bytes"]) == (0, 0, 0)


@pytest.mark.parametrize("min_step", [0, 8192])
def test_checkpoint_min_step_spaces_a_slots_checkpoints(model, min_step):
    """Five short messages: with -cms 0 each message start is a checkpoint, so a prompt parting inside the fourth
    picks up at its start; with llama-server's default only the first (and the prompt's last) is one."""
    turns = SYSTEM + sum((message(872, 100 + i, 101 + i) for i in range(4)), []) + ASSISTANT
    starts = [i for i, t in enumerate(turns) if t == S and i > 0]
    other = turns[:starts[3] + 3] + [4242] + turns[starts[3] + 4:]       # parts inside the fourth question
    with serve(model, "-cram", "0", "-cms", str(min_step)) as s:
        completion(s.url, turns, 2)
        got = completion(s.url, other, 2)["timings"]["cache_n"]
    assert got == (starts[3] if min_step == 0 else starts[0])


def test_the_same_prompt_again_without_the_cache_is_served_each_time(model):
    """The benchmark's sequence (tools/bench_offload.py): a prompt of 100 plain ids with 8 ids generated, then
    the same prompt for one id, cache_prompt false, three times. Before the third, the slot held a prefix of
    the first entry's ids with its end elsewhere, so that entry does not cover it, and the new entry takes all
    but its last position from it. Before, that save started at the end (a save of nothing) and was refused,
    failing the request (on the card, every pp cell after a tg cell)."""
    p = list(range(3000, 3100))
    with serve(model) as s:
        long = completion(s.url, p, n=8, cache_prompt=False)
        runs = [completion(s.url, p, n=1, cache_prompt=False) for _ in range(3)]
    assert [r["tokens"] for r in runs] == [long["tokens"][:1]] * 3
