"""llama-server's recorded answers on the real model, kept in the repo (tests/golden/llama_server/README.md).

One case NAME is NAME.request.json (method, path, headers, body, body_json), NAME.meta.json (status,
headers) and NAME.response.json (or .response.sse.txt for a stream)."""
from __future__ import annotations

import json
from pathlib import Path

CAPTURES = Path(__file__).resolve().parent / "golden" / "llama_server"


def request(name: str) -> dict:
    return json.loads((CAPTURES / f"{name}.request.json").read_text())


def response(name: str) -> dict:
    return json.loads((CAPTURES / f"{name}.response.json").read_text())


def status(name: str) -> int:
    return json.loads((CAPTURES / f"{name}.meta.json").read_text())["status"]
