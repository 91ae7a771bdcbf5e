#!/usr/bin/env bash
# router_overload.sh — early rejection under overload (DESIGN.md §5): the
# same cluster as bench/router_policies.sh (`tandem up`, 2 prefill + 1 decode
# workers, 3 kvstore nodes, router.placement predictive, router SLOs TTFT
# TTFT_MS and TPOT TPOT_MS), the synthetic prefix-heavy workload.
#  1. a rate sweep (SWEEP, each rate on a fresh cluster) with early rejection
#     off finds the goodput rate (where fewer than 90% of requests meet both
#     SLOs, interpolated);
#  2. at OVER times that rate, N requests with router.early_reject off, then
#     on, then off and on again (alternating, one cluster each): SLO
#     attainment of all and of admitted requests, requests meeting both SLOs
#     per second, rejections and how fast they were answered.
# Results: OUT/sweep-RATE.{txt,json}, OUT/{off,on}-rN.{txt,json,health.json}.
#
# usage: bench/router_overload.sh   Environment: OUT, SWEEP, OVER, RATE (skip
#        the sweep), N, REPS, TTFT_MS, TPOT_MS, INPUT, PREFIX_GROUPS, THREADS
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
. bench/cluster.sh
out=${OUT:-bench/results/router-overload-$(date -u +%Y-%m-%d)}
mkdir -p "$out"
ttft=${TTFT_MS:-1000} tpot=${TPOT_MS:-100} sweep=${SWEEP:-1,1.5,2,2.5,3}
load=(--input-len "${INPUT:-uniform:128:512}" --output-len fixed:16 --ignore-eos
      --prefix-groups "${PREFIX_GROUPS:-20}" --prefix-share 0.8 --goodput "ttft:$ttft,tpot:$tpot" --timeout 300 --seed 11)
up() { # early_reject
  cluster_up "$(printf 'router: { placement: predictive, ttft_slo_ms: %s, tpot_slo_ms: %s, early_reject: %s }\nprefill: { count: 2, kv_mib: 48 }\ndecode: { kv_mib: 96 }\nkvstore: { dram_mb: 256 }' \
    "$ttft" "$tpot" "$1")"
}
rate=${RATE:-}
if [ -z "$rate" ]; then # each rate on a fresh cluster: a warm one would serve the next rate's prefixes cached
  for r in ${sweep//,/ }; do
    up false
    build/bin/tandem bench --endpoint "$ep" --api grpc --rate "$r" --num-requests "${N:-60}" "${load[@]}" \
      --output "$out/sweep-$r.json" 2>&1 | grep -v '^\[bench\] t=' | tee "$out/sweep-$r.txt"
    cluster_down
  done
  rate=$(python3 - "$out" ${sweep//,/ } <<'PY'
import json, sys
rates = [float(r) for r in sys.argv[2:]]
att = [json.load(open("%s/sweep-%s.json" % (sys.argv[1], r)))["runs"][0]["summary"]["attainment"] for r in sys.argv[2:]]
good = 0.0
for i, (r, a) in enumerate(zip(rates, att)):
    if a < 0.9:
        good = rates[i - 1] + (att[i - 1] - 0.9) / (att[i - 1] - a) * (r - rates[i - 1]) if i else 0.0
        break
    good = r
print(round(good, 2))
PY
)
  [ "$rate" != 0.0 ] || { echo "no rate of the sweep met the SLOs for 90% of requests"; exit 1; }
fi
over=$(python3 -c "import sys; print(round(float(sys.argv[1]) * float(sys.argv[2]), 2))" "$rate" "${OVER:-2}")
echo "goodput rate $rate req/s; overload runs at $over req/s"
for r in $(seq "${REPS:-2}"); do
  for er in false true; do
    name=$([ "$er" = true ] && echo on || echo off)-r$r
    up "$er"
    build/bin/tandem bench --endpoint "$ep" --api grpc --rate "$over" --num-requests "${N:-60}" "${load[@]}" \
      --output "$out/$name.json" 2>&1 | grep -v '^\[bench\] t=' | tee "$out/$name.txt"
    build/bin/tandem health --endpoint "$ep" | sed 's/^[A-Z_]* //' >"$out/$name.health.json" || true
    cluster_down
  done
done
rm -f "$out"/*.png "$out"/*.dat "$out"/*.gp # the SVG plots stay
