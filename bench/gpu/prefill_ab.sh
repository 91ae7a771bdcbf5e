#!/usr/bin/env bash
# prefill_ab.sh — the prompt attention's kernels side by side in one build, in alternating rounds (issue 51):
# TANDEM_CUDA_WGMMA=0 is the mma.sync kernel (attention.cu), 1.. the warpgroup-MMA variants (attention_wg.cu's
# wg_shapes). For each: the prompt kernels' checks against the CPU backend and their timings (1k, 4k, 16k fresh;
# 1k after 3k). Then, for 0, the default (WG_DEFAULT) and the variant whose 4k attention was fastest: the Llama-2-7B
# shape's 4k prefill whole and op by op (and its logits against the mma.sync kernel's), `tandem generate`'s time to
# first token of a 4,095-token prompt, and every check of tandem-cuda-check. On the GPU machine, from the bundle:
#   bench/prefill_ab.sh OUT "0 1 2 ..." ROUNDS
set -uo pipefail
out=$1 variants=$2 rounds=${3:-2}
here=$(cd "$(dirname "$0")/.." && pwd)
m=${MODEL_DIR:-/tmp/llama2-7b-dummy}
[ -f "$m/config.json" ] || python3 "$here/bench/make_random_llama.py" "$m" --shape llama2-7b \
  --tokenizer "$here/fixtures/tiny-llama3" --config-only > "$out/make-dummy.txt" 2>&1 || exit 1
for r in $(seq 1 "$rounds"); do
  for v in $variants; do
    TANDEM_CUDA_WGMMA=$v timeout 40 "$here/bin/tandem-cuda-check" --no-ops --no-timings --time-attention \
      > "$out/att-$v-$r.txt" 2>&1
    echo "variant $v round $r: checks $(grep -c ' ok$' "$out/att-$v-$r.txt") ok, $(grep -c FAIL "$out/att-$v-$r.txt") failed;" \
      "$(grep timing "$out/att-$v-$r.txt" | sed -E 's/.* x ([0-9]+) rows after ([0-9]+).*: ([0-9.]+) ms = ([0-9.]+) TFLOP.*/\1@\2 \3ms \4TF/' | tr '\n' ' ')"
  done
done
# the fastest at 4k (the mean of its rounds) of those whose checks passed
best=$(for v in $variants; do
  grep -q FAIL "$out"/att-"$v"-*.txt && continue
  grep -h "x 4096 rows after 0" "$out"/att-"$v"-*.txt | sed -E 's/.*: ([0-9.]+) ms.*/\1/' |
    awk -v v="$v" '{s += $1; n++} END {if (n) print s / n, v}'
done | sort -g | head -1 | cut -d' ' -f2)
echo "fastest at 4k: variant $best"
variants=$(echo 0 1 "$best" | tr ' ' '\n' | awk '!seen[$0]++' | tr '\n' ' ')
p4=$(python3 "$here/bench/prompt_of.py" "$m/tokenizer.json" 4095)
for v in $variants; do
  TANDEM_CUDA_WGMMA=$v timeout 150 "$here/bin/tandem-cuda-check" --no-ops --no-timings --dummy --time-model "$m" \
    > "$out/model-$v.txt" 2>&1
  echo "variant $v: $(grep -E '^timing model' "$out/model-$v.txt" | head -1 | sed -E 's/decode step.*//')"
  grep -E "ops, ms in the prefill:" "$out/model-$v.txt" | head -1 | sed -E 's/^ +/   /'
  grep -E "vs mma.sync" "$out/model-$v.txt" | sed -E 's/^/   /'
done
for r in $(seq 1 "$rounds"); do
  for v in $variants; do
    TANDEM_CUDA_WGMMA=$v timeout 60 "$here/bin/tandem" generate --model "$m" --load-format dummy --device cuda --ignore-eos \
      --ids --max-tokens 1 --token-budget 4096 --kv-mib 4096 "$p4" 2>&1 >/dev/null | grep -E "tok/s|error" |
      sed -E 's/\| KV .*//' | sed "s/^/variant $v round $r prefill 4095: /"
  done
done
for v in $variants; do
  [ "$v" = 0 ] && continue
  TANDEM_CUDA_WGMMA=$v timeout 200 "$here/bin/tandem-cuda-check" --crafted "$here/fixtures/crafted.gguf" --no-timings \
    > "$out/check-$v.txt" 2>&1
  echo "variant $v: every check: $(grep -E 'cuda check' "$out/check-$v.txt")"; grep FAIL "$out/check-$v.txt" | head
done
exit 0
