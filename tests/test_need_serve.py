"""Two real bloomery-serve processes on the real model behind a real bloomery-broker whose host cap holds one.

The second start stays `queued` (503 with phase queued from every route) until the first
stops; the broker is SIGKILLed and restarted mid-queue and keeps the lease and the queue;
a granted server SIGKILLed has its lease released within seconds. The need hook's
contract is exercised through --need-hook too (a refusal reaches the start by name)."""
from __future__ import annotations

import json
import os
import signal
import stat
import time
import urllib.error
import urllib.request

import pytest

from serve_proc import Served
from test_broker_daemon import BrokerProc, wait_for

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def need_bytes(real_model_path) -> int:
    """The host need a `-c 2048 --backend cpu` start asks for, by the plan's own arithmetic."""
    from bloomery.gguf_file import open_gguf
    from bloomery.plan import Census, make_plan, model_facts

    gf = open_gguf(str(real_model_path))
    try:
        facts = model_facts(gf)
    finally:
        gf.close()
    return make_plan(facts, Census(1 << 40), "numpy", ctx_size=2048, n_parallel=1).host_bytes


def server_args(path) -> list[str]:
    return ["-m", str(path), "-c", "2048", "--backend", "cpu", "--no-warmup"]


def answer(url: str, body: bytes | None = None, timeout_s: float = 10) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_second_start_queued_until_the_first_stops(tmp_path, real_model_path, need_bytes):
    broker = BrokerProc(tmp_path, cap=str(need_bytes * 3 // 2)).start()       # one need fits, two do not
    env = {"BLOOMERY_BROKER_DIR": broker.env["BLOOMERY_BROKER_DIR"]}          # the default hook finds the socket
    a = b = None
    try:
        a = Served(*server_args(real_model_path), env=env).start()
        leases = broker.status()["leases"]
        assert [(e["need"]["pid"], e["need"]["host_bytes"]) for e in leases] == [(a.proc.pid, need_bytes)]
        assert leases[0]["need"]["model"] == real_model_path.name and leases[0]["need"]["disk_bytes"] > 0

        b = Served(*server_args(real_model_path), env=env).start(wait_ready=False)
        wait_for(lambda: answer(b.url + "/health")[1].get("error", {}).get("phase") == "queued", 60, "B queued")
        for route, body in (("/health", None), ("/v1/models", None), ("/completion", b'{"prompt": "hi"}')):
            code, got = answer(b.url + route, body)
            assert code == 503 and got["error"]["phase"] == "queued" and got["error"]["message"] == "Loading model"
        wait_for(lambda: [e["need"]["pid"] for e in broker.status()["queue"]] == [b.proc.pid], 10, "B in the queue")
        wait_for(lambda: any("need-hook: queued" in x and "position=1" in x for x in b.lines), 10, "a queue record")

        broker.stop(signal.SIGKILL)                      # mid-queue: nothing may be lost
        broker.start()
        st = broker.status()
        assert [e["need"]["pid"] for e in st["leases"]] == [a.proc.pid]
        assert [e["need"]["pid"] for e in st["queue"]] == [b.proc.pid]
        time.sleep(1.5)
        assert answer(b.url + "/health")[1]["error"]["phase"] == "queued"

        t0 = time.monotonic()
        assert a.stop() == 0
        b.wait_ready()
        assert time.monotonic() - t0 < 120
        code, got = answer(b.url + "/completion", b'{"prompt": "def add(a, b):", "n_predict": 2}', 120)
        assert code == 200 and got["tokens_predicted"] == 2
        assert [e["need"]["pid"] for e in broker.status()["leases"]] == [b.proc.pid]
        assert any("[queued] need-hook: granted" in x for x in b.lines)

        b.proc.send_signal(signal.SIGKILL)               # a granted server killed: its lease goes within seconds
        b.proc.wait()
        t0 = time.monotonic()
        wait_for(lambda: broker.status()["leases"] == [], 10, "B's lease to be released")
        assert time.monotonic() - t0 < 5
    finally:
        for s in (a, b):
            if s is not None:
                s.stop()
        broker.stop()


def _ended_by_hook(tmp_path, real_model_path, name: str, script: str, status: int) -> tuple[Served, str]:
    """A server whose --need-hook is `script`: it ends with `status` before loading; (server, its records)."""
    hook = tmp_path / name
    hook.write_text("#!/bin/sh\n" + script)
    hook.chmod(hook.stat().st_mode | stat.S_IXUSR)
    s = Served(*server_args(real_model_path), "--need-hook", str(hook))
    s.start(wait_ready=False)
    assert s.proc.wait(60) == status
    text = "\n".join(s.lines)
    assert "[load]" not in text                          # ended before any weight is read
    return s, text


def test_need_hook_refusal_ends_the_start_by_name(tmp_path, real_model_path):
    s, text = _ended_by_hook(tmp_path, real_model_path, "refuse", 'cat > "$0.stdin"\n'
                             'echo \'{"event": "refused", "reason": "no room on card 0"}\' >&2\nexit 1\n', 1)
    assert "the need hook refused the start (exit 1): no room on card 0" in text
    need = json.loads((tmp_path / "refuse.stdin").read_text())
    assert need["pid"] == s.proc.pid and need["version"] == 1 and need["card_bytes"] == []
    assert need["host_bytes"] > 0 and need["disk_bytes"] == os.path.getsize(real_model_path)


def test_need_hook_exit_75_ends_the_server_with_75_and_the_hooks_last_stdout_line(tmp_path, real_model_path):
    _, text = _ended_by_hook(tmp_path, real_model_path, "later",
                             "cat > /dev/null\necho 'asking the broker'\necho 'card 0 is lent until 12:00'\n"
                             "echo '{\"event\": \"queued\", \"position\": 2}' >&2\nexit 75\n", 75)
    assert "the need hook deferred the start (exit 75): card 0 is lent until 12:00" in text


def test_need_hook_that_cannot_run_is_refused_before_fetch(tmp_path, real_model_path):
    hook = tmp_path / "not-executable"
    hook.write_text("#!/bin/sh\nexit 0\n")
    s = Served(*server_args(real_model_path), env={"BLOOMERY_NEED_HOOK": str(hook)})
    s.start(wait_ready=False)
    assert s.proc.wait(60) == 1
    assert any(f"BLOOMERY_NEED_HOOK {hook}: not executable" in x for x in s.lines)


def test_sigterm_while_queued_withdraws_and_exits_0(tmp_path, real_model_path, need_bytes):
    import subprocess
    broker = BrokerProc(tmp_path, cap=str(need_bytes * 3 // 2)).start()
    holder = subprocess.Popen(["sleep", "60"])
    try:
        granted = broker.ask({"op": "need", "id": "other", "need": {"pid": holder.pid, "host_bytes": need_bytes}})
        assert granted["op"] == "granted"
        s = Served(*server_args(real_model_path), env={"BLOOMERY_BROKER_DIR": broker.env["BLOOMERY_BROKER_DIR"]})
        s.start(wait_ready=False)
        wait_for(lambda: [e["need"]["pid"] for e in broker.status()["queue"]] == [s.proc.pid], 60, "queued")
        assert s.stop() == 0
        assert broker.status()["queue"] == []          # withdrawn by the hook at once, not left to the pid poll
        assert any("need-hook: error" in x and "withdrawn" in x for x in s.lines)
        assert not any("[load]" in x for x in s.lines)
    finally:
        holder.kill()
        holder.wait()
        broker.stop()
