"""The bounded GGUF reader: real file vs gguf's own reader, hostile headers, splits."""
from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from bloomery.gguf_file import GGUFError, open_gguf

VT = gguf.GGUFValueType


# --- raw encoders: build exactly the bytes a hostile file would hold -------------

def s(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def kv(key: str, vtype: int, payload: bytes) -> bytes:
    return s(key) + struct.pack("<I", vtype) + payload


def u32kv(key: str, v: int) -> bytes:
    return kv(key, VT.UINT32, struct.pack("<I", v))


def tinfo(name: str, dims, ggml_type: int = 0, offset: int = 0, n_dims: int | None = None) -> bytes:
    n = len(dims) if n_dims is None else n_dims
    return (s(name) + struct.pack("<I", n) + b"".join(struct.pack("<Q", d) for d in dims)
            + struct.pack("<IQ", ggml_type, offset))


def header(n_tensors: int, n_kv: int, version: int = 3, magic: bytes = b"GGUF") -> bytes:
    return magic + struct.pack("<IQQ", version, n_tensors, n_kv)


def raw_file(tmp_path: Path, kvs: list[bytes], infos: list[bytes], data: bytes = b"",
             n_tensors: int | None = None, n_kv: int | None = None, version: int = 3,
             align: int = 32, name: str = "m.gguf") -> Path:
    body = header(len(infos) if n_tensors is None else n_tensors,
                  len(kvs) if n_kv is None else n_kv, version) + b"".join(kvs) + b"".join(infos)
    if infos:
        body += b"\0" * (-len(body) % align)
    path = tmp_path / name
    path.write_bytes(body + data)
    return path


def good_file(tmp_path: Path, name: str = "good.gguf") -> Path:
    """A small valid file written by gguf's own writer: 2 tensors, every value kind."""
    path = tmp_path / name
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_uint32("qwen2.block_count", 2)
    w.add_float32("qwen2.rope.freq_base", 1e6)
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    w.add_string("general.name", "tiny")
    w.add_array("tokenizer.ggml.tokens", ["a", "bc", "Ġd"])
    w.add_array("tokenizer.ggml.scores", [0.5, -1.0, 2.0])
    w.add_key_value("tokenizer.ggml.token_type", [1, 3, 6], VT.ARRAY, sub_type=VT.INT32)
    w.add_tensor("a.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.add_tensor("b.weight", np.full((2, 32), 7, dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def refused(path: Path, *words: str) -> str:
    with pytest.raises(GGUFError) as e:
        open_gguf(str(path))
    msg = str(e.value)
    assert str(path) in msg, msg
    for word in words:
        assert word in msg, msg
    return msg


# --- valid files ---------------------------------------------------------------

def test_small_file_round_trip(tmp_path):
    g = open_gguf(str(good_file(tmp_path)))
    assert g.arch() == "qwen2"
    assert g.get("qwen2.block_count") == 2 and g.get("missing", 5) == 5
    assert g.get("tokenizer.ggml.add_bos_token") is False
    assert g.get("tokenizer.ggml.tokens") == ["a", "bc", "Ġd"]
    assert g.get("tokenizer.ggml.scores") == [0.5, -1.0, 2.0]
    assert g.get("tokenizer.ggml.token_type") == [1, 3, 6]
    assert g.value_types["tokenizer.ggml.token_type"] == (VT.ARRAY, VT.INT32)
    assert list(g.tensors) == ["a.weight", "b.weight"]
    a = g.tensors["a.weight"]
    assert (a.type_name, a.shape, a.n_bytes) == ("F32", (4, 3), 48)
    assert g.tensors["b.weight"].shape == (32, 2) and g.tensors["b.weight"].n_bytes == 128
    data = g.tensor_data("a.weight")
    assert data.dtype == np.uint8 and data.shape == (48,)
    assert data.view(np.float32).tolist() == list(range(12))
    assert (g.tensor_data("b.weight").view(np.float16) == 7).all()
    with pytest.raises(ValueError):
        data[0] = 1                       # read-only mapping
    with pytest.raises(GGUFError, match="no tensor named 'nope'"):
        g.tensor_data("nope")
    g.close()


@pytest.mark.real_model
def test_real_model_matches_gguf_reader(real_model_path):
    g = open_gguf(str(real_model_path))
    ref = gguf.GGUFReader(str(real_model_path))
    assert g.arch() == "qwen2" and g.shards == [str(real_model_path)]
    assert len(g.tensors) == len(ref.tensors) == 291
    for t in ref.tensors:
        mine = g.tensors[t.name]
        assert mine.ggml_type == int(t.tensor_type) and mine.type_name == t.tensor_type.name
        assert mine.shape == tuple(int(d) for d in t.shape)
        assert (mine.offset, mine.n_bytes) == (t.data_offset, t.n_bytes)
    for name in ("output_norm.weight", "blk.23.ffn_down.weight"):
        t = next(t for t in ref.tensors if t.name == name)
        assert np.array_equal(g.tensor_data(name), np.asarray(t.data).view(np.uint8).reshape(-1))
    for key in ("qwen2.block_count", "qwen2.context_length", "qwen2.attention.head_count_kv",
                "tokenizer.ggml.eos_token_id", "general.file_type"):
        assert g.get(key) == ref.fields[key].contents()
    assert g.get("qwen2.rope.freq_base") == pytest.approx(1e6)
    assert g.get("tokenizer.ggml.tokens") == ref.fields["tokenizer.ggml.tokens"].contents()
    assert len(g.get("tokenizer.ggml.merges")) == len(ref.fields["tokenizer.ggml.merges"].contents())
    assert g.get("tokenizer.chat_template") == ref.fields["tokenizer.chat_template"].contents()


# --- truncated and corrupt files -----------------------------------------------

def test_every_truncation_is_refused(tmp_path):
    full = good_file(tmp_path).read_bytes()
    cut = tmp_path / "cut.gguf"
    for n in range(len(full)):
        cut.write_bytes(full[:n])
        with pytest.raises(GGUFError, match="cut.gguf"):
            open_gguf(str(cut))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=4))
def test_corrupt_bytes_open_or_refuse(tmp_path, flips):
    path = tmp_path / "fuzz.gguf"
    if not path.exists():
        good_file(tmp_path, "fuzz_src.gguf").rename(path)
    raw = bytearray(path.read_bytes())
    bad = tmp_path / "fuzzed.gguf"
    for pos, byte in flips:
        raw[pos % len(raw)] = byte
    bad.write_bytes(bytes(raw))
    try:
        g = open_gguf(str(bad))
    except GGUFError as e:
        assert "fuzzed.gguf" in str(e)
    else:
        for name, info in g.tensors.items():
            assert g.tensor_data(name).shape == (info.n_bytes,)
        g.close()


def test_empty_and_missing_files(tmp_path):
    (tmp_path / "empty.gguf").write_bytes(b"")
    refused(tmp_path / "empty.gguf", "truncated", "0 bytes")
    refused(tmp_path / "absent.gguf", "cannot open")


@pytest.mark.parametrize("magic,version,words", [
    (b"GGML", 3, ["bad magic"]),
    (b"GGUF", 1, ["version 1"]),
    (b"GGUF", 4, ["version 4"]),
    (b"GGUF", 0x03000000, ["big-endian"]),
])
def test_magic_and_version(tmp_path, magic, version, words):
    path = tmp_path / "h.gguf"
    path.write_bytes(magic + struct.pack("<IQQ", version, 0, 0))
    refused(path, *words)


def test_absurd_counts_are_bounded_before_use(tmp_path):
    refused(raw_file(tmp_path, [], [], n_tensors=2**60), "tensor count 1152921504606846976", "at most")
    refused(raw_file(tmp_path, [], [], n_kv=2**63), "kv count 9223372036854775808", "at most")
    huge_str = struct.pack("<Q", 2**62) + b"k" * 16
    refused(raw_file(tmp_path, [huge_str + struct.pack("<I", 4)], [], n_kv=1), "key 0 (4611686018427387904 bytes)")
    arr = kv("big", VT.ARRAY, struct.pack("<IQ", VT.UINT64, 2**59))
    refused(raw_file(tmp_path, [arr], []), "'big' claims 576460752303423488 array elements", "at most")
    sarr = kv("strs", VT.ARRAY, struct.pack("<IQ", VT.STRING, 10**6) + s("x"))
    refused(raw_file(tmp_path, [sarr], []), "'strs' claims 1000000")
    sval = kv("name", VT.STRING, struct.pack("<Q", 2**40) + b"abc")
    refused(raw_file(tmp_path, [sval], []), "value of 'name'", "1099511627776 bytes")


def test_bad_values_are_refused(tmp_path):
    nested = kv("n", VT.ARRAY, struct.pack("<IQ", VT.ARRAY, 1) + struct.pack("<IQ", VT.UINT8, 1) + b"\1")
    refused(raw_file(tmp_path, [nested], []), "'n' is an array of arrays")
    refused(raw_file(tmp_path, [kv("t", 13, b"\0" * 8)], []), "'t' has value type 13")
    refused(raw_file(tmp_path, [kv("t", VT.ARRAY, struct.pack("<IQ", 99, 1) + b"\0")], []), "element type 99")
    refused(raw_file(tmp_path, [u32kv("a", 1), u32kv("a", 2)], []), "duplicate metadata key 'a'")
    refused(raw_file(tmp_path, [u32kv("", 1)], []), "key 0 is empty")
    refused(raw_file(tmp_path, [u32kv("general.alignment", 24)], [tinfo("w", [8])], b"\0" * 32),
            "general.alignment is 24")
    align64 = kv("general.alignment", VT.UINT64, struct.pack("<Q", 32))
    refused(raw_file(tmp_path, [align64], []), "general.alignment must be a uint32")


def test_bad_tensor_infos_are_refused(tmp_path):
    data = b"\0" * 256
    cases = [
        ([tinfo("w", [], n_dims=0)], "n_dims=0, must be 1..4"),
        ([tinfo("w", [1, 1, 1, 1, 1])], "n_dims=5, must be 1..4"),
        ([tinfo("w", [8, 0])], "dim 1 is 0, must be >= 1"),
        ([tinfo("w", [2**40, 2**40])], "more than 9223372036854775807 elements"),
        ([tinfo("w", [8], ggml_type=4)], "ggml type 4, not a known type"),
        ([tinfo("w", [8], ggml_type=99)], "ggml type 99"),
        ([tinfo("w", [48], ggml_type=12)], "row length 48, not a multiple of its block size 256"),
        ([tinfo("w", [8], offset=4)], "data offset 4, not a multiple of general.alignment 32"),
        ([tinfo("w", [8], offset=32)], "data offset 32, expected 0"),
        ([tinfo("w", [8]), tinfo("w", [8], offset=32)], "duplicate tensor name 'w'"),
        ([tinfo("w", [8]), tinfo("v", [8], offset=64)], "'v' has data offset 64, expected 32"),
        ([tinfo("w", [1024])], "ends past the file end"),
        ([tinfo("", [8])], "name '' must be 1..63 bytes"),
        ([tinfo("x" * 64, [8])], "must be 1..63 bytes"),
    ]
    for infos, words in cases:
        refused(raw_file(tmp_path, [], infos, data), words)


def test_hand_built_file_opens(tmp_path):
    """The raw encoders build valid files too, so the refusals above are about the one bad field."""
    data = np.arange(8, dtype=np.float32).tobytes() + np.ones(8, np.float32).tobytes()  # 32 B each
    g = open_gguf(str(raw_file(tmp_path, [u32kv("general.alignment", 32)],
                               [tinfo("w", [8]), tinfo("v", [8], offset=32)], data)))
    assert g.tensor_data("w").view(np.float32).tolist() == list(range(8))
    assert g.tensor_data("v").view(np.float32).tolist() == [1.0] * 8
    v2 = open_gguf(str(raw_file(tmp_path, [u32kv("k", 5)], [tinfo("w", [8])], data[:32], version=2, name="v2.gguf")))
    assert v2.get("k") == 5 and v2.tensors["w"].n_bytes == 32


# --- split sets ------------------------------------------------------------------

def write_split(tmp_path: Path, n: int, prefix: str = "model", bad_no: dict | None = None,
                name: str = "t{i}.weight", n_tensors_key: int | None = None) -> list[Path]:
    paths = []
    for i in range(n):
        path = tmp_path / f"{prefix}-{i + 1:05d}-of-{n:05d}.gguf"
        w = gguf.GGUFWriter(str(path), "qwen2")
        w.add_uint16("split.no", (bad_no or {}).get(i, i))
        w.add_uint16("split.count", n)
        w.add_int32("split.tensors.count", n if n_tensors_key is None else n_tensors_key)
        w.add_tensor(name.format(i=i), np.full(8, i, dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        paths.append(path)
    return paths


def test_split_set_opens_every_shard(tmp_path):
    paths = write_split(tmp_path, 3)
    g = open_gguf(str(paths[0]))
    assert g.shards == [str(p) for p in paths]
    assert list(g.tensors) == ["t0.weight", "t1.weight", "t2.weight"]
    for i, p in enumerate(paths):
        assert g.tensors[f"t{i}.weight"].path == str(p)
        assert g.tensor_data(f"t{i}.weight").view(np.float32).tolist() == [float(i)] * 8


def test_split_set_refusals(tmp_path):
    paths = write_split(tmp_path, 3)
    msg = refused(paths[1], "shard 2 of 3", "open the first shard")
    assert str(paths[0]) in msg
    paths[2].unlink()
    refused(paths[0], "missing 1", str(paths[2]))
    bad = write_split(tmp_path, 2, prefix="bad", bad_no={1: 0})
    refused(bad[0], "split.no=0 split.count=2", str(bad[1]))
    dup = write_split(tmp_path, 2, prefix="dup", name="same.weight")
    refused(dup[0], "tensor 'same.weight' is also in", str(dup[1]))
    short = write_split(tmp_path, 2, prefix="short", n_tensors_key=3)
    refused(short[0], "split.tensors.count is 3, the shards hold 2")


def test_split_keys_without_split_name(tmp_path):
    paths = write_split(tmp_path, 2)
    lone = tmp_path / "renamed.gguf"
    paths[0].rename(lone)
    refused(lone, "split.count=2", "does not follow")


# --- string arrays: bounded at open, decoded on first read -----------------------

def string_array(items: list[bytes]):
    from bloomery.gguf_file import StringArray
    offsets = np.array([sum(8 + len(x) for x in items[:i]) for i in range(len(items))], np.int64)
    return StringArray(b"".join(s(x) for x in items), offsets)


def test_string_array_reads_as_the_list_it_packs(tmp_path):
    gf = open_gguf(str(good_file(tmp_path)))
    tokens = gf.get("tokenizer.ggml.tokens")
    assert len(tokens) == 3 and tokens._items is None            # the count without decoding
    assert tokens == ["a", "bc", "Ġd"] and list(tokens) == ["a", "bc", "Ġd"] and tokens[1:] == ["bc", "Ġd"]
    assert tokens[-1] == "Ġd" and tokens._items is not None
    assert tokens != ["a", "bc"] and tokens != "abc"
    gf.close()
    assert tokens[0] == "a"                                       # its own bytes: the file may be closed


@pytest.mark.parametrize("items,ok", [
    ([b"a", b"", "é中".encode(), "🙂".encode()], True),
    ([], True),
    ([b"a", b"b\xfe"], False),
    ([b"\xc3", b"\xa9"], False),                  # each half of one character: the join alone would pass
    ([b"\xc3", b"", b"\xa9x"], False),
    ([b"x\xed\xa0\x80"], False),                  # an encoded surrogate
    ([b"\xc0\xaf"], False),                       # an overlong form
])
def test_string_array_all_utf8_matches_a_per_item_check(items, ok):
    arr = string_array(items)
    assert arr.all_utf8() is ok
    per_item = all(x.encode("utf-8", "surrogateescape").decode("utf-8", "strict") is not None
                   if not any(0xdc80 <= ord(c) <= 0xdcff for c in x) else False for x in arr)
    assert per_item is ok and arr.all_utf8() is ok                # decoded now: the same answer


def test_a_packed_vocabulary_that_is_not_utf8_is_refused_by_element():
    from bloomery.header_check import HeaderError, check_strings
    arr = string_array([b"a", b"\xc3", b"\xa9"] + [b"x"] * 600)
    with pytest.raises(HeaderError) as e:
        check_strings("m.gguf", {"tokenizer.ggml.tokens": arr}, {})
    assert "tokenizer.ggml.tokens'[1]" in str(e.value) and "0xc3" in str(e.value)


@pytest.mark.parametrize("items", [
    [b"a\xff", b"b"], [b"\xff"], [b"", b""], [b""], [b"x", b"\xed\xa0\x80", b"y"], [b"\xc3", b"\xa9"], [b"ok", b"\x80"],
])
def test_string_array_decodes_each_element_as_the_reader_always_did(items):
    arr = string_array(items)
    assert list(arr) == [x.decode("utf-8", "surrogateescape") for x in items]


def test_a_real_vocabulary_decodes_in_one_pass_to_the_same_strings(tokenizer_source):
    with open_gguf(str(tokenizer_source)) as gf:
        for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
            arr = gf.get(key)
            assert arr.all_utf8() and arr._items is None
            one_by_one = type(arr)(arr._raw, arr._offsets)._decode_each()
            assert list(arr) == one_by_one and len(one_by_one) > 150_000


@pytest.mark.parametrize("tail,words", [
    (struct.pack("<Q", 1000) + b"xy", ("element 2 of 'tok'", "(1000 bytes)")),
    (struct.pack("<Q", 2**64 - 1), ("element 2 of 'tok'",)),
    (b"\x01\x00", ("element 2 of 'tok' length",)),
])
def test_a_string_array_that_runs_past_the_end_names_its_element(tmp_path, tail, words):
    arr = kv("tok", VT.ARRAY, struct.pack("<IQ", VT.STRING, 3) + s("aaaa") + s("bbbb") + tail)
    refused(raw_file(tmp_path, [arr], []), "truncated", *words)


def test_string_array_find_matches_whole_elements_only():
    import struct

    import numpy as np

    from bloomery.gguf_file import StringArray
    items = ["a<|im_start|>", "<|im_start|>x", "<|im_start|>", "b", "<|im_start|>"]
    raw, offsets = b"", []
    for t in items:
        offsets.append(len(raw))
        raw += struct.pack("<Q", len(t.encode())) + t.encode()
    arr = StringArray(raw, np.array(offsets, np.int64))
    assert arr.find("<|im_start|>") == 2 and arr.find("b") == 3 and arr.find("zz") is None
    assert arr.find("<|im_start|>") == list(arr).index("<|im_start|>") == arr.find("<|im_start|>")   # decoded too
