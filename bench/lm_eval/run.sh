#!/usr/bin/env bash
# run.sh — lm-evaluation-harness, unmodified, against tandem's HTTP API and
# against llama.cpp's server (llama-cpp-python[server]) on the same GGUF, on
# make_task.py's multiple-choice task; compare.py puts accuracy and every
# choice's log-likelihood side by side in bench/results/lm-eval-DATE.md.
#
# usage: bench/lm_eval/run.sh PYTHON   (a Python with lm-eval[api] and llama-cpp-python[server], the latter
#        built for AVX2 as reference numerics follow it: CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON
#        -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF" pip install "llama-cpp-python[server]==0.3.36")
# Environment: NUMERICS (the workers' model.numerics: reference, the default here, rounds as llama.cpp; or fast)
# Three runs, each alone on the machine:
#   tandem  lm_eval --model local-completions: token-id prompts, tandem's /tokenizer_info and /tokenize
#   tandem  lm_eval --model gguf: text prompts, the continuation found by text_offset
#   llama   lm_eval --model gguf against llama.cpp's server (it has no /tokenizer_info for local-completions)
# and the reference: llama_ref.py, the same requests' log-likelihoods from llama-cpp-python in process.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
py=${1:?usage: run.sh PYTHON_WITH_LM_EVAL_AND_LLAMA_CPP}
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
name=SmolLM2-135M-Instruct.Q4_1
work=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill -TERM -- "-$p" 2>/dev/null || true; done; rm -rf "$work"; }
trap cleanup EXIT
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1
"$py" bench/lm_eval/make_task.py "$work/task" "${N:-60}"
lm_eval() { # OUT MODEL ARGS
  local t0=$SECONDS
  "$py" -m lm_eval --model "$2" --model_args "$3" --include_path "$work/task" --tasks tandem_mc \
    --output_path "$work/$1" --log_samples >"$work/$1.log" 2>&1 || { tail -30 "$work/$1.log"; exit 1; }
  echo "$1: $((SECONDS - t0)) s" | tee -a "$work/times"
}

# 1. tandem up: etcd, router, a prefill and a decode worker
setsid build/bin/tandem up --model "$model" --worker-arg --numerics --worker-arg "${NUMERICS:-reference}" >"$work/up.out" 2>"$work/up.err" &
pids+=($!)
for _ in $(seq 120); do grep -q "HTTP API at" "$work/up.err" && break; sleep 0.5; done
http=$(grep -o "HTTP API at http://[^ ]*/v1" "$work/up.err" | head -1 | sed 's/HTTP API at //')
[ -n "$http" ] || { echo "tandem up did not start:"; cat "$work/up.err"; exit 1; }
for _ in $(seq 120); do curl -sf "${http%/v1}/health" >/dev/null && break; sleep 0.5; done
lm_eval tandem-ids local-completions "base_url=$http/completions,model=$name,num_concurrent=4,max_retries=1"
lm_eval tandem-text gguf "base_url=${http%/v1}"
kill -TERM -- "-${pids[0]}"; wait "${pids[0]}" || true; pids=()

# 2. llama.cpp's server on the same file (log-probabilities of the prompt need logits_all)
port=$("$py" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
setsid "$py" -m llama_cpp.server --model "$model" --host 127.0.0.1 --port "$port" --n_threads 2 --n_ctx 2048 \
  --logits_all True >"$work/llama.log" 2>&1 &
pids+=($!)
for _ in $(seq 120); do curl -sf "http://127.0.0.1:$port/v1/models" >/dev/null && break; sleep 0.5; done
lm_eval llama-text gguf "base_url=http://127.0.0.1:$port"

t0=$SECONDS
"$py" bench/lm_eval/llama_ref.py "$model" "$work/task/mc.jsonl" "$work/llama-ref"
echo "llama-ref: $((SECONDS - t0)) s" >>"$work/times"
versions=$("$py" -c 'import importlib.metadata as m; print("lm-eval %s, llama-cpp-python %s" % (m.version("lm_eval"), m.version("llama_cpp_python")))')
"$py" bench/lm_eval/compare.py "$work" "$versions" "${NUMERICS:-reference}" > "bench/results/lm-eval-$(date -u +%Y-%m-%d).md"
cat "bench/results/lm-eval-$(date -u +%Y-%m-%d).md"
