#!/usr/bin/env bash
# run.sh — the whole test suite, as CI runs it (the README's test command).
#
#   1. installs what is missing (deploy/install-deps.sh --test)
#   2. builds everything but the CUDA backend into build/ (the CUDA build, build-cuda/, compiles beside the last
#      suites when nvcc is found, and runs the unit suites whose code has CUDA branches: CI has no GPU)
#   3. runs every Criterion suite
#   4. builds the suites again with AddressSanitizer + UBSan checks (build-asan/) and runs them
#   5. builds tests/tsan/tsan_stress.c with ThreadSanitizer (build-tsan/) and runs it (Criterion
#      itself cannot run under TSan: Snaipe/Criterion#274)
#   6. runs the libFuzzer targets for FUZZ_SECONDS each (default 20)
# The Python suites (pytest, tests/conftest.py: real clusters) run between 3 and 4; a user's build (Release, no test package), the
# sanitizer and fuzz builds and the sanitizer pass's test_generate run beside them at the lowest CPU priority, in
# the time they leave idle; the cache-hits suite (outputs against cold references, no timings) at a low priority
# beside the last ones after the timed suites (scale, scheduling), and the rest of 4, 5 and 6 and the CUDA build
# beside those, the same way.
# and prints one closing line: "tests: N passed, N failed".
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
fuzz_secs=${FUZZ_SECONDS:-20}
jobs=$(nproc)

passed=0 failed=0
sec_name="" sec_t0=0 sec_times=()
section_end() { # the section before: how long it took, kept for the closing table
  [ -n "$sec_name" ] && sec_times+=("$(printf '%4dm%02ds  %s' $(((SECONDS - sec_t0) / 60)) $(((SECONDS - sec_t0) % 60)) "${sec_name:0:60}")")
}
section() { section_end; sec_name=$1 sec_t0=$SECONDS; printf '== %s  [%dm%02ds]\n' "$1" $((SECONDS / 60)) $((SECONDS % 60)); }
failures=() # one line per failure, repeated at the end (CI keeps only the tail of the output)
run_one() { # $1: test binary, $2: label, then Criterion's arguments if any (--filter)
  local t=$1 label=$2 out p f c line
  # a bound on the whole binary too (its tests have their own): a hung suite is a failure, not a hung CI
  out=$(timeout -k 10 900 "$t" --jobs "$jobs" "${@:3}" 2>&1)
  line=$(printf '%s\n' "$out" | grep 'Synthesis: Tested' | tail -1)
  p=$(sed -n 's/.*Passing: \([0-9]*\).*/\1/p' <<<"$line")
  f=$(sed -n 's/.*Failing: \([0-9]*\).*/\1/p' <<<"$line")
  c=$(sed -n 's/.*Crashing: \([0-9]*\).*/\1/p' <<<"$line")
  if [ -z "$line" ]; then p=0 f=1 c=0; fi
  passed=$((passed + p)); failed=$((failed + f + c))
  if [ $((f + c)) -gt 0 ] || [ -z "$line" ]; then
    # a sanitizer's report names the fault at its head, which the tail cuts off: the head first
    printf '%s\n' "$out" | grep -m1 -A30 -E 'ERROR: AddressSanitizer|runtime error:|WARNING: ThreadSanitizer' || true
    printf '%s\n' "$out" | grep -v ' error tandem' | tail -40
    echo "FAILED: $label $(basename "$t")"; failures+=("$label $(basename "$t")")
  else
    printf '%-12s %-22s %s\n' "$label" "$(basename "$t")" "$line"
  fi
  printf '%s\n' "$out" | grep -E '^(tokenizer corpus|dequant|sentencepiece|normalizers|greedy|perplexity|tiny|kernels|/.*: [0-9]+ of)' || true
}
# A job beside the suites (a subshell in the background): job_begin NICE lowers its CPU priority and starts its own
# counts; job_end FILE writes them where the end of the run reads them back
job_begin() { renice -n "$1" -p "$BASHPID" >/dev/null; passed=0 failed=0 failures=(); }
job_end() { { echo "$passed $failed"; [ ${#failures[@]} -eq 0 ] || printf '%s\n' "${failures[@]}"; } > "$1"; }
run_suites() { # $1: build dir, $2: label
  local t
  for t in "$1"/bin/tests/test_*; do
    run_one "$t" "$2"
  done
}

section "dependencies (deploy/install-deps.sh --test: packages, the test venv, the model)"
deploy/install-deps.sh --test || { echo "tests: 0 passed, 1 failed"; exit 1; }

# the workers' start-up profiles are kept in the host's cache (worker/profile_store.h): one of this run's own, so
# its first cluster measures them and the later ones reuse them, as a user's clusters on one host do
export XDG_CACHE_HOME
XDG_CACHE_HOME=$(mktemp -d)
trap 'rm -rf "$XDG_CACHE_HOME"; [ -z "${bg_pid:-}" ] || kill "$bg_pid" 2>/dev/null' EXIT

section "build (release, CPU; the CUDA build comes later, beside the last suites)"
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTANDEM_TESTS=ON -DTANDEM_WERROR=ON -DTANDEM_CUDA=OFF >/dev/null && cmake --build build -j"$jobs" >/dev/null \
  || { echo "build failed"; cmake --build build 2>&1 | tail -30; echo "tests: $passed passed, $((failed + 1)) failed"; exit 1; }
run_suites build release
# the kernels again on the AVX2 path without VNNI (the suite checks the portable path itself)
TANDEM_CPU=avx2 run_one build/bin/tests/test_kernels "release/avx2"


run_py() { # $1: a pytest suite, $2: a short name for the log, $3: time limit (s)
  local out line p f rc=0 t0=$SECONDS
  # past the limit SIGABRT makes Python's faulthandler print every thread's stack: where it hung
  out=$(timeout -s ABRT -k 30 "$3" .venv/bin/python -X faulthandler -m pytest -s -q -p no:cacheprovider --bin build/bin \
          --durations 0 --durations-min 10 --junitxml "build/junit/$(basename "$1" .py).xml" "$1" 2>&1 | sed -E 's/^[.FEsx]+(PASS|FAIL|  )/\1/') || rc=$?
  printf '%s\n' "$out" | grep -E "^(PASS|FAIL|  )|^checks:|^[0-9.]+s (call|setup)|Traceback|Error|^(Current )?[Tt]hread 0x" | sed 's/^/  /'
  echo "  ($2: $(basename "$1") took $((SECONDS - t0)) s of its $3)"
  while IFS= read -r f; do failures+=("$(basename "$1"): $f"); done < <(printf '%s\n' "$out" | grep '^FAIL ')
  line=$(printf '%s\n' "$out" | grep "^checks:" | tail -1)
  if [ -n "$line" ]; then
    p=$(echo "$line" | sed -E 's/.* ([0-9]+) passed.*/\1/'); f=$(echo "$line" | sed -E 's/.* ([0-9]+) failed.*/\1/')
    passed=$((passed + p)); failed=$((failed + f))
  else
    local last where how
    last=$(printf '%s\n' "$out" | grep -E '^(PASS|FAIL)' | tail -1)
    # faulthandler's stacks (a hang) list the innermost frame first, a traceback (an uncaught error) last
    where=$(printf '%s\n' "$out" | grep -E "^  File \".*$(basename "$1")\"" | tr -s ' ')
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then how="did not finish in $3 s"; where=$(printf '%s\n' "$where" | head -3)
    else where=$(printf '%s\n' "$where" | tail -3); how="ended early (exit $rc): $(printf '%s\n' "$out" | grep -E "^[A-Za-z.]*(Error|Exception)" | tail -1 | cut -c1-1500)"; fi
    where=$(printf '%s\n' "$where" | tr '\n' ';')
    echo "  $1 $how"; failed=$((failed + 1))
    failures+=("$(basename "$1") $how; last result: ${last:-none}; its frames:${where:- ?}")
  fi
}

# A user's build, the sanitizer builds and the sanitizer pass's longest suite (test_generate, ~6 minutes of 2
# cores) run beside the integration suites at the lowest CPU priority: the clusters leave about a quarter of the cores idle while
# they wait on each other, and a nice-19 job takes only that (the scheduler gives every other process the core
# first). Its output and counts are read back after the integration suites.
bg_log=$(mktemp) bg_status=$(mktemp) ulog=$(mktemp)
(
  job_begin 19
  t0=$SECONDS
  # a user's build: Release, no test package (Criterion hidden from pkg-config), warnings not errors
  hide=$(mktemp -d)
  for d in $(pkg-config --variable pc_path pkg-config | tr : ' '); do
    [ -d "$d" ] || continue
    for f in "$d"/*.pc; do [ "$(basename "$f")" = criterion.pc ] || ln -s "$f" "$hide/" 2>/dev/null || true; done
  done
  if PKG_CONFIG_LIBDIR=$hide cmake -S . -B build-user -DCMAKE_BUILD_TYPE=Release -DTANDEM_CUDA=OFF >"$ulog" 2>&1 &&
     grep -q "Criterion not found" "$ulog" && cmake --build build-user -j"$jobs" >>"$ulog" 2>&1 &&
     [ ! -e build-user/bin/tests ]; then
    echo ok >> "$ulog"
  fi
  rm -rf "$hide"
  # at -O1, as AddressSanitizer's documentation advises for a usable speed: the sanitizer pass's test_generate takes
  # 1m56s here against 5m15s at -O0 (2 cores), the same checks made
  if cmake -S . -B build-asan -DTANDEM_TESTS=ON -DTANDEM_WERROR=ON -DTANDEM_SANITIZE=address -DTANDEM_CUDA=OFF \
       -DCMAKE_BUILD_TYPE=Debug -DCMAKE_C_FLAGS="-O1 -fsanitize=undefined -fno-sanitize-recover=undefined" >/dev/null &&
     cmake --build build-asan -j"$jobs" >/dev/null; then
    TANDEM_TEST_QUICK=1 ASAN_OPTIONS=detect_leaks=1 run_one build-asan/bin/tests/test_generate asan+ubsan
  else
    echo "sanitizer build failed"; cmake --build build-asan 2>&1 | tail -30; failed=$((failed + 1))
    failures+=("sanitizer build")
  fi
  cmake -S . -B build-tsan -DTANDEM_TESTS=ON -DTANDEM_WERROR=ON -DTANDEM_SANITIZE=thread -DTANDEM_CUDA=OFF \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null && cmake --build build-tsan -j"$jobs" --target tsan_stress >/dev/null
  [ "$fuzz_secs" -gt 0 ] && tests/fuzz/run.sh --build-only >/dev/null
  echo "  (the sanitizer builds and asan+ubsan test_generate took $((SECONDS - t0)) s beside the integration suites)"
  job_end "$bg_status"
) > "$bg_log" 2>&1 &
bg_pid=$!

section "integration (a real local cluster: tandem up, a Python grpcio client)"
run_py tests/integration/test_cluster.py integration 900

section "OpenAI HTTP API (the openai client against a real cluster)"
run_py tests/integration/test_http.py http 300

section "structured output (tandem grammar's token masks against llguidance's)"
run_py tests/integration/test_structured.py structured 300

section "security (the adversarial run's attacks against a real cluster, a victim request beside each)"
run_py tests/integration/test_security.py security 300

section "KV store (3 kvstore nodes, 2 prefill workers: prefixes from the store, restarts, bad block files, kill -9)"
run_py tests/integration/test_kvstore.py kvstore 900

section "KV store hot blocks (3 nodes, one reader near each: copies up to replicas_max, spread, cool, kill -9 of a home)"
run_py tests/integration/test_kvstore_hot.py kvstore-hot 240

section "router (the cache index heals from dropped events and a router restart; placement on cached prefixes; predictions; early rejection)"
run_py tests/integration/test_router.py router 300

# the scale suite's workload shift is timed (the planner must move a worker within its phase): it runs with the
# cores to itself, after the background job
section "waiting for the background job (the user's, sanitizer and fuzz builds; asan+ubsan test_generate)"
wait "$bg_pid"

section "scale (tandem scale under load: 1P+1D -> 2P+1D -> 1P+2D with a role flip; the ops config's errors; a workload shift under policy auto)"
run_py tests/cluster/test_scale.py scale 900

section "scheduling (the prefill queue's orders: cache-aware computes fewer prompt tokens, mlq keeps chats fast beside a flood; tenants share by their keys' weights)"
run_py tests/cluster/test_sched.py sched 600

# The cache-hits suite checks outputs against cold references, not times: it starts here, at a low CPU priority
# (nice 10: the suites that follow get the cores first), with a cache folder of its own (its clusters measure their
# start-up profiles under that load, which the suites beside it must not reuse), and runs beside the last suites;
# its output and counts are read back after them.
hits_log=$(mktemp) hits_status=$(mktemp)
(
  job_begin 10
  XDG_CACHE_HOME=$(mktemp -d)
  run_py tests/integration/test_cache_hits.py cache-hits 1500
  rm -rf "$XDG_CACHE_HOME"
  job_end "$hits_status"
) > "$hits_log" 2>&1 &
hits_pid=$!

# The sanitizers' other suites, the thread sanitizer's stress, the fuzzers and the CUDA build run beside the last
# suites and the cache-hits suite at the lowest CPU priority, as the background job above did; their output and
# counts are read back after them.
tail_log=$(mktemp) tail_status=$(mktemp)
(
  job_begin 19
  t0=$SECONDS
  echo "== address + undefined sanitizers (their builds and test_generate ran beside the integration suites)"
  cat "$bg_log"
  if [ -x build-asan/bin/tests/test_generate ]; then
    for t in build-asan/bin/tests/test_*; do
      [ "$(basename "$t")" = test_generate ] || TANDEM_TEST_QUICK=1 ASAN_OPTIONS=detect_leaks=1 run_one "$t" asan+ubsan
    done
  fi
  echo "  (the sanitizers' suites ended $((SECONDS - t0)) s into this job)"
  echo "== thread sanitizer (tests/tsan/tsan_stress.c: the objects threads share, driven concurrently)"
  if [ -x build-tsan/bin/tests/tsan_stress ]; then
    # UCX's memory hooks and TSan's interceptors do not mix: the hooks are off for this run
    if out=$(UCX_MEM_EVENTS=no UCX_MEM_MMAP_HOOK_MODE=none UCX_MEM_MALLOC_HOOKS=no \
             TSAN_OPTIONS="halt_on_error=1 suppressions=$root/tests/tsan/suppressions.txt" \
             timeout 600 build-tsan/bin/tests/tsan_stress models/SmolLM2-135M-Instruct.Q4_1.gguf 2>&1); then
      printf '%s\n' "$out" | grep '^tsan_stress:' | sed 's/^/  /'; passed=$((passed + 1))
    else
      printf '%s\n' "$out" | grep -v ' tandem' | tail -60; echo "FAILED: tsan_stress"; failed=$((failed + 1))
      failures+=("tsan_stress")
    fi
  else
    echo "thread sanitizer build failed"; failed=$((failed + 1)); failures+=("thread sanitizer build")
  fi
  echo "  (the thread sanitizer's stress ended $((SECONDS - t0)) s into this job)"
  echo "== fuzz (${fuzz_secs}s per target)"
  if [ "$fuzz_secs" -gt 0 ]; then
    if tests/fuzz/run.sh "$fuzz_secs"; then passed=$((passed + 1)); else failed=$((failed + 1)); failures+=("fuzz"); fi
  fi
  echo "== the CUDA build (build-cuda/: the backend's kernels compiled for sm_90, warnings as errors; the unit suites with CUDA branches, no GPU here)"
  if [ -x /usr/local/cuda/bin/nvcc ] || command -v nvcc >/dev/null; then
    if cmake -S . -B build-cuda -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTANDEM_TESTS=ON -DTANDEM_WERROR=ON -DTANDEM_CUDA=ON \
         >/dev/null && cmake --build build-cuda -j"$jobs" --target tandem tandem-cuda-check tandem-gemv-study \
         tandem-gemm-study test_transport test_generate >/dev/null; then
      run_one build-cuda/bin/tests/test_transport cuda
      run_one build-cuda/bin/tests/test_generate cuda --filter "generate/backend_devices_are_named_or_refused"
    else
      echo "CUDA build failed"; cmake --build build-cuda 2>&1 | grep -E "error|warning" | head -30
      failed=$((failed + 1)); failures+=("CUDA build")
    fi
  else
    echo "  no nvcc: the CUDA build is not made"
  fi
  echo "  (this job, begun with the cache-hits suite at $((t0 / 60))m$((t0 % 60))s, took $((SECONDS - t0)) s)"
  job_end "$tail_status"
) > "$tail_log" 2>&1 &
tail_pid=$!

section "hosts (three network-namespace hosts: greedy output, KV over TCP across hosts, certless clients refused by every port; kill -9 of each type, a link cut, etcd paused 30 s, the planner's router killed and frozen)"
run_py tests/cluster/test_hosts.py hosts 600

section "deploy files (systemd-analyze verify on the units, kubernetes-validate on the manifests, their configs)"
run_py tests/cluster/test_deploy.py deploy 300

section "docs (every relative link of README.md and docs/ resolves; the README's five-minute tour runs as written)"
run_py tests/cluster/test_docs.py docs 300

section "Prometheus (a real prometheus scrapes every process through the router's /targets; the TTFT histogram, the store's hit rate, the dashboard's queries)"
run_py tests/cluster/test_prometheus.py prometheus 300

section "cache hits (randomized shared-prefix workloads on real clusters vs cold single-process output; started after the scheduling suite, beside the suites since)"
wait "$hits_pid"
cat "$hits_log"

section "a user's build (Release, no test package: Criterion hidden from pkg-config, warnings not errors; built beside the integration suites before scale) and make demo's job on it"
dlog=$(mktemp)
if [ "$(tail -1 "$ulog")" = ok ] && deploy/demo.sh build-user >"$dlog" 2>&1 && [ -s "$dlog" ]; then
  echo "  user build (no Criterion) and demo: ok"; passed=$((passed + 1))
else
  echo "  user build (no Criterion) or its demo FAILED:"; tail -20 "$ulog" "$dlog" 2>/dev/null; failed=$((failed + 1))
  failures+=("user build (no Criterion) or its demo")
fi
rm -f "$ulog" "$dlog"

section "sanitizers, thread sanitizer, fuzz, the CUDA build (run beside the last suites; their output follows)"
wait "$tail_pid"
cat "$tail_log"
for st in "$bg_status" "$hits_status" "$tail_status"; do
  if [ -s "$st" ]; then
    { read -r p f; mapfile -t more; } < "$st"
    passed=$((passed + p)); failed=$((failed + f)); failures+=("${more[@]}")
  else
    echo "a background job ended without its result ($st)"; failed=$((failed + 1)); failures+=("background job")
  fi
done

section_end
echo "== time of each section"
printf '%s\n' "${sec_times[@]}"
for f in "${failures[@]}"; do echo "FAILED: $f"; done
echo "tests: $passed passed, $failed failed (in $((SECONDS / 60))m$((SECONDS % 60))s)"
[ "$failed" -eq 0 ]
