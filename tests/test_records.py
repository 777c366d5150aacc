"""A record whose sink is gone is lost, and the caller goes on (SIGTERM under a lost journal stream)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

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
