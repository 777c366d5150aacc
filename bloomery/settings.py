"""bloomery-serve's flags: ONE table, read by parsing, --help, --config and LLAMA_ARG_*.

Each row carries llama-server's spellings (long, short, LLAMA_ARG_* variable), the
--config key (the long name without dashes), the value's type, its default and what
we do with it: "set" (honoured), "noop" (read, one record says it has no effect
here) or "refuse" (the start ends naming it). Precedence (serving guide 7.2):
command line > --config file > LLAMA_ARG_* > default; API keys add up.
"""
from __future__ import annotations

import csv
import json
import math
import os
from dataclasses import dataclass, field

SEATS = ("qwen2", "qwen3", "qwen3moe")   # --model <seat>; the file's arch must match
DEVICES = ("cpu", "cuda", "auto")
# config keys that ask the start to do something rather than set it (7.1)
ACTION_KEYS = {"plan", "levers", "help", "version", "list-devices", "records-schema", "recommend",
               "dry-run", "json", "config", "usage"}


class SettingsError(Exception):
    """A start refused before anything loads; the message names the flag, the value and the rule."""


@dataclass(frozen=True)
class Flag:
    long: str                       # "--ctx-size"
    shorts: tuple[str, ...] = ()    # other spellings: "-c", "--predict", ...
    env: str | None = None          # LLAMA_ARG_* variable read as this flag
    type: str = "str"               # str | int | float | switch | keys | choice | int_or_auto | path
    default: object = None
    help: str = ""
    action: str = "set"             # set | noop | refuse
    dest: str = ""                  # Settings field (set) ; "" -> long name with underscores
    choices: tuple[str, ...] = ()
    negs: tuple[str, ...] = ()      # switch spellings that turn it off (--no-slots)
    why: str = ""                   # why a noop has no effect / why a refuse is refused

    @property
    def key(self) -> str:
        return self.long.lstrip("-")

    @property
    def field(self) -> str:
        return self.dest or self.key.replace("-", "_")


def _noop(long, shorts=(), env=None, type="switch", negs=(), why="bloomery has no such tuning", choices=()):
    return Flag(long, tuple(shorts), env, type, None, f"accepted; no effect here ({why})", "noop",
                choices=tuple(choices), negs=tuple(negs), why=why)


def _refuse(long, shorts=(), env=None, type="str", why="not supported by bloomery yet"):
    return Flag(long, tuple(shorts), env, type, None, f"refused: {why}", "refuse", why=why)


_SAMPLING_WHY = "sets the request default"
TABLE: tuple[Flag, ...] = (
    Flag("--model-file", ("-m",), "LLAMA_ARG_MODEL", "path", None, "GGUF file to serve (first shard of a split set)"),
    Flag("--model", (), None, "choice", None, "the seat (model family engine): " + ", ".join(SEATS),
         dest="seat", choices=SEATS),
    Flag("--ctx-size", ("-c", "--ctx"), "LLAMA_ARG_CTX_SIZE", "int", None,
         "total context over all slots (default: the plan's choice, up to the model's limit)"),
    Flag("--slot-ctx", (), None, "int", None, "one slot's context (total = slots x this)"),
    Flag("--parallel", ("-np",), "LLAMA_ARG_N_PARALLEL", "int_or_auto", 1, "slots: N or auto"),
    Flag("--host", (), "LLAMA_ARG_HOST", "str", "127.0.0.1", "address to listen on"),
    Flag("--port", (), "LLAMA_ARG_PORT", "int", 8080, "port to listen on (0 takes a free port)"),
    Flag("--alias", ("-a",), "LLAMA_ARG_ALIAS", "str", None, "the model's name in answers"),
    Flag("--api-key", (), "LLAMA_API_KEY", "keys", (), "API keys, comma-separated (adds to the other key sources)"),
    Flag("--api-key-file", (), "LLAMA_ARG_API_KEY_FILE", "path", None, "file of API keys, one a line"),
    Flag("--chat-template-file", (), "LLAMA_ARG_CHAT_TEMPLATE_FILE", "path", None,
         "jinja chat template file (default: the GGUF's template)"),
    Flag("--n-predict", ("-n", "--predict"), "LLAMA_ARG_N_PREDICT", "int", -1,
         "default token limit of a request (-1: the context)"),
    Flag("--jinja", (), "LLAMA_ARG_JINJA", "switch", True, "jinja templates (always on)", negs=("--no-jinja",)),
    Flag("--config", (), None, "path", None, "read flags from one JSON object (keys: long names)"),
    Flag("--plan", (), None, "switch", False, "print the plan records and exit before loading weights"),
    Flag("--help", ("-h", "--usage"), None, "switch", False, "print this table and exit"),
    Flag("--version", (), None, "switch", False, "print the version and exit"),
    Flag("--device", (), None, "choice", "auto", "backend: cpu, cuda or auto (cuda where CuPy sees a card)",
         choices=DEVICES),
    Flag("--temp", ("--temperature",), "LLAMA_ARG_TEMPERATURE", "float", None, "default temperature", dest="temperature"),
    Flag("--seed", ("-s",), None, "int", None, "default seed (-1: random)"),
    Flag("--top-k", (), "LLAMA_ARG_TOP_K", "int", None, "default top_k"),
    Flag("--top-p", (), "LLAMA_ARG_TOP_P", "float", None, "default top_p"),
    Flag("--min-p", (), "LLAMA_ARG_MIN_P", "float", None, "default min_p"),
    Flag("--repeat-penalty", (), "LLAMA_ARG_REPEAT_PENALTY", "float", None, "default repeat_penalty"),
    Flag("--repeat-last-n", (), None, "int", None, "default repeat_last_n"),
    Flag("--presence-penalty", (), "LLAMA_ARG_PRESENCE_PENALTY", "float", None, "default presence_penalty"),
    Flag("--frequency-penalty", (), "LLAMA_ARG_FREQUENCY_PENALTY", "float", None, "default frequency_penalty"),
    Flag("-ngl", ("--gpu-layers", "--n-gpu-layers"), "LLAMA_ARG_N_GPU_LAYERS", "str", None,
         "all, auto, a negative count or at least the file's layers + 1 (every layer runs on the device)",
         dest="ngl"),
    _noop("--threads", ("-t",), "LLAMA_ARG_THREADS", "int"),
    _noop("--threads-batch", ("-tb",), None, "int"),
    _noop("--threads-http", (), "LLAMA_ARG_THREADS_HTTP", "int"),
    _noop("--batch-size", ("-b",), "LLAMA_ARG_BATCH", "int"),
    _noop("--ubatch-size", ("-ub",), "LLAMA_ARG_UBATCH", "int"),
    _noop("--flash-attn", ("-fa",), "LLAMA_ARG_FLASH_ATTN", "choice", choices=("on", "off", "auto")),
    _noop("--mlock", why="weights are read through mmap"),
    _noop("--mmap", negs=("--no-mmap",), why="weights are read through mmap"),
    _noop("--webui", ("--ui",), "LLAMA_ARG_UI", negs=("--no-webui", "--no-ui"), why="no web UI is served"),
    _noop("--metrics", (), "LLAMA_ARG_ENDPOINT_METRICS", why="no /metrics in this build"),
    _noop("--slots", (), "LLAMA_ARG_ENDPOINT_SLOTS", negs=("--no-slots",), why="/slots is always served"),
    _noop("--props", (), "LLAMA_ARG_ENDPOINT_PROPS", why="POST /props is not served"),
    _noop("--cont-batching", ("-cb",), "LLAMA_ARG_CONT_BATCHING", negs=("--no-cont-batching", "-nocb"),
          why="slots are always batched"),
    _noop("--verbose", ("-v", "--log-verbose")), _noop("--log-verbosity", ("-lv", "--verbosity"), None, "int"),
    _noop("--log-disable"), _noop("--log-file", (), "LLAMA_ARG_LOG_FILE", "str"),
    _noop("--log-colors", (), "LLAMA_ARG_LOG_COLORS", "str"),
    _noop("--log-prefix", (), "LLAMA_ARG_LOG_PREFIX", negs=("--no-log-prefix",)),
    _noop("--log-timestamps", (), "LLAMA_ARG_LOG_TIMESTAMPS", negs=("--no-log-timestamps",)),
    _noop("--warmup", negs=("--no-warmup",)), _noop("--offline", (), "LLAMA_ARG_OFFLINE", why="-m reads a local file"),
    _noop("--kv-unified", ("-kvu",), "LLAMA_ARG_KV_UNIFIED", negs=("--no-kv-unified", "-no-kvu"),
          why="each slot holds its own KV"),
    _noop("--context-shift", (), "LLAMA_ARG_CONTEXT_SHIFT", negs=("--no-context-shift",),
          why="a full slot ends with length"),
    _noop("--cache-reuse", (), "LLAMA_ARG_CACHE_REUSE", "int"),
    _noop("--cache-prompt", (), "LLAMA_ARG_CACHE_PROMPT", negs=("--no-cache-prompt",),
          why="requests choose cache_prompt"),
    _noop("--reasoning", ("-rea",), "LLAMA_ARG_REASONING", "str", why="the template decides"),
    _noop("--timeout", ("-to",), "LLAMA_ARG_TIMEOUT", "int"), _noop("--sleep-idle-seconds", (), None, "int"),
    _noop("--cors-origins", (), "LLAMA_ARG_CORS_ORIGINS", "str"), _noop("--tags", (), "LLAMA_ARG_TAGS", "str"),
    _noop("--cache-ram", ("-cram",), "LLAMA_ARG_CACHE_RAM", "int", why="no host prompt cache in this build"),
    _noop("--no-mmproj", why="no image encoder is loaded"),
    _noop("--fit", ("-fit",), "LLAMA_ARG_FIT", "choice", choices=("on",), why="the plan always fits"),
    _noop("--split-mode", ("-sm",), "LLAMA_ARG_SPLIT_MODE", "choice", choices=("layer", "none"),
          why="one device runs every layer"),
    _refuse("--hf-repo", ("-hf", "-hfr", "--hf"), "LLAMA_ARG_HF_REPO", why="downloads are not served yet; use -m"),
    _refuse("--hf-file", ("-hff",), "LLAMA_ARG_HF_FILE", why="downloads are not served yet; use -m"),
    _refuse("-dev", (), "LLAMA_ARG_DEVICE", why="card lists are not served yet; use --device cpu|cuda|auto"),
    _refuse("--tensor-split", ("-ts",), "LLAMA_ARG_TENSOR_SPLIT", why="one device only"),
    _refuse("--main-gpu", ("-mg",), "LLAMA_ARG_MAIN_GPU", why="one device only"),
    _refuse("--lora", ("--lora-scaled",), why="no LoRA adapters"),
    _refuse("--mmproj", ("-mm",), "LLAMA_ARG_MMPROJ", why="no image encoder"),
    _refuse("--embeddings", ("--embedding",), "LLAMA_ARG_EMBEDDINGS", "switch", why="no embedding model"),
    _refuse("--reranking", ("--rerank",), "LLAMA_ARG_RERANKING", "switch", why="no reranking"),
    _refuse("--grammar", ("--grammar-file",), why="no grammar sampler"),
    _refuse("--json-schema", ("-j", "--json-schema-file", "-jf"), why="no default schema"),
    _refuse("--chat-template", (), "LLAMA_ARG_CHAT_TEMPLATE", why="built-in template names are not served; "
            "use --chat-template-file"),
    _refuse("--model-draft", ("-md", "--spec-draft-model"), "LLAMA_ARG_SPEC_DRAFT_MODEL", why="no draft model"),
    _refuse("--cache-type-k", ("-ctk",), "LLAMA_ARG_CACHE_TYPE_K", why="the KV cache is float32"),
    _refuse("--cache-type-v", ("-ctv",), "LLAMA_ARG_CACHE_TYPE_V", why="the KV cache is float32"),
    _refuse("--slot-save-path", (), "LLAMA_ARG_SLOT_SAVE_PATH", why="no slot files"),
    _refuse("--rope-scaling", ("--rope-scale", "--rope-freq-base", "--rope-freq-scale"), why="RoPE comes from the file"),
    _refuse("--cpu-moe", ("-cmoe", "--n-cpu-moe", "-ncmoe", "--override-tensor", "-ot"), "LLAMA_ARG_CPU_MOE",
            why="no routed experts on this seat"),
    _refuse("--list-devices", (), why="no device census in this build"),
    _refuse("--ignore-eos", (), "switch", why="request field only"),
)

SPELLINGS: dict[str, tuple[Flag, bool]] = {}   # spelling -> (flag, value for a switch spelling)
for _f in TABLE:
    for _s in (_f.long, *_f.shorts):
        SPELLINGS[_s] = (_f, True)
    for _s in _f.negs:
        SPELLINGS[_s] = (_f, False)
BY_KEY = {f.key: f for f in TABLE}
BY_ENV = {f.env: f for f in TABLE if f.env}

_TRUE = {"on", "enabled", "true", "1"}
_FALSE = {"off", "disabled", "false", "0"}
_I32_MAX = 2**31 - 1


@dataclass
class Settings:
    model_file: str | None = None
    seat: str | None = None
    ctx_size: int | None = None        # None: the plan chooses (0 on the command line means the same)
    slot_ctx: int | None = None
    parallel: int | str = 1            # int >= 1 or "auto"
    host: str = "127.0.0.1"
    port: int = 8080
    alias: str | None = None
    api_keys: tuple[str, ...] = ()     # every source added; never printed
    api_key_file: str | None = None
    chat_template_file: str | None = None
    n_predict: int = -1
    jinja: bool = True
    config: str | None = None
    plan: bool = False
    help: bool = False
    version: bool = False
    device: str = "auto"
    ngl: str | None = None
    sampling_defaults: dict[str, float | int] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)             # field -> where its value came from
    notes: list[tuple[str, dict]] = field(default_factory=list)       # records to print: (message, k=v)

    def redacted(self) -> dict:
        """The settings as plain data, API keys replaced by their count."""
        d = {k: v for k, v in self.__dict__.items() if k not in ("api_keys", "notes", "sources")}
        d["n_api_keys"] = len(self.api_keys)
        return d


@dataclass
class _Entry:
    flag: Flag
    raw: object          # str from argv/env; str|int|float|True from --config
    switch_on: bool      # for switches: which spelling was given
    source: str          # "command line", "config FILE", "LLAMA_ARG_X"
    name: str            # how the user spelled it: "-c", "config key ctx-size", "LLAMA_ARG_CTX_SIZE"


def _from_argv(argv: list[str]) -> list[_Entry]:
    out: list[_Entry] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        spelling, eq, inline = tok.partition("=") if tok.startswith("--") else (tok, "", "")
        if spelling not in SPELLINGS:
            raise SettingsError(f"unknown flag {tok!r}" + ("" if tok.startswith("-") else
                                " (a value with no flag before it)") + "; bloomery-serve --help lists the flags")
        flag, on = SPELLINGS[spelling]
        if flag.type == "switch":
            if eq:
                raise SettingsError(f"{spelling} is a switch and takes no value (got {inline!r})")
            raw: object = on
        elif eq:
            raw = inline
        else:
            if i + 1 >= len(argv):
                raise SettingsError(f"{spelling} needs a value ({flag.type})")
            i += 1
            raw = argv[i]
        out.append(_Entry(flag, raw, on, "command line", spelling))
        i += 1
    return out


def _config_pairs(pairs):
    seen = set()
    for k, _ in pairs:
        if k in seen:
            raise SettingsError(f"--config: key {k!r} is named twice")
        seen.add(k)
    return dict(pairs)


def _from_config(path: str) -> list[_Entry]:
    try:
        text = open(path, encoding="utf-8").read()
    except OSError as e:
        raise SettingsError(f"--config {path}: cannot read it ({e.strerror})") from None
    try:
        obj = json.loads(text, object_pairs_hook=_config_pairs)
    except json.JSONDecodeError as e:
        raise SettingsError(f"--config {path}: not JSON ({e})") from None
    if not isinstance(obj, dict):
        raise SettingsError(f"--config {path}: must be one JSON object, got {type(obj).__name__}")
    src = f"config {path}"
    out: list[_Entry] = []
    neg_keys = {s.lstrip("-"): f for f in TABLE for s in f.negs if s.startswith("--")}
    for key, value in obj.items():
        name = f"--config key {key!r}"
        if key.startswith("-"):
            raise SettingsError(f"{name}: write keys without their dashes ({key.lstrip('-')!r})")
        if key in ACTION_KEYS:
            raise SettingsError(f"{name} asks the start to do something; give --{key} on the command line")
        flag, on = (BY_KEY[key], True) if key in BY_KEY else (neg_keys[key], False) if key in neg_keys else (None, True)
        if flag is None:
            raise SettingsError(f"{name}: no such flag (keys are long names such as 'ctx-size')")
        values = value if isinstance(value, list) else [value]
        if isinstance(value, list) and not value:
            raise SettingsError(f"{name}: an empty list is no value")
        if len(values) > 1 and flag.type != "keys":
            raise SettingsError(f"{name}: a list gives the flag {len(values)} times; {flag.long} is taken once")
        for v in values:
            if v is False or v is None or isinstance(v, (dict, list)):
                raise SettingsError(f"{name}: {json.dumps(v)} is no value (leave out a switch that is off)")
            if flag.type == "switch" and v is not True:
                raise SettingsError(f"{name}: {flag.long} is a switch; its value is true, not {json.dumps(v)}")
            if flag.type != "switch" and v is True:
                raise SettingsError(f"{name}: {flag.long} takes a value ({flag.type}), not true")
            if flag.type == "path" and isinstance(v, str):
                v = os.path.abspath(v)     # read from the directory the server starts in
            out.append(_Entry(flag, v, on, src, name))
    return out


def _from_env(env: dict[str, str], notes: list) -> list[_Entry]:
    out = []
    for var in sorted(env):
        if not (var.startswith("LLAMA_ARG_") or var == "LLAMA_API_KEY"):
            continue
        flag = BY_ENV.get(var)
        if flag is None:
            notes.append(("env variable not read by bloomery", {"variable": var}))
            continue
        raw: object = env[var]
        on = True
        if flag.type == "switch":
            word = str(raw).strip().lower()
            if word not in _TRUE | _FALSE:
                raise SettingsError(f"{var}={raw!r}: {flag.long} is a switch; give one of "
                                    + ", ".join(sorted(_TRUE | _FALSE)))
            on = raw = word in _TRUE
        out.append(_Entry(flag, raw, on, var, var))
    return out


def _split_keys(text: str, name: str) -> list[str]:
    """A comma list where a quoted item may hold commas; an empty item names no key."""
    items = next(csv.reader([text], skipinitialspace=True)) if text else [""]
    keys = [k.strip() for k in items]
    if any(not k for k in keys):
        raise SettingsError(f"{name}: an empty API key (a key must name something)")
    return keys


def _convert(e: _Entry) -> object:
    f, raw, name = e.flag, e.raw, e.name
    if f.type == "switch":
        return bool(e.switch_on)
    if isinstance(raw, float) and f.type != "float" or isinstance(raw, bool):
        raise SettingsError(f"{name}: {f.long} takes {f.type}, got {raw!r}")
    text = str(raw)
    if f.type in ("int", "int_or_auto"):
        if f.type == "int_or_auto" and text == "auto":
            return "auto"
        try:
            v = int(text, 10)
        except ValueError:
            want = "an integer or auto" if f.type == "int_or_auto" else "an integer"
            raise SettingsError(f"{name}: {f.long} takes {want}, got {text!r}") from None
        if not -_I32_MAX <= v <= _I32_MAX:
            raise SettingsError(f"{name}: {f.long} {v} is outside -{_I32_MAX} .. {_I32_MAX}")
        return v
    if f.type == "float":
        try:
            v = float(text)
        except ValueError:
            raise SettingsError(f"{name}: {f.long} takes a number, got {text!r}") from None
        if not math.isfinite(v):
            raise SettingsError(f"{name}: {f.long} must be finite, got {text!r}")
        return v
    if f.type == "choice":
        if text not in f.choices:
            hint = "; a model file is -m/--model-file" if f.long == "--model" else ""
            raise SettingsError(f"{name}: {f.long} takes one of {', '.join(f.choices)}, got {text!r}{hint}")
        return text
    if f.type == "keys":
        return _split_keys(text, name)
    if not text:
        raise SettingsError(f"{name}: {f.long} needs a non-empty value")
    return text


def _read_key_file(path: str) -> list[str]:
    try:
        lines = open(path, encoding="utf-8").read().splitlines()
    except OSError as e:
        raise SettingsError(f"--api-key-file {path}: cannot read it ({e.strerror})") from None
    keys = []
    for n_line, line in enumerate(lines, 1):
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        parts = s.split()
        if len(parts) > 1:   # never echo the key itself
            raise SettingsError(f"--api-key-file {path} line {n_line}: fields after the key "
                                f"(field 2: {parts[1].split('=')[0]!r}) are not served by this build")
        keys.append(parts[0])
    if not keys:
        raise SettingsError(f"--api-key-file {path}: names no key")
    return keys


def parse(argv: list[str], env: dict[str, str] | None = None) -> Settings:
    """Command line (+ --config file + LLAMA_ARG_*) -> Settings, or SettingsError naming the problem."""
    env = dict(os.environ if env is None else env)
    s = Settings()
    cmd = _from_argv(argv)
    seen: dict[str, str] = {}
    for e in cmd:
        if e.flag.long in seen:
            raise SettingsError(f"{e.flag.long} is given twice ({seen[e.flag.long]} and {e.name})")
        seen[e.flag.long] = e.name
    cfg_path = next((str(e.raw) for e in cmd if e.flag.long == "--config"), None)
    cfg = _from_config(os.path.abspath(cfg_path)) if cfg_path else []
    envs = _from_env(env, s.notes)

    chosen: dict[str, list[_Entry]] = {}
    for layer in (cmd, cfg, envs):       # highest first
        by_flag: dict[str, list[_Entry]] = {}
        for e in layer:
            by_flag.setdefault(e.flag.long, []).append(e)
        for long, entries in by_flag.items():
            if long == "--api-key" and entries[0].source.startswith("LLAMA"):
                chosen.setdefault("LLAMA_API_KEY", entries)      # the variable's keys add
            elif long in chosen:
                winner = chosen[long][0]
                for e in entries:
                    s.notes.append(("setting replaced", {"entry": e.name, "by": winner.name}))
            else:
                chosen[long] = entries

    keys: list[str] = []
    for long, entries in chosen.items():
        for e in entries:
            f = e.flag
            if f.action == "refuse":
                raise SettingsError(f"{e.name} is refused: {f.why}")
            value = _convert(e)
            if f.action == "noop":
                s.notes.append(("flag read, no effect here", {"flag": e.name, "why": f.why}))
                continue
            if f.type == "keys":
                keys.extend(value)
                continue
            if e.source.startswith("config"):
                shown = value if f.key in ("ctx-size", "parallel", "alias", "host", "port", "api-key-file",
                                           "chat-template-file") else "set"
                s.notes.append(("config entry read", {"key": f.key, "as": f"{f.long}", "value": shown}))
            elif e.source.startswith("LLAMA"):
                s.notes.append(("env variable read", {"variable": e.source, "as": f.long}))
            if f.long in ("--temp", "--seed", "--top-k", "--top-p", "--min-p", "--repeat-penalty",
                          "--repeat-last-n", "--presence-penalty", "--frequency-penalty"):
                s.sampling_defaults[f.field] = value
            else:
                setattr(s, f.field, value)
            s.sources[f.field] = e.source
    _check(s, keys)
    return s


def _check(s: Settings, keys: list[str]) -> None:
    if s.api_key_file:
        keys.extend(_read_key_file(s.api_key_file))
    s.api_keys = tuple(dict.fromkeys(keys))
    if not s.jinja:
        s.jinja = True
        s.notes.append(("flag read, no effect here", {"flag": "--no-jinja", "why": "jinja templates are always on"}))
    if s.help or s.version:
        return
    if not s.model_file:
        raise SettingsError("no model: give -m FILE (--model-file), or LLAMA_ARG_MODEL")
    if s.ctx_size is not None and s.ctx_size < 0:
        raise SettingsError(f"--ctx-size {s.ctx_size}: must be >= 0 (0: the plan's choice)")
    if s.ctx_size == 0:
        s.ctx_size = None
    if s.slot_ctx is not None:
        if s.slot_ctx < 1:
            raise SettingsError(f"--slot-ctx {s.slot_ctx}: must be >= 1")
        if s.ctx_size is not None:
            raise SettingsError("--slot-ctx beside --ctx-size is refused: one names the total, the other a slot's share")
    if s.parallel == "auto" and s.ctx_size is not None:
        raise SettingsError("--parallel auto beside --ctx-size is refused (use --slot-ctx for one slot's context)")
    if isinstance(s.parallel, int) and s.parallel < 1:
        raise SettingsError(f"--parallel {s.parallel}: must be >= 1 (or auto)")
    if not 0 <= s.port <= 65535:
        raise SettingsError(f"--port {s.port}: must be in 0 .. 65535 (0 takes a free port)")
    if s.n_predict < -1:
        raise SettingsError(f"--n-predict {s.n_predict}: must be >= -1 (-1: until the context is full)")
    if s.ngl is not None and s.ngl not in ("all", "auto"):
        try:
            int(s.ngl)
        except ValueError:
            raise SettingsError(f"-ngl {s.ngl!r}: takes all, auto or a count") from None
    if s.chat_template_file and not os.access(s.chat_template_file, os.R_OK):
        raise SettingsError(f"--chat-template-file {s.chat_template_file}: cannot read it")
    seed = s.sampling_defaults.get("seed")
    if seed is not None and not -1 <= seed <= 0xFFFFFFFF:
        raise SettingsError(f"--seed {seed}: must be in -1 .. {0xFFFFFFFF}")
    for k in ("top_k", "repeat_last_n"):
        if s.sampling_defaults.get(k, 0) < -1:
            raise SettingsError(f"--{k.replace('_', '-')} {s.sampling_defaults[k]}: must be >= -1")


def help_text() -> str:
    """--help: the table itself."""
    lines = ["usage: bloomery-serve -m FILE [flags]", ""]
    for f in TABLE:
        names = ", ".join([*f.shorts, f.long, *f.negs])
        value = "" if f.type == "switch" else f" {f.type.upper()}" if not f.choices else " {" + "|".join(f.choices) + "}"
        extra = [f"default: {f.default}"] if f.default not in (None, (), False) else []
        extra += [f"env: {f.env}"] if f.env else []
        lines.append(f"  {names}{value}")
        lines.append(f"      {f.help}" + (f" ({'; '.join(extra)})" if extra else ""))
    return "\n".join(lines) + "\n"
