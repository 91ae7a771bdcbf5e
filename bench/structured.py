#!/usr/bin/env python3
"""Structured output's cost: tandem generate's decode tokens/s with and without
a JSON Schema mask, at batch 1 and 32, runs alternating (medians of RUNS each).

    python3 bench/structured.py [RUNS]    (from the repository root, after a build)

The schema asks for an array of 60 to 80 integers (a long output of many short
tokens: a mask at every step). The plain runs generate as many tokens with
ignore_eos. Prints a markdown summary (bench/results/structured-DATE.md)."""
import json
import os
import re
import statistics
import subprocess
import sys
import time

RUNS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
SCHEMA = json.dumps({"type": "array", "items": {"type": "integer"}, "minItems": 60, "maxItems": 80})
PROMPT = "List some numbers as a JSON array."


def run(batch, schema):
    args = ["build/bin/tandem", "generate", "--threads", "2", "--chat", "--n", str(batch), "--temperature", "0.8",
            "--seed", "1", "--max-tokens", "240"]
    args += ["--json-schema", SCHEMA] if schema else ["--ignore-eos"]
    err = subprocess.run(args + [PROMPT], capture_output=True, text=True, check=True).stderr
    m = re.search(r"decode (\d+) tokens in ([\d.]+) ms = ([\d.]+) tok/s", err)
    return float(m.group(3)), int(m.group(1))


rows = []
for batch in (1, 32):
    got = {False: [], True: []}
    for _ in range(RUNS):
        for schema in (False, True):
            got[schema].append(run(batch, schema))
    plain = statistics.median(r[0] for r in got[False])
    masked = statistics.median(r[0] for r in got[True])
    rows.append((batch, plain, masked, statistics.median(r[1] for r in got[True]) / batch))
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
print("# Structured output's cost — %s\n" % time.strftime("%Y-%m-%d", time.gmtime()))
print("- machine: %s, %d cores; commit %s; the default model (SmolLM2-135M-Instruct Q4_1), CPU backend, 2 threads"
      % (cpu, os.cpu_count(), commit))
print("- command: `python3 bench/structured.py %d` (tandem generate, runs alternating, medians of %d)" % (RUNS, RUNS))
print("- schema: `%s`; the plain runs: the same prompt, ignore_eos, 240 tokens a sequence\n" % SCHEMA)
print("| batch | plain tok/s | JSON Schema tok/s | masked / plain | tokens a masked sequence |\n|---|---|---|---|---|")
for b, p, m, n in rows:
    print("| %d | %.0f | %.0f | %.2f | %.0f |" % (b, p, m, m / p, n))
