#!/usr/bin/env python3
"""The OpenAI-compatible HTTP API of the router, driven by the real `openai`
client (and raw HTTP where the client hides the wire) against a `tandem up`
cluster: greedy completions identical to single-process `tandem generate`,
streamed and not; chat streamed and not, the same text both ways; usage and
cached tokens; every error in OpenAI's shape naming its field; models, health,
tokenize/detokenize; a client that disconnects mid-stream, or while it waits
for a whole (non-streamed) answer, frees its KV on the decode worker; a 100 MB body is refused before it is read; 200 slowloris
clients dribbling their headers do not slow the others down; after all the
bad input the router's RSS and the decode worker's KV are back to idle.

Run with pytest (tests/conftest.py says how)."""
import http.client
import json
import os
import random
import re
import signal
import socket
import tempfile
import threading
import time
import types

import pytest

import harness as hs

import gguf  # noqa: E402
import jsonschema  # noqa: E402
import openai  # noqa: E402

check = hs.check
TOKENS = 24


def raw(host, port, method, path, body=None, headers=None):
    c = http.client.HTTPConnection(host, port, timeout=60)
    c.request(method, path, body=body, headers=headers or {"Content-Type": "application/json"})
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, dict(r.getheaders()), data


def slowloris(host, port, n):
    """n connections that sent half a request head, and a thread dribbling a header line into each every 0.5 s
    until the returned event is set (join the returned thread after)."""
    crowd, stop = [], threading.Event()
    for _ in range(n):
        try:
            x = socket.create_connection((host, port), timeout=30)
            x.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            crowd.append(x)
        except OSError:
            pass

    def dribble():
        while not stop.is_set():
            for x in crowd:
                try:
                    x.sendall(b"X-a: b\r\n")
                except OSError:
                    pass
            stop.wait(0.5)
    th = threading.Thread(target=dribble)
    th.start()
    return crowd, stop, th


def abuse(c, cl, model, host, port, prompt):
    """A 100 MB body and a slowloris crowd; the router's RSS and the KV back to idle after."""
    rp = hs.router_pid(c)
    dw = c.worker("decode")
    _, rss0 = hs.proc_status(rp)
    # 100 MB announced and sent: refused from the header, the connection closed long before 100 MB went
    s = socket.create_connection((host, port), timeout=30)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 104857600\r\n\r\n")
    sent, chunk, t0 = 0, b"a" * (1 << 20), time.time()
    try:
        while sent < 100 << 20:
            s.sendall(chunk)
            sent += len(chunk)
    except OSError:
        pass
    try:
        head = s.recv(4096)
    except OSError:
        head = b""
    s.close()
    check("a 100 MB body: %r after %.1f s, the connection closed after %d MiB of it were sent" %
          (head.split(b"\r\n")[0], time.time() - t0, sent >> 20),
          head.startswith(b"HTTP/1.1 413") and sent < (100 << 20))

    # slowloris: 200 connections sending their headers a few bytes at a time, while 8 requests are served
    socks, stop, th = slowloris(host, port, 200)
    lat = []
    try:
        for _ in range(8):
            t0 = time.time()
            r = cl.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
            lat.append(time.time() - t0)
        ok = bool(r.choices[0].text)
    finally:
        stop.set()
        th.join()
    threads, rss = hs.proc_status(rp)
    for x in socks:
        x.close()
    t0 = time.time()
    back = hs.wait_for(lambda: hs.proc_status(rp)[1] < rss0 + 16 and c.stats(dw).kv_in_use == 0, 20)
    _, rss_after = hs.proc_status(rp)
    check("200 slowloris connections: 8 requests beside them served in %.2f s at most (%d router threads, %.0f "
          "MiB RSS meanwhile)" % (max(lat), threads, rss), ok and max(lat) < 5)
    check("after the bad input the router's RSS is back to idle (%.0f MiB before, %.0f MiB after %.1f s) and the "
          "decode worker's KV is free" % (rss0, rss_after, time.time() - t0), back)


def new_key(name, rpm, tpm):
    out = hs.subprocess.run([hs.BIN + "/tandem", "apikey", name, "--rpm", str(rpm), "--tpm", str(tpm)],
                            capture_output=True, text=True, check=True).stdout.splitlines()
    return out[0].split()[1], out[1].split(None, 1)[1]


def api_keys():
    """A cluster whose HTTP API takes keys (router.api_keys): unknown keys are 401; each key's request and
    token rates are limited on its own (429 with Retry-After)."""
    d = tempfile.mkdtemp(prefix="tandem-keys-")
    (ka, la), (kb, lb), (kc, lc) = new_key("alice", 3, 0), new_key("bob", 0, 60), new_key("carol", 0, 0)
    with open(d + "/keys", "w") as f:
        f.write("# name rpm tpm\n%s\n%s\n%s\n" % (la, lb, lc))
    with open(d + "/tandem.yaml", "w") as f:
        f.write("router:\n  api_keys: %s\n  max_streams: 1\n" % (d + "/keys"))
    c = hs.Cluster(config=d + "/tandem.yaml")
    try:
        hs.wait_for(lambda: c.health()[0], 60)
        url = "http://%s/v1" % re.search(r"HTTP API at http://(\S+)/v1", c.log()).group(1)
        host, port = url[7:-3].rsplit(":", 1)

        def call(key, max_tokens=4):
            cl = openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=60)
            try:
                cl.completions.create(model="Smollm2 135M 8k Lc100K Mix1 Ep2", prompt="Hi", max_tokens=max_tokens,
                                      temperature=0, extra_body={"ignore_eos": True})
                return 200, ""
            except openai.APIStatusError as e:
                return e.status_code, "%s %s" % (e.response.headers.get("retry-after"), e.body)
        st, _, _ = raw(host, int(port), "GET", "/v1/models", headers={})
        st_h, _, _ = raw(host, int(port), "GET", "/health", headers={})
        wrong = call("tdk-" + "0" * 48)
        check("no key: %d; an unknown key: %d; /health without a key: %d" % (st, wrong[0], st_h),
              st == 401 and wrong[0] == 401 and st_h == 200)
        alice = [call(ka) for _ in range(4)]
        check("alice (3 requests a minute): %s; the 4th is 429 with Retry-After (%s)" %
              ([a[0] for a in alice], alice[3][1][:120]),
              [a[0] for a in alice] == [200, 200, 200, 429] and alice[3][1].split()[0] not in ("None", "0"))
        bob = [call(kb, 24) for _ in range(3)]
        check("bob (60 tokens a minute; each request may use ~26, charged at admission): %s, the 3rd refused for "
              "tokens (%s)" %
              ([b[0] for b in bob], bob[2][1][:120]),
              [b[0] for b in bob] == [200, 200, 429] and "tokens" in bob[2][1])

        # the router full (router.max_streams: 1): a second request at once is 429 with Retry-After. The first
        # asks for 1,500 tokens so that it is still streaming when the second comes (300 could end first when a
        # colocated decode worker serves it whole); closing its connection cancels it.
        body = json.dumps({"model": "Smollm2 135M 8k Lc100K Mix1 Ep2", "prompt": "Hi", "max_tokens": 1500,
                           "temperature": 0, "ignore_eos": True, "stream": True}).encode()
        s = socket.create_connection((host, int(port)), timeout=30)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + kc.encode() +
                  b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(body)).encode() +
                  b"\r\n\r\n" + body)
        first = s.recv(4096)
        second = call(kc)
        s.close()
        check("with the router full, a second request: %d (%s)" % (second[0], second[1][:140]),
              first.startswith(b"HTTP/1.1 200") and second[0] == 429 and second[1].split()[0] == "1")

        # nothing can serve (the only decode worker frozen past its lease): 503 at once, not a wait
        dw = c.worker("decode")
        hs.wait_for(lambda: c.stats(dw).running == 0, 10)
        os.kill(dw["pid"], signal.SIGSTOP)
        try:
            hs.wait_for(lambda: not c.worker("decode"), 10)
            t0 = time.time()
            st = call(kc)
            secs = time.time() - t0
        finally:
            os.kill(dw["pid"], signal.SIGCONT)
        check("with no decode worker: %d after %.2f s (%s)" % (st[0], secs, st[1][:140]), st[0] == 503 and secs < 2)

        # slowloris at the connection limit (router.max_streams 1: at most 1,026 open): 1,030 connections that
        # send half a request head and dribble a header line every 0.5 s; a legitimate request beside them gets
        # its answer or a 503, at once — their heads are late, and one client may hold only so many unfinished
        crowd, stop, th = slowloris(host, int(port), 1030)
        answers = []
        try:
            for _ in range(3):
                t0 = time.time()
                try:
                    st, hd, body = raw(host, port, "GET", "/v1/models", headers={"Authorization": "Bearer " + kc})
                except OSError as e:
                    st, hd, body = 0, {}, repr(e).encode()
                answers.append((st, time.time() - t0, hd.get("Connection")))
                time.sleep(1)
            closed = 0
            for x in crowd:
                try:
                    x.settimeout(0.01)
                    closed += x.recv(1) == b""
                except (socket.timeout, BlockingIOError):
                    pass
                except OSError:
                    closed += 1
        finally:
            stop.set()
            th.join()
        for x in crowd:
            x.close()
        hs.wait_for(lambda: raw(host, port, "GET", "/health")[0] == 200, 10)
        st2 = raw(host, port, "GET", "/v1/models", headers={"Authorization": "Bearer " + kc})[0]
        check("1,030 half-sent request heads held open (%d connected, %d of them closed by the server): a legitimate "
              "request gets %s; after they close: %d" %
              (len(crowd), closed, ["%d in %.2f s%s" % (a, t, ", Connection: close" if cl == "close" else "")
                                    for a, t, cl in answers], st2),
              all(a in (200, 503) and t < 5 and (a == 200 or cl == "close") for a, t, cl in answers) and
              closed >= len(crowd) - 2 * 256 and st2 == 200)
    finally:
        c.stop()


@pytest.fixture(scope="module")
def api():
    """A `tandem up` cluster and the openai client pointed at its HTTP API; the prompts' single-process texts."""
    prompts = hs.PROMPTS[:4]
    refs = {p: hs.reference_text(p, TOKENS) for p in prompts}
    c = hs.Cluster()
    hs.wait_for(lambda: c.health()[0], 60)
    m = re.search(r"HTTP API at http://(\S+)/v1", c.log())
    host, port = m.group(1).rsplit(":", 1)
    port = int(port)
    cl = openai.OpenAI(base_url="http://%s:%d/v1" % (host, port), api_key="unused", max_retries=0, timeout=120)
    models = cl.models.list().data
    check("GET /v1/models lists the one model: %s" % [x.id for x in models], len(models) == 1)
    model = models[0].id
    yield types.SimpleNamespace(c=c, cl=cl, model=model, host=host, port=port, refs=refs, prompts=prompts)
    c.stop()


def test_completions_identical_to_single_process(api):
    cl, model, refs, prompts = api.cl, api.model, api.refs, api.prompts
    # completions: identical to single-process greedy, streamed and not
    same = same_stream = 0
    for p in prompts:
        r = cl.completions.create(model=model, prompt=p, max_tokens=TOKENS, temperature=0,
                                  extra_body={"ignore_eos": True})
        same += r.choices[0].text == refs[p] and r.usage.completion_tokens == TOKENS
        text, last = "", None
        for ch in cl.completions.create(model=model, prompt=p, max_tokens=TOKENS, temperature=0, stream=True,
                                        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
            if ch.choices:
                text += ch.choices[0].text
            last = ch
        same_stream += text == refs[p] and last.usage is not None and last.usage.completion_tokens == TOKENS \
            and not last.choices
    check("completions: %d/%d identical to single-process greedy; streamed %d/%d (with a last usage chunk)" %
          (same, len(prompts), same_stream, len(prompts)), same == same_stream == len(prompts))


def test_slo_fields(api):
    cl, model, prompts = api.cl, api.model, api.prompts
    # tandem's SLO fields: one no idle worker can meet is refused at once, 400 (the client does not retry),
    # saying which SLO in rejected-early and giving no retry hint; a malformed one names its field
    def refused(**extra):
        t0 = time.time()
        try:
            cl.completions.create(model=model, prompt=prompts[0], max_tokens=4, temperature=0, extra_body=extra)
            return 200, None, None, "", 0
        except openai.APIStatusError as e:
            return (e.status_code, e.response.headers.get("rejected-early"),
                    e.response.headers.get("retry-after-ms"), str(e.body), (time.time() - t0) * 1e3)
    late, bad = refused(ttft_slo_ms=1), refused(ttft_slo_ms=0)
    check("ttft_slo_ms 1: %d, rejected-early %s, retry-after-ms %s, in %.0f ms: %s" %
          (late[0], late[1], late[2], late[4], late[3][:140]),
          late[0] == 400 and late[1] == "ttft" and late[2] is None and "will not help" in late[3] and late[4] < 1000)
    check("ttft_slo_ms 0: %d, rejected-early %s: %s" % (bad[0], bad[1], bad[3][:120]),
          bad[0] == 400 and bad[1] is None and "ttft_slo_ms" in bad[3])


def test_http_text_equals_grpc(api):
    c, cl, model = api.c, api.cl, api.model
    # every prompt of the integration suite: the HTTP text equals the gRPC API's
    same_grpc = 0
    for p in hs.PROMPTS:
        rq = hs.pb.GenerateRequest(prompt=p, sampling=hs.pb.SamplingParams(max_tokens=TOKENS, ignore_eos=True))
        g = "".join(r.text for r in c.stub.Generate(rq, timeout=120))
        h = cl.completions.create(model=model, prompt=p, max_tokens=TOKENS, temperature=0,
                                  extra_body={"ignore_eos": True}).choices[0].text
        same_grpc += g == h
    check("greedy text over HTTP identical to the gRPC API's for %d/%d prompts" % (same_grpc, len(hs.PROMPTS)),
          same_grpc == len(hs.PROMPTS) >= 20)


def test_chat(api):
    cl, model = api.cl, api.model
    # chat: streamed and not give the same text; finish reason and usage; a repeat hits the prefix cache
    msgs = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Name a color."}]
    r1 = cl.chat.completions.create(model=model, messages=msgs, max_tokens=12, temperature=0)
    parts, roles, fin = [], [], None
    for ch in cl.chat.completions.create(model=model, messages=msgs, max_tokens=12, temperature=0, stream=True):
        d = ch.choices[0].delta
        roles += [d.role] if d.role else []
        parts += [d.content] if d.content else []
        fin = ch.choices[0].finish_reason or fin
    r2 = cl.chat.completions.create(model=model, messages=msgs, max_tokens=12, temperature=0)
    cached = r2.usage.prompt_tokens_details.cached_tokens if r2.usage.prompt_tokens_details else 0
    check("chat: %r non-streamed == streamed (%r), role once, finish %s; the repeat's cached_tokens %d" %
          (r1.choices[0].message.content, "".join(parts), fin, cached),
          r1.choices[0].message.content == "".join(parts) and roles == ["assistant"] and
          fin == r1.choices[0].finish_reason and r1.choices[0].finish_reason in ("stop", "length") and
          r1.choices[0].message.role == "assistant" and cached > 0 and
          r2.choices[0].message.content == r1.choices[0].message.content)


def test_sampling_parameters(api):
    cl, model, refs, prompts = api.cl, api.model, api.refs, api.prompts
    # sampling parameters reach the engine: a seeded sample repeats, a stop string stops
    kw = dict(model=model, prompt=prompts[1], max_tokens=16, temperature=0.9, top_p=0.9, seed=7,
              extra_body={"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True})
    a, b = cl.completions.create(**kw).choices[0].text, cl.completions.create(**kw).choices[0].text
    check("a seeded sample (temperature, top_p, top_k, min_p, repetition_penalty) repeats: %r" % a, a == b)
    full = refs[prompts[0]]
    word = full.split()[3]
    s = cl.completions.create(model=model, prompt=prompts[0], max_tokens=TOKENS, temperature=0, stop=[word])
    check("stop=%r ends the text before it: %r, finish %s" % (word, s.choices[0].text, s.choices[0].finish_reason),
          word not in s.choices[0].text and full.startswith(s.choices[0].text) and
          s.choices[0].finish_reason == "stop")
    # vLLM's stop_token_ids (the stop token's text kept) and min_tokens (it held back until then)
    ids = [i for r in api.c.stub.Generate(hs.pb.GenerateRequest(
        prompt=prompts[0], return_token_ids=True, sampling=hs.pb.SamplingParams(max_tokens=TOKENS, ignore_eos=True)),
        timeout=60) for i in r.token_ids]
    t = next(ids[k] for k in range(3, len(ids)) if ids[k] not in ids[:k])
    s = cl.completions.create(model=model, prompt=prompts[0], max_tokens=TOKENS, temperature=0,
                              extra_body={"stop_token_ids": [t], "ignore_eos": True})
    check("stop_token_ids=[%d]: %r, finish %s" % (t, s.choices[0].text, s.choices[0].finish_reason),
          s.choices[0].finish_reason == "stop" and full.startswith(s.choices[0].text) and
          s.usage.completion_tokens == ids.index(t) + 1)
    s = cl.completions.create(model=model, prompt=prompts[0], max_tokens=TOKENS, temperature=0,
                              extra_body={"stop_token_ids": [t], "min_tokens": TOKENS, "ignore_eos": True})
    check("with min_tokens=%d it runs to max_tokens: %d tokens" % (TOKENS, s.usage.completion_tokens),
          s.usage.completion_tokens == TOKENS and s.choices[0].finish_reason == "length")


def test_logprobs(api):
    cl, model, refs, prompts = api.cl, api.model, api.refs, api.prompts
    # logprobs in OpenAI's shapes: completions' logprobs = k (streamed and not), chat's logprobs / top_logprobs. Greedy:
    # the sampled token is the most likely, so its log-probability is the top one's; the tokens spell the text.
    r = cl.completions.create(model=model, prompt=prompts[0], max_tokens=TOKENS, temperature=0, logprobs=3,
                              extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    ok = (len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n and
          "".join(lp.tokens) == r.choices[0].text == refs[prompts[0]] and
          all(v <= 0 and abs(v - max(t.values())) < 1e-6 and 3 <= len(t) <= 4
              for v, t in zip(lp.token_logprobs, lp.top_logprobs)) and
          lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0)
    check("completions logprobs=3: %d tokens, each greedy token the most likely (%s ...)"
          % (n, [round(v, 3) for v in lp.token_logprobs[:4]]), ok, str(lp)[:300])
    st = []
    for ch in cl.completions.create(model=model, prompt=prompts[0], max_tokens=TOKENS, temperature=0, logprobs=3,
                                    stream=True, extra_body={"ignore_eos": True}):
        if ch.choices and ch.choices[0].logprobs:
            st += ch.choices[0].logprobs.token_logprobs
    check("streamed, the same log-probabilities", st == lp.token_logprobs, "%d %d %s vs %s" % (len(st), len(lp.token_logprobs), st[-4:], lp.token_logprobs[-4:]))
    c = cl.chat.completions.create(model=model, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=8,
                                   temperature=0, logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    ok = (len(content) == c.usage.completion_tokens and
          all(len(e.top_logprobs) == 2 and abs(e.logprob - e.top_logprobs[0].logprob) < 1e-6 and
              e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob and bytes(e.bytes).decode() == e.token
              for e in content if not e.token.startswith("bytes:")))
    check("chat logprobs, top_logprobs=2: %d entries, %r" % (len(content), [(e.token, round(e.logprob, 3))
                                                                             for e in content[:3]]), ok)
    # echo: the prompt back, with its tokens' log-probabilities (the first has none); with max_tokens 0 the prompt
    # alone is scored (what lm-evaluation-harness sends). Scoring the prompt and its greedy completion gives the
    # completion's tokens the log-probabilities they had when generated.
    text = refs[prompts[0]]
    sc = cl.completions.create(model=model, prompt=prompts[0] + text, max_tokens=0, logprobs=1, echo=True)
    slp = sc.choices[0].logprobs
    k = len(lp.tokens)
    ok = (sc.choices[0].text == prompts[0] + text and sc.usage.completion_tokens == 0 and
          slp.token_logprobs[0] is None and slp.top_logprobs[0] is None and "".join(slp.tokens[1:]).endswith(text) and
          slp.tokens[-k:] == lp.tokens and
          all(abs(a - b) < 1e-4 for a, b in zip(slp.token_logprobs[-k:], lp.token_logprobs)))
    check("echo, max_tokens 0: %d prompt tokens scored; the completion's %d as when generated (%s vs %s)"
          % (len(slp.tokens), k, [round(v, 4) for v in slp.token_logprobs[-2:]],
             [round(v, 4) for v in lp.token_logprobs[-2:]]), ok, str(slp)[:300])
    ec = cl.completions.create(model=model, prompt=prompts[0], max_tokens=4, temperature=0, logprobs=1, echo=True,
                               extra_body={"ignore_eos": True})
    elp = ec.choices[0].logprobs
    check("echo with 4 tokens: the prompt, then the completion (%r)" % ec.choices[0].text,
          ec.choices[0].text.startswith(prompts[0]) and text.startswith(ec.choices[0].text[len(prompts[0]):]) and
          len(elp.token_logprobs) == ec.usage.prompt_tokens + 4 and elp.token_logprobs[0] is None)


def test_n_choices(api):
    c, cl, model, refs, prompts = api.c, api.cl, api.model, api.refs, api.prompts
    # n = 4 greedy choices: four copies of the single-process text; the prompt (~100 tokens, not seen before) is
    # computed once (the workers' prompt_tokens_computed): the other choices start from its KV in the prefix cache
    p = prompts[2]
    long_p = "Choices %d. " % random.Random().randrange(1 << 30) + " ".join([p] * 12)
    ref = cl.completions.create(model=model, prompt=long_p, max_tokens=TOKENS, temperature=0,
                                extra_body={"ignore_eos": True})
    n_prompt = ref.usage.prompt_tokens
    long_p = long_p.replace("Choices", "Choice")  # a prompt no cache holds, of about the same length
    computed = lambda: sum(c.stats(w).prompt_tokens_computed for w in c.workers())  # noqa: E731
    before = computed()
    r = cl.completions.create(model=model, prompt=long_p, n=4, max_tokens=TOKENS, temperature=0,
                              extra_body={"ignore_eos": True})
    ran = computed() - before
    texts = [ch.text for ch in sorted(r.choices, key=lambda ch: ch.index)]
    cold = hs.reference_text(long_p, TOKENS)  # single-process: choices 1-3 took the prompt from the prefix cache
    check("n=4 at temperature 0: choices %s, 4 copies of the cold single-process text, usage %d prompt + %d "
          "completion tokens; the workers computed %d prompt tokens for a %d-token prompt (once, and each other "
          "choice its last partial block)" % ([ch.index for ch in r.choices], r.usage.prompt_tokens,
                                              r.usage.completion_tokens, ran, r.usage.prompt_tokens),
          sorted(ch.index for ch in r.choices) == [0, 1, 2, 3] and texts == [cold] * 4 and
          r.usage.completion_tokens == 4 * TOKENS and abs(r.usage.prompt_tokens - n_prompt) <= 2 and
          ran <= r.usage.prompt_tokens + 3 * 16)
    one = cl.completions.create(model=model, prompt=p, n=2, max_tokens=TOKENS, temperature=0,
                                extra_body={"ignore_eos": True})
    check("n=2: both choices the single-process text", [ch.text for ch in one.choices] == [refs[p]] * 2)
    # each choice its own seed stream: choice i of seed 5 is the single choice of seed 5 + i; streamed, by index
    kw = dict(model=model, prompt=prompts[1], max_tokens=12, temperature=1.0, extra_body={"ignore_eos": True})
    singles = [cl.completions.create(seed=5 + i, **kw).choices[0].text for i in range(3)]
    streamed = ["", "", ""]
    finished = [None] * 3
    for ch in cl.completions.create(seed=5, n=3, stream=True, **kw):
        for x in ch.choices:
            streamed[x.index] += x.text
            finished[x.index] = x.finish_reason or finished[x.index]
    check("n=3 streamed with seed 5: choice i is seed 5 + i's single choice (%s), each finished (%s)" %
          ([a == b for a, b in zip(streamed, singles)], finished),
          streamed == singles and finished == ["length"] * 3 and len(set(singles)) > 1)
    # best_of: 4 sampled, the 2 of highest log-probability answered (the same 4 as n=4 of the same seed, summed)
    all4 = cl.completions.create(seed=9, n=4, logprobs=0, **kw).choices
    sums = sorted(((sum(ch.logprobs.token_logprobs), ch.text) for ch in all4), reverse=True)
    best = cl.completions.create(seed=9, n=2, best_of=4, **kw)
    check("best_of=4, n=2: %r, the two of highest log-probability of %s; no logprobs unless asked" %
          ([ch.text for ch in best.choices], [round(v, 2) for v, _ in sums]),
          [ch.text for ch in best.choices] == [t for _, t in sums[:2]] and
          all(ch.logprobs is None for ch in best.choices) and [ch.index for ch in best.choices] == [0, 1])
    chat = cl.chat.completions.create(model=model, messages=[{"role": "user", "content": "Name a fruit."}], n=2,
                                      max_tokens=8, temperature=0)
    check("chat n=2: %r" % [ch.message.content for ch in chat.choices],
          len(chat.choices) == 2 and chat.choices[0].message.content == chat.choices[1].message.content)
    # gRPC: sampling.n, messages told apart by index
    rq = hs.pb.GenerateRequest(prompt=p, sampling=hs.pb.SamplingParams(max_tokens=TOKENS, ignore_eos=True, n=2))
    by = {}
    for m in c.stub.Generate(rq, timeout=120):
        by[m.index] = by.get(m.index, "") + m.text
    check("gRPC sampling.n=2: %d choices, each the single-process text" % len(by),
          sorted(by) == [0, 1] and list(by.values()) == [refs[p]] * 2)


def test_function_calling(api):
    cl, model, host, port = api.cl, api.model, api.host, api.port
    # a named function's call: its arguments validate against its parameters (jsonschema, the reference) and are the
    # text response_format gives for that schema (the structured-output path the call is built on), streamed too
    params = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}, "days": {"type": "integer"}},
              "required": ["city", "days"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "the forecast", "parameters": params}},
             {"type": "function", "function": {"name": "get_time"}}]
    msgs = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = cl.chat.completions.create(model=model, messages=msgs, tools=tools, tool_choice=named, max_tokens=60,
                                   temperature=0)
    m, fin = r.choices[0].message, r.choices[0].finish_reason
    call = m.tool_calls[0] if m.tool_calls else None
    try:
        jsonschema.validate(json.loads(call.function.arguments), params)
        valid = True
    except Exception as e:  # noqa: BLE001
        valid = repr(e)[:80]
    ref = cl.chat.completions.create(model=model, messages=msgs, max_tokens=60, temperature=0,
                                     response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": params}})
    check("tool_choice naming get_weather: one call (%s), arguments %r validate against its parameters (%s), equal "
          "to response_format's text for them, content %r, finish %s" % (
              call and (call.id, call.type, call.function.name), call and call.function.arguments, valid, m.content,
              fin),
          call is not None and len(m.tool_calls) == 1 and call.type == "function" and
          call.function.name == "get_weather" and call.id and valid is True and m.content is None and fin == "stop" and
          call.function.arguments == ref.choices[0].message.content)
    first, args, ids = None, "", set()
    for ch in cl.chat.completions.create(model=model, messages=msgs, tools=tools, tool_choice=named, max_tokens=60,
                                         temperature=0, stream=True):
        d = ch.choices[0].delta if ch.choices else None
        for tc in (d.tool_calls or []) if d else []:
            first = first or tc
            ids.add(tc.id)
            args += tc.function.arguments or ""
    check("... streamed: the first delta names the call (%s, %s), the deltas' arguments join to the same text" %
          (first and first.id, first and first.function.name),
          first is not None and first.function.name == "get_weather" and ids - {None} == {first.id} and
          call is not None and args == call.function.arguments)
    # "required" with one tool: its call; "none": text, as without tools
    one = cl.chat.completions.create(model=model, messages=msgs, tools=tools[1:], tool_choice="required", max_tokens=40,
                                     temperature=0)
    oc = one.choices[0].message.tool_calls
    try:
        obj = json.loads(oc[0].function.arguments) if oc else None
    except ValueError:
        obj = None
    check("tool_choice required with one tool (no parameters): its call, arguments a JSON object or cut by "
          "max_tokens (%s, %r, finish %s)" % (oc and oc[0].function.name, oc and oc[0].function.arguments[:60],
                                              one.choices[0].finish_reason),
          oc and oc[0].function.name == "get_time" and
          (isinstance(obj, dict) or one.choices[0].finish_reason == "length"))
    # "required" over two tools: the text held to {"name": one of theirs, "arguments": its parameters} (the anyOf
    # response_format gives the same text for), read back into the call; streamed, the call whole in one chunk; cut by
    # max_tokens, the text itself
    anyof = {"anyOf": [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                         "arguments": t["function"].get("parameters", {"type": "object"})},
                        "required": ["name", "arguments"], "additionalProperties": False} for t in tools]}
    ref2 = cl.chat.completions.create(model=model, messages=msgs, max_tokens=80, temperature=0, response_format={
        "type": "json_schema", "json_schema": {"name": "any", "schema": anyof}}).choices[0].message.content
    req = cl.chat.completions.create(model=model, messages=msgs, tools=tools, tool_choice="required", max_tokens=80,
                                     temperature=0)
    rc = req.choices[0].message.tool_calls
    try:
        want = json.loads(ref2)
        ok_req = (rc and len(rc) == 1 and rc[0].function.name == want["name"] and
                  json.loads(rc[0].function.arguments) == want["arguments"] and req.choices[0].message.content is None)
    except (ValueError, KeyError, TypeError) as e:
        ok_req = False
        ref2 += " (%r)" % e
    streamed = [(d.tool_calls, ch.choices[0].finish_reason) for ch in cl.chat.completions.create(
        model=model, messages=msgs, tools=tools, tool_choice="required", max_tokens=80, temperature=0, stream=True)
        for d in [ch.choices[0].delta] if ch.choices]
    calls = [tc for tcs, _ in streamed for tc in (tcs or [])]
    check("tool_choice required over two tools: the call of %s with %r, read back from response_format's anyOf text "
          "for them (%r); streamed, %d delta(s) with the call, the same" % (
              rc and rc[0].function.name, rc and rc[0].function.arguments, ref2[:80], len(calls)),
          ok_req and len(calls) == 1 and calls[0].function.name == rc[0].function.name and
          calls[0].function.arguments == rc[0].function.arguments and streamed[-1][1] == "stop")
    cut = cl.chat.completions.create(model=model, messages=msgs, tools=tools, tool_choice="required", max_tokens=5,
                                     temperature=0)
    check("... cut by max_tokens 5: no call, the text (%r), finish %s" % (cut.choices[0].message.content,
                                                                          cut.choices[0].finish_reason),
          cut.choices[0].message.tool_calls is None and cut.choices[0].finish_reason == "length" and
          ref2.startswith(cut.choices[0].message.content or "-"))
    plain = cl.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0)
    none = cl.chat.completions.create(model=model, messages=msgs, tools=tools, tool_choice="none", max_tokens=8,
                                      temperature=0)
    check("tool_choice none: text (%r), as the same request without tools" % none.choices[0].message.content,
          none.choices[0].message.tool_calls is None and
          none.choices[0].message.content == plain.choices[0].message.content)
    # what cannot be answered is refused naming the field
    cases = [("tool_choice auto", dict(tool_choice="auto"), "tool_choice"),
             ("tools without tool_choice (auto)", {}, "tool_choice"),
             ("required with no tools", dict(tools=[], tool_choice="required"), "tool_choice"),
             ("a function no tool names", dict(tool_choice={"type": "function", "function": {"name": "nope"}}),
              "tool_choice"),
             ("a tool named with a space", dict(tools=[{"type": "function", "function": {"name": "a b"}}],
                                                tool_choice="required"), "tools[0]"),
             ("response_format beside a call", dict(tool_choice=named, response_format={"type": "json_object"}),
              "tool_choice"),
             ("parameters with a keyword outside the subset (minimum)",
              dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {
                  "type": "object", "properties": {"n": {"type": "integer", "minimum": 1}}}}}], tool_choice="required"),
              "tools")]
    for name, kw, param in cases:
        kw = dict(kw)
        kw.setdefault("tools", tools)
        try:
            cl.chat.completions.create(model=model, messages=msgs, max_tokens=4, **kw)
            ok, why = False, "accepted"
        except openai.BadRequestError as e:
            body = e.body if isinstance(e.body, dict) else {}
            ok, why = body.get("param") == param and bool(body.get("message")), "%d %s" % (e.status_code, body)
        check("%s is refused naming %s: %s" % (name, param, why[:200]), ok)
    st, _, body = raw(host, port, "POST", "/v1/completions",
                      body=json.dumps({"model": model, "prompt": "Hi", "tools": tools}).encode())
    check("tools on /v1/completions: %d %s" % (st, body[:120]), st == 400 and b'"param":"tools"' in body)


def test_structured_output(api):
    c, cl, model = api.c, api.cl, api.model
    # a JSON Schema's output validates against it (jsonschema, the reference), 20 schemas, greedy, streamed for half
    schemas = json.load(open(os.path.join(hs.ROOT, "tests/fixtures/structured/schemas.json")))
    bad = []
    for i, sc in enumerate(schemas):
        msgs = [{"role": "user", "content": "Reply with JSON for this schema: " + json.dumps(sc)}]
        rf = {"type": "json_schema", "json_schema": {"name": "s%d" % i, "schema": sc}}
        if i % 2:
            text, fin = "", None
            for ch in cl.chat.completions.create(model=model, messages=msgs, max_tokens=160, temperature=0,
                                                 response_format=rf, stream=True):
                if ch.choices:
                    text += ch.choices[0].delta.content or ""
                    fin = ch.choices[0].finish_reason or fin
        else:
            r = cl.chat.completions.create(model=model, messages=msgs, max_tokens=160, temperature=0,
                                           response_format=rf)
            text, fin = r.choices[0].message.content, r.choices[0].finish_reason
        try:
            jsonschema.validate(json.loads(text), sc)
            ok = fin == "stop"
        except Exception as e:  # noqa: BLE001
            ok = False
            text += " (%s)" % str(e).splitlines()[0][:80]
        if not ok:
            bad.append((i, fin, text[:120]))
    check("response_format json_schema: %d of %d schemas' outputs validate (jsonschema) and end with stop%s" %
          (len(schemas) - len(bad), len(schemas), (": failed " + repr(bad[:3])) if bad else ""), not bad)
    r = cl.chat.completions.create(model=model, messages=[{"role": "user", "content": 'Repeat this JSON object: {"cat": "Tom", "age": 3}'}],
                                   max_tokens=200, temperature=0, response_format={"type": "json_object"})
    try:
        obj = json.loads(r.choices[0].message.content)
    except ValueError:
        obj = None
    check("response_format json_object: a JSON object (%r)" % r.choices[0].message.content[:80],
          isinstance(obj, dict) and r.choices[0].finish_reason == "stop")
    # vLLM's guided_regex and guided_choice (the regex checked by Python's re, the reference)
    rx = r"(\d{3})-(\d{3})-\d{4}"
    t = cl.completions.create(model=model, prompt="Call me at", max_tokens=20, temperature=0,
                              extra_body={"guided_regex": rx}).choices[0].text
    ch = [cl.completions.create(model=model, prompt="Is water wet? Answer:", max_tokens=8, temperature=0.8, seed=s,
                                extra_body={"guided_choice": ["yes", "no", "it depends"]}).choices[0].text
          for s in range(4)]
    check("guided_regex %s: %r; guided_choice: %r" % (rx, t, ch), re.fullmatch(rx, t) is not None and
          all(x in ("yes", "no", "it depends") for x in ch))
    # over gRPC, on a disaggregated pair and with n choices: the same masks in the prefill and decode workers
    rq = hs.pb.GenerateRequest(prompt="Numbers:", sampling=hs.pb.SamplingParams(
        max_tokens=40, regex=r"\[(0|[1-9][0-9]{0,2})(, (0|[1-9][0-9]{0,2})){2,5}\]", n=2, temperature=0.7, seed=3))
    by = {}
    for m in c.stub.Generate(rq, timeout=120):
        by[m.index] = by.get(m.index, "") + m.text
    check("gRPC regex, n=2 sampled: %r" % by, sorted(by) == [0, 1] and all(
        re.fullmatch(r"\[(0|[1-9][0-9]{0,2})(, (0|[1-9][0-9]{0,2})){2,5}\]", v) for v in by.values()))


def test_front_door_disaggregated(api):
    """The same fields on a cluster that prefills every prompt on its prefill worker (the KV landing in the decode
    worker's pool): n choices, structured output, logprobs with echo — answered as the default cluster answers."""
    cl0, model, p = api.cl, api.model, api.prompts[2] + " " + " ".join([api.prompts[0]] * 8)
    c = hs.Cluster(extra=hs.PAIRS_ONLY)
    try:
        hs.wait_for(lambda: c.health()[0], 60)
        host, port = re.search(r"HTTP API at http://(\S+)/v1", c.log()).group(1).rsplit(":", 1)
        cl = openai.OpenAI(base_url="http://%s:%s/v1" % (host, port), api_key="unused", max_retries=0, timeout=120)
        dw = c.worker("decode")
        landed = c.stats(dw).landed_blocks
        kw = dict(model=model, prompt=p, max_tokens=TOKENS, temperature=0, extra_body={"ignore_eos": True})
        one = cl0.completions.create(**kw).choices[0].text
        r = cl.completions.create(n=3, **kw)
        check("disaggregated n=3: 3 copies of the default cluster's text; %d blocks landed" %
              (c.stats(dw).landed_blocks - landed),
              [ch.text for ch in r.choices] == [one] * 3 and c.stats(dw).landed_blocks > landed)
        sc = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                               "legs": {"type": "integer"}}}
        out = cl.chat.completions.create(model=model, messages=[{"role": "user", "content": "An animal as JSON."}],
                                         max_tokens=80, temperature=0, response_format={
                                             "type": "json_schema", "json_schema": {"name": "a", "schema": sc}})
        text = out.choices[0].message.content
        try:
            jsonschema.validate(json.loads(text), sc)
            valid = True
        except Exception:  # noqa: BLE001
            valid = False
        check("disaggregated json_schema: %r validates" % text, valid and out.choices[0].finish_reason == "stop")
        a = cl.completions.create(model=model, prompt=p, max_tokens=0, logprobs=2, echo=True).choices[0].logprobs
        b = cl0.completions.create(model=model, prompt=p, max_tokens=0, logprobs=2, echo=True).choices[0].logprobs
        worst = max(abs(x - y) for x, y in zip(a.token_logprobs[1:], b.token_logprobs[1:]))
        check("disaggregated echo + logprobs, the prompt scored: %d tokens, at most %.1e from the default cluster's"
              % (len(a.tokens), worst), a.tokens == b.tokens and worst < 1e-4)
    finally:
        c.stop()


def test_token_id_prompts(api):
    c, cl, model, host, port, refs, prompts = api.c, api.cl, api.model, api.host, api.port, api.refs, api.prompts
    # prompts as token ids (what lm-evaluation-harness sends): taken as they are, the same text as the string's tokens
    p = prompts[1]
    st, _, body = raw(host, port, "POST", "/tokenize", body=json.dumps({"prompt": p, "add_special_tokens": False}))
    ids = json.loads(body)["tokens"]
    outs = [cl.completions.create(model=model, prompt=form, max_tokens=TOKENS, temperature=0,
                                  extra_body={"ignore_eos": True}).choices[0].text for form in (ids, [ids])]
    rq = hs.pb.GenerateRequest(prompt_ids=hs.pb.TokenIds(ids=ids), sampling=hs.pb.SamplingParams(
        max_tokens=TOKENS, ignore_eos=True))
    by_grpc = "".join(r.text for r in c.stub.Generate(rq, timeout=120))
    check("a prompt of %d token ids, as [ids], [[ids]] and over gRPC: the string prompt's single-process text (%s)"
          % (len(ids), [o == refs[p] for o in outs + [by_grpc]]), st == 200 and outs == [refs[p]] * 2 and
          by_grpc == refs[p])
    # lm-evaluation-harness's log-likelihood request: [[context + continuation]], echo, logprobs 1, max_tokens 1
    text = refs[p]
    full = json.loads(raw(host, port, "POST", "/tokenize", body=json.dumps(
        {"prompt": p + text, "add_special_tokens": False}))[2])["tokens"]
    lm = cl.completions.create(model=model, prompt=[full], max_tokens=1, temperature=0, logprobs=1, echo=True,
                               seed=1234)
    sc = cl.completions.create(model=model, prompt=p + text, max_tokens=0, logprobs=1, echo=True)
    a, b = lm.choices[0].logprobs, sc.choices[0].logprobs
    worst = max(abs(x - y) for x, y in zip(a.token_logprobs[1:-1], b.token_logprobs[1:]))
    check("lm-eval's request (ids, echo, logprobs=1, max_tokens 1): the prompt's %d log-probabilities as the string "
          "prompt's (at most %.1e apart), its text echoed, one token more" % (len(full), worst),
          len(a.token_logprobs) == len(full) + 1 and a.token_logprobs[0] is None and worst < 1e-5 and
          lm.choices[0].text.startswith(p + text) and lm.usage.prompt_tokens == len(full))
    # when the one token generated is the end token, it is listed too (lm-eval drops the last entry as the generated
    # token's): OpenAI's shape, finish "stop"
    q = "Question: What is 11 + 27?\nAnswer: 38"
    qids = json.loads(raw(host, port, "POST", "/tokenize", body=json.dumps(
        {"prompt": q, "add_special_tokens": False}))[2])["tokens"]
    e = cl.completions.create(model=model, prompt=[qids], max_tokens=1, temperature=0, logprobs=1, echo=True)
    elp = e.choices[0].logprobs
    check("an echoed prompt whose next token is the end token: %d entries for %d prompt tokens, the last %r (%s), "
          "finish %s" % (len(elp.token_logprobs), len(qids), elp.tokens[-1], elp.token_logprobs[-1],
                         e.choices[0].finish_reason),
          len(elp.token_logprobs) == len(qids) + 1 and e.choices[0].text == q and e.choices[0].finish_reason == "stop"
          and elp.token_logprobs[-1] is not None)
    # GET /tokenizer_info (vLLM's; lm-eval's remote tokenizer asks it): the GGUF's own EOS and BOS tokens
    r = gguf.GGUFReader(hs.MODEL)
    tok = lambda k: bytes(r.fields["tokenizer.ggml.tokens"].parts[  # noqa: E731
        r.fields["tokenizer.ggml.tokens"].data[int(r.fields[k].parts[-1][0])]]).decode()
    st, _, body = raw(host, port, "GET", "/tokenizer_info")
    info = json.loads(body)
    check("GET /tokenizer_info: eos %r, bos %r, as the GGUF's; its context %s" % (
        info.get("eos_token"), info.get("bos_token"), info.get("model_max_length")),
        st == 200 and info["eos_token"] == tok("tokenizer.ggml.eos_token_id") and
        info["bos_token"] == tok("tokenizer.ggml.bos_token_id") and info["model_max_length"] > 0)


def test_errors_in_openai_shape(api):
    cl, model, host, port = api.cl, api.model, api.host, api.port
    # errors: OpenAI's shape, naming the field
    cases = [
        ("temperature=-1", lambda: cl.completions.create(model=model, prompt="Hi", temperature=-1),
         openai.BadRequestError, "temperature"),
        ("an unknown model", lambda: cl.completions.create(model="nope", prompt="Hi"), openai.NotFoundError,
         "model"),
        ("a token id past the vocabulary", lambda: cl.completions.create(model=model, prompt=[1, 49152]),
         openai.BadRequestError, "prompt[1]"),
        ("two prompts in one request", lambda: cl.completions.create(model=model, prompt=["Hi", "Ho"]),
         openai.BadRequestError, "prompt"),
        ("n=17", lambda: cl.completions.create(model=model, prompt="Hi", n=17), openai.BadRequestError, "n"),
        ("best_of streamed", lambda: cl.completions.create(model=model, prompt="Hi", best_of=3, stream=True),
         openai.BadRequestError, "best_of"),
        ("best_of below n", lambda: cl.completions.create(model=model, prompt="Hi", n=3, best_of=2),
         openai.BadRequestError, "best_of"),
        ("n=16 of 1,000 tokens (past the decode pool)",
         lambda: cl.completions.create(model=model, prompt="Hi", n=16, max_tokens=1000), openai.BadRequestError,
         "n"),
        ("logprobs=21", lambda: cl.completions.create(model=model, prompt="Hi", max_tokens=2, logprobs=21),
         openai.BadRequestError, "logprobs"),
        ("min_tokens over max_tokens", lambda: cl.completions.create(model=model, prompt="Hi", max_tokens=4,
                                                                     extra_body={"min_tokens": 5}),
         openai.BadRequestError, "min_tokens"),
        ("messages missing", lambda: cl.chat.completions.create(model=model, messages=[]),
         openai.BadRequestError, "messages"),
        ("a NUL in the prompt", lambda: cl.completions.create(model=model, prompt="a\0b"),
         openai.BadRequestError, "prompt"),
        ("max_tokens 2^40", lambda: cl.completions.create(model=model, prompt="Hi", max_tokens=1 << 40),
         openai.BadRequestError, "max_tokens"),
        ("a JSON Schema with allOf",
         lambda: cl.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                            response_format={"type": "json_schema", "json_schema": {
                                                "name": "x", "schema": {"allOf": [{"type": "string"}]}}}),
         openai.BadRequestError, "response_format"),
        ("a regex with an unclosed group", lambda: cl.completions.create(
            model=model, prompt="Hi", extra_body={"guided_regex": "(ab"}), openai.BadRequestError, "guided_regex"),
        ("guided_choice with ignore_eos", lambda: cl.completions.create(
            model=model, prompt="Hi", extra_body={"guided_choice": ["a"], "ignore_eos": True}),
         openai.BadRequestError, "guided_choice"),
        ("guided_json beside response_format", lambda: cl.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hi"}], response_format={"type": "json_object"},
            extra_body={"guided_json": {"type": "string"}}), openai.BadRequestError, "guided_json"),
    ]
    for name, fn, exc, param in cases:
        try:
            fn()
            ok, why = False, "accepted"
        except exc as e:
            body = e.body if isinstance(e.body, dict) else {}
            ok = bool(body.get("message")) and body.get("type") and (param is None or body.get("param") == param)
            why = "%d %s" % (e.status_code, body)
        except Exception as e:  # noqa: BLE001
            ok, why = False, repr(e)
        check("%s is refused in OpenAI's shape: %s" % (name, why[:200]), ok)
    st, _, body = raw(host, port, "POST", "/v1/completions", body=b"{not json")
    check("a body that is not JSON: %d %s" % (st, body[:120]), st == 400 and b'"error"' in body)
    st, _, body = raw(host, port, "POST", "/v1/completions", body=b"[1, 2]")
    check("a JSON array body: %d %s" % (st, body[:120]), st == 400 and b"it is an array" in body)
    big = json.dumps({"model": model, "prompt": "Hi", "max_tokens": 1 << 40}).encode()
    st, _, body = raw(host, port, "POST", "/v1/completions", body=big)
    check("max_tokens 2^40: %d %s" % (st, body[:140]), st == 400 and b"too large" in body)


def test_cross_site_posts_refused(api):
    model, host, port = api.model, api.host, api.port
    # a browser posts text/plain and forms cross-site without a preflight: refused, so a page cannot use it
    ok_body = json.dumps({"model": model, "prompt": "Hi", "max_tokens": 2}).encode()
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        st, _, body = raw(host, port, "POST", "/v1/completions", body=ok_body, headers={"Content-Type": ctype})
        check("a JSON body sent as %s: %d %s" % (ctype, st, body[:120]), st == 415 and b"application/json" in body)


def test_chunked_body_refused(api):
    host, port = api.host, api.port
    # 5 MiB sent chunked (no Content-Length to refuse it by): read, counted, refused
    s = socket.create_connection((host, port), timeout=60)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
    for _ in range(5):
        s.sendall(b"100000\r\n" + b"a" * (1 << 20) + b"\r\n")
    s.sendall(b"0\r\n\r\n")
    resp = b""
    while b"}}" not in resp:
        more = s.recv(65536)
        if not more:
            break
        resp += more
    s.close()
    check("a 5 MiB chunked body: %r" % resp.split(b"\r\n")[0], resp.startswith(b"HTTP/1.1 413") and
          b'"error"' in resp)
    st, _, body = raw(host, port, "GET", "/v1/nothing")
    check("an unknown route: %d" % st, st == 404 and b'"error"' in body)


def test_health_tokenize(api):
    c, host, port, prompts = api.c, api.host, api.port, api.prompts
    # health, tokenize, detokenize (against the gRPC Tokenize)
    st, _, body = raw(host, port, "GET", "/health")
    check("GET /health: %d %s" % (st, body), st == 200)
    st, _, body = raw(host, port, "POST", "/tokenize", body=json.dumps({"prompt": prompts[0]}))
    toks = json.loads(body)["tokens"]
    grpc_toks = list(c.stub.Tokenize(hs.pb.TokenizeRequest(text=prompts[0], add_bos=True), timeout=10).token_ids)
    st2, _, body2 = raw(host, port, "POST", "/detokenize", body=json.dumps({"tokens": toks}))
    check("tokenize equals the gRPC Tokenize (%d tokens), detokenize gives the prompt back" % len(toks),
          st == 200 and toks == grpc_toks and st2 == 200 and json.loads(body2)["prompt"].endswith(prompts[0]))


def test_disconnect_frees_kv(api):
    c, model, host, port, prompts = api.c, api.model, api.host, api.port, api.prompts
    # a client that disconnects mid-stream: its request is cancelled and its KV freed on the decode worker
    dw = c.worker("decode")
    s = socket.create_connection((host, port), timeout=30)
    body = json.dumps({"model": model, "prompt": "Tell me a long story.", "max_tokens": 2000,
                       "temperature": 0, "stream": True, "extra": 1, "ignore_eos": True}).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
              + str(len(body)).encode() + b"\r\n\r\n" + body)
    got = b""
    while got.count(b"data: ") < 5:
        more = s.recv(65536)
        if not more:
            break
        got += more
    running = c.stats(dw).running
    s.close()
    t0 = time.time()
    freed = hs.wait_for(lambda: c.stats(dw).running == 0 and c.stats(dw).kv_in_use == 0, 10)
    check("a client that disconnects mid-stream (%d running before): its sequence ends and its KV is freed "
          "after %.1f s" % (running, time.time() - t0), running == 1 and freed)
    # the same without streaming: the connection waits for the whole answer (suspended), the hang-up is
    # still seen and the request cancelled
    s = socket.create_connection((host, port), timeout=30)
    body = json.dumps({"model": model, "prompt": "Tell me a long story.", "max_tokens": 2000,
                       "temperature": 0, "ignore_eos": True}).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
              + str(len(body)).encode() + b"\r\n\r\n" + body)
    started = hs.wait_for(lambda: c.stats(dw).running == 1, 10)
    s.close()
    t0 = time.time()
    freed = hs.wait_for(lambda: c.stats(dw).running == 0 and c.stats(dw).kv_in_use == 0, 10)
    check("a non-streaming client that disconnects while its answer is generated (running: %s): cancelled, its "
          "KV freed after %.1f s" % (started, time.time() - t0), started and freed and time.time() - t0 < 3)
    ids, _ = hs.generate(c.stub, prompts[0])
    check("the cluster serves afterwards", ids == hs.reference(prompts[0]))


def test_abuse(api):
    c, cl, model, host, port, prompts = api.c, api.cl, api.model, api.host, api.port, api.prompts
    abuse(c, cl, model, host, int(port), prompts[0])


def test_api_keys():
    api_keys()
