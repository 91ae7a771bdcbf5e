#!/usr/bin/env python3
"""TTFT against the length of the prefix the KV store supplies (0 ... 4k tokens).

Starts `tandem up --kvstores 1` (1 prefill + 1 decode worker, THREADS compute
threads each). For each prefix length L: a prompt of L prefix tokens + a short
question is served cold (its blocks are published to the store); the prefill
worker is then killed (tandem up starts it again, with an empty pool) and the
same prefix + another question is served: its prefix comes from the store. The
same prompt once more is served from the worker's own pool. Prints a JSON
document: per L, TTFT cold / from the store / from the pool, and the tokens the
store and the cache supplied.
Usage: bench/kvstore_ttft.py BUILD_BIN_DIR [THREADS] (needs grpcio, grpcio-tools)."""
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import grpc
from grpc_tools import protoc

ROOT = os.getcwd()
BIN = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else "build/bin")
THREADS = sys.argv[2] if len(sys.argv) > 2 else "1"
MODEL = os.path.join(ROOT, "models/SmolLM2-135M-Instruct.Q4_1.gguf")
LENGTHS = [0, 256, 512, 1024, 2048, 4096]

out = tempfile.mkdtemp(prefix="tandem-stubs-")
protoc.main(["protoc", "-I" + os.path.join(ROOT, "proto"), "--python_out=" + out, "--grpc_python_out=" + out,
             "tandem/v1/tandem.proto"])
sys.path.insert(0, out)
from tandem.v1 import tandem_pb2 as pb  # noqa: E402
from tandem.v1 import tandem_pb2_grpc as pbg  # noqa: E402


def prefix_of(n, tag):
    # " a" is one token per word for this tokenizer; the tag word keeps each length's prefix its own
    return "" if n == 0 else tag + " a" * (n - 1)


def ask(stub, prompt):
    last = None
    t0 = time.time()
    for r in stub.Generate(pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(max_tokens=4)), timeout=600):
        last = r
    return {"ttft_ms": last.timing.ttft_ms, "cached": last.usage.cached_prompt_tokens,
            "from_store": last.usage.store_cached_tokens, "prompt_tokens": last.usage.prompt_tokens,
            "wall_s": round(time.time() - t0, 2)}


def prefill_pids():
    r = subprocess.run(["pgrep", "-f", BIN + "/tandem-prefill"], capture_output=True, text=True)
    return [int(p) for p in r.stdout.split()]


def workers(stub):
    return json.loads(stub.Health(pb.HealthRequest(), timeout=10).detail)["prefill_workers"]


def restart_prefill(stub):
    old = prefill_pids()
    for p in old:
        os.kill(p, signal.SIGKILL)
    end = time.time() + 60
    while time.time() < end and workers(stub) > 0:  # the dead worker's etcd record expires
        time.sleep(0.2)
    while time.time() < end and not (workers(stub) == 1 and set(prefill_pids()) - set(old)):
        time.sleep(0.2)


def main():
    err = open(tempfile.mktemp(prefix="tandem-up-"), "a+")  # append: the children share our offset
    up = subprocess.Popen([BIN + "/tandem", "up", "--model", MODEL, "--kvstores", "1", "--worker-arg", "--threads",
                           "--worker-arg", THREADS, "--worker-arg", "--kv-mib", "--worker-arg", "256"],
                          stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
    ep = up.stdout.readline().strip()
    stub = pbg.TandemStub(grpc.insecure_channel(ep))
    res = {"date": time.strftime("%Y-%m-%d"), "machine": os.uname().nodename, "cores": os.cpu_count(),
           "threads_per_worker": int(THREADS), "lengths": {}}
    try:
        for i, n in enumerate(LENGTHS):
            tag = "w%d" % i
            row = {"cold": ask(stub, prefix_of(n, tag) + " Question one: what is it?")}
            time.sleep(1)  # write-behind publishing
            restart_prefill(stub)
            row["store"] = ask(stub, prefix_of(n, tag) + " Question two: where is it?")
            row["pool"] = ask(stub, prefix_of(n, tag) + " Question three: who is it?")
            res["lengths"][str(n)] = row
            print(n, json.dumps(row), file=sys.stderr, flush=True)
    finally:
        os.killpg(up.pid, signal.SIGTERM)
        up.wait(60)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
