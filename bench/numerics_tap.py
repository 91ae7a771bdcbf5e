"""Op-by-op comparison of tandem's forward pass with llama.cpp's on one chat prompt.

    python3 bench/numerics_tap.py [MODEL] [--prompt I] [--steps K] [--layers 0,29] [--numerics reference|fast]
    (needs: build/bin/tandem-numerics-tap, and llama-cpp-python in this Python)

llama.cpp side: the scheduler's eval callback hands over every graph tensor
(Qcur-0, kq-0, ffn_out-0, ...) as it is computed; tandem side: the forward
pass's tap (engine/forward.h) writes the same intermediates. The prompt is
prompt I of tests/fixtures/generate/greedy.jsonl, run as one prefill, then K
decode steps on llama.cpp's own greedy tokens. Prints, for every op of the
chosen layers, the share of bit-identical floats and the largest difference —
the first op below 100% is where the rounding parts.
"""
import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
from llama_cpp import Llama
from llama_cpp import llama_cpp as C
import llama_cpp.llama as LL

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAIRS = [("attn_norm", "attn_norm-{l}"), ("Qcur", "Qcur-{l}"), ("Kcur", "Kcur-{l}"), ("Vcur", "Vcur-{l}"),
         ("Qrope", "Qcur-{l}#2"), ("Krope", "Kcur-{l}#2"), ("kqv_out", "kqv_out-{l}"), ("attn_out", "attn_out-{l}"),
         ("ffn_inp", "ffn_inp-{l}"), ("ffn_norm", "ffn_norm-{l}"), ("ffn_gate", "ffn_gate-{l}"),
         ("ffn_up", "ffn_up-{l}"), ("ffn_swiglu", "ffn_swiglu-{l}"), ("ffn_out", "ffn_out-{l}"), ("l_out", "l_out-{l}")]


def llama_taps(model, ids, steps):
    base = ctypes.CDLL(os.path.join(os.path.dirname(C._lib._name), "libggml-base.so"))
    base.ggml_get_name.restype = ctypes.c_char_p
    base.ggml_get_name.argtypes = [ctypes.c_void_p]
    base.ggml_get_data.restype = ctypes.c_void_p
    base.ggml_get_data.argtypes = [ctypes.c_void_p]
    base.ggml_is_contiguous.restype = ctypes.c_bool
    base.ggml_is_contiguous.argtypes = [ctypes.c_void_p]
    store, step = {}, [0]

    def cb(t, ask, _):
        if ask:
            return True
        # struct ggml_tensor: type (int32, padded to 8), buffer pointer, ne[4] at byte 16
        typ = ctypes.c_int32.from_address(t).value
        ne = [ctypes.c_int64.from_address(t + 16 + 8 * i).value for i in range(4)]
        if typ == 0 and base.ggml_is_contiguous(t):
            n = ne[0] * ne[1] * ne[2] * ne[3]
            a = np.ctypeslib.as_array((ctypes.c_float * n).from_address(base.ggml_get_data(t))).copy()
            key, k, i = f"{step[0]}:{base.ggml_get_name(t).decode()}", None, 0
            k = key
            while k in store:
                i += 1
                k = f"{key}#{i}"
            store[k] = a.reshape(-1, ne[0] * (ne[1] if ne[2] > 1 and ne[1] != ids_len[0] else 1))
        return True

    ids_len = [len(ids)]
    fn = C.ggml_backend_sched_eval_callback(cb)
    orig = C.llama_context_default_params

    def patched():
        p = orig()
        p.cb_eval = fn
        return p

    C.llama_context_default_params = LL.llama_cpp.llama_context_default_params = patched
    llm = Llama(model, n_ctx=1024, n_threads=2, n_batch=512, verbose=False)
    C.llama_context_default_params = LL.llama_cpp.llama_context_default_params = orig
    llm.eval(ids["prompt"])
    for s in range(steps):
        step[0] = s + 1
        llm.eval([ids["greedy"][s]])
    return store


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=os.path.join(ROOT, "models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--prompt", type=int, default=0)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--layers", default="0,1")
    ap.add_argument("--numerics", default="reference")
    a = ap.parse_args()
    ref = [json.loads(l) for l in open(os.path.join(ROOT, "tests/fixtures/generate/greedy.jsonl"))][a.prompt]
    ids = {"prompt": ref["ids"], "greedy": ref["greedy"]}
    theirs = llama_taps(a.model, ids, a.steps)
    out = tempfile.mkdtemp(prefix="tandem-tap-")
    subprocess.run([os.path.join(ROOT, "build/bin/tandem-numerics-tap"), a.model, out,
                    ",".join(map(str, ref["ids"])), ",".join(map(str, ref["greedy"][:a.steps]))],
                   check=True, env=dict(os.environ, TANDEM_TAP_NUMERICS=a.numerics))
    index = {}
    for line in open(os.path.join(out, "index.tsv")):
        f, r, c = line.split("\t")
        index[f] = (int(r), int(c))

    def ours(step, name):
        f = f"{step}_{name}.f32"
        return np.fromfile(os.path.join(out, f), dtype=np.float32).reshape(index[f]) if f in index else None

    def show(label, mine, want):
        # llama.cpp keeps only the output row after the last layer's attention
        want = want.reshape(-1, mine.shape[1])
        mine = mine[-want.shape[0]:]
        d = np.abs(mine - want)
        print(f"{label:24s} identical {100 * np.mean(mine == want):6.2f}%  max |diff| {d.max():.3e}")

    for s in range(a.steps + 1):
        for l in map(int, a.layers.split(",")):
            for mine_name, their_name in PAIRS:
                mine, key = ours(s, f"{mine_name}-{l}"), f"{s}:{their_name.format(l=l)}"
                if mine is not None and key in theirs:
                    show(f"step {s} layer {l} {mine_name}", mine, theirs[key])
        show(f"step {s} logits", ours(s, "result_output"), theirs[f"{s}:result_output"])


if __name__ == "__main__":
    sys.exit(main())
