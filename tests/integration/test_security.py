#!/usr/bin/env python3
"""The attacks of the adversarial run against a real `tandem up` cluster, each
one refused with a clear error while a victim request runs beside it; the
victim's greedy output must stay identical to single-process `tandem
generate`, and the cluster must still serve afterwards.

Covered here:
- every internal RPC of both workers called without TLS, with TLS but no
  client certificate, and with a certificate from another CA: refused; with
  a certificate of this cluster that is not the router's: every one but
  Stats refused PERMISSION_DENIED, naming the certificate;
- etcd: an anonymous put of a fake prefill-worker record and a delete of the
  decode worker's, without a certificate and with another CA's: refused,
  nothing changed;
- every listening socket of every process of the cluster is on loopback;
- with the router's own certificate (the strongest peer): a Prefill whose
  landing offset lies outside the decode pool (2^40), or whose landing is
  another reservation's blocks under this one's grant, or is unsigned, or is
  signed by a certificate of this cluster that is not a decode worker's, or
  whose land-by time has passed, or whose reservation the router cancelled
  before it came: each refused by the prefill worker before any byte moves,
  which keeps serving; blocks of a reservation released with its landing not
  closed stay fenced until its land-by time, then return;
- a prefill worker frozen (SIGSTOP) mid-prefill past its request's deadline:
  the landing blocks stay out of the decode pool until land-by, and once it
  resumes it drops its late puts (Stats late_puts_dropped) and serves again;
- one certificate holds at most 1,024 reservations (a second router's, on a
  pool larger than that), while the router's own requests are served;
- a Reserve of 2^32 - 1 tokens (wrapped to 0 blocks before): refused, nothing
  reserved; a pool-sized Reserve without a lease: returned within the short
  default lease; reservation ids cannot be guessed from one another;
- a NUL inside a prompt, a chat message or a stop string: refused naming the
  field (never cut short); a request_id of 1 MiB, 17 stop strings, 2,000
  logit-bias entries: each refused naming the field; a 5 MiB message:
  RESOURCE_EXHAUSTED before it is parsed;
- a worker's etcd record deleted by someone else: put back under its lease;
- the client pair tandem up hands out sits in a folder of its own (no CA key,
  no other role's key); etcd (its own access control, a role per certificate
  role) refuses it any write — a fake worker's record, a delete, the ops
  config — and a worker's pair any record of another role;
- a prefill record (written with a prefill worker's pair) pointing at a
  server that shows the client certificate: the router never connects, so
  no prompt reaches it, and says why;
- prompts past the decode pool (within the context) between ordinary
  requests: refused clearly, the decode worker not taken out for them;
- Scale without the administrator key, from the router's own host and as
  the local user nobody: refused; with the key tandem up printed: taken;
- 300 streams with 600 s deadlines cancelled at once: the decode pool back to
  idle within seconds, not at their deadline;
- router.api_keys on the gRPC API (authorization metadata), and a key's
  token limit under ten concurrent requests (charged at admission).

Run with pytest (tests/conftest.py says how)."""
import os
import random
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import types

import pytest

import harness as hs

import grpc  # noqa: E402

pb, wpb, wpbg = hs.pb, hs.wpb, hs.wpbg
VICTIM = hs.PROMPTS[0]
VICTIM_TOKENS = 48


def refused(fn, code, needle):
    """Calls fn; returns (True, details) when it fails with code and details naming needle."""
    try:
        fn()
    except grpc.RpcError as e:
        return e.code() == code and needle in (e.details() or ""), "%s: %s" % (e.code().name, e.details())
    return False, "accepted"


class Victim:
    """A greedy request that runs while an attack does."""

    def __init__(self, c, ref):
        self.c, self.ref, self.ids, self.err = c, ref, None, None
        self.t = threading.Thread(target=self.run)
        self.t.start()

    def run(self):
        try:
            self.ids = hs.generate(self.c.stub, VICTIM, max_tokens=VICTIM_TOKENS)[0]
        except grpc.RpcError as e:
            self.err = "%s: %s" % (e.code().name, e.details())

    def same(self):
        self.t.join(120)
        return self.ids == self.ref, self.err or ("identical" if self.ids == self.ref else "differs: %s" % self.ids)


def gen(c, **kw):
    sampling = kw.pop("sampling", pb.SamplingParams(max_tokens=4))
    return lambda: list(c.stub.Generate(pb.GenerateRequest(sampling=sampling, **kw), timeout=30))


def internal_calls(dstub, pstub, ct):
    """One call of every internal RPC: (name, fn)."""
    return [
        ("Prefill.Prefill", lambda: pstub.Prefill(wpb.PrefillRequest(request_id="x", tokens=[1]), timeout=5)),
        ("Prefill.Cancel", lambda: pstub.Cancel(wpb.CancelPrefillRequest(reservation_id=1), timeout=5)),
        ("Prefill.Stats", lambda: pstub.Stats(wpb.StatsRequest(), timeout=5)),
        ("Decode.Reserve", lambda: dstub.Reserve(wpb.ReserveRequest(n_tokens=16, max_tokens=1, contract=ct),
                                                 timeout=5)),
        ("Decode.Decode", lambda: list(dstub.Decode(wpb.DecodeRequest(reservation_id=1, tokens=[1], first_token=1),
                                                    timeout=5))),
        ("Decode.Release", lambda: dstub.Release(wpb.ReleaseRequest(reservation_id=1), timeout=5)),
        ("Decode.Renew", lambda: dstub.Renew(wpb.RenewRequest(reservation_ids=[1], lease_ms=100), timeout=5)),
        ("Decode.Stats", lambda: dstub.Stats(wpb.StatsRequest(), timeout=5)),
    ]


def sign_as(certs, name, landing):
    """landing signed with certs/NAME's key, as a decode worker signs its grants (openssl's CLI)."""
    body = wpb.LandingDescriptor()
    body.CopyFrom(landing)
    body.ClearField("signature")
    body.ClearField("signer_cert")
    d = tempfile.mkdtemp(prefix="tandem-sign-")
    with open(d + "/m", "wb") as f:
        f.write(body.SerializeToString())
    sig = subprocess.run(["openssl", "dgst", "-sha256", "-sign", "%s/%s.key" % (certs, name), d + "/m"],
                         capture_output=True, check=True).stdout
    der = subprocess.run(["openssl", "x509", "-in", "%s/%s.pem" % (certs, name), "-outform", "DER"],
                         capture_output=True, check=True).stdout
    body.signature, body.signer_cert = sig, der
    return body


def listening(pids):
    """(pid, address, port) of every listening TCP socket of pids, from /proc."""
    inodes = {}
    for pid in pids:
        try:
            for fd in os.listdir("/proc/%d/fd" % pid):
                link = os.readlink("/proc/%d/fd/%s" % (pid, fd))
                if link.startswith("socket:["):
                    inodes[link[8:-1]] = pid
        except OSError:
            pass
    out = []
    for f, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        for line in open(f).readlines()[1:]:
            col = line.split()
            if col[3] != "0A" or col[9] not in inodes:  # 0A: LISTEN
                continue
            hexaddr, hexport = col[1].split(":")
            raw = bytes.fromhex(hexaddr)
            if v6:  # four 32-bit words, each little-endian
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
                addr = ("127.0.0.1" if raw[:12] == b"\0" * 10 + b"\xff\xff" and raw[12:] == bytes([127, 0, 0, 1])
                        else "::1" if raw == b"\0" * 15 + b"\1" else raw.hex())
            else:
                addr = ".".join(str(b) for b in raw[::-1])
            out.append((inodes[col[9]], addr, int(hexport, 16)))
    return out


def peer_quota(ref):
    """One peer (certificate) holds at most 1,024 reservations: a second router's certificate takes its
    fill of a decode pool large enough for more, and the router's own requests still get theirs."""
    c = hs.Cluster(extra=["--worker-arg", "--kv-mib", "--worker-arg", "440"] + hs.PAIRS_ONLY)
    try:
        hs.wait_for(lambda: c.health()[0], 60)
        dw = c.worker("decode")
        ct = wpb.KvContract(**dw["contract"])
        subprocess.run([hs.BIN + "/tandem", "certs", "--dir", c.certs, "--names", "router-b"], check=True,
                       capture_output=True)
        ch = c.channel(dw["addr"], cert="router-b")
        stub = wpbg.DecodeStub(ch)
        blocks = c.stats(dw).kv_blocks
        held = 0
        for _ in range(1024):
            stub.Reserve(wpb.ReserveRequest(n_tokens=1, max_tokens=1, contract=ct, lease_ms=30000, landing_ms=100),
                         timeout=5)
            held += 1
        ok, why = refused(lambda: stub.Reserve(wpb.ReserveRequest(n_tokens=1, max_tokens=1, contract=ct), timeout=5),
                          grpc.StatusCode.RESOURCE_EXHAUSTED, "the most one peer may hold")
        ids, _ = hs.generate(c.stub, VICTIM, max_tokens=VICTIM_TOKENS)
        hs.check("a second router certificate holds %d reservations of a %d-block pool; its next is refused (%s); "
                 "the router's own request beside it is served, identical" % (held, blocks, why),
                 ok and blocks > 1024 + 8 and ids == ref)
        ch.close()
    finally:
        c.stop()


class FakePrefill(wpbg.PrefillServicer):
    """A gRPC server that answers as a prefill worker would, counting what reaches it."""

    def __init__(self):
        self.calls = 0

    def Prefill(self, request, context):
        self.calls += 1
        context.abort(grpc.StatusCode.UNAVAILABLE, "a fake worker")

    def Cancel(self, request, context):
        self.calls += 1
        context.abort(grpc.StatusCode.UNAVAILABLE, "a fake worker")


def fake_worker(c, pw, ref):
    """A prefill-worker record (written with a prefill worker's own pair, as one stolen would be) pointing at a
    server that shows the client pair: the router never sends it a prompt, and requests are served."""
    from concurrent import futures
    rd = lambda n: open(os.path.join(c.certs, n), "rb").read()  # noqa: E731
    srv = grpc.server(futures.ThreadPoolExecutor(4))
    fake = FakePrefill()
    wpbg.add_PrefillServicer_to_server(fake, srv)
    port = srv.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials(
        [(rd("client.key"), rd("client.pem"))], root_certificates=rd("ca.pem"), require_client_auth=True))
    srv.start()
    rec = dict(pw, id="prefill-fake", addr="127.0.0.1:%d" % port, pid=1)
    key = "/tandem/workers/prefill/prefill-fake"
    put = c.etcdctl("put", key, hs.json.dumps(rec), cert="prefill")
    try:
        hs.wait_for(lambda: "prefill-fake" in c.log(), 5)
        outs = [hs.generate(c.stub, VICTIM, max_tokens=VICTIM_TOKENS)[0] for _ in range(4)]
        warned = "not one of role prefill" in c.log()
        hs.check("a prefill record pointing at a server with the client certificate (put rc %d): %d of its calls "
                 "reached it; 4 requests identical (%s); the router says why it would not connect (%s)" %
                 (put.returncode, fake.calls, [o == ref for o in outs], warned),
                 put.returncode == 0 and fake.calls == 0 and all(o == ref for o in outs) and warned)
    finally:
        c.etcdctl("del", key, cert="router")
        srv.stop(0)


def oversized(c, ref):
    """A prompt that fits the model's context but not the decode worker's pool is refused with a clear error, and
    the decode worker is not taken out for it: ordinary requests between such prompts keep their latency."""
    def ordinary():
        t0 = time.time()
        ids, _ = hs.generate(c.stub, VICTIM, max_tokens=8)
        return time.time() - t0, ids == ref[:8]
    base = sorted(ordinary()[0] for _ in range(6))
    big = " ".join(["word"] * 4000)
    errs, lat, same = [], [], True

    def attack():
        try:
            hs.generate(c.stub, big, max_tokens=4)
            errs.append("served")
        except grpc.RpcError as e:
            errs.append("%s: %s" % (e.code().name, e.details()))
    for _ in range(8):
        t = threading.Thread(target=attack)
        t.start()
        t.join()
        try:
            secs, ok = ordinary()
            lat.append(secs)
            same = same and ok
        except grpc.RpcError as e:
            lat.append(99)
            same = False
            errs.append("ordinary: %s: %s" % (e.code().name, e.details()))
    lat.sort()
    clear = all(e.startswith("INVALID_ARGUMENT") and "pool" in e for e in errs)
    hs.check("8 prompts of ~4,000 tokens (past the decode pool, within the context) between ordinary requests: each "
             "refused clearly (%s); the ordinary ones identical, p50 %.2f s against %.2f s alone" %
             (errs[0][:140] if errs else "none", lat[len(lat) // 2], base[len(base) // 2]),
             clear and len(errs) == 8 and same and lat[len(lat) // 2] < 2 * base[len(base) // 2] + 0.1)


def cancel_flood(c, ref):
    """Streams opened with a 600 s deadline and cancelled at once, in waves: the decode worker's landing blocks
    come back within seconds (cancels answered at once, fences bounded by a short landing lease), not at the
    requests' deadline, and an ordinary request afterwards is served identically. Idle, they are back in ~4 s;
    beside a compile of the tree on both cores once in 20 s, which the bound of 30 s (of a 600 s deadline) allows."""
    dw = c.worker("decode")

    def quiet():
        st = c.stats(dw)
        return st.running == 0 and st.reservations == 0 and st.fenced_blocks == 0
    hs.wait_for(quiet, 10)  # the tests before may leave a request's blocks on their way back
    idle = c.stats(dw)
    rq = pb.GenerateRequest(prompt=VICTIM, return_token_ids=True,
                            sampling=pb.SamplingParams(max_tokens=VICTIM_TOKENS, ignore_eos=True))
    rng = random.Random(47)
    peak = [0, 0]

    def one():
        call = c.stub.Generate(rq, timeout=600)
        time.sleep(rng.random() * 0.08)
        call.cancel()
    for _ in range(6):
        ths = [threading.Thread(target=one) for _ in range(50)]
        for t in ths:
            t.start()
        for t in ths:
            t.join()
        st = c.stats(dw)
        peak = [max(peak[0], st.kv_in_use), max(peak[1], st.fenced_blocks)]
    t0 = time.time()
    log_from = len(c.log())
    trail = []  # what the pool held, once a second while it waits: said when it is late

    def idle_again():
        st = c.stats(dw)
        line = "%.0fs %d/%d/%d/%d" % (time.time() - t0, st.kv_in_use, st.fenced_blocks, st.reservations, st.running)
        if not trail or time.time() - t0 >= len(trail):
            trail.append(line)
        return st.kv_in_use <= idle.kv_in_use and st.fenced_blocks == 0 and st.reservations == 0
    back = hs.wait_for(idle_again, 40)
    secs = time.time() - t0
    st = c.stats(dw)
    ids, _ = hs.generate(c.stub, VICTIM, max_tokens=VICTIM_TOKENS)
    late = ""
    if not back or secs >= 30:
        said = [l for l in c.log()[log_from:].splitlines() if re.search("reserv|landing|fenc|cancel", l)]
        late = "; in use/fenced/reservations/running each second: %s; the cluster said (%d lines) %s" % (
            " ".join(trail[::max(1, len(trail) // 12)]), len(said), " | ".join(said if len(said) <= 6 else said[:3] + ["..."] + said[-3:]))
    hs.check("300 streams (600 s deadlines) cancelled within 80 ms of opening: the decode pool back to idle %.1f s "
             "after the last (at most %d blocks in use, %d fenced meanwhile; now %d in use (%d before), %d fenced, "
             "%d reservations); a request afterwards identical%s" % (secs, peak[0], peak[1], st.kv_in_use,
                                                                    idle.kv_in_use, st.fenced_blocks, st.reservations,
                                                                    late),
             back and secs < 30 and ids == ref)


def api_keys_grpc(ref):
    """router.api_keys binds the gRPC API too (authorization metadata, as the HTTP API's header), and a key's
    token limit is charged at admission: ten concurrent requests on a 100-tokens-a-minute key use at most 100."""
    d = tempfile.mkdtemp(prefix="tandem-keys-")
    keys = {}
    for name, tpm in (("alice", 0), ("tok", 100)):
        out = subprocess.run([hs.BIN + "/tandem", "apikey", name, "--tpm", str(tpm)], capture_output=True, text=True,
                             check=True).stdout.splitlines()
        keys[name] = (out[0].split()[1], out[1].split(None, 1)[1])
    with open(d + "/keys", "w") as f:
        f.write("".join(line + "\n" for _, line in keys.values()))
    with open(d + "/tandem.yaml", "w") as f:
        f.write("router:\n  api_keys: %s\n" % (d + "/keys"))
    c = hs.Cluster(config=d + "/tandem.yaml")
    try:
        hs.wait_for(lambda: c.health()[0], 60)

        def gen(key, max_tokens=VICTIM_TOKENS):
            rq = pb.GenerateRequest(prompt=VICTIM, return_token_ids=True,
                                    sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            md = [("authorization", "Bearer " + key)] if key else None
            ids, last = [], None
            for r in c.stub.Generate(rq, timeout=120, metadata=md):
                ids.extend(r.token_ids)
                last = r
            return ids, last
        no, why_no = refused(lambda: gen(None), grpc.StatusCode.UNAUTHENTICATED, "API key")
        bad, why_bad = refused(lambda: gen("tdk-" + "0" * 48), grpc.StatusCode.UNAUTHENTICATED, "not one of")
        ids, _ = gen(keys["alice"][0])
        hs.check("gRPC with router.api_keys: no key refused (%s), an unknown key refused (%s), alice's served "
                 "identical" % (why_no, why_bad), no and bad and ids == ref)
        res = [None] * 10

        def one(i):
            try:
                last = gen(keys["tok"][0], 16)[1]
                res[i] = ("ok", last.usage.prompt_tokens + last.usage.completion_tokens)
            except grpc.RpcError as e:
                res[i] = (e.code().name, e.details())
        ths = [threading.Thread(target=one, args=(i,)) for i in range(10)]
        for t in ths:
            t.start()
        for t in ths:
            t.join()
        used = sum(r[1] for r in res if r[0] == "ok")
        n_ok = sum(r[0] == "ok" for r in res)
        limited = [r for r in res if r[0] == "RESOURCE_EXHAUSTED" and "tokens per minute" in r[1]]
        hs.check("ten concurrent requests on a 100-tokens-a-minute key: %d served using %d tokens, %d refused for "
                 "tokens (%s)" % (n_ok, used, len(limited), limited[0][1][:120] if limited else res),
                 0 < used <= 100 and n_ok + len(limited) == 10 and bool(limited))
    finally:
        c.stop()


@pytest.fixture(scope="module")
def ref():
    """The victim's single-process output."""
    return hs.reference(VICTIM, VICTIM_TOKENS)


@pytest.fixture(scope="module")
def sec(ref):
    """A `tandem up` cluster, every prompt on its prefill worker (the attacks below are on the disaggregated path's
    planes: reservations, landings, the prefill worker's puts); its workers' records and stubs to them with the
    router's certificate (the strongest peer); a client pair of another CA."""
    c = hs.Cluster(extra=hs.PAIRS_ONLY)
    hs.wait_for(lambda: c.health()[0], 60)
    dw, pw = c.worker("decode"), c.worker("prefill")
    ct = wpb.KvContract(**dw["contract"])
    # the data-plane attacks below use the router's certificate: the strongest peer there is
    dch, pch = c.channel(dw["addr"], cert="router"), c.channel(pw["addr"], cert="router")
    dstub, pstub = wpbg.DecodeStub(dch), wpbg.PrefillStub(pch)
    blocks = c.stats(dw).kv_blocks
    # a client pair of another CA
    other = tempfile.mkdtemp(prefix="tandem-other-ca-")
    subprocess.run([hs.BIN + "/tandem", "certs", "--dir", other, "--names", "client"], check=True,
                   capture_output=True)
    yield types.SimpleNamespace(c=c, dw=dw, pw=pw, ct=ct, dch=dch, pch=pch, dstub=dstub, pstub=pstub, blocks=blocks, other=other, ref=ref)
    dch.close()
    pch.close()
    c.stop()


def test_internal_planes_refuse_strangers(sec):
    c, dw, pw, ct, other, ref = sec.c, sec.dw, sec.pw, sec.ct, sec.other, sec.ref
    # the internal planes: every RPC without TLS, without a client certificate, with another CA's
    rd = lambda d, n: open(os.path.join(d, n), "rb").read()  # noqa: E731
    ca = rd(c.certs, "ca.pem")
    ways = [("no TLS", None),
            ("TLS without a client certificate", grpc.ssl_channel_credentials(ca)),
            ("a certificate from another CA", grpc.ssl_channel_credentials(ca, rd(other, "client.key"),
                                                                           rd(other, "client.pem")))]
    v = Victim(c, ref)
    for how, creds in ways:
        chs = [grpc.secure_channel(a, creds) if creds else grpc.insecure_channel(a)
               for a in (dw["addr"], pw["addr"])]
        bad = []
        for name, fn in internal_calls(wpbg.DecodeStub(chs[0]), wpbg.PrefillStub(chs[1]), ct):
            ok, why = refused(fn, grpc.StatusCode.UNAVAILABLE, "")
            if not ok:
                bad.append("%s: %s" % (name, why))
        for ch in chs:
            ch.close()
        hs.check("every internal RPC (8) with %s is refused%s" % (how, "; not: " + "; ".join(bad) if bad else ""),
                 not bad)
    # a certificate of this cluster, not the router's (tandem up's client certificate, as an operator's
    # or a stolen worker's would be): every method but Stats refused, naming the certificate
    chs = [c.channel(a, cert="client") for a in (dw["addr"], pw["addr"])]
    bad = []
    for name, fn in internal_calls(wpbg.DecodeStub(chs[0]), wpbg.PrefillStub(chs[1]), ct):
        if name.endswith("Stats"):
            try:
                fn()
            except grpc.RpcError as e:
                bad.append("%s: %s" % (name, e.details()))
            continue
        ok, why = refused(fn, grpc.StatusCode.PERMISSION_DENIED, 'CN "client"')
        if not ok:
            bad.append("%s: %s" % (name, why))
    for ch in chs:
        ch.close()
    hs.check("with a cluster certificate that is not the router's, every internal RPC but Stats is refused "
             "PERMISSION_DENIED naming it, Stats answers%s" % ("; not: " + "; ".join(bad) if bad else ""), not bad)
    same, vwhy = v.same()
    hs.check("the victim beside them: %s" % vwhy, same)


def test_etcd_refuses_fake_records(sec):
    c, dw, pw, other = sec.c, sec.dw, sec.pw, sec.other
    # etcd: a fake prefill record and a delete of the decode worker's, without the cluster's certificate
    fake = '{"id":"evil","role":"prefill","addr":"127.0.0.1:1","pid":1,"contract":%s}' % \
        hs.json.dumps(pw["contract"])
    key = "/tandem/workers/decode/" + dw["id"]
    other_args = ["--cert", other + "/client.pem", "--key", other + "/client.key"]
    for how, extra in (("no certificate", []), ("another CA's certificate", other_args)):
        ep = ["etcdctl", "--endpoints", "https://" + c.etcd, "--cacert", c.certs + "/ca.pem",
              "--command-timeout", "3s", "--dial-timeout", "3s"] + extra
        env = dict(os.environ, ETCDCTL_API="3")
        put = subprocess.run(ep + ["put", "/tandem/workers/prefill/evil", fake], capture_output=True, text=True,
                             env=env, timeout=30)
        dele = subprocess.run(ep + ["del", key], capture_output=True, text=True, env=env, timeout=30)
        ids = [w["id"] for w in c.workers()]
        hs.check("etcd with %s: put refused (rc %d), delete refused (rc %d); the members are still %s" %
                 (how, put.returncode, dele.returncode, ids),
                 put.returncode != 0 and dele.returncode != 0 and "evil" not in ids and dw["id"] in ids)

    # the client pair tandem up hands out: a folder of its own (no CA key, no other role's key); etcd takes
    # reads from it and refuses a fake worker's record and a delete
    files = sorted(os.listdir(c.client_certs)) if c.client_certs else []
    hs.check("tandem up's folder for tools holds the CA and the client pair alone: %s" % files,
             files == ["ca.pem", "client.key", "client.pem"] and c.client_certs != c.certs)
    cl_args = ["--cacert", c.client_certs + "/ca.pem", "--cert", c.client_certs + "/client.pem",
               "--key", c.client_certs + "/client.key"]
    ep = ["etcdctl", "--endpoints", "https://" + c.etcd, "--command-timeout", "3s", "--dial-timeout", "3s"]
    env = dict(os.environ, ETCDCTL_API="3")
    put = subprocess.run(ep + cl_args + ["put", "/tandem/workers/prefill/evil", fake], capture_output=True,
                         text=True, env=env, timeout=30)
    dele = subprocess.run(ep + cl_args + ["del", key], capture_output=True, text=True, env=env, timeout=30)
    ops = subprocess.run(ep + cl_args + ["put", "/tandem/ops", "models: []"], capture_output=True, text=True,
                         env=env, timeout=30)
    got = subprocess.run(ep + cl_args + ["get", "--prefix", "/tandem/workers/", "--keys-only"],
                         capture_output=True, text=True, env=env, timeout=30)
    ids = [w["id"] for w in c.workers()]
    hs.check("etcd with the client pair: a fake prefill record, a delete of the decode worker's and a put of the "
             "ops config refused (%s; %s; %s), a read answered; the members are still %s" %
             ((put.stderr.strip().splitlines() or ["rc 0"])[-1], (dele.stderr.strip().splitlines() or ["rc 0"])[-1],
              (ops.stderr.strip().splitlines() or ["rc 0"])[-1], ids),
             put.returncode and "permission denied" in put.stderr and dele.returncode and ops.returncode and
             not got.returncode and key in got.stdout and "evil" not in ids and dw["id"] in ids)
    # a worker's own pair writes only its role's records
    wrong = c.etcdctl("put", "/tandem/workers/decode/evil", fake, cert="prefill")
    hs.check("etcd with a prefill worker's pair: a decode record refused (%s)" %
             (wrong.stderr.strip().splitlines() or ["rc 0"])[-1],
             wrong.returncode and "permission denied" in wrong.stderr)


def test_fake_worker(sec):
    c, pw, ref = sec.c, sec.pw, sec.ref
    fake_worker(c, pw, ref)


def test_oversized(sec):
    c, ref = sec.c, sec.ref
    oversized(c, ref)


def test_cancel_flood(sec):
    c, ref = sec.c, sec.ref
    cancel_flood(c, ref)


def test_scale_needs_admin_key(sec):
    c = sec.c
    # Scale: an administrator's call, never the address's: no key from the router's own host is refused,
    # another local user (nobody) too; the key tandem up printed is taken
    no_key = subprocess.run([hs.BIN + "/tandem", "scale", "--endpoint", c.endpoint, "--prefill", "3", "--decode",
                             "3"], capture_output=True, text=True, timeout=30)
    hs.check("tandem scale from the router's host without the administrator key: refused (%s)" %
             no_key.stderr.strip()[-160:], no_key.returncode == 1 and "PERMISSION_DENIED" in no_key.stderr)
    if os.geteuid() == 0 and shutil.which("runuser"):
        nob = subprocess.run(["runuser", "-u", "nobody", "--", hs.BIN + "/tandem", "scale", "--endpoint",
                              c.endpoint, "--prefill", "3", "--decode", "3"], capture_output=True, text=True,
                             timeout=30)
        hs.check("tandem scale as the local user nobody: refused (%s)" % (nob.stderr.strip()[-160:] or nob.returncode),
                 nob.returncode != 0 and "is not an administrator" in nob.stderr)
        key_read = subprocess.run(["runuser", "-u", "nobody", "--", "cat", c.admin_key], capture_output=True,
                                  text=True, timeout=30)
        hs.check("the administrator key is not readable by nobody (%s)" % key_read.stderr.strip()[-120:],
                 key_read.returncode != 0)
    adm = subprocess.run([hs.BIN + "/tandem", "scale", "--endpoint", c.endpoint, "--prefill", "1", "--decode",
                          "1", "--admin-key", c.admin_key], capture_output=True, text=True, timeout=30)
    hs.check("tandem scale with the administrator key: taken (%s)" % (adm.stderr.strip()[-160:] or "ok"),
             adm.returncode == 0 and "the ops config in force" in adm.stdout)
    pn = c.health()[1]
    hs.check("the cluster still runs 1 prefill + 1 decode worker (%s + %s)" %
             (pn.get("prefill_workers"), pn.get("decode_workers")),
             pn.get("prefill_workers") == 1 and pn.get("decode_workers") == 1)


def test_listening_sockets(sec):
    c = sec.c
    # every listening socket on loopback
    socks = listening(c.pids())
    off = [s for s in socks if s[1] not in ("127.0.0.1", "::1")]
    hs.check("every listening socket of the cluster's processes is on loopback (%d sockets%s)" %
             (len(socks), "; not: %s" % off if off else ""), socks and not off)


def test_data_plane_grants(sec):
    c, dw, ct, dstub, pstub, other, ref = sec.c, sec.dw, sec.ct, sec.dstub, sec.pstub, sec.other, sec.ref
    # the data plane: a landing outside the pool, another reservation's blocks, forged or stale grants
    v = Victim(c, ref)
    other_res = dstub.Reserve(wpb.ReserveRequest(n_tokens=16, max_tokens=1, contract=ct, lease_ms=5000),
                              timeout=5)
    r = dstub.Reserve(wpb.ReserveRequest(n_tokens=16, max_tokens=1, contract=ct, lease_ms=5000), timeout=5)
    def attempt(landing):  # noqa: E306
        return lambda: pstub.Prefill(wpb.PrefillRequest(request_id="attack", tokens=[1] * 16, landing=landing),
                                     timeout=10)
    far = wpb.LandingDescriptor()
    far.CopyFrom(r.landing)
    del far.block_offsets[:]
    far.block_offsets.append(1 << 40)
    theirs = wpb.LandingDescriptor()
    theirs.CopyFrom(r.landing)
    del theirs.block_offsets[:]
    theirs.block_offsets.extend(other_res.landing.block_offsets)
    unsigned = wpb.LandingDescriptor()
    unsigned.CopyFrom(r.landing)
    unsigned.ClearField("signature")
    unsigned.ClearField("signer_cert")
    # a decode worker's own grant naming parts (a pool split over ranks) that leave a KV head out, or whose region
    # is smaller than one part's block: refused before anything is put (signed with the decode certificate's key)
    def with_parts(heads, region_bytes):  # noqa: E306
        d = wpb.LandingDescriptor()
        d.CopyFrom(r.landing)
        for h in heads:
            d.parts.add(region=wpb.KvRegion(region_key=r.landing.region_key, remote_base=r.landing.remote_base,
                                            region_bytes=region_bytes), kv_head0=h, kv_heads=1)
        return sign_as(c.certs, "decode", d)
    gap, small = with_parts([0, 0], r.landing.region_bytes), with_parts(range(ct.n_kv_heads), 64)
    cases = [("a landing offset of 2^40", far, grpc.StatusCode.PERMISSION_DENIED, "signature is not"),
             ("another reservation's blocks under this one's grant", theirs, grpc.StatusCode.PERMISSION_DENIED,
              "signature is not"),
             ("an unsigned landing", unsigned, grpc.StatusCode.PERMISSION_DENIED, "not signed"),
             ("another CA's signature", sign_as(other, "client", theirs), grpc.StatusCode.PERMISSION_DENIED,
              "not one the cluster CA signed"),
             ("the signature of a cluster certificate that is not a decode worker's",
              sign_as(c.certs, "client", theirs), grpc.StatusCode.PERMISSION_DENIED, 'not a decode'),
             ("a signed landing into parts that leave a KV head out", gap, grpc.StatusCode.INVALID_ARGUMENT,
              "no part holds KV head 1"),
             ("a signed landing into parts of 64 bytes", small, grpc.StatusCode.INVALID_ARGUMENT,
              "is not a whole block inside part 0")]
    for how, landing, code, needle in cases:
        ok, why = refused(attempt(landing), code, needle)
        hs.check("%s is refused by the prefill worker (%s)" % (how, why), ok)
    stale = dstub.Reserve(wpb.ReserveRequest(n_tokens=16, max_tokens=1, contract=ct, landing_ms=50), timeout=5)
    time.sleep(0.3)
    ok2, why2 = refused(attempt(stale.landing), grpc.StatusCode.DEADLINE_EXCEEDED, "land-by")
    hs.check("a true grant whose land-by time has passed is refused (%s)" % why2, ok2)
    # the router's acknowledged cancel before the Prefill arrives: the Prefill is refused when it comes
    early = dstub.Reserve(wpb.ReserveRequest(n_tokens=16, max_tokens=1, contract=ct, lease_ms=5000), timeout=5)
    ack = pstub.Cancel(wpb.CancelPrefillRequest(reservation_id=early.landing.reservation_id,
                                                land_by_unix_ms=early.landing.land_by_unix_ms), timeout=5)
    ok3, why3 = refused(attempt(early.landing), grpc.StatusCode.CANCELLED, "before it began")
    hs.check("a Prefill arriving after the router's Cancel of its reservation (answered, found=%s) is refused "
             "(%s)" % (ack.found, why3), ok3 and not ack.found)
    dstub.Release(wpb.ReleaseRequest(reservation_id=early.landing.reservation_id, landing_closed=True), timeout=5)
    same, vwhy = v.same()
    hs.check("the victim beside the landing attacks: %s" % vwhy, same)
    # fences: a release whose landing is not closed keeps the blocks until land-by, a closed one frees them
    for x in (other_res, r, stale):
        dstub.Release(wpb.ReleaseRequest(reservation_id=x.landing.reservation_id, landing_closed=True), timeout=5)
    hs.wait_for(lambda: c.stats(dw).fenced_blocks == 0 and c.stats(dw).reservations == 0, 5)
    base = c.stats(dw).kv_in_use
    f = dstub.Reserve(wpb.ReserveRequest(n_tokens=64, max_tokens=1, contract=ct, landing_ms=2000), timeout=5)
    dstub.Release(wpb.ReleaseRequest(reservation_id=f.landing.reservation_id), timeout=5)
    st = c.stats(dw)
    fenced, in_use = st.fenced_blocks, st.kv_in_use - base
    t0 = time.time()
    back = hs.wait_for(lambda: c.stats(dw).fenced_blocks == 0, 10)
    waited = time.time() - t0
    hs.check("released with its landing open: %d blocks fenced (%d still out of the pool), back after %.1f s "
             "(land-by 2 s + 1 s margin)" % (fenced, in_use, waited),
             fenced == 4 and in_use == 4 and back and 1.0 < waited < 5)


def test_frozen_prefill_past_deadline(sec):
    c, dw, pw, ref = sec.c, sec.dw, sec.pw, sec.ref
    # a prefill worker frozen mid-prefill (SIGSTOP) past its request's deadline: the router gives the
    # reservation up (its Cancel unanswered), the decode worker keeps the blocks out of the pool until
    # land-by, and the worker, resumed after land-by, drops its late puts instead of writing into blocks
    # that may be someone else's by then
    # a prompt whose prefill takes ~1 s here (admitted with a 2 s deadline, not refused at once), its length
    # found from the measured first token of a probe of other words (no cached prefix shared). The router's
    # prediction is a model and this machine may be loaded: a prompt refused at once (predicted past 2 s) or
    # served before the freeze is retried shorter or longer, with words of its own
    def first_token_ms(text):
        ttft = None
        for r in c.stub.Generate(pb.GenerateRequest(prompt=text, sampling=pb.SamplingParams(max_tokens=1)),
                                 timeout=120):
            ttft = r.timing.ttft_ms or ttft
        return ttft or 1000.0
    probe_ms = first_token_ms(" ".join("probe%d" % (i % 89) for i in range(700)))
    words = max(60, min(700, int(700 * 1000 / probe_ms)))
    idle = c.stats(dw).kv_in_use
    dropped0 = c.stats(pw).late_puts_dropped
    tries = []
    for attempt in range(4):
        long_prompt = " ".join("w%dx%d" % (attempt, i % 97) for i in range(words))
        err = []
        def slow():  # noqa: E306
            try:
                list(c.stub.Generate(pb.GenerateRequest(prompt=long_prompt,
                                                        sampling=pb.SamplingParams(max_tokens=1)), timeout=2.0))
                err.append("completed")
            except grpc.RpcError as e:
                err.append(e.code().name if e.code() != grpc.StatusCode.INVALID_ARGUMENT else e.details())
        t = threading.Thread(target=slow)
        t0 = time.time()
        t.start()
        time.sleep(0.4)
        if not t.is_alive():  # answered before the freeze: refused at once, or served in under 0.4 s
            tries.append("%d words: %s" % (words, err))
            words = max(30, int(words * (0.6 if err != ["completed"] else 1.6)))
            continue
        break
    os.kill(pw["pid"], signal.SIGSTOP)
    try:
        t.join(10)
        time.sleep(max(0, t0 + 2.7 - time.time()))  # past the deadline (2 s), before land-by + 1 s (~3 s)
        held = c.stats(dw).kv_in_use - idle
        time.sleep(4)
    finally:
        os.kill(pw["pid"], signal.SIGCONT)
    time.sleep(1)
    dropped = c.stats(pw).late_puts_dropped - dropped0
    back = hs.wait_for(lambda: c.stats(dw).fenced_blocks == 0 and c.stats(dw).kv_in_use == idle, 10)
    hs.check("a prefill worker frozen past its request's deadline (%s; %d words after %s): its %d landing blocks "
             "kept out of the pool past the deadline, %d late puts dropped after it resumed, the blocks back (%s)"
             % (err, words, tries or "no retry", held, dropped, back),
             err == ["DEADLINE_EXCEEDED"] and held > 0 and dropped > 0 and back)
    hs.wait_for(lambda: c.health()[0] and c.worker("prefill") is not None, 30)
    v = Victim(c, ref)
    same, vwhy = v.same()
    hs.check("after it resumed, a request through it: %s" % vwhy, same)


def test_reservation_bounds(sec):
    c, dw, ct, dstub, blocks, ref = sec.c, sec.dw, sec.ct, sec.dstub, sec.blocks, sec.ref
    # reservations: a wrap-around size, a pool-sized one without a lease, ids
    v = Victim(c, ref)
    ok, why = refused(lambda: dstub.Reserve(wpb.ReserveRequest(n_tokens=(1 << 32) - 1, max_tokens=1, contract=ct),
                                            timeout=5), grpc.StatusCode.INVALID_ARGUMENT, "n_tokens")
    same, vwhy = v.same()
    held = c.stats(dw).reservations  # once the victim's own reservation was claimed
    hs.check("a Reserve of 2^32-1 tokens is refused (%s), nothing held (%d)" % (why, held), ok and held == 0)
    hs.check("the victim beside it: %s" % vwhy, same)
    big = dstub.Reserve(wpb.ReserveRequest(n_tokens=blocks * 16 * 3 // 4, max_tokens=1, contract=ct), timeout=5)
    ids = [big.landing.reservation_id] + [
        dstub.Reserve(wpb.ReserveRequest(n_tokens=1, max_tokens=1, contract=ct, lease_ms=500),
                      timeout=5).landing.reservation_id for _ in range(3)]
    t0 = time.time()
    back = hs.wait_for(lambda: c.stats(dw).reservations == 0, 10)
    hs.check("a pool-sized Reserve without a lease is returned after %.1f s (the default lease is 3 s)" %
             (time.time() - t0), back and time.time() - t0 < 5)
    steps = [abs(b - a) for a, b in zip(ids, ids[1:])]
    hs.check("reservation ids are not guessable from one another (%s)" % ids, min(steps) > 1 << 20)


def test_input_limits(sec):
    c, ref = sec.c, sec.ref
    # input limits on the public API
    v = Victim(c, ref)
    cases = [
        ("a NUL inside the prompt", gen(c, prompt="Hello\0 world"), grpc.StatusCode.INVALID_ARGUMENT,
         "prompt: a NUL"),
        ("a NUL inside a chat message", gen(c, chat=pb.ChatInput(messages=[pb.ChatMessage(
            role="user", content="hi\0there")])), grpc.StatusCode.INVALID_ARGUMENT, "chat.messages.content"),
        ("a NUL inside a stop string", gen(c, prompt="Hi", sampling=pb.SamplingParams(max_tokens=4, stop=["a\0b"])),
         grpc.StatusCode.INVALID_ARGUMENT, "sampling.stop"),
        ("a request_id of 1 MiB", gen(c, prompt="Hi", request_id="x" * (1 << 20)),
         grpc.StatusCode.INVALID_ARGUMENT, "request_id"),
        ("17 stop strings", gen(c, prompt="Hi", sampling=pb.SamplingParams(max_tokens=4, stop=["s%d" % i for i in
                                                                                              range(17)])),
         grpc.StatusCode.INVALID_ARGUMENT, "sampling.stop"),
        ("2,000 logit-bias entries", gen(c, prompt="Hi", sampling=pb.SamplingParams(
            max_tokens=4, logit_bias={i: 1.0 for i in range(2000)})), grpc.StatusCode.INVALID_ARGUMENT,
         "sampling.logit_bias"),
        ("a 5 MiB message", gen(c, prompt="a " * (5 << 19)), grpc.StatusCode.RESOURCE_EXHAUSTED, "limit"),
        ("a NUL in a Tokenize text", lambda: c.stub.Tokenize(pb.TokenizeRequest(text="a\0b"), timeout=10),
         grpc.StatusCode.INVALID_ARGUMENT, "text: a NUL"),
    ]
    for name, fn, code, needle in cases:
        ok, why = refused(fn, code, needle)
        hs.check("%s is refused: %s" % (name, why[:160]), ok)
    same, vwhy = v.same()
    hs.check("the victim beside the malformed requests: %s" % vwhy, same)


def test_deleted_record_put_back(sec):
    c, dw, ref = sec.c, sec.dw, sec.ref
    # etcd: a worker whose record someone deletes while its lease lives puts it back
    key = "/tandem/workers/decode/" + dw["id"]
    deleted = c.etcdctl("del", key, cert="router").stdout.strip()
    t0 = time.time()
    back = hs.wait_for(lambda: c.worker("decode") == dw, 10)
    hs.check("a decode worker's record deleted from etcd (%s deleted) is put back as it was, after %.1f s" %
             (deleted, time.time() - t0), deleted == "1" and back and time.time() - t0 < 3)
    ids, _ = hs.generate(c.stub, VICTIM, max_tokens=VICTIM_TOKENS)
    hs.check("the cluster serves afterwards, output identical", ids == ref)


def test_peer_quota(ref):
    peer_quota(ref)


def test_api_keys_grpc(ref):
    api_keys_grpc(ref)
