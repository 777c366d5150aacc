"""Every flag llama-server (llama.cpp b11434, common/arg.cpp) reads, against bloomery-serve's flag table.

EXPECTED is written from a reading of arg.cpp's add_opt(...) calls that apply to llama-server:
each row is `spellings | negated spellings | arity | environment variable`. Arity is `switch`
(no value), `1` (one value) or `2` (two values). bloomery honours a flag, reads it with a
record saying it has no effect, or refuses it by name; whichever, it reads the flag with
llama-server's arity, every alias and the same variable.
"""
from __future__ import annotations

import pytest

from bloomery import flags
from bloomery.settings import SettingsError, parse

EXPECTED = """
-h --help --usage |  | switch | -
--version |  | switch | -
-cl --cache-list |  | switch | -
--completion-bash |  | switch | -
-t --threads |  | 1 | LLAMA_ARG_THREADS
-tb --threads-batch |  | 1 | -
-C --cpu-mask |  | 1 | -
-Cr --cpu-range |  | 1 | -
--cpu-strict |  | 1 | -
--prio |  | 1 | -
--poll |  | 1 | -
-Cb --cpu-mask-batch |  | 1 | -
-Crb --cpu-range-batch |  | 1 | -
--cpu-strict-batch |  | 1 | -
--prio-batch |  | 1 | -
--poll-batch |  | 1 | -
-lcs --lookup-cache-static |  | 1 | -
-lcd --lookup-cache-dynamic |  | 1 | -
-c --ctx-size |  | 1 | LLAMA_ARG_CTX_SIZE
--kv-unified-per-slot |  | 1 | LLAMA_ARG_KV_UNIFIED_PER_SLOT
-n --predict --n-predict |  | 1 | LLAMA_ARG_N_PREDICT
-b --batch-size |  | 1 | LLAMA_ARG_BATCH
-ub --ubatch-size |  | 1 | LLAMA_ARG_UBATCH
--keep |  | 1 | -
--swa-full |  | switch | LLAMA_ARG_SWA_FULL
-ctxcp --ctx-checkpoints --swa-checkpoints |  | 1 | LLAMA_ARG_CTX_CHECKPOINTS
-cms --checkpoint-min-step |  | 1 | LLAMA_ARG_CHECKPOINT_MIN_SPACING_NT
-cram --cache-ram |  | 1 | LLAMA_ARG_CACHE_RAM
-kvu --kv-unified | -no-kvu --no-kv-unified | switch | LLAMA_ARG_KV_UNIFIED
--cache-idle-slots | --no-cache-idle-slots | switch | LLAMA_ARG_CACHE_IDLE_SLOTS
--context-shift | --no-context-shift | switch | LLAMA_ARG_CONTEXT_SHIFT
-fa --flash-attn |  | 1 | LLAMA_ARG_FLASH_ATTN
--perf | --no-perf | switch | LLAMA_ARG_PERF
-e --escape | --no-escape | switch | -
-r --reverse-prompt |  | 1 | -
-sp --special |  | switch | -
--warmup | --no-warmup | switch | -
--spm-infill |  | switch | -
--samplers |  | 1 | -
-s --seed |  | 1 | -
--sampler-seq --sampling-seq |  | 1 | -
--ignore-eos |  | switch | -
--temp --temperature |  | 1 | LLAMA_ARG_TEMPERATURE
--top-k |  | 1 | LLAMA_ARG_TOP_K
--top-p |  | 1 | LLAMA_ARG_TOP_P
--min-p |  | 1 | LLAMA_ARG_MIN_P
--top-nsigma --top-n-sigma |  | 1 | -
--xtc-probability |  | 1 | -
--xtc-threshold |  | 1 | -
--typical --typical-p |  | 1 | -
--repeat-last-n |  | 1 | -
--repeat-penalty |  | 1 | LLAMA_ARG_REPEAT_PENALTY
--presence-penalty |  | 1 | LLAMA_ARG_PRESENCE_PENALTY
--frequency-penalty |  | 1 | LLAMA_ARG_FREQUENCY_PENALTY
--dry-multiplier |  | 1 | -
--dry-base |  | 1 | -
--dry-allowed-length |  | 1 | -
--dry-penalty-last-n |  | 1 | -
--dry-sequence-breaker |  | 1 | -
--adaptive-target |  | 1 | -
--adaptive-decay |  | 1 | -
--dynatemp-range |  | 1 | -
--dynatemp-exp |  | 1 | -
--mirostat |  | 1 | -
--mirostat-lr |  | 1 | -
--mirostat-ent |  | 1 | -
-l --logit-bias |  | 1 | -
--grammar |  | 1 | -
--grammar-file |  | 1 | -
-j --json-schema |  | 1 | -
-jf --json-schema-file |  | 1 | -
-bs --backend-sampling |  | switch | LLAMA_ARG_BACKEND_SAMPLING
--pooling |  | 1 | LLAMA_ARG_POOLING
--rope-scaling |  | 1 | LLAMA_ARG_ROPE_SCALING_TYPE
--rope-scale |  | 1 | LLAMA_ARG_ROPE_SCALE
--rope-freq-base |  | 1 | LLAMA_ARG_ROPE_FREQ_BASE
--rope-freq-scale |  | 1 | LLAMA_ARG_ROPE_FREQ_SCALE
--yarn-orig-ctx |  | 1 | LLAMA_ARG_YARN_ORIG_CTX
--yarn-ext-factor |  | 1 | LLAMA_ARG_YARN_EXT_FACTOR
--yarn-attn-factor |  | 1 | LLAMA_ARG_YARN_ATTN_FACTOR
--yarn-beta-slow |  | 1 | LLAMA_ARG_YARN_BETA_SLOW
--yarn-beta-fast |  | 1 | LLAMA_ARG_YARN_BETA_FAST
-kvo --kv-offload | -nkvo --no-kv-offload | switch | LLAMA_ARG_KV_OFFLOAD
--repack | -nr --no-repack | switch | LLAMA_ARG_REPACK
--no-host |  | switch | LLAMA_ARG_NO_HOST
-ctk --cache-type-k |  | 1 | LLAMA_ARG_CACHE_TYPE_K
-ctv --cache-type-v |  | 1 | LLAMA_ARG_CACHE_TYPE_V
-dt --defrag-thold |  | 1 | LLAMA_ARG_DEFRAG_THOLD
-np --parallel |  | 1 | LLAMA_ARG_N_PARALLEL
-cb --cont-batching | -nocb --no-cont-batching | switch | LLAMA_ARG_CONT_BATCHING
-mm --mmproj |  | 1 | LLAMA_ARG_MMPROJ
-mmu --mmproj-url |  | 1 | LLAMA_ARG_MMPROJ_URL
--mmproj-auto | --no-mmproj --no-mmproj-auto | switch | LLAMA_ARG_MMPROJ_AUTO
--mmproj-offload | --no-mmproj-offload | switch | LLAMA_ARG_MMPROJ_OFFLOAD
--image-min-tokens |  | 1 | LLAMA_ARG_IMAGE_MIN_TOKENS
--image-max-tokens |  | 1 | LLAMA_ARG_IMAGE_MAX_TOKENS
--mtmd-batch-max-tokens |  | 1 | LLAMA_ARG_MTMD_BATCH_MAX_TOKENS
--video-fps |  | 1 | LLAMA_ARG_VIDEO_FPS
--video-timestamp-interval |  | 1 | LLAMA_ARG_VIDEO_TIMESTAMP_INTERVAL
--video-ffmpeg-dir |  | 1 | LLAMA_ARG_VIDEO_FFMPEG_DIR
--rpc |  | 1 | LLAMA_ARG_RPC
-lm --load-mode |  | 1 | LLAMA_ARG_LOAD_MODE
-lzm --lazy-mode |  | 1 | LLAMA_ARG_LAZY_MODE
--numa |  | 1 | LLAMA_ARG_NUMA
-dev --device |  | 1 | LLAMA_ARG_DEVICE
--list-devices |  | switch | -
-ot --override-tensor |  | 1 | LLAMA_ARG_OVERRIDE_TENSOR
-cmoe --cpu-moe |  | switch | LLAMA_ARG_CPU_MOE
-ncmoe --n-cpu-moe |  | 1 | LLAMA_ARG_N_CPU_MOE
-ncffn --n-cpu-ffn |  | 1 | LLAMA_ARG_N_CPU_FFN
-ngl --gpu-layers --n-gpu-layers |  | 1 | LLAMA_ARG_N_GPU_LAYERS
-sm --split-mode |  | 1 | LLAMA_ARG_SPLIT_MODE
-ts --tensor-split |  | 1 | LLAMA_ARG_TENSOR_SPLIT
-mg --main-gpu |  | 1 | LLAMA_ARG_MAIN_GPU
-fit --fit |  | 1 | LLAMA_ARG_FIT
-fitt --fit-target |  | 1 | LLAMA_ARG_FIT_TARGET
-fitc --fit-ctx |  | 1 | LLAMA_ARG_FIT_CTX
--check-tensors |  | switch | -
--override-kv |  | 1 | -
--op-offload | --no-op-offload | switch | -
--lora |  | 1 | -
--lora-scaled |  | 1 | -
--control-vector |  | 1 | -
--control-vector-scaled |  | 1 | -
--control-vector-layer-range |  | 2 | -
-a --alias |  | 1 | LLAMA_ARG_ALIAS
--tags |  | 1 | LLAMA_ARG_TAGS
-m --model |  | 1 | LLAMA_ARG_MODEL
-mu --model-url |  | 1 | LLAMA_ARG_MODEL_URL
-dr --docker-repo |  | 1 | LLAMA_ARG_DOCKER_REPO
-hf -hfr --hf-repo |  | 1 | LLAMA_ARG_HF_REPO
-hff --hf-file |  | 1 | LLAMA_ARG_HF_FILE
-hft --hf-token |  | 1 | HF_TOKEN
--embd-normalize |  | 1 | -
--host |  | 1 | LLAMA_ARG_HOST
--port |  | 1 | LLAMA_ARG_PORT
--reuse-port |  | switch | LLAMA_ARG_REUSE_PORT
--path |  | 1 | LLAMA_ARG_STATIC_PATH
--cors-origins |  | 1 | LLAMA_ARG_CORS_ORIGINS
--cors-methods |  | 1 | LLAMA_ARG_CORS_METHODS
--cors-headers |  | 1 | LLAMA_ARG_CORS_HEADERS
--cors-credentials | --no-cors-credentials | switch | LLAMA_ARG_CORS_CREDENTIALS
--api-prefix |  | 1 | LLAMA_ARG_API_PREFIX
--ui-config --webui-config |  | 1 | LLAMA_ARG_UI_CONFIG
--ui-config-file --webui-config-file |  | 1 | LLAMA_ARG_UI_CONFIG_FILE
--ui-mcp-proxy --webui-mcp-proxy | --no-ui-mcp-proxy --no-webui-mcp-proxy | switch | LLAMA_ARG_UI_MCP_PROXY
--tools |  | 1 | LLAMA_ARG_TOOLS
--tools-runtime |  | 1 | LLAMA_ARG_TOOLS_RUNTIME
--mcp-servers-config |  | 1 | LLAMA_ARG_MCP_SERVERS_CONFIG
--mcp-servers-json |  | 1 | LLAMA_ARG_MCP_SERVERS_JSON
-ag --agent | -no-ag --no-agent | switch | LLAMA_ARG_AGENT
--ui --webui | --no-ui --no-webui | switch | LLAMA_ARG_UI
--embedding --embeddings |  | switch | LLAMA_ARG_EMBEDDINGS
--rerank --reranking |  | switch | LLAMA_ARG_RERANKING
--api-key |  | 1 | LLAMA_API_KEY
--api-key-file |  | 1 | LLAMA_ARG_API_KEY_FILE
--ssl-key-file |  | 1 | LLAMA_ARG_SSL_KEY_FILE
--ssl-cert-file |  | 1 | LLAMA_ARG_SSL_CERT_FILE
--chat-template-kwargs |  | 1 | LLAMA_ARG_CHAT_TEMPLATE_KWARGS
-to --timeout |  | 1 | LLAMA_ARG_TIMEOUT
--sse-ping-interval |  | 1 | LLAMA_ARG_SSE_PING_INTERVAL
--threads-http |  | 1 | LLAMA_ARG_THREADS_HTTP
--cache-prompt | --no-cache-prompt | switch | LLAMA_ARG_CACHE_PROMPT
--cache-reuse |  | 1 | LLAMA_ARG_CACHE_REUSE
--metrics |  | switch | LLAMA_ARG_ENDPOINT_METRICS
--props |  | switch | LLAMA_ARG_ENDPOINT_PROPS
--slots | --no-slots | switch | LLAMA_ARG_ENDPOINT_SLOTS
--slot-save-path |  | 1 | -
--media-path |  | 1 | -
--models-dir |  | 1 | LLAMA_ARG_MODELS_DIR
--models-preset |  | 1 | LLAMA_ARG_MODELS_PRESET
--models-max |  | 1 | LLAMA_ARG_MODELS_MAX
--models-autoload | --no-models-autoload | switch | LLAMA_ARG_MODELS_AUTOLOAD
--jinja | --no-jinja | switch | LLAMA_ARG_JINJA
--reasoning-format |  | 1 | LLAMA_ARG_THINK
-rea --reasoning |  | 1 | LLAMA_ARG_REASONING
--reasoning-effort |  | 1 | LLAMA_ARG_REASONING_EFFORT
--reasoning-budget |  | 1 | LLAMA_ARG_THINK_BUDGET
--reasoning-budget-message |  | 1 | LLAMA_ARG_THINK_BUDGET_MESSAGE
--reasoning-preserve | --no-reasoning-preserve | switch | LLAMA_ARG_REASONING_PRESERVE
--chat-template |  | 1 | LLAMA_ARG_CHAT_TEMPLATE
--chat-template-file |  | 1 | LLAMA_ARG_CHAT_TEMPLATE_FILE
--skip-chat-parsing | --no-skip-chat-parsing | switch | LLAMA_ARG_SKIP_CHAT_PARSING
--prefill-assistant | --no-prefill-assistant | switch | LLAMA_ARG_PREFILL_ASSISTANT
-sps --slot-prompt-similarity |  | 1 | -
--lora-init-without-apply |  | switch | -
--sleep-idle-seconds |  | 1 | -
--log-disable |  | switch | -
--log-file |  | 1 | LLAMA_ARG_LOG_FILE
--log-jsonl | --no-log-jsonl | switch | LLAMA_ARG_LOG_JSONL
--log-prompts-dir |  | 1 | -
--log-colors |  | 1 | LLAMA_ARG_LOG_COLORS
-v --verbose --log-verbose |  | switch | -
--offline |  | switch | LLAMA_ARG_OFFLINE
-lv --verbosity --log-verbosity |  | 1 | LLAMA_ARG_LOG_VERBOSITY
--log-prefix | --no-log-prefix | switch | LLAMA_ARG_LOG_PREFIX
--log-timestamps | --no-log-timestamps | switch | LLAMA_ARG_LOG_TIMESTAMPS
--spec-draft-hf -hfd -hfrd --hf-repo-draft |  | 1 | LLAMA_ARG_SPEC_DRAFT_HF_REPO
--spec-draft-threads -td --threads-draft |  | 1 | -
--spec-draft-threads-batch -tbd --threads-batch-draft |  | 1 | -
--spec-draft-cpu-mask -Cd --cpu-mask-draft |  | 1 | -
--spec-draft-cpu-range -Crd --cpu-range-draft |  | 1 | -
--spec-draft-cpu-strict --cpu-strict-draft |  | 1 | -
--spec-draft-prio --prio-draft |  | 1 | -
--spec-draft-poll --poll-draft |  | 1 | -
--spec-draft-cpu-mask-batch -Cbd --cpu-mask-batch-draft |  | 1 | -
--spec-draft-cpu-strict-batch --cpu-strict-batch-draft |  | 1 | -
--spec-draft-prio-batch --prio-batch-draft |  | 1 | -
--spec-draft-poll-batch --poll-batch-draft |  | 1 | -
--spec-draft-type-k -ctkd --cache-type-k-draft |  | 1 | LLAMA_ARG_SPEC_DRAFT_CACHE_TYPE_K
--spec-draft-type-v -ctvd --cache-type-v-draft |  | 1 | LLAMA_ARG_SPEC_DRAFT_CACHE_TYPE_V
--spec-draft-override-tensor -otd --override-tensor-draft |  | 1 | -
--spec-draft-cpu-moe -cmoed --cpu-moe-draft |  | switch | LLAMA_ARG_SPEC_DRAFT_CPU_MOE
--spec-draft-n-cpu-moe --spec-draft-ncmoe -ncmoed --n-cpu-moe-draft |  | 1 | LLAMA_ARG_SPEC_DRAFT_N_CPU_MOE
--spec-draft-n-max |  | 1 | LLAMA_ARG_SPEC_DRAFT_N_MAX
--spec-draft-n-min |  | 1 | LLAMA_ARG_SPEC_DRAFT_N_MIN
--spec-synth-len |  | 1 | LLAMA_ARG_SPEC_SYNTH_LEN
--spec-synth-rates |  | 1 | LLAMA_ARG_SPEC_SYNTH_RATES
--spec-draft-p-split --draft-p-split |  | 1 | LLAMA_ARG_SPEC_DRAFT_P_SPLIT
--spec-draft-p-min --draft-p-min |  | 1 | LLAMA_ARG_SPEC_DRAFT_P_MIN
--spec-draft-backend-sampling | --no-spec-draft-backend-sampling | switch | LLAMA_ARG_SPEC_DRAFT_BACKEND_SAMPLING
--spec-draft-sampling |  | 1 | LLAMA_ARG_SPEC_DRAFT_SAMPLING
--spec-draft-device -devd --device-draft |  | 1 | -
--spec-draft-ngl -ngld --gpu-layers-draft --n-gpu-layers-draft |  | 1 | LLAMA_ARG_N_GPU_LAYERS_DRAFT
--spec-draft-model -md --model-draft |  | 1 | LLAMA_ARG_SPEC_DRAFT_MODEL
--spec-type |  | 1 | LLAMA_ARG_SPEC_TYPE
--spec-ngram-mod-n-min |  | 1 | -
--spec-ngram-mod-n-max |  | 1 | -
--spec-ngram-mod-n-match |  | 1 | -
--spec-ngram-simple-size-n |  | 1 | -
--spec-ngram-simple-size-m |  | 1 | -
--spec-ngram-simple-min-hits |  | 1 | -
--spec-ngram-map-k-size-n |  | 1 | -
--spec-ngram-map-k-size-m |  | 1 | -
--spec-ngram-map-k-min-hits |  | 1 | -
--spec-ngram-map-k4v-size-n |  | 1 | -
--spec-ngram-map-k4v-size-m |  | 1 | -
--spec-ngram-map-k4v-min-hits |  | 1 | -
--draft --draft-n --draft-max |  | 1 | LLAMA_ARG_DRAFT_MAX
--draft-min --draft-n-min |  | 1 | LLAMA_ARG_DRAFT_MIN
--spec-ngram-size-n |  | 1 | -
--spec-ngram-size-m |  | 1 | -
--spec-ngram-min-hits |  | 1 | -
--embd-gemma-default |  | switch | -
--fim-qwen-1.5b-default |  | switch | -
--fim-qwen-3b-default |  | switch | -
--fim-qwen-7b-default |  | switch | -
--fim-qwen-7b-spec |  | switch | -
--fim-qwen-14b-spec |  | switch | -
--fim-qwen-30b-default |  | switch | -
--gpt-oss-20b-default |  | switch | -
--gpt-oss-120b-default |  | switch | -
--vision-gemma-4b-default |  | switch | -
--vision-gemma-12b-default |  | switch | -
--spec-default |  | switch | -
-mmdev --mmproj-device |  | 1 | MTMD_BACKEND_DEVICE
"""


def _rows():
    for line in EXPECTED.strip().splitlines():
        spellings, negs, arity, env = (part.strip() for part in line.split("|"))
        yield spellings.split(), negs.split(), arity, None if env == "-" else env


ROWS = list(_rows())
M = ["-m", "model.gguf"]


def test_the_expected_table_is_whole():
    assert len(ROWS) == 256
    names = [n for spellings, negs, _, _ in ROWS for n in (*spellings, *negs)]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("spellings,negs,arity,env", ROWS, ids=[r[0][-1] for r in ROWS])
def test_each_llama_server_flag_has_its_arity_aliases_and_variable(spellings, negs, arity, env):
    f, on = flags.SPELLINGS[spellings[0]]
    for name in spellings:
        assert flags.SPELLINGS[name] == (f, True), name
    for name in negs:
        assert flags.SPELLINGS[name] == (f, False), name
    assert {"switch": f.type == "switch", "1": f.type not in ("switch", "pair"), "2": f.type == "pair"}[arity], f
    assert f.env == env


@pytest.mark.parametrize("spellings,negs,arity,env", ROWS, ids=[r[0][-1] for r in ROWS])
def test_each_flag_is_read_with_its_arity(spellings, negs, arity, env):
    f, _ = flags.SPELLINGS[spellings[0]]
    name = spellings[-1]
    if arity == "switch":
        with pytest.raises(SettingsError, match="is a switch and takes no value"):
            parse(M + [f"{name}=1"] if name.startswith("--") else M + [f"--{name.lstrip('-')}=1"], {})
    else:
        with pytest.raises(SettingsError, match=f"{name} needs {'two values' if arity == '2' else 'a value'}"):
            parse(M + [name], {})
    if f.action == "refuse":     # with its values it is read whole, then refused naming it
        values = {"switch": [], "1": ["x"], "2": ["1", "2"]}[arity]
        with pytest.raises(SettingsError, match=f"^{name} is refused: "):
            parse(M + [name, *values], {})


def test_help_prints_switches_without_a_value():
    text = flags.help_text()
    assert "(env: switch)" not in text
    for line in text.splitlines():
        head = line.strip()
        for name in ("--cpu-moe", "--list-devices", "--ignore-eos", "--metrics", "--log-jsonl"):
            if head.endswith(name) or head.startswith(f"{name} "):
                assert head.split(", ")[-1] == name, line


def test_llama_server_reads_underscores_as_dashes():
    assert parse(M + ["--ctx_size", "4096"], {}).ctx_size == 4096


def test_a_negated_variable_turns_a_switch_off():
    assert not parse(M, {"LLAMA_ARG_NO_ENDPOINT_SLOTS": "1"}).endpoint_slots   # LLAMA_ARG_ENDPOINT_SLOTS off
    assert parse(M, {"LLAMA_ARG_ENDPOINT_SLOTS": "1"}).endpoint_slots


# --- --model is the model file, as in llama-server; a seat word where no such file exists is the seat ---

def _reading(s):
    return [kv for msg, kv in s.notes if msg == "flag read" and kv["flag"] in ("--model", "-m", "--seat")]


def test_model_is_the_model_file_as_llama_servers_tests_write_it():
    s = parse(["--model", "/path/x.gguf", "--port", "8080"], {})
    assert s.model_file == "/path/x.gguf" and s.seat is None
    assert _reading(s) == [{"flag": "--model", "as": "--model", "value": "/path/x.gguf"}]
    assert parse([], {"LLAMA_ARG_MODEL": "/path/x.gguf"}).model_file == "/path/x.gguf"
    assert parse(["--model=/path/x.gguf"], {}).model_file == "/path/x.gguf"


def test_a_seat_word_is_the_seat_where_no_such_file_exists(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    s = parse(["--model", "qwen3", "-m", "x.gguf"], {})
    assert (s.seat, s.model_file) == ("qwen3", "x.gguf")
    assert {"flag": "--model", "as": "--seat", "why": "a seat word, and no file named qwen3 here",
            "value": "qwen3"} in _reading(s)
    (tmp_path / "qwen3").write_bytes(b"GGUF")            # now a file of that name exists: it is the model
    s = parse(["--model", "qwen3"], {})
    assert (s.seat, s.model_file) == (None, "qwen3")
    assert _reading(s) == [{"flag": "--model", "as": "--model", "value": "qwen3"}]


def test_two_model_files_are_refused():
    with pytest.raises(SettingsError, match=r"--model is given twice \(--model and -m\)"):
        parse(["--model", "/a.gguf", "-m", "/b.gguf"], {})


# --- -dev is llama-server's device list; --backend is bloomery's own picker ---

@pytest.mark.parametrize("argv,backend,card,source", [
    ([], "auto", None, "default"),
    (["-dev", "none"], "cpu", None, "-dev none"),
    (["--device", "CUDA0"], "cuda", 0, "-dev CUDA0"),
    (["--backend", "cpu"], "cpu", None, "--backend cpu"),
    (["--backend", "cuda", "-dev", "CUDA0"], "cuda", 0, "-dev CUDA0"),
    (["--backend", "auto", "-dev", "none"], "cpu", None, "-dev none"),
])
def test_device_list_and_backend(argv, backend, card, source):
    s = parse(M + argv, {})
    assert (s.backend, s.card, s.backend_from) == (backend, card, source)
    if "-dev" in argv or "--device" in argv:
        [kv] = [kv for msg, kv in s.notes if msg == "device list read"]
        assert kv["as"] == f"--backend {backend}"


def test_the_plan_refuses_a_card_that_is_not_there():
    from bloomery.stages.common import StageRefusal
    from bloomery.stages.plan import choose_backend
    assert choose_backend("cpu", (), None, "-dev none") == ("numpy", "-dev none")
    assert choose_backend("cuda", (1 << 30,), 0, "-dev CUDA0") == ("cuda", "-dev CUDA0")
    with pytest.raises(StageRefusal, match=r"-dev CUDA2: no such device; CuPy sees 1 card\(s\): CUDA0"):
        choose_backend("cuda", (1 << 30,), 2, "-dev CUDA2")
    with pytest.raises(StageRefusal, match="-dev CUDA0: CuPy sees no card"):
        choose_backend("cuda", (), 0, "-dev CUDA0")


def test_list_devices_prints_llama_servers_listing():
    from bloomery.census import device_list
    assert device_list([]) == "Available devices:\n  (none)\n"
    assert device_list([("NVIDIA H200", 143771 << 20, 140000 << 20)]) == \
        "Available devices:\n  CUDA0: NVIDIA H200 (143771 MiB, 140000 MiB free)\n"
    assert parse(["--list-devices"], {}).list_devices          # no model needed


def test_list_devices_is_a_switch_that_prints_and_exits():
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "bloomery.supervisor", "--list-devices"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("Available devices:\n"), r
    assert "cupy" not in r.stderr       # the census ran in a child; the front never imported CuPy


def test_a_config_file_names_the_seat_or_the_file_under_model(tmp_path, monkeypatch):
    import json
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.json").write_text(json.dumps({"model": "qwen3moe", "model-file": "rel/x.gguf"}))
    s = parse(["--config", "c.json"], {})
    assert (s.seat, s.model_file) == ("qwen3moe", str(tmp_path / "rel" / "x.gguf"))
