"""Opt-in: the same requests to a freshly built llama-server and to bloomery-serve, live.

BLOOMERY_LIVE_REF=1 python3 -m pytest tests/test_live_reference.py
(builds llama.cpp's CPU reference into the cache on first use: about 10 minutes).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from serve_proc import Served

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools" / "ref"))
pytestmark = [pytest.mark.live_reference, pytest.mark.real_model, pytest.mark.slow]

REQUESTS = json.loads((REPO / "tests/golden/chat/requests.json").read_text())


def test_chat_and_template_equal_live(real_model_path):
    from reference_server import ReferenceServer, http_json

    with ReferenceServer(real_model_path) as ref, Served("-m", str(real_model_path), "-c", "4096") as ours:
        for case in REQUESTS:
            for path, body in (("/v1/chat/completions", case["body"]),
                               ("/apply-template", {"messages": case["body"]["messages"]})):
                s1, want = ref.post(path, body)
                s2, got = http_json(ours.url + path, body)
                assert (s1, s2) == (200, 200), (want, got)
                if path == "/apply-template":
                    assert got["prompt"] == want["prompt"], case["name"]
                else:
                    assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"], case["name"]
                    assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
