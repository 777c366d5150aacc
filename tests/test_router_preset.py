"""Router presets (--models-preset FILE, llama-server's INI presets): the file read as common/preset.cpp reads it,
the model list they join (bloomery/router/catalog.py), and GET /models?reload=1 reconciling a running router's
models with a changed file (bloomery/router/pool.py). Pure or in one event loop: no model is loaded; the
reload's children are stand-ins that answer /health at once."""
from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from bloomery.http.types import Request
from bloomery.router import pool as pool_module
from bloomery.router.catalog import CACHE, PRESET, CatalogError, catalog
from bloomery.router.preset import PresetError, canonical_name, read_text
from bloomery.router.routes import Router
from bloomery.router.serve import ROUTER_ONLY
from bloomery.settings import argv_without, parse

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "llama_server_suite"))
import presets as suite_presets  # noqa: E402


def values(opts) -> dict[str, str]:
    return {ident: o.value for ident, o in opts.items()}


# -- the INI file -------------------------------------------------------------------------------
def test_sections_keys_comments_and_the_global_section():
    glob, models = read_text(
        "version = 1\n"
        "; a comment line\n"
        "  # another, indented\n"
        "[*]\r\n"
        "c = 8192\n"
        "n-gpu-layers = 8\n"
        "\n"
        "[ ggml-org/MY-MODEL-GGUF:q8_0 ]\n"
        "chat-template = chatml   ; the rest of the line is a comment\n"
        "jinja = true\n"
        "no-mmap = 1\n"
        "LLAMA_ARG_CACHE_RAM = 0\n"
        "model-draft=./draft.gguf#no blank before the comment\n"
        "[custom_model]\n"
        "model = /models/my-awesome-model-Q4_K_M.gguf\n", "my.ini")
    assert values(glob) == {"--ctx-size": "8192", "-ngl": "8"}        # c and n-gpu-layers: their flags
    assert list(models) == ["ggml-org/MY-MODEL-GGUF:Q8_0", "custom_model"]    # the tag as a quant is written
    assert values(models["ggml-org/MY-MODEL-GGUF:Q8_0"]) == {
        "--chat-template": "chatml", "--jinja": "true", "--mmap": "false",     # no-mmap = 1: --mmap off
        "--cache-ram": "0", "--model-draft": "./draft.gguf"}
    assert values(models["custom_model"]) == {"--model": "/models/my-awesome-model-Q4_K_M.gguf"}


def test_keys_before_any_section_are_the_default_model_and_an_empty_one_is_dropped():
    assert read_text("version = 1\n[a]\nmodel = /x.gguf\n", "f.ini")[1].keys() == {"a"}
    _, models = read_text("model = /x.gguf\n[a]\nmodel = /y.gguf\n", "f.ini")
    assert values(models["default"]) == {"--model": "/x.gguf"}


def test_a_later_key_wins_and_a_section_named_twice_starts_again():
    _, models = read_text("[a]\nc = 1\nctx-size = 2\n[b]\nc = 5\n[a]\nseed = 3\n", "f.ini")
    assert values(models["a"]) == {"--seed": "3"} and values(models["b"]) == {"--ctx-size": "5"}


@pytest.mark.parametrize("tag,canon", [("q8_0", "Q8_0"), ("Q4_K_M", "Q4_K_M"), ("model-q4_k_m", "Q4_K_M"),
                                       ("x.f16", "F16"), ("weird tag", "WEIRD TAG")])
def test_a_sections_tag_is_written_as_llama_server_writes_a_quant(tag, canon):
    assert canonical_name(f"owner/repo:{tag}") == f"owner/repo:{canon}"
    assert canonical_name("plain-name") == "plain-name" and canonical_name("*") == "*"


def test_switch_values_and_negated_spellings():
    _, models = read_text("[a]\nmetrics = on\nno-slots = true\ncont-batching = 0\nLLAMA_ARG_NO_JINJA = 1\n", "f")
    opts = models["a"]
    assert values(opts) == {"--metrics": "true", "--slots": "false", "--cont-batching": "false", "--jinja": "false"}
    assert [w for o in opts.values() for w in o.argv()] == ["--metrics", "--no-slots", "--no-cont-batching",
                                                          "--no-jinja"]


@pytest.mark.parametrize("text,words", [
    ("[a]\nno-such-flag = 1\n", ["my.ini", "line 2", "unknown key 'no-such-flag'"]),
    ("[a]\njinja = maybe\n", ["my.ini", "jinja is a switch", "'maybe'"]),
    ("[a]\nctx-size =\n", ["my.ini", "ctx-size needs a value"]),
    ("[a\nc = 1\n", ["my.ini line 1", "not a [section] header"]),
    ("[a]\njust words\n", ["my.ini line 2", "neither a [section] nor key = value"]),
    ("[a]\nstop-timeout = soon\n", ["stop-timeout", "whole number"]),
    ("[a]\ndedup-cache-models = perhaps\n", ["dedup-cache-models", "no yes/no word"]),
    ("[a]\nalias = other\n", ["alias", "not served"]),
])
def test_bad_input_names_the_file_the_line_and_the_key(text, words):
    with pytest.raises(PresetError) as e:
        read_text(text, "my.ini")
    for w in words:
        assert w in str(e.value)


def test_models_preset_is_read_and_is_the_routers_own_flag():
    s = parse(["--models-preset", "my.ini", "-c", "512"], env={})
    assert s.router and s.models_preset == "my.ini"
    assert argv_without(s.argv, ROUTER_ONLY) == ["-c", "512"]
    assert parse([], env={"LLAMA_ARG_MODELS_PRESET": "env.ini"}).models_preset == "env.ini"


# -- the model list -----------------------------------------------------------------------------
@pytest.fixture
def cache(tmp_path) -> dict[str, str]:
    """The suite's three cached presets (huggingface_hub's layout, as llama.cpp's test preload leaves them)."""
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    suite_presets.write_cache(tmp_path / "llama", model)
    return {"LLAMA_CACHE": str(tmp_path / "llama"), "BLOOMERY_CACHE": str(tmp_path / "bloomery")}


STORIES, INFILL, GEMMA = ("ggml-org/test-model-stories260K:F32", "ggml-org/test-model-stories260K-infill:F32",
                          "ggml-org/tinygemma3-GGUF:Q8_0")
DOWNLOADED = "ggml-org/test-model-router-download:F16"     # test_router.py's MODEL_DOWNLOAD_ID, as it leaves it


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_presets_join_the_cache_and_a_preset_hf_repo_is_the_cached_file(tmp_path, cache):
    ini = write(tmp_path / "p.ini", "[*]\nc = 4096\n[mine]\nhf-repo = ggml-org/test-model-stories260K\nseed = 7\n"
                                    f"[{GEMMA}]\ntemp = 0.1\n[local]\nmodel = /models/x.gguf\n")
    found = catalog(None, cache, ini)
    assert sorted(found) == sorted([STORIES, INFILL, GEMMA, DOWNLOADED, "mine", "local"])
    mine = found["mine"]
    assert mine.source == PRESET and mine.path == found[STORIES].path      # the cached file, no download
    assert mine.args(["-c", "512"]) == ["-c", "512", "--seed", "7", "--model", found[STORIES].path]  # CLI wins
    assert found[STORIES].source == CACHE and found[STORIES].args([]) == ["--ctx-size", "4096", "--model",
                                                                          found[STORIES].path]
    gemma = found[GEMMA]        # a section named as a cached model is that model, with its options
    assert gemma.source == PRESET and gemma.args([]) == ["--ctx-size", "4096", "--temp", "0.1", "--model",
                                                         found[STORIES].path.replace(
                                                             "test-model-stories260K", "tinygemma3-GGUF").replace(
                                                             "stories260K-F32", "tinygemma3-Q8_0")]
    assert found["local"].args([]) == ["--ctx-size", "4096", "--model", "/models/x.gguf"]
    assert all(not e.hidden and e.refusal() is None and e.unfit() is None for e in found.values())


def test_an_hf_repo_not_cached_is_fetched_by_the_child_and_a_quant_or_file_chooses(tmp_path, cache):
    ini = write(tmp_path / "p.ini", "[far]\nhf-repo = someone/Else-GGUF:Q4_K_M\n"
                                    "[tagged]\nhf-repo = ggml-org/tinygemma3-GGUF:q8_0\n"
                                    "[filed]\nhf-repo = ggml-org/test-model-stories260K-infill\n"
                                    "hf-file = stories260K-infill-F32.gguf\n"
                                    "[wrong-quant]\nhf-repo = ggml-org/tinygemma3-GGUF:Q2_K\n")
    found = catalog(None, cache, ini)
    assert found["far"].model_args() == ["--hf-repo", "someone/Else-GGUF:Q4_K_M"]     # online: the child fetches
    assert found["tagged"].path == found[GEMMA].path and found["filed"].path == found[INFILL].path
    assert found["wrong-quant"].model_args() == ["--hf-repo", "ggml-org/tinygemma3-GGUF:Q2_K"]


def test_router_owned_keys_are_dropped_and_refused_flags_refuse_the_model(tmp_path, cache):
    ini = write(tmp_path / "p.ini", "[a]\nmodel = /x.gguf\nport = 1\nhost = 0.0.0.0\napi-key = k\nmodels-max = 9\n"
                                    "[b]\nmodel = /x.gguf\nspec-draft-hf = o/draft\n"
                                    "[c]\nseed = 1\n"
                                    "[d]\nmodel = /x.gguf\nhf-repo = o/r\n")
    found = catalog(None, cache, ini)
    assert found["a"].args([]) == ["--model", "/x.gguf"] and found["a"].refusal() is None
    assert "'spec-draft-hf' (--spec-draft-hf) is refused: speculative decoding" in found["b"].refusal()
    assert found["c"].refusal() is None and "names no model" in found["c"].unfit()
    assert "both model (/x.gguf) and hf-repo (o/r)" in found["d"].unfit()
    assert found["a"].unfit() is None and found["b"].unfit() is None


def test_dedup_hides_the_cache_entries_a_preset_stands_for(tmp_path, cache):
    section = "[model-dedup]\nhf-repo = ggml-org/test-model-stories260K\n" \
              "spec-draft-hf = ggml-org/test-model-stories260K-infill\n"
    hidden = lambda text: {n for n, e in catalog(None, cache, write(tmp_path / "p.ini", text)).items() if e.hidden}
    assert hidden(section + "dedup-cache-models = 1\n") == {STORIES, INFILL}
    assert hidden(section) == set()
    assert hidden("[*]\ndedup-cache-models = true\n\n" + section) == {STORIES, INFILL}
    assert hidden(section + f"dedup-cache-models = 1\n[{STORIES}]\nseed = 1\n") == {INFILL}   # not a pure cache entry


def test_a_preset_file_that_cannot_be_read_is_a_catalog_error(tmp_path, cache):
    with pytest.raises(CatalogError, match="cannot read it"):
        catalog(None, cache, str(tmp_path / "missing.ini"))
    with pytest.raises(CatalogError, match=r"bad\.ini line 2 \[a\]: unknown key 'nope'"):
        catalog(None, cache, write(tmp_path / "bad.ini", "[a]\nnope = 1\n"))


# -- GET /models?reload=1 -----------------------------------------------------------------------
class StandInChild:
    """A child that is ready at once and runs until stopped (pool.py's Child, without a process)."""
    started: list[list[str]] = []

    def __init__(self, argv, port, env, stop_s=10.0):
        self.argv, self.port, self.stop_s, self.proc = argv, port, stop_s, None
        self._ended = asyncio.Event()

    async def start(self):
        StandInChild.started.append(self.argv)

    async def ready(self):
        return {"id": self.argv[self.argv.index("--alias") + 1]}

    async def wait(self):
        await self._ended.wait()
        return 0

    async def stop(self):
        self._ended.set()
        return 0

    def kill(self):
        self._ended.set()


def get(router: Router, path: str, query: dict | None = None) -> tuple[int, dict]:
    res = asyncio.get_event_loop().run_until_complete(router.dispatch(Request("GET", path, query or {}, {}, b"")))
    return res.status, json.loads(res.body)


def post(router: Router, path: str, body: dict) -> tuple[int, dict]:
    req = Request("POST", path, {}, {}, json.dumps(body).encode())
    res = asyncio.get_event_loop().run_until_complete(router.dispatch(req))
    return res.status, json.loads(res.body)


def settle(router: Router) -> None:
    asyncio.get_event_loop().run_until_complete(asyncio.sleep(0.05))


@pytest.fixture
def loop():
    lp = asyncio.new_event_loop()
    asyncio.set_event_loop(lp)
    yield lp
    lp.close()


def test_reload_adds_removes_and_unloads_what_changed(tmp_path, cache, monkeypatch, loop):
    monkeypatch.setattr(pool_module, "Child", StandInChild)
    StandInChild.started = []
    ini = tmp_path / "reload.ini"
    write(ini, "[model-reload-a]\nmodel = /a.gguf\n\n[model-reload-b]\nmodel = /b.gguf\n\n"
               "[model-kept]\nmodel = /k.gguf\nstop-timeout = 3\n")
    reread = lambda: catalog(None, cache, str(ini))
    router = Router(reread(), ["-c", "512"], {}, models_max=0, autoload=True, reread=reread)
    ids = lambda body: {m["id"] for m in body["data"]}
    status, body = get(router, "/models")
    assert status == 200 and {"model-reload-a", "model-reload-b", "model-kept"} <= ids(body)
    for name in ("model-reload-a", "model-reload-b", "model-kept"):
        assert post(router, "/models/load", {"model": name}) == (200, {"success": True})
    settle(router)
    assert {n: st.status for n, st in router.table.states.items() if st.running} == {
        "model-reload-a": "loaded", "model-reload-b": "loaded", "model-kept": "loaded"}
    assert router.pool.children["model-kept"].stop_s == 3.0        # the preset's stop-timeout
    kept_child = router.pool.children["model-kept"]

    write(ini, "[model-reload-b]\nmodel = /b2.gguf\n\n[model-reload-c]\nmodel = /c.gguf\n\n"
               "[model-kept]\nmodel = /k.gguf\nstop-timeout = 3\n")
    assert {"model-reload-a", "model-reload-b"} <= ids(get(router, "/models")[1])     # no reload asked: as it was
    status, body = get(router, "/models", {"reload": "1"})
    assert status == 200
    listed = {m["id"]: m for m in body["data"]}
    assert "model-reload-a" not in listed and "model-reload-c" in listed
    assert listed["model-reload-b"]["status"]["value"] == "unloaded"       # changed: its child was stopped
    assert listed["model-reload-c"]["status"]["value"] == "unloaded" and listed["model-reload-c"]["source"] == "preset"
    assert listed["model-kept"]["status"]["value"] == "loaded" and router.pool.children["model-kept"] is kept_child
    assert listed["model-kept"]["status"]["preset"] == "[model-kept]\nmodel = /k.gguf\nstop-timeout = 3\n\n"
    assert post(router, "/models/load", {"model": "model-reload-a"})[0] == 404        # gone
    assert post(router, "/models/load", {"model": "model-reload-b"}) == (200, {"success": True})
    settle(router)
    assert StandInChild.started[-1][StandInChild.started[-1].index("--model") + 1] == "/b2.gguf"   # the new preset

    write(ini, "[model-kept]\nno-such-key = 1\n")          # a file that cannot be read: 500, models as they were
    status, body = get(router, "/models", {"reload": "1"})
    assert status == 500 and "no-such-key" in body["error"]["message"] and "reload.ini" in body["error"]["message"]
    assert {"model-reload-b", "model-reload-c", "model-kept"} <= ids(get(router, "/models")[1])
    loop.run_until_complete(router.close())


def test_a_refused_preset_is_listed_and_refused_by_name_when_loaded(tmp_path, cache, monkeypatch, loop):
    monkeypatch.setattr(pool_module, "Child", StandInChild)
    ini = write(tmp_path / "p.ini", "[model-dedup]\nhf-repo = ggml-org/test-model-stories260K\n"
                                    "spec-draft-hf = ggml-org/test-model-stories260K-infill\ndedup-cache-models = 1\n")
    router = Router(catalog(None, cache, ini), [], {}, models_max=0, autoload=True)
    ids = {m["id"] for m in get(router, "/models")[1]["data"]}
    assert ids == {"model-dedup", GEMMA, DOWNLOADED}        # the two entries it stands for are hidden
    status, body = post(router, "/models/load", {"model": "model-dedup"})
    assert status == 501 and "'spec-draft-hf' (--spec-draft-hf) is refused" in body["error"]["message"]
    status, body = post(router, "/tokenize", {"model": "model-dedup", "content": "hi"})
    assert status == 501 and "model-dedup" in body["error"]["message"]
    assert post(router, "/models/load", {"model": STORIES}) == (200, {"success": True})   # hidden, still usable
    loop.run_until_complete(router.close())
    ini = write(tmp_path / "q.ini", "[bare]\nseed = 1\n")
    router = Router(catalog(None, cache, ini), [], {}, models_max=0, autoload=True)
    status, body = post(router, "/models/load", {"model": "bare"})
    assert status == 500 and "'bare' cannot be loaded: its preset names no model" in body["error"]["message"]
    loop.run_until_complete(router.close())


def test_load_on_startup_loads_at_the_first_reading_within_the_cap(tmp_path, cache, monkeypatch, loop):
    monkeypatch.setattr(pool_module, "Child", StandInChild)
    ini = write(tmp_path / "p.ini", "[a]\nmodel = /a.gguf\nload-on-startup = true\n[b]\nmodel = /b.gguf\n"
                                    "[c]\nmodel = /c.gguf\nload-on-startup = 1\n")
    router = Router(catalog(None, cache, ini), [], {}, models_max=2, autoload=True)

    async def start():
        return router.startup()
    assert loop.run_until_complete(start()) == ["a", "c"]
    settle(router)
    assert {n for n, st in router.table.states.items() if st.running} == {"a", "c"}
    loop.run_until_complete(router.close())
    over = Router(catalog(None, cache, ini), [], {}, models_max=1, autoload=True)
    with pytest.raises(ValueError, match=r"2 models to load on startup \(a, c\) exceed --models-max 1"):
        over.startup()
