"""The model facts /v1/models and /props report, read from the GGUF header as llama.cpp reads them.

The plan stage computes these (it has the header open) and hands them to the
engine stage in its facts, which puts them into ModelInfo; nothing here reads
tensor data.
"""
from __future__ import annotations

# llama_ftype_name: general.file_type -> the name llama-server reports as model_ftype / meta.ftype
FTYPE_NAMES = {
    0: "all F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1",
    10: "Q2_K - Medium", 11: "Q3_K - Small", 12: "Q3_K - Medium", 13: "Q3_K - Large",
    14: "Q4_K - Small", 15: "Q4_K - Medium", 16: "Q5_K - Small", 17: "Q5_K - Medium", 18: "Q6_K",
    19: "IQ2_XXS - 2.0625 bpw", 20: "IQ2_XS - 2.3125 bpw", 21: "Q2_K - Small", 22: "IQ3_XS - 3.3 bpw",
    23: "IQ3_XXS - 3.0625 bpw", 24: "IQ1_S - 1.5625 bpw", 25: "IQ4_NL - 4.5 bpw", 26: "IQ3_S - 3.4375 bpw",
    27: "IQ3_S mix - 3.66 bpw", 28: "IQ2_S - 2.5 bpw", 29: "IQ2_M - 2.7 bpw", 30: "IQ4_XS - 4.25 bpw",
    31: "IQ1_M - 1.75 bpw", 32: "BF16", 36: "TQ1_0 - 1.69 bpw ternary", 37: "TQ2_0 - 2.06 bpw ternary",
    38: "MXFP4 MoE",
}
FTYPE_GUESSED = 1024          # llama.cpp's flag for a file type it guessed (no general.file_type)
# a tensor type -> the file type llama.cpp guesses when that type holds the most tensors
GUESS_FROM_TYPE = {"F32": 0, "F16": 1, "BF16": 32, "Q4_0": 2, "Q4_1": 3, "Q5_0": 8, "Q5_1": 9, "Q8_0": 7,
                   "Q2_K": 10, "Q3_K": 12, "Q4_K": 15, "Q5_K": 17, "Q6_K": 18}
# tokenizer.ggml.model -> llama_vocab_type (include/llama.h)
VOCAB_TYPES = {"no_vocab": 0, "none": 0, "llama": 1, "gpt2": 2, "hybriddna": 2, "whitespace": 2, "gemma4": 2,
               "bert": 3, "t5": 4, "rwkv": 5, "plamo2": 6}


def ftype_name(file_type: object, tensor_types: list[str]) -> str:
    """llama_ftype_name of general.file_type; without it, llama.cpp's guess: the type that first
    reaches the highest tensor count (file order), with its "(guessed) " prefix."""
    if isinstance(file_type, int) and not isinstance(file_type, bool):
        name = FTYPE_NAMES.get(file_type & ~FTYPE_GUESSED, "unknown, may not work")
        return f"(guessed) {name}" if file_type & FTYPE_GUESSED else name
    counts: dict[str, int] = {}
    most, n_most = "F32", 0
    for t in tensor_types:
        counts[t] = counts.get(t, 0) + 1
        if counts[t] > n_most:
            most, n_most = t, counts[t]
    return "(guessed) " + FTYPE_NAMES[GUESS_FROM_TYPE.get(most, 0)]   # an unknown type: llama.cpp says all F32


def model_meta(gf) -> dict[str, object]:
    """n_embd, vocab_type, ftype, n_params, size_bytes of an open GGUFFile (header only)."""
    md = gf.metadata
    arch = gf.arch()
    n_embd = md.get(f"{arch}.embedding_length", 0)
    n_params, size_bytes = 0, 0
    for t in gf.tensors.values():
        n = 1
        for d in t.shape:
            n *= d
        n_params += n
        size_bytes += t.n_bytes
    return {"n_embd": int(n_embd) if isinstance(n_embd, int) else 0,
            "vocab_type": VOCAB_TYPES.get(str(md.get("tokenizer.ggml.model", "none")), 0),
            "ftype": ftype_name(md.get("general.file_type"), [t.type_name for t in gf.tensors.values()]),
            "n_params": n_params, "size_bytes": size_bytes}
