"""id_slot on one real bloomery-serve: a request runs in the slot it names (waiting while it is busy), n choices
naming one slot run there one after the other, and a slot that does not exist is a 400 naming it."""
from __future__ import annotations

import pytest
import requests

from serve_proc import Served

pytestmark = [pytest.mark.real_model]
MESSAGES = [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}]


@pytest.fixture(scope="module")
def server(real_model_path):
    with Served("-m", str(real_model_path), "-c", "1024", "-np", "2", "--temp", "0", "--no-warmup") as s:
        yield s


def test_choices_share_the_named_slot(server):
    for _ in range(2):
        r = requests.post(server.url + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4, "n": 2,
                                                                      "id_slot": 1}, timeout=300)
        assert r.status_code == 200, r.text
        got = r.json()["choices"]
        assert len(got) == 2 and all(c["finish_reason"] == "length" for c in got)
    for prompt in ("Hello", "Goodbye"):
        body = requests.post(server.url + "/completion", json={"prompt": prompt, "n_predict": 2, "id_slot": 0},
                             timeout=300).json()
        assert body["id_slot"] == 0


def test_a_slot_that_does_not_exist_is_named(server):
    r = requests.post(server.url + "/completion", json={"prompt": "Hello", "n_predict": 2, "id_slot": 2}, timeout=60)
    assert r.status_code == 400 and "slot 2 does not exist" in r.json()["error"]["message"]
