"""The flag table: spellings, precedence (7.2), --config rules (7.1), refusals by name."""
from __future__ import annotations

import json

import pytest

from bloomery import settings as S
from bloomery.settings import SettingsError, parse

M = ["-m", "model.gguf"]


def refused(argv, env=None, match=""):
    with pytest.raises(SettingsError, match=match) as ei:
        parse(argv, env or {})
    return str(ei.value)


def cfg(tmp_path, obj, name="c.json"):
    p = tmp_path / name
    p.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return str(p)


def test_defaults():
    s = parse(M, {})
    assert (s.host, s.port, s.parallel, s.ctx_size, s.n_predict, s.backend) == ("127.0.0.1", 8080, 1, None, -1, "auto")
    assert s.api_keys == () and s.jinja and not s.plan


@pytest.mark.parametrize("argv,field,value", [
    (["-c", "4096"], "ctx_size", 4096), (["--ctx-size=2048"], "ctx_size", 2048), (["--ctx", "512"], "ctx_size", 512),
    (["-np", "3"], "parallel", 3), (["--parallel", "auto"], "parallel", "auto"), (["-a", "coder"], "alias", "coder"),
    (["--port", "0"], "port", 0), (["-n", "-1"], "n_predict", -1), (["--predict", "7"], "n_predict", 7),
    (["--backend", "cpu"], "backend", "cpu"), (["--model", "qwen2"], "seat", "qwen2"), (["--plan"], "plan", True),
    (["-ngl", "99"], "ngl", "99"), (["-ngl", "all"], "ngl", "all"),
])
def test_spellings(argv, field, value):
    assert getattr(parse(M + argv, {}), field) == value


def test_model_file_long_and_env():
    assert parse(["--model-file", "a.gguf"], {}).model_file == "a.gguf"
    assert parse([], {"LLAMA_ARG_MODEL": "b.gguf"}).model_file == "b.gguf"
    assert parse([], {}).router and not parse([], {"LLAMA_ARG_MODEL": "b.gguf"}).router   # no model: router mode


def test_precedence_command_line_over_config_over_env(tmp_path):
    c = cfg(tmp_path, {"ctx-size": 2048, "port": 9000, "alias": "from-file"})
    env = {"LLAMA_ARG_CTX_SIZE": "1024", "LLAMA_ARG_PORT": "7000", "LLAMA_ARG_HOST": "0.0.0.0",
           "LLAMA_ARG_ALIAS": "from-env"}
    s = parse(M + ["--config", c, "-c", "4096"], env)
    assert s.ctx_size == 4096 and s.sources["ctx_size"] == "command line"
    assert s.port == 9000 and s.sources["port"].startswith("config")
    assert s.host == "0.0.0.0" and s.sources["host"] == "LLAMA_ARG_HOST"
    assert s.alias == "from-file"
    replaced = [kv for msg, kv in s.notes if msg == "setting replaced"]
    assert {"entry": "LLAMA_ARG_CTX_SIZE", "by": "-c"} in replaced
    assert any(kv["entry"] == "--config key 'ctx-size'" for kv in replaced)


def test_api_keys_add_and_command_line_replaces_config_list(tmp_path):
    kf = tmp_path / "keys"
    kf.write_text("# comment\n\nk-file\n")
    c = cfg(tmp_path, {"api-key": ["c1", "c2"]})
    s = parse(M + ["--config", c, "--api-key", 'k1,"k,2"', "--api-key-file", str(kf)], {"LLAMA_API_KEY": "k-env"})
    assert set(s.api_keys) == {"k1", "k,2", "k-file", "k-env"}       # config's list replaced by --api-key
    s = parse(M + ["--config", c], {"LLAMA_API_KEY": "k-env"})
    assert set(s.api_keys) == {"c1", "c2", "k-env"}


def test_no_note_prints_a_key(tmp_path):
    s = parse(M + ["--api-key", "sekrit-1"], {"LLAMA_API_KEY": "sekrit-2"})
    assert "sekrit" not in repr(s.notes) and "sekrit" not in repr(s.redacted())


@pytest.mark.parametrize("argv,match", [
    (["-c", "1", "--ctx-size", "2"], "given twice"),
    (["--slots", "--no-slots"], "given twice"),
    (["-c", "big"], "--ctx-size takes an integer, got 'big'"),
    (["--port", "70000"], "--port 70000: must be in 0 .. 65535"),
    (["-np", "0"], "--parallel 0"),
    (["--temp", "nan"], "finite"),
    (["--frobnicate"], "unknown flag '--frobnicate'"),
    (["stray"], "a value with no flag"),
    (["-c"], "-c needs a value"),
    (["--plan=yes"], "switch and takes no value"),
    (["--seat", "llama"], "--seat takes one of qwen2, qwen3, qwen3moe"),
    (["--model", "/x.gguf"], r"--model is given twice \(-m and --model\)"),
    (["--backend", "tpu"], "--backend takes one of cpu, cuda, auto"),
    (["--device", "tpu"], "-dev tpu: no device of that name here"),
    (["-dev", "none", "--backend", "cuda"], "-dev none beside --backend cuda"),
    (["-hf", "org/repo"], "give one model source"),
    (["-dev", "CUDA0,CUDA1"], "-dev CUDA0,CUDA1: several devices are not served yet"),
    (["-sm", "row"], "-sm row: splitting one layer's weights over cards is not served"),
    (["--lora", "a.gguf"], "--lora is refused"),
    (["--mmproj", "x"], "--mmproj is refused"),
    (["--pooling", "rank"], "--pooling rank: reranking needs a reranker"),
    (["--grammar", "root ::= x"], "--grammar is refused"),
    (["--slot-ctx", "1024", "-c", "4096"], "--slot-ctx beside --ctx-size"),
    (["-np", "auto", "-c", "4096"], "--parallel auto beside --ctx-size"),
    (["--api-key", ""], "empty API key"),
    (["--api-key", "a,,b"], "empty API key"),
    (["-n", "-2"], "--n-predict -2"),
    (["-ngl", "lots"], "-ngl 'lots'"),
    (["--chat-template-file", "/nonexistent/t.jinja"], "cannot read"),
    (["--api-key-file", "/nonexistent/keys"], "cannot read"),
    (["--seed", "-5"], "--seed -5"),
])
def test_refusals_name_the_problem(argv, match):
    refused(M + argv, {}, match)


@pytest.mark.parametrize("env,match", [
    ({"LLAMA_ARG_SPLIT_MODE": "row"}, "LLAMA_ARG_SPLIT_MODE"),
    ({"LLAMA_ARG_DEVICE": "CUDA0,CUDA1"}, "several devices are not served yet"),
    ({"LLAMA_ARG_CTX_SIZE": "lots"}, "LLAMA_ARG_CTX_SIZE: --ctx-size takes an integer"),
    ({"LLAMA_API_KEY": ""}, "empty API key"),
    ({"LLAMA_ARG_EMBEDDINGS": "maybe"}, "LLAMA_ARG_EMBEDDINGS='maybe'"),
    ({"LLAMA_ARG_POOLING": "rank"}, "--pooling rank: reranking needs"),
])
def test_env_refusals_name_the_variable(env, match):
    refused(M, env, match)


def test_noop_flags_are_read_and_recorded():
    s = parse(M + ["-t", "4", "-b", "512", "-fa", "on", "--no-mmap", "--no-webui", "-cb",
                   "--no-warmup", "-v", "--kv-unified", "--context-shift", "--cache-reuse", "256", "--no-jinja"], {})
    flags = [kv["flag"] for msg, kv in s.notes if msg == "flag read, no effect here"]
    assert s.threads == 4                          # -t: the offload tier's host threads
    assert flags == ["-fa", "--no-mmap", "--no-webui", "-cb", "--context-shift", "--cache-reuse", "--no-jinja"]
    assert s.kv_unified and s.cache_idle_slots      # --kv-unified: idle slots saved are emptied too
    assert s.jinja and not s.warmup          # --no-warmup has an effect: it is honoured, not noted
    assert s.batch_size == 512               # -b too: return_progress's pass size, /infill's budget
    assert s.verbose                         # -v has one too: answers carry __verbose
    refused(M + ["-t", "x"], {}, "--threads takes an integer")
    on = parse(M, {"LLAMA_ARG_EMBEDDINGS": "1", "LLAMA_ARG_POOLING": "mean"})
    assert on.embeddings and on.pooling == "mean" and on.embd_normalize == 2
    assert parse(M + ["--embd-normalize", "-1", "--pooling", "last"], {}).embd_normalize == -1
    off = parse(M + ["--no-cache-idle-slots"], {})
    assert not off.cache_idle_slots and not off.kv_unified
    assert not parse(M, {"LLAMA_ARG_CACHE_IDLE_SLOTS": "0"}).cache_idle_slots


def test_unknown_llama_variable_gets_a_line():
    s = parse(M, {"LLAMA_ARG_SOMETHING_NEW": "1", "LLAMA_ARG_THREADS_HTTP": "8", "LLAMA_ARG_THREADS": "8",
                  "PATH": "/bin"})
    assert ("env variable not read by bloomery", {"variable": "LLAMA_ARG_SOMETHING_NEW"}) in s.notes
    assert any(kv.get("flag") == "LLAMA_ARG_THREADS_HTTP" for _, kv in s.notes)
    assert s.threads == 8


def test_sampling_defaults_are_kept():
    s = parse(M + ["--temp", "0", "--seed", "42", "--top-k", "10"], {})
    assert s.sampling_defaults == {"temperature": 0.0, "seed": 42, "top_k": 10}


def test_sampling_flags_become_the_request_defaults():
    from bloomery.engine.types import SamplingParams
    s = parse(M + ["--temp", "0.2", "--top-k", "5", "--min-p", "0", "--repeat-penalty", "1.1", "--repeat-last-n",
                   "-1", "--presence-penalty", "0.5", "--frequency-penalty", "0.25", "--seed", "-1", "-n", "9"],
              {"LLAMA_ARG_TOP_P": "0.9"})
    assert s.sampling() == SamplingParams(temperature=0.2, top_k=5, top_p=0.9, min_p=0.0, repeat_penalty=1.1,
                                          repeat_last_n=-1, presence_penalty=0.5, frequency_penalty=0.25,
                                          seed=0xFFFFFFFF)
    assert s.n_predict == 9
    assert parse(M, {}).sampling() == SamplingParams()       # no flag: llama-server's own defaults
    assert not [m for m, _ in s.notes if "not applied" in m or "no effect" in m]


@pytest.mark.parametrize("argv,match", [
    (["--top-p", "1.5"], "--top-p 1.5: must be in 0 .. 1"),
    (["--min-p", "-0.1"], "--min-p -0.1: must be in 0 .. 1"),
    (["--repeat-penalty", "0"], "--repeat-penalty 0: must be above 0"),
    (["--seed", "-2"], "--seed -2: must be in -1"),
    (["--temp", "nan"], "--temp must be finite"),
])
def test_bad_sampling_flags_are_refused_by_name(argv, match):
    refused(M + argv, {}, match)


def test_slots_and_metrics_switches():
    assert parse(M, {}).endpoint_slots and not parse(M, {}).metrics
    assert not parse(M + ["--no-slots"], {}).endpoint_slots
    assert not parse(M, {"LLAMA_ARG_ENDPOINT_SLOTS": "0"}).endpoint_slots
    s = parse(M + ["--metrics"], {})
    assert s.metrics and any(kv == {"flag": "--metrics"} and "/metrics is served" in m for m, kv in s.notes)


def test_config_file_values(tmp_path):
    c = cfg(tmp_path, {"model-file": "rel/model.gguf", "ctx-size": "8192", "parallel": 2, "host": "0.0.0.0",
                       "metrics": True, "no-webui": True})
    s = parse(["--config", c], {})
    assert s.model_file.endswith("/rel/model.gguf") and s.model_file.startswith("/")
    assert (s.ctx_size, s.parallel, s.host) == (8192, 2, "0.0.0.0")
    read = [kv for msg, kv in s.notes if msg == "config entry read"]
    assert {"key": "ctx-size", "as": "--ctx-size", "value": 8192} in read
    assert {"key": "model", "as": "--model", "value": "set"} in read


@pytest.mark.parametrize("obj,match", [
    ("[1, 2]", "must be one JSON object"),
    ("{nope", "not JSON"),
    ('{"ctx-size": 1, "ctx-size": 2}', "named twice"),
    ({"--ctx-size": 1}, "without their dashes"),
    ({"plan": True}, "asks the start to do something"),
    ({"config": "x.json"}, "asks the start to do something"),
    ({"help": True}, "asks the start to do something"),
    ({"ctx_size": 1}, "no such flag"),
    ({"c": 1}, "no such flag"),
    ({"metrics": False}, "is no value"),
    ({"alias": None}, "is no value"),
    ({"alias": {"a": 1}}, "is no value"),
    ({"api-key": []}, "empty list"),
    ({"metrics": "yes"}, "is a switch"),
    ({"ctx-size": True}, "takes a value"),
    ({"ctx-size": [1, 2]}, "taken once"),
    ({"ctx-size": 1.5}, "takes int"),
    ({"hf-repo": "a/b"}, "give one model source"),
])
def test_config_refusals(tmp_path, obj, match):
    refused(["-m", "x", "--config", cfg(tmp_path, obj)], {}, match)


def test_config_twice_and_missing(tmp_path):
    c = cfg(tmp_path, {})
    refused(M + ["--config", c, "--config", c], {}, "--config is given twice")
    refused(M + ["--config", str(tmp_path / "none.json")], {}, "cannot read")


def test_help_prints_the_table():
    text = S.help_text()
    for f in S.TABLE:
        assert f.long in text
    assert "LLAMA_ARG_CTX_SIZE" in text and "-np" in text
    assert parse(["--help"], {}).help and parse(["-h"], {}).help   # no model needed


def test_every_row_is_consistent():
    envs = [f.env for f in S.TABLE if f.env]
    assert len(envs) == len(set(envs)), "an env variable names two flags"
    for f in S.TABLE:
        assert f.action in ("set", "noop", "refuse") and f.help
        assert f.type in ("str", "int", "float", "switch", "keys", "choice", "int_or_auto", "path", "pair")
        assert not f.choices or f.type == "choice"


def test_metrics_text_says_it_is_served_with_the_flag():
    """--help, the flag's note and the start record: GET /metrics is served with --metrics."""
    import io

    from bloomery import records
    from bloomery.front import choice_records
    help_lines = S.help_text().splitlines()
    at = next(i for i, ln in enumerate(help_lines) if ln.strip().startswith("--metrics"))
    assert "not served" not in help_lines[at + 1] and "serve GET /metrics" in help_lines[at + 1]
    out = io.StringIO()
    records.configure("bloomery-serve", stream=out)
    try:
        choice_records(parse(M + ["--metrics"], {}), {"arch": "qwen2", "backend": "numpy"})
        choice_records(parse(M, {}), {"arch": "qwen2", "backend": "numpy"})
    finally:
        records.configure("bloomery-serve", stream=None)
    ends = [ln for ln in out.getvalue().splitlines() if "endpoints" in ln]
    assert "metrics=served" in ends[0] and 'metrics="not served (501 without --metrics)"' in ends[1], ends


def test_sleep_idle_seconds_as_llama_server():
    assert parse(M, {}).sleep_idle_seconds == -1
    assert parse(M + ["--sleep-idle-seconds", "30"], {}).sleep_idle_seconds == 30
    for bad in ("0", "-2"):
        refused(M + ["--sleep-idle-seconds", bad], match="cannot be 0 or less than -1")


def test_checkpoint_min_step_as_llama_server():
    """-cms/--checkpoint-min-step, LLAMA_ARG_CHECKPOINT_MIN_SPACING_NT: arg.cpp's default (8192), 0 for no minimum,
    a negative value refused in its words; sent to the engine stage."""
    from bloomery.engine.limits import CHECKPOINT_MIN_STEP
    assert parse(M, {}).checkpoint_min_step == CHECKPOINT_MIN_STEP == 8192
    assert parse(M + ["-cms", "256"], {}).checkpoint_min_step == 256
    assert parse(M + ["--checkpoint-min-step", "0"], {}).checkpoint_min_step == 0
    assert parse(M + ["--checkpoint-min-step=64"], {}).checkpoint_min_step == 64
    s = parse(M, {"LLAMA_ARG_CHECKPOINT_MIN_SPACING_NT": "1024"})
    assert s.checkpoint_min_step == 1024 and s.sources["checkpoint_min_step"] == "LLAMA_ARG_CHECKPOINT_MIN_SPACING_NT"
    assert parse(M + ["-cms", "5"], {"LLAMA_ARG_CHECKPOINT_MIN_SPACING_NT": "1024"}).checkpoint_min_step == 5
    for argv, env in ((M + ["-cms", "-1"], {}), (M + ["--checkpoint-min-step", "-300"], {}),
                      (M, {"LLAMA_ARG_CHECKPOINT_MIN_SPACING_NT": "-2"})):
        refused(argv, env, match=r"^--checkpoint-min-step -\d+: checkpoint-min-step must be non-negative$")
    refused(M + ["-cms", "many"], match="--checkpoint-min-step takes an integer")


def test_cache_ram_as_llama_server_but_always_with_a_budget():
    assert parse(M, {}).cache_ram is None                              # the plan's default
    assert parse(M + ["-cram", "512"], {}).cache_ram == 512
    assert parse(M + ["--cache-ram", "0"], {}).cache_ram == 0           # off
    assert parse(M, {"LLAMA_ARG_CACHE_RAM": "64"}).cache_ram == 64
    for argv in (M + ["-cram", "-1"], M + ["--cache-ram", "-5"]):
        msg = refused(argv, match=r"--cache-ram -\d+: the prompt cache always has a budget")
        assert "-1, no limit, is refused" in msg
    refused(M, {"LLAMA_ARG_CACHE_RAM": "-1"}, match="always has a budget")


def test_ubatch_size_is_read_as_llama_server_reads_it():
    """-ub / --ubatch-size / LLAMA_ARG_UBATCH: the most ids one prompt pass computes, handed to the plan (which counts
    that pass's scratch and tells the load); absent, each backend keeps its own pass; 0 or less is refused by name."""
    assert parse(M + ["-ub", "512"], {}).ubatch_size == 512
    assert parse(M + ["--ubatch-size", "64"], {}).ubatch_size == 64
    assert parse(M, {"LLAMA_ARG_UBATCH": "256"}).ubatch_size == 256
    assert parse(M, {}).ubatch_size is None
    refused(M + ["-ub", "0"], {}, r"--ubatch-size 0: must be >= 1")
    refused(M + ["-ub", "x"], {}, "--ubatch-size takes an integer")
