#!/usr/bin/env python3
"""sched_orders_table.py OUT ORDER... — the markdown table of a
bench/sched_orders.sh run: per order the median over its runs (each
ORDER[-rN].json with its .health.json) of TTFT p50/p90/p99 over the requests
served, the p90 TTFT of the short ones (prompt up to SHORT tokens, 256) and of
the rest, job completion time (send to last token) p50/p90, goodput (requests
meeting both SLOs per second), requests that failed, the prompt tokens the
workers computed during the run (their engines' counts: not from a prefix
cache; the Health after less the one before), and the router's output-length
prediction error (|predicted - generated| / generated over its last 256 ends)."""
import glob, json, os, statistics, sys

SHORT = int(os.environ.get("SHORT", "256"))
out, orders = sys.argv[1], sys.argv[2:]
q = lambda v, x: v[min(len(v) - 1, int(round(x * (len(v) - 1))))] if v else float("nan")
print("| order | runs | TTFT p50 | TTFT p90 | TTFT p99 | TTFT p90, prompts <= %d | TTFT p90, longer | JCT p50 | JCT p90 "
      "| goodput (req/s) | failed | prompt tokens computed | output length predicted: error p50 / p90 |" % SHORT)
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for o in orders:
    runs = []
    for f in sorted(glob.glob(os.path.join(out, o + ".json")) + glob.glob(os.path.join(out, o + "-r[0-9]*.json"))):
        if f.endswith(".health.json") or f.endswith(".before.json"):
            continue
        j = json.load(open(f))
        rq = j["runs"][0]["requests"]
        s = j["runs"][0]["summary"]
        count = lambda name: sum(p.get("prompt_tokens_computed", 0) for p in json.load(open(name)).get("pools", [])) \
            if os.path.exists(name) else 0
        computed = count(f[:-5] + ".health.json") - count(f[:-5] + ".before.json")
        ol = json.load(open(f[:-5] + ".health.json")).get("output_length", {}) \
            if os.path.exists(f[:-5] + ".health.json") else {}
        ok = [r for r in rq if r["ok"]]
        t = sorted(r["ttft"] for r in ok)
        ts = sorted(r["ttft"] for r in ok if r["input_tokens"] <= SHORT)
        tl = sorted(r["ttft"] for r in ok if r["input_tokens"] > SHORT)
        e = sorted(r["e2e"] for r in ok)
        runs.append(dict(p50=1e3 * q(t, .5), p90=1e3 * q(t, .9), p99=1e3 * q(t, .99), s90=1e3 * q(ts, .9),
                         l90=1e3 * q(tl, .9), j50=q(e, .5), j90=q(e, .9), good=s["slo_met"] / (s["duration"] or 1),
                         failed=len(rq) - len(ok), computed=computed,
                         o50=100 * ol.get("error_p50", float("nan")), o90=100 * ol.get("error_p90", float("nan"))))
    if not runs:
        continue
    m = lambda k: statistics.median(r[k] for r in runs)
    print(f"| {o} | {len(runs)} | {m('p50'):.0f} ms | {m('p90'):.0f} ms | {m('p99'):.0f} ms | {m('s90'):.0f} ms | "
          f"{m('l90'):.0f} ms | {m('j50'):.2f} s | {m('j90'):.2f} s | {m('good'):.2f} | {m('failed'):g} | "
          f"{m('computed'):,.0f} | {m('o50'):.0f}% / {m('o90'):.0f}% |")
