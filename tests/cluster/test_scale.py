#!/usr/bin/env python3
"""Cluster suite: the prefill/decode ratio changed under load (DESIGN.md §7).

A real cluster (`tandem up`, CPU workers) serves `tandem bench` at a steady
rate while `tandem scale` takes it 1P+1D -> 2P+1D -> 1P+2D: the second step
flips the new prefill worker into a decode worker (it drains, then starts in
the other role). Every request must complete (0 failed, 0 lost), each change
must show in the router's membership, and the planner must say why. Also:
the ops config's errors name the key and its line, a bad count is refused
naming its bound, and an ops file with policy auto is applied whole.
Then the workload shift under the planner: a fresh cluster of 3 workers
(1P+2D) serves a prefill-heavy phase (long prompts, short outputs) then a
decode-heavy one (short prompts, long outputs); under policy auto the planner
must turn a decode worker into a prefill worker in the first phase and back
in the second, and every request completes; its predicted demand (the
placed requests' prompt tokens and predicted outputs against the workers'
profiles, router/demand.h) must say, in each phase, that the role the phase
loads needs more workers than the other. With --compare a second cluster,
fixed at 1P+2D, serves the same requests (nothing may move there) and the
SLO attainment of the two is printed side by side; CI leaves the comparison
out (it checks nothing the first part does not, and costs 100 s).
Last, the mode (ops choose_mode): 2 workers, 1P+1D, whose decode workers prefill
too; short prompts make the planner go colocated (no prefill worker), chat
streams beside long documents bring a prefill worker back; every request
completes, and the attainment before and after each change is printed.
Prints the time each change took and SLO attainment before, during and after
each, one line per check. Run with pytest (tests/conftest.py says how; --compare adds the fixed cluster)."""
import glob
import json
import os
import subprocess
import tempfile
import threading
import time

import pytest

import harness as hs

pb = hs.pb
check = hs.check
BIN = hs.BIN
TTFT_SLO_MS, TPOT_SLO_MS = 3000, 300


def scale(c, *args):
    """tandem scale as the administrator: with the key tandem up made for its router."""
    return subprocess.run([BIN + "/tandem", "scale", "--endpoint", c.endpoint, "--admin-key", c.admin_key] +
                          list(args), capture_output=True, text=True, timeout=30)


def counts(c):
    h = c.health()[1]
    return h["prefill_workers"], h["decode_workers"], h.get("planner", {})


def attainment(reqs, t0, t1):
    """SLO attainment of the requests sent in [t0, t1) (bench-relative seconds), and how many."""
    sel = [r for r in reqs if t0 <= r["t_sent"] < t1]
    met = [r for r in sel if r["status"] == 0 and r["ttft"] is not None and r["ttft"] * 1e3 <= TTFT_SLO_MS and
           (r["tpot"] or 0) * 1e3 <= TPOT_SLO_MS]
    return (100.0 * len(met) / len(sel) if sel else float("nan")), len(sel)


@pytest.fixture(scope="module")
def c():
    """One cluster of 1P+1D, which the tests below change in turn (each starts from where the one before left it)."""
    cl = hs.Cluster()
    yield cl
    if cl.p.returncode is None:
        cl.stop()


def test_starts_seeded(c):
    ok, h = c.health()
    check("the cluster starts at 1 prefill + 1 decode", ok and (h["prefill_workers"], h["decode_workers"]) == (1, 1),
          str(h))
    # the founder seeded the ops config; the planner (this one router) made it the desired counts
    check("tandem up seeds the ops config and the elected planner adopts it",
          hs.wait_for(lambda: counts(c)[2].get("leader") and counts(c)[2].get("desired", {}).get("prefill") == 1,
                      10), str(counts(c)[2]))


def test_ops_config_errors(c):
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
    os.unlink(bad.name)


def test_scale_under_load(c):
    # the load: tandem bench at a steady rate, every request recorded
    out = tempfile.mktemp(suffix=".json")
    n_req, rate = 90, 1.5
    bench = subprocess.Popen([BIN + "/tandem", "bench", "--endpoint", c.endpoint, "--api", "grpc",
                              "--rate", str(rate), "--num-requests", str(n_req), "--workload", "synthetic",
                              "--input-len", "uniform:32:200", "--output-len", "fixed:24", "--ignore-eos",
                              "--tokenizer", hs.MODEL, "--goodput", "ttft:%d,tpot:%d" % (TTFT_SLO_MS, TPOT_SLO_MS),
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
        seen = hs.wait_for(lambda: counts(c)[:2] == (int(p), int(d)), 60)
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
    flips = [l for l in c.log().splitlines() if "drained in" in l]
    check("the flip drained the prefill worker and started it as a decode worker: %s" %
          (flips[-1] if flips else "none"), any("now decode-" in l for l in flips), "")


def test_ops_file_auto(c):
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
          hs.wait_for(lambda: counts(c)[2].get("verdict", "").startswith("auto:"), 10) and counts(c)[:2] == (1, 2),
          str(counts(c)))
    os.unlink(good.name)


def test_etcd_wipe(c):
    # a wipe of everything under /tandem/ in etcd: the members re-register, and the elected planner puts back
    # the ops config it last applied (not the seed of tandem up's start-up counts), so the shape stays
    before = c.etcdctl("get", "/tandem/ops", "--print-value-only").stdout
    wiped = c.etcdctl("del", "--prefix", "/tandem/", cert="router")
    t0 = time.time()
    back = hs.wait_for(lambda: c.etcdctl("get", "/tandem/ops", "--print-value-only").stdout == before and
                       len(c.workers()) == 3, 15)
    t1 = time.time()
    check("after a wipe of /tandem/ (%s keys): the ops config is back as it was and the 3 workers re-registered "
          "in %.1f s; the workers stay 1P+2D (%s)" % (wiped.stdout.strip(), t1 - t0, counts(c)[:2]),
          back and before and "policy: auto" in before and
          hs.wait_for(lambda: counts(c)[:2] == (1, 2), 10) and counts(c)[2].get("ops_restored", 0) >= 1,
          wiped.stderr)


def test_stops_cleanly(c):
    code = c.stop()
    check("the cluster stops cleanly after the changes", code == 0, "exit %s" % code)


# The workload shift: a prefill-heavy phase (long prompts, short outputs), then a decode-heavy one (short prompts,
# long outputs), on 3 workers starting at 1P+2D; once under policy auto (the planner moves workers between roles),
# once fixed at 1P+2D (no planner decisions), the same requests in both.
SHIFT_SLO = {"ttft_ms": 2500, "tpot_ms": 30}
SHIFT_PHASES = [  # name, input lengths, output length, requests, rate (per second)
    ("long prompts, short outputs", "uniform:300:500", 4, 45, 0.9),
    ("short prompts, long outputs", "uniform:16:48", 96, 120, 5.0),
]


def registered(c):
    """The workers registered with the router by role (suspect ones too: load makes a worker briefly unusable)."""
    pools = c.health()[1].get("pools", [])
    return sum(w["role"] == "prefill" for w in pools), sum(w["role"] == "decode" for w in pools)


def solo(c, inp, outl, seed):
    """Median TTFT and TPOT (ms) of 4 requests of the phase's kind sent slowly (each alone) through tandem bench: the
    machine's speed. The phases' load and SLOs are set from it, so that a phase overloads what it must on a fast CPU
    as on a slow one (CI's machines differ by 2x: a fixed rate left the prefill-heavy phase unmissed on a fast one)."""
    reqs, _ = run_phase(c, ("alone", inp, outl, 4, 0.25), seed, time.time(), {"ttft_ms": 60000, "tpot_ms": 1000})
    ttft = sorted(q["ttft"] * 1e3 for q in reqs if q["ttft"] is not None)
    tpot = sorted(q["tpot"] * 1e3 for q in reqs if q["tpot"] is not None)
    return ttft[len(ttft) // 2], tpot[len(tpot) // 2]


def service(c, inp, outl, seed, n=6):
    """Seconds between the first tokens of n requests sent at once: the time the prefill worker gives each, which
    is less than a request's TTFT alone (that also holds the router's and the decode worker's part, which overlap
    the next prefill: on one 2-core machine the rate from TTFTs alone overloaded nothing)."""
    reqs, _ = run_phase(c, ("burst", inp, outl, n, 50.0), seed, time.time(), {"ttft_ms": 60000, "tpot_ms": 1000})
    firsts = sorted(q["t_sent"] + q["ttft"] for q in reqs if q["ttft"] is not None)
    return (firsts[-1] - firsts[0]) / max(1, len(firsts) - 1)


def run_phase(c, phase, seed, t_origin, slo=SHIFT_SLO):
    """One phase through tandem bench: its requests, times relative to t_origin."""
    name, inp, outl, n, rate = phase
    out = tempfile.mktemp(suffix=".json")
    t0 = time.time()
    r = subprocess.run([BIN + "/tandem", "bench", "--endpoint", c.endpoint, "--api", "grpc", "--rate", str(rate),
                        "--num-requests", str(n), "--workload", "synthetic", "--input-len", inp,
                        "--output-len", "fixed:%d" % outl, "--ignore-eos", "--tokenizer", hs.MODEL,
                        "--goodput", "ttft:%d,tpot:%d" % (slo["ttft_ms"], slo["tpot_ms"]),
                        "--timeout", "120", "--seed", str(seed), "--output", out],
                       capture_output=True, text=True, timeout=600)
    res = json.load(open(out)) if os.path.exists(out) else None
    for f in glob.glob(out[:-5] + "*"):
        os.unlink(f)
    if not res:
        raise AssertionError("tandem bench (%s) wrote no result: %s" % (name, r.stdout[-500:] + r.stderr[-500:]))
    reqs = res["runs"][0]["requests"]
    for q in reqs:
        q["t_abs"] = t0 - t_origin + q["t_sent"]
    return reqs, n


def met(q):
    return (q["status"] == 0 and q["ttft"] is not None and q["ttft"] * 1e3 <= SHIFT_SLO["ttft_ms"] and
            (q["tpot"] or 0) * 1e3 <= SHIFT_SLO["tpot_ms"])


def shift_run(policy):
    """One cluster through both phases under policy ("auto" or "fixed"): the requests, the role changes seen
    (time, prefill, decode, the planner's reason) and the lost count."""
    c = hs.Cluster(extra=["--prefill", "1", "--decode", "2"] + hs.PAIRS_ONLY)
    changes, preds, unpredicted, stop = [], [], [], threading.Event()
    try:
        # this machine's speed: each phase's requests alone (TTFT of the first's, TPOT of the second's); the SLOs are
        # 5x and 3x them
        # (2,500 and 30 ms on the VM the test was first tuned on) and the prefill-heavy phase arrives at 1.6x the
        # rate one prefill worker serves (measured by a burst)
        hs.wait_for(lambda: c.health()[0], 60)
        ttft1, _ = solo(c, SHIFT_PHASES[0][1], SHIFT_PHASES[0][2], 5)
        _, tpot1 = solo(c, SHIFT_PHASES[1][1], SHIFT_PHASES[1][2], 6)
        svc = service(c, SHIFT_PHASES[0][1], SHIFT_PHASES[0][2], 9)
        SHIFT_SLO.update(ttft_ms=int(5 * ttft1), tpot_ms=max(10, int(3 * tpot1)))
        rate1 = round(1.6 / svc, 2)
        SHIFT_PHASES[0] = SHIFT_PHASES[0][:3] + (int(rate1 * 50), rate1)
        print("  %s: alone, TTFT %.0f ms (300-500 tokens), TPOT %.1f ms; a prompt's prefill in a burst %.0f ms: SLOs "
              "TTFT %d ms, TPOT %d ms; the prefill-heavy phase %d requests at %.2f/s" %
              (policy, ttft1, tpot1, 1e3 * svc, SHIFT_SLO["ttft_ms"], SHIFT_SLO["tpot_ms"], SHIFT_PHASES[0][3], rate1),
              flush=True)
        ops = tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False)
        ops.write("slo: {ttft_ms: %d, tpot_ms: %d, attainment: 0.9}\nplanner: {hold_s: 4, cooldown_s: 8}\n"
                  "models:\n  - {name: \"*\", policy: %s, prefill: 1, decode: 2, min_prefill: 1, min_decode: 1, "
                  "max_prefill: 2, max_decode: 2}\n" % (SHIFT_SLO["ttft_ms"], SHIFT_SLO["tpot_ms"], policy))
        ops.close()
        r = scale(c, "--apply", ops.name)
        os.unlink(ops.name)
        if r.returncode:
            raise AssertionError("tandem scale --apply (%s): %s" % (policy, r.stderr))
        hs.wait_for(lambda: counts(c)[:2] == (1, 2), 30)
        t_origin = time.time()

        def watch():
            last = None
            while not stop.is_set():
                try:
                    p, d = registered(c)
                    pl = counts(c)[2]
                    pz = pl.get("predicted")
                    if pz:  # the planner's predicted demand (router/demand.h): workers each role needs
                        preds.append((time.time() - t_origin, pz["prefill_workers"], pz["decode_workers"]))
                    elif pl.get("demand_inputs"):  # none: what it lacked
                        unpredicted.append((round(time.time() - t_origin, 1), pl["demand_inputs"]))
                    if (p, d) != last:
                        dz = counts(c)[2].get("desired", {})
                        changes.append((time.time() - t_origin, p, d, dz.get("reason", ""), dz.get("at", 0) - t_origin))
                        last = (p, d)
                except Exception:  # a Health that timed out: the next look
                    pass
                stop.wait(0.5)
        w = threading.Thread(target=watch)
        w.start()
        reqs, sent, bounds = [], 0, []
        for k, ph in enumerate(SHIFT_PHASES):
            t_start = time.time() - t_origin
            got, n = run_phase(c, ph, 11 + k, t_origin)
            reqs += got
            sent += n
            bounds.append((t_start, time.time() - t_origin))
        stop.set()
        w.join()
        return reqs, sent, changes, bounds, (preds, unpredicted)
    finally:
        stop.set()
        code = c.stop()
        check("the %s cluster stops cleanly (exit %s)" % (policy, code), code == 0)


def test_workload_shift(pytestconfig):
    compare = pytestconfig.getoption("--compare")
    runs = {}
    policies = ("auto", "fixed") if compare else ("auto",)
    for policy in policies:
        reqs, sent, changes, bounds, preds = shift_run(policy)
        ok = sum(q["status"] == 0 for q in reqs)
        failed = len(reqs) - ok
        lost = sent - len(reqs)
        runs[policy] = (reqs, changes, bounds, preds)
        check("%s: every request of the shifting workload completed: %d sent, %d ok, %d failed, %d lost" %
              (policy, sent, ok, failed, lost), ok == sent and lost == 0)
    # the planner moved a decode worker to prefill in the first phase and back in the second
    reqs, changes, bounds, (preds, unpredicted) = runs["auto"]
    # the planner reads the load on its way (placed requests' prompt tokens and predicted outputs against the
    # workers' profiles): in each phase's second half, the role the phase loads needs more workers than the other
    for k, role in enumerate(("prefill", "decode")):
        a, b = bounds[k]
        sel = [(pp, dd) for t, pp, dd in preds if (a + b) / 2 <= t < b]
        mid = tuple(sorted(x[j] for x in sel)[len(sel) // 2] for j in (0, 1)) if sel else None
        check("auto: phase %d's predicted demand needs more %s than %s workers (median %s of %d looks)" %
              (k + 1, role, "decode" if k == 0 else "prefill",
               "%.2f prefill + %.2f decode" % mid if mid else "none", len(sel)),
              bool(mid) and (mid[0] > mid[1] if k == 0 else mid[1] > mid[0]),
              "no prediction at %s" % [u for u in unpredicted if a <= u[0] < b][-3:])
    moves = [(t, p, d) for t, p, d, _, _ in changes[1:]]
    first = [m for m in moves if bounds[0][0] <= m[0] < bounds[0][1] and (m[1], m[2]) == (2, 1)]
    second = [m for m in moves if bounds[1][0] <= m[0] < bounds[1][1] + 10 and (m[1], m[2]) == (1, 2)]
    # the planner may already have turned back before the decode-heavy phase began (it moves on the misses it
    # sees, and the prefill-heavy phase's last requests miss TPOT at 2P+1D too): then that phase ran at 1P+2D
    # from its start, and no move in it may undo that
    before = [m for m in moves if first and first[0][0] < m[0] < bounds[1][0]]
    already = bool(before) and (before[-1][1], before[-1][2]) == (1, 2) and \
        not [m for m in moves if bounds[1][0] <= m[0] < bounds[1][1] and (m[1], m[2]) != (1, 2)]
    check("auto: the prefill-heavy phase turned a decode worker into a prefill worker (2P+1D at %s s)" %
          ("%.0f" % first[0][0] if first else "never"), bool(first), str(changes))
    check("auto: the decode-heavy phase turned it back (1P+2D at %s s%s)" %
          ("%.0f" % (second or before)[-1 if not second else 0][0] if second or already else "never",
           ", before the phase began, and it stayed" if already and not second else ""),
          bool(second) or already, str(changes))
    if compare:
        check("fixed: no role changed", [(p, d) for _, p, d, _, _ in runs["fixed"][1]] == [(1, 2)],
              str(runs["fixed"][1]))
    for t, p, d, why, decided in changes[1:]:
        if (p, d) in ((2, 1), (1, 2)):  # a move complete (a flip passes through 1P+1D while the worker drains)
            print("  auto: %dP+%dD decided at %.1f s, in effect at %.1f s (took %.1f s): %s" % (p, d, decided, t,
                                                                                        t - decided, why))
    # attainment per window: each phase before, during (the decision until the router saw the new counts) and after
    for policy in policies:
        reqs, _, bounds, _ = runs[policy]
        parts = []
        edges = sorted({0.0} | {t for t, *_ in runs["auto"][1][1:]} | {b[0] for b in bounds} | {bounds[-1][1] + 1e6})
        for a, b in zip(edges, edges[1:]):
            sel = [q for q in reqs if a <= q["t_abs"] < b]
            if sel:
                parts.append("[%.0f s, %s): %.0f%% of %d" % (a, "end" if b > 1e5 else "%.0f s" % b,
                                                             100.0 * sum(map(met, sel)) / len(sel), len(sel)))
        per_phase = []
        for k, (a, b) in enumerate(bounds):
            sel = [q for q in reqs if a <= q["t_abs"] < b]
            per_phase.append("phase %d %.0f%%" % (k + 1, 100.0 * sum(map(met, sel)) / max(1, len(sel))))
        print("  %s: SLO attainment (TTFT %d ms, TPOT %d ms) %s; by window (auto's change times) %s" %
              (policy, SHIFT_SLO["ttft_ms"], SHIFT_SLO["tpot_ms"], ", ".join(per_phase), "; ".join(parts)),
              flush=True)


# The mode shift (ops choose_mode): 2 workers whose decode workers prefill too (decode.colocated), starting 1P+1D
# under policy auto. Short prompts at a low rate: the decode worker prefills nearly all of them itself, so the
# planner makes the prefill worker a decode worker (colocated: no prefill worker). Then a mixed workload, chat
# streams beside long documents: the documents' chunks stall the streams on both colocated workers, TPOT is
# missed, and the planner makes one a prefill worker again (the documents go there; the streams keep their pace).
# Every request completes through both changes.
MODE_SLO = {"ttft_ms": 30000, "tpot_ms": 12}  # TPOT: about 1.5x a decode step alone here; TTFT: only TPOT counts
# The target is 75%, not 90%: an 8-token answer's TPOT is 7 intervals, so one prompt's chunk beside it on a 2-core
# machine is a miss, and at 90% the first phase's window of 8-16 requests kept the planner from going colocated in
# 1-2 of 3 runs on an idle VM (session 40), with the placement before and after its mean-TPOT rule; the second
# phase meets 45-60%
MODE_PHASES = [  # name, then each stream of it: input lengths, output length, requests, rate (per second)
    ("short prompts, short outputs", [("uniform:16:48", 8, 16, 0.8)]),
    ("chat streams beside documents", [("uniform:16:48", 64, 22, 0.75), ("uniform:400:500", 4, 12, 0.4)]),
]


def test_mode_shift():
    work = tempfile.mkdtemp(prefix="tandem-mode-")
    cfg = os.path.join(work, "tandem.yaml")
    with open(cfg, "w") as f:
        f.write("decode: { colocated: true }\n")
    c = hs.Cluster(config=cfg, extra=["--prefill", "1", "--decode", "1"])
    seen, stop = [], threading.Event()
    try:
        # the TPOT SLO from this machine's speed: 1.5x a short stream's TPOT alone (12 ms on the VM first tuned on)
        hs.wait_for(lambda: c.health()[0], 60)
        # and the documents arrive to keep a worker prefilling them 120% of the time, 60% of each of two colocated
        # workers (0.4/s of ~0.45 s each stalled too few streams on a fast CPU: 75% of them met the SLO, the target,
        # and the planner stayed; a third of the time left ~78% of the chats unstalled: stop 61's CI stayed
        # colocated; at 60% a fresh-clone run of session 47 met 79% in the second phase, at 80% stop 64's 78%, runs
        # here 36% to 69%: the planner stayed colocated when a phase's chats happened to miss the documents; at
        # 120% two runs here met 33% and 36% in the phase's first window and went back at 22 s)
        # (the first phase's short answers alone: an 8-token answer's TPOT is above a 64-token stream's, its first
        # steps the slowest)
        _, tpot1 = solo(c, MODE_PHASES[0][1][0][0], MODE_PHASES[0][1][0][1], 7)
        doc_ttft, _ = solo(c, MODE_PHASES[1][1][1][0], MODE_PHASES[1][1][1][1], 8)
        MODE_SLO["tpot_ms"] = max(4, int(round(1.5 * tpot1)))
        doc_rate = round(min(3.0, 1.2 * 1000.0 / doc_ttft), 2)
        docs = MODE_PHASES[1][1][1]
        MODE_PHASES[1] = (MODE_PHASES[1][0], [MODE_PHASES[1][1][0], docs[:2] + (max(12, int(doc_rate * 30)), doc_rate)])
        print("  mode shift: alone, a stream's TPOT %.1f ms, a document's TTFT %.0f ms: the TPOT SLO %d ms, documents "
              "at %.2f/s" % (tpot1, doc_ttft, MODE_SLO["tpot_ms"], doc_rate), flush=True)
        ops = os.path.join(work, "ops.yaml")
        with open(ops, "w") as f:
            f.write("slo: {ttft_ms: %d, tpot_ms: %d, attainment: 0.75}\nplanner: {interval_s: 1, hold_s: 2, "
                    "cooldown_s: 4}\nmodels:\n  - {name: \"*\", policy: auto, prefill: 1, decode: 1, min_prefill: 1, "
                    "max_prefill: 1, min_decode: 1, max_decode: 2, choose_mode: true}\n" %
                    (MODE_SLO["ttft_ms"], MODE_SLO["tpot_ms"]))
        r = scale(c, "--apply", ops)
        check("an ops file with choose_mode is applied", r.returncode == 0 and "choose_mode: true" in r.stdout,
              r.stderr)
        aim = {"ttft_ms": MODE_SLO["ttft_ms"], "tpot_ms": MODE_SLO["tpot_ms"]}
        check("the router's placement aims at the ops file's SLOs (%s)" % aim,
              hs.wait_for(lambda: c.health()[1]["placement"].get("slo_aim") == aim, 15),
              str(c.health()[1]["placement"].get("slo_aim")))
        hs.wait_for(lambda: registered(c) == (1, 1), 60)
        t_origin = time.time()

        def watch():
            last = None
            while not stop.is_set():
                try:
                    dz = counts(c)[2].get("desired", {})
                    now = (registered(c), dz.get("prefill"), dz.get("colocated", False))
                    if now != last:
                        seen.append((time.time() - t_origin,) + now + (dz.get("reason", ""),))
                        last = now
                except Exception:  # a Health that timed out: the next look
                    pass
                stop.wait(0.25)
        w = threading.Thread(target=watch)
        w.start()
        reqs, sent, bounds = [], 0, []
        for k, (name, streams) in enumerate(MODE_PHASES):
            t_start = time.time() - t_origin
            got = [None] * len(streams)

            def one(j, st):
                got[j] = run_phase(c, (name,) + st, 21 + 10 * k + j, t_origin, MODE_SLO)
            ts = [threading.Thread(target=one, args=(j, st)) for j, st in enumerate(streams)]
            [t.start() for t in ts]
            [t.join() for t in ts]
            for j, g in enumerate(got):
                if g is None:
                    raise AssertionError("phase %d stream %d: tandem bench failed" % (k + 1, j + 1))
                for q in g[0]:
                    q["kind"] = j
                reqs += g[0]
                sent += g[1]
            bounds.append((t_start, time.time() - t_origin))
            if k == 0:  # the colocated mode in effect before the second phase starts
                print("  mode shift: after the first phase, the planner: %s; placed %s" %
                      (counts(c)[2].get("verdict"), c.health()[1].get("placement", {}).get("placed")), flush=True)
                hs.wait_for(lambda: registered(c) == (0, 2), 30)
        stop.set()
        w.join()
    finally:
        stop.set()
        code = c.stop()
        check("the mode-shift cluster stops cleanly (exit %s)" % code, code == 0)
    for t, reg, p, col, why in seen:
        print("  %.1f s: registered %dP+%dD; planner: prefill %s%s: %s" % (t, reg[0], reg[1], p,
                                                                          " colocated" if col else "", why))
    ok = sum(q["status"] == 0 for q in reqs)
    check("mode shift: every request completed: %d sent, %d ok, %d lost" % (sent, ok, sent - len(reqs)),
          ok == sent and len(reqs) == sent)
    went = [s for s in seen if s[3] and bounds[0][0] <= s[0] < bounds[0][1] + 30]
    back = [s for s in seen if not s[3] and s[2] == 1 and bounds[1][0] <= s[0] < bounds[1][1] + 30]
    # the planner goes colocated only when the decode worker prefilled 3 in 4 of the prompt tokens itself; which
    # side prefills a short prompt is the router's choice by predicted TTFT, and on a CPU whose prefill is slow
    # beside its fixed costs (a 2-core Xeon here) the pair's prediction and the local one are close: in some runs
    # the router sends nearly every short prompt to the prefill worker (1 of 16 local, 77% local in another run).
    # Then staying disaggregated is the rule's answer, checked as such, and the way back cannot be shown.
    p1 = [q for q in reqs if bounds[0][0] <= q["t_abs"] < bounds[0][1]]
    local1 = sum(q.get("prefill_worker") == q.get("decode_worker") for q in p1)
    premise = 4 * local1 >= 3 * len(p1)
    check("short prompts: the planner went colocated (at %s s; %d of %d prompts prefilled by the decode worker)" %
          ("%.0f" % went[0][0] if went else "never", local1, len(p1)), bool(went) or not premise, str(seen))
    if went or premise:
        check("chat streams beside documents: back to a prefill worker (at %s s)" %
              ("%.0f" % back[0][0] if back else "never"), bool(back), str(seen))
    else:
        print("  (the way back is not shown: the router prefilled %d of %d short prompts on the decode worker, and "
              "the planner rightly stayed disaggregated)" % (local1, len(p1)), flush=True)
    edges = sorted({b for ab in bounds for b in ab} | ({back[0][0]} if back else set()))
    for a, b in zip(edges, edges[1:]):
        sel = [q for q in reqs if a <= q["t_abs"] < b]
        if not sel:
            continue
        good = [q for q in sel if q["status"] == 0 and q["ttft"] is not None and q["ttft"] * 1e3 <= MODE_SLO["ttft_ms"]
                and (q["tpot"] or 0) * 1e3 <= MODE_SLO["tpot_ms"]]
        tp = sorted((q["tpot"] or 0) * 1e3 for q in sel if q["kind"] == 0)
        local = sum(q.get("prefill_worker") == q.get("decode_worker") for q in sel)
        print("  [%.0f s, %.0f s): %d requests, %.0f%% met the SLOs, chat TPOT p50 %.1f ms p90 %.1f ms, %d prefilled "
              "where decoded" % (a, b, len(sel), 100.0 * len(good) / len(sel), tp[len(tp) // 2] if tp else 0,
                                 tp[int(0.9 * (len(tp) - 1))] if tp else 0, local), flush=True)
