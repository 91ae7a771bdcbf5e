#!/usr/bin/env bash
# ncu_steps.sh — where a step's time goes, kernel by kernel, under Nsight Compute (issue 51): a 4,095-token
# prefill of the Llama-2-7B shape (dummy weights) in one step, and decode steps at batch 1 and 256, each with fp16
# and FP8 weights. ncu runs every kernel alone (no overlap between kernels, caches flushed before each), so the sums
# are each kernel's own time, not the captured step's; what it tells is the split between kernels and each one's
# DRAM bytes. On the GPU machine, from the bundle:
# `pipes` also reads the batch-1 GEMVs' speed of light and pipe use (the first 8 launches of each weight format's).
#   bench/ncu_steps.sh OUT [prefill|b1|b256|pipes ...]
set -uo pipefail
out=$1
shift
what=" ${*:-prefill b1 b256} "
here=$(cd "$(dirname "$0")/.." && pwd)
T=$here/bin/tandem
m=${MODEL_DIR:-/tmp/llama2-7b-dummy}
[ -f "$m/config.json" ] || python3 "$here/bench/make_random_llama.py" "$m" --shape llama2-7b \
  --tokenizer "$here/fixtures/tiny-llama3" --config-only > "$out/make-dummy.txt" 2>&1 || exit 1
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -x "$NCU" ] || { echo "ncu: not found"; exit 1; }
metrics=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum
# profile NAME ARGS...: ncu over `tandem generate ARGS`, its kernels summed by name into $out/ncu-NAME.txt
profile() {
  local name=$1
  shift
  timeout 280 "$NCU" --clock-control none --graph-profiling node --metrics "$metrics" --csv --print-units base \
    "$T" generate --model "$m" --load-format dummy --device cuda --ignore-eos --ids "$@" \
    > "$out/ncu-$name.csv" 2> "$out/ncu-$name.err" || echo "ncu $name: FAILED or cut ($(tail -1 "$out/ncu-$name.err"))"
  python3 - "$out/ncu-$name.csv" "$name" > "$out/ncu-$name.txt" << 'EOF'
import csv, re, sys
rows = {}
order = []
for r in csv.reader(l for l in open(sys.argv[1]) if l.startswith('"')):
    if r[0] == "ID":
        h = {k: i for i, k in enumerate(r)}
        continue
    k = (r[h["ID"]], r[h["Kernel Name"]])
    rows.setdefault(k, {})[r[h["Metric Name"]]] = float(r[h["Metric Value"]].replace(",", "") or 0)
by = {}
for (i, name), m in rows.items():
    short = re.sub(r"\(.*", "", name)
    short = re.sub(r"^void ", "", short)
    b = by.setdefault(short, [0, 0.0, 0.0])
    b[0] += 1
    b[1] += m.get("gpu__time_duration.sum", 0) / 1e3  # ns -> us
    b[2] += (m.get("dram__bytes_read.sum", 0) + m.get("dram__bytes_write.sum", 0)) / 1e9
total = sum(b[1] for b in by.values())
print("%s: %d kernels, %.1f us in all (each alone)" % (sys.argv[2], sum(b[0] for b in by.values()), total))
for short, (n, us, gb) in sorted(by.items(), key=lambda kv: -kv[1][1]):
    if us < total * 0.002:
        continue
    print("  %-60.60s %5d x %9.2f us = %9.1f us (%4.1f%%) %7.3f GB, %6.0f GB/s" %
          (short, n, us / n, us, 100 * us / total, gb, gb / (us * 1e-6) if us else 0))
EOF
  cat "$out/ncu-$name.txt"
  rm -f "$out/ncu-$name.csv" # (large: the summary is what comes back)
}
if [[ $what == *" prefill "* ]]; then
  p4=$(python3 "$here/bench/prompt_of.py" "$m/tokenizer.json" 4095)
  for w in ${PREFILL_WEIGHTS:-file fp8}; do
    profile "prefill-$w" --weights $w --max-tokens 1 --token-budget 4096 --kv-mib 4096 "$p4"
  done
fi
p16=$(python3 "$here/bench/prompt_of.py" "$m/tokenizer.json" 16)
for b in 1 256; do
  [[ $what == *" b$b "* ]] || continue
  for w in file fp8; do
    # the prompt's step, then 3 decode steps (run, captured, replayed)
    profile "b$b-$w" --weights $w --n $b --max-tokens 4 --kv-mib $((b * 80 + 512)) "$p16"
  done
done
if [[ $what == *" pipes "* ]]; then
  for w in file fp8; do
    k=k_gemv; [ $w = fp8 ] && k=k_gemv_f8
    timeout 200 "$NCU" --clock-control none --graph-profiling node -k "regex:^$k" -c 8 --section SpeedOfLight \
      --section ComputeWorkloadAnalysis --section LaunchStats --section Occupancy --section WarpStateStats \
      "$T" generate --model "$m" --load-format dummy --device cuda --ignore-eos --ids --weights $w --max-tokens 4 \
      --kv-mib 512 "$p16" > "$out/ncu-pipes-$w.txt" 2>&1 || echo "ncu pipes $w: FAILED or cut"
    grep -E "k_gemv|Duration|DRAM Throughput|Memory Throughput|Compute \(SM\)|Issue Slots|Executed Ipc A|Registers|Achieved Occupancy|Pipe|Stall|Warp Cycles Per Issued" \
      "$out/ncu-pipes-$w.txt" | head -80
  done
fi
exit 0
