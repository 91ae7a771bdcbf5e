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
- a worker's etcd record deleted by someone else: put back under its lease.

Usage: test_security.py BUILD_BIN_DIR  (run from the repository root)."""
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_cluster as tc  # noqa: E402  (stubs, Cluster, the model path)

import grpc  # noqa: E402

pb, wpb, wpbg = tc.pb, tc.wpb, tc.wpbg
VICTIM = tc.PROMPTS[0]
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
            self.ids = tc.generate(self.c.stub, VICTIM, max_tokens=VICTIM_TOKENS)[0]
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
    c = tc.Cluster(extra=["--worker-arg", "--kv-mib", "--worker-arg", "440"])
    try:
        tc.wait_for(lambda: c.health()[0], 60)
        dw = c.worker("decode")
        ct = wpb.KvContract(**dw["contract"])
        subprocess.run([tc.BIN + "/tandem", "certs", "--dir", c.certs, "--names", "router-b"], check=True,
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
        ids, _ = tc.generate(c.stub, VICTIM, max_tokens=VICTIM_TOKENS)
        tc.check("a second router certificate holds %d reservations of a %d-block pool; its next is refused (%s); "
                 "the router's own request beside it is served, identical" % (held, blocks, why),
                 ok and blocks > 1024 + 8 and ids == ref)
        ch.close()
    finally:
        c.stop()


def main():
    ref = tc.reference(VICTIM, VICTIM_TOKENS)
    c = tc.Cluster()
    try:
        tc.wait_for(lambda: c.health()[0], 60)
        dw, pw = c.worker("decode"), c.worker("prefill")
        ct = wpb.KvContract(**dw["contract"])
        # the data-plane attacks below use the router's certificate: the strongest peer there is
        dch, pch = c.channel(dw["addr"], cert="router"), c.channel(pw["addr"], cert="router")
        dstub, pstub = wpbg.DecodeStub(dch), wpbg.PrefillStub(pch)
        blocks = c.stats(dw).kv_blocks

        # the internal planes: every RPC without TLS, without a client certificate, with another CA's
        other = tempfile.mkdtemp(prefix="tandem-other-ca-")
        subprocess.run([tc.BIN + "/tandem", "certs", "--dir", other, "--names", "client"], check=True,
                       capture_output=True)
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
            tc.check("every internal RPC (8) with %s is refused%s" % (how, "; not: " + "; ".join(bad) if bad else ""),
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
        tc.check("with a cluster certificate that is not the router's, every internal RPC but Stats is refused "
                 "PERMISSION_DENIED naming it, Stats answers%s" % ("; not: " + "; ".join(bad) if bad else ""), not bad)
        same, vwhy = v.same()
        tc.check("the victim beside them: %s" % vwhy, same)

        # etcd: a fake prefill record and a delete of the decode worker's, without the cluster's certificate
        fake = '{"id":"evil","role":"prefill","addr":"127.0.0.1:1","pid":1,"contract":%s}' % \
            tc.json.dumps(pw["contract"])
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
            tc.check("etcd with %s: put refused (rc %d), delete refused (rc %d); the members are still %s" %
                     (how, put.returncode, dele.returncode, ids),
                     put.returncode != 0 and dele.returncode != 0 and "evil" not in ids and dw["id"] in ids)

        # every listening socket on loopback
        socks = listening(c.pids())
        off = [s for s in socks if s[1] not in ("127.0.0.1", "::1")]
        tc.check("every listening socket of the cluster's processes is on loopback (%d sockets%s)" %
                 (len(socks), "; not: %s" % off if off else ""), socks and not off)

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
        cases = [("a landing offset of 2^40", far, grpc.StatusCode.PERMISSION_DENIED, "signature is not"),
                 ("another reservation's blocks under this one's grant", theirs, grpc.StatusCode.PERMISSION_DENIED,
                  "signature is not"),
                 ("an unsigned landing", unsigned, grpc.StatusCode.PERMISSION_DENIED, "not signed"),
                 ("another CA's signature", sign_as(other, "client", theirs), grpc.StatusCode.PERMISSION_DENIED,
                  "not one the cluster CA signed"),
                 ("the signature of a cluster certificate that is not a decode worker's",
                  sign_as(c.certs, "client", theirs), grpc.StatusCode.PERMISSION_DENIED, 'not a decode')]
        for how, landing, code, needle in cases:
            ok, why = refused(attempt(landing), code, needle)
            tc.check("%s is refused by the prefill worker (%s)" % (how, why), ok)
        stale = dstub.Reserve(wpb.ReserveRequest(n_tokens=16, max_tokens=1, contract=ct, landing_ms=50), timeout=5)
        time.sleep(0.3)
        ok2, why2 = refused(attempt(stale.landing), grpc.StatusCode.DEADLINE_EXCEEDED, "land-by")
        tc.check("a true grant whose land-by time has passed is refused (%s)" % why2, ok2)
        # the router's acknowledged cancel before the Prefill arrives: the Prefill is refused when it comes
        early = dstub.Reserve(wpb.ReserveRequest(n_tokens=16, max_tokens=1, contract=ct, lease_ms=5000), timeout=5)
        ack = pstub.Cancel(wpb.CancelPrefillRequest(reservation_id=early.landing.reservation_id,
                                                    land_by_unix_ms=early.landing.land_by_unix_ms), timeout=5)
        ok3, why3 = refused(attempt(early.landing), grpc.StatusCode.CANCELLED, "before it began")
        tc.check("a Prefill arriving after the router's Cancel of its reservation (answered, found=%s) is refused "
                 "(%s)" % (ack.found, why3), ok3 and not ack.found)
        dstub.Release(wpb.ReleaseRequest(reservation_id=early.landing.reservation_id, landing_closed=True), timeout=5)
        same, vwhy = v.same()
        tc.check("the victim beside the landing attacks: %s" % vwhy, same)

        # fences: a release whose landing is not closed keeps the blocks until land-by, a closed one frees them
        for x in (other_res, r, stale):
            dstub.Release(wpb.ReleaseRequest(reservation_id=x.landing.reservation_id, landing_closed=True), timeout=5)
        tc.wait_for(lambda: c.stats(dw).fenced_blocks == 0 and c.stats(dw).reservations == 0, 5)
        base = c.stats(dw).kv_in_use
        f = dstub.Reserve(wpb.ReserveRequest(n_tokens=64, max_tokens=1, contract=ct, landing_ms=2000), timeout=5)
        dstub.Release(wpb.ReleaseRequest(reservation_id=f.landing.reservation_id), timeout=5)
        st = c.stats(dw)
        fenced, in_use = st.fenced_blocks, st.kv_in_use - base
        t0 = time.time()
        back = tc.wait_for(lambda: c.stats(dw).fenced_blocks == 0, 10)
        waited = time.time() - t0
        tc.check("released with its landing open: %d blocks fenced (%d still out of the pool), back after %.1f s "
                 "(land-by 2 s + 1 s margin)" % (fenced, in_use, waited),
                 fenced == 4 and in_use == 4 and back and 1.0 < waited < 5)

        # a prefill worker frozen mid-prefill (SIGSTOP) past its request's deadline: the router gives the
        # reservation up (its Cancel unanswered), the decode worker keeps the blocks out of the pool until
        # land-by, and the worker, resumed after land-by, drops its late puts instead of writing into blocks
        # that may be someone else's by then
        long_prompt = " ".join("word%d" % (i % 97) for i in range(700))  # ~2,000 tokens: seconds of prefill here
        err = []
        def slow():  # noqa: E306
            try:
                list(c.stub.Generate(pb.GenerateRequest(prompt=long_prompt, sampling=pb.SamplingParams(max_tokens=1)),
                                     timeout=2.0))
                err.append("completed")
            except grpc.RpcError as e:
                err.append(e.code().name if e.code() != grpc.StatusCode.INVALID_ARGUMENT else e.details())
        idle = c.stats(dw).kv_in_use
        dropped0 = c.stats(pw).late_puts_dropped
        t = threading.Thread(target=slow)
        t0 = time.time()
        t.start()
        time.sleep(0.4)
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
        back = tc.wait_for(lambda: c.stats(dw).fenced_blocks == 0 and c.stats(dw).kv_in_use == idle, 10)
        tc.check("a prefill worker frozen past its request's deadline (%s): its %d landing blocks kept out of the "
                 "pool past the deadline, %d late puts dropped after it resumed, the blocks back (%s)" %
                 (err, held, dropped, back), err == ["DEADLINE_EXCEEDED"] and held > 0 and dropped > 0 and back)
        tc.wait_for(lambda: c.health()[0] and c.worker("prefill") is not None, 30)
        v = Victim(c, ref)
        same, vwhy = v.same()
        tc.check("after it resumed, a request through it: %s" % vwhy, same)

        # reservations: a wrap-around size, a pool-sized one without a lease, ids
        v = Victim(c, ref)
        ok, why = refused(lambda: dstub.Reserve(wpb.ReserveRequest(n_tokens=(1 << 32) - 1, max_tokens=1, contract=ct),
                                                timeout=5), grpc.StatusCode.INVALID_ARGUMENT, "n_tokens")
        same, vwhy = v.same()
        held = c.stats(dw).reservations  # once the victim's own reservation was claimed
        tc.check("a Reserve of 2^32-1 tokens is refused (%s), nothing held (%d)" % (why, held), ok and held == 0)
        tc.check("the victim beside it: %s" % vwhy, same)
        big = dstub.Reserve(wpb.ReserveRequest(n_tokens=blocks * 16 * 3 // 4, max_tokens=1, contract=ct), timeout=5)
        ids = [big.landing.reservation_id] + [
            dstub.Reserve(wpb.ReserveRequest(n_tokens=1, max_tokens=1, contract=ct, lease_ms=500),
                          timeout=5).landing.reservation_id for _ in range(3)]
        t0 = time.time()
        back = tc.wait_for(lambda: c.stats(dw).reservations == 0, 10)
        tc.check("a pool-sized Reserve without a lease is returned after %.1f s (the default lease is 3 s)" %
                 (time.time() - t0), back and time.time() - t0 < 5)
        steps = [abs(b - a) for a, b in zip(ids, ids[1:])]
        tc.check("reservation ids are not guessable from one another (%s)" % ids, min(steps) > 1 << 20)

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
            tc.check("%s is refused: %s" % (name, why[:160]), ok)
        same, vwhy = v.same()
        tc.check("the victim beside the malformed requests: %s" % vwhy, same)
        # etcd: a worker whose record someone deletes while its lease lives puts it back
        key = "/tandem/workers/decode/" + dw["id"]
        deleted = c.etcdctl("del", key).stdout.strip()
        t0 = time.time()
        back = tc.wait_for(lambda: c.worker("decode") == dw, 10)
        tc.check("a decode worker's record deleted from etcd (%s deleted) is put back as it was, after %.1f s" %
                 (deleted, time.time() - t0), deleted == "1" and back and time.time() - t0 < 3)
        ids, _ = tc.generate(c.stub, VICTIM, max_tokens=VICTIM_TOKENS)
        tc.check("the cluster serves afterwards, output identical", ids == ref)
        dch.close()
        pch.close()
    finally:
        c.stop()
    peer_quota(ref)
    print("security: %d passed, %d failed" % (sum(tc.results), len(tc.results) - sum(tc.results)))
    return 0 if all(tc.results) else 1


if __name__ == "__main__":
    sys.exit(main())
