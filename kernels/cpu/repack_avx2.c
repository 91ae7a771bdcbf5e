/* repack_avx2.c — the matmul kernels over 8-row interleaved weights
 * (repack.h). Compiled with -mavx2 -mfma -mf16c; used after the CPU check.
 * Tokens go in groups of up to 4: a block's weights are unpacked once into
 * registers and serve every token of the group; each group size has its own
 * fully unrolled tile so nothing spills to the stack. */
#include "kernels/cpu/repack.h"

#if defined(__x86_64__)
#include "kernels/cpu/repack_int.h"

void kern_quantize_q8f(const float *x, void *y, size_t n)
{
    uint8_t *o = y;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (size_t b = 0; b < n / 32; b++, x += 32, o += KERN_Q8F_BYTES) {
        __m256 v[4];
        __m256 m = _mm256_setzero_ps();
        for (int k = 0; k < 4; k++) {
            v[k] = _mm256_loadu_ps(x + 8 * k);
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[k]));
        }
        __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(m, 1), _mm256_castps256_ps128(m));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        float amax = _mm_cvtss_f32(m4);
        float d = amax / 127.f, id = amax != 0.f ? 127.f / amax : 0.f;
        __m256i q[4];
        for (int k = 0; k < 4; k++)
            q[k] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[k], _mm256_set1_ps(id)), _MM_FROUND_TO_NEAREST_INT));
        __m256i s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        s4 = _mm_hadd_epi32(s4, s4);
        s4 = _mm_hadd_epi32(s4, s4);
        int32_t qsum = _mm_cvtsi128_si32(s4);
        /* scale and Q4_1's sum term rounded to fp16, as the file formats (and
         * llama.cpp) hold them: the integer sums then agree to the last bit */
        uint16_t dh = _cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT), sh = _cvtss_sh(d * (float)qsum, _MM_FROUND_TO_NEAREST_INT);
        memcpy(o, &dh, 2);
        memcpy(o + 2, &sh, 2);
        memcpy(o + 4, &qsum, 4);
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(o + 8), p);
    }
}

/* One 8-row group against T tokens (T a constant after inlining, so the
 * accumulators and unpacked weights live in registers). */
static inline __attribute__((always_inline)) void q4_1x8_tile(const uint8_t *blk, uint32_t nb, const uint8_t *X,
                                                             size_t xs, const int T, float *y, size_t ys)
{
    const __m256i lo = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
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
            __m256i s = _mm256_maddubs_epi16(w[0], bcast4(a + 8));
#pragma GCC unroll 8
            for (int c = 1; c < 8; c++)
                s = _mm256_add_epi16(s, _mm256_maddubs_epi16(w[c], bcast4(a + 8 + 4 * c)));
            __m256 f = _mm256_cvtepi32_ps(_mm256_madd_epi16(s, ones));
            acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(dv, _mm256_set1_ps(rdf(a))), f, acc[t]);
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
    const __m256i ones = _mm256_set1_epi16(1);
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
            __m256i aw = _mm256_abs_epi8(w);
#pragma GCC unroll 4
            for (int t = 0; t < T; t++) {
                const uint8_t *a = X + (size_t)t * xs + (size_t)b * KERN_Q8F_BYTES;
                __m256i p = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(bcast4(a + 8 + 4 * c), w));
                isum[t] = _mm256_add_epi32(isum[t], _mm256_madd_epi16(p, ones));
            }
        }
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) {
            const uint8_t *a = X + (size_t)t * xs + (size_t)b * KERN_Q8F_BYTES;
            acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(dv, _mm256_set1_ps(rdf(a))), _mm256_cvtepi32_ps(isum[t]), acc[t]);
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < T; t++)
        _mm256_storeu_ps(y + (size_t)t * ys, acc[t]);
}

void kern_gemm_q4_1x8(const void *wr, uint32_t cols, uint32_t g0, uint32_t g1, const void *xq, size_t xq_stride,
                      uint32_t n, float *y, uint32_t rows)
{
    GEMM_BODY(q4_1x8_tile, 160)
}

void kern_gemm_q8_0x8(const void *wr, uint32_t cols, uint32_t g0, uint32_t g1, const void *xq, size_t xq_stride,
                      uint32_t n, float *y, uint32_t rows)
{
    GEMM_BODY(q8_0x8_tile, 272)
}
#endif
