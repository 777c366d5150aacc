"""The architectures bloomery serves: the one list that the flags (--model's seat words and
--help), the plan stage and the loader read. Each name is a GGUF general.architecture value
and the module bloomery/engine/models/<name>.py, whose MODEL is its class.

Device-free and import-light: reading ARCHS imports no model code (flags.py reads it)."""
from __future__ import annotations

import importlib

ARCHS = ("qwen2", "qwen3", "qwen3moe", "qwen35", "qwen35moe")


def model_class(arch: str):
    """The CausalLM subclass of one of ARCHS (KeyError-free: callers check membership first)."""
    return importlib.import_module(f"bloomery.engine.models.{arch}").MODEL
