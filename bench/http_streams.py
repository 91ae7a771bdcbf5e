#!/usr/bin/env python3
"""Many concurrent SSE streams through the router's OpenAI HTTP API: N
streaming /v1/completions requests (greedy, short prompts, 32 tokens each)
opened at once from one asyncio client over plain HTTP/1.1 connections (one
per stream), each stream's text compared with the gRPC API's for the same
prompt; the router's threads and RSS sampled from /proc (peak reported).
Then one request at a time ("Hi", 2 tokens), alternating between gRPC and
HTTP on the same cluster: the client-side latency of each, p50/p99.

Usage: bench/http_streams.py BUILD_BIN_DIR [--streams 2000] [--tokens 32] [--serial 200]"""
import argparse
import asyncio
import json
import os
import re
import resource
import socket
import sys
import time

sys.argv, _argv = sys.argv[:2], sys.argv
sys.path.insert(0, os.path.join(os.getcwd(), "tests", "integration"))
sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
import test_cluster as tc  # noqa: E402
import streams  # noqa: E402  (router_pid, proc_status)

sys.argv = _argv


def request_bytes(model, prompt, tokens, stream=True):
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
                       "ignore_eos": True, "stream": stream}).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nHost: tandem\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def dechunk(raw):
    """The body of an HTTP/1.1 response in chunked transfer encoding."""
    body = raw.partition(b"\r\n\r\n")[2]
    out = b""
    while body:
        size_line, _, rest = body.partition(b"\r\n")
        n = int(size_line.split(b";")[0] or b"0", 16)
        if n == 0:
            break
        out += rest[:n]
        body = rest[n + 2:]
    return out


def sse_text(raw):
    """The text of an SSE completion stream."""
    text, done = "", False
    for m in re.finditer(rb"data: (.*?)\n\n", dechunk(raw), re.S):
        payload = m.group(1)
        if payload == b"[DONE]":
            done = True
            continue
        ch = json.loads(payload)
        if "error" in ch:
            return None, ch["error"]["message"]
        text += "".join(c.get("text", "") for c in ch.get("choices", []))
    return (text, None) if done else (None, "no [DONE]")


async def one_stream(host, port, req, deadline):
    try:
        r, w = await asyncio.wait_for(asyncio.open_connection(host, port), deadline)
        w.write(req)
        await w.drain()
        raw = b""
        while b"data: [DONE]" not in raw:
            more = await asyncio.wait_for(r.read(65536), deadline)
            if not more:
                break
            raw += more
        w.close()
        head = raw.split(b"\r\n", 1)[0]
        if not head.startswith(b"HTTP/1.1 200"):
            return None, head.decode(errors="replace")
        return sse_text(raw)
    except (OSError, asyncio.TimeoutError) as e:
        return None, repr(e)


async def all_streams(host, port, model, prompts, n, tokens):
    return await asyncio.gather(*(one_stream(host, port, request_bytes(model, prompts[i % len(prompts)], tokens),
                                             900) for i in range(n)))


def q(v, p):
    v = sorted(v)
    return v[min(len(v) - 1, int(p * len(v)))] * 1e3 if v else 0.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bin")
    ap.add_argument("--streams", type=int, default=2000)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--serial", type=int, default=200)
    a = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # one connection per stream, here and in the router
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    c = tc.Cluster()
    try:
        tc.wait_for(lambda: c.health()[0], 60)
        c.err.seek(0)
        host, port = re.search(r"HTTP API at http://(\S+)/v1", c.err.read()).group(1).rsplit(":", 1)
        port = int(port)
        model = c.stub.ListModels(tc.pb.ListModelsRequest(), timeout=10).models[0].id
        prompts = tc.PROMPTS
        refs = {}
        for p in prompts:
            rq = tc.pb.GenerateRequest(prompt=p, sampling=tc.pb.SamplingParams(max_tokens=a.tokens, ignore_eos=True))
            refs[p] = "".join(r.text for r in c.stub.Generate(rq, timeout=120))

        # one request at a time, alternating blocks of gRPC and HTTP (one keep-alive connection)
        lat = {"grpc": [], "http": []}
        s = socket.create_connection((host, port))
        req = request_bytes(model, "Hi", 2, stream=False)
        for block in range(4):
            for _ in range(a.serial // 4):
                t0 = time.perf_counter()
                tc.generate(c.stub, "Hi", max_tokens=2)
                lat["grpc"].append(time.perf_counter() - t0)
            for _ in range(a.serial // 4):
                t0 = time.perf_counter()
                s.sendall(req)
                raw = b""
                while True:
                    raw += s.recv(65536)
                    head, _, body = raw.partition(b"\r\n\r\n")
                    m = re.search(rb"Content-Length: (\d+)", head)
                    if m and len(body) >= int(m.group(1)):
                        break
                lat["http"].append(time.perf_counter() - t0)
        s.close()
        print("one request at a time (\"Hi\", 2 tokens, %d each, alternating blocks), client-side latency: "
              "gRPC p50 %.2f p99 %.2f ms; HTTP p50 %.2f p99 %.2f ms" %
              (len(lat["grpc"]), q(lat["grpc"], 0.5), q(lat["grpc"], 0.99), q(lat["http"], 0.5),
               q(lat["http"], 0.99)))

        rp = streams.router_pid(c)
        t0_threads, t0_rss = streams.proc_status(rp)
        sampler = streams.PeakSampler(rp)
        t0 = time.time()
        res = asyncio.run(all_streams(host, port, model, prompts, a.streams, a.tokens))
        secs = time.time() - t0
        peak = sampler.done()
        same = sum(1 for i, (text, err) in enumerate(res) if err is None and text == refs[prompts[i % len(prompts)]])
        errs = {}
        for text, err in res:
            if err:
                errs[err[:90]] = errs.get(err[:90], 0) + 1
        time.sleep(2)
        idle_threads, idle_rss = streams.proc_status(rp)
        print("%d concurrent SSE streams of %d tokens: %d/%d identical to the gRPC API's text, %d errors %s, %.1f s "
              "(%.0f tokens/s)" % (a.streams, a.tokens, same, a.streams, sum(errs.values()), errs or "", secs,
                                   a.streams * a.tokens / secs))
        print("router: %d threads and %.0f MiB RSS before; at the peak %d threads and %.0f MiB RSS; 2 s after, "
              "%d threads and %.0f MiB" % (t0_threads, t0_rss, peak[0], peak[1], idle_threads, idle_rss))
    finally:
        c.stop()


if __name__ == "__main__":
    main()
