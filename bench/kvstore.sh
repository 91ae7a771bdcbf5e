#!/usr/bin/env bash
# bench/kvstore.sh — the KV store's node-local numbers beside their floors, in
# one run: index lookups per core (tandem-bench-kvstore index), the SSD tier's
# write and read GB/s (tandem-bench-kvstore ssd: O_DIRECT + io_uring, one block
# in flight, a checksum per read) and fio on the same file system with the same
# block size (a 4 KiB header + one 368,640-byte block = 372,736 bytes), the same
# engine and depth, alternating, three runs each.
# Usage: bench/kvstore.sh [BUILD_BIN_DIR] [DIR] [BLOCKS]
set -euo pipefail
BIN=${1:-build/bin}
DIR=${2:-$(mktemp -d "${TMPDIR:-/var/tmp}/tandem-kvbench-XXXXXX")}
BLOCKS=${3:-2048}
command -v fio >/dev/null || { echo "bench/kvstore.sh: needs fio (apt-get install fio)" >&2; exit 2; }
mkdir -p "$DIR"
BS=372736
SIZE=$((BS * BLOCKS))
echo "# $(date -u +%F) $(uname -n), $(nproc) cores; $DIR on $(df -T "$DIR" | awk 'NR==2{print $2" ("$1")"}')"
"$BIN/tandem-bench-kvstore" index 1000000
# like with like: a write into a fresh file (the tier's files at a node's first
# start; ext4 allocates extents as it goes) and a write over a file written
# before (a node running a while) are measured apart, for both
fio_run() {
  fio --name=kv --filename="$DIR/fio.dat" --size=$SIZE --bs=$BS --rw=$1 --direct=1 --ioengine=io_uring \
      --iodepth=1 --numjobs=1 --output-format=json 2>/dev/null |
    python3 -c "import json,sys; j=json.load(sys.stdin)['jobs'][0]; k='$1';
print(json.dumps({'bench':'fio','rw':k,'file':'$2','bs':$BS,'gb_s':round(j[k]['bw_bytes']/1e9,3)}))"
}
for run in 1 2 3; do
  rm -rf "$DIR/tier" "$DIR/fio.dat"
  "$BIN/tandem-bench-kvstore" ssd "$DIR/tier" "$BLOCKS"   # fresh file
  "$BIN/tandem-bench-kvstore" ssd "$DIR/tier" "$BLOCKS" 2>/dev/null  # over the blocks written before
  fio_run write fresh
  fio_run write over
  fio_run read over
done
rm -rf "$DIR/tier" "$DIR/fio.dat"
