#!/usr/bin/env bash
# A/B of two tandem builds (bundle/bin/t-A, t-B): decode tok/s at batch n and a prompt of about L tokens, alternating.
set -u
export LD_LIBRARY_PATH=$PWD/bundle/lib UCX_MODULE_DIR=$PWD/bundle/lib/ucx
m7=/tmp/tandem-gpu-work/llama2-7b
[ -f "$m7/model.safetensors" ] || bash bundle/run.sh make7b > /dev/null 2>&1
bundle/bin/cc-ks --no-timings > "$OUT/ops-ks.txt" 2>&1; grep -E "cuda check|FAIL" "$OUT/ops-ks.txt" | head -5
for pass in 1 2; do
  for cfg in 64:200 64:600 64:1000 64:2500 256:200 256:600 128:1000; do
    n=${cfg%%:*} L=${cfg##*:}
    p=$(python3 -c "print(' '.join(['hello'] * ($L // 4)))")
    for v in base ks; do
      r=$(bundle/bin/t-$v generate --model "$m7" --device cuda --n "$n" --max-tokens 64 --ignore-eos --kv-mib 90000 "$p" 2>&1 >/dev/null |
          grep -o 'prompt [0-9]* tokens x [0-9]*\|= [0-9.]* tok/s' | tr '\n' ' ')
      echo "pass $pass n $n L $L $v: $r" | tee -a "$OUT/ksab.txt"
    done
  done
done
