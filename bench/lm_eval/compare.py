#!/usr/bin/env python3
"""run.sh's three lm-eval runs side by side, as markdown: accuracy, and each
choice's log-likelihood (lm-eval's per-request answer) compared run to run.

    compare.py WORK "VERSIONS" NUMERICS   (WORK: run.sh's folder with tandem-ids/, tandem-text/, llama-text/)"""
import glob
import json
import os
import platform
import subprocess
import sys
import time

work, versions, numerics = sys.argv[1:4]
RUNS = [("tandem-ids", "tandem, `--model local-completions` (token-id prompts, tandem's /tokenize)"),
        ("tandem-text", "tandem, `--model gguf` (text prompts)"),
        ("llama-ref", "llama-cpp-python in process (`llama_ref.py`: the same tokens, llama.cpp's logits)"),
        ("llama-text", "llama-cpp-python's server, `--model gguf` (text prompts; see below)")]


def load(run):
    res = json.load(open(glob.glob(os.path.join(work, run, "*", "results_*.json"))[0]))["results"]["tandem_mc"]
    items = {}
    for line in open(glob.glob(os.path.join(work, run, "*", "samples_*.jsonl"))[0]):
        s = json.loads(line)
        items[s["doc_id"]] = ([float(r[0]) for r in s["filtered_resps"]], s["acc"])
    return res["acc,none"], res["acc_stderr,none"], items


data = {r: load(r) for r, _ in RUNS}
secs = dict(l.split(": ") for l in open(os.path.join(work, "times")).read().splitlines())


def diff(a, b):
    ia, ib = data[a][2], data[b][2]
    d = [abs(x - y) for k in ia for x, y in zip(ia[k][0], ib[k][0])]
    same_pick = sum(max(range(len(ia[k][0])), key=ia[k][0].__getitem__) ==
                    max(range(len(ib[k][0])), key=ib[k][0].__getitem__) for k in ia)
    d.sort()
    return len(d), d[len(d) // 2], d[-1], sum(x <= 1e-3 for x in d), same_pick, len(ia)


cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
print("# lm-evaluation-harness against tandem and llama.cpp — %s\n" % time.strftime("%Y-%m-%d", time.gmtime()))
print("- machine: %s, %d cores (%s); commit %s; %s" % (cpu, os.cpu_count(), platform.platform(), commit, versions))
print("- command: `bench/lm_eval/run.sh PYTHON` (PYTHON has `lm-eval[api]` and `llama-cpp-python[server]`)")
print("- model: SmolLM2-135M-Instruct Q4_1 GGUF (the default), one file for both servers")
print("- task: `bench/lm_eval/make_task.py`'s %d multiple-choice items (sums and capitals, 4 choices, seed 52) from a "
      "local JSONL; %d log-likelihood requests a run" % (len(data["tandem-ids"][2]), 4 * len(data["tandem-ids"][2])))
print("- tandem: `tandem up` (etcd, router, one prefill and one decode worker), `model.numerics: %s`; llama.cpp: "
      "`python -m llama_cpp.server --n_threads 2 --logits_all True`\n" % numerics)
print("| run | acc | ± stderr | wall (s) |\n|---|---|---|---|")
for r, label in RUNS:
    print("| %s | %.4f | %.4f | %s |" % (label, data[r][0], data[r][1], secs[r].split()[0]))
print("\nEach choice's log-likelihood (the sum over the continuation's tokens), run against run:\n")
print("| runs | choices | median abs diff | max abs diff | within 1e-3 | same pick (items) |\n|---|---|---|---|---|---|")
for a, b in (("tandem-ids", "llama-ref"), ("tandem-ids", "tandem-text"), ("tandem-text", "llama-text")):
    n, med, mx, ok, pick, items = diff(a, b)
    print("| %s vs %s | %d | %.1e | %.1e | %d of %d | %d of %d |" % (a, b, n, med, mx, ok, n, pick, items))
print("\nllama-cpp-python's server answers `echo` with each prompt token's log-probability taken from the *next* "
      "position's distribution (its `top_logprobs` at a token are the following token's: \"The capital\" shows "
      "\" of\" on top at \" capital\"), so lm-eval scored on it is not a reference; llama_ref.py computes the same "
      "model's log-likelihoods in process instead.")
