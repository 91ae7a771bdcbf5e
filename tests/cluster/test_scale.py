#!/usr/bin/env python3
"""Cluster suite: the prefill/decode ratio changed under load (DESIGN.md §7).

A real cluster (`tandem up`, CPU workers) serves `tandem bench` at a steady
rate while `tandem scale` takes it 1P+1D -> 2P+1D -> 1P+2D: the second step
flips the new prefill worker into a decode worker (it drains, then starts in
the other role). Every request must complete (0 failed, 0 lost), each change
must show in the router's membership, and the planner must say why. Also:
the ops config's errors name the key and its line, a bad count is refused
naming its bound, and an ops file with policy auto is applied whole.
Prints the time each change took and SLO attainment before, during and after
each, one line per check, and closes with "scale: N passed, N failed".
Usage: test_scale.py BUILD_BIN_DIR  (from the repository root)."""
import glob
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "integration"))
import test_cluster as tc  # noqa: E402

pb = tc.pb
check = tc.check
BIN = tc.BIN
TTFT_SLO_MS, TPOT_SLO_MS = 3000, 300


def scale(c, *args):
    return subprocess.run([BIN + "/tandem", "scale", "--endpoint", c.endpoint] + list(args), capture_output=True,
                          text=True, timeout=30)


def counts(c):
    h = c.health()[1]
    return h["prefill_workers"], h["decode_workers"], h.get("planner", {})


def attainment(reqs, t0, t1):
    """SLO attainment of the requests sent in [t0, t1) (bench-relative seconds), and how many."""
    sel = [r for r in reqs if t0 <= r["t_sent"] < t1]
    met = [r for r in sel if r["status"] == 0 and r["ttft"] is not None and r["ttft"] * 1e3 <= TTFT_SLO_MS and
           (r["tpot"] or 0) * 1e3 <= TPOT_SLO_MS]
    return (100.0 * len(met) / len(sel) if sel else float("nan")), len(sel)


def main():
    c = tc.Cluster()
    try:
        ok, h = c.health()
        check("the cluster starts at 1 prefill + 1 decode", ok and (h["prefill_workers"], h["decode_workers"]) == (1, 1),
              str(h))
        # the founder seeded the ops config; the planner (this one router) made it the desired counts
        check("tandem up seeds the ops config and the elected planner adopts it",
              tc.wait_for(lambda: counts(c)[2].get("leader") and counts(c)[2].get("desired", {}).get("prefill") == 1,
                          10), str(counts(c)[2]))
        # the ops config's errors, before anything moves
        bad = tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False)
        bad.write("slo:\n  ttft_ms: 2000\nmodels:\n  - name: \"*\"\n    prefil: 2\n")
        bad.close()
        r = scale(c, "--apply", bad.name)
        check("a wrong key in the ops file is refused naming the file, the line and the key",
              r.returncode == 2 and "%s:5: key 'models.prefil'" % bad.name in r.stderr, r.stderr)
        r = scale(c, "--prefill", "17", "--decode", "1")
        check("a count past the bounds is refused naming the bound", r.returncode == 1 and "max_prefill" in r.stderr,
              r.stderr)

        # the load: tandem bench at a steady rate, every request recorded
        out = tempfile.mktemp(suffix=".json")
        n_req, rate = 90, 1.5
        bench = subprocess.Popen([BIN + "/tandem", "bench", "--endpoint", c.endpoint, "--api", "grpc",
                                  "--rate", str(rate), "--num-requests", str(n_req), "--workload", "synthetic",
                                  "--input-len", "uniform:32:200", "--output-len", "fixed:24", "--ignore-eos",
                                  "--tokenizer", tc.MODEL, "--goodput", "ttft:%d,tpot:%d" % (TTFT_SLO_MS, TPOT_SLO_MS),
                                  "--timeout", "120", "--seed", "7", "--output", out],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        t_bench = time.time()
        steps = [("2", "1"), ("1", "2")]
        marks = []  # (bench-relative start, end) of each change
        time.sleep(12)
        for p, d in steps:
            t0 = time.time()
            r = scale(c, "--prefill", p, "--decode", d)
            if r.returncode:
                check("tandem scale --prefill %s --decode %s" % (p, d), False, r.stderr)
                continue
            seen = tc.wait_for(lambda: counts(c)[:2] == (int(p), int(d)), 60)
            t1 = time.time()
            marks.append((t0 - t_bench, t1 - t_bench))
            why = counts(c)[2].get("desired", {}).get("reason", "")
            check("%sP+%sD under load: the router sees it in %.1f s (planner: %s)" % (p, d, t1 - t0, why),
                  seen and "fixed: %s prefill + %s decode" % (p, d) in why, str(counts(c)))
            time.sleep(10)
        log, _ = bench.communicate(timeout=300)
        res = json.load(open(out))
        for f in glob.glob(out[:-5] + "*"):  # the report and its plots
            os.unlink(f)
        reqs = res["runs"][0]["requests"]
        s = res["runs"][0]["summary"]
        lost = n_req - len(reqs)
        check("every request completed while the workers changed: %d sent, %d ok, %d failed, %d rejected, %d lost" %
              (len(reqs), s["ok"], s["failed"], s["rejected"], lost),
              lost == 0 and s["failed"] == 0 and s["rejected"] == 0 and s["ok"] == n_req,
              "\n".join(l for l in log.splitlines()[-12:]))
        edges = [0.0] + [x for m in marks for x in m] + [1e9]
        names = ["before"] + [n for k in range(len(marks)) for n in ("during change %d" % (k + 1),
                                                                     "after change %d" % (k + 1))]
        parts = []
        for k, name in enumerate(names):
            a, n = attainment(reqs, edges[k], edges[k + 1])
            parts.append("%s %.0f%% of %d" % (name, a, n))
        print("  SLO attainment (TTFT %d ms, TPOT %d ms): %s" % (TTFT_SLO_MS, TPOT_SLO_MS, "; ".join(parts)),
              flush=True)
        c.err.seek(0)
        flips = [l for l in c.err.read().splitlines() if "drained in" in l]
        check("the flip drained the prefill worker and started it as a decode worker: %s" %
              (flips[-1] if flips else "none"), any("now decode-" in l for l in flips), "")
        # an ops file applied whole: auto within bounds, the planner says what it waits for
        good = tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False)
        good.write("slo: {ttft_ms: %d, tpot_ms: %d}\nplanner: {hold_s: 2, cooldown_s: 5}\nmodels:\n"
                   "  - {name: \"*\", policy: auto, prefill: 1, decode: 2, max_prefill: 2, max_decode: 2}\n" %
                   (TTFT_SLO_MS, TPOT_SLO_MS))
        good.close()
        r = scale(c, "--apply", good.name)
        check("an ops file is applied whole (policy auto)", r.returncode == 0 and "policy: auto" in r.stdout,
              r.stderr)
        check("under auto the planner keeps the workers and says why",
              tc.wait_for(lambda: counts(c)[2].get("verdict", "").startswith("auto:"), 10) and counts(c)[:2] == (1, 2),
              str(counts(c)))
        os.unlink(good.name)
        os.unlink(bad.name)
    finally:
        code = c.stop()
    check("the cluster stops cleanly after the changes", code == 0, "exit %s" % code)


if __name__ == "__main__":
    try:
        main()
    except Exception as e:  # a crash of the suite is a failure, not a hang
        check("the suite ran to its end", False, repr(e))
    p = sum(tc.results)
    print("scale: %d passed, %d failed" % (p, len(tc.results) - p))
    sys.exit(0 if all(tc.results) else 1)
