#!/usr/bin/env python3
"""Disaggregated vs single-process: TTFT and TPOT for 128, 512 and 2,048-token
prompts, the share of KV transfer time hidden behind prefill compute, and the
router's own time per request. Starts a cluster with `tandem up` (1 prefill +
1 decode worker, THREADS compute threads each) and runs `tandem generate` in
one process (THREADS threads) on the same prompts; then the router's own
time per request in a second cluster. Prints a JSON document.
Usage: bench/disagg.py BUILD_BIN_DIR [THREADS] (needs grpcio, grpcio-tools)."""
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import grpc
from grpc_tools import protoc

ROOT = os.getcwd()
BIN = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else "build/bin")
THREADS = sys.argv[2] if len(sys.argv) > 2 else "1"
MODEL = os.path.join(ROOT, "models/SmolLM2-135M-Instruct.Q4_1.gguf")
GEN = 32
REPS = 3

out = tempfile.mkdtemp(prefix="tandem-stubs-")
for p in ["tandem/v1/tandem.proto", "tandem/internal/v1/worker.proto"]:
    protoc.main(["protoc", "-I" + os.path.join(ROOT, "proto"), "--python_out=" + out, "--grpc_python_out=" + out, p])
sys.path.insert(0, out)
from tandem.v1 import tandem_pb2 as pb  # noqa: E402
from tandem.v1 import tandem_pb2_grpc as pbg  # noqa: E402
from tandem.internal.v1 import worker_pb2 as wpb  # noqa: E402
from tandem.internal.v1 import worker_pb2_grpc as wpbg  # noqa: E402


def prompt_of(n, rep=0):
    # " a" repeated is one token per word for this tokenizer; BOS adds one. A
    # different first word per repetition keeps the prefix cache out of it.
    return ["a", "b", "c", "d", "e", "f"][rep] + " a" * (n - 2)


def single(n):
    r = subprocess.run(["timeout", "300", BIN + "/tandem", "generate", "--model", MODEL, "--threads", THREADS,
                        "--max-tokens", str(GEN), "--ignore-eos", prompt_of(n)], capture_output=True, text=True)
    m = re.search(r"TTFT ([\d.]+) ms", r.stderr)
    d = re.search(r"= ([\d.]+) tok/s", r.stderr)
    return float(m.group(1)), 1000.0 / float(d.group(1)), r.stderr


def start_cluster():
    err = open(tempfile.mktemp(prefix="tandem-up-"), "a+")  # append: the children share our offset
    up = subprocess.Popen([BIN + "/tandem", "up", "--model", MODEL, "--worker-arg", "--threads", "--worker-arg",
                           THREADS], stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
    ep = up.stdout.readline().strip()
    err.seek(0)
    log = err.read()
    etcd = re.search(r"etcd on (\S+),", log).group(1)
    certs = re.search(r"certificates in (\S+) ", log).group(1)  # the internal planes' mutual TLS
    return up, ep, etcd, certs


def router_overhead():
    """The router's own time per request (parse, tokenize, place, pack, relay),
    from its Health detail, in a fresh cluster: 300 requests one at a time,
    then 4,096 from 8 concurrent clients (the router keeps the last 4,096)."""
    up, ep, _ = start_cluster()
    stub = pbg.TandemStub(grpc.insecure_channel(ep))
    rq = pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingParams(max_tokens=2))
    out = {}
    try:
        for _ in range(300):
            list(stub.Generate(rq, timeout=60))
        out["sequential_300"] = json.loads(stub.Health(pb.HealthRequest(), timeout=5).detail)

        def client():
            for _ in range(512):
                list(stub.Generate(rq, timeout=60))
        ts = [threading.Thread(target=client) for _ in range(8)]
        t0 = time.time()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        out["concurrent_8x512"] = json.loads(stub.Health(pb.HealthRequest(), timeout=5).detail)
        out["concurrent_8x512"]["requests_per_s"] = 4096 / (time.time() - t0)
    finally:
        os.killpg(up.pid, signal.SIGTERM)
        up.wait(60)
    return out


def main():
    up, ep, etcd, certs = start_cluster()
    stub = pbg.TandemStub(grpc.insecure_channel(ep))
    res = {"threads_per_process": int(THREADS), "generated_tokens": GEN, "prompts": {}}
    try:
        for n in (128, 512, 2048):
            ttft, tpot, ttft_c, n_prompt = [], [], [], 0
            for rep in range(REPS):
                t0 = time.time()
                first = None
                last = None
                for r in stub.Generate(pb.GenerateRequest(prompt=prompt_of(n, rep), sampling=pb.SamplingParams(
                        max_tokens=GEN, ignore_eos=True)), timeout=300):
                    if first is None and r.text:
                        first = time.time() - t0
                    last = r
                ttft.append(last.timing.ttft_ms)
                tpot.append(last.timing.tpot_ms)
                ttft_c.append(first * 1e3)
                n_prompt = last.usage.prompt_tokens
            s = [single(n) for rep in range(REPS)]
            res["prompts"][str(n)] = {
                "prompt_tokens": n_prompt,
                "disagg_ttft_ms": statistics.median(ttft), "disagg_ttft_client_ms": statistics.median(ttft_c),
                "disagg_tpot_ms": statistics.median(tpot),
                "single_ttft_ms": statistics.median(x[0] for x in s),
                "single_tpot_ms": statistics.median(x[1] for x in s),
            }
            print(n, res["prompts"][str(n)], file=sys.stderr, flush=True)
        envv = dict(os.environ, ETCDCTL_API="3")
        recs = subprocess.run(["etcdctl", "--endpoints", "https://" + etcd, "--cacert", certs + "/ca.pem",
                               "--cert", certs + "/client.pem", "--key", certs + "/client.key",
                               "get", "--prefix", "/tandem/workers/prefill",
                               "--print-value-only"], capture_output=True, text=True, env=envv).stdout
        pw = json.loads([l for l in recs.splitlines() if l.startswith("{")][0])
        rd = lambda n: open(os.path.join(certs, n), "rb").read()  # noqa: E731
        creds = grpc.ssl_channel_credentials(rd("ca.pem"), rd("client.key"), rd("client.pem"))
        st = wpbg.PrefillStub(grpc.secure_channel(pw["addr"], creds)).Stats(wpb.StatsRequest(), timeout=5)
        res["kv_transfer"] = {
            "bytes": st.transfer_bytes, "pusher_busy_ms": st.transfer_ms, "exposed_ms": st.exposed_transfer_ms,
            "hidden_share": 1 - st.exposed_transfer_ms / st.transfer_ms if st.transfer_ms else None,
            "put_gbs_while_computing": st.transfer_bytes / (st.transfer_ms / 1e3) / 1e9 if st.transfer_ms else None,
        }
    finally:
        os.killpg(up.pid, signal.SIGTERM)
        up.wait(60)
    res["router"] = router_overhead()
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
