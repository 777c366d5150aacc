"""bloomery-serve's flag table: ONE table, read by parsing (settings.py), --help, --config and LLAMA_ARG_*.

Each row carries llama-server's spellings (long, short, LLAMA_ARG_* variable), the
--config key (the long name without dashes), the value's type, its default and what
we do with it: "set" (honoured), "noop" (read, one record says it has no effect
here) or "refuse" (the start ends naming it).
"""
from __future__ import annotations

import csv
import math
import textwrap
from dataclasses import dataclass

from bloomery.engine.models.registry import ARCHS as SEATS   # --seat (or --model <seat> where no such file exists)
from bloomery.llama_flags import ROWS, WHY
from bloomery.engine.limits import CHECKPOINT_MIN_STEP, CTX_CHECKPOINTS

BACKENDS = ("cpu", "cuda", "auto")       # --backend; -dev none / -dev CUDA0 choose the same
LOG_FORMATS = ("text", "json")
# --reasoning's words, as llama.cpp's is_truthy / is_falsey / is_autoy read them
REASONING_ON, REASONING_OFF = ("on", "enabled", "true", "1"), ("off", "disabled", "false", "0")
REASONING_WORDS = (*REASONING_ON, *REASONING_OFF, "auto", "-1")
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
    type: str = "str"               # str | int | float | switch | keys | choice | int_or_auto | path | pair
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


def _refuse(long, shorts=(), env=None, type="str", why="not supported by bloomery yet", negs=()):
    return Flag(long, tuple(shorts), env, type, None, f"refused: {why}", "refuse", negs=tuple(negs), why=why)


def _llama_refused() -> tuple[Flag, ...]:
    """llama_flags.ROWS as refused Flags: the long name first, llama-server's arity and variable."""
    out = []
    for group, spellings, negs, arity, env in ROWS:
        names = spellings.split()
        long = next(n for n in names if n.startswith("--"))
        kind = {"switch": "switch", "1": "str", "2": "pair"}[arity]
        out.append(_refuse(long, [n for n in names if n != long], env, kind, WHY[group], negs.split()))
    return tuple(out)


def _placement_rows() -> tuple[Flag, ...]:
    """llama-server's placement flags: read as given, then by bloomery.placement_flags (one reader, one record)."""
    rows = (("--cpu-moe", ("-cmoe",), "LLAMA_ARG_CPU_MOE", "switch", "every routed expert tensor on the host"),
            ("--n-cpu-moe", ("-ncmoe",), "LLAMA_ARG_N_CPU_MOE", "str",
             "the routed experts of the first N layers on the host (N >= the layers: every layer)"),
            ("--override-tensor", ("-ot",), "LLAMA_ARG_OVERRIDE_TENSOR", "str",
             "<tensor name pattern>=<buffer type>,...: matching tensors on CPU or CUDA<N> (may be repeated)"),
            ("--fit", ("-fit",), "LLAMA_ARG_FIT", "str", "on|off: fit the card by moving routed experts to the host"),
            ("--fit-target", ("-fitt",), "LLAMA_ARG_FIT_TARGET", "str", "MiB0,MiB1,...: the margin kept free per "
             "card (one value: every card; default 1024)"),
            ("--fit-ctx", ("-fitc",), "LLAMA_ARG_FIT_CTX", "str", "the smallest context the fitted rule chooses "
             "(default 4096)"),
            ("--tensor-split", ("-ts",), "LLAMA_ARG_TENSOR_SPLIT", "str", "N0,N1,...: one share per card; the cards "
             "beside the main one take the routed experts it does not hold in these shares"),
            ("--main-gpu", ("-mg",), "LLAMA_ARG_MAIN_GPU", "str", "the card that runs every layer (default: the "
             "largest)"),
            ("--split-mode", ("-sm",), "LLAMA_ARG_SPLIT_MODE", "str", "none (one card) or layer (default)"))
    return tuple(Flag(long, shorts, env, kind, None, text, dest="placement_given") for long, shorts, env, kind, text
                 in rows)


TABLE: tuple[Flag, ...] = (
    Flag("--model", ("-m", "--model-file"), "LLAMA_ARG_MODEL", "path", None,
         "GGUF file to serve (first shard of a split set); a seat word (" + ", ".join(SEATS) + ") where no "
         "file of that name exists is read as --seat; with no model (nor -hf) bloomery-serve is a router of "
         "several models (--models-dir)", dest="model_file"),
    Flag("--seat", (), None, "choice", None, "the seat (model family engine; default: the file's architecture): "
         + ", ".join(SEATS), choices=SEATS),
    Flag("--ctx-size", ("-c", "--ctx"), "LLAMA_ARG_CTX_SIZE", "int", None,
         "total context over all slots (default: the plan's choice, up to the model's limit)"),
    Flag("--slot-ctx", (), None, "int", None, "one slot's context (total = slots x this)"),
    Flag("--parallel", ("-np",), "LLAMA_ARG_N_PARALLEL", "int_or_auto", 1, "slots: N or auto"),
    Flag("--host", (), "LLAMA_ARG_HOST", "str", "127.0.0.1", "address to listen on"),
    Flag("--port", (), "LLAMA_ARG_PORT", "int", 8080, "port to listen on (0 takes a free port)"),
    Flag("--alias", ("-a",), "LLAMA_ARG_ALIAS", "str", None,
         "the model's names in answers, comma-separated (the id is the first in sorted order)"),
    Flag("--tags", (), "LLAMA_ARG_TAGS", "str", None, "comma-separated tags listed in /v1/models"),
    Flag("--api-key", (), "LLAMA_API_KEY", "keys", (), "API keys, comma-separated (adds to the other key sources)"),
    Flag("--api-key-file", (), "LLAMA_ARG_API_KEY_FILE", "path", None, "file of API keys, one a line"),
    Flag("--chat-template-file", (), "LLAMA_ARG_CHAT_TEMPLATE_FILE", "path", None,
         "jinja chat template file (default: the GGUF's template)"),
    Flag("--chat-template", (), "LLAMA_ARG_CHAT_TEMPLATE", "str", None,
         "chat template: a llama.cpp built-in name (chatml, llama3, command-r, ...; one not served here is "
         "refused listing those that are) or the jinja text itself"),
    Flag("--n-predict", ("-n", "--predict"), "LLAMA_ARG_N_PREDICT", "int", -1,
         "default token limit of a request (-1: the context)"),
    Flag("--jinja", (), "LLAMA_ARG_JINJA", "switch", True, "jinja templates (always on)", negs=("--no-jinja",)),
    Flag("--config", (), None, "path", None, "read flags from one JSON object (keys: long names)"),
    Flag("--plan", (), None, "switch", False, "print the plan records and exit before loading weights"),
    Flag("--help", ("-h", "--usage"), None, "switch", False, "print this table and exit"),
    Flag("--version", (), None, "switch", False, "print the version and exit"),
    Flag("--backend", (), None, "choice", "auto", "bloomery's backend: cpu (numpy), cuda or auto (cuda where CuPy "
         "sees a card)", choices=BACKENDS),
    Flag("--device", ("-dev",), "LLAMA_ARG_DEVICE", "str", None,
         "llama-server's device list: none (no offload: the CPU backend) or CUDA0 (the card); several cards are "
         "refused (--list-devices lists them)", dest="devices"),
    Flag("--list-devices", (), None, "switch", False, "print the devices as llama-server does and exit"),
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
    Flag("--threads", ("-t",), "LLAMA_ARG_THREADS", "int", -1,
         "threads: the CPU backend's (-1: 2, or BLOOMERY_NUMPY_THREADS), and on the card the host threads of the experts "
         "the placement keeps in host RAM (-1: every core but two)", dest="threads"),
    _noop("--threads-batch", ("-tb",), None, "int"),
    _noop("--threads-http", (), "LLAMA_ARG_THREADS_HTTP", "int"),
    Flag("--batch-size", ("-b",), "LLAMA_ARG_BATCH", "int", 2048,
         "prompt ids per pass for a request with return_progress (one progress event each) and /infill's budget"),
    Flag("--ubatch-size", ("-ub",), "LLAMA_ARG_UBATCH", "int", None,
         "prompt ids one pass computes at most (llama-server's physical batch; default the backend's own: 512 on the "
         "CPU, 4096 on a card, 2048 on a card whose plan keeps routed experts in host RAM); the plan counts that "
         "pass's scratch", dest="ubatch_size"),
    _noop("--backend-sampling", ("-bs",), "LLAMA_ARG_BACKEND_SAMPLING",
          why="the sampler chain runs where the engine places it; the probabilities are the same"),
    _noop("--flash-attn", ("-fa",), "LLAMA_ARG_FLASH_ATTN", "choice", choices=("on", "off", "auto")),
    _noop("--mlock", why="weights are read through mmap"),                    # older llama-servers' flags
    _noop("--mmap", negs=("--no-mmap",), why="weights are read through mmap"),
    _noop("--webui", ("--ui",), "LLAMA_ARG_UI", negs=("--no-webui", "--no-ui"), why="no web UI is served"),
    Flag("--metrics", (), "LLAMA_ARG_ENDPOINT_METRICS", "switch", False,
         "serve GET /metrics (Prometheus text); without it /metrics answers 501 as llama-server", dest="metrics"),
    Flag("--slots", (), "LLAMA_ARG_ENDPOINT_SLOTS", "switch", True, "serve GET /slots (--no-slots: it answers 501)",
         negs=("--no-slots",), dest="endpoint_slots"),
    _noop("--props", (), "LLAMA_ARG_ENDPOINT_PROPS", why="POST /props is not served"),
    _noop("--cont-batching", ("-cb",), "LLAMA_ARG_CONT_BATCHING", negs=("--no-cont-batching", "-nocb"),
          why="slots are always batched"),
    Flag("--verbose", ("-v", "--log-verbose"), None, "switch", False,
         "answers carry llama-server's __verbose debug field unless a request says verbose: false", dest="verbose"),
    _noop("--log-verbosity", ("-lv", "--verbosity"), "LLAMA_ARG_LOG_VERBOSITY", "int",
          why="every record is printed"),
    _noop("--log-disable", why="the records are how bloomery-serve reports its state; they stay on"),
    Flag("--log-file", (), "LLAMA_ARG_LOG_FILE", "path", None, "append every record to this file too"),
    _noop("--log-colors", (), "LLAMA_ARG_LOG_COLORS", "str", why="records are not coloured"),
    Flag("--log-format", (), None, "choice", "text", "records as text lines or as JSON objects, one a line on "
         "stderr", choices=LOG_FORMATS),
    Flag("--log-jsonl", (), "LLAMA_ARG_LOG_JSONL", "switch", False, "records as JSON objects (--log-format json; "
         "on stderr, where llama-server writes them to stdout)", negs=("--no-log-jsonl",)),
    Flag("--log-prefix", (), "LLAMA_ARG_LOG_PREFIX", "switch", True, "start each text record with its time and "
         "level (--no-log-prefix: the bare [phase] component: message k=v)", negs=("--no-log-prefix",)),
    Flag("--log-timestamps", (), "LLAMA_ARG_LOG_TIMESTAMPS", "switch", True, "put the time (UTC, ISO 8601) on "
         "every record (--no-log-timestamps: leave it out)", negs=("--no-log-timestamps",)),
    Flag("--drain-timeout", (), None, "float", 25.0,
         "seconds requests still generating may go on after SIGTERM/SIGINT before they are ended (the unit's "
         "TimeoutStopSec=45 covers this, the engine's 10 s and the HTTP close's 5 s)"),
    Flag("--need-hook", (), None, "str", None,
         "program that grants the start after plan (the need record as JSON on stdin; exit 0: go on); "
         "default $BLOOMERY_NEED_HOOK, else hooks/bloomery-need when a broker socket exists; none/off: no hook"),
    Flag("--warmup", (), None, "switch", True,
         "run one token through the model at load, so the first request does not pay for preparing the "
         "weights (--no-warmup: skip it)", negs=("--no-warmup",), dest="warmup"),
    Flag("--offline", (), "LLAMA_ARG_OFFLINE", "switch", False,
         "--hf-repo from the download cache only, never the network (HF_HUB_OFFLINE=1 does the same)"),
    Flag("--kv-unified", ("-kvu",), "LLAMA_ARG_KV_UNIFIED", "switch", False,
         "each slot keeps its own KV region here; as in llama-server, an idle slot that --cache-idle-slots saved "
         "is then emptied (it frees no room here: a prompt for that text restores it from the prompt cache)",
         negs=("--no-kv-unified", "-no-kvu")),
    Flag("--cache-idle-slots", (), "LLAMA_ARG_CACHE_IDLE_SLOTS", "switch", True,
         "when a request starts, save every idle slot's state to the prompt cache (needs --cache-ram above 0); "
         "with --kv-unified the idle slot is then emptied", negs=("--no-cache-idle-slots",)),
    _noop("--context-shift", (), "LLAMA_ARG_CONTEXT_SHIFT", negs=("--no-context-shift",),
          why="a full slot ends with length"),
    _noop("--cache-reuse", (), "LLAMA_ARG_CACHE_REUSE", "int"),
    _noop("--cache-prompt", (), "LLAMA_ARG_CACHE_PROMPT", negs=("--no-cache-prompt",),
          why="requests choose cache_prompt"),
    Flag("--reasoning", ("-rea",), "LLAMA_ARG_REASONING", "choice", "auto",
         "thinking in chat: on / off set the template's enable_thinking for every request that does not; "
         "auto: the template's default", choices=REASONING_WORDS),
    Flag("--reasoning-format", (), "LLAMA_ARG_THINK", "choice", "auto",
         "default reasoning_format: none keeps the think span in content; auto / deepseek / deepseek-legacy "
         "move it to reasoning_content", choices=("none", "auto", "deepseek", "deepseek-legacy")),
    Flag("--reasoning-budget", (), "LLAMA_ARG_THINK_BUDGET", "int", -1,
         "default think-span budget in generated ids (-1: unrestricted, 0: the span is closed at once)"),
    Flag("--reasoning-budget-message", (), "LLAMA_ARG_THINK_BUDGET_MESSAGE", "str", None,
         "text forced before the end-of-thinking tag when a budget runs out (default: none)"),
    Flag("--spm-infill", (), None, "switch", False,
         "/infill puts the suffix before the prefix (suffix/prefix/middle), as some models prefer"),
    _noop("--timeout", ("-to",), "LLAMA_ARG_TIMEOUT", "int"),
    Flag("--sleep-idle-seconds", (), None, "int", -1,
         "after this many idle seconds the engine frees its weights and KV; a request loads them again (-1: never)"),
    Flag("--cors-origins", (), "LLAMA_ARG_CORS_ORIGINS", "str", None,
         'origins answered with CORS headers: "*" (any, without credentials), "localhost" (an Origin on '
         'localhost, 127.0.0.1 or [::1]), or a comma list of origins (default: "*" with an API key, '
         'else "localhost")'),
    Flag("--cors-methods", (), "LLAMA_ARG_CORS_METHODS", "str", "GET, POST, DELETE, OPTIONS",
         "comma-separated methods a CORS preflight allows"),
    Flag("--cors-headers", (), "LLAMA_ARG_CORS_HEADERS", "str", "*", "comma-separated headers a CORS preflight allows"),
    Flag("--cors-credentials", (), "LLAMA_ARG_CORS_CREDENTIALS", "switch", True,
         'allow credentials for CORS (never with --cors-origins "*")', negs=("--no-cors-credentials",)),
    Flag("--ctx-checkpoints", ("-ctxcp", "--swa-checkpoints"), "LLAMA_ARG_CTX_CHECKPOINTS", "int", CTX_CHECKPOINTS,
         "the most checkpoints a slot keeps of a state that cannot rewind (the qwen35 family's recurrent "
         "layers), taken at message starts (<|im_start|>) as a prompt is read, so a prompt sharing the prefix up "
         "to one reads only the rest; the oldest goes first (0: none)"),
    Flag("--checkpoint-min-step", ("-cms",), "LLAMA_ARG_CHECKPOINT_MIN_SPACING_NT", "int", CHECKPOINT_MIN_STEP,
         "the least spacing in ids between a slot's checkpoints: a message start within N ids of the slot's latest "
         "checkpoint is not one, unless it is the prompt's last or the slot has none (0: no minimum; negative "
         "refused)"),
    Flag("--cache-ram", ("-cram",), "LLAMA_ARG_CACHE_RAM", "int", None,
         "the prompt cache's budget in MiB: saved slot states in host RAM, restored when a prompt shares a "
         "prefix with one (0: off; default: the lesser of 8 GiB and half the host RAM the plan leaves; "
         "-1, no limit, is refused)"),
    _noop("--mmproj-auto", (), "LLAMA_ARG_MMPROJ_AUTO", negs=("--no-mmproj", "--no-mmproj-auto"),
          why="no image encoder is loaded"),
    *_placement_rows(),
    Flag("--models-dir", (), "LLAMA_ARG_MODELS_DIR", "path", None,
         "router mode (no -m/-hf): a folder of GGUF files (or a folder per model) served on demand; a request's "
         "\"model\" names one"),
    Flag("--models-preset", (), "LLAMA_ARG_MODELS_PRESET", "path", None,
         "router mode: an INI file of model presets (sections are models, keys are flags without dashes; "
         "[*] for every model; GET /models?reload=1 reads it again)"),
    Flag("--models-max", (), "LLAMA_ARG_MODELS_MAX", "int", 4,
         "router mode: models loaded at once (each its own bloomery-serve); past it the least recently used "
         "idle one is unloaded (0: no limit)"),
    Flag("--models-autoload", (), "LLAMA_ARG_MODELS_AUTOLOAD", "switch", True,
         "router mode: load a model a request names (--no-models-autoload: POST /models/load first)",
         negs=("--no-models-autoload",)),
    Flag("--hf-repo", ("-hf", "-hfr", "--hf"), "LLAMA_ARG_HF_REPO", "str", None,
         "<user>/<model>[@<rev>][:<quant>]: the GGUF of that quant (default Q4_K_M, then Q8_0, then the first) "
         "from the Hugging Face hub (HF_ENDPOINT) into $BLOOMERY_CACHE/hf (~/.cache/bloomery/hf)"),
    Flag("--hf-file", ("-hff",), "LLAMA_ARG_HF_FILE", "str", None,
         "the repo's file to serve (overrides the quant of --hf-repo)"),
    Flag("--hf-token", ("-hft",), "HF_TOKEN", "str", None, "Hugging Face access token (default: HF_TOKEN)"),
    _refuse("--lora", (), why="no LoRA adapters"), _refuse("--lora-scaled", (), why="no LoRA adapters"),
    _refuse("--mmproj", ("-mm",), "LLAMA_ARG_MMPROJ", why="no image encoder"),
    Flag("--embeddings", ("--embedding",), "LLAMA_ARG_EMBEDDINGS", "switch", False,
         "serve POST /embedding, /embeddings and /v1/embeddings: the model's hidden states after its final norm, "
         "pooled (--pooling); generation stays served", dest="embeddings"),
    Flag("--pooling", (), "LLAMA_ARG_POOLING", "choice", None,
         "how an embedding pools a prompt's rows: none (every id's row; not on /v1/embeddings), mean, cls (the "
         "first), last; default: the file's pooling_type, else none. rank (a reranker's head) is refused",
         choices=("none", "mean", "cls", "last", "rank")),
    Flag("--embd-normalize", (), None, "int", 2,
         "a pooled embedding's normalisation: -1 none, 0 max absolute scaled to int16, 1 taxicab, 2 euclidean, "
         ">2 p-norm (a request's embd_normalize overrides it)"),
    _refuse("--reranking", ("--rerank",), "LLAMA_ARG_RERANKING", "switch", why="no reranking"),
    _refuse("--grammar", (), why="no server-wide grammar (a request's grammar field is served)"),
    _refuse("--grammar-file", (), why="no server-wide grammar (a request's grammar field is served)"),
    _refuse("--json-schema", ("-j",), why="no server-wide schema (a request's json_schema field is served)"),
    _refuse("--json-schema-file", ("-jf",), why="no server-wide schema (a request's json_schema field is served)"),
    _refuse("--model-draft", ("-md", "--spec-draft-model"), "LLAMA_ARG_SPEC_DRAFT_MODEL", why="no draft model"),
    _refuse("--cache-type-k", ("-ctk",), "LLAMA_ARG_CACHE_TYPE_K", why="the KV cache is float32"),
    _refuse("--cache-type-v", ("-ctv",), "LLAMA_ARG_CACHE_TYPE_V", why="the KV cache is float32"),
    Flag("--slot-save-path", (), None, "path", None, "folder of the slot files that POST /slots/{id}?action=save "
         "writes and action=restore reads (default: disabled, those answer 501)"),
    _refuse("--rope-scaling", (), "LLAMA_ARG_ROPE_SCALING_TYPE", why="RoPE comes from the file"),
    _refuse("--rope-scale", (), "LLAMA_ARG_ROPE_SCALE", why="RoPE comes from the file"),
    _refuse("--rope-freq-base", (), "LLAMA_ARG_ROPE_FREQ_BASE", why="RoPE comes from the file"),
    _refuse("--rope-freq-scale", (), "LLAMA_ARG_ROPE_FREQ_SCALE", why="RoPE comes from the file"),
    _refuse("--ignore-eos", (), None, "switch", why="a server-wide ignore_eos is not served (a request field only)"),
    *_llama_refused(),
)

SPELLINGS: dict[str, tuple[Flag, bool]] = {}   # spelling -> (flag, value for a switch spelling)
for _f in TABLE:
    for _s, _on in [*((x, True) for x in (_f.long, *_f.shorts)), *((x, False) for x in _f.negs)]:
        if _s in SPELLINGS:
            raise AssertionError(f"flag table: {_s} names both {SPELLINGS[_s][0].long} and {_f.long}")
        SPELLINGS[_s] = (_f, _on)
# --config keys: the long name without dashes, and each other -- spelling (model-file, ctx, ...)
BY_KEY = {s.lstrip("-"): f for f in TABLE for s in (*reversed(f.shorts), f.long) if s.startswith("--")}
BY_ENV = {f.env: f for f in TABLE if f.env}

# the flags that set a request default of the sampler chain (SamplingParams fields by dest)
SAMPLING_FLAGS = ("--temp", "--seed", "--top-k", "--top-p", "--min-p", "--repeat-penalty", "--repeat-last-n",
                  "--presence-penalty", "--frequency-penalty")


_I32_MAX = 2**31 - 1


def _split_keys(text: str, name: str) -> list[str]:
    """A comma list where a quoted item may hold commas; an empty item names no key."""
    items = next(csv.reader([text], skipinitialspace=True)) if text else [""]
    keys = [k.strip() for k in items]
    if any(not k for k in keys):
        raise SettingsError(f"{name}: an empty API key (a key must name something)")
    return keys


def convert(f: Flag, raw: object, name: str, switch_on: bool = True) -> object:
    """One raw value (str from argv/env; str|int|float from --config) -> the flag's type, or SettingsError
    naming how the user spelled it (`name`), the flag and the value."""
    if f.type == "switch":
        return bool(switch_on)
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
            raise SettingsError(f"{name}: {f.long} takes one of {', '.join(f.choices)}, got {text!r}")
        return text
    if f.type == "keys":
        return _split_keys(text, name)
    if not text:
        raise SettingsError(f"{name}: {f.long} needs a non-empty value")
    return text


def value_hint(f: Flag) -> str:
    """What follows the flag on a command line: nothing for a switch."""
    if f.type == "switch":
        return ""
    if f.choices:
        return " {" + "|".join(f.choices) + "}"
    return {"pair": " VALUE VALUE", "int_or_auto": " N|auto", "keys": " KEY[,KEY...]", "str": " VALUE"}.get(
        f.type, f" {f.type.upper()}")


def help_text() -> str:
    """--help: the table itself; llama-server's flags that are refused are listed by name at the end."""
    lines = ["usage: bloomery-serve -m FILE [flags]", ""]
    refused: dict[str, list[str]] = {}
    for f in TABLE:
        names = ", ".join([*f.shorts, f.long, *f.negs])
        if f.action == "refuse" and f.why in WHY.values():
            refused.setdefault(f.why, []).append(names + value_hint(f))
            continue
        extra = [f"default: {f.default}"] if f.default not in (None, (), False) and f.type != "switch" else []
        extra += [f"env: {f.env}"] if f.env else []
        lines.append(f"  {names}{value_hint(f)}")
        lines.append(f"      {f.help}" + (f" ({'; '.join(extra)})" if extra else ""))
    lines += ["", "llama-server's flags refused by name (read with llama-server's arity; the start ends naming them):"]
    for why, names in refused.items():
        lines.append(f"  {why}:")
        lines += textwrap.wrap("; ".join(names), 100, initial_indent=" " * 6, subsequent_indent=" " * 6,
                               break_on_hyphens=False)
    return "\n".join(lines) + "\n"
