#!/usr/bin/env bash
# bench/kvstore_store.sh — the store's data path beside its floors, in one run:
# a real etcd and one tandem-kvstore node on loopback (plaintext), then,
# alternating three times each: tandem-bench-kvstore store (put and get GB/s
# through the client library, one-block read latency) and tandem-bench-kvxfer
# (raw UCX puts between two processes and memcpy, chunks of one block).
# Usage: bench/kvstore_store.sh [BUILD_BIN_DIR] [BLOCKS]
set -euo pipefail
BIN=${1:-build/bin}
BLOCKS=${2:-1024}
BB=368640
work=$(mktemp -d "${TMPDIR:-/tmp}/tandem-kvstore-bench-XXXXXX")
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
cp=$(port) pp=$(port)
etcd --name bench --data-dir "$work/etcd" --listen-client-urls "http://127.0.0.1:$cp" \
     --advertise-client-urls "http://127.0.0.1:$cp" --listen-peer-urls "http://127.0.0.1:$pp" \
     --initial-advertise-peer-urls "http://127.0.0.1:$pp" --initial-cluster "bench=http://127.0.0.1:$pp" \
     --log-level error >"$work/etcd.log" 2>&1 &
epid=$!
mb=$(( (BLOCKS * BB >> 20) + 64 ))  # one round of blocks: each later round evicts the one before
trap 'kill $kpid $epid 2>/dev/null; wait 2>/dev/null; rm -rf "$work"' EXIT
sleep 1
"$BIN/tandem-kvstore" --plaintext true --etcd "127.0.0.1:$cp" --dram-mb "$mb" --id bench-0 >"$work/kv.log" 2>&1 &
kpid=$!
sleep 2
echo "# $(date -u +%F) $(uname -n), $(nproc) cores; one node, ${mb} MiB CPU tier, $BLOCKS blocks of $BB bytes"
for run in 1 2 3; do
  "$BIN/tandem-bench-kvstore" store "127.0.0.1:$cp" "$BLOCKS"
  "$BIN/tandem-bench-kvxfer" $(( BLOCKS * BB >> 20 )) "$BB"
done
