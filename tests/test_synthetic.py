"""tools/make_synthetic.py: names and shapes as llama.cpp loads them, value statistics, refusals."""
from __future__ import annotations

import os
import subprocess
import tracemalloc
from pathlib import Path

import gguf
import numpy as np
import pytest
from conftest import load_tool

from bloomery.gguf_file import open_gguf

ms = load_tool("make_synthetic")
Q = gguf.GGMLQuantizationType
ARCHS = ("qwen2", "qwen3", "qwen3moe")


@pytest.fixture(scope="module")
def tok_source(real_model_path) -> str:
    return str(real_model_path)


def make(synthetic_dir: Path, tok_source: str, name: str, **kw) -> Path:
    path = synthetic_dir / f"{name}.gguf"
    if not path.exists():
        ms.write_synthetic(path, tokenizer_from=tok_source, **kw)
    return path


def values(g, name: str) -> np.ndarray:
    info = g.tensors[name]
    raw = g.tensor_data(name)
    if info.type_name == "F32":
        return raw.view(np.float32)
    if info.type_name == "F16":
        return raw.view(np.float16).astype(np.float32)
    block, type_size = gguf.GGML_QUANT_SIZES[Q(info.ggml_type)]
    return gguf.quants.dequantize(raw.reshape(-1, type_size), Q(info.ggml_type)).reshape(-1)


@pytest.mark.real_model
def test_qwen3moe_names_shapes_and_keys(synthetic_dir, tok_source):
    g = open_gguf(str(make(synthetic_dir, tok_source, "moe_f32", arch="qwen3moe", n_layer=2, n_embd=64,
                           n_head=4, n_head_kv=2, head_dim=32, n_expert=8, n_expert_used=2, n_ff_exp=96)))
    layer0 = {k[6:]: v.shape for k, v in g.tensors.items() if k.startswith("blk.0.")}
    assert layer0 == {  # ne order; q is head_dim * n_head = 128 wide, apart from n_embd
        "attn_norm.weight": (64,), "attn_q.weight": (64, 128), "attn_k.weight": (64, 64),
        "attn_v.weight": (64, 64), "attn_output.weight": (128, 64), "attn_q_norm.weight": (32,),
        "attn_k_norm.weight": (32,), "ffn_norm.weight": (64,), "ffn_gate_inp.weight": (64, 8),
        "ffn_gate_exps.weight": (64, 96, 8), "ffn_up_exps.weight": (64, 96, 8),
        "ffn_down_exps.weight": (96, 64, 8)}
    assert g.tensors["token_embd.weight"].shape == (64, 151936) == g.tensors["output.weight"].shape
    assert len(g.tensors) == 3 + 2 * 12
    assert {k: g.get(k) for k in ("qwen3moe.block_count", "qwen3moe.expert_count", "qwen3moe.expert_used_count",
                                   "qwen3moe.expert_feed_forward_length", "qwen3moe.attention.key_length",
                                   "qwen3moe.attention.head_count_kv", "general.file_type")} == {
        "qwen3moe.block_count": 2, "qwen3moe.expert_count": 8, "qwen3moe.expert_used_count": 2,
        "qwen3moe.expert_feed_forward_length": 96, "qwen3moe.attention.key_length": 32,
        "qwen3moe.attention.head_count_kv": 2, "general.file_type": 0}
    real = open_gguf(tok_source)
    tok_keys = [k for k in real.metadata if k.startswith("tokenizer.")]
    assert "tokenizer.chat_template" in tok_keys and "tokenizer.ggml.merges" in tok_keys
    for k in tok_keys:
        assert (g.get(k), g.value_types[k]) == (real.get(k), real.value_types[k]), k


@pytest.mark.real_model
@pytest.mark.parametrize("arch", ARCHS)
def test_float_mode_statistics(synthetic_dir, tok_source, arch):
    g = open_gguf(str(make(synthetic_dir, tok_source, f"{arch}_f16", arch=arch, mode="float", ftype="f16",
                           n_embd=64, n_ff=256, n_ff_exp=256, seed=3)))
    assert g.arch() == arch
    has = {n.split(".")[2] for n in g.tensors if n.startswith("blk.1.")}
    assert ("attn_q" in has and {"attn_q_norm", "attn_k_norm"} <= has) == (arch != "qwen2")
    assert ("blk.0.attn_q.bias" in g.tensors) == (arch == "qwen2")
    assert ("ffn_gate_exps" in has) == (arch == "qwen3moe")
    for name, info in g.tensors.items():
        v = values(g, name)
        if name.endswith("norm.weight"):
            assert info.type_name == "F32" and abs(v.mean() - 1) < 0.05, name
        elif name.endswith(".bias"):
            assert info.type_name == "F32" and abs(v.std() - 0.1) < 0.03, name
        else:
            want = 1 / np.sqrt(info.shape[0])
            assert abs(v.std() / want - 1) < 0.1 and abs(v.mean()) < 0.1 * want, (name, v.std(), want)


@pytest.mark.real_model
@pytest.mark.parametrize("mix,types", [
    ("q4_k_m", {"token_embd": "Q4_K", "output": "Q6_K", "attn_q": "Q4_K", "attn_v": "Q6_K",
                "ffn_down_exps": "Q6_K", "ffn_up_exps": "Q4_K", "ffn_gate_inp": "F32"}),
    ("q8_0", {"token_embd": "Q8_0", "output": "Q8_0", "attn_v": "Q8_0", "ffn_down_exps": "Q8_0"}),
])
def test_blocks_mode_types_and_statistics(synthetic_dir, tok_source, mix, types):
    g = open_gguf(str(make(synthetic_dir, tok_source, f"moe_{mix}", arch="qwen3moe", mode="blocks", mix=mix,
                           n_embd=256, n_head=4, n_head_kv=2, n_ff_exp=256, n_expert=4, seed=1)))
    got = {n.split(".")[-2] if n.startswith("blk.") else n.split(".")[0]: t.type_name
           for n, t in g.tensors.items() if n.startswith(("blk.0.", "token_embd", "output."))}
    assert {k: got[k] for k in types} == types
    for name, info in g.tensors.items():
        if info.type_name != "F32":
            v = values(g, name)                 # gguf's own dequantizer reads our blocks
            want = 1 / np.sqrt(info.shape[0])
            assert abs(v.std() / want - 1) < 0.1 and abs(v.mean()) < 0.1 * want, (name, v.std(), want)


@pytest.mark.real_model
def test_blocks_rows_not_multiple_of_256_fall_back_like_llama_quantize(synthetic_dir, tok_source):
    g = open_gguf(str(make(synthetic_dir, tok_source, "q2_small", arch="qwen2", mode="blocks",
                           n_embd=64, n_ff=256)))
    t = {n: i.type_name for n, i in g.tensors.items()}
    assert (t["token_embd.weight"], t["output.weight"]) == ("Q5_0", "Q8_0")     # rows of 64
    assert (t["blk.0.attn_q.weight"], t["blk.0.attn_v.weight"]) == ("Q5_0", "Q8_0")
    assert t["blk.0.ffn_down.weight"] == "Q6_K"                                 # rows of n_ff 256
    assert g.get("general.file_type") == 15
    for name in ("token_embd.weight", "output.weight", "blk.0.ffn_down.weight"):
        assert abs(values(g, name).std() * np.sqrt(g.tensors[name].shape[0]) - 1) < 0.1


@pytest.mark.real_model
def test_seed_decides_the_bytes(synthetic_dir, tok_source):
    a = make(synthetic_dir, tok_source, "seed_a", mode="blocks", seed=7).read_bytes()
    assert make(synthetic_dir, tok_source, "seed_b", mode="blocks", seed=7).read_bytes() == a
    assert make(synthetic_dir, tok_source, "seed_c", mode="blocks", seed=8).read_bytes() != a


@pytest.mark.real_model
def test_blocks_mode_streams_tensor_by_tensor(tmp_path, tok_source):
    shape = dict(arch="qwen3moe", mode="blocks", n_layer=6, n_embd=256, n_expert=32, n_ff_exp=512)
    ms.tokenizer_keys(tok_source)                  # the cached tokenizer is not the model
    tracemalloc.start()
    path = ms.write_synthetic(tmp_path / "big.gguf", tokenizer_from=tok_source, **shape)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    with open_gguf(str(path)) as g:
        largest = max(t.n_bytes for t in g.tensors.values())
        total = sum(t.n_bytes for t in g.tensors.values())
    assert total > 3 * largest and peak < 2.5 * largest, (peak, largest, total)


@pytest.mark.real_model
@pytest.mark.parametrize("kw,words", [
    ({"vocab": "1000"}, "--vocab '1000'"),
    ({"n_head": 6, "n_head_kv": 4}, "--n-head 6 must be a multiple of --n-head-kv 4"),
    ({"head_dim": 32}, "--head-dim 32: qwen2 takes n_embd / n_head = 16"),
    ({"n_layer": 0}, "--n-layer 0 must be an integer >= 1"),
    ({"mode": "blocks", "n_ff": 100}, "--n-ff = 100: blocks mode needs rows that are a multiple of 32"),
    ({"arch": "qwen3moe", "n_expert_used": 9, "n_expert": 8}, "--n-expert-used 9 must be 1..--n-expert 8"),
    ({"arch": "llama"}, "--arch 'llama' must be one of"),
    ({"n_experts": 3}, "unknown shape keys ['n_experts']"),
])
def test_bad_shapes_are_refused_by_name(tmp_path, tok_source, kw, words):
    with pytest.raises(ms.ShapeError) as e:
        ms.write_synthetic(tmp_path / "x.gguf", tokenizer_from=tok_source, **kw)
    assert words in str(e.value)
    assert not (tmp_path / "x.gguf").exists()


@pytest.mark.real_model
def test_command_line(tmp_path, tok_source, capsys):
    out = tmp_path / "cli.gguf"
    ms.main(["--arch", "qwen3", "--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--n-head-kv", "1",
             "--head-dim", "24", "--ftype", "f16", "--tokenizer-from", tok_source, "-o", str(out)])
    assert capsys.readouterr().out.strip() == str(out)
    g = open_gguf(str(out))
    assert g.tensors["blk.0.attn_q.weight"].shape == (32, 48) and g.tensors["blk.0.attn_q.weight"].type_name == "F16"
    with pytest.raises(SystemExit):
        ms.main(["--n-head", "3", "--n-head-kv", "2", "--tokenizer-from", tok_source, "-o", str(tmp_path / "y.gguf")])
    assert "--n-head 3 must be a multiple of --n-head-kv 2" in capsys.readouterr().err


# --- llama.cpp loads what we write (opt-in: BLOOMERY_LIVE_REF=1) ---------------------

def llama_bin() -> Path:
    root = os.environ.get("BLOOMERY_REF_DIR") or Path(os.environ.get("BLOOMERY_CACHE", Path.home() / ".cache/bloomery")) / "ref"
    path = Path(root) / "build-cpu-11434.0.0" / "bin"
    if not (path / "llama-eval-callback").exists():
        pytest.skip(f"llama.cpp not built at {path} (tools/ref/build-llama.sh)")
    return path


@pytest.mark.live_reference
@pytest.mark.real_model
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode", ["float", "blocks"])
def test_llama_cpp_runs_synthetic(synthetic_dir, tok_source, arch, mode):
    path = make(synthetic_dir, tok_source, f"live_{arch}_{mode}", arch=arch, mode=mode, n_embd=256,
                n_ff=512, n_ff_exp=256)
    r = subprocess.run([str(llama_bin() / "llama-eval-callback"), "-m", str(path), "-p", "hello world",
                        "-n", "1", "-t", "2"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    log = r.stdout + r.stderr
    assert "result_output" in log and " nan" not in log.lower()


@pytest.mark.live_reference
@pytest.mark.real_model
def test_llama_quantize_takes_a_float_file(synthetic_dir, tok_source, tmp_path):
    src = make(synthetic_dir, tok_source, "live_quant_src", arch="qwen3", mode="float", n_embd=256, n_ff=512)
    out = tmp_path / "q4km.gguf"
    r = subprocess.run([str(llama_bin() / "llama-quantize"), str(src), str(out), "Q4_K_M", "2"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    g = open_gguf(str(out))
    assert g.get("general.file_type") == 15
    assert g.tensors["blk.0.attn_q.weight"].type_name in ("Q4_K", "Q5_K", "Q6_K")
