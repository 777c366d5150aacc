"""POST /infill (fill-in-the-middle) as llama-server builds it, and the 501 routes of what is not served:
the prompt layout from the real Qwen2.5-Coder vocab's FIM tokens (pure), then one real bloomery-serve."""
from __future__ import annotations

import pytest
import requests

from bloomery.api.infill import FimTokens, fim_prompt, fim_tokens, read_extra
from bloomery.gguf_file import open_gguf
from bloomery.http.types import ApiError
from bloomery.tokenizer import Tokenizer
from serve_proc import Served

pytestmark = [pytest.mark.real_model]

PREFIX = "#include <cstdio>\n#include \"llama.h\"\n\nint main() {\n"
TYPED = "    int n_threads = llama_"
SUFFIX = "}\n"
EXTRA = [{"filename": "llama.h", "text": "LLAMA_API int32_t llama_n_threads();\n"}]


@pytest.fixture(scope="module")
def tok(real_model_path):
    with open_gguf(str(real_model_path)) as gf:
        return Tokenizer.from_gguf(gf.metadata)


def test_the_qwen_coder_vocab_has_every_fim_token(tok):
    # the ids llama.cpp's vocab loader prints for this file (FIM PRE/SUF/MID/PAD/REP/SEP)
    assert fim_tokens(tok) == FimTokens(pre=151659, suf=151661, mid=151660, rep=151663, sep=151664)
    assert tok.fim_id("pad") == 151662


def test_repo_level_layout(tok):
    fim = fim_tokens(tok)

    def enc(s):
        return tok.encode(s, add_special=False)
    prefix, suffix, typed = enc(PREFIX), enc(SUFFIX), enc(TYPED)
    got = fim_prompt(tok, fim, prefix, suffix, read_extra(EXTRA), typed, n_ctx=8192, n_predict=-1)
    assert got == [fim.rep, *enc("myproject\n"), fim.sep, *enc("llama.h\n"), *enc(EXTRA[0]["text"]),
                   fim.sep, *enc("filename\n"), fim.pre, *prefix, *typed, fim.suf, *suffix, fim.mid]
    # --spm-infill: suffix first
    spm = fim_prompt(tok, fim, prefix, suffix, [], typed, n_ctx=8192, n_predict=-1, spm=True)
    assert spm[-len(suffix) - len(prefix) - len(typed) - 3:] == [fim.suf, *suffix, fim.pre, *prefix, *typed, fim.mid]


def test_budget_as_llama_server(tok):
    fim = fim_tokens(tok)
    prefix, suffix = list(range(10, 3010)), list(range(20, 1020))
    got = fim_prompt(tok, fim, prefix, suffix, [("a", "x" * 50)], [7, 8], n_ctx=2048, n_predict=-1)
    # the extra chunks get n_ctx - n_batch - 2 * n_predict = 2 ids (their last two: "filename\n" ends them)
    pre_at = got.index(fim.pre)
    assert got[:pre_at] == tok.encode("filename\n", add_special=False)[-2:]
    # the prefix keeps its last 3/4 batch (1536), the suffix its first 1/4 batch less 2 and the typed ids
    assert got[pre_at + 1:pre_at + 1537] == prefix[-1536:] and got[pre_at + 1537:pre_at + 1539] == [7, 8]
    assert got[pre_at + 1540:-1] == suffix[:512 - 4]


class _NoFim:
    def fim_id(self, name):
        return {"pre": 5}.get(name)


def test_a_vocab_without_fim_tokens_is_named():
    with pytest.raises(ApiError) as e:
        fim_tokens(_NoFim())
    assert e.value.status == 501
    assert e.value.message == ("Infill is not supported by this model: suffix token is missing. "
                               "middle token is missing.")


@pytest.fixture(scope="module")
def server(real_model_path):
    with Served("-m", str(real_model_path), "-c", "4096", "--temp", "0", "--no-warmup") as s:
        yield s


def test_infill_feeds_the_fim_prompt(server, tok):
    body = {"input_extra": EXTRA, "input_prefix": PREFIX, "prompt": TYPED, "input_suffix": SUFFIX, "n_predict": 8}
    r = requests.post(server.url + "/infill", json=body, timeout=300)
    assert r.status_code == 200, r.text
    got = r.json()
    enc = tok.encode
    ids = fim_prompt(tok, fim_tokens(tok), enc(PREFIX, add_special=False), enc(SUFFIX, add_special=False),
                     read_extra(EXTRA), enc(TYPED, add_special=False), n_ctx=4096, n_predict=-1)
    assert got["tokens_evaluated"] == len(ids)
    assert got["prompt"].startswith("<|repo_name|>myproject\n<|file_sep|>llama.h\n")
    assert got["prompt"].endswith(TYPED + "<|fim_suffix|>" + SUFFIX + "<|fim_middle|>")
    # the same ids through /completion give the same greedy ids: /infill is exactly that prompt
    plain = requests.post(server.url + "/completion", json={"prompt": ids, "n_predict": 8}, timeout=300).json()
    assert got["content"] == plain["content"] and got["content"].strip()


@pytest.mark.parametrize("body, says", [
    ({"input_extra": [{}]}, '"text" field'),
    ({"input_extra": [{"filename": "ok"}]}, '"text" field'),
    ({"input_extra": [{"filename": 123, "text": "abc"}]}, '"filename" field must be a string'),
    ({"input_extra": {"text": "abc"}}, "must be an array"),
    ({"prompt": 5}, '"prompt" must be a string'),
    ({"input_prefix": None}, "input_prefix"),
])
def test_bad_infill_requests_are_named(server, body, says):
    full = {"input_prefix": PREFIX, "prompt": TYPED, "input_suffix": SUFFIX, **body}
    full = {k: v for k, v in full.items() if v is not None}
    r = requests.post(server.url + "/infill", json=full, timeout=60)
    assert r.status_code == 400 and says in r.json()["error"]["message"]


@pytest.mark.parametrize("path, what", [
    *((p, "embeddings") for p in ("/embedding", "/embeddings", "/v1/embeddings")),
    *((p, "reranking") for p in ("/rerank", "/reranking", "/v1/rerank", "/v1/reranking")),
    ("/slots/0?action=save", "slots action"),
])
def test_routes_not_served_answer_501(server, path, what):
    r = requests.post(server.url + path, json={"input": "hello", "query": "q", "documents": ["d"]}, timeout=60)
    assert r.status_code == 501
    err = r.json()["error"]
    assert err["type"] == "not_supported_error" and err["message"].startswith(f"This server does not support {what}")
