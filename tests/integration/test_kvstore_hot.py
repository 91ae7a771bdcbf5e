#!/usr/bin/env python3
"""Hot-block replication in the KV store (kvstore/server.c), on real nodes:
a real etcd, three tandem-kvstore processes on loopback, and
`tandem-bench-kvstore hot`, which puts one chain of blocks and reads it at a
high rate with the client library the workers use, one reader per node, each
with that node as its near node (what `tandem up` gives each prefill worker).
The nodes run with hot_hits 4 and a 2 s half-life so that a test sees blocks
heat and cool in seconds (the defaults are 8 and 30 s).

- replicas_max 1: every block gets exactly one copy on another node (the cap),
  every read is a full-chain hit with the bytes put, every node serves reads; after the load
  stops the copies cool and are dropped, the homes keep theirs.
- replicas_max 2: every node holds every block (its own and two copies) and
  the reads spread evenly (each reader reads its near node);
  kill -9 of a node while the copies exist: after its etcd record goes, all
  three readers (the one near the dead node too) still read the whole chain.
The planes run plaintext here: the store's mutual TLS is test_kvstore.py's.
Run with pytest (tests/conftest.py says how)."""
import json
import shutil
import signal
import subprocess
import tempfile
import time

from harness import BIN, check, free_port

BLOCKS = 24


def wait_for(fn, timeout):
    end = time.time() + timeout
    while time.time() < end:
        v = fn()
        if v:
            return v
        time.sleep(0.2)
    return fn()


class Store:
    def __init__(self, replicas_max):
        self.dir = tempfile.mkdtemp(prefix="tandem-kvhot-")
        cp, pp = free_port(), free_port()
        self.ep = "127.0.0.1:%d" % cp
        etcd = shutil.which("etcd") or "/usr/local/bin/etcd"
        self.etcd = subprocess.Popen(
            [etcd, "--name", "t", "--data-dir", self.dir + "/etcd", "--listen-client-urls", "http://" + self.ep,
             "--advertise-client-urls", "http://" + self.ep, "--listen-peer-urls", "http://127.0.0.1:%d" % pp,
             "--initial-advertise-peer-urls", "http://127.0.0.1:%d" % pp,
             "--initial-cluster", "t=http://127.0.0.1:%d" % pp, "--log-level", "error"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.nodes = {}
        for i in range(3):
            nid = "kv-%d" % i
            log = open("%s/%s.log" % (self.dir, nid), "w")
            self.nodes[nid] = subprocess.Popen(
                [BIN + "/tandem-kvstore", "--plaintext", "true", "--etcd", self.ep, "--id", nid, "--dram-mb", "64",
                 "--lease-ttl", "2", "--replicas-max", str(replicas_max), "--hot-hits", "4",
                 "--hit-half-life-s", "2"], stdout=log, stderr=subprocess.STDOUT)
        wait_for(lambda: len(self.stats()) == 3, 30)

    def stats(self):
        r = subprocess.run([BIN + "/tandem", "kvstore-status", "--etcd", self.ep, "--json"], capture_output=True,
                           text=True, timeout=30)
        return {j["id"]: j for j in (json.loads(l) for l in r.stdout.splitlines() if l.startswith("{"))}

    def hot(self, seconds):
        return subprocess.Popen([BIN + "/tandem-bench-kvstore", "hot", self.ep, ",".join(sorted(self.nodes)),
                                 str(BLOCKS), str(seconds)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True)

    def log(self, nid):
        with open("%s/%s.log" % (self.dir, nid)) as f:
            return f.read()

    def stop(self):
        codes = {}
        for nid, p in self.nodes.items():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for nid, p in self.nodes.items():
            try:
                codes[nid] = p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                codes[nid] = "hung"
        self.etcd.terminate()
        self.etcd.wait(30)
        shutil.rmtree(self.dir, ignore_errors=True)
        return codes


def read_phase(h, timeout=60):
    """The bench's next JSON line (phase results), within timeout seconds."""
    import select
    end = time.time() + timeout
    while time.time() < end:
        r, _, _ = select.select([h.stdout], [], [], max(0.1, end - time.time()))
        if r:
            line = h.stdout.readline()
            if not line:
                return None
            if line.startswith("{"):
                return json.loads(line)
    return None


def full_share(phase):
    """The smallest share of full-chain reads among the readers; 0 if any block read differed from what was put."""
    if not phase or not phase["readers"] or any(r["blocks_differ"] for r in phase["readers"]):
        return 0.0
    return min(r["full"] / r["reads"] for r in phase["readers"])


def test_one_replica():
    s = Store(1)
    try:
        h = s.hot(4)
        st = read_phase(h)
        check("replicas_max 1: the chain stored (%s)" % st, st and st["stored"] == BLOCKS)
        p1 = read_phase(h)
        now = s.stats()
        reps = sum(n["replicas"] for n in now.values())
        hits = {k: n["hits"] for k, n in now.items()}
        check("replicas_max 1: every block got exactly one copy on another node (%d replicas for %d blocks; "
              "pushed %s)" % (reps, BLOCKS, [n["replicas_pushed"] for n in now.values()]), reps == BLOCKS)
        check("... every read by the three readers was a full-chain hit (%s)" % p1,
              p1 and full_share(p1) == 1.0 and min(r["reads"] for r in p1["readers"]) >= 20)
        total = sum(hits.values())
        check("... and every node served reads (hits %s, each >= 5%%)" % hits, total and min(hits.values()) >= 0.05 * total)
        h.stdin.write("\n")
        h.stdin.flush()
        read_phase(h)
        h.wait(30)
        cooled = wait_for(lambda: (lambda st: sum(n["replicas"] for n in st.values()) == 0 and st)(s.stats()), 30)
        check("after the load stopped the copies cooled and were dropped (%s)" %
              ({k: (n["replicas"], n["replicas_dropped"]) for k, n in (cooled or s.stats()).items()}),
              cooled and sum(n["replicas_dropped"] for n in cooled.values()) == BLOCKS)
        check("... the homes kept their own blocks (%d blocks held)" %
              sum(t["blocks"] for n in s.stats().values() for t in n["tiers"]),
              sum(t["blocks"] for n in s.stats().values() for t in n["tiers"]) == BLOCKS)
    finally:
        codes = s.stop()
        check("the nodes stop cleanly (%s)" % codes, all(c == 0 for c in codes.values()))


def test_kill_home():
    s = Store(2)
    try:
        h = s.hot(4)
        read_phase(h)
        p1 = read_phase(h)
        now = s.stats()
        per = {k: (n["replicas"], sum(t["blocks"] for t in n["tiers"])) for k, n in now.items()}
        check("replicas_max 2: every node holds every block, its own and copies (replicas, blocks per node: %s)" %
              per, all(b == BLOCKS for _, b in per.values()) and sum(r for r, _ in per.values()) == 2 * BLOCKS)
        check("... full-chain hits for every reader (%s)" % p1, p1 and full_share(p1) == 1.0)
        hits = {k: n["hits"] for k, n in now.items()}
        total = sum(hits.values())
        check("... and the reads spread evenly over the three nodes (hits %s, each >= 25%%)" % hits,
              total and min(hits.values()) >= 0.25 * total)
        victim = "kv-0"
        s.nodes[victim].kill()
        s.nodes[victim].wait(10)
        gone = wait_for(lambda: victim not in s.stats() and len(s.stats()) == 2, 30)
        check("kill -9 of %s: its etcd record is gone" % victim, gone)
        h.stdin.write("\n")
        h.stdin.flush()
        p2 = read_phase(h)
        h.wait(30)
        check("... hits continue: every reader, the one near %s too, reads the whole chain from the copies (%s)" %
              (victim, p2), p2 and full_share(p2) == 1.0 and min(r["reads"] for r in p2["readers"]) >= 20)
    finally:
        codes = s.stop()
        check("the surviving nodes stop cleanly (%s)" % {k: v for k, v in codes.items() if k != "kv-0"},
              all(c == 0 for k, c in codes.items() if k != "kv-0"))

