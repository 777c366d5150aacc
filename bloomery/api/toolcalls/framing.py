"""Which call framing a chat template writes, read from its text (the call it renders)."""
from __future__ import annotations


def framing_of(template_source: str) -> str | None:
    """"qwen3_coder" (<function=...><parameter=...> markup), "hermes" (JSON in <tool_call>), or None."""
    src = template_source or ""
    if "<tool_call>" not in src:
        return None
    if "<function=" in src and "<parameter=" in src:
        return "qwen3_coder"
    return "hermes"
