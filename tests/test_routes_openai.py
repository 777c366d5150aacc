"""n choices, logprobs, /metrics, /props, model lookup, Ollama's list/show and the count routes,
on one real bloomery-serve (real model, --metrics), through the openai SDK and plain HTTP."""
from __future__ import annotations

import openai
import pytest
import requests

pytestmark = [pytest.mark.real_model, pytest.mark.slow]
HI = [{"role": "user", "content": "Say hi"}]


@pytest.fixture(scope="module")
def server(real_server):
    return real_server        # the session's one server (conftest.py: -c 1024 --metrics)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def test_chat_n_choices_with_logprobs(client):
    r = client.chat.completions.create(model="x", messages=HI, max_tokens=3, n=2, seed=7,
                                       logprobs=True, top_logprobs=2)
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        lp = c.logprobs.content
        assert lp and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in lp)
        assert "".join(t.token for t in lp) == c.message.content        # no stop id within 3 ids here
        assert lp[0].top_logprobs[0].logprob >= lp[0].top_logprobs[1].logprob
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) for c in r.choices)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream_n_choices(client):
    got = {0: "", 1: ""}
    finish = {}
    for chunk in client.chat.completions.create(model="x", messages=HI, max_tokens=3, n=2, stream=True):
        for c in chunk.choices:
            got[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert set(finish) == {0, 1} and all(got.values())


def test_completions_n_choices_seed_plus_i(server):
    body = {"prompt": "def add(", "max_tokens": 3, "seed": 11, "temperature": 1.0}
    two = requests.post(server.url + "/v1/completions", json={**body, "n": 2}).json()
    one = requests.post(server.url + "/v1/completions", json=body).json()
    assert [c["index"] for c in two["choices"]] == [0, 1]
    assert two["choices"][0]["text"] == one["choices"][0]["text"]      # choice 0 is what n 1 answers
    assert two["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]   # the prompt counted once


@pytest.mark.parametrize("body,field", [
    ({"n": 65}, "n"), ({"n": 0}, "n"), ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
])
def test_chat_bounds_name_the_field(server, body, field):
    r = requests.post(server.url + "/v1/chat/completions", json={"messages": HI, "max_tokens": 1, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == field


def test_metrics_counts_what_ran(server):
    def scrape() -> dict:
        r = requests.get(server.url + "/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
        return {ln.split()[0]: float(ln.split()[1]) for ln in r.text.splitlines() if ln.startswith("llamacpp:")}
    before = scrape()
    out = requests.post(server.url + "/completion", json={"prompt": "Hello", "n_predict": 3,
                                                          "cache_prompt": False}).json()
    after = scrape()
    assert after["llamacpp:tokens_predicted_total"] - before["llamacpp:tokens_predicted_total"] == \
        out["tokens_predicted"]
    assert after["llamacpp:prompt_tokens_total"] - before["llamacpp:prompt_tokens_total"] == out["tokens_evaluated"]
    assert after["llamacpp:predicted_tokens_seconds"] > 0 and after["llamacpp:requests_processing"] == 0


def test_props_and_post_props(server):
    props = requests.get(server.url + "/props").json()
    assert props["endpoint_metrics"] is True and props["endpoint_props"] is False
    r = requests.post(server.url + "/props", json={})
    assert r.status_code == 501 and "--props" in r.json()["error"]["message"]


def test_model_lookup_and_ollama(server, client):
    name = client.models.list().data[0].id
    assert client.models.retrieve(name).id == name
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert name in str(e.value)
    tags = requests.get(server.url + "/api/tags").json()["models"]
    assert tags[0]["name"] == name and tags[0]["details"]["quantization_level"] == "Q4_K_M"
    show = requests.post(server.url + "/api/show", json={"model": name}).json()
    assert show["model_info"]["qwen2.context_length"] == 1024 and "tools" in show["capabilities"]
    assert "im_start" in show["template"]
    assert requests.post(server.url + "/api/show", json={"model": "nope"}).status_code == 404


def test_input_tokens_equal_the_prompt_ids(server):
    body = {"messages": [{"role": "system", "content": "Be brief."}, *HI]}
    ids = requests.post(server.url + "/apply-template", json={**body, "return_prompt_ids": True}).json()["prompt_ids"]
    for path in ("/v1/chat/completions/input_tokens", "/chat/completions/input_tokens"):
        assert requests.post(server.url + path, json=body).json()["input_tokens"] == len(ids)
    resp = requests.post(server.url + "/v1/responses/input_tokens",
                         json={"instructions": "Be brief.", "input": "Say hi"}).json()
    assert resp["input_tokens"] == len(ids)
