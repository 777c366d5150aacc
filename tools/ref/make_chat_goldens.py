#!/usr/bin/env python3
"""Regenerate tests/golden/chat/*.json: llama-server's greedy chat answers on the real model.

For each request of tests/golden/chat/requests.json it records llama-server's
/v1/chat/completions answer, and the ids of the same generation through
/apply-template + /completion (return_tokens), with cache_prompt false.
Usage: tools/ref/make_chat_goldens.py
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fetch_model import fetch  # noqa: E402
from reference_server import REPO, ReferenceServer  # noqa: E402

GOLDEN = REPO / "tests/golden/chat"


def main() -> None:
    requests = json.loads((GOLDEN / "requests.json").read_text())
    model = fetch()
    out = {}
    with ReferenceServer(model) as ref:
        for case in requests:
            body = case["body"]
            status, chat = ref.post("/v1/chat/completions", body)
            assert status == 200, chat
            status, tmpl = ref.post("/apply-template", {"messages": body["messages"]})
            assert status == 200, tmpl
            status, comp = ref.post("/completion", {"prompt": tmpl["prompt"], "n_predict": body["max_tokens"],
                                                    "temperature": 0, "cache_prompt": False,
                                                    "return_tokens": True})
            assert status == 200, comp
            out[case["name"]] = {
                "content": chat["choices"][0]["message"]["content"],
                "finish_reason": chat["choices"][0]["finish_reason"],
                "usage": chat["usage"],
                "prompt": tmpl["prompt"],
                "completion_tokens": comp["tokens"],
                "completion_content": comp["content"],
            }
            print(case["name"], repr(out[case["name"]]["content"][:60]))
    (GOLDEN / "expected.json").write_text(json.dumps(out, ensure_ascii=False, indent=1) + "\n")


if __name__ == "__main__":
    main()
