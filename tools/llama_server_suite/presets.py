"""The router tests' models in the cache, as the tests' conftest would have downloaded them (run.py skips
that preload): each preset name test_router.py routes to, with the real model file in its place, and the model
test_router_download_model downloads through the router (MODEL_DOWNLOAD_ID), as that test leaves it for
test_router_delete_model (downloads are not served here, and this runner has no network).

llama.cpp's conftest runs ServerPreset.load_all() so that a router started with no model finds the
presets in its cache (LLAMA_CACHE, huggingface_hub's layout). Here each of those repos holds one file,
a link to the model every other test gets through wrapper.py; llama-server and bloomery-serve both list
the cache as `owner/name:QUANT` from the file name. The blob's name is not the file's hash: neither server's
listing reads it as one.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

# (repo, file) of the presets test_router.py names (ServerPreset.tinygemma3, stories260K, its infill twin), and
# of its MODEL_DOWNLOAD_ID "ggml-org/test-model-router-download:F16" (the tag from the file name, as the others')
ROUTER_PRESETS = (("ggml-org/tinygemma3-GGUF", "tinygemma3-Q8_0.gguf"),
                  ("ggml-org/test-model-stories260K", "stories260K-F32.gguf"),
                  ("ggml-org/test-model-stories260K-infill", "stories260K-infill-F32.gguf"),
                  ("ggml-org/test-model-router-download", "test-model-router-download-F16.gguf"))
COMMIT = "0" * 40


def write_cache(cache: Path, model: Path) -> list[str]:
    """The presets under `cache` in huggingface_hub's layout, each a link to `model`; their router names. What
    is there already is left as it is, so a second call (wrapper.py's, at each server start, another run beside
    it) only puts back what a test removed."""
    names = []
    for repo, file in ROUTER_PRESETS:
        folder = cache / ("models--" + repo.replace("/", "--"))
        (folder / "refs").mkdir(parents=True, exist_ok=True)
        if not (folder / "refs" / "main").exists():
            (folder / "refs" / "main").write_text(COMMIT)
        blob = folder / "blobs" / hashlib.sha256(f"{repo}/{file}".encode()).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        _link(blob, str(model.resolve()))
        link = folder / "snapshots" / COMMIT / file
        link.parent.mkdir(parents=True, exist_ok=True)
        _link(link, os.path.relpath(blob, link.parent))
        names.append(f"{repo}:{file.rsplit('-', 1)[1][:-len('.gguf')]}")
    return names


def _link(path: Path, target: str) -> None:
    if not path.is_symlink():
        try:
            path.symlink_to(target)
        except FileExistsError:     # made meanwhile by a server start beside this one
            pass
