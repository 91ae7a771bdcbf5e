#!/usr/bin/env bash
# router_policies.sh — the placement policies side by side (DESIGN.md §5): the
# same cluster (`tandem up`, 2 prefill + 1 decode workers, 3 kvstore nodes) and
# the same workload, once per router.placement, one after the other, each alone
# on the machine; with REPS=2 the order is reversed for the second round, so a
# drift of the machine's speed does not favour one policy.
#
# The workload: the synthetic prefix-heavy one (PREFIX_GROUPS groups sharing
# PREFIX_SHARE of each prompt, INPUT lengths, RATE requests/s, N requests), or
# with TRACE=FILE a Mooncake-format trace (bench/mooncake_sample.py makes one
# from whole conversations) with lengths divided by TRACE_DIVIDE and its
# times multiplied by TIME_SCALE (0.5: twice the rate).
# With SLOW_THREADS=N the cluster's workers are unequal, as in a fleet of
# mixed machines: one prefill worker runs on a second node agent (tandem up
# --join) with N threads, the others with THREADS (bench/cluster.sh); its id
# goes to OUT/POLICY[-rN].slow and the table gives its share of the requests.
# With ROUTER_SLO=1 the router's config carries GOODPUT's SLOs (router.ttft_slo_ms,
# tpot_slo_ms), as a user who states them sets them: every policy gets them, and
# the one that predicts (predictive) rejects early what it predicts will miss them.
# Each run's `tandem bench` summary and JSON go to OUT/POLICY[-rN].{txt,json}
# with the router's Health after it; OUT/table.md sums them up.
#
# usage: bench/router_policies.sh   Environment: POLICIES, REPS, OUT, RATE, N,
#        THREADS, PREFIX_GROUPS, PREFIX_SHARE, INPUT, OUTPUT, TRACE,
#        TRACE_DIVIDE, TIME_SCALE, SLOW_THREADS, PREFILL_MIB, DECODE_MIB, GOODPUT (ttft:MS,tpot:MS), KVSTORES (3),
#        ROUTER_SLO
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
. bench/cluster.sh
policies=${POLICIES:-least_loaded round_robin kv_cost predictive}
out=${OUT:-bench/results/router-policies-$(date -u +%Y-%m-%d)}
mkdir -p "$out"
if [ -n "${TRACE:-}" ]; then
  load=(--workload trace "$TRACE" --trace-divide "${TRACE_DIVIDE:-32}" --time-scale "${TIME_SCALE:-1}")
else
  load=(--rate "${RATE:-1}" --num-requests "${N:-60}" --input-len "${INPUT:-uniform:128:512}"
        --output-len "${OUTPUT:-fixed:16}" --ignore-eos --prefix-groups "${PREFIX_GROUPS:-6}"
        --prefix-share "${PREFIX_SHARE:-0.8}")
fi
goodput=${GOODPUT:-ttft:1000,tpot:100}
slo=""
if [ -n "${ROUTER_SLO:-}" ]; then
  slo=$(echo "$goodput" | sed -E 's/ttft:([0-9]+),tpot:([0-9]+)/, ttft_slo_ms: \1, tpot_slo_ms: \2/')
  [[ $slo == ", ttft_slo_ms: "* ]] || { echo "ROUTER_SLO needs GOODPUT as ttft:MS,tpot:MS, not '$goodput'" >&2; exit 2; }
fi
one() { # policy, name
  local pol=$1 name=$2
  cluster_up "$(printf 'router: { placement: %s%s }\nprefill: { count: 2, kv_mib: %s }\ndecode: { kv_mib: %s }\nkvstore: { dram_mb: 256 }' \
    "$pol" "$slo" "${PREFILL_MIB:-48}" "${DECODE_MIB:-96}")"
  build/bin/tandem bench --endpoint "$ep" --api grpc "${load[@]}" \
    --goodput "$goodput" --timeout 300 --seed 11 --output "$out/$name.json" \
    2>&1 | grep -v '^\[bench\] t=' | tee "$out/$name.txt"
  cluster_health "$out/$name.health.json"
  [ -z "${SLOW_THREADS:-}" ] || echo "$cluster_slow_id" >"$out/$name.slow"
  cluster_down
}
order=($policies)
for r in $(seq "${REPS:-1}"); do
  for pol in "${order[@]}"; do one "$pol" "$pol$([ "${REPS:-1}" -gt 1 ] && echo "-r$r")"; done
  order=($(printf '%s\n' "${order[@]}" | tac))
done
# the SVG plots stay; without gnuplot no plot was drawn, and the scripts and data that draw them later stay
command -v gnuplot >/dev/null && rm -f "$out"/*.png "$out"/*.dat "$out"/*.gp
python3 bench/router_policies_table.py "$out" $policies >"$out/table.md"
cat "$out/table.md"
