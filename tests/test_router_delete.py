"""DELETE /models?model=NAME (bloomery/router/remove.py, routes.py): a cache model's files leave the caches and it
leaves the list, as llama-server's router removes one; a loaded one is unloaded first; everything else (a blob
another entry links to, what a blob link points to, the other models, a --models-dir file, a preset) stays, and
what is no cache model, or whose files would leave the cache, is refused by name. One event loop, stand-in
children (test_router_preset.py's): no model is loaded."""
from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from bloomery.hf.cache import RepoCache
from bloomery.hf.select import RepoFile
from bloomery.http.types import Request
from bloomery.router import pool as pool_module
from bloomery.router import remove
from bloomery.router.catalog import catalog
from bloomery.router.routes import Router
from test_router_preset import DOWNLOADED, GEMMA, INFILL, STORIES, StandInChild, get, post, settle, write
from test_router_preset import cache, loop  # noqa: F401  (fixtures)

COMMIT = "0" * 40


def delete(router: Router, name: str | None) -> tuple[int, dict]:
    req = Request("DELETE", "/models", {} if name is None else {"model": name}, {}, b"")
    res = asyncio.get_event_loop().run_until_complete(router.dispatch(req))
    return res.status, json.loads(res.body)


def files(root: Path) -> set[str]:
    """Every file and link under root, relative (links not followed)."""
    out = set()
    for top, dirs, names in os.walk(root):
        out |= {os.path.relpath(os.path.join(top, n), root) for n in names + dirs
                if os.path.islink(os.path.join(top, n)) or not os.path.isdir(os.path.join(top, n))}
    return out


def hub_repo(hub: Path, repo: str) -> Path:
    return hub / ("models--" + repo.replace("/", "--"))


def link(path: Path, target: str | Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(target)
    return path


def test_a_cached_model_leaves_the_cache_and_the_list_and_nothing_else_does(tmp_path, cache, monkeypatch, loop):
    monkeypatch.setattr(pool_module, "Child", StandInChild)
    hub = Path(cache["LLAMA_CACHE"])
    model = tmp_path / "model.gguf"         # the file each of the suite's blobs links to
    # a split Q4_K_M (two shards) beside its projector, a Q8_0, a copy linking to shard 1 and a repo linking to 2
    folder = hub_repo(hub, "owner/Split-GGUF")
    blobs = {n: folder / "blobs" / n for n in ("s1", "s2", "proj", "q8")}
    for b in blobs.values():
        b.parent.mkdir(parents=True, exist_ok=True)
        b.write_bytes(b"GGUF")
    snap = folder / "snapshots" / COMMIT
    for name, blob in (("Split-Q4_K_M-00001-of-00002.gguf", "s1"), ("Split-Q4_K_M-00002-of-00002.gguf", "s2"),
                       ("mmproj-Split-Q4_K_M.gguf", "proj"), ("Split-Q8_0.gguf", "q8"),
                       ("other/Copy-Q8_0.gguf", "s1")):
        link(snap / name, os.path.relpath(blobs[blob], (snap / name).parent))
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(COMMIT)
    other = hub_repo(hub, "owner/Other-GGUF") / "snapshots" / COMMIT / "Other-Q2_K.gguf"   # another repo's link
    link(other, os.path.relpath(blobs["s2"], other.parent))
    before = files(hub)
    env = {**cache}
    router = Router(catalog(None, env), [], env, models_max=0, autoload=True)
    assert "owner/Split-GGUF:Q4_K_M" in {m["id"] for m in get(router, "/models")[1]["data"]}

    assert delete(router, "owner/Split-GGUF:Q4_K_M") == (200, {"success": True})
    rel = os.path.relpath(folder, hub)
    gone = {f"{rel}/snapshots/{COMMIT}/Split-Q4_K_M-00001-of-00002.gguf",
            f"{rel}/snapshots/{COMMIT}/Split-Q4_K_M-00002-of-00002.gguf"}
    assert files(hub) == before - gone      # s1 and s2 stay (another snapshot, another repo link to them), and the
    assert other.read_bytes() == b"GGUF"    # projector; the unshared blob's case: the suite's entry below
    listed = {m["id"] for m in get(router, "/models")[1]["data"]}
    assert "owner/Split-GGUF:Q4_K_M" not in listed and {"owner/Split-GGUF:Q8_0", GEMMA, STORIES} <= listed
    assert "owner/Split-GGUF:Q4_K_M" not in catalog(None, env)          # a reload does not bring it back

    # the suite's entry: its blob is a link to the real file, which stays (only the link goes)
    assert delete(router, DOWNLOADED) == (200, {"success": True})
    download = hub_repo(hub, "ggml-org/test-model-router-download")
    assert files(download) == {"refs/main"} and model.read_bytes() == b"GGUF"
    assert DOWNLOADED not in {m["id"] for m in get(router, "/models")[1]["data"]}
    loop.run_until_complete(router.close())


def test_a_loaded_model_is_unloaded_first(cache, monkeypatch, loop):
    monkeypatch.setattr(pool_module, "Child", StandInChild)
    router = Router(catalog(None, cache), [], dict(cache), models_max=0, autoload=True)
    assert post(router, "/models/load", {"model": DOWNLOADED}) == (200, {"success": True})
    settle(router)
    child = router.pool.children[DOWNLOADED]
    assert router.table.get(DOWNLOADED).status == "loaded"
    assert delete(router, DOWNLOADED) == (200, {"success": True})
    assert child._ended.is_set() and DOWNLOADED not in router.pool.children and router.table.get(DOWNLOADED) is None
    status, body = post(router, "/tokenize", {"model": DOWNLOADED, "content": "hi"})
    assert status == 400 and body["error"]["message"] == f"model '{DOWNLOADED}' not found"
    loop.run_until_complete(router.close())


def test_what_is_no_cache_model_is_refused_by_name(tmp_path, cache, monkeypatch, loop):
    monkeypatch.setattr(pool_module, "Child", StandInChild)
    models_dir = tmp_path / "dir"
    models_dir.mkdir()
    (models_dir / "local.gguf").write_bytes(b"GGUF")
    ini = write(tmp_path / "p.ini", f"[mine]\nmodel = {models_dir / 'local.gguf'}\n[{INFILL}]\ntemp = 0.1\n")
    router = Router(catalog(str(models_dir), cache, ini), [], dict(cache), models_max=0, autoload=True)
    before = files(tmp_path)
    for name, source in (("local", "models_dir"), ("mine", "preset"), (INFILL, "preset")):
        assert delete(router, name) == (500, {"error": {
            "code": 500, "message": f"model name={name} is not removable (not from cache: its source is {source})",
            "type": "server_error"}})
    assert delete(router, "nope/none:Q8_0") == (500, {"error": {
        "code": 500, "message": "model name=nope/none:Q8_0 is not found", "type": "server_error"}})
    assert delete(router, None) == (400, {"error": {
        "code": 400, "message": "model must be a non-empty string", "type": "invalid_request_error"}})
    assert post(router, "/models", {"model": DOWNLOADED})[0] == 501          # downloads stay refused by name
    assert files(tmp_path) == before
    assert {"local", "mine", INFILL} <= {m["id"] for m in get(router, "/models")[1]["data"]}
    loop.run_until_complete(router.close())


def test_a_link_out_of_the_cache_refuses_the_whole_removal(tmp_path, cache, monkeypatch, loop):
    monkeypatch.setattr(pool_module, "Child", StandInChild)
    hub = Path(cache["LLAMA_CACHE"])
    outside = tmp_path / "precious.gguf"
    outside.write_bytes(b"GGUF")
    folder = hub_repo(hub, "owner/Odd-GGUF")
    (folder / "blobs").mkdir(parents=True)
    (folder / "blobs" / "b").write_bytes(b"GGUF")
    snap = folder / "snapshots" / COMMIT
    link(snap / "Odd-Q4_0-00001-of-00002.gguf", "../../blobs/b")
    link(snap / "Odd-Q4_0-00002-of-00002.gguf", os.path.relpath(outside, snap))    # leaves the cache
    router = Router(catalog(None, cache), [], dict(cache), models_max=0, autoload=True)
    before = files(tmp_path)
    status, body = delete(router, "owner/Odd-GGUF:Q4_0")
    assert status == 500 and "Odd-Q4_0-00002-of-00002.gguf links to" in body["error"]["message"]
    assert "outside the cache folder" in body["error"]["message"] and "nothing was removed" in body["error"]["message"]
    assert files(tmp_path) == before and outside.read_bytes() == b"GGUF"
    assert "owner/Odd-GGUF:Q4_0" in {m["id"] for m in get(router, "/models")[1]["data"]}
    loop.run_until_complete(router.close())


def test_bloomery_cache_blobs_named_by_the_manifests(tmp_path):
    """bloomery's cache: the blobs its manifests name for that tag go, in every commit; a blob a row of another
    file names stays; a manifest naming a blob outside blobs/ refuses."""
    root = tmp_path / "bloomery" / "hf"
    cache = RepoCache(root, "owner/Model-GGUF")
    q4, q8 = RepoFile("Model-Q4_K_M.gguf", 3, "1" * 64), RepoFile("Model-Q8_0.gguf", 3, "2" * 64)
    twin = RepoFile("copy/Model-Q8_0.gguf", 3, "1" * 64)     # other bytes' name: same blob as q4
    old = RepoFile("Model-Q4_K_M.gguf", 3, "3" * 64)
    cache.write_manifest("a" * 40, [q4, q8, twin])
    cache.write_manifest("b" * 40, [old])
    for f in (q4, q8, old):
        cache.blob_path(f).parent.mkdir(parents=True, exist_ok=True)
        cache.blob_path(f).write_bytes(b"abc")
    cache.link("a" * 40, q4)
    env = {"BLOOMERY_CACHE": str(tmp_path / "bloomery"), "LLAMA_CACHE": str(tmp_path / "hub")}
    plan = remove.plan("owner/Model-GGUF:Q4_K_M", env)
    assert sorted(p.relative_to(cache.dir).as_posix() for p in plan.files) == sorted([
        f"snapshots/{'a' * 40}/Model-Q4_K_M.gguf", f"blobs/{'3' * 64}"])      # q4's blob: twin still names it
    assert remove.apply(plan) == []
    assert cache.has_blob(q4) and cache.has_blob(q8) and not cache.has_blob(old)
    cache.write_manifest("c" * 40, [RepoFile("Model-Q5_0.gguf", 3, "../../../x")])
    with pytest.raises(remove.RemoveRefused, match="outside the cache folder"):
        remove.plan("owner/Model-GGUF:Q5_0", env)
    with pytest.raises(remove.RemoveRefused, match="no owner/name repo id"):
        remove.plan("../x:Q4_0", env)
