#!/usr/bin/env bash
# router_prediction.sh — how well the router predicts TTFT (DESIGN.md §5) on a
# mixed workload: prompt lengths log-uniform over 64-4096 tokens, 6 groups
# sharing half of each prompt, with 1 and then 2 prefill workers (1 decode
# worker, 3 kvstore nodes, predictive placement), each at a rate that keeps
# its prefill workers about half busy (RATE1, RATE2). The error of each
# request's prediction, |predicted - measured| / measured TTFT (both the
# router's own), over all requests and after the first WARMUP ones.
# Results: OUT/p1.{txt,json}, OUT/p2.{txt,json}, OUT/errors.md.
#
# usage: bench/router_prediction.sh   Environment: OUT, N, RATE1, RATE2, WARMUP, THREADS
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
. bench/cluster.sh
out=${OUT:-bench/results/router-prediction-$(date -u +%Y-%m-%d)}
mkdir -p "$out"
for np in 1 2; do
  rate=$([ "$np" = 1 ] && echo "${RATE1:-0.08}" || echo "${RATE2:-0.15}")
  cluster_up "$(printf 'router: { placement: predictive }\nprefill: { count: %s, kv_mib: 256 }\ndecode: { kv_mib: 512 }\nkvstore: { dram_mb: 256 }' "$np")"
  build/bin/tandem bench --endpoint "$ep" --api grpc --rate "$rate" --num-requests "${N:-30}" \
    --input-len loguniform:64:4096 --output-len fixed:16 --ignore-eos --prefix-groups 6 --prefix-share 0.5 \
    --goodput ttft:30000,tpot:100 --timeout 600 --seed 11 --output "$out/p$np.json" 2>&1 |
    grep -v '^\[bench\] t=' | tee "$out/p$np.txt"
  cluster_health "$out/p$np.health.json"
  cluster_down
done
rm -f "$out"/*.png "$out"/*.dat "$out"/*.gp # the SVG plots stay
python3 - "$out" "${WARMUP:-5}" >"$out/errors.md" <<'PY'
import json, sys
out, warm = sys.argv[1], int(sys.argv[2])
def q(v, x):
    v = sorted(v)
    return v[min(len(v) - 1, int(round(x * (len(v) - 1))))] if v else float("nan")
print("| prefill workers | requests | TTFT error p50 / p90, all | after the first %d |" % warm)
print("|---:|---:|---:|---:|")
for np in (1, 2):
    rq = json.load(open("%s/p%d.json" % (out, np)))["runs"][0]["requests"]
    rq.sort(key=lambda r: r["t_sent"])
    e = [abs(r["predicted_ttft"] - r["server_ttft"]) / r["server_ttft"] for r in rq
         if r["ok"] and r.get("predicted_ttft") and r.get("server_ttft")]
    print("| %d | %d | %.1f%% / %.1f%% | %.1f%% / %.1f%% |" % (np, len(e), 100 * q(e, .5), 100 * q(e, .9),
                                                            100 * q(e[warm:], .5), 100 * q(e[warm:], .9)))
PY
cat "$out/errors.md"
