"""bloomery-serve's settings: the flag table (bloomery/flags.py) read from the command line,
a --config file and LLAMA_ARG_* variables into one Settings, or a SettingsError naming
the flag, the value and the rule. Precedence (serving guide 7.2): command line >
--config file > LLAMA_ARG_* > default; API keys add up.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

from bloomery import placement_flags
from bloomery.engine.limits import CHECKPOINT_MIN_STEP, CTX_CHECKPOINTS
from bloomery.engine.types import SamplingParams
from bloomery.flags import (ACTION_KEYS, BACKENDS, BY_ENV, BY_KEY, SAMPLING_FLAGS, SEATS, SPELLINGS,  # noqa: F401
                            TABLE, Flag, SettingsError, convert, help_text)
from bloomery.placement_flags import PlacementAsk

DEFAULT_SEED = 0xFFFFFFFF       # LLAMA_DEFAULT_SEED: --seed -1 asks for a random seed per request

_TRUE = {"on", "enabled", "true", "1"}
_FALSE = {"off", "disabled", "false", "0"}


@dataclass
class Settings:
    model_file: str | None = None
    hf_repo: str | None = None         # --hf-repo <repo>[@<rev>][:<quant>]: the fetch stage downloads it
    hf_file: str | None = None
    hf_token: str | None = None        # never printed (redacted() leaves it out; a record secret)
    offline: bool = False              # --offline: --hf-repo from the cache only
    seat: str | None = None
    ctx_size: int | None = None        # None: the plan chooses (0 on the command line means the same)
    slot_ctx: int | None = None
    parallel: int | str = 1            # int >= 1 or "auto"
    host: str = "127.0.0.1"
    port: int = 8080
    alias: str | None = None
    tags: str | None = None
    cors_origins: str | None = None    # None: "*" with an API key, else "localhost" (_check resolves it)
    cors_methods: str = "GET, POST, DELETE, OPTIONS"
    cors_headers: str = "*"
    cors_credentials: bool = True
    drain_timeout: float = 25.0        # --drain-timeout: how long a SIGTERM lets generations finish
    api_keys: tuple[str, ...] = ()     # every source added; never printed
    api_key_file: str | None = None
    chat_template_file: str | None = None
    chat_template: str | None = None   # --chat-template: a built-in name or jinja text
    n_predict: int = -1
    jinja: bool = True
    config: str | None = None
    plan: bool = False
    help: bool = False
    version: bool = False
    list_devices: bool = False
    backend: str = "auto"              # --backend cpu|cuda|auto, or what -dev chose
    devices: str | None = None         # -dev/--device as given: none or CUDA<N>
    card: int | None = None            # -dev CUDA<N>: N (the plan checks that the card is there)
    backend_from: str = "default"      # the flag that chose the backend, for the records
    log_format: str = "text"           # --log-format text|json (--log-jsonl: json)
    log_jsonl: bool = False
    log_prefix: bool = True            # --no-log-prefix: text records without the time and level
    log_timestamps: bool = True        # --no-log-timestamps: no time on records
    log_file: str | None = None        # --log-file: every record appended there too
    ngl: str | None = None
    placement_given: dict[str, tuple[str, object]] = field(default_factory=dict)   # placement flags as given
    placement_ask: PlacementAsk = field(default_factory=PlacementAsk)   # how they were read (placement_flags)
    endpoint_slots: bool = True        # --no-slots: GET /slots answers 501
    warmup: bool = True                # --no-warmup: the first request prepares the weights
    threads: int = -1                  # -t: host threads of the offload tier's host experts (-1: every core but two)
    metrics: bool = False              # --metrics: GET /metrics serves Prometheus text (without it: 501)
    verbose: bool = False              # -v: a request's verbose defaults to true (the __verbose debug field)
    reasoning: str = "auto"            # --reasoning on|off|auto: the template's enable_thinking default
    reasoning_format: str = "auto"     # --reasoning-format: a request's default reasoning_format
    reasoning_budget: int = -1         # --reasoning-budget: a request's default think-span budget
    reasoning_budget_message: str | None = None   # --reasoning-budget-message
    spm_infill: bool = False           # --spm-infill: /infill's suffix/prefix/middle order
    batch_size: int = 2048             # -b: prompt-pass size under return_progress, /infill's budget
    ubatch_size: int | None = None     # -ub: the most ids one prompt pass computes (None: the backend's own)
    cache_ram: int | None = None       # -cram MiB: the prompt cache's budget (0: off; None: the plan's default)
    ctx_checkpoints: int = CTX_CHECKPOINTS   # -ctxcp: checkpoints a slot keeps of a state that cannot rewind (<= 0: none)
    checkpoint_min_step: int = CHECKPOINT_MIN_STEP   # -cms: the least spacing in ids between a slot's checkpoints
    embeddings: bool = False           # --embeddings: /embedding(s) and /v1/embeddings are served (else 501)
    pooling: str | None = None         # --pooling none|mean|cls|last (None: the file's pooling_type, else none)
    embd_normalize: int = 2            # --embd-normalize: a pooled embedding's norm (-1 none, 0 int16 max, p > 0: p-norm)
    cache_idle_slots: bool = True      # --no-cache-idle-slots: idle slots are not saved when a request starts
    kv_unified: bool = False           # --kv-unified: idle slots saved by --cache-idle-slots are also emptied
    sleep_idle_seconds: int = -1       # --sleep-idle-seconds: free the weights after this idle time (-1: never)
    slot_save_path: str | None = None  # --slot-save-path: the folder of POST /slots/{id}'s save and restore files
    models_dir: str | None = None      # router mode (no model): a folder of models served on demand
    models_preset: str | None = None   # router mode: an INI file of model presets (bloomery/router/preset.py)
    models_max: int = 4                # router mode: models loaded at once (0: no limit)
    models_autoload: bool = True       # router mode: a request's model is loaded when it is not
    router: bool = False               # no -m/-hf: llama-server's router mode (bloomery/router)
    argv: list[str] = field(default_factory=list)   # the command line as given (a router's children get it)
    need_hook: str | None = None       # --need-hook PATH (None: $BLOOMERY_NEED_HOOK, else the broker's hook if any)
    sampling_defaults: dict[str, float | int] = field(default_factory=dict)   # SamplingParams field -> flag value
    sources: dict[str, str] = field(default_factory=dict)             # field -> where its value came from
    notes: list[tuple[str, dict]] = field(default_factory=list)       # records to print: (message, k=v)

    def sampling(self) -> SamplingParams:
        """The request defaults the sampling flags set, over llama-server's own (--seed -1: random)."""
        kv = dict(self.sampling_defaults)
        if kv.get("seed") == -1:
            kv["seed"] = DEFAULT_SEED
        return SamplingParams(**kv)

    def redacted(self) -> dict:
        """The settings as plain data, API keys replaced by their count."""
        d = {k: v for k, v in self.__dict__.items() if k not in ("api_keys", "hf_token", "notes", "sources", "argv")}
        d["n_api_keys"] = len(self.api_keys)
        return d


@dataclass
class _Entry:
    flag: Flag
    raw: object          # str from argv/env; str|int|float|True from --config
    switch_on: bool      # for switches: which spelling was given
    source: str          # "command line", "config FILE", "LLAMA_ARG_X"
    name: str            # how the user spelled it: "-c", "config key ctx-size", "LLAMA_ARG_CTX_SIZE"
    tokens: tuple[str, ...] = ()   # the command-line words it took (the flag and its values)


def _from_argv(argv: list[str]) -> list[_Entry]:
    out: list[_Entry] = []
    i = 0
    while i < len(argv):
        tok, start = argv[i], i
        spelling, eq, inline = tok.partition("=") if tok.startswith("--") else (tok, "", "")
        if spelling.startswith("--"):
            spelling = spelling.replace("_", "-")      # llama-server reads --ctx_size as --ctx-size
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
            n_values = 2 if flag.type == "pair" else 1
            if i + n_values >= len(argv):
                raise SettingsError(f"{spelling} needs {'two values' if n_values == 2 else 'a value'} ({flag.type})")
            raw = " ".join(argv[i + 1:i + 1 + n_values])
            i += n_values
        out.append(_Entry(flag, raw, on, "command line", spelling, tuple(argv[start:i + 1])))
        i += 1
    return out


def argv_without(argv: list[str], longs: set[str]) -> list[str]:
    """The command line without the flags named (by their long name, any spelling) and their values: what a
    router's children are given (bloomery/router)."""
    return [word for e in _from_argv(argv) if e.flag.long not in longs for word in e.tokens]


def argv_flags(argv: list[str]) -> set[str]:
    """The long names of the flags a command line gives (a router's preset options yield to them)."""
    return {e.flag.long for e in _from_argv(argv)}


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
            if flag.type == "path" and isinstance(v, str) and not _seat_word(flag, v):
                v = os.path.abspath(v)     # read from the directory the server starts in
            out.append(_Entry(flag, v, on, src, name))
    return out


def _from_env(env: dict[str, str], notes: list) -> list[_Entry]:
    out = []
    for var in sorted(env):
        if not (var.startswith("LLAMA_ARG_") or var == "LLAMA_API_KEY"):   # HF_TOKEN: read by the fetch stage
            continue
        flag = BY_ENV.get(var)
        negated = flag is None and NEG_ENV.get(var)       # LLAMA_ARG_NO_X: llama-server reads it as X off
        if negated:
            out.append(_Entry(negated, False, False, var, var))
            continue
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


NEG_ENV = {f.env.replace("LLAMA_ARG_", "LLAMA_ARG_NO_", 1): f for f in TABLE
           if f.env and f.negs and f.env.startswith("LLAMA_ARG_")}
_SECRET_KEYS = ("api-key", "hf-token")


def _seat_word(flag: Flag, raw: object) -> bool:
    return flag.long == "--model" and isinstance(raw, str) and raw in SEATS and not os.path.exists(raw)


def _model_readings(entries: list[_Entry]) -> list[_Entry]:
    """--model (any spelling or source) names the model file, as in llama-server; a seat word where no
    file of that name exists is read as --seat (bloomery's older spelling)."""
    return [_Entry(BY_KEY["seat"], e.raw, True, e.source, e.name) if _seat_word(e.flag, e.raw) else e
            for e in entries]


def _read_note(e: _Entry, value: object) -> tuple[str, dict]:
    """The record that says how one command-line flag was read."""
    f = e.flag
    kv: dict = {"flag": e.name, "as": f.long}
    if f.long == "--seat" and e.name != "--seat":
        kv["why"] = f"a seat word, and no file named {value} here"
    if f.key not in _SECRET_KEYS:
        kv["value"] = value if not isinstance(value, list) else len(value)
    return "flag read", kv


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
    s = Settings(argv=list(argv))
    cmd = _model_readings(_from_argv(argv))
    seen: dict[str, str] = {}
    for e in cmd:
        if e.flag.long in seen and e.flag.long != "--override-tensor":   # -ot may repeat, as in llama-server
            raise SettingsError(f"{e.flag.long} is given twice ({seen[e.flag.long]} and {e.name})")
        seen[e.flag.long] = e.name
    cfg_path = next((str(e.raw) for e in cmd if e.flag.long == "--config"), None)
    cfg = _model_readings(_from_config(os.path.abspath(cfg_path))) if cfg_path else []
    envs = _model_readings(_from_env(env, s.notes))

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
            value = convert(e.flag, e.raw, e.name, e.switch_on)
            if f.action == "noop":
                s.notes.append(("flag read, no effect here", {"flag": e.name, "why": f.why}))
                continue
            if f.type == "keys":
                keys.extend(value)
                if e.source == "command line" and value:   # ps and /proc/PID/cmdline show argv to every local user
                    s.notes.append(("--api-key on the command line is visible to every local user (ps, "
                                    "/proc/PID/cmdline); give --api-key-file FILE or LLAMA_API_KEY instead",
                                    {"level": "warning"}))
                continue
            if f.field == "placement_given":   # read in _check, one record each (placement_flags)
                name, had = s.placement_given.get(f.long, ("", None))
                joined = f"{had},{value}" if had is not None and f.long == "--override-tensor" else value
                s.placement_given[f.long] = (f"{name} {e.name}".strip() if had is not None else e.name, joined)
                s.sources[f.field] = e.source
                continue
            if e.source == "command line" and f.long not in ("--api-key", "--device"):   # -dev: its own line
                s.notes.append(_read_note(e, value))
            elif e.source.startswith("config"):
                shown = value if f.key in ("ctx-size", "parallel", "alias", "host", "port", "api-key-file",
                                           "chat-template-file") else "set"
                s.notes.append(("config entry read", {"key": f.key, "as": f"{f.long}", "value": shown}))
            elif e.source.startswith("LLAMA"):
                s.notes.append(("env variable read", {"variable": e.source, "as": f.long}))
            if f.long in SAMPLING_FLAGS:
                s.sampling_defaults[f.field] = value
            else:
                setattr(s, f.field, value)
            s.sources[f.field] = e.source
    _gcp_port(s, env)
    _check(s, keys)
    return s


def _gcp_port(s: Settings, env: dict[str, str]) -> None:
    """Vertex AI's prediction mode (AIP_MODE=PREDICTION, api/gcp.py): AIP_HTTP_PORT (default 8080) replaces --port,
    as llama-server; a predict route that is one of the served routes is refused."""
    if env.get("AIP_MODE") != "PREDICTION":
        return
    raw = env.get("AIP_HTTP_PORT") or "8080"
    try:
        port = int(raw)
    except ValueError:
        raise SettingsError(f"AIP_HTTP_PORT={raw!r}: must be a port number") from None
    if port != s.port:
        s.notes.append(("Vertex AI prediction mode: AIP_HTTP_PORT replaces the port", {"port": port, "was": s.port}))
    s.port, s.sources["port"] = port, "AIP_HTTP_PORT"
    from bloomery.api.app import ROUTES
    from bloomery.api.gcp import from_env
    predict = from_env(env).predict_path
    if ("POST", predict) in ROUTES:
        raise SettingsError(f"AIP_PREDICT_ROUTE={predict} is one of this server's routes; choose another path")


def _check_model_source(s: Settings) -> None:
    if s.model_file and s.hf_repo:
        raise SettingsError(f"-m {s.model_file} beside --hf-repo {s.hf_repo}: give one model source")
    if s.hf_file and not s.hf_repo:
        raise SettingsError(f"--hf-file {s.hf_file}: needs --hf-repo (the repo that holds it)")
    if s.hf_repo:
        from bloomery.hf.errors import SpecError
        from bloomery.hf.spec import parse_spec
        try:
            parse_spec(s.hf_repo)
        except SpecError as e:
            raise SettingsError(str(e)) from None
    elif not s.model_file:      # llama-server's router mode: models from --models-dir and the cache, on demand
        if s.plan:
            raise SettingsError("--plan needs a model: give -m/--model FILE or --hf-repo <user>/<model>[:quant] "
                                "(with neither, bloomery-serve is a router of several models)")
        if s.models_max < 0:
            raise SettingsError(f"--models-max {s.models_max}: must be >= 0 (0: no limit)")
        s.router = True
        s.notes.append(("router mode: no model given; models are served on demand", {
            "models_dir": s.models_dir or "none", "models_preset": s.models_preset or "none",
            "models_max": s.models_max, "autoload": s.models_autoload}))


def _check_backend(s: Settings) -> None:
    """-dev (llama-server's device list) and --backend (bloomery's) choose one backend; a clash is refused."""
    named = "backend" in s.sources
    s.backend_from = f"--backend {s.backend}" if named else "default"
    if s.devices is None:
        return
    names = [d.strip() for d in s.devices.split(",")]
    m = re.fullmatch(r"CUDA(\d+)", names[0])
    if names == ["none"]:
        backend, card = "cpu", None
    elif len(names) > 1:
        raise SettingsError(f"-dev {s.devices}: several devices are not served yet; name one card (CUDA0) or none")
    elif m:
        backend, card = "cuda", int(m.group(1))
    else:
        raise SettingsError(f"-dev {s.devices}: no device of that name here (none, or CUDA<N>; "
                            f"bloomery-serve --list-devices lists them)")
    if named and s.backend not in ("auto", backend):
        raise SettingsError(f"-dev {s.devices} beside --backend {s.backend}: they choose different backends; give one")
    s.backend, s.card, s.backend_from = backend, card, f"-dev {s.devices}"
    s.notes.append(("device list read", {"flag": "-dev", "value": s.devices, "as": f"--backend {backend}",
                                         **({"card": card} if card is not None else {"offload": "none"})}))


def _check_logs(s: Settings) -> None:
    if s.log_jsonl:
        if "log_format" in s.sources and s.log_format != "json":
            raise SettingsError(f"--log-jsonl beside --log-format {s.log_format}: give one")
        s.log_format = "json"


def _check(s: Settings, keys: list[str]) -> None:
    if s.api_key_file:
        keys.extend(_read_key_file(s.api_key_file))
    s.api_keys = tuple(dict.fromkeys(keys))
    if s.cors_origins is None:   # llama-server's "*" would let any web page drive a server that has no key
        s.cors_origins = "*" if s.api_keys else "localhost"
        s.sources.setdefault("cors_origins", "default: " + ("an API key is set" if s.api_keys else "no API key"))
    if not s.jinja:
        s.jinja = True
        s.notes.append(("flag read, no effect here", {"flag": "--no-jinja", "why": "jinja templates are always on"}))
    _check_backend(s)
    _check_logs(s)
    try:
        s.placement_ask, read = placement_flags.read(s.placement_given)
    except placement_flags.PlacementFlagError as e:
        raise SettingsError(str(e)) from None
    s.notes.extend(read)
    if s.help or s.version or s.list_devices:
        return
    _check_model_source(s)
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
    if not 0 <= s.drain_timeout <= 3600:
        raise SettingsError(f"--drain-timeout {s.drain_timeout}: must be in 0..3600 seconds")
    if not 0 <= s.port <= 65535:
        raise SettingsError(f"--port {s.port}: must be in 0 .. 65535 (0 takes a free port)")
    if s.checkpoint_min_step < 0:    # llama-server's words (arg.cpp)
        raise SettingsError(f"--checkpoint-min-step {s.checkpoint_min_step}: checkpoint-min-step must be non-negative")
    if s.reasoning_budget < -1:
        raise SettingsError(f"--reasoning-budget {s.reasoning_budget}: must be >= -1 (-1: unrestricted)")
    if s.sleep_idle_seconds == 0 or s.sleep_idle_seconds < -1:
        raise SettingsError(f"--sleep-idle-seconds {s.sleep_idle_seconds}: cannot be 0 or less than -1 (-1: never)")
    if s.slot_save_path is not None and not os.path.isdir(s.slot_save_path):
        raise SettingsError(f"--slot-save-path {s.slot_save_path}: not a directory")
    if s.cache_ram is not None and s.cache_ram < 0:
        raise SettingsError(f"--cache-ram {s.cache_ram}: the prompt cache always has a budget here (llama-server's "
                            f"-1, no limit, is refused); give MiB >= 1, or 0 to turn it off")
    if s.pooling == "rank":
        raise SettingsError("--pooling rank: reranking needs a reranker's classification head; not served here "
                            "(none, mean, cls and last are)")
    if s.batch_size < 1:
        raise SettingsError(f"--batch-size {s.batch_size}: must be >= 1")
    if s.ubatch_size is not None and s.ubatch_size < 1:
        raise SettingsError(f"--ubatch-size {s.ubatch_size}: must be >= 1 (the most ids one prompt pass computes)")
    if s.n_predict < -1:
        raise SettingsError(f"--n-predict {s.n_predict}: must be >= -1 (-1: until the context is full)")
    if s.ngl is not None and s.ngl not in ("all", "auto"):
        try:
            int(s.ngl)
        except ValueError:
            raise SettingsError(f"-ngl {s.ngl!r}: takes all, auto or a count") from None
    if s.chat_template_file and not os.access(s.chat_template_file, os.R_OK):
        raise SettingsError(f"--chat-template-file {s.chat_template_file}: cannot read it")
    if s.chat_template is not None:
        from bloomery.chat_template.builtin import UnknownBuiltin, template_source
        if s.chat_template_file:
            raise SettingsError("--chat-template and --chat-template-file both name the chat template; give one")
        try:
            template_source(s.chat_template)
        except UnknownBuiltin as e:
            raise SettingsError(str(e)) from None
    seed = s.sampling_defaults.get("seed")
    if seed is not None and not -1 <= seed <= 0xFFFFFFFF:
        raise SettingsError(f"--seed {seed}: must be in -1 .. {0xFFFFFFFF}")
    for k in ("top_k", "repeat_last_n"):
        if s.sampling_defaults.get(k, 0) < -1:
            raise SettingsError(f"--{k.replace('_', '-')} {s.sampling_defaults[k]}: must be >= -1")
    for k in ("top_p", "min_p"):
        if not 0.0 <= s.sampling_defaults.get(k, 0.5) <= 1.0:
            raise SettingsError(f"--{k.replace('_', '-')} {s.sampling_defaults[k]:g}: must be in 0 .. 1")
    if s.sampling_defaults.get("repeat_penalty", 1.0) <= 0.0:
        raise SettingsError(f"--repeat-penalty {s.sampling_defaults['repeat_penalty']:g}: must be above 0 "
                            f"(1: off)")
    if s.metrics:
        s.notes.append(("flag read: GET /metrics is served (Prometheus text)", {"flag": "--metrics"}))
