#!/usr/bin/env python3
"""Side by side of bench/serve_compare.sh's two runs: OUT/README.md (goodput
and the per-rate table) and OUT/attainment.{svg,png} (both attainment curves
against the offered rate, through gnuplot).
Usage: serve_side_by_side.py OUT SWEEP N THREADS LLAMA_CPP_VERSION"""
import json
import subprocess
import sys

out, sweep, n, threads, lv = sys.argv[1:6]
t = json.load(open(out + "/tandem/run.json"))
l = json.load(open(out + "/llamacpp/run.json"))


def ms(v):
    return "-" if v is None else "%.0f" % (v * 1e3)


rows = []
for a, b in zip(t["runs"], l["runs"]):
    sa, sb = a["summary"], b["summary"]
    rows.append("| %.1f | %.0f%% | %.0f%% | %s / %s | %s / %s | %s / %s | %s / %s | %.0f / %.0f |" % (
        a["rate"], 100 * sa["attainment"], 100 * sb["attainment"], ms(sa["ttft_p50"]), ms(sb["ttft_p50"]),
        ms(sa["ttft_p99"]), ms(sb["ttft_p99"]), ms(sa["tpot_p50"]), ms(sb["tpot_p50"]),
        ms(sa["tpot_p99"]), ms(sb["tpot_p99"]), sa["out_tok_per_s"], sb["out_tok_per_s"]))

with open(out + "/attainment.dat", "w") as f:
    for a, b in zip(t["runs"], l["runs"]):
        f.write("%g %g %g\n" % (a["rate"], 100 * a["summary"]["attainment"], 100 * b["summary"]["attainment"]))
target = 100 * t["config"]["attainment"]
for term, ext in (("svg size 720,440", "svg"), ("pngcairo size 720,440", "png")):
    gp = f"""set terminal {term}
set output '{out}/attainment.{ext}'
set title 'SLO attainment vs offered rate (TTFT <= {t['config']['ttft_slo_ms']:.0f} ms, TPOT <= {t['config']['tpot_slo_ms']:.0f} ms)'
set xlabel 'offered rate (req/s)'
set ylabel 'requests meeting both SLOs (%)'
set logscale x 2
set yrange [0:105]
set key bottom left
set grid
plot '{out}/attainment.dat' using 1:2 with linespoints lw 2 title 'tandem (gRPC, 1 prefill + 1 decode)', \\
     '{out}/attainment.dat' using 1:3 with linespoints lw 2 title 'llama.cpp server (OpenAI API)', \\
     {target} with lines dt 2 lc rgb 'gray' title '{target:.0f}% target'
"""
    subprocess.run(["gnuplot"], input=gp, text=True, check=True)

cmd = "bench/serve_compare.sh /tmp/venv/bin/python (SWEEP=%s N=%s THREADS=%s)" % (sweep, n, threads)
bound = {True: "", False: " (a lower bound: every rate met the SLOs)"}
doc = f"""# SLO goodput: tandem cluster vs llama.cpp server — {t['date'][:10]}

- machine: {t['machine']}
- commit: {t['git_commit']}; llama.cpp: llama-cpp-python {lv} (its OpenAI-compatible server)
- command: `{cmd}` (the Python given has `llama-cpp-python[server]`); each server alone on the
  machine, one after the other
- tandem: `tandem up` — etcd, router, 1 prefill + 1 decode worker of {threads} thread(s) each;
  `tandem bench --api grpc`
- llama.cpp: `python -m llama_cpp.server --n_threads {2 * int(threads)}` (one sequence at a time);
  `tandem bench --api openai`. Both use the machine's {2 * int(threads)} cores.
- workload: synthetic, Poisson arrivals, {n} requests per rate, prompts uniform 64..256 tokens,
  48 generated tokens (ignore_eos), greedy; SLOs TTFT <= {t['config']['ttft_slo_ms']:.0f} ms and
  TPOT <= {t['config']['tpot_slo_ms']:.0f} ms for {target:.0f}% of requests

| goodput (req/s, interpolated crossing of {target:.0f}%) | tandem | llama.cpp |
|---|---|---|
| | **{t['goodput']:.2f}**{bound[bool(t['goodput_bounded'])]} | {l['goodput']:.2f}{bound[bool(l['goodput_bounded'])]} |

| rate (req/s) | SLO met tandem | SLO met llama.cpp | TTFT p50 (ms) t / l | TTFT p99 | TPOT p50 | TPOT p99 | output tok/s t / l |
|---|---|---|---|---|---|---|---|
""" + "\n".join(rows) + """

![attainment](attainment.png)

Files: attainment.svg/.png (both curves); tandem/ and llamacpp/ hold run.json (every request,
the configuration, commit and machine), summary.txt (the terminal table, with the SLO-scale
sweep) and the plots of each run (run-attainment, run-ttft, run-tpot as .svg and .png).
"""
open(out + "/README.md", "w").write(doc)
print(doc)
