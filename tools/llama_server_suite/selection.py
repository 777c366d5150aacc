"""Which of llama.cpp's server test files a run takes, and why the others are left out.

Rule (see README.md): a file runs when it tests a feature bloomery serves (SERVED);
a file that tests a feature bloomery refuses by name, or that needs a model kind
the Qwen2.5-Coder-0.5B substitute is not (embeddings, rerank, vision), is in
REFUSED_FILES with the reason, and its tests count as refused by name. CI runs the
SERVED tests that pass on llama-server (ci_tests) and are not CI_TOO_SLOW; the golden
baseline's `covers` names the SERVED files measured so far.
"""
from __future__ import annotations

from pathlib import Path

SERVED: tuple[str, ...] = (
    "unit/test_basic.py", "unit/test_security.py", "unit/test_tokenize.py", "unit/test_template.py",
    "unit/test_completion.py", "unit/test_chat_completion.py", "unit/test_stream.py", "unit/test_ignore_eos.py",
    "unit/test_compat_anthropic.py", "unit/test_compat_oai_responses.py", "unit/test_tool_call.py",
    "unit/test_metrics.py", "unit/test_ctx_shift.py", "unit/test_kv_keep_only_active.py",
    # served since 2026-12-02, in the golden since (measured on llama-server b11434's CPU build)
    "unit/test_infill.py", "unit/test_compat_gcp.py", "unit/test_sleep.py", "unit/test_slot_save.py",
    # router mode, served since 2026-12-02 (bloomery/router); its models are the presets in the cache (presets.py)
    "unit/test_router.py",
    # served since 2026-12-02 (--embeddings, --pooling): bert-bge-small's tests, run on the Qwen file
    "unit/test_embedding.py",
)

REFUSED_FILES: dict[str, str] = {
    "unit/test_rerank.py": "reranking (--reranking) is not served: /rerank and its aliases answer 501",
    "unit/test_lora.py": "LoRA adapters (--lora, the request's lora field) are refused by name",
    "unit/test_speculative.py": "speculative decoding (--model-draft, --spec-*) is not in this build",
    "unit/test_mcp_servers.py": "MCP servers (--mcp-servers-*) are not served",
    "unit/test_tools_builtin.py": "built-in server tools (--tools) are not served",
    "unit/test_vision_api.py": "images need a vision model and --mmproj; the substitute has none",
    "unit/test_proxy.py": "the web UI's CORS proxy (--ui-mcp-proxy, /cors-proxy) is not served",
    "unit/test_systemone.py": "/v1/systemone is a decision-model route; not on this seat yet",
}

# Single tests in SERVED files that exercise a feature bloomery refuses by name: node id (or a prefix
# of one, e.g. a parametrized test's name) -> the reason. A gap test not listed here fails CI.
REFUSED_TESTS: dict[str, str] = {
    **{f"unit/test_completion.py::test_logit_bias[{v}]": "logit_bias as an array of pairs or with a token's text "
       "as key is refused by name: the serving guide (11.2) names these forms as refused, OpenAI's object of "
       "ids only"
       for v in ("False-False", "False-True", "True-False")},
    "unit/test_basic.py::test_no_ui": "the web UI is not served (/ answers 404)",
    "unit/test_basic.py::test_load_split_model": "the test downloads a split model; substituted by one file",
    "unit/test_security.py::test_access_static_assets_without_api_key": "the web UI is not served: its "
        "assets (/, /sw.js, /manifest.webmanifest, /_app/version.json) are 404s, with or without a key",
    "unit/test_security.py::test_cors_proxy_only_forwards_explicit_proxy_headers":
        "the web UI's CORS proxy (--ui-mcp-proxy) is not served",
    **{f"unit/test_security.py::test_cors_options[{case}]": "CORS under --cors-origins \"*\" answers `*` and never "
       "allows credentials (llama-server echoes the Origin with credentials; docs/security.md)"
       for case in ("localhost-Access-Control-Allow-Origin-localhost",
                    "web.mydomain.fr-Access-Control-Allow-Origin-web.mydomain.fr",
                    "origin-Access-Control-Allow-Credentials-true")},
    "unit/test_security.py::test_local_media_file": "images (--media-path, a vision model) are not served",
    "unit/test_security.py::test_cors_origins_defaults_to_localhost_with_tools_enabled":
        "built-in server tools (--tools) are not served",
    "unit/test_router.py::test_router_download_model": "downloading models through the router (POST /models, "
        "GET /models/sse) answers 501 not_supported_error; fetch with -hf or use --models-dir",
    "unit/test_router.py::test_router_remote_preset": "an -hf repo of router presets (INI) is not served; and "
        "wrapper.py swaps the test's -hf repo for the real file, so the server it starts is no router",
    "unit/test_compat_oai_responses.py::test_responses_stream_with_llama_telemetry": "a reply cut by "
        "max_output_tokens ends with response.incomplete (OpenAI's status); llama-server says response.completed "
        "(docs/serving.md). The prompt progress and timings the test is about are served",
    **{f"unit/test_compat_anthropic.py::{t}": "images are refused by name with a 400 naming the block (this server "
       "reads text only; a client error is never a 500 here); llama-server answers 500 'image input is not "
       "supported' for a model without --mmproj" for t in (
           "test_anthropic_tool_result_with_image", "test_anthropic_vision_format_accepted")},
}

# Tests that pass on llama-server but run too long for CI's budget (the suite's share is ~15-25 min on
# 2 cores): node id (or a parametrized test's name) -> the time measured. They stay in the golden; run
# them by hand (run.py --server bloomery NODEID) when the code they touch changes. Not refusals: never
# a gap's excuse. Empty since 2026-12-01: with the numpy backend's compiled kernels every one of the 31
# tests once listed here passed on bloomery-serve in 7-42 s (tools/llama_server_suite/README.md).
CI_TOO_SLOW: dict[str, str] = {}

# Open gaps known and tracked in issue 4: they still run, are reported, and the CI test fails
# if one of them starts passing (so this list only shrinks) or any other gap appears.
KNOWN_OPEN_GAPS: dict[str, str] = {}

# Files whose tests never generate (/apply-template, /tokenize and /detokenize only): bloomery-serve runs
# them with --no-warmup, so each of the file's server starts skips the ~9 s numpy warm-up that no request
# would use.
NO_GENERATION: frozenset[str] = frozenset({"unit/test_template.py", "unit/test_tokenize.py"})

GOLDEN = Path(__file__).resolve().parents[2] / "tests/golden/llama_server_suite_baseline.json"


def _listed(nodeid: str, table: dict[str, str]) -> str | None:
    for prefix, why in table.items():
        if nodeid == prefix or nodeid.startswith(prefix + "["):
            return why
    return None


def refused_reason(nodeid: str) -> str | None:
    """Why a test is refused by name (its file or the test), or None."""
    file = nodeid.split("::", 1)[0]
    if file in REFUSED_FILES:
        return REFUSED_FILES[file]
    return _listed(nodeid, REFUSED_TESTS)


def too_slow(nodeid: str) -> str | None:
    return _listed(nodeid, CI_TOO_SLOW)


def ci_tests(golden: dict) -> list[str]:
    """CI's rule: every SERVED test that passes on llama-server (the golden), is not refused by name and
    is not in CI_TOO_SLOW. A test that fails on llama-server itself can never be a gap, so CI does not
    spend time on it."""
    return sorted(n for n, r in golden["tests"].items()
                  if r["outcome"] == "passed" and n.split("::", 1)[0] in SERVED and refused_reason(n) is None
                  and too_slow(n) is None)


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


# Seconds a CI test of each file took on bloomery-serve (the mean over the file's CI tests, one run here with other
# jobs beside it, 2026-12-02): only the order in which chunks are handed to --jobs workers, longest first, so
# that no long file starts last. A file not listed counts as DEFAULT_TEST_S a test.
TEST_S: dict[str, float] = {
    "unit/test_tool_call.py": 50, "unit/test_ctx_shift.py": 54, "unit/test_completion.py": 29,
    "unit/test_basic.py": 18, "unit/test_ignore_eos.py": 17, "unit/test_metrics.py": 16, "unit/test_security.py": 15,
    "unit/test_chat_completion.py": 14, "unit/test_compat_anthropic.py": 11, "unit/test_template.py": 5,
    "unit/test_tokenize.py": 5, "unit/test_router.py": 22,
}
DEFAULT_TEST_S = 20.0
# files whose tests generate long (a test's mean at or above this): run.py --hold-heavy keeps them until told
HEAVY_TEST_S = 25.0


# heavy files whose requests carry the tests' own 60 s HTTP timeout (TIMEOUT_HTTP_REQUEST): run.py --hold-heavy
# starts them only once the machine is theirs, where the others may run beside the other tests, one at a time
NEEDS_GO: frozenset[str] = frozenset({"unit/test_tool_call.py"})


def heavy(chunk: list[str]) -> bool:
    return TEST_S.get(chunk[0].split("::", 1)[0], DEFAULT_TEST_S) >= HEAVY_TEST_S


def needs_go(chunk: list[str]) -> bool:
    return chunk[0].split("::", 1)[0] in NEEDS_GO


def may_start(chunk: list[str], waiting: list[list[str]], running_heavy: int, held: bool) -> bool:
    """run.py --hold-heavy's rule for a waiting chunk. Held (the other tests still run): a long-generating chunk
    starts only once every light chunk is handed out, one at a time, and never one of NEEDS_GO; not held:
    anything."""
    if not held or not heavy(chunk):
        return True
    return running_heavy == 0 and not needs_go(chunk) and all(heavy(w) for w in waiting)
CHUNK_TESTS = 8      # with --jobs above 1 a file's tests are cut into pytest runs of at most this many


def chunks(selections: list[str], split: bool) -> list[list[str]]:
    """by_file's groups, each cut into runs of at most CHUNK_TESTS when split (one pytest run each; runs side by
    side balance better in small pieces), longest expected run first. Unsplit, by_file's order is kept."""
    groups = by_file(selections)
    if not split:
        return groups
    cut = [g[i:i + CHUNK_TESTS] for g in groups for i in range(0, len(g), CHUNK_TESTS)]
    return sorted(cut, key=lambda g: -len(g) * TEST_S.get(g[0].split("::", 1)[0], DEFAULT_TEST_S))
