/* refnum.h — reference numerics (refnum_avx2.c): the CPU ops computed in
 * llama.cpp's order of operations, bit for bit, for a backend created with
 * reference numerics (kern_cpu_backend_create_ex). AVX2 machines only. */
#ifndef KERN_CPU_REFNUM_H
#define KERN_CPU_REFNUM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/backend.h"

void kern_ref_swiglu(const float *g, const float *u, float *y, size_t n);
/* RoPE with angles p·s^i as a float product chain (s = powf(base, -2/head_dim)) */
void kern_ref_rope(float *x, uint32_t n, uint32_t heads, uint32_t head_dim, const int32_t *pos, float theta_scale,
                   bool neox);
/* One (row, head) of attention over fp16 KV. scratch: room for the row's
 * positions rounded up to 32, as floats and again as fp16. */
void kern_ref_attention_row(const kern_kv_view_t *kv, const kern_attn_seq_t *s, uint32_t row, uint32_t head,
                            uint32_t n_heads, const float *q_all, float *out_all, float scale, float *scratch);

#endif
