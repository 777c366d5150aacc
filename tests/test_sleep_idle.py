"""--sleep-idle-seconds on one real bloomery-serve: idle, the engine process frees its weights (its memory
falls); GET routes answer without waking it; a POST wakes it and answers as before."""
from __future__ import annotations

import re
import time

import pytest
import requests

from serve_proc import Served

pytestmark = [pytest.mark.real_model, pytest.mark.slow]
BODY = {"prompt": "def fibonacci(n):", "n_predict": 6}


@pytest.fixture(scope="module")
def server(real_model_path):
    with Served("-m", str(real_model_path), "-c", "512", "--temp", "0", "--sleep-idle-seconds", "1",
                "--metrics") as s:
        yield s


def sleeping(server) -> bool:
    return requests.get(server.url + "/props", timeout=30).json()["is_sleeping"]


def wait_asleep(server, timeout_s=30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not sleeping(server):
        assert time.monotonic() < deadline, "the server did not go to sleep"
        time.sleep(0.2)


def engine_rss_kib(server) -> int:
    pid = next(int(m.group(1)) for line in server.lines
               if (m := re.search(r"stage started stage=engine pid=(\d+)", line)))
    status = open(f"/proc/{pid}/status").read()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1))


def test_sleep_frees_the_weights_and_a_request_wakes(server):
    awake = requests.post(server.url + "/completion", json=BODY, timeout=300).json()["content"]
    rss_awake = engine_rss_kib(server)
    wait_asleep(server)
    assert any("asleep: weights and KV freed" in line for line in server.lines)
    rss_asleep = engine_rss_kib(server)
    assert rss_asleep < rss_awake - 200 * 1024, (rss_awake, rss_asleep)     # the 0.5B file's weights are gone
    for path in ("/health", "/props", "/v1/models", "/metrics", "/slots"):
        assert requests.get(server.url + path, timeout=30).status_code == 200
    assert sleeping(server)                                                   # GET routes do not wake it
    again = requests.post(server.url + "/completion", json=BODY, timeout=300).json()
    assert again["content"] == awake and again["timings"]["cache_n"] == 0    # loaded again; the cache went too
    assert not sleeping(server)
    assert any("awake: weights loaded again" in line for line in server.lines)


def test_token_routes_wake_it(server):
    wait_asleep(server)
    r = requests.post(server.url + "/tokenize", json={"content": "Hello"}, timeout=300)
    assert r.status_code == 200 and r.json()["tokens"] and not sleeping(server)
