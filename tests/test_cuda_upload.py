"""engine/cuda/upload.py: a load's weights reach the card through several reader threads, each with its
own pinned buffers and stream; every byte arrives where a plain copy would put it, from a file's mapping
too, and a load through the backend's loading() gives the same weights as the plain path."""
from __future__ import annotations

import mmap

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("n", [0, 17, (4 << 20) + 1, (37 << 20) + 12_345])
@pytest.mark.parametrize("threads", [1, 3, 8])
def test_to_card_puts_every_byte_in_place(gpu, n, threads):
    import cupy
    from bloomery.engine.cuda.upload import Uploader
    src = np.random.default_rng(n + threads).integers(0, 256, n, dtype=np.uint8)
    with Uploader(threads) as up:
        dev = up.to_card(src)
        again = up.to_card(src[::-1])                 # a second tensor through the same buffers
    assert dev.dtype == cupy.uint8 and dev.shape == (n,)
    assert np.array_equal(cupy.asnumpy(dev), src)
    assert np.array_equal(cupy.asnumpy(again), src[::-1])


def test_to_card_reads_a_file_mapping(gpu, tmp_path):
    import cupy
    from bloomery.engine.cuda.upload import Uploader
    data = np.random.default_rng(1).integers(0, 256, (21 << 20) + 7, dtype=np.uint8)
    path = tmp_path / "blob"
    path.write_bytes(b"x" * 99 + data.tobytes())
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        view = np.frombuffer(mm, np.uint8, data.size, offset=99)
        with Uploader(4) as up:
            dev = up.to_card(view)
        del view
    assert np.array_equal(cupy.asnumpy(dev), data)


def test_a_load_through_loading_gives_the_plain_weights(gpu, tokenizer_source, synthetic_dir):
    """load_model opens ops.loading() (the reader threads); a model made without it (each weight by a plain
    cupy.asarray) gives the same logits, bit for bit: the same bytes reached the card."""
    from bloomery.engine.cuda.backend import CudaOps
    from bloomery.engine.loader import load_model
    from bloomery.engine.models.registry import model_class
    from bloomery.gguf_file import open_gguf
    from bloomery.placement import whole
    from tests.conftest import load_tool
    path = load_tool("make_synthetic").write_synthetic(
        synthetic_dir / "upload-qwen3moe.gguf", arch="qwen3moe", mode="blocks", mix="q4_k_m", seed=2,
        tokenizer_from=str(tokenizer_source), n_layer=2, n_embd=1024, n_head=8, n_head_kv=2, head_dim=128,
        n_expert=32, n_expert_used=4, n_ff_exp=768)
    loaded = load_model(str(path), whole("cuda", 1, 256))
    plain = model_class("qwen3moe")(open_gguf(str(path)), CudaOps(), 1, 256)
    ids = np.arange(500, 540, dtype=np.int32)
    assert np.array_equal(loaded.prefill(0, ids, 0), plain.prefill(0, ids, 0))
