"""A Llama-shaped model with random weights, written as a Hugging Face
directory (config.json, model.safetensors, the tokenizer given), for GPU
benchmarks: the same files feed tandem and transformers.

    python3 make_random_llama.py OUT_DIR --shape llama2-7b|llama3-8b|llama3-70b [--dtype fp16|bf16] --tokenizer DIR
                                 [--config-only]

--config-only writes config.json and the tokenizer alone: a folder for tandem's dummy load format
(model.load_format: dummy), whose weights are seeded values the backend makes (no torch needed then).

Weights: normal, std 0.02, made on the GPU with a fixed seed; norms are ones.
The tokenizer is DIR's (a small byte-level BPE is enough), its vocabulary
padded with plain word tokens up to the model's, so that every id the random
model samples decodes. Needs torch and safetensors (the GPU machine has both).
"""
import argparse
import json
import os
import shutil


SHAPES = {
    "llama2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, vocab_size=32000, rope_theta=10000.0, max_position_embeddings=4096),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192),
    "llama3-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                       num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--config-only", action="store_true")
    a = ap.parse_args()
    s = SHAPES[a.shape]
    os.makedirs(a.out, exist_ok=True)
    write_config(a, s)
    if a.config_only:
        print("%s: %s, config and tokenizer only (the dummy load format)" % (a.out, a.shape))
        return
    import torch
    from safetensors.torch import save_file
    dt = torch.float16 if a.dtype == "fp16" else torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(1234)
    H, F, V = s["hidden_size"], s["intermediate_size"], s["vocab_size"]
    hd = H // s["num_attention_heads"]
    kv = s["num_key_value_heads"] * hd

    def rnd(*shape):
        return (torch.randn(*shape, generator=g, device="cuda", dtype=torch.float32) * 0.02).to(dt).cpu()

    t = {"model.embed_tokens.weight": rnd(V, H), "model.norm.weight": torch.ones(H, dtype=dt),
         "lm_head.weight": rnd(V, H)}
    for i in range(s["num_hidden_layers"]):
        p = "model.layers.%d." % i
        t[p + "self_attn.q_proj.weight"] = rnd(H, H)
        t[p + "self_attn.k_proj.weight"] = rnd(kv, H)
        t[p + "self_attn.v_proj.weight"] = rnd(kv, H)
        t[p + "self_attn.o_proj.weight"] = rnd(H, H)
        t[p + "mlp.gate_proj.weight"] = rnd(F, H)
        t[p + "mlp.up_proj.weight"] = rnd(F, H)
        t[p + "mlp.down_proj.weight"] = rnd(H, F)
        t[p + "input_layernorm.weight"] = torch.ones(H, dtype=dt)
        t[p + "post_attention_layernorm.weight"] = torch.ones(H, dtype=dt)
    save_file(t, os.path.join(a.out, "model.safetensors"), metadata={"format": "pt"})
    n = sum(x.numel() for x in t.values())
    print("%s: %s, %.2f B parameters, %s" % (a.out, a.shape, n / 1e9, a.dtype))


def write_config(a, s):
    V = s["vocab_size"]
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", rms_norm_eps=1e-5, tie_word_embeddings=False,
               bos_token_id=0, eos_token_id=1, torch_dtype="float16" if a.dtype == "fp16" else "bfloat16", **s)
    json.dump(cfg, open(os.path.join(a.out, "config.json"), "w"), indent=1)
    tok = json.load(open(os.path.join(a.tokenizer, "tokenizer.json")))
    vocab = tok["model"]["vocab"]
    taken = set(vocab.values()) | {t["id"] for t in tok.get("added_tokens", [])}
    for i in range(V):
        if i not in taken:
            vocab["\u0120w%d" % i] = i  # "Ġw123": a word, as byte-level BPE spells a leading space
    json.dump(tok, open(os.path.join(a.out, "tokenizer.json"), "w"))
    if os.path.exists(os.path.join(a.tokenizer, "tokenizer_config.json")):
        shutil.copy(os.path.join(a.tokenizer, "tokenizer_config.json"), a.out)


if __name__ == "__main__":
    main()
