#!/usr/bin/env python3
"""Stand-in for llama-server that llama.cpp's server tests start (LLAMA_SERVER_BIN_PATH points here).

The tests name tiny models to download (their Hugging Face preset: -hf/--hf-repo,
-hff/--hf-file, -mu/--model-url); this swaps that preset for `--model <one real local
file>` and leaves every other argument as the test wrote it, its own -m/--model included,
then execs the server under test in place (same pid, so the tests' terminate() reaches it).

    BLOOMERY_SUITE_TARGET  "bloomery" (python -m bloomery.supervisor) or a llama-server binary path
    BLOOMERY_SUITE_MODEL   the GGUF file every model argument becomes
    BLOOMERY_SUITE_NO_WARMUP  "1": bloomery-serve starts with --no-warmup (set by run.py for the files
                           whose tests never generate: the ~9 s warm-up would be spent for nothing)
    LLAMA_CACHE            the run's cache (run.py): the router tests' models are put back there first
                           (presets.write_cache), whatever a test before removed
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import presets      # this folder's (the script's own folder is first on sys.path)

# the download preset's flags (each takes a value); they and their values are dropped
PRESET_FLAGS = {"-hf", "-hfr", "--hf-repo", "-hff", "--hf-file", "-mu", "--model-url"}


def rewrite(args: list[str], model_path: str) -> list[str]:
    """args with the download preset's flags (and their values) removed and `--model model_path` added once,
    only when the test named a download at all (the router preset names none, a local model is kept)."""
    out: list[str] = []
    named = False
    i = 0
    while i < len(args):
        flag, _, inline = args[i].partition("=")
        if flag in PRESET_FLAGS:
            named = True
            i += 1 if inline else 2
            continue
        out.append(args[i])
        i += 1
    return (["--model", model_path] + out) if named else out


def main() -> None:
    target = os.environ.get("BLOOMERY_SUITE_TARGET", "")
    model = os.environ.get("BLOOMERY_SUITE_MODEL", "")
    if not target or not model:
        sys.exit("llama_server_suite wrapper: set BLOOMERY_SUITE_TARGET and BLOOMERY_SUITE_MODEL")
    args = rewrite(sys.argv[1:], model)
    if os.environ.get("LLAMA_CACHE"):
        # the router tests' cache as the preload and test_router_download_model leave it upstream: that test
        # removes MODEL_DOWNLOAD_ID first and cannot download it again here (no network, POST /models not
        # served), while test_router_delete_model, next, expects it cached (presets.py)
        presets.write_cache(Path(os.environ["LLAMA_CACHE"]), Path(model))
    if target == "bloomery":
        if os.environ.get("BLOOMERY_SUITE_NO_WARMUP") == "1":
            args.append("--no-warmup")      # run.py: a file whose tests never generate (selection.NO_GENERATION)
        argv = [sys.executable, "-m", "bloomery.supervisor", *args]
    else:
        argv = [target, *args]
    sys.stderr.write("llama_server_suite wrapper: " + " ".join(argv) + "\n")
    sys.stderr.flush()
    os.execv(argv[0], argv)


if __name__ == "__main__":
    main()
