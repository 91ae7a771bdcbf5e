#!/usr/bin/env python3
"""Cluster suite: tandem on three hosts, made of network namespaces.

Three namespaces (`ip netns`) joined by veth pairs to one bridge are hosts
A (10.77.0.1), B (.2) and C (.3); the test's own namespace reaches them on
the bridge (.254). Certificates name those hosts (`tandem certs --hosts`).
A runs etcd and the router (`tandem up --address 10.77.0.1 --run-workers no
--kvstores 0`, the public API under mutual TLS too); B and C each run a node
agent (`tandem up --join`), which runs a kvstore node and its share of the
workers: the prefill worker lands on B and the decode worker on C, so every
KV block crosses hosts. UCX is held to TCP on eth0 (UCX_TLS=tcp: the
namespaces share one kernel, and shared memory would not cross real hosts).

Checks: greedy output identical to single-process `tandem generate`, with the
KV crossing hosts (the prefill worker's Stats count the bytes it put); every
process advertises its host's address; a client without a certificate is
refused by every gRPC and etcd port of every host, and answered 403 by
every HTTPS listener (metrics, the OpenAI API); then the faults, each
under load (a stream of requests from the test's namespace), each counted as
completed / failed with a clear error / hung / lost with the time to
recover: kill -9 of each process type, B's link cut and restored, etcd
stopped 30 s, and the router killed (a second router on A takes over
planning). The fault table goes to stdout and, with --fault-table FILE, to a file.
Run with pytest (tests/conftest.py says how), as root: it makes namespaces."""
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import threading
import time
import types

import pytest

import harness as hs

check = hs.check
pb, pbg = hs.pb, hs.pbg
BIN = hs.BIN
NET = "10.77.0"
HOSTS = {"A": NET + ".1", "B": NET + ".2", "C": NET + ".3"}
BR = "tdbr0"


def sh(*args, check_rc=True):
    r = subprocess.run(list(args), capture_output=True, text=True, timeout=30)
    if check_rc and r.returncode:
        raise AssertionError("%s: %s" % (" ".join(args), r.stderr.strip()))
    return r


def ns(h):
    return "td" + h


def net_down():
    for h in HOSTS:
        sh("ip", "netns", "del", ns(h), check_rc=False)
        sh("ip", "link", "del", "tdv" + h, check_rc=False)
    sh("ip", "link", "del", BR, check_rc=False)


def net_up():
    net_down()
    sh("ip", "link", "add", BR, "type", "bridge")
    sh("ip", "addr", "add", NET + ".254/24", "dev", BR)
    sh("ip", "link", "set", BR, "up")
    for h, addr in HOSTS.items():
        sh("ip", "netns", "add", ns(h))
        sh("ip", "link", "add", "tdv" + h, "type", "veth", "peer", "name", "eth0", "netns", ns(h))
        sh("ip", "link", "set", "tdv" + h, "master", BR)
        sh("ip", "link", "set", "tdv" + h, "up")
        sh("ip", "netns", "exec", ns(h), "ip", "addr", "add", addr + "/24", "dev", "eth0")
        sh("ip", "netns", "exec", ns(h), "ip", "link", "set", "eth0", "up")
        sh("ip", "netns", "exec", ns(h), "ip", "link", "set", "lo", "up")


class Host:
    """A `tandem up` on one host (namespace)."""

    def __init__(self, h, args, log_dir):
        self.h = h
        self.log = open(os.path.join(log_dir, "host-%s.log" % h), "a+")
        env = dict(os.environ, UCX_TLS="tcp")
        self.p = subprocess.Popen(["ip", "netns", "exec", ns(h), BIN + "/tandem", "up"] + args,
                                  stdout=subprocess.PIPE, stderr=self.log, text=True, env=env,
                                  start_new_session=True)

    def text(self):
        # through a file description of its own: self.log's offset is shared with the host's processes
        with open(self.log.name, errors="replace") as f:
            return f.read()

    def stop(self, sig=signal.SIGTERM, wait=40):
        if self.p.poll() is None:
            os.killpg(self.p.pid, sig)
            try:
                self.p.wait(wait)
            except subprocess.TimeoutExpired:
                os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait(10)
        return self.p.returncode


def etcd_json(c_certs, etcd, prefix):
    r = subprocess.run(["etcdctl", "--endpoints", "https://" + etcd, "--cacert", c_certs + "/ca.pem", "--cert",
                        c_certs + "/client.pem", "--key", c_certs + "/client.key", "--command-timeout", "5s", "get",
                        "--prefix", prefix, "--print-value-only"], capture_output=True, text=True, timeout=20,
                       env=dict(os.environ, ETCDCTL_API="3"))
    return [json.loads(ln) for ln in r.stdout.splitlines() if ln.startswith("{")]


def refuses_certless(addr, ca):
    """A TLS client that trusts the CA but shows no certificate: refused (handshake or first read fails)?"""
    host, port = addr.rsplit(":", 1)
    ctx = ssl.create_default_context(cafile=ca)
    ctx.check_hostname = False
    ctx.set_alpn_protocols(["h2"])
    try:
        with socket.create_connection((host, int(port)), timeout=5) as s:
            with ctx.wrap_socket(s) as t:
                # TLS 1.3: the server checks the client's (missing) certificate after the handshake;
                # its refusal arrives as an alert on the first read
                t.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
                t.settimeout(5)
                data = t.recv(1024)
                return not data, "answered %r" % data[:40]
    except (ssl.SSLError, ConnectionError, OSError) as e:
        return True, str(e)


class Load:
    """Requests one after another from the test's namespace (greedy, 16 tokens, 60 s deadline each), each
    recorded: ok, failed (code, message), hung (passed its deadline with nothing), with its end time."""

    def __init__(self, stub, n_threads=2):
        self.stub, self.recs, self.mu = stub, [], threading.Lock()
        self.threads = [threading.Thread(target=self.run, args=(k,), daemon=True) for k in range(n_threads)]
        self.done = False
        for t in self.threads:
            t.start()

    def run(self, k):
        i = 0
        while not self.done:
            i += 1
            t0 = time.time()
            rec = {"t0": t0, "status": "ok"}
            try:
                rq = pb.GenerateRequest(prompt="Host test %d.%d: the capital of France is" % (k, i),
                                        return_token_ids=True,
                                        sampling=pb.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
                n = 0
                for m in self.stub.Generate(rq, timeout=60):
                    n += len(m.token_ids)
                rec["tokens"] = n
            except hs.grpc.RpcError as e:
                code = e.code()
                rec["status"] = "hung" if code == hs.grpc.StatusCode.DEADLINE_EXCEEDED else "failed"
                rec["why"] = "%s: %s" % (code.name, e.details())
            rec["t1"] = time.time()
            with self.mu:
                self.recs.append(rec)
            if rec["status"] != "ok":
                time.sleep(0.2)

    def mark(self):
        with self.mu:
            return len(self.recs)

    def since(self, k):
        with self.mu:
            return list(self.recs[k:])

    def finish(self):
        self.done = True
        for t in self.threads:
            t.join(90)


def wait_ok_after(load, t, secs):
    """Seconds from t to the end of the first request started after t that succeeded, or None."""
    deadline = time.time() + secs
    while time.time() < deadline:
        for r in load.since(0):
            if r["t0"] >= t and r["status"] == "ok":
                return r["t1"] - t
        time.sleep(0.2)
    return None


@pytest.fixture(scope="module")
def h3():
    """The three hosts serving: A's etcd and router, B's and C's node agents with their workers and kvstore nodes.
    Their logs stay in h3.work when a check failed."""
    if os.geteuid() != 0:
        pytest.fail("the suite runs as root (it makes network namespaces): euid %d" % os.geteuid())
    work = tempfile.mkdtemp(prefix="tandem-hosts-")
    hosts = {}
    failed0 = len(hs.failed)
    try:
        net_up()
        certs = os.path.join(work, "tls")
        sh(BIN + "/tandem", "certs", "--dir", certs, "--hosts", ",".join(HOSTS.values()))
        cfg = os.path.join(work, "tandem.yaml")
        with open(cfg, "w") as f:
            f.write("model:\n  path: %s\n"
                    "router:\n  tls_cert: %s/router.pem\n  tls_key: %s/router.key\n  tls_client_ca: %s/ca.pem\n"
                    "  tls_ca: %s/ca.pem\n"
                    "transport:\n  interfaces: eth0\n"
                    "kvstore:\n  dram_mb: 256\n" % (os.path.abspath(hs.MODEL), certs, certs, certs, certs))
        t_start = time.time()
        hosts["A"] = Host("A", ["--config", cfg, "--address", HOSTS["A"], "--node", "hostA", "--certs", certs,
                                "--run-workers", "no", "--kvstores", "0", "--prefill", "1", "--decode", "1"], work)
        m, deadline = None, time.time() + 60
        while not m and time.time() < deadline and hosts["A"].p.poll() is None:
            m = re.search(r"etcd on (\S+),", hosts["A"].text())
            time.sleep(0.2)
        if not (m and m.group(1).startswith(HOSTS["A"] + ":")):
            pytest.fail("host A did not start etcd on its address: " + hosts["A"].text()[-800:])
        etcd = m.group(1)
        for h in "BC":  # every prompt to B's prefill worker, its KV to C's decode worker over TCP (PAIRS_ONLY)
            hosts[h] = Host(h, ["--join", etcd, "--config", cfg, "--address", HOSTS[h], "--node", "host" + h,
                                "--certs", certs, "--kvstores", "1", "--worker-arg", "--threads", "--worker-arg", "1"] +
                            hs.PAIRS_ONLY, work)
        line = ""
        deadline = time.time() + 120
        import select
        while not line and time.time() < deadline and hosts["A"].p.poll() is None:
            if select.select([hosts["A"].p.stdout], [], [], 1)[0]:
                line = hosts["A"].p.stdout.readline().strip()
        if not line.startswith(HOSTS["A"] + ":"):
            pytest.fail("the three-host cluster did not serve in 120 s: " + line + " | " + hosts["A"].text()[-1500:])
        endpoint = line
        rd = lambda n: open(os.path.join(certs, n), "rb").read()  # noqa: E731
        creds = hs.grpc.ssl_channel_credentials(rd("ca.pem"), rd("client.key"), rd("client.pem"))
        stub = pbg.TandemStub(hs.grpc.secure_channel(endpoint, creds))
        print("  the three-host cluster serves (router on A, workers on B and C) in %.0f s" % (time.time() - t_start))
        yield types.SimpleNamespace(hosts=hosts, work=work, certs=certs, etcd=etcd, endpoint=endpoint, creds=creds,
                                    stub=stub, rd=rd)
    finally:
        for h in ("B", "C", "A"):
            if h in hosts:
                hosts[h].stop()
        net_down()
        if len(hs.failed) == failed0:
            shutil.rmtree(work, ignore_errors=True)
        else:  # the hosts' logs (every process's stderr) stay for whoever reads the failure
            print("  the hosts' logs are kept in %s" % work)


def test_placement_and_addresses(h3):
    certs, etcd = h3.certs, h3.etcd
    workers = etcd_json(certs, etcd, "/tandem/workers/")
    stores = etcd_json(certs, etcd, "/tandem/kvstores/")
    where = {w["role"]: w["addr"].rsplit(":", 1)[0] for w in workers}
    check("the prefill worker runs on B and the decode worker on C (the planner's counts, split by the agents)",
          where == {"prefill": HOSTS["B"], "decode": HOSTS["C"]}, str(workers))
    check("every process advertises its host's address (workers, kvstore nodes, metrics)",
          sorted(s["addr"].rsplit(":", 1)[0] for s in stores) == [HOSTS["B"], HOSTS["C"]] and
          all(r["metrics"].startswith(r["addr"].rsplit(":", 1)[0] + ":") for r in workers + stores),
          str(stores))


def test_greedy_across_hosts(h3):
    stub, creds = h3.stub, h3.creds
    workers = etcd_json(h3.certs, h3.etcd, "/tandem/workers/")
    # greedy output against single-process generation
    prompts = hs.PROMPTS[:6]
    refs = [hs.reference(p) for p in prompts]
    got = [hs.generate(stub, p)[0] for p in prompts]
    same = sum(g == r for g, r in zip(got, refs))
    check("greedy output across hosts is identical to single-process generate (%d/%d prompts)" % (same, len(refs)),
          same == len(refs), str([(g[:5], r[:5]) for g, r in zip(got, refs) if g != r][:2]))
    pw = [w for w in workers if w["role"] == "prefill"][0]
    ch = hs.grpc.secure_channel(pw["addr"], creds)
    st = hs.wpbg.PrefillStub(ch).Stats(hs.wpb.StatsRequest(), timeout=5)
    ch.close()
    check("the KV crossed hosts: B's prefill worker put %.1f MiB into C's decode pool over TCP" %
          (st.transfer_bytes / 2**20), st.transfer_bytes > 0, str(st))


def test_certless_clients_refused(h3):
    certs, etcd, endpoint, work, rd, hosts = h3.certs, h3.etcd, h3.endpoint, h3.work, h3.rd, h3.hosts
    workers = etcd_json(certs, etcd, "/tandem/workers/")
    stores = etcd_json(certs, etcd, "/tandem/kvstores/")
    # certless clients: every gRPC and etcd port of every host
    ports = [endpoint, etcd] + [w["addr"] for w in workers] + [s["addr"] for s in stores]
    bad = []
    for a in ports:
        ok, why = refuses_certless(a, os.path.join(certs, "ca.pem"))
        if not ok:
            bad.append("%s %s" % (a, why))
    check("a client without a certificate is refused by each of the %d gRPC and etcd ports on the 3 hosts" %
          len(ports), not bad, "; ".join(bad))
    # the HTTP listeners: every process's metrics, and the router's OpenAI API
    routers = etcd_json(certs, etcd, "/tandem/routers/")
    m = re.search(r"HTTP API at (https://\S+)/v1", hosts["A"].text())
    urls = ["https://%s/metrics" % r["metrics"] for r in routers + workers + stores] + \
           ([m.group(1) + "/v1/models"] if m else [])
    certless = {u: hs.http_answer(u, hs.tls_context(certs, None)) for u in urls}
    with_cert = {u: hs.http_answer(u, hs.tls_context(certs)) for u in urls}
    check("the %d HTTPS listeners (every process's metrics, the router's OpenAI API) answer a certless client "
          "403 and a client of the cluster CA 200" % len(urls),
          m is not None and len(urls) == 6 and all(v.startswith("403: ") for v in certless.values()) and
          all(v == "200" for v in with_cert.values()), "%s | %s" % (certless, with_cert))
    # the same client with a certificate of its own CA
    other = os.path.join(work, "other")
    sh(BIN + "/tandem", "certs", "--dir", other, "--names", "client", "--hosts", NET + ".254")
    ocreds = hs.grpc.ssl_channel_credentials(rd("ca.pem"), open(other + "/client.key", "rb").read(),
                                             open(other + "/client.pem", "rb").read())
    try:
        pbg.TandemStub(hs.grpc.secure_channel(endpoint, ocreds)).Health(pb.HealthRequest(), timeout=5)
        refused = False
    except hs.grpc.RpcError:
        refused = True
    check("a client certificate of another CA is refused by the public API", refused)


def test_faults(h3, pytestconfig):
    faults(h3.hosts, h3.endpoint, h3.etcd, h3.certs, h3.stub, h3.work, pytestconfig.getoption("--fault-table"))


def pid_of(binary, addr, exclude=()):
    """The process running binary with addr in its arguments (but not one of exclude: host A runs two routers)."""
    # the binary first on the command line: a router's "--etcd 10.77.0.1:..." must not match etcd
    r = subprocess.run(["pgrep", "-f", "^([^ ]*/)?%s .*%s:" % (binary, re.escape(addr))], capture_output=True,
                       text=True)
    pids = [int(x) for x in r.stdout.split() if int(x) not in exclude]
    return pids[0] if pids else None


def health(stub):
    r = stub.Health(pb.HealthRequest(), timeout=5)
    return json.loads(r.detail)


def full(stub):
    try:
        h = health(stub)
        return h["prefill_workers"] == 1 and h["decode_workers"] == 1
    except hs.grpc.RpcError:
        return False


def faults(hosts, endpoint, etcd, certs, stub, work, results):
    cfg = os.path.join(work, "tandem.yaml")
    # a second router on A: it plans when the first dies
    rd = lambda n: open(os.path.join(certs, n), "rb").read()  # noqa: E731
    creds = hs.grpc.ssl_channel_credentials(rd("ca.pem"), rd("client.key"), rd("client.pem"))

    def second_router():
        log = open(os.path.join(work, "router2.log"), "w+")
        p = subprocess.Popen(["ip", "netns", "exec", ns("A"), BIN + "/tandem-router", "--config", cfg, "--model",
                              os.path.abspath(hs.MODEL), "--listen", HOSTS["A"] + ":0", "--http-listen", "",
                              "--etcd", etcd, "--cluster-ca", certs + "/ca.pem", "--cluster-cert",
                              certs + "/router.pem", "--cluster-key", certs + "/router.key", "--metrics-listen",
                              HOSTS["A"] + ":0"], stdout=log, stderr=log, start_new_session=True)
        m = None
        for _ in range(150):
            log.seek(0)
            m = re.search(r"on port (\d+)", log.read())
            if m:
                break
            time.sleep(0.2)
        st = pbg.TandemStub(hs.grpc.secure_channel("%s:%s" % (HOSTS["A"], m.group(1)), creds)) if m else None
        return p, st
    r2, stub2 = second_router()
    check("a second router starts on A", stub2 is not None and hs.wait_for(lambda: full(stub2), 30))

    load = Load(stub)
    time.sleep(5)
    rows = []

    def row(name, do, undo=None, hold=0.0, expect_serving=False):
        k = load.mark()
        t = time.time()
        note = do() or ""
        if hold:
            time.sleep(hold)
        t_undo = time.time()
        if undo:
            undo()
        # recovered: the membership whole again and a request started after the fault's end served
        rec = None
        deadline = time.time() + 90
        while time.time() < deadline:
            if full(stub) and any(r["t0"] >= t_undo and r["status"] == "ok" for r in load.since(k)):
                rec = time.time() - t_undo
                break
            time.sleep(0.2)
        time.sleep(2)
        recs = [r for r in load.since(k)]
        done = [r for r in recs if r["status"] == "ok" and r.get("tokens") == 16]
        lost = [r for r in recs if r["status"] == "ok" and r.get("tokens") != 16]
        failed = [r for r in recs if r["status"] == "failed"]
        hung = [r for r in recs if r["status"] == "hung"]
        during = [r for r in recs if r["t0"] < t_undo]
        served_during = sum(1 for r in during if r["status"] == "ok")
        whys = sorted({re.sub(r"\d+", "N", r["why"])[:110] for r in failed})
        rows.append({"fault": name, "requests": len(recs), "completed": len(done), "failed": len(failed),
                     "hung": len(hung), "lost": len(lost), "served_during": served_during,
                     "recovery_s": round(rec, 1) if rec is not None else None, "errors": whys, "note": note})
        check("%s: %d requests, %d completed, %d failed with a clear error, 0 hung, 0 lost, recovered in %s s" %
              (name, len(recs), len(done), len(failed), "%.1f" % rec if rec is not None else "never"),
              not hung and not lost and rec is not None and all(r.get("why") for r in failed) and
              (not expect_serving or served_during > 0),
              "hung %s lost %s served during %d errors %s" % (hung[:2], lost[:2], served_during, whys))

    def kill(binary, h):
        pid = pid_of(binary, HOSTS[h])
        os.kill(pid, signal.SIGKILL)
        return "pid %d" % pid

    row("kill -9 prefill worker (host B)", lambda: kill("tandem-prefill", "B"))
    row("kill -9 decode worker (host C)", lambda: kill("tandem-decode", "C"))
    row("kill -9 kvstore node (host B)", lambda: kill("tandem-kvstore", "B"), expect_serving=True)
    row("kill -9 kvstore node (host C)", lambda: kill("tandem-kvstore", "C"), expect_serving=True)
    row("host B's link cut for 10 s, restored", lambda: sh("ip", "link", "set", "tdvB", "down") and None,
        lambda: sh("ip", "link", "set", "tdvB", "up"), hold=10)
    etcd_pid = pid_of("etcd", HOSTS["A"])
    # the membership settled before etcd stops: after the link cut the agents may still move a worker back to its
    # host (a fresh-clone run of session 47 stopped etcd while the prefill worker re-registered on B, and no
    # prefill worker was registered for the whole pause)
    settled, deadline = 0.0, time.time() + 60
    while settled < 8 and time.time() < deadline:
        settled = settled + 0.5 if full(stub) else 0.0
        time.sleep(0.5)
    row("etcd stopped (SIGSTOP) for 30 s", lambda: os.kill(etcd_pid, signal.SIGSTOP),
        lambda: os.kill(etcd_pid, signal.SIGCONT), hold=30, expect_serving=True)
    # the planner's router: whichever leads now (an etcd pause may have moved the lead)
    first_leads = health(stub)["planner"].get("leader")
    second_leads = health(stub2)["planner"].get("leader")
    t_kill = [0.0]

    def kill_router():
        t_kill[0] = time.time()
        if first_leads:
            pid = pid_of("tandem-router", HOSTS["A"], exclude=(r2.pid,))
            os.kill(pid, signal.SIGKILL)
            return "pid %d (the first router; tandem up on A restarts it)" % pid
        os.killpg(r2.pid, signal.SIGKILL)
        return "pid %d (the second router)" % r2.pid
    row("kill -9 the planner's router (host A)", kill_router)
    def leads(st):
        try:
            return bool(health(st)["planner"].get("leader"))
        except hs.grpc.RpcError:
            return False
    check("after the kill a router plans (the survivor, or the killed one restarted by its agent)",
          (first_leads or second_leads) and hs.wait_for(lambda: leads(stub) or leads(stub2), 30),
          "first leads %s, second leads %s" % (first_leads, second_leads))
    # the leader frozen (SIGSTOP: dead to etcd, and no agent restarts it): the other must take over
    took = None
    if r2.poll() is not None:  # the second router was the one killed: another, for the next check
        r2, stub2 = second_router()
    if stub2 and hs.wait_for(lambda: full(stub) and full(stub2), 30):
        frozen = pid_of("tandem-router", HOSTS["A"], exclude=(r2.pid,)) if leads(stub) else r2.pid
        other = stub2 if leads(stub) else stub
        t0 = time.time()
        os.kill(frozen, signal.SIGSTOP)
        if hs.wait_for(lambda: leads(other), 30):
            took = time.time() - t0
        os.kill(frozen, signal.SIGCONT)
    check("the other router takes over planning %s after the leader froze (etcd lease TTL 3 s)" %
          ("%.1f s" % took if took is not None else "never"), took is not None)
    load.finish()
    if r2.poll() is None:
        os.killpg(r2.pid, signal.SIGTERM)
    r2.wait(30)

    lines = ["| fault | requests | completed | failed (clear error) | hung | silently lost | served during the fault "
             "| recovery (s) | errors seen |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append("| %s | %d | %d | %d | %d | %d | %d | %s | %s |" % (
            r["fault"], r["requests"], r["completed"], r["failed"], r["hung"], r["lost"], r["served_during"],
            r["recovery_s"], "; ".join(r["errors"]) or "-"))
    lines.append("")
    lines.append("planner failover: with the leading router frozen (SIGSTOP), the other led after %s" %
                 ("%.1f s" % took if took is not None else "never"))
    table = "\n".join(lines)
    print(table)
    if results:
        with open(results, "w") as f:
            f.write(table + "\n")

