#!/usr/bin/env bash
# ab.sh — A/B of tandem-cuda-check builds on the GPU machine, run from the
# repository root there: `bash bundle/bench/ab.sh base new ...` times the
# Llama-2-7B shape's captured decode step (`--time-model`) with each build
# bundle/bin/cc-<name> in turn, twice over, after the ops check of each (OPS
# names the builds to check instead; OPS="" checks none). Make the builds on
# the development VM: change the source, `cmake --build build-gpu --target
# tandem-cuda-check`, copy build-gpu/bin/tandem-cuda-check to
# bundle/bin/cc-<name> (stripped) after deploy/gpu-bundle.sh. The model is made
# on the machine the first time (bundle/run.sh make7b).
set -u
export LD_LIBRARY_PATH=$PWD/bundle/lib UCX_MODULE_DIR=$PWD/bundle/lib/ucx
m7=${WORK:-/tmp/tandem-gpu-work}/llama2-7b
[ -f "$m7/model.safetensors" ] || bash bundle/run.sh make7b > /dev/null 2>&1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
vs="$*"
for v in ${OPS-$vs}; do
  echo "== $v ops"
  bundle/bin/cc-"$v" --no-timings > "${OUT:-/tmp}/ops-$v.txt" 2>&1
  grep -E "cuda check|FAIL" "${OUT:-/tmp}/ops-$v.txt" | head -5
done
for pass in 1 2; do
  for v in $vs; do
    echo "== $v pass $pass"
    bundle/bin/cc-"$v" --no-ops --no-timings --time-model "$m7" 2>&1 | grep -E "timing model|edges" | head -2
  done
done
