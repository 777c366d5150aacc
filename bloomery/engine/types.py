"""What the front asks of the engine and what the engine answers, per token.

These are plain frozen dataclasses shared by the in-process engine, the engine
process loop and the typed messages of bloomery/messages/engine.py (which
encodes them for the front <-> engine sockets). The front owns text: it
tokenizes, detokenizes and checks stop strings, and cancels a request when a
stop string ends it. The engine sees ids only.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """llama.cpp's sampler chain settings, with llama-server's defaults."""

    temperature: float = 0.8      # <= 0: greedy (argmax), as llama.cpp
    top_k: int = 40               # <= 0: off
    top_p: float = 0.95           # 1.0: off
    min_p: float = 0.05           # 0.0: off
    repeat_penalty: float = 1.0   # 1.0: off
    repeat_last_n: int = 64       # 0: off, -1: the context size
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = 0xFFFFFFFF        # LLAMA_DEFAULT_SEED: a random seed per request
    n_probs: int = 0              # > 0: report the top n_probs candidates of each step
    post_sampling_probs: bool = False   # the n_probs candidates after the chain (their pick probabilities)
    logit_bias: tuple[tuple[int, float], ...] = ()   # (id, bias); -inf bans the id
    grammar: str = ""             # structured output: llguidance grammar text (bloomery.grammar); "" = free
    n_drawn: int = 0              # draws the seeded stream made already (a continuation starts past them)


@dataclass(frozen=True)
class EngineRequest:
    req_id: str
    prompt_ids: tuple[int, ...]               # [P] the whole prompt, ids
    n_predict: int                            # -1: until the context is full
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_ids: tuple[int, ...] = ()            # end-of-generation ids (EOS/EOT); empty under ignore_eos
    cache_prompt: bool = True                 # reuse the slot's cached prefix when it matches
    id_task: int = -1                         # the front's task number (what /slots reports as id_task)
    return_progress: bool = False             # report the prompt pass batch by batch (progress TokenOuts)
    id_slot: int = -1                         # run in this slot (waiting while it is busy); -1: any free slot
    pooling: str = ""                         # an embedding request: none, mean, cls or last (the hidden states
                                              # after the final norm, pooled so); "": a generation


@dataclass(frozen=True)
class TokenProb:
    token: int
    logprob: float
    prob: float


@dataclass(frozen=True)
class TokenOut:
    """One engine step's result for one request."""

    req_id: str
    token: int | None                         # None only on a finish without a new token (cancel, error)
    finish: str | None = None                 # None while running; "stop" (a stop id), "length", "cancel", "error",
                                              # "shutdown" (the front's client ends it: the server is stopping)
    logprob: float | None = None              # log-softmax of the chosen id (when n_probs > 0)
    top: tuple[TokenProb, ...] = ()           # top n_probs candidates, most likely first (when n_probs > 0)
    n_prompt: int = 0                         # prompt ids of the request (set on its first output)
    n_cached: int = 0                         # prompt ids reused from the slot's cache (first output)
    prompt_ms: float = 0.0                    # prompt pass wall time (first output)
    cache_ms: float = 0.0                     # the prompt cache's work before the prompt pass: saving what the slot
                                              # held, restoring a saved prefix (first output; timings.cache_ms)
    error: str | None = None                  # message when finish is "error" or "shutdown"
    slot: int = -1                            # the slot that ran the request; -1 when none did (queued, refused)
    n_processed: int = -1                     # >= 0 only on a prompt-progress output (token and finish None):
                                              # prompt ids in the slot so far, the cached ones included
    embedding: str = ""                       # an embedding request's answer: base64 of float32 [embd_rows, n_embd]
    embd_rows: int = 0                        # rows in `embedding` (1 pooled; one a prompt id under pooling none)

    @property
    def is_progress(self) -> bool:
        return self.n_processed >= 0


@dataclass(frozen=True)
class ModelInfo:
    """Post-load facts the engine sends with READY."""

    name: str                  # --alias, else general.name, else the file's stem
    arch: str
    n_ctx: int                 # total context over all slots
    n_ctx_slot: int            # positions one slot holds
    n_slots: int
    n_vocab: int
    n_ctx_train: int
    backend: str               # "numpy" or "cuda"
    model_path: str
    n_params: int = 0          # elements of every tensor (llama_model_n_params)
    size_bytes: int = 0        # bytes of every tensor as stored (llama_model_size), not the file's size
    n_embd: int = 0            # {arch}.embedding_length
    vocab_type: int = 0        # llama.cpp's enum: 0 none, 1 SPM, 2 BPE, 3 WPM, 4 UGM, 5 RWKV, 6 PLaMo-2
    ftype: str = ""            # llama_ftype_name of general.file_type ("Q4_K - Medium"), "(guessed) ..." without it
    pooling: str = "none"      # embeddings (--embeddings): --pooling, else the file's {arch}.pooling_type, else none
