#!/usr/bin/env bash
# serve_compare.sh — `tandem bench` against a local tandem cluster (gRPC) and
# against llama.cpp's OpenAI-compatible server (llama-cpp-python[server]) on
# the same model, machine and workload, one after the other, each alone on the
# machine. Results, plots and a side-by-side summary go to
# bench/results/serve-DATE/{tandem,llamacpp}/ and serve-DATE/README.md.
#
# usage: bench/serve_compare.sh [PYTHON_WITH_LLAMA_CPP]   (default: python3)
# Environment: SWEEP (rates), N (requests per rate), THREADS (per worker /
# server threads: the cluster gets 1 prefill + 1 decode worker of THREADS
# each, llama.cpp 2*THREADS).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
py=${1:-python3}
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
sweep=${SWEEP:-0.2,0.4,0.8,1.6,3.2}
n=${N:-24}
threads=${THREADS:-1}
out=bench/results/serve-$(date -u +%Y-%m-%d)
mkdir -p "$out/tandem" "$out/llamacpp"
work=$(mktemp -d)
common=(--sweep "$sweep" --num-requests "$n" --input-len uniform:64:256 --output-len fixed:48 --ignore-eos
        --goodput ttft:1000,tpot:50 --slo-scale 0.5,1,2,4 --timeout 300 --seed 7)
pids=()
cleanup() { for p in "${pids[@]}"; do kill -TERM -- "-$p" 2>/dev/null || true; done; rm -rf "$work"; }
trap cleanup EXIT

# 1. tandem: tandem up (etcd, router, 1 prefill + 1 decode worker)
setsid build/bin/tandem up --model "$model" --worker-arg --threads --worker-arg "$threads" \
  >"$work/up.out" 2>"$work/up.err" &
pids+=($!)
for _ in $(seq 120); do [ -s "$work/up.out" ] && break; sleep 0.5; done
ep=$(head -1 "$work/up.out")
[ -n "$ep" ] || { echo "tandem up did not start:"; cat "$work/up.err"; exit 1; }
build/bin/tandem bench --endpoint "$ep" --api grpc "${common[@]}" --output "$out/tandem/run.json" \
  2>&1 | grep -v '^\[bench\] t=' | tee "$out/tandem/summary.txt"
kill -TERM -- "-${pids[0]}"; wait "${pids[0]}" || true; pids=()

# 2. llama.cpp's server on the same file
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
setsid "$py" -m llama_cpp.server --model "$model" --host 127.0.0.1 --port "$port" \
  --n_threads $((2 * threads)) --n_ctx 4096 --interrupt_requests False >"$work/llama.log" 2>&1 &
pids+=($!)
for _ in $(seq 120); do curl -sf "http://127.0.0.1:$port/v1/models" >/dev/null && break; sleep 0.5; done
build/bin/tandem bench --endpoint "127.0.0.1:$port" --api openai "${common[@]}" --output "$out/llamacpp/run.json" \
  2>&1 | grep -v '^\[bench\] t=' | tee "$out/llamacpp/summary.txt"
llama_version=$("$py" -c 'import llama_cpp; print(llama_cpp.__version__)')

# 3. side by side: README.md and the attainment curves of both in one plot
python3 bench/serve_side_by_side.py "$out" "$sweep" "$n" "$threads" "$llama_version"
