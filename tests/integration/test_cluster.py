#!/usr/bin/env python3
"""Integration suite: a real local cluster started with `tandem up` (etcd, the
router, a prefill and a decode worker, the default model on CPU), driven by a
Python gRPC client (grpcio from PyPI) whose stubs are generated here from our
.proto files. Single-process `tandem generate` is the reference output.

One cluster serves the tests from greedy output to the router's kill -9, in this order (the later ones kill its
processes); others start their own. Run with pytest (tests/conftest.py says how)."""
import collections
import glob
import json
import os
import re
import signal
import ssl
import subprocess
import tempfile
import threading
import time

import grpc
import pytest

from harness import (BIN, MAX_TOKENS, MODEL, PAIRS_ONLY, PROMPTS, SEEDED, Cluster, check, generate, pb, pbg,
                     proc_state, reference, reference_text, wait_for, wpb, wpbg)


def tls_cluster(refs):
    """The public API over TLS: `tandem up` with router.tls_cert/tls_key in its
    config (a self-signed certificate made here by openssl)."""
    d = tempfile.mkdtemp(prefix="tandem-tls-")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", d + "/key.pem",
                    "-out", d + "/cert.pem"], check=True, capture_output=True)
    with open(d + "/tandem.yaml", "w") as f:
        f.write("router:\n  tls_cert: %s/cert.pem\n  tls_key: %s/key.pem\n" % (d, d))
    cert = open(d + "/cert.pem", "rb").read()
    c = Cluster(d + "/tandem.yaml", grpc.ssl_channel_credentials(root_certificates=cert))
    try:
        ids, _ = generate(c.stub, PROMPTS[0])
        check("TLS: a grpcio client trusting the router's certificate streams a correct generation",
              ids == refs[PROMPTS[0]], "got %s" % ids[:8])
        plain = pbg.TandemStub(grpc.insecure_channel(c.endpoint))
        try:
            generate(plain, PROMPTS[0], timeout=3)
            refused = False
        except grpc.RpcError as e:
            refused = e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        check("TLS: a plaintext client is refused", refused)
        cli = subprocess.run([BIN + "/tandem", "generate", "--endpoint", c.endpoint, "--tls-ca", d + "/cert.pem",
                              "--ids", "--max-tokens", str(MAX_TOKENS), "--ignore-eos", PROMPTS[0]],
                             capture_output=True, text=True, timeout=60)
        check("TLS: tandem generate --endpoint --tls-ca streams the same tokens",
              [int(x) for x in cli.stdout.split()] == refs[PROMPTS[0]], cli.stderr[-300:])
        # the OpenAI HTTP API takes the same pair: HTTPS, and plain HTTP is refused
        m = re.search(r"HTTP API at (\S+)/v1", c.log())
        check("TLS: tandem up names the HTTP API as https://", m is not None and m.group(1).startswith("https://"),
              m.group(0) if m else "no HTTP API line")
        if m:
            import openai
            cl = openai.OpenAI(base_url=m.group(1) + "/v1", api_key="unused", max_retries=0, timeout=60,
                               http_client=openai.DefaultHttpxClient(verify=ssl.create_default_context(
                                   cafile=d + "/cert.pem")))
            text = cl.completions.create(model=cl.models.list().data[0].id, prompt=PROMPTS[0], max_tokens=8,
                                         temperature=0).choices[0].text
            check("TLS: the openai client over HTTPS, trusting the router's certificate, gets a completion (%r)" % text,
                  len(text) > 0)
            try:
                plain = openai.OpenAI(base_url=m.group(1).replace("https://", "http://") + "/v1", api_key="unused",
                                      max_retries=0, timeout=10)
                plain.models.list()
                refused = "answered"
            except openai.APIConnectionError as e:
                refused = "refused: %s" % e
            except openai.APIStatusError as e:
                refused = "answered %d" % e.status_code
            check("TLS: plain HTTP to the HTTPS API is refused", refused.startswith("refused"), refused)
    finally:
        check("TLS cluster stops cleanly (exit %s)" % c.stop(), c.p.returncode == 0)


def test_cli_conventions():
    for cmd in ["inspect", "tokenize", "generate", "perplexity", "bench", "up", "health", "config"]:
        r = subprocess.run([BIN + "/tandem", cmd, "--help"], capture_output=True, text=True, timeout=10)
        check("tandem %s --help: usage on stdout, exit 0" % cmd,
              r.returncode == 0 and r.stdout.startswith("usage: tandem " + cmd), "exit %d: %s" % (r.returncode,
                                                                                             (r.stdout + r.stderr)[:200]))
    for prog in ["tandem-router", "tandem-prefill", "tandem-decode", "tandem-kvstore"]:
        r = subprocess.run([BIN + "/" + prog, "--help"], capture_output=True, text=True, timeout=10)
        keys = re.findall(r"^  ([a-z]+\.[a-z_]+) ", r.stdout, re.M)
        check("%s --help: usage and the config keys (%d, with their defaults) on stdout, exit 0" % (prog, len(keys)),
              r.returncode == 0 and r.stdout.startswith("usage: " + prog) and "kvstore.hot_hits" in keys and
              "router.placement" in keys, "exit %d: %s" % (r.returncode, (r.stdout + r.stderr)[:200]))
    r = subprocess.run([BIN + "/tandem", "bench", "--endpoint", "", "--api", "grpc", "--num-requests", "1"],
                       capture_output=True, text=True, timeout=10)
    check("tandem bench --endpoint '' fails at once naming the endpoint (exit %d)" % r.returncode,
          r.returncode == 2 and "--endpoint '' names no host" in r.stderr, r.stderr[-200:])
    # two counts of the same workers: refused at once, naming both, before anything starts
    for args, want in [(["--colocated", "2", "--decode", "1"], "it takes no --decode"),
                       (["--decode", "1", "--colocated", "2"], "it takes no --decode"),
                       (["--colocated", "2", "--prefill", "1"], "it takes no --prefill")]:
        r = subprocess.run([BIN + "/tandem", "up", "--model", MODEL] + args, capture_output=True, text=True,
                           timeout=10)
        check("tandem up %s: refused (exit %d)" % (" ".join(args), r.returncode),
              r.returncode == 2 and want in r.stderr, r.stderr[-200:])
    # the commit is the one the build was configured from (CI configures a fresh clone: HEAD)
    r = subprocess.run([BIN + "/tandem", "--version"], capture_output=True, text=True, timeout=10)
    check("tandem --version names the version and commit (%s)" % r.stdout.strip(),
          r.returncode == 0 and re.match(r"tandem \d+\.\d+\.\d+ \(commit [0-9a-f]{12}\)", r.stdout) is not None,
          r.stdout + r.stderr)


def test_sigkill_up_leaves_nothing():
    """tandem up killed with SIGKILL (no chance to stop its children): every
    child (etcd, router, workers) ends by itself, within a few seconds."""
    c = Cluster()
    kids = [int(p) for p in os.listdir("/proc") if p.isdigit() and proc_state(int(p))[1] == c.p.pid]
    os.kill(c.p.pid, signal.SIGKILL)
    c.p.wait()
    t0 = time.time()
    gone = wait_for(lambda: all(proc_state(k)[0] in (None, "Z") for k in kids), 20)
    left = [k for k in kids if proc_state(k)[0] not in (None, "Z")]
    check("tandem up killed with SIGKILL: its %d children end by themselves (%.1f s; left: %s)" %
          (len(kids), time.time() - t0, left), gone and len(kids) >= 4)
    # they stop together with etcd, their calls to it in flight: none may abort (gRPC 1.51's retry filter did, in
    # about 2 of 5 such stops, on the trailing metadata of a call etcd closed while stopping)
    aborts = [l for l in c.log().splitlines() if "Assertion" in l or "Aborted" in l]
    check("tandem up killed with SIGKILL: no child aborts while stopping (%d)" % len(aborts), not aborts,
          " | ".join(aborts[:3]))
    for k in left:
        os.kill(k, signal.SIGKILL)
    # its run folder (etcd's data, the CA's and every role's key) is left; the next tandem up removes it
    run_dir = os.path.dirname(c.certs) if c.certs else None
    kept = bool(run_dir) and os.path.isdir(run_dir)
    first_log = c.log()
    c2 = Cluster()
    try:
        profile_cache(first_log, c2.log())
        removed = re.search(r"removed (\d+) run folders? of earlier runs", c2.log())
        check("the next tandem up removes the run folder a SIGKILLed one left (%s: %s before, %s after; it said: %s)" %
              (run_dir, "there" if kept else "absent", "there" if run_dir and os.path.isdir(run_dir) else "gone",
               removed.group(0) if removed else "nothing"),
              kept and removed is not None and not os.path.isdir(run_dir))
    finally:
        c2.stop()


PROFILE_CACHE = tempfile.mkdtemp(prefix="tandem-cache-")


def profile_cache(first, second):
    """The start-up profile is kept in this host's cache (XDG_CACHE_HOME): the
    first cluster's workers measure it, the next cluster's reuse it from the
    file (worker/profile_store.h)."""
    files = sorted(glob.glob(os.path.join(PROFILE_CACHE, "tandem", "profiles", "*.json")))
    measured = re.findall(r"(\S+): profile measured", first)
    reused = re.findall(r"(\S+): profile reused from (\S+) ", second)
    check("the first cluster's workers measure their profiles, kept in %d cache files (%s)" %
          (len(files), [os.path.basename(f) for f in files]),
          len(measured) == 2 and len(files) == 2 and all(json.load(open(f)).get("prefill") for f in files))
    check("the next cluster's workers reuse them from the files (%s)" % reused,
          len(reused) == 2 and sorted(r[1] for r in reused) == files)


def bad_profiles():
    """A cache file that is not a profile is named in a warning and measured over; one measured an hour ago and 5x
    slower than this host (kept in another state of it) fails its check and is measured again; returns the checks
    for the log of the cluster started after."""
    files = sorted(glob.glob(os.path.join(PROFILE_CACHE, "tandem", "profiles", "*prefill*.json")))
    with open(files[0], "w") as f:
        f.write('{"prefill": [1, 2], "decode": "x"')
    slow = sorted(glob.glob(os.path.join(PROFILE_CACHE, "tandem", "profiles", "*decode*.json")))[0]
    good = json.load(open(slow))
    json.dump(dict(good, prefill=[5 * x for x in good["prefill"]], decode=[5 * x for x in good["decode"]],
                   measured_at=time.time() - 3600), open(slow, "w"))  # an hour old: checked before it is reused

    def after(log):
        warned = re.search(r"the cached profile (\S+) is not a profile \(([^)]*)\); measuring it again", log)
        fixed = json.load(open(files[0])).get("prefill")
        check("a corrupt cache file is named in a warning (%s) and measured over (%s)" %
              (warned.group(0) if warned else "no warning", fixed),
              warned is not None and warned.group(1) == files[0] and fixed is not None and len(fixed) == 3)
        stale = re.search(r"the profile from (\S+) is stale here \(a 128-token prefill took ([0-9.]+)x", log)
        now = json.load(open(slow))["prefill"]

        def ms128(c):  # a cold 128-token prefill, as the profile predicts it
            return c[0] + c[1] * 128 + c[2] * 128 * 64
        check("a cache file 5x slower than this host fails its check (%s) and is measured again (a 128-token "
              "prefill predicted at %.0f ms, %.0f ms before the 5x)" % (stale.group(0) if stale else "no such line",
                                                                        ms128(now), ms128(good["prefill"])),
              stale is not None and stale.group(1) == slow and float(stale.group(2)) < 0.5 and
              ms128(now) < 2.5 * ms128(good["prefill"]))
    return after


def two_by_two(refs):
    """A cluster of 2 prefill + 2 decode workers: concurrent requests spread
    over all four, each output identical to single-process. Started on an
    empty profile cache: the sweeps take turns, and the second worker of a
    role reuses the first one's profile."""
    os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="tandem-cache-")
    try:
        c = Cluster(extra=["--prefill", "2", "--decode", "2"] + PAIRS_ONLY)
    finally:
        os.environ["XDG_CACHE_HOME"] = PROFILE_CACHE
    try:
        # a worker registers after its profile: every line is in the log once all four have
        ok = wait_for(lambda: len(c.workers()) == 4 and c.health()[0], 60)
        check("2 prefill + 2 decode workers registered (%d)" % len(c.workers()), ok)
        log = c.log()
        how = {r: [h for w, h in re.findall(r"(%s-\d+): profile (measured|reused from \S+) " % r, log)]
               for r in ("prefill", "decode")}
        # each sweep's interval: its log line's time less the sweep's length
        sweeps = sorted((int(h) * 3600 + int(m) * 60 + float(sec) - float(d), int(h) * 3600 + int(m) * 60 + float(sec))
                        for h, m, sec, d in re.findall(r"T(\d\d):(\d\d):(\d\d\.\d+)Z \S+ +\S+ \S+: profile measured "
                                                       r"\((\d+\.\d+) s sweep\)", log))
        check("on an empty cache, one worker of each role sweeps and the other reuses its file (%s), the sweeps one "
              "after the other (%s)" % (how, ["%.1f-%.1f s" % (a - sweeps[0][0], b - sweeps[0][0]) for a, b in sweeps]
                                        if sweeps else "no sweep logged"),
              all(len(h) == 2 and sum(x == "measured" for x in h) == 1 for h in how.values()) and len(sweeps) == 2
              and sweeps[1][0] >= sweeps[0][1] - 0.1)
        out = {}

        def run(i):
            p = PROMPTS[i % len(PROMPTS)]
            ids, last = generate(c.stub, p)
            out[i] = (p, ids, last.timing.prefill_worker, last.timing.decode_worker)
        ts = [threading.Thread(target=run, args=(i,)) for i in range(12)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(180)
        same = sum(1 for p, ids, _, _ in out.values() if ids == refs[p])
        pws = {o[2] for o in out.values()}
        dws = {o[3] for o in out.values()}
        check("2+2 cluster: %d/12 concurrent requests identical to single-process" % same, same == 12)
        per = collections.Counter(o[2] for o in out.values()) + collections.Counter(o[3] for o in out.values())
        check("2+2 cluster: requests used %d prefill and %d decode workers (%s)" % (len(pws), len(dws), dict(per)),
              len(pws) == 2 and len(dws) == 2, "%s %s" % (pws, dws))
    finally:
        c.stop()

@pytest.fixture(scope="module", autouse=True)
def profile_home():
    """The workers' profile cache: one of this suite's own, empty at its start (test_profile_cache)."""
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = PROFILE_CACHE
    yield PROFILE_CACHE
    if old is None:
        os.environ.pop("XDG_CACHE_HOME")
    else:
        os.environ["XDG_CACHE_HOME"] = old


@pytest.fixture(scope="module")
def refs():
    return {p: reference(p) for p in PROMPTS}


@pytest.fixture(scope="module")
def c():
    """The suite's main cluster. When the profile cache holds the files the SIGKILL test's clusters measured, two
    are spoilt first (bad_profiles) and this cluster's log is kept for test_bad_profiles."""
    spoilt = bad_profiles() if len(glob.glob(os.path.join(PROFILE_CACHE, "tandem", "profiles", "*.json"))) == 2 \
        else None
    cl = Cluster(extra=PAIRS_ONLY)
    cl.start_log, cl.spoilt = cl.log(), spoilt
    yield cl
    if cl.p.returncode is None:
        cl.stop()


def test_bad_profiles(c):
    if c.spoilt is None:
        pytest.skip("the profile cache was not filled by test_sigkill_up_leaves_nothing")
    c.spoilt(c.start_log)


def test_greedy_identical_to_single_process(c, refs):
    # 1. greedy output identical to single-process tandem generate
    same, paths = 0, []
    for p in PROMPTS:
        ids, last = generate(c.stub, p)
        paths.append(last.timing)
        if ids == refs[p]:
            same += 1
        else:
            print("  differs: %r\n    cluster %s\n    local   %s" % (p, ids, refs[p]))
    check("greedy identical to single-process for %d/%d prompts" % (same, len(PROMPTS)), same == len(PROMPTS))
    # the first token's way on the disaggregated path, taken apart (medians over the prompts, one at a time)
    med = {k: sorted(getattr(t, k) for t in paths)[len(paths) // 2]
           for k in ("ttft_ms", "reserve_ms", "prefill_call_ms", "prefill_worker_ms", "handoff_ms")}
    # the first token goes to the client when the prefill worker answers: the decode worker's hand-off (its Decode
    # call, the landing's check, its next step) is not in the TTFT
    check("the first token's way, medians of %d: TTFT %.1f ms = Reserve %.1f + Prefill call %.1f (the prefill "
          "worker's own %.1f of it) + the router's placing and sending %.1f; the decode worker's hand-off (%.1f ms) "
          "not in it (first token sent early: %d of %d)" %
          (len(paths), med["ttft_ms"], med["reserve_ms"], med["prefill_call_ms"], med["prefill_worker_ms"],
           med["ttft_ms"] - med["reserve_ms"] - med["prefill_call_ms"], med["handoff_ms"],
           sum(t.first_token_early for t in paths), len(paths)),
          all(t.HasField("handoff_ms") and t.first_token_early and t.reserve_ms > 0 and
              0 < t.prefill_worker_ms <= t.prefill_call_ms and t.handoff_ms > 0 and
              t.reserve_ms + t.prefill_call_ms <= t.ttft_ms < t.reserve_ms + t.prefill_call_ms + t.handoff_ms
              for t in paths))
    check("final message has usage and timing",
          last.usage.completion_tokens == MAX_TOKENS and last.timing.ttft_ms > 0 and
          last.finish_reason == pb.FINISH_REASON_LENGTH and last.timing.prefill_worker != "",
          str(last))
    # the ports tandem up chose lie outside the kernel's range for outgoing connections, where another
    # process's connection cannot take one before its listener binds it
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        lo, hi = map(int, f.read().split())
    ports = [int(c.endpoint.rsplit(":", 1)[1]), int(c.etcd.rsplit(":", 1)[1])]
    check("tandem up's router and etcd ports %s lie outside the outgoing range %d-%d" % (ports, lo, hi),
          all(p < lo or p > hi for p in ports))


def test_reservations_leases(c, refs):
    # 1b. reservations: an unclaimed one returns when its lease ends, renewed ones live on, a
    # released one returns at once (the decode worker's Stats counts them)
    dw = c.worker("decode")
    dch = c.channel(dw["addr"], cert="router")  # only the router's certificate may reserve
    dstub = wpbg.DecodeStub(dch)
    ct = wpb.KvContract(**dw["contract"])
    r1 = dstub.Reserve(wpb.ReserveRequest(n_tokens=40, max_tokens=8, contract=ct, lease_ms=600, landing_ms=100),
                       timeout=5)
    r2 = dstub.Reserve(wpb.ReserveRequest(n_tokens=40, max_tokens=8, contract=ct, lease_ms=600, landing_ms=100),
                       timeout=5)
    held = c.stats(dw).reservations
    for _ in range(4):  # renew r2 only, for 1.2 s: r1's 0.6 s lease runs out meanwhile
        unknown = dstub.Renew(wpb.RenewRequest(reservation_ids=[r2.landing.reservation_id], lease_ms=600),
                              timeout=5).unknown_ids
        time.sleep(0.3)
    after_lease = c.stats(dw).reservations
    dstub.Release(wpb.ReleaseRequest(reservation_id=r2.landing.reservation_id, landing_closed=True), timeout=5)
    after_release = c.stats(dw).reservations
    gone = dstub.Renew(wpb.RenewRequest(reservation_ids=[r1.landing.reservation_id], lease_ms=600),
                       timeout=5).unknown_ids
    # a whole request (no reservation) is for colocated decode workers only: this one refuses it, saying why
    try:
        list(dstub.Decode(wpb.DecodeRequest(tokens=[1, 2, 3]), timeout=5))
        whole = "served"
    except grpc.RpcError as e:
        whole = "%s: %s" % (e.code().name, e.details())
    dch.close()
    check("a decode worker not colocated refuses a whole request naming decode.colocated (%s)" % whole,
          whole.startswith("FAILED_PRECONDITION") and "decode.colocated" in whole)
    check("reservations: 2 held, the unrenewed one expired with its 0.6 s lease (%d left), the renewed one "
          "lived, and Release returned it (%d left)" % (after_lease, after_release),
          held == 2 and after_lease == 1 and not unknown and after_release == 0 and
          list(gone) == [r1.landing.reservation_id])


def test_concurrent_streams(c, refs):
    # 2. 64 concurrent streams, all correct
    out = [None] * 64

    def run(i):
        try:
            out[i] = generate(c.stub, PROMPTS[i % len(PROMPTS)])[0]
        except Exception as e:  # noqa: BLE001
            out[i] = e
    ts = [threading.Thread(target=run, args=(i,)) for i in range(64)]
    t0 = time.time()
    [t.start() for t in ts]
    [t.join() for t in ts]
    good = sum(1 for i in range(64) if out[i] == refs[PROMPTS[i % len(PROMPTS)]])
    check("64 concurrent streams: %d/64 complete and correct (%.1f s)" % (good, time.time() - t0), good == 64,
          str([o for o in out if not isinstance(o, list)][:2]))


def test_seeded_sampling(c, refs):
    # 2b. seeded sampling: the decode side continues the prefill side's random stream
    same = 0
    for p in PROMPTS[:6]:
        ids = []
        for r in c.stub.Generate(pb.GenerateRequest(prompt=p, return_token_ids=True, sampling=pb.SamplingParams(
                max_tokens=MAX_TOKENS, ignore_eos=True, **SEEDED)), timeout=120):
            ids.extend(r.token_ids)
        same += ids == reference(p, seeded=True)
    check("seeded sampling (temperature 0.9, top_p 0.95, seed 1234) identical to single-process for %d/6 prompts"
          % same, same == 6)


def test_stop_token_ids_and_min_tokens(c, refs):
    # 2c. vLLM's stop_token_ids and min_tokens through the prefill and decode workers: a token of the greedy output
    # named a stop token ends it there; with min_tokens past it, it is held back there; the first token (sampled by
    # the prefill worker) is held back too
    p = PROMPTS[0]
    ref = refs[p]
    i = next(k for k in range(2, len(ref)) if ref[k] not in ref[:k])

    def run(**sp):
        ids, fin = [], None
        for r in c.stub.Generate(pb.GenerateRequest(prompt=p, return_token_ids=True, sampling=pb.SamplingParams(
                max_tokens=MAX_TOKENS, ignore_eos=True, **sp)), timeout=120):
            ids.extend(r.token_ids)
            fin = r.finish_reason or fin
        return ids, fin
    stopped, fin = run(stop_token_ids=[ref[i]])
    check("stop_token_ids: the output ends at its stop token (%d of %d tokens)" % (len(stopped), i + 1),
          stopped == ref[:i + 1] and fin == pb.FINISH_REASON_STOP, "%s %s" % (stopped, fin))
    held, _ = run(stop_token_ids=[ref[i]], min_tokens=i + 2)
    check("min_tokens holds the stop token back at token %d" % i,
          held[:i] == ref[:i] and held[i] != ref[i] and len(held) >= i + 2, str(held))
    first, _ = run(stop_token_ids=[ref[0]], min_tokens=1)
    check("min_tokens holds a stop token back from the prefill worker's first token",
          first and first[0] != ref[0], str(first))


def test_logprobs(c, refs):
    # 2d. log-probabilities through the prefill and decode workers: one per token, the first one's (sampled by the
    # prefill worker) too; greedy, so each token is its top one
    p = PROMPTS[1]
    ids, lps = [], []
    for r in c.stub.Generate(pb.GenerateRequest(prompt=p, return_token_ids=True, sampling=pb.SamplingParams(
            max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=True, top_logprobs=2)), timeout=120):
        ids.extend(r.token_ids)
        lps.extend(r.logprobs)
    ok = ids == refs[p] and [x.token_id for x in lps] == ids and all(
        len(x.top) == 2 and x.top[0].token_id == x.token_id and abs(x.logprob - x.top[0].logprob) < 1e-6 and
        x.top[1].logprob <= x.top[0].logprob <= 0 for x in lps)
    check("logprobs on prefill + decode workers: %d of %d tokens, each its top one (%s ...)"
          % (len(lps), len(ids), [round(x.logprob, 3) for x in lps[:3]]), ok, str(lps[:2]))
    # the prompt scored alone (max_tokens 0) on the prefill worker: the prompt followed by that greedy text gives its
    # tokens the log-probabilities they had when generated; nothing is generated
    text = "".join(r.text for r in c.stub.Generate(pb.GenerateRequest(prompt=p, sampling=pb.SamplingParams(
        max_tokens=MAX_TOKENS, ignore_eos=True)), timeout=120))
    plp, out, fin = [], [], None
    for r in c.stub.Generate(pb.GenerateRequest(prompt=p + text, return_token_ids=True, sampling=pb.SamplingParams(
            max_tokens=0, prompt_logprobs=True, top_logprobs=1)), timeout=120):
        plp.extend(r.prompt_logprobs)
        out.extend(r.token_ids)
        fin = r.finish_reason or fin
    k = len(ids)
    ok = (not out and fin == pb.FINISH_REASON_LENGTH and not plp[0].HasField("logprob") and
          [x.token_id for x in plp[-k:]] == ids and all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(plp[-k:], lps)))
    check("prompt logprobs on the prefill worker (max_tokens 0): %d prompt tokens, the last %d as generated"
          % (len(plp), k), ok, str(plp[-2:]))


def test_cancel_frees_kv(c, refs):
    # 3. a client cancel frees the request's KV on both workers
    pw, dw = c.worker("prefill"), c.worker("decode")
    idle_p, idle_d = c.stats(pw).kv_in_use, c.stats(dw).kv_in_use
    call = c.stub.Generate(pb.GenerateRequest(prompt="Tell me a long story. " * 20,
                                              sampling=pb.SamplingParams(max_tokens=1500, ignore_eos=True)),
                           timeout=120)
    n = 0
    for _ in call:
        n += 1
        if n == 5:
            break
    busy_d = c.stats(dw).kv_in_use
    call.cancel()
    freed = wait_for(lambda: c.stats(dw).kv_in_use == idle_d and c.stats(pw).kv_in_use == idle_p, 5)
    check("cancel frees KV on both workers (decode in use %d while running, back to %d; prefill %d)" %
          (busy_d, c.stats(dw).kv_in_use, c.stats(pw).kv_in_use), freed and busy_d > idle_d)
    # cancel during prefill too: a long prompt, cancelled before its first token
    call = c.stub.Generate(pb.GenerateRequest(prompt="word " * 1500, sampling=pb.SamplingParams(max_tokens=4)),
                           timeout=120)
    time.sleep(0.4)
    call.cancel()
    freed = wait_for(lambda: c.stats(dw).kv_in_use == idle_d and c.stats(pw).kv_in_use == idle_p and
                     c.stats(dw).reservations == 0, 10)
    check("cancel mid-prefill frees the prefill KV and the decode reservation", freed,
          "prefill in use %d, decode in use %d" % (c.stats(pw).kv_in_use, c.stats(dw).kv_in_use))


def test_malformed_requests(c, refs):
    # 4. malformed and oversized requests: INVALID_ARGUMENT naming the field
    def code_of(rq, raw=None):
        try:
            if raw is not None:
                f = c.ch.unary_stream("/tandem.v1.Tandem/Generate", request_serializer=lambda x: x,
                                      response_deserializer=lambda x: x)
                list(f(raw, timeout=10))
            else:
                list(c.stub.Generate(rq, timeout=10))
            return grpc.StatusCode.OK, ""
        except grpc.RpcError as e:
            return e.code(), e.details()
    bad = [
        ("garbage bytes", None, b"\xff\xff\xff\xff\x0f", "does not parse"),
        ("no input", pb.GenerateRequest(), None, "input"),
        ("empty prompt", pb.GenerateRequest(prompt=""), None, "prompt"),
        ("temperature -1", pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(temperature=-1)), None,
         "temperature"),
        ("top_p 0", pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(top_p=0)), None, "top_p"),
        ("oversized prompt", pb.GenerateRequest(prompt="word " * 9000), None, "context"),
        ("bad chat role", pb.GenerateRequest(chat=pb.ChatInput(messages=[pb.ChatMessage(role="wizard",
                                                                                        content="x")])),
         None, "role"),
        ("empty stop string", pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(stop=[""])), None,
         "stop"),
    ]
    for name, rq, raw, field in bad:
        code, msg = code_of(rq, raw)
        check("malformed: %s -> INVALID_ARGUMENT naming '%s' (%s)" % (name, field, msg),
              code == grpc.StatusCode.INVALID_ARGUMENT and field in msg, "%s %s" % (code, msg))
    code, msg = code_of(pb.GenerateRequest(prompt="hi", model="no-such-model"))
    check("unknown model -> NOT_FOUND naming it", code == grpc.StatusCode.NOT_FOUND and "no-such-model" in msg,
          msg)
    ids, _ = generate(c.stub, PROMPTS[0])
    check("the cluster keeps serving after bad requests", ids == refs[PROMPTS[0]])


def test_client_deadlines_leave_workers_usable(c, refs):
    # 4a. a client's own 1 ms deadline ends its request, and does not make the workers unusable for
    # others (it used to mark the decode worker suspect for 2 s)
    codes = []
    for _ in range(5):
        try:
            list(c.stub.Generate(pb.GenerateRequest(prompt=PROMPTS[0], deadline_ms=1, sampling=pb.SamplingParams(
                max_tokens=4, ignore_eos=True)), timeout=10))
            codes.append("OK")
        except grpc.RpcError as e:
            codes.append(e.code().name)
    t0 = time.time()
    ids, _ = generate(c.stub, PROMPTS[0])
    secs = time.time() - t0
    check("five 1 ms deadlines (%s) leave the workers usable: the next request is correct in %.2f s" %
          (",".join(sorted(set(codes))), secs), ids == refs[PROMPTS[0]] and secs < 1.5 and
          all(x in ("DEADLINE_EXCEEDED", "OK") for x in codes), str(codes))


def test_bench_against_the_cluster(c, refs):
    # 4b. tandem bench --api grpc against the cluster: an open-loop run with a JSON report
    rep = tempfile.mkdtemp(prefix="tandem-bench-") + "/run.json"
    b = subprocess.run([BIN + "/tandem", "bench", "--endpoint", c.endpoint, "--api", "grpc", "--rate", "8",
                        "--num-requests", "8", "--input-len", "fixed:32", "--output-len", "fixed:8",
                        "--ignore-eos", "--tokenizer", MODEL, "--output", rep],
                       capture_output=True, text=True, timeout=120)
    ok = False
    if b.returncode == 0:
        r = json.load(open(rep))
        reqs = r["runs"][0]["requests"]
        ok = "goodput" in r and len(reqs) == 8 and all(
            q["ok"] and q["output_tokens"] == 8 and q["input_tokens"] == 32 for q in reqs)
    check("tandem bench --api grpc: 8 open-loop requests, all ok with 32 prompt and 8 output tokens each",
          ok, (b.stderr + b.stdout)[-400:])
    # ... and pointed at the gRPC port with the OpenAI API: every request fails, and the report says why
    b = subprocess.run([BIN + "/tandem", "bench", "--endpoint", c.endpoint, "--rate", "8", "--num-requests", "4",
                        "--input-len", "fixed:8", "--output-len", "fixed:2", "--tokenizer", MODEL],
                       capture_output=True, text=True, timeout=120)
    why = [l for l in b.stdout.splitlines() if "failed (status" in l]
    check("tandem bench --api openai against the gRPC port: the failures' first error shown (%s)" %
          (why[0][:160] if why else "none"), bool(why), b.stdout[-400:])


def test_other_kv_contract_refused(c, refs):
    # 5. a worker with another KV contract is refused, naming both values
    def refused(wid, *flags):
        p = subprocess.Popen([BIN + "/tandem-decode", "--model", MODEL, "--etcd", c.etcd, "--threads", "1",
                              "--id", wid] + list(flags) + c.tls_args("decode"), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
        seen = wait_for(lambda: any(r["id"] == wid for r in c.health()[1]["refused"]), 15)
        why = [r["why"] for r in c.health()[1]["refused"] if r["id"] == wid]
        return p, (why[0] if seen and why else "")
    odd, why = refused("decode-bt32", "--block-tokens", "32")
    check("a worker with block_tokens 32 is refused: %s" % (why or "-"),
          "block_tokens" in why and "16" in why and "32" in why)
    # and one whose KV is fp8_e4m3 (a byte a value, its scales): refused the same way, both dtypes named
    f8, why8 = refused("decode-fp8", "--kv-dtype", "fp8")
    check("a worker with an fp8_e4m3 KV cache is refused: %s" % (why8 or "-"),
          "dtype" in why8 and "'fp16'" in why8 and "'fp8_e4m3'" in why8)
    ok_all = all(generate(c.stub, p)[0] == refs[p] for p in PROMPTS[:4])
    check("requests never land on the refused workers", ok_all)
    for p in (odd, f8):
        p.terminate()
        p.wait(30)


def test_kill_prefill_mid_prefill(c, refs):
    # 6. kill -9 of the prefill worker mid-prefill
    pw = c.worker("prefill")
    long_prompt = "The history of the city is long and complicated. " * 120
    ref_long = reference(long_prompt, 8)
    res = {}

    def long_req():
        t = time.time()
        try:
            res["ids"] = generate(c.stub, long_prompt, max_tokens=8, timeout=90)[0]
        except grpc.RpcError as e:
            res["err"] = (e.code(), e.details())
        res["secs"] = time.time() - t
    t = threading.Thread(target=long_req)
    t.start()
    time.sleep(0.6)
    os.kill(pw["pid"], signal.SIGKILL)
    t.join(100)
    check("prefill killed mid-prefill: the request %s in %.1f s" %
          ("completed correctly" if res.get("ids") == ref_long else "ended with " + str(res.get("err")),
           res.get("secs", -1)),
          not t.is_alive() and res.get("ids") == ref_long)
    back = wait_for(lambda: c.worker("prefill") and c.worker("prefill")["pid"] != pw["pid"] and c.health()[0], 30)
    check("the killed prefill worker is restarted and rejoins", back)


def test_kill_decode_mid_decode(c, refs):
    # 7. kill -9 of the decode worker mid-decode
    dw = c.worker("decode")
    # seeded: the resume must continue the random stream too; a stop string that never matches
    # makes the decode side hold text back, which the resumed stream must still deliver
    ref300 = reference(PROMPTS[1], 200, seeded=True)
    ref_text = reference_text(PROMPTS[1], 200, seeded=True)
    got, err, text = [], None, []
    t0 = time.time()
    try:
        for r in c.stub.Generate(pb.GenerateRequest(prompt=PROMPTS[1], return_token_ids=True,
                                                    sampling=pb.SamplingParams(max_tokens=200, ignore_eos=True,
                                                                               stop=["@@never@@"], **SEEDED)),
                                 timeout=90):
            got.extend(r.token_ids)
            text.append(r.text)
            if len(got) >= 20 and dw:
                os.kill(dw["pid"], signal.SIGKILL)
                dw = None
    except grpc.RpcError as e:
        err = (e.code(), e.details())
    how = ("resumed and completed identically, seeded sampling (%d tokens, text %s)" %
           (len(got), "identical" if "".join(text) == ref_text else "DIFFERENT")) if got == ref300 else \
        "ended with %s after %d tokens" % (err, len(got))
    check("decode killed mid-decode: the stream %s in %.1f s" % (how, time.time() - t0),
          got == ref300 and "".join(text) == ref_text)
    back = wait_for(lambda: c.worker("decode") and c.health()[0], 30)
    check("the killed decode worker is restarted and rejoins", back)
    ids, _ = generate(c.stub, PROMPTS[2])
    check("the cluster serves after the restarts", ids == refs[PROMPTS[2]])
    time.sleep(3.5)
    ids, _ = generate(c.stub, PROMPTS[3])
    peers = c.stats(c.worker("prefill")).kv_peers
    check("the prefill worker closed its connection to the dead decode worker (open: %d)" % peers,
          peers == 1 and ids == refs[PROMPTS[3]])


def test_kill_router_mid_prefill(c, refs):
    # 8. kill -9 of the router mid-prefill: the reservation it held on the decode worker is no
    # longer renewed and returns within its 3 s lease (+1 s), not at the request's deadline
    router_pid = [k for k in (int(p) for p in os.listdir("/proc") if p.isdigit())
                  if proc_state(k)[1] == c.p.pid and b"tandem-router" in open("/proc/%d/cmdline" % k, "rb").read()]
    dw = c.worker("decode")
    res = {}

    def fresh_long_req():  # a prompt no worker has cached: its prefill takes seconds
        try:
            res["ids"] = generate(c.stub, "The story of the river is long and winding. " * 120, max_tokens=8,
                                  timeout=90)[0]
        except grpc.RpcError as e:
            res["err"] = (e.code(), e.details())
    t = threading.Thread(target=fresh_long_req)
    t.start()
    held = wait_for(lambda: c.stats(dw).reservations >= 1, 20)
    os.kill(router_pid[0], signal.SIGKILL)
    t0 = time.time()
    back = wait_for(lambda: c.stats(dw).reservations == 0, 30)
    secs = time.time() - t0
    t.join(100)
    check("router killed mid-prefill: its reservation on the decode worker returned in %.1f s (lease 3 s)" % secs,
          held and back and secs <= 4.0)
    check("the client of the killed router got an error, not a hang (%s)" % (res.get("err"),),
          not t.is_alive() and "err" in res)
    check("the killed router is restarted and serves",
          wait_for(lambda: c.health()[0], 30) and generate(c.stub, PROMPTS[0])[0] == refs[PROMPTS[0]])


def test_stops_cleanly(c):
    rc = c.stop()
    check("tandem up stops cleanly on SIGTERM (exit %s)" % rc, rc == 0)


def test_tls_cluster(refs):
    tls_cluster(refs)


def test_two_by_two(refs):
    two_by_two(refs)


@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2)])
def test_prefill_and_decode_of_different_tp_degrees(prefill_tp, decode_tp):
    """Different parallelism for prefill and decode (engine/tp.h): a prefill worker of 2 tensor-parallel ranks
    puts each rank's KV heads into their place in a decode worker's whole blocks over UCX; the reverse, a prefill
    worker of one rank puts each layer's slice of a block into the parts of a decode worker of 2 ranks (a region a
    rank, each getting the heads it holds); the output is the single process's either way. tiny-llama3 (4 heads,
    2 KV heads: the default model's 9 heads do not split in two)."""
    tiny = os.path.join(os.path.dirname(MODEL), "..", "tests", "fixtures", "hf", "tiny-llama3")
    cfg = tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False)
    cfg.write("prefill: {tp: %d, token_budget: 48}\ndecode: {tp: %d}\nrouter: {http_listen: \"\"}\n" %
              (prefill_tp, decode_tp))  # chunks of 48: a block put twice
    cfg.close()
    c = Cluster(config=cfg.name, extra=PAIRS_ONLY, model=tiny)
    try:
        words = "the of and to in is was for on that with as by at from his her it an were are".split()
        prompts = ["Hello world, this is", " ".join(words[i % len(words)] for i in range(60)), "The quick brown fox"]
        prompts.append(prompts[1] + " and then")  # the long one's blocks from the prefill worker's cache
        same, cached = 0, []
        for p in prompts:
            want = subprocess.run([BIN + "/tandem", "generate", "--model", tiny, "--ids", "--threads", "1",
                                   "--max-tokens", "16", "--ignore-eos", p], capture_output=True, text=True,
                                  check=True).stdout.split()
            ids, last = generate(c.stub, p, max_tokens=16)
            same += [str(i) for i in ids] == want
            cached.append(last.usage.cached_prompt_tokens)
        tps = {role: [w["contract"].get("tp", 1) for w in c.workers() if w["role"] == role]
               for role in ("prefill", "decode")}
        check("a prefill worker of tp %s (their contracts) and a decode worker of tp %s: greedy identical to the "
              "single process for %d of %d prompts (the last one's prefix cached: %s tokens)" %
              (tps["prefill"], tps["decode"], same, len(prompts), cached[-1]),
              same == len(prompts) and tps == {"prefill": [prefill_tp], "decode": [decode_tp]} and cached[-1] > 0)
    finally:
        os.unlink(cfg.name)
        rc = c.stop()
        check("the tp cluster stops cleanly (exit %s)" % rc, rc == 0, "; ".join(c.unclean()))
