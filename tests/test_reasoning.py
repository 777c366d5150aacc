"""<think> spans into reasoning_content, streamed and whole; reasoning fields; the loop detector."""
from __future__ import annotations

import itertools

import pytest

from bloomery.api.params import Fields
from bloomery.api.reasoning import LoopDetector, ThinkParser, prompt_opens_think, read_reasoning
from bloomery.api.toolcalls.reply import Reply
from bloomery.http.types import ApiError


@pytest.mark.parametrize("text,starts_open,reasoning,content", [
    ("<think>\nhmm, let me see\n</think>\n\nThe answer", False, "hmm, let me see", "The answer"),
    ("I think</think>answer", True, "I think", "answer"),
    ("plain <think>x</think>", False, "", "plain <think>x</think>"),
    ("<think>cut short\n", False, "cut short", ""),
])
def test_whole_and_streamed_agree(text, starts_open, reasoning, content):
    whole = ThinkParser(True, starts_open)
    whole.feed(text)
    whole.finish()
    assert (whole.reasoning, whole.content) == (reasoning, content)
    streamed = ThinkParser(True, starts_open)
    r = c = ""
    for ch in text:
        dr, dc = streamed.feed(ch)
        r, c = r + dr, c + dc
    dr, dc = streamed.finish()
    assert (r + dr, c + dc) == (reasoning, content)


def test_format_none_keeps_tags_in_content():
    p = ThinkParser(extract=False)
    p.feed("<think>x</think>y")
    assert p.content == "<think>x</think>y" and p.reasoning == ""


def test_prompt_opening_a_span():
    assert prompt_opens_think("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_think("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_think("<|im_start|>assistant\n")


def test_reply_streams_reasoning_deltas():
    r = Reply(None, starts_open=True)
    deltas = [d for ch in "plan</think>done" for d in r.feed(ch)] + r.finish(False)
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "plan"
    assert "".join(d.get("content", "") for d in deltas) == "done"
    assert r.message()["reasoning_content"] == "plan"


@pytest.mark.parametrize("body,word", [({"reasoning_format": "xml"}, "reasoning_format"),
                                       ({"reasoning_effort": "huge"}, "reasoning_effort"),
                                       ({"reasoning_budget": -2}, "reasoning_budget"),
                                       ({"reasoning_loop": "yes"}, "reasoning_loop")])
def test_bad_reasoning_fields_named(body, word):
    with pytest.raises(ApiError) as e:
        read_reasoning(Fields(body))
    assert word in str(e.value.body())


def test_effort_none_turns_thinking_off_but_client_kwargs_win():
    rs = read_reasoning(Fields({"reasoning_effort": "none"}))
    assert rs.template_kwargs(None) == {"enable_thinking": False}
    assert rs.template_kwargs({"enable_thinking": True}) == {"enable_thinking": True}


def test_loop_detector_needs_256_ids_and_a_whole_cycle():
    d = LoopDetector()
    hits = [i for i, t in enumerate(itertools.islice(itertools.cycle([1, 2, 3]), 400)) if d.feed(t)]
    assert hits and hits[0] == 3 + 255          # 256 ids equal to the id 3 back
    d = LoopDetector()
    assert not any(d.feed(t) for t in range(600))


# --- the think-span watch: reasoning_budget and reasoning_loop over a generation's ids ---------------

from bloomery.api.reasoning import (ReasoningSettings, ThinkSpec, ThinkWatch, prompt_closes_think,  # noqa: E402
                                    think_spec, utf8_complete)

OPEN, CLOSE, FORCED = (7, 8), (9, 10), (5, 9, 10)      # <think>, </think>, message + </think>


def _watch(budget, starts_open=True, loop=False, pieces=None):
    spec = ThinkSpec(OPEN, (CLOSE,), FORCED, budget, starts_open, loop)
    return ThinkWatch(spec, lambda t: (pieces or {}).get(t, b"x"))


def _run(w, model_ids):
    """Feed ids as a generation would: a forced id replaces the model's pick while the watch forces."""
    got = []
    for t in model_ids:
        nxt = w.forced_next
        while nxt is not None:
            got.append(nxt)
            w.accept(nxt, forced=True)
            nxt = w.forced_next
        got.append(t)
        w.accept(t)
    return got


def test_budget_counts_ids_in_the_open_span_then_forces_the_end():
    w = _watch(3)
    assert _run(w, [1, 2, 3, 4, 4]) == [1, 2, 3, 5, 9, 10, 4, 4]
    assert w.state == "done" and w.n_forced == 3


def test_budget_zero_closes_at_once_and_minus_one_never_forces():
    assert _run(_watch(0), [1, 2]) == [5, 9, 10, 1, 2]
    w = _watch(-1)
    assert _run(w, list(range(20, 60))) == list(range(20, 60)) and w.in_span


def test_budget_starts_at_a_generated_open_tag_and_the_model_may_close_first():
    w = _watch(2, starts_open=False)
    assert _run(w, [1, 7, 8, 1, 2, 3]) == [1, 7, 8, 1, 2, 5, 9, 10, 3]
    w = _watch(5)
    assert _run(w, [1, 9, 10, 2, 3, 4, 5, 6]) == [1, 9, 10, 2, 3, 4, 5, 6]      # closed by the model: no force
    w = _watch(1)                                                                # a new <think> re-arms it
    assert _run(w, [1, 2, 7, 8, 3, 4]) == [1, 5, 9, 10, 2, 7, 8, 3, 5, 9, 10, 4]


def test_budget_waits_for_a_whole_utf8_character():
    w = _watch(1, pieces={1: b"\xe4\xbd", 2: b"\xa0", 3: b"\xa0!"})
    assert _run(w, [1, 2, 3, 4]) == [1, 2, 3, 5, 9, 10, 4]     # a lone continuation byte is not whole either
    assert utf8_complete(b"a\xe4\xbd\xa0") and not utf8_complete(b"\xe4\xbd") and utf8_complete(b"")
    assert not utf8_complete(b"\xa0")


def test_loop_is_seen_only_inside_the_span():
    w = _watch(-1, loop=True)
    for i, t in enumerate([1, 2] * 200):
        w.accept(t)
        if w.looped:
            break
    assert w.looped and i == 2 + 255
    w = _watch(-1, starts_open=False, loop=True)
    for t in [1, 2] * 300:
        w.accept(t)
    assert not w.looped                                   # never inside a span


class _Tok:
    def encode(self, text, add_special, parse_special):
        return {"<think>": [7, 8], "</think>": [9, 10], "<tool_call>": [11], "Enough.": [5]}[text]


def test_think_spec_from_the_prompt_and_template():
    rs = ReasoningSettings(budget=4, budget_message="Enough.")
    spec = think_spec(_Tok(), rs, "<|im_start|>assistant\n<think>\n", True, ("<tool_call>",))
    assert spec == ThinkSpec((7, 8), ((9, 10), (11,)), (5, 9, 10), 4, True, False)
    assert think_spec(_Tok(), rs, "assistant\n<think>\n\n</think>\n\n", True) is None      # the template closed it
    assert prompt_closes_think("x<think>\n\n</think>\n\n")
    assert think_spec(_Tok(), rs, "assistant\n", False) is None                            # no span in the template
    assert think_spec(_Tok(), ReasoningSettings(), "<think>\n", True) is None               # nothing to watch
    assert think_spec(_Tok(), ReasoningSettings(loop=True), "<think>\n", True).budget == -1


@pytest.mark.parametrize("body,budget,set_", [({}, 7, False), ({"reasoning_budget": 3}, 3, True),
                                              ({"thinking_budget_tokens": 0}, 0, True),
                                              ({"reasoning_budget_tokens": -1}, 7, False)])
def test_budget_fields_and_server_default(body, budget, set_):
    rs = read_reasoning(Fields(body), default_budget=7)
    assert (rs.budget, rs.budget_set) == (budget, set_)


# --- through the front (api/generate.py) over a scripted engine: the forced ids, the legs, the loop end -------

import asyncio  # noqa: E402
import json  # noqa: E402

from bloomery.api.app import App  # noqa: E402
from bloomery.engine.types import ModelInfo, TokenOut  # noqa: E402
from bloomery.http.types import Request  # noqa: E402

WORDS = ["<eos>", "<think>", "</think>", "a", "b", " ", "x", "\n"]


class WordTok:
    """One id per word of WORDS; text is split greedily into those words."""
    n_vocab = len(WORDS)
    eog_ids = frozenset({0})
    bos_id, eos_id = None, 0

    def token_to_piece(self, i, special=True):
        return b"" if i == 0 else WORDS[i].encode()

    def encode(self, text, add_special, parse_special):
        out = []
        while text:
            w = max((w for w in WORDS[1:] if text.startswith(w)), key=len)
            out.append(WORDS.index(w))
            text = text[len(w):]
        return out

    def decode(self, ids):
        return "".join(WORDS[i] for i in ids if i)


class LegClient:
    """Each request yields `script` ids (the model's picks) from wherever its prompt ends."""

    def __init__(self, script):
        self.script, self.requests = script, []

    async def generate(self, req):
        self.requests.append(req)
        for k, tok in enumerate(self.script):
            await asyncio.sleep(0)
            last = k == len(self.script) - 1
            yield TokenOut(req.req_id, tok, "length" if last else None, n_prompt=len(req.prompt_ids), prompt_ms=1.0)


def _app(client):
    info = ModelInfo(name="w", arch="qwen2", n_ctx=64, n_ctx_slot=64, n_slots=1, n_vocab=len(WORDS), n_ctx_train=64,
                     backend="numpy", model_path="/m.gguf")
    return App(WordTok(), None, client, info, log=lambda line: None)


def _post(app, path, body):
    r = asyncio.run(app.dispatch(Request("POST", path, {}, {}, json.dumps(body).encode())))
    return r.status, json.loads(r.body)


def test_budget_forces_the_end_tag_and_goes_on_in_a_new_engine_request():
    client = LegClient([3, 4, 3, 4, 3, 4])                  # the model: "ababab"
    status, body = _post(_app(client), "/completion", {"prompt": "x<think>", "reasoning_budget": 2, "n_predict": 7,
                                                        "return_tokens": True})
    assert status == 200
    assert body["tokens"] == [3, 4, 2, 3, 4, 3, 4] and body["content"] == "ab</think>abab"
    assert body["tokens_predicted"] == 7 and body["stop_type"] == "limit"
    first, second = client.requests
    assert second.prompt_ids == first.prompt_ids + (3, 4, 2) and second.n_predict == 4
    assert second.req_id != first.req_id and second.cache_prompt


@pytest.mark.parametrize("seed", [7, 0xFFFFFFFF])
def test_budget_legs_share_one_seeded_stream(seed):
    """llama.cpp's dist sampler draws once per generated id, forced ones included: the next leg
    starts its stream past the draws of every id so far, from the same seed (a random seed is
    fixed once for all legs)."""
    client = LegClient([3, 4, 3, 4, 3, 4])
    status, _ = _post(_app(client), "/completion", {"prompt": "x<think>", "reasoning_budget": 2, "n_predict": 7,
                                                     "temperature": 0.8, "seed": seed})
    assert status == 200
    first, second = client.requests
    assert first.sampling.n_drawn == 0 and second.sampling.n_drawn == 3          # two sampled ids + the end tag
    assert first.sampling.seed == second.sampling.seed != 0xFFFFFFFF
    if seed != 0xFFFFFFFF:
        assert first.sampling.seed == seed


def test_a_skipped_stream_continues_where_the_draws_left_off():
    from bloomery.engine.sampler import MT19937, Sampler
    from bloomery.engine.types import SamplingParams
    whole = MT19937(1234)
    draws = [whole.uniform_double() for _ in range(700)]                # past one 624-word twist
    s = Sampler(SamplingParams(seed=1234, n_drawn=400), n_vocab=10, n_ctx_slot=64)
    assert [s.rng.uniform_double() for _ in range(300)] == draws[400:]
    greedy = Sampler(SamplingParams(seed=1234, temperature=0, n_drawn=400), n_vocab=10, n_ctx_slot=64)
    assert greedy.rng.uniform_double() == draws[0]                      # greedy never draws: nothing skipped


def test_budget_zero_closes_the_span_before_the_model_writes():
    client = LegClient([3, 4])
    _, body = _post(_app(client), "/completion", {"prompt": "<think>", "reasoning_budget": 0, "n_predict": 3,
                                                   "return_tokens": True})
    assert body["tokens"] == [2, 3, 4]      # the end tag is forced before the model's first id
    assert client.requests[0].prompt_ids[-1] == 2 and client.requests[0].n_predict == 2


def test_no_budget_and_a_closed_span_leave_one_engine_request():
    for body in ({"prompt": "<think>"}, {"prompt": "x", "reasoning_budget": 1}):
        client = LegClient([3, 4, 3])
        _post(_app(client), "/completion", {**body, "n_predict": 3})
        assert len(client.requests) == 1


def test_chat_budget_splits_reasoning_and_content():
    app = _app(LegClient([3, 5, 4, 3, 3]))
    app.template = OpenTmpl()
    app.encode_chat = lambda rendered: [6, 1]
    status, body = _post(app, "/v1/chat/completions", {"messages": [{"role": "user", "content": "q"}],
                                                        "reasoning_budget": 1, "max_tokens": 6})
    msg = body["choices"][0]["message"]
    assert status == 200 and msg["reasoning_content"] == "a" and msg["content"] == "a ba"


def test_reasoning_loop_ends_the_generation_with_its_own_reason():
    cycle = [3, 4, 5] * 120
    for path, word in (("/completion", "stop_type"), ("/v1/completions", "finish_reason")):
        client = LegClient(cycle)
        _, body = _post(_app(client), path, {"prompt": "<think>", "reasoning_loop": True, "n_predict": 360})
        got = body[word] if word in body else body["choices"][0][word]
        assert got == "reasoning_loop"
        n = body.get("tokens_predicted") or body["usage"]["completion_tokens"]
        assert n == 3 + 256
    client = LegClient(cycle)                                   # outside a span: no loop end
    _, body = _post(_app(client), "/completion", {"prompt": "x", "reasoning_loop": True, "n_predict": 360})
    assert body["stop_type"] == "limit"


class OpenTmpl:
    """A template stand-in whose prompt opens the span (as QwQ's or DeepSeek-R1's generation prompt)."""
    source = "<think>"
    caps = type("C", (), {"thinking": True})()

    def render(self, messages, **kw):
        from bloomery.chat_template import RenderedPrompt
        return RenderedPrompt("x<think>", (("x<think>", False),))


def test_reasoning_loop_on_the_chat_shaped_routes():
    def app_of(client):
        app = _app(client)
        app.template = OpenTmpl()
        app.encode_chat = lambda rendered: [6, 1]
        return app
    msgs = [{"role": "user", "content": "q"}]
    cycle = [3, 4] * 200
    _, chat = _post(app_of(LegClient(cycle)), "/v1/chat/completions",
                    {"messages": msgs, "max_tokens": 300, "reasoning_loop": True})
    choice = chat["choices"][0]
    assert choice["finish_reason"] == "reasoning_loop" and chat["usage"]["completion_tokens"] == 2 + 256
    assert choice["message"]["reasoning_content"].startswith("abab") and not choice["message"].get("content")
    _, msg = _post(app_of(LegClient(cycle)), "/v1/messages",
                   {"model": "x", "messages": msgs, "max_tokens": 300, "reasoning_loop": True})
    assert msg["stop_reason"] == "reasoning_loop" and msg["content"][0]["type"] == "thinking"
    _, resp = _post(app_of(LegClient(cycle)), "/v1/responses",
                    {"input": "q", "max_output_tokens": 300, "reasoning_loop": True, "store": False})
    assert resp["status"] == "incomplete" and resp["incomplete_details"] == {"reason": "reasoning_loop"}
    _, free = _post(app_of(LegClient(cycle)), "/v1/chat/completions", {"messages": msgs, "max_tokens": 300})
    assert free["choices"][0]["finish_reason"] == "length"          # off unless asked


def test_server_default_budget_applies_to_chat_but_a_request_can_lift_it():
    Tmpl = OpenTmpl
    info = ModelInfo(name="w", arch="qwen2", n_ctx=64, n_ctx_slot=64, n_slots=1, n_vocab=len(WORDS), n_ctx_train=64,
                     backend="numpy", model_path="/m.gguf")
    chat = {"messages": [{"role": "user", "content": "q"}], "max_tokens": 4}
    for extra, reasoning in (({}, "a"), ({"reasoning_budget": 3}, "aba"), ({"reasoning_budget": -1}, "a")):
        client = LegClient([3, 4, 3, 4])
        app = App(WordTok(), Tmpl(), client, info, reasoning_budget=1, log=lambda line: None)
        app.encode_chat = lambda rendered: [6, 1]
        _, body = _post(app, "/v1/chat/completions", {**chat, **extra})
        assert body["choices"][0]["message"].get("reasoning_content") == reasoning, extra


# --- through one real bloomery-serve: a template whose generation prompt opens the span (as QwQ's) -------------

THINKING_TEMPLATE = (
    "{%- for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{ '<think>\\n' }}{%- endif %}{%- endif %}")
Q = [{"role": "user", "content": "What is 17 * 23? Think step by step."}]


@pytest.fixture(scope="module")
def thinking_server(real_model_path, tmp_path_factory):
    import requests as _requests  # noqa: F401  (the real-server tests need it)
    from serve_proc import Served
    tmpl = tmp_path_factory.mktemp("tmpl") / "thinking.jinja"
    tmpl.write_text(THINKING_TEMPLATE)
    with Served("-m", str(real_model_path), "-c", "1024", "--temp", "0", "--chat-template-file", str(tmpl)) as s:
        yield s


def _ids(server, text):
    import requests
    return requests.post(server.url + "/tokenize", json={"content": text}, timeout=60).json()["tokens"]


@pytest.mark.real_model
@pytest.mark.parametrize("budget", [0, 4])
def test_real_budget_forces_the_end_tag_after_that_many_ids(thinking_server, budget):
    import requests
    prompt = "<|im_start|>user\nWhat is 17 * 23?<|im_end|>\n<|im_start|>assistant\n<think>\n"
    r = requests.post(thinking_server.url + "/completion", timeout=300, json={
        "prompt": prompt, "n_predict": budget + 6, "temperature": 0, "reasoning_budget": budget, "return_tokens": True})
    assert r.status_code == 200, r.text
    body, end = r.json(), _ids(thinking_server, "</think>")
    assert body["tokens"][budget:budget + len(end)] == end, body
    assert body["tokens_predicted"] == len(body["tokens"]) >= budget + len(end)     # the forced ids are generated ids
    free = requests.post(thinking_server.url + "/completion", timeout=300, json={
        "prompt": prompt, "n_predict": budget + 6, "temperature": 0, "return_tokens": True}).json()
    assert free["tokens"][:budget] == body["tokens"][:budget] and "</think>" not in free["content"]


@pytest.mark.real_model
def test_real_chat_budget_splits_reasoning_and_content_streamed_and_whole(thinking_server):
    import requests
    url = thinking_server.url + "/v1/chat/completions"
    body = {"messages": Q, "max_tokens": 12, "reasoning_budget": 3}
    whole = requests.post(url, json=body, timeout=300).json()
    msg = whole["choices"][0]["message"]
    assert msg["reasoning_content"] and msg["content"], msg
    assert len(_ids(thinking_server, msg["reasoning_content"])) <= 3
    r = requests.post(url, json={**body, "stream": True}, timeout=300, stream=True)
    deltas = [json.loads(line[6:])["choices"] for line in r.iter_lines(decode_unicode=True)
              if line.startswith("data: ") and line != "data: [DONE]"]
    got = {k: "".join(c[0]["delta"].get(k) or "" for c in deltas if c) for k in ("reasoning_content", "content")}
    assert got == {"reasoning_content": msg["reasoning_content"], "content": msg["content"]}
    free = requests.post(url, json={"messages": Q, "max_tokens": 12}, timeout=300).json()["choices"][0]["message"]
    assert not free.get("content") and len(free["reasoning_content"]) > len(msg["reasoning_content"])


@pytest.mark.real_model
def test_real_anthropic_thinking_block_and_its_budget(thinking_server):
    import requests
    url = thinking_server.url + "/v1/messages"
    body = {"model": "x", "max_tokens": 10, "messages": Q, "thinking": {"type": "enabled", "budget_tokens": 2}}
    m = requests.post(url, json=body, timeout=300).json()
    assert [b["type"] for b in m["content"]] == ["thinking", "text"], m
    assert m["content"][0]["signature"] == "" and len(_ids(thinking_server, m["content"][0]["thinking"])) <= 2
    r = requests.post(url, json={**body, "stream": True}, timeout=300, stream=True)
    events = [json.loads(line[6:]) for line in r.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    starts = [(e["index"], e["content_block"]["type"]) for e in events if e["type"] == "content_block_start"]
    assert starts == [(0, "thinking"), (1, "text")]
    kinds = [e["delta"]["type"] for e in events if e["type"] == "content_block_delta"]
    assert kinds.index("signature_delta") < kinds.index("text_delta") and "thinking_delta" in kinds
    thinking = "".join(e["delta"].get("thinking", "") for e in events if e["type"] == "content_block_delta")
    assert thinking == m["content"][0]["thinking"]
