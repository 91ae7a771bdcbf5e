#!/usr/bin/env python3
"""The same task's log-likelihoods from the same GGUF loaded another way:
llama-cpp-python in process, each request tokenized as lm-eval's API models
do (the whole context + continuation, the context's own length marking where
the continuation starts), log-softmax of llama.cpp's logits. Written where
compare.py reads a run: OUT/ref/results_ref.json and samples_ref.jsonl.

    llama_ref.py MODEL.gguf TASK_JSONL OUT"""
import json
import os
import sys

import numpy as np
from llama_cpp import Llama

model, task, out = sys.argv[1:4]
llm = Llama(model_path=model, logits_all=True, n_ctx=2048, n_threads=2, verbose=False)
tok = lambda s: llm.tokenize(s.encode(), add_bos=False, special=False)  # noqa: E731
os.makedirs(os.path.join(out, "ref"), exist_ok=True)
correct = []
with open(os.path.join(out, "ref", "samples_ref.jsonl"), "w") as f:
    for i, line in enumerate(open(task)):
        doc = json.loads(line)
        ctx = "%s\nAnswer:" % doc["question"]
        lls = []
        for choice in doc["choices"]:
            whole, n_ctx = tok(ctx + " " + choice), len(tok(ctx))
            llm.reset()
            llm.eval(whole)
            logits = np.array(llm.scores[:len(whole)], dtype=np.float64)
            rows = logits[n_ctx - 1:len(whole) - 1]
            lse = np.log(np.exp(rows - rows.max(1, keepdims=True)).sum(1)) + rows.max(1)
            lls.append(float(sum(rows[k, t] - lse[k] for k, t in enumerate(whole[n_ctx:]))))
        acc = float(int(np.argmax(lls)) == doc["answer"])
        correct.append(acc)
        f.write(json.dumps({"doc_id": i, "filtered_resps": [[str(v), "False"] for v in lls], "acc": acc}) + "\n")
n = len(correct)
mean = sum(correct) / n
stderr = (sum((c - mean) ** 2 for c in correct) / (n - 1) / n) ** 0.5
json.dump({"results": {"tandem_mc": {"acc,none": mean, "acc_stderr,none": stderr}}},
          open(os.path.join(out, "ref", "results_ref.json"), "w"))
