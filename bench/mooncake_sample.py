#!/usr/bin/env python3
"""mooncake_sample.py — whole conversations from Mooncake's request trace, for
replay on a small model (../shared/data/mooncake/README.md says why: a
contiguous window keeps almost none of the multi-turn reuse).

A request continues a conversation when its prompt shares at least two leading
blocks (block 0, the system prompt, and one more) with an earlier request's;
the conversation is the chain of such requests back to its first. SESSIONS
conversations are drawn at random (seeded), and all their requests are written,
in time order, in the trace's own format, with time compressed so the
conversations' first turns spread over SPAN seconds while each conversation's
own gaps between turns shrink by the same factor (capped at MAX_GAP seconds).
Lengths are left as they are: `tandem bench --workload trace OUT --trace-divide
K` scales them.

usage: mooncake_sample.py TRACE OUT [--sessions 40] [--span 60] [--max-gap 4] [--seed 1]
"""
import argparse
import json
import random
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("out")
    ap.add_argument("--sessions", type=int, default=40)
    ap.add_argument("--span", type=float, default=60.0)
    ap.add_argument("--max-gap", type=float, default=4.0)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    reqs = [json.loads(line) for line in open(a.trace) if line.strip()]
    reqs.sort(key=lambda r: r["timestamp"])
    last_with = {}  # a prompt prefix (>= 2 blocks) -> the latest request that had it
    session = []
    for i, r in enumerate(reqs):
        h = tuple(r["hash_ids"])
        parent = None
        for k in range(len(h), 1, -1):
            if h[:k] in last_with:
                parent = last_with[h[:k]]
                break
        session.append(session[parent] if parent is not None else i)
        for k in range(2, len(h) + 1):
            last_with[h[:k]] = i
    members = {}
    for i, s in enumerate(session):
        members.setdefault(s, []).append(i)
    multi = sorted(s for s, m in members.items() if len(m) > 1)
    single = sorted(s for s, m in members.items() if len(m) == 1)
    rng = random.Random(a.seed)
    # keep the trace's mix: the share of conversations with more than one turn
    n_multi = round(a.sessions * len(multi) / (len(multi) + len(single)))
    chosen = rng.sample(multi, min(n_multi, len(multi))) + rng.sample(single, a.sessions - min(n_multi, len(multi)))
    t_first = sorted(reqs[s]["timestamp"] for s in chosen)
    starts = {s: a.span * 1000.0 * k / max(1, len(chosen) - 1) for k, s in
              enumerate(sorted(chosen, key=lambda s: reqs[s]["timestamp"]))}
    out = []
    for s in chosen:
        t = starts[s]
        prev = None
        for i in members[s]:
            if prev is not None:
                gap = (reqs[i]["timestamp"] - reqs[prev]["timestamp"]) / 1000.0
                t += 1000.0 * min(a.max_gap, gap * a.span / max(1.0, (t_first[-1] - t_first[0]) / 1000.0))
            out.append(dict(reqs[i], timestamp=round(t, 3)))
            prev = i
    out.sort(key=lambda r: r["timestamp"])
    with open(a.out, "w") as f:
        for r in out:
            f.write(json.dumps(r) + "\n")
    turns = len(out)
    reuse = 0
    seen = set()
    total = 0
    for r in out:
        total += len(r["hash_ids"])
        reuse += sum(1 for h in r["hash_ids"] if h in seen)
        seen.update(r["hash_ids"])
    print(f"{len(chosen)} conversations ({min(n_multi, len(multi))} of several turns), {turns} requests over "
          f"{out[-1]['timestamp'] / 1000:.1f} s; {100.0 * reuse / total:.1f}% of prompt blocks seen before",
          file=sys.stderr)


if __name__ == "__main__":
    main()
