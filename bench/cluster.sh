# cluster.sh — sourced by the cluster benchmarks (router_policies.sh,
# router_overload.sh, router_prediction.sh): one `tandem up` at a time.
#   cluster_up YAML   starts a cluster with that config text (KVSTORES kvstore nodes, default 3,
#                     THREADS threads a worker, default 1) and sets $ep; with SLOW_THREADS=N
#                     a second node agent (tandem up --join, the way another host joins) takes
#                     one of the prefill workers and runs it with N threads: a cluster of
#                     unequal workers (the config must ask for 2 prefill workers); its id is
#                     then in $cluster_slow_id
#   cluster_health F  the router's Health as JSON into F
#   cluster_down      stops it (also on exit)
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
cluster_work=$(mktemp -d)
cluster_pid= cluster_join_pid=
cluster_down() {
  if [ -n "$cluster_join_pid" ]; then
    kill -TERM -- "-$cluster_join_pid" 2>/dev/null || true
    wait "$cluster_join_pid" || true
    cluster_join_pid=
  fi
  [ -n "$cluster_pid" ] || return 0
  kill -TERM -- "-$cluster_pid" 2>/dev/null || true
  wait "$cluster_pid" || true
  cluster_pid=
  : >"$cluster_work/up.out"
}
trap 'cluster_down; rm -rf "$cluster_work"' EXIT
cluster_up() {
  printf '%s\n' "$1" >"$cluster_work/c.yaml"
  local two=()
  if [ -n "${SLOW_THREADS:-}" ]; then # both nodes need the cluster's certificates
    [ -d "$cluster_work/tls" ] || build/bin/tandem certs --dir "$cluster_work/tls" >/dev/null
    two=(--certs "$cluster_work/tls" --node a-fast)
  fi
  setsid build/bin/tandem up --model "$model" --config "$cluster_work/c.yaml" --kvstores "${KVSTORES:-3}" "${two[@]}" \
    --worker-arg --threads --worker-arg "${THREADS:-1}" >"$cluster_work/up.out" 2>"$cluster_work/up.err" &
  cluster_pid=$!
  for _ in $(seq 240); do [ -s "$cluster_work/up.out" ] && break; sleep 0.5; done
  ep=$(head -1 "$cluster_work/up.out")
  [ -n "$ep" ] || { echo "tandem up did not start:"; tail -20 "$cluster_work/up.err"; exit 1; }
  [ -n "${SLOW_THREADS:-}" ] || return 0
  local etcd before
  prefill_ids() { # the prefill workers the router sees, one id a line
    build/bin/tandem status --endpoint "$ep" --json 2>/dev/null | python3 -c '
import json, sys
d = json.load(sys.stdin)
print("\n".join(sorted(p["id"] for p in d.get("pools", []) if p.get("role") == "prefill" and "error" not in p)))'
  }
  for _ in $(seq 240); do before=$(prefill_ids); [ "$(wc -l <<<"$before")" = 2 ] && break; sleep 0.5; done
  [ "$(wc -l <<<"$before")" = 2 ] || { echo "the cluster did not show 2 prefill workers in 120 s"; exit 1; }
  etcd=$(sed -n 's/^tandem up: etcd on \([^,]*\),.*/\1/p' "$cluster_work/up.err" | head -1)
  setsid build/bin/tandem up --join "$etcd" --model "$model" --config "$cluster_work/c.yaml" --kvstores 0 \
    --certs "$cluster_work/tls" --node b-slow --worker-arg --threads --worker-arg "$SLOW_THREADS" \
    >"$cluster_work/join.out" 2>"$cluster_work/join.err" &
  cluster_join_pid=$!
  # the founder ran both prefill workers until the second node came: wait for one of its two to have
  # gone and the second node's to be there
  local now
  for _ in $(seq 240); do
    now=$(prefill_ids)
    if [ "$(wc -l <<<"$now")" = 2 ] && [ "$(comm -12 <(echo "$before") <(echo "$now") | wc -l)" = 1 ]; then
      cluster_slow_id=$(comm -13 <(echo "$before") <(echo "$now"))
      return 0
    fi
    sleep 0.5
  done
  echo "the second node's prefill worker did not register:"; tail -20 "$cluster_work/join.err"; exit 1
}
cluster_health() { build/bin/tandem health --endpoint "$ep" | sed 's/^[A-Z_]* //' >"$1" || true; }
