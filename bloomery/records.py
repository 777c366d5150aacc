"""Records: one line each on stderr, `TIME LEVEL [phase] component: message k=v ...` or one JSON object.

Every module writes through record(). structlog's own processors stamp the time
(UTC, ISO 8601) and the level; the event then goes through a redaction step (no
API key is ever printed) to one of two sinks:
- the supervisor (and any tool): the line goes to stderr;
- a stage process (configure(push_addr=...)): the record goes to the
  supervisor's PULL socket as a typed Record message, and the supervisor
  relays it to its stderr, so each record is printed exactly once.
The supervisor's --log-format text|json (--log-jsonl), --no-log-prefix and
--no-log-timestamps choose how a record is printed (configure_format).
"""
from __future__ import annotations

import json
import sys
import threading

import structlog

from bloomery.messages import stage as sm

_SECRET_FIELDS = {"api_key", "api_keys", "key", "keys", "authorization", "x_api_key"}
_secrets: set[str] = set()
_state: dict = {"component": "bloomery-serve", "push": None, "stream": None, "lost": 0,
                "format": "text", "prefix": True, "timestamps": True}
_RESERVED = ("time", "level", "phase", "component", "message")
_stamp = structlog.processors.TimeStamper(fmt="iso", utc=True, key="time")
_lock = threading.Lock()


def add_secret(*values: str) -> None:
    """Values that must never appear in a line (API keys)."""
    _secrets.update(v for v in values if v)


def redact(text: str) -> str:
    for s in sorted(_secrets, key=len, reverse=True):
        text = text.replace(s, "***")
    return text


def _value(v: object) -> str:
    if isinstance(v, str) and v and not any(c.isspace() or c in '"=' for c in v):
        return v
    return json.dumps(v, ensure_ascii=False, default=str)


def now() -> str:
    return _stamp(None, "", {})["time"]


def format_record(rec: sm.Record) -> str:
    """One printed line: text (`TIME LEVEL [phase] component: message k=v`) or one JSON object."""
    time = (rec.time or now()) if _state["timestamps"] else ""
    if _state["format"] == "json":
        head = {"time": time} if time else {}
        head.update(level=rec.level, phase=rec.phase, component=rec.component, message=rec.message)
        head.update({(f"field_{k}" if k in _RESERVED else k): v for k, v in rec.fields.items()})
        return redact(json.dumps(head, ensure_ascii=False, default=str))
    kv = " ".join(f"{k}={_value(v)}" for k, v in rec.fields.items())
    prefix = " ".join(x for x in (time, f"{rec.level:<7}") if x) + " " if _state["prefix"] else ""
    return redact(f"{prefix}[{rec.phase}] {rec.component}: {rec.message}" + (f" {kv}" if kv else ""))


def _scalar(v: object) -> sm.Scalar:
    return v if v is None or isinstance(v, (str, int, float, bool)) else str(v)


def _to_record(_logger, method: str, event: dict) -> sm.Record:
    level = str(event.pop("level", method))          # structlog's add_log_level
    time = str(event.pop("time", ""))                 # structlog's TimeStamper
    phase = event.pop("phase", "-")
    component = event.pop("component", None) or _state["component"]
    message = str(event.pop("event", ""))
    fields = {k: ("***" if k.lower() in _SECRET_FIELDS else _scalar(v)) for k, v in event.items()}
    return sm.Record(str(phase), str(component), message, fields, level, time)


def _sink(_logger, level: str, event: dict) -> str:
    rec = _to_record(_logger, level, event)
    emit(rec)
    raise structlog.DropEvent


def emit(rec: sm.Record) -> None:
    """Print a record (or send it to the supervisor from a stage process)."""
    with _lock:
        push = _state["push"]
        if push is not None:
            try:
                push.send(sm.encode(rec), flags=0, copy=True)
                return
            except Exception:          # supervisor gone: fall back to our own stderr
                pass
        line = format_record(rec) + "\n"
        for stream in (_state["stream"] or sys.stderr, _state.get("file")):
            if stream is None:
                continue
            try:
                stream.write(line)
                stream.flush()
            except (OSError, ValueError):   # the sink is gone (a broken pipe, a closed journal stream):
                _state["lost"] += 1         # the record is lost, never the caller's control flow


def lost_records() -> int:
    """Records that could not be written because stderr was gone."""
    return _state["lost"]


def configure(component: str = "bloomery-serve", push_addr: str | None = None, ctx=None, stream=None) -> None:
    """Set the process's component name and sink. A stage passes the supervisor's records address."""
    _state["component"] = component
    _state["stream"] = stream
    if push_addr is not None:
        import zmq

        sock = (ctx or zmq.Context.instance()).socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 2000)      # records queued at exit still reach the supervisor
        sock.connect(push_addr)
        _state["push"] = sock
    structlog.configure(processors=[structlog.processors.add_log_level, _stamp, _sink],
                        cache_logger_on_first_use=False)


def configure_format(log_format: str = "text", prefix: bool = True, timestamps: bool = True,
                     file=None) -> None:
    """How the records this process prints look (the supervisor: from --log-format and friends); `file`
    (an open text file, --log-file) gets every line too."""
    _state.update(format=log_format, prefix=prefix, timestamps=timestamps, file=file)


def push_socket():
    """The stage's PUSH socket (stages send their outcome messages on it too)."""
    return _state["push"]


def send(msg) -> None:
    """Send a stage message (FetchDone, PlanDone, Ready, Dead, Progress) to the supervisor."""
    with _lock:
        _state["push"].send(sm.encode(msg))


def record(phase: str, message: str, component: str | None = None, level: str = "info", **kv) -> None:
    """One record: `[phase] component: message k=v ...`."""
    if not structlog.is_configured():
        configure(_state["component"], stream=_state["stream"])
    kv = {(f"field_{k}" if k in _RESERVED else k): v for k, v in kv.items()}    # structlog sets time itself
    getattr(structlog.get_logger(), level if level in ("info", "warning", "error") else "info")(
        message, phase=phase, component=component, **kv)
