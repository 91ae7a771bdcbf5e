#!/usr/bin/env python3
"""Suite: the documentation holds.

- every relative link in README.md and docs/*.md resolves to a file or folder of
  the repository (a link into a page that moved or was renamed fails here), and a
  page of docs/ that no other page links to is named;
- the README's five-minute tour runs as it is written: its shell block, taken
  from the README, run by bash -e in a scratch folder whose build/bin and models/
  are this build's (the tour's `python3` is the test venv's, which has openai);
  each of its commands must succeed and print what the tour says it prints, and
  the cluster it starts must stop.
Run with pytest (tests/conftest.py says how)."""
import json
import os
import re
import shutil
import subprocess
import tempfile

from harness import BIN, ROOT, check

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def pages():
    return [os.path.join(ROOT, "README.md")] + sorted(
        os.path.join(ROOT, "docs", f) for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))


def test_links():
    bad, n, linked = [], 0, set()
    for p in pages():
        text = re.sub(r"```.*?```", "", open(p).read(), flags=re.S)  # code blocks hold no links
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a URL or an anchor in the page
            n += 1
            path = os.path.normpath(os.path.join(os.path.dirname(p), target.split("#")[0]))
            linked.add(path)
            if not os.path.exists(path):
                bad.append("%s -> %s" % (os.path.relpath(p, ROOT), target))
    check("%d relative links in README.md and docs/ (%d pages) resolve" % (n, len(pages())), n > 20 and not bad,
          "; ".join(bad))
    orphans = [os.path.relpath(p, ROOT) for p in pages()[1:] if p not in linked]
    check("every page of docs/ is linked from another page", not orphans, ", ".join(orphans))
    lines = sum(1 for _ in open(os.path.join(ROOT, "README.md")))
    check("the README is a front page: %d lines (at most 150)" % lines, lines <= 150)
    # the check can fail: a broken link is found
    d = tempfile.mkdtemp(prefix="tandem-links-")
    try:
        with open(os.path.join(d, "x.md"), "w") as f:
            f.write("[a](nowhere.md) [b](x.md)\n")
        found = [t for t in LINK.findall(open(os.path.join(d, "x.md")).read())
                 if not os.path.exists(os.path.join(d, t))]
        check("a link to a missing page is found by the same reading", found == ["nowhere.md"], str(found))
    finally:
        shutil.rmtree(d)


def tour():
    text = open(os.path.join(ROOT, "README.md")).read()
    part = text[text.index("## A five-minute tour"):]
    return re.search(r"```sh\n(.*?)```", part, re.S).group(1)


def test_tour():
    block = tour()
    work = tempfile.mkdtemp(prefix="tandem-tour-")
    os.makedirs(os.path.join(work, "build"))
    os.symlink(BIN, os.path.join(work, "build", "bin"))
    os.symlink(os.path.join(ROOT, "models"), os.path.join(work, "models"))
    env = dict(os.environ, PATH=os.path.join(ROOT, ".venv", "bin") + ":" + os.environ["PATH"],
               XDG_CACHE_HOME=os.path.join(work, "cache"))
    try:
        r = subprocess.run(["bash", "-e", "-c", block], cwd=work, env=env, capture_output=True, text=True,
                           timeout=300)
        out, log = r.stdout, open(os.path.join(work, "tandem-up.log")).read()
        check("the README's tour ran as written (bash -e: every command succeeded; %d lines)" % block.count("\n"),
              r.returncode == 0, (r.stderr + out)[-1500:])
        # what each command printed, in turn: the gRPC continuation, the chat completion's JSON, the openai
        # client's text, tandem status, tandem bench
        ref = subprocess.run([BIN + "/tandem", "generate", "--model", os.path.join(ROOT, "models",
                              "SmolLM2-135M-Instruct.Q4_1.gguf"), "--max-tokens", "24", "--threads", "1",
                              "The capital of France is"], capture_output=True, text=True, timeout=120).stdout
        gen, _, rest = out.partition('{"id":"chatcmpl')
        check("  tandem generate streamed the continuation, identical to single-process (%r)" % gen[:60],
              gen.strip() and gen.rstrip("\n") == ref.rstrip("\n"), "%r vs %r" % (gen, ref))
        chat, _, rest = ('{"id":"chatcmpl' + rest).partition("\n")
        try:
            content = json.loads(chat)["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError):
            content = None
        check("  curl got a chat completion (%r)" % content, bool(content), chat[:400])
        text, _, status = rest.partition("cluster: ")
        check("  the openai client printed a completion (%r)" % text.strip()[:60], bool(text.strip()), rest[:400])
        check("  tandem status: serving, the workers and the planner",
              status.startswith("SERVING") and "prefill-" in status and "decode-" in status and "planner:" in status,
              status[:600])
        check("  tandem bench: 16 of 16 served and the goodput", "sent 16, done 16, failed 0" in r.stderr and
              "goodput" in status, (status[-600:] + r.stderr[-300:]))
        check("  tandem up drained and stopped when killed", "tandem up: stopping" in log, log[-800:])
    finally:
        subprocess.run(["pkill", "-TERM", "-f", work], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
