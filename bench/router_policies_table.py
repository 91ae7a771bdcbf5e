#!/usr/bin/env python3
"""router_policies_table.py OUT POLICY... — the markdown table of a
bench/router_policies.sh run: per policy the median over its runs (each
POLICY[-rN].json with its .health.json) of SLO attainment (over every request
sent: one rejected early counts as missed), the requests rejected early, TTFT
p50/p90/p99 (of the requests served),
requests meeting both SLOs per second, the share of prompt tokens served from
a KV cache, and the TTFT prediction's error; placements by reason per run;
with a POLICY[-rN].slow file (SLOW_THREADS), the share of the requests the
slow prefill worker served. When a policy rejected requests early, a second
table compares like with like: TTFT over the requests that every run of
every policy served (the workload is the same in each run: requests are
matched by their planned send time's order)."""
import glob, json, os, statistics, sys


def early(r):
    """Refused at once by the router's early rejection: RESOURCE_EXHAUSTED with a hint, or FAILED_PRECONDITION
    when even an idle worker would miss the SLO. tandem bench marks both "rejected" since they carry
    rejected-early; runs made before that marked only the first, so the message is read too."""
    return r.get("rejected") or "rejected early" in r.get("error", "")


out, pols = sys.argv[1], sys.argv[2:]
slow = bool(glob.glob(os.path.join(out, "*.slow")))
print("| policy | runs | SLO met | rejected early | TTFT p50 | TTFT p90 | TTFT p99 | goodput (req/s meeting both SLOs) | prefix hit | placed pool / store / cold | prediction error p50 / p90 |"
      + (" on the slow worker |" if slow else ""))
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|" + ("---:|" if slow else ""))
q = lambda v, x: v[min(len(v) - 1, int(round(x * (len(v) - 1))))] if v else float("nan")
files = {p: sorted(glob.glob(os.path.join(out, p + ".json")) + [f for f in glob.glob(os.path.join(out, p + "-r*.json"))
                                                               if not f.endswith(".health.json")]) for p in pols}
ordered = {}  # each run's requests in the order they were planned
for p in pols:
    runs = []
    for f in files[p]:
        j = json.load(open(f))
        rq = j["runs"][0]["requests"]
        ordered[f] = sorted(rq, key=lambda r: r["t_planned"])
        s = j["runs"][0]["summary"]
        sid = open(f[:-5] + ".slow").read().strip() if os.path.exists(f[:-5] + ".slow") else ""
        h = json.load(open(f[:-5] + ".health.json")) if os.path.exists(f[:-5] + ".health.json") else {}
        pl = h.get("placement", {}).get("placed", {})
        ttft = sorted(r["ttft"] for r in rq if r["ok"])
        met = s["slo_met"]
        dur = s["duration"] or 1
        runs.append(dict(met=100.0 * met / s["n"], rej=sum(1 for r in rq if early(r)), p50=1e3 * q(ttft, .5), p90=1e3 * q(ttft, .9), p99=1e3 * q(ttft, .99),
                         good=met / dur, pool=pl.get("pool_hit", 0), store=pl.get("store_hit", 0), cold=pl.get("cold", 0),
                         e50=100 * (s.get("pred_err_p50") or float("nan")), e90=100 * (s.get("pred_err_p90") or float("nan")),
                         hit=100 * (s.get("cached_share") or 0),
                         slow=100 * sum(r.get("prefill_worker") == sid for r in rq) / max(1, len(rq)) if sid else 0))
    if not runs:
        continue
    m = lambda k: statistics.median(r[k] for r in runs)
    print(f"| {p} | {len(runs)} | {m('met'):.1f}% | {m('rej'):g} | {m('p50'):.0f} ms | {m('p90'):.0f} ms | {m('p99'):.0f} ms | "
          f"{m('good'):.2f} | {m('hit'):.1f}% of prompt tokens | "
          f"{' ; '.join('%d/%d/%d' % (r['pool'], r['store'], r['cold']) for r in runs)} | {m('e50'):.1f}% / {m('e90'):.1f}% |"
          + (f" {m('slow'):.0f}% |" if slow else ""))

if any(early(r) for v in ordered.values() for r in v) and len({len(v) for v in ordered.values()}) == 1:
    n = len(next(iter(ordered.values())))
    both = [i for i in range(n) if all(v[i]["ok"] for v in ordered.values())]
    print("\nTTFT over the %d of %d requests that every run of every policy served:\n" % (len(both), n))
    print("| policy | TTFT p50 | TTFT p90 | TTFT p99 |")
    print("|---|---:|---:|---:|")
    for p in pols:
        if not files[p]:
            continue
        per = [sorted(ordered[f][i]["ttft"] for i in both) for f in files[p]]
        m = lambda x: statistics.median(1e3 * q(v, x) for v in per)
        print(f"| {p} | {m(.5):.0f} ms | {m(.9):.0f} ms | {m(.99):.0f} ms |")
