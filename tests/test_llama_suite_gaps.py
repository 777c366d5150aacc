"""The gaps llama.cpp's server suite found (tools/llama_server_suite), each closed and checked here on one
real bloomery-serve: /completion's prompt forms (several prompts, the {"prompt_string"} object, multimodal
data refused by name) and response_fields."""
from __future__ import annotations

import pytest
import requests

from bloomery.api.prompts import read_prompts
from serve_proc import Served

PROMPT = "I believe the meaning of life is"


class _Tok:
    """Stand-in for the tokenizer in the pure parsing checks: one id per character."""
    n_vocab = 1000

    def encode(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        return ([1] if add_special else []) + [ord(c) % 1000 for c in text]


def test_prompt_forms_split_as_llama_server():
    tok = _Tok()
    assert read_prompts(tok, "ab") == [[1, 97, 98]]
    assert read_prompts(tok, [5, 6]) == [[5, 6]]
    assert read_prompts(tok, [5, "a"]) == [[5, 97]]                  # a later string gets no BOS
    assert read_prompts(tok, [[5], "a", {"prompt_string": "b"}]) == [[5], [1, 97], [1, 98]]
    assert read_prompts(tok, ["a"]) == [[1, 97]]
    long = [i % 1000 for i in range(5000)]
    assert read_prompts(tok, long) == [long]


@pytest.mark.parametrize("value, says", [
    ([], "must not be empty"),
    ({"prompt_string": "a", "multimodal_data": ["AA=="]}, "multimodal_data"),
    ({"text": "a"}, "prompt_string"),
    ([5, 1.5], "prompt[1]"),
    ([5, 5000], "outside 0..999"),
    ([5, True], "prompt[1]"),
    (list(range(999)) + [-1], "prompt[999]: token id -1 is outside 0..999"),
])
def test_bad_prompts_are_named(value, says):
    with pytest.raises(Exception) as e:
        read_prompts(_Tok(), value)
    assert e.value.status == 400 and says in e.value.message


@pytest.fixture(scope="module")
def server(real_model_path):
    with Served("-m", str(real_model_path), "-c", "1024", "-np", "2", "--temp", "0") as s:
        yield s


def _post(server, body: dict) -> requests.Response:
    return requests.post(server.url + "/completion", json={"n_predict": 3, **body}, timeout=120)


@pytest.mark.real_model
def test_several_prompts_answer_an_array_in_order(server):
    ids = requests.post(server.url + "/tokenize", json={"content": PROMPT, "add_special": True}).json()["tokens"]
    one = _post(server, {"prompt": ids})
    assert one.status_code == 200 and isinstance(one.json()["content"], str)
    for prompt in ([ids, ids], [ids, PROMPT], [ids, {"prompt_string": PROMPT}]):
        r = _post(server, {"prompt": prompt})
        assert r.status_code == 200, r.text
        body = r.json()
        assert isinstance(body, list) and [b["index"] for b in body] == [0, 1]
        assert body[0]["content"] == body[1]["content"] == one.json()["content"]
    mixed = _post(server, {"prompt": [1, 2, 3, PROMPT, 7, 8, PROMPT]})   # one prompt: ids and strings mixed
    assert mixed.status_code == 200 and isinstance(mixed.json()["content"], str)


@pytest.mark.real_model
def test_multimodal_prompt_is_refused_by_name(server):
    r = _post(server, {"prompt": {"prompt_string": PROMPT + " <__media__>", "multimodal_data": ["iVBORw0KGgo="]}})
    assert r.status_code == 400 and "multimodal_data" in r.json()["error"]["message"]


@pytest.mark.real_model
def test_response_fields_keep_only_the_named_paths(server):
    r = _post(server, {"prompt": PROMPT, "response_fields": ["content", "generation_settings/n_predict", "nope/x"]})
    assert r.status_code == 200
    assert sorted(r.json()) == ["content", "generation_settings/n_predict"]
    assert r.json()["generation_settings/n_predict"] == 3
    assert _post(server, {"prompt": PROMPT, "response_fields": "content"}).status_code == 400


@pytest.mark.real_model
def test_logit_bias_pairs_and_text_keys_are_refused_by_name(server):
    """Serving guide 11.2: only OpenAI's object of ids; llama-server's other forms are refused."""
    for bias in ([[" Paris", False]], {" Paris": -100}, [[15, 1]]):
        r = _post(server, {"prompt": "The capital of France is", "logit_bias": bias})
        assert r.status_code == 400 and "logit_bias" in r.json()["error"]["message"], r.text


@pytest.mark.real_model
def test_generation_settings_show_every_bias_with_bans_as_null(server):
    r = _post(server, {"prompt": PROMPT, "n_predict": 1, "ignore_eos": True, "logit_bias": {"15": 2}})
    assert r.status_code == 200
    bias = r.json()["generation_settings"]["logit_bias"]
    assert {"bias": 2.0, "token": 15} in bias
    bans = [b for b in bias if b["bias"] is None]                  # the stop ids ignore_eos bans: -inf
    assert bans and all(b["token"] != 15 for b in bans)
    plain = _post(server, {"prompt": PROMPT, "n_predict": 1})
    assert plain.json()["generation_settings"]["logit_bias"] == []


@pytest.mark.real_model
def test_chat_verbose_adds_the_completion_answer_with_the_rendered_prompt(server):
    body = {"max_tokens": 1, "messages": [{"role": "system", "content": "Book"}, {"role": "user", "content": "Hi"}]}
    on = requests.post(server.url + "/v1/chat/completions", json={**body, "verbose": True}, timeout=120).json()
    assert "<|im_start|>system\nBook" in on["__verbose"]["prompt"] and on["__verbose"]["tokens_predicted"] == 1
    off = requests.post(server.url + "/v1/chat/completions", json=body, timeout=120).json()
    assert "__verbose" not in off


@pytest.mark.real_model
def test_continue_final_message_continues_and_excludes_the_generation_prompt(server):
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Whill"}]
    url = server.url + "/v1/chat/completions"
    r = requests.post(url, json={"max_tokens": 1, "messages": msgs, "verbose": True, "add_generation_prompt": False,
                                 "continue_final_message": True}, timeout=120)
    assert r.status_code == 200 and r.json()["__verbose"]["prompt"].endswith("<|im_start|>assistant\nWhill")
    both = requests.post(url, json={"max_tokens": 1, "messages": msgs, "continue_final_message": True}, timeout=120)
    assert both.status_code == 400 and "continue_final_message" in both.json()["error"]["message"]


@pytest.mark.real_model
def test_top_level_json_schema_constrains_the_chat_reply(server):
    body = {"max_tokens": 6, "messages": [{"role": "user", "content": "Write an example"}], "json_schema": {"const": "42"}}
    r = requests.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == '"42"'
    both = requests.post(server.url + "/v1/chat/completions", timeout=120,
                         json={**body, "response_format": {"type": "json_object"}})
    assert both.status_code == 400 and "json_schema" in both.json()["error"]["message"]


# --- test_template.py's gaps: --reasoning on/off/auto reaches the template; --reasoning-format / -budget flags ---

QWEN3_LIKE = ("{%- for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}"
              "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
              "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
              "{%- endif %}{%- endif %}")


@pytest.mark.parametrize("word,tail", [("off", "<think>\n\n</think>\n\n"), ("false", "<think>\n\n</think>\n\n"),
                                       ("on", "assistant\n"), ("auto", "assistant\n")])
def test_reasoning_flag_sets_the_templates_enable_thinking(word, tail):
    import asyncio
    import json

    from bloomery.chat_template import ChatTemplate
    from bloomery.engine.types import ModelInfo
    from bloomery.front import make_app
    from bloomery.http.types import Request
    from bloomery.settings import parse

    s = parse(["-m", "/m.gguf", "--reasoning", word], env={})
    info = ModelInfo(name="m", arch="qwen2", n_ctx=64, n_ctx_slot=64, n_slots=1, n_vocab=10, n_ctx_train=64,
                     backend="numpy", model_path="/m.gguf")
    app = make_app(s, _Tok(), ChatTemplate(QWEN3_LIKE), None, info)

    def prompt(body):
        req = Request("POST", "/apply-template", {}, {}, json.dumps(body).encode())
        return json.loads(asyncio.run(app.dispatch(req)).body)["prompt"]
    msgs = [{"role": "user", "content": "What is today?"}]
    assert prompt({"messages": msgs}).endswith("<|im_start|>" + tail if tail == "assistant\n" else tail)
    # a request's own switch wins over the server's default
    on = prompt({"messages": msgs, "chat_template_kwargs": {"enable_thinking": True}})
    assert on.endswith("<|im_start|>assistant\n")


def test_reasoning_flags_parse_and_refuse_by_name():
    from bloomery.settings import SettingsError, parse
    s = parse(["-m", "/m.gguf", "--reasoning-format", "none", "--reasoning-budget", "0",
               "--reasoning-budget-message", "Enough."], env={})
    assert (s.reasoning, s.reasoning_format, s.reasoning_budget, s.reasoning_budget_message) == \
        ("auto", "none", 0, "Enough.")
    assert parse(["-m", "/m.gguf"], env={"LLAMA_ARG_THINK_BUDGET": "5"}).reasoning_budget == 5
    for argv, word in ((["--reasoning", "maybe"], "--reasoning"), (["--reasoning-budget", "-2"], "--reasoning-budget"),
                       (["--reasoning-format", "xml"], "--reasoning-format")):
        with pytest.raises(SettingsError, match=word):
            parse(["-m", "/m.gguf", *argv], env={})
