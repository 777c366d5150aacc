"""The supervisor's HTTP front: the gate every request passes, and the App built after READY.

Gate: on headers, before the body is read (HttpServer's precheck): the Host guard
when bound to loopback (403, http/guard.py says why), OPTIONS answered as
llama-server's CORS preflight, then the phase gate (503 "Loading model" while
loading, 503 "Server is shutting down" once draining), then the API key (401), in
llama-server's order; dispatch checks the phase again (a request that passed
precheck just before a signal). Every answer echoes the request's Origin.
build_front reads the tokenizer and chat template from the GGUF header (no weights).
"""
from __future__ import annotations

import os

from bloomery.http import guard
from bloomery.http.types import Response
from bloomery.lifecycle import Lifecycle
from bloomery.records import record
from bloomery.settings import Settings

# llama-server keeps /health and /v1/health public; the model list is public here too (issue 4: a
# client may discover the model before it has a key; the list names only the model).
PUBLIC_PATHS = ("/health", "/v1/health", "/v1/models", "/models")
INVALID_KEY = {"error": {"code": 401, "message": "Invalid API Key", "type": "authentication_error"}}


class Gate:
    def __init__(self, life: Lifecycle, api_keys: tuple[str, ...], cors: guard.Cors = guard.Cors()):
        self.life = life
        self.cors = cors
        self.api_keys = api_keys
        self._key_bytes = tuple(k.encode("utf-8") for k in api_keys)
        self.app = None                 # the App, once the engine is READY

    def phase_response(self) -> Response | None:
        gate = self.life.gate()
        return None if gate is None else Response.json(gate[1], status=gate[0])

    def precheck(self, req) -> Response | None:
        """On the headers alone: Host guard, OPTIONS (CORS preflight), phase 503, API key 401."""
        refusal = guard.host_refusal(req.listen, req.headers)
        if refusal is not None:
            record("http", "refused: Host is not a loopback name", level="warning", peer=req.peer,
                   host=req.headers.get("host", "")[:200])
            return Response.json({"error": {"code": 403, "message": refusal, "type": "permission_error"}},
                                 status=403)
        if req.method == "OPTIONS":
            return Response(200, b"", [("content-type", "text/html"), *guard.preflight_headers(req.headers, self.cors)])
        early = self.phase_response()
        if early is None and self.api_keys and req.path not in PUBLIC_PATHS:
            if not guard.key_matches(guard.offered_key(req.headers), self._key_bytes):
                record("http", "unauthorized: Invalid API Key", level="warning", peer=req.peer,
                       method=req.method, path=req.path[:200])
                early = Response.json(INVALID_KEY, status=401)
        if early is not None:
            early.headers = [*early.headers, *guard.cors_headers(req.headers, self.cors)]
        return early

    async def dispatch(self, req):
        early = self.phase_response()
        if early is not None or self.app is None:
            response = early or Response.json(self.life.gate()[1], status=503)
        else:
            response = await self.app.dispatch(req)
        cors = guard.cors_headers(req.headers, self.cors)
        if cors:   # a new list: a handler may answer one shared Response object
            response.headers = [*response.headers, *cors]
        return response


def make_app(s: Settings, tokenizer, template, client, info, **kw):
    """The API App with the server's request defaults and endpoint switches from the settings."""
    from bloomery.api import gcp
    from bloomery.api.app import App

    return App(tokenizer, template, client, info, **kw, sampling_defaults=s.sampling(), n_predict_default=s.n_predict,
               alias=s.alias, tags=s.tags, endpoint_slots=s.endpoint_slots, metrics_requested=s.metrics,
               verbose_default=s.verbose, reasoning=s.reasoning, reasoning_format=s.reasoning_format,
               reasoning_budget=s.reasoning_budget, reasoning_budget_message=s.reasoning_budget_message,
               spm_infill=s.spm_infill, n_batch=s.batch_size, embeddings_on=s.embeddings,
               embd_normalize=s.embd_normalize,
               sleep_idle_s=s.sleep_idle_seconds, slot_save_path=s.slot_save_path, gcp_mode=gcp.from_env(dict(os.environ)))


def choice_records(s: Settings, facts: dict) -> None:
    """One record per choice the start made, after the plan (the ctx/parallel lines come from the plan)."""
    record("start", "model", path=s.model_file, seat=facts.get("arch"), source="--seat" if s.seat else "file arch")
    record("start", "backend", backend=facts.get("backend"), chosen=s.backend, source=s.backend_from)
    record("start", "alias", name=s.alias or facts.get("general_name") or os.path.basename(s.model_file or ""),
           source="--alias" if s.alias else "general.name" if facts.get("general_name") else "file name")
    record("start", "n_predict", default=s.n_predict, source=s.sources.get("n_predict", "default"))
    record("start", "api keys", n_keys=len(s.api_keys), public=list(PUBLIC_PATHS) if s.api_keys else "all")
    record("start", "cors", origins=s.cors_origins, credentials=s.cors_credentials and s.cors_origins.strip() != "*",
           source=s.sources.get("cors_origins", "default"))
    if s.cors_origins.strip() == "*" and not s.api_keys:
        record("start", "no API key is set and CORS allows every origin: any web page a local browser opens can "
                        "use this server", level="warning")
    record("start", "chat template", source=s.chat_template_file or (s.chat_template is not None and
           f"--chat-template {s.chat_template[:40]!r}") or "the GGUF's tokenizer.chat_template")
    if s.sampling_defaults:
        record("start", "sampling defaults: requests that leave these out get them", **s.sampling_defaults)
    record("start", "endpoints", slots=s.endpoint_slots, metrics="served" if s.metrics else "not served (501 without --metrics)")


def build_front(path: str, s: Settings):
    """Tokenizer and chat template from the GGUF header (no weights), in a worker thread."""
    from bloomery.chat_template import ChatTemplate
    from bloomery.gguf_file import open_gguf
    from bloomery.stage_runner import StageFailed
    from bloomery.tokenizer import Tokenizer

    with open_gguf(path) as gf:
        md = gf.metadata
        tok = Tokenizer.from_gguf(md)
        if s.chat_template_file:
            source, origin = open(s.chat_template_file, encoding="utf-8").read(), s.chat_template_file
        elif s.chat_template is not None:
            from bloomery.chat_template.builtin import template_source
            source, origin = template_source(s.chat_template)
        else:
            source, origin = md.get("tokenizer.chat_template"), "the GGUF's tokenizer.chat_template"
        if not isinstance(source, str):
            raise StageFailed("load", f"{path}: no tokenizer.chat_template; give --chat-template-file")
        template = ChatTemplate(source, bos_token=_piece(tok, tok.bos_id), eos_token=_piece(tok, tok.eos_id),
                                add_bos=bool(tok.add_bos), add_eos=bool(getattr(tok, "add_eos", False)), origin=origin)
    return tok, template


def _piece(tok, token_id) -> str:
    if token_id is None or token_id < 0:
        return ""
    return tok.token_to_piece(token_id).decode("utf-8", "replace")
