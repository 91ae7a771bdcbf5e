/* repack_vnni.c — the 8-row interleaved matmul tiles with AVX-512 VNNI
 * (repack.h): vpdpbusd multiplies unsigned by signed bytes and adds each
 * lane's four products straight into int32, so a 4-value chunk of 8 rows is
 * one instruction against the broadcast activation bytes. Q8_0 weights are in
 * the unsigned layout (w + 128); the offset comes back out with 128·Σq.
 * Compiled with -mavx512vnni -mavx512vl (256-bit forms); used after a CPU check. */
#include "kernels/cpu/repack.h"

#if defined(__x86_64__)
#include "kernels/cpu/repack_int.h"

static inline __attribute__((always_inline)) void q4_1x8_tile(const uint8_t *blk, uint32_t nb, const uint8_t *X,
                                                             size_t xs, const int T, float *y, size_t ys)
{
    const __m256i lo = _mm256_set1_epi8(0x0f);
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (uint32_t b = 0; b < nb; b++, blk += 160) {
        for (int k = 0; k < 160; k += 64)
            _mm_prefetch((const char *)blk + PREFETCH_AHEAD + k, _MM_HINT_T0);
        __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16)));
        __m256i w[8];
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 32 + 32 * c));
            w[c] = _mm256_and_si256(v, lo);
            w[c + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo);
        }
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) {
            const uint8_t *a = X + (size_t)t * xs + (size_t)b * KERN_Q8F_BYTES;
            __m256i s = _mm256_setzero_si256();
#pragma GCC unroll 8
            for (int c = 0; c < 8; c++)
                s = _mm256_dpbusd_epi32(s, w[c], bcast4(a + 8 + 4 * c));
            acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(dv, _mm256_set1_ps(rdf(a))), _mm256_cvtepi32_ps(s), acc[t]);
            acc[t] = _mm256_fmadd_ps(mv, _mm256_set1_ps(rdf(a + 2)), acc[t]);
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < T; t++)
        _mm256_storeu_ps(y + (size_t)t * ys, acc[t]);
}

static inline __attribute__((always_inline)) void q8_0x8_tile(const uint8_t *blk, uint32_t nb, const uint8_t *X,
                                                             size_t xs, const int T, float *y, size_t ys)
{
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (uint32_t b = 0; b < nb; b++, blk += 272) {
        for (int k = 0; k < 272; k += 64)
            _mm_prefetch((const char *)blk + PREFETCH_AHEAD + k, _MM_HINT_T0);
        __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        __m256i isum[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                           _mm256_setzero_si256()};
#pragma GCC unroll 8
        for (int c = 0; c < 8; c++) {
            __m256i w = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * c));
#pragma GCC unroll 4
            for (int t = 0; t < T; t++)
                isum[t] = _mm256_dpbusd_epi32(isum[t], w,
                                              bcast4(X + (size_t)t * xs + (size_t)b * KERN_Q8F_BYTES + 8 + 4 * c));
        }
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) {
            const uint8_t *a = X + (size_t)t * xs + (size_t)b * KERN_Q8F_BYTES;
            __m256i fixed = _mm256_sub_epi32(isum[t], _mm256_set1_epi32(128 * rdi(a + 4)));
            acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(dv, _mm256_set1_ps(rdf(a))), _mm256_cvtepi32_ps(fixed), acc[t]);
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < T; t++)
        _mm256_storeu_ps(y + (size_t)t * ys, acc[t]);
}

void kern_gemm_q4_1x8_vnni(const void *wr, uint32_t cols, uint32_t g0, uint32_t g1, const void *xq,
                           size_t xq_stride, uint32_t n, float *y, uint32_t rows)
{
    GEMM_BODY(q4_1x8_tile, 160)
}

void kern_gemm_q8_0x8_vnni(const void *wr, uint32_t cols, uint32_t g0, uint32_t g1, const void *xq,
                           size_t xq_stride, uint32_t n, float *y, uint32_t rows)
{
    GEMM_BODY(q8_0x8_tile, 272)
}
#endif
