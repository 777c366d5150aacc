"""tools/make_synthetic.py: names and shapes as llama.cpp loads them, value statistics, refusals."""
from __future__ import annotations

import hashlib
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


def values(g, name: str, n_rows: int | None = None) -> np.ndarray:
    """A tensor's values, flat (its first n_rows rows only, if given)."""
    info = g.tensors[name]
    raw = g.tensor_data(name)
    if n_rows is not None:
        raw = raw[:n_rows * info.n_bytes // int(np.prod(info.shape[1:]))]
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
    ("q5_k_m", {"token_embd": "Q5_K", "output": "Q6_K", "attn_q": "Q5_K", "attn_v": "Q6_K",
                "ffn_down_exps": "Q6_K", "ffn_up_exps": "Q5_K", "ffn_gate_inp": "F32"}),
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
    ({"mode": "blocks", "mix": "q5_k_m", "n_embd": 64}, "--mix q5_k_m: rows of 64 are not a multiple of 256"),
    ({"mode": "blocks", "mix": "q3_k_m"}, "q4_k_m|q5_k_m|q8_0"),
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


@pytest.mark.real_model
@pytest.mark.parametrize("kw,digest", [
    (dict(arch="qwen3moe", mode="blocks", n_embd=256, n_ff_exp=256, n_expert=8, n_expert_used=2, seed=5),
     "2f6cc1037b3f8e2dd3f303f9661de398396ed473f00844211985e609a834e81f"),
    (dict(arch="qwen3moe", n_expert=8, seed=5), "c19db1a982f151ce32c3786b45d66fdd26051b39c13bc3ebeb398414e2166fd9"),
])
def test_files_without_new_options_keep_their_bytes(tmp_path, tok_source, kw, digest):
    """The bytes written before --router-skew and --shape existed (sha256 taken then), kept."""
    path = ms.write_synthetic(tmp_path / "d.gguf", tokenizer_from=tok_source, **kw)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == digest


def test_shape_preset_sets_every_key_and_flags_override(monkeypatch, capsys):
    seen = {}
    monkeypatch.setattr(ms, "write_synthetic", lambda out, **kw: seen.update(kw, out=out) or out)
    ms.main(["--shape", "qwen3-30b-a3b", "--n-layer", "4", "--router-skew", "0.6", "-o", "x.gguf"])
    arch, shape = ms.PRESETS["qwen3-30b-a3b"]
    assert seen == {**shape, "n_layer": 4, "arch": "qwen3moe", "router_skew": 0.6, "tokenizer_from": None,
                    "out": "x.gguf"}
    assert shape["n_embd"] == 2048 and shape["n_expert"] == 128 and shape["mix"] == "q4_k_m"
    seen.clear()
    ms.main(["--n-layer", "3", "-o", "y.gguf"])                # no preset: only the flags given
    assert seen == {"n_layer": 3, "arch": "qwen2", "router_skew": None, "tokenizer_from": None, "out": "y.gguf"}
    bench_cuda = load_tool("bench_cuda")
    assert bench_cuda.SHAPE == shape                            # one definition of the card benchmark's file


def routed_counts(path: Path, n_tokens: int = 256) -> np.ndarray:
    """Per layer, how often each expert was picked over a prompt of random ids: the numpy engine
    runs the file, its router top-k (ops.moe_route) counted, one call per layer in order."""
    from bloomery.engine.loader import load_model
    from bloomery.placement import whole
    model = load_model(str(path), whole("numpy", n_ctx_slot=n_tokens))
    counts = np.zeros((model.n_layer, model.moe.n_expert), np.int64)
    calls = [0]
    route = model.ops.moe_route

    def counted(logits, n_used, norm_weights):
        ids, w = route(logits, n_used, norm_weights)
        np.add.at(counts[calls[0] % model.n_layer], np.asarray(ids).reshape(-1), 1)
        calls[0] += 1
        return ids, w
    model.ops.moe_route = counted
    model.forward_all(0, np.random.default_rng(0).integers(100, 150000, n_tokens), 0)
    assert calls[0] == model.n_layer
    return counts


SKEW_SHAPE = dict(arch="qwen3moe", mode="blocks", n_layer=4, n_embd=256, n_head=4, n_head_kv=2, head_dim=64,
                  n_expert=32, n_expert_used=4, n_ff_exp=64, seed=1)


@pytest.mark.slow
@pytest.mark.real_model
def test_router_skew_is_the_running_models_routing(synthetic_dir, tok_source):
    """Run on the numpy engine, a file written with --router-skew 0.6 routes with the top fifth of
    each layer's experts taking ~0.6 of the picks, one written with 0.2 evenly; both keep the
    default file's tensors, types and sizes (the same cost to run)."""
    from bloomery.routing_skew import routing_skew, top_share
    skewed = make(synthetic_dir, tok_source, "skew06", router_skew=0.6, **SKEW_SHAPE)
    even = make(synthetic_dir, tok_source, "skew02", router_skew=0.2, **SKEW_SHAPE)
    plain = make(synthetic_dir, tok_source, "skew_none", **SKEW_SHAPE)
    c = routed_counts(skewed)
    assert 0.5 <= routing_skew(c) <= 0.7 and all(0.45 <= top_share(row) <= 0.75 for row in c), c
    assert routing_skew(routed_counts(even)) < 0.35
    infos = []
    for path in (skewed, even, plain):
        with open_gguf(str(path)) as g:
            infos.append({n: (t.type_name, t.shape, t.n_bytes) for n, t in g.tensors.items()})
    assert infos[0] == infos[1] == infos[2]
    assert skewed.stat().st_size == plain.stat().st_size


@pytest.mark.real_model
@pytest.mark.parametrize("mode", ["blocks", pytest.param("float", marks=pytest.mark.slow)])
def test_router_skew_channel_is_constant_and_unread(synthetic_dir, tok_source, mode):
    """The embedding's first 32 coordinates hold one constant in every row; no matrix but the
    routers reads them, none writes them; routers of a 0.6 file read them, of a 0.2 file not."""
    shape = {**SKEW_SHAPE, "n_layer": 2, "mode": mode}
    for share in (0.6, 0.2):
        g = open_gguf(str(make(synthetic_dir, tok_source, f"chan_{mode}_{share}", router_skew=share, **shape)))
        c, d = ms.SKEW_CHANNEL, shape["n_embd"]
        emb = values(g, "token_embd.weight", 4096).reshape(-1, d)
        assert np.all(emb[:, :c] == emb[0, 0]) and emb[0, 0] > 0
        assert abs(emb[:, c:].std() / ms.SKEW_EMBD_STD - 1) < 0.1
        for name in g.tensors:
            if name.endswith(ms.SKEW_READERS) or name == "output.weight":
                v = values(g, name, 4096).reshape(-1, g.tensors[name].shape[0])
                assert not v[:, :c].any() and v[:, c:].any(), name
            elif name.endswith(ms.SKEW_WRITERS):
                v = values(g, name).reshape(-1, d, g.tensors[name].shape[0])
                assert not v[:, :c].any() and v[:, c:].any(), name
        router = values(g, "blk.1.ffn_gate_inp.weight").reshape(-1, d)        # [E, D]
        assert router[:, :c].any() == (share > 0.2)
        assert abs(router[:, c:].std() * np.sqrt(d) - 1) < 0.1


@pytest.mark.real_model
@pytest.mark.parametrize("kw,words", [
    ({"arch": "qwen3"}, "--router-skew needs --arch qwen3moe"),
    ({"arch": "qwen3moe", "router_skew": 0.1}, "--router-skew 0.1: the top fifth's share must be in [0.20, 1)"),
    ({"arch": "qwen3moe", "router_skew": 1.0}, "must be in [0.20, 1)"),
    ({"arch": "qwen3moe", "n_expert": 4, "n_expert_used": 2}, "4 experts, 2 used a token, reach at most 0.40"),
    ({"arch": "qwen3moe", "n_embd": 32, "n_head": 2, "n_head_kv": 1}, "--router-skew needs --n-embd >= 64"),
    ({"arch": "qwen3moe", "mode": "blocks", "mix": "q5_k_m"}, "--router-skew writes q4_k_m or q8_0 blocks"),
])
def test_router_skew_refusals(tmp_path, tok_source, kw, words):
    with pytest.raises(ms.ShapeError) as e:
        ms.write_synthetic(tmp_path / "x.gguf", tokenizer_from=tok_source, **{"router_skew": 0.6, **kw})
    assert words in str(e.value)
    assert not (tmp_path / "x.gguf").exists()


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


@pytest.mark.slow
def test_float_twin_holds_the_dequantized_tensors_and_the_same_keys(synthetic_dir, tok_source, tmp_path):
    """write_float_twin: every tensor F32 and equal to gguf-py's dequantize of the original, the keys the same
    (the file type all-F32), and the numpy backend reads it as the same model (logits near the original's)."""
    from bloomery.engine.loader import load_model
    from bloomery.placement import whole
    src = make(synthetic_dir, tok_source, "twin_src", arch="qwen35moe", mode="blocks", mix="q4_k_m", n_layer=2,
               n_embd=128, n_head=2, n_head_kv=1, head_dim=64, n_expert=4, n_expert_used=2, n_ff_exp=128,
               n_ff_shexp=128, full_attn_interval=2, ssm_d_state=32, ssm_n_group=1, ssm_dt_rank=2)
    twin = ms.write_float_twin(src, tmp_path / "twin.gguf")
    a, b = gguf.GGUFReader(str(src)), gguf.GGUFReader(str(twin))
    assert {t.name for t in a.tensors} == {t.name for t in b.tensors}
    got = {t.name: t for t in b.tensors}
    for t in a.tensors:
        u = got[t.name]
        assert u.tensor_type == Q.F32 and list(u.shape) == list(t.shape)
        np.testing.assert_array_equal(np.asarray(u.data).reshape(-1),
                                      gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(-1))
    keys = lambda r: {k: r.fields[k].contents() for k in r.fields if not k.startswith("GGUF.")}  # noqa: E731
    ka, kb = keys(a), keys(b)
    assert kb.pop("general.file_type") == 0 and ka.pop("general.file_type") == 15 and ka == kb
    models = [load_model(str(p), whole("numpy", n_slots=1, n_ctx_slot=64)) for p in (src, twin)]
    la, lb = (m.prefill(0, np.arange(100, 120, dtype=np.int32), 0) for m in models)
    assert 0 < np.abs(la - lb).max() < 0.5 * np.abs(la).max()
