"""Pre-tokenization: the word split llama.cpp applies before byte-level BPE.

llama.cpp (unicode.cpp) applies a list of regexes in turn; each one splits every
piece left by the previous one into its matches and the gaps between them. A
regex that names a Unicode category (\\p{L}, \\p{N}, ...) runs on a "collapsed"
copy of the text where each non-ASCII code point stands for its class (one
placeholder per category, 0x0B for any whitespace), so the classes are exactly
llama.cpp's tables (Unicode 15.1: unicode_table.py); a regex without categories
runs on the code points with non-ASCII whitespace replaced by 0x0B. We do the same with Python's `re` in ASCII
mode (its \\s is then C's isspace, as std::regex's). The hand-written fast paths
llama.cpp has for gpt2/llama3/qwen2 give the same splits as their regexes on the
collapsed text (every undefined code point still carries a category flag there).
"""
from __future__ import annotations

import re
from bisect import bisect_right
from dataclasses import dataclass, field
from itertools import accumulate

from .errors import TokenizerError
from .unicode_table import RUNS

# the class of every code point, as runs: starts[i] .. starts[i+1]-1 have classes[i]
_RUN_PAIRS = [(int(r[:-1], 16), r[-1]) for r in "".join(RUNS).split()]
_RUN_STARTS = [p[0] for p in _RUN_PAIRS]
_RUN_CLASSES = [p[1] for p in _RUN_PAIRS]

# category placeholders in the collapsed text, and the ASCII members of each class
_CAT_CHAR = {"N": "\xd1", "L": "\xd2", "P": "\xd3", "M": "\xd4", "S": "\xd5", "W": "\x0b", "O": "\xd0"}
_CAT_ASCII = {"N": "0-9", "L": "A-Za-z", "P": r"!-#%-*,-/:;?@\[\\\]_{}", "M": "",
              "S": r"$+<=>\^`|~"}
_PROP_ALIAS = {"N": "N", "L": "L", "P": "P", "M": "M", "S": "S",
               "Lu": "L", "Ll": "L", "Lt": "L", "Lm": "L", "Lo": "L"}


def category_of(ch: str) -> str:
    """llama.cpp's class of one code point: 'W' whitespace, N L P M S, or 'O' other."""
    return _RUN_CLASSES[bisect_right(_RUN_STARTS, ord(ch)) - 1]


class _CollapseTable(dict):
    """str.translate table: code point -> its collapsed class (filled lazily)."""

    def __missing__(self, cp: int) -> int:
        v = cp if cp < 128 else ord(_CAT_CHAR[category_of(chr(cp))])
        self[cp] = v
        return v


class _WsTable(dict):
    def __missing__(self, cp: int) -> int:
        v = 0x0B if cp >= 128 and category_of(chr(cp)) == "W" else cp
        self[cp] = v
        return v


_COLLAPSE = _CollapseTable()
_WS_ONLY = _WsTable()


def _translate_regex(expr: str) -> tuple[str, bool]:
    """llama.cpp pattern -> Python pattern on the collapsed text; says if categories are used."""
    uses_cat = r"\p{" in expr
    out, inside, i = [], False, 0
    while i < len(expr):
        c = expr[i]
        if c == "\\" and i + 1 < len(expr):
            if expr[i + 1] == "p" and expr[i + 2:i + 3] == "{":
                end = expr.index("}", i)
                cls = _PROP_ALIAS[expr[i + 3:end]]
                body = _CAT_CHAR[cls] + _CAT_ASCII[cls]
                out.append(body if inside else "[" + body + "]")
                i = end + 1
                continue
            out.append(expr[i:i + 2])
            i += 2
            continue
        if c == "[" and not inside:
            inside = True
        elif c == "]" and inside:
            inside = False
        elif c == "$" and not inside:
            c = r"\Z"   # ECMAScript '$' is the end of input only
        out.append(c)
        i += 1
    return "".join(out), uses_cat


_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_TAIL = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}" + _TAIL
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}" + _TAIL
_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
           r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_STARCODER = [r"\p{N}", r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"]
_DEEPSEEK3 = [r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+",
              r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
              r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"]
_DEFAULT = [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"]


@dataclass(frozen=True)
class PreType:
    name: str
    regexes: tuple[str, ...]
    clean_spaces: bool = True       # llama.cpp's detokenize clean-up passes
    ignore_merges: bool = False     # a word already in the vocab is one token
    add_bos: bool = False
    no_bos: bool = False
    compiled: tuple = field(default=(), compare=False, repr=False)


def _pt(name, regexes, **kw) -> PreType:
    return PreType(name, tuple(regexes), **kw)


_GROUPS = [
    (("default",), _pt("default", _DEFAULT)),
    (("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
      "jina-v5-nano"), _pt("llama3", [_LLAMA3], ignore_merges=True, add_bos=True)),
    (("dbrx", "smaug-bpe"), _pt("dbrx", [_LLAMA3])),
    (("minicpm5",), _pt("minicpm5", [r"\p{N}{1,3}", _CONTRACTIONS +
                                     r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+" + _TAIL], ignore_merges=True)),
    (("deepseek-coder",), _pt("deepseek-coder", [r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+",
                                                 r"[一-龥ࠀ-一가-퟿]+", r"\p{N}"], clean_spaces=False)),
    (("deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"),
     _pt("deepseek-v3", _DEEPSEEK3, clean_spaces=False)),
    (("falcon",), _pt("falcon", [r"[\p{P}\$\+<=>\^~\|`]+",
                                 r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
                                 r"[0-9][0-9][0-9]"])),
    (("starcoder", "refact", "codeshell", "exaone", "minerva-7b", "mellum2"),
     _pt("starcoder", _STARCODER)),
    (("command-r",), _pt("command-r", _STARCODER, clean_spaces=False)),
    (("smollm",), _pt("smollm", _STARCODER, clean_spaces=False)),
    (("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0",
      "mellum", "modern-bert", "mpt", "olmo", "jais", "exaone4"), _pt("gpt-2", [_GPT2])),
    (("trillion", "granite-docling"), _pt("trillion", [_GPT2], clean_spaces=False)),
    (("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "hunyuan", "solar-open"),
     _pt("qwen2", [_QWEN2], clean_spaces=False)),
    (("stablelm2", "megrez"), _pt("stablelm2", [_QWEN2])),
    (("qwen35",), _pt("qwen35", [_QWEN35], clean_spaces=False)),
    (("chatglm-bpe",), _pt("chatglm-bpe", [_LLAMA3], no_bos=True)),
    (("glm4", "glm5"), _pt("glm4", [_LLAMA3], no_bos=True, ignore_merges=True)),
    (("poro-chat",), _pt("poro-chat", [r" ?[^(\s|.,!?…。，、।۔،)]+"], clean_spaces=False)),
    (("bloom", "gpt3-finnish"), _pt("bloom", [r" ?[^(\s|.,!?…。，、।۔،)]+"])),
    (("viking",), _pt("viking", [r" ?[^(\s|.,!?…。，、।۔،)]+", r"\p{N}"], clean_spaces=False)),
    (("seed-coder",), _pt("seed-coder", [_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}"
                                         r"| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+"],
                          clean_spaces=False)),
    (("grok-2",), _pt("grok-2", [_QWEN2], clean_spaces=False)),
    (("ufakzeka",), _pt("ufakzeka", [r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}" + _TAIL], clean_spaces=False)),
    (("bailingmoe", "bailingmoe2", "llada-moe"),
     _pt("bailingmoe", [r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"], clean_spaces=False)),
]

PRE_TYPES: dict[str, PreType] = {}
for _names, _p in _GROUPS:
    _compiled = []
    for _expr in _p.regexes:
        _py, _cat = _translate_regex(_expr)
        _compiled.append((re.compile(_py, re.ASCII), _cat))
    _p = PreType(_p.name, _p.regexes, _p.clean_spaces, _p.ignore_merges, _p.add_bos, _p.no_bos,
                 tuple(_compiled))
    for _n in _names:
        PRE_TYPES[_n] = _p


def pre_type_for(name) -> PreType:
    if name is None or name == "":
        return PRE_TYPES["default"]   # llama.cpp warns "missing pre-tokenizer type"
    if name not in PRE_TYPES:
        raise TokenizerError(f"tokenizer.ggml.pre = {name!r} is not supported; known: "
                             f"{', '.join(sorted(PRE_TYPES))}")
    return PRE_TYPES[name]


def split_words(text: str, pre: PreType) -> list[str]:
    """The words llama.cpp's unicode_regex_split gives for `text` (before byte encoding)."""
    if not text:
        return []
    ascii_only = text.isascii()
    collapsed = text if ascii_only else None
    ws_only = text if ascii_only else None
    if len(pre.compiled) == 1:
        # fast path: one regex that left no gap; the collapsed words have the lengths
        # of the original ones
        rx, uses_cat = pre.compiled[0]
        subject = text if ascii_only else text.translate(_COLLAPSE if uses_cat else _WS_ONLY)
        words = rx.findall(subject)
        if sum(map(len, words)) == len(text):
            if ascii_only:
                return words
            ends = list(accumulate(map(len, words)))
            return [text[a:b] for a, b in zip([0, *ends], ends)]
    spans = [(0, len(text))]
    for rx, uses_cat in pre.compiled:
        if uses_cat:
            if collapsed is None:
                collapsed = text.translate(_COLLAPSE)
            subject = collapsed
        else:
            if ws_only is None:
                ws_only = text.translate(_WS_ONLY)
            subject = ws_only
        out = []
        for a, b in spans:
            pos = a
            for m in rx.finditer(subject, a, b):
                s, e = m.span()
                if s == e:
                    continue
                if s > pos:
                    out.append((pos, s))   # the gap between matches is a word too
                out.append((s, e))
                pos = e
            if pos < b:
                out.append((pos, b))
        spans = out
    return [text[a:b] for a, b in spans]
