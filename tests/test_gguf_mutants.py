"""A seeded GGUF mutation fuzzer: the reader, the plan, and a load of what passes the plan (issue 16, part 5).

One small synthetic qwen2 file (tools/make_synthetic.py, with a 257-token byte-level
tokenizer written here, so no real model is needed). Each mutant changes the header
in place, the same length (a number, a float, a string byte, a tensor's dims, type or
offset, an array length, any byte): the data section stays where it was. Every mutant
must end as a named refusal (GGUFError from the reader, StageRefusal from the plan
stage) or pass the plan; a sample of those that pass is served by the real
bloomery-serve, which must either refuse it by name with exit 1 (no traceback, never
exit 70) or answer a completion. BLOOMERY_FUZZ_MUTANTS=N runs N mutants (default 300)
and serves N // 100 of the passing ones (at least 3).
"""
from __future__ import annotations

import os
import random
import shutil
import signal
import struct
import time
import urllib.request
from pathlib import Path

import gguf
import pytest

from bloomery.census import Census
from bloomery.gguf_file import GGUFError, open_gguf
from bloomery.stages.common import StageRefusal
from bloomery.stages.meta import model_meta
from bloomery.stages.plan import check_seat, make
from serve_proc import Served

N_MUTANTS = int(os.environ.get("BLOOMERY_FUZZ_MUTANTS", "300"))
N_LOADS = max(3, N_MUTANTS // 100)
SEED = 16
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}" \
           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"


def byte_tokens() -> list[str]:
    """GPT-2's byte-to-character table: every byte is one token, so any text tokenizes."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


def write_tokenizer(path: Path) -> Path:
    w = gguf.GGUFWriter(str(path), "qwen2")
    tokens = byte_tokens() + ["<|im_start|>", "<|im_end|>"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([1] * 256 + [3, 3])
    w.add_token_merges([])
    w.add_eos_token_id(257)
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    return path


# --- where a header's values sit (GGUF v3) -------------------------------------------------------------
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def header_sites(data: bytes) -> tuple[list[tuple[str, int, str]], int]:
    """([(kind, offset, struct format)], the header's length): every number, string byte run and length."""
    sites: list[tuple[str, int, str]] = []
    pos = 8
    n_tensors, n_kv = struct.unpack_from("<QQ", data, pos)
    sites += [("count", pos, "<Q"), ("count", pos + 8, "<Q")]
    pos += 16

    def string(pos: int) -> int:
        (n,) = struct.unpack_from("<Q", data, pos)
        sites.append(("length", pos, "<Q"))
        if n:
            sites.append(("string", pos + 8, f"{n}s"))
        return pos + 8 + n

    def value(vtype: int, pos: int) -> int:
        if vtype == 8:
            return string(pos)
        if vtype == 9:
            sub, n = struct.unpack_from("<IQ", data, pos)
            sites.append(("length", pos + 4, "<Q"))
            pos += 12
            if sub == 8:
                for _ in range(n):
                    pos = string(pos) if len(sites) < 2000 else pos + 8 + struct.unpack_from("<Q", data, pos)[0]
                return pos
            size = struct.calcsize(SCALARS[sub])
            for i in range(min(n, 8)):
                sites.append(("number", pos + i * size, SCALARS[sub]))
            return pos + n * size
        sites.append(("float" if vtype in (6, 12) else "number", pos, SCALARS[vtype]))
        return pos + struct.calcsize(SCALARS[vtype])

    for _ in range(n_kv):
        pos = string(pos)
        (vtype,) = struct.unpack_from("<I", data, pos)
        sites.append(("vtype", pos, "<I"))
        pos = value(vtype, pos + 4)
    for _ in range(n_tensors):
        pos = string(pos)
        (n_dims,) = struct.unpack_from("<I", data, pos)
        sites.append(("n_dims", pos, "<I"))
        pos += 4
        for i in range(n_dims):
            sites.append(("dim", pos + 8 * i, "<Q"))
        pos += 8 * n_dims
        sites += [("ggml_type", pos, "<I"), ("offset", pos + 4, "<Q")]
        pos += 12
    return sites, pos


def mutate(rng: random.Random, data: bytes, sites, header_len: int) -> tuple[int, bytes, str]:
    """(offset, the bytes to put there, what it is) of one mutation."""
    kind, off, fmt = rng.choice(sites)
    if rng.random() < 0.1:
        off = rng.randrange(8, header_len)
        return off, bytes([rng.randrange(256)]), f"byte {off}"
    if kind == "string":
        n = struct.calcsize(fmt)
        at = off + rng.randrange(n)
        return at, bytes([rng.choice([0xFF, 0xC3, 0x80, 0x00, rng.randrange(256)])]), f"string byte {at}"
    size = struct.calcsize(fmt)
    (old,) = struct.unpack_from(fmt, data, off)
    if fmt in ("<f", "<d"):
        new = rng.choice([float("nan"), float("inf"), float("-inf"), 0.0, -1.0, 1e38, 1e-45, old * 2])
        return off, struct.pack(fmt, new), f"{kind} {off}: {old} -> {new}"
    if fmt == "<?":
        return off, bytes([rng.choice([0, 1, 2, 255])]), f"bool {off}"
    bits = size * 8
    signed = fmt[1].islower() and fmt[1] not in "?"
    top = (1 << (bits - 1)) - 1 if signed else (1 << bits) - 1
    low = -(1 << (bits - 1)) if signed else 0
    new = rng.choice([0, 1, 2, 3, top, low, old + 1, old - 1, old * 2, old // 2, rng.randint(low, top),
                      1 << rng.randrange(bits - 1), 40, 99])
    new = min(max(new, low), top)
    return off, struct.pack(fmt, new), f"{kind} {off}: {old} -> {new}"


class Hang(Exception):
    pass


def plan_outcome(path: str) -> str:
    """reader | plan (named refusals) | pass; anything else raises."""
    try:
        gf = open_gguf(path)
    except GGUFError:
        return "reader"
    try:   # as stages/plan.py's main does
        check_seat(None, gf.arch(), path)
        make({"device": "cpu", "ctx_size": 256}, gf, Census(host_avail_bytes=64 << 30))
        model_meta(gf)
    except (StageRefusal, GGUFError):
        return "plan"
    finally:
        gf.close()
    return "pass"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    from conftest import load_tool
    folder = tmp_path_factory.mktemp("mutants")
    tok = write_tokenizer(folder / "tok.gguf")
    return load_tool("make_synthetic").write_synthetic(folder / "tiny.gguf", "qwen2", tokenizer_from=str(tok),
                                                       n_layer=2, n_embd=64, n_ff=128)


@pytest.fixture(scope="module")
def passing(model, tmp_path_factory) -> list[tuple[int, bytes, str]]:
    """Runs every mutant through the reader and the plan; the ones that pass (offset, bytes, what)."""
    original = model.read_bytes()
    sites, header_len = header_sites(original)
    work = tmp_path_factory.mktemp("work") / "mutant.gguf"
    shutil.copyfile(model, work)
    rng = random.Random(SEED)
    counts = {"reader": 0, "plan": 0, "pass": 0}
    out: list[tuple[int, bytes, str]] = []

    def alarm(*_):
        raise Hang()
    old_handler = signal.signal(signal.SIGALRM, alarm)
    t0 = time.monotonic()
    try:
        for i in range(N_MUTANTS):
            off, new, what = mutate(rng, original, sites, header_len)
            with open(work, "r+b") as f:
                f.seek(off)
                f.write(new)
            signal.alarm(20)
            try:
                got = plan_outcome(str(work))
            except Hang:
                pytest.fail(f"mutant {i} ({what}) hung the reader or the plan")
            except Exception as e:   # a traceback, not a named refusal
                raise AssertionError(f"mutant {i} ({what}): {type(e).__name__}: {e}") from e
            finally:
                signal.alarm(0)
            counts[got] += 1
            if got == "pass":
                out.append((off, new, what))
            with open(work, "r+b") as f:
                f.seek(off)
                f.write(original[off:off + len(new)])
    finally:
        signal.signal(signal.SIGALRM, old_handler)
    print(f"{N_MUTANTS} mutants in {time.monotonic() - t0:.1f} s: {counts}")
    assert counts["reader"] and counts["plan"] and counts["pass"]
    return out


def test_every_mutant_is_a_named_refusal_or_passes_the_plan(passing):
    assert passing


@pytest.mark.slow
def test_mutants_that_pass_the_plan_are_refused_by_name_or_served(model, passing, tmp_path):
    """A named refusal (exit 1, no traceback, never 70) or a server that answers a completion."""
    original = model.read_bytes()
    for off, new, what in random.Random(SEED + 1).sample(passing, min(N_LOADS, len(passing))):
        served = tmp_path / "served.gguf"
        data = bytearray(original)
        data[off:off + len(new)] = new
        served.write_bytes(bytes(data))
        s = Served("-m", str(served), "-c", "256", ready_timeout_s=120)
        s.start(wait_ready=False)
        try:
            try:
                s.wait_ready()
            except RuntimeError:
                code = s.proc.wait(timeout=60)
                text = "\n".join(s.lines)
                assert code == 1 and "Traceback" not in text, f"mutant ({what}) exit {code}:\n{text[-3000:]}"
                continue
            req = urllib.request.Request(s.url + "/completion", data=b'{"prompt": "hi", "n_predict": 2}',
                                         method="POST")
            with urllib.request.urlopen(req, timeout=60) as r:
                assert r.status == 200, f"mutant ({what}) answered {r.status}"
        finally:
            s.stop()
