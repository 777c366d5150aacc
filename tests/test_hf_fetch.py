"""--hf-repo against a local hub (tests/hf_fakehub.py): real HTTP, huggingface_hub's client, our cache."""
from __future__ import annotations

import hashlib
import os

import pytest

from bloomery.hf import errors as E
from bloomery.hf.fetch import fetch
from bloomery.hf.spec import parse_spec
from hf_fakehub import FakeHub

MIB = 1 << 20
Q4 = os.urandom(3 * MIB)
Q8 = os.urandom(MIB)
SHARDS = [os.urandom(400_000), os.urandom(300_000), os.urandom(200_000)]
UD = {f"UD-Q4_K_XL/m-UD-Q4_K_XL-{i:05d}-of-00003.gguf": d for i, d in enumerate(SHARDS, 1)}


@pytest.fixture
def hub():
    with FakeHub() as h:
        h.add("org/m-GGUF", {"README.md": b"# m", "mmproj-m-F16.gguf": b"p" * 100, "m-Q8_0.gguf": Q8,
                             "m-Q4_K_M.gguf": Q4, **UD})
        yield h


@pytest.fixture
def env(hub, tmp_path):
    return {"HF_ENDPOINT": hub.url, "BLOOMERY_CACHE": str(tmp_path)}


def get(spec: str, env: dict, **kw):
    return fetch(parse_spec(spec), env=env, **kw)


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def test_default_quant_downloads_q4_k_m_into_the_cache(hub, env, tmp_path):
    got = get("org/m-GGUF", env)
    assert [os.path.basename(p) for p in got.paths] == ["m-Q4_K_M.gguf"]
    assert read(got.paths[0]) == Q4 and got.source == "hub" and got.n_bytes == len(Q4)
    assert got.paths[0].startswith(str(tmp_path / "hf" / "models--org--m-GGUF" / "snapshots" / got.commit))
    assert len(hub.resolves()) == 1                   # the one file; never the mmproj nor README


def test_quant_is_case_insensitive(hub, env):
    got = get("org/m-GGUF:q8_0", env)
    assert [os.path.basename(p) for p in got.paths] == ["m-Q8_0.gguf"] and read(got.paths[0]) == Q8


def test_a_split_set_downloads_every_shard_side_by_side(hub, env):
    got = get("org/m-GGUF:ud-q4_k_xl", env)
    assert [os.path.basename(p) for p in got.paths] == [f"m-UD-Q4_K_XL-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert [read(p) for p in got.paths] == SHARDS
    assert len({os.path.dirname(p) for p in got.paths}) == 1     # where open_gguf looks for the shards


def test_an_absent_quant_lists_the_quants(hub, env):
    with pytest.raises(E.NoSuchQuant, match="its quants: Q8_0, Q4_K_M, UD-Q4_K_XL$"):
        get("org/m-GGUF:Q5_K_S", env)
    assert hub.resolves() == []


def test_a_cached_file_is_never_fetched_twice(hub, env):
    first = get("org/m-GGUF:Q4_K_M", env)
    notes = []
    again = get("org/m-GGUF:Q4_K_M", env, note=lambda m, kv: notes.append(m))
    assert again.paths == first.paths and again.source == "cache" and read(again.paths[0]) == Q4
    assert len(hub.resolves()) == 1 and "cached file" in notes


def test_a_cut_connection_resumes_from_the_bytes_already_there(hub, env):
    hub.cut_once["m-Q4_K_M.gguf"] = MIB + 12345
    seen = []
    got = get("org/m-GGUF:Q4_K_M", env, progress=lambda path, done, total, rate: seen.append((done, total)))
    assert read(got.paths[0]) == Q4
    assert [q["range"] for q in hub.resolves()] == [None, f"bytes={MIB + 12345}-"]
    assert seen[-1] == (len(Q4), len(Q4))


def test_a_part_left_by_an_earlier_run_is_resumed(hub, env, tmp_path):
    blobs = tmp_path / "hf" / "models--org--m-GGUF" / "blobs"      # what a killed earlier start left
    blobs.mkdir(parents=True)
    (blobs / f"{hashlib.sha256(Q4).hexdigest()}.part").write_bytes(Q4[:MIB])
    got = get("org/m-GGUF:Q4_K_M", env)
    assert read(got.paths[0]) == Q4 and [q["range"] for q in hub.resolves()] == [f"bytes={MIB}-"]


def test_a_checksum_mismatch_removes_the_bad_file(hub, env, tmp_path):
    hub.corrupt.add("m-Q8_0.gguf")
    with pytest.raises(E.ChecksumMismatch, match=r"org/m-GGUF:Q8_0: m-Q8_0.gguf: .* sha256 .*the bad file was removed"):
        get("org/m-GGUF:Q8_0", env)
    repo_dir = tmp_path / "hf" / "models--org--m-GGUF"
    assert not [p for p in (repo_dir / "blobs").iterdir() if not p.name.endswith(".lock")]
    assert not (repo_dir / "snapshots").exists()
    hub.corrupt.clear()                                        # the next start fetches it whole and serves it
    assert read(get("org/m-GGUF:Q8_0", env).paths[0]) == Q8


def test_offline_without_a_cache_is_refused_by_name(hub, env):
    with pytest.raises(E.NotCached, match="offline .* holds no org/m-GGUF@main"):
        get("org/m-GGUF", {**env, "HF_HUB_OFFLINE": "1"})
    with pytest.raises(E.NotCached, match="holds no"):
        get("org/m-GGUF", env, offline=True)
    assert hub.requests == []


def test_offline_with_a_cache_needs_no_network(hub, env):
    online = get("org/m-GGUF:UD-Q4_K_XL", env)
    n_requests = len(hub.requests)
    offline = get("org/m-GGUF:UD-Q4_K_XL", {**env, "HF_HUB_OFFLINE": "1"})
    assert offline.paths == online.paths and offline.source == "cache" and len(hub.requests) == n_requests
    with pytest.raises(E.NotCached, match="offline and m-Q8_0.gguf .* is not in the cache"):
        get("org/m-GGUF:Q8_0", {**env, "HF_HUB_OFFLINE": "1"})       # the manifest knows it; the bytes are not here


def test_network_down_uses_the_cache_or_says_nothing_is_cached(hub, env):
    down = {**env, "HF_ENDPOINT": "http://127.0.0.1:9"}          # nothing listens on the discard port
    with pytest.raises(E.NetworkDown, match="cannot reach the hub .*; nothing cached for it"):
        get("org/m-GGUF:Q8_0", down)
    online = get("org/m-GGUF:Q8_0", env)
    notes = []
    got = get("org/m-GGUF:Q8_0", down, note=lambda m, kv: notes.append(m))
    assert got.paths == online.paths and "hub unreachable: using the cached copy" in notes


def test_unknown_repo_and_revision_are_named(hub, env):
    with pytest.raises(E.UnknownRepo, match="the hub has no repo 'org/nope'"):
        get("org/nope", env)
    with pytest.raises(E.UnknownRevision, match="revision 'v9' is no branch, tag or commit"):
        get("org/m-GGUF@v9", env)


def test_a_revision_picks_that_commits_files(hub, env):
    old = os.urandom(1000)
    commit = hub.add("org/r", {"r-Q4_K_M.gguf": old}, branch="main", tags=("v1",))
    hub.add("org/r", {"r-Q4_K_M.gguf": b"new" * 100}, branch="main")
    assert read(get("org/r@v1", env).paths[0]) == old
    assert read(get(f"org/r@{commit}", env).paths[0]) == old
    assert read(get("org/r", env).paths[0]) == b"new" * 100


def test_a_gated_repo_needs_its_token(hub, env):
    hub.add("org/gated", {"g-Q4_K_M.gguf": Q8}, token="hf_right")
    with pytest.raises(E.Gated, match=r"org/gated is gated; .*\(--hf-token or HF_TOKEN\)"):
        get("org/gated", env)
    with pytest.raises(E.Gated):
        get("org/gated", env, token="hf_wrong")
    assert read(get("org/gated", env, token="hf_right").paths[0]) == Q8


def test_a_download_the_disk_cannot_hold_is_refused_before_a_byte(hub, env, monkeypatch):
    import shutil
    from collections import namedtuple
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 * MIB, 10 * MIB - 1000, 1000))
    with pytest.raises(E.DiskFull, match=rf"{len(Q8)} more bytes to download, 1000 bytes free"):
        get("org/m-GGUF:Q8_0", env)
    assert hub.resolves() == []


def test_metadata_without_a_usable_hash_is_refused(hub, env):
    from hf_fakehub import Blob
    hub.add("org/odd", {"o-Q4_K_M.gguf": b"o" * 10}, blobs={"o-Q4_K_M.gguf": Blob(b"o" * 10, "../../../x")})
    with pytest.raises(E.DownloadFailed, match="o-Q4_K_M.gguf holds no usable hash"):
        get("org/odd", env)
    assert hub.resolves() == []


def test_a_file_stored_in_git_is_checked_by_its_blob_id(hub, env):
    from hf_fakehub import Blob
    data = os.urandom(5000)
    hub.add("org/small", {"s-Q8_0.gguf": data}, blobs={"s-Q8_0.gguf": Blob(data, lfs=False)})
    hub.corrupt.add("s-Q8_0.gguf")
    with pytest.raises(E.ChecksumMismatch, match="git blob id"):
        get("org/small", env)
    hub.corrupt.clear()
    assert read(get("org/small", env).paths[0]) == data


def test_two_starts_at_once_download_the_file_once(hub, env):
    import threading
    hub.rate_bytes_s = 4 * MIB                       # the first holds the file's lock for ~1 s
    results, notes = [], []
    threads = [threading.Thread(target=lambda: results.append(get("org/m-GGUF:Q8_0", env, note=lambda m, kv:
                                                                  notes.append(m)))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(results) == 2 and all(read(r.paths[0]) == Q8 for r in results)
    assert len(hub.resolves()) == 1 and "waiting for another process's download of this file" in notes


def test_two_links_of_one_file_at_once_both_land(tmp_path, monkeypatch):
    """Both callers are inside link() together (each has made its temp link before either
    renames): each must rename its own, and the snapshot path must name the blob."""
    import threading
    from bloomery.hf.cache import RepoCache
    from bloomery.hf.select import RepoFile
    cache = RepoCache(tmp_path, "org/m")
    f = RepoFile("m-Q8_0.gguf", 4, "ab" * 32)
    cache.blob_path(f).parent.mkdir(parents=True)
    cache.blob_path(f).write_bytes(b"GGUF")
    both_made = threading.Barrier(2, timeout=10)
    real_symlink = os.symlink

    def symlink_then_wait(src, dst, *a, **kw):
        real_symlink(src, dst, *a, **kw)
        both_made.wait()
    monkeypatch.setattr(os, "symlink", symlink_then_wait)
    out, errors = [], []

    def run():
        try:
            out.append(cache.link("c" * 40, f))
        except Exception as e:          # noqa: BLE001 - the test reports what a caller saw
            errors.append(e)
    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert errors == [] and len(out) == 2
    assert read(str(out[0])) == b"GGUF" and out[0] == out[1]
    assert [p.name for p in out[0].parent.iterdir()] == ["m-Q8_0.gguf"]   # no temp link left


# -- huggingface_hub's own cache (hf download, vLLM, transformers) ---------------------------
def hf_download(hub, tmp_path, filename: str) -> str:
    """The file as `hf download` leaves it: huggingface_hub's own download into its own cache."""
    from huggingface_hub import hf_hub_download
    return hf_hub_download("org/m-GGUF", filename, cache_dir=str(tmp_path / "hfhub"), endpoint=hub.url)


def test_a_file_in_the_hugging_face_cache_is_linked_not_downloaded_again(hub, env, tmp_path):
    theirs = hf_download(hub, tmp_path, "m-Q4_K_M.gguf")
    n_before, notes = len(hub.resolves()), []
    got = get("org/m-GGUF:Q4_K_M", {**env, "HF_HUB_CACHE": str(tmp_path / "hfhub")},
              note=lambda m, kv: notes.append(m))
    assert len(hub.resolves()) == n_before and "found in the Hugging Face cache" in notes
    assert read(got.paths[0]) == Q4 and got.source == "cache"
    assert os.path.samefile(got.paths[0], theirs)          # a hard link: no second copy on the disk
    assert len(hub.resolves()) == n_before and get("org/m-GGUF:Q4_K_M", env).source == "cache"


def test_a_copy_there_with_other_bytes_is_downloaded_instead(hub, env, tmp_path):
    theirs = os.path.realpath(hf_download(hub, tmp_path, "m-Q4_K_M.gguf"))
    with open(theirs, "r+b") as f:
        f.write(b"\0" * 16)                                # same size, other bytes
    n_before, notes = len(hub.resolves()), []
    got = get("org/m-GGUF:Q4_K_M", {**env, "HF_HOME": str(tmp_path / "hfhome")}, note=lambda m, kv: notes.append(m))
    assert "found in the Hugging Face cache" not in notes      # HF_HOME/hub holds nothing: not looked up there
    os.unlink(got.paths[0])
    for blob in (tmp_path / "hf" / "models--org--m-GGUF" / "blobs").iterdir():
        blob.unlink()
    got = get("org/m-GGUF:Q4_K_M", {**env, "HF_HUB_CACHE": str(tmp_path / "hfhub")},
              note=lambda m, kv: notes.append(m))
    assert "the Hugging Face cache's copy does not match the hub's hash: downloading" in notes
    assert read(got.paths[0]) == Q4 and got.source == "hub" and len(hub.resolves()) == n_before + 2
    assert not os.path.samefile(got.paths[0], theirs)
