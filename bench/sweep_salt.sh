#!/usr/bin/env bash
# sweep_salt.sh — does a `tandem bench --sweep` rate see another rate's prompts?
# One cluster (`tandem up`, 1 prefill + 1 decode, one kvstore node: a store a
# later rate could hit) per run, a sweep of RATES over it, four runs:
#   trace-{salted,unsalted}     a Mooncake-format trace (whole conversations,
#                               bench/mooncake_sample.py; lengths / TRACE_DIVIDE):
#                               its own sharing (system prompt, later turns)
#   nosharing-{salted,unsalted} synthetic prompts sharing nothing
# salted is the default of a sweep (--salt 1: rate k uses salt 1 + k), unsalted
# is --salt none (every rate the same prompts, as before). Each run's summary
# goes to OUT/NAME.txt; OUT/table.md gives each rate's cached share of prompt
# tokens side by side.
#
# usage: bench/sweep_salt.sh   Environment: OUT, RATES (0.5,1,1.5), N (24), TRACE_DIVIDE (32),
#        SESSIONS (12), THREADS
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
export KVSTORES=1
. bench/cluster.sh
out=${OUT:-bench/results/bench-sweep-$(date -u +%Y-%m-%d)}
mkdir -p "$out"
rates=${RATES:-0.5,1,1.5}
n=${N:-24}
trace=$cluster_work/trace.jsonl
python3 bench/mooncake_sample.py ../shared/data/mooncake/conversation_trace.jsonl "$trace" \
  --sessions "${SESSIONS:-12}" --span 20 --max-gap 2 --seed 7 >/dev/null
run() { # name, then tandem bench's arguments
  local name=$1
  shift
  cluster_up 'kvstore: { dram_mb: 256 }'
  build/bin/tandem bench --endpoint "$ep" --api grpc --sweep "$rates" --num-requests "$n" "$@" \
    --goodput ttft:2000,tpot:200 --timeout 300 --seed 11 2>&1 | grep -v '^\[bench\] t=' | tee "$out/$name.txt"
  cluster_down
}
tr=(--workload trace "$trace" --trace-divide "${TRACE_DIVIDE:-32}" --ignore-eos)
syn=(--input-len uniform:128:384 --output-len fixed:16 --ignore-eos)
run trace-salted "${tr[@]}"
run trace-unsalted --salt none "${tr[@]}"
run nosharing-salted "${syn[@]}"
run nosharing-unsalted --salt none "${syn[@]}"
{
  echo "# Cached share of prompt tokens per rate ($(date -u +%Y-%m-%d), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//'), $(nproc) cores)"
  echo
  echo "Command: \`bench/sweep_salt.sh\` (RATES=$rates N=$n). Each run its own \`tandem up\` with a kvstore node."
  echo
  echo "| run | $(echo "$rates" | sed 's/,/ | /g') req/s |"
  echo "|---$(echo "$rates" | tr ',' '\n' | sed 's/.*/|---/' | tr -d '\n')|"
  for name in trace-salted trace-unsalted nosharing-salted nosharing-unsalted; do
    row=$(sed -n 's/^rate \([0-9.]*\): \([0-9.]*\)% of prompt tokens were served from the KV cache/\2%/p' "$out/$name.txt" |
          paste -sd'|' | sed 's/|/ | /g')
    echo "| $name | $row |"
  done
} >"$out/table.md"
cat "$out/table.md"
