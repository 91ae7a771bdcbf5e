#!/usr/bin/env bash
# build_llamacpp.sh — llama.cpp's CUDA build of the tool issue 51's peer
# columns run (llama-batched-bench: batched decode and prompt processing),
# for Hopper (sm_90), statically linked so that the bundle carries one binary
# and no libraries; the source is the llama.cpp that PyPI's llama-cpp-python
# sdist vendors (a package registry, where GitHub is out of reach). ~20
# minutes on two cores (the CUDA backend is ~200 files of nvcc): run it once,
# then
#   LLAMACPP=DIR/build deploy/gpu-bundle.sh ... 17
#
#   bench/gpu/build_llamacpp.sh DIR [VERSION]     (VERSION of llama-cpp-python; default 0.3.36)
set -euo pipefail
dir=${1:?usage: build_llamacpp.sh DIR [VERSION]}
ver=${2:-0.3.36}
root=$(cd "$(dirname "$0")/../.." && pwd)
py=$root/.venv/bin/python
[ -x "$py" ] || py=python3
mkdir -p "$dir"
cd "$dir"
[ -f "llama_cpp_python-$ver.tar.gz" ] ||
  "$py" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$ver" -d . >/dev/null
[ -d "llama_cpp_python-$ver" ] || tar xzf "llama_cpp_python-$ver.tar.gz"
src=$dir/llama_cpp_python-$ver/vendor/llama.cpp
cmake -S "$src" -B "$dir/build" -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_CURL=OFF -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc >/dev/null
cmake --build "$dir/build" -j"$(nproc)" --target llama-batched-bench >/dev/null
ln -sfn "$src/gguf-py" "$dir/build/gguf-py"
echo "$dir/build: llama.cpp $(git -C "$src" rev-parse --short HEAD 2>/dev/null || echo "(llama-cpp-python $ver)")"
ls -la "$dir/build/bin/llama-batched-bench"
