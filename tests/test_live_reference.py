"""Opt-in: the same requests to a freshly built llama-server and to bloomery-serve, live.

BLOOMERY_LIVE_REF=1 python3 -m pytest tests/test_live_reference.py -s
(builds llama.cpp's CPU reference into the cache on first use: about 10 minutes).
The same rules as test_acceptance_chat.py, against llama-server's live answers
instead of the committed goldens.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from serve_proc import Served
from test_acceptance_chat import parting_step

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools" / "ref"))
pytestmark = [pytest.mark.live_reference, pytest.mark.real_model, pytest.mark.slow]

REQUESTS = json.loads((REPO / "tests/golden/chat/requests.json").read_text())


def test_template_tokens_and_greedy_ids_live(real_model_path):
    from reference_server import ReferenceServer, http_json

    with ReferenceServer(real_model_path) as ref, Served("-m", str(real_model_path), "-c", "4096") as ours:
        for case in REQUESTS:
            msgs = {"messages": case["body"]["messages"]}
            (s1, want), (s2, got) = ref.post("/apply-template", msgs), http_json(ours.url + "/apply-template", msgs)
            assert (s1, s2) == (200, 200) and got["prompt"] == want["prompt"], case["name"]
            tok = {"content": want["prompt"]}
            assert http_json(ours.url + "/tokenize", tok)[1] == ref.post("/tokenize", tok)[1]
            body = {"prompt": want["prompt"], "n_predict": 72, "temperature": 0, "cache_prompt": False,
                    "return_tokens": True, "n_probs": 2}
            gold = ref.post("/completion", body)[1]["tokens"]
            mine = http_json(ours.url + "/completion", body)[1]
            k = parting_step(mine["tokens"], gold)
            print(f"{case['name']}: {k} of {len(gold)} ids equal to live llama-server's")
            if k < len(gold):
                top = mine["completion_probabilities"][k]["top_logprobs"]
                pytest.fail(f"{case['name']}: parted at step {k}: ours {mine['tokens'][k]}, llama-server's "
                            f"{gold[k]}; our top two {top}")
