"""The request size limits (api/limits.py), the sliced JSON encoder and the large-body parse (bloomery/workpool.py)."""
from __future__ import annotations

import json

import pytest

from bloomery import workpool
from bloomery.api import limits
from bloomery.api.params import Fields, parse_gen_params
from bloomery.http.types import ApiError, Request


def refused(obj) -> str:
    with pytest.raises(ApiError) as e:
        limits.check_body(obj)
    assert e.value.status == 400
    return e.value.message


def test_each_limit_is_refused_by_name_and_the_limit_itself_passes():
    limits.check_body({"prompt": "x" * (limits.MAX_PROMPT_CHARS - len("prompt"))})
    assert "MAX_PROMPT_CHARS" in refused({"prompt": "x" * (limits.MAX_PROMPT_CHARS + 1)})
    # the characters of every string count together, keys included
    half = "x" * (limits.MAX_PROMPT_CHARS // 2)
    assert "MAX_PROMPT_CHARS" in refused({"messages": [{"role": "user", "content": half}] * 3})
    limits.check_body({"messages": [{"role": "user", "content": "hi"}] * limits.MAX_MESSAGES})
    assert "MAX_MESSAGES" in refused({"messages": [{"role": "user", "content": "hi"}] * (limits.MAX_MESSAGES + 1)})
    assert "MAX_MESSAGES" in refused({"input": [{"role": "user", "content": "hi"}] * (limits.MAX_MESSAGES + 1)})
    limits.check_body({"prompt": [1] * limits.MAX_IDS})
    assert "MAX_IDS" in refused({"prompt": [1] * (limits.MAX_IDS + 1)})
    assert "MAX_IDS" in refused({"tokens": [[1] * (limits.MAX_IDS + 1)]})


def test_n_probs_over_the_limit_is_refused_by_name():
    def parse(n):
        return parse_gen_params(Fields({"n_probs": n}), n_predict_default=-1, n_vocab=151936, eog_ids=frozenset())
    assert parse(limits.MAX_N_PROBS).n_probs == limits.MAX_N_PROBS
    with pytest.raises(ApiError) as e:
        parse(151000)
    assert e.value.status == 400 and "MAX_N_PROBS" in e.value.message


def test_an_integer_past_4300_digits_is_a_400():
    req = Request("POST", "/completion", {}, {}, b'{"n_predict": ' + b"9" * 5000 + b"}")
    with pytest.raises(ApiError) as e:
        req.json()
    assert e.value.status == 400 and "digits" in e.value.message


def test_parse_checked_says_ok_bad_or_limit():
    assert limits.parse_checked(b'{"prompt": "hi"}') == ("ok", {"prompt": "hi"})
    assert limits.parse_checked(b'{"prompt": ')[0] == "bad"
    kind, why = limits.parse_checked(json.dumps({"prompt": [0] * (limits.MAX_IDS + 1)}).encode())
    assert kind == "limit" and "MAX_IDS" in why


@pytest.mark.parametrize("obj", [
    {"tokens": [{"id": i, "piece": "é\n\"x"} for i in range(3 * workpool.CHUNK_ITEMS + 5)]},
    [1, [2, [3, [4, [5, [6]]]]]], {"a": {}, "b": [], "c": None, "d": 1.5, "e": "\u2028"}, [], {}, "x", 3,
    {"completion_probabilities": [{"top_logprobs": [{"id": i, "bytes": [1, 2]} for i in range(2500)]}] * 3},
])
def test_json_text_is_json_dumps(obj):
    assert workpool.json_text(obj) == json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def test_shutdown_ends_the_helper_processes_at_once():
    """The server's stop ends the parser process itself (workpool.shutdown), and a later body starts a new one."""
    import time
    assert workpool.parser().submit(limits.parse_checked, b'{"prompt": "x"}').result(timeout=60) == \
        ("ok", {"prompt": "x"})
    procs = list(workpool.parser()._processes.values())
    assert procs and all(p.is_alive() for p in procs)
    t0 = time.monotonic()
    workpool.shutdown()
    assert time.monotonic() - t0 < 5 and not any(p.is_alive() for p in procs)
    assert workpool.parser().submit(int).result(timeout=60) == 0     # a fresh one
    workpool.shutdown()


def test_the_tokenizer_process_starts_with_the_first_long_text(tokenizer_source):
    """No tokenizer process at the server's start; the first text of LONG_TEXT_CHARS starts it, and its ids are
    the local tokenizer's."""
    from bloomery.gguf_file import open_gguf
    from bloomery.tokenizer import Tokenizer
    with open_gguf(tokenizer_source) as gf:
        tok = Tokenizer.from_gguf(gf.metadata)
    before = len(workpool._helpers)
    split = workpool.ProcessTokenizer(tok, str(tokenizer_source))
    assert split.encode("def f(x): return x") == tok.encode("def f(x): return x")
    assert len(workpool._helpers) == before                     # nothing started yet
    text = "def f(x):\n    return x  # é中\n" * (workpool.LONG_TEXT_CHARS // 20)
    assert len(text) >= workpool.LONG_TEXT_CHARS
    assert split.encode(text) == tok.encode(text)
    assert len(workpool._helpers) == before + 1
    workpool.shutdown()


def test_the_parser_process_starts_with_the_first_large_body():
    """No parser process at the server's start (workpool.in_parser starts it, off the event loop); its answer
    is the one parse_checked gives here."""
    import asyncio
    workpool.shutdown()
    assert workpool._parser is None
    body = json.dumps({"prompt": "x" * workpool.PROCESS_BYTES, "n_predict": 1}).encode()
    assert asyncio.run(workpool.in_parser(limits.parse_checked, body)) == limits.parse_checked(body)
    assert workpool._parser is not None
    workpool.shutdown()
