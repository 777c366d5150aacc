"""return_progress on one real bloomery-serve: the prompt runs in passes of -b ids, and a stream reports
each as llama-server's prompt_progress (on /completion, chat, /v1/completions and Responses)."""
from __future__ import annotations

import json

import pytest
import requests

from serve_proc import Served

pytestmark = [pytest.mark.real_model]
PROMPT = "the quick brown fox jumps over the lazy dog " * 4     # 37 ids: 5 passes of 8


@pytest.fixture(scope="module")
def server(real_model_path):
    with Served("-m", str(real_model_path), "-c", "512", "-b", "8", "--temp", "0", "--no-warmup") as s:
        yield s


def events(server, path: str, body: dict) -> list[dict]:
    with requests.post(server.url + path, json={"stream": True, "return_progress": True, **body}, stream=True,
                       timeout=300) as r:
        assert r.status_code == 200, r.text
        return [json.loads(line[6:]) for line in r.iter_lines(decode_unicode=True)
                if line.startswith("data: ") and line != "data: [DONE]"]


def test_completion_reports_each_pass(server):
    n_ids = len(requests.post(server.url + "/tokenize", json={"content": PROMPT}, timeout=30).json()["tokens"])
    got = events(server, "/completion", {"prompt": PROMPT, "n_predict": 2, "timings_per_token": True,
                                         "cache_prompt": False})
    progress = [e for e in got if "prompt_progress" in e]
    processed = [e["prompt_progress"]["processed"] for e in progress]
    assert processed == [*range(0, n_ids, 8), n_ids]                  # before the first pass, then after each
    assert all(e["prompt_progress"]["total"] == n_ids and e["prompt_progress"]["cache"] == 0 for e in progress)
    first = progress[0]["timings"]
    assert (first["prompt_n"], first["prompt_ms"], first["predicted_n"]) == (0, 0.0, 0)
    assert [e["timings"]["prompt_n"] for e in progress] == processed
    ms = [e["timings"]["prompt_ms"] for e in progress]
    assert ms == sorted(ms) and ms[-1] > 0
    assert progress[0] is got[0] and got[-1]["stop"] is True and got[-1]["tokens_predicted"] == 2
    # the same greedy ids as one pass: the passes fill the same cache
    plain = requests.post(server.url + "/completion", json={"prompt": PROMPT, "n_predict": 2, "cache_prompt": False},
                          timeout=300).json()
    assert "".join(e["content"] for e in got) == plain["content"]


def test_chat_reuses_the_cache_and_reports_it(server):
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2}
    events(server, "/v1/chat/completions", body)
    got = events(server, "/v1/chat/completions", body)
    progress = [e["prompt_progress"] for e in got if "prompt_progress" in e]
    assert len(progress) == 2 and progress[0]["cache"] == progress[0]["processed"] > 0
    assert progress[1]["processed"] == progress[1]["total"]
    assert all(e["object"] == "chat.completion.chunk" for e in got)


def test_v1_completions_and_responses_report_progress(server):
    got = events(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "cache_prompt": False})
    assert sum("prompt_progress" in e for e in got) == 6
    got = events(server, "/v1/responses", {"input": PROMPT + "!", "max_output_tokens": 2})
    progress = [e for e in got if "prompt_progress" in e]
    assert progress and all(e["type"] == "response.in_progress" for e in progress)


def test_no_progress_without_a_stream_or_the_field(server):
    got = events(server, "/completion", {"prompt": PROMPT, "n_predict": 1, "return_progress": False})
    assert not any("prompt_progress" in e for e in got)
    r = requests.post(server.url + "/completion", json={"prompt": PROMPT, "n_predict": 1, "return_progress": True},
                      timeout=300)
    assert r.status_code == 200 and "prompt_progress" not in r.json()
