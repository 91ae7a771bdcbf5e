#!/usr/bin/env bash
# batch_ab.sh — batched decode and prefill of the Llama-2-7B shape (dummy weights), two builds side by side in
# alternating rounds (issue 51): tokens/s at decode batches 1, 64 and 256 (128 tokens after a 5-token prompt) and
# the time to first token of a 4,095-token prompt. On the GPU machine, from the bundle's folder:
#   bench/batch_ab.sh OUT A_BIN B_BIN [ROUNDS]
# where A_BIN and B_BIN are the two builds' `tandem` (B_BIN "": A alone). Prints one line a run, labelled a or b.
# The model's config is made in MODEL_DIR (/tmp/llama2-7b-dummy) unless it is there.
set -uo pipefail
out=$1 a=$2 b=$3 rounds=${4:-2}
m=${MODEL_DIR:-/tmp/llama2-7b-dummy}
[ -f "$m/config.json" ] || python3 "$(dirname "$0")/make_random_llama.py" "$m" --shape llama2-7b \
  --tokenizer "$(dirname "$0")/../fixtures/tiny-llama3" --config-only > "$out/make-dummy.txt" 2>&1 || exit 1
p4=$(python3 "$(dirname "$0")/prompt_of.py" "$m/tokenizer.json" 4095)
run() { # label binary args...
  local l=$1 t=$2
  shift 2
  "$t" generate --model "$m" --load-format dummy --device cuda --ignore-eos --ids "$@" 2>&1 >/dev/null |
    grep -E "tok/s|error" | sed -E 's/\| KV .*//' | sed "s/^/$l: /"
}
for r in $(seq 1 "$rounds"); do
  for v in a b; do
    t=$a; [ $v = b ] && t=$b
    [ -n "$t" ] || continue
    for n in 1 64 256; do run "round $r $v batch $n" "$t" --n $n --max-tokens 128 --kv-mib $((n * 80 + 512)) hello; done
    run "round $r $v prefill 4095" "$t" --max-tokens 1 --token-budget 4096 --kv-mib 4096 "$p4"
  done
done
