"""Tokenizer: llama.cpp's ids, id for id (goldens from llama-tokenize), decoding, streaming."""
from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from bloomery.gguf_file import open_gguf
from bloomery.tokenizer import StreamDecoder, Tokenizer, TokenizerError
from bloomery.tokenizer.pretok import category_of
import captures

GOLDEN = Path(__file__).resolve().parent / "golden" / "tokenizer"
CORPUS: list[str] = json.loads((GOLDEN / "corpus.json").read_text())
REF = Path.home() / ".cache" / "bloomery" / "ref"
BIN_DIR = REF / "build-cpu-11434.0.0" / "bin"

# golden name -> vocab-only file in llama.cpp's tree and the pre-tokenizer to force
VOCAB_FILES = {"llama-spm": ("ggml-vocab-llama-spm.gguf", None),
               "llama-bpe": ("ggml-vocab-llama-bpe.gguf", None),
               "gpt-2": ("ggml-vocab-gpt-2.gguf", None),
               "deepseek-v3": ("ggml-vocab-qwen2.gguf", "deepseek-v3"),
               "default": ("ggml-vocab-qwen2.gguf", "default")}


@pytest.fixture(scope="module")
def qwen_meta(real_model_path) -> dict:
    return open_gguf(str(real_model_path)).metadata


@pytest.fixture(scope="module")
def qwen(qwen_meta) -> Tokenizer:
    return Tokenizer.from_gguf(qwen_meta)


def _vocab_tokenizer(name: str, llama_cpp_src: Path) -> Tokenizer:
    file_name, pre = VOCAB_FILES[name]
    path = llama_cpp_src / "models" / file_name
    meta = dict(open_gguf(str(path)).metadata)
    if pre is not None:
        meta["tokenizer.ggml.pre"] = pre
    return Tokenizer.from_gguf(meta)


def _check_golden(tok: Tokenizer, golden: dict) -> None:
    bad = []
    for mode, parse in (("parse_special", True), ("no_parse_special", False)):
        for text, want in zip(CORPUS, golden[mode], strict=True):
            got = tok.encode(text, add_special=False, parse_special=parse)
            if got != want:
                bad.append(f"{mode} {text[:60]!r}\n  llama.cpp {want[:24]}\n  ours      {got[:24]}")
    for text, want in zip(CORPUS, golden["model_default_add_special"]):
        got = tok.encode(text, add_special=tok.add_bos, parse_special=True)
        if got != want:
            bad.append(f"add_special={tok.add_bos} {text[:60]!r}\n  llama.cpp {want[:24]}\n  ours {got[:24]}")
    assert not bad, f"{len(bad)} of {2 * len(CORPUS)} differ:\n" + "\n".join(bad[:10])


def test_corpus_is_broad():
    assert len(CORPUS) >= 200
    joined = "".join(CORPUS)
    for needle in ("<|im_start|>", "<|endoftext|>", "\u200d", "你好", "\t", "    ", "שלום", "́"):
        assert needle in joined


@pytest.mark.real_model
def test_qwen_ids_equal_llama_cpp(qwen):
    _check_golden(qwen, json.loads((GOLDEN / "qwen2-real.json").read_text()))


@pytest.mark.parametrize("name", sorted(VOCAB_FILES))
def test_vocab_file_ids_equal_llama_cpp(name, llama_cpp_src):
    golden_path = GOLDEN / f"{name}.json"
    assert golden_path.exists(), f"missing golden {golden_path}: run tools/ref/make_tokenizer_goldens.py"
    _check_golden(_vocab_tokenizer(name, llama_cpp_src), json.loads(golden_path.read_text()))


@pytest.mark.real_model
def test_server_reference_tokenize_and_detokenize(qwen):
    n_checked = 0
    for req_path in sorted(captures.CAPTURES.glob("tokenize*.request.json")):
        body = json.loads(req_path.read_text())["body_json"]
        answer = json.loads(req_path.with_name(req_path.name.replace("request", "response")).read_text())
        ids = qwen.encode(body["content"], add_special=body.get("add_special", False),
                          parse_special=body.get("parse_special", True))
        want = [t["id"] if isinstance(t, dict) else t for t in answer["tokens"]]
        assert ids == want, req_path.name
        n_checked += 1
    body, answer = captures.request("detokenize")["body_json"], captures.response("detokenize")
    assert qwen.decode(body["tokens"]) == answer["content"]
    assert n_checked >= 3


@pytest.mark.real_model
def test_qwen_special_tokens_and_eog(qwen):
    assert qwen.encode("<|im_start|>user<|im_end|>", False, True) == [151644, 872, 151645]
    assert 151644 not in qwen.encode("<|im_start|>", False, False)
    # user-defined tokens split out even without special parsing (as llama.cpp)
    assert qwen.encode("<tool_call>", False, False) == [151657]
    # llama.cpp's EOG list for this file (its load log): </s> is forced there too
    assert qwen.eog_ids == frozenset({128247, 151643, 151645, 151662, 151663, 151664})
    assert (qwen.bos_id, qwen.eos_id, qwen.eot_id, qwen.add_bos) == (151643, 151645, 151645, False)
    assert len(qwen.vocab.special_ids) == 23   # "special tokens cache size = 23"
    assert qwen.encode("hi", add_special=True) == qwen.encode("hi", add_special=False)
    assert qwen.n_vocab == 151936 and qwen.piece(9707) == "Hello"


@pytest.mark.real_model
def test_token_to_piece(qwen):
    assert qwen.token_to_piece(151645, special=True) == b"<|im_end|>"
    assert qwen.token_to_piece(151645, special=False) == b""
    assert qwen.token_to_piece(151657, special=False) == b"<tool_call>"   # user-defined renders
    assert qwen.token_to_piece(1879) == b" world"          # byte alphabet undone
    assert qwen.token_to_piece(198) == b"\n"
    assert qwen.token_to_piece(151700) == b""               # unused [PAD..] renders nothing
    with pytest.raises(TokenizerError, match=r"151936 .*out of range|out of range.*151936"):
        qwen.token_to_piece(151936)
    with pytest.raises(TokenizerError, match="-1"):
        qwen.decode([1, -1])


@pytest.mark.real_model
def test_decode_inverts_encode_on_corpus(qwen):
    for text in CORPUS:
        for parse in (True, False):
            ids = qwen.encode(text, add_special=False, parse_special=parse)
            assert qwen.decode(ids) == text, (parse, text)


@pytest.mark.real_model
def test_stream_decoder_holds_split_characters(qwen):
    by_byte = {b: qwen.vocab.text_to_id[c] for b, c in enumerate(_byte_chars())}
    ids = [by_byte[b] for b in "你".encode()]           # three byte tokens E4 BD A0
    dec = StreamDecoder(qwen)
    assert [dec.feed(i) for i in ids] == ["", "", "你"]
    emoji_ids = [by_byte[b] for b in "😀".encode()]
    dec = StreamDecoder(qwen)
    assert dec.feed(9707) == "Hello"
    assert dec.feed_many(emoji_ids[:3]) == ""
    assert dec.pending_bytes == "😀".encode()[:3]
    assert dec.feed(emoji_ids[3]) == "😀"
    dec.feed(emoji_ids[0])
    assert dec.flush() == "\ufffd"                        # an unfinished tail at the end
    assert dec.flush() == ""


@pytest.mark.real_model
def test_stream_decoder_matches_decode_on_corpus(qwen):
    for text in CORPUS:
        ids = qwen.encode(text, add_special=False, parse_special=True)
        dec = StreamDecoder(qwen)
        chunks = [dec.feed(i) for i in ids] + [dec.flush()]
        assert "".join(chunks) == text
        assert not any("\ufffd" in c for c in chunks if "\ufffd" not in text)


def _byte_chars() -> list[str]:
    from bloomery.tokenizer.bpe import BYTE_TO_CHAR
    return BYTE_TO_CHAR


def _mixed_text(qwen: Tokenizer, n_tokens: int) -> str:
    import argparse
    import dataclasses
    import email.message
    import typing
    parts = [inspect.getsource(m) for m in (argparse, typing, dataclasses, email.message)]
    text = "\n".join(parts[:2]) + "\n" + "\n".join(CORPUS) + "\n" + "\n".join(parts[2:])
    while len(qwen.encode(text, False, True)) < n_tokens:
        text += "\n" + text
    return text


@pytest.mark.real_model
def test_speed_32k_token_prompt(qwen, qwen_meta):
    text = _mixed_text(qwen, 32_000)
    ids = qwen.encode(text, False, True)
    cut = len(qwen.decode(ids[:32_000]))                 # exactly the first 32k tokens' text
    text = text[:cut]
    fresh = Tokenizer.from_gguf(qwen_meta)               # cold word cache
    t0 = time.perf_counter()
    n = len(fresh.encode(text, add_special=False, parse_special=True))
    dt_s = time.perf_counter() - t0
    assert n >= 31_990
    assert dt_s < 0.5, f"{n} tokens took {dt_s:.3f} s"


def test_bad_input_errors_name_the_problem():
    meta = _tiny_spm_meta()
    tok = Tokenizer.from_gguf(meta)
    with pytest.raises(TokenizerError, match=r"surrogate U\+D800 at index 2"):
        tok.encode("ab\ud800", add_special=False)
    with pytest.raises(TokenizerError, match="must be a string, got bytes"):
        tok.encode(b"abc")
    with pytest.raises(TokenizerError, match=r"token id 9999 is out of range.*\b266 tokens"):
        tok.decode([9999])
    with pytest.raises(TokenizerError, match="tokenizer.ggml.pre = 'no-such-pre'"):
        Tokenizer.from_gguf({**_tiny_bpe_meta(), "tokenizer.ggml.pre": "no-such-pre"})
    with pytest.raises(TokenizerError, match="tokenizer.ggml.model = 'wordpiece'"):
        Tokenizer.from_gguf({**meta, "tokenizer.ggml.model": "wordpiece"})
    with pytest.raises(TokenizerError, match="lacks 'tokenizer.ggml.tokens'"):
        Tokenizer.from_gguf({"tokenizer.ggml.model": "llama"})
    with pytest.raises(TokenizerError, match="token_type has 2 entries, fewer than the"):
        Tokenizer.from_gguf({**meta, "tokenizer.ggml.token_type": [1, 1]})


def _tiny_spm_meta() -> dict:
    """A small SPM vocab: <unk> <s> </s>, 256 byte tokens, and a few scored pieces."""
    pieces = {"▁": -1.0, "▁a": -2.0, "ab": -1.5, "▁ab": -0.5, "b": -3.0, "a": -3.0, "c": -3.0}
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + list(pieces)
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * 259 + list(pieces.values())
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.scores": scores}


def _tiny_bpe_meta() -> dict:
    chars = _byte_chars()
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2",
            "tokenizer.ggml.tokens": chars + ["ab", "Ġab"], "tokenizer.ggml.merges": ["a b", "Ġ ab"]}


def test_spm_scores_byte_fallback_and_space_prefix():
    tok = Tokenizer.from_gguf(_tiny_spm_meta())
    t2i = tok.vocab.text_to_id
    assert tok.add_bos and tok.bos_id == 1
    # "▁ab" wins on score; "c" is a piece; "é" is not -> its two UTF-8 bytes
    assert tok.encode("abc é", add_special=True) == [1, t2i["▁ab"], t2i["c"], t2i["▁"],
                                                     t2i["<0xC3>"], t2i["<0xA9>"]]
    assert tok.decode(tok.encode("abc é", add_special=False)) == "abc é"   # leading space dropped
    assert tok.encode("", add_special=True) == [1]


def test_bpe_merges_by_rank_and_bytes():
    tok = Tokenizer.from_gguf(_tiny_bpe_meta())
    t2i = tok.vocab.text_to_id
    assert tok.encode(" ab", False) == [t2i["Ġab"]]
    assert tok.encode("aab", False) == [t2i["a"], t2i["ab"]]
    assert tok.decode(tok.encode("x ab\n€", False)) == "x ab\n€"


def test_clean_spaces_pass_for_gpt2_style_vocabs():
    meta = {**_tiny_bpe_meta(), "tokenizer.ggml.pre": "gpt-2"}
    tok = Tokenizer.from_gguf(meta)
    ids = tok.encode("Hello , world . It 's ' ok ' ?", False)
    assert tok.decode(ids) == "Hello, world. It's'ok '?"


def test_unicode_classes_match_llama_cpp_tables(llama_cpp_src):
    """Our code point classes against llama.cpp's generated table (unicode-data.cpp)."""
    src = (llama_cpp_src / "src" / "unicode-data.cpp").read_text()
    body = src.split("unicode_ranges_flags = {", 1)[1].split("};", 1)[0]
    pairs = re.findall(r"\{0x([0-9A-Fa-f]+), 0x([0-9A-Fa-f]+)\}", body)
    ranges = [(int(a, 16), int(f, 16)) for a, f in pairs]
    ws_body = src.split("unicode_set_whitespace = {", 1)[1].split("};", 1)[0]
    ws = {int(x, 16) for x in re.findall(r"0x([0-9A-Fa-f]+)", ws_body)}
    names = {0x02: "N", 0x04: "L", 0x10: "M", 0x20: "P", 0x40: "S"}
    differ = []
    for (start, flags), (end, _) in zip(ranges, ranges[1:]):
        for cp in range(start, min(end, 0x110000)):
            if 0xD800 <= cp < 0xE000:
                continue
            want = "W" if cp in ws else names.get(flags & 0xFF, "O")
            got = category_of(chr(cp))
            if got != want:
                differ.append(f"U+{cp:04X} llama.cpp {want} ours {got}")
    assert not differ, f"{len(differ)} code points differ: {differ[:20]}"


@pytest.mark.live_reference
@pytest.mark.real_model
def test_live_llama_tokenize(qwen, real_model_path):
    exe = BIN_DIR / "llama-tokenize"
    if not exe.exists():
        pytest.skip(f"{exe} not built (tools/ref/build-llama.sh)")
    for text in CORPUS[::12]:
        for parse in (True, False):
            with tempfile.NamedTemporaryFile("wb", delete=False) as f:
                f.write(text.encode())
            cmd = [str(exe), "-m", str(real_model_path), "-f", f.name, "--ids", "--no-escape",
                   "--log-disable", "--no-bos"] + ([] if parse else ["--no-parse-special"])
            out = subprocess.run(cmd, capture_output=True, check=True).stdout.decode()
            os.unlink(f.name)
            want = json.loads([ln for ln in out.splitlines() if ln.startswith("[")][-1])
            assert qwen.encode(text, False, parse) == want, text


def test_special_spellings_split_longest_first():
    meta = _tiny_bpe_meta()
    n = len(meta["tokenizer.ggml.tokens"])
    meta = {**meta, "tokenizer.ggml.tokens": meta["tokenizer.ggml.tokens"] + ["<x>", "<x><y>"],
            "tokenizer.ggml.token_type": [1] * n + [4, 3]}   # user-defined, control
    tok = Tokenizer.from_gguf(meta)
    t2i = tok.vocab.text_to_id
    ux, cxy = t2i["<x>"], t2i["<x><y>"]
    assert tok.encode("a<x><y>b<x>", False, parse_special=True) == [t2i["a"], cxy, t2i["b"], ux]
    # without special parsing the control token is text; the user-defined one still splits
    assert tok.encode("a<x><y>b<x>", False, parse_special=False) == \
        [t2i["a"], ux, t2i["<"], t2i["y"], t2i[">"], t2i["b"], ux]
    assert tok.decode([cxy], special=False) == "" and tok.decode([ux], special=False) == "<x>"


# llama.cpp's own tokenizer fixtures (tests/test-tokenizer-0 checks llama.cpp against them)
LLAMA_CPP_FIXTURES = ["qwen2", "qwen35", "gpt-2", "llama-bpe", "llama-spm", "phi-3", "deepseek-coder",
                      "falcon", "mpt", "starcoder", "refact", "command-r"]


@pytest.mark.parametrize("name", LLAMA_CPP_FIXTURES)
def test_llama_cpp_vocab_fixtures(name, llama_cpp_src):
    path = llama_cpp_src / "models" / f"ggml-vocab-{name}.gguf"
    tok = Tokenizer.from_gguf(open_gguf(str(path)).metadata)
    texts = Path(f"{path}.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    wants = Path(f"{path}.out").read_text().split("\n")
    assert len(texts) >= 40
    for text, want in zip(texts, wants, strict=True):
        want_ids = [int(x) for x in want.split()]
        assert tok.encode(text, add_special=False, parse_special=False) == want_ids, text


def test_merge_ranks_keyed_by_the_stored_merge_answer_as_pairs_did():
    """parse_merges keys by "LEFT RIGHT"; the encoder's symbols (the byte alphabet) hold no space, so a
    pair's key finds the merge that cuts to it at the first space after its first character, first rank kept."""
    from bloomery.tokenizer.bpe import BYTE_TO_CHAR, parse_merges
    assert " " not in BYTE_TO_CHAR
    merges = ["", " ", "a", "a b", " a b", "ab  c", "a b c", "Ġ t", "é 中", "a b", "x y"]
    by_pair: dict = {}
    for rank, m in enumerate(merges):
        cut = m.find(" ", 1)
        by_pair.setdefault((m[:cut], m[cut + 1:]) if cut >= 0 else ("", ""), rank)
    ranks = parse_merges(merges)
    for left in ("a", "ab", "Ġ", "é", "x", "b"):
        for right in ("b", "c", "t", "中", "y", "b c"[:1]):
            assert ranks.get(left + " " + right) == by_pair.get((left, right)), (left, right)
