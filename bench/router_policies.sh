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
# from whole conversations) with lengths divided by TRACE_DIVIDE.
# Each run's `tandem bench` summary and JSON go to OUT/POLICY[-rN].{txt,json}
# with the router's Health after it; OUT/table.md sums them up.
#
# usage: bench/router_policies.sh   Environment: POLICIES, REPS, OUT, RATE, N,
#        THREADS, PREFIX_GROUPS, PREFIX_SHARE, INPUT, OUTPUT, TRACE,
#        TRACE_DIVIDE, PREFILL_MIB, DECODE_MIB, GOODPUT (ttft:MS,tpot:MS)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
policies=${POLICIES:-least_loaded round_robin kv_cost predictive}
out=${OUT:-bench/results/router-policies-$(date -u +%Y-%m-%d)}
mkdir -p "$out"
work=$(mktemp -d)
pid=
cleanup() { [ -n "$pid" ] && kill -TERM -- "-$pid" 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
if [ -n "${TRACE:-}" ]; then
  load=(--workload trace "$TRACE" --trace-divide "${TRACE_DIVIDE:-32}")
else
  load=(--rate "${RATE:-1}" --num-requests "${N:-60}" --input-len "${INPUT:-uniform:128:512}"
        --output-len "${OUTPUT:-fixed:16}" --ignore-eos --prefix-groups "${PREFIX_GROUPS:-6}"
        --prefix-share "${PREFIX_SHARE:-0.8}")
fi
one() { # policy, name
  local pol=$1 name=$2
  printf 'router: { placement: %s }\nprefill: { count: 2, kv_mib: %s }\ndecode: { kv_mib: %s }\nkvstore: { dram_mb: 256 }\n' \
    "$pol" "${PREFILL_MIB:-48}" "${DECODE_MIB:-96}" >"$work/$pol.yaml"
  setsid build/bin/tandem up --model "$model" --config "$work/$pol.yaml" --kvstores 3 \
    --worker-arg --threads --worker-arg "${THREADS:-1}" >"$work/up.out" 2>"$work/up.err" &
  pid=$!
  for _ in $(seq 240); do [ -s "$work/up.out" ] && break; sleep 0.5; done
  ep=$(head -1 "$work/up.out")
  [ -n "$ep" ] || { echo "tandem up did not start:"; tail -20 "$work/up.err"; exit 1; }
  build/bin/tandem bench --endpoint "$ep" --api grpc "${load[@]}" \
    --goodput "${GOODPUT:-ttft:1000,tpot:100}" --timeout 300 --seed 11 --output "$out/$name.json" \
    2>&1 | grep -v '^\[bench\] t=' | tee "$out/$name.txt"
  build/bin/tandem health --endpoint "$ep" | sed 's/^[A-Z_]* //' >"$out/$name.health.json" || true
  kill -TERM -- "-$pid"; wait "$pid" || true; pid=
  : >"$work/up.out"
}
order=($policies)
for r in $(seq "${REPS:-1}"); do
  for pol in "${order[@]}"; do one "$pol" "$pol$([ "${REPS:-1}" -gt 1 ] && echo "-r$r")"; done
  order=($(printf '%s\n' "${order[@]}" | tac))
done
rm -f "$out"/*.png "$out"/*.dat "$out"/*.gp # the SVG plots stay
python3 bench/router_policies_table.py "$out" $policies >"$out/table.md"
cat "$out/table.md"
