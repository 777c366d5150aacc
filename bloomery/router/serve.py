"""The supervisor's router run: no model, so no stage runs here; the HTTP front (the same HttpServer and
Gate: Host guard, CORS, API key) answers with the Router, and each model's child runs the stages itself.

A child gets the router's own command line without the flags the router owns (what it listens on, the
router's models, its log file) and without the API keys on it: the keys go in the child's environment
(LLAMA_API_KEY), never in its argv, and the router forwards the client's Authorization header, so the child
checks the same keys. systemd's variables (NOTIFY_SOCKET, the watchdog, socket activation) are the router's
alone: a child that saw them would tell systemd it is the service.
"""
from __future__ import annotations

import os

from bloomery.lifecycle import Phase
from bloomery.records import record
from bloomery.router.catalog import CatalogError, catalog
from bloomery.router.routes import Router
from bloomery.settings import SettingsError, argv_without

ROUTER_ONLY = {"--models-dir", "--models-max", "--models-autoload", "--models-preset", "--host", "--port", "--alias",
               "--api-key", "--log-file", "--offline"}
SYSTEMD_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES")


def child_env(env: dict[str, str], api_keys: tuple[str, ...]) -> dict[str, str]:
    out = {k: v for k, v in env.items() if k not in SYSTEMD_ENV and k != "LLAMA_API_KEY"}
    if api_keys:
        out["LLAMA_API_KEY"] = ",".join(api_keys)
    return out


async def run_router(sup) -> int:
    """Serve until a signal; then stop every child (each drains its requests) and close the front."""
    s = sup.s

    def reread() -> dict:
        return catalog(s.models_dir, preset=s.models_preset)

    try:
        entries = reread()
    except CatalogError as e:
        raise SettingsError(str(e)) from None
    router = Router(entries, argv_without(s.argv, ROUTER_ONLY), child_env(dict(os.environ), s.api_keys),
                    models_max=s.models_max, autoload=s.models_autoload, reread=reread)
    sup.gate.app = router
    for name, entry in entries.items():
        record("start", "router model", model=name, source=entry.source, path=entry.path or entry.hf_repo,
               **({"hidden": "deduplicated by a preset"} if entry.hidden else {}))
    try:
        router.startup()
    except ValueError as e:
        raise SettingsError(str(e)) from None
    sup.life.advance(Phase.READY, role="router", n_models=len(entries), models_max=s.models_max)
    try:
        await sup.stop.wait()
    finally:
        sup.life.advance(Phase.DRAINING, reason=sup.stop_cause or "ended")
        await router.close()
        await sup._close_http()
        sup.life.advance(Phase.STOPPED, reason=sup.stop_cause or "ended")
    return 0
