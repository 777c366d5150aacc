"""packaging/build-deb.sh: the .deb builds from this tree, carries the units, the hook, the entry
points and the example config, installs into a scratch root (dpkg -x), and bloomery-serve
--version runs from there. The package's venv gets its dependencies as a real build does
(pip, from its cache or the index), so the test holds the same in a venv and outside one;
--compress none keeps the build at about a minute (xz alone takes that long again)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from test_systemd_units import ANALYZE, scratch_root, verify

REPO = Path(__file__).resolve().parents[1]
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
VENV = "opt/bloomery/venv"
# what the package's own python runs with: a caller's PYTHONPATH (a source tree) would be imported instead
PACKAGE_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="dpkg-deb is not installed (a Debian host)")]


@pytest.fixture(scope="module")
def deb(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("deb")
    base = getattr(sys, "_base_executable", sys.executable)     # in a venv: the interpreter it was made from
    run = subprocess.run(["bash", str(REPO / "packaging/build-deb.sh"), "--out", str(out), "--python", base,
                          "--compress", "none"], capture_output=True, text=True, timeout=900,
                         # no nvcc step (setup.py): that is the prebuilt kernels' test, and takes minutes
                         env={**os.environ, "BLOOMERY_PIP_PYTHON": sys.executable, "BLOOMERY_BUILD_KERNELS": "0"})
    assert run.returncode == 0, run.stderr[-4000:]
    path = Path(run.stdout.strip().splitlines()[-1])
    assert path.name == f"bloomery_{VERSION}_{_arch()}.deb" and path.is_file()
    return path


@pytest.fixture(scope="module")
def scratch(deb, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("scratch")
    subprocess.run(["dpkg", "-x", str(deb), str(root)], check=True)
    return root


def _arch() -> str:
    return subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True).stdout.strip()


def test_control_fields(deb):
    fields = subprocess.run(["dpkg-deb", "-f", str(deb), "Package", "Version", "Architecture", "Depends"],
                            capture_output=True, text=True, check=True).stdout
    assert f"Package: bloomery\nVersion: {VERSION}\nArchitecture: {_arch()}\n" in fields
    assert re.search(r"Depends: python3\.\d+, adduser", fields)


def test_contents(deb):
    listing = subprocess.run(["dpkg-deb", "-c", str(deb)], capture_output=True, text=True, check=True).stdout
    entries = {line.split()[5].lstrip("."): line for line in listing.splitlines()}
    for unit in ("bloomery@.service", "bloomery@.socket", "bloomery-broker.service"):
        assert entries[f"/lib/systemd/system/{unit}"].startswith("-rw-r--r-- root/root")
    assert entries["/usr/lib/bloomery/bloomery-need"].startswith("-rwxr-xr-x root/root")
    assert entries["/usr/lib/bloomery/backoff/install"].startswith("-rwxr-xr-x root/root")
    for unit in ("bloomery@.service", "bloomery-broker.service"):
        assert f"/usr/lib/bloomery/backoff/{unit}.d/backoff.conf" in entries
        assert not any(e.startswith(f"/lib/systemd/system/{unit}.d") for e in entries), "postinst's, by version"
    assert f"/{VENV}/lib/python3.11/site-packages/bloomery/supervisor.py" in entries
    assert f"/{VENV}/lib/python3.11/site-packages/bloomery/__pycache__/supervisor.cpython-311.pyc" in entries
    assert "/etc/bloomery/example.json" in entries and "/usr/share/doc/bloomery/service.md" in entries
    for script in ("bloomery-serve", "bloomery-broker"):
        assert entries[f"/usr/bin/{script}"].endswith(f"/usr/bin/{script} -> ../../{VENV}/bin/{script}")
        assert entries[f"/{VENV}/bin/{script}"].startswith("-rwxr-xr-x")


def test_maintainer_scripts(deb, tmp_path):
    subprocess.run(["dpkg-deb", "-e", str(deb), str(tmp_path / "ctl")], check=True)
    ctl = tmp_path / "ctl"
    assert (ctl / "conffiles").read_text().split() == ["/etc/bloomery/example.json"]
    for name in ("postinst", "prerm", "postrm"):
        assert os.access(ctl / name, os.X_OK)
        subprocess.run(["sh", "-n", str(ctl / name)], check=True)
    post = (ctl / "postinst").read_text()
    assert "adduser --system" in post and "systemctl daemon-reload" in post
    assert post.count("/usr/lib/bloomery/backoff/install\n") == 2      # on configure and on a systemd upgrade
    assert "/usr/lib/bloomery/backoff/install --remove" in (ctl / "prerm").read_text()
    triggers = [x for x in (ctl / "triggers").read_text().splitlines() if x and not x.startswith("#")]
    assert triggers == ["interest-noawait /lib/systemd/systemd", "interest-noawait /usr/lib/systemd/systemd"]


def test_installed_tree_names_only_installed_paths(scratch):
    """Shebangs, pyvenv.cfg and byte-code name /opt/bloomery, never the build's staging folder."""
    assert (scratch / VENV / "bin/bloomery-serve").read_text().startswith(f"#!/{VENV}/bin/python\n")
    assert (scratch / "usr/lib/bloomery/bloomery-need").read_text().startswith(f"#!/{VENV}/bin/python\n")
    leaks = subprocess.run(["grep", "-rlaF", "bloomery-deb.", str(scratch)], capture_output=True, text=True).stdout
    assert leaks == ""


def test_serve_version_runs_from_the_scratch_root(scratch, tmp_path):
    """The package's own venv and script, its python reading the scratch tree's site-packages."""
    py = scratch / VENV / "bin/python"
    out = subprocess.run([str(py), str(scratch / "usr/bin/bloomery-serve"), "--version"], capture_output=True,
                         text=True, cwd=tmp_path, timeout=60, env=PACKAGE_ENV)
    assert out.returncode == 0 and out.stdout == f"bloomery-serve {VERSION}\n", out.stderr
    where = subprocess.run([str(py), "-c", "import bloomery; print(bloomery.__file__)"], capture_output=True,
                           text=True, cwd=tmp_path, env=PACKAGE_ENV).stdout.strip()
    assert where.startswith(str(scratch / VENV))


def _in_namespace(scratch: Path, script: str) -> subprocess.CompletedProcess:
    """Run `script` where /opt/bloomery is the package's (a private mount namespace, as root)."""
    setup = f"mount -t tmpfs none /opt && mkdir /opt/bloomery && mount --bind {scratch}/opt/bloomery /opt/bloomery"
    out = subprocess.run(["unshare", "-m", "sh", "-c", f"{setup} || exit 99; {script}"], capture_output=True,
                         text=True, timeout=60, env=PACKAGE_ENV)
    if out.returncode == 99 or "unshare failed" in out.stderr:
        pytest.skip(f"no private mount namespace here (unshare -m as root): {out.stderr.strip()[:200]}")
    return out


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0, reason="needs unshare -m as root")
def test_entry_points_run_at_their_installed_paths(scratch):
    out = _in_namespace(scratch, f"{scratch}/usr/bin/bloomery-serve --version && "
                                 f"{scratch}/usr/bin/bloomery-broker --help >/dev/null && "
                                 f"echo '{{' | {scratch}/usr/lib/bloomery/bloomery-need; echo hook=$?")
    assert out.stdout.startswith(f"bloomery-serve {VERSION}\n"), out.stderr
    assert "hook=2" in out.stdout               # the hook ran (pyzmq found) and refused a bad need record


@pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed (apt-get install systemd)")
def test_installed_units_verify_against_the_package(scratch, tmp_path):
    """The units as installed, their ExecStart= resolved inside the package (no stand-in executables)."""
    root = scratch_root(tmp_path, scratch / "lib/systemd/system", executables=())
    shutil.copytree(scratch, root, symlinks=True, dirs_exist_ok=True)
    assert verify(root) == []
