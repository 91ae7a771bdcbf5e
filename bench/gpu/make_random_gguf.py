"""A Llama-shaped GGUF with random weights in F16 or Q8_0, for llama.cpp's
benchmarks beside tandem's on the same shape (issue 51's llama.cpp peer).
Weights normal, std 0.02, one block of values per matrix shape shared by every
layer (speed does not depend on the values; Q8_0 is gguf-py's quantization of
that block); norms ones; a plain SentencePiece-style vocabulary of the shape's
size. The embedding table and the output matrix are F16 in both.

    python3 make_random_gguf.py OUT.gguf --shape llama2-7b|llama3-8b [--type f16|q8_0]

Needs numpy and gguf-py (llama.cpp's own, or the gguf package from PyPI).
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_random_llama import SHAPES  # noqa: E402

import gguf  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama2-7b")
    ap.add_argument("--type", choices=["f16", "q8_0"], default="f16")
    a = ap.parse_args()
    s = SHAPES[a.shape]
    H, Fd, V, L = s["hidden_size"], s["intermediate_size"], s["vocab_size"], s["num_hidden_layers"]
    nh, nkv = s["num_attention_heads"], s["num_key_value_heads"]
    hd = H // nh
    w = gguf.GGUFWriter(a.out, "llama")
    w.add_name("random " + a.shape)
    w.add_context_length(s["max_position_embeddings"])
    w.add_embedding_length(H)
    w.add_block_count(L)
    w.add_feed_forward_length(Fd)
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(s["rope_theta"])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(V)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if a.type == "q8_0" else gguf.LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model("llama")
    toks = [b"<unk>", b"<s>", b"</s>"] + [("<0x%02X>" % i).encode() for i in range(256)]
    toks += [("w%d" % i).encode() for i in range(V - len(toks))]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
    types += [gguf.TokenType.NORMAL] * (V - len(types))
    w.add_token_list(toks)
    w.add_token_scores([0.0] * V)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    rng = np.random.default_rng(1234)
    blocks = {}

    def mat(rows, cols):
        if (rows, cols) not in blocks:
            blocks[rows, cols] = (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)
        return blocks[rows, cols]

    quant = {}

    def layer_mat(name, rows, cols):  # a layer's matrix in the file's type
        if a.type == "f16":
            w.add_tensor(name, mat(rows, cols))
            return
        if (rows, cols) not in quant:
            quant[rows, cols] = gguf.quants.quantize(mat(rows, cols).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
        w.add_tensor(name, quant[rows, cols], raw_dtype=gguf.GGMLQuantizationType.Q8_0)

    ones = np.ones(H, dtype=np.float32)
    w.add_tensor("token_embd.weight", mat(V, H))
    w.add_tensor("output_norm.weight", ones)
    w.add_tensor("output.weight", mat(V, H))
    for i in range(L):
        p = "blk.%d." % i
        w.add_tensor(p + "attn_norm.weight", ones)
        w.add_tensor(p + "ffn_norm.weight", ones)
        layer_mat(p + "attn_q.weight", nh * hd, H)
        layer_mat(p + "attn_k.weight", nkv * hd, H)
        layer_mat(p + "attn_v.weight", nkv * hd, H)
        layer_mat(p + "attn_output.weight", H, nh * hd)
        layer_mat(p + "ffn_gate.weight", Fd, H)
        layer_mat(p + "ffn_up.weight", Fd, H)
        layer_mat(p + "ffn_down.weight", H, Fd)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print("%s: %s, random %s weights, %.2f GB" % (a.out, a.shape, a.type, os.path.getsize(a.out) / 1e9))


if __name__ == "__main__":
    main()
