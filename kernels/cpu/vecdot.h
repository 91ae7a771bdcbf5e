/* vecdot.h — dot products of one weight row with one activation row, the inner
 * loop of the CPU matmul, and the activation quantizers they need.
 *
 * As llama.cpp does, activations meet 4- and 8-bit weights as 8-bit blocks of
 * their own, so the dot product runs on integers:
 *   Q8_0  32 values  34 B  { f16 d; i8 qs[32]; }              x ≈ d * q
 *   Q8_1  32 values  36 B  { f16 d; f16 s; i8 qs[32]; }       s = d * Σq
 * Q4_0 and Q8_0 weights take Q8_0 activations, Q4_1 takes Q8_1 (its min needs
 * Σq); F16, BF16 and F32 weights take fp32 activations; K-quant rows are
 * decoded to fp32 first. Shapes: w is one row of n values in its format; x is
 * n activation values in the format the weight takes. */
#ifndef KERN_CPU_VECDOT_H
#define KERN_CPU_VECDOT_H

#include <stddef.h>
#include <stdint.h>

#define KERN_Q8_0_BYTES 34
#define KERN_Q8_1_BYTES 36

typedef float (*kern_vec_dot_fn)(const void *w, const void *x, size_t n);
typedef void (*kern_quantize_fn)(const float *x, void *y, size_t n);
/* out[t] = dot(w, x + t * x_stride) for t < 4: one weight row against four
 * activation rows, each result rounded exactly as the single dot would be */
typedef void (*kern_vec_dot4_fn)(const void *w, const void *x, size_t x_stride, size_t n, float out[4]);
/* y[i] += a * x[i], x in fp16 or fp32 (attention's weighted sum of V) */
typedef void (*kern_axpy_fn)(float a, const void *x, float *y, size_t n);

/* One stretch of n <= 16 consecutive positions of a sequence's KV (fp16 rows
 * k_i, v_i, hd apart) for nq <= 8 query rows that share that KV head
 * (attention.c's online softmax): for each query r, the scores
 * s_i = (k_i . q_r) * scale, its running max m[r], sum l[r] and weighted sum
 * acc[r * hd ...] rescaled if the stretch raises the max, and
 * acc_r += sum_i e^(s_i - m[r]) v_i. Each query's arithmetic is the same
 * whatever nq is. hd is a multiple of 8, at most 512. */
typedef void (*kern_attn_rows_fn)(const void *k, const void *v, size_t n, const float *q, size_t nq, size_t hd,
                                  float scale, float *m, float *l, float *acc);

/* y[i] = silu(g[i]) * u[i] */
typedef void (*kern_swiglu_fn)(const float *g, const float *u, float *y, size_t n);
/* y[i] = fp16(x[i]), round to nearest even */
typedef void (*kern_to_f16_fn)(const float *x, uint16_t *y, size_t n);

typedef struct kern_vecdot_table {
    kern_quantize_fn quantize_q8_0, quantize_q8_1;
    kern_vec_dot_fn q4_0_q8_0, q4_1_q8_1, q8_0_q8_0, f16_f32, bf16_f32, f32_f32;
    kern_vec_dot4_fn q4_1_q8_1_x4; /* optional (NULL: four single dots) */
    kern_vec_dot4_fn q4_1_q8_1_r4; /* optional: four weight rows (stride x_stride) against one activation row */
    kern_axpy_fn axpy_f16, axpy_f32;
    kern_attn_rows_fn attn_rows_f16; /* optional (NULL: a dot, an expf and an axpy per position) */
    kern_swiglu_fn swiglu;
    kern_to_f16_fn to_f16;
} kern_vecdot_table_t;

extern const kern_vecdot_table_t kern_vecdot_portable;
extern const kern_vecdot_table_t kern_vecdot_avx2; /* x86-64 builds; checked at run time */
extern const kern_vecdot_table_t kern_vecdot_avx2_ref;

/* The table for this CPU (AVX2 when present and not TANDEM_CPU=portable). */
const kern_vecdot_table_t *kern_vecdot(void);

#endif
