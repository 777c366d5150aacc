"""The prebuilt kernels on a card (engine/cuda/fatbin.py, engine/cuda/kernels.py): where fresh
fatbins cover it, the backend starts with no NVRTC compile, and the nvcc-built kernels give the
same bits as the NVRTC-built ones (same source, same options: --std=c++17, -ftz=true).

Skips without a card, and, naming the cause, where no fresh fatbin covers the card: build them
with `python3 -m bloomery.engine.cuda.fatbin` (nvcc) and carry bloomery/engine/cuda/prebuilt/.
"""
from __future__ import annotations

import numpy as np
import pytest
from bloomery.engine.cuda.fatbin import MODULES

pytestmark = pytest.mark.gpu
gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def covered(gpu):
    import cupy
    from bloomery.engine.cuda import fatbin
    cc = cupy.cuda.Device().compute_capability
    missing = {m: why for m, (how, _, why) in fatbin.plan(cc, "auto").items() if how != "prebuilt"}
    if missing:
        pytest.skip(f"no fresh prebuilt fatbin covers sm_{cc} in {fatbin.PREBUILT}: {missing}")
    return cc


@pytest.fixture
def count_compiles(monkeypatch):
    """Every module CuPy compiles or takes from its disk cache goes through
    cupy.cuda.compiler._compile_module_with_cache: counted here."""
    import cupy
    from cupy.cuda import compiler
    seen: list[str] = []
    real = compiler._compile_module_with_cache

    def counting(source, *a, **kw):
        seen.append(source[:80])
        return real(source, *a, **kw)
    monkeypatch.setattr(compiler, "_compile_module_with_cache", counting)
    # the counter sees a compile: a kernel no one compiled before
    probe = f'extern "C" __global__ void probe_{np.random.randint(1 << 30)}(int* p) {{ *p = 1; }}'
    cupy.RawModule(code=probe).compile()
    assert len(seen) == 1, "the compile counter missed a RawModule compile: CuPy's path changed"
    seen.clear()
    return seen


def test_a_covered_card_starts_with_no_compile(covered, count_compiles, monkeypatch):
    from bloomery.engine.cuda.kernels import Kernels
    monkeypatch.setenv("BLOOMERY_CUDA_KERNELS", "auto")
    k = Kernels()
    got = k.wait()
    k.compile_all()                       # every kernel's function from its module
    assert count_compiles == []
    assert set(k.report) == set(MODULES)
    assert {how for how, _, _ in k.report.values()} == {"prebuilt"}, got
    assert got["arch"] == f"sm_{covered}" and "compiled" not in got


@pytest.fixture(scope="module")
def both(covered):
    """Two backends on the card: one compiling every module with NVRTC, one taking only fatbins."""
    import os
    from bloomery.engine.cuda.backend import CudaOps
    made = {}
    for mode in ("nvrtc", "prebuilt"):
        os.environ["BLOOMERY_CUDA_KERNELS"] = mode
        try:
            made[mode] = CudaOps()
        finally:
            del os.environ["BLOOMERY_CUDA_KERNELS"]
        got = made[mode].k.wait()
        assert ("compiled" if mode == "nvrtc" else "prebuilt") in got and len(got) == 3, got
    return made["nvrtc"], made["prebuilt"]


def _random_blocks(qt, n_rows: int, n_cols: int, rng) -> np.ndarray:
    """Random stored bytes of a [n_rows, n_cols] tensor of type qt with f16 scales near 1/64."""
    block, size = gguf.GGML_QUANT_SIZES[qt]
    raw = rng.integers(0, 256, (n_rows * n_cols // block, size), dtype=np.uint8)
    scale_at = {Q.Q4_K: (0, 2), Q.Q6_K: (208,), Q.Q8_0: (0,)}[qt]
    for off in scale_at:
        d = (rng.uniform(0.5, 1.5, len(raw)) / 64).astype(np.float16)
        raw[:, off:off + 2] = d.view(np.uint8).reshape(-1, 2)
    return raw.reshape(-1)


def _same(a, b, what: str) -> None:
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype, what
    diff = np.argwhere(a != b) if a.dtype.kind != "f" else np.argwhere(~((a == b) | (np.isnan(a) & np.isnan(b))))
    assert diff.size == 0, f"{what}: {len(diff)} values differ, first at {diff[0].tolist()}"


@pytest.mark.parametrize("qt", [Q.Q4_K, Q.Q6_K, Q.Q8_0], ids=lambda t: t.name)
def test_prebuilt_kernels_give_the_nvrtc_kernels_bits(both, qt):
    import cupy
    nv, pre = both
    rng = np.random.default_rng(int(qt))
    n_rows, n_cols = 384, 1024
    data = _random_blocks(qt, n_rows, n_cols, rng)
    g = rng.uniform(0.5, 1.5, n_cols).astype(np.float32)
    x = rng.standard_normal((3, n_cols)).astype(np.float32)
    ids = np.array([0, 17, 383, 5], np.int32)
    out = {}
    for name, ops in (("nvrtc", nv), ("prebuilt", pre)):
        w = ops.weight(int(qt), (n_cols, n_rows), data)
        nw = ops.weight(int(Q.F32), (n_cols,), g.view(np.uint8))
        rows = ops.get_rows(w, ids)                                       # dequantize (layers.cu)
        h = ops.rms_norm(cupy.asarray(x), nw, 1e-6)                       # rms_norm_q8 (matvec.cu)
        y = ops.matmul(h, w)                                              # int8 mat-vec (matvec.cu)
        out[name] = [cupy.asnumpy(a) for a in (rows, h, y, ops.argmax(y))]
    for what, a, b in zip(("get_rows", "rms_norm", "matmul", "argmax"), out["nvrtc"], out["prebuilt"]):
        _same(a, b, f"{qt.name} {what}")
