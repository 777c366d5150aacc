"""Our answers have llama-server's shapes: the same keys, types and nesting as its captured answers.

Values (ids, created, timings, the text) differ; shapes may not. This file holds the
comparison and runs it on the routes whose shape does not depend on the model
(errors, /health, /props, /v1/models) and on generation shapes over a scripted engine;
test_api_real.py runs the same comparison on the real model for every generating case.
"""
from __future__ import annotations

import asyncio
import json
import re

import pytest

from bloomery.api.app import App
from bloomery.engine.types import ModelInfo, TokenOut, TokenProb
from bloomery.http.types import Request, Response, StreamResponse
from captures import CAPTURES, request, response, status as ref_status


def load_case(name: str) -> tuple[dict, int, object]:
    """A reference case: (its request, its status, its body as JSON or a list of SSE events)."""
    req, status = request(name), ref_status(name)
    sse = CAPTURES / f"{name}.response.sse.txt"
    body = parse_sse(sse.read_bytes()) if sse.exists() else response(name)
    return req, status, body


def parse_sse(data: bytes) -> list:
    out = []
    for block in data.split(b"\n\n"):
        if block.strip():
            assert block.startswith(b"data: "), block[:60]
            payload = block[6:]
            out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out


def _kind(v: object) -> str:
    return "bool" if isinstance(v, bool) else type(v).__name__


# The keys bloomery adds beside llama-server's, by the name of the object that holds them: the serving guide's
# timings.cache_ms (the prompt cache's work before the prompt). Nothing else may be extra.
EXTENSIONS = {"timings": frozenset({"cache_ms"})}


def assert_same_shape(ref: object, ours: object, where: str = "$") -> None:
    """Same keys (any order), same JSON types, same nesting; list items compared to the reference's first. An
    object may also hold the EXTENSIONS its name has."""
    assert _kind(ours) == _kind(ref), f"{where}: ours is {_kind(ours)} ({ours!r:.80}), llama-server's {_kind(ref)}"
    if isinstance(ref, dict):
        ours = {k: v for k, v in ours.items() if k not in EXTENSIONS.get(where.rsplit(".", 1)[-1], ())}
        missing, extra = set(ref) - set(ours), set(ours) - set(ref)
        assert not missing and not extra, f"{where}: missing {sorted(missing)}, extra {sorted(extra)}"
        for k in ref:
            assert_same_shape(ref[k], ours[k], f"{where}.{k}")
    elif isinstance(ref, list) and ref and ours:
        for i, item in enumerate(ours):
            assert_same_shape(ref[0], item, f"{where}[{i}]")


def assert_same_stream(ref: list, ours: list, *, n_tail: int) -> None:
    """The first event, the last n_tail events and every event between them against the reference's."""
    assert len(ours) >= n_tail + 1, ours
    for i in range(1, n_tail + 1):
        assert_same_shape(ref[-i], ours[-i], f"event[-{i}]")
    assert_same_shape(ref[0], ours[0], "event[0]")
    for i, ev in enumerate(ours[1:-n_tail], 1):
        assert_same_shape(ref[1], ev, f"event[{i}]")


def dispatch(app: App, req: dict, body_override: dict | None = None):
    body = req["body"].encode() if req["body"] is not None else b""
    if body_override is not None:
        body = json.dumps({**req["body_json"], **body_override}).encode()
    r = asyncio.run(app.dispatch(Request(req["method"], req["path"], {}, {}, body)))
    if isinstance(r, StreamResponse):
        async def read():
            return b"".join([c async for c in r.chunks])
        return r.status, parse_sse(asyncio.run(read()))
    assert isinstance(r, Response)
    return r.status, json.loads(r.body)


# --- a scripted engine and a small tokenizer: the front's shapes without the model ---

class ByteTok:
    """Ids 0..255 are bytes; 256 is the stop id. The front only needs these calls."""
    n_vocab = 257
    eog_ids = frozenset({256})
    bos_id, eos_id = 256, 256

    def token_to_piece(self, i: int, special: bool = True) -> bytes:
        return (b"<|im_end|>" if special else b"") if i == 256 else bytes([i])

    def encode(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        return list(text.encode())

    def decode(self, ids) -> str:
        return b"".join(self.token_to_piece(i, False) for i in ids).decode("utf-8", "replace")


class Scripted:
    """Replays `text` one byte an id, with probabilities when asked, then a length finish."""

    def __init__(self, text: str = "Hi there\n", slot: int = 0):
        self.ids = list(text.encode())
        self.slot = slot

    async def generate(self, req):
        for k, tok in enumerate(self.ids[:req.n_predict if req.n_predict >= 0 else None]):
            last = k == len(self.ids) - 1 or k + 1 == req.n_predict
            top = tuple(TokenProb(t, -0.5 * j, 0.5) for j, t in enumerate([tok, 65, 66][:req.sampling.n_probs]))
            yield TokenOut(req.req_id, tok, "length" if last else None, logprob=-0.25 if top else None, top=top,
                           n_prompt=len(req.prompt_ids), prompt_ms=2.0, slot=self.slot)


INFO = ModelInfo(name="models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", arch="qwen2", n_ctx=4096, n_ctx_slot=4096,
                 n_slots=1, n_vocab=257, n_ctx_train=32768, backend="numpy", model_path="models/x.gguf",
                 n_params=630167424, size_bytes=485452288, n_embd=896, vocab_type=2, ftype="Q4_K - Medium")


class Template:
    """Enough of ChatTemplate for the shape of /props; chat rendering is tested on the real one."""
    source = "{{ messages }}"


def scripted_app(**kw) -> App:
    return App(ByteTok(), Template(), kw.pop("client", None) or Scripted(), INFO, **kw)


@pytest.mark.parametrize("case", [
    "health", "models", "v1_models", "props", "err_bad_json", "err_unknown_route", "err_unknown_route_post",
    "err_wrong_method", "err_max_tokens_string", "err_max_tokens_nonnumeric_string", "err_missing_messages",
    "err_completion_no_prompt",      # chat_n2: n > 1 is served here (serving guide 11.1), refused by llama-server
])
def test_model_free_routes_have_the_reference_shape(case):
    req, status, ref = load_case(case)
    got_status, ours = dispatch(scripted_app(), req)
    assert got_status == status
    if "error" in ref:     # OpenAI's param is ours beside llama-server's fields (serving guide 11.1)
        ours["error"].pop("param", None)
    assert_same_shape(ref, ours)


def test_error_messages_copy_llama_servers_where_clients_match_them():
    for case in ("err_max_tokens_string", "err_missing_messages"):
        req, _, ref = load_case(case)
        _, ours = dispatch(scripted_app(), req)
        # llama-server's message with its JSON library's exception tag left out
        assert ours["error"]["message"] == re.sub(r"\[json\.exception\.[a-z_]+\.\d+\] ", "", ref["error"]["message"])


@pytest.mark.parametrize("case,n_tail", [
    ("completion", 0), ("completion_n_probs", 0), ("completion_return_tokens_stop", 0), ("v1_completions", 0),
    ("completion_stream", 1), ("v1_completions_stream", 2),
])
def test_generation_shapes_over_a_scripted_engine(case, n_tail):
    req, status, ref = load_case(case)
    got_status, ours = dispatch(scripted_app(), req)
    assert got_status == status == 200
    if n_tail:
        assert_same_stream(ref, ours, n_tail=n_tail)
    else:
        assert_same_shape(ref, ours)


def test_the_shape_check_catches_a_missing_key():
    _, _, ref = load_case("completion")
    broken = dict(ref)
    del broken["stopping_word"]
    with pytest.raises(AssertionError, match="stopping_word"):
        assert_same_shape(ref, broken)
    with pytest.raises(AssertionError, match="tokens_predicted"):
        assert_same_shape(ref, {**ref, "tokens_predicted": 3.0})
