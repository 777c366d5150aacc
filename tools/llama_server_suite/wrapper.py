#!/usr/bin/env python3
"""Stand-in for llama-server that llama.cpp's server tests start (LLAMA_SERVER_BIN_PATH points here).

The tests name tiny models to download (-hf/--hf-repo/--hf-file/-m/--model-url);
this rewrites those arguments to one real local file and leaves every other
argument as the test wrote it, then execs the server under test in place (same
pid, so the tests' terminate() reaches it).

    BLOOMERY_SUITE_TARGET  "bloomery" (python -m bloomery.supervisor) or a llama-server binary path
    BLOOMERY_SUITE_MODEL   the GGUF file every model argument becomes
    BLOOMERY_SUITE_NO_WARMUP  "1": bloomery-serve starts with --no-warmup (set by run.py for the files
                           whose tests never generate: the ~9 s warm-up would be spent for nothing)
"""
from __future__ import annotations

import os
import sys

# model-source flags and whether they take a value (all do); their values are dropped
MODEL_FLAGS = {"-m", "--model", "-hf", "-hfr", "--hf-repo", "-hff", "--hf-file", "-mu", "--model-url"}


def rewrite(args: list[str], model_path: str) -> list[str]:
    """args with every model-source flag (and its value) removed and `-m model_path` added once,
    only when the test named a model at all (the router preset names none)."""
    out: list[str] = []
    named = False
    i = 0
    while i < len(args):
        flag, _, inline = args[i].partition("=")
        if flag in MODEL_FLAGS:
            named = True
            i += 1 if inline else 2
            continue
        out.append(args[i])
        i += 1
    # "-m": llama-server reads it as --model; bloomery-serve reads --model as the seat and -m as the file
    return (["-m", model_path] + out) if named else out


def main() -> None:
    target = os.environ.get("BLOOMERY_SUITE_TARGET", "")
    model = os.environ.get("BLOOMERY_SUITE_MODEL", "")
    if not target or not model:
        sys.exit("llama_server_suite wrapper: set BLOOMERY_SUITE_TARGET and BLOOMERY_SUITE_MODEL")
    args = rewrite(sys.argv[1:], model)
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
