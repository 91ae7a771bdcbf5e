#!/usr/bin/env python3
"""The fault matrix: a real cluster (`tandem up`: etcd, router, 1 prefill + 1
decode worker) under open-loop Poisson load, and one fault per run, injected
as a user's machine would suffer it: kill -9, or SIGSTOP for 20 s then
SIGCONT, of the prefill worker, the decode worker, the router, or etcd.

Every request is a grpcio client call with a 30 s deadline, greedy, whose
tokens are compared with single-process `tandem generate` of the same prompt.
For each run it reports: requests, completed correctly, completed wrong (must
be 0), errors (by code), requests that waited out their deadline, the longest
time from the fault to an error answer, and whether every process is back.

With --workers N the cluster has N prefill and N decode workers (the fault
hits one of each role; the others can take over).

Usage: bench/faults.py BUILD_BIN_DIR [--rate R] [--secs S] [--only NAME] [--workers N] [--logs DIR]
Writes a Markdown table to stdout (bench/results/faults-DATE.md keeps one)."""
import argparse
import os
import random
import signal
import subprocess
import sys
import threading
import time

sys.argv, _argv = sys.argv[:2], sys.argv  # test_cluster reads the bin dir from argv[1]
sys.path.insert(0, os.path.join(os.getcwd(), "tests", "integration"))
import test_cluster as tc  # noqa: E402  (the Cluster, stubs and reference of the integration suite)
import grpc  # noqa: E402

sys.argv = _argv
LEASE_S = 3.0  # etcd.lease_ttl_s: a dead worker leaves the membership this long after
DEADLINE_S = 30.0
MAX_TOKENS = 24


def children(c):
    """pid of each tandem up child by its program name."""
    out = {}
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        st, ppid = tc.proc_state(int(p))
        if ppid != c.p.pid or st in (None, "Z"):
            continue
        try:
            cmd = open("/proc/%s/cmdline" % p, "rb").read().split(b"\0")[0].decode()
        except OSError:
            continue
        out.setdefault(os.path.basename(cmd), int(p))
    return out


def run(bin_dir, target, how, rate, secs, refs, prompts, workers=1, logs=""):
    c = tc.Cluster(extra=["--prefill", str(workers), "--decode", str(workers)] if workers > 1 else ())
    results, lock = [], threading.Lock()
    try:
        tc.wait_for(lambda: c.health()[0], 60)
        kids = children(c)
        name = {"prefill": "tandem-prefill", "decode": "tandem-decode", "router": "tandem-router",
                "etcd": "etcd"}[target]
        victim = kids.get(name)
        assert victim, "no %s among %s" % (name, kids)
        rng = random.Random(7)
        t0 = time.time()
        fault_at = t0 + secs / 3

        def one(prompt, t_start):
            rq = tc.pb.GenerateRequest(prompt=prompt, return_token_ids=True,
                                       sampling=tc.pb.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
            ids, code, msg = [], None, ""
            try:
                for r in c.stub.Generate(rq, timeout=DEADLINE_S):
                    ids.extend(r.token_ids)
                    if r.finish_reason == tc.pb.FINISH_REASON_ERROR:  # ended by the engine, with its reason
                        code, msg = "FINISH_REASON_ERROR", r.error
            except grpc.RpcError as e:
                code, msg = e.code().name, e.details()
            with lock:
                results.append(dict(prompt=prompt, start=t_start, end=time.time(), ids=ids, code=code, msg=msg))

        threads = []
        faulted = stopped = False
        t_next = t0
        while time.time() - t0 < secs:
            now = time.time()
            if not faulted and now >= fault_at:
                os.kill(victim, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
                faulted, t_fault = True, now
                stopped = how == "stop"
            if stopped and now >= t_fault + 20:
                os.kill(victim, signal.SIGCONT)
                stopped = False
            if now >= t_next:
                p = rng.choice(prompts)
                th = threading.Thread(target=one, args=(p, now), daemon=True)
                th.start()
                threads.append(th)
                t_next += rng.expovariate(rate)
            time.sleep(0.01)
        if stopped:
            time.sleep(max(0, t_fault + 20 - time.time()))
            os.kill(victim, signal.SIGCONT)
        for th in threads:
            th.join(DEADLINE_S + 10)
        hung = sum(th.is_alive() for th in threads)
        back = tc.wait_for(lambda: c.health()[0], 60)
        # after the fault: a request that reaches the cluster now is served correctly
        try:
            ids, _ = tc.generate(c.stub, prompts[0], max_tokens=MAX_TOKENS, timeout=DEADLINE_S)
            after_ok = ids == refs[prompts[0]]
        except grpc.RpcError:
            after_ok = False
    finally:
        rc = c.stop()
        c.err.seek(0)
        log = c.err.read()
        if logs:
            with open(os.path.join(logs, "%s-%s.log" % (target, how)), "w") as f:
                f.write(log)
        # an ASan/UBSan build reports here (the children's stderr): counted, never ignored
        san = log.count("ERROR: AddressSanitizer") + log.count("runtime error:") + log.count("ERROR: LeakSanitizer")
    ok = [r for r in results if r["code"] is None and r["ids"] == refs[r["prompt"]]]
    wrong = [r for r in results if r["code"] is None and r["ids"] != refs[r["prompt"]]]
    errs = [r for r in results if r["code"] is not None]
    deadline = [r for r in errs if r["code"] == "DEADLINE_EXCEEDED" or r["end"] - r["start"] >= DEADLINE_S - 0.5]
    # how long each error answer took from the later of its start and the fault
    late = [r["end"] - max(r["start"], t_fault) for r in errs if r["end"] >= t_fault]
    codes = {}
    for r in errs:
        codes[r["code"]] = codes.get(r["code"], 0) + 1
    return dict(target=target, how=how, n=len(results), ok=len(ok), wrong=len(wrong), errors=len(errs),
                codes=codes, deadline=len(deadline), max_err_s=max(late) if late else 0.0, hung=hung,
                back=back, after_ok=after_ok, stop_rc=rc, san=san,
                sample=[(r["code"], r["msg"][:80]) for r in errs[:2]],
                wrong_sample=[(len(r["ids"]), len(refs[r["prompt"]]),
                               next((i for i, (x, y) in enumerate(zip(r["ids"], refs[r["prompt"]])) if x != y), None))
                              for r in wrong[:3]])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bin")
    ap.add_argument("--rate", type=float, default=3.5)
    ap.add_argument("--secs", type=float, default=45)
    ap.add_argument("--only", default="")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--logs", default="", help="keep each row's cluster log (tandem up's stderr) in this folder")
    a = ap.parse_args()
    prompts = tc.PROMPTS[:12]
    refs = {p: tc.reference(p, MAX_TOKENS) for p in prompts}
    runs = [(t, h) for t in ("prefill", "decode", "router", "etcd") for h in ("kill", "stop")]
    print("| process | fault | requests | correct | wrong | errors (codes) | waited out the 30 s deadline | "
          "longest wait for an error, from the later of its start and the fault (s) | hung | "
          "recovered, next request correct | sanitizer reports |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for t, h in runs:
        if a.only and a.only not in (t, "%s-%s" % (t, h)):
            continue
        r = run(a.bin, t, h, a.rate, a.secs, refs, prompts, a.workers, a.logs)
        print("| %s | %s | %d | %d | %d | %d %s | %d | %.1f | %d | %s | %d |" % (
            t, "kill -9" if h == "kill" else "SIGSTOP 20 s", r["n"], r["ok"], r["wrong"], r["errors"],
            r["codes"] or "", r["deadline"], r["max_err_s"], r["hung"],
            "yes" if r["back"] and r["after_ok"] else "NO", r["san"]), flush=True)
        if r["sample"]:
            print("<!-- %s %s: %s -->" % (t, h, r["sample"]), flush=True)
        if r["wrong_sample"]:  # (tokens got, tokens expected, first differing index)
            print("<!-- %s %s wrong: %s -->" % (t, h, r["wrong_sample"]), flush=True)


if __name__ == "__main__":
    main()
