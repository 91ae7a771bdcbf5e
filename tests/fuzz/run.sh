#!/usr/bin/env bash
# run.sh SECONDS — builds the libFuzzer targets with clang + ASan (build-fuzz/)
# and runs each for SECONDS from its seed corpus (the committed fixtures);
# run.sh --build-only builds them.
# Exit status is non-zero if any target finds a crash, a leak or an overread.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
secs=${1:-60}
cd "$root"
CC=clang cmake -S . -B build-fuzz -DTANDEM_FUZZ=ON -DTANDEM_SANITIZE=address -DTANDEM_TESTS=OFF \
  -DTANDEM_CUDA=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build-fuzz -j"$(nproc)" --target fuzz_gguf fuzz_safetensors fuzz_openai fuzz_grammar >/dev/null
[ "$secs" = --build-only ] && exit 0 # (tests/run.sh builds them early, beside other work)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/gguf" "$work/st" "$work/openai" "$work/grammar"
# structured output's sources (first byte: 0 JSON Schema, 1 regex, 2 choices a line), as clients send them
printf '0{"type":"object","properties":{"a":{"type":"array","items":{"$ref":"#/$defs/t"},"maxItems":3},"b":{"enum":[1,"x",null]},"c":{"type":"string","pattern":"[a-z]{2,4}"}},"$defs":{"t":{"anyOf":[{"type":"integer"},{"type":"null"}]}}}' > "$work/grammar/schema.bin"
printf '1(cat|dog)s? [0-9]{3}-\\d{2,}\\.[^a-z\\s]*(?:x|.)+$' > "$work/grammar/regex.bin"
printf '2yes\nno\nit depends' > "$work/grammar/choice.bin"
# OpenAI request bodies (first byte: 1 chat, 0 completion), as clients send them
printf '1{"model":"m","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":[{"type":"text","text":"Hi"}]}],"max_tokens":8,"temperature":0.5,"top_p":0.9,"stop":["\\n"],"stream":true,"stream_options":{"include_usage":true}}' > "$work/openai/chat.json"
printf '0{"model":"m","prompt":["Hello"],"max_tokens":16,"seed":7,"top_k":40,"min_p":0.1,"logit_bias":{"50256":-100},"presence_penalty":0.5,"frequency_penalty":0.5,"repetition_penalty":1.1,"ignore_eos":true,"n":1,"logprobs":null}' > "$work/openai/completion.json"
cp tests/fixtures/dequant/crafted.gguf "$work/gguf/"
head -c 65536 models/SmolLM2-135M-Instruct.Q4_1.gguf > "$work/gguf/model-head.gguf" 2>/dev/null || true
cp tests/fixtures/hf/tiny-llama3/model.safetensors tests/fixtures/hf/tiny-spm/model-00001-of-00002.safetensors "$work/st/"
# the targets two at a time (each is one process on one core): each still runs SECONDS
run_target() { # $1: name, $2: its corpus folder
  ./build-fuzz/bin/fuzz_"$1" "$work/$2" -max_total_time="$secs" -max_len=65536 -rss_limit_mb=2048 \
    -timeout=10 -artifact_prefix="$work/$1-" -print_final_stats=1 2>"$work/$1.log"
}
report() { # $1: name, $2: its exit status
  if [ "$2" -ne 0 ]; then
    echo "fuzz: $1 FOUND A PROBLEM:"; tail -40 "$work/$1.log"
    cp "$work/$1"-crash-* "$work/$1"-leak-* "$work/$1"-timeout-* . 2>/dev/null || true
    return 1
  fi
  echo "fuzz: $1 for ${secs}s: $(grep -E "stat::number_of_executed_units|Done" "$work/$1.log" | tr '\n' ' ')"
}
status=0
run_target gguf gguf & p1=$!
run_target safetensors st & p2=$!
r1=0 r2=0 r3=0 # (set -e: a target's failure is its status, not the script's end)
r4=0
wait $p1 || r1=$?
run_target openai openai & p3=$!
wait $p2 || r2=$?
run_target grammar grammar & p4=$!
wait $p3 || r3=$?
wait $p4 || r4=$?
report gguf $r1 || status=1
report safetensors $r2 || status=1
report openai $r3 || status=1
report grammar $r4 || status=1
exit $status
