#!/usr/bin/env python3
"""distserve.py — DistServe's experiment on tandem: SLO goodput of
disaggregated serving (a prefill and a decode worker, KV through CUDA IPC)
against colocated serving (workers that prefill and decode in one engine,
`tandem up --colocated N`), on the same GPUs, model and workloads.

Workloads (prompts of ' a' words after a distinct number, so nothing is
cached; EOS ignored):
  chat     prompts of 64-512 tokens, 200-token answers, a tight TPOT SLO;
  summary  prompts of 1536-3072 tokens, 32-token answers, a loose TPOT SLO;
  mixed    a quarter summary's documents, three quarters chat's prompts, in
           turn; TTFT <= 5x a document alone, TPOT <= 3x a chat alone.
SLOs relative to one request's latency, as DistServe chose them: a single
process (`tandem generate --device`) serves one request of each workload's
median prompt alone, and the SLOs are TTFT <= 5x its TTFT for both, TPOT <=
2x its TPOT for chat and 5x for summary. `tandem bench --sweep` then finds
each mode's goodput (the highest rate with 90% of requests within both SLOs;
--slo-scale shows attainment at tighter and looser SLOs too).

Modes:
  disagg     tandem up --prefill 1 --decode 1, every prompt on the prefill
             worker (decode.colocated false; both on --device; with one GPU
             the two processes share it);
  colocated  tandem up --colocated N (N workers on --device);
  auto       tandem up --prefill 1 --decode 1 as it starts by default: the
             decode worker prefills a request itself when the router predicts
             that keeps its SLOs sooner (conditional disaggregation); the
             report counts the requests each way.
  disagg:PxD, auto:PxD
             the same with P prefill and D decode workers (DistServe's
             fixed shapes on four GPUs: 3x1, 2x2, 1x3), the prefill workers
             on the first P of --gpus, the decode workers on the next D;
  planner    auto, and the planner too: before each workload's sweep an ops
             file (tandem scale --apply) sets its SLOs and policy auto with
             choose_mode over --planner-workers workers (1 prefill to start;
             colocated, or 1 to N-1 prefill workers); a role's k-th worker
             takes the k-th of --planner-devices (prefill) or of the same list
             backwards (decode), so the two roles' first workers never share
             one. The report keeps the planner's decision (tandem health).
Every rate of a sweep gets prompts of its own (tandem bench salts them), so
no rate is served from another's prefix cache.
On one GPU this is the experiment's one-GPU form. On two, DistServe's own:
  --prefill-device cuda:0 --decode-device cuda:1 for disagg (KV GPU to GPU),
  and --colocated 2 --colocated-device cuda:0,cuda:1 (a worker on each GPU),
  and --planner-workers 2 --planner-devices cuda:0,cuda:1 for planner.
On four: --gpus cuda:0,cuda:1,cuda:2,cuda:3 --modes disagg:3x1,disagg:2x2,
  disagg:1x3,colocated,planner --colocated 4 --colocated-device (the list)
  --planner-workers 4 --planner-devices (the list).

Standard library only. Prints one JSON document; each sweep's JSON (every
request) and plot data go to --out. Usage:
  distserve.py --bin DIR --model PATH --out DIR [--device cuda] [--workloads chat,summary]
               [--modes disagg,colocated] [--colocated 1] [--prefill-device D] [--decode-device D]
               [--colocated-device D[,D]] [--planner-workers N] [--planner-devices D[,D...]] [--gpus D,D,...]
               [--rates WORKLOAD=R1,R2,...]... [--requests WORKLOAD=N]... [--smoke]
"""
import argparse
import json
import os
import random
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import disagg_gpu as dg  # noqa: E402

WORKLOADS = {  # prompt tokens (uniform), answer tokens, requests, rates, SLO multiples (TTFT, TPOT)
    "chat": dict(lo=64, hi=512, out=200, n=64, rates="2,4,8,16,32", ttft_x=5, tpot_x=2),
    "summary": dict(lo=1536, hi=3072, out=32, n=32, rates="0.5,1,2,4,8", ttft_x=5, tpot_x=5),
    # every 4th request a summary document, the rest chat: the SLOs from a document alone (TTFT) and a chat alone
    "mixed": dict(mix=("summary", "chat", "chat", "chat"), n=64, rates="2,4,8,16,32", ttft_x=5, tpot_x=3),
}


def shape(w, i=0):
    """The prompt lengths and answer of a workload's i-th request (a mixed workload's by its turn)."""
    return WORKLOADS[w["mix"][i % len(w["mix"])]] if "mix" in w else w


def prompts_file(out, name, w):
    rnd = random.Random(name)
    path = os.path.join(out, "prompts-%s.jsonl" % name)
    with open(path, "w") as f:
        for i in range(w["n"]):
            s = shape(w, i)
            f.write(json.dumps({"prompt": "%d" % (10000 + i) + " a" * rnd.randint(s["lo"], s["hi"]),
                                "max_tokens": s["out"]}) + "\n")
    return path


def ways(path):
    """A bench JSON's requests by the way their first token went: local (prefilled by their decode worker),
    pair (by a prefill worker), and how many of the pair's first tokens went to the client early."""
    b = json.load(open(path))
    out = {}
    for run in b.get("runs", []):
        qs = run.get("requests", [])
        pair = [q for q in qs if q.get("prefill_worker", "").startswith("prefill")]
        out[str(run.get("rate"))] = {"local": sum(q.get("prefill_worker") and q.get("prefill_worker") ==
                                                  q.get("decode_worker") for q in qs), "pair": len(pair),
                                     "first_token_early": sum(q.get("first_token_path", {}).get("first_token_early",
                                                                                               False) for q in pair)}
    return out


def planner_ops(path, slo, n):
    """The ops file of the planner mode: the workload's SLOs, auto with choose_mode over n workers."""
    with open(path, "w") as f:
        f.write("slo: {ttft_ms: %g, tpot_ms: %g, attainment: 0.9}\nplanner: {interval_s: 1, hold_s: 5, cooldown_s: 10}\n"
                "models:\n  - {name: \"*\", policy: auto, prefill: 1, decode: %d, min_prefill: 1, max_prefill: %d, "
                "min_decode: 1, max_decode: %d, choose_mode: true}\n" % (slo["ttft_ms"], slo["tpot_ms"], n - 1,
                                                                         max(1, n - 1), n))


def health(a, ep):
    """The router's Health detail (tandem health prints SERVING or NOT_SERVING, then it)."""
    r = subprocess.run([a.bin + "/tandem", "health", "--endpoint", ep], capture_output=True, text=True, timeout=30)
    try:
        return json.loads(r.stdout.partition(" ")[2])
    except ValueError:
        return {}


def main():
    ap = argparse.ArgumentParser()
    dg.base_args(ap)
    ap.add_argument("--workloads", default="chat,summary,mixed")
    ap.add_argument("--modes", default="disagg,colocated,auto")
    ap.add_argument("--colocated", type=int, default=1)
    ap.add_argument("--prefill-device", default="", help="disagg: the prefill worker's (default --device)")
    ap.add_argument("--decode-device", default="", help="disagg: the decode worker's (default --device)")
    ap.add_argument("--colocated-device", default="",
                    help="colocated: the workers' device or list, one each in turn (default --device)")
    ap.add_argument("--planner-workers", type=int, default=2, help="planner: the workers the planner shares out")
    ap.add_argument("--planner-devices", default="", help="planner: their devices (default --device for each)")
    ap.add_argument("--gpus", default="", help="disagg:PxD and auto:PxD: the devices, the prefill workers' first "
                    "(default --device for each)")
    ap.add_argument("--kv-mib", type=int, default=16384)
    ap.add_argument("--prefill-kv-mib", type=int, default=8192)
    ap.add_argument("--prefill-budget", type=int, default=4096, help="the prefill worker's token budget")
    ap.add_argument("--decode-budget", type=int, default=2048,
                    help="the decode workers' token budget: a colocated worker's prompt chunks")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rates", action="append", default=[], metavar="WORKLOAD=R1,R2,...",
                    help="the sweep's rates for one workload (repeatable; default: the table above)")
    ap.add_argument("--requests", action="append", default=[], metavar="WORKLOAD=N",
                    help="requests a rate for one workload (repeatable)")
    ap.add_argument("--smoke", action="store_true", help="a run of minutes on a CPU: prompts and answers / 8, "
                    "8 requests, rates 1 and 2 (to try the script, not to measure)")
    a = ap.parse_args()
    modes = []  # (mode, kind, prefill workers, decode workers); disagg:3x1: 3 prefill and 1 decode workers on --gpus
    for mode in [x for x in a.modes.split(",") if x]:
        kind, _, form = mode.partition(":")
        m = re.fullmatch(r"([1-9]\d*)x([1-9]\d*)", form)
        if kind not in ("disagg", "colocated", "auto", "planner") or (form and (not m or kind not in ("disagg", "auto"))):
            ap.error("--modes %s: want disagg, colocated, auto, planner, disagg:PxD or auto:PxD" % mode)
        modes.append((mode, kind, int(m[1]) if m else 1, int(m[2]) if m else 1))
    if a.smoke:
        for w in WORKLOADS.values():
            if "mix" not in w:
                w.update(lo=w["lo"] // 8, hi=w["hi"] // 8, out=w["out"] // 8)
            w.update(n=8, rates="1,2")
    for key, opt in (("rates", a.rates), ("n", a.requests)):
        for o in opt:
            name, _, v = o.partition("=")
            if name not in WORKLOADS or not v:
                ap.error("--%s %s: want WORKLOAD=VALUE, WORKLOAD one of %s" % (
                    "rates" if key == "rates" else "requests", o, ",".join(WORKLOADS)))
            WORKLOADS[name][key] = v if key == "rates" else int(v)
    os.makedirs(a.out, exist_ok=True)
    # what disagg_gpu's helpers read
    a.token_budget, a.kvstores, a.kvstore_mib, a.transport = a.prefill_budget, 0, 1024, "auto"
    workloads = [w for w in a.workloads.split(",") if w]
    devices = {"prefill": a.prefill_device or a.device, "decode": a.decode_device or a.device,
               "colocated": a.colocated_device or a.device}
    res = {"model": a.model, "devices": devices, "budgets": {"prefill": a.prefill_budget, "decode": a.decode_budget},
           "workloads": {}}
    files = {}
    alone = {}

    def single(kind):
        """One request of a (plain) workload's median prompt alone, in one process: TTFT and TPOT."""
        if kind not in alone:
            s = WORKLOADS[kind]
            p = "7" + " a" * ((s["lo"] + s["hi"]) // 2)
            dg.single(a, p, 8)  # the first run warms the GPU up
            _, ttft, tpot = dg.single(a, p, 64)
            alone[kind] = {"prompt_tokens": (s["lo"] + s["hi"]) // 2, "ttft_ms": ttft, "tpot_ms": tpot}
        return alone[kind]
    for name in workloads:
        w = WORKLOADS[name]
        files[name] = prompts_file(a.out, name, w)
        # the SLOs' base: a mixed workload's TTFT from its longest kind's request alone, TPOT from its shortest's
        kinds = sorted(set(w.get("mix", (name,))), key=lambda k: WORKLOADS[k]["hi"])
        t_base, p_base = single(kinds[-1]), single(kinds[0])
        slo = {"ttft_ms": round(w["ttft_x"] * t_base["ttft_ms"], 1), "tpot_ms": round(w["tpot_x"] * p_base["tpot_ms"], 2)}
        res["workloads"][name] = {"alone": {k: single(k) for k in kinds}, "slo": slo, "modes": {}}
        print(name, "alone", res["workloads"][name], file=sys.stderr, flush=True)
    pdevs = (a.planner_devices or ",".join([a.device] * a.planner_workers)).split(",")
    if a.planner_workers < 2 or len(pdevs) != a.planner_workers:
        ap.error("--planner-workers %d with --planner-devices naming %d: want 2 or more, a device each" %
                 (a.planner_workers, len(pdevs)))
    for mode, kind, np_, nd in modes:
        form = mode != kind
        tag = mode.replace(":", "-")  # file names: disagg-3x1
        log_path = os.path.join(a.out, "cluster-%s.log" % tag)
        extra = ["--colocated", str(a.colocated)] if kind == "colocated" else \
            ["--prefill", str(np_), "--decode", str(nd)]
        if kind == "disagg":  # every prompt to the prefill worker (the default lets the decode worker take some)
            extra += ["--worker-arg", "--colocated", "--worker-arg", "false"]
        a.prefill_device = devices["prefill"]
        a.decode_device = devices["colocated" if kind == "colocated" else "decode"]
        if form:
            gpus = (a.gpus or ",".join([a.device] * (np_ + nd))).split(",")
            if len(gpus) < np_ + nd:
                ap.error("--modes %s: --gpus names %d devices, %d wanted" % (mode, len(gpus), np_ + nd))
            a.prefill_device, a.decode_device = ",".join(gpus[:np_]), ",".join(gpus[np_:np_ + nd])
        if mode == "planner":
            a.prefill_device, a.decode_device = ",".join(pdevs), ",".join(reversed(pdevs))
            extra = ["--prefill", "1", "--decode", str(a.planner_workers - 1)]
        up, ep = dg.start_cluster(a, log_path, extra=extra, decode_budget=a.decode_budget)
        try:
            admin = re.search(r"administrator key \(tandem scale --admin-key\) in (\S+)", open(log_path).read())
            for name in workloads:
                w, slo = WORKLOADS[name], res["workloads"][name]["slo"]
                if mode == "planner":
                    ops = os.path.join(a.out, "ops-%s.yaml" % name)
                    planner_ops(ops, slo, a.planner_workers)
                    r = subprocess.run([a.bin + "/tandem", "scale", "--endpoint", ep, "--apply", ops] +
                                       (["--admin-key", admin.group(1)] if admin else []),
                                       capture_output=True, text=True, timeout=60)
                    if r.returncode:
                        raise RuntimeError("tandem scale --apply %s: %s" % (ops, r.stderr.strip()[-500:]))
                for k in range(3):  # warm-up (captured decode steps, the allocator) before anything is timed
                    dg.remote(a, ep, "%d" % (900 + k) + " a" * shape(w)["hi"], 16)
                out = os.path.join(a.out, "bench-%s-%s.json" % (name, tag))
                r = subprocess.run([a.bin + "/tandem", "bench", "--endpoint", ep, "--api", "grpc", "--output", out,
                                    "--sweep", w["rates"], "--num-requests", str(w["n"]), "--ignore-eos",
                                    "--timeout", "120", "--goodput", "ttft:%g,tpot:%g" % (slo["ttft_ms"],
                                                                                          slo["tpot_ms"]),
                                    "--slo-scale", "0.5,1,2,4", "--workload", "prompts", files[name]],
                                   capture_output=True, text=True, timeout=560)
                got = {"bench_exit": r.returncode, "tail": (r.stdout + r.stderr)[-1500:]}
                if os.path.exists(out):
                    b = json.load(open(out))
                    got.update(goodput=b.get("goodput"), bounded=b.get("goodput_bounded"),
                               curve=b.get("attainment_curve"), ways=ways(out))
                if mode == "planner":  # where it went, and why (the last decision's reason)
                    h = health(a, ep)
                    got["planner"] = {"workers": [h.get("prefill_workers"), h.get("decode_workers")],
                                      "desired": h.get("planner", {}).get("desired"),
                                      "verdict": h.get("planner", {}).get("verdict")}
                res["workloads"][name]["modes"][mode] = got
                print(name, mode, "goodput", got.get("goodput"), file=sys.stderr, flush=True)
        finally:
            dg.stop_cluster(up, log_path)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
