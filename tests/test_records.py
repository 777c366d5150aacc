"""A record whose sink is gone is lost, and the caller goes on (SIGTERM under a lost journal stream)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from bloomery import records


class _Broken:
    def write(self, _text):
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self):
        raise BrokenPipeError(32, "Broken pipe")


def test_record_to_a_broken_pipe_is_dropped_not_raised():
    before = records.lost_records()
    records.configure("test", stream=_Broken())
    try:
        records.record("draining", "stopping", cause="SIGTERM")
    finally:
        records.configure("test", stream=None)
    assert records.lost_records() == before + 1


def test_sigterm_stops_a_server_whose_stderr_is_gone(tokenizer_source, tmp_path):
    """bloomery-serve with nobody reading its stderr (every write gets EPIPE) keeps serving,
    and one SIGTERM still drains it and exits 0."""
    from tests.conftest import load_tool
    model = load_tool("make_synthetic").write_synthetic(tmp_path / "tiny.gguf", "qwen2",
                                                        tokenizer_from=str(tokenizer_source))
    r, w = os.pipe()
    proc = subprocess.Popen([sys.executable, "-m", "bloomery.supervisor", "--port", "0", "-m", str(model)],
                            stderr=w, stdout=subprocess.DEVNULL,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    os.close(w)
    os.close(r)
    try:
        time.sleep(4)
        assert proc.poll() is None, f"bloomery-serve ended by itself ({proc.returncode})"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# --- the record shape: structlog's time and level on every record; --log-format text|json ---

def _capture(fn, **fmt):
    import io
    out = io.StringIO()
    records.configure("test", stream=out)
    records.configure_format(**fmt)
    try:
        fn()
    finally:
        records.configure("test", stream=None)
        records.configure_format()
    return out.getvalue().splitlines()


def test_a_text_record_starts_with_its_utc_time_and_level():
    import re
    [line] = _capture(lambda: records.record("plan", "ctx", level="warning", n_ctx=4096))
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+Z warning \[plan\] test: ctx n_ctx=4096", line), line


def test_prefix_and_timestamps_switches():
    one = lambda: records.record("plan", "ctx", n_ctx=1)     # noqa: E731
    assert _capture(one, prefix=False) == ["[plan] test: ctx n_ctx=1"]
    assert _capture(one, timestamps=False) == ["info    [plan] test: ctx n_ctx=1"]


def test_a_json_record_is_one_object_with_time_and_level():
    import json
    [line] = _capture(lambda: records.record("ready", "request 3 /completion", level="error", time_s=1.5,
                                             time="clash"), log_format="json")
    obj = json.loads(line)
    assert obj["time"].endswith("Z") and obj["level"] == "error"
    assert {k: obj[k] for k in ("phase", "component", "message", "time_s", "field_time")} == \
        {"phase": "ready", "component": "test", "message": "request 3 /completion", "time_s": 1.5,
         "field_time": "clash"}


def test_a_stage_record_keeps_the_time_it_was_made():
    from bloomery.messages import stage as sm
    rec = sm.decode(sm.encode(sm.Record("load", "engine", "warmup", {}, "info", "2026-01-02T03:04:05.000006Z")))
    [line] = _capture(lambda: records.emit(rec))
    assert line == "2026-01-02T03:04:05.000006Z info    [load] engine: warmup"


def test_log_flags_read_into_settings():
    import pytest

    from bloomery.settings import SettingsError, parse
    m = ["-m", "x.gguf"]
    assert parse(m, {}).log_format == "text"
    assert parse(m + ["--log-format", "json"], {}).log_format == "json"
    assert parse(m + ["--log-jsonl"], {}).log_format == "json"
    assert parse(m, {"LLAMA_ARG_LOG_JSONL": "1"}).log_format == "json"
    s = parse(m + ["--no-log-prefix", "--no-log-timestamps"], {})
    assert (s.log_prefix, s.log_timestamps) == (False, False)
    with pytest.raises(SettingsError, match="--log-jsonl beside --log-format text"):
        parse(m + ["--log-jsonl", "--log-format", "text"], {})


@pytest.mark.slow
def test_a_json_server_prints_only_json_records_and_the_request_record(tokenizer_source, tmp_path):
    """bloomery-serve --log-format json: every stderr line is one JSON object with time and level,
    the per-request line among them as a record of the same shape."""
    import json
    import re
    import urllib.request

    from tests.conftest import load_tool
    model = load_tool("make_synthetic").write_synthetic(tmp_path / "tiny.gguf", "qwen2",
                                                        tokenizer_from=str(tokenizer_source))
    proc = subprocess.Popen([sys.executable, "-m", "bloomery.supervisor", "--port", "0", "--model", str(model),
                             "--log-format", "json", "--no-warmup", "-c", "256"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    lines: list[str] = []
    try:
        port = None
        while port is None:
            line = proc.stderr.readline().decode()
            assert line, "\n".join(lines)
            lines.append(line)
            port = json.loads(line).get("port") if '"listening"' in line else None
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        body = json.dumps({"prompt": "ab", "n_predict": 2}).encode()
        with urllib.request.urlopen(urllib.request.Request(url + "/completion", data=body), timeout=60) as r:
            assert r.status == 200
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=30)[1].decode()
        lines += rest.splitlines()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    objs = [json.loads(x) for x in lines if x.strip()]
    assert all(re.fullmatch(r"\d{4}-.*Z", o["time"]) and o["level"] in ("info", "warning", "error") for o in objs)
    [req] = [o for o in objs if o["message"].startswith("request ")]
    assert req["component"] == "bloomery-serve" and req["phase"] == "ready" and "/completion: prompt" in req["message"]
    assert {"flag": "--model", "as": "--model", "message": "flag read"}.items() <= next(
        o for o in objs if o.get("flag") == "--model").items()


def test_log_file_gets_every_record_too(tmp_path):
    path = tmp_path / "records.log"
    with open(path, "a", encoding="utf-8") as f:
        shown = _capture(lambda: records.record("plan", "ctx", n_ctx=1), file=f, prefix=False)
    assert shown == ["[plan] test: ctx n_ctx=1"] and path.read_text() == "[plan] test: ctx n_ctx=1\n"


def test_a_log_file_that_cannot_be_opened_refuses_the_start(tmp_path):
    r = subprocess.run([sys.executable, "-m", "bloomery.supervisor", "-m", "x.gguf", "--log-file",
                        str(tmp_path / "no" / "such" / "dir" / "f.log")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "--log-file" in r.stderr and "cannot open it" in r.stderr
