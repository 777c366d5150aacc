"""ChatTemplate: one template compiled once, rendered per request as llama-server does."""
from __future__ import annotations

import copy
import os
import time

import jinja2

from .caps import probe_caps
from .errors import TemplateError
from .guard import mark_client, mark_messages, mark_tools
from .normalize import apply_caps, parse_messages, parse_tools
from .sandbox import make_env, run_template
from .segments import RenderedPrompt, rendered_prompt

# llama-server's fallback when a model carries no template (our own spelling of ChatML)
CHATML_TEMPLATE = (
    "{%- for message in messages -%}\n"
    "  {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "  {{- '<|im_start|>assistant\\n' -}}\n"
    "{%- endif -%}")


# stand-ins for a continued message's reasoning and content (Unicode private use: no template writes them)
_REASONING_MARK, _CONTENT_MARK = "\ue000reasoning\ue000", "\ue000content\ue000"


class ChatTemplate:
    """One chat template, compiled once; render() is safe to call from many requests."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "",
                 add_bos: bool = False, add_eos: bool = False, origin: str = "chat template"):
        if not isinstance(source, str) or not source.strip():
            raise TemplateError(f"{origin} is empty")
        self.source, self.origin = source, origin
        self.bos_token, self.eos_token = bos_token or "", eos_token or ""
        self.add_bos, self.add_eos = add_bos, add_eos   # the vocab adds them: strip the template's copy
        try:
            self._template = make_env().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise TemplateError(f"{origin}: syntax error at line {e.lineno}: {e.message}") from None
        except jinja2.TemplateError as e:
            raise TemplateError(f"{origin}: {e.message}") from None
        self.caps = probe_caps(self._template, source)

    def render(self, messages, tools=None, add_generation_prompt: bool = True,
               enable_thinking: bool | None = None, prefill_assistant: bool = True,
               **template_kwargs) -> RenderedPrompt:
        """llama-server's prompt for a chat request; a trailing assistant message is continued."""
        msgs = parse_messages(messages)
        prefill: tuple[str, str] | None = None
        if prefill_assistant and msgs and msgs[-1]["role"] == "assistant":
            prefill = _prefill_text(msgs)   # pops the message: the model's own text, not marked
            add_generation_prompt = False
        history = copy.deepcopy(msgs) if prefill is not None else None
        msgs = mark_messages(apply_caps(msgs, self.caps, self.source))
        variables = self._variables(msgs, parse_tools(tools), enable_thinking, template_kwargs)
        if prefill is None:
            return rendered_prompt(self._run(variables, add_generation_prompt))
        bare = self._run(variables, False)
        return rendered_prompt(bare + self._continuation(variables, history, bare, *prefill))

    def _continuation(self, variables: dict, history: list[dict], bare: str, content: str, reasoning: str) -> str:
        """A continued final message after the history, as llama.cpp builds it (common/chat.cpp, the
        continuation of chat-auto-parser-generator.cpp). Where the template renders an assistant message's
        reasoning (found by rendering one with stand-ins for its reasoning and content after the history): the
        message's text up to its reasoning, the reasoning, and, where there is content, the text between the
        two then the content. Else the template's assistant opener (what add_generation_prompt adds) and the
        content."""
        probe = history + [{"role": "assistant", "content": _CONTENT_MARK, "reasoning_content": _REASONING_MARK}]
        full = self._run({**variables, "messages": mark_messages(apply_caps(probe, self.caps, self.source))}, False)
        tail = full[len(bare):] if full.startswith(bare) else ""
        i, j = tail.find(_REASONING_MARK), tail.find(_CONTENT_MARK)
        if 0 <= i < j:
            return tail[:i] + reasoning + (tail[i + len(_REASONING_MARK):j] + content if content else "")
        with_prompt = self._run(variables, True)
        return with_prompt[len(os.path.commonprefix([bare, with_prompt])):] + content

    def _variables(self, msgs, tool_list, enable_thinking, template_kwargs) -> dict:
        variables: dict = {"messages": msgs, "bos_token": self.bos_token, "eos_token": self.eos_token}
        # unset: llama-server's default, on where the template thinks (--reasoning on)
        variables["enable_thinking"] = self.caps.thinking if enable_thinking is None else enable_thinking
        if tool_list:
            variables["tools"] = mark_tools(tool_list)
        now = time.localtime()
        variables["datetime"] = time.strftime("%b %d %Y", now)
        variables["date_string"] = time.strftime("%d %b %Y", now)
        for key, value in template_kwargs.items():
            variables[key] = value if key == "enable_thinking" else mark_client(value, f"chat_template_kwargs.{key}")
        if isinstance(variables.get("reasoning_effort"), str) and variables["reasoning_effort"]:
            variables["reasoning_strength"] = variables["reasoning_effort"]
        return variables

    def _run(self, variables: dict, add_generation_prompt: bool) -> str:
        if add_generation_prompt:    # llama.cpp leaves it undefined when false
            variables = {**variables, "add_generation_prompt": True}
        marked = run_template(self._template, variables)
        if self.add_bos and self.bos_token and marked.startswith(self.bos_token):
            marked = marked[len(self.bos_token):]
        if self.add_eos and self.eos_token and marked.endswith(self.eos_token):
            marked = marked[: -len(self.eos_token)]
        return marked


def _prefill_text(msgs: list[dict]) -> tuple[str, str] | None:
    """Pop the trailing assistant message and return its content and reasoning to continue (None: nothing)."""
    n = len(msgs)
    if n >= 2 and msgs[-2]["role"] == "assistant":
        raise TemplateError(f"messages[{n - 2}] and messages[{n - 1}]: cannot have 2 or more "
                            "assistant messages at the end of the list")
    if msgs[-1].get("tool_calls"):
        raise TemplateError(f"messages[{n - 1}]: cannot continue an assistant message "
                            "that contains tool calls")
    last = msgs.pop()
    content = last["content"]
    prefill = content if isinstance(content, str) else "\n\n".join(p["text"] for p in content)
    reasoning = last.get("reasoning_content") or ""
    if not prefill and not reasoning:
        return None   # llama.cpp continues nothing: the bare history
    return prefill, reasoning

