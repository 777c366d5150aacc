"""The Router: llama-server's router routes, and every model route forwarded by its "model".

What answers here (server-models.cpp, server_models_routes): GET /health; GET /props without ?model (the
router's own props); GET /models and /v1/models (every model with its status; ?reload=1 reads the sources
again first: --models-dir, the caches, --models-preset); POST /models/load and /models/unload; DELETE /models?model=
(a cache model's files removed, remove.py; a loaded one is unloaded first). Every other
model route goes to the child serving the model the request names: POST routes by the body's "model", GET
routes (/props, /metrics, /slots, /residency) by ?model=. With autoload (the default, --no-models-autoload
turns it off, ?autoload=true|false per request) a model not loaded is loaded first; past --models-max the
least recently used idle model is unloaded for it. A request that finds every loaded model busy waits until
one is idle (a model serving a request is never unloaded under it); requests for one model coalesce on one
load; a client that leaves while waiting gives up nothing. Errors are llama-server's words and codes.
"""
from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator, Callable

from bloomery.api.app import PATTERN_ROUTES, ROUTES
from bloomery.api.shapes import BUILD_INFO
from bloomery.http.types import ApiError, Request, Response, StreamResponse
from bloomery.records import record
from bloomery.router import proxy, remove
from bloomery.router.catalog import CACHE, Entry
from bloomery.router.pool import ModelPool
from bloomery.router.preset import LOAD_ON_STARTUP, to_ini, truthy
from bloomery.router.table import LOADED

FAKE_BUSY_S = 2.0
GET_BY_QUERY = ("/props", "/metrics", "/slots", "/residency")   # GET routes a child answers, named by ?model=
NOT_SERVED = {("POST", "/models"): "downloading a model through the router (POST /models) is not served; "
                                   "fetch it with bloomery-serve -hf REPO or put the file in --models-dir",
              ("GET", "/models/sse"): "the router's model event stream (GET /models/sse) is not served"}


def _post_route(path: str) -> bool:
    return ("POST", path) in ROUTES or any(m == "POST" and pat.fullmatch(path) for m, pat, _ in PATTERN_ROUTES)


class Router:
    def __init__(self, entries: dict[str, Entry], base_args: list[str], env: dict[str, str], *,
                 models_max: int, autoload: bool, log: Callable[..., None] = record,
                 reread: Callable[[], dict[str, Entry]] | None = None):
        self.entries = entries          # the pool's dict: a reload replaces its contents
        self.reread = reread            # the sources read again (GET /models?reload=1); None: nothing to re-read
        self.autoload = autoload
        # llama-server's debug variable (server-models.cpp; llama.cpp's server tests set it): a routed request
        # holds its model busy this long before it is forwarded, so tests can see a busy model
        self.fake_busy_s = FAKE_BUSY_S if env.get("LLAMA_SERVER_DEBUG_FAKE_TIMING") else 0.0
        self.pool = ModelPool(entries, base_args, env, models_max=models_max, log=log)
        self.table = self.pool.table
        self.created = int(time.time())

    # -- the routes ---------------------------------------------------------------------------
    async def dispatch(self, req: Request) -> Response | StreamResponse:
        try:
            return await self._route(req)
        except ApiError as e:
            return Response.json(e.body(), status=e.status)
        except Exception as e:   # a bug of ours still answers llama-server's error object
            err = ApiError(500, f"internal error in {req.method} {req.path}: {type(e).__name__}: {e}", "server_error")
            return Response.json(err.body(), status=500)

    async def _route(self, req: Request) -> Response | StreamResponse:
        method, path = req.method.upper(), req.path
        if (method, path) in NOT_SERVED:
            raise ApiError(501, NOT_SERVED[method, path], "not_supported_error")
        if method == "GET":
            if path in ("/health", "/v1/health"):
                return Response.json({"status": "ok"})
            if path in ("/models", "/v1/models"):
                if req.query.get("reload"):         # any value, as llama-server's get_param("reload") != ""
                    await self.reload()
                return Response.json(self.listing())
            if path == "/props" and not req.query.get("model"):
                return Response.json(self.props())
            if path in GET_BY_QUERY:
                return await self._forward(req, req.query.get("model", ""))
        elif method == "POST":
            if path == "/models/load":
                await self.pool.settled()
                return self.post_load(_body(req))
            if path == "/models/unload":
                return self.post_unload(_body(req))
            if _post_route(path):
                model = _body(req).get("model", "")
                return await self._forward(req, model if isinstance(model, str) else "")
        elif method == "DELETE" and path == "/models":
            return await self.delete_model(req.query.get("model", ""))
        raise ApiError(404, f"File Not Found: {req.method} {req.path}", "not_found_error")

    def _check(self, name: str, autoload: bool) -> None:
        if not name:
            raise ApiError(400, "model name is missing from the request")
        st = self.table.get(name)
        if st is None:
            raise ApiError(400, f"model '{name}' not found")
        if not autoload and not st.running:
            raise ApiError(400, "model is not loaded")
        if not st.running:
            self._refused(name)

    def _refused(self, name: str) -> None:
        """A model whose preset asks what this build refuses is refused by name (501); one whose preset names
        no model, or two, is the router's configuration at fault (500)."""
        entry = self.entries[name]
        for why, status, kind in ((entry.refusal(), 501, "not_supported_error"), (entry.unfit(), 500, "server_error")):
            if why:
                self.pool.log("router", "model refused", level="error", model=name, why=why)
                raise ApiError(status, f"model '{name}' cannot be loaded: {why}", kind)

    async def reload(self) -> None:
        """Read the sources again and reconcile (pool.reload); a source that cannot be read answers 500 naming
        it, and the models stay as they were."""
        if self.reread is None:
            return
        try:
            entries = self.reread()
        except Exception as e:
            raise ApiError(500, f"reloading the models failed: {e}", "server_error") from None
        await self.pool.reload(entries)

    def startup(self) -> list[str]:
        """Load the models whose preset says load-on-startup (llama-server: at the first reading only); a
        ValueError naming the problem when they are more than --models-max or one is refused."""
        names = [n for n, e in self.entries.items() if truthy(e.option(LOAD_ON_STARTUP) or "false")]
        if self.table.models_max and len(names) > self.table.models_max:
            raise ValueError(f"{len(names)} models to load on startup ({', '.join(names)}) exceed --models-max "
                             f"{self.table.models_max}")
        for name in names:
            why = self.entries[name].refusal() or self.entries[name].unfit()
            if why:
                raise ValueError(f"model {name!r} (load-on-startup) cannot be loaded: {why}")
        for name in names:
            self.pool.load_now(name)
        return names

    async def _forward(self, req: Request, name: str) -> Response | StreamResponse:
        word = req.query.get("autoload", "")
        autoload = (word in ("true", "1")) if word else self.autoload
        self._check(name, autoload)
        port = await self.pool.ready(name)
        try:
            if self.fake_busy_s:
                await asyncio.sleep(self.fake_busy_s)
            res = await proxy.forward(port, req)
        except BaseException:
            self._release(name)
            raise
        if isinstance(res, StreamResponse):
            res.chunks = self._released(res.chunks, name)
        else:
            self._release(name)
        return res

    def _release(self, name: str) -> None:
        self.table.release(name)
        self.pool.notify()

    async def _released(self, chunks: AsyncIterator[bytes], name: str) -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            await chunks.aclose()
            self._release(name)

    def post_load(self, body: dict) -> Response:
        name = body.get("model", "")
        st = self.table.get(name) if isinstance(name, str) else None
        if st is None:
            raise ApiError(404, "model is not found", "not_found_error")
        if st.running:
            raise ApiError(400, "model is already running")
        self._refused(name)
        if not self.pool.load_now(name):
            raise ApiError(500, "model limit reached, try again later", "server_error")
        return Response.json({"success": True})

    def post_unload(self, body: dict) -> Response:
        name = body.get("model", "")
        st = self.table.get(name) if isinstance(name, str) else None
        if st is None:
            raise ApiError(400, "model is not found")
        if not st.running:
            raise ApiError(400, "model is not running")
        self.pool.task(self.pool.unload(name))
        return Response.json({"success": True})

    async def delete_model(self, name: str) -> Response:
        """DELETE /models?model=NAME, as llama-server's: a cache model only; a loaded one is unloaded first, then
        its files leave the caches (remove.py) and it leaves the list. Errors are llama-server's words and codes
        (its runtime errors are 500s)."""
        if not name:
            raise ApiError(400, "model must be a non-empty string")
        await self.pool.settled()
        entry = self.entries.get(name)
        if entry is None:
            raise ApiError(500, f"model name={name} is not found", "server_error")
        if entry.source != CACHE:
            raise ApiError(500, f"model name={name} is not removable (not from cache: its source is "
                                f"{entry.source})", "server_error")
        try:
            files = remove.plan(name, self.pool.env)
        except remove.RemoveRefused as e:
            self.pool.log("router", "model removal refused", level="error", model=name, why=str(e))
            raise ApiError(500, f"model name={name} is not removable: {e}", "server_error") from None
        failed = await self.pool.remove(name, lambda: remove.apply(files))
        if failed is None:
            raise ApiError(500, f"model name={name} is not found", "server_error")
        if failed:
            raise ApiError(500, f"model name={name}: these files could not be removed: {'; '.join(failed)}",
                           "server_error")
        return Response.json({"success": True})

    def listing(self) -> dict:
        data = []
        for name, entry in self.entries.items():
            if entry.hidden:            # a cache entry a preset with dedup-cache-models stands for
                continue
            st = self.table.get(name)
            status: dict = {"value": st.status, "args": st.args}
            if entry.options:
                status["preset"] = to_ini(name, {o.ident: o for o in entry.options})
            if st.exit_code is not None:
                status.update(exit_code=st.exit_code, failed=True)
            item = {"id": name, "aliases": [], "tags": [], "object": "model", "owned_by": "llamacpp",
                    "created": self.created, "status": status,
                    "architecture": {"input_modalities": ["text"], "output_modalities": ["text"]},
                    "source": entry.source, "can_remove": entry.source == CACHE}
            if st.status == LOADED:
                item.update({k: v for k, v in st.loaded_info.items() if k not in item})
            data.append(item)
        return {"data": data, "object": "list"}

    def props(self) -> dict:
        return {"role": "router", "max_instances": self.table.models_max, "models_autoload": self.autoload,
                "model_alias": "llama-server", "model_path": "none",
                "default_generation_settings": {"params": {}, "n_ctx": 0}, "build_info": BUILD_INFO,
                "cors_proxy_enabled": False}

    async def close(self) -> None:
        await self.pool.close()


def _body(req: Request) -> dict:
    obj = req.json()
    if not isinstance(obj, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return obj
