#!/usr/bin/env python3
"""Cluster suite: the order a prefill worker computes its waiting prompts in
(prefill.queue: fcfs, cache, mlq; engine/sched.h), on real clusters
(`tandem up`, 1 prefill + 1 decode CPU worker, no KV store: what the
worker does not hold it computes).

- Hot prefixes: four 300-token prefixes, five questions on each, sent at once
  in interleaved order to a prefill worker whose pool holds about three
  prefixes. fcfs computes them in arrival order, so each prefix is evicted
  before its next question comes; the cache order takes the questions on a
  prefix it holds first, and lets a question wait a step for the prefix
  another prompt is computing. The prefill worker's count of prompt tokens it
  computed (Stats.prompt_tokens_computed) must be lower in the cache order,
  and every answer the same in both and equal to single-process output.
- A flood of long prompts beside short chats: the chats' TTFT alone is
  measured first (10 of them, one at a time), then with the flood under way
  (20, each sent at its time); under mlq (a short prompt passes long ones
  already queued or under way) the chats' p90 TTFT stays within 2x of their
  p90 alone, under fcfs (a chat waits behind every long prompt
  ahead) it does not. The flood is sized from the machine's measured speed.
- Tenants (router.admit_max, API keys with weights; router/fair.h): two keys
  weighted 1:3, both with more requests waiting than the cluster admits: the
  second's share of tokens served is within 10% of 3/4; one key's burst past
  its queue is refused with its own retry hint while the other's requests
  start at once; per-tenant metrics.
- Swap: a decode pool too small for its streams preempts; with swap the
  preempted KV goes to host memory and back (decode.swap_mib), with the same
  outputs and fewer prompt tokens computed than recomputing them.
Run with pytest (tests/conftest.py says how)."""
import json
import os
import random
import statistics
import subprocess
import tempfile
import threading
import time
import urllib.request

import grpc

import harness as hs

pb = hs.pb
check = hs.check
MAX = 4
text = hs.words


def cluster(order, prefill, decode_mib=256, decode_extra=""):
    """A 1P+1D cluster whose prefill worker runs `order` with the given prefill-section keys; no KV store."""
    cfg = tempfile.mktemp(prefix="tandem-sched-", suffix=".yaml")
    with open(cfg, "w") as f:
        f.write("prefill: { queue: %s, %s }\ndecode: { kv_mib: %d%s }\n" % (order, prefill, decode_mib, decode_extra))
    c = hs.Cluster(config=cfg, extra=["--kvstores", "0"] + hs.PAIRS_ONLY)
    os.unlink(cfg)
    ok = hs.wait_for(lambda: len(c.workers()) == 2 and c.health()[0], 60)
    check("%s: 1 prefill + 1 decode worker up" % order, ok, str(c.workers()))
    return c


def prefill_computed(c):
    return sum(c.stats(w).prompt_tokens_computed for w in c.workers() if w["role"] == "prefill")


def ttft(c, prompt, max_tokens=MAX):
    """Seconds to the first streamed token, and the token ids."""
    rq = pb.GenerateRequest(prompt=prompt, return_token_ids=True,
                            sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    t0, first, ids = time.time(), None, []
    for r in c.stub.Generate(rq, timeout=300):
        if r.token_ids and first is None:
            first = time.time() - t0
        ids.extend(r.token_ids)
    return first, ids


def burst(c, prompts, gap=0.005):
    """Every prompt at once (started in order, gap apart); their token ids."""
    out = [None] * len(prompts)

    def one(i):
        out[i] = ttft(c, prompts[i])[1]
    ts = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in ts:
        t.start()
        time.sleep(gap)
    for t in ts:
        t.join(300)
    return out


def test_cache_order_computes_fewer_prompt_tokens():
    rng = random.Random(5)
    prefixes = [text(300, rng) for _ in range(4)]
    prompts = [prefixes[g] + " question %d:%s" % (i, text(24, rng)) for i in range(5) for g in range(4)]
    got, computed = {}, {}
    for order in ("fcfs", "cache"):
        # 24 MiB: 68 blocks of 16 tokens, about three of the four prefixes with their questions
        c = cluster(order, "kv_mib: 24")
        try:
            before = prefill_computed(c)
            got[order] = burst(c, prompts)
            computed[order] = prefill_computed(c) - before
        finally:
            c.stop()
    check("hot prefixes: the prefill worker computed %d prompt tokens in the cache order, %d in fcfs (%.2fx fewer)" %
          (computed["cache"], computed["fcfs"], computed["fcfs"] / max(1, computed["cache"])),
          0 < computed["cache"] and computed["cache"] * 1.2 <= computed["fcfs"])
    refs = [hs.reference(prompts[i], MAX) for i in range(4)]  # one question on each prefix, single-process
    check("hot prefixes: every answer the same in both orders, and those checked equal single-process output",
          got["fcfs"] == got["cache"] and all(got["cache"][i] == refs[i] for i in range(4)),
          str([i for i in range(len(prompts)) if got["fcfs"][i] != got["cache"][i]]))


def p90(xs):
    return sorted(xs)[max(0, int(round(0.9 * len(xs))) - 1)]


def test_mlq_keeps_short_chats_fast_beside_a_long_prompt_flood():
    rng = random.Random(7)
    chats = [text(30, rng) for _ in range(32)]
    longs = [text(1200, rng) for _ in range(16)]
    res = {}
    for order in ("fcfs", "mlq"):
        # a budget of 8 tokens a step: a step cannot be stopped, so a chat waits for the one under way as it
        # arrives; with 8 tokens it is a fraction of the chat's own prefill (on a GPU a 512-token step is)
        # no age bound within the flood: on a slow machine its 4 long prompts outlast the default 10 s, and past it
        # they rightly go first (test_sched.c checks the bound)
        c = cluster(order, "token_budget: 8, kv_mib: 192, queue_age_ms: 600000")
        try:
            ttft(c, chats[0])  # warm: connections, the first step
            alone = [ttft(c, chats[i])[0] for i in range(1, 11)]
            t_long = ttft(c, longs[0])[0]  # one long prompt's TTFT alone
            # a flood lasting about 8 s of this machine's prefill, the chats spread over its first half, each
            # sent at its time whatever the others do
            n_long = max(4, min(len(longs) - 1, int(8 / t_long) + 1))
            flood = [threading.Thread(target=ttft, args=(c, longs[1 + i])) for i in range(n_long)]
            for t in flood:
                t.start()
            time.sleep(min(1.0, t_long))  # the long prompts are queued and the first is under way
            loaded = [None] * 20

            def chat(i):
                loaded[i] = ttft(c, chats[11 + i])[0]
            gap = n_long * t_long / 2 / 20
            cs = []
            for i in range(20):
                cs.append(threading.Thread(target=chat, args=(i,)))
                cs[-1].start()
                time.sleep(gap)
            for t in cs + flood:
                t.join(300)
            res[order] = (p90(alone), p90(loaded), n_long, t_long)
            print("  %s: the chats' TTFTs beside the flood (ms): %s" % (order, [round(1e3 * x) for x in loaded]))
        finally:
            c.stop()
    for order, (alone, loaded, n_long, t_long) in res.items():
        print("  %s: chats' TTFT p90 alone %.0f ms, beside %d long prompts (%.2f s each alone) p90 %.0f ms "
              "(%.1fx)" % (order, alone * 1e3, n_long, t_long, loaded * 1e3, loaded / alone))
    a_m, l_m = res["mlq"][:2]
    a_f, l_f = res["fcfs"][:2]
    check("long-prompt flood: mlq keeps the chats' p90 TTFT within 2x of alone (%.0f ms vs %.0f ms, %.1fx)" %
          (l_m * 1e3, a_m * 1e3, l_m / a_m), l_m <= 2 * a_m)
    check("long-prompt flood: fcfs does not (%.0f ms vs %.0f ms, %.1fx)" % (l_f * 1e3, a_f * 1e3, l_f / a_f),
          l_f > 2 * a_f)


def keyed_cluster(d, keys, router_extra):
    """A 1P+1D cluster whose router admits the keys {name: (weight, priority)} and takes router_extra's keys;
    the keys' secrets by name."""
    secrets, lines = {}, []
    for name, (weight, prio) in keys.items():
        out = subprocess.run([hs.BIN + "/tandem", "apikey", name, "--weight", str(weight), "--priority", str(prio)],
                             capture_output=True, text=True, check=True).stdout.splitlines()
        secrets[name] = out[0].split()[1]
        lines.append(out[1].split(None, 1)[1])
    with open(d + "/keys", "w") as f:
        f.write("".join(line + "\n" for line in lines))
    with open(d + "/tandem.yaml", "w") as f:
        f.write("router: { api_keys: %s, %s }\nprefill: { kv_mib: 128 }\ndecode: { kv_mib: 128 }\n" %
                (d + "/keys", router_extra))
    c = hs.Cluster(config=d + "/tandem.yaml", extra=["--kvstores", "0"] + hs.PAIRS_ONLY)
    check("keyed cluster up", hs.wait_for(lambda: len(c.workers()) == 2 and c.health()[0], 60))
    return c, secrets


def keyed(c, key, prompt, max_tokens=16):
    """(TTFT s, output tokens, None) or (None, 0, the gRPC error)."""
    rq = pb.GenerateRequest(prompt=prompt, return_token_ids=True,
                            sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    t0, first, n = time.time(), None, 0
    try:
        for r in c.stub.Generate(rq, timeout=120, metadata=[("authorization", "Bearer " + key)]):
            if r.token_ids and first is None:
                first = time.time() - t0
            n += len(r.token_ids)
    except grpc.RpcError as e:
        return None, 0, e
    return first, n, None


def tenants(c):
    return {t["tenant"]: t for t in c.health()[1].get("tenants", [])}


def test_tenants_share_a_contended_cluster_by_weight():
    """Two keys, weights 1:3, both with more requests waiting than the cluster admits (router.admit_max 2):
    of the tokens served while both wait, bob's share is within 10% of 3/4. alice floods with 24 clients, bob
    has 8."""
    rng = random.Random(11)
    d = tempfile.mkdtemp(prefix="tandem-fair-")
    c, key = keyed_cluster(d, {"alice": (1, 0), "bob": (3, 0)}, "admit_max: 2, tenant_queue_max: 64")
    stop = threading.Event()
    served = {"alice": 0, "bob": 0}
    errors = []

    def client(name):
        while not stop.is_set():
            _, n, err = keyed(c, key[name], text(rng.randint(20, 60), rng))
            if err is not None:
                errors.append((name, err.code(), err.details()))
            served[name] += n
    try:
        ts = [threading.Thread(target=client, args=("alice",)) for _ in range(24)] + \
             [threading.Thread(target=client, args=("bob",)) for _ in range(8)]
        for t in ts:
            t.start()
        time.sleep(4)  # both queues fill
        t0 = tenants(c)
        time.sleep(12)
        t1 = tenants(c)
        stop.set()
        for t in ts:
            t.join(120)
        got = {n: t1[n]["tokens_served"] - t0[n]["tokens_served"] for n in ("alice", "bob")}
        share = got["bob"] / max(1, got["alice"] + got["bob"])
        waited = all(t0[n]["waiting"] > 0 and t1[n]["waiting"] > 0 for n in ("alice", "bob"))
        check("weights 1:3 under contention: bob served %d tokens, alice %d in 12 s: bob's share %.3f (3/4 within "
              "10%%: 0.675..0.825), both waiting throughout (%s)" %
              (got["bob"], got["alice"], share, {n: (t0[n]["waiting"], t1[n]["waiting"]) for n in t0}),
              waited and 0.675 <= share <= 0.825 and not errors, str(errors[:3]))
        at = metrics_at(c)
        m = urllib.request.urlopen("https://%s/metrics" % at, timeout=10,
                                   context=hs.tls_context(c.certs)).read().decode() if at else ""
        ol = c.health()[1].get("output_length", {})
        check("the output-length predictor learnt the 16-token answers: %d ends, error p50 %s" %
              (ol.get("ends", 0), ol.get("error_p50")), ol.get("ends", 0) > 50 and ol.get("error_p50", 1) < 0.1, str(ol))
        lines = [l for l in m.splitlines() if l.startswith("tandem:tenant_tokens_total")]
        check("per-tenant metrics: tandem:tenant_tokens_total for each key (%s)" % lines,
              any('tenant="alice"' in l for l in lines) and any('tenant="bob"' in l for l in lines))
    finally:
        stop.set()
        c.stop()


def metrics_at(c):
    """The router's metrics listener (its etcd record)."""
    out = c.etcdctl("get", "--prefix", "/tandem/routers/", "--print-value-only").stdout
    for line in out.splitlines():
        if line.startswith("{"):
            return json.loads(line).get("metrics")
    return None


def test_a_tenants_burst_waits_in_its_own_queue():
    """alice sends 40 requests at once to a cluster admitting 2 (her queue holds 24): 16 are refused at once
    with her own retry hint; bob's requests meanwhile start within a request's time, not behind alice's."""
    rng = random.Random(12)
    d = tempfile.mkdtemp(prefix="tandem-burst-")
    c, key = keyed_cluster(d, {"alice": (1, 0), "bob": (1, 0)}, "admit_max: 2, tenant_queue_max: 24")
    try:
        alone = statistics.median(keyed(c, key["bob"], text(40, rng))[0] for _ in range(3))
        res = [None] * 40

        def one(i):
            res[i] = keyed(c, key["alice"], text(40, rng))
        ts = [threading.Thread(target=one, args=(i,)) for i in range(40)]
        for t in ts:
            t.start()
        time.sleep(0.5)
        bob = [keyed(c, key["bob"], text(40, rng))[0] for _ in range(4)]
        for t in ts:
            t.join(180)
        refused = [r[2] for r in res if r[2] is not None]
        hint = [e for e in refused if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "tenant 'alice'" in e.details()
                and "try again in" in e.details()]
        a_ttft = sorted(r[0] for r in res if r[0] is not None)
        check("alice's burst of 40: %d refused with her own retry hint (%s), %d served (TTFT median %.0f ms)" %
              (len(hint), hint[0].details() if hint else refused[:1], len(a_ttft),
               1e3 * statistics.median(a_ttft) if a_ttft else -1),
              len(hint) >= 10 and len(hint) == len(refused) and len(a_ttft) + len(refused) == 40)
        check("bob beside alice's burst: TTFT median %.0f ms (alone %.0f ms, alice's median %.0f ms)" %
              (1e3 * statistics.median(bob), 1e3 * alone, 1e3 * statistics.median(a_ttft)),
              statistics.median(bob) < statistics.median(a_ttft) / 2)
    finally:
        c.stop()


def test_swap_instead_of_recompute_on_a_short_decode_pool():
    """A decode pool of 22 blocks under 8 streams of 136 tokens (9 blocks each): the decode worker preempts.
    With decode.swap_mib 0 a preempted stream's KV is computed again; with swap it goes to host memory and
    back. Every output equals single-process output either way; with swap the decode worker computes fewer
    prompt tokens (its recomputation)."""
    rng = random.Random(13)
    prompts = [text(36, rng) for _ in range(8)]
    refs = [hs.reference(p, 96) for p in prompts[:3]]
    got, computed, swaps = {}, {}, {}
    for mib in (0, 64):
        c = cluster("fcfs", "kv_mib: 64", decode_mib=8, decode_extra=", swap_mib: %d" % mib)
        try:
            out = [None] * len(prompts)

            def one(i):
                out[i] = ttft(c, prompts[i], 96)[1]
            ts = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
            for t in ts:
                t.start()
            for t in ts:
                t.join(300)
            d = [w for w in c.workers() if w["role"] == "decode"][0]
            st = c.stats(d)
            got[mib], computed[mib], swaps[mib] = out, st.prompt_tokens_computed, (st.preemptions, st.swapped_out)
        finally:
            c.stop()
    check("a short decode pool: preemptions and swaps without swap %s, with swap %s; the decode worker computed "
          "%d prompt tokens without swap, %d with" % (swaps[0], swaps[64], computed[0], computed[64]),
          swaps[0][0] > 0 and swaps[0][1] == 0 and swaps[64][1] > 0 and computed[64] < computed[0])
    check("... every stream completes, the same with and without swap, and those checked equal single-process output",
          all(o is not None and len(o) == 96 for o in got[0] + got[64]) and got[0] == got[64] and
          all(got[64][i] == refs[i] for i in range(3)))
