"""llama-server's router presets (--models-preset FILE), read as llama.cpp b11434 reads them (common/preset.cpp).
Pure: text in, options out; no I/O but reading the file.

The file is INI: `[NAME]` starts a model's section, `key = value` sets one option, `;` or `#` starts a comment
(a whole line, or the rest of a line after a value). Keys are llama-server's flag names without the leading
dashes (`ctx-size`, `c`, `hf-repo`, `no-mmap`), or their LLAMA_ARG_* variables; a negated spelling turns a
switch off. Three keys are the preset's own, never a flag: load-on-startup, stop-timeout, dedup-cache-models.
`[*]` holds the options every model gets (a model's own section wins); keys before any section form the
`default` section, dropped when empty; `version` is reserved and skipped. A section named `repo:tag` has its tag
written as llama-server writes a quant (`:q8_0` -> `:Q8_0`).

An unknown key, a switch whose value is no yes/no word, a preset-only key with a bad value, or a line that is
none of the four kinds ends the read with PresetError naming the file, the line or section and the key.
A key for a flag bloomery refuses is kept: the model that carries it is refused by name when it is loaded.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from bloomery.flags import BY_ENV, SPELLINGS, Flag
from bloomery.settings import NEG_ENV

GLOBAL, DEFAULT = "*", "default"
TRUE_WORDS, FALSE_WORDS = ("on", "enabled", "true", "1"), ("off", "disabled", "false", "0")   # is_truthy/falsey
LOAD_ON_STARTUP, STOP_TIMEOUT, DEDUP = "load-on-startup", "stop-timeout", "dedup-cache-models"
PRESET_ONLY = {LOAD_ON_STARTUP: "bool", STOP_TIMEOUT: "int", DEDUP: "bool"}
# the router's own flags: a preset's value is dropped (llama-server's unset_reserved_args; host, port and the
# model's name are the router's to give each child)
RESERVED = {"--host", "--port", "--api-key", "--api-key-file", "--ssl-key-file", "--ssl-cert-file", "--models-dir",
            "--models-max", "--models-preset", "--models-autoload"}
# keys the router does not serve in a preset yet (a model's other names and its tags)
NOT_SERVED = {"--alias": "a model's aliases in a preset are not served by this router (its name is the section)",
              "--tags": "a model's tags in a preset are not served by this router"}

_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")
_TAG = re.compile(r"[-.]([A-Z0-9_]+)$", re.I)


class PresetError(Exception):
    """A preset file the router cannot read; the message names the file and what is wrong."""


@dataclass(frozen=True)
class Option:
    key: str                # as the file spells it (the refusal names it so)
    flag: Flag | None       # None: a preset-only key
    value: str              # a switch's value is "true" or "false", a negated spelling already turned round

    @property
    def ident(self) -> str:
        """What two spellings of one option share: the flag's long name, or the preset-only key."""
        return self.flag.long if self.flag is not None else self.key

    def argv(self) -> list[str]:
        """The option as a child's command-line words (a switch off with no negated spelling: none)."""
        f = self.flag
        if f is None:
            return []
        if f.type == "switch":
            if self.value == "true":
                return [f.long]
            negs = [n for n in f.negs if n.startswith("--")] or list(f.negs)
            return [negs[-1]] if negs else []
        if f.type == "pair":
            return [f.long, *self.value.split()]
        return [f.long, self.value]

    def ini(self) -> str:
        return f"{self.ident.lstrip('-')} = {self.value}"


Options = dict[str, Option]     # ident -> Option


def truthy(value: str) -> bool:
    return value.strip().lower() in TRUE_WORDS


def parse_ini(text: str, path: str) -> list[tuple[str, dict[str, tuple[int, str]]]]:
    """The file's sections in order, each {key: (line number, value)}; llama-server's grammar (a header, a
    key = value line, a comment line or a blank line). A section named twice starts again, as there."""
    sections: list[tuple[str, dict[str, tuple[int, str]]]] = []
    current: dict[str, tuple[int, str]] = {}
    sections.append((DEFAULT, current))
    for n, line in enumerate(text.splitlines(), 1):
        s = line.strip(" \t")
        if not s or s[0] in ";#":
            continue
        if s.startswith("["):
            close = s.find("]")
            name = s[1:close].strip(" \t") if close > 0 else ""
            rest = s[close + 1:].strip(" \t") if close > 0 else "?"
            if not name or (rest and rest[0] not in ";#"):
                raise PresetError(f"--models-preset {path} line {n}: {line.strip()!r} is not a [section] header")
            sections = [(sec, kv) for sec, kv in sections if sec != name]
            current = {}
            sections.append((name, current))
            continue
        key, eq, value = s.partition("=")
        key = key.rstrip(" \t")
        if not eq or not _KEY.fullmatch(key):
            raise PresetError(f"--models-preset {path} line {n}: {line.strip()!r} is neither a [section] nor "
                              "key = value")
        current[key] = (n, _strip_comment(value.strip(" \t")))
    return sections


def _strip_comment(value: str) -> str:
    """A value ends at the first ';' or '#', the blanks before it dropped (llama-server's eol: a comment may
    follow a value with no blank between)."""
    return re.split(r"[;#]", value, maxsplit=1)[0].rstrip(" \t")


def canonical_name(section: str) -> str:
    """`repo:tag` with the tag as llama-server writes a quant (canonical_tag): the last -/. part, upper case."""
    if section in (GLOBAL, DEFAULT) or ":" not in section:
        return section
    head, _, tag = section.rpartition(":")
    m = _TAG.search(tag)
    return f"{head}:{(m.group(1) if m else tag).upper()}"


def lookup(key: str) -> tuple[Flag | None, bool] | None:
    """The option a key names: (flag, its spelling's on/off) or (None, True) for a preset-only key."""
    if key in PRESET_ONLY:
        return None, True
    for spelling in (f"--{key}", f"-{key}"):
        if spelling in SPELLINGS:
            return SPELLINGS[spelling]
    if key in BY_ENV:
        return BY_ENV[key], True
    if key in NEG_ENV:
        return NEG_ENV[key], False
    return None


def read_option(key: str, value: str, where: str) -> Option:
    found = lookup(key)
    if found is None:
        raise PresetError(f"{where}: unknown key {key!r} (keys are llama-server's flag names without the dashes, "
                          f"their LLAMA_ARG_* variables, or {', '.join(PRESET_ONLY)})")
    flag, on = found
    if flag is None:
        kind = PRESET_ONLY[key]
        if kind == "bool" and value.strip().lower() not in TRUE_WORDS + FALSE_WORDS:
            raise PresetError(f"{where}: {key} = {value!r} is no yes/no word ({', '.join(TRUE_WORDS + FALSE_WORDS)})")
        if kind == "int" and not re.fullmatch(r"\d+", value.strip()):
            raise PresetError(f"{where}: {key} = {value!r} is not a whole number of seconds")
        return Option(key, None, value.strip())
    if flag.long in NOT_SERVED:
        raise PresetError(f"{where}: {key}: {NOT_SERVED[flag.long]}")
    if flag.type == "switch":
        word = value.strip().lower()
        if word not in TRUE_WORDS + FALSE_WORDS:
            raise PresetError(f"{where}: {key} is a switch; {value!r} is no yes/no word "
                              f"({', '.join(TRUE_WORDS + FALSE_WORDS)})")
        return Option(key, flag, "true" if (word in TRUE_WORDS) == on else "false")
    if not value:
        raise PresetError(f"{where}: {key} needs a value")
    if flag.type == "pair" and len(value.split()) != 2:
        raise PresetError(f"{where}: {key} takes two values, space-separated (got {value!r})")
    return Option(key, flag, value)


def read_text(text: str, path: str) -> tuple[Options, dict[str, Options]]:
    """(the [*] section's options, {model name: its options}); PresetError naming the file and key."""
    glob: Options = {}
    presets: dict[str, Options] = {}
    for section, kv in parse_ini(text, path):
        name = canonical_name(section)
        opts: Options = {}
        for key, (n, value) in kv.items():
            if key == "version":
                continue
            o = read_option(key, value, f"--models-preset {path} line {n} [{section}]")
            opts[o.ident] = o
        if name == DEFAULT and not opts:
            continue
        if name == GLOBAL:
            glob = opts
        else:
            presets[name] = opts
    return glob, presets


def read_file(path: str) -> tuple[Options, dict[str, Options]]:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise PresetError(f"--models-preset {path}: cannot read it ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise PresetError(f"--models-preset {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    return read_text(text, path)


def refusal(opts: Options) -> str | None:
    """Why a model with these options cannot start here: the first option whose flag bloomery refuses."""
    for o in opts.values():
        if o.flag is not None and o.flag.action == "refuse":
            return f"preset option {o.key!r} ({o.flag.long}) is refused: {o.flag.why}"
    return None


def to_ini(name: str, opts: Options) -> str:
    """The section as llama-server shows it in GET /models (status.preset)."""
    lines = [f"[{name}]", *(o.ini() for o in opts.values() if o.flag is None or o.flag.long not in RESERVED)]
    return "\n".join(lines) + "\n\n"
