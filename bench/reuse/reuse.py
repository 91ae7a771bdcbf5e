#!/usr/bin/env python3
"""reuse.py GROUPS_TXT RUN_DIR [SHARE] — for each run (POLICY-rN.json) of a
bench/router_policies.sh synthetic workload: the prefix tokens each served
request could have reused (the longest group prefix, in whole 16-token
blocks, of any request of its group served and answered before it was sent)
against the cached tokens it got. GROUPS_TXT is groups.c's output for the
same workload. Prints per run the sums and the requests that got less."""
import glob, json, os, sys

groups = [l.split() for l in open(sys.argv[1])]
share = float(sys.argv[3]) if len(sys.argv) > 3 else 0.8
grp = [int(g[3]) for g in groups]
shared = [int(int(g[2]) * share) for g in groups]
for f in sorted(glob.glob(os.path.join(sys.argv[2], "*-r?.json"))):
    rq = sorted(json.load(open(f))["runs"][0]["requests"], key=lambda r: r["t_planned"])
    avail = cached = 0
    short = []
    for i, r in enumerate(rq):
        if not r["ok"]:
            continue
        av = max([min(shared[i], shared[j]) // 16 * 16 for j in range(i)
                  if rq[j]["ok"] and grp[j] == grp[i] and rq[j]["t_sent"] + rq[j]["ttft"] <= r["t_sent"]] or [0])
        avail += av
        cached += r["cached_tokens"]
        if r["cached_tokens"] + 16 < av:
            short.append((i, av, r["cached_tokens"]))
    print("%s: reusable %d, cached %d, got less than reusable: %s" % (os.path.basename(f), avail, cached, short or "none"))
