#!/usr/bin/env python3
"""Heap allocations per generated token on the token path (decode engine ->
decode worker -> router -> client), counted.

A cluster (`tandem up`) runs with bench/alloc/count_alloc.c preloaded: every
malloc/calloc/realloc is counted by the object that called it (tandem's own
code, libc on its behalf, protobuf-c, gRPC). Two requests of the same prompt
differ only in max_tokens (N1, then N2, greedy, EOS ignored); the difference
of the counts over the difference of tokens is the per-token cost, with every
per-request cost cancelled out. Run a few times; quote the median.

Usage: bench/alloc_per_token.py BUILD_BIN_DIR [--n1 16] [--n2 528] [--repeats 3]"""
import argparse
import os
import subprocess
import sys
import tempfile
import time

sys.argv, _argv = sys.argv[:2], sys.argv
sys.path.insert(0, os.path.join(os.getcwd(), "tests", "integration"))
import test_cluster as tc  # noqa: E402

sys.argv = _argv


def counts(d):
    out = {}
    for f in os.listdir(d):
        if f.endswith(".tmp"):
            continue
        role = f.rsplit("-", 1)[0].replace("tandem-", "")
        with open(os.path.join(d, f)) as fh:
            out[role] = {k: int(v) for k, v in (l.split() for l in fh if l.strip())}
    return out


def settle(d):
    time.sleep(0.5)  # two dumps (every 100 ms) after the last token
    return counts(d)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bin")
    ap.add_argument("--n1", type=int, default=16)
    ap.add_argument("--n2", type=int, default=528)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    so = os.path.join(tempfile.mkdtemp(prefix="tandem-alloc-"), "count_alloc.so")
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", so, "bench/alloc/count_alloc.c", "-ldl", "-lpthread"],
                   check=True)
    d = tempfile.mkdtemp(prefix="tandem-alloc-counts-")
    os.environ.update(LD_PRELOAD=so, TANDEM_ALLOC_DIR=d)
    c = tc.Cluster()
    os.environ.pop("LD_PRELOAD")
    prompt = "Write a long story about a lighthouse keeper and the sea."
    rows = []
    try:
        tc.wait_for(lambda: c.health()[0], 60)
        tc.generate(c.stub, prompt, max_tokens=8)  # warm-up: connections, first-use buffers
        for _ in range(a.repeats):
            c0 = settle(d)
            tc.generate(c.stub, prompt, max_tokens=a.n1)
            c1 = settle(d)
            ids, _ = tc.generate(c.stub, prompt, max_tokens=a.n2, timeout=300)
            c2 = settle(d)
            assert len(ids) == a.n2, "the long request made %d tokens" % len(ids)
            per = {}
            for role in ("decode", "router"):
                per[role] = {k: ((c2[role][k] - c1[role][k]) - (c1[role][k] - c0[role][k])) / (a.n2 - a.n1)
                             for k in c2[role]}
            rows.append(per)
    finally:
        c.stop()
    print("allocations per generated token (N1=%d, N2=%d; %d runs, median), by the object that called malloc:" %
          (a.n1, a.n2, a.repeats))
    for role in ("decode", "router"):
        cols = sorted(rows[0][role])
        med = {k: sorted(r[role][k] for r in rows)[len(rows) // 2] for k in cols}
        ours = med.get("exe", 0) + med.get("libc", 0) + med.get("protobuf_c", 0)
        print("  %-7s tandem's code (exe + libc + protobuf-c for it): %5.2f   [%s]" %
              (role, ours, ", ".join("%s %.2f" % (k, med[k]) for k in cols)))


if __name__ == "__main__":
    main()
