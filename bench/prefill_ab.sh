#!/usr/bin/env bash
# prefill_ab.sh A_BIN B_BIN [WORDS] [ROUNDS] [THREADS] — one long prompt's prefill by two builds of
# `tandem generate` (its first token only: --max-tokens 1), alternating A and B ROUNDS times each on THREADS threads
# (default 2), the default model; prints every wall time and each build's median. WORDS (default 1500) repeats a
# 10-word sentence (1,501 tokens at 1500 with the default model).
set -euo pipefail
a=$1 b=$2 words=${3:-1500} rounds=${4:-5} threads=${5:-2}
model=$(cd "$(dirname "$0")/.." && pwd)/models/SmolLM2-135M-Instruct.Q4_1.gguf
prompt=$(python3 -c "print('The history of the city is long and complicated. ' * ($words // 10))")
run() { # $1: binary; prints the wall seconds
  local t0 t1
  t0=$(date +%s.%N)
  "$1" generate --model "$model" --max-tokens 1 --threads "$threads" --ids "$prompt" >/dev/null 2>&1
  t1=$(date +%s.%N)
  echo "$t1 - $t0" | bc
}
ta=() tb=()
for _ in $(seq "$rounds"); do
  ta+=("$(run "$a")")
  tb+=("$(run "$b")")
done
median() { printf '%s\n' "$@" | sort -n | awk '{v[NR]=$1} END {print (NR % 2) ? v[(NR+1)/2] : (v[NR/2]+v[NR/2+1])/2}'; }
echo "A $a: ${ta[*]} s; median $(median "${ta[@]}") s"
echo "B $b: ${tb[*]} s; median $(median "${tb[@]}") s"
