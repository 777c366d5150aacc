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


def test_need_terms_from_the_plan_need_record():
    rec = sm.Record("plan", "plan", "need", {"bytes": 123, "cards": "[0, 456]"})   # as the plan stage sends it
    planned = sm.PlanDone((rec,), {"n_ctx": 1})
    assert need.need_terms(planned) == (123, [0, 456])
    assert need.need_terms(sm.PlanDone((), {"host_bytes": 7, "card_bytes": [8]})) == (7, [8])
    fetched = sm.FetchDone("/m.gguf", (), n_bytes=99)
    r = need.need_record(planned, fetched, "m", {})
    assert r["host_bytes"] == 123 and r["card_bytes"] == [0, 456] and r["disk_bytes"] == 99 and r["version"] == 1
    from bloomery.broker.book import parse_need
    assert parse_need(r).host_bytes == 123                              # the broker reads what we send
