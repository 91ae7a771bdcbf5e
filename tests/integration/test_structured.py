#!/usr/bin/env python3
"""Structured output's token masks against llguidance's (PyPI), the reference:
for regular expressions, lists of strings and JSON Schemas, random walks of
allowed tokens where, at every step, `tandem grammar` (tandem's compiler and
matcher on the default model's vocabulary) allows exactly the tokens
llguidance allows on the same vocabulary. llguidance's tokenizer is built
from the GGUF's own tokens (the GPT-2 byte alphabet undone), with the HF
tokenizers library as its encoder.

llguidance narrows a mask where the next bytes are forced (only the canonical
tokens of the forced bytes; its "fast-forward" tokens), where tandem allows
every token that continues the text. So a step compares: every token
llguidance's mask allows, tandem allows; every other token tandem allows,
llguidance takes too (validate_tokens, which checks the grammar alone); and of
the tokens tandem refuses, 2,000 drawn at random (and the end token) llguidance
refuses.

Where the two define a language differently, the cases say so: `\\d` is an
ASCII digit for tandem (as in JSON Schema's ECMA-262 patterns) and any Unicode
digit for llguidance (Rust's regex), so the cases write [0-9]; JSON Schemas
take llguidance's whitespace pattern as tandem's (at most 16 of space, tab,
newline between tokens), and list every property as required (tandem writes
each).

Run with pytest (tests/conftest.py says how)."""
import json
import os
import random
import subprocess
import sys

import gguf
import numpy as np
import pytest

import harness as hs

import llguidance  # noqa: E402
import llguidance.numpy as lnp  # noqa: E402

sys.path.insert(0, os.path.join(hs.ROOT, "tests/fixtures/tokenizer"))
from reference import hf_from_gguf  # noqa: E402

WS = {"x-guidance": {"whitespace_pattern": "[ \\t\\n]{0,16}"}}

REGEXES = [r"[a-z]+( [a-z]+){0,3}\.", r"([0-9]{3})-([0-9]{3})-[0-9]{4}", r"(cat|dog|bird)s? (run|fly)",
           r"[A-Z][a-z]{1,8}, [A-Z]{2} [0-9]{5}", r"\[(0|[1-9][0-9]{0,2})(, (0|[1-9][0-9]{0,2})){0,4}\]",
           r"(yes|no)!?"]
CHOICES = [["yes", "no", "it depends"], ["red", "green", "blue", "reddish"], ["Paris", "London", "New York"]]
SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "array", "items": {"type": "boolean"},
                                                                    "maxItems": 2}, "c": {"enum": ["x", "y"]}},
     "required": ["a", "b", "c"], "additionalProperties": False},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "array", "items": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                                "additionalProperties": False}, "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"v": {"anyOf": [{"type": "number"}, {"type": "null"}]},
                                      "s": {"const": "done"}}, "required": ["v", "s"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def ref():
    r = gguf.GGUFReader(hs.MODEL)
    f = r.fields
    toks = [bytes(f["tokenizer.ggml.tokens"].parts[i]).decode() for i in f["tokenizer.ggml.tokens"].data]
    types = [int(f["tokenizer.ggml.token_type"].parts[i][0]) for i in f["tokenizer.ggml.token_type"].data]
    eos = int(f["tokenizer.ggml.eos_token_id"].parts[-1][0])
    bos = int(f["tokenizer.ggml.bos_token_id"].parts[-1][0])
    # GPT-2's byte alphabet, undone
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    dec = {chr(c): b for b, c in zip(bs, cs)}
    tb = [t.encode() if types[i] == 3 else bytes(dec[ch] for ch in t) for i, t in enumerate(toks)]
    hf = hf_from_gguf(hs.MODEL)

    class Vocab:
        eos_token_id = eos
        bos_token_id = bos
        tokens = tb
        special_token_ids = [i for i, t in enumerate(types) if t == 3]

        def __call__(self, s):
            return hf.encode(s.decode("utf-8", "replace") if isinstance(s, bytes) else s,
                             add_special_tokens=False).ids
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(Vocab())), len(tb), eos


def walk(ref, fmt, text, args, seed, steps):
    """The first step where the two masks differ (None: none), after a walk of llguidance's allowed tokens."""
    tok, V, eos = ref
    rng = random.Random(seed)
    ms = [llguidance.LLMatcher(tok, llguidance.grammar_from(fmt, text), log_level=0)]
    assert not ms[0].is_error(), ms[0].get_error()
    refs, path = [], []
    for _ in range(steps):
        m = ms[-1]
        bm = lnp.allocate_token_bitmask(1, V)
        lnp.fill_next_token_bitmask(m, bm, 0)
        a = set(np.nonzero(np.unpackbits(bm[0].view(np.uint8), bitorder="little")[:V])[0].tolist())
        refs.append(a)
        c = sorted(a - {eos})
        if not c or len(refs) == steps:
            break
        t = rng.choice(c)
        nxt = llguidance.LLMatcher(tok, llguidance.grammar_from(fmt, text), log_level=0)  # the walk so far, again:
        assert nxt.consume_tokens(path + [t]), nxt.get_error()  # a matcher per step, to ask it afterwards
        path.append(t)
        ms.append(nxt)
    out = subprocess.run([hs.BIN + "/tandem", "grammar", hs.MODEL] + args + ["--tokens", ",".join(map(str, path))],
                         capture_output=True, text=True, timeout=300)
    mine = [set(json.loads(l)["allowed"]) for l in out.stdout.splitlines()]
    if len(mine) != len(refs):
        return "tandem stopped after %d of %d steps: %s" % (len(mine), len(refs), out.stderr.strip()[:200])
    for i, (x, y) in enumerate(zip(refs, mine)):
        where = "step %d (after %s)" % (i, path[:i])
        if x - y:
            return "%s: llguidance's mask allows %s, tandem's not" % (where, sorted(x - y)[:8])
        extra = [t for t in sorted(y - x) if t != eos]
        bad = [t for t in extra if ms[i].validate_tokens([t]) != 1]
        if bad:
            return "%s: tandem allows %s, which llguidance refuses" % (where, bad[:8])
        refused = [t for t in rng.sample(range(V), 2000) if t not in y and t != eos]
        took = [t for t in refused if ms[i].validate_tokens([t]) == 1]
        if took:
            return "%s: tandem refuses %s, which llguidance takes" % (where, took[:8])
        if (eos in y) != (eos in x):
            return "%s: the end token: tandem %s, llguidance %s" % (where, eos in y, eos in x)
    return None


def run(ref, cases, seeds, steps):
    bad, n = [], 0
    for fmt, text, args in cases:
        for seed in seeds:
            why = walk(ref, fmt, text, args, seed, steps)
            n += 1
            if why:
                bad.append("%s %s seed %d: %s" % (fmt, text[:60], seed, why))
    return n, bad


def test_regex_masks(ref):
    n, bad = run(ref, [("regex", r, ["--regex", r]) for r in REGEXES], range(3), 16)
    hs.check("regular expressions: %d walks of up to 16 tokens, every step agrees with llguidance%s" %
             (n, ": " + "; ".join(bad[:2]) if bad else ""), not bad)


def test_choice_masks(ref):
    cases = [("choice", json.dumps(c), [a for s in c for a in ("--choice", s)]) for c in CHOICES]
    n, bad = run(ref, cases, range(4), 8)
    hs.check("lists of strings: %d walks, every step agrees with llguidance%s" %
             (n, ": " + "; ".join(bad[:2]) if bad else ""), not bad)


def test_json_schema_masks(ref):
    cases = []
    for s in SCHEMAS:
        text = json.dumps(dict(s, **WS))
        cases.append(("json_schema", text, ["--json-schema", json.dumps(s)]))
    n, bad = run(ref, cases, range(3), 24)
    hs.check("JSON Schemas: %d walks of up to 24 tokens, every step agrees with llguidance%s" %
             (n, ": " + "; ".join(bad[:2]) if bad else ""), not bad)
