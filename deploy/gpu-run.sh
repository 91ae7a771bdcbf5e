#!/usr/bin/env bash
# gpu-run.sh — bundle/run.sh on the GPU machine (deploy/gpu-bundle.sh makes
# the bundle): every check and benchmark of the CUDA backend in one go; what
# it prints, then every log it kept, go to $OUT/gpu-run.log. Exit status:
# non-zero if a check failed. `bundle/run.sh 1 6` runs sections 1 and 6 only
# (the device tool's 10 minutes a call); no argument runs them all.
set -u
here=$(cd "$(dirname "$0")" && pwd)
work=${WORK:-/tmp/tandem-gpu-work}
out=$work/logs
mkdir -p "$out"
if [ -z "${GPU_RUN_TEED:-}" ]; then # everything printed also goes to $OUT/gpu-run.log, the logs after it
  mkdir -p "${OUT:-/tmp}"
  GPU_RUN_TEED=1 "$0" "$@" 2>&1 | tee "${OUT:-/tmp}/gpu-run.log"
  rc=${PIPESTATUS[0]}
  for f in "$out"/*; do printf '\n===== %s\n' "$(basename "$f")"; cat "$f"; done >> "${OUT:-/tmp}/gpu-run.log"
  exit "$rc"
fi
export LD_LIBRARY_PATH=$here/lib:/usr/local/cuda/lib64:/usr/local/cuda/lib:${LD_LIBRARY_PATH:-}
export UCX_MODULE_DIR=$here/lib/ucx
# the programs come compressed (deploy/gpu-bundle.sh): unpacked in place, once
for z in "$here"/bin/tandem*.xz; do
  [ -f "$z" ] || continue
  xz -dc "$z" > "${z%.xz}" && chmod +x "${z%.xz}" && rm -f "$z" || { echo "unpacking $z FAILED"; exit 1; }
done
T=$here/bin/tandem
fail=0
sections=" ${*:-1 2 3 4 5 6 7 8 9 11 12 14 16 17} " # 10 and 18 (two GPUs) only when named
want() { [[ $sections == *" $1 "* ]]; }
m7=$work/llama2-7b
make7b() {
  [ -f "$m7/model.safetensors" ] || python3 "$here/bench/make_random_llama.py" "$m7" --shape llama2-7b --dtype fp16 \
    --tokenizer "$here/fixtures/tiny-llama3" > "$out/make-7b.txt" 2>&1 || { echo "making the model FAILED"; cat "$out/make-7b.txt"; fail=1; }
}
# greedy ids at tp 2 over DEVICES against one rank on the GPU (tiny-llama3 and the 7B shape's dummy weights, made
# by the caller), MAX_TOKENS of them for each PROMPT: a line each in FILE (errors in FILE.err), fail=1 on a failed run
tp_greedy() { # DEVICES MAX_TOKENS FILE PROMPT...
  local devs=$1 n=$2 file=$3 spec m extra p a b; shift 3
  : > "$file"
  for spec in "$here/fixtures/tiny-llama3|" "$work/llama2-7b-dummy|--load-format dummy --kv-mib 2048"; do
    m=${spec%%|*}; extra=${spec#*|}
    for p in "$@"; do
      # shellcheck disable=SC2086
      a=$("$T" generate --model "$m" $extra --device cuda --ids --max-tokens "$n" --ignore-eos "$p" 2>/dev/null)
      # shellcheck disable=SC2086
      b=$("$T" generate --model "$m" $extra --device "$devs" --tp 2 --ids --max-tokens "$n" --ignore-eos "$p" \
          2>>"$file.err")
      [ -n "$b" ] || { echo "tp 2 over $devs on $(basename "$m") FAILED: $(tail -1 "$file.err")"; fail=1; }
      python3 -c "import sys; a, b = sys.argv[1].split(), sys.argv[2].split(); n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))); print('%s, %r: tp 2 over %s vs tp 1, the first %d of %d tokens equal' % (sys.argv[3], sys.argv[4], sys.argv[5], n, len(a)))" \
        "$a" "$b" "$(basename "$m")" "$p" "$devs" >> "$file"
    done
  done
  cat "$file"
}
# tandem up's etcd, carried compressed; tandem up finds it on PATH
unpack_etcd() {
  [ -x "$work/bin/etcd" ] ||
    { mkdir -p "$work/bin" && xz -dc "$here/bin/etcd.xz" > "$work/bin/etcd" && chmod +x "$work/bin/etcd"; }
  export PATH=$work/bin:$PATH
}
dev=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "device: $dev ($(nvidia-smi --query-gpu=driver_version,memory.total --format=csv,noheader | head -1)), $(date -u +%F)"

# the default model, joined from its three carried parts
smol=""
if [ -f "$here/smollm2.part-a" ] && [ -f "$here/../bundle-model-b/smollm2.part-b" ] &&
   [ -f "$here/../bundle-model-c/smollm2.part-c" ]; then
  cat "$here/smollm2.part-a" "$here/../bundle-model-b/smollm2.part-b" "$here/../bundle-model-c/smollm2.part-c" \
    > "$work/smollm2.gguf"
  if [ "$(sha256sum "$work/smollm2.gguf" | cut -d' ' -f1)" = "$(cat "$here/smollm2.sha256")" ]; then smol=$work/smollm2.gguf
  else echo "the joined default model's sha256 differs: skipped"; fi
fi

if want 1; then
echo "== 1. every op vs the CPU backend; the decoders; whole models vs the CPU backend and transformers"
python3 "$here/fixtures/make_logits_hf.py" "$work/tiny-fp32.json" >/dev/null &&
  python3 "$here/fixtures/make_logits_hf.py" "$work/tiny-bf16.json" bf16 >/dev/null || { echo "transformers reference FAILED"; fail=1; }
"$here/bin/tandem-cuda-check" --crafted "$here/fixtures/crafted.gguf" ${smol:+--model "$smol"} \
  --hf "$here/fixtures/tiny-llama3" "$work/tiny-fp32.json" --hf "$here/fixtures/tiny-llama3" "$work/tiny-bf16.json" \
  > "$out/check.txt" 2>&1 || fail=1
cat "$out/check.txt"
fi

if want 2 && [ -n "$smol" ]; then
  echo "== 2. the default model: greedy tokens and perplexity, cpu vs cuda"
  same=0; total=0
  for p in "The capital of France is" "Write a haiku about the sea." "def fibonacci(n):" "1, 2, 3, 4,"; do
    a=$("$T" generate --model "$smol" --ids --max-tokens 48 --ignore-eos --device cpu "$p" 2>/dev/null)
    b=$("$T" generate --model "$smol" --ids --max-tokens 48 --ignore-eos --device cuda "$p" 2>>"$out/generate.err")
    total=$((total + 1)); [ "$a" = "$b" ] && same=$((same + 1))
    printf '%s\n  cpu  %s\n  cuda %s\n' "$p" "$a" "$b" >> "$out/greedy.txt"
  done
  echo "greedy, 48 tokens: $same of $total prompts identical on cpu and cuda"
  for d in cpu cuda; do
    "$T" perplexity "$here/fixtures/ppl.txt" --model "$smol" --device $d > "$out/ppl-$d.txt" 2>&1
    echo "perplexity $d: $(head -1 "$out/ppl-$d.txt")"
  done
fi

want make7b && make7b
if want 3; then
echo "== 3. a Llama-2-7B-shaped model (random fp16 weights): tandem beside transformers"
make7b
: > "$out/tandem-7b.txt"
for b in 1 8 32 128 256; do
  kv=$(( b * 80 + 512 ))
  "$T" generate --model "$m7" --device cuda --n $b --max-tokens 128 --ignore-eos --ids --kv-mib $kv "hello" \
    2>&1 >/dev/null | grep -E "tok/s|error" | grep -v "outside the vocabulary" | sed "s/^/batch $b: /" >> "$out/tandem-7b.txt"
done
for n in 1024 4096; do # a prompt of n tokens less one (BOS comes first) under the model's tokenizer
  p=$(python3 "$here/bench/prompt_of.py" "$m7/tokenizer.json" $((n - 1)))
  "$T" generate --model "$m7" --device cuda --max-tokens 1 --ignore-eos --ids --token-budget 4096 --kv-mib 4096 "$p" \
    2>&1 >/dev/null | grep -E "tok/s|error" | grep -v "outside the vocabulary" | sed "s/^/prefill $n: /" >> "$out/tandem-7b.txt"
done
cat "$out/tandem-7b.txt"
python3 "$here/bench/hf_bench.py" "$m7" --logits "$work/7b-hf.json" > "$out/hf-7b.jsonl" 2> "$out/hf-7b.err" ||
  { echo "transformers benchmark FAILED"; tail -5 "$out/hf-7b.err"; fail=1; }
"$here/bin/tandem-cuda-check" --no-ops --no-timings --hf "$m7" "$work/7b-hf.json" > "$out/check-7b.txt" 2>&1 || fail=1
cat "$out/check-7b.txt"
cat "$out/hf-7b.jsonl"
fi

if want 4; then
echo "== 4. a Llama-3-8B-shaped model (GQA 32/8, random bf16 weights; both sides compute in fp16)"
m8=$work/llama3-8b
[ -f "$m8/model.safetensors" ] || python3 "$here/bench/make_random_llama.py" "$m8" --shape llama3-8b --dtype bf16 \
  --tokenizer "$here/fixtures/tiny-llama3" > "$out/make-8b.txt" 2>&1 || { echo "making the model FAILED"; cat "$out/make-8b.txt"; fail=1; }
python3 "$here/bench/hf_bench.py" "$m8" --logits "$work/8b-hf.json" --batches 1,32 --prefill 4096 > "$out/hf-8b.jsonl" \
  2> "$out/hf-8b.err" || { echo "transformers benchmark FAILED"; tail -5 "$out/hf-8b.err"; fail=1; }
"$here/bin/tandem-cuda-check" --no-ops --no-timings --hf "$m8" "$work/8b-hf.json" > "$out/check-8b.txt" 2>&1 || fail=1
cat "$out/check-8b.txt" "$out/hf-8b.jsonl"
"$T" generate --model "$m8" --device cuda --max-tokens 64 --ignore-eos --ids --kv-mib 1024 "hello" 2>&1 >/dev/null |
  grep -E "tok/s|error" | grep -v "outside the vocabulary" | sed "s/^/8b batch 1: /"
fi

if want 5; then
echo "== 5. timings: read bandwidth, GEMM/GEMV, attention; each model's forward pass whole and op by op"
tm=""; for m in "$m7" "${m8:-$work/llama3-8b}"; do [ -f "$m/model.safetensors" ] && tm="$tm --time-model $m"; done
"$here/bin/tandem-cuda-check" --no-ops $tm > "$out/timings.txt" 2>&1 || fail=1
grep -A1 timing "$out/timings.txt"
# the GEMV's shapes over a 7B step's weights (bench/gpu/gemv_study.cu)
"$here/bin/tandem-gemv-study" > "$out/gemv-study.txt" 2>&1 || { echo "tandem-gemv-study FAILED"; fail=1; }
grep -E "read floor|R2 U2 W8 persistent|before" "$out/gemv-study.txt" | head -4
fi

if want 6; then
echo "== 6. disaggregated on the GPU: a prefill and a decode worker, KV through CUDA IPC"
unpack_etcd
# CUDA IPC between two processes vs a device-to-device copy: chunks of one layer of one block
# (SmolLM2: 12 KiB; the 7B shape: 256 KiB; 1000 bytes, unaligned), and a put ordered after a fence
for c in 12288 262144 1000; do "$here/bin/tandem-bench-kvxfer" 1024 $c cuda_ipc 2>&1 || fail=1; done | tee "$out/kvxfer.txt"
mkdir -p "${OUT:-/tmp}/disagg"
if [ -n "$smol" ]; then
  python3 "$here/bench/disagg_gpu.py" --bin "$here/bin" --model "$smol" --out "${OUT:-/tmp}/disagg" --kv-mib 1024 \
    --lengths 128,1024 --identity 6 --bench "--sweep 4,16,64 --num-requests 64 --input-len uniform:64:1024 \
    --output-len fixed:64 --ignore-eos --goodput ttft:250,tpot:25" > "$out/disagg-smol.json" 2> "$out/disagg-smol.err" ||
    { echo "disaggregated SmolLM2 FAILED"; tail -5 "$out/disagg-smol.err"; fail=1; }
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print('SmolLM2 greedy, 48 tokens: %d of %d prompts identical disaggregated and single-process' % (d['identical'], len(d['identity']))); print(json.dumps(d['lengths'])); print(json.dumps(d['kv_transfer']))" "$out/disagg-smol.json" || fail=1
fi
make7b
python3 "$here/bench/disagg_gpu.py" --bin "$here/bin" --model "$m7" --out "${OUT:-/tmp}/disagg" --kv-mib 8192 \
  --lengths 1024,3072 --identity 2 --bench "--sweep 2,4,8,16,32 --num-requests 48 --output-len fixed:128 \
  --ignore-eos --goodput ttft:250,tpot:50" --bench-prompts 240:256:2048 > "$out/disagg-7b.json" \
  2> "$out/disagg-7b.err" || { echo "disaggregated 7B FAILED"; tail -5 "$out/disagg-7b.err"; fail=1; }
python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print('7B greedy, 48 tokens: %d of %d prompts identical' % (d['identical'], len(d['identity']))); print(json.dumps(d['lengths'])); print(json.dumps(d['kv_transfer'])); print(d.get('bench_tail', ''))" "$out/disagg-7b.json" || fail=1
fi
if want 7; then
echo "== 7. GPU workers over UCX (KV staged through page-locked host memory, as between hosts) and the KV store"
unpack_etcd
# device memory to device memory over UCX through host staging vs a device-to-host copy of the same chunks
for c in 12288 262144 1000; do "$here/bin/tandem-bench-kvxfer" 1024 $c ucx_staged 2>&1 || fail=1; done |
  tee "$out/kvxfer-staged.txt"
grep -q '"landed_ok": true, "ordered_after_fence": true' "$out/kvxfer-staged.txt" || { echo "staged transfer FAILED"; fail=1; }
if [ -n "$smol" ]; then
  for t in ucx auto; do # over UCX staged through host memory, then over CUDA IPC: each with a KV store node
    mkdir -p "${OUT:-/tmp}/disagg-$t"
    python3 "$here/bench/disagg_gpu.py" --bin "$here/bin" --model "$smol" --out "${OUT:-/tmp}/disagg-$t" --kv-mib 1024 \
      --transport $t --kvstores 1 --prefill-kv-mib 48 --store-len 1000 --lengths 128,1024 --identity 6 \
      > "$out/disagg-smol-$t.json" 2> "$out/disagg-smol-$t.err" ||
      { echo "disaggregated SmolLM2 (transport $t) FAILED"; tail -5 "$out/disagg-smol-$t.err"; fail=1; }
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print('SmolLM2, transport %s: greedy 48 tokens, %d of %d prompts identical disaggregated and single-process' % (sys.argv[2], d['identical'], len(d['identity']))); print(json.dumps(d['lengths'])); print(json.dumps(d['kv_transfer'])); print('store:', json.dumps(d['store'])); sys.exit(0 if d['identical'] == len(d['identity']) and d['store']['same_as_single'] and d['store']['again']['from_store'] > 0 else 1)" "$out/disagg-smol-$t.json" $t || fail=1
  done
fi
fi
if want 8; then
echo "== 8. the Llama-2-7B shape over UCX staged, with a KV store node: 8 MiB blocks through host memory"
# on two GPUs: S8_ARGS="--prefill-device cuda:0 --decode-device cuda:1"
unpack_etcd
make7b
mkdir -p "${OUT:-/tmp}/disagg-7b-ucx"
python3 "$here/bench/disagg_gpu.py" --bin "$here/bin" --model "$m7" --out "${OUT:-/tmp}/disagg-7b-ucx" --kv-mib 8192 \
  --transport ucx --kvstores 1 --kvstore-mib 4096 --prefill-kv-mib 1024 --store-len 1000 --lengths 1024 --reps 2 \
  --identity 2 ${S8_ARGS:-} > "$out/disagg-7b-ucx.json" 2> "$out/disagg-7b-ucx.err" ||
  { echo "disaggregated 7B over UCX FAILED"; tail -5 "$out/disagg-7b-ucx.err"; fail=1; }
python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print('7B over UCX, greedy 48 tokens: %d of %d prompts identical' % (d['identical'], len(d['identity']))); print(json.dumps(d['lengths'])); print(json.dumps(d['kv_transfer'])); print('store:', json.dumps(d['store'])); sys.exit(0 if d['identical'] == len(d['identity']) and d['store']['same_as_single'] and d['store']['again']['from_store'] > 0 else 1)" "$out/disagg-7b-ucx.json" || fail=1
fi
if want 9; then
echo "== 9. DistServe's comparison on this GPU: disaggregated (1 prefill + 1 decode worker) vs colocated, SLO goodput"
make7b
unpack_etcd
# (bundle: deploy/gpu-bundle.sh 9 10.) One workload a call fits the device tool's 10 minutes:
# DS_WORKLOADS=chat, then summary, then mixed (DS_MODES picks
# among disagg, colocated, auto, planner); on two GPUs
# DS_ARGS="--prefill-device cuda:0 --decode-device cuda:1 --colocated 2 --colocated-device cuda:0,cuda:1
#          --planner-workers 2 --planner-devices cuda:0,cuda:1"; on four DS_MODES=disagg:3x1,disagg:2x2,disagg:1x3,
# colocated,planner and DS_ARGS="--gpus cuda:0,cuda:1,cuda:2,cuda:3 --colocated 4 --colocated-device (the same)
#          --planner-workers 4 --planner-devices (the same)" (issue 49's table: each fixed shape beside auto)
mkdir -p "${OUT:-/tmp}/distserve"
# shellcheck disable=SC2086
python3 "$here/bench/distserve.py" --bin "$here/bin" --model "$m7" --out "${OUT:-/tmp}/distserve" \
  --workloads "${DS_WORKLOADS:-chat,summary,mixed}" --modes "${DS_MODES:-disagg,colocated,auto}" ${DS_ARGS:-} \
  > "$out/distserve.json" 2> "$out/distserve.err" ||
  { echo "the DistServe comparison FAILED"; tail -5 "$out/distserve.err"; fail=1; }
python3 -c "
import json, sys
d = json.load(open(sys.argv[1]))
for n, w in d['workloads'].items():
    print('%s: alone %s; SLOs TTFT %.1f ms, TPOT %.2f ms' % (n, '; '.join('%s TTFT %.1f ms, TPOT %.2f ms' % (
          k, a['ttft_ms'], a['tpot_ms']) for k, a in w['alone'].items()), w['slo']['ttft_ms'], w['slo']['tpot_ms']))
    for m, g in w['modes'].items():
        print('  %-11s goodput %s req/s (bench exit %s); attainment by rate %s; ways by rate %s%s' % (m, g.get('goodput'),
              g.get('bench_exit'), g.get('curve'), g.get('ways'), '; the planner: %s' % g['planner'] if 'planner' in g
              else ''))
" "$out/distserve.json" || fail=1
fi
if want 10; then
echo "== 10. two GPUs of one host: prefill on cuda:0, decode on cuda:1, the KV GPU to GPU"
ngpu=$(nvidia-smi -L | wc -l)
if [ "$ngpu" -lt 2 ]; then echo "two GPUs needed, $ngpu here: skipped"; fail=1; else
unpack_etcd
make7b
nvidia-smi topo -m > "$out/topo.txt" 2>&1; cat "$out/topo.txt"
# CUDA IPC peer to peer (one layer of one block: SmolLM2 12 KiB, the 7B shape 256 KiB; 1000 bytes, unaligned;
# 8 MiB, a 7B block's every layer) against cudaMemcpyPeerAsync of the same chunks and of all the bytes at once;
# then UCX staged through host memory between the two GPUs (the path between hosts)
{ for c in 12288 262144 1000 8388608; do "$here/bin/tandem-bench-kvxfer" 1024 $c cuda_ipc 0 1 2>&1 || fail=1; done
  "$here/bin/tandem-bench-kvxfer" 1024 262144 ucx_staged 0 1 2>&1 || fail=1; } | tee "$out/kvxfer-two-gpus.txt"
grep -q '"gpus": \[0, 1\].*"landed_ok": true, "ordered_after_fence": true' "$out/kvxfer-two-gpus.txt" ||
  { echo "peer-to-peer transfer FAILED"; fail=1; }
mkdir -p "${OUT:-/tmp}/disagg-2gpu"
python3 "$here/bench/disagg_gpu.py" --bin "$here/bin" --model "$m7" --out "${OUT:-/tmp}/disagg-2gpu" --kv-mib 8192 \
  --prefill-device cuda:0 --decode-device cuda:1 --lengths 1024,3072 --identity 2 > "$out/disagg-7b-2gpu.json" \
  2> "$out/disagg-7b-2gpu.err" || { echo "disaggregated 7B on two GPUs FAILED"; tail -5 "$out/disagg-7b-2gpu.err"; fail=1; }
python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print('7B on two GPUs, greedy 48 tokens: %d of %d prompts identical' % (d['identical'], len(d['identity']))); print(json.dumps(d['lengths'])); print(json.dumps(d['kv_transfer'])); sys.exit(0 if d['identical'] == len(d['identity']) else 1)" "$out/disagg-7b-2gpu.json" || fail=1
fi
fi

if want 11; then
echo "== 11. FP8 weights (E4M3, a scale a row): PyTorch's reference, fp8 against fp16 — quality and speed"
python3 "$here/fixtures/make_fp8_ref.py" "${OUT:-/tmp}/tiny-llama3-fp8.json" > "$out/fp8-ref.txt" 2>&1 ||
  { echo "the FP8 reference FAILED"; cat "$out/fp8-ref.txt"; fail=1; }
make7b
"$here/bin/tandem-cuda-check" --no-ops --no-timings --model "$here/fixtures/tiny-llama3" --fp8-model "$m7" \
  > "$out/check-fp8.txt" 2>&1 || fail=1
cat "$out/check-fp8.txt"
if [ -n "$smol" ]; then
  same=0; total=0
  for p in "The capital of France is" "Write a haiku about the sea." "def fibonacci(n):" "1, 2, 3, 4," \
      "Explain photosynthesis in one sentence." "The quick brown fox" "List three prime numbers:" \
      "Translate 'good morning' into French:" "Once upon a time" "What is the boiling point of water?"; do
    a=$("$T" generate --model "$smol" --ids --max-tokens 48 --ignore-eos --device cuda "$p" 2>/dev/null)
    b=$("$T" generate --model "$smol" --ids --max-tokens 48 --ignore-eos --device cuda --weights fp8 "$p" 2>>"$out/fp8.err")
    total=$((total + 1)); [ "$a" = "$b" ] && same=$((same + 1))
    python3 -c "import sys; a, b = sys.argv[1].split(), sys.argv[2].split(); n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))); print('%s: the first %d of 48 tokens equal' % (sys.argv[3], n))" "$a" "$b" "$p" >> "$out/fp8-greedy.txt"
  done
  cat "$out/fp8-greedy.txt"
  echo "SmolLM2 greedy, 48 tokens: $same of $total prompts identical with fp8 and fp16 weights on the GPU"
  for w in file fp8; do
    "$T" perplexity "$here/fixtures/ppl.txt" --model "$smol" --device cuda --weights $w > "$out/ppl-cuda-$w.txt" 2>&1
    echo "SmolLM2 perplexity, cuda, weights $w: $(tail -1 "$out/ppl-cuda-$w.txt")"
  done
fi
# the Llama-2-7B shape: batch-1 decode alternating fp16 and fp8 (3 rounds), then larger batches, then prefill
: > "$out/fp8-7b.txt"
for r in 1 2 3; do for w in file fp8; do
  "$T" generate --model "$m7" --device cuda --weights $w --max-tokens 256 --ignore-eos --ids --kv-mib 1024 "hello" \
    2>&1 >/dev/null | grep -E "tok/s|error" | sed "s/^/round $r, weights $w, batch 1: /" >> "$out/fp8-7b.txt"
done; done
for b in 8 32 64 128 256; do for w in file fp8; do
  "$T" generate --model "$m7" --device cuda --weights $w --n $b --max-tokens 128 --ignore-eos --ids \
    --kv-mib $(( b * 80 + 512 )) "hello" 2>&1 >/dev/null | grep -E "tok/s|error" | sed "s/^/weights $w, batch $b: /" \
    >> "$out/fp8-7b.txt"
done; done
p4=$(python3 "$here/bench/prompt_of.py" "$m7/tokenizer.json" 4095)
for w in file fp8; do
  "$T" generate --model "$m7" --device cuda --weights $w --max-tokens 1 --ignore-eos --ids --token-budget 4096 \
    --kv-mib 4096 "$p4" 2>&1 >/dev/null | grep -E "tok/s|error" | sed "s/^/weights $w, prefill 4096: /" >> "$out/fp8-7b.txt"
done
sed -E 's/\| KV .*//' "$out/fp8-7b.txt"
fi

if want 12; then
echo "== 12. the dummy load format: shapes without weights (the GPU fills the CPU's bits; the 7B shape as from a file;"
echo "   the Llama-3-70B shape in FP8 on one GPU)"
for sh in llama2-7b llama3-70b; do
  python3 "$here/bench/make_random_llama.py" "$work/$sh-dummy" --shape $sh --tokenizer "$here/fixtures/tiny-llama3" \
    --config-only >> "$out/make-dummy.txt" 2>&1 || { echo "making $sh's config FAILED"; fail=1; }
done
mkdir -p "$work/tiny-dummy" && cp "$here/fixtures/tiny-llama3/"*.json "$work/tiny-dummy/" && rm -f "$work/tiny-dummy/model.safetensors"
"$here/bin/tandem-cuda-check" --no-ops --no-timings --dummy --model "$work/tiny-dummy" > "$out/check-dummy.txt" 2>&1 || fail=1
grep -E "rel err|greedy|failed" "$out/check-dummy.txt"
: > "$out/dummy.txt"
for w in file fp8; do
  "$T" generate --model "$work/llama2-7b-dummy" --load-format dummy --device cuda --weights $w --max-tokens 256 --ignore-eos \
    --ids --kv-mib 1024 "hello" 2>&1 >/dev/null | grep -E "tok/s|error" | sed "s/^/7B dummy, weights $w, batch 1: /" >> "$out/dummy.txt"
done
for b in 1 8 32 64; do
  "$T" generate --model "$work/llama3-70b-dummy" --load-format dummy --device cuda --weights fp8 --n $b --max-tokens 64 \
    --ignore-eos --ids --kv-mib 8192 "hello" 2>&1 >/dev/null | grep -E "tok/s|error" | sed "s/^/70B dummy fp8, batch $b: /" >> "$out/dummy.txt"
done
"$T" generate --model "$work/llama3-70b-dummy" --load-format dummy --device cuda --weights fp8 --max-tokens 1 --ignore-eos \
  --ids --token-budget 1024 --kv-mib 8192 "$(python3 -c "print(' '.join(str(i % 97) for i in range(1020)))")" 2>&1 >/dev/null |
  grep -E "tok/s|error" | sed "s/^/70B dummy fp8, prefill ~1k: /" >> "$out/dummy.txt"
sed -E 's/\| KV .*//' "$out/dummy.txt"
nvidia-smi --query-gpu=memory.used --format=csv,noheader
fi

if want 13; then
echo "== 13. structured output on the GPU: the mask made on the host, the pick made on the GPU within it; the"
echo "   same texts as the CPU backend's, each valid; tokens/s with and without a JSON Schema at batch 1 and 32 (7B shape)"
tiny=$here/fixtures/tiny-llama3
: > "$out/structured.txt"
while IFS='|' read -r name args check; do
  for d in cpu cuda; do
    eval "\"$T\" generate --model \"$tiny\" --device $d --max-tokens 48 $args \"Hello\"" \
      > "$out/structured-$name-$d.txt" 2>"$out/structured-$name-$d.err" || { echo "$name on $d FAILED"; fail=1; }
  done
  python3 - "$out/structured-$name-cpu.txt" "$out/structured-$name-cuda.txt" "$check" "$name" >> "$out/structured.txt" <<'PY'
import json, re, sys
a, b = (open(f).read().rstrip("\n") for f in sys.argv[1:3])
check, name = sys.argv[3], sys.argv[4]
def valid(t):
    try:
        return bool(eval(check, {"json": json, "re": re, "t": t}))
    except Exception:
        return False
print("%s: cuda %r, valid %s; cpu valid %s; the same text %s" % (name, b[:60], valid(b), valid(a), a == b))
PY
done <<'EOF2'
json-object-bounded|--json-schema '{"type":"object","properties":{"k":{"type":"string","maxLength":4},"v":{"enum":[1,2,null]}}}'|isinstance(json.loads(t), dict)
json-schema|--json-schema '{"type":"object","properties":{"a":{"type":"integer"},"b":{"type":"array","items":{"type":"boolean"},"maxItems":3}}}'|set(json.loads(t)) == {"a", "b"}
regex|--regex '[a-z]{3,8}( [0-9]{2}){2}'|re.fullmatch(r"[a-z]{3,8}( [0-9]{2}){2}", t)
choice|--choice alpha --choice beta --choice gamma|t in ("alpha", "beta", "gamma")
EOF2
cat "$out/structured.txt"
grep -q "valid False" "$out/structured.txt" && { echo "structured output: an invalid text"; fail=1; }
m7d=$work/llama2-7b-dummy
[ -f "$m7d/config.json" ] || python3 "$here/bench/make_random_llama.py" "$m7d" --shape llama2-7b \
  --tokenizer "$tiny" --config-only >> "$out/make-dummy.txt" 2>&1
schema='{"type":"array","items":{"type":"integer"},"minItems":60,"maxItems":80}'
for b in 1 32; do
  for rep in 1 2; do
    for mode in plain schema; do
      extra="--ignore-eos"; [ $mode = schema ] && extra="--json-schema $schema"
      "$T" generate --model "$m7d" --load-format dummy --device cuda --n $b --max-tokens 128 --ids --kv-mib 4096 \
        --temperature 0.8 --seed $rep $extra "hello" 2>&1 >/dev/null | grep -oE "decode [0-9]+ tokens in [0-9.]+ ms = [0-9.]+ tok/s" |
        sed "s/^/7B dummy, batch $b, $mode, run $rep: /"
    done
  done
done | tee "$out/structured-speed.txt"
fi

if want 14; then
echo "== 14. the fp8_e4m3 KV cache on the GPU (a row's codes and its scale): greedy and perplexity against fp16 KV and"
echo "   the CPU backend's fp8 KV; the KV bytes a disaggregated prefill moves; decode and prefill tokens/s (7B shape)"
if [ -n "$smol" ]; then
  : > "$out/kv8-greedy.txt"; same16=0; samecpu=0; total=0
  for p in "The capital of France is" "Write a haiku about the sea." "def fibonacci(n):" "1, 2, 3, 4," \
      "Explain photosynthesis in one sentence." "The quick brown fox" "List three prime numbers:" \
      "Translate 'good morning' into French:" "Once upon a time" "What is the boiling point of water?"; do
    g="--model $smol --ids --max-tokens 48 --ignore-eos"
    a=$("$T" generate $g --device cuda "$p" 2>/dev/null)
    b=$("$T" generate $g --device cuda --kv-dtype fp8 "$p" 2>>"$out/kv8.err")
    c=$("$T" generate $g --device cpu --kv-dtype fp8 "$p" 2>/dev/null)
    total=$((total + 1)); [ "$a" = "$b" ] && same16=$((same16 + 1)); [ "$b" = "$c" ] && samecpu=$((samecpu + 1))
    python3 -c "import sys; a, b = sys.argv[1].split(), sys.argv[2].split(); n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))); print('%s: the first %d of 48 tokens equal' % (sys.argv[3], n))" "$a" "$b" "$p" >> "$out/kv8-greedy.txt"
  done
  cat "$out/kv8-greedy.txt"
  echo "SmolLM2 greedy, 48 tokens, fp8 KV on the GPU: $same16 of $total prompts identical to fp16 KV (the GPU's),"
  echo "  $samecpu of $total to the CPU backend's fp8 KV"
  for kd in fp16 fp8; do
    "$T" perplexity "$here/fixtures/ppl.txt" --model "$smol" --device cuda --kv-dtype $kd > "$out/ppl-cuda-kv-$kd.txt" 2>&1
    echo "SmolLM2 perplexity, cuda, KV $kd: $(tail -1 "$out/ppl-cuda-kv-$kd.txt")"
  done
  unpack_etcd
  mkdir -p "${OUT:-/tmp}/kv8"
  for kd in fp16 fp8_e4m3; do
    python3 "$here/bench/disagg_gpu.py" --bin "$here/bin" --model "$smol" --out "${OUT:-/tmp}/kv8" --kv-mib 1024 \
      --kv-dtype $kd --lengths 1024 --reps 2 --identity 6 > "$out/kv8-disagg-$kd.json" 2> "$out/kv8-disagg-$kd.err" ||
      { echo "disaggregated SmolLM2, KV $kd FAILED"; tail -5 "$out/kv8-disagg-$kd.err"; fail=1; }
    python3 -c "
import json, sys
d = json.load(open(sys.argv[1]))
print('SmolLM2 disaggregated, KV %s: greedy %d of %d prompts identical to the single process; 1024 tokens: %s; KV moved: %s'
      % (d['kv_dtype'], d['identical'], len(d['identity']), json.dumps(d['lengths']), json.dumps(d['kv_transfer'])))
sys.exit(d['identical'] != len(d['identity']))" "$out/kv8-disagg-$kd.json" || fail=1
  done
fi
# the Llama-2-7B shape (dummy weights): decode at a context of ~1,000 tokens, batch 1, 16 and 64, fp16 and fp8 KV
# alternating (2 rounds); then a 4,096-token prefill
m7d=$work/llama2-7b-dummy
[ -f "$m7d/config.json" ] || python3 "$here/bench/make_random_llama.py" "$m7d" --shape llama2-7b \
  --tokenizer "$here/fixtures/tiny-llama3" --config-only >> "$out/make-dummy.txt" 2>&1
words() { python3 -c "
from tokenizers import Tokenizer
t = Tokenizer.from_file('$m7d/tokenizer.json')
w = []
while len(t.encode(' '.join(w), add_special_tokens=False).ids) < $1:
    w.append(str(len(w) % 97))
print(' '.join(w[:-1]))"; }
p1=$(words 1000); p4=$(words 4095)
: > "$out/kv8-7b.txt"
for r in 1 2; do for b in 1 16 64; do for kd in fp16 fp8; do
  "$T" generate --model "$m7d" --load-format dummy --device cuda --kv-dtype $kd --n $b --max-tokens 128 \
    --ignore-eos --ids --kv-mib 40000 "$p1" 2>&1 >/dev/null | grep -E "tok/s|error" |
    sed "s/^/round $r, KV $kd, batch $b, context ~1k: /" >> "$out/kv8-7b.txt"
done; done; done
for kd in fp16 fp8; do
  "$T" generate --model "$m7d" --load-format dummy --device cuda --kv-dtype $kd --max-tokens 1 --ignore-eos --ids \
    --token-budget 4096 --kv-mib 4096 "$p4" 2>&1 >/dev/null | grep -E "tok/s|error" |
    sed "s/^/KV $kd, prefill 4096: /" >> "$out/kv8-7b.txt"
done
sed -E 's/\| KV .*//' "$out/kv8-7b.txt"
grep -q error "$out/kv8-7b.txt" && fail=1
fi

if want 15; then
echo "== 15. tensor parallelism on one GPU (both ranks on it, their all-reduce in memory; NCCL takes a GPU a rank):"
echo "   greedy ids at tp 2 against tp 1 (tiny-llama3, the 7B shape with dummy weights); tp 2 over GPUs this machine lacks"
tiny=$here/fixtures/tiny-llama3
m7d=$work/llama2-7b-dummy
[ -f "$m7d/config.json" ] || python3 "$here/bench/make_random_llama.py" "$m7d" --shape llama2-7b \
  --tokenizer "$tiny" --config-only >> "$out/make-dummy.txt" 2>&1
tp_greedy cuda:0,0 32 "$out/tp.txt" "Hello world" "The quick brown fox" "1 2 3 4"
"$T" generate --model "$tiny" --device cuda:0,1 --tp 2 --max-tokens 4 "Hello" > /dev/null 2> "$out/tp-two.err"
rc=$?
echo "tp 2 over cuda:0,1 on a machine of $(nvidia-smi -L | wc -l) GPU(s): exit $rc: $(grep -v '^$' "$out/tp-two.err" | tail -1)"
fi

if want 16; then
echo "== 16. batched decode and prefill of the 7B shape (dummy weights): tok/s at batch 1, 64 and 256 and a 4k prompt's"
echo "   TTFT (2 rounds); a step op by op at batch 64 and 256 against its floors; the step's GEMMs laid out for cuBLAS"
m7d=$work/llama2-7b-dummy
MODEL_DIR=$m7d bash "$here/bench/batch_ab.sh" "$out" "$T" "" 2 | tee "$out/batch.txt"
"$here/bin/tandem-cuda-check" --no-ops --no-timings --dummy --time-model "$m7d" > "$out/batch-ops.txt" 2>&1 || fail=1
grep -A1 "timing decode batch" "$out/batch-ops.txt"
"$here/bin/tandem-gemm-study" 1 64 256 1024 4096 > "$out/gemm-study.txt" 2>&1 || { echo "tandem-gemm-study FAILED"; fail=1; }
grep -E "peak|m +256|m 4096" "$out/gemm-study.txt"
fi

if want 17; then
echo "== 17. the peers on the 7B shape (issue 51): decode tok/s at batch 1-256 (128 tokens after a 16-token prompt)"
echo "   and prefill at 1k/4k/16k, fp16 and FP8 weights: tandem, a torch.compile'd decode loop (gpt-fast's method,"
echo "   bench/compile_peer.py) and llama.cpp's CUDA build (F16, Q8_0); P17 picks the parts (tandem compile llamacpp)"
parts=" ${P17:-tandem compile llamacpp} "
m7d=$work/llama2-7b-dummy m7l=$work/llama2-7b-dummy-32k
[ -f "$m7d/config.json" ] || python3 "$here/bench/make_random_llama.py" "$m7d" --shape llama2-7b \
  --tokenizer "$here/fixtures/tiny-llama3" --config-only >> "$out/make-dummy.txt" 2>&1
# the same shape with room for a 16k prompt (the shape's 4,096 positions are a config value; speed does not see it)
[ -f "$m7l/config.json" ] || { cp -r "$m7d" "$m7l" && python3 -c "
import json, sys; p = sys.argv[1] + '/config.json'; c = json.load(open(p)); c['max_position_embeddings'] = 32768
json.dump(c, open(p, 'w'), indent=1)" "$m7l"; }
nvidia-smi --query-gpu=clocks.max.sm,power.limit --format=csv,noheader | sed 's/^/clock, power limit: /'
echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//'), $(nproc) cores"
if [[ $parts == *" tandem "* ]]; then
  : > "$out/peers-tandem.txt"
  p16=$(python3 "$here/bench/prompt_of.py" "$m7d/tokenizer.json" 16) # 15 tokens or a few less, then BOS
  # with bundle/base/tandem (another build, for an A/B), each run of this build is followed by one of that build
  for b in 1 8 32 64 128 256; do for w in file fp8; do for v in new base; do
    t=$T; [ $v = base ] && t=$here/base/tandem
    [ -x "$t" ] || continue
    "$t" generate --model "$m7d" --load-format dummy --device cuda --weights $w --n $b --max-tokens 128 \
      --ignore-eos --ids --kv-mib $((b * 80 + 512)) "$p16" 2>&1 >/dev/null |
      grep -oE "prompt [0-9]+ tokens|decode [0-9]+ tokens in [0-9.]+ ms = [0-9.]+ tok/s|error.*" | tr '\n' ' ' |
      sed "s/^/tandem$([ $v = base ] && echo " (base)"), weights $w, batch $b: /; s/$/\n/" >> "$out/peers-tandem.txt"
  done; done; done
  "$here/bin/tandem-cuda-check" --no-ops --no-timings --dummy --time-prefill "$m7l" >> "$out/peers-tandem.txt" 2>&1 || fail=1
  grep -E "^tandem|timing prefill" "$out/peers-tandem.txt"
fi
if [[ $parts == *" compile "* ]]; then
  for w in fp16 fp8; do
    PYTHONUNBUFFERED=1 timeout 290 python3 "$here/bench/compile_peer.py" --shape llama2-7b --weights $w \
      > "$out/peers-compile-$w.jsonl" 2> "$out/peers-compile-$w.err" ||
      { echo "the torch.compile peer, $w: FAILED or cut at 290 s"; tail -3 "$out/peers-compile-$w.err"; }
    cat "$out/peers-compile-$w.jsonl"
  done
fi
if [[ $parts == *" llamacpp "* ]]; then
  Ld=$here/../bundle-llamacpp
  if [ -f "$Ld/llama-batched-bench.xz" ]; then
    mkdir -p "$work/bin" && xz -dc "$Ld/llama-batched-bench.xz" > "$work/bin/llama-batched-bench" &&
      chmod +x "$work/bin/llama-batched-bench"
  fi
  B=$work/bin/llama-batched-bench
  if [ ! -x "$B" ]; then echo "llama.cpp: no bundle-llamacpp/ carried (LLAMACPP=... deploy/gpu-bundle.sh 17)"; else
  for ty in f16 q8_0; do
    g=$work/llama2-7b-$ty.gguf
    [ -f "$g" ] || PYTHONPATH=$Ld/gguf-py python3 "$here/bench/make_random_gguf.py" "$g" --shape llama2-7b --type $ty \
      >> "$out/peers-gguf.txt" 2>&1 || { echo "making the $ty GGUF FAILED"; tail -3 "$out/peers-gguf.txt"; continue; }
    # decode: each sequence its own 16-token prompt, then 128 tokens; flash attention on, every layer on the GPU
    timeout 200 "$B" -m "$g" -c 40960 -b 2048 -ub 512 -npp 16 -ntg 128 -npl 1,8,32,64,128,256 -ngl 99 -fa on \
      --output-format jsonl > "$out/peers-llamacpp-$ty.jsonl" 2> "$out/peers-llamacpp-$ty.err" ||
      { echo "llama-batched-bench $ty FAILED"; tail -3 "$out/peers-llamacpp-$ty.err"; }
    # prefill: one prompt in ubatches of 4,096 tokens, each length twice (the second is the warm one)
    timeout 120 "$B" -m "$g" -c 16512 -b 16384 -ub 4096 -npp 1024,1024,4096,4096,16384,16384 -ntg 1 -npl 1 -ngl 99 \
      -fa on --output-format jsonl > "$out/peers-llamacpp-pp-$ty.jsonl" 2> "$out/peers-llamacpp-pp-$ty.err" ||
      { echo "llama-batched-bench prefill $ty FAILED"; tail -3 "$out/peers-llamacpp-pp-$ty.err"; }
    python3 -c "
import json, sys
for f in sys.argv[1:3]:
    for l in open(f):
        if l.startswith('{'):
            r = json.loads(l)
            if r['tg'] > 1:
                print('llama.cpp %s, batch %d: decode %.1f tok/s (%.2f ms a step)' % (sys.argv[3], r['pl'], r['speed_tg'], r['t_tg'] / r['tg'] * 1e3))
            else:
                print('llama.cpp %s, prefill %d: %.1f ms = %.0f tok/s' % (sys.argv[3], r['pp'], r['t_pp'] * 1e3, r['speed_pp']))" \
      "$out/peers-llamacpp-$ty.jsonl" "$out/peers-llamacpp-pp-$ty.jsonl" $ty
    rm -f "$g" # 13.5 GB (F16): the disk holds one at a time
  done
  fi
fi
# side by side, with each one's fraction of the roofline, from what this call's and earlier calls' parts left
python3 "$here/bench/peers_table.py" "$out" --shape llama2-7b
fi

if want 18; then
echo "== 18. tensor parallelism over GPUs (issue 50): NCCL's all-reduce against the link; greedy ids at tp 2 over"
echo "   cuda:0,1 against tp 1; batch-1 decode of the 7B shape at tp 1 and 2; the 70B shape (dummy weights) at tp 2:"
echo "   decode at batch 1-128 against its floor, prefill 1k and 4k; disaggregated with different parallelism (8B"
echo "   shape): prefill tp 2 -> decode tp 1 and the reverse, against one process. P18 picks the parts"
parts=" ${P18:-allreduce greedy speed 70b disagg} "
ngpu=$(nvidia-smi -L | wc -l)
if [ "$ngpu" -lt 2 ]; then echo "two GPUs needed, $ngpu here: skipped"; fail=1; else
unpack_etcd
nvidia-smi topo -m > "$out/topo.txt" 2>&1; cat "$out/topo.txt"
tiny=$here/fixtures/tiny-llama3
m7d=$work/llama2-7b-dummy m8d=$work/llama3-8b-dummy m70d=$work/llama3-70b-dummy
for s in llama2-7b:$m7d llama3-8b:$m8d llama3-70b:$m70d; do
  [ -f "${s#*:}/config.json" ] || python3 "$here/bench/make_random_llama.py" "${s#*:}" --shape "${s%%:*}" \
    --tokenizer "$tiny" --config-only >> "$out/make-dummy.txt" 2>&1
done
p16=$(python3 "$here/bench/prompt_of.py" "$tiny/tokenizer.json" 16)
if [[ $parts == *" allreduce "* ]]; then
  for g in 2 $([ "$ngpu" -ge 4 ] && echo 4); do
    "$here/bin/tandem-bench-allreduce" $g 256 > "$out/allreduce-$g.jsonl" 2> "$out/allreduce-$g.err" ||
      { echo "the all-reduce over $g GPUs FAILED: $(tail -1 "$out/allreduce-$g.err")"; fail=1; }
    cat "$out/allreduce-$g.jsonl"
  done
fi
if [[ $parts == *" greedy "* ]]; then
  tp_greedy cuda:0,1 48 "$out/tp2.txt" "Hello world" "The quick brown fox" "1 2 3 4" "Once upon a time"
fi
dec() { # MODEL DEVICE TP BATCH KV_MIB LABEL: one decode run's tok/s line
  "$T" generate --model "$1" --load-format dummy --device "$2" --tp "$3" --n "$4" --max-tokens 128 --ignore-eos \
    --ids --kv-mib "$5" "$p16" 2>&1 >/dev/null |
    grep -oE "decode [0-9]+ tokens in [0-9.]+ ms = [0-9.]+ tok/s|error.*" | sed "s/^/$6, tp $3, batch $4: /"
}
if [[ $parts == *" speed "* ]]; then
  for r in 1 2; do dec "$m7d" cuda 1 1 1024 "7B shape"; dec "$m7d" cuda:0,1 2 1 1024 "7B shape"; done |
    tee "$out/tp-7b-speed.txt"
fi
if [[ $parts == *" 70b "* ]]; then
  { for b in 1 8 32 128; do dec "$m70d" cuda:0,1 2 $b $((b * 48 + 1024)) "70B shape"; done
    for n in 1024 4096; do
      pn=$(python3 "$here/bench/prompt_of.py" "$tiny/tokenizer.json" $n)
      for r in 1 2; do # the second is the warm one
        "$T" generate --model "$m70d" --load-format dummy --device cuda:0,1 --tp 2 --max-tokens 1 --ids \
          --token-budget 4096 --kv-mib 4096 "$pn" 2>&1 >/dev/null |
          grep -oE "prompt [0-9]+ tokens|TTFT [0-9.]+ ms|error.*" | tr '\n' ' ' | sed "s/^/70B shape, tp 2, prefill: /; s/$/\n/"
      done
    done; } | tee "$out/tp-70b.txt"
  # the floor: each GPU reads half the fp16 weights a step, at GPU 0's measured read bandwidth; the all-reduces
  # (two a layer) at batch 1 from the bench's time for 32 KiB (8,192 fp32 values)
  python3 - "$out" "$here/bench" <<'PY'
import json, os, re, sys
sys.path.insert(0, sys.argv[2])
from make_random_llama import SHAPES
s = SHAPES["llama3-70b"]
H, F, V, L = s["hidden_size"], s["intermediate_size"], s["vocab_size"], s["num_hidden_layers"]
kvd = s["num_key_value_heads"] * H // s["num_attention_heads"]
half = 2.0 * (L * (2 * H * H + 2 * H * kvd + 3 * H * F) + V * H) / 2
rows = [json.loads(l) for l in open(os.path.join(sys.argv[1], "allreduce-2.jsonl")) if l.startswith("{")] \
    if os.path.exists(os.path.join(sys.argv[1], "allreduce-2.jsonl")) else []
bw = next((r["read_gbs"] for r in rows if "read_gbs" in r), 0)
ar = next((r["us"] for r in rows if r.get("bytes") == 4 * H), 0)
m = re.search(r"batch 1: decode \d+ tokens in [\d.]+ ms = ([\d.]+) tok/s", open(os.path.join(sys.argv[1], "tp-70b.txt")).read())
if not bw or not m:
    print("70B floor: no read bandwidth (run the allreduce part) or no batch-1 run")
else:
    floor = bw * 1e9 / half
    print("70B shape, tp 2, batch 1: %.1f tok/s = %.0f%% of the floor (%.1f GB a GPU a step at %.0f GB/s: %.1f tok/s); "
          "160 all-reduces of %d bytes a step: %.2f ms (%.0f us each)" % (float(m[1]), 100 * float(m[1]) / floor,
          half / 1e9, bw, floor, 4 * H, 160 * ar / 1e3, ar))
PY
fi
if [[ $parts == *" disagg "* ]]; then
  for mode in "prefill2|--prefill-device cuda:0,cuda:1 --prefill-tp 2 --decode-device cuda:1" \
              "decode2|--prefill-device cuda:0 --decode-device cuda:0,cuda:1 --decode-tp 2"; do
    tag=${mode%%|*}; mkdir -p "${OUT:-/tmp}/tp-$tag"
    # shellcheck disable=SC2086
    python3 "$here/bench/disagg_gpu.py" --bin "$here/bin" --model "$m8d" --load-format dummy --out "${OUT:-/tmp}/tp-$tag" \
      --kv-mib 4096 ${mode#*|} --lengths 1024,3072 --identity 4 > "$out/tp-disagg-$tag.json" 2> "$out/tp-disagg-$tag.err" ||
      { echo "disaggregated, $tag, FAILED"; tail -5 "$out/tp-disagg-$tag.err"; fail=1; }
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print('8B shape, prefill tp %d on %s -> decode tp %d on %s, greedy 48 tokens: %d of %d prompts identical to one process' % (d['tp']['prefill'], d['devices']['prefill'], d['tp']['decode'], d['devices']['decode'], d['identical'], len(d['identity']))); print(json.dumps(d['lengths'])); print(json.dumps(d['kv_transfer'])); sys.exit(0 if d['identical'] == len(d['identity']) else 1)" "$out/tp-disagg-$tag.json" || fail=1
  done
fi
fi
fi

echo "gpu run: $([ $fail = 0 ] && echo ok || echo FAILED)"

exit $fail
