#!/usr/bin/env bash
# startup.sh — runs tandem-bench-startup on the default model and writes the
# result, with the machine, date and commit, to bench/results/startup-DATE.md.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
model=${1:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
out=bench/results/startup-$(date -u +%Y-%m-%d).md
{
  echo "# Start-up: process start to model ready"
  echo
  echo "- date: $(date -u +%Y-%m-%dT%H:%MZ); commit $(git rev-parse --short HEAD)"
  echo "- machine: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores, $(free -g | awk '/Mem:/{print $2}') GiB; $(uname -sr)"
  echo "- command: bench/startup.sh (build/bin/tandem-bench-startup $model build/bin/tandem)"
  echo
  build/bin/tandem-bench-startup "$model" build/bin/tandem
} > "$out"
cat "$out"
