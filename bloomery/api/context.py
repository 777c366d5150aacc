"""What a route handler may use of the server's state: the App's shape, as a Protocol.

The handlers (chat.py, completion.py, ...) are typed against this, not against app.py's
class, so app.py imports its handlers and no handler imports app.py back.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol

from bloomery.api.generate import Generation
from bloomery.api.metrics import Metrics
from bloomery.api.params import GenParams
from bloomery.api.recent import Memo, Recent
from bloomery.api.responses_store import ResponseStore
from bloomery.engine.types import ModelInfo, SamplingParams


class ApiContext(Protocol):
    tok: Any                      # the Tokenizer
    template: Any                 # the ChatTemplate
    client: Any                   # the engine client
    info: ModelInfo
    sampling_defaults: SamplingParams
    n_predict_default: int
    aliases: list[str]
    model_name: str
    tags: list[str]
    endpoint_slots: bool
    metrics_requested: bool
    verbose_default: bool
    endpoint_props: bool
    enable_thinking_default: bool | None
    reasoning_format_default: str
    reasoning_budget_default: int
    reasoning_budget_message: str
    metrics: Metrics
    responses: ResponseStore
    log: Callable[[str], None]
    created: int
    media_marker: str
    spm_infill: bool              # /infill: the suffix before the prefix (--spm-infill)
    n_batch: int                  # -b: the prompt's pass size where progress is reported
    embeddings: bool              # --embeddings: /embedding(s) and /v1/embeddings answer (else 501)
    embd_normalize: int           # --embd-normalize: a pooled embedding's default normalisation
    residency: Any                # --sleep-idle-seconds' idle watch (api/sleep.py)
    recent: Recent                # generations for /slots (done ones as memos in a byte budget)
    slot_save_path: str | None    # --slot-save-path: POST /slots/{id}'s folder (None: those answer 501)

    def gen_defaults(self) -> dict: ...
    def sse_headers(self) -> list[tuple[str, str]]: ...
    def encode_chat(self, rendered) -> list[int]: ...
    def start(self, path: str, prompt_ids: list[int], params: GenParams) -> Generation: ...
    def generation(self, req_id: str) -> Generation | Memo | None: ...
    def routes(self): ...
    async def dispatch(self, req) -> Any: ...
