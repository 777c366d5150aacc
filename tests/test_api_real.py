"""The routes end to end on the real model: tokenizer, chat template and the numpy engine in a thread.

Every case of llama-server's captured answers that this slice serves is replayed
and compared by shape (test_api_shapes.assert_same_shape); where the answer is
determined (tokenization, templates, greedy ids, counts, refusals) by value too.
Generations are kept to a few ids: the numpy engine is slow on this machine.
"""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from bloomery.engine.types import ModelInfo
from bloomery.http.types import Request
from test_api_shapes import assert_same_shape, assert_same_stream, dispatch, load_case, parse_sse

pytestmark = pytest.mark.real_model
N_CTX_SLOT = 4096      # the reference server's -c 4096 -np 1, so refusals carry the same numbers


class RealStack:
    """The tokenizer and template at once; the model and engine on first use (loading takes a while)."""

    def __init__(self, path: Path):
        from bloomery.chat_template import ChatTemplate
        from bloomery.gguf_file import open_gguf
        try:
            from bloomery.tokenizer import Tokenizer
        except ImportError:
            from bloomery.tokenizer.tokenizer import Tokenizer

        self.path = path
        gf = open_gguf(str(path))
        self.tok = Tokenizer.from_gguf(gf.metadata)
        self.template = ChatTemplate(gf.get("tokenizer.chat_template"),
                                     bos_token=self.tok.token_to_piece(self.tok.bos_id).decode(),
                                     eos_token=self.tok.token_to_piece(self.tok.eos_id).decode())
        from bloomery.stages.meta import model_meta
        meta = model_meta(gf)       # what the plan stage hands the engine stage for ModelInfo
        self.info = ModelInfo(name="models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", arch=gf.arch(),
                              n_ctx=N_CTX_SLOT, n_ctx_slot=N_CTX_SLOT, n_slots=1, n_vocab=self.tok.n_vocab,
                              n_ctx_train=int(gf.get("qwen2.context_length", 0)), backend="numpy",
                              model_path=str(path), **meta)
        self.client = None

    def app(self, **kw):
        from bloomery.api.app import App
        return App(self.tok, self.template, self.client, self.info, **kw)

    def start_engine(self) -> None:
        if self.client is None:
            from bloomery.engine.core import Engine
            from bloomery.engine.inproc import InProcessEngineClient
            from bloomery.engine.loader import load_model
            from bloomery.placement import whole
            model = load_model(str(self.path), whole("numpy", n_slots=1, n_ctx_slot=N_CTX_SLOT))
            self.client = InProcessEngineClient(Engine(model, 1, N_CTX_SLOT), self.info)


@pytest.fixture(scope="module")
def front(real_model_path):
    """Tokenizer and template on the real file; no engine."""
    try:
        s = RealStack(real_model_path)
    except ImportError as e:     # a module of the stack is not in the tree yet
        pytest.skip(f"the real front stack is not complete: {e}")
    yield s
    if s.client is not None:
        s.client.close()


@pytest.fixture
def stack(front):
    try:
        front.start_engine()
    except ImportError as e:
        pytest.skip(f"the real engine stack is not complete: {e}")
    return front


# (case, overrides that keep generation short; None: as captured)
# chat_n2 is not here: llama-server refuses n > 1, bloomery serves n choices (serving guide 11.2,
# docs/serving.md; tests/test_routes_openai.py)
EXACT_CASES = ["tokenize", "tokenize_with_pieces", "tokenize_add_special_with_pieces", "tokenize_no_parse_special",
               "detokenize", "apply_template", "err_prompt_too_long"]


@pytest.mark.parametrize("case", EXACT_CASES)
def test_determined_answers_equal_llama_servers(front, case):
    req, status, ref = load_case(case)
    got_status, ours = dispatch(front.app(), req)
    assert got_status == status
    if "error" in ref:
        ours["error"].pop("param", None)
    assert ours == ref


@pytest.mark.parametrize("case", ["health", "models", "v1_models", "props"])
def test_model_facts_have_the_reference_shape_on_the_real_file(front, case):
    req, status, ref = load_case(case)
    got_status, ours = dispatch(front.app(), req)
    assert got_status == status
    assert_same_shape(ref, ours)
    if case == "v1_models":     # every model fact read from the file, as llama-server reads it
        assert ours["data"][0]["meta"] == ref["data"][0]["meta"]
    if case == "props":
        assert ours["model_ftype"] == ref["model_ftype"]
    if case == "props":
        for key in ("chat_template", "bos_token", "eos_token", "chat_template_caps"):
            assert ours[key] == ref[key], key


@pytest.mark.parametrize("case,override,n_tail", [
    ("completion", {"n_predict": 3}, 0),
    ("completion_n_probs", {"n_predict": 2}, 0),
    ("completion_return_tokens_stop", {"stop": [" 5"]}, 0),
    ("v1_completions", {"max_tokens": 3}, 0),
    ("completion_stream", {"n_predict": 3}, 1),
    ("v1_completions_stream", {"max_tokens": 3}, 2),
    ("chat_completions", {"max_tokens": 3}, 0),
    ("chat_stop_seq", {"stop": ["3"]}, 0),
    ("chat_completions_stream", {"max_tokens": 3}, 2),
    ("chat_completions_stream_usage", {"max_tokens": 3}, 3),
    ("err_empty_messages", {"max_tokens": 2}, 0),    # llama-server's jinja renders messages[0] on [] (200)
    ("chat_tools_auto", {"max_tokens": 3}, 0),
])
def test_generating_routes_have_the_reference_shape(stack, case, override, n_tail):
    req, status, ref = load_case(case)
    got_status, ours = dispatch(stack.app(), req, override)
    assert got_status == status == 200, ours
    if n_tail:
        assert_same_stream(ref, ours, n_tail=n_tail)
    else:
        assert_same_shape(ref, ours)


def test_greedy_ids_and_counts_match_llama_server(stack):
    _, _, ref_stream = load_case("completion_stream")
    ref_ids = [ev["tokens"][0] for ev in ref_stream[:4]]
    req, _, _ = load_case("completion")
    _, ours = dispatch(stack.app(), req, {"n_predict": 4, "return_tokens": True, "cache_prompt": False})
    assert ours["tokens"] == ref_ids
    assert ours["content"] == "".join(ev["content"] for ev in ref_stream[:4])
    assert ours["tokens_evaluated"] == 4 and ours["tokens_predicted"] == 4 and ours["stop_type"] == "limit"


def test_a_stop_string_ends_the_real_generation(stack):
    req, _, ref = load_case("completion_return_tokens_stop")
    _, ours = dispatch(stack.app(), req, {"stop": [" 5"]})
    assert ours["content"] == " 4," and ours["stop_type"] == "word" and ours["stopping_word"] == " 5"
    assert ours["tokens"] == ref["tokens"][:5]          # " 4, 5": the stop's ids are reported


def test_chat_prompt_counts_match_llama_server(stack):
    req, _, ref = load_case("chat_completions")
    _, ours = dispatch(stack.app(), req, {"max_tokens": 1})
    assert ours["usage"]["prompt_tokens"] == ref["usage"]["prompt_tokens"]
    assert ours["choices"][0]["finish_reason"] == "length"


def test_streamed_chat_deltas_add_up_to_the_answer(stack):
    req, _, _ = load_case("chat_completions_stream")
    _, events = dispatch(stack.app(), req, {"max_tokens": 4, "cache_prompt": False})
    streamed = "".join(ev["choices"][0]["delta"].get("content") or "" for ev in events[:-1] if ev["choices"])
    _, whole = dispatch(stack.app(), req, {"max_tokens": 4, "cache_prompt": False, "stream": False})
    assert streamed == whole["choices"][0]["message"]["content"]
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert events[-1] == "[DONE]"


def test_a_client_that_leaves_frees_the_slot(stack):
    lines = []
    app = stack.app(log=lines.append)
    body = json.dumps({"prompt": "def fibonacci(n):", "n_predict": 64, "stream": True}).encode()

    async def go():
        r = await app.dispatch(Request("POST", "/completion", {}, {}, body))
        got = []
        async for c in r.chunks:
            got.append(c)
            if len(got) == 2:
                break
        await r.chunks.aclose()
        for _ in range(200):        # the engine drops the request within a step or two
            if not any(s.get("is_processing") for s in stack.client.slots()):
                break
            await asyncio.sleep(0.05)
        return got
    got = asyncio.run(go())
    assert len(parse_sse(b"".join(got))) == 2
    assert not any(s.get("is_processing") for s in stack.client.slots())
    assert len(lines) == 1 and "stop cancel" in lines[0] and "/completion" in lines[0]
