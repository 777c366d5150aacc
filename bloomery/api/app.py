"""The route table and what every handler shares: tokenizer, template, engine client, model facts.

`App.dispatch` never raises: a handler's ApiError becomes llama-server's error
object, and anything else a 500 that names it, so the transport only writes.
"""
from __future__ import annotations

import itertools
import re
import time
import uuid
from typing import Awaitable, Callable


from bloomery import workpool
from bloomery.api import limits
from bloomery.api import (anthropic, chat, completion, embeddings, experts, gcp, infill, input_tokens, models,
                          ollama, props, responses, slot_actions, slots, sleep, tokenize)
from bloomery.api.metrics import Metrics
from bloomery.api.generate import Generation
from bloomery.api.params import GenParams
from bloomery.api.recent import Memo, Recent
from bloomery.api.shapes import slot_params
from bloomery.engine.limits import prompt_fits
from bloomery.engine.types import ModelInfo, SamplingParams
from bloomery.flags import REASONING_OFF, REASONING_ON
from bloomery.http.types import ApiError, Request, Response, StreamResponse
from bloomery.records import record


class ExceedContextError(ApiError):
    """llama-server's exceed_context_size_error, which carries the counts beside the message."""

    def __init__(self, n_prompt: int, n_ctx: int):
        super().__init__(400, f"request ({n_prompt} tokens) exceeds the available context size ({n_ctx} tokens), "
                              f"try increasing it", "exceed_context_size_error")
        self.n_prompt, self.n_ctx = n_prompt, n_ctx

    def body(self) -> dict:
        out = super().body()
        out["error"].update(n_prompt_tokens=self.n_prompt, n_ctx=self.n_ctx)
        return out


def _record(line: str) -> None:
    """A request's line as a record (the supervisor passes one that names the lifecycle's phase)."""
    record("ready", line)


async def _parse_body(req: Request) -> None:
    """The body's JSON, checked against the size limits (api/limits.py) before any handler reads it; a large
    body in the parser process (bloomery/workpool.py). A body that is not JSON is left to its handler, which
    refuses it in its route's own shape."""
    if len(req.body) < workpool.PROCESS_BYTES:
        kind, got = limits.parse_checked(req.body)
    else:
        kind, got = await workpool.in_parser(limits.parse_checked, req.body)
    if kind == "limit":
        raise ApiError(400, str(got), "invalid_request_error")
    if kind == "ok":
        req.parsed = got
    else:
        req.parse_error = str(got)



Route = Callable[["App", Request], Awaitable["Response | StreamResponse"]]
ROUTES: dict[tuple[str, str], Route] = {}
for _path in ("/health", "/v1/health"):
    ROUTES["GET", _path] = props.handle_health
for _path in ("/v1/models", "/models"):
    ROUTES["GET", _path] = models.handle_models
ROUTES["GET", "/props"] = props.handle_props
ROUTES["GET", "/slots"] = slots.handle_slots
ROUTES["GET", "/metrics"] = slots.handle_metrics
ROUTES["POST", "/tokenize"] = tokenize.handle_tokenize
ROUTES["POST", "/detokenize"] = tokenize.handle_detokenize
ROUTES["POST", "/apply-template"] = chat.handle_apply_template
for _path in ("/completion", "/completions"):
    ROUTES["POST", _path] = completion.handle_completion
ROUTES["POST", "/v1/completions"] = completion.handle_v1_completions
for _path in ("/v1/chat/completions", "/chat/completions"):
    ROUTES["POST", _path] = chat.handle_chat
ROUTES["POST", "/props"] = props.handle_post_props
for _path in ("/v1/chat/completions/input_tokens", "/chat/completions/input_tokens"):
    ROUTES["POST", _path] = input_tokens.handle_chat_input_tokens
ROUTES["GET", "/api/tags"] = ollama.handle_tags
ROUTES["POST", "/api/show"] = ollama.handle_show
for _path in ("/v1/responses", "/responses"):
    ROUTES["POST", _path] = responses.handle_create
for _path in ("/v1/responses/input_tokens", "/responses/input_tokens"):
    ROUTES["POST", _path] = input_tokens.handle_responses_input_tokens
ROUTES["POST", "/infill"] = infill.handle_infill
ROUTES["GET", "/residency"] = experts.handle_residency             # bloomery's own: routed experts' residency
ROUTES["POST", "/residency/reset"] = experts.handle_reset


def not_served(message: str) -> Route:
    """A route llama-server has that this build does not serve: 501 with llama-server's sentence, then ours."""
    async def refuse(app: "App", req: Request) -> Response:
        raise ApiError(501, message, "not_supported_error")
    return refuse


for _path in ("/embedding", "/embeddings"):
    ROUTES["POST", _path] = embeddings.handle_embeddings
ROUTES["POST", "/v1/embeddings"] = embeddings.handle_v1_embeddings
for _path in ("/rerank", "/reranking", "/v1/rerank", "/v1/reranking"):
    ROUTES["POST", _path] = not_served("This server does not support reranking: it serves generative models only "
                                       "(--reranking is refused at start)")
ROUTES["POST", "/v1/messages"] = anthropic.handle_messages
ROUTES["POST", "/v1/messages/count_tokens"] = anthropic.handle_count_tokens

# routes with an id in the path: (method, pattern, handler); the handler reads the id from req.path
PATTERN_ROUTES: list[tuple[str, "re.Pattern[str]", Route]] = [
    ("GET", re.compile(r"/(?:v1/)?models/.+"), models.handle_model),
    ("GET", re.compile(r"/(?:v1/)?responses/[^/]+"), responses.handle_get),
    ("DELETE", re.compile(r"/(?:v1/)?responses/[^/]+"), responses.handle_delete),
    ("POST", re.compile(r"/(?:v1/)?responses/[^/]+/cancel"), responses.handle_cancel),
    ("POST", re.compile(r"/slots/[^/]+"), slot_actions.handle_slot_action),
]


def find_route(method: str, path: str) -> Route | None:
    handler = ROUTES.get((method, path))
    if handler is None:
        handler = next((h for m, pat, h in PATTERN_ROUTES if m == method and pat.fullmatch(path)), None)
    return handler


class App:
    """sampling_defaults / n_predict_default: what a request gets for a field it leaves out (the server's
    --temp, --top-k, ..., --seed and -n, as llama-server's flags set its request defaults).
    endpoint_slots: GET /slots is served (--no-slots: 501). metrics_requested: --metrics was given
    (/metrics is served; without it 501 as llama-server). endpoint_props: --props (POST /props answers)."""

    def __init__(self, tokenizer, template, client, info: ModelInfo, *,
                 sampling_defaults: SamplingParams | None = None, n_predict_default: int = -1,
                 alias: str | None = None, tags: str | None = None, endpoint_slots: bool = True,
                 metrics_requested: bool = False, verbose_default: bool = False,
                 endpoint_props: bool = False, reasoning: str = "auto", reasoning_format: str = "auto",
                 reasoning_budget: int = -1, reasoning_budget_message: str | None = None,
                 spm_infill: bool = False, n_batch: int = 2048,
                 embeddings_on: bool = False, embd_normalize: int = 2, sleep_idle_s: int = -1, slot_save_path: str | None = None, gcp_mode: "gcp.GcpMode | None" = None, log: Callable[[str], None] = _record):
        self.tok = tokenizer
        self.template = template
        self.client = client
        self.info = info
        self.sampling_defaults = sampling_defaults or SamplingParams()
        self.n_predict_default = n_predict_default
        # --alias a,b,c: every name answers; the id is the first in sorted order (llama-server's std::set)
        self.aliases = sorted({a.strip() for a in (alias or "").split(",") if a.strip()}) or [info.name]
        self.model_name = self.aliases[0]
        self.tags = sorted({t.strip() for t in (tags or "").split(",") if t.strip()})
        self.endpoint_slots = endpoint_slots
        self.metrics_requested = metrics_requested
        self.verbose_default = verbose_default        # -v: answers carry __verbose unless a request turns it off
        self.endpoint_props = endpoint_props          # --props: POST /props answers success (it changes nothing)
        # --reasoning on/off: the template's enable_thinking unless a request sets it (auto: None, the template's)
        self.enable_thinking_default = (True if reasoning in REASONING_ON else False if reasoning in REASONING_OFF
                                        else None)
        self.reasoning_format_default = reasoning_format     # --reasoning-format
        self.reasoning_budget_default = reasoning_budget     # --reasoning-budget
        self.reasoning_budget_message = reasoning_budget_message or ""
        self.spm_infill = spm_infill                  # --spm-infill: /infill puts the suffix before the prefix
        self.n_batch = n_batch                        # -b: /infill's prefix/suffix budget
        self.embeddings = embeddings_on               # --embeddings: the embedding routes answer (else 501)
        self.embd_normalize = embd_normalize          # --embd-normalize: a pooled embedding's default norm
        self.slot_save_path = slot_save_path          # --slot-save-path: POST /slots/{id}'s folder (None: 501)
        self.gcp_mode = gcp_mode                      # AIP_MODE=PREDICTION: Vertex AI's predict (and health) route
        self.residency = sleep.Residency(client, sleep_idle_s, log)   # --sleep-idle-seconds (-1: never)
        self.metrics = Metrics()
        self.responses = responses.ResponseStore()    # /v1/responses kept for GET / previous_response_id
        self.log = log
        self.created = int(time.time())
        self.media_marker = f"<__media_{uuid.uuid4().hex}__>"
        self._task_ids = itertools.count()
        self.recent = Recent(slot_params)         # generations for /slots, done ones as memos in a byte budget

    def routes(self):
        """(method, path) of every fixed route, in registration order."""
        return ROUTES.keys()

    def _find(self, method: str, path: str) -> Route | None:
        mode = self.gcp_mode
        if mode is not None:
            if method == "POST" and path == mode.predict_path:
                return gcp.handle_predict
            if method == "GET" and path == mode.health_path:
                return props.handle_health
        return find_route(method, path)

    async def dispatch(self, req: Request) -> Response | StreamResponse:
        handler = self._find(req.method.upper(), req.path)
        if handler is None:
            err = ApiError(404, f"File Not Found: {req.method} {req.path}", "not_found_error")
            return Response.json(err.body(), status=404)
        waking = self.residency.enabled and req.method.upper() == "POST"
        if not waking:
            return await self._run(handler, req)
        try:
            await self.residency.enter()
        except Exception as e:   # the engine could not load again (or is gone): this request says why
            self.residency.leave()
            err = ApiError(500, f"waking the server failed: {type(e).__name__}: {e}", "server_error")
            return Response.json(err.body(), status=500)
        res = None
        try:
            res = await self._run(handler, req)
        finally:
            if isinstance(res, StreamResponse):
                res.chunks = sleep.released(res.chunks, self.residency.leave)
            else:
                self.residency.leave()
        return res

    async def _run(self, handler: Route, req: Request) -> Response | StreamResponse:
        try:
            if req.body and req.method.upper() == "POST":
                await _parse_body(req)
            return await handler(self, req)
        except ApiError as e:
            return Response.json(e.body(), status=e.status)
        except Exception as e:   # a bug of ours still answers llama-server's error object
            err = ApiError(500, f"internal error in {req.method} {req.path}: {type(e).__name__}: {e}", "server_error")
            return Response.json(err.body(), status=500)

    # --- what the route modules share ---

    def gen_defaults(self) -> dict:
        return {"n_predict_default": self.n_predict_default, "sampling_defaults": self.sampling_defaults,
                "n_vocab": self.tok.n_vocab, "eog_ids": frozenset(self.tok.eog_ids)}

    def sse_headers(self) -> list[tuple[str, str]]:
        return [("content-type", "text/event-stream"), ("x-accel-buffering", "no")]

    def encode_chat(self, rendered) -> list[int]:
        from bloomery.chat_template import encode_segments   # the chat-template module owns the guard
        return list(encode_segments(self.tok, rendered.segments, add_special=True))

    def start(self, path: str, prompt_ids: list[int], params: GenParams) -> Generation:
        """A generation ready to run; refuses a prompt the slot cannot hold before anything reaches the engine."""
        n_ctx = self.info.n_ctx_slot
        if not prompt_fits(len(prompt_ids), n_ctx):
            raise ExceedContextError(len(prompt_ids), n_ctx)
        if params.id_slot >= self.info.n_slots:
            raise ApiError(400, f"Field 'id_slot': slot {params.id_slot} does not exist; this server has slots "
                                f"0..{self.info.n_slots - 1}", param="id_slot")
        task_id = next(self._task_ids)
        gen = Generation(tok=self.tok, client=self.client, req_id=f"cmpl-{task_id}-{uuid.uuid4().hex[:8]}",
                         task_id=task_id, path=path, prompt_ids=prompt_ids, params=params,
                         n_ctx_slot=n_ctx, log=self.log, metrics=self.metrics)
        self.recent.add(gen)
        return gen

    def generation(self, req_id: str) -> "Generation | Memo | None":
        """A recent generation (or its memo, once done) by its engine req_id (for /slots' params); a later leg's
        id ("<id>+<n>", after forced reasoning-budget ids) names its generation too."""
        return self.recent.get(req_id.split("+", 1)[0])
