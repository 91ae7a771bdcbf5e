#!/bin/sh
# The README's main job: a whole cluster on this machine (tandem up), one chat
# generation streamed through its router by the gRPC client, then a clean stop.
# To keep a cluster running instead: build/bin/tandem up  (prints HOST:PORT).
# Usage: deploy/demo.sh [BUILD_DIR]  (default: build)
set -e
cd "$(dirname "$0")/.."
bin=${1:-build}/bin
out=$(mktemp)
"$bin"/tandem up --worker-arg --threads --worker-arg 1 >"$out" &
up=$!
trap 'kill -TERM $up 2>/dev/null; wait $up 2>/dev/null; rm -f "$out"' EXIT INT TERM
for _ in $(seq 1 300); do [ -s "$out" ] && break; sleep 0.1; done
ep=$(head -1 "$out")
[ -n "$ep" ] || { echo "demo: the cluster did not come up" >&2; exit 1; }
echo "demo: cluster serving at $ep" >&2
timeout 120 "$bin"/tandem generate --endpoint "$ep" --chat --max-tokens 96 \
  "Explain in two sentences why the sky is blue."
