"""The front's generation loop (bloomery/api/generate.py) and the stream shapes, over a scripted engine.

The thing under test is the front: stop strings, cancel on close, counts, the log
line, SSE framing. The engine here replays a fixed list of TokenOuts and records
whether the front closed it early; the real-engine tests are in test_api_real.py.
"""
from __future__ import annotations

import asyncio
import json
import re

import pytest

from bloomery.api.app import App
from bloomery.engine.types import ModelInfo, TokenOut
from bloomery.http.types import Request, Response, StreamResponse

EOS = 0
PIECES = ["<eos>", "a", "b", " ", "1", ",", "2", "3", "\n", "\xe4", "\xbd", "\xa0"]   # ids 9..11: bytes of 你


class MiniTok:
    """Ids are single characters (9..11 single bytes): enough to drive the front's text handling."""
    n_vocab = len(PIECES)
    eog_ids = frozenset({EOS})
    bos_id, eos_id = None, EOS

    def token_to_piece(self, i: int, special: bool = True) -> bytes:
        if i == EOS:
            return b"<eos>" if special else b""
        return PIECES[i].encode("latin-1") if i >= 9 else PIECES[i].encode()

    def encode(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        return [PIECES.index(c) for c in text]

    def decode(self, ids) -> str:
        return b"".join(self.token_to_piece(i, special=False) for i in ids).decode("utf-8", "replace")


class ScriptedClient:
    def __init__(self, ids: list[int], finish: str = "length", n_cached: int = 0):
        self.ids, self.finish, self.n_cached = ids, finish, n_cached
        self.closed_early = None
        self.closed_when_answered = None
        self.requests = []

    async def generate(self, req):
        self.requests.append(req)
        done = False
        try:
            for k, tok in enumerate(self.ids):
                last = k == len(self.ids) - 1
                await asyncio.sleep(0)
                yield TokenOut(req.req_id, tok, self.finish if last else None, n_prompt=len(req.prompt_ids),
                               n_cached=self.n_cached, prompt_ms=1.5)
            done = True
        finally:
            self.closed_early = not done


INFO = ModelInfo(name="mini", arch="qwen2", n_ctx=16, n_ctx_slot=16, n_slots=1, n_vocab=len(PIECES),
                 n_ctx_train=16, backend="numpy", model_path="/m.gguf")


def make_app(client, log=None) -> App:
    return App(MiniTok(), None, client, INFO, log=log or (lambda line: None))


def post(app: App, path: str, body: dict):
    """Dispatches in a fresh loop; the engine's closed state is read before the loop ends, because ending
    the loop finalizes every open async generator and would hide a front that forgot to close it."""
    async def go():
        r = await app.dispatch(Request("POST", path, {}, {}, json.dumps(body).encode()))
        if isinstance(app.client, ScriptedClient):
            app.client.closed_when_answered = app.client.closed_early
        return r
    return asyncio.run(go())


def read_stream(resp: StreamResponse, n_chunks: int | None = None, client=None):
    async def go():
        out = []
        async for c in resp.chunks:
            out.append(c)
            if n_chunks is not None and len(out) == n_chunks:
                await resp.chunks.aclose()   # the client leaves
                break
        await asyncio.sleep(0)
        return out, client.closed_early
    return asyncio.run(go())


def events(chunks: list[bytes]) -> list:
    out = []
    for c in chunks:
        assert c.startswith(b"data: ") and c.endswith(b"\n\n")
        data = c[6:-2]
        out.append(data.decode() if data == b"[DONE]" else json.loads(data))
    return out


def test_a_stop_string_cuts_the_content_and_cancels_the_engine():
    client = ScriptedClient([4, 5, 3, 6, 5, 3, 7, 5])       # "1, 2, 3,"
    r = post(make_app(client), "/completion", {"prompt": "ab", "stop": [" 3"], "return_tokens": True})
    body = json.loads(r.body)
    assert body["content"] == "1, 2," and body["stop_type"] == "word" and body["stopping_word"] == " 3"
    assert body["tokens"] == [4, 5, 3, 6, 5, 3, 7]           # the stop's ids are counted, as llama-server
    assert body["tokens_predicted"] == 7 and client.closed_when_answered


def test_a_stop_id_ends_with_eos_and_is_not_rendered():
    client = ScriptedClient([1, 2, EOS], finish="stop")
    body = json.loads(post(make_app(client), "/completion", {"prompt": "a"}).body)
    assert body["content"] == "ab" and body["stop_type"] == "eos" and body["tokens_predicted"] == 3
    assert client.requests[0].stop_ids == (EOS,)
    r = post(make_app(ScriptedClient([1, EOS], finish="stop")), "/v1/completions", {"prompt": "a"})
    assert json.loads(r.body)["choices"][0]["finish_reason"] == "stop"


def test_ignore_eos_sends_no_stop_ids():
    client = ScriptedClient([1, 2])
    post(make_app(client), "/completion", {"prompt": "a", "ignore_eos": True})
    assert client.requests[0].stop_ids == ()
    assert dict(client.requests[0].sampling.logit_bias)[EOS] == float("-inf")


def test_the_limit_and_the_counts():
    client = ScriptedClient([1, 2, 1], n_cached=1)
    body = json.loads(post(make_app(client), "/completion", {"prompt": "ab", "n_predict": 3}).body)
    assert body["stop_type"] == "limit" and body["tokens_evaluated"] == 2 and body["tokens_cached"] == 4
    t = body["timings"]
    assert t["cache_n"] == 1 and t["prompt_n"] == 1 and t["predicted_n"] == 3


def test_the_front_bounds_n_predict_even_if_the_engine_goes_on():
    client = ScriptedClient([1, 2, 1, 2, 1])
    body = json.loads(post(make_app(client), "/completion", {"prompt": "a", "n_predict": 2}).body)
    assert body["content"] == "ab" and body["stop_type"] == "limit" and client.closed_when_answered


def test_streamed_chunks_hold_back_a_possible_stop_and_split_utf8():
    client = ScriptedClient([1, 9, 10, 11, 2, 1, 3])            # "a你ba "
    r = post(make_app(client), "/completion", {"prompt": "a", "stop": ["ab"], "stream": True})
    assert isinstance(r, StreamResponse)
    ev = events(read_stream(r, client=client)[0])
    texts = [e["content"] for e in ev[:-1]]
    assert texts == ["a你", "b", "a "]                       # "a" held (could start "ab"), 你 sent whole
    assert [e["tokens"] for e in ev[:-1]] == [[1, 9, 10, 11], [2], [1, 3]]
    assert ev[-1]["stop"] is True and ev[-1]["content"] == "" and ev[-1]["tokens_predicted"] == 7
    assert sum(len(e["tokens"]) for e in ev[:-1]) == 7


def test_a_client_that_leaves_cancels_the_generation_and_logs_cancel():
    lines = []
    client = ScriptedClient([1, 2, 1, 2, 1, 2, 1, 2])
    r = post(make_app(client, lines.append), "/v1/completions", {"prompt": "a", "stream": True})
    _, closed = read_stream(r, n_chunks=2, client=client)
    assert closed
    assert len(lines) == 1 and "stop cancel" in lines[0]


def test_the_log_line_has_the_serving_guides_format():
    lines = []
    post(make_app(ScriptedClient([1, 2, EOS], finish="stop"), lines.append), "/completion", {"prompt": "ab"})
    assert len(lines) == 1
    pat = (r"request \d+ /completion: prompt 2 ids \(0 reused\) in [\d.]+ s, [\d.]+ ids/s; "
           r"generated 3 ids in [\d.]+ s, [\d.]+ ids/s; stop eos; ctx 4/16")
    assert re.fullmatch(pat, lines[0]), lines[0]


def test_a_prompt_the_slot_cannot_hold_is_refused_before_the_engine():
    client = ScriptedClient([1])
    r = post(make_app(client), "/completion", {"prompt": "ab" * 8})
    body = json.loads(r.body)
    assert r.status == 400 and body["error"]["type"] == "exceed_context_size_error"
    assert body["error"]["n_prompt_tokens"] == 16 and body["error"]["n_ctx"] == 16
    assert body["error"]["message"] == ("request (16 tokens) exceeds the available context size (16 tokens), "
                                        "try increasing it")
    assert client.requests == []


def test_an_engine_error_is_a_500_naming_it():
    class Failing(ScriptedClient):
        async def generate(self, req):
            yield TokenOut(req.req_id, None, "error", error="card on fire")
    r = post(make_app(Failing([])), "/completion", {"prompt": "a"})
    assert r.status == 500 and "card on fire" in json.loads(r.body)["error"]["message"]


def test_an_empty_prompt_answers_empty_without_the_engine():
    client = ScriptedClient([1])
    body = json.loads(post(make_app(client), "/completion", {"prompt": ""}).body)
    assert body["content"] == "" and body["tokens_predicted"] == 0 and client.requests == []


@pytest.mark.parametrize("method,path", [("GET", "/nope"), ("POST", "/v1/does-not-exist"),
                                         ("GET", "/v1/chat/completions")])
def test_unknown_routes_are_404_naming_method_and_path(method, path):
    r = asyncio.run(make_app(ScriptedClient([])).dispatch(Request(method, path, {}, {}, b"")))
    assert isinstance(r, Response) and r.status == 404
    assert json.loads(r.body) == {"error": {"code": 404, "message": f"File Not Found: {method} {path}",
                                            "type": "not_found_error"}}


def test_reasoning_effort_reaches_the_template_and_bad_words_are_refused():
    from bloomery.chat_template import ChatTemplate

    tmpl = ChatTemplate("{{ enable_thinking is defined and enable_thinking }}|{{ reasoning_effort | default('-') }}")
    app = App(MiniTok(), tmpl, ScriptedClient([]), INFO, log=lambda line: None)
    msgs = [{"role": "user", "content": "hi"}]
    assert json.loads(post(app, "/apply-template", {"messages": msgs, "reasoning_effort": "none"}).body)["prompt"] == "False|-"
    assert json.loads(post(app, "/apply-template", {"messages": msgs, "reasoning_effort": "high"}).body)["prompt"].endswith("|high")
    kw = {"messages": msgs, "reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}}
    assert json.loads(post(app, "/apply-template", kw).body)["prompt"].startswith("True|")
    r = post(app, "/apply-template", {"messages": msgs, "reasoning_effort": "huge"})
    assert r.status == 400 and b"reasoning_effort" in r.body
