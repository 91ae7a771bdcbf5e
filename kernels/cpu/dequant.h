/* dequant.h — CPU row decoders, one per weight format, shared by the portable
 * and the AVX2 builds of kernels/cpu/dequant*.c. Shapes: src holds n/block_elems
 * blocks of the format; dst holds n floats. */
#ifndef KERN_CPU_DEQUANT_H
#define KERN_CPU_DEQUANT_H

#include <stddef.h>

typedef void (*kern_dequant_fn)(const void *src, float *dst, size_t n);

typedef struct kern_dequant_table {
    kern_dequant_fn f16, bf16, q4_0, q4_1, q8_0, q4_k, q5_k, q6_k;
} kern_dequant_table_t;

extern const kern_dequant_table_t kern_dequant_portable;
/* The portable K-quant decoders, which the AVX2 table shares. */
void kern_dq_q4_k_ref(const void *src, float *dst, size_t n);
void kern_dq_q5_k_ref(const void *src, float *dst, size_t n);
void kern_dq_q6_k_ref(const void *src, float *dst, size_t n);
/* Filled only in builds for x86-64; checked at run time before use. */
extern const kern_dequant_table_t kern_dequant_avx2;

#endif
