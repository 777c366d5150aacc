"""Heavy request work off the front's event loop: tokenizing, template rendering, JSON.

The event loop serves every connection, /health and the watchdog ping; a 4 MiB prompt
takes the tokenizer seconds. That work runs here, in a small pool of threads. The
tokenizer and the template are Python code, so the interpreter hands the loop its turn
every switch interval (5 ms): measured on the real model's tokenizer, a 1 MB prompt took
2.4 s in a thread while the loop's longest pause was 81 ms (a process pool would have to
copy the tokenizer and every prompt across; bounded work in threads is enough here).
json.loads holds the GIL for the whole call (a 64 MiB body of numbers is seconds), so a
large body is parsed and checked against api/limits.py in a separate process; only a body
within the limits comes back (pickled, which is quick to read). Long answers are encoded
by json_text, a slice at a time.
"""
from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import threading
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from typing import Callable, TypeVar

T = TypeVar("T")
N_THREADS = 2                   # heavy requests beyond this wait their turn (the loop never does)
# the loop gives up the GIL at every system call and then waits up to this long to take it back from a
# busy worker thread; Python's 5 ms default made one /health answer wait 100-300 ms (about 20 hand-overs)
SWITCH_INTERVAL_S = 0.0005

PROCESS_BYTES = 256 << 10       # a body this large is parsed in the parser process
_pool: ThreadPoolExecutor | None = None
_parser: ProcessPoolExecutor | None = None
_helpers: list[ProcessPoolExecutor] = []     # every helper process pool started (the parser, the tokenizer)
_parser_lock = threading.Lock()


def pool() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=N_THREADS, thread_name_prefix="bloomery-heavy")
    return _pool


async def run(fn: Callable[..., T], *args) -> T:
    """fn(*args) in the heavy pool; the caller's task waits, the loop goes on."""
    return await asyncio.get_running_loop().run_in_executor(pool(), fn, *args)


def parser() -> ProcessPoolExecutor:
    """One parser process, spawned (the supervisor holds threads and a ZeroMQ context: no fork)."""
    global _parser
    with _parser_lock:
        if _parser is None:
            _parser = _helper(_die_with_parent, (os.getpid(),))
        return _parser


def _helper(initializer, initargs) -> ProcessPoolExecutor:
    """A one-process pool, spawned (the supervisor holds threads and a ZeroMQ context: no fork); shutdown() ends it."""
    pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                               initializer=initializer, initargs=initargs)
    _helpers.append(pool)
    return pool


def shutdown() -> None:
    """At the server's stop: end the helper processes at once. They hold nothing (a parse, a tokenizer built
    from the file), and a pool left to the interpreter's exit waits for each to notice and wind down, still
    loading its tokenizer when the stop came early: up to a second added to every stop."""
    global _parser
    while _helpers:
        pool = _helpers.pop()
        for proc in list((getattr(pool, "_processes", None) or {}).values()):
            proc.kill()
        pool.shutdown(wait=True, cancel_futures=True)
    _parser = None


async def in_parser(fn: Callable[..., T], *args) -> T:
    """fn(*args) in the parser process (fn and its answer must pickle). The process starts with the first
    large body, not with the server: it is a Python start that imports the supervisor's modules (about
    0.25 s of CPU), spent on every start while most servers never see a body this large. The submit runs
    in a worker thread, since the first one spawns the process (the event loop does not wait for that)."""
    fut = await asyncio.to_thread(lambda: parser().submit(fn, *args))
    return await asyncio.wrap_future(fut)


CHUNK_ITEMS = 1024      # a list longer than this is encoded a slice at a time (the GIL changes hands between)


def _encode(v: object, out: list[str], depth: int) -> None:
    if depth and isinstance(v, list) and v:
        out.append("[")
        for i in range(0, len(v), CHUNK_ITEMS if len(v) > CHUNK_ITEMS else 1):
            if i:
                out.append(",")
            part = v[i:i + CHUNK_ITEMS] if len(v) > CHUNK_ITEMS else [v[i]]
            if len(part) == 1:
                _encode(part[0], out, depth - 1)
            else:
                out.append(_dumps(part)[1:-1])
        out.append("]")
    elif depth and isinstance(v, dict) and v:
        out.append("{")
        for i, (k, x) in enumerate(v.items()):
            out.append(("," if i else "") + _dumps(str(k)) + ":")
            _encode(x, out, depth - 1)
        out.append("}")
    else:
        out.append(_dumps(v))


def _dumps(v: object) -> str:
    return json.dumps(v, ensure_ascii=False, separators=(",", ":"))


def json_text(obj: object, depth: int = 4) -> str:
    """json.dumps(obj) with the same compact output, but no single C call over a long list: a probability
    table of 151,000 candidates a token is 0.7 s in one json.dumps, which holds the GIL throughout."""
    out: list[str] = []
    _encode(obj, out, depth)
    return "".join(out)


# --- the tokenizer process: a long text's tokenizing (regex splits are long C calls) ---------------------

LONG_TEXT_CHARS = 32 << 10      # a text this long is tokenized in the tokenizer process
_worker_tok = None              # in the tokenizer process: its own Tokenizer


def _die_with_parent(parent_pid: int) -> None:
    """A worker ends with the supervisor, even a SIGKILLed one (a lease waits for every descendant); one
    whose supervisor died while it was starting ends at once."""
    from bloomery.stages.common import die_with_parent
    die_with_parent()
    if os.getppid() != parent_pid:
        os._exit(0)


def _load_worker_tokenizer(parent_pid: int, path: str) -> None:
    global _worker_tok
    _die_with_parent(parent_pid)
    from bloomery.stages.common import import_numpy_one_blas_thread
    import_numpy_one_blas_thread()
    from bloomery.gguf_file import open_gguf
    from bloomery.tokenizer import Tokenizer
    with open_gguf(path) as gf:
        _worker_tok = Tokenizer.from_gguf(gf.metadata)


def _worker_encode(text: str, add_special: bool, parse_special: bool) -> bytes:
    import array
    return array.array("i", _worker_tok.encode(text, add_special, parse_special)).tobytes()


class ProcessTokenizer:
    """The front's Tokenizer, with encode() of a long text done in a separate process that built the same
    Tokenizer from the same GGUF header; everything else is the local one. Call encode from a worker
    thread (run() above): it waits there, holding no lock but the moment it takes to start the process.

    The process starts with the first long text, not with the server: building its tokenizer is about
    1.5 s of CPU (a Python start, the GGUF header, the vocabulary and merges), spent on every start
    beside the server's first requests, while most servers never see a text this long. That first text
    waits for it once (about a second here); the event loop does not."""

    def __init__(self, tok, gguf_path: str):
        self._tok = tok
        self._path = gguf_path
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    def _started(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = _helper(_load_worker_tokenizer, (os.getpid(), self._path))
            return self._pool

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        if len(text) < LONG_TEXT_CHARS:
            return self._tok.encode(text, add_special, parse_special)
        import array
        ids = array.array("i")
        ids.frombytes(self._started().submit(_worker_encode, text, add_special, parse_special).result())
        return ids.tolist()
