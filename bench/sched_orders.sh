#!/usr/bin/env bash
# sched_orders.sh — the prefill worker's queue orders side by side
# (prefill.queue: fcfs, cache, mlq; engine/sched.h): the same cluster
# (`tandem up`, 1 prefill + 1 decode worker, no KV store: what a worker's
# pool does not hold it computes) and the same workload, once per
# order, one after the other, each alone on the machine; with REPS=2 the order
# of the runs is reversed in the second round, so a drift of the machine's
# speed favours none.
#
# WORKLOAD=trace (the default): Mooncake's conversation trace, whole
# conversations (bench/mooncake_sample.py: SESSIONS of them over SPAN seconds, seed 3; TRACE
# names another trace file), lengths
# and blocks divided by TRACE_DIVIDE (32: a 512-token block is 16 tokens),
# times multiplied by TIME_SCALE. WORKLOAD=synthetic: RATE requests/s, N
# requests, prompts log-uniform over INPUT (a mix of chats and documents) with
# PREFIX_GROUPS shared prefixes, outputs heavy-tailed (log-normal OUTPUT).
# Both roles run the order (the decode worker prefills too where the router
# places a prompt on it whole). Each run's `tandem bench` summary and JSON go
# to OUT/ORDER[-rN].{txt,json}, the router's Health before and after it (the
# workers' prompt tokens computed) to OUT/ORDER[-rN].{before,health}.json;
# OUT/table.md sums them up
# (bench/sched_orders_table.py).
#
# usage: bench/sched_orders.sh   Environment: ORDERS, REPS, OUT, WORKLOAD, SESSIONS, TRACE_DIVIDE,
#        SPAN, TRACE, TIME_SCALE, RATE, N, INPUT, OUTPUT, PREFIX_GROUPS, THREADS, PREFILL_MIB, DECODE_MIB, BUDGET, GOODPUT
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
KVSTORES=0
. bench/cluster.sh
orders=${ORDERS:-fcfs cache mlq}
out=${OUT:-bench/results/sched-orders-$(date -u +%Y-%m-%d)}
mkdir -p "$out"
if [ "${WORKLOAD:-trace}" = trace ]; then
  trace=${TRACE:-$root/../shared/data/mooncake/conversation_trace.jsonl}
  python3 bench/mooncake_sample.py "$trace" "$cluster_work/trace.jsonl" --sessions "${SESSIONS:-40}" \
    --span "${SPAN:-60}" --seed 3
  load=(--workload trace "$cluster_work/trace.jsonl" --trace-divide "${TRACE_DIVIDE:-32}"
        --time-scale "${TIME_SCALE:-1}")
else
  load=(--rate "${RATE:-2}" --num-requests "${N:-80}" --input-len "${INPUT:-loguniform:24:1500}"
        --output-len "${OUTPUT:-lognormal:24:1.0}" --ignore-eos --prefix-groups "${PREFIX_GROUPS:-4}"
        --prefix-share 0.5)
fi
goodput=${GOODPUT:-ttft:2000,tpot:200}
one() { # order, name
  cluster_up "$(printf 'prefill: { queue: %s, kv_mib: %s, token_budget: %s }\ndecode: { queue: %s, kv_mib: %s, token_budget: %s }' \
    "$1" "${PREFILL_MIB:-48}" "${BUDGET:-256}" "$1" "${DECODE_MIB:-192}" "${BUDGET:-256}")"
  # the workers' counts before (a start-up profile sweep is computed too)
  for _ in $(seq 60); do
    cluster_health "$out/$2.before.json"
    grep -q prompt_tokens_computed "$out/$2.before.json" && [ "$(grep -o '"role":' "$out/$2.before.json" | wc -l)" -ge 2 ] && break
    sleep 0.5
  done
  build/bin/tandem bench --endpoint "$ep" --api grpc "${load[@]}" \
    --goodput "$goodput" --timeout 600 --seed 11 --output "$out/$2.json" \
    2>&1 | grep -v '^\[bench\] t=' | tee "$out/$2.txt"
  cluster_health "$out/$2.health.json"
  cluster_down
}
list=($orders)
for r in $(seq "${REPS:-1}"); do
  for o in "${list[@]}"; do one "$o" "$o$([ "${REPS:-1}" -gt 1 ] && echo "-r$r")"; done
  list=($(printf '%s\n' "${list[@]}" | tac))
done
command -v gnuplot >/dev/null && rm -f "$out"/*.png "$out"/*.dat "$out"/*.gp
python3 bench/sched_orders_table.py "$out" $orders >"$out/table.md"
cat "$out/table.md"
