"""The warm-up a load runs before it reports ready: every path a request can take is run once, so
nothing is compiled, captured or first allocated on a request's path (llama-server's warmup runs one
decode; a backend with more paths needs each of them).

- one id through every layer: each weight's first use (the numpy backend's decoded forms; the cuda
  kernels' modules);
- that position saved to the host and restored, as the prompt cache and the slot files do (the KV's
  copies, and a recurrent model's checkpoint, whose strided copies CuPy compiles a kernel for on first use);
- a backend with a separate prompt path (caps.decode_rows > 0): prompts of 2, 4, 8 and 16 ids (the
  mat-vec kernels of each row count a short prompt takes outside the captured steps), then passes of
  decode_rows + 1, 64 and 512 ids, which load the GEMM and attention kernels of that path for small
  and large passes (cuBLAS picks its kernels by shape, and the card loads each on its first launch);
- a backend with captured decode steps (caps.decode_graphs): one step of every batch size up to the
  slots (the largest the captured steps take), which captures each graph; then the captured passes
  of short prompts, one a bucket of rows (cuda/graph.py), where the model allows them.

The slots' bookkeeping is made after (engine/core.py), so nothing reuses what this wrote into the KV.
Returns each part's name and seconds, for the start record.
"""
from __future__ import annotations

import time

import numpy as np


def warm_up(model, n_slots: int) -> list[tuple[str, float]]:
    parts: list[tuple[str, float]] = []

    def timed(name: str, fn) -> None:
        t = time.monotonic()
        fn()
        parts.append((name, round(time.monotonic() - t, 3)))

    caps = model.ops.caps
    timed("first id", lambda: model.prefill(0, np.zeros(1, np.int32), 0))

    def copies() -> None:                # slot 0 holds that one position now
        model.restore_kv(0, model.save_kv(0, 1), 1)
        if getattr(model, "checkpoints", False) and getattr(model, "checkpoint_bytes", 0):
            model.restore_checkpoint(0, model.save_checkpoint(0, 1), 1)
    timed("prompt cache copies", copies)
    if caps.decode_rows > 0:
        short = [n for n in (2, 4, 8, 16) if n <= caps.decode_rows and n < model.n_ctx_slot]
        passes = [n for n in (caps.decode_rows + 1, 64, 512)
                  if caps.decode_rows < n < model.n_ctx_slot and n <= model.n_ubatch]

        def prompts(sizes) -> None:
            for n in sizes:
                model.prefill(0, np.zeros(n, np.int32), 0)
        if short:
            timed(f"short prompts ({', '.join(map(str, short))} ids)", lambda: prompts(short))
        if passes:
            timed(f"prompt path ({', '.join(map(str, passes))} ids)", lambda: prompts(passes))
    if caps.decode_graphs:
        runner = model.ops.decode_runner(model)
        top = min(n_slots, runner.max_batch if runner is not None else 0)

        def steps() -> None:
            for s in range(1, top):
                model.prefill(s, np.zeros(1, np.int32), 0)
            for b in range(1, top + 1):
                model.decode_greedy(list(range(b)), np.zeros(b, np.int32), np.ones(b, np.int32))
        if top:
            timed(f"decode steps (batches 1-{top})", steps)
        if runner is not None and runner.prompt_capturable():
            buckets: list[int] = []
            timed("prompt graphs", lambda: buckets.extend(runner.capture_prompts()))
            name, took = parts.pop()
            parts.append((f"{name} ({', '.join(map(str, buckets))} rows)", took))
    return parts
