"""--chat-template NAME: llama.cpp's built-in template names, each as a jinja source of ours.

llama.cpp keeps these formats as C++ code (src/llama-chat.cpp, its non-jinja path); here each
is a small jinja template that writes the same text for the same messages, so it goes through
the same renderer, guard and caps as a GGUF's own template. As llama.cpp's built-ins they read
only each message's role and text (text parts joined by a newline) and never tools. A name
llama.cpp knows but this table lacks is refused at start by name, listing the served ones.
"""
from __future__ import annotations

from .template import CHATML_TEMPLATE


# Literal text is written as jinja string expressions ({{- '...' -}}), so whitespace control never eats it.
# m.content is a string here: list content reaches a string-only template as its text (normalize.apply_caps).

def _q(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("\n", "\\n").replace("'", "\\'") + "'"


def _each(body: str, gen: str = "") -> str:
    """A template that writes `body` (a jinja expression over m, the message) per message and `gen` at the end."""
    tail = "{%- if add_generation_prompt -%}{{- " + _q(gen) + " -}}{%- endif -%}" if gen else ""
    return "{%- for m in messages -%}{{- " + body + " -}}{%- endfor -%}" + tail


def _by_role(cases: dict[str, str], other: str | None = None) -> str:
    """A per-message expression chosen by role: cases role -> expression; other for the rest ('' if None)."""
    out = ""
    for role, expr in cases.items():
        out += f"({expr}) if m.role == {_q(role)} else "
    return out + (f"({other})" if other is not None else "''")


def _llama2(system: bool, bos_inside: bool, strip: bool) -> str:
    t = "(m.content | trim)" if strip else "m.content"
    sys_part = f"'<<SYS>>\\n' + {t} + '\\n<</SYS>>\\n\\n'" if system else f"{t} + '\\n'"
    again = _q("<s>[INST] " if bos_inside else "[INST] ")
    return ("{%- set ns = namespace(inside=true) -%}{{- '[INST] ' -}}{%- for m in messages -%}"
            "{%- if not ns.inside -%}{%- set ns.inside = true -%}{{- " + again + " -}}{%- endif -%}"
            "{{- " + _by_role({"system": sys_part, "user": f"{t} + ' [/INST]'"}, f"{t} + '</s>'") + " -}}"
            "{%- if m.role not in ('system', 'user') -%}{%- set ns.inside = false -%}{%- endif -%}"
            "{%- endfor -%}")


def _mistral_v7(sp: str) -> str:
    return _each(_by_role({"system": f"{_q('[SYSTEM_PROMPT]' + sp)} + m.content + '[/SYSTEM_PROMPT]'",
                           "user": f"{_q('[INST]' + sp)} + m.content + '[/INST]'"}, f"{_q(sp)} + m.content + '</s>'"))


_GEMMA = ("{%- set ns = namespace(system='') -%}{%- for m in messages -%}"
          "{%- if m.role == 'system' -%}{%- set ns.system = ns.system + (m.content | trim) -%}{%- else -%}"
          "{%- set role = 'model' if m.role == 'assistant' else m.role -%}"
          "{{- '<start_of_turn>' + role + '\\n' -}}"
          "{%- if ns.system and role != 'model' -%}{{- ns.system + '\\n\\n' -}}{%- set ns.system = '' -%}{%- endif -%}"
          "{{- (m.content | trim) + '<end_of_turn>\\n' -}}"
          "{%- endif -%}{%- endfor -%}{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}")

_TURN = "'<|START_OF_TURN_TOKEN|><|{}_TOKEN|>' + (m.content | trim) + '<|END_OF_TURN_TOKEN|>'"

BUILTIN: dict[str, str] = {
    "chatml": CHATML_TEMPLATE,
    "llama2": _llama2(system=False, bos_inside=False, strip=False),
    "llama2-sys": _llama2(system=True, bos_inside=False, strip=False),
    "llama2-sys-bos": _llama2(system=True, bos_inside=True, strip=False),
    "llama2-sys-strip": _llama2(system=True, bos_inside=False, strip=True),
    "mistral-v7": _mistral_v7(" "),
    "mistral-v7-tekken": _mistral_v7(""),
    "phi3": _each("'<|' + m.role + '|>\\n' + m.content + '<|end|>\\n'", "<|assistant|>\n"),
    "phi4": _each("'<|im_start|>' + m.role + '<|im_sep|>' + m.content + '<|im_end|>'", "<|im_start|>assistant<|im_sep|>"),
    "falcon3": _each("'<|' + m.role + '|>\\n' + m.content + '\\n'", "<|assistant|>\n"),
    "zephyr": _each("'<|' + m.role + '|>\\n' + m.content + '<|endoftext|>\\n'", "<|assistant|>\n"),
    "gemma": _GEMMA,
    "command-r": _each(_by_role({"system": _TURN.format("SYSTEM"), "user": _TURN.format("USER"),
                                 "assistant": _TURN.format("CHATBOT")}), "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"),
    "llama3": _each("'<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + (m.content | trim) + '<|eot_id|>'",
                    "<|start_header_id|>assistant<|end_header_id|>\n\n"),
    "deepseek3": _each(_by_role({"system": "m.content + '\\n\\n'", "user": "'<\uff5cUser\uff5c>' + m.content",
                                 "assistant": "'<\uff5cAssistant\uff5c>' + m.content + "
                                              "'<\uff5cend\u2581of\u2581sentence\uff5c>'"}),
                       "<\uff5cAssistant\uff5c>"),
}

# every name llama.cpp b11434 knows (src/llama-chat.cpp); those not in BUILTIN are refused by name
LLAMA_CPP_NAMES = (
    "chatml", "llama2", "llama2-sys", "llama2-sys-bos", "llama2-sys-strip", "mistral-v1", "mistral-v3",
    "mistral-v3-tekken", "mistral-v7", "mistral-v7-tekken", "phi3", "phi4", "falcon3", "zephyr", "monarch", "gemma",
    "orion", "openchat", "vicuna", "vicuna-orca", "deepseek", "deepseek2", "deepseek3", "deepseek-ocr", "command-r",
    "llama3", "chatglm3", "chatglm4", "glmedge", "minicpm", "exaone3", "exaone4", "exaone-moe", "rwkv-world",
    "granite", "granite-4.0", "granite-4.1", "gigachat", "megrez", "yandex", "bailing", "bailing-think", "bailing2",
    "llama4", "smolvlm", "hunyuan-moe", "gpt-oss", "hunyuan-dense", "hunyuan-vl", "kimi-k2", "seed_oss", "grok-2",
    "pangu-embedded", "solar-open",
)


class UnknownBuiltin(ValueError):
    pass


def template_source(value: str) -> tuple[str, str]:
    """--chat-template's value -> (jinja source, where it came from). A built-in name gives its template; a
    name llama.cpp has that is not served here is refused naming the served ones; anything else is a jinja
    template's own text (llama-server's reading under --jinja)."""
    if value in BUILTIN:
        return BUILTIN[value], f"built-in template {value!r}"
    if value in LLAMA_CPP_NAMES:
        raise UnknownBuiltin(f"--chat-template {value}: llama.cpp's built-in {value!r} is not served here; served "
                             f"names: {', '.join(BUILTIN)} (or give the model's jinja with --chat-template-file)")
    return value, "--chat-template (jinja text)"
