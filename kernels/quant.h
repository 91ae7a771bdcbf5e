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
 * F8_E4M3 is tandem's own number (above ggml's; a GGUF never holds it): one
 * byte a value, OCP FP8 E4M3 ("fn": no infinities, ±448 largest, 0x7f/0xff
 * NaN), each row scaled by an fp32 of its own (per output channel) that lives
 * beside the matrix (kern_weight_t.scale), as FP8 safetensors publish it
 * ("weight_scale", [rows][1], or one value for the tensor).
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
    KERN_TYPE_F8_E4M3 = 64, /* tandem's own (see above) */
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

/* FP8 E4M3 <-> fp32: exact one way; the other rounds to nearest even and
 * saturates to ±448 (NaN stays NaN) — CUDA's __nv_cvt_float_to_fp8 with
 * __NV_SATFINITE, bit for bit. */
float kern_fp8_to_fp32(uint8_t q);
uint8_t kern_fp32_to_fp8(float f);
/* Seeded values for a matrix made without a file (a dummy load format, for
 * benchmarks): value i of row r is uniform in ±0.0346 (std 0.02) from a
 * counter-based generator of (seed, r, i), rounded to fp16 — integer
 * arithmetic and one multiplication, so every backend makes the same bits. */
#ifdef __CUDACC__
#define KERN_HD __host__ __device__
#else
#define KERN_HD
#endif
#define KERN_FILL_STEP 0x1.1bc779ef0d4e8p-28 /* 0.02 * sqrt(3) / 2^23 */
static inline KERN_HD uint64_t kern_fill_bits(uint64_t seed, uint64_t row, uint64_t i)
{
    uint64_t z = seed + (row * 0x9e3779b97f4a7c15ull ^ (i + 1) * 0xbf58476d1ce4e5b9ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
/* The fp32 value before the fp16 rounding: (k - 2^23) * step, k the top 24 bits. */
static inline KERN_HD float kern_fill_value(uint64_t seed, uint64_t row, uint64_t i)
{
    return (float)((int32_t)(kern_fill_bits(seed, row, i) >> 40) - (1 << 23)) * (float)KERN_FILL_STEP;
}
void kern_fill_row_f16(uint64_t seed, uint64_t row, uint32_t col0, uint32_t cols, uint16_t *dst);

/* One row of n values in FP8 with its scale: amax / 448 (1 for a row of
 * zeros), q[i] = fp8(x[i] / scale). */
void kern_fp8_quantize_row(const float *x, size_t n, uint8_t *q, float *scale);

/* Decodes n values (a multiple of the type's block_elems) from src into dst
 * (F8_E4M3: the values before their row's scale).
 * Uses AVX2/FMA/F16C when the CPU has them (chosen once, at first use; the
 * environment variable TANDEM_CPU=portable forces the portable path). */
td_status_t kern_dequant_row(uint32_t type, const void *src, float *dst, size_t n);

/* The CPU path in use: "avx2" or "portable". */
const char *kern_cpu_path(void);

#ifdef __cplusplus
}
#endif

#endif
