"""Router mode's bookkeeping and catalog on the CPU: the --models-max cap and its LRU victim, which models a
--models-dir holds, the cache's models, and what a child is given (no process, no socket)."""
from __future__ import annotations

import os
import time

import pytest

from bloomery.hf.cache import RepoCache
from bloomery.hf.select import RepoFile
from bloomery.router.catalog import CACHE, MODELS_DIR, CatalogError, catalog, scan_models_dir
from bloomery.router.serve import ROUTER_ONLY, child_env
from bloomery.router.table import LOADED, LOADING, UNLOADED, ModelTable
from bloomery.settings import SettingsError, argv_without, parse


def _loaded(table: ModelTable, name: str, used_s: float) -> None:
    table.loading(name, 1000, [])
    table.loaded(name, {})
    table.get(name).last_used_s = used_s


def test_cap_counts_loading_and_loaded_models():
    t = ModelTable(["a", "b", "c"], models_max=2)
    assert t.has_capacity()
    t.loading("a", 1, [])
    assert t.get("a").status == LOADING and t.has_capacity()
    t.loading("b", 2, [])
    assert not t.has_capacity()
    t.ended("b", None)
    assert t.get("b").status == UNLOADED and t.get("b").exit_code is None and t.has_capacity()
    assert ModelTable(["a"], models_max=0).has_capacity()       # 0: no limit
    with pytest.raises(ValueError, match="--models-max -1"):
        ModelTable(["a"], models_max=-1)


def test_victim_is_the_least_recently_used_idle_model():
    t = ModelTable(["a", "b", "c"], models_max=2)
    now = time.monotonic()
    _loaded(t, "a", now - 10)
    _loaded(t, "b", now - 5)
    assert t.victim() == "a"
    t.acquire("a")                        # a request in flight: a is busy (and now the most recent)
    assert t.victim() == "b"
    t.acquire("b")
    assert t.victim() is None             # every model busy: a new load waits
    t.release("b")
    assert t.victim() == "b"
    t.get("b").stopping = True            # already going: not picked twice
    assert t.victim() is None
    t.loading("c", 3, [])                 # a model still loading is never a victim
    assert t.get("c").status == LOADING and t.victim() is None


def test_a_child_that_exits_on_its_own_is_listed_failed():
    t = ModelTable(["a"], models_max=1)
    _loaded(t, "a", 0.0)
    assert t.get("a").status == LOADED
    t.ended("a", 70)
    assert t.get("a").status == UNLOADED and t.get("a").exit_code == 70 and t.get("a").port == 0


def test_models_dir_reads_files_and_folders_as_llama_server(tmp_path):
    (tmp_path / "alpha.gguf").write_bytes(b"x")
    (tmp_path / "mmproj-alpha.gguf").write_bytes(b"x")          # a projector is no model of its own
    (tmp_path / "notes.txt").write_text("x")
    big = tmp_path / "big"
    big.mkdir()
    for i in (1, 2):
        (big / f"big-Q4_K_M-0000{i}-of-00002.gguf").write_bytes(b"x")
    (big / "mmproj-F16.gguf").write_bytes(b"x")
    one = tmp_path / "one"
    one.mkdir()
    (one / "one-Q8_0.gguf").write_bytes(b"x")
    (tmp_path / "empty").mkdir()
    found = {e.name: e for e in scan_models_dir(str(tmp_path))}
    assert sorted(found) == ["alpha", "big", "one"]
    assert found["alpha"].path == str(tmp_path / "alpha.gguf") and found["alpha"].source == MODELS_DIR
    assert found["big"].path.endswith("big-Q4_K_M-00001-of-00002.gguf")        # the first shard
    assert found["one"].model_args() == ["--model", str(one / "one-Q8_0.gguf")]
    with pytest.raises(CatalogError, match="does not exist or is not a directory"):
        scan_models_dir(str(tmp_path / "missing"))


def test_cache_models_are_named_by_repo_and_quant(tmp_path):
    root = tmp_path / "hf"
    cache = RepoCache(root, "owner/Model-GGUF")
    commit = "a" * 40
    have = RepoFile("Model-Q8_0.gguf", 3, "1" * 64, "b1")
    missing = RepoFile("Model-Q4_K_M.gguf", 3, "2" * 64, "b2")      # listed, never downloaded: not served
    cache.write_manifest(commit, [have, missing])
    cache.write_ref("main", commit)
    cache.blob_path(have).parent.mkdir(parents=True, exist_ok=True)
    cache.blob_path(have).write_bytes(b"abc")
    models_dir = tmp_path / "dir"
    models_dir.mkdir()
    (models_dir / "local.gguf").write_bytes(b"x")
    hub = tmp_path / "hub"             # huggingface_hub's layout (hf download, llama-server's -hf)
    hub_snapshot = _hub_file(hub, "other/Hub-GGUF", commit, "Hub-Q4_K_M.gguf")
    _hub_file(hub, "other/Hub-GGUF", commit, "mmproj-Hub-F16.gguf")
    _hub_file(hub, "owner/Model-GGUF", commit, "Model-Q8_0.gguf")      # in both caches: bloomery's wins
    found = catalog(str(models_dir), {"BLOOMERY_CACHE": str(tmp_path), "HF_HUB_CACHE": str(hub)})
    assert sorted(found) == ["local", "other/Hub-GGUF:Q4_K_M", "owner/Model-GGUF:Q8_0"]
    entry = found["owner/Model-GGUF:Q8_0"]
    assert entry.source == CACHE and entry.model_args() == ["--hf-repo", f"owner/Model-GGUF@{commit}:Q8_0",
                                                            "--offline"]
    assert found["other/Hub-GGUF:Q4_K_M"].model_args() == ["--model", str(hub_snapshot)]


def _hub_file(hub, repo: str, commit: str, name: str):
    folder = hub / ("models--" + repo.replace("/", "--"))
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / "main").write_text(commit)
    blob = folder / "blobs" / f"{abs(hash(name)):064x}"[:64]
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(b"gguf")
    link = folder / "snapshots" / commit / name
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(blob, link.parent))
    return link


def test_no_model_is_router_mode_and_children_get_the_rest_of_the_command_line():
    argv = ["--models-dir", "/m", "--models-max", "2", "--no-models-autoload", "-c", "512", "--port", "9000",
            "--host=0.0.0.0", "--api-key", "sk-1", "--temp", "0.5", "-np", "2"]
    s = parse(argv, env={})
    assert s.router and s.models_dir == "/m" and s.models_max == 2 and s.models_autoload is False
    assert argv_without(s.argv, ROUTER_ONLY) == ["-c", "512", "--temp", "0.5", "-np", "2"]
    env = child_env({"PATH": "/bin", "NOTIFY_SOCKET": "/run/x", "LISTEN_FDS": "1", "LLAMA_API_KEY": "old"},
                    s.api_keys)
    assert env == {"PATH": "/bin", "LLAMA_API_KEY": "sk-1"}      # keys in the environment, never in argv
    assert parse([], env={}).router and parse([], env={}).models_max == 4 and parse([], env={}).models_autoload
    with pytest.raises(SettingsError, match="--plan needs a model"):
        parse(["--plan"], env={})
    with pytest.raises(SettingsError, match="--models-max -1"):
        parse(["--models-max", "-1"], env={})
    assert parse(["--models-preset", "x.ini"], env={}).models_preset == "x.ini"   # tests/test_router_preset.py
