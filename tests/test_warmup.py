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
    assert [name for name, _ in parts] == ["first id"]        # one path: a prompt and a step are the same code
    assert all(s >= 0 for _, s in parts)


@pytest.mark.gpu
def test_the_cuda_backend_warms_the_prompt_path_and_captures_every_batch(gpu, small):
    from bloomery.engine.loader import load_model
    from bloomery.engine.warmup import warm_up
    from bloomery.placement import whole
    model = load_model(small, whole("cuda", 3, 256))
    parts = warm_up(model, 3)
    assert [name for name, _ in parts] == ["first id", "short prompts (2, 4, 8 ids)", "prompt path (9, 64 ids)",
                                          "decode steps (batches 1-3)"]
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
