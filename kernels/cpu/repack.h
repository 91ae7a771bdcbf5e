/* repack.h — weights re-laid for the AVX2 matmul: 8 rows interleaved.
 *
 * The file's layouts (kernels/quant.h) keep each row's blocks together, so a
 * dot product needs a horizontal sum per row and re-decodes the row for every
 * token. At load the CPU backend copies Q4_1 and Q8_0 matrices (rows a multiple
 * of 8) into groups of 8 rows, block by block:
 *
 *   Q4_1x8, 160 B per 8 rows x 32 values:  f16 d[8] | f16 m[8] | u8 qs[4][8][4]
 *   Q8_0x8, 272 B per 8 rows x 32 values:  f16 d[8] | i8 qs[8][8][4]
 *
 * qs[c][r][k] is value 4c + k of row r (Q4_1: the byte holding values 4c + k in
 * its low nibble and 16 + 4c + k in its high one). One 32-byte load is then a
 * 4-value chunk of all 8 rows; multiplied (vpmaddubsw) by the matching 4
 * activation bytes broadcast, it adds to 8 lanes — one per row — so sums stay
 * vertical, and the unpacked chunk serves every token of a batch. Same bytes
 * per value as the file: decode reads no more memory.
 *
 * With AVX-512 VNNI (vpdpbusd: unsigned x signed bytes into int32 lanes, no
 * int16 stage) Q8_0 is stored offset to unsigned (w + 128) and the offset is
 * taken back with 128·Σq of the activation block.
 *
 * Activations for these kernels are Q8F blocks: { f16 d; f16 s; i32 Σq; i8 q[32] },
 * x ≈ d·q, s = d·Σq (Q4_1's min term), Σq for the VNNI offset; d and s rounded
 * to fp16 as the file's own 8-bit blocks (and llama.cpp) hold them. */
#ifndef KERN_CPU_REPACK_H
#define KERN_CPU_REPACK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/backend.h"

#define KERN_Q8F_BYTES 40

/* Bytes of w's repacked copy, 0 if its type or shape has none. Q4_0 (exactly)
 * and Q4_K (sub-block scales and mins rounded to fp16) are re-expressed as
 * Q4_1x8, so they run on the Q4_1 kernels. */
size_t kern_repack_size(const kern_weight_t *w);
/* The layout a type is repacked to: KERN_TYPE_Q4_1 or KERN_TYPE_Q8_0. */
uint32_t kern_repack_kernel_type(uint32_t type);
/* Writes the repacked copy of w into dst (kern_repack_size bytes); q8_unsigned
 * stores Q8_0 values + 128 (the VNNI layout). */
void kern_repack(const kern_weight_t *w, void *dst, bool q8_unsigned);
/* Whether this CPU has AVX-512 VNNI with 256-bit forms (and TANDEM_CPU allows it). */
bool kern_cpu_has_vnni(void);

/* AVX2 kernels (kernels/cpu/repack_avx2.c; call only on the AVX2 path) */
void kern_quantize_q8f(const float *x, void *y, size_t n);
/* y[t][rows] for row groups [g0, g1) and tokens [0, n): the repacked weight wr
 * (cols columns) times Q8F activations xq (xq_stride bytes per token). */
void kern_gemm_q4_1x8(const void *wr, uint32_t cols, uint32_t g0, uint32_t g1, const void *xq, size_t xq_stride,
                      uint32_t n, float *y, uint32_t rows);
void kern_gemm_q8_0x8(const void *wr, uint32_t cols, uint32_t g0, uint32_t g1, const void *xq, size_t xq_stride,
                      uint32_t n, float *y, uint32_t rows);
/* The same with VNNI (kernels/cpu/repack_vnni.c); Q8_0 in the unsigned layout. */
void kern_gemm_q4_1x8_vnni(const void *wr, uint32_t cols, uint32_t g0, uint32_t g1, const void *xq,
                           size_t xq_stride, uint32_t n, float *y, uint32_t rows);
void kern_gemm_q8_0x8_vnni(const void *wr, uint32_t cols, uint32_t g0, uint32_t g1, const void *xq,
                           size_t xq_stride, uint32_t n, float *y, uint32_t rows);

#endif
