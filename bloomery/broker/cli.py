"""`bloomery-broker [serve] [--config FILE]` runs the broker; `bloomery-broker status [--json]` prints it.

Places: the socket in $BLOOMERY_BROKER_DIR, else $RUNTIME_DIRECTORY (systemd's
RuntimeDirectory=), else /run/bloomery-broker; the state in $BLOOMERY_BROKER_STATE,
else $STATE_DIRECTORY, else /var/lib/bloomery-broker; the config in --config, else
$BLOOMERY_BROKER_CONFIG, else /etc/bloomery/broker.toml when it exists.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import zmq

from bloomery import records
from bloomery.broker import capacity as cap_mod, protocol
from bloomery.broker.book import Book
from bloomery.broker.daemon import SOCKET_NAME, Broker, runtime_dir
from bloomery.broker.state import state_dir
from bloomery.records import record

DEFAULT_CONFIG = "/etc/bloomery/broker.toml"
EXIT_REFUSED, EXIT_UNREACHABLE = 1, 3


def _config_path(arg: str | None) -> str | None:
    path = arg or os.environ.get("BLOOMERY_BROKER_CONFIG")
    if path:
        return path
    return DEFAULT_CONFIG if os.path.exists(DEFAULT_CONFIG) else None


def serve(args) -> int:
    path = _config_path(args.config)
    try:
        cfg = cap_mod.read_config(path)
    except cap_mod.ConfigError as e:
        record("broker", "refused", level="error", error=str(e))
        return EXIT_REFUSED
    total, limit = cap_mod.host_total_bytes()
    cards = cap_mod.probe_cards()
    capacity = cap_mod.capacity_from(total, limit, cards, cfg)
    info = {"host": {"total_bytes": total, "cgroup_limit_bytes": limit, "config": path},
            "cards": [{"ordinal": i, "free_bytes": f, "total_bytes": t} for i, (f, t) in enumerate(cards)]}
    broker = Broker(Book(capacity), state_dir(), runtime_dir(), info)
    try:
        return broker.serve()
    except (ValueError, OSError, zmq.ZMQError) as e:     # unreadable state, unbindable socket: by name
        record("broker", "refused", level="error", error=f"{type(e).__name__}: {e}")
        return EXIT_REFUSED


def ask(request: dict, timeout_s: float = 5.0) -> dict | None:
    path = runtime_dir() / SOCKET_NAME
    if not path.exists():
        return None
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    try:
        s.connect(f"ipc://{path}")
        s.send(protocol.encode(request))
        if not s.poll(int(timeout_s * 1000)):
            return None
        return json.loads(s.recv())
    finally:
        s.close(0)
        ctx.term()


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def format_status(st: dict) -> str:
    cap, held = st["capacity"], st["held"]
    lines = [f"host: {_gib(held['host_bytes'])} held of {_gib(cap['host_bytes'])}"]
    for i, c in enumerate(cap["card_bytes"]):
        free = next((d["free_bytes"] for d in st.get("cards", []) if d["ordinal"] == i), None)
        lines.append(f"card {i}: {_gib(held['card_bytes'][i])} held of {_gib(c)}"
                     + (f" (free at start {_gib(free)})" if free is not None else ""))
    now = time.time()
    lines.append(f"leases: {len(st['leases'])}")
    for e in st["leases"]:
        n = e["need"]
        lines.append(f"  {e['id']} pid={n['pid']} unit={n['unit'] or '-'} host={n['host_bytes']} "
                     f"cards={n['card_bytes']} model={n['model'] or '-'} for={now - e['since']:.0f}s")
    lines.append(f"queue: {len(st['queue'])}")
    for e in st["queue"]:
        n = e["need"]
        lines.append(f"  {e['position']}. {e['id']} pid={n['pid']} unit={n['unit'] or '-'} host={n['host_bytes']} "
                     f"cards={n['card_bytes']} waits for: {e['waits_for']}")
    return "\n".join(lines) + "\n"


def status(args) -> int:
    st = ask({"op": "status"})
    if st is None:
        sys.stderr.write(f"bloomery-broker: no broker answers at {runtime_dir() / SOCKET_NAME}\n")
        return EXIT_UNREACHABLE
    sys.stdout.write(json.dumps(st, indent=1) + "\n" if args.json else format_status(st))
    return 0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="bloomery-broker", description="the host broker for bloomery starts")
    config_help = f"TOML capacity config (default $BLOOMERY_BROKER_CONFIG or {DEFAULT_CONFIG})"
    p.add_argument("--config", help=config_help)
    sub = p.add_subparsers(dest="cmd")
    sp = sub.add_parser("serve", help="run the broker (the default)")
    sp.add_argument("--config", dest="serve_config", help=config_help)
    st = sub.add_parser("status", help="print the grants and the queue")
    st.add_argument("--json", action="store_true", help="the broker's answer as JSON")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    records.configure("bloomery-broker")
    if args.cmd == "status":
        sys.exit(status(args))
    args.config = getattr(args, "serve_config", None) or args.config
    sys.exit(serve(args))


if __name__ == "__main__":
    main()
