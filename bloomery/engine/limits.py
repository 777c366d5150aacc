"""The rules of a slot's length, owned here once and read by both sides: the engine (scheduler.py
admits, core.py finishes) and the front (api/app.py refuses before sending, api/generate.py
stops asking for ids). They follow llama-server's process_token.
"""
from __future__ import annotations

# a slot's checkpoints of a state that cannot rewind: llama-server's --ctx-checkpoints default (common.h's
# n_ctx_checkpoints), read by the flag table, the plan (their bytes) and the engine
CTX_CHECKPOINTS = 32
# the least spacing in ids between a slot's checkpoints: llama-server's --checkpoint-min-step default (common.h's
# checkpoint_min_step), read by the flag table and the engine (scheduler.py places the checkpoints)
CHECKPOINT_MIN_STEP = 8192


def prompt_fits(n_prompt: int, n_ctx_slot: int) -> bool:
    """A prompt fits a slot when at least one position is left for the first sampled id."""
    return n_prompt < n_ctx_slot


def finish_reason(n_prompt: int, n_generated: int, n_ctx_slot: int, n_predict: int, stopped: bool) -> str | None:
    """Why a request ends after its n_generated-th id, or None: "length" when the slot's context
    is full or n_predict (>= 0) ids were generated, "stop" for a stop id or a finished structured
    output (it wins over "length", reported in the same output)."""
    if stopped:
        return "stop"
    if n_prompt + n_generated >= n_ctx_slot or 0 <= n_predict <= n_generated:
        return "length"
    return None
