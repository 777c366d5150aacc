"""bloomery/header_check.py: a GGUF header is checked, hyperparameters and tensors, before the plan allocates."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest

from bloomery.header_check import HeaderError, check_header, expected_tensors, hyperparameters


@dataclass(frozen=True)
class Info:
    name: str
    ggml_type: int
    shape: tuple[int, ...]


def header(arch: str = "qwen2", **over):
    md = {"general.architecture": arch, f"{arch}.block_count": 2, f"{arch}.embedding_length": 64,
          f"{arch}.attention.head_count": 4, f"{arch}.attention.head_count_kv": 2, f"{arch}.context_length": 4096,
          f"{arch}.attention.layer_norm_rms_epsilon": 1e-6, f"{arch}.rope.freq_base": 1e6,
          f"{arch}.feed_forward_length": 128, f"{arch}.vocab_size": 512, "general.name": "tiny"}
    if arch == "qwen3moe":
        md |= {f"{arch}.expert_count": 4, f"{arch}.expert_used_count": 2, f"{arch}.expert_feed_forward_length": 64}
    md |= over
    hp = hyperparameters("f", arch, md, {})
    tensors = {n: Info(n, 0 if len(s) == 1 else 8, s) for n, s, opt in expected_tensors(arch, hp)}   # F32 / Q8_0
    return md, tensors


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "qwen3moe"])
def test_a_sound_header_passes(arch):
    md, tensors = header(arch)
    check_header("f", md, tensors)
    assert "blk.1.ffn_down.weight" in tensors or "blk.1.ffn_down_exps.weight" in tensors


def refused(md, tensors, *words):
    with pytest.raises(HeaderError) as e:
        check_header("f", md, tensors)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_block_count_out_of_range_is_refused_before_anything_is_sized():
    md, tensors = header()
    refused({**md, "qwen2.block_count": 2**32 - 1}, tensors, "qwen2.block_count", "4294967295", "1..512")
    refused({**md, "qwen2.block_count": 0}, tensors, "block_count")


@pytest.mark.parametrize("key", ["qwen2.attention.layer_norm_rms_epsilon", "qwen2.rope.freq_base"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -1.0, 0.0])
def test_non_finite_or_out_of_range_floats_are_refused(key, value):
    md, tensors = header()
    refused({**md, key: value}, tensors, key)


def test_a_missing_tensor_is_named():
    md, tensors = header()
    del tensors["blk.1.attn_k.weight"]
    refused(md, tensors, "blk.1.attn_k.weight", "missing")
    md, tensors = header()
    del tensors["blk.0.attn_q.bias"]          # optional in qwen2's declaration
    check_header("f", md, tensors)


def test_a_wrong_shape_or_type_is_named():
    md, tensors = header()
    t = tensors["blk.0.ffn_up.weight"]
    refused(md, {**tensors, t.name: replace(t, shape=(64, 129))}, "blk.0.ffn_up.weight", "[64, 129]", "[64, 128]")
    refused(md, {**tensors, t.name: replace(t, ggml_type=12)}, "blk.0.ffn_up.weight", "block size 256")   # Q4_K
    refused(md, {**tensors, t.name: replace(t, ggml_type=99)}, "ggml type 99")
    n = tensors["output_norm.weight"]
    refused(md, {**tensors, n.name: replace(n, ggml_type=8)}, "output_norm.weight", "norm or bias")


def test_heads_and_experts_out_of_range():
    md, tensors = header()
    refused({**md, "qwen2.attention.head_count_kv": 3}, tensors, "multiple")
    refused({**md, "qwen2.attention.head_count_kv": 0}, tensors, "head_count_kv")
    md, tensors = header("qwen3moe")
    refused({**md, "qwen3moe.expert_used_count": 5}, tensors, "expert_used_count")


def test_strings_that_are_not_utf8_are_named():
    md, tensors = header()
    refused({**md, "general.name": "bad\udcff"}, tensors, "general.name", "0xff", "UTF-8")
    refused({**md, "tokenizer.ggml.tokens": ["a", "b\udcfe"] + ["x"] * 510}, tensors, "tokenizer.ggml.tokens'[1]")
