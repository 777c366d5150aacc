"""POST /slots/{id}?action=save|restore|erase on the real bloomery-serve with --slot-save-path, through
requests and curl: save a slot, erase it, restore the file into the other slot, and a request there
reuses the restored prefix (timings.cache_n) with the ids of a cold run; the refusals by name."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import requests

from serve_proc import REPO, Served

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

PROMPT = "Write a Python function that returns the sum of the squares of the numbers in a list."


def complete(url: str, id_slot: int, **kw) -> dict:
    body = {"prompt": PROMPT, "n_predict": 6, "temperature": 0, "ignore_eos": True, "return_tokens": True,
            "id_slot": id_slot, "cache_prompt": True, **kw}
    r = requests.post(url + "/completion", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def action(url: str, slot: int | str, act: str, body: dict | None = None) -> requests.Response:
    return requests.post(f"{url}/slots/{slot}?action={act}", json=body, timeout=120)


def test_save_erase_restore_then_the_restored_prefix_is_reused(real_model_path, tmp_path):
    folder = tmp_path / "slots"
    folder.mkdir()
    with Served("-m", str(real_model_path), "-c", "1024", "-np", "2", "-cram", "0",
                "--slot-save-path", str(folder)) as s:
        first = complete(s.url, 1)
        n_slot = first["tokens_evaluated"] + 5                  # the prompt and the 5 fed ids
        saved = action(s.url, 1, "save", {"filename": "one.bin"})
        assert saved.status_code == 200, saved.text
        body = saved.json()
        assert (body["id_slot"], body["filename"], body["n_saved"]) == (1, "one.bin", n_slot)
        assert body["n_written"] == (folder / "one.bin").stat().st_size and body["timings"]["save_ms"] >= 0
        erased = action(s.url, 1, "erase")
        assert erased.json() == {"id_slot": 1, "n_erased": n_slot}
        assert complete(s.url, 1)["timings"]["cache_n"] == 0   # erased: the prompt runs whole again
        # restore through curl, as a user would
        out = subprocess.run(["curl", "-s", "-X", "POST", f"{s.url}/slots/0?action=restore",
                              "-H", "Content-Type: application/json", "-d", '{"filename": "one.bin"}'],
                             capture_output=True, text=True, timeout=120)
        got = json.loads(out.stdout)
        assert (got["id_slot"], got["filename"], got["n_restored"], got["n_read"]) == (0, "one.bin", n_slot,
                                                                                        body["n_written"])
        assert got["timings"]["restore_ms"] >= 0
        again = complete(s.url, 0)
        cold = complete(s.url, 0, cache_prompt=False)
        # refusals, by name
        bad = action(s.url, 0, "save", {"filename": "../escape.bin"})
        missing = action(s.url, 0, "restore", {"filename": "none.bin"})
        no_name = action(s.url, 0, "save", {})
        unknown = action(s.url, 0, "frobnicate", {"filename": "x.bin"})
        bad_id = action(s.url, "x", "erase")
        out_of_range = action(s.url, 5, "erase")
        (folder / "other.bin").write_bytes((folder / "one.bin").read_bytes().replace(
            real_model_path.name.encode(), b"x" * len(real_model_path.name.encode()), 1))
        other = action(s.url, 0, "restore", {"filename": "other.bin"})
    assert again["timings"]["cache_n"] == first["tokens_evaluated"] - 1 and again["timings"]["prompt_n"] == 1
    assert again["tokens"] == first["tokens"] == cold["tokens"]
    assert bad.status_code == 400 and "Invalid filename" in bad.json()["error"]["message"]
    assert not (tmp_path / "escape.bin").exists()
    assert missing.status_code == 400 and "no file 'none.bin'" in missing.json()["error"]["message"]
    assert no_name.status_code == 400 and '"filename" is required' in no_name.json()["error"]["message"]
    assert unknown.status_code == 400 and unknown.json()["error"]["message"] == "Invalid action"
    assert bad_id.status_code == 400 and bad_id.json()["error"]["message"] == "Invalid slot ID"
    assert out_of_range.status_code == 400 and out_of_range.json()["error"]["message"] == "Invalid slot ID"
    assert other.status_code == 400 and "the file was saved from model 'xxx" in other.json()["error"]["message"]


def test_without_slot_save_path_slot_actions_answer_501_as_llama_server(real_model_path):
    with Served("-m", str(real_model_path), "-c", "512", "-np", "1", "--no-warmup") as s:
        r = action(s.url, 0, "erase")
    assert r.status_code == 501
    assert r.json()["error"]["message"] == "This server does not support slots action. Start it with `--slot-save-path`"


def test_a_slot_save_path_that_is_no_folder_is_refused_at_start(real_model_path, tmp_path):
    done = subprocess.run([sys.executable, "-m", "bloomery.supervisor", "-m", str(real_model_path), "--port", "0",
                           "--slot-save-path", str(tmp_path / "nope")], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode != 0 and "--slot-save-path" in done.stderr and "not a directory" in done.stderr, done.stderr
