"""POST /infill: fill-in-the-middle, the route editor plugins use with Coder models.

The prompt is built from the vocab's FIM tokens in the repo-level layout llama-server uses
(Qwen2.5-Coder's report, arXiv 2409.12186):

    [FIM_REP]myproject\\n [FIM_SEP]name0\\n text0 ... [FIM_SEP]filename\\n [FIM_PRE]prefix[FIM_SUF]suffix[FIM_MID]

with `prompt` (the text already typed after the prefix) right after the prefix, and the same
budget as llama-server: the prefix keeps its last 3/4 of a batch, the suffix its first
1/4 less the prompt, the extra chunks what the slot has left after a batch and twice the
server's -n. --spm-infill puts the suffix first. The answer is /completion's.
A vocab without FIM prefix, suffix and middle tokens answers 501 naming the missing ones.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from bloomery.api.params import Fields, field_error
from bloomery.http.types import ApiError, Request, Response, StreamResponse

if TYPE_CHECKING:
    from bloomery.api.context import ApiContext as App

N_BATCH = 2048          # llama-server's default -b (the server's -b sets it): the budget of its FIM prompt
REPO_NAME = "myproject\n"
FILE_NAME = "filename\n"       # llama-server names the file being edited so
# without a file separator token, chunks are joined by this line (as llama-server's bytes)
CHUNK_SEPARATOR = "\n\n--- snippet ---\n\n"


@dataclass(frozen=True)
class FimTokens:
    pre: int
    suf: int
    mid: int
    rep: int | None
    sep: int | None


def fim_tokens(tok) -> FimTokens:
    """The vocab's FIM ids, or a 501 naming what is missing (llama-server's message)."""
    missing = [what for what, name in (("prefix", "pre"), ("suffix", "suf"), ("middle", "mid"))
               if tok.fim_id(name) is None]
    if missing:
        raise ApiError(501, "Infill is not supported by this model: " +
                       " ".join(f"{w} token is missing." for w in missing), "not_supported_error")
    return FimTokens(tok.fim_id("pre"), tok.fim_id("suf"), tok.fim_id("mid"), tok.fim_id("rep"), tok.fim_id("sep"))


def _text_ids(tok, value: object, name: str) -> list[int]:
    """input_prefix / input_suffix: a string, or an array of strings and token ids; special text is text."""
    if isinstance(value, str):
        return tok.encode(value, add_special=False, parse_special=False)
    if isinstance(value, list):
        ids: list[int] = []
        for i, x in enumerate(value):
            if isinstance(x, str):
                ids += tok.encode(x, add_special=False, parse_special=False)
            elif isinstance(x, int) and not isinstance(x, bool) and 0 <= x < tok.n_vocab:
                ids.append(x)
            else:
                raise field_error(name, f"{name}[{i}] must be a string or a token id in 0..{tok.n_vocab - 1}, "
                                        f"but is {x!r}")
        return ids
    raise field_error(name, f"must be a string or an array of strings and token ids, but is {type(value).__name__}")


def read_extra(value: object) -> list[tuple[str, str]]:
    """input_extra: [{"filename": str (default "tmp"), "text": str}] -> (filename, text) pairs."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise field_error("input_extra", 'must be an array of {"filename": string, "text": string}')
    out = []
    for i, chunk in enumerate(value):
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
            raise field_error("input_extra", f'input_extra[{i}] must contain a "text" field with a string value')
        name = chunk.get("filename", "tmp")
        if not isinstance(name, str):
            raise field_error("input_extra", f"input_extra[{i}]'s \"filename\" field must be a string")
        out.append((name, chunk["text"]))
    return out


def fim_prompt(tok, fim: FimTokens, prefix: list[int], suffix: list[int], extra: list[tuple[str, str]],
               typed: list[int], *, n_ctx: int, n_predict: int, n_batch: int = N_BATCH,
               spm: bool = False) -> list[int]:
    """The ids llama-server's infill feeds the model (pure; the budget rules in the module doc)."""
    def enc(text: str) -> list[int]:
        return tok.encode(text, add_special=False, parse_special=False)

    head: list[int] = []
    if fim.rep is not None:
        head += [fim.rep, *enc(REPO_NAME)]
    for name, text in extra:
        head += [fim.sep, *enc(name + "\n")] if fim.sep is not None else enc(CHUNK_SEPARATOR)
        head += enc(text)
    if fim.sep is not None:
        head += [fim.sep, *enc(FILE_NAME)]
    n_prefix = min(len(prefix), 3 * (n_batch // 4))
    n_suffix = min(len(suffix), max(0, n_batch // 4 - (2 + len(typed))))
    n_extra = min(max(0, n_ctx - n_batch - 2 * n_predict), len(head))
    pre = [fim.pre, *prefix[len(prefix) - n_prefix:], *typed]
    suf = [fim.suf, *suffix[:n_suffix]]
    first, second = (suf, pre) if spm else (pre, suf)
    bos = [tok.bos_id] if tok.add_bos and tok.bos_id is not None else []
    return [*head[len(head) - n_extra:], *bos, *first, *second, fim.mid]


async def handle_infill(app: "App", req: Request) -> Response | StreamResponse:
    from bloomery.api.completion import answer_llama    # completion owns the /completion answer
    fim = fim_tokens(app.tok)
    f = Fields(req.json())
    typed = f.raw("prompt")
    if typed is not None and not isinstance(typed[1], str):
        raise field_error("prompt", '"prompt" must be a string')
    for name in ("input_prefix", "input_suffix"):
        if name not in f.body:
            raise field_error(name, f'"{name}" is required')
    extra = read_extra(f.body.get("input_extra"))
    typed_ids = app.tok.encode(typed[1], add_special=False, parse_special=True) if typed else []
    ids = fim_prompt(app.tok, fim, _text_ids(app.tok, f.body["input_prefix"], "input_prefix"),
                     _text_ids(app.tok, f.body["input_suffix"], "input_suffix"), extra, typed_ids,
                     n_ctx=app.info.n_ctx_slot, n_predict=app.n_predict_default, n_batch=app.n_batch,
                     spm=app.spm_infill)
    return await answer_llama(app, req, f, [ids], [app.tok.decode(ids)])
