"""Section 17's side-by-side tables (issue 51): decode tok/s per batch and weight format for tandem, the
torch.compile peer and llama.cpp, each with its fraction of the roofline, and prefill at 1k/4k/16k with MFU
against cuBLAS's measured peak — from the logs the section's parts left (any part missing: its columns empty).

    python3 peers_table.py LOGS_DIR [--shape llama2-7b]

The roofline is the issue's: the larger of the fp16 weights read at the measured read bandwidth and the step's
FLOPs at the measured cuBLAS peak (`tandem-cuda-check --time-prefill` measures both), one denominator for every
column. Prefill FLOPs: the layers' matmuls and the causal attention, as tandem-cuda-check counts them.
"""
import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_random_llama import SHAPES  # noqa: E402

BATCHES = [1, 8, 32, 64, 128, 256]
PROMPTS = [1024, 4096, 16384]


def lines(path):
    return open(path).read().splitlines() if os.path.exists(path) else []


def jsonl(path):
    return [json.loads(l) for l in lines(path) if l.startswith("{")]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("logs")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama2-7b")
    a = ap.parse_args()
    s = SHAPES[a.shape]
    H, F, V, L = s["hidden_size"], s["intermediate_size"], s["vocab_size"], s["num_hidden_layers"]
    hd = H // s["num_attention_heads"]
    kvd = s["num_key_value_heads"] * hd
    layer = L * (2 * H * H + 2 * H * kvd + 3 * H * F)
    w_bytes, tok_flop = 2.0 * (layer + V * H), 2.0 * (layer + V * H)

    def prompt_flop(n):
        return 2.0 * n * layer + 4.0 * hd * s["num_attention_heads"] * L * (0.5 * n * (n + 1))

    dec, pre = {}, {}  # (column, batch) -> tok/s; (column, tokens) -> ms
    peak = bw = None
    for l in lines(os.path.join(a.logs, "peers-tandem.txt")):
        m = re.match(r"tandem, weights (\w+), batch (\d+): .*= ([0-9.]+) tok/s", l)
        if m:
            dec["tandem " + ("fp16" if m[1] == "file" else m[1]), int(m[2])] = float(m[3])
        m = re.match(r"timing prefill \S+, weights (\w+): (\d+) tokens ([0-9.]+) ms", l)
        if m:
            pre["tandem " + ("fp16" if m[1] == "file" else m[1]), int(m[2])] = float(m[3])
        m = re.search(r"measured peak .* ([0-9.]+) TFLOP/s", l)
        if m:
            peak = float(m[1]) * 1e12
        m = re.search(r"read bandwidth .* ([0-9.]+) GB/s", l)
        if m:
            bw = float(m[1]) * 1e9
    for w in ("fp16", "fp8"):
        for r in jsonl(os.path.join(a.logs, "peers-compile-%s.jsonl" % w)):
            if r["what"] == "compile_decode":
                dec["compile " + w, r["batch"]] = r["tok_s"]
            elif r["what"] == "compile_prefill":
                pre["compile " + w, r["tokens"]] = r["ms"]
    for ty, col in (("f16", "llama.cpp F16"), ("q8_0", "llama.cpp Q8_0")):
        for r in jsonl(os.path.join(a.logs, "peers-llamacpp-%s.jsonl" % ty)):
            dec[col, r["pl"]] = r["speed_tg"]
        for r in jsonl(os.path.join(a.logs, "peers-llamacpp-pp-%s.jsonl" % ty)):
            pre[col, r["pp"]] = r["t_pp"] * 1e3  # the last of each length: the warm one
    cols = ["tandem fp16", "tandem fp8", "compile fp16", "compile fp8", "llama.cpp F16", "llama.cpp Q8_0"]
    if not peak or not bw:
        print("peers: no measured peak or bandwidth (the tandem part did not run): fractions left out")
    print("decode tok/s (%s, 128 tokens after 16; in brackets the fraction of the roofline:" % a.shape)
    if peak and bw:
        print("  max(%.2f GB of fp16 weights at %.0f GB/s, %.1f GFLOP a token at %.1f TFLOP/s))"
              % (w_bytes / 1e9, bw / 1e9, tok_flop / 1e9, peak / 1e12))
    print("| batch | " + " | ".join(cols) + " | roofline |")
    print("|---:|" + "---:|" * (len(cols) + 1))
    for b in BATCHES:
        roof = b / max(w_bytes / bw, b * tok_flop / peak) if peak and bw else None
        cells = []
        for c in cols:
            v = dec.get((c, b))
            cells.append("" if v is None else "%.0f" % v + (" (%.0f%%)" % (100 * v / roof) if roof else ""))
        print("| %d | %s | %s |" % (b, " | ".join(cells), "%.0f" % roof if roof else ""))
    print("prefill, one prompt, warm: ms (MFU against the measured cuBLAS peak)")
    print("| tokens | " + " | ".join(cols) + " |")
    print("|---:|" + "---:|" * len(cols))
    for n in PROMPTS:
        cells = []
        for c in cols:
            ms = pre.get((c, n))
            cells.append("" if ms is None else "%.1f" % ms + (" (%.0f%%)" % (100 * prompt_flop(n) / (ms / 1e3) / peak)
                                                               if peak else ""))
        print("| %d | %s |" % (n, " | ".join(cells)))


if __name__ == "__main__":
    main()
