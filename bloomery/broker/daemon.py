"""The broker's ZeroMQ loop: a ROUTER on ipc://RUNTIME/broker.sock, the book, the state file.

Every change (a need queued, a grant, a release, a process found gone) is written
to the state file before the answer leaves, so a broker killed at any point comes
back with every lease and the queue in its order. Every TICK_S the loop checks each
lease's and queued need's process (pid + start time, and a lease's descendants) and
grants from the head of the queue.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import zmq

from bloomery.broker import procs, protocol
from bloomery.broker.book import Book, NeedError, parse_need
from bloomery.broker.state import read_state, write_state
from bloomery.records import record

SOCKET_NAME = "broker.sock"
TICK_S = 0.5


def runtime_dir(env: dict | None = None) -> Path:
    env = os.environ if env is None else env
    return Path(env.get("BLOOMERY_BROKER_DIR") or env.get("RUNTIME_DIRECTORY", "").split(":")[0]
                or "/run/bloomery-broker")


def _answers(ctx: zmq.Context, path: Path) -> bool:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    try:
        s.connect(f"ipc://{path}")
        s.send(protocol.encode({"op": "status"}))
        return bool(s.poll(1000))
    finally:
        s.close(0)


class Broker:
    def __init__(self, book: Book, state_dir: Path, run_dir: Path, host_info: dict | None = None):
        self.book = book
        self.state_dir = state_dir
        self.sock_path = run_dir / SOCKET_NAME
        self.host_info = host_info or {}
        self.stopping = False

    # -- state -----------------------------------------------------------------------------
    def restore(self) -> None:
        saved = read_state(self.state_dir)
        if saved is not None:
            try:
                self.book.load(saved)
            except (KeyError, TypeError, ValueError, NeedError) as e:   # never start over silently: leases would go
                raise ValueError(f"broker state {self.state_dir}/state.json: unreadable "
                                 f"({type(e).__name__}: {e}); move it aside to start with no leases") from None
            record("broker", "state restored", n_leases=len(self.book.leases), n_queued=len(self.book.queue))

    def save(self) -> None:
        write_state(self.state_dir, self.book.to_dict())

    # -- the rules over time ---------------------------------------------------------------
    def tick(self) -> bool:
        """Drop what is gone, note lease descendants, grant; True when the state changed."""
        changed = False
        for was, e in self.book.prune(procs.entry_alive):
            record("broker", "released: process gone" if was == "lease" else "withdrawn: process gone",
                   id=e.id, pid=e.need.pid, unit=e.need.unit)
            changed = True
        for e in self.book.leases.values():
            seen = {p for p, _ in e.kids}
            new = [k for k in procs.descendants(e.need.pid, e.start_time) if k[0] not in seen]
            live = [k for k in e.kids if procs.same_process(*k)]
            if new or len(live) != len(e.kids):
                e.kids = live + new
                changed = True
        for e in self.book.grant(time.time()):
            record("broker", "granted", id=e.id, pid=e.need.pid, unit=e.need.unit, host_bytes=e.need.host_bytes,
                   card_bytes=list(e.need.card_bytes))
            changed = True
        return changed

    # -- requests --------------------------------------------------------------------------
    def answer(self, frames: list[bytes], peer: int | None = None) -> dict:
        """One request; `peer` is the asking process's pid as the kernel saw it (SO_PEERCRED), None when the
        transport cannot say (then nothing is checked)."""
        try:
            req = protocol.decode_request(frames)
        except protocol.RequestError as e:
            record("broker", "request refused", level="warning", reason=str(e))
            return protocol.refused(str(e))
        if req["op"] == "status":
            return self.status()
        if req["op"] == "release":
            refusal = self.not_on_behalf(req, peer)
            if refusal:
                record("broker", "request refused", level="warning", peer_pid=peer, reason=refusal)
                return protocol.refused(refusal)
            was = self.book.remove(req["id"])
            if was:
                self.save()
                record("broker", "released" if was == "lease" else "withdrawn", id=req["id"])
            return {"op": "released", "id": req["id"], "was": was}
        return self.answer_need(req["id"], req["need"], lambda: self.not_on_behalf(req, peer))

    def not_on_behalf(self, req: dict, peer: int | None) -> str:
        """Why the asking process may not act for the pid the request names ("" when it may): a need's pid,
        or the pid of the entry a release names, must be in the asker's session (systemd makes every service
        its own session; the need hook runs in its server's)."""
        if peer is None:
            return ""
        if req["op"] == "need":
            raw = req.get("need")
            pid = raw.get("pid") if isinstance(raw, dict) else None
        else:
            found = self.book.find(req["id"])
            pid = found[1].need.pid if found is not None else None
        if not isinstance(pid, int) or isinstance(pid, bool) or procs.same_session(peer, pid):
            return ""
        return (f"request {req['op']} {req['id']!r}: process {peer} asks for process {pid}, which is not in its "
                "session; a lease is taken and released by its own process or its need hook")

    def answer_need(self, entry_id: str, raw: object, on_behalf=lambda: "") -> dict:
        found = self.book.find(entry_id)
        if found is None:
            try:
                need = parse_need(raw)
                started = procs.start_time(need.pid)
                if started is None:
                    raise NeedError(f"need field 'pid': {need.pid} is not a live process")
                refusal = on_behalf()      # the asker may name only a process of its own session
                if refusal:
                    raise NeedError(refusal)
                self.book.enqueue(entry_id, need, started, time.time())
            except NeedError as e:
                record("broker", "need refused", level="warning", id=entry_id, reason=str(e))
                return protocol.refused(str(e))
            record("broker", "queued", id=entry_id, pid=need.pid, unit=need.unit, host_bytes=need.host_bytes,
                   card_bytes=list(need.card_bytes))
            self.tick()          # grant at once when it fits
            self.save()
            found = self.book.find(entry_id)
        was, e = found
        if was == "lease":
            return {"op": "granted", "id": e.id, "lease": e.to_dict()}
        return {"op": "queued", "id": e.id, "position": self.book.position(e.id),
                "waits_for": self.book.waits_for(e.id)}

    def status(self) -> dict:
        b = self.book
        return {"op": "status", "capacity": b.capacity.to_dict(), "held": b.held().to_dict(), **self.host_info,
                "leases": [e.to_dict() for e in sorted(b.leases.values(), key=lambda e: e.seq)],
                "queue": [{**e.to_dict(), "position": i + 1, "waits_for": b.waits_for(e.id)}
                          for i, e in enumerate(b.queue)]}

    # -- the loop --------------------------------------------------------------------------
    def bind(self, ctx: zmq.Context) -> zmq.Socket:
        self.sock_path.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
        if self.sock_path.exists():        # a dead broker's socket file is ours now; a live broker's is not
            if _answers(ctx, self.sock_path):
                raise OSError(f"another broker answers at {self.sock_path}")
            self.sock_path.unlink()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_WIRE_BYTES)
        old = os.umask(0o117)              # the socket file is born 0660: the service group only
        try:
            sock.bind(f"ipc://{self.sock_path}")
        finally:
            os.umask(old)
        os.chmod(self.sock_path, 0o660)
        return sock

    def serve(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: setattr(self, "stopping", True))
        self.restore()
        self.tick()
        self.save()
        ctx = zmq.Context()
        sock = self.bind(ctx)
        record("broker", "serving", socket=str(self.sock_path), state=str(self.state_dir),
               host_bytes=self.book.capacity.host_bytes, card_bytes=list(self.book.capacity.card_bytes))
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        next_tick = time.monotonic() + TICK_S
        try:
            while not self.stopping:
                if poller.poll(int(max(0.0, next_tick - time.monotonic()) * 1000) + 1):
                    self.one_request(sock)
                if time.monotonic() >= next_tick:
                    if self.tick():
                        self.save()
                    next_tick = time.monotonic() + TICK_S
        finally:
            sock.close(0)
            ctx.term()
            try:
                self.sock_path.unlink()
            except OSError:
                pass
        record("broker", "stopped", n_leases=len(self.book.leases), n_queued=len(self.book.queue))
        return 0

    def one_request(self, sock: zmq.Socket) -> None:
        try:
            frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return
        ident, body = frames[0].bytes, [f.bytes for f in frames[1:]]
        try:
            reply = self.answer(body, protocol.peer_pid(frames[-1]))
        except Exception as e:        # a bug must not take the broker down: name it, keep serving
            record("broker", "request failed", level="error", error=f"{type(e).__name__}: {e}")
            reply = protocol.refused(f"broker error: {type(e).__name__}: {e}")
        sock.send_multipart([ident, protocol.encode(reply)])
