#!/usr/bin/env python3
"""Cluster suite: a real Prometheus scrapes every tandem process.

`tandem up` (2 prefill + 1 decode workers, 1 kvstore node, round-robin
placement so that a shared prefix prefilled on one worker is fetched from the
store by the other) serves requests that share a long system prompt. A real
Prometheus (the Debian package) finds every process through the router's
/targets (http_sd_configs) and scrapes them each second over HTTPS with a
client certificate of the cluster's CA; each metrics port answers a certless
client 403 and refuses plain HTTP and another CA's certificate. Then, through
Prometheus's HTTP API: every target is up, the router's TTFT histogram holds
the requests sent, the store's hit rate (hits / lookups) is a number above 0,
and every role's series carry model_name and role. The deploy dashboard's
queries must name only metrics the processes export.
Run with pytest (tests/conftest.py says how)."""
import json
import os
import re
import shutil
import ssl
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request

import pytest

import harness as hs

check = hs.check
ROOT = hs.ROOT


def get(url, timeout=10, ctx=None):
    with urllib.request.urlopen(url, timeout=timeout, context=ctx) as r:
        return r.read().decode()


def query(prom, q):
    """The result vector of an instant query through Prometheus's HTTP API."""
    body = json.loads(get("http://%s/api/v1/query?%s" % (prom, urllib.parse.urlencode({"query": q}))))
    if body.get("status") != "success":
        raise AssertionError("query %s: %s" % (q, body))
    return body["data"]["result"]


@pytest.fixture(scope="module")
def c():
    """2 prefill + 1 decode workers and 1 kvstore node, round-robin placement; c.targets_url is its /targets page."""
    cfg = tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False)
    cfg.write("router:\n  placement: round_robin\nkvstore:\n  count: 1\n")
    cfg.close()
    cl = hs.Cluster(config=cfg.name, extra=["--prefill", "2", "--decode", "1"] + hs.PAIRS_ONLY)
    os.unlink(cfg.name)
    m = re.search(r"listed at https://(\S+)/targets", cl.log())
    cl.targets_url = "https://%s/targets" % m.group(1) if m else None
    yield cl
    cl.stop()


def test_targets_page(c):
    check("tandem up names the router's Prometheus targets page, on HTTPS", c.targets_url is not None and
          bool(c.certs))


def test_metrics_ports_are_internal_planes(c):
    targets_url, client = c.targets_url, hs.tls_context(c.certs)
    # every metrics port is an internal plane: HTTPS, and only a client certificate of the cluster's CA
    # the router serves once one worker of each role is in; the second prefill worker may come a moment later
    hs.wait_for(lambda: len(json.loads(get(targets_url, ctx=client))) == 5, 30)
    targets = json.loads(get(targets_url, ctx=client))
    ids = sorted(t["labels"]["tandem_id"].split("-")[0].split("@")[0] for t in targets)
    check("/targets lists the router, both prefill workers, the decode worker and the kvstore node",
          ids == ["decode", "kvstore", "prefill", "prefill", "router"], str(targets))
    addrs = [t["targets"][0] for t in targets]
    certless = {a: hs.http_answer("https://%s/metrics" % a, hs.tls_context(c.certs, None)) for a in addrs}
    plain = {a: hs.http_answer("http://%s/metrics" % a, None) for a in addrs}
    check("every metrics port answers a client without a certificate 403, naming the missing certificate",
          all(v.startswith("403: forbidden: no client certificate") for v in certless.values()), str(certless))
    check("every metrics port refuses plain HTTP", all(not v.startswith(("200", "403")) for v in plain.values()),
          str(plain))
    foreign = tempfile.mkdtemp(prefix="tandem-foreign-ca-")
    subprocess.run([hs.BIN + "/tandem", "certs", "--dir", foreign, "--names", "client"], check=True,
                   capture_output=True, timeout=30)
    fctx = ssl.create_default_context(cafile=c.certs + "/ca.pem")
    fctx.load_cert_chain(foreign + "/client.pem", foreign + "/client.key")
    shutil.rmtree(foreign, ignore_errors=True)
    outsider = hs.http_answer("https://%s/metrics" % addrs[0], fctx)
    check("a metrics port refuses a certificate another CA signed", not outsider.startswith("200"), outsider)
    print("  a certless client: %s; another CA's certificate: %s" % (next(iter(certless.values())), outsider))



@pytest.fixture(scope="module")
def prom(c):
    """A real Prometheus scraping the cluster through its /targets, once 8 requests sharing a prefix were served."""
    prom_bin = shutil.which("prometheus")
    if not prom_bin:
        pytest.fail("the prometheus binary is not on PATH (deploy/install-deps.sh --test installs it)")
    # requests sharing a 300-token system prompt; round robin puts every other one on the worker that
    # did not prefill the prefix, which fetches it from the store
    system = " ".join("Rule %d: answer briefly and politely, in plain words." % i for i in range(30))
    for i in range(8):
        hs.generate(c.stub, "%s\nQuestion %d: what is %d plus %d?" % (system, i, i, i + 1), max_tokens=8)

    data = tempfile.mkdtemp(prefix="tandem-prom-")
    targets_url = c.targets_url
    port = hs.free_port()
    prom = "127.0.0.1:%d" % port
    pcfg = os.path.join(data, "prometheus.yml")
    with open(pcfg, "w") as f:
        f.write("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
                "scrape_configs:\n  - job_name: tandem\n    scheme: https\n    tls_config: &tls\n"
                "      ca_file: {ca}\n      cert_file: {cert}\n      key_file: {key}\n"
                "    http_sd_configs:\n      - url: {url}\n        refresh_interval: 2s\n"
                "        tls_config: *tls\n".format(ca=c.certs + "/ca.pem", cert=c.certs + "/client.pem",
                                                  key=c.certs + "/client.key", url=targets_url))
    plog = open(os.path.join(data, "prometheus.log"), "w")
    prom_p = subprocess.Popen([prom_bin, "--config.file", pcfg, "--storage.tsdb.path", os.path.join(data, "tsdb"),
                               "--web.listen-address", prom, "--log.level", "warn"], stdout=plog,
                              stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 60  # until every process was scraped (test_scrapes_every_process checks it)
    while time.time() < deadline:
        try:
            up = query(prom, "up{job=\"tandem\"}")
            if len(up) == 5 and all(r["value"][1] == "1" for r in up):
                break
        except Exception:  # not listening yet
            pass
        time.sleep(1)
    yield prom
    os.killpg(prom_p.pid, 15)
    prom_p.wait(20)
    shutil.rmtree(data, ignore_errors=True)


def test_scrapes_every_process(prom):
    up = query(prom, "up{job=\"tandem\"}")
    check("Prometheus found the 5 processes through http_sd and scrapes each (up == 1)",
          len(up) == 5 and all(r["value"][1] == "1" for r in up), str(up))



def test_ttft_histogram(prom):
    ttft = query(prom, "sum(tandem:time_to_first_token_seconds_count)")
    n = float(ttft[0]["value"][1]) if ttft else -1
    check("the TTFT histogram through Prometheus counts the 8 requests", n == 8, str(ttft))
    buckets = query(prom, "tandem:time_to_first_token_seconds_bucket{role=\"router\"}")
    check("the TTFT histogram has its buckets, labelled model_name and role",
          len(buckets) >= 10 and all(b["metric"].get("model_name") for b in buckets), str(buckets[:2]))
    p90 = query(prom, "histogram_quantile(0.9, sum by (le) (tandem:time_to_first_token_seconds_bucket))")
    check("histogram_quantile gives a TTFT p90 in seconds", p90 and 0 < float(p90[0]["value"][1]) < 60, str(p90))
    print("  TTFT p90 from Prometheus: %.3f s" % float(p90[0]["value"][1]) if p90 else "")



def test_store_hit_rate(prom):
    rate = query(prom, "sum(tandem:kvstore_hits_total) / sum(tandem:kvstore_lookups_total)")
    lookups = query(prom, "sum(tandem:kvstore_lookups_total)")
    hr = float(rate[0]["value"][1]) if rate else float("nan")
    check("the store's hit rate through Prometheus is a number above 0 (the second worker found the prefix)",
          rate and 0 < hr <= 1, "rate %s, lookups %s" % (rate, lookups))
    print("  store hit rate: %.3f of %s blocks looked up" % (hr, lookups[0]["value"][1] if lookups else "?"))
    store_tokens = query(prom, "sum(tandem:store_cache_hits_total)")
    check("the router counts prompt tokens served from the store",
          store_tokens and float(store_tokens[0]["value"][1]) > 0, str(store_tokens))



def test_every_role_exports(prom):
    roles = {r["metric"].get("role") for r in query(prom, "tandem:num_requests_running or tandem:kvstore_hits_total")}
    check("every role exports its series (router, prefill, decode, kvstore)",
          roles == {"router", "prefill", "decode", "kvstore"}, str(roles))
    usage = query(prom, "tandem:kv_cache_usage_perc")
    check("the workers export KV cache usage as a fraction", len(usage) == 3 and
          all(0 <= float(u["value"][1]) <= 1 for u in usage), str(usage))



def test_tandem_status(c, prom):
    # tandem status: the same cluster for a person
    st = subprocess.run([hs.BIN + "/tandem", "status", "--endpoint", c.endpoint], capture_output=True, text=True,
                        timeout=30)
    out = st.stdout
    check("tandem status shows the node, the router, 3 workers with their KV pools, the store's tier, the SLO "
          "window and the planner's decision",
          st.returncode == 0 and "cluster: SERVING, 2 prefill + 1 decode workers" in out and
          len(re.findall(r"^  (prefill|decode) +\S+ +\d+ ms", out, re.M)) == 3 and
          re.search(r"kvstore-0 +hit rate", out) and re.search(r"^    cpu ", out, re.M) and
          re.search(r"met it", out) and "planner: this router is the planner; desired 2 prefill + 1 decode" in out,
          out + st.stderr)
    print("\n".join("  | " + ln for ln in out.splitlines()))
    js = subprocess.run([hs.BIN + "/tandem", "status", "--endpoint", c.endpoint, "--json"], capture_output=True,
                        text=True, timeout=30)
    check("tandem status --json is the router's Health detail",
          js.returncode == 0 and len(json.loads(js.stdout)["pools"]) == 3, js.stdout[:300] + js.stderr)



def test_grafana_dashboard(prom):
    # the dashboard: every metric its queries name is one some process exports
    dash = json.load(open(os.path.join(ROOT, "deploy", "grafana", "tandem.json")))
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    names = {n for e in exprs for n in re.findall(r"tandem:[a-z0-9_:]+", e)}
    exported = set(json.loads(get("http://%s/api/v1/label/__name__/values" % prom))["data"])
    base = {re.sub(r"_(bucket|sum|count)$", "", n) for n in exported}
    missing = sorted(n for n in names if n not in exported and n not in base)
    check("the Grafana dashboard's %d queries name only exported metrics" % len(exprs),
          exprs and not missing, "missing: %s" % missing)
    bad = []
    for e in exprs:
        try:
            query(prom, e.replace("$__rate_interval", "1m").replace("$model", ".*"))
        except Exception as ex:  # a query Prometheus refuses
            bad.append("%s: %s" % (e, ex))
    check("Prometheus accepts every query of the dashboard", not bad, "; ".join(bad))
