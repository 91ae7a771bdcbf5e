"""tandem's CPU engine beside llama.cpp on the same GGUF, same threads, same run.

    python3 bench/engine.py [MODEL] [--repeats N] [--out bench/results]
    (needs: build/bin/tandem-bench-engine, and llama-cpp-python in this Python)

For 1 and 2 threads, alternating tandem and llama.cpp, N times each:
prefill of 512 tokens (tokens/s; tandem with fast and with reference numerics), decode of 1 sequence and of 16 sequences
(generated tokens/s after the first token; 32-token prompts, 64 steps). Then
medians, and each against its floor on this machine, measured in the same run
by tandem-bench-engine: decode against memory bandwidth (every weight byte read
once per step), prefill against the fp32 FMA peak (2 FLOPs per parameter per
token). Writes engine-DATE.md and engine-DATE.json under --out.
"""
import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import llama_cpp
from llama_cpp import Llama

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tandem(model, threads, numerics="fast"):
    out = subprocess.run([os.path.join(ROOT, "build/bin/tandem-bench-engine"), model, str(threads), "1", numerics],
                         check=True, capture_output=True, text=True).stdout
    rows = [json.loads(l) for l in out.splitlines() if l.strip()]
    return {r["what"]: (r["tok_s"][0] if "tok_s" in r else r["value"]) for r in rows}


def llama(model, threads):
    res = {}
    llm = Llama(model, n_ctx=2048, n_batch=512, n_ubatch=512, n_threads=threads, n_threads_batch=threads,
                verbose=False)
    prompt = [1000 + (i * 37) % 20000 for i in range(512)]
    t = time.time()
    llm.eval(prompt)
    res["prefill512"] = 512 / (time.time() - t)
    llm.reset()
    llm.eval(prompt[:32])
    t = time.time()
    for _ in range(64):
        llm.eval([1000])
    res["decode1"] = 64 / (time.time() - t)
    # 16 sequences in one batch: the low-level API, one context with 16 sequence slots
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = 4096, 512, 512, 16
    cp.n_threads = cp.n_threads_batch = threads
    ctx = llama_cpp.llama_init_from_model(llm._model.model, cp)
    batch = llama_cpp.llama_batch_init(512, 0, 16)

    def submit(items):
        for k, (tok, pos, seq, want) in enumerate(items):
            batch.token[k], batch.pos[k], batch.n_seq_id[k] = tok, pos, 1
            batch.seq_id[k][0], batch.logits[k] = seq, want
        batch.n_tokens = len(items)
        assert llama_cpp.llama_decode(ctx, batch) == 0

    submit([(1000 + s + (i * 37) % 20000, i, s, i == 31) for s in range(16) for i in range(32)])
    t = time.time()
    for step in range(64):
        submit([(1000, 32 + step, s, True) for s in range(16)])
    res["decode16"] = 16 * 64 / (time.time() - t)
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(ctx)
    del llm
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=os.path.join(ROOT, "models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench/results"))
    a = ap.parse_args()
    runs = {}
    for threads in (1, 2):
        for rep in range(a.repeats):
            for name, fn in (("tandem", tandem), ("tandem-ref", lambda m, t: tandem(m, t, "reference")),
                             ("llama.cpp", llama)):
                r = fn(a.model, threads)
                for k, v in r.items():
                    runs.setdefault((name, threads, k), []).append(v)
                print(f"threads {threads} rep {rep} {name}: " +
                      ", ".join(f"{k} {v:.1f}" for k, v in r.items() if k in ("prefill512", "decode1", "decode16")),
                      file=sys.stderr)
    med = {k: statistics.median(v) for k, v in runs.items()}
    cpu = subprocess.run(["sh", "-c", "lscpu | sed -n 's/^Model name: *//p'"], capture_output=True,
                         text=True).stdout.strip()
    date = datetime.date.today().isoformat()
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    lines = [f"# CPU engine: tandem beside llama.cpp", "",
             f"- date {date}, commit {commit}; machine: {cpu}, {os.cpu_count()} cores, {platform.platform()}",
             f"- model: {os.path.basename(a.model)}; llama.cpp: llama-cpp-python {llama_cpp.__version__}",
             f"- command: python3 bench/engine.py --repeats {a.repeats}; medians of {a.repeats} alternating runs", "",
             "",
             "tandem runs twice: fast numerics (its own kernels, the default) and reference numerics",
             "(llama.cpp's rounding bit for bit: same greedy tokens; `--numerics reference`).", "",
             "| threads | measure | tandem fast tok/s | tandem reference tok/s | llama.cpp tok/s | fast / llama.cpp | "
             "reference / llama.cpp | floor tok/s | fast / floor | reference / floor |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for threads in (1, 2):
        bw = med[("tandem", threads, "read_gbs")]
        fl = med[("tandem", threads, "fma_gflops")]
        bpt = med[("tandem", threads, "bytes_per_token")]
        fpt = med[("tandem", threads, "flops_per_token")]
        for k, floor, how in (("prefill512", fl * 1e9 / fpt, f"FMA peak {fl:.0f} GFLOP/s"),
                              ("decode1", bw * 1e9 / bpt, f"read {bw:.1f} GB/s"),
                              ("decode16", min(16 * bw * 1e9 / bpt, fl * 1e9 / fpt),
                               "the lower of 16x the read floor and the FMA floor")):
            t, r, l = med[("tandem", threads, k)], med[("tandem-ref", threads, k)], med[("llama.cpp", threads, k)]
            lines.append(f"| {threads} | {k} | {t:.1f} | {r:.1f} | {l:.1f} | {t / l:.2f}x | {r / l:.2f}x | "
                         f"{floor:.0f} ({how}) | {100 * t / floor:.0f}% | {100 * r / floor:.0f}% |")
    lines += ["", f"Decode floor: {bpt / 1e6:.1f} MB of weights read per step at the measured bandwidth; "
              f"prefill floor: {fpt / 1e6:.0f} MFLOP per token at the measured fp32 FMA peak (the int8 "
              "kernels can exceed it)."]
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"engine-{date}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(a.out, f"engine-{date}.json"), "w") as f:
        json.dump({"date": date, "commit": commit, "cpu": cpu, "model": a.model,
                   "runs": {"|".join(map(str, k)): v for k, v in runs.items()}}, f, indent=1)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
