"""llama-server's JSON shapes that several routes share: generation settings, usage, SSE framing."""
from __future__ import annotations

import json
import secrets
import string

import numpy as np

from bloomery.api.params import DEFAULT_SAMPLERS, GenParams
from bloomery.engine.types import SamplingParams

BUILD_INFO = "b0-unknown"   # what the reference build reports as system_fingerprint and build_info
_ID_ALPHABET = string.ascii_letters + string.digits


def f32(x: float) -> float:
    """llama-server keeps sampling settings as float32; report them as it prints them (0.8 -> 0.800000011920929)."""
    return float(np.float32(x))


def completion_id() -> str:
    return "chatcmpl-" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(32))


def sse(obj: object) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def _sampling_settings(sp: SamplingParams, *, n_predict: int, ignore_eos: bool, stream: bool,
                       samplers: tuple[str, ...]) -> dict:
    # the stages this server does not run are reported at llama-server's off values
    return {
        "seed": sp.seed, "temperature": f32(sp.temperature), "dynatemp_range": 0.0, "dynatemp_exponent": 1.0,
        "top_k": sp.top_k, "top_p": f32(sp.top_p), "min_p": f32(sp.min_p), "top_n_sigma": -1.0,
        "xtc_probability": 0.0, "xtc_threshold": f32(0.1), "typical_p": 1.0,
        "repeat_last_n": sp.repeat_last_n, "repeat_penalty": f32(sp.repeat_penalty),
        "presence_penalty": f32(sp.presence_penalty), "frequency_penalty": f32(sp.frequency_penalty),
        "dry_multiplier": 0.0, "dry_base": 1.75, "dry_allowed_length": 2, "dry_penalty_last_n": 64,
        "mirostat": 0, "mirostat_tau": 5.0, "mirostat_eta": f32(0.1),
        "adaptive_target": -1.0, "adaptive_decay": f32(0.9),
        "max_tokens": n_predict, "n_predict": n_predict, "n_keep": 0, "n_discard": 0,
        "ignore_eos": ignore_eos, "stream": stream, "n_probs": sp.n_probs, "min_keep": 0,
        "chat_format": "Content-only", "reasoning_format": "none", "reasoning_in_content": False,
        "generation_prompt": "", "samplers": list(samplers), "speculative.types": "none",
        "timings_per_token": False, "post_sampling_probs": sp.post_sampling_probs, "backend_sampling": False,
        "lora": [],
    }


def default_settings(n_predict_default: int, sampling_defaults: SamplingParams | None = None) -> dict:
    """/props' default_generation_settings.params: the server's request defaults (its sampling flags)."""
    return _sampling_settings(sampling_defaults or SamplingParams(), n_predict=n_predict_default, ignore_eos=False,
                              stream=False, samplers=DEFAULT_SAMPLERS)


def slot_params(p: GenParams) -> dict:
    """/slots' params of a slot's request (llama-server's to_json(only_metrics): no stop, grammar, bias)."""
    return _sampling_settings(p.sampling, n_predict=p.n_predict, ignore_eos=p.ignore_eos, stream=p.stream,
                              samplers=p.samplers)


def generation_settings(p: GenParams) -> dict:
    """A /completion answer's generation_settings: the request's settings, in llama-server's key order."""
    base = _sampling_settings(p.sampling, n_predict=p.n_predict, ignore_eos=p.ignore_eos, stream=p.stream,
                              samplers=p.samplers)
    out: dict = {}
    for k, v in base.items():
        out[k] = v
        if k == "dry_penalty_last_n":
            out["dry_sequence_breakers"] = ["\n", ":", "\"", "*"]
        elif k == "adaptive_decay":
            out["stop"] = list(p.stop)
        elif k == "stream":
            # every bias, ignore_eos's bans too; -inf is null, as llama-server's JSON writes it
            out["logit_bias"] = [{"bias": None if b == float("-inf") else b, "token": t}
                                 for t, b in p.sampling.logit_bias]
        elif k == "min_keep":
            out.update(grammar="", grammar_lazy=False, grammar_triggers=[], preserved_tokens=[])
    return out


def usage(n_prompt: int, n_gen: int, n_cached: int) -> dict:
    return {"completion_tokens": n_gen, "prompt_tokens": n_prompt, "total_tokens": n_prompt + n_gen,
            "prompt_tokens_details": {"cached_tokens": n_cached}}
