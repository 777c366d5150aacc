"""Embeddings (--embeddings, --pooling, --embd-normalize): the normalisations of llama.cpp's
common_embd_normalize, the input shapes llama-server reads, the engine's pooled final-norm rows
(checked against the model's own output head: the rows times the head are the logits), and a live
bloomery-serve on the real file answered through the openai SDK, checked against the same file
computed in this process."""
from __future__ import annotations

import base64

import numpy as np
import pytest
import requests

from bloomery.api.embeddings import normalize, read_inputs
from bloomery.engine.core import Engine
from bloomery.engine.types import EngineRequest
from bloomery.http.types import ApiError
from test_engine_core import drain, greq


# -- normalisation and input shapes (pure) ------------------------------------------------------------------------
def test_normalize_follows_common_embd_normalize():
    v = np.array([3.0, -4.0, 0.0], np.float32)
    assert np.allclose(normalize(v, 2), [0.6, -0.8, 0.0])                      # euclidean
    assert np.allclose(normalize(v, 1), [3 / 7, -4 / 7, 0.0])                  # taxicab
    assert np.allclose(normalize(v, 0), v * 32760.0 / 4.0)                     # max absolute to the int16 range
    assert np.allclose(normalize(v, -1), v)                                     # none
    p3 = (27 + 64) ** (1 / 3)
    assert np.allclose(normalize(v, 3), v / p3)                                 # p-norm
    assert np.all(normalize(np.zeros(3, np.float32), 2) == 0)                  # a zero vector stays zero


class Tok:
    n_vocab = 1000

    def encode(self, text, add_special=True, parse_special=False):
        return [ord(c) for c in text]


@pytest.mark.parametrize("value, want", [
    ("ab", [[97, 98]]),
    ([12, 34, 56], [[12, 34, 56]]),
    ([12, "a", 56], [[12, 97, 56]]),
    (["a", "bc"], [[97], [98, 99]]),
    (["a", [1, 2]], [[97], [1, 2]]),
    ([[1, 2], [3, "a"]], [[1, 2], [3, 97]]),
    ({"prompt_string": "ab"}, [[97, 98]]),
    ({"content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}, [[97, 98]]),
    (["x", {"prompt_string": "y"}, {"content": [{"type": "text", "text": "z"}]}], [[120], [121], [122]]),
])
def test_input_shapes_as_llama_server_reads_them(value, want):
    assert read_inputs(Tok(), value) == want


@pytest.mark.parametrize("value, says", [
    ([], "must not be empty"),
    (True, "must be a string"),
    ({"content": "string"}, "must be an array"),
    ({"content": [{"type": "unknown"}]}, "unsupported content part 'unknown'"),
    ({"content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}, "image input"),
    ({"content": [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}, "audio input"),
    ([1, 5000], "token id 5000 is outside"),
    ({"other": 1}, "without 'prompt_string'"),
])
def test_bad_input_is_a_400_naming_it(value, says):
    with pytest.raises(ApiError) as e:
        read_inputs(Tok(), value)
    assert e.value.status == 400 and says in e.value.message and "'prompt'" not in e.value.message


# -- the engine over a synthetic model ------------------------------------------------------------------------------
SHAPE = dict(n_layer=2, n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_ff=512)


@pytest.fixture(scope="module")
def synthetic(tokenizer_source, synthetic_dir):
    from conftest import load_tool
    from bloomery.engine.loader import load_model
    from bloomery.placement import whole
    path = load_tool("make_synthetic").write_synthetic(synthetic_dir / "embd-qwen2.gguf", arch="qwen2", mode="blocks",
                                                        mix="q4_k_m", seed=7, tokenizer_from=str(tokenizer_source),
                                                        **SHAPE)
    return load_model(path, whole("numpy", 2, 128))


def embed_req(rid, ids, pooling):
    return EngineRequest(rid, tuple(ids), 0, cache_prompt=False, pooling=pooling)


def vectors(out):
    return np.frombuffer(base64.b64decode(out.embedding), "<f4").reshape(out.embd_rows, -1)


def test_the_rows_are_what_the_output_head_reads_and_each_pooling_takes_its_rows(synthetic):
    ids = [int(i) for i in np.arange(300, 340)]
    rows = synthetic.hidden_states(0, ids)                                     # [T, D]
    assert rows.shape == (len(ids), SHAPE["n_embd"]) and rows.dtype == np.float32
    logits = synthetic.forward_all(1, ids, 0)                                  # [T, V], another slot
    head = np.asarray(synthetic.ops.to_host(synthetic.ops.matmul(synthetic.ops.from_host(rows), synthetic.output)))
    assert np.allclose(head, logits, rtol=1e-4, atol=1e-4 * float(np.abs(logits).max()))
    engine = Engine(synthetic, 2, 128)
    for pooling in ("none", "mean", "cls", "last"):
        engine.add(embed_req(pooling, ids, pooling))
    outs = {rid: o[-1] for rid, o in drain(engine).items()}
    assert all(o.finish == "stop" and o.n_prompt == len(ids) for o in outs.values())
    assert np.allclose(vectors(outs["none"]), rows, atol=1e-5)
    assert np.allclose(vectors(outs["mean"]), rows.mean(0, keepdims=True), atol=1e-5)
    assert np.allclose(vectors(outs["cls"]), rows[:1], atol=1e-5)
    assert np.allclose(vectors(outs["last"]), rows[-1:], atol=1e-5)


def test_an_embedding_beside_a_generation_leaves_the_generation_as_it_is_alone(synthetic):
    prompt = [int(i) for i in np.arange(500, 520)]
    engine = Engine(synthetic, 2, 128)
    engine.add(greq("alone", prompt, n_predict=8))
    alone = [o.token for o in drain(engine)["alone"]]
    engine = Engine(synthetic, 2, 128)
    engine.add(greq("gen", prompt, n_predict=8))
    first = [o.token for o in engine.step() if o.req_id == "gen"]           # the prompt pass and its first id
    engine.add(embed_req("e", [int(i) for i in np.arange(700, 760)], "last"))
    outs = drain(engine)
    assert first + [o.token for o in outs["gen"]] == alone and outs["e"][-1].embd_rows == 1


# -- a live bloomery-serve on the real file, through the openai SDK ----------------------------------------------------
@pytest.mark.real_model
@pytest.mark.slow
def test_openai_sdk_embeddings_against_bloomery_serve_match_the_model_computed_here(real_model_path):
    from openai import OpenAI
    from serve_proc import Served
    from bloomery.engine.loader import load_model
    from bloomery.placement import whole
    texts = ["I believe the meaning of life is", "def add(a, b):\n    return a + b", "hello"]
    with Served("-m", str(real_model_path), "--embeddings", "--pooling", "last", "-np", "2", "-c", "1024") as s:
        client = OpenAI(api_key="dummy", base_url=s.url + "/v1")
        one = client.embeddings.create(model="any", input=texts[0])
        many = client.embeddings.create(model="any", input=texts)
        b64 = client.embeddings.create(model="any", input=texts, encoding_format="base64")
        floats = requests.post(s.url + "/v1/embeddings", json={"input": texts[0], "encoding_format": "float"},
                               timeout=120)
        ids = requests.post(s.url + "/tokenize", json={"content": texts[0]}, timeout=60).json()["tokens"]
        by_ids = requests.post(s.url + "/v1/embeddings", json={"input": ids}, timeout=120).json()
        by_id_lists = requests.post(s.url + "/v1/embeddings", json={"input": [ids, ids[:3]]}, timeout=120).json()
        raw = requests.post(s.url + "/v1/embeddings", json={"input": texts[0], "embd_normalize": -1}, timeout=120).json()
        legacy = requests.post(s.url + "/embedding", json={"content": texts[2]}, timeout=120).json()
        bad = requests.post(s.url + "/v1/embeddings", json={"input": "x", "encoding_format": 1}, timeout=60)
        fits = requests.post(s.url + "/v1/embeddings", json={"input": "This is a test " * 200}, timeout=60)
    assert len(one.data) == 1 and len(many.data) == 3 and [d.index for d in many.data] == [0, 1, 2]
    assert one.usage.prompt_tokens == one.usage.total_tokens == len(ids)
    v0 = np.array(one.data[0].embedding)
    assert len(v0) == 896 and abs(float(v0 @ v0) - 1) < 1e-4                 # euclidean by default
    assert np.allclose(many.data[0].embedding, v0, atol=1e-6)                # the same prompt, the same vector
    # the SDK asks for base64 when the caller names no format, and decodes it (many, one); asked by name, the
    # caller gets the string: float32 bytes, little-endian, the same vectors
    assert all(np.allclose(np.frombuffer(base64.b64decode(b.embedding), "<f4"), m.embedding, atol=1e-6)
               for b, m in zip(b64.data, many.data))
    assert np.allclose(floats.json()["data"][0]["embedding"], v0, atol=1e-6)
    assert np.allclose(by_ids["data"][0]["embedding"], v0, atol=1e-6) and by_ids["usage"]["prompt_tokens"] == len(ids)
    assert len(by_id_lists["data"]) == 2 and by_id_lists["usage"]["prompt_tokens"] == len(ids) + 3
    assert isinstance(legacy, list) and len(legacy[0]["embedding"]) == 1 and len(legacy[0]["embedding"][0]) == 896
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    assert fits.status_code == 400 and "too large" in fits.json()["error"]["message"]
    # the same file computed in this process: the last prompt id's final-norm row, normalised
    model = load_model(str(real_model_path), whole("numpy", 1, 64))
    want = model.hidden_states(0, ids)[-1].astype(np.float64)
    got_raw = np.array(raw["data"][0]["embedding"])
    assert np.allclose(got_raw, want, rtol=1e-3, atol=1e-3 * np.abs(want).max())
    assert np.allclose(v0, want / np.linalg.norm(want), atol=1e-4)


@pytest.mark.real_model
@pytest.mark.slow
def test_pooling_none_gives_every_row_and_is_refused_on_the_openai_route_and_without_the_flag_501(real_model_path):
    from serve_proc import Served
    with Served("-m", str(real_model_path), "--embeddings", "--pooling", "none", "-np", "1", "-c", "256",
                "--no-warmup") as s:
        rows = requests.post(s.url + "/embeddings", json={"input": "hello hello hello"}, timeout=120).json()
        oai = requests.post(s.url + "/v1/embeddings", json={"input": "hello hello hello"}, timeout=60)
        n = len(requests.post(s.url + "/tokenize", json={"content": "hello hello hello"}, timeout=60).json()["tokens"])
    assert len(rows[0]["embedding"]) == n == 3
    assert all(abs(sum(x * x for x in r) - 1) > 1e-3 for r in rows[0]["embedding"])     # not normalised
    assert oai.status_code == 400 and "Pooling type 'none' is not OAI compatible" in oai.json()["error"]["message"]
    with Served("-m", str(real_model_path), "-np", "1", "-c", "256", "--no-warmup") as s:
        off = requests.post(s.url + "/v1/embeddings", json={"input": "x"}, timeout=60)
    assert off.status_code == 501 and "Start it with `--embeddings`" in off.json()["error"]["message"]

