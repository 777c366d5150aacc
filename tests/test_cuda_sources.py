"""The kernel sources without a card: includes inlined once, every kernel the Python side
launches exists, and (where nvcc is installed) every module compiles for sm_90."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from bloomery.engine.cuda.kernels import MODULES, kernel_dir, source

CUDA = Path(__file__).resolve().parents[1] / "bloomery" / "engine" / "cuda"


def kernel_names() -> set[str]:
    names: set[str] = set()
    for mod in MODULES:
        src = source(mod)
        names |= set(re.findall(r'extern "C" __global__ void (?:__launch_bounds__\([^)]*\)\s+)?(?!__launch_bounds__)(\w+)\(', src))
        for macro, prefix in (("MMV3", "mmv3_b"), ("MMV3N", "mmv3n_b"), ("MOE_ROUTE_W", "moe_route_w")):
            names |= {prefix + n for n in re.findall(rf"^{macro}\((\d+)\)", src, re.M)}
        names |= {f"attn_dec_{a}_{b}" for a, b in re.findall(r"^ATTN_DEC\((\d+), (\d+)\)", src, re.M)}
        names |= {f"moe_mm_{k}_{n}" for n in re.findall(r"^MOE_MM\(\w+, (\w+)\)", src, re.M) for k in ("gu", "dn")}
    return names


def test_includes_are_inlined_once():
    for mod in MODULES:
        src = source(mod)
        assert "#include" not in src, mod
        assert src.count("__device__ __forceinline__ float h2f(") == 1, mod
    assert (kernel_dir() / "matvec.cu").is_file()


def test_every_launched_kernel_exists():
    names = kernel_names()
    called: set[str] = set()
    for py in CUDA.glob("*.py"):
        called |= set(re.findall(r"\.k\.(\w+)\(", py.read_text()))
    called -= {"compile_all", "view"}             # the loader's own method; cupy's ndarray.view
    assert called and called <= names, sorted(called - names)
    # the families picked by name at run time: getattr(ops.k, f"mmv3_b{nb}") and the like
    for py in CUDA.glob("*.py"):
        for template in re.findall(r'getattr\([\w.]*\bk, f"([\w{}.\[\]\s()<>=,]+)"\)', py.read_text()):
            pattern = re.sub(r"\{[^}]*\}", r"\\w+", template)
            assert any(re.fullmatch(pattern, n) for n in names), (py.name, template)
    assert {"mmv3_b1", "mmv3_b2", "mmv3_b4", "mmv3_b8", "mmv3_b16", "attn_dec_64_8", "attn_dec_128_8", "attn_dec_256_8", "mmv3n_b1", "mmv3n_b8",
            "moe_route_w4", "moe_route_w8", "moe_route_w16", "moe_route_w32"} <= names


@pytest.mark.slow                    # nvcc: 1-8 s a module on 2 cores at -O0 (2-19 s optimised)
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("mod", MODULES)
def test_module_compiles_for_sm90(mod, tmp_path):
    cu = tmp_path / f"{mod}.cu"
    cu.write_text(source(mod))
    # -O0 in both passes: the same front end and the same sm_90 assembler check every kernel (types, templates,
    # static shared memory), in 40 % of the optimised build's time; the shipped fatbins are built optimised
    out = subprocess.run(["nvcc", "-arch=sm_90", "-cubin", "-Xcicc", "-O0", "-Xptxas", "-O0",
                          "-o", str(tmp_path / f"{mod}.cubin"), str(cu)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]


def _functions(src: str) -> dict[str, str]:
    """Each function definition's body, by name: a name, its balanced parameter list, then a
    brace (matched to its close)."""
    src = re.sub(r"/\*.*?\*/|//[^\n]*", "", src, flags=re.S)        # comments hold parentheses too
    out = {}
    for m in re.finditer(r"\b(\w+)\s*\(", src):
        depth, i = 1, m.end()
        while depth and i < len(src):
            depth += {"(": 1, ")": -1}.get(src[i], 0)
            i += 1
        rest = re.match(r"\s*(?:const\s*)?\{", src[i:])
        if not rest:
            continue
        depth, k = 1, i + rest.end()
        start = k
        while depth and k < len(src):
            depth += {"{": 1, "}": -1}.get(src[k], 0)
            k += 1
        out.setdefault(m.group(1), src[start:k])
    return out


def test_every_kernel_waits_for_the_one_before():
    """The captured decode step launches every kernel with programmatic dependent launch, which
    is only safe if each kernel reaches pdl_wait() (common.cuh) before reading what the kernel
    before wrote: every __global__ function, and every kernel a macro makes, calls pdl_wait
    itself or through the body function it hands off to."""
    for mod in MODULES:
        src = source(mod)
        bodies = _functions(src)
        waits = {name for name, body in bodies.items() if "pdl_wait();" in body}
        waits |= {name for name, body in bodies.items() if any(re.search(rf"\b{w}\s*[<(]", body) for w in waits)}
        kernels = re.findall(r'extern "C" __global__ void (?:__launch_bounds__\([^)]*\)\s+)?(?!__launch_bounds__)(\w+)\(', src)
        assert kernels, mod
        for k in kernels:
            if k in bodies:
                assert k in waits, (mod, k)
        for macro, body in re.findall(r"#define (\w+)\(\w+(?:, \w+)*\) extern \"C\" __global__[^{]*\{(.*?)\}",
                                      src, re.S):
            called = re.findall(r"(\w+)\s*<", body)
            assert called and any(c in waits for c in called), (mod, macro, called)


def test_every_decode_sized_batch_has_its_kernels():
    """sizes.DECODE_ROWS (the captured step's rows) against the sources: an mmv3_bN for each of MMV_SIZES (the
    widest DECODE_ROWS), mmv3n_bN up to MMV3N_ROWS and none wider (backend.norm_matmuls runs the norm on its
    own past it), mmt's rows (MMT_ROWS) at least DECODE_ROWS, and the offload's doorbell: host_post's picks
    hold a step of DECODE_ROWS rows of 32 experts, and the job word keeps DECODE_ROWS in the bits below
    BELL_WORD, the same BELL_WORD in kernels/moe.cu, kernels/host_moe.c and cpu/host_moe.py."""
    from bloomery.engine.cpu import host_moe
    from bloomery.engine.cuda import sizes
    names = kernel_names()
    assert sizes.MMV_SIZES == tuple(sorted(sizes.MMV_SIZES)) and sizes.MMV_SIZES[-1] == sizes.DECODE_ROWS
    assert {f"mmv3_b{n}" for n in sizes.MMV_SIZES} <= names
    fused = {int(n) for n in re.findall(r"^MMV3N\((\d+)\)", source("matvec"), re.M)}
    assert max(fused) == sizes.MMV3N_ROWS and fused <= set(sizes.MMV_SIZES)
    assert sizes.MMT_ROWS >= sizes.DECODE_ROWS
    moe = source("moe")
    picks = int(re.search(r"^#define POST_PICKS (\d+)", moe, re.M).group(1))
    assert picks >= 32 * sizes.DECODE_ROWS                  # moe.ffn takes up to 32 experts a token
    host_c = (kernel_dir() / "host_moe.c").read_text()
    words = {int(re.search(r"^#define BELL_WORD (\d+)", text, re.M).group(1)) for text in (moe, host_c)}
    assert words == {host_moe.BELL_WORD} and sizes.DECODE_ROWS < host_moe.BELL_WORD
    assert host_moe.BELL_WORD & (host_moe.BELL_WORD - 1) == 0    # the bell reads T as word & (BELL_WORD - 1)


def test_the_prompt_attention_lever_is_read_by_name(monkeypatch):
    """BLOOMERY_CUDA_PROMPT_ATTN: tc by default, which takes heads of attn_prompt's size only; gemm turns it off;
    anything else is refused by name (device-free: sizes.py)."""
    from bloomery.engine.cuda import sizes
    monkeypatch.delenv("BLOOMERY_CUDA_PROMPT_ATTN", raising=False)
    assert sizes.prompt_attn() == "tc" and sizes.tc_prompt_fits(32, 4, 128) and sizes.tc_prompt_fits(14, 2, 128)
    monkeypatch.setenv("BLOOMERY_CUDA_PROMPT_ATTN", "gemm")
    assert not sizes.tc_prompt_fits(32, 4, 128)
    monkeypatch.setenv("BLOOMERY_CUDA_PROMPT_ATTN", "tc")
    assert not sizes.tc_prompt_fits(32, 2, 128)            # 16 query heads a KV head: past a block of 8 warps
    assert not sizes.tc_prompt_fits(16, 4, 64)             # attn_prompt's head size is 128
    monkeypatch.setenv("BLOOMERY_CUDA_PROMPT_ATTN", "flash")
    with pytest.raises(ValueError, match="BLOOMERY_CUDA_PROMPT_ATTN='flash': one of gemm, tc"):
        sizes.prompt_attn()


def test_attn_prompt_splits_fill_the_card_and_stop_at_eight():
    """attn_prompt's key splits (device-free: sizes.py): two blocks an SM where the rows alone leave it idle."""
    from bloomery.engine.cuda.sizes import PA_MAX_SPLITS, prompt_splits
    assert prompt_splits(64, 132) == 5              # 256 rows over 4 KV heads on an H200
    assert prompt_splits(128, 132) == 3             # 512 rows
    assert prompt_splits(16, 132) == PA_MAX_SPLITS  # 64 rows: no more than eight
    assert prompt_splits(512, 132) == 1             # enough blocks: one walk, no merge
    assert prompt_splits(0, 132) == PA_MAX_SPLITS
