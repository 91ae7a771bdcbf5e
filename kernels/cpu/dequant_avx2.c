/* dequant_avx2.c — AVX2/F16C decoders of the 32-value block formats; compiled
 * with -mavx2 -mfma -mf16c and used only after a run-time CPU check
 * (kernels/cpu/dequant.c). They multiply and add separately, never fused, so
 * they give exactly the portable decoders' values. The K-quants use the
 * portable decoders for now: they are read once at load, not per token. */
#include "kernels/cpu/dequant.h"

#if defined(__x86_64__)
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

static inline __m256 load_h8(const uint8_t *p)
{
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

static inline float h1(const uint8_t *p)
{
    uint16_t v;
    memcpy(&v, p, 2);
    return _cvtsh_ss(v);
}

static void dq_f16(const void *src, float *dst, size_t n)
{
    const uint8_t *s = src;
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, load_h8(s + 2 * i));
    for (; i < n; i++)
        dst[i] = h1(s + 2 * i);
}

static void dq_bf16(const void *src, float *dst, size_t n)
{
    const uint8_t *s = src;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(s + 2 * i)));
        _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
    }
    for (; i < n; i++) {
        uint16_t v;
        memcpy(&v, s + 2 * i, 2);
        uint32_t bits = (uint32_t)v << 16;
        memcpy(dst + i, &bits, 4);
    }
}

/* 32 nibbles of qs[16] as two vectors of 16 bytes: low nibbles, high nibbles,
 * each widened to 2 x 8 floats. */
static inline void nibbles_to_f32(const uint8_t *qs, __m256 out[4])
{
    __m128i raw = _mm_loadu_si128((const __m128i *)qs);
    __m128i mask = _mm_set1_epi8(0x0f);
    __m128i lo = _mm_and_si128(raw, mask);
    __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    out[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    out[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    out[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    out[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}

static void dq_q4_0(const void *src, float *dst, size_t n)
{
    const uint8_t *b = src;
    const __m256 eight = _mm256_set1_ps(8.0f);
    for (size_t i = 0; i < n / 32; i++, b += 18, dst += 32) {
        __m256 d = _mm256_set1_ps(h1(b));
        __m256 q[4];
        nibbles_to_f32(b + 2, q);
        for (int k = 0; k < 4; k++)
            _mm256_storeu_ps(dst + 8 * k, _mm256_mul_ps(_mm256_sub_ps(q[k], eight), d));
    }
}

static void dq_q4_1(const void *src, float *dst, size_t n)
{
    const uint8_t *b = src;
    for (size_t i = 0; i < n / 32; i++, b += 20, dst += 32) {
        __m256 d = _mm256_set1_ps(h1(b));
        __m256 m = _mm256_set1_ps(h1(b + 2));
        __m256 q[4];
        nibbles_to_f32(b + 4, q);
        for (int k = 0; k < 4; k++)
            _mm256_storeu_ps(dst + 8 * k, _mm256_add_ps(_mm256_mul_ps(q[k], d), m));
    }
}

static void dq_q8_0(const void *src, float *dst, size_t n)
{
    const uint8_t *b = src;
    for (size_t i = 0; i < n / 32; i++, b += 34, dst += 32) {
        __m256 d = _mm256_set1_ps(h1(b));
        for (int k = 0; k < 4; k++) {
            __m128i q8 = _mm_loadl_epi64((const __m128i *)(b + 2 + 8 * k));
            __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8));
            _mm256_storeu_ps(dst + 8 * k, _mm256_mul_ps(q, d));
        }
    }
}

const kern_dequant_table_t kern_dequant_avx2 = {
    .f16 = dq_f16, .bf16 = dq_bf16, .q4_0 = dq_q4_0, .q4_1 = dq_q4_1,
    .q8_0 = dq_q8_0, .q4_k = kern_dq_q4_k_ref, .q5_k = kern_dq_q5_k_ref,
    .q6_k = kern_dq_q6_k_ref,
};
#endif
