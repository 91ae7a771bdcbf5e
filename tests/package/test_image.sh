#!/usr/bin/env bash
# test_image.sh — the container image the Kubernetes manifests run: built by
# deploy/container/build.sh (podman), then run: who it runs as, what it holds
# (the package's programs, etcd, no compiler), and `tandem up` + one generation
# inside one container, compared with the same image's single-process answer
# and with this tree's build. Prints one PASS/FAIL line per check; exit 1 if
# any failed.
#   tests/package/test_image.sh [IMAGE]   (default: build it)
set -u
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
. deploy/container/podman-opts.sh
t0=$SECONDS
image=${1:-$(deploy/container/build.sh)} || { echo "FAIL the image did not build"; exit 1; }
echo "image: $image, built in $((SECONDS - t0)) s; $(podman image inspect "$image" --format '{{.Size}}' |
  awk '{printf "%.0f MB", $1 / 1e6}')"
fails=0
check() { # NAME, then a command: PASS when it succeeds
  local name=$1; shift
  if "$@" >/dev/null 2>&1; then echo "PASS $name"; else echo "FAIL $name"; fails=$((fails + 1)); fi
}
inside() { podman "${podman_global[@]}" run --rm "${podman_opts[@]}" "$image" "$@"; }
user=$(inside id -un 2>&1)
check "it runs as the tandem user, not root ($user)" test "$user" = tandem
check "it holds the package's programs, etcd and the model" \
  inside sh -c 'tandem --version && tandem-router --help && command -v etcd && test -s /models/SmolLM2-135M-Instruct.Q4_1.gguf'
check "it holds no compiler, no headers of the build" inside sh -c '! command -v cc && ! command -v cmake && ! test -d /usr/include/grpc'
prompt="Write one sentence about the sea."
model=/models/SmolLM2-135M-Instruct.Q4_1.gguf
out=$(inside sh -c '
  single=$(tandem generate --model '"$model"' --max-tokens 24 --threads 1 --chat "'"$prompt"'" 2>/dev/null)
  tandem up --model '"$model"' > /tmp/ep 2> /tmp/up.log &
  up=$!
  for i in $(seq 120); do [ -s /tmp/ep ] && break; sleep 1; done
  cluster=$(timeout 60 tandem generate --endpoint "$(cat /tmp/ep)" --max-tokens 24 --chat "'"$prompt"'" 2>/dev/null)
  kill $up; wait $up
  printf "single=%s\ncluster=%s\nstopped=%s\n" "$single" "$cluster" "$(grep -c "tandem up: stopping" /tmp/up.log)"' 2>&1)
single=$(echo "$out" | sed -n 's/^single=//p')
cluster=$(echo "$out" | sed -n 's/^cluster=//p')
echo "  inside: single process \"$single\"; tandem up \"$cluster\""
check "tandem up inside the image served one generation, identical to the single process's" \
  sh -c '[ -n "$1" ] && [ "$1" = "$2" ]' _ "$cluster" "$single"
check "tandem up inside the image stopped on SIGTERM" sh -c 'echo "$1" | grep -qx "stopped=1"' _ "$out"
if [ -x build/bin/tandem ] && [ -f models/SmolLM2-135M-Instruct.Q4_1.gguf ]; then
  here=$(build/bin/tandem generate --model models/SmolLM2-135M-Instruct.Q4_1.gguf --max-tokens 24 --threads 1 --chat \
    "$prompt" 2>/dev/null)
  check "the image's answer is this tree's build's ($here)" test "$here" = "$single"
fi
echo "test_image: $fails failed"
[ "$fails" -eq 0 ]
