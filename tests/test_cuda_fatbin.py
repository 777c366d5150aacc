"""The prebuilt kernels without a card (engine/cuda/fatbin.py, the loader in engine/cuda/kernels.py):
the build writes each module's fatbin with the sha256 of the source it compiled, the loader takes
a fatbin only for that source and a card its cubins cover, and compiles the rest with NVRTC in
parallel threads. A fake nvcc stands in for the compiler (it copies the source and the command
line into the "fatbin"), and a fake cupy for the card; where nvcc is installed, one module is
built for real (slow)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import types
import zipfile
from pathlib import Path

import pytest

from bloomery.engine.cuda import fatbin

REPO = Path(__file__).resolve().parents[1]

FAKE_NVCC = """#!/usr/bin/env python3
import sys
args = sys.argv[1:]
if args == ["--version"]:
    print("Cuda compilation tools, release 0.0, fake")
    sys.exit(0)
with open(sys.argv[0] + ".calls", "a") as f:
    f.write(" ".join(args) + "\\n")
out, src = args[args.index("-o") + 1], args[-1]
with open(out, "w") as f:
    f.write(" ".join(args[:-3]) + "\\n" + open(src).read())
"""


def fake_nvcc(folder: Path) -> Path:
    path = folder / "nvcc"
    path.write_text(FAKE_NVCC)
    path.chmod(0o755)
    return path


@pytest.fixture
def nvcc(tmp_path) -> Path:
    return fake_nvcc(tmp_path)


@pytest.fixture(scope="module")
def tree_fatbins(tmp_path_factory) -> Path:
    """Fake fatbins of the tree's own sources, built once (the tests that use it only read it)."""
    tmp = tmp_path_factory.mktemp("tree-prebuilt")
    fatbin.build(tmp / "prebuilt", str(fake_nvcc(tmp)), log=lambda s: None)
    return tmp / "prebuilt"


def calls(nvcc: Path) -> list[str]:
    log = Path(str(nvcc) + ".calls")
    return log.read_text().splitlines() if log.exists() else []


@pytest.fixture
def kdir(tmp_path) -> Path:
    """A copy of kernels/ to edit."""
    out = tmp_path / "kernels"
    shutil.copytree(fatbin.KERNELS, out, ignore=shutil.ignore_patterns("__pycache__", "*.py"))
    return out


def test_the_build_records_the_source_it_compiled(tmp_path, nvcc, kdir):
    out = tmp_path / "prebuilt"
    assert fatbin.build(out, str(nvcc), kdir=kdir, log=lambda s: None) == {m: "built" for m in fatbin.MODULES}
    for m in fatbin.MODULES:
        meta = json.loads((out / f"{m}.json").read_text())
        body = (out / f"{m}.fatbin").read_text()
        assert meta["source_sha256"] == fatbin.source_sha256(m, kdir)
        assert body.split("\n", 1)[1] == fatbin.source(m, kdir)          # what nvcc compiled is that source
        assert meta["cubins"] == list(fatbin.ARCHS) and meta["ptx"] == fatbin.PTX
        assert meta["options"] == ["--std=c++17", "-ftz=true"] and meta["nvcc"].endswith("fake")
        head = body.split("\n", 1)[0]
        for a in fatbin.ARCHS[:-1]:
            assert f"arch=compute_{a},code=sm_{a}" in head
        assert f"arch=compute_90,code=[sm_90,compute_90]" in head
        assert "--std=c++17 -ftz=true -fatbin" in head
    assert len(calls(nvcc)) == len(fatbin.MODULES)
    # built again: nothing to do; one header edited: only the modules that include it
    assert set(fatbin.build(out, str(nvcc), kdir=kdir, log=lambda s: None).values()) == {"fresh"}
    assert len(calls(nvcc)) == len(fatbin.MODULES)
    (kdir / "layers.cu").write_text((kdir / "layers.cu").read_text() + "\n// an edit\n")
    assert fatbin.check("layers", "90", out, kdir) == (None, "the prebuilt fatbin is of another source")
    got = fatbin.build(out, str(nvcc), kdir=kdir, log=lambda s: None)
    assert got == {"matvec": "fresh", "moe": "fresh", "moe_mm": "fresh", "attention": "fresh", "layers": "built",
                   "recurrent": "fresh"}
    assert fatbin.check("layers", "90", out, kdir)[0] == "cubin"


def test_a_failed_build_names_the_module_and_leaves_no_manifest(tmp_path, kdir):
    bad = tmp_path / "nvcc"
    bad.write_text("#!/bin/sh\necho 'error: expected a ;' >&2\nexit 2\n")
    bad.chmod(0o755)
    with pytest.raises(RuntimeError, match=r"nvcc failed on kernels/\w+\.cu \(exit 2\):\nerror: expected a ;"):
        fatbin.build(tmp_path / "out", str(bad), kdir=kdir, log=lambda s: None)
    assert not list((tmp_path / "out").glob("*.json"))


def test_no_nvcc_is_refused_by_name(tmp_path, kdir, monkeypatch):
    monkeypatch.delenv("BLOOMERY_NVCC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "empty"))
    assert fatbin.find_nvcc() is None
    with pytest.raises(FileNotFoundError, match="nvcc not found"):
        fatbin.build(tmp_path / "out", kdir=kdir, log=lambda s: None)


@pytest.fixture
def built(tmp_path, nvcc, kdir) -> Path:
    out = tmp_path / "prebuilt"
    fatbin.build(out, str(nvcc), kdir=kdir, log=lambda s: None)
    return out


@pytest.mark.parametrize("cc, want", [("90", "cubin"), ("80", "cubin"), ("86", "cubin"), ("89", "cubin"),
                                      ("87", "cubin"),        # sm_86's cubin runs on 8.7
                                      ("100", "ptx"), ("120", "ptx"), ("75", None)])
def test_which_cards_a_fatbin_covers(tree_fatbins, cc, want):
    kind, got = fatbin.check("moe", cc, tree_fatbins)
    assert kind == want, got
    if want is None:
        assert got == "no cubin for sm_75 (the fatbin has sm_80, sm_86, sm_89, sm_90)"


def test_the_plan_takes_fresh_cubins_and_compiles_the_rest(built, kdir):
    assert {m: how for m, (how, _, _) in fatbin.plan("90", "auto", built, kdir).items()} == \
        {m: "prebuilt" for m in fatbin.MODULES}
    # a newer card: NVRTC for its own architecture, unless told to take the PTX
    assert {how for how, _, _ in fatbin.plan("100", "auto", built, kdir).values()} == {"nvrtc"}
    assert fatbin.plan("100", "auto", built, kdir)["moe"][2] == "no cubin for sm_100"
    assert fatbin.plan("100", "prebuilt", built, kdir)["moe"][0] == "prebuilt"
    assert {how for how, _, _ in fatbin.plan("90", "nvrtc", built, kdir).values()} == {"nvrtc"}
    with pytest.raises(ValueError, match=r"kernels/matvec\.cu has no usable prebuilt fatbin for sm_75 .*no cubin for sm_75"):
        fatbin.plan("75", "prebuilt", built, kdir)
    with pytest.raises(ValueError, match=r"BLOOMERY_CUDA_KERNELS='fast': one of auto, nvrtc, prebuilt"):
        fatbin.plan("90", "fast", built, kdir)
    # stale, altered or missing: compiled, each with its reason
    (kdir / "attention.cu").write_text((kdir / "attention.cu").read_text() + "\n")
    (built / "matvec.fatbin").write_bytes((built / "matvec.fatbin").read_bytes() + b"\0")
    (built / "layers.json").unlink()
    meta = json.loads((built / "moe.json").read_text())
    (built / "moe.json").write_text(json.dumps({**meta, "options": ["--std=c++17"]}))
    got = fatbin.plan("90", "auto", built, kdir)
    assert got == {"attention": ("nvrtc", None, "the prebuilt fatbin is of another source"),
                   "matvec": ("nvrtc", None, "the prebuilt fatbin does not match its manifest"),
                   "layers": ("nvrtc", None, "no prebuilt fatbin"),
                   "moe": ("nvrtc", None, "the prebuilt fatbin was built with --std=c++17"),
                   "moe_mm": ("prebuilt", str(built / "moe_mm.fatbin"), "cubin"),
                   "recurrent": ("prebuilt", str(built / "recurrent.fatbin"), "cubin")}
    with pytest.raises(ValueError, match=r"kernels/matvec\.cu has no usable prebuilt fatbin for sm_90 .* \(the prebuilt fatbin does not match its manifest\)"):
        fatbin.plan("90", "prebuilt", built, kdir)


def test_the_command_line_refuses_a_bad_arch_by_name(capsys):
    with pytest.raises(SystemExit):
        fatbin.main(["--arch", "sm_90"])
    assert "--arch/--ptx sm_90: compute capabilities as digits" in capsys.readouterr().err


# --- the loader with a fake cupy -------------------------------------------------------------

class FakeCupy:
    """What kernels.Kernels asks of CuPy: the card, RawModule by code (NVRTC) or by path."""

    def __init__(self, cc: str, compile_wait=None, load_fails=()):
        self.loaded: list[str] = []                 # fatbin paths
        self.compiled: list[tuple[str, str]] = []   # (module name, thread name)
        self.compile_wait = compile_wait
        fake = self

        class Device:
            def __init__(self, i=None):
                self.id, self.compute_capability = 0 if i is None else i, cc
                self.attributes = {"MaxSharedMemoryPerBlockOptin": 232448}

            def use(self):
                return self

        class Fn:
            shared_size_bytes, max_dynamic_shared_size_bytes = 0, 0

        class RawModule:
            def __init__(self, *, code=None, path=None, options=()):
                self.code, self.path, self.options = code, path, options

            def compile(self):
                if self.path is not None:
                    if Path(self.path).stem in load_fails:
                        raise RuntimeError("CUDA_ERROR_UNSUPPORTED_PTX_VERSION")
                    fake.loaded.append(self.path)
                    return
                name = next(m for m in fatbin.MODULES if fatbin.source(m) == self.code)
                assert self.options == fatbin.OPTIONS
                if fake.compile_wait:
                    fake.compile_wait(name)
                fake.compiled.append((name, threading.current_thread().name))

            def get_function(self, fn):
                return Fn()

        self.RawModule = RawModule
        self.cuda = types.SimpleNamespace(Device=Device)


@pytest.fixture
def fake_cupy(monkeypatch, tmp_path):
    def make(cc="90", compile_wait=None, load_fails=()):
        fake = FakeCupy(cc, compile_wait, load_fails)
        monkeypatch.setitem(sys.modules, "cupy", fake)
        monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path / "cupy-cache"))
        return fake
    return make


@pytest.fixture
def tree_built(monkeypatch, tmp_path, tree_fatbins) -> Path:
    """A copy of tree_fatbins where the loader looks, to spoil at will."""
    out = tmp_path / "tree-prebuilt"
    shutil.copytree(tree_fatbins, out)
    monkeypatch.setattr(fatbin, "PREBUILT", out)
    return out


def test_the_loader_takes_the_prebuilt_modules_and_compiles_none(fake_cupy, tree_built):
    from bloomery.engine.cuda.kernels import Kernels
    fake = fake_cupy("90")
    k = Kernels()
    got = k.wait()
    assert sorted(fake.loaded) == sorted(str(tree_built / f"{m}.fatbin") for m in fatbin.MODULES)
    assert fake.compiled == []
    assert got["arch"] == "sm_90" and got["mode"] == "auto" and "compiled" not in got
    assert [p.split()[0] for p in got["prebuilt"].split(", ")] == list(fatbin.MODULES)
    k.compile_all()                       # every kernel found in its module
    assert k.mmv3_b1 is k.mmv3_b1


def test_a_stale_module_compiles_in_a_thread_and_is_named(fake_cupy, tree_built):
    from bloomery.engine.cuda.kernels import Kernels
    meta = json.loads((tree_built / "attention.json").read_text())
    (tree_built / "attention.json").write_text(json.dumps({**meta, "source_sha256": "0" * 64}))
    fake = fake_cupy("90")
    got = Kernels().wait()
    assert [n for n, _ in fake.compiled] == ["attention"]
    assert fake.compiled[0][1].startswith("nvrtc")                # not the caller's thread
    assert str(tree_built / "attention.fatbin") not in fake.loaded and len(fake.loaded) == len(fatbin.MODULES) - 1
    assert got["compiled"].startswith("attention ") and got["compiled"].endswith(" s (the prebuilt fatbin is of another source)")


def test_a_fatbin_the_driver_refuses_is_compiled_instead(fake_cupy, tree_built, monkeypatch):
    from bloomery.engine.cuda.kernels import Kernels
    fake = fake_cupy("90", load_fails=("moe",))
    got = Kernels().wait()
    assert [n for n, _ in fake.compiled] == ["moe"] and len(fake.loaded) == len(fatbin.MODULES) - 1
    assert got["compiled"].endswith("(the fatbin did not load: RuntimeError: CUDA_ERROR_UNSUPPORTED_PTX_VERSION)")
    monkeypatch.setenv("BLOOMERY_CUDA_KERNELS", "prebuilt")              # told to compile none: refused by name
    fake_cupy("90", load_fails=("moe",))
    with pytest.raises(RuntimeError, match=r"BLOOMERY_CUDA_KERNELS=prebuilt: .*moe\.fatbin: the fatbin did not load"):
        Kernels()


def test_modules_without_a_cubin_compile_at_once_in_parallel(fake_cupy, tree_built):
    """sm_100: no cubin, so every module compiles with NVRTC; all four are inside their compile
    at the same moment (a barrier of four, which one thread at a time would never pass)."""
    from bloomery.engine.cuda.kernels import Kernels
    barrier = threading.Barrier(len(fatbin.MODULES), timeout=10)
    fake = fake_cupy("100", compile_wait=lambda name: barrier.wait())
    k = Kernels()
    got = k.wait()
    assert sorted(n for n, _ in fake.compiled) == sorted(fatbin.MODULES) and fake.loaded == []
    assert "prebuilt" not in got and got["compiled"].count("(no cubin for sm_100)") == len(fatbin.MODULES)
    assert len({t for _, t in fake.compiled}) == len(fatbin.MODULES)


def test_a_kernel_asked_for_before_wait_joins_its_own_compile(fake_cupy, tree_built, monkeypatch):
    from bloomery.engine.cuda.kernels import Kernels
    monkeypatch.setenv("BLOOMERY_CUDA_KERNELS", "nvrtc")
    fake = fake_cupy("90")
    k = Kernels()
    assert k.get_rows is k.get_rows                             # layers.cu
    assert "layers" in k.report and k.report["layers"][0] == "compiled"
    assert k.wait()["compiled"].count("BLOOMERY_CUDA_KERNELS=nvrtc") == len(fatbin.MODULES)
    assert fake.loaded == []


def test_a_failed_compile_names_its_module(fake_cupy, tree_built, monkeypatch):
    from bloomery.engine.cuda.kernels import Kernels
    monkeypatch.setenv("BLOOMERY_CUDA_KERNELS", "nvrtc")

    def fail(name):
        if name == "moe":
            raise ValueError("error: identifier x is undefined")
    fake_cupy("90", compile_wait=fail)
    with pytest.raises(RuntimeError, match=r"compiling kernels/moe\.cu with NVRTC failed: ValueError: error: identifier x"):
        Kernels().wait()


# --- the real compiler and the wheel -------------------------------------------------------

@pytest.mark.slow                    # nvcc on one module for one arch: a minute or more on 2 busy cores
@pytest.mark.skipif(fatbin.find_nvcc() is None, reason="nvcc is not installed")
def test_nvcc_builds_a_fatbin_holding_every_kernel(tmp_path):
    from bloomery.engine.cuda.kernels import kernel_names
    got = fatbin.build(tmp_path, modules=("layers",), archs=("90",), ptx=None, log=lambda s: None)
    assert got == {"layers": "built"}
    data = (tmp_path / "layers.fatbin").read_bytes()
    assert data[:4] == bytes.fromhex("50ed55ba")                  # the fatbin magic, little-endian 0xba55ed50
    for name in kernel_names(fatbin.source("layers")):
        assert name.encode() + b"\0" in data, name                # the cubin's symbol table names it
    assert fatbin.check("layers", "90", tmp_path) == ("cubin", str(tmp_path / "layers.fatbin"))
    assert fatbin.check("layers", "89", tmp_path)[0] is None       # one arch built: sm_89 compiles


def _wheel(tmp_path, env) -> zipfile.ZipFile:
    src = tmp_path / "src"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "--", ".", ":!tests", ":!tools"],
                           cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    for f in files:
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        if (REPO / f).is_symlink():
            (src / f).symlink_to(os.readlink(REPO / f))
        elif (REPO / f).is_file():
            shutil.copy2(REPO / f, src / f)
    run = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                          "-w", str(tmp_path / "wheel"), str(src)], capture_output=True, text=True,
                         env={**os.environ, **env}, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return zipfile.ZipFile(next((tmp_path / "wheel").glob("bloomery-*.whl")))


@pytest.mark.slow
def test_the_wheel_ships_a_fresh_fatbin_per_module(tmp_path, nvcc):
    whl = _wheel(tmp_path, {"BLOOMERY_NVCC": str(nvcc)})
    for m in fatbin.MODULES:
        meta = json.loads(whl.read(f"bloomery/engine/cuda/prebuilt/{m}.json"))
        assert meta["source_sha256"] == fatbin.source_sha256(m)
        assert whl.read(f"bloomery/engine/cuda/prebuilt/{m}.fatbin").decode().split("\n", 1)[1] == fatbin.source(m)


@pytest.mark.slow
def test_without_nvcc_the_wheel_builds_with_no_fatbins(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    whl = _wheel(tmp_path, {"PATH": f"{Path(sys.executable).parent}:{empty}", "CUDA_HOME": str(empty),
                            "BLOOMERY_NVCC": ""})
    names = whl.namelist()
    assert "bloomery/engine/cuda/kernels.py" in names
    assert not [n for n in names if "/prebuilt/" in n]
