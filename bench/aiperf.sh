#!/usr/bin/env bash
# aiperf.sh — NVIDIA's aiperf (PyPI, unmodified) against tandem's OpenAI HTTP API,
# beside `tandem bench` on the same workload (bench/results/aiperf-*.md).
#
#   bench/aiperf.sh URL [RATE] [REQUESTS]      URL: the router's http://HOST:PORT (no /v1)
#
# aiperf needs a Hugging Face tokenizer and this machine reaches no hub: the
# tokenizer is built from the default model's GGUF with the suite's reference
# construction (tests/fixtures/tokenizer/reference.py) and saved to a folder.
# aiperf lives in its own venv (.venv-aiperf): it pins packages of its own.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
url=${1:?usage: bench/aiperf.sh URL [RATE] [REQUESTS]}
rate=${2:-1}
n=${3:-60}
venv=$root/.venv-aiperf
[ -x "$venv/bin/aiperf" ] || { python3 -m venv "$venv" && "$venv/bin/pip" install -q aiperf tokenizers; }
tok=$root/build/aiperf-tokenizer
model_file=$root/models/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f "$tok/tokenizer.json" ]; then
  "$venv/bin/pip" install -q gguf
  "$venv/bin/python3" - "$root" "$model_file" "$tok" <<'PY'
import sys
sys.path.insert(0, sys.argv[1] + "/tests/fixtures/tokenizer")
import reference
from transformers import PreTrainedTokenizerFast
t = reference.hf_from_gguf(sys.argv[2])
PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<|im_start|>", eos_token="<|im_end|>").save_pretrained(sys.argv[3])
PY
fi
model=$(python3 -c 'import json,sys,urllib.request; print(json.load(urllib.request.urlopen(sys.argv[1] + "/v1/models"))["data"][0]["id"])' "$url")
out=$(mktemp -d /tmp/aiperf-XXXX)
"$venv/bin/aiperf" profile --model "$model" --tokenizer "$tok" --url "$url" --endpoint-type completions --streaming \
  --request-rate "$rate" --request-count "$n" --isl 128 --osl 64 --extra-inputs ignore_eos:true --random-seed 7 \
  --goodput "time_to_first_token:500 inter_token_latency:50" --ui-type none --artifact-dir "$out" >"$out/run.log" 2>&1
grep -E "^(Time to First Token|Inter Token Latency|Request Latency|Goodput|Request Throughput)" \
  "$out/profile_export_aiperf.csv"
echo "aiperf's files: $out"
# the same workload through tandem bench:
#   build/bin/tandem bench --endpoint HOST:PORT --api openai|grpc --rate RATE --num-requests N \
#     --input-len fixed:128 --output-len fixed:64 --goodput ttft:500,tpot:50 --ignore-eos --seed 7 \
#     --tokenizer models/SmolLM2-135M-Instruct.Q4_1.gguf
