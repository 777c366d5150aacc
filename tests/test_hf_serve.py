"""bloomery-serve --hf-repo end to end: the real supervisor and fetch stage against a local hub."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from conftest import load_tool
from hf_fakehub import Blob, FakeHub
from serve_proc import Served

REPO = Path(__file__).resolve().parents[1]


def serve_cmd(*args: str, env: dict, timeout_s: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bloomery.supervisor", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout_s, env={**os.environ, **env})


def health(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.real_model
@pytest.mark.slow
def test_plan_of_the_real_model_fetched_from_the_hub(real_model_path, tmp_path):
    sha = load_tool("fetch_model").SHA256           # the file was checked against it when it was fetched
    with FakeHub() as hub:
        name = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
        hub.add("localrepo", {name: real_model_path, "qwen2.5-coder-0.5b-instruct-q8_0.gguf": b"x" * 10},
                blobs={name: Blob(real_model_path, sha)})
        env = {"HF_ENDPOINT": hub.url, "BLOOMERY_CACHE": str(tmp_path), "HF_TOKEN": "hf_tok_secret"}
        r = serve_cmd("--hf", "localrepo:Q4_K_M", "-c", "4096", "--plan", env=env)
    snapshot = tmp_path / "hf" / "models--localrepo" / "snapshots"
    served = next(snapshot.iterdir()) / name
    shutil.rmtree(tmp_path / "hf")                              # half a gigabyte: gone before the checks
    assert r.returncode == 0, r.stderr
    assert "[plan] plan: ctx n_ctx_slot=4096 n_ctx=4096 rule=set" in r.stderr
    assert re.search(r"\[fetch\] fetch: hub files repo=localrepo revision=main commit=[0-9a-f]{40} shards=1 "
                     r"bytes=491400064 source=hub", r.stderr), r.stderr
    assert f"path={served}" in r.stderr
    assert "hf_tok_secret" not in r.stderr                      # a token is never printed
    assert [q["auth"] for q in hub.resolves()] == ["Bearer hf_tok_secret"]


def test_the_server_answers_503_fetch_with_progress_records_while_it_downloads(tmp_path):
    with FakeHub() as hub:
        hub.add("org/slow-GGUF", {"slow-Q4_K_M.gguf": b"\0" * (3 << 20)})
        hub.rate_bytes_s = 1 << 20                                  # three seconds of download
        env = {"HF_ENDPOINT": hub.url, "BLOOMERY_CACHE": str(tmp_path)}
        s = Served("--hf", "org/slow-GGUF", env=env).start(wait_ready=False)
        try:
            code, body = health(s.url)
            deadline = time.monotonic() + 30
            while not any("download file=slow-Q4_K_M.gguf" in line for line in s.lines):
                assert time.monotonic() < deadline and s.proc.poll() is None, "\n".join(s.lines)
                time.sleep(0.1)
            code2, body2 = health(s.url)
        finally:
            s.proc.send_signal(signal.SIGTERM)
            rc = s.proc.wait(timeout=30)
    assert code == 503 and body["error"]["message"] == "Loading model" and body["error"]["phase"] == "fetch"
    assert code2 == 503 and body2["error"]["phase"] == "fetch"
    line = next(x for x in s.lines if "download file=slow-Q4_K_M.gguf" in x)
    assert re.search(r"bytes=\d+ total_bytes=3145728 percent=[\d.]+ rate_bytes_s=\d+", line), line
    assert rc == 0, "\n".join(s.lines)


@pytest.mark.parametrize("args,extra_env,match", [
    (["--hf", "org/m-GGUF:Q5_K_S"], {}, "no GGUF of quant Q5_K_S; its quants: Q4_K_M"),
    (["--hf", "org/none"], {}, "the hub has no repo 'org/none'"),
    (["--hf", "org/m-GGUF"], {"HF_HUB_OFFLINE": "1"}, "offline .* the cache holds no org/m-GGUF@main"),
    (["--hf", "org/m-GGUF", "--offline"], {}, "offline .* the cache holds no org/m-GGUF@main"),
])
def test_a_refused_fetch_is_named_and_exits_1(tmp_path, args, extra_env, match):
    with FakeHub() as hub:
        hub.add("org/m-GGUF", {"m-Q4_K_M.gguf": b"m" * 100})
        env = {"HF_ENDPOINT": hub.url, "BLOOMERY_CACHE": str(tmp_path), **extra_env}
        r = serve_cmd(*args, "--port", "0", env=env, timeout_s=60)
    assert r.returncode == 1, r.stderr
    failed = [line for line in r.stderr.splitlines() if "stage failed" in line]
    assert failed and "stage=fetch" in failed[0] and re.search(match, failed[0]), r.stderr


def test_hf_token_flag_reaches_a_gated_repo_and_is_never_printed(tmp_path):
    with FakeHub() as hub:
        hub.add("org/gated", {"g-Q4_K_M.gguf": b"not a gguf" * 10}, token="hf_flag_secret")
        env = {"HF_ENDPOINT": hub.url, "BLOOMERY_CACHE": str(tmp_path), "HF_TOKEN": ""}
        refused = serve_cmd("--hf", "org/gated", "--plan", env=env, timeout_s=60)
        passed = serve_cmd("--hf", "org/gated", "-hft", "hf_flag_secret", "--plan", env=env, timeout_s=60)
    assert refused.returncode == 1 and re.search(r"stage failed stage=fetch .*org/gated is gated", refused.stderr)
    # the fetch passed: the plan stage is the one that refuses these bytes (not a GGUF)
    assert passed.returncode == 1 and re.search(r"stage failed stage=plan .*not a GGUF file", passed.stderr), \
        passed.stderr
    assert "hf_flag_secret" not in passed.stderr
