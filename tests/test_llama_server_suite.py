"""Acceptance (issue 4): llama.cpp's own server tests against bloomery-serve on the real model.

Runs tools/llama_server_suite/run.py --server bloomery --select ci (the tests that pass on
llama-server with the same file: tests/golden/llama_server_suite_baseline.json) and fails
listing every test that passes there and fails here, unless selection.py refuses it by name
(with the reason). Regenerate the golden with the command stored in it ("regenerate").
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SUITE = REPO / "tools/llama_server_suite"


def _load(name: str):
    sys.path.insert(0, str(SUITE))
    spec = importlib.util.spec_from_file_location(f"llama_server_suite_{name}", SUITE / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_golden_baseline_is_consistent():
    """The golden names only SERVED or REFUSED files and says how to make it again."""
    selection = _load("selection")
    golden = json.loads(selection.GOLDEN.read_text())
    assert golden["server"] == "llama" and golden["regenerate"].startswith("python tools/llama_server_suite/run.py")
    files = {n.split("::", 1)[0] for n in golden["tests"]}
    assert files <= set(selection.SERVED) | set(selection.REFUSED_FILES)
    assert selection.ci_tests(golden), "the golden has no passing test: CI would check nothing"


@pytest.mark.real_model
@pytest.mark.slow
def test_gap_is_only_tests_refused_by_name(real_model_path, tmp_path):
    from conftest import SUITE_BESIDE, suite_command

    selection, gap = _load("selection"), _load("gap")
    if SUITE_BESIDE:      # started beside the other tests as collection ended (conftest.py): its results
        out, log = SUITE_BESIDE["out"], SUITE_BESIDE["log"]
        (SUITE_BESIDE["folder"] / "go").touch()       # the other tests are done: the long generations may start
        code = SUITE_BESIDE["proc"].wait(timeout=3600)
        assert code == 0, f"run.py exited {code}: {(SUITE_BESIDE['folder'] / 'run.txt').read_text()[-3000:]}"
    else:
        out, log = tmp_path / "bloomery.json", tmp_path / "pytest.log"
        subprocess.run(suite_command(real_model_path, out, log), check=True, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=3600)
    ours = json.loads(out.read_text())
    golden = json.loads(selection.GOLDEN.read_text())
    missing = sorted(set(selection.ci_tests(golden)) - set(ours["tests"]))
    assert not missing, f"tests selected but never reported (see {log}): {missing[:20]}"
    open_gap, _refused = gap.gap(golden, ours)
    known = selection.KNOWN_OPEN_GAPS
    new_gap = [(n, why) for n, why in open_gap if n not in known]
    closed = sorted(set(known) & {n for n, r in ours["tests"].items() if r["outcome"] == "passed"})
    report = "\n".join(f"{n}\n    {why}" for n, why in new_gap)
    assert not new_gap, f"{len(new_gap)} tests pass on llama-server and fail on bloomery:\n{report}"
    assert not closed, f"known gaps now pass: take them out of selection.KNOWN_OPEN_GAPS: {closed}"
    for n in sorted(set(known) & {n for n, _ in open_gap}):
        print(f"known open gap: {n}: {known[n]}")


def test_wrapper_swaps_only_the_model_arguments():
    rewrite = _load("wrapper").rewrite
    got = rewrite(["--port", "8080", "--hf-repo", "ggml-org/models", "--hf-file", "x/y.gguf", "--alias", "a",
                   "-hf", "r", "--model-url=http://u", "--api-key", "k", "--no-jinja"], "/m.gguf")
    assert got == ["--model", "/m.gguf", "--port", "8080", "--alias", "a", "--api-key", "k", "--no-jinja"]
    assert rewrite(["--port", "1", "--ctx-size", "8"], "/m.gguf") == ["--port", "1", "--ctx-size", "8"]  # router
    own = ["--model", "/local/x.gguf", "--port", "1", "-m", "/y.gguf"]       # the test's own model flags stay
    assert rewrite(own, "/m.gguf") == own


def test_wrapper_adds_no_warmup_only_when_run_asks(monkeypatch):
    """run.py sets BLOOMERY_SUITE_NO_WARMUP for selection.NO_GENERATION files; the wrapper passes --no-warmup to
    bloomery-serve then, never to llama-server."""
    wrapper, selection = _load("wrapper"), _load("selection")
    assert selection.NO_GENERATION <= set(selection.SERVED)
    seen = []
    monkeypatch.delenv("LLAMA_CACHE", raising=False)
    monkeypatch.setattr(wrapper.os, "execv", lambda path, argv: seen.append(argv))
    for target, flag in (("bloomery", "1"), ("bloomery", "0"), ("/bin/llama-server", "1")):
        monkeypatch.setenv("BLOOMERY_SUITE_TARGET", target)
        monkeypatch.setenv("BLOOMERY_SUITE_MODEL", "/m.gguf")
        monkeypatch.setenv("BLOOMERY_SUITE_NO_WARMUP", flag)
        monkeypatch.setattr(wrapper.sys, "argv", ["wrapper.py", "--port", "1", "-hf", "x"])
        wrapper.main()
    assert [a[-1] == "--no-warmup" for a in seen] == [True, False, False]


def test_wrapper_puts_back_the_router_tests_cache(monkeypatch, tmp_path):
    """test_router_download_model removes MODEL_DOWNLOAD_ID and cannot fetch it again here; the next server start
    finds it cached again (test_router_delete_model expects it), with what else the cache holds left alone."""
    wrapper, presets = _load("wrapper"), _load("presets")
    model, cache = tmp_path / "m.gguf", tmp_path / "cache"
    model.write_bytes(b"GGUF")
    names = presets.write_cache(cache, model)
    assert "ggml-org/test-model-router-download:F16" in names and len(names) == len(presets.ROUTER_PRESETS)
    link = cache / "models--ggml-org--test-model-router-download/snapshots" / presets.COMMIT / \
        "test-model-router-download-F16.gguf"
    blob = Path(os.path.normpath(link.parent / os.readlink(link)))
    link.unlink()
    blob.unlink()
    other = cache / "models--ggml-org--tinygemma3-GGUF/snapshots" / presets.COMMIT / "tinygemma3-Q8_0.gguf"
    before = os.readlink(other)
    monkeypatch.setattr(wrapper.os, "execv", lambda path, argv: None)
    for key, value in (("BLOOMERY_SUITE_TARGET", "/bin/llama-server"), ("BLOOMERY_SUITE_MODEL", str(model)),
                       ("LLAMA_CACHE", str(cache))):
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(wrapper.sys, "argv", ["wrapper.py", "--port", "1"])
    wrapper.main()
    assert link.read_bytes() == b"GGUF" and os.readlink(other) == before


def test_gap_counts_only_tests_that_pass_on_llama_server():
    gap = _load("gap")
    golden = {"tests": {"unit/test_basic.py::a": {"outcome": "passed"}, "unit/test_basic.py::b": {"outcome": "failed"},
                        "unit/test_basic.py::test_no_ui": {"outcome": "passed"},
                        "unit/test_basic.py::c": {"outcome": "passed"}}}
    ours = {"tests": {"unit/test_basic.py::a": {"outcome": "failed", "reason": "assert 1 == 2"},
                      "unit/test_basic.py::b": {"outcome": "failed", "reason": "x"},
                      "unit/test_basic.py::test_no_ui": {"outcome": "failed", "reason": "404"},
                      "unit/test_basic.py::c": {"outcome": "passed", "reason": ""}}}
    open_gap, refused = gap.gap(golden, ours)
    assert open_gap == [("unit/test_basic.py::a", "assert 1 == 2")]
    assert [n for n, _ in refused] == ["unit/test_basic.py::test_no_ui"]


def test_merge_replaces_only_the_files_a_run_measured():
    merged = _load("run").merged
    prior = {"server": "llama", "regenerate": "python tools/llama_server_suite/run.py --select served",
             "file_s": {"unit/a.py": 1.0, "unit/b.py": 2.0},
             "tests": {"unit/a.py::x": {"outcome": "passed"}, "unit/b.py::y": {"outcome": "passed"}}}
    doc = merged(prior, {"server": "llama", "regenerate": "python run.py unit/b.py", "file_s": {"unit/b.py": 3.0},
                         "tests": {"unit/b.py::z": {"outcome": "failed"}}})
    assert doc["tests"] == {"unit/a.py::x": {"outcome": "passed"}, "unit/b.py::z": {"outcome": "failed"}}
    assert doc["file_s"] == {"unit/a.py": 1.0, "unit/b.py": 3.0} and doc["covers"] == ["unit/a.py", "unit/b.py"]
    assert doc["regenerate"] == prior["regenerate"]


def test_ci_leaves_out_refused_and_too_slow_tests_but_never_counts_them_as_passing(monkeypatch):
    selection, gap = _load("selection"), _load("gap")
    slow = "unit/test_completion.py::test_a_long_one"
    monkeypatch.setitem(selection.CI_TOO_SLOW, slow, "90 s here")
    golden = {"tests": {slow: {"outcome": "passed"}, "unit/test_basic.py::test_no_ui": {"outcome": "passed"},
                        "unit/test_basic.py::a": {"outcome": "passed"}}}
    assert selection.ci_tests(golden) == ["unit/test_basic.py::a"]
    # a too-slow test that was run and failed is still a gap (CI_TOO_SLOW is not a refusal)
    open_gap, _ = gap.gap(golden, {"tests": {slow: {"outcome": "failed", "reason": "x"}}})
    assert open_gap == [(slow, "x")]


def test_chunks_cut_files_for_side_by_side_runs_longest_first(monkeypatch):
    selection = _load("selection")
    monkeypatch.setattr(selection, "CHUNK_TESTS", 2)
    monkeypatch.setattr(selection, "TEST_S", {"unit/a.py": 1.0, "unit/b.py": 10.0})
    tests = [f"unit/a.py::t{i}" for i in range(5)] + ["unit/b.py::x", "unit/c.py::y"]
    assert selection.chunks(tests, split=False) == selection.by_file(tests)      # one run per file, in order
    got = selection.chunks(tests, split=True)
    assert sorted(n for g in got for n in g) == sorted(tests) and all(len(g) <= 2 for g in got)
    assert all(len({n.split("::")[0] for n in g}) == 1 for g in got)             # a run holds one file's tests
    # expected seconds: c (DEFAULT_TEST_S, 20), b (10), then a's runs of two (2, 2) and of one (1)
    assert got == [["unit/c.py::y"], ["unit/b.py::x"], ["unit/a.py::t0", "unit/a.py::t1"],
                   ["unit/a.py::t2", "unit/a.py::t3"], ["unit/a.py::t4"]]


def test_heavy_files_are_those_of_long_generations(monkeypatch):
    selection = _load("selection")
    monkeypatch.setattr(selection, "TEST_S", {"unit/a.py": 30.0, "unit/b.py": 5.0})
    assert selection.heavy(["unit/a.py::x"]) and not selection.heavy(["unit/b.py::y"])
    assert selection.heavy(["unit/c.py::z"]) == (selection.DEFAULT_TEST_S >= selection.HEAVY_TEST_S)


def test_held_long_generations_run_one_at_a_time_after_the_light_ones(monkeypatch):
    selection = _load("selection")
    monkeypatch.setattr(selection, "TEST_S", {"unit/long.py": 30.0, "unit/timed.py": 30.0, "unit/light.py": 5.0})
    monkeypatch.setattr(selection, "NEEDS_GO", frozenset({"unit/timed.py"}))
    light, long_, timed = ["unit/light.py::a"], ["unit/long.py::b"], ["unit/timed.py::c"]
    assert selection.may_start(light, [light, long_], 1, held=True)             # light runs never wait
    assert not selection.may_start(long_, [light, long_], 0, held=True)         # a light one still waits
    assert selection.may_start(long_, [long_, timed], 0, held=True)             # the light ones are handed out
    assert not selection.may_start(long_, [long_], 1, held=True)                # one long run at a time
    assert not selection.may_start(timed, [timed], 0, held=True)                # 60 s timeouts: the machine first
    assert all(selection.may_start(c, [long_, timed], 1, held=False) for c in (long_, timed))


@pytest.mark.slow
def test_the_per_test_alarm_is_reported_as_itself_not_as_the_requests_read_timeout(tmp_path, monkeypatch):
    """A request of llama.cpp's tests (timeout 600 s) cut by the runner's alarm names the alarm; a
    TimeoutError would be socket.timeout to urllib3 and read "Read timed out. (read timeout=600)"."""
    import socket
    monkeypatch.setenv("BLOOMERY_SUITE_TEST_TIMEOUT_S", "1")
    run = _load("run")
    (tmp_path / "conftest.py").write_text("import pytest\n" + run.ADDED_CONFTEST)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)                        # accepts, never answers
    port = silent.getsockname()[1]
    (tmp_path / "test_hang.py").write_text(
        "import requests\n\n\ndef test_hang():\n"
        f"    requests.get('http://127.0.0.1:{port}/', timeout=600)\n")
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                              cwd=tmp_path, capture_output=True, text=True, timeout=120)
    finally:
        silent.close()
    assert done.returncode == 1
    assert "the test ran past 1 s" in done.stdout and "Read timed out" not in done.stdout, done.stdout[-2000:]


def test_router_presets_are_listed_by_the_router_under_the_tests_names(tmp_path):
    """presets.py stands in for the tests' preload: a router started on that cache (LLAMA_CACHE) lists each
    preset under the name test_router.py routes to (and MODEL_DOWNLOAD_ID, which it downloads), served from the
    real file."""
    from bloomery.router.catalog import catalog
    model = tmp_path / "real.gguf"
    model.write_bytes(b"GGUF")
    names = _load("presets").write_cache(tmp_path / "cache", model)
    assert names == ["ggml-org/tinygemma3-GGUF:Q8_0", "ggml-org/test-model-stories260K:F32",
                     "ggml-org/test-model-stories260K-infill:F32", "ggml-org/test-model-router-download:F16"]
    found = catalog(None, {"LLAMA_CACHE": str(tmp_path / "cache"), "BLOOMERY_CACHE": str(tmp_path / "none")})
    assert sorted(found) == sorted(names)
    assert all(Path(e.path).resolve() == model.resolve() for e in found.values())

