#!/usr/bin/env python3
"""Many concurrent Generate streams through one router: N streams (grpcio
asyncio client, short prompts, 32 tokens each, greedy) opened at once against
a `tandem up` cluster; every output is compared with single-process `tandem
generate`. While they run, the router's thread count and RSS are sampled from
/proc (the peak is reported). Then the router's own overhead, one request at
a time: the p50/p99 of its per-request work as the Health RPC reports it.

Usage: bench/streams.py BUILD_BIN_DIR [--streams 2000] [--tokens 32] [--serial 200]"""
import argparse
import asyncio
import json
import os
import sys
import tempfile
import threading
import time

sys.argv, _argv = sys.argv[:2], sys.argv
sys.path.insert(0, os.path.join(os.getcwd(), "tests", "integration"))
import test_cluster as tc  # noqa: E402
import grpc  # noqa: E402

sys.argv = _argv


router_pid, proc_status = tc.router_pid, tc.proc_status  # the suite's, shared


class PeakSampler:
    """Samples a process's thread count and RSS every 0.2 s from a thread; .peak is the largest seen."""

    def __init__(self, pid):
        self.pid, self.peak, self.stop = pid, list(proc_status(pid)), threading.Event()
        self.t = threading.Thread(target=self.run, daemon=True)
        self.t.start()

    def run(self):
        while not self.stop.is_set():
            try:
                th, rss = proc_status(self.pid)
                self.peak = [max(self.peak[0], th), max(self.peak[1], rss)]
            except OSError:
                pass
            time.sleep(0.2)

    def done(self):
        self.stop.set()
        self.t.join()
        return self.peak


def pin(c):
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        sys.exit("--pin-router needs at least 2 CPUs")
    rp = router_pid(c)
    for pid in c.pids() + [os.getpid()]:
        mask = {cpus[0]} if pid == rp else set(cpus[1:])
        for t in os.listdir("/proc/%d/task" % pid):
            try:
                os.sched_setaffinity(int(t), mask)
            except OSError:
                pass
    print("router (pid %d) pinned to CPU %d; the rest of the cluster and the client to %s" %
          (rp, cpus[0], cpus[1:]))


async def all_streams(endpoint, prompts, n, tokens, deadline):
    async with grpc.aio.insecure_channel(endpoint, options=[("grpc.max_concurrent_streams", 1 << 20)]) as ch:
        stub = tc.pbg.TandemStub(ch)

        async def one(i):
            p = prompts[i % len(prompts)]
            rq = tc.pb.GenerateRequest(prompt=p, return_token_ids=True,
                                       sampling=tc.pb.SamplingParams(max_tokens=tokens, ignore_eos=True))
            ids = []
            try:
                async for r in stub.Generate(rq, timeout=deadline):
                    ids.extend(r.token_ids)
                return p, ids, None
            except grpc.aio.AioRpcError as e:
                return p, ids, "%s: %s" % (e.code().name, e.details())
        return await asyncio.gather(*(one(i) for i in range(n)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bin")
    ap.add_argument("--streams", type=int, default=2000)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--serial", type=int, default=300)
    ap.add_argument("--serial-prompt", default="Hi")
    ap.add_argument("--serial-tokens", type=int, default=2)
    ap.add_argument("--plaintext", action="store_true",
                    help="run the cluster with cluster.plaintext: true (no mutual TLS on the internal planes), "
                         "to measure what TLS costs")
    ap.add_argument("--pin-router", action="store_true",
                    help="before the serial requests, pin the router to CPU 0 and every other process of the "
                         "cluster and this client to the other CPUs (tells the router's work from contention "
                         "for shared cores)")
    a = ap.parse_args()
    prompts = tc.PROMPTS
    refs = {p: tc.reference(p, a.tokens) for p in prompts}
    cfg = None
    if a.plaintext:
        cfg = tempfile.mktemp(prefix="tandem-plain-", suffix=".yaml")
        with open(cfg, "w") as f:
            f.write("cluster:\n  plaintext: true\n")
    c = tc.Cluster(config=cfg)
    try:
        tc.wait_for(lambda: c.health()[0], 60)
        if a.pin_router:
            pin(c)
        # first, one request at a time: the router's own work per request (Health reports its quantiles
        # over its last 4096 requests, so this comes before the concurrent ones)
        ttft, tpot = [], []
        for i in range(a.serial):  # as bench/results/disagg-2026-11-21.md measured it: "Hi", 2 tokens
            _, last = tc.generate(c.stub, a.serial_prompt, max_tokens=a.serial_tokens)
            ttft.append(last.timing.ttft_ms)
            tpot.append(last.timing.tpot_ms)
        ok, detail = c.health()
        serial = {k: v for k, v in detail.items() if "overhead" in k or "handoff" in k}
        rp = router_pid(c)
        t0_threads, t0_rss = proc_status(rp)
        sampler = PeakSampler(rp)
        t0 = time.time()
        res = asyncio.run(all_streams(c.endpoint, prompts, a.streams, a.tokens, 900)) if a.streams else []
        secs = time.time() - t0
        peak = sampler.done()
        same = sum(1 for p, ids, err in res if err is None and ids == refs[p])
        errs = {}
        for p, ids, err in res:
            if err:
                errs[err[:90]] = errs.get(err[:90], 0) + 1
        if a.streams:
            print("%d concurrent streams of %d tokens: %d/%d identical to single-process, %d errors %s, %.1f s "
                  "(%.0f tokens/s)" % (a.streams, a.tokens, same, a.streams, sum(errs.values()), errs or "",
                                       secs, a.streams * a.tokens / secs))
            print("router: %d threads and %.0f MiB RSS idle; at the peak %d threads and %.0f MiB RSS" %
                  (t0_threads, t0_rss, peak[0], peak[1]))
        print("router overhead, %d requests of %r, %d tokens, one at a time (its Health detail): %s" %
              (a.serial, a.serial_prompt, a.serial_tokens, json.dumps(serial)))
        q = lambda v, p: sorted(v)[min(len(v) - 1, int(p * len(v)))] if v else 0.0  # noqa: E731
        print("the same requests' TTFT p50 %.2f p99 %.2f ms, TPOT p50 %.2f p99 %.2f ms (the router's timing)" %
              (q(ttft, 0.5), q(ttft, 0.99), q(tpot, 0.5), q(tpot, 0.99)))
    finally:
        c.stop()


if __name__ == "__main__":
    main()
