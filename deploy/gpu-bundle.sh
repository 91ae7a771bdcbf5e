#!/usr/bin/env bash
# gpu-bundle.sh — builds tandem with CUDA for Hopper and gathers what a GPU
# machine run needs (../shared/GPU.md): bundle/ holds the binaries, every
# shared library they load that is neither glibc nor the CUDA driver (cuBLAS is
# the machine's own), the fixtures, the benchmark scripts, run.sh and the first
# part of the default model; bundle-model/ holds the model's second part (the
# device tool carries at most 64 MiB a call: carry bundle/ on one call and
# bundle-model/ on the next). On the GPU machine: bundle/run.sh, which checks
# every op against the CPU backend, whole models against the CPU backend and
# transformers, then benchmarks a Llama-2-7B-shaped model beside transformers
# and prints a table; logs go to $OUT.
# The programs are carried xz-compressed (each holds its CUDA kernels: ~6 MB, ~1.8 compressed; the tool carries
# 64 MiB a call, the repository's ~7.5 MB included); bundle/run.sh unpacks them in place first (`bundle/run.sh 0`
# unpacks and runs nothing).
#   deploy/gpu-bundle.sh            everything (bundle/ is then over the tool's 64 MiB a call: carry it compressed)
#   deploy/gpu-bundle.sh 9 10 18    only what sections 9, 10 and 18 need (the cluster's programs, etcd, the benchmark
#                                   scripts; no tandem-cuda-check, tandem-gemv-study or default model)
#   deploy/gpu-bundle.sh 1 11       sections of the backend alone (1-5, 11, 12): no cluster programs, no etcd
#   LLAMACPP=DIR deploy/gpu-bundle.sh 17   also bundle-llamacpp/, llama.cpp's batched bench for section 17's peer
#                                   (bench/gpu/build_llamacpp.sh builds it): carried on a call of its own, bundle/
#                                   being on the machine from the call before
set -euo pipefail
cluster_only=1 backend_only=1
for s in "${@:-all}"; do case $s in 9|10|18) ;; *) cluster_only=0 ;; esac; done
for s in "${@:-all}"; do case $s in 1|2|3|4|5|11|12|13|16|17) ;; *) backend_only=0 ;; esac; done
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
cmake -S . -B build-gpu -DTANDEM_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DTANDEM_TESTS=OFF \
  -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build-gpu -j"$(nproc)" --target tandem tandem-cuda-check tandem-router tandem-prefill tandem-decode \
  tandem-kvstore tandem-bench-kvxfer tandem-gemv-study tandem-gemm-study tandem-bench-allreduce >/dev/null
rm -rf bundle bundle-model* && mkdir -p bundle/bin bundle/lib bundle/fixtures bundle/bench bundle-model-b bundle-model-c
cp build-gpu/bin/tandem build-gpu/bin/tandem-cuda-check build-gpu/bin/tandem-router build-gpu/bin/tandem-prefill \
  build-gpu/bin/tandem-decode build-gpu/bin/tandem-kvstore build-gpu/bin/tandem-bench-kvxfer \
  build-gpu/bin/tandem-gemv-study build-gpu/bin/tandem-gemm-study build-gpu/bin/tandem-bench-allreduce bundle/bin/
strip bundle/bin/*
for b in bundle/bin/*; do ldd "$b"; done | awk '$3 ~ /^\// {print $3}' | sort -u |
  grep -Ev '/(libc|libm|libdl|librt|libpthread|ld-linux[^/]*|libgcc_s|libstdc\+\+|libcublas|libcublasLt)\.so' |
  while read -r l; do cp -L "$l" bundle/lib/; done
strip --strip-unneeded bundle/lib/*.so* 2>/dev/null || true
xz -9 -T0 -c "$(command -v etcd)" > bundle/bin/etcd.xz # tandem up's etcd (section 6), unpacked there
ucx=$(dirname "$(ldd build-gpu/bin/tandem | awk '/libucp/ {print $3}')")/ucx
[ -d "$ucx" ] && mkdir -p bundle/lib/ucx && cp -L "$ucx"/libuct_*.so.0 "$ucx"/libucm_*.so.0 bundle/lib/ucx/ 2>/dev/null || true
cp tests/fixtures/dequant/crafted.gguf bundle/fixtures/
cp -r tests/fixtures/hf/tiny-llama3 bundle/fixtures/
cp tests/fixtures/hf/make_logits_hf.py tests/fixtures/hf/make_fp8_ref.py bundle/fixtures/
cat /usr/share/common-licenses/GPL-3 /usr/share/common-licenses/Apache-2.0 > bundle/fixtures/ppl.txt
cp bench/gpu/make_random_llama.py bench/gpu/hf_bench.py bench/gpu/disagg_gpu.py bench/gpu/distserve.py bench/gpu/ab.sh \
  bench/gpu/batch_ab.sh bench/gpu/prefill_ab.sh bench/gpu/prompt_of.py bench/gpu/compile_peer.py \
  bench/gpu/make_random_gguf.py bench/gpu/peers_table.py bench/gpu/ncu_steps.sh bundle/bench/
if [ -n "${LLAMACPP:-}" ]; then # section 17's llama.cpp peer (bench/gpu/build_llamacpp.sh's build), a call of its own
  rm -rf bundle-llamacpp && mkdir -p bundle-llamacpp
  strip -o bundle-llamacpp/llama-batched-bench "$LLAMACPP"/bin/llama-batched-bench
  xz -6 -T0 bundle-llamacpp/llama-batched-bench # ~41 MB: CUDA code for every quantization llama.cpp has
  cp -rL "$LLAMACPP"/gguf-py bundle-llamacpp/ && rm -rf bundle-llamacpp/gguf-py/tests
fi
if [ "$cluster_only" -eq 1 ]; then # sections 9 and 10 run the 7B shape made there: no op checks, no default model
  rm -f bundle/bin/tandem-cuda-check bundle/bin/tandem-gemv-study bundle/bin/tandem-gemm-study
  rmdir bundle-model-b bundle-model-c
fi
if [ "$backend_only" -eq 1 ]; then # the backend's checks and benchmarks: tandem and tandem-cuda-check
  rm -f bundle/bin/tandem-router bundle/bin/tandem-prefill bundle/bin/tandem-decode bundle/bin/tandem-kvstore \
    bundle/bin/tandem-bench-kvxfer bundle/bin/tandem-bench-allreduce bundle/bin/etcd.xz
fi
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
if [ "$cluster_only" -eq 0 ] && [ -f "$model" ]; then
  a=$((12 * 1000 * 1000)) size=$(stat -c %s "$model") # bundle/ has about 45 MB besides
  b=$(((size - a) / 2))
  head -c "$a" "$model" > bundle/smollm2.part-a
  dd if="$model" of=bundle-model-b/smollm2.part-b bs=1M iflag=skip_bytes,count_bytes skip="$a" count="$b" status=none
  tail -c +"$((a + b + 1))" "$model" > bundle-model-c/smollm2.part-c
  sha256sum "$model" | cut -d' ' -f1 > bundle/smollm2.sha256
fi
xz -9 -T0 bundle/bin/tandem* # (after ldd above read them); run.sh unpacks them
cp deploy/gpu-run.sh bundle/run.sh
chmod +x bundle/run.sh
du -sh bundle bundle-model-* 2>/dev/null || true # (no bundle-model-* for the cluster sections)
