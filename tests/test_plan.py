"""Plan arithmetic with hand-computed numbers for the real model's header.

Qwen2.5-Coder-0.5B (qwen2): 24 layers, n_embd 896, 14 heads, 2 KV heads of 64,
n_ff 4864, vocab 151936, trained context 32768; tensor bytes 485,452,288.
K+V per position over all layers: 24 * 2 * (64 + 64) = 6144 elements.
numpy host need at n_ctx_slot S (1 slot), with the 256 MiB reserve (these hand-made facts
list no tensors, so no decoded forms are counted; test_numpy_counts_its_decoded_forms does):
  weights 485,452,288 + reserve 268,435,456 + kv 6144*2*S (f16, as kv_cache.py allocates it)
  + scratch 41,900,032 (plan._numpy_scratch: the peak is the dense FFN's down projection of a
  512-row pass, 5 [T, D] float32 rows and, per [T, F] element, gate, up and SwiGLU in float32
  plus the SwiGLU's q8_K codes: 512*896*4*5 + 512*4864*(12 + 1.140625); the attention's moment,
  13,631,488 + 520 * S, passes it only past S = 54,364)
  + RoPE's cos and sin table 256 * S (32 pairs of f32 per position seen, kept: cpu/backend.rope_table)
  = 795,787,776 + 12,544 * S
"""
from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest

from bloomery import plan as plan_mod
from bloomery.census import cgroup_limit_bytes, take_census
from bloomery.gguf_file import open_gguf
from bloomery.placement import gib
from bloomery.plan import Census, ModelFacts, PlanError, make_plan, model_facts

QWEN25 = ModelFacts(
    arch="qwen2", n_layer=24, n_ctx_train=32768, n_embd=896, n_head=14, n_head_kv=(2,) * 24,
    head_dim_k=64, head_dim_v=64, n_ff=4864, n_vocab=151936,
    tensor_bytes={"F32": 286208, "Q4_K": 29417472, "Q5_0": 266742784, "Q6_K": 42900480, "Q8_0": 146105344},
    n_weights=630167424, max_tensor_elems=136134656)
WEIGHTS = 485_452_288
BIG = Census(host_avail_bytes=10**12)


@pytest.fixture(autouse=True)
def compiled_attention(monkeypatch):
    """The hand numbers are the compiled kernels' (a machine without a C compiler runs the numpy attention,
    whose scores the plan counts too: test_numpy_scratch_without_the_compiled_attention)."""
    monkeypatch.setattr(plan_mod, "_compiled_attention", lambda head_dim: True)
    monkeypatch.setattr(plan_mod, "_compiled_products", lambda: True)


def host_need(slot: int, n_slots: int = 1) -> int:     # the docstring's formula, any slot count
    return WEIGHTS + 268_435_456 + 6144 * 2 * slot * n_slots + 256 * slot + 41_900_032


@pytest.mark.real_model
def test_facts_from_the_real_header(real_model_path):
    with open_gguf(str(real_model_path)) as g:
        assert model_facts(g) == QWEN25


def test_set_context_one_slot():
    p = make_plan(QWEN25, BIG, ctx_size=4096)
    assert (p.n_ctx, p.n_ctx_slot, p.n_slots, p.ctx_rule) == (4096, 4096, 1, "set")
    assert p.weights_bytes == WEIGHTS == sum(p.tensor_bytes.values())
    assert p.kv_bytes == 51_380_224                       # 4096 * 6144 * 2 + RoPE's 4096 * 256
    assert p.scratch_bytes == 41_900_032                  # 512*896*4*5 + 512*4864*(12 + 1.140625)
    assert p.host_bytes == 847_168_000 == host_need(4096)
    assert p.card_bytes == ()


def test_slots_share_a_set_context_like_llama_server():
    p = make_plan(QWEN25, BIG, ctx_size=8192, n_parallel=4)
    assert (p.n_ctx, p.n_ctx_slot, p.n_slots) == (8192, 2048, 4)
    assert p.kv_bytes == 8192 * 6144 * 2 + 2048 * 256       # RoPE's table: the slots share positions
    # llama.cpp pads n_ctx to 256 and each slot's share to 256: 4096/3 = 1365 -> 1536
    p = make_plan(QWEN25, BIG, ctx_size=4096, n_parallel=3)
    assert (p.n_ctx, p.n_ctx_slot) == (4608, 1536)
    assert make_plan(QWEN25, BIG, ctx_size=1000).n_ctx_slot == 1024
    p = make_plan(QWEN25, BIG, slot_ctx=32768, n_parallel=4)
    assert (p.n_ctx, p.n_ctx_slot, p.ctx_rule) == (131072, 32768, "set")


def test_default_context_is_the_trained_limit_per_slot():
    p = make_plan(QWEN25, Census(host_need(32768)))        # exactly enough
    assert (p.n_ctx_slot, p.ctx_rule, p.host_bytes) == (32768, "target", 1_206_829_568)
    p = make_plan(QWEN25, BIG, n_parallel=2)
    assert (p.n_ctx, p.n_ctx_slot, p.ctx_rule) == (65536, 32768, "target")


def test_default_context_fits_down_in_steps_of_1024():
    p = make_plan(QWEN25, Census(host_need(32768) - 1))   # one byte short of the target
    assert (p.n_ctx_slot, p.ctx_rule) == (31744, "fitted")
    # 1.06e9 bytes: S <= (1.06e9 - 795,787,776) / 12,544 = 21063.0 -> 20480
    p = make_plan(QWEN25, Census(1_060_000_000))
    assert (p.n_ctx_slot, p.n_ctx, p.ctx_rule) == (20480, 20480, "fitted")
    assert p.host_bytes == host_need(20480) <= 1_060_000_000
    assert make_plan(QWEN25, Census(host_need(4096))).n_ctx_slot == 4096
    with pytest.raises(PlanError, match=r"no context fits 1 slot\(s\).*floor 4096.*847168000 bytes"):
        make_plan(QWEN25, Census(host_need(4096) - 1))


def test_a_set_context_that_does_not_fit_names_every_term():
    with pytest.raises(PlanError) as e:
        make_plan(QWEN25, Census(1_060_000_000), ctx_size=32768)
    msg = str(e.value)
    for part in ("--ctx-size 32768", "host needs 1206829568 bytes", "weights 485452288",
                 "kv 411041792", "scratch 41900032", "reserve 268435456", "1060000000 available",
                 "largest context that fits is 20992"):       # 21063 rounded down to 256
        assert part in msg, msg
    with pytest.raises(PlanError, match=r"largest context that fits is 8192 \(2 slots x 4096\)"):
        # two slots: 795,787,776 + 2*12,288 * S <= host_need(4096, 2) -> S = 4096
        make_plan(QWEN25, Census(host_need(4096, 2)), ctx_size=16384, n_parallel=2)


def test_cuda_puts_weights_and_f16_kv_on_the_largest_card():
    from bloomery.plan import scratch_bytes_for
    need = WEIGHTS + 32768 * 6144 * 2 + scratch_bytes_for(QWEN25, 32768, "cuda", graphs=True)   # kv 384 MiB
    margin = 1024 * 2**20
    p = make_plan(QWEN25, Census(2**30, (need + margin - 1, need + margin)), backend="cuda")
    assert p.kv_bytes == 402_653_184
    assert (p.card_bytes, p.host_bytes, p.ctx_rule) == ((0, need), 256 * 2**20, "target")
    p = make_plan(QWEN25, Census(2**30, (need + margin - 1,)), backend="cuda")
    assert (p.n_ctx_slot, p.ctx_rule) == (31744, "fitted")
    with pytest.raises(PlanError, match=f"cuda:0 needs {need + margin} bytes.*margin {margin}"):
        make_plan(QWEN25, Census(2**30, (need + margin - 1,)), backend="cuda", ctx_size=32768)
    with pytest.raises(PlanError, match="census lists none"):
        make_plan(QWEN25, BIG, backend="cuda")


def test_numpy_counts_its_decoded_forms_and_cuda_does_not():
    """The numpy backend's compiled kernels read the stored blocks in place; where they are off,
    its numpy kernels keep a decoded form (planes) of each matrix beside its blocks, and the plan
    counts it on the host. The cuda backend computes from the stored blocks."""
    from bloomery.engine.cpu import kernels
    from bloomery.engine.cpu.forms import decoded_bytes
    q8 = int(gguf.GGMLQuantizationType.Q8_0)
    tensors = (("blk.0.ffn_up.weight", q8, (896, 4864)), ("blk.0.attn_norm.weight", 0, (896,)),
               ("token_embd.weight", q8, (896, 151936)), ("output.weight", q8, (896, 151936)))
    facts = dataclasses.replace(QWEN25, tensors=tensors)
    p = make_plan(facts, BIG, ctx_size=4096)
    n = decoded_bytes(tensors)
    if kernels.lib() is None:
        assert p.decoded_bytes == n >= 4864 * 896 + 151936 * 896  # at least a byte per element of the two matrices
    else:
        assert p.decoded_bytes == n == 0                           # read in place: nothing decoded is kept
    assert p.decoded_bytes == n
    assert p.host_bytes == host_need(4096) + n
    assert p.placement.device("host").terms.decoded == n
    assert decoded_bytes(tensors[:1]) + decoded_bytes(tensors[3:]) == n   # the norm's F32 is read in place, the
    cuda = make_plan(facts, Census(2**30, (10**12,)), backend="cuda", ctx_size=4096)   # embedding by rows
    assert cuda.decoded_bytes == 0 and cuda.placement.device("cuda:0").terms.decoded == 0


def test_numpy_scratch_without_the_compiled_attention(monkeypatch):
    """BLOOMERY_CPU_KERNELS=off (or no compiler): the numpy attention's tiled path holds the scores [H, T, L]
    at 16 bytes each (f32, and each FMA step's f64 product and f32 result), beside q in f32 and f64 and K, V
    widened to f32: at S = 4096 that moment passes the dense FFN's."""
    monkeypatch.setattr(plan_mod, "_compiled_attention", lambda head_dim: False)
    assert plan_mod.scratch_bytes_for(QWEN25, 4096) == (
        2 * 512 * 896 * 4 + 512 * 896 * 4 + 512 * 18 * 64 * 4      # the block's input, embedded rows, norm, q k v
        + 512 * 16 * 64 * 4 + 512 * 14 * 64 * 16                     # rotated q and k; grouped q, f64 q, output
        + 8 * 2 * 64 * 4096 + 16 * 512 * 14 * 4096) == 491_257_856   # K and V in f32; the scores


def test_numpy_fallback_product_temporaries():
    """BLOOMERY_CPU_KERNELS=off (or no compiler): a product's own temporaries in the numpy kernels, from their
    chunking (measured with tracemalloc on the synthetic files' weights: 67,114,856 and 93,378,208 bytes)."""
    from gguf import GGMLQuantizationType as QT
    # a Q6_K head [151936, 256] for two decode rows (the lanes): chunks of 2^22 / (16 * 2) rows, their half
    # sums [1, 2, 8, n, 2] f32 four times over, and the codes and their lane-ordered copy
    assert plan_mod._numpy_product_temps(QT.Q6_K, 2, 256, 151936) == 2 * 2 * 256 * 4 + 4 * 16 * 131072 * 2 * 4
    # a repacked Q4_K [1024, 256] over a 512-row pass: one chunk, its sums [8, 512, 1024] f32 5.5 times over
    assert plan_mod._numpy_product_temps(QT.Q4_K, 512, 256, 1024) == 2 * 512 * 256 * 4 + 11 * 8 * 512 * 1024 * 2
    # an expert's rows run the gemv: 3.5 times, and its two accumulators [T, n] f32
    assert plan_mod._numpy_product_temps(QT.Q4_K, 512, 256, 1024, per_row=True) == (
        2 * 512 * 256 * 4 + 7 * 8 * 512 * 1024 * 2 + 2 * 512 * 1024 * 4)


def test_numpy_forms_without_the_compiled_kernels_are_planes(monkeypatch):
    """BLOOMERY_CPU_KERNELS=off (or no compiler): the numpy kernels' planes, 4 bytes an element
    or more, are counted."""
    from bloomery.engine.cpu import kernels
    from bloomery.engine.cpu.forms import bytes_per_row
    monkeypatch.setattr(kernels, "lib", lambda: None)
    bytes_per_row.cache_clear()
    try:
        assert bytes_per_row(int(gguf.GGMLQuantizationType.Q8_0), 896, "matrix", True) >= 4 * 896
    finally:
        bytes_per_row.cache_clear()


def test_records():
    p = make_plan(QWEN25, Census(1_060_000_000), n_parallel=1)
    recs = dict(p.records())
    assert list(recs) == ["plan", "ctx", "parallel", "need"]
    assert recs["ctx"] == {"n_ctx_slot": 20480, "n_ctx": 20480, "rule": "fitted", "n_ctx_train": 32768}
    assert recs["parallel"] == {"slots": 1, "from": "set"}
    assert recs["need"] == {"bytes": host_need(20480), "cards": []}
    assert recs["plan"]["Q8_0_bytes"] == 146105344 and recs["plan"]["kv_bytes"] == p.kv_bytes
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.n_ctx = 1


@pytest.mark.parametrize("kwargs,words", [
    ({"n_parallel": 0}, "--parallel 0 must be an integer >= 1 or .auto."),
    ({"n_parallel": "auto", "ctx_size": 8192}, "--parallel auto beside --ctx-size 8192 is refused"),
    ({"ctx_size": -5}, "--ctx-size -5 must be an integer >= 0"),
    ({"ctx_size": 4096, "slot_ctx": 1024}, "--slot-ctx 1024 beside --ctx-size 4096"),
    ({"backend": "vulkan"}, "backend 'vulkan' is not one of"),
])
def test_bad_settings_are_refused_by_name(kwargs, words):
    with pytest.raises(PlanError, match=words):
        make_plan(QWEN25, BIG, **kwargs)


def write_header(path, keys: dict):
    w = gguf.GGUFWriter(str(path), "qwen2")
    for k, v in keys.items():
        w.add_uint32(k, v)
    w.add_tensor("x.weight", np.zeros(32, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return open_gguf(str(path))


def test_missing_or_bad_header_keys_are_named(tmp_path):
    keys = {"qwen2.block_count": 2, "qwen2.context_length": 2048, "qwen2.embedding_length": 64,
            "qwen2.attention.head_count": 4, "qwen2.feed_forward_length": 128, "qwen2.vocab_size": 100}
    f = model_facts(write_header(tmp_path / "ok.gguf", keys))
    assert (f.n_head_kv, f.head_dim_k, f.n_vocab, f.tensor_bytes) == ((4, 4), 16, 100, {"F32": 128})
    with pytest.raises(PlanError, match="qwen2.context_length is missing"):
        model_facts(write_header(tmp_path / "a.gguf", {k: v for k, v in keys.items() if "context" not in k}))
    with pytest.raises(PlanError, match="qwen2.block_count is 0"):
        model_facts(write_header(tmp_path / "b.gguf", {**keys, "qwen2.block_count": 0}))


def test_census_reads_this_machine(tmp_path):
    c = take_census()
    assert 0 < c.host_avail_bytes and isinstance(c.card_free_bytes, tuple)
    proc = tmp_path / "cgroup"
    root = tmp_path / "fs"
    own = root / "box" / "svc"
    own.mkdir(parents=True)
    proc.write_text("0::/box/svc\n")
    (root / "memory.max").write_text("max\n")                # the mount's root: no limit
    assert cgroup_limit_bytes(root, proc) is None
    (root / "box" / "memory.max").write_text("1000\n")       # a parent's limit binds its children
    (root / "box" / "memory.current").write_text("300\n")
    assert cgroup_limit_bytes(root, proc) == 700
    (own / "memory.max").write_text("500\n")
    (own / "memory.current").write_text("100\n")
    assert cgroup_limit_bytes(root, proc) == 400
    v1 = root / "memory" / "ctr"                                 # cgroup v1, as on this machine
    v1.mkdir(parents=True)
    proc.write_text("4:memory:/ctr\n0::/\n")
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert cgroup_limit_bytes(root, proc) is None
    (v1 / "memory.limit_in_bytes").write_text("2048\n")
    (v1 / "memory.usage_in_bytes").write_text("48\n")
    assert cgroup_limit_bytes(root, proc) == 2000


def test_parallel_auto_counts_slots_of_one_requests_context():
    four = host_need(32768, 4)      # 4 slots of the trained limit, scratch sized for one pass
    p = make_plan(QWEN25, Census(four), n_parallel="auto")
    assert (p.n_slots, p.n_ctx_slot, p.ctx_rule, p.parallel_from) == (4, 32768, "target", "auto")
    assert dict(p.records())["parallel"] == {"slots": 4, "from": "auto"}
    assert make_plan(QWEN25, Census(four - 1), n_parallel="auto").n_slots == 3
    assert make_plan(QWEN25, BIG, n_parallel="auto").n_slots == 8
    p = make_plan(QWEN25, Census(1_060_000_000), n_parallel="auto")   # one slot already fitted
    assert (p.n_slots, p.n_ctx_slot, p.ctx_rule) == (1, 20480, "fitted")
    p = make_plan(QWEN25, Census(host_need(4096, 3)), n_parallel="auto", slot_ctx=4096)
    assert (p.n_slots, p.n_ctx, p.ctx_rule) == (3, 12288, "set")


@pytest.mark.live_reference
@pytest.mark.real_model
@pytest.mark.parametrize("ctx_size,n_parallel", [(8192, 2), (4096, 3), (1000, 1)])
def test_slots_and_kv_bytes_match_llama_cpp(synthetic_dir, real_model_path, ctx_size, n_parallel):
    import re
    import subprocess

    from conftest import load_tool
    from test_synthetic import llama_bin

    path = synthetic_dir / "plan_live_qwen3.gguf"
    if not path.exists():
        load_tool("make_synthetic").write_synthetic(path, arch="qwen3", mode="blocks", n_embd=256,
                                                    n_head=4, n_head_kv=2, n_ff=512,
                                                    tokenizer_from=str(real_model_path))
    r = subprocess.run([str(llama_bin() / "llama-eval-callback"), "-m", str(path), "-p", "hi", "-n", "1",
                        "-t", "2", "-v", "-c", str(ctx_size), "-np", str(n_parallel)],
                       capture_output=True, text=True, timeout=300)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-3000:]
    n_ctx = int(re.search(r"llama_context: n_ctx\s+= (\d+)", log)[1])
    n_ctx_seq = int(re.search(r"llama_context: n_ctx_seq\s+= (\d+)", log)[1])
    kv_mib = float(re.search(r"llama_kv_cache: size =\s+([\d.]+) MiB", log)[1])
    with open_gguf(str(path)) as g:
        p = make_plan(model_facts(g), Census(2**40, (2**40,)), backend="cuda",
                      ctx_size=ctx_size, n_parallel=n_parallel)
    assert (p.n_ctx, p.n_ctx_slot) == (n_ctx, n_ctx_seq)
    assert p.kv_bytes == kv_mib * 2**20


def test_cuda_scratch_counts_the_prompt_paths_f16_weight_copies():
    """The cuda plan's scratch holds three f16 copies of the largest tensor (the prompt path
    dequantizes MoE gate, up and down stacks at once) plus its activations; numpy's does not."""
    from bloomery.plan import CUDA_SCORE_BYTES, CUDA_UBATCH, scratch_bytes_for
    moe = dataclasses.replace(QWEN25, max_tensor_elems=128 * 768 * 2048)
    cuda = scratch_bytes_for(moe, 4096, "cuda")
    assert cuda >= 3 * 2 * 128 * 768 * 2048 + CUDA_SCORE_BYTES
    assert cuda - scratch_bytes_for(QWEN25, 4096, "cuda") == 3 * 2 * (128 * 768 * 2048 - 136134656)
    assert scratch_bytes_for(moe, 4096, "numpy") == scratch_bytes_for(QWEN25, 4096, "numpy") == 41_900_032
    assert CUDA_UBATCH == 4096


def test_the_plan_in_words():
    """--plan's sentences: per device "needs X of Y available" in GiB with every term, the context
    rule as it applied, and a warning when a slot's context passes the trained one."""
    def words(p):
        return [(level, text) for level, text, _ in p.explain()]
    p = make_plan(QWEN25, Census(1_060_000_000))
    (lvl, host), (_, rule), (_, cache) = words(p)
    assert lvl == "info" and host.startswith("host needs 0.98 GiB of 0.99 GiB available: weights 0.45 GiB + KV ")
    # the prompt cache's default: half of what the plan leaves (1_060_000_000 - host_bytes), beside the need
    assert p.prompt_cache_bytes == (1_060_000_000 - p.host_bytes) // 2 and p.host_bytes == p.placement.need()[0]
    assert host.endswith(f"and the prompt cache up to {gib(p.prompt_cache_bytes)} beside it")
    assert cache.startswith(f"prompt cache {gib(p.prompt_cache_bytes)} of host RAM: the default")
    assert "reserve 0.25 GiB" in host and "decoded" not in host          # these facts list no tensors
    assert rule.startswith('context rule "fitted": no -c given, and 1 slot of the trained context (32768) does not '
                           'fit') and "20480" in rule
    assert 'rule "target"' in words(make_plan(QWEN25, BIG))[1][1]
    set_words = words(make_plan(QWEN25, BIG, ctx_size=65536, n_parallel=2))
    assert "-c 65536 set it: 2 slots share it" in set_words[1][1] and "32768 each" in set_words[1][1]
    assert not any(level == "warning" for level, _ in set_words)           # 32768 a slot: the trained context
    over = words(make_plan(QWEN25, BIG, ctx_size=65536))
    assert over[-1][0] == "warning" and "65536, exceeds the model's trained context, 32768" in over[-1][1]
    cuda = words(make_plan(QWEN25, Census(2**30, (10 * 2**30, 80 * 2**30)), backend="cuda", ctx_size=4096))
    assert cuda[0][1] == ("host needs 0.25 GiB of 1.00 GiB available: reserve 0.25 GiB, and the prompt cache up to "
                          "0.38 GiB beside it")   # (1 - 0.25) / 2
    assert cuda[1][1].startswith("cuda:1 needs ") and "of 80.00 GiB free" in cuda[1][1]
    assert "margin kept free 1.00 GiB" in cuda[1][1] and not any(t.startswith("cuda:0") for _, t in cuda)


def test_the_prompt_cache_budget_on_the_host():
    """-cram MiB is counted on the host beside the load's need; unset, the lesser of 8 GiB and half of what
    the plan leaves; 0 is off; -1 (llama-server's no limit) is refused by name."""
    big = make_plan(QWEN25, BIG, ctx_size=4096)
    assert big.prompt_cache_bytes == 8 << 30 == big.placement.device("host").terms.prompt_cache
    small = make_plan(QWEN25, Census(2_000_000_000), ctx_size=4096)
    assert small.prompt_cache_bytes == (2_000_000_000 - small.host_bytes) // 2
    set_ = make_plan(QWEN25, BIG, ctx_size=4096, cache_ram_mib=300)
    assert set_.prompt_cache_bytes == 300 << 20 and set_.host_bytes == big.host_bytes
    assert "-cram 300 set it" in set_.explain()[-1][1]
    off = make_plan(QWEN25, BIG, ctx_size=4096, cache_ram_mib=0)
    assert off.prompt_cache_bytes == 0 and "-cram 0 turned it off" in off.explain()[-1][1]
    over = make_plan(QWEN25, Census(2_000_000_000), ctx_size=4096, cache_ram_mib=4096)
    assert over.explain()[0][0] == "warning"             # the host cannot hold the load and that budget
    with pytest.raises(PlanError, match=r"--cache-ram -1: the prompt cache always has a budget"):
        make_plan(QWEN25, BIG, ctx_size=4096, cache_ram_mib=-1)
