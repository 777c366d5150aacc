"""POST /slots/{id}?action=save|restore|erase on the engine's side: a slot's ids and KV to a file and back.

llama-server's --slot-save-path: save writes what an idle slot holds (its ids, by position, and
their K and V as the model's save_kv gives them) to a file; restore reads such a file into an idle
slot, so the next request sharing its prefix runs only the rest; erase forgets what the slot holds.
`answer` is what the engine thread runs between steps (never while a step runs); the engine stage
(stages/engine.py) and the in-process client (engine/inproc.py) both call it. The front
(api/slot_actions.py) checks the file name and joins it to the folder; this file writes only the
path it is given.

The file is ours, not llama.cpp's (its KV layout is another engine's):

    MAGIC (8 bytes) | header length (u32 LE) | header (JSON, utf-8) | ids (i32 LE, n) | each array's bytes

The header names the model file and its arch, the ids' count and each array's dtype and shape, so a
file written for another model (or another shape of the same) is refused by name before any byte
reaches the slot.
"""
from __future__ import annotations

import json
import os
import struct
import time
from dataclasses import dataclass, field

import numpy as np

MAGIC = b"BLMSLOT\x01"
FORMAT = 1
ACTIONS = ("save", "restore", "erase")

OK, BAD, UNAVAILABLE, NOT_SUPPORTED, FAILED = 200, 400, 503, 501, 500


@dataclass(frozen=True)
class SlotAnswer:
    status: int                   # the HTTP status the front answers with
    body: dict = field(default_factory=dict)   # llama-server's answer (status 200)
    error: str = ""               # why not (status != 200)


class SlotFileError(ValueError):
    """A slot file that cannot be restored here; the message says why."""


def encode(model_name: str, arch: str, ids: list[int], state: tuple) -> bytes:
    arrays = [np.ascontiguousarray(a) for a in state]
    header = {"format": FORMAT, "model": model_name, "arch": arch, "n_ids": len(ids),
              "arrays": [{"dtype": str(a.dtype), "shape": list(a.shape)} for a in arrays]}
    head = json.dumps(header, sort_keys=True).encode("utf-8")
    parts = [MAGIC, struct.pack("<I", len(head)), head, np.asarray(ids, dtype="<i4").tobytes()]
    parts += [a.tobytes() for a in arrays]
    return b"".join(parts)


def decode(data: bytes) -> tuple[dict, list[int], tuple[np.ndarray, ...]]:
    """(header, ids, arrays) of a slot file; SlotFileError naming what is wrong."""
    if data[:len(MAGIC)] != MAGIC:
        raise SlotFileError("not a bloomery slot file (its first bytes are not the slot file's magic)")
    at = len(MAGIC) + 4
    if len(data) < at:
        raise SlotFileError("the file ends inside its header")
    (n_head,) = struct.unpack_from("<I", data, len(MAGIC))
    try:
        header = json.loads(data[at:at + n_head].decode("utf-8"))
        n_ids = int(header["n_ids"])
        specs = [(np.dtype(a["dtype"]), tuple(int(x) for x in a["shape"])) for a in header["arrays"]]
    except (UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise SlotFileError(f"the file's header is not readable: {type(e).__name__}: {e}") from None
    if header.get("format") != FORMAT:
        raise SlotFileError(f"the file is format {header.get('format')!r}; this server reads format {FORMAT}")
    at += n_head
    want = at + 4 * n_ids + sum(dt.itemsize * int(np.prod(shape)) for dt, shape in specs)
    if n_ids < 0 or len(data) != want:
        raise SlotFileError(f"the file has {len(data)} bytes where its header describes {want}")
    ids = np.frombuffer(data, dtype="<i4", count=n_ids, offset=at).tolist()
    at += 4 * n_ids
    arrays = []
    for dt, shape in specs:
        n = dt.itemsize * int(np.prod(shape))
        arrays.append(np.frombuffer(data, dtype=dt, count=int(np.prod(shape)), offset=at).reshape(shape))
        at += n
    return header, ids, tuple(arrays)


def check_fits(header: dict, arrays: tuple, probe: tuple, model_name: str, arch: str, n_ctx_slot: int,
               n_vocab: int, ids: list[int]) -> None:
    """The file was written for this model and fits this slot; `probe` is this model's one-position state
    (its dtypes and every extent but the positions' must match)."""
    if header.get("model") != model_name or header.get("arch") != arch:
        raise SlotFileError(f"the file was saved from model {header.get('model')!r} ({header.get('arch')}); "
                            f"this server runs {model_name!r} ({arch})")
    n = len(ids)
    if n > n_ctx_slot:
        raise SlotFileError(f"the file holds {n} ids; a slot here holds at most n_ctx_slot = {n_ctx_slot}")
    bad = next((t for t in ids if not 0 <= t < n_vocab), None)
    if bad is not None:
        raise SlotFileError(f"the file holds id {bad}, not a token of this model (0..{n_vocab - 1})")
    if n == 0:
        return
    if len(arrays) != len(probe):
        raise SlotFileError(f"the file holds {len(arrays)} arrays; this model's slot state has {len(probe)}")
    for a, p in zip(arrays, probe):
        same = a.dtype == p.dtype and a.ndim == p.ndim and all(
            x == y or (y == 1 and x == n) for x, y in zip(a.shape, p.shape))
        if not same:
            raise SlotFileError(f"the file's state {a.dtype}{list(a.shape)} does not match this model's "
                                f"{p.dtype}{list(p.shape)} per position (another shape of model or backend)")


def _refusal(engine, id_slot: int, action: str) -> SlotAnswer | None:
    model = engine.model
    if not 0 <= id_slot < len(engine.scheduler.slots):
        return SlotAnswer(BAD, error="Invalid slot ID")
    if engine.scheduler.slots[id_slot].is_processing:
        return SlotAnswer(UNAVAILABLE, error=f"slot {id_slot} is processing a request: {action} needs an idle slot")
    if action == "erase":
        return None
    if model is None:
        return SlotAnswer(UNAVAILABLE, error="the engine is asleep (--sleep-idle-seconds): no slot state to "
                                             f"{action}")
    if not model.rewinds:
        return SlotAnswer(NOT_SUPPORTED, error=f"slot {action} is not supported for this model ({model.arch}): its "
                                               "recurrent layers keep a state the slot file does not hold")
    if not model.saves_kv:
        return SlotAnswer(NOT_SUPPORTED, error=f"slot {action} is not supported for this model ({model.arch}): "
                                               "it cannot copy a slot's KV out and back")
    return None


def answer(engine, action: str, id_slot: int, path: str, filename: str, model_name: str) -> SlotAnswer:
    """Run one slot action on `engine` (core.Engine) between steps: path is the file (the front made it
    from --slot-save-path and a checked name), model_name the served file's name (the header's key)."""
    if action not in ACTIONS:
        return SlotAnswer(BAD, error="Invalid action")
    refused = _refusal(engine, id_slot, action)
    if refused is not None:
        return refused
    slot = engine.scheduler.slots[id_slot]
    t0 = time.perf_counter()
    if action == "erase":
        n = len(slot.cached_ids)
        engine.scheduler.forget(slot)
        return SlotAnswer(OK, {"id_slot": id_slot, "n_erased": n})
    model = engine.model
    arch = str(model.arch)
    if action == "save":
        ids = list(slot.cached_ids)
        try:
            state = model.save_kv(id_slot, len(ids)) if ids else ()
            data = encode(model_name, arch, ids, state)
            tmp = f"{path}.{os.getpid()}.part"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except Exception as e:
            return SlotAnswer(FAILED, error=f"Unable to save slot: {type(e).__name__}: {e}")
        return SlotAnswer(OK, {"id_slot": id_slot, "filename": filename, "n_saved": len(ids), "n_written": len(data),
                               "timings": {"save_ms": (time.perf_counter() - t0) * 1000.0}})
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return SlotAnswer(BAD, error=f"Unable to restore slot: no file {filename!r} in --slot-save-path")
    except OSError as e:
        return SlotAnswer(BAD, error=f"Unable to restore slot: {filename!r} cannot be read: {e}")
    try:
        header, ids, arrays = decode(data)
        probe = model.save_kv(id_slot, 1)
        check_fits(header, arrays, probe, model_name, arch, engine.n_ctx_slot, engine.n_vocab, ids)
    except SlotFileError as e:       # the slot is untouched
        return SlotAnswer(BAD, error=f"Unable to restore slot: {e}")
    engine.scheduler.forget(slot)    # nothing counts until the copy is done
    try:
        if ids:
            model.restore_kv(id_slot, arrays, len(ids))
    except Exception as e:
        return SlotAnswer(FAILED, error=f"Unable to restore slot: {type(e).__name__}: {e} (the slot is now empty)")
    slot.cached_ids[:] = ids
    return SlotAnswer(OK, {"id_slot": id_slot, "filename": filename, "n_restored": len(ids), "n_read": len(data),
                           "timings": {"restore_ms": (time.perf_counter() - t0) * 1000.0}})
