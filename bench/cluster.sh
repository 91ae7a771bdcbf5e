# cluster.sh — sourced by the cluster benchmarks (router_policies.sh,
# router_overload.sh, router_prediction.sh): one `tandem up` at a time.
#   cluster_up YAML   starts a cluster with that config text (KVSTORES kvstore nodes, default 3,
#                     THREADS threads a worker, default 1) and sets $ep
#   cluster_health F  the router's Health as JSON into F
#   cluster_down      stops it (also on exit)
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
cluster_work=$(mktemp -d)
cluster_pid=
cluster_down() {
  [ -n "$cluster_pid" ] || return 0
  kill -TERM -- "-$cluster_pid" 2>/dev/null || true
  wait "$cluster_pid" || true
  cluster_pid=
  : >"$cluster_work/up.out"
}
trap 'cluster_down; rm -rf "$cluster_work"' EXIT
cluster_up() {
  printf '%s\n' "$1" >"$cluster_work/c.yaml"
  setsid build/bin/tandem up --model "$model" --config "$cluster_work/c.yaml" --kvstores "${KVSTORES:-3}" \
    --worker-arg --threads --worker-arg "${THREADS:-1}" >"$cluster_work/up.out" 2>"$cluster_work/up.err" &
  cluster_pid=$!
  for _ in $(seq 240); do [ -s "$cluster_work/up.out" ] && break; sleep 0.5; done
  ep=$(head -1 "$cluster_work/up.out")
  [ -n "$ep" ] || { echo "tandem up did not start:"; tail -20 "$cluster_work/up.err"; exit 1; }
}
cluster_health() { build/bin/tandem health --endpoint "$ep" | sed 's/^[A-Z_]* //' >"$1" || true; }
