"""The broker's wire messages: one JSON object per ZeroMQ frame, both ways. Pure.

Requests (a DEALER client sends one frame; the ROUTER answers one frame):
  {"op": "need", "id": ID, "need": NEED}   queue a need (idempotent by id: asking again reports its state)
  {"op": "release", "id": ID}              withdraw a queued need or release a lease
  {"op": "status"}                         capacity, leases, queue
Answers:
  {"op": "queued", "id", "position", "waits_for"}       still waiting (position is 1-based)
  {"op": "granted", "id", "lease": ENTRY}
  {"op": "refused", "reason"}                            names the field / value / bound
  {"op": "released", "id", "was": "lease"|"queued"|null}
  {"op": "status", "capacity", "held", "leases": [ENTRY], "queue": [ENTRY], "cards": [...], "host": {...}}
"""
from __future__ import annotations

import json

MAX_REQUEST_BYTES = 64 * 1024           # a larger request is refused by name
MAX_WIRE_BYTES = 1024 * 1024            # zmq MAXMSGSIZE: a peer sending more is cut off without an answer
OPS = ("need", "release", "status")


class RequestError(Exception):
    """A request refused before any bookkeeping: names the problem and the bound."""


def decode_request(frames: list[bytes]) -> dict:
    if len(frames) != 1:
        raise RequestError(f"request: expected one frame (a JSON object), got {len(frames)} frames")
    data = frames[0]
    if len(data) > MAX_REQUEST_BYTES:
        raise RequestError(f"request: {len(data)} bytes; the bound is {MAX_REQUEST_BYTES} bytes")
    try:
        obj = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise RequestError(f"request: not UTF-8 (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise RequestError(f"request: not JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    if not isinstance(obj, dict):
        raise RequestError(f"request: expected a JSON object, got {type(obj).__name__}")
    op = obj.get("op")
    if op not in OPS:
        raise RequestError(f"request field 'op': {op!r} is not one of {', '.join(OPS)}")
    if op in ("need", "release") and not isinstance(obj.get("id"), str):
        raise RequestError(f"request field 'id': expected a string, got {obj.get('id')!r}")
    if op == "need" and "need" not in obj:
        raise RequestError("request field 'need': missing (the need record)")
    return obj


def encode(obj: dict) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def refused(reason: str) -> dict:
    return {"op": "refused", "reason": reason}


def peer_pid(frame) -> int | None:
    """The sending process's pid of a frame received on an ipc:// socket: libzmq reads SO_PEERCRED and puts
    ":uid:gid:pid" at the end of the frame's Peer-Address; None where it does not (not Linux)."""
    try:
        address = frame.get("Peer-Address")
    except Exception:        # no such property on this libzmq
        return None
    parts = str(address).rsplit(":", 3)
    if len(parts) != 4 or not parts[3].isdigit():
        return None
    return int(parts[3])
