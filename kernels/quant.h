/* quant.h — the weight formats tandem reads, as GGUF numbers them, and their
 * block layouts.
 *
 * A quantized row is a sequence of fixed-size blocks; each block codes
 * `block_elems` consecutive values in `block_bytes` bytes. The layouts are
 * ggml's (GGUF stores them verbatim):
 *
 *   Q4_0  32 values  18 B  { f16 d;            u8 qs[16]; }           x = (q - 8) * d
 *   Q4_1  32 values  20 B  { f16 d; f16 m;     u8 qs[16]; }           x = q * d + m
 *   Q8_0  32 values  34 B  { f16 d;            i8 qs[32]; }           x = q * d
 *   Q4_K 256 values 144 B  { f16 d; f16 dmin; u8 scales[12]; u8 qs[128]; }
 *   Q5_K 256 values 176 B  { f16 d; f16 dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]; }
 *   Q6_K 256 values 210 B  { u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d; }
 *
 * In Q4_0/Q4_1 value j < 16 is the low nibble of qs[j], value j + 16 the high one.
 * The K-quants split a block into sub-blocks of 32 (Q4_K, Q5_K: 6-bit scale and
 * min each, packed in `scales`) or 16 (Q6_K: one int8 scale each). */
#ifndef KERN_QUANT_H
#define KERN_QUANT_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* GGUF / ggml type numbers; only those listed are read. */
typedef enum kern_type {
    KERN_TYPE_F32 = 0,
    KERN_TYPE_F16 = 1,
    KERN_TYPE_Q4_0 = 2,
    KERN_TYPE_Q4_1 = 3,
    KERN_TYPE_Q8_0 = 8,
    KERN_TYPE_Q4_K = 12,
    KERN_TYPE_Q5_K = 13,
    KERN_TYPE_Q6_K = 14,
    KERN_TYPE_BF16 = 30,
} kern_type_t;

typedef struct kern_type_info {
    const char *name;      /* "Q4_1" */
    uint32_t block_elems;  /* values per block (1 for plain floats) */
    uint32_t block_bytes;  /* bytes per block */
} kern_type_info_t;

/* The description of a supported type, NULL for any other number. */
const kern_type_info_t *kern_type_info(uint32_t type);
/* Name of any ggml type number, supported or not ("IQ2_XXS"), or NULL. */
const char *kern_type_name_any(uint32_t type);

/* Bytes that n values of a type take; n must be a multiple of block_elems. */
static inline size_t kern_type_row_bytes(const kern_type_info_t *info, size_t n)
{
    return n / info->block_elems * info->block_bytes;
}

/* fp16 / bf16 <-> fp32, bit exact (round to nearest even on the way down). */
float kern_fp16_to_fp32(uint16_t h);
uint16_t kern_fp32_to_fp16(float f);
float kern_bf16_to_fp32(uint16_t h);

/* Decodes n values (a multiple of the type's block_elems) from src into dst.
 * Uses AVX2/FMA/F16C when the CPU has them (chosen once, at first use; the
 * environment variable TANDEM_CPU=portable forces the portable path). */
td_status_t kern_dequant_row(uint32_t type, const void *src, float *dst, size_t n);

/* The CPU path in use: "avx2" or "portable". */
const char *kern_cpu_path(void);

#ifdef __cplusplus
}
#endif

#endif
