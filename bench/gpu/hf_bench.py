"""Hugging Face transformers on the same model directory as tandem, for the
GPU benchmark's side-by-side columns: the logits of a fixed prompt (saved for
tandem-cuda-check --hf), decode tokens/s at several batch sizes, prefill
tokens/s at several prompt lengths. One JSON object per line on stdout.

    python3 hf_bench.py DIR --logits OUT.json [--batches 1,8,32] [--prefill 1024,4096] [--steps 32]
"""
import argparse
import json
import time

import torch
import transformers
from transformers import AutoModelForCausalLM

IDS = [0, 17, 230, 45, 99, 301, 12, 7, 550, 421, 88, 3, 64, 199, 250, 333, 17, 18, 19, 20, 21, 22, 23, 24]


def timed(fn, reps):
    fn()
    torch.cuda.synchronize()
    t = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        t.append(time.perf_counter() - t0)
    return sorted(t)[len(t) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--logits")
    ap.add_argument("--batches", default="1,8,32,128,256")
    ap.add_argument("--prefill", default="1024,4096")
    ap.add_argument("--steps", type=int, default=32)
    a = ap.parse_args()
    m = AutoModelForCausalLM.from_pretrained(a.dir, dtype=torch.float16, attn_implementation="sdpa").cuda().eval()
    print(json.dumps({"what": "hf", "transformers": transformers.__version__, "torch": torch.__version__,
                      "device": torch.cuda.get_device_name()}), flush=True)
    with torch.no_grad():
        if a.logits:
            lg = m(torch.tensor([IDS], device="cuda")).logits[0].float()
            json.dump({"ids": IDS, "first_row": len(IDS) - 4, "logits": lg[-4:].double().tolist(), "dtype": "fp16",
                       "transformers": transformers.__version__}, open(a.logits, "w"))
        for n in [int(x) for x in a.prefill.split(",") if x]:
            ids = torch.randint(2, 500, (1, n), device="cuda")
            dt = timed(lambda: m(ids, use_cache=False, logits_to_keep=1), 3)
            print(json.dumps({"what": "hf_prefill", "tokens": n, "s": dt, "tok_s": n / dt}), flush=True)
        for b in [int(x) for x in a.batches.split(",") if x]:
            ids = torch.randint(2, 500, (b, 16), device="cuda")

            def run():
                out = m(ids, use_cache=True)
                past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(a.steps):
                    out = m(nxt, past_key_values=past, use_cache=True)
                    past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
                torch.cuda.synchronize()
                return time.perf_counter() - t0
            run()
            dt = sorted(run() for _ in range(3))[1]
            print(json.dumps({"what": "hf_decode", "batch": b, "step_ms": dt / a.steps * 1e3,
                              "tok_s": b * a.steps / dt}), flush=True)


if __name__ == "__main__":
    main()
