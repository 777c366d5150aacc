"""Chat templates: jinja2 sandbox rendering with llama.cpp's variables, and the client-text guard.

Every string a client sent (except an assistant's own content and reasoning) reaches the
template as a `ClientStr`: it compares as its characters but prints wrapped in two Unicode
noncharacters. After rendering, the marks split the prompt into (text, is_client_text)
segments, so client text never parses special tokens while the template's own tokens do
(serving guide 11.2). Message normalisation follows llama-server (common/chat.cpp).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

MARK_OPEN, MARK_CLOSE = "\ufdd0", "\ufdd1"  # noncharacters: reserved for internal use by Unicode
MAX_OUTPUT_CHARS = 64 << 20                  # a rendered prompt larger than this is a runaway loop
MAX_RANGE_ITEMS = 1_000_000                  # range() items per render, all loops together


class TemplateError(Exception):
    """A template or its input is wrong; the message names what (routes answer 400)."""


class ClientStr(str):
    """Client text: equal to its characters, printed inside the guard marks."""
    __slots__ = ()

    def __str__(self) -> str:
        return MARK_OPEN + str.__str__(self) + MARK_CLOSE

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)

    def __add__(self, other):
        return str(self) + (str(other) if isinstance(other, ClientStr) else other)

    def __radd__(self, other):
        return other + str(self)

    def __mod__(self, args):
        return str(self) % args

    def __getitem__(self, key):
        return ClientStr(str.__getitem__(self, key))

    def join(self, items):
        return str(self).join(str(x) for x in items)


def _keep_client(name: str):
    method = getattr(str, name)

    def wrapped(self, *args, **kwargs):
        out = method(self, *args, **kwargs)
        if isinstance(out, list):
            return [ClientStr(x) for x in out]
        if isinstance(out, tuple):
            return tuple(ClientStr(x) for x in out)
        return ClientStr(out)
    wrapped.__name__ = name
    return wrapped


# one-to-one and one-to-many string operations keep the client mark, as llama.cpp's jinja::string
for _name in ("strip", "lstrip", "rstrip", "upper", "lower", "title", "capitalize", "swapcase",
              "replace", "split", "rsplit", "splitlines", "partition", "rpartition",
              "removeprefix", "removesuffix", "center", "ljust", "rjust", "zfill", "casefold",
              "expandtabs"):
    setattr(ClientStr, _name, _keep_client(_name))


def mark_client(value, path: str = "client text"):
    """Deep copy of a JSON value whose strings (keys too) are ClientStr."""
    if isinstance(value, str):
        if MARK_OPEN in value or MARK_CLOSE in value:
            raise TemplateError(f"{path} holds U+FDD0 or U+FDD1, characters this server reserves")
        return ClientStr(value)
    if isinstance(value, dict):
        return {mark_client(k, path): mark_client(v, f"{path}.{k}") for k, v in value.items()}
    if isinstance(value, list):
        return [mark_client(v, f"{path}[{i}]") for i, v in enumerate(value)]
    return value


@dataclass(frozen=True)
class RenderedPrompt:
    text: str                           # the prompt, no marks: what /apply-template answers
    segments: list[tuple[str, bool]]    # (text, is_client_text), in order, joined == text


def split_segments(marked: str) -> list[tuple[str, bool]]:
    """Cut rendered text at the marks; a mark left open or closed twice is a TemplateError."""
    segments: list[tuple[str, bool]] = []
    depth, start = 0, 0
    for i, ch in enumerate(marked):
        if ch != MARK_OPEN and ch != MARK_CLOSE:
            continue
        if i > start:
            _append(segments, marked[start:i], depth > 0)
        start = i + 1
        depth += 1 if ch == MARK_OPEN else -1
        if depth < 0:
            raise TemplateError(_cut_message(marked, i))
    if depth != 0:
        raise TemplateError(_cut_message(marked, marked.rfind(MARK_OPEN)))
    if start < len(marked):
        _append(segments, marked[start:], False)
    return segments


def _append(segments: list[tuple[str, bool]], text: str, is_client: bool) -> None:
    if segments and segments[-1][1] == is_client:
        segments[-1] = (segments[-1][0] + text, is_client)
    else:
        segments.append((text, is_client))


def _cut_message(marked: str, at: int) -> str:
    near = marked[max(0, at - 40): at + 40].replace(MARK_OPEN, "").replace(MARK_CLOSE, "")
    return (f"the chat template cut a client text through its guard mark (near {near!r}); "
            "it sliced or rebuilt a string the client sent")


def encode_segments(tokenizer, segments: list[tuple[str, bool]], add_special: bool) -> list[int]:
    """Token ids of a rendered prompt: special spellings parse only in the template's text.

    Client text without a special spelling is tokenized together with its neighbours, so the ids
    equal llama-server's whole-prompt tokenization; one with a spelling is cut out and
    tokenized as plain characters.
    """
    runs: list[tuple[str, bool]] = []   # (text, parse_special)
    pending = ""
    for text, is_client in segments:
        if is_client and _has_special(tokenizer, text):
            if pending:
                runs.append((pending, True))
            runs.append((text, False))
            pending = ""
        else:
            pending += text
    if pending or not runs:
        runs.append((pending, True))
    ids: list[int] = []
    for text, parse_special in runs:
        ids += tokenizer.encode(text, add_special=False, parse_special=parse_special)
    if add_special:
        if getattr(tokenizer, "add_bos", False) and tokenizer.bos_id is not None and tokenizer.bos_id >= 0:
            ids.insert(0, tokenizer.bos_id)
        if getattr(tokenizer, "add_eos", False) and tokenizer.eos_id is not None and tokenizer.eos_id >= 0:
            ids.append(tokenizer.eos_id)
    return ids


def _has_special(tokenizer, text: str) -> bool:
    special_texts = getattr(tokenizer, "special_texts", None)
    if special_texts is not None:
        return any(s and s in text for s in special_texts)
    # a spelling shows as a difference between the two tokenizations
    return (tokenizer.encode(text, add_special=False, parse_special=True)
            != tokenizer.encode(text, add_special=False, parse_special=False))



# --- tojson as llama.cpp's jinja writes it (Python's json.dumps spacing; floats as C++ streams) ---

def to_json(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    indent_n = indent if isinstance(indent, int) and not isinstance(indent, bool) else None
    seps = list(separators) if isinstance(separators, (list, tuple)) else []
    item_sep = str.__str__(seps[0]) if seps else (", " if indent_n is None else ",")
    key_sep = str.__str__(seps[1]) if len(seps) > 1 else ": "
    out: list[str] = []
    _json_into(out, value, 0, indent_n, item_sep, key_sep, bool(ensure_ascii), bool(sort_keys))
    return "".join(out)


def _json_string(s: str, ensure_ascii: bool) -> str:
    raw = json.dumps(str.__str__(s), ensure_ascii=ensure_ascii)
    if isinstance(s, ClientStr):
        return '"' + MARK_OPEN + raw[1:-1] + MARK_CLOSE + '"'
    return raw


def _json_into(out, v, level, indent, item_sep, key_sep, ensure_ascii, sort_keys) -> None:
    nl = "\n" if indent is not None else ""
    pad_in = " " * (indent * (level + 1)) if indent else ""
    pad_out = " " * (indent * level) if indent else ""
    if v is None or isinstance(v, jinja2.Undefined):
        out.append("null")
    elif isinstance(v, bool):
        out.append("true" if v else "false")
    elif isinstance(v, int):
        out.append(str(v))
    elif isinstance(v, float):
        out.append("%g" % v)   # llama.cpp writes doubles with ostream's default 6 digits
    elif isinstance(v, str):
        out.append(_json_string(v, ensure_ascii))
    elif isinstance(v, (list, tuple)):
        out.append("[")
        for i, item in enumerate(v):
            out.append(nl + pad_in if i == 0 else item_sep + nl + pad_in)
            _json_into(out, item, level + 1, indent, item_sep, key_sep, ensure_ascii, sort_keys)
        out.append((nl + pad_out if v else "") + "]")
    elif isinstance(v, dict):
        pairs = sorted(v.items(), key=lambda kv: str.__str__(str(kv[0]))) if sort_keys else list(v.items())
        out.append("{")
        for i, (k, item) in enumerate(pairs):
            out.append(nl + pad_in if i == 0 else item_sep + nl + pad_in)
            key = k if isinstance(k, str) else str(k)
            out.append(_json_string(key, ensure_ascii) + key_sep)
            _json_into(out, item, level + 1, indent, item_sep, key_sep, ensure_ascii, sort_keys)
        out.append((nl + pad_out if pairs else "") + "}")
    else:
        out.append("null")


# --- llama-server's message and tool normalisation (common_chat_msgs_parse_oaicompat & co) ---

def _bad(msg: str) -> TemplateError:
    return TemplateError(msg)


def parse_messages(messages) -> list[dict]:
    """Client messages -> the dicts llama-server hands its templates (before the caps fixes)."""
    if not isinstance(messages, list):
        raise _bad(f"'messages' must be an array, got {type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(f"{where} must be an object, got {type(m).__name__}")
        role = m.get("role")
        if not isinstance(role, str):
            raise _bad(f"{where}.role must be a string, got {json.dumps(role)}")
        has_content, has_calls = "content" in m, "tool_calls" in m
        if role != "assistant" and not has_content:
            raise _bad(f"{where}: all non-assistant messages must contain 'content'")
        if not has_content and not has_calls:
            raise _bad(f"{where}: an assistant message must contain either 'content' or 'tool_calls'")
        msg: dict = {"role": role, "content": _parse_content(m.get("content"), where)}
        for key, out_key in (("reasoning_content", "reasoning_content"), ("name", "name"),
                             ("tool_call_id", "tool_call_id")):
            val = m.get(key)
            if val is not None and not isinstance(val, str):
                raise _bad(f"{where}.{key} must be a string, got {json.dumps(val)}")
            if val:
                msg[out_key] = val
        if has_calls and m["tool_calls"] is not None:
            calls = [_parse_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(_list(m["tool_calls"], f"{where}.tool_calls"))]
            if calls:
                msg["tool_calls"] = calls
        out.append(msg)
    return out


def _list(v, where: str) -> list:
    if not isinstance(v, list):
        raise _bad(f"{where} must be an array, got {type(v).__name__}")
    return v


def _parse_content(content, where: str):
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise _bad(f"{where}.content must be a string or an array of parts, got {type(content).__name__}")
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or "type" not in part:
            raise _bad(f"{where}.content[{j}]: missing content part type")
        if part["type"] != "text":
            raise _bad(f"{where}.content[{j}]: unsupported content part type {json.dumps(part['type'])} "
                       "(this server takes \"text\" parts only)")
        if not isinstance(part.get("text"), str):
            raise _bad(f"{where}.content[{j}].text must be a string")
        parts.append({"type": "text", "text": part["text"]})
    return parts or ""


def _parse_call(c, where: str) -> dict:
    if not isinstance(c, dict) or c.get("type") != "function":
        raise _bad(f"{where}: unsupported tool call type (expected \"function\")")
    fn = c.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise _bad(f"{where}.function.name is missing or not a string")
    args = fn.get("arguments")
    if "arguments" not in fn:
        raise _bad(f"{where}.function.arguments is missing")
    if not isinstance(args, str):   # llama.cpp keeps arguments as compact JSON text
        args = json.dumps(args, ensure_ascii=False, separators=(",", ":"))
    call = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if c.get("id"):
        call["id"] = str(c["id"])
    return call


def parse_tools(tools) -> list[dict]:
    if tools is None:
        return []
    out = []
    for i, t in enumerate(_list(tools, "tools")):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function":
            raise _bad(f"{where}: unsupported tool type (expected \"function\")")
        fn = t.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _bad(f"{where}.function.name is missing or not a string")
        desc = fn.get("description", "")
        if not isinstance(desc, str):
            raise _bad(f"{where}.function.description must be a string")
        params = fn.get("parameters", {})
        out.append({"type": "function", "function": {"name": fn["name"], "description": desc,
                                                       "parameters": params}})
    return out


@dataclass(frozen=True)
class Caps:
    """What a template reads, probed as llama.cpp's jinja::caps_get does."""
    string_content: bool = True
    typed_content: bool = False
    system_role: bool = True
    tool_calls: bool = True
    object_arguments: bool = False
    thinking: bool = False   # the template writes a reasoning span (enable_thinking's default)


def apply_caps(msgs: list[dict], caps: Caps, source: str) -> list[dict]:
    only_string = caps.string_content and not caps.typed_content
    only_typed = caps.typed_content and not caps.string_content
    for m in msgs:
        c = m["content"]
        if only_string and isinstance(c, list):     # parts joined by newlines, as llama-server
            m["content"] = "\n".join(p["text"] for p in c)
        elif only_typed and isinstance(c, str):
            m["content"] = [{"type": "text", "text": c}]
    if "<|channel|>" not in source:   # GPT-OSS keeps its developer role
        for m in msgs:
            if m["role"] == "developer":
                m["role"] = "system"
    if not caps.system_role and msgs and msgs[0]["role"] == "system":
        first = msgs.pop(0)
        if msgs:
            msgs[0]["content"] = _text_of(first["content"]) + "\n" + _text_of(msgs[0]["content"])
    if caps.object_arguments:
        for i, m in enumerate(msgs):
            for j, call in enumerate(m.get("tool_calls", [])):
                fn = call["function"]
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except ValueError as e:
                    raise _bad(f"messages[{i}].tool_calls[{j}].function.arguments is not valid JSON: {e}") from None
    return msgs


def _text_of(content) -> str:
    return content if isinstance(content, str) else "\n".join(p["text"] for p in content)


def mark_messages(msgs: list[dict]) -> list[dict]:
    """Mark every client string; an assistant's content and reasoning keep the model's ids."""
    out = []
    for i, m in enumerate(msgs):
        own = m["role"] == "assistant"
        marked = {}
        for k, v in m.items():
            if own and k in ("content", "reasoning_content"):
                marked[k] = v
            elif k == "tool_calls":
                marked[k] = [{"type": c["type"], "function": mark_client(c["function"], f"messages[{i}].tool_calls"),
                              **({"id": mark_client(c["id"])} if "id" in c else {})} for c in v]
            elif k == "content" and isinstance(v, list):
                marked[k] = [{"type": p["type"], "text": mark_client(p["text"], f"messages[{i}].content")} for p in v]
            else:
                marked[k] = mark_client(v, f"messages[{i}].{k}")
        out.append(marked)
    return out


def mark_tools(tools: list[dict]) -> list[dict]:
    return [{"type": t["type"], "function": mark_client(t["function"], f"tools[{i}].function")}
            for i, t in enumerate(tools)]


# --- the sandbox ---

class _Sandbox(ImmutableSandboxedEnvironment):
    """llama.cpp's jinja settings; `*` and `**` checked so a template cannot build a huge value."""
    intercepted_binops = frozenset(["*", "**"])

    def call_binop(self, context, operator, left, right):
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_OUTPUT_CHARS:
                    raise TemplateError(f"the chat template repeats a value {n} times, past the "
                                        f"{MAX_OUTPUT_CHARS}-character output bound")
        if operator == "**" and isinstance(right, int) and abs(right) > 1024:
            raise TemplateError(f"the chat template raises to the power {right}, past the bound 1024")
        return super().call_binop(context, operator, left, right)


def _raise_exception(message="") -> None:
    raise TemplateError(f"Jinja Exception: {message}")


def _strftime_now(fmt) -> str:
    return time.strftime(str.__str__(str(fmt)) if not isinstance(fmt, ClientStr) else str.__str__(fmt))


def _finalize(value):
    """What `{{ value }}` prints, as llama.cpp: none prints nothing, a list its items run together."""
    if value is None:
        return ""
    if isinstance(value, (list, tuple)):   # not iter(): printing is no array access for the probes
        return "".join(str(_finalize(value[i] if isinstance(value, tuple) else list.__getitem__(value, i)))
                       for i in range(len(value)))
    return value


def _join_filter(value, d="", attribute=None):
    items = [x[attribute] if attribute is not None else x for x in value]
    return str(d).join(str(x) for x in items)   # str() keeps each item's client mark


def make_env() -> _Sandbox:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=False,
                   extensions=["jinja2.ext.loopcontrols"], finalize=_finalize,
                   undefined=jinja2.ChainableUndefined)   # llama.cpp: undefined.x is undefined
    env.filters["tojson"] = to_json
    env.filters["join"] = _join_filter
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, tojson=to_json)
    return env


class _Budget:
    """range() with one item budget per render: nested loops cannot spin for hours."""

    def __init__(self) -> None:
        self.n_left = MAX_RANGE_ITEMS

    def range(self, *args):
        r = range(*args)
        self.n_left -= len(r)
        if self.n_left < 0:
            raise TemplateError(f"the chat template's loops ran past {MAX_RANGE_ITEMS} range items")
        return r


def run_template(template: jinja2.Template, variables: dict) -> str:
    budget = _Budget()
    pieces: list[str] = []
    n_chars = 0
    try:
        for piece in template.generate(**variables, range=budget.range):
            n_chars += len(piece)
            if n_chars > MAX_OUTPUT_CHARS:
                raise TemplateError(f"the chat template wrote more than {MAX_OUTPUT_CHARS} characters")
            pieces.append(piece)
    except TemplateError:
        raise
    except jinja2.TemplateError as e:
        raise TemplateError(f"chat template error: {e.message or type(e).__name__}") from None
    except RecursionError:
        raise TemplateError("chat template error: recursion too deep") from None
    except Exception as e:  # a template can make Python raise anything (1/0, bad types)
        raise TemplateError(f"chat template error: {type(e).__name__}: {e}") from None
    return "".join(pieces)


# --- capability probes (the same questions jinja::caps_get asks) ---

class _TrackStr(str):
    used_as_array = False

    def __iter__(self):
        self.used_as_array = True
        return str.__iter__(self)

    def __getitem__(self, key):
        if isinstance(key, int):
            self.used_as_array = True
        return str.__getitem__(self, key)


class _TrackList(list):
    used = False

    def __iter__(self):
        self.used = True
        return list.__iter__(self)

    def __getitem__(self, key):
        self.used = True
        return list.__getitem__(self, key)


class _TrackDict(dict):
    used = False

    def _touch(self):
        self.used = True

    def __getitem__(self, key):
        self._touch()
        return dict.__getitem__(self, key)

    def get(self, *args):
        self._touch()
        return dict.get(self, *args)

    def items(self):
        self._touch()
        return dict.items(self)

    def values(self):
        self._touch()
        return dict.values(self)


def _probe(template, messages, tools=None, **extra) -> tuple[bool, str]:
    try:
        return True, run_template(template, {"messages": messages, "tools": tools or [],
                                             "bos_token": "", "eos_token": "",
                                             "add_generation_prompt": True, **extra})
    except TemplateError:
        return False, ""


def probe_caps(template: jinja2.Template, source: str) -> Caps:
    marker = "STRING_MARKER"
    content = _TrackStr(marker)
    ok, text = _probe(template, [{"role": "user", "content": content}])
    typed = content.used_as_array
    string = ok and not (typed and marker not in text)
    parts = _TrackList([])
    ok, _ = _probe(template, [{"role": "user", "content": parts}])
    typed = typed or (ok and parts.used)

    ok, text = _probe(template, [{"role": "system", "content": "SYSTEM_MARKER"},
                                 {"role": "user", "content": "User message"}])
    system_role = "SYSTEM_MARKER" in text

    tools = [{"name": "tool", "type": "function", "function": {
        "name": "tool1", "description": "Tool description", "parameters": {
            "type": "object", "properties": {"arg": {"type": "string", "description": "Arg description"}},
            "required": ["arg"]}}}]

    def call_messages(args):
        calls = _TrackList([{"id": "call00001", "type": "function",
                             "function": {"name": "tool1", "arguments": args}}])
        return calls, [
            {"role": "user", "content": "User message"},
            {"role": "assistant", "content": "", "tool_calls": calls},
            {"role": "tool", "content": "Tool response", "tool_call_id": "call00001"},
            {"role": "assistant", "content": "The tool response was 'tool response'"},
            {"role": "user", "content": "User message"}]
    args = _TrackDict({"arg": "value"})
    calls, msgs = call_messages(args)
    ok, _ = _probe(template, msgs, tools)
    object_arguments = ok and calls.used and args.used
    tool_calls = ok and calls.used
    if not object_arguments:
        calls, msgs = call_messages('{"arg": "value"}')
        ok, _ = _probe(template, msgs, tools)
        tool_calls = ok and calls.used
    user = [{"role": "user", "content": "test"}]
    on = _probe(template, user, None, enable_thinking=True)
    off = _probe(template, user, None, enable_thinking=False)
    # llama.cpp's autoparser looks for a reasoning span, not merely a use of the variable
    thinking = any(tag in text for text in (source, on[1], off[1]) for tag in THINK_TAGS)
    return Caps(string_content=string, typed_content=typed, system_role=system_role,
                tool_calls=tool_calls, object_arguments=object_arguments, thinking=thinking)


# reasoning span openers llama.cpp's autoparser finds in templates that always think
THINK_TAGS = ("<think>", "[THINK]", "<|channel|>", "<seed:think>", "<|START_THINKING|>")


# --- the template ---

# llama-server's fallback when a model carries no template (our own spelling of ChatML)
CHATML_TEMPLATE = (
    "{%- for message in messages -%}\n"
    "  {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "  {{- '<|im_start|>assistant\\n' -}}\n"
    "{%- endif -%}")


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
        prefill: str | None = None
        if prefill_assistant and msgs and msgs[-1]["role"] == "assistant":
            if len(msgs) >= 2 and msgs[-2]["role"] == "assistant":
                n = len(msgs)
                raise TemplateError(f"messages[{n - 2}] and messages[{n - 1}]: cannot have 2 or more "
                                    "assistant messages at the end of the list")
            if msgs[-1].get("tool_calls"):
                raise TemplateError(f"messages[{len(msgs) - 1}]: cannot continue an assistant message "
                                    "that contains tool calls")
            last = msgs.pop()   # the model's own text: not marked
            content = last["content"]
            prefill = content if isinstance(content, str) else "\n\n".join(p["text"] for p in content)
            add_generation_prompt = False
            if not prefill and not last.get("reasoning_content"):
                prefill = None   # llama.cpp continues nothing: the bare history
        msgs = mark_messages(apply_caps(msgs, self.caps, self.source))
        variables = self._variables(msgs, parse_tools(tools), enable_thinking, template_kwargs)
        if prefill is None:
            return self._finish(self._run(variables, add_generation_prompt))
        # a continued message: the history, the template's assistant opener, then the text
        bare = self._run(variables, False)
        with_prompt = self._run(variables, True)
        n_same = 0
        while n_same < min(len(bare), len(with_prompt)) and bare[n_same] == with_prompt[n_same]:
            n_same += 1
        return self._finish(bare + with_prompt[n_same:] + prefill)

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

    @staticmethod
    def _finish(marked: str) -> RenderedPrompt:
        segments = split_segments(marked)
        return RenderedPrompt(text="".join(t for t, _ in segments), segments=segments)


def template_args(chat_template_kwargs=None, reasoning_effort=None,
                  default_enable_thinking: bool | None = None) -> dict:
    """A request's chat_template_kwargs and reasoning_effort -> render()'s keyword arguments.

    As llama-server: "none" turns thinking off and drops reasoning_effort, another word is
    passed as reasoning_effort; an enable_thinking in chat_template_kwargs wins over both.
    """
    if chat_template_kwargs is None:
        chat_template_kwargs = {}
    if not isinstance(chat_template_kwargs, dict):
        raise TemplateError(f"chat_template_kwargs must be an object, got {type(chat_template_kwargs).__name__}")
    kwargs = dict(chat_template_kwargs)
    enable_thinking = default_enable_thinking
    if reasoning_effort is not None:
        if not isinstance(reasoning_effort, str):
            raise TemplateError(f"reasoning_effort must be a string, got {json.dumps(reasoning_effort)}")
        if reasoning_effort == "none":
            enable_thinking = False
            kwargs.pop("reasoning_effort", None)
        elif reasoning_effort:
            kwargs["reasoning_effort"] = reasoning_effort
    if "enable_thinking" in kwargs:
        value = kwargs.pop("enable_thinking")
        if isinstance(value, str):
            raise TemplateError("invalid type for \"enable_thinking\" (expected boolean, got string)")
        enable_thinking = value
    return {"enable_thinking": enable_thinking, **kwargs}
