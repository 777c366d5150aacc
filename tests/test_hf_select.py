"""--hf-repo's pure parts: the spec, which files a quant names, the progress meter, the flags."""
from __future__ import annotations

import pytest

from bloomery import settings
from bloomery.hf.cache import safe_relpath
from bloomery.hf.download import Meter
from bloomery.hf.errors import HfError, NoSuchFile, NoSuchQuant, SpecError
from bloomery.hf.select import RepoFile, list_quants, pick, quant_tag
from bloomery.hf.spec import HfSpec, parse_spec
from bloomery.settings import SettingsError


@pytest.mark.parametrize("text,want", [
    ("org/m-GGUF", HfSpec("org/m-GGUF", "main", "")),
    ("org/m-GGUF:q4_k_m", HfSpec("org/m-GGUF", "main", "q4_k_m")),
    ("org/m-GGUF@v1.0:UD-Q4_K_XL", HfSpec("org/m-GGUF", "v1.0", "UD-Q4_K_XL")),
    ("org/m@refs/pr/3", HfSpec("org/m", "refs/pr/3", "")),
    ("localrepo:Q8_0", HfSpec("localrepo", "main", "Q8_0")),
])
def test_spec_parses(text, want):
    assert parse_spec(text) == want


@pytest.mark.parametrize("text,match", [
    ("", "without spaces"), ("org/m:", "quant ''"), ("org/m:Q4 K", "quant 'Q4 K'"), ("a/b/c", "repo 'a/b/c'"),
    ("org/m@:Q4_K_M", "revision ''"), ("org/m@a..b", "revision 'a..b'"), ("../x", "repo '../x'"),
])
def test_bad_spec_is_named(text, match):
    with pytest.raises(SpecError, match=match):
        parse_spec(text)


@pytest.mark.parametrize("path,tag", [
    ("Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf", "Q4_K_M"), ("x-UD-Q4_K_XL-00001-of-00003.gguf", "UD-Q4_K_XL"),
    ("UD-Q4_K_XL/x-UD-Q4_K_XL-00002-of-00003.gguf", "UD-Q4_K_XL"), ("model.q8_0.gguf", "Q8_0"),
    ("m-BF16.gguf", "BF16"), ("m-IQ2_XXS.gguf", "IQ2_XXS"), ("m-f16.gguf", "F16"), ("Qwen3-8B.gguf", "8B"),
])
def test_quant_tag(path, tag):
    assert quant_tag(path) == tag


def files(*paths: str) -> list[RepoFile]:
    return [RepoFile(p, 10, "0" * 64) for p in paths]


REPO = files("README.md", "mmproj-m-Q8_0.gguf", "m-Q8_0.gguf", "m-Q4_K_M.gguf", "m-UD-Q4_K_M.gguf",
             "big/m-Q6_K-00002-of-00002.gguf", "big/m-Q6_K-00001-of-00002.gguf", "m-imatrix.gguf")


def names(chosen) -> list[str]:
    return [f.path for f in chosen]


def test_default_is_q4_k_m_then_q8_0_then_the_first_model_file():
    assert names(pick(REPO, "r")) == ["m-Q4_K_M.gguf"]
    no_q4 = [f for f in REPO if "Q4_K_M" not in f.path]
    assert names(pick(no_q4, "r")) == ["m-Q8_0.gguf"]          # the mmproj Q8_0 is a sidecar, never the model
    only_q6 = files("README.md", "mmproj-F16.gguf", "big/m-Q6_K-00002-of-00002.gguf", "big/m-Q6_K-00001-of-00002.gguf")
    assert names(pick(only_q6, "r")) == ["big/m-Q6_K-00001-of-00002.gguf", "big/m-Q6_K-00002-of-00002.gguf"]


def test_quant_is_case_insensitive_and_prefers_the_exact_tag():
    assert names(pick(REPO, "r", "q8_0")) == ["m-Q8_0.gguf"]
    assert names(pick(REPO, "r", "Q4_K_M")) == ["m-Q4_K_M.gguf"]       # not m-UD-Q4_K_M.gguf
    assert names(pick(REPO, "r", "ud-q4_k_m")) == ["m-UD-Q4_K_M.gguf"]
    assert names(pick(REPO[::-1], "r", "Q4_K_M")) == ["m-Q4_K_M.gguf"]  # whatever the listing order


def test_a_split_set_resolves_to_every_shard_in_order():
    assert names(pick(REPO, "r", "q6_k")) == ["big/m-Q6_K-00001-of-00002.gguf", "big/m-Q6_K-00002-of-00002.gguf"]
    assert names(pick(REPO, "r", hf_file="big/m-Q6_K-00002-of-00002.gguf"))[0] == "big/m-Q6_K-00001-of-00002.gguf"
    with pytest.raises(NoSuchFile, match="lacks shard"):
        pick(files("m-Q6_K-00001-of-00003.gguf", "m-Q6_K-00003-of-00003.gguf"), "r", "Q6_K")


def test_an_absent_quant_lists_the_repos_quants():
    with pytest.raises(NoSuchQuant, match=r"no GGUF of quant Q5_K_S; its quants: Q8_0, Q4_K_M, UD-Q4_K_M, Q6_K$"):
        pick(REPO, "r", "Q5_K_S")
    with pytest.raises(NoSuchQuant, match="holds no GGUF model file"):
        pick(files("README.md", "model.safetensors"), "r")
    with pytest.raises(NoSuchFile, match="'nope.gguf': repo r has no such file"):
        pick(REPO, "r", hf_file="nope.gguf")


def test_hf_file_overrides_the_quant():
    assert names(pick(REPO, "r", "Q8_0", hf_file="m-UD-Q4_K_M.gguf")) == ["m-UD-Q4_K_M.gguf"]


def test_list_quants_skips_sidecars():
    assert list_quants(REPO) == ["Q8_0", "Q4_K_M", "UD-Q4_K_M", "Q6_K"]


@pytest.mark.parametrize("path", ["../x.gguf", "/etc/passwd", "a//b.gguf", "a/./b", ""])
def test_a_hub_path_that_leaves_the_snapshot_is_refused(path):
    with pytest.raises(HfError, match="no safe relative path"):
        safe_relpath(path)


def test_meter_sends_a_record_per_interval_and_at_the_end():
    m = Meter(interval_s=1.0)
    m.start(0.0, 0)
    assert m.due(0.5, 100, 1000) is None
    assert m.due(1.0, 200, 1000) == pytest.approx(200.0)
    assert m.due(1.1, 300, 1000) is None
    assert m.due(1.5, 1000, 1000) == pytest.approx(1600.0)


# -- the flags ---------------------------------------------------------------------------------

def test_hf_flags_are_read():
    s = settings.parse(["-hf", "org/m:Q8_0", "-hff", "m-Q8_0.gguf", "-hft", "hf_secret", "--offline"], env={})
    assert (s.hf_repo, s.hf_file, s.hf_token, s.offline, s.model_file) == ("org/m:Q8_0", "m-Q8_0.gguf",
                                                                           "hf_secret", True, None)
    assert "hf_secret" not in repr(s.redacted())
    s = settings.parse([], env={"LLAMA_ARG_HF_REPO": "org/m", "LLAMA_ARG_OFFLINE": "1"})
    assert (s.hf_repo, s.offline) == ("org/m", True)
    assert settings.parse(["--hf", "org/m@v2"], env={}).hf_repo == "org/m@v2"


@pytest.mark.parametrize("argv,match", [
    (["-m", "x.gguf", "-hf", "org/m"], "give one model source"),
    (["-hff", "m.gguf"], "needs --hf-repo"),
    (["-hf", "org/m:Q4 K"], "quant 'Q4 K'"),
    (["--plan"], "--plan needs a model: give -m/--model FILE or --hf-repo"),   # no model and no --plan: a router
])
def test_hf_flag_refusals(argv, match):
    with pytest.raises(SettingsError, match=match):
        settings.parse(argv, env={})
