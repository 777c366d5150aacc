"""The vocabulary as llama.cpp sees it: token texts, attributes, special ids, EOG set.

Built from the GGUF metadata keys `tokenizer.ggml.*` (plain python values). The
attribute rules (control-looking tokens forced to CONTROL, "unused" control tokens,
the end-of-generation list) follow llama.cpp's llama-vocab.cpp load(), because
they decide which spellings split as special tokens and which pieces render.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import repeat

from .errors import TokenizerError
from .pretok import PRE_TYPES, PreType, pre_type_for


# llama_token_attr bits
ATTR_UNDEFINED = 0
ATTR_UNKNOWN = 1 << 0
ATTR_UNUSED = 1 << 1
ATTR_NORMAL = 1 << 2
ATTR_CONTROL = 1 << 3
ATTR_USER_DEFINED = 1 << 4
ATTR_BYTE = 1 << 5
ATTR_LSTRIP = 1 << 7
ATTR_RSTRIP = 1 << 8

# GGUF token_type value -> attribute (llama_token_type order)
_TYPE_TO_ATTR = {0: ATTR_UNDEFINED, 1: ATTR_NORMAL, 2: ATTR_UNKNOWN, 3: ATTR_CONTROL,
                 4: ATTR_USER_DEFINED, 5: ATTR_UNUSED, 6: ATTR_BYTE}

_K = "tokenizer.ggml."

# auto-detected special tokens by spelling (llama.cpp has no metadata for these in old files)
_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
              "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>",
              "<end_of_utterance>")
_EOM_TEXTS = ("<|eom_id|>",)
_FIM_PAD_TEXTS = ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")
_FIM_REP_TEXTS = ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")
_FIM_SEP_TEXTS = ("<|file_sep|>",)
_FIM_PRE_TEXTS = ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>",
                  "▁<PRE>", "<|code_prefix|>", "<|prefix|>")
_FIM_SUF_TEXTS = ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>",
                  "▁<SUF>", "<|code_suffix|>", "<|suffix|>")
_FIM_MID_TEXTS = ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>",
                  "▁<MID>", "<|code_middle|>", "<|middle|>")
_EOG_TEXTS = frozenset(("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>",
                        "<|flush|>", "<|calls|>", "<end_of_turn>", "<|endoftext|>", "</s>",
                        "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
                        "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
                        "<｜end▁of▁sentence｜>", "[e~["))
_ALWAYS_RENDER = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")


@dataclass
class Vocab:
    model: str                      # "gpt2" (BPE) or "llama" (SPM)
    pre: PreType | None             # BPE pre-tokenizer; None for SPM
    texts: list[str]
    scores: list[float]
    attrs: list[int]
    text_to_id: dict[str, int]
    merges: list[str]
    bos_id: int | None
    eos_id: int | None
    eot_id: int | None
    unk_id: int | None
    pad_id: int | None
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    clean_spaces: bool
    eog_ids: frozenset = field(default_factory=frozenset)
    special_ids: list[int] = field(default_factory=list)   # longest spelling first
    # fill-in-the-middle ids (stored, else found by spelling as llama.cpp does); None where the vocab has none
    fim: dict[str, int | None] = field(default_factory=dict)   # "pre", "suf", "mid", "pad", "rep", "sep"

    @property
    def n_vocab(self) -> int:
        return len(self.texts)


def _get_list(meta: dict, key: str, required: bool) -> list | None:
    value = meta.get(key)
    if value is None:
        if required:
            raise TokenizerError(f"GGUF metadata lacks '{key}'; the tokenizer cannot be built")
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):   # a list, or the reader's StringArray
        raise TokenizerError(f"GGUF metadata '{key}' must be an array, got {type(value).__name__}")
    return list(value)


def _get_id(meta: dict, key: str, default: int | None, n_vocab: int) -> int | None:
    # a default beyond the vocab is dropped; a bad stored id keeps the default (llama.cpp warns)
    if default is not None and default >= n_vocab:
        default = None
    value = meta.get(_K + key)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < n_vocab:
        return default
    return value


def _get_bool(meta: dict, key: str, default: bool) -> bool:
    value = meta.get(_K + key)
    return default if value is None else bool(value)


def load_vocab(meta: dict) -> Vocab:
    model = meta.get(_K + "model")
    if model not in ("gpt2", "llama"):
        raise TokenizerError(f"tokenizer.ggml.model = {model!r} is not supported "
                             f"(supported: 'gpt2' byte-level BPE, 'llama' SPM)")
    # 150,000-entry tables: built with C-level calls (map, zip) where the rule allows, a few ms each
    texts = list(map(str, _get_list(meta, _K + "tokens", True)))
    n_vocab = len(texts)
    if n_vocab == 0:
        raise TokenizerError("tokenizer.ggml.tokens is empty")
    if "" in texts:
        for i, t in enumerate(texts):
            if t == "":
                texts[i] = f"[EMPTY_{i}]"   # llama.cpp renames empty tokens the same way
    types = _get_list(meta, _K + "token_type", False)
    if types is not None and len(types) < n_vocab:
        raise TokenizerError(f"tokenizer.ggml.token_type has {len(types)} entries, "
                             f"fewer than the {n_vocab} tokens")
    scores = _get_list(meta, _K + "scores", False)
    if scores is not None and len(scores) < n_vocab:
        raise TokenizerError(f"tokenizer.ggml.scores has {len(scores)} entries, "
                             f"fewer than the {n_vocab} tokens")
    attrs = [ATTR_NORMAL] * n_vocab if types is None else \
        list(map(_TYPE_TO_ATTR.get, map(int, types[:n_vocab]), repeat(ATTR_UNDEFINED)))
    text_to_id = dict(zip(texts, range(n_vocab)))   # a duplicate spelling keeps the last id

    pre_name = meta.get(_K + "pre")
    if model == "gpt2":
        merges = [str(m) for m in _get_list(meta, _K + "merges", True)]
        pre = pre_type_for(pre_name)
        bos, eos, unk = 11, 11, None
        add_bos, add_space_prefix, clean_spaces = pre.add_bos, False, pre.clean_spaces
        if pre.no_bos:
            bos = None
    else:
        merges, pre = [], None
        bos, eos, unk = 1, 2, 0
        add_bos, add_space_prefix, clean_spaces = True, True, False
    add_space_prefix = _get_bool(meta, "add_space_prefix", add_space_prefix)

    bos = _get_id(meta, "bos_token_id", bos, n_vocab)
    eos = _get_id(meta, "eos_token_id", eos, n_vocab)
    eot = _get_id(meta, "eot_token_id", None, n_vocab)
    eom = _get_id(meta, "eom_token_id", None, n_vocab)
    unk = _get_id(meta, "unknown_token_id", unk, n_vocab)
    pad = _get_id(meta, "padding_token_id", None, n_vocab)
    fim_pad = _get_id(meta, "fim_pad_token_id", None, n_vocab)
    fim_rep = _get_id(meta, "fim_rep_token_id", None, n_vocab)
    fim_sep = _get_id(meta, "fim_sep_token_id", None, n_vocab)
    add_bos = _get_bool(meta, "add_bos_token", add_bos)
    add_eos = _get_bool(meta, "add_eos_token", False)

    def force_control(tid: int) -> None:
        attrs[tid] |= ATTR_CONTROL

    # control-looking tokens: the first spelling found fills a missing id and is made
    # CONTROL (llama.cpp scans its hash map, so with several candidates its pick is
    # unordered; we take the first in our list, which gives its pick on Qwen2.5).
    def detect(current: int | None, spellings) -> int | None:
        found = [text_to_id[s] for s in spellings if s in text_to_id]
        if current is not None or not found:
            return current
        force_control(found[0])
        return found[0]

    eot = detect(eot, _EOT_TEXTS)
    eom = detect(eom, _EOM_TEXTS)
    fim_pad = detect(fim_pad, _FIM_PAD_TEXTS)
    fim_rep = detect(fim_rep, _FIM_REP_TEXTS)
    fim_sep = detect(fim_sep, _FIM_SEP_TEXTS)
    fim = {"pad": fim_pad, "rep": fim_rep, "sep": fim_sep}
    for name, old_key, spellings in (("pre", "prefix_token_id", _FIM_PRE_TEXTS),
                                     ("suf", "suffix_token_id", _FIM_SUF_TEXTS),
                                     ("mid", "middle_token_id", _FIM_MID_TEXTS)):
        stored = _get_id(meta, old_key, _get_id(meta, f"fim_{name}_token_id", None, n_vocab), n_vocab)
        fim[name] = detect(stored, spellings)
    for tid, t in enumerate(texts):   # control tokens named "unused" are unused
        if attrs[tid] & ATTR_CONTROL and "unused" in t:
            attrs[tid] |= ATTR_UNUSED

    eog = {t for t in (fim_pad, fim_rep, fim_sep) if t is not None}
    for s in _EOG_TEXTS:
        tid = text_to_id.get(s)
        if tid is not None:
            eog.add(tid)
            force_control(tid)
    for s in _ALWAYS_RENDER:
        if s in text_to_id:
            attrs[text_to_id[s]] = ATTR_USER_DEFINED
    eog.update(t for t in (eos, eot, eom) if t is not None)
    _drop_false_eogs(eog, texts, attrs)

    if "phi-3" in str(meta.get("general.name", "")).lower() or \
            "phi3" in str(meta.get("general.name", "")).lower():
        _phi3_rstrip(attrs, text_to_id)

    specials = [i for i, a in enumerate(attrs) if a & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN)]
    specials.sort(key=lambda i: -len(texts[i].encode("utf-8")))
    return Vocab(model=model, pre=pre, texts=texts,
                 scores=[float(s) for s in scores[:n_vocab]] if scores is not None else [0.0] * n_vocab,
                 attrs=attrs, text_to_id=text_to_id, merges=merges, bos_id=bos, eos_id=eos,
                 eot_id=eot, unk_id=unk, pad_id=pad, add_bos=add_bos, add_eos=add_eos,
                 add_space_prefix=add_space_prefix, clean_spaces=clean_spaces,
                 eog_ids=frozenset(eog), special_ids=specials, fim=fim)


def _drop_false_eogs(eog: set, texts: list[str], attrs: list[int]) -> None:
    # o200k_harmony / solar-open: "<|end|>" ends a message, not the generation
    by_text = {texts[t]: t for t in eog}
    if "<|end|>" in by_text and (("<|return|>" in by_text and "<|call|>" in by_text) or
                                 ("<|calls|>" in by_text and "<|flush|>" in by_text)):
        end_id = by_text["<|end|>"]
        eog.discard(end_id)
        attrs[end_id] = ATTR_USER_DEFINED
    # gemma4 / plamo: "</s>" is a normal token there
    if "</s>" in by_text and ("<|tool_response>" in by_text or "<|plamo:eos|>" in by_text):
        s_id = by_text["</s>"]
        eog.discard(s_id)
        attrs[s_id] = ATTR_NORMAL


def _phi3_rstrip(attrs: list[int], text_to_id: dict[str, int]) -> None:
    for tid, a in enumerate(attrs):
        if a & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN):
            attrs[tid] |= ATTR_RSTRIP
    if "</s>" in text_to_id:
        attrs[text_to_id["</s>"]] |= ATTR_RSTRIP
    for s in ("<unk>", "<s>", "<|endoftext|>"):
        if s in text_to_id:
            attrs[text_to_id[s]] &= ~ATTR_RSTRIP


__all__ = ["Vocab", "load_vocab", "TokenizerError", "PRE_TYPES"]
