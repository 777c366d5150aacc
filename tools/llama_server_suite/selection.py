"""Which of llama.cpp's server test files a run takes, and why the others are left out.

Rule (see README.md): a file runs when it tests a feature bloomery serves (SERVED);
a file that tests a feature bloomery refuses by name, or that needs a model kind
the Qwen2.5-Coder-0.5B substitute is not (embeddings, rerank, vision, FIM), is in
REFUSED_FILES with the reason, and its tests count as refused by name. CI runs the
SERVED tests that pass on llama-server (ci_tests); the golden baseline covers the
SERVED files.
"""
from __future__ import annotations

from pathlib import Path

SERVED: tuple[str, ...] = (
    "unit/test_basic.py", "unit/test_security.py", "unit/test_tokenize.py", "unit/test_template.py",
    "unit/test_completion.py", "unit/test_chat_completion.py", "unit/test_stream.py", "unit/test_ignore_eos.py",
    "unit/test_compat_anthropic.py", "unit/test_compat_oai_responses.py", "unit/test_tool_call.py",
    "unit/test_metrics.py", "unit/test_ctx_shift.py", "unit/test_kv_keep_only_active.py",
)

REFUSED_FILES: dict[str, str] = {
    "unit/test_embedding.py": "embeddings (--embedding, /embedding, /v1/embeddings) are not served on a generative seat",
    "unit/test_rerank.py": "reranking (--reranking, /rerank) is not served",
    "unit/test_infill.py": "/infill (FIM) is not served; the substitute model is not the test's FIM model",
    "unit/test_lora.py": "LoRA adapters (--lora, the request's lora field) are refused by name",
    "unit/test_speculative.py": "speculative decoding (--model-draft, --spec-*) is not in this build",
    "unit/test_router.py": "router mode (several models, --models-dir) is not served",
    "unit/test_mcp_servers.py": "MCP servers (--mcp-servers-*) are not served",
    "unit/test_tools_builtin.py": "built-in server tools (--tools) are not served",
    "unit/test_vision_api.py": "images need a vision model and --mmproj; the substitute has none",
    "unit/test_proxy.py": "the web UI's CORS proxy (--ui-mcp-proxy, /cors-proxy) is not served",
    "unit/test_sleep.py": "--sleep-idle-seconds (model unload when idle) is not served",
    "unit/test_slot_save.py": "slot save/restore (--slot-save-path, /slots?action=) is refused by name",
    "unit/test_compat_gcp.py": "Vertex AI prediction mode (AIP_MODE) is not served",
    "unit/test_systemone.py": "/v1/systemone is a decision-model route; not on this seat yet",
}

# Single tests in SERVED files that exercise a feature bloomery refuses by name: node id (or a prefix
# of one, e.g. a parametrized test's name) -> the reason. A gap test not listed here fails CI.
REFUSED_TESTS: dict[str, str] = {
    "unit/test_basic.py::test_no_ui": "the web UI is not served (/ answers 404)",
    "unit/test_basic.py::test_load_split_model": "the test downloads a split model; substituted by one file",
    "unit/test_security.py::test_access_static_assets_without_api_key": "the web UI is not served",
    "unit/test_security.py::test_cors_proxy_only_forwards_explicit_proxy_headers":
        "the web UI's CORS proxy (--ui-mcp-proxy) is not served",
    "unit/test_security.py::test_local_media_file": "images (--media-path, a vision model) are not served",
    "unit/test_security.py::test_cors_origins_defaults_to_localhost_with_tools_enabled":
        "built-in server tools (--tools) are not served",
    **{f"unit/test_security.py::test_cors_origins_localhost_{kind}": "router mode (no -m, models on demand) is "
       "not served; --cors-origins localhost itself is (tests/test_security.py::test_cors_origins_setting)"
       for kind in ("reflects", "rejects")},
}

GOLDEN = Path(__file__).resolve().parents[2] / "tests/golden/llama_server_suite_baseline.json"


def refused_reason(nodeid: str) -> str | None:
    """Why a test is refused by name (its file or the test), or None."""
    file = nodeid.split("::", 1)[0]
    if file in REFUSED_FILES:
        return REFUSED_FILES[file]
    for prefix, why in REFUSED_TESTS.items():
        if nodeid == prefix or nodeid.startswith(prefix + "["):
            return why
    return None


def ci_tests(golden: dict) -> list[str]:
    """CI's rule: every SERVED test that passes on llama-server (the golden) and is not refused by name.
    A test that fails on llama-server itself can never be a gap, so CI does not spend time on it."""
    return sorted(n for n, r in golden["tests"].items()
                  if r["outcome"] == "passed" and n.split("::", 1)[0] in SERVED and refused_reason(n) is None)


def files(select: str, tests: Path) -> list[str]:
    every = sorted(f"unit/{p.name}" for p in (tests / "unit").glob("test_*.py"))
    unknown = sorted(set(every) - set(SERVED) - set(REFUSED_FILES))
    if unknown:   # a new llama.cpp test file: decide which list it joins
        raise SystemExit(f"llama_server_suite: test files in neither SERVED nor REFUSED_FILES: {unknown}")
    if select == "ci":
        import json
        return ci_tests(json.loads(GOLDEN.read_text()))
    chosen = {"all": every, "served": list(SERVED)}[select]
    missing = [f for f in chosen if f not in every]
    if missing:
        raise SystemExit(f"llama_server_suite: selection names files not in {tests}: {missing}")
    return chosen


def by_file(selections: list[str]) -> list[list[str]]:
    """Node ids grouped by file (one pytest run each), in first-seen order."""
    groups: dict[str, list[str]] = {}
    for sel in selections:
        groups.setdefault(sel.split("::", 1)[0], []).append(sel)
    return list(groups.values())
