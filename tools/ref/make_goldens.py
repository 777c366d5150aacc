#!/usr/bin/env python3
"""Regenerate every golden file in tests/golden/ from the llama.cpp reference.

Runs each tools/ref/make_*_goldens.py in turn (tokenizer, templates, logits,
chat); each builds or reuses the reference through tools/ref/build-llama.sh.
Usage: tools/ref/make_goldens.py [NAME ...]   (NAME: tokenizer, template, logit, chat)
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    scripts = sorted(HERE.glob("make_*_goldens.py"))
    wanted = set(sys.argv[1:])
    for script in scripts:
        name = script.stem.removeprefix("make_").removesuffix("_goldens")
        if wanted and name not in wanted:
            continue
        print(f"== {script.name}", flush=True)
        subprocess.run([sys.executable, str(script)], check=True)


if __name__ == "__main__":
    main()
