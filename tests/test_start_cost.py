"""What a server's start leaves out (tools/bench_start_cpu.py measures what it costs): numpy's OpenBLAS
threads in the processes that multiply no matrix, and the constraint engine until the first grammar."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

THREADS = "print(os.environ.get('OPENBLAS_NUM_THREADS'), " \
          "[int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('Threads:')][0])"


def _run(code: str, env: dict) -> str:
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                          timeout=120).stdout.split()


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the thread count from /proc")
def test_numpy_loads_with_one_blas_thread_and_the_environment_stays_as_it_was():
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    code = "import os\nfrom bloomery.stages.common import import_numpy_one_blas_thread as f\nf()\n" + THREADS
    assert _run(code, env) == ["None", "1"]          # no OpenBLAS thread, and the engine's environment untouched
    assert _run(code, {**env, "OPENBLAS_NUM_THREADS": "2"})[0] == "2"     # the user's value is kept


def test_the_start_imports_no_constraint_engine_until_a_grammar_is_read():
    code = ("import sys\nimport bloomery.supervisor, bloomery.api.app, bloomery.stages.engine, bloomery.engine.core\n"
            "import bloomery.plan, bloomery.engine.cpu.backend, bloomery.stages.plan\n"
            "from bloomery.grammar import GrammarError, SchemaError\n"
            "print('llguidance' in sys.modules)\n"
            "from bloomery.grammar import schema_grammar\n"
            "print('llguidance' in sys.modules, bool(schema_grammar({'type': 'integer'})))")
    assert _run(code, dict(os.environ)) == ["False", "True", "True"]
