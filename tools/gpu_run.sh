#!/usr/bin/env bash
# On a GPU machine with no network (the device): install the carried wheels, then run the
# steps named, in order, each under its own time limit, results under $OUT (or ./gpu-out).
#
#   tools/gpu_run.sh [llama-build] [tests] [bench] [variants] [profile] [llama] [grammar] [offload] [serve] [start] [depth]
#                    [offload-gap]
#
#   llama-build  start building llama-server (CUDA, sm_90) from the carried trimmed sdist $dev/llama-src.tar.xz
#             into /tmp/llama, in its own process session (setsid): the device ends a call's other processes,
#             but this one goes on while the machine stays warm (30 s between calls), so the next calls find
#             it (about 10 minutes on 16 cores at nice 15). Once /tmp/llama/done exists, offload, serve and
#             start use it as $LLAMA_SERVER. Wait for it with a bound: a build that fails or is still running
#             must not hold a call.
#   tests     the GPU tests (tests/test_cuda_*.py, or the pytest arguments in $TESTS), tests.log
#   bench     tools/bench_cuda.py on the Qwen3-30B-A3B-shaped file (written once into
#             $BENCH_WORK, in the background while the tests run), bench.json
#   variants  with bench: decode at depth 512 for each decode-step switch
#   profile   with bench: per-kernel times of the captured step and of a prompt
#   llama     with bench: llama.cpp's llama-bench on the same file, same run
#   grammar   tools/bench_grammar.py on the same file: decode under a JSON schema against free decode
#             through HTTP, grammar.json (with $dev/llama/llama-server carried: llama-server's too)
#   offload   tools/bench_offload.py on two Qwen3-30B-A3B-shaped files, --router-skew 0.2 and 0.6
#             (written once into $BENCH_WORK), bloomery-serve and llama-server ($LLAMA_SERVER, else
#             $dev/llama/llama-server; without one, bloomery alone) at the card budgets; the JSON
#             stays in $BENCH_WORK, so the same step in the next call goes on with the cells left
#             ($OFFLOAD_CELLS: --cells patterns), offload.json and offload.log
#   serve     tools/bench_serve.py on the bench file: K concurrent streams (K = 1, 4, 8, 16; P = 512
#             and 4096) and the multi-turn replay with and without the prompt cache, bloomery-serve
#             and llama-server (as for offload); the JSON stays in $BENCH_WORK, so the same step in
#             the next call goes on ($SERVE_CELLS: --cells patterns), serve.json and serve.log
#   start     tools/bench_start.py on the bench file: seconds to /health 200 with CuPy's kernel cache
#             empty, with the prebuilt kernels and with every module compiled by NVRTC ($START_MODES),
#             -c 32768 -np 4; start.json and start.log (the fatbins: carry bloomery/engine/cuda/prebuilt)
#   depth     tools/bench_steps.py on the bench file: prompt passes of 64, 256 and 512 ids at position
#             $DEPTH_AT (default 4000, a chat's later turn), uncaptured and captured, once with
#             BLOOMERY_CUDA_PROMPT_ATTN=gemm (not captured at a depth) and once with tc (the default);
#             depth-gemm.json, depth-tc.json, depth.log
#   offload-gap  the served offload against the engine in process, on the even file (written once into
#             $BENCH_WORK) at -fitt $GAP_FITT (default 132803, ~11.5 GB on the card) and -t $GAP_THREADS
#             (default 14): tools/bench_steps.py's decode (host ms a step, the card's share of the picks) and
#             tools/bench_offload.py's fit/tg128 cell, bloomery alone (host wait per generated id, the host's
#             share of the picks, experts moved), served with BLOOMERY_RESIDENCY_PROMPT_WEIGHT 1 and 0.03;
#             gap-steps.json, gap-offload-w1.json, gap-offload-w0.03.json, gap.log
#   ($SERVE_ARGS: more bench_serve flags for serve, e.g. --replay-own-documents)
#
# Carried beside the tree in $BLOOMERY_DEVICE_DIR (default .device, git-ignored):
#   whl/*.whl            pyzmq, structlog, gguf, llguidance (the device image lacks them)
#   tokenizer.gguf       tools/make_synthetic.py --tokenizer-only -o .device/tokenizer.gguf
#   llama-src.tar.xz     llama.cpp b11434's sdist tree (`llama.cpp/`), trimmed to fit: without models, docs,
#                        media, benches, tools/ui/src and tests, tools/server/tests, gguf-py, conversion and the
#                        other ggml backends (about 5.5 MB); for llama-build
#   (any of these may be carried as NAME.xz: it is unpacked first)
#   llama/part00, part01 llama-server's xz split in two (the tree and it must pass the 64 MiB a call carries: move
#                        tests/golden aside for that call); joined into llama/llama-server at the start
#   ssl-libs.tar.xz      libssl.so.3 and libcrypto.so.3 of the machine that built it, where the device lacks them
#   llama/llama-bench    llama.cpp's CUDA llama-bench (tools/ref/build-llama.sh --cuda-static),
#                        linked against libcublas.so.13, which the device has in its CUDA wheels
#   llama/llama-server   the same way: BLOOMERY_REF_TARGETS=llama-server tools/ref/build-llama.sh --cuda-static
#                        (about 45 minutes on 2 cores; 73 MB stripped, 42 MB as xz). With the tree that passes the
#                        64 MiB a call carries: split the .xz in two and carry both parts in one call whose other
#                        carried paths are small, then `cat part00 part01 | xz -dc` there (session 11's run L);
#                        no build then runs beside bloomery's measurements
set -uo pipefail
cd "$(dirname "$0")/.."
dev=${BLOOMERY_DEVICE_DIR:-.device}
out=${OUT:-gpu-out}
work=${BENCH_WORK:-/tmp/bench}
mkdir -p "$out" "$work"
steps=" $* "
has() { case "$steps" in *" $1 "*) return 0;; esac; return 1; }

for z in "$dev"/*.xz "$dev"/*/*.xz; do      # carried compressed to fit the 64 MiB the tree may take
  [ -f "$z" ] && [ ! -e "${z%.xz}" ] && xz -dc "$z" > "${z%.xz}"
done
if [ -f "$dev/llama/part00" ] && [ ! -x "$dev/llama/llama-server" ]; then   # carried as xz parts (64 MiB a call)
  cat "$dev"/llama/part* | xz -dc > "$dev/llama/llama-server" && chmod +x "$dev/llama/llama-server"
fi
if [ -x "$dev/llama/llama-server" ]; then   # its CUDA libraries from the device's wheels; libssl/libcrypto if carried
  for lib in libcublas.so.13 libcublasLt.so.13 libcudart.so.13; do
    at=$(find / -name "$lib" -not -path '/proc/*' 2>/dev/null | head -n 1)
    [ -n "$at" ] && export LD_LIBRARY_PATH=$(dirname "$at")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  done
  if [ -f "$dev/ssl-libs.tar.xz" ]; then
    mkdir -p /tmp/ssl && tar -C /tmp/ssl -xJf "$dev/ssl-libs.tar.xz" && export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:/tmp/ssl
  fi
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  "$dev"/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 BLOOMERY_TOKENIZER_GGUF=$PWD/$dev/tokenizer.gguf
nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm,clocks.max.sm --format=csv,noheader

built=/tmp/llama/llama.cpp/build/bin/llama-server
if has llama-build && [ ! -f /tmp/llama/started ] && [ -f "$dev/llama-src.tar.xz" ]; then
  mkdir -p /tmp/llama && touch /tmp/llama/started
  setsid nohup bash -c "cd /tmp/llama && tar xJf '$PWD/$dev/llama-src.tar.xz' && cd llama.cpp && \
    cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
      -DCMAKE_BUILD_TYPE=Release -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
      > /tmp/llama/cmake.log 2>&1 && nice -n 15 cmake --build build --target llama-server -j\$(nproc) \
      > /tmp/llama/build.log 2>&1; echo rc \$? > /tmp/llama/done" > /dev/null 2>&1 < /dev/null &
  echo "llama-build: started in its own session (/tmp/llama/build.log)"
fi
[ -z "${LLAMA_SERVER:-}" ] && [ -f /tmp/llama/done ] && [ -x "$built" ] && export LLAMA_SERVER=$built

big=$work/qwen3moe-30b-a3b-shape-q4_k_m-L48.gguf
if { has bench || has grammar || has serve || has start || has depth; } && [ ! -s "$big" ]; then        # the same file bench_cuda.py would write, started early
  (python3 - "$work" "$BLOOMERY_TOKENIZER_GGUF" > "$out/write.log" 2>&1 <<'EOF'
import sys, time
from pathlib import Path
sys.path.insert(0, "tools")
import bench_cuda, make_synthetic
work, tok = Path(sys.argv[1]), sys.argv[2]
t = time.perf_counter()
part = work / "big.part"
make_synthetic.write_synthetic(part, "qwen3moe", tokenizer_from=tok, **bench_cuda.SHAPE)
part.rename(work / "qwen3moe-30b-a3b-shape-q4_k_m-L48.gguf")
print(f"wrote the bench file in {time.perf_counter() - t:.0f} s")
EOF
  ) &
  writer=$!
fi

if has tests; then
  t0=$SECONDS
  # TESTS: other pytest arguments (default: every GPU test file)
  timeout "${TESTS_S:-330}" python3 -m pytest -q -rs -p no:cacheprovider \
    ${TESTS:-tests/test_cuda_backend.py tests/test_cuda_models.py tests/test_cuda_sources.py} 2>&1 \
    | tee "$out/tests.log" | tail -n 25
  echo "tests: $((SECONDS - t0)) s"
fi

if has bench; then
  [ -n "${writer:-}" ] && { wait "$writer"; cat "$out/write.log"; }
  args=(--work "$work" --tokenizer-from "$BLOOMERY_TOKENIZER_GGUF" --out "$out/bench.json")
  has variants && args+=(--variants)
  has profile && args+=(--profile)
  if has llama; then
    for lib in libcublas.so.13 libcublasLt.so.13 libcudart.so.13; do
      at=$(find / -name "$lib" -not -path '/proc/*' 2>/dev/null | head -n 1)
      [ -n "$at" ] && export LD_LIBRARY_PATH=$(dirname "$at")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    done
    chmod +x "$dev/llama/llama-bench"
    ldd "$dev/llama/llama-bench" | grep 'not found'
    args+=(--llama-bench "$dev/llama/llama-bench")
  fi
  t0=$SECONDS
  timeout "${BENCH_S:-420}" python3 tools/bench_cuda.py "${args[@]}" 2>&1 | tee "$out/bench.log" | tail -n 70
  echo "bench: $((SECONDS - t0)) s"
fi

if has grammar; then
  [ -n "${writer:-}" ] && wait "$writer" 2>/dev/null
  args=(--synthetic 30b --work "$work" --backend cuda --out "$out/grammar.json")
  [ -x "$dev/llama/llama-server" ] && args+=(--llama-server "$dev/llama/llama-server")
  t0=$SECONDS
  timeout "${GRAMMAR_S:-600}" python3 tools/bench_grammar.py "${args[@]}" 2>&1 | tee "$out/grammar.log" | tail -n 20
  echo "grammar: $((SECONDS - t0)) s"
fi

# tools/bench_$1.py with "${args[@]}" against llama-server ($LLAMA_SERVER, else the carried one; without
# one, bloomery alone), cells $2, under $3 seconds; its JSON stays in $work for the next call
against_llama() {
  local ls=${LLAMA_SERVER:-$dev/llama/llama-server} t0=$SECONDS
  if [ -x "$ls" ]; then args+=(--llama-server "$ls"); else args+=(--engines bloomery); fi
  [ -n "$2" ] && args+=(--cells "$2")
  timeout "$3" python3 "tools/bench_$1.py" "${args[@]}" 2>&1 | tee "$out/$1.log" | tail -n 40
  cp -r "$work/$1.json" "$work/logs" "$out/" 2>/dev/null
  echo "$1: $((SECONDS - t0)) s"
}

skew_file() {  # skew_file SHARE: $work/qwen3-30b-a3b-rSHARE.gguf, written once (--router-skew SHARE)
  local f=$work/qwen3-30b-a3b-r$1.gguf
  [ -s "$f" ] || { python3 tools/make_synthetic.py --shape qwen3-30b-a3b --router-skew "$1" \
    --tokenizer-from "$BLOOMERY_TOKENIZER_GGUF" -o "$f.part" > /dev/null && mv "$f.part" "$f"; }
}

if has offload; then
  skew_file 0.2 & skew_file 0.6 &
  wait
  args=(--model "even=$work/qwen3-30b-a3b-r0.2.gguf" --model "skew=$work/qwen3-30b-a3b-r0.6.gguf"
        --out "$work/offload.json")
  against_llama offload "${OFFLOAD_CELLS:-}" "${OFFLOAD_S:-540}"
fi

if has serve; then
  [ -n "${writer:-}" ] && wait "$writer" 2>/dev/null
  args=(--model "$big" --backend cuda --out "$work/serve.json" ${SERVE_ARGS:-})
  against_llama serve "${SERVE_CELLS:-}" "${SERVE_S:-540}"
fi

if has depth; then
  [ -n "${writer:-}" ] && wait "$writer" 2>/dev/null
  t0=$SECONDS
  for mode in gemm tc; do
    BLOOMERY_CUDA_PROMPT_ATTN=$mode timeout "${DEPTH_S:-200}" python3 tools/bench_steps.py -m "$big" \
      --prompts 64,256,512 --prompt-at "${DEPTH_AT:-4000}" --batches 1 --steps 8 --reps 5 --captured \
      --out "$out/depth-$mode.json" 2>&1 | sed "s/^/$mode: /" | tee -a "$out/depth.log" | grep -v '^[a-z]*: decode'
  done
  echo "depth: $((SECONDS - t0)) s"
fi

if has offload-gap; then
  f=$work/qwen3-30b-a3b-r0.2.gguf
  skew_file 0.2
  t0=$SECONDS
  timeout "${GAP_S:-150}" python3 tools/bench_steps.py -m "$f" -fitt "${GAP_FITT:-132803}" -t "${GAP_THREADS:-14}" \
    --prompts 512 --batches 1 --depth 512 --steps 128 --out "$out/gap-steps.json" 2>&1 | tee "$out/gap.log" | tail -n 8
  for w in 1 0.03; do     # BLOOMERY_RESIDENCY_PROMPT_WEIGHT: 0.03 weighs a 512-id prompt as one decode update
    BLOOMERY_RESIDENCY_PROMPT_WEIGHT=$w timeout "${GAP_S:-150}" python3 tools/bench_offload.py --engines bloomery \
      --model "even=$f" --threads "${GAP_THREADS:-14}" --cells 'even/bloomery/fit/tg128' --fresh \
      --out "$out/gap-offload-w$w.json" 2>&1 | sed "s/^/w=$w: /" | tee -a "$out/gap.log" | tail -n 6
  done
  echo "offload-gap: $((SECONDS - t0)) s"
fi

if has start; then
  [ -n "${writer:-}" ] && wait "$writer" 2>/dev/null
  t0=$SECONDS
  timeout "${START_S:-540}" python3 tools/bench_start.py --model "$big" --modes "${START_MODES:-auto,nvrtc}" \
    --work "$work/start" --bloomery-args "-c 32768 -np 4" --out "$out/start.json" 2>&1 | tee "$out/start.log" | tail -n 20
  echo "start: $((SECONDS - t0)) s"
fi
