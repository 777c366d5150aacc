"""The Router: llama-server's router routes, and every model route forwarded by its "model".

What answers here (server-models.cpp, server_models_routes): GET /health; GET /props without ?model (the
router's own props); GET /models and /v1/models (every model with its status); POST /models/load and
/models/unload. Every other model route goes to the child serving the model the request names: POST routes
by the body's "model", GET routes (/props, /metrics, /slots, /residency) by ?model=. With autoload (the
default, --no-models-autoload turns it off, ?autoload=true|false per request) a model not loaded is loaded
first; past --models-max the least recently used idle model is unloaded for it. A request that finds every
loaded model busy waits until one is idle (a model serving a request is never unloaded under it); requests
for one model coalesce on one load; a client that leaves while waiting gives up nothing. Errors are
llama-server's words and codes.
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import AsyncIterator, Callable

from bloomery.api.app import PATTERN_ROUTES, ROUTES
from bloomery.api.shapes import BUILD_INFO
from bloomery.http.types import ApiError, Request, Response, StreamResponse
from bloomery.records import record
from bloomery.router import proxy
from bloomery.router.catalog import CACHE, Entry
from bloomery.router.children import Child, child_argv, free_port
from bloomery.router.table import LOADED, LOADING, UNLOADED, ModelTable

GET_BY_QUERY = ("/props", "/metrics", "/slots", "/residency")   # GET routes a child answers, named by ?model=
NOT_SERVED = {("POST", "/models"): "downloading a model through the router (POST /models) is not served; "
                                   "fetch it with bloomery-serve -hf REPO or put the file in --models-dir",
              ("DELETE", "/models"): "removing a cached model through the router (DELETE /models) is not served",
              ("GET", "/models/sse"): "the router's model event stream (GET /models/sse) is not served"}


def _post_route(path: str) -> bool:
    return ("POST", path) in ROUTES or any(m == "POST" and pat.fullmatch(path) for m, pat, _ in PATTERN_ROUTES)


class Router:
    def __init__(self, entries: dict[str, Entry], base_args: list[str], env: dict[str, str], *,
                 models_max: int, autoload: bool, log: Callable[..., None] = record):
        self.entries = entries
        self.base_args = base_args      # the router's own flags, router-only ones taken out (settings.argv_without)
        self.env = env
        self.autoload = autoload
        self.table = ModelTable(list(entries), models_max)
        self.children: dict[str, Child] = {}
        self.tasks: set[asyncio.Task] = set()
        self.created = int(time.time())
        self._changed = asyncio.Event()
        self.log = log

    # -- the one place the table's changes are announced ------------------------------------------
    def _notify(self) -> None:
        event, self._changed = self._changed, asyncio.Event()
        event.set()

    def _task(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    # -- loading and unloading ----------------------------------------------------------------
    def _claim(self, name: str, victim: str | None) -> None:
        """Mark the model loading now (it holds its place under --models-max from here), then load it in a task
        of its own: a client that leaves does not stop a load it started."""
        entry = self.entries[name]
        port = free_port()
        argv = child_argv(self.base_args + (["--offline"] if entry.source == CACHE else []), entry.model_args(),
                          name, port)
        self.table.loading(name, port, argv)
        if victim is not None:   # from now on no request is routed to it, so none can hold it up
            self.table.get(victim).stopping = True
        self.log("router", "loading model", model=name, port=port, **({"evicting": victim} if victim else {}))
        self._notify()
        self._task(self._run_child(name, victim, Child(argv, port, self.env)))

    async def _run_child(self, name: str, victim: str | None, child: Child) -> None:
        code: int | None = None
        try:
            if victim is not None:
                await self.unload(victim)
            if self.table.get(name).stopping:
                return
            self.children[name] = child
            await child.start()
            info = await child.ready()
            if self.table.get(name).stopping:
                await child.stop()
                return
            self.table.loaded(name, info)
            self.log("router", "model loaded", model=name, port=child.port)
            self._notify()
            code = await child.wait()
        except asyncio.CancelledError:
            child.kill()
            raise
        except Exception as e:
            self.log("router", "model failed to load", level="error", model=name, error=str(e))
            code = child.proc.returncode if child.proc is not None and child.proc.returncode is not None else -1
            child.kill()
        finally:
            asked = self.table.get(name).stopping
            if self.children.get(name) is child:
                del self.children[name]
            self.table.ended(name, None if asked else code)
            if code is not None and not asked:
                self.log("router", "model's server exited", level="warning", model=name, exit_code=code)
            self._notify()

    async def unload(self, name: str) -> None:
        """Stop the model's child and wait until it is gone."""
        st = self.table.get(name)
        if not st.running:
            return
        st.stopping = True
        self.log("router", "unloading model", model=name)
        self._notify()
        child = self.children.get(name)
        if child is not None:
            await child.stop()
        while self.table.get(name).status != UNLOADED:
            await self._changed.wait()

    def _load_now(self, name: str) -> bool:
        """Start the model's load if there is room, or room once an idle model is given up; False: wait."""
        if self.table.has_capacity():
            self._claim(name, None)
            return True
        victim = self.table.victim()
        if victim is None:
            return False
        self._claim(name, victim)
        return True

    async def ready(self, name: str) -> int:
        """Wait until the model is loaded; count the request against it (a model serving one is never given
        up) and return its child's port."""
        saw_loading = False
        while True:
            st, changed = self.table.get(name), self._changed
            if st.status == LOADED and not st.stopping:
                self.table.acquire(name)
                return st.port
            if st.status == LOADING:
                saw_loading = True
            elif st.status == UNLOADED:
                if saw_loading and st.exit_code is not None:
                    raise ApiError(500, f"model name={name} failed to load", "server_error")
                if self._load_now(name):
                    continue
            await changed.wait()

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
                return Response.json(self.listing())
            if path == "/props" and not req.query.get("model"):
                return Response.json(self.props())
            if path in GET_BY_QUERY:
                return await self._forward(req, req.query.get("model", ""))
        elif method == "POST":
            if path == "/models/load":
                return self.post_load(_body(req))
            if path == "/models/unload":
                return self.post_unload(_body(req))
            if _post_route(path):
                model = _body(req).get("model", "")
                return await self._forward(req, model if isinstance(model, str) else "")
        raise ApiError(404, f"File Not Found: {req.method} {req.path}", "not_found_error")

    def _check(self, name: str, autoload: bool) -> None:
        if not name:
            raise ApiError(400, "model name is missing from the request")
        st = self.table.get(name)
        if st is None:
            raise ApiError(400, f"model '{name}' not found")
        if not autoload and not st.running:
            raise ApiError(400, "model is not loaded")

    async def _forward(self, req: Request, name: str) -> Response | StreamResponse:
        word = req.query.get("autoload", "")
        autoload = (word in ("true", "1")) if word else self.autoload
        self._check(name, autoload)
        port = await self.ready(name)
        try:
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
        self._notify()

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
        if not self._load_now(name):
            raise ApiError(500, "model limit reached, try again later", "server_error")
        return Response.json({"success": True})

    def post_unload(self, body: dict) -> Response:
        name = body.get("model", "")
        st = self.table.get(name) if isinstance(name, str) else None
        if st is None:
            raise ApiError(400, "model is not found")
        if not st.running:
            raise ApiError(400, "model is not running")
        self._task(self.unload(name))
        return Response.json({"success": True})

    def listing(self) -> dict:
        data = []
        for name, entry in self.entries.items():
            st = self.table.get(name)
            status: dict = {"value": st.status, "args": st.args}
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
        """Stop every child (they drain as under systemd), then end the tasks that watched them."""
        await asyncio.gather(*(self.unload(n) for n, st in self.table.states.items() if st.running),
                             return_exceptions=True)
        for task in list(self.tasks):
            task.cancel()
        for child in self.children.values():
            child.kill()


def _body(req: Request) -> dict:
    obj = req.json()
    if not isinstance(obj, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return obj
