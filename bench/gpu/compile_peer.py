"""The torch.compile peer of issue 51: a Llama decode loop in gpt-fast's manner
(a static KV cache per layer, the step compiled with mode="reduce-overhead",
so each batch size replays one CUDA graph; greedy picks inside the step),
random weights in a named shape, sized so that batch 256 fits: the cache holds
the prompt and the tokens decoded, no more. Weights fp16, or FP8 E4M3 with a
scale a row and activations quantized a token at a time (torch._scaled_mm's
row-wise scaling: W8A8 as vLLM serves FP8 on Hopper). Prefill: the same model
uncompiled over one prompt with SDPA's causal kernel (flash attention).

    python3 compile_peer.py --shape llama2-7b [--weights fp16|fp8] [--batches 1,8,32,64,128,256]
                            [--prompt 16] [--steps 128] [--prefill 1024,4096,16384]

One JSON object a line on stdout: {"what": "compile_decode", "weights", "batch", "ms_step", "tok_s"} and
{"what": "compile_prefill", "weights", "tokens", "ms", "tok_s"}. Needs torch with CUDA (the GPU machine has it).
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_random_llama import SHAPES  # noqa: E402

F8_MAX = 448.0
# the activations' dtype: fp16, or bf16 beside FP8 weights (torch's row-wise FP8 GEMM writes bf16)
DT = torch.float16


def rows_to_fp8(w):
    """w [out][in] -> (codes float8_e4m3fn, fp32 scale a row [1][out]), amax / 448 as tandem's load"""
    s = (w.float().abs().amax(dim=1, keepdim=True) / F8_MAX).clamp(min=1e-12)
    return (w.float() / s).clamp(-F8_MAX, F8_MAX).to(torch.float8_e4m3fn), s.t().contiguous()


class Linear(torch.nn.Module):
    """y = x · Wᵀ, W fp16 [out][in], or FP8 codes [out][in] with a scale a row (W8A8)"""

    def __init__(self, out, inp, fp8, gen):
        super().__init__()
        w = torch.randn(out, inp, generator=gen, device="cuda", dtype=DT) * 0.02
        self.fp8 = fp8
        if fp8:
            q, s = rows_to_fp8(w)
            self.w = torch.nn.Parameter(q, requires_grad=False)
            self.s = torch.nn.Parameter(s, requires_grad=False)
        else:
            self.w = torch.nn.Parameter(w, requires_grad=False)

    def forward(self, x):
        if not self.fp8:
            return F.linear(x, self.w)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        n = x2.shape[0]
        pad = (16 - n % 16) % 16  # cuBLAS's FP8 GEMM takes rows a multiple of 16
        x2 = F.pad(x2, (0, 0, 0, pad))
        xs = (x2.float().abs().amax(dim=1, keepdim=True) / F8_MAX).clamp(min=1e-12)
        xq = (x2.float() / xs).clamp(-F8_MAX, F8_MAX).to(torch.float8_e4m3fn)
        y = torch._scaled_mm(xq, self.w.t(), scale_a=xs, scale_b=self.s, out_dtype=DT)
        return y[:n].reshape(*shape[:-1], y.shape[-1])


def rms_norm(x, w, eps=1e-5):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def rope(x, cos, sin):
    """x [b][t][h][d] in neox halves; cos, sin [t][d/2]"""
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d].float(), x[..., d:].float()
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


class Layer(torch.nn.Module):
    def __init__(self, H, Fd, nh, nkv, hd, fp8, g, cache_shape):
        super().__init__()
        self.H, self.F, self.nh, self.nkv, self.hd = H, Fd, nh, nkv, hd
        self.an = torch.nn.Parameter(torch.ones(H, device="cuda", dtype=DT), requires_grad=False)
        self.fn = torch.nn.Parameter(torch.ones(H, device="cuda", dtype=DT), requires_grad=False)
        self.wqkv = Linear((nh + 2 * nkv) * hd, H, fp8, g)  # gpt-fast's fused Q|K|V
        self.wo = Linear(H, nh * hd, fp8, g)
        self.w13 = Linear(2 * Fd, H, fp8, g)  # gate|up as one matrix
        self.w2 = Linear(H, Fd, fp8, g)
        # the static cache, for the largest batch; a batch of b takes its first b sequences
        self.register_buffer("kc", torch.zeros(cache_shape, device="cuda", dtype=DT), persistent=False)
        self.register_buffer("vc", torch.zeros(cache_shape, device="cuda", dtype=DT), persistent=False)

    def forward(self, x, cos, sin, pos, mask):
        b, t, _ = x.shape
        h = rms_norm(x, self.an)
        q, k, v = self.wqkv(h).split([self.nh * self.hd, self.nkv * self.hd, self.nkv * self.hd], dim=-1)
        q = rope(q.view(b, t, self.nh, self.hd), cos, sin).transpose(1, 2)
        k = rope(k.view(b, t, self.nkv, self.hd), cos, sin).transpose(1, 2)
        v = v.view(b, t, self.nkv, self.hd).transpose(1, 2)
        gqa = self.nkv != self.nh
        if mask is not None:  # gpt-fast's step: K and V into the static cache, the attention over all of it, masked
            kc, vc = self.kc[:b], self.vc[:b]
            kc.index_copy_(2, pos, k)
            vc.index_copy_(2, pos, v)
            o = F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, enable_gqa=gqa)
        else:  # a fresh prompt: SDPA's causal kernel
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        x = x + self.wo(o.transpose(1, 2).reshape(b, t, self.H))
        gu = self.w13(rms_norm(x, self.fn))
        return x + self.w2(F.silu(gu[..., :self.F]) * gu[..., self.F:])


class Model(torch.nn.Module):
    def __init__(self, s, fp8, max_batch, max_seq):
        super().__init__()
        g = torch.Generator(device="cuda").manual_seed(1234)
        H, Fd, V = s["hidden_size"], s["intermediate_size"], s["vocab_size"]
        nh, nkv = s["num_attention_heads"], s["num_key_value_heads"]
        hd = H // nh
        self.emb = torch.nn.Parameter(torch.randn(V, H, generator=g, device="cuda", dtype=DT) * 0.02,
                                      requires_grad=False)
        self.out = Linear(V, H, False, g)  # the output matrix stays fp16, as tandem's
        self.norm = torch.nn.Parameter(torch.ones(H, device="cuda", dtype=DT), requires_grad=False)
        self.layers = torch.nn.ModuleList(Layer(H, Fd, nh, nkv, hd, fp8, g, (max_batch, nkv, max_seq, hd))
                                          for _ in range(s["num_hidden_layers"]))
        self.theta, self.hd = s["rope_theta"], hd
        self.angles(max_seq)
        self.register_buffer("causal", torch.tril(torch.ones(max_seq, max_seq, dtype=torch.bool, device="cuda")),
                             persistent=False)

    def angles(self, n):
        inv = 1.0 / (self.theta ** (torch.arange(0, self.hd, 2, device="cuda").float() / self.hd))
        ang = torch.outer(torch.arange(n, device="cuda").float(), inv)
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)

    def forward(self, ids, pos, cached=True):
        """ids [b][t], pos [t]; cached: gpt-fast's step over the static cache; else a fresh prompt"""
        x = F.embedding(ids, self.emb)
        cos, sin = self.cos[pos], self.sin[pos]
        mask = self.causal[None, None, pos] if cached else None
        for L in self.layers:
            x = L(x, cos, sin, pos, mask)
        return self.out(rms_norm(x[:, -1:], self.norm))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama2-7b")
    ap.add_argument("--weights", choices=["fp16", "fp8"], default="fp16")
    ap.add_argument("--batches", default="1,8,32,64,128,256")
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--prefill", default="1024,4096,16384")
    a = ap.parse_args()
    global DT
    DT = torch.bfloat16 if a.weights == "fp8" else torch.float16
    torch._dynamo.config.cache_size_limit = 32
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = True
    batches = [int(x) for x in a.batches.split(",") if x]
    m = Model(SHAPES[a.shape], a.weights == "fp8", max(batches), a.prompt + a.steps)
    print(json.dumps({"what": "compile_peer", "torch": torch.__version__, "device": torch.cuda.get_device_name(),
                      "shape": a.shape, "weights": a.weights}), flush=True)

    def step(ids, pos):
        return m.forward(ids, pos).argmax(-1)

    cstep = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        for b in batches:
            ids = torch.randint(2, 500, (b, a.prompt), device="cuda")
            nxt = m.forward(ids, torch.arange(a.prompt, device="cuda")).argmax(-1)
            t0 = time.perf_counter()
            for k in range(3):  # compile (the first batch size, and the first with a batch size of its own) and record
                nxt = cstep(nxt, torch.tensor([a.prompt + k], device="cuda")).clone()
            torch.cuda.synchronize()
            warm = time.perf_counter() - t0
            m.forward(ids, torch.arange(a.prompt, device="cuda"))
            pos = [torch.tensor([a.prompt + k], device="cuda") for k in range(a.steps)]
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for k in range(a.steps):
                nxt = cstep(nxt, pos[k]).clone()
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            print(json.dumps({"what": "compile_decode", "weights": a.weights, "batch": b, "steps": a.steps,
                              "ms_step": dt / a.steps * 1e3, "tok_s": b * a.steps / dt, "warm_s": round(warm, 1)}),
                  flush=True)
        for L in m.layers:  # the caches' room to the prompts
            L.kc = L.vc = None
        torch.cuda.empty_cache()
        for n in [int(x) for x in a.prefill.split(",") if x]:
            if n > m.cos.shape[0]:
                m.angles(n)
            ids = torch.randint(2, 500, (1, n), device="cuda")
            pos = torch.arange(n, device="cuda")
            ts = []
            for r in range(4):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                m.forward(ids, pos, cached=False)
                torch.cuda.synchronize()
                if r:
                    ts.append(time.perf_counter() - t0)
            dt = sorted(ts)[len(ts) // 2]
            print(json.dumps({"what": "compile_prefill", "weights": a.weights, "tokens": n, "ms": dt * 1e3,
                              "tok_s": n / dt}), flush=True)


if __name__ == "__main__":
    main()
