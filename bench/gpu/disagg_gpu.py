#!/usr/bin/env python3
"""disagg_gpu.py — tandem disaggregated on one GPU machine: `tandem up` with a
prefill and a decode worker on the GPU (KV through CUDA IPC) beside
`tandem generate --device cuda` in one process, on the same model.

 1. greedy token ids of the cluster and of the single process, per prompt;
 2. TTFT and TPOT, disaggregated and single-process, at each prompt length
    (median of REPS; a distinct first word per repetition keeps the prefix
    cache out of it; the single process warms up before it times);
 3. the prefill worker's KV transfer totals (its exit log: bytes pushed, the
    time the engine waited for the transfer after its compute);
 4. with --kvstores N (N kvstore nodes, the workers using them), the KV
    store's path on the GPU: a prompt, then others that push its blocks out
    of the prefill worker's pool (--prefill-kv-mib), then the prompt again,
    whose prefix the prefill worker now reads from the store into the GPU
    (through host staging): its tokens from the store and its greedy ids
    beside the single process's;
 5. with --bench, `tandem bench` against the cluster (its JSON and plot data
    go to --out).

--transport ucx runs the workers' KV over UCX staged through page-locked host
memory (what GPU workers on different hosts use) instead of CUDA IPC.

Standard library only (the GPU machine has no gRPC tools). Prints one JSON
document. Usage:
  disagg_gpu.py --bin DIR --model PATH --out DIR [--device cuda] [--kv-mib N] [--lengths 128,1024]
                [--transport auto|ucx] [--prefill-device D] [--decode-device D] [--kvstores N --kvstore-mib N --prefill-kv-mib N --store-len N]
                [--prefill-tp N] [--decode-tp N] [--load-format dummy]
                [--gen N] [--reps N] [--identity N] [--threads N] [--kv-dtype fp16|fp8_e4m3]
                [--bench "ARGS" [--bench-prompts N:MIN:MAX]]
"""
import argparse
import json
import os
import random
import re
import select
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time

PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):", "1, 2, 3, 4,",
           "Explain why the sky is blue in one sentence.", "Once upon a time"]
WORDS = ["a", "b", "c", "d", "e", "f", "g", "h"]


def prompt_of(n, rep):
    return WORDS[rep % len(WORDS)] + " a" * (n - 2)


def run(cmd, timeout=600):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if r.returncode:
        raise RuntimeError("%s: exit %d: %s" % (" ".join(cmd[:3]), r.returncode, r.stderr.strip()[-600:]))
    return r


def start_cluster(a, log_path, extra=(), decode_budget=0):
    """`tandem up` on a's model and devices (extra: more tandem up arguments; decode_budget: the decode
    workers' token budget, a's by default); its process and the router's HOST:PORT."""
    cfg = os.path.join(a.out, "gpu-cluster.yaml")
    with open(cfg, "w") as f:
        f.write("model: {path: %s, kv_dtype: %s%s}\nrouter: {http_listen: \"\"}\n"
                "prefill: {device: \"%s\", kv_mib: %d, token_budget: %d, threads: %d, tp: %d}\n"
                "decode: {device: \"%s\", kv_mib: %d, token_budget: %d, threads: %d, tp: %d}\n"
                "kvstore: {count: %d, use: %s, dram_mb: %d}\n"
                "transport: {kind: %s}\n"
                % (a.model, a.kv_dtype, ", load_format: " + a.load_format if a.load_format else "",
                   getattr(a, "prefill_device", None) or a.device, a.prefill_kv_mib or a.kv_mib,
                   a.token_budget, a.threads, getattr(a, "prefill_tp", 1), getattr(a, "decode_device", None) or a.device,
                   a.kv_mib, decode_budget or a.token_budget, a.threads, getattr(a, "decode_tp", 1), a.kvstores,
                   "true" if a.kvstores else "false", a.kvstore_mib, a.transport))
    log = open(log_path, "a+")  # append: the children share the offset
    up = subprocess.Popen([a.bin + "/tandem", "up", "--config", cfg] + list(extra), stdout=subprocess.PIPE,
                          stderr=log, text=True, start_new_session=True)
    ready, _, _ = select.select([up.stdout], [], [], 600)
    ep = up.stdout.readline().strip() if ready else ""
    if not ep:
        os.killpg(up.pid, signal.SIGTERM)
        up.wait(60)
        log.seek(0)
        raise RuntimeError("the GPU cluster did not start: " + log.read()[-1500:])
    return up, ep


def stop_cluster(up, log_path):
    os.killpg(up.pid, signal.SIGTERM)
    try:
        up.wait(90)
    except subprocess.TimeoutExpired:
        os.killpg(up.pid, signal.SIGKILL)
        up.wait(30)
    log = open(log_path).read()
    log = log[log.rfind("serving at"):] if "serving at" in log else log  # this cluster's lines: the log is appended
    m = re.search(r"KV pushed over (\S+): (\d+) bytes, the pusher busy ([\d.]+) ms, the engine waited ([\d.]+) ms",
                  log)
    if not m:
        return None
    res = {"transport": m.group(1), "bytes": int(m.group(2)), "pusher_busy_ms": float(m.group(3)),
           "exposed_ms": float(m.group(4))}
    for role, p in re.findall(r"tandem-(prefill|decode): (\d+ blocks copied out of the pool for the KV store; "
                              r"the engine thread spent [\d.]+ ms on it)", log):
        res["store_copy_out_" + role] = p
    return res


def remote(a, ep, prompt, gen):
    r = run([a.bin + "/tandem", "generate", "--endpoint", ep, "--ids", "--max-tokens", str(gen), "--ignore-eos",
             prompt])
    m = re.search(r"\[(\d+) prompt \+ (\d+) generated tokens; TTFT ([\d.]+) ms, TPOT ([\d.]+) ms.*; (\d+) prompt "
                  r"tokens cached, (\d+) of them from the KV store", r.stderr)
    return r.stdout.split(), int(m.group(1)), float(m.group(3)), float(m.group(4)), int(m.group(5)), int(m.group(6))


def single(a, prompt, gen):
    r = run([a.bin + "/tandem", "generate", "--model", a.model, "--device", a.device, "--threads", str(a.threads), "--ids", "--max-tokens", str(gen),
             "--ignore-eos", "--kv-dtype", a.kv_dtype, "--kv-mib", str(a.kv_mib), "--token-budget", str(a.token_budget)]
            + (["--load-format", a.load_format] if a.load_format else []) + [prompt])
    t = re.search(r"TTFT ([\d.]+) ms", r.stderr)
    d = re.search(r"= ([\d.]+) tok/s", r.stderr)
    return r.stdout.split(), float(t.group(1)), 1000.0 / float(d.group(1))


def base_args(ap):
    """What every GPU cluster script takes: the binaries, the model, where results go, the device."""
    ap.add_argument("--bin", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--kv-dtype", default="fp16", help="model.kv_dtype of the cluster and the single process")
    ap.add_argument("--load-format", default="", help="model.load_format (dummy: a config.json's shape, seeded "
                    "weights) of the cluster and the single process")


def main():
    ap = argparse.ArgumentParser()
    base_args(ap)
    ap.add_argument("--kv-mib", type=int, default=2048)
    ap.add_argument("--token-budget", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lengths", default="128,1024")
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--identity", type=int, default=4)
    ap.add_argument("--transport", default="auto", choices=["auto", "ucx"])
    ap.add_argument("--prefill-device", default="", help="the prefill worker's device (default --device)")
    ap.add_argument("--decode-device", default="", help="the decode worker's device (default --device): another "
                    "GPU of the host puts the KV GPU to GPU")
    ap.add_argument("--prefill-tp", type=int, default=1, help="the prefill worker's tensor-parallel ranks (its "
                    "device lists a GPU a rank); the single process stays one rank")
    ap.add_argument("--decode-tp", type=int, default=1, help="the decode worker's ranks, likewise")
    ap.add_argument("--kvstores", type=int, default=0)
    ap.add_argument("--prefill-kv-mib", type=int, default=0)
    ap.add_argument("--kvstore-mib", type=int, default=1024)
    ap.add_argument("--store-len", type=int, default=1000)
    ap.add_argument("--bench", default="")
    ap.add_argument("--bench-max-tokens", type=int, default=128)
    ap.add_argument("--bench-prompts", default="", help="N:MIN:MAX — bench on a JSONL of N prompts of MIN..MAX "
                    "tokens (' a' words after a distinct number) instead of synthetic words, for a tokenizer that "
                    "has too few one-token words")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    name = os.path.basename(a.model.rstrip("/"))
    log_path = os.path.join(a.out, "gpu-cluster-%s.log" % name)
    res = {"model": a.model, "kv_dtype": a.kv_dtype, "kv_mib": a.kv_mib, "transport": a.transport, "kvstores": a.kvstores, "identity": [],
           "lengths": {}, "devices": {"single": a.device, "prefill": a.prefill_device or a.device,
                                      "decode": a.decode_device or a.device},
           "tp": {"prefill": a.prefill_tp, "decode": a.decode_tp}}
    # single-process first: the cluster's two processes then have the GPU to themselves
    single_ids = [single(a, p, 48)[0] for p in PROMPTS[:a.identity]]
    lengths = [int(x) for x in a.lengths.split(",") if x]
    single_t = {n: [single(a, prompt_of(n, r), a.gen)[1:] for r in range(a.reps)] for n in lengths}
    store_p = ["%d%s" % (900 + i, " a" * (a.store_len - 2)) for i in range(4)]
    single_store = single(a, store_p[0], 48)[0] if a.kvstores else None
    up, ep = start_cluster(a, log_path)
    try:
        for p, s in zip(PROMPTS, single_ids):
            d = remote(a, ep, p, 48)[0]
            res["identity"].append({"prompt": p, "same": d == s, "agree": sum(x == y for x, y in zip(d, s)),
                                    "of": len(s), "single": " ".join(s), "disagg": " ".join(d)})
        for n in lengths:
            rr = [remote(a, ep, prompt_of(n, r + 4), a.gen) for r in range(a.reps)]
            res["lengths"][str(n)] = {
                "prompt_tokens": rr[0][1],
                "disagg_ttft_ms": statistics.median(x[2] for x in rr),
                "disagg_tpot_ms": statistics.median(x[3] for x in rr),
                "single_ttft_ms": statistics.median(x[0] for x in single_t[n]),
                "single_tpot_ms": statistics.median(x[1] for x in single_t[n]),
            }
            print(name, n, res["lengths"][str(n)], file=sys.stderr, flush=True)
        if a.kvstores:
            first = remote(a, ep, store_p[0], 48)
            for p in store_p[1:]:  # each as long: the first one's blocks leave the prefill worker's pool
                remote(a, ep, p, 4)
            again = remote(a, ep, store_p[0], 48)
            res["store"] = {"prompt_tokens": first[1], "first": {"ttft_ms": first[2], "cached": first[4],
                                                                  "from_store": first[5]},
                            "again": {"ttft_ms": again[2], "cached": again[4], "from_store": again[5]},
                            "same_as_single": again[0] == single_store and first[0] == single_store}
            print(name, "store", res["store"], file=sys.stderr, flush=True)
        if a.bench:
            out = os.path.join(a.out, "bench-%s.json" % name)
            extra = []
            if a.bench_prompts:
                n, lo, hi = (int(x) for x in a.bench_prompts.split(":"))
                rnd = random.Random(7)
                path = os.path.join(a.out, "prompts-%s.jsonl" % name)
                with open(path, "w") as f:
                    for i in range(n):
                        f.write(json.dumps({"prompt": "%d" % (1000 + i) + " a" * rnd.randint(lo, hi),
                                            "max_tokens": a.bench_max_tokens}) + "\n")
                extra = ["--workload", "prompts", path]
            r = subprocess.run([a.bin + "/tandem", "bench", "--endpoint", ep, "--api", "grpc", "--output", out] + shlex.split(a.bench) + extra,
                               capture_output=True, text=True, timeout=500)
            res["bench_exit"] = r.returncode
            res["bench_tail"] = (r.stdout + r.stderr)[-3000:]
    finally:
        res["kv_transfer"] = stop_cluster(up, log_path)
    res["identical"] = sum(x["same"] for x in res["identity"])
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
