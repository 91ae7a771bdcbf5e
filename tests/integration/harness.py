"""The integration suites' common parts: the paths (the build's bin folder from
TANDEM_BIN, which tests/conftest.py sets from --bin), the Python gRPC stubs
generated here from our .proto files, single-process `tandem generate` as the
reference output, a cluster started with `tandem up`, and check(): one line
per check, PASS or FAIL; conftest.py fails the test a failed check was in."""
import json
import os
import random
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import re
import select

import grpc
from grpc_tools import protoc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.abspath(os.environ.get("TANDEM_BIN", os.path.join(ROOT, "build/bin")))
MODEL = os.path.join(ROOT, "models/SmolLM2-135M-Instruct.Q4_1.gguf")
PROMPTS = [
    "The capital of France is", "Once upon a time", "def fibonacci(n):", "The three primary colors are",
    "Water boils at", "My favourite book is", "In 1969, humans", "The quick brown fox", "To make a cake, you",
    "The largest planet in the solar system", "Python is a programming language that", "Dear hiring manager,",
    "The meaning of life is", "A haiku about autumn:", "Step 1: open the box.", "The sun rises in the",
    "SELECT name FROM users WHERE", "Photosynthesis converts", "The best way to learn", "Q: What is 2+2?\nA:",
    "Rust and C are both", "Mount Everest is",
]
MAX_TOKENS = 24
# Decode workers that prefill nothing themselves (decode.colocated false, over its default of true): the suites about
# the disaggregated path itself (reservations and leases, KV transfer, the store, a prefill worker's faults) pin
# every prompt to a prefill worker; the default (conditional disaggregation) is what the other suites run
PAIRS_ONLY = ["--worker-arg", "--colocated", "--worker-arg", "false"]

results = []  # every check's outcome, in order
failed = []  # the names of the failed ones


def check(name, ok, why=""):
    ok = bool(ok)
    results.append(ok)
    if not ok:
        failed.append(name)
    print(("PASS " if ok else "FAIL ") + name + ("" if ok else ": " + why), flush=True)


def gen_stubs():
    out = tempfile.mkdtemp(prefix="tandem-stubs-")
    for p in ["tandem/v1/tandem.proto", "tandem/internal/v1/worker.proto", "tandem/internal/v1/kvstore.proto"]:
        rc = protoc.main(["protoc", "-I" + os.path.join(ROOT, "proto"), "--python_out=" + out,
                          "--grpc_python_out=" + out, p])
        assert rc == 0, "protoc failed on " + p
    sys.path.insert(0, out)


gen_stubs()
from tandem.v1 import tandem_pb2 as pb  # noqa: E402
from tandem.v1 import tandem_pb2_grpc as pbg  # noqa: E402
from tandem.internal.v1 import worker_pb2 as wpb  # noqa: E402
from tandem.internal.v1 import worker_pb2_grpc as wpbg  # noqa: E402


SEEDED = dict(temperature=0.9, top_p=0.95, seed=1234)


def reference(prompt, max_tokens=MAX_TOKENS, seeded=False):
    """Cold single-process `tandem generate` (on 2 threads: a row's numbers do not depend on how the rows are split
    between threads, and the cluster's workers run 1 each)."""
    extra = ["--temperature", str(SEEDED["temperature"]), "--top-p", str(SEEDED["top_p"]), "--seed",
             str(SEEDED["seed"])] if seeded else []
    out = subprocess.run(["timeout", "120", BIN + "/tandem", "generate", "--model", MODEL, "--ids", "--threads", "2",
                          "--max-tokens", str(max_tokens), "--ignore-eos"] + extra + [prompt],
                         capture_output=True, text=True, check=True).stdout
    return [int(x) for x in out.split()]


def reference_text(prompt, max_tokens, seeded=False):
    extra = ["--temperature", str(SEEDED["temperature"]), "--top-p", str(SEEDED["top_p"]), "--seed",
             str(SEEDED["seed"])] if seeded else []
    return subprocess.run(["timeout", "120", BIN + "/tandem", "generate", "--model", MODEL, "--threads", "2",
                           "--max-tokens", str(max_tokens), "--ignore-eos"] + extra + [prompt],
                          capture_output=True, check=True).stdout.decode()[:-1]  # generate ends with a newline


class Cluster:
    def __init__(self, config=None, creds=None, extra=(), model=MODEL):
        # append mode: the cluster's processes share this file's offset with us, and a write landing after
        # our seek(0) to read it would otherwise overwrite the log's first lines
        self.err = open(tempfile.mktemp(prefix="tandem-up-", suffix=".log"), "a+")
        # idle UCX connections are closed after 3 s (transport.peer_idle_s, 60 by default), so the suite can see it
        self.p = subprocess.Popen([BIN + "/tandem", "up", "--model", model, "--worker-arg", "--threads",
                                   "--worker-arg", "1", "--worker-arg", "--peer-idle-s", "--worker-arg", "3"] +
                                  (["--config", config] if config else []) + list(extra),
                                  stdout=subprocess.PIPE, stderr=self.err, text=True, start_new_session=True)
        line = ""
        deadline = time.time() + 90
        while not line and time.time() < deadline and self.p.poll() is None:  # a start that hangs fails, not hangs
            if select.select([self.p.stdout], [], [], max(0.0, deadline - time.time()))[0]:
                line = self.p.stdout.readline().strip()
        log = self.log()
        m = re.search(r"etcd on (\S+),", log)
        if not re.fullmatch(r"[\d.]+:\d+", line) or not m:
            # a failed start stops what it started (its processes would outlive the suite otherwise)
            os.killpg(self.p.pid, signal.SIGKILL)
            self.p.wait(30)
            # one line, so that the suite's summary carries the log's end too
            raise AssertionError("tandem up printed %s (exit %s): %r; its log ends: %s" %
                                 ("no etcd address" if m is None and line else "no endpoint in 90 s",
                                  self.p.returncode, line, " | ".join(log[-3000:].splitlines()[-8:])))
        self.endpoint = line
        self.etcd = m.group(1)
        # the internal planes are mutual TLS: tandem up's throwaway CA and its client pair
        m = re.search(r"certificates in (\S+) ", log)
        self.certs = m.group(1) if m else None
        # what tandem up hands to tools: the CA and the client pair alone; and its router's administrator key
        m = re.search(r"for tools such as etcdctl: (\S+) ", log)
        self.client_certs = m.group(1) if m else None
        m = re.search(r"administrator key \(tandem scale --admin-key\) in (\S+)", log)
        self.admin_key = m.group(1) if m else None
        self.ch = grpc.secure_channel(self.endpoint, creds) if creds else grpc.insecure_channel(self.endpoint)
        self.stub = pbg.TandemStub(self.ch)

    def log(self):
        """What the cluster's processes have written to stderr so far. Read through a file description of its own:
        self.err's offset is shared with the children, whose appends move it to the end between a seek and a read."""
        with open(self.err.name, errors="replace") as f:
            return f.read()

    def etcdctl(self, *args, cert="client"):
        """etcdctl against the cluster's etcd, showing certificate `cert` of tandem up's folder (None: none)."""
        tls = ["--cacert", self.certs + "/ca.pem"] if self.certs else []
        if self.certs and cert:
            tls += ["--cert", "%s/%s.pem" % (self.certs, cert), "--key", "%s/%s.key" % (self.certs, cert)]
        ep = ("https://" if self.certs else "http://") + self.etcd
        return subprocess.run(["etcdctl", "--endpoints", ep, "--command-timeout", "5s"] + tls + list(args),
                              capture_output=True, text=True, env=dict(os.environ, ETCDCTL_API="3"), timeout=20)

    def channel(self, addr, cert="client"):
        """A channel to an internal plane (a worker), with tandem up's client certificate."""
        if not self.certs:
            return grpc.insecure_channel(addr)
        rd = lambda n: open(os.path.join(self.certs, n), "rb").read()  # noqa: E731
        creds = grpc.ssl_channel_credentials(rd("ca.pem"), rd(cert + ".key") if cert else None,
                                             rd(cert + ".pem") if cert else None)
        return grpc.secure_channel(addr, creds)

    def pids(self):
        """The processes of the cluster: `tandem up` and everything below it."""
        out, todo = [], [self.p.pid]
        while todo:
            pid = todo.pop()
            out.append(pid)
            todo += [int(p) for p in os.listdir("/proc") if p.isdigit() and proc_state(int(p))[1] == pid]
        return out

    def tls_args(self, name):
        """The flags that give a process started by hand (not by tandem up) certificate `name` of the cluster."""
        if not self.certs:
            return []
        return ["--cluster-ca", self.certs + "/ca.pem", "--cluster-cert", "%s/%s.pem" % (self.certs, name),
                "--cluster-key", "%s/%s.key" % (self.certs, name)]

    def workers(self):
        out = self.etcdctl("get", "--prefix", "/tandem/workers/", "--print-value-only").stdout
        return [json.loads(l) for l in out.splitlines() if l.startswith("{")]

    def worker(self, role):
        ws = [w for w in self.workers() if w["role"] == role and w["contract"]["block_tokens"] == 16]
        return ws[0] if ws else None

    def stats(self, w):
        ch = self.channel(w["addr"])
        stub = (wpbg.PrefillStub if w["role"] == "prefill" else wpbg.DecodeStub)(ch)
        r = stub.Stats(wpb.StatsRequest(), timeout=5)
        ch.close()
        return r

    def health(self):
        r = self.stub.Health(pb.HealthRequest(), timeout=5)
        return r.status == pb.HealthResponse.STATUS_SERVING, json.loads(r.detail)

    def unclean(self):
        """What tandem up said of a process that did not stop cleanly (its log's lines)."""
        return [l for l in self.log().splitlines() if "while stopping" in l or "did not stop in time" in l]

    def stop(self):
        self.ch.close()
        os.killpg(self.p.pid, signal.SIGTERM)
        try:
            self.p.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.p.pid, signal.SIGKILL)
            self.p.wait()
        return self.p.returncode


def generate(stub, prompt, max_tokens=MAX_TOKENS, timeout=120, ignore_eos=True, on_token=None):
    """A streamed generation's token ids and last response; on_token() is called as each response with tokens
    arrives."""
    rq = pb.GenerateRequest(prompt=prompt, return_token_ids=True,
                            sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos))
    ids, last = [], None
    for r in stub.Generate(rq, timeout=timeout):
        ids.extend(r.token_ids)
        last = r
        if on_token and r.token_ids:
            on_token()
    return ids, last


def tls_context(certs, cert="client"):
    """Checks the server against certs/ca.pem and shows certificate `cert` of that folder (None: none)."""
    ctx = ssl.create_default_context(cafile=certs + "/ca.pem")
    if cert:
        ctx.load_cert_chain("%s/%s.pem" % (certs, cert), "%s/%s.key" % (certs, cert))
    return ctx


def http_answer(url, ctx=None):
    """How an HTTP(S) listener answers a GET: "200", "403: its reason", or "refused: the error"."""
    try:
        with urllib.request.urlopen(url, timeout=10, context=ctx) as r:
            return str(r.status)
    except urllib.error.HTTPError as e:
        return "%d: %s" % (e.code, e.read().decode(errors="replace").strip()[:200])
    except (urllib.error.URLError, OSError) as e:
        return "refused: %s" % e


def free_port():
    """A loopback port to listen on, drawn outside the kernel's range for outgoing connections (as `tandem up`
    draws its own): a port the kernel gave out by binding 0 could be taken by another process's outgoing
    connection before the listener that was told it binds it."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        lo, hi = map(int, f.read().split())
    spans = [(a, b) for a, b in ((10000, lo - 1), (hi + 1, 65535)) if b > a]
    for _ in range(200):
        a, b = random.choice(spans)
        p = random.randint(a, b)
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", p))
            return p
        except OSError:
            continue
        finally:
            s.close()
    raise RuntimeError("no free loopback port outside %d-%d" % (lo, hi))


WORDS = ("the of and to in is was for on that with as by at from his her it an were are which this be or has had "
         "not but one all new first after their also two who they more its time when city year would been").split()


def words(n, rng):
    """n common English words drawn with rng, each after a space: prompts of about n tokens."""
    return "".join(" " + rng.choice(WORDS) for _ in range(n))


def wait_for(pred, secs):
    t0 = time.time()
    while time.time() - t0 < secs:
        try:
            if pred():
                return True
        except Exception:
            pass
        time.sleep(0.1)
    return False


def proc_state(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            st = f.read().rsplit(")", 1)[1].split()
        return st[0], int(st[1])  # state, parent pid
    except OSError:
        return None, None


def router_pid(c):
    """The pid of cluster c's tandem-router."""
    for p in os.listdir("/proc"):
        if p.isdigit() and proc_state(int(p))[1] == c.p.pid:
            try:
                if b"tandem-router" in open("/proc/%s/cmdline" % p, "rb").read():
                    return int(p)
            except OSError:
                pass
    return None


def proc_status(pid):
    """(threads, RSS in MiB) of pid."""
    out = {}
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            k, _, v = line.partition(":")
            out[k] = v.strip()
    return int(out["Threads"]), int(out["VmRSS"].split()[0]) / 1024.0
