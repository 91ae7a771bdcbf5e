#!/usr/bin/env python3
"""prompt_of.py TOKENIZER_JSON N — prints a prompt of fewer than N tokens (N - 1 or a few less: BOS comes first)
under the tokenizer, made of small numbers, for the GPU benchmarks' long-prompt (prefill) runs."""
import sys

from tokenizers import Tokenizer

t = Tokenizer.from_file(sys.argv[1])
n = int(sys.argv[2])
w = []
while len(t.encode(" ".join(w), add_special_tokens=False).ids) < n:
    w.append(str(len(w) % 97))
print(" ".join(w[:-1]))
