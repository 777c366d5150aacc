"""units/: `systemd-analyze verify` (and its offline security score) on every unit, in a scratch
root that holds the host's own units and the executables the units name; then what the
units promise (Type=notify, the watchdog, the back-off, the hardening) read from the files."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
UNITS = ("bloomery@.service", "bloomery@.socket", "bloomery-broker.service")
ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed "
                                   "(apt-get install systemd): the units cannot be verified here")
MAX_EXPOSURE = 30              # systemd-analyze security's threshold: 3.0 of 10 ("OK")


def systemd_version() -> int:
    out = subprocess.run([ANALYZE, "--version"], capture_output=True, text=True).stdout
    return int(re.match(r"systemd (\d+)", out).group(1))


def scratch_root(tmp: Path, unit_dir: Path, executables=("usr/bin/bloomery-serve", "usr/bin/bloomery-broker")) -> Path:
    """A root with the host's units (the targets ours name) beside ours, and the executables."""
    root = tmp / "root"
    dest = root / "lib/systemd/system"
    host_units = next(p for p in (Path("/lib/systemd/system"), Path("/usr/lib/systemd/system")) if p.is_dir())
    shutil.copytree(host_units, dest, symlinks=True, dirs_exist_ok=True)
    for unit in UNITS:
        shutil.copy(unit_dir / unit, dest / unit)
    for exe in executables:
        path = root / exe
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("#!/bin/sh\n")
            path.chmod(0o755)
    return root


def verify(root: Path) -> list[str]:
    """systemd-analyze verify's complaints about our units (it exits 0 on many of them: every line counts)."""
    paths = [str(root / "lib/systemd/system" / u) for u in UNITS]
    out = subprocess.run([ANALYZE, "verify", "--man=no", f"--root={root}", *paths], capture_output=True, text=True,
                         cwd=root)
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]
    return lines + ([f"exit status {out.returncode}"] if out.returncode else [])


@needs_analyze
def test_every_unit_verifies(tmp_path):
    assert verify(scratch_root(tmp_path, REPO / "units")) == []


@needs_analyze
def test_verify_catches_a_bad_value(tmp_path):
    """The check itself: a wrong value (systemd ignores it with a warning, exit 0) is caught."""
    bad = tmp_path / "units"
    shutil.copytree(REPO / "units", bad)
    text = (bad / "bloomery@.service").read_text()
    (bad / "bloomery@.service").write_text(text.replace("KillMode=mixed", "KillMode=gentle"))
    assert any("KillMode" in line or "kill mode" in line for line in verify(scratch_root(tmp_path, bad)))


@needs_analyze
def test_verify_catches_a_missing_executable(tmp_path):
    root = scratch_root(tmp_path, REPO / "units", executables=("usr/bin/bloomery-serve",))
    assert any("/usr/bin/bloomery-broker" in line for line in verify(root))


@needs_analyze
@pytest.mark.parametrize("unit", ["bloomery@x.service", "bloomery-broker.service"])
def test_hardening_exposure_stays_low(tmp_path, unit):
    root = scratch_root(tmp_path, REPO / "units")
    out = subprocess.run([ANALYZE, "security", "--offline=yes", f"--threshold={MAX_EXPOSURE}", f"--root={root}",
                          "--no-pager", unit], capture_output=True, text=True, cwd=root)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr


# -- what the units promise, read from the files ------------------------------------------
def settings(unit: str, path: Path | None = None) -> dict[str, list[str]]:
    """key -> every value given (a key may repeat: DeviceAllow=); comments and sections dropped."""
    out: dict[str, list[str]] = {}
    for line in (path or REPO / "units" / unit).read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            out.setdefault(key, []).append(value)
    return out


def test_service_is_notify_with_watchdog_short_start_and_bounded_restarts():
    s = settings("bloomery@.service")
    assert s["Type"] == ["notify"] and s["NotifyAccess"] == ["main"]
    assert s["ExecStart"] == ["/usr/bin/bloomery-serve --config /etc/bloomery/%i.json"]
    assert int(s["TimeoutStartSec"][0]) <= 120        # EXTEND_TIMEOUT_USEC carries a long start
    assert int(s["WatchdogSec"][0]) >= 10
    assert s["Restart"] == ["on-failure"] and int(s["RestartSec"][0]) > 0
    assert int(s["StartLimitBurst"][0]) > 0 and int(s["StartLimitIntervalSec"][0]) > 0
    assert int(backoff("bloomery@.service")["RestartMaxDelaySec"][0]) >= int(s["RestartSec"][0])


@pytest.mark.parametrize("unit", ["bloomery@.service", "bloomery-broker.service"])
def test_services_run_hardened_as_the_static_user(unit):
    s = settings(unit)
    assert s["User"] == ["bloomery"] and s["Group"] == ["bloomery"]
    for key, value in {"ProtectSystem": "strict", "ProtectHome": "yes", "PrivateTmp": "yes",
                       "NoNewPrivileges": "yes", "DevicePolicy": "closed", "CapabilityBoundingSet": ""}.items():
        assert s[key] == [value], key
    allowed = " ".join(s["DeviceAllow"])
    assert "char-nvidia-frontend rw" in allowed and "char-nvidia-uvm rw" in allowed
    assert "DynamicUser" not in s


def test_directories_and_their_modes():
    server, broker = settings("bloomery@.service"), settings("bloomery-broker.service")
    assert server["RuntimeDirectory"] == ["bloomery/%i"] and server["RuntimeDirectoryMode"] == ["0700"]
    assert server["CacheDirectory"] == ["bloomery"] and server["StateDirectory"] == ["bloomery"]
    assert "XDG_RUNTIME_DIR=%t/bloomery/%i" in " ".join(server["Environment"])   # stage sockets live there
    assert broker["RuntimeDirectory"] == ["bloomery-broker"] and broker["RuntimeDirectoryMode"] == ["0750"]
    assert broker["StateDirectory"] == ["bloomery-broker"]
    assert broker["ExecStart"] == ["/usr/bin/bloomery-broker serve"]


def test_socket_passes_one_listener_to_its_service():
    s = settings("bloomery@.socket")
    assert len(s["ListenStream"]) == 1 and s["Accept"] == ["no"]
    assert s["Service"] == ["bloomery@%i.service"] and s["FileDescriptorName"] == ["http"]


def test_example_config_is_a_valid_instance_config():
    from bloomery.settings import parse
    s = parse(["--config", str(REPO / "packaging/example.json")], {})
    assert s.port == 8080 and (s.hf_repo or s.model_file)


# -- the restart back-off: a drop-in only where systemd knows its keys (>= 254) ---------------
BACKOFF = REPO / "units" / "backoff"


def backoff(unit: str) -> dict[str, list[str]]:
    return settings(unit, BACKOFF / f"{unit}.d" / "backoff.conf")


def install_backoff(root: Path, *args: str) -> list[Path]:
    subprocess.run(["sh", str(BACKOFF / "install"), "--root", str(root), *args], check=True)
    return sorted((root / "lib/systemd/system").glob("bloomery*.d/*.conf"))


def test_backoff_dropins_go_in_only_from_systemd_254_and_go_away_on_remove(tmp_path):
    units = tmp_path / "lib/systemd/system"
    assert install_backoff(tmp_path, "--systemd-version", "252") == []
    got = install_backoff(tmp_path, "--systemd-version", "254")
    assert [p.relative_to(units).as_posix() for p in got] == \
        ["bloomery-broker.service.d/50-backoff.conf", "bloomery@.service.d/50-backoff.conf"]
    assert got[1].read_bytes() == (BACKOFF / "bloomery@.service.d/backoff.conf").read_bytes()
    assert install_backoff(tmp_path, "--systemd-version", "253") == [] and not any(units.iterdir())
    install_backoff(tmp_path, "--systemd-version", "255")
    assert install_backoff(tmp_path, "--remove") == [] and not any(units.iterdir())
    bad = subprocess.run(["sh", str(BACKOFF / "install"), "--root", str(tmp_path), "--systemd-version", "25x"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "systemd version '25x' is no number" in bad.stderr


def test_backoff_doubles_from_restart_sec_to_a_bounded_delay():
    for unit in ("bloomery@.service", "bloomery-broker.service"):
        s, b = settings(unit), backoff(unit)
        assert sorted(b) == ["RestartMaxDelaySec", "RestartSteps"], unit
        assert int(b["RestartSteps"][0]) > 0 and int(b["RestartMaxDelaySec"][0]) > int(s["RestartSec"][0])
        assert "RestartSteps" not in s and "RestartMaxDelaySec" not in s, f"{unit}: 252 warns on them"


@needs_analyze
def test_units_with_this_systemds_dropins_verify(tmp_path):
    """What the .deb's postinst leaves on this host (drop-ins or none) verifies with no complaint."""
    root = scratch_root(tmp_path, REPO / "units")
    dropins = install_backoff(root)
    assert bool(dropins) == (systemd_version() >= 254)
    assert verify(root) == []


@needs_analyze
@pytest.mark.skipif(ANALYZE is not None and systemd_version() >= 254, reason="systemd >= 254 knows the keys")
def test_an_older_systemd_warns_on_the_backoff_keys(tmp_path):
    """Why they are a drop-in: systemd < 254 (Debian 12's 252) names both keys unknown."""
    root = scratch_root(tmp_path, REPO / "units")
    install_backoff(root, "--systemd-version", "254")
    complaints = " ".join(verify(root))
    assert "Unknown key 'RestartSteps'" in complaints and "Unknown key 'RestartMaxDelaySec'" in complaints
