"""bloomery/need.py's pure parts: which hook runs, the unit name, the need record's terms from the plan."""
from __future__ import annotations

import sys

import pytest

from bloomery import need
from bloomery.messages import stage as sm
from bloomery.settings import SettingsError, parse


def test_hook_choice_flag_env_default(tmp_path):
    hook = tmp_path / "h"
    hook.write_text("#!/bin/sh\nexit 0\n")
    hook.chmod(0o755)
    sock_dir = tmp_path / "run"
    env = {"BLOOMERY_BROKER_DIR": str(sock_dir)}
    assert need.resolve_hook(None, env) is None                       # no broker socket: no hook
    sock_dir.mkdir()
    (sock_dir / "broker.sock").touch()
    assert need.resolve_hook(None, env) == [sys.executable, str(need.SHIPPED_HOOK)]
    assert need.resolve_hook(None, {**env, "BLOOMERY_NEED_HOOK": str(hook)}) == [str(hook)]
    assert need.resolve_hook(str(hook), {**env, "BLOOMERY_NEED_HOOK": "/nope"}) == [str(hook)]   # the flag wins
    assert need.resolve_hook("none", env) is None and need.resolve_hook(None, {**env, "BLOOMERY_NEED_HOOK": ""}) is None
    with pytest.raises(SettingsError, match="--need-hook /no/such: no such file"):
        need.resolve_hook("/no/such", env)
    hook.chmod(0o644)
    with pytest.raises(SettingsError, match=f"BLOOMERY_NEED_HOOK {hook}: not executable"):
        need.resolve_hook(None, {"BLOOMERY_NEED_HOOK": str(hook)})


def test_need_hook_flag_parses():
    s = parse(["-m", "x.gguf", "--need-hook", "/opt/h"])
    assert s.need_hook == "/opt/h"
    assert parse(["-m", "x.gguf"]).need_hook is None


def test_unit_name(tmp_path):
    cg = tmp_path / "cgroup"
    cg.write_text("0::/system.slice/system-bloomery.slice/bloomery@qwen.service\n")
    assert need.unit_name({}, cg) is None                              # not under systemd
    assert need.unit_name({"INVOCATION_ID": "abc"}, cg) == "bloomery@qwen.service"
    assert need.unit_name({"BLOOMERY_UNIT": "u.service", "INVOCATION_ID": "abc"}, cg) == "u.service"


def test_need_terms_from_the_plans_placement():
    from bloomery.placement import DeviceNeed, Placement, Terms
    from bloomery.stage_runner import StageFailed
    placement = Placement("cuda", 1, 4096, "cuda:1", devices=(
        DeviceNeed("host", 10**9, Terms(margin=100)), DeviceNeed("cuda:0", 5, Terms()),
        DeviceNeed("cuda:1", 10**9, Terms(weights=300, kv=100, scratch=56, margin=1000))))
    planned = sm.decode(sm.encode(sm.PlanDone((), {"n_ctx": 1}, placement)))   # as it crosses from the plan stage
    assert planned.placement == placement
    assert need.need_terms(planned) == (100, [0, 456])       # the host's reserve asked for, a card's margin not
    with pytest.raises(StageFailed, match="no placement"):
        need.need_terms(sm.PlanDone((), {}))
    fetched = sm.FetchDone("/m.gguf", (), n_bytes=99)
    r = need.need_record(planned, fetched, "m", {})
    assert r["host_bytes"] == 100 and r["card_bytes"] == [0, 456] and r["disk_bytes"] == 99 and r["version"] == 1
    from bloomery.broker.book import parse_need
    assert parse_need(r).host_bytes == 100                              # the broker reads what we send
