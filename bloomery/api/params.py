"""Reading request fields: every field is read, refused by name, or ignored.

Messages follow llama-server's where a client may match on them
("Field 'max_tokens': type must be number, but is string"); each error carries
the field's top-level name as OpenAI's `param`. `null` always means unset.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from bloomery.api import limits
from bloomery.engine.types import SamplingParams
from bloomery.http.types import ApiError

INT32_MAX = 2**31 - 1
UINT32_MAX = 2**32 - 1
DEFAULT_SEED = 0xFFFFFFFF          # LLAMA_DEFAULT_SEED: a random seed per request
# llama-server's default chain; a request may name a subsequence of it (stages left out are off)
DEFAULT_SAMPLERS = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")


def _json_type(v: object) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    return "object"


def field_error(name: str, problem: str) -> ApiError:
    return ApiError(400, f"Field '{name}': {problem}", "invalid_request_error", param=name.split(".")[0])


class Fields:
    """Typed getters over one JSON object body; each returns None when the field is absent or null."""

    def __init__(self, body: object, what: str = "request body"):
        if not isinstance(body, dict):
            raise ApiError(400, f"The {what} must be a JSON object, but is {_json_type(body)}")
        self.body = body

    def raw(self, *names: str) -> tuple[str, object] | None:
        """The first of `names` present and not null (llama-server's alias order)."""
        for n in names:
            v = self.body.get(n)
            if v is not None:
                return n, v
        return None

    def _number(self, names: tuple[str, ...]):
        """(name, value) of the first field set among names, checked to be a JSON number; None if unset."""
        got = self.raw(*names)
        if got is not None and (isinstance(got[1], bool) or not isinstance(got[1], (int, float))):
            raise field_error(got[0], f"type must be number, but is {_json_type(got[1])}")
        return got

    def int(self, *names: str, lo: int = -INT32_MAX - 1, hi: int = INT32_MAX) -> int | None:
        got = self._number(names)
        if got is None:
            return None
        n, v = got
        if isinstance(v, float):
            if not math.isfinite(v) or v != int(v):
                raise field_error(n, f"must be an integer, but got {v}")
            v = int(v)
        if v < lo or v > hi:
            raise field_error(n, f"Value must be between {lo} <= value <= {hi}, but got {v}")
        return v

    def float(self, *names: str, lo: float = -math.inf, hi: float = math.inf) -> float | None:
        got = self._number(names)
        if got is None:
            return None
        n, v = got
        v = float(v)
        if not math.isfinite(v):
            raise field_error(n, f"must be a finite number, but got {v}")
        if v < lo or v > hi:
            raise field_error(n, f"Value must be between {lo:g} <= value <= {hi:g}, but got {v:g}")
        return v

    def _typed(self, name: str, kind: type, kind_name: str):
        got = self.raw(name)
        if got is None:
            return None
        if not isinstance(got[1], kind):
            raise field_error(name, f"type must be {kind_name}, but is {_json_type(got[1])}")
        return got[1]

    def bool(self, name: str) -> bool | None:
        return self._typed(name, bool, "boolean")

    def str(self, name: str) -> str | None:
        return self._typed(name, str, "string")


@dataclass(frozen=True)
class GenParams:
    """What a generating route asks of one generation, read from its body."""

    n_predict: int
    sampling: SamplingParams
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    cache_prompt: bool = True
    stream: bool = False
    return_tokens: bool = False
    n_probs: int = 0
    timings_per_token: bool = False
    return_progress: bool = False               # a stream reports the prompt pass (prompt_progress chunks)
    id_slot: int = -1                           # the slot to run in (app.start checks it names one); -1: any
    samplers: tuple[str, ...] = DEFAULT_SAMPLERS
    extra: dict = field(default_factory=dict)   # echoed in generation_settings
    think: object = None                        # api/reasoning.ThinkSpec: the span's budget / loop watch


def refuse_unsupported(f: Fields) -> None:
    """Fields llama-server knows that this server cannot honor: a 400 naming each when turned on."""
    def on(name: str, off: float, *, above: bool = False) -> None:
        v = f.float(name)
        if v is not None and ((v > off) if above else (v != off)):
            raise field_error(name, f"{v:g} is not supported by this server (only {off:g}, which turns it off)")
    lora = f.raw("lora")
    if lora is not None and lora[1] != []:
        raise field_error("lora", "LoRA adapters are not supported by this server")
    on("n_indent", 0, above=True)
    on("t_max_predict_ms", 0, above=True)
    on("mirostat", 0)
    on("typical_p", 1)
    on("dry_multiplier", 0, above=True)
    on("xtc_probability", 0, above=True)
    on("top_n_sigma", 0, above=True)
    on("dynatemp_range", 0, above=True)


def parse_stop(f: Fields) -> tuple[str, ...]:
    got = f.raw("stop")
    if got is None:
        return ()
    v = got[1]
    words = [v] if isinstance(v, str) else v
    if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
        raise field_error("stop", f"must be a string or an array of strings, but is {_json_type(v)}")
    if any(w == "" for w in words):
        raise field_error("stop", "an empty stop string would end every generation at once")
    return tuple(dict.fromkeys(words))


def parse_logit_bias(f: Fields, n_vocab: int) -> list[tuple[int, float]]:
    """OpenAI's object {"id": bias}, bias in -100..100 (serving guide 11.2). llama-server's other
    forms (an array of pairs, false, a token's text as key) are refused by name, as the guide says."""
    got = f.raw("logit_bias")
    if got is None:
        return []
    if not isinstance(got[1], dict):
        raise field_error("logit_bias", f"must be an object from token ids to numbers (arrays of pairs are not "
                                        f"served), but is {_json_type(got[1])}")
    out: dict[int, float] = {}
    for key, bias in got[1].items():
        try:
            tok = int(key)
        except ValueError:
            raise field_error("logit_bias", f"key {key!r} is not a token id (a token's text is not served)") from None
        if not 0 <= tok < n_vocab:
            raise field_error("logit_bias", f"token id {tok} is outside 0..{n_vocab - 1}")
        if tok in out:
            raise field_error("logit_bias", f"token id {tok} is named twice")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
            raise field_error("logit_bias", f"bias of token {tok} must be a number, but is {bias!r}")
        if not -100 <= bias <= 100:
            raise field_error("logit_bias", f"bias of token {tok} must be in -100..100, but got {bias:g}")
        out[tok] = float(bias)
    return list(out.items())


def parse_samplers(f: Fields) -> tuple[str, ...]:
    got = f.raw("samplers")
    if got is None:
        return DEFAULT_SAMPLERS
    names = got[1]
    if not isinstance(names, list) or not all(isinstance(s, str) for s in names):
        raise field_error("samplers", "must be an array of sampler names")
    pos = -1
    for s in names:
        if s not in DEFAULT_SAMPLERS:
            raise field_error("samplers", f"unknown sampler {s!r}; this server has {', '.join(DEFAULT_SAMPLERS)}")
        if DEFAULT_SAMPLERS.index(s) <= pos:
            raise field_error("samplers", f"{s!r} is out of llama-server's default order ({', '.join(DEFAULT_SAMPLERS)})")
        pos = DEFAULT_SAMPLERS.index(s)
    if "temperature" not in names:
        raise field_error("samplers", "a chain without 'temperature' is not supported by this server")
    return tuple(names)


def parse_gen_params(f: Fields, *, n_predict_default: int, n_vocab: int, eog_ids: frozenset[int],
                     sampling_defaults: SamplingParams | None = None,
                     n_predict_names: tuple[str, ...] = ("n_predict", "max_completion_tokens", "max_tokens"),
                     allow_n_probs: bool = True, n_max: int = 1, n_probs_set: int = 0) -> GenParams:
    """n_max: the route's bound on `n` (1 outside the routes that serve choices: llama-server's message).
    n_probs_set: candidates per id a route asked for in its own fields (chat's top_logprobs) when allow_n_probs
    is off."""
    refuse_unsupported(f)
    f.int("n", lo=1, hi=n_max)
    n_predict = f.int(*n_predict_names, lo=-1, hi=INT32_MAX)
    if n_predict is None or n_predict == -1:
        n_predict = n_predict_default
    d = sampling_defaults or SamplingParams()      # the server's flags (--temp, ...) over llama-server's own
    samplers = parse_samplers(f)
    seed = f.int("seed", lo=-1, hi=UINT32_MAX)
    n_probs = n_probs_set
    if allow_n_probs:
        n_probs = f.int("n_probs", "logprobs", lo=0, hi=n_vocab) or 0   # llama-server's alias order
        if n_probs > limits.MAX_N_PROBS:
            raise field_error("n_probs", f"{n_probs} candidates a token is over this server's limit of "
                                         f"{limits.MAX_N_PROBS} (bloomery.api.limits.MAX_N_PROBS; docs/security.md)")
    elif f.raw("n_probs") is not None:
        raise field_error("n_probs", "this route renders no probabilities (use /completion)")
    post = bool(f.bool("post_sampling_probs"))
    if post and not allow_n_probs:
        raise field_error("post_sampling_probs", "probabilities after the sampling chain are served on /completion "
                                                 "(with n_probs) only")
    ignore_eos = bool(f.bool("ignore_eos"))
    bias = parse_logit_bias(f, n_vocab)
    if ignore_eos:   # as llama-server: the stop ids can never be picked
        bias = [(t, b) for t, b in bias if t not in eog_ids] + [(t, -math.inf) for t in sorted(eog_ids)]

    def pick(v, default):
        return default if v is None else v
    sp = SamplingParams(
        temperature=pick(f.float("temperature", lo=0.0), d.temperature),
        top_k=pick(f.int("top_k"), d.top_k),
        top_p=pick(f.float("top_p", lo=0.0, hi=1.0), d.top_p),
        min_p=pick(f.float("min_p", lo=0.0, hi=1.0), d.min_p),
        repeat_penalty=pick(f.float("repeat_penalty", lo=0.0), d.repeat_penalty),
        repeat_last_n=pick(f.int("repeat_last_n", lo=-1, hi=INT32_MAX), d.repeat_last_n),
        presence_penalty=pick(f.float("presence_penalty"), d.presence_penalty),
        frequency_penalty=pick(f.float("frequency_penalty"), d.frequency_penalty),
        seed=d.seed if seed is None else DEFAULT_SEED if seed == -1 else seed,
        n_probs=n_probs, post_sampling_probs=post,
        logit_bias=tuple(bias),
        grammar=read_grammar(f),
    )
    sp = _apply_samplers(sp, samplers)
    f.int("min_keep", lo=0)
    return GenParams(
        n_predict=n_predict, sampling=sp, stop=parse_stop(f), ignore_eos=ignore_eos,
        cache_prompt=pick(f.bool("cache_prompt"), True), stream=bool(f.bool("stream")),
        return_tokens=bool(f.bool("return_tokens")), n_probs=n_probs, samplers=samplers,
        timings_per_token=bool(f.bool("timings_per_token")), id_slot=pick(f.int("id_slot", lo=-1), -1),
        return_progress=bool(f.bool("return_progress") and f.bool("stream")),
    )


def read_grammar(f: Fields) -> str:
    """llama-server's `grammar` (GBNF) and `json_schema` fields -> the engine's grammar text ("" for none)."""
    gbnf = f.str("grammar")
    schema = f.raw("json_schema")
    if gbnf and schema is not None:
        raise field_error("grammar", 'Either "json_schema" or "grammar" can be specified, but not both')
    if not gbnf and schema is None:
        return ""
    from bloomery.grammar import GrammarSyntaxError, SchemaError, gbnf_grammar, schema_grammar
    try:
        if schema is not None:
            return schema_grammar(schema[1])
        return gbnf_grammar(gbnf) if gbnf else ""
    except SchemaError as e:
        raise field_error("json_schema", str(e)) from None
    except GrammarSyntaxError as e:
        raise field_error("grammar", str(e)) from None


def _apply_samplers(sp: SamplingParams, samplers: tuple[str, ...]) -> SamplingParams:
    """A stage left out of `samplers` is turned off by its value, which the engine's chain honors."""
    from dataclasses import replace
    if "penalties" not in samplers:
        sp = replace(sp, repeat_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)
    if "top_k" not in samplers:
        sp = replace(sp, top_k=0)
    if "top_p" not in samplers:
        sp = replace(sp, top_p=1.0)
    if "min_p" not in samplers:
        sp = replace(sp, min_p=0.0)
    return sp
