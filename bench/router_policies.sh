#!/usr/bin/env bash
# router_policies.sh — the placement policies side by side (DESIGN.md §5): the
# same cluster (`tandem up`, 2 prefill + 1 decode workers, 3 kvstore nodes) and
# the same workload, once per router.placement, one after the other, each alone
# on the machine. The workload: the synthetic prefix-heavy one (PREFIX_GROUPS
# groups sharing PREFIX_SHARE of each prompt) at RATE requests/s, N requests.
# Each policy's `tandem bench` summary and JSON go to
# bench/results/router-policies-DATE/POLICY.{txt,json}.
#
# usage: bench/router_policies.sh   Environment: POLICIES, RATE, N, THREADS,
#        PREFIX_GROUPS, PREFIX_SHARE, INPUT (tandem bench --input-len)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
policies=${POLICIES:-least_loaded round_robin kv_cost predictive}
out=bench/results/router-policies-$(date -u +%Y-%m-%d)
mkdir -p "$out"
work=$(mktemp -d)
pid=
cleanup() { [ -n "$pid" ] && kill -TERM -- "-$pid" 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
for pol in $policies; do
  printf 'router: { placement: %s }\nprefill: { count: 2, kv_mib: 48 }\ndecode: { kv_mib: 96 }\nkvstore: { dram_mb: 256 }\n' \
    "$pol" >"$work/$pol.yaml"
  setsid build/bin/tandem up --model "$model" --config "$work/$pol.yaml" --kvstores 3 \
    --worker-arg --threads --worker-arg "${THREADS:-1}" >"$work/up.out" 2>"$work/up.err" &
  pid=$!
  for _ in $(seq 240); do [ -s "$work/up.out" ] && break; sleep 0.5; done
  ep=$(head -1 "$work/up.out")
  [ -n "$ep" ] || { echo "tandem up did not start:"; tail -20 "$work/up.err"; exit 1; }
  build/bin/tandem bench --endpoint "$ep" --api grpc --rate "${RATE:-1}" --num-requests "${N:-60}" \
    --input-len "${INPUT:-uniform:128:512}" --output-len fixed:16 --ignore-eos \
    --prefix-groups "${PREFIX_GROUPS:-6}" --prefix-share "${PREFIX_SHARE:-0.8}" \
    --goodput ttft:1000,tpot:100 --timeout 300 --seed 11 --output "$out/$pol.json" \
    2>&1 | grep -v '^\[bench\] t=' | tee "$out/$pol.txt"
  build/bin/tandem health --endpoint "$ep" | sed 's/^[A-Z_]* //' >"$out/$pol.health.json" || true
  kill -TERM -- "-$pid"; wait "$pid" || true; pid=
  : >"$work/up.out"
done
