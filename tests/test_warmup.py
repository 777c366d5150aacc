"""engine/warmup.py: the warm-up runs each path a request can take on the backend, and names each part."""
from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import load_tool

SHAPE = dict(n_layer=2, n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_ff=512)


@pytest.fixture(scope="module")
def small(tokenizer_source, synthetic_dir):
    return load_tool("make_synthetic").write_synthetic(synthetic_dir / "warmup-qwen3.gguf", arch="qwen3",
                                                         mode="blocks", mix="q4_k_m", seed=3,
                                                         tokenizer_from=str(tokenizer_source), **SHAPE)


def test_the_cpu_backend_warms_with_one_id(small):
    from bloomery.engine.loader import load_model
    from bloomery.engine.warmup import warm_up
    from bloomery.placement import whole
    model = load_model(small, whole("numpy", 2, 64))
    parts = warm_up(model, 2)
    assert [name for name, _ in parts] == ["first id", "prompt cache copies"]   # one path: a prompt and a step are one code
    assert all(s >= 0 for _, s in parts)


@pytest.mark.gpu
def test_the_cuda_backend_warms_the_prompt_path_and_captures_every_batch(gpu, small):
    from bloomery.engine.loader import load_model
    from bloomery.engine.warmup import warm_up
    from bloomery.placement import whole
    model = load_model(small, whole("cuda", 3, 256))
    parts = warm_up(model, 3)
    assert [name for name, _ in parts] == ["first id", "prompt cache copies", "short prompts (2, 4, 8, 16 ids)",
                                          "prompt path (17, 64 ids)", "decode steps (batches 1-3)",
                                          "prompt graphs (8, 16, 32, 64, 128, 256 rows)"]
    runner = model.ops.decode_runner(model)
    assert sorted(runner._graphs) == [1, 2, 3]
    # the first request's prompt pass after the warm-up compiles nothing: as quick as a later one
    import time
    times = []
    for _ in range(3):
        t = time.perf_counter()
        model.prefill(0, np.arange(100, 164, dtype=np.int32), 0)
        times.append(time.perf_counter() - t)
    assert times[0] <= 3 * min(times[1:]) + 0.05, times


MOE_SHAPE = dict(n_layer=2, n_embd=512, n_head=8, n_head_kv=2, head_dim=128, n_expert=16, n_expert_used=4, n_ff_exp=256)


@pytest.fixture(scope="module")
def small_moe(tokenizer_source, synthetic_dir):
    return load_tool("make_synthetic").write_synthetic(synthetic_dir / "warmup-qwen3moe.gguf", arch="qwen3moe",
                                                         mode="blocks", mix="q4_k_m", seed=5,
                                                         tokenizer_from=str(tokenizer_source), **MOE_SHAPE)


@pytest.mark.gpu
def test_a_served_request_compiles_nothing_after_ready(gpu, small_moe, tmp_path):
    """#15: nothing is compiled on the request path. A real server starts with CuPy's kernel cache empty (its own
    CUPY_CACHE_DIR); every kernel CuPy compiles is written there. After /health answers 200, the requests a user
    sends (a short prompt and a long one, greedy and sampled with n_probs, a JSON-schema chat, two streams at once)
    add no file to it: each kernel they run was compiled, or loaded prebuilt, by the warm-up."""
    import json
    import threading
    import urllib.request

    from tests.serve_proc import Served
    cache = tmp_path / "cupy-cache"
    cache.mkdir()

    def post(url, body):
        req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.read()

    def files():
        return {p.name: p for p in cache.rglob("*") if p.is_file()}

    kernel_names = load_tool("bench_start").kernel_names      # the names a cubin's symbol strings hold

    with Served("-m", str(small_moe), "--backend", "cuda", "-c", "2048", "-np", "2",
                env={"CUPY_CACHE_DIR": str(cache)}) as srv:
        c = srv.url + "/completion"

        def two_streams():
            both = [threading.Thread(target=post, args=(c, {"prompt": f"stream {k}", "n_predict": 12,
                                                            "stream": True, "temperature": 0})) for k in range(2)]
            for t in both:
                t.start()
            for t in both:
                t.join()
        asks = [
            ("a short greedy prompt", lambda: post(c, {"prompt": "The cold start of a server", "n_predict": 8,
                                                      "temperature": 0, "cache_prompt": False})),
            ("a 600-id prompt", lambda: post(c, {"prompt": list(range(300, 900)), "n_predict": 4, "temperature": 0})),
            ("sampled with n_probs", lambda: post(c, {"prompt": "Sampled", "n_predict": 8, "temperature": 0.8,
                                                     "top_k": 20, "n_probs": 3, "seed": 4})),
            ("a JSON-schema chat", lambda: post(srv.url + "/v1/chat/completions", {
                "messages": [{"role": "user", "content": "a JSON object"}], "max_tokens": 8,
                "response_format": {"type": "json_schema", "json_schema": {"schema": {
                    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}})),
            ("two streams at once", two_streams),
        ]
        before, compiled = files(), {}
        for what, ask in asks:
            ask()
            now = files()
            new = sorted(set(now) - set(before))
            if new:
                compiled[what] = kernel_names(now[n] for n in new)
            before = now
    assert not compiled, f"compiled after ready: {compiled}"
