/* vecdot_avx2.c — AVX2/FMA dot products and quantizers (see vecdot.h);
 * compiled with -mavx2 -mfma -mf16c, used after a run-time CPU check. The
 * integer products use the unsigned-by-signed byte multiply (vpmaddubsw) with
 * the sign moved onto the activation, as llama.cpp does. */
#include "kernels/cpu/vecdot.h"
#include "kernels/cpu/refnum.h"

#if defined(__x86_64__)
#include <immintrin.h>
#include <math.h>
#include <string.h>

static inline float h(const uint8_t *p)
{
    uint16_t v;
    memcpy(&v, p, 2);
    return _cvtsh_ss(v);
}

static inline float hsum8(__m256 v)
{
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}

/* 32 nibbles as 32 bytes: low nibbles of qs[0..16) then high nibbles. */
static inline __m256i nibbles32(const uint8_t *qs)
{
    __m128i raw = _mm_loadu_si128((const __m128i *)qs);
    __m256i both = _mm256_insertf128_si256(_mm256_castsi128_si256(raw), _mm_srli_epi16(raw, 4), 1);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0f));
}

/* 8 int32 sums of u8 x i8 products, as floats */
static inline __m256 dot_us8(__m256i ux, __m256i sy)
{
    __m256i p16 = _mm256_maddubs_epi16(ux, sy);
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
}

/* the same for signed x signed */
static inline __m256 dot_ss8(__m256i x, __m256i y)
{
    return dot_us8(_mm256_sign_epi8(x, x), _mm256_sign_epi8(y, x));
}

static void quantize_q8(const float *x, uint8_t *y, size_t n, int with_sum)
{
    size_t stride = with_sum ? KERN_Q8_1_BYTES : KERN_Q8_0_BYTES;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (size_t b = 0; b < n / 32; b++, x += 32, y += stride) {
        __m256 v0 = _mm256_loadu_ps(x), v1 = _mm256_loadu_ps(x + 8), v2 = _mm256_loadu_ps(x + 16),
               v3 = _mm256_loadu_ps(x + 24);
        __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                                 _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
        __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(m, 1), _mm256_castps256_ps128(m));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        float amax = _mm_cvtss_f32(m4);
        float d = amax / 127.f, id = amax != 0.f ? 127.f / amax : 0.f;
        __m256 mul = _mm256_set1_ps(id);
        __m256i i0 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v0, mul), _MM_FROUND_TO_NEAREST_INT));
        __m256i i1 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v1, mul), _MM_FROUND_TO_NEAREST_INT));
        __m256i i2 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v2, mul), _MM_FROUND_TO_NEAREST_INT));
        __m256i i3 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v3, mul), _MM_FROUND_TO_NEAREST_INT));
        uint16_t hd = _cvtss_sh(d, 0);
        memcpy(y, &hd, 2);
        if (with_sum) {
            __m256i s = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
            __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
            s4 = _mm_hadd_epi32(s4, s4);
            s4 = _mm_hadd_epi32(s4, s4);
            uint16_t hs = _cvtss_sh(d * (float)_mm_cvtsi128_si32(s4), 0);
            memcpy(y + 2, &hs, 2);
        }
        /* pack 32 int32 to 32 int8 in order */
        __m256i p01 = _mm256_packs_epi32(i0, i1), p23 = _mm256_packs_epi32(i2, i3);
        __m256i p = _mm256_packs_epi16(p01, p23);
        p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(y + (with_sum ? 4 : 2)), p);
    }
}

static void q8_0(const float *x, void *y, size_t n) { quantize_q8(x, y, n, 0); }
static void q8_1(const float *x, void *y, size_t n) { quantize_q8(x, y, n, 1); }

static float dot_q4_0_q8_0(const void *w, const void *x, size_t n)
{
    const uint8_t *a = w, *b = x;
    __m256 acc = _mm256_setzero_ps();
    for (size_t i = 0; i < n / 32; i++, a += 18, b += KERN_Q8_0_BYTES) {
        __m256i qx = _mm256_sub_epi8(nibbles32(a + 2), _mm256_set1_epi8(8));
        __m256i qy = _mm256_loadu_si256((const __m256i *)(b + 2));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(h(a) * h(b)), dot_ss8(qx, qy), acc);
    }
    return hsum8(acc);
}

static float dot_q4_1_q8_1(const void *w, const void *x, size_t n)
{
    const uint8_t *a = w, *b = x;
    /* two blocks per step into two accumulators: the FMA latency chain, not
     * memory, bounds a single-accumulator loop */
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    __m128 mm0 = _mm_setzero_ps(), mm1 = _mm_setzero_ps();
    size_t nb = n / 32, i = 0;
    for (; i + 1 < nb; i += 2, a += 40, b += 2 * KERN_Q8_1_BYTES) {
        const uint8_t *a1 = a + 20, *b1 = b + KERN_Q8_1_BYTES;
        mm0 = _mm_fmadd_ss(_mm_set_ss(h(a + 2)), _mm_set_ss(h(b + 2)), mm0);
        mm1 = _mm_fmadd_ss(_mm_set_ss(h(a1 + 2)), _mm_set_ss(h(b1 + 2)), mm1);
        __m256 p0 = dot_us8(nibbles32(a + 4), _mm256_loadu_si256((const __m256i *)(b + 4)));
        __m256 p1 = dot_us8(nibbles32(a1 + 4), _mm256_loadu_si256((const __m256i *)(b1 + 4)));
        acc0 = _mm256_fmadd_ps(_mm256_set1_ps(h(a) * h(b)), p0, acc0);
        acc1 = _mm256_fmadd_ps(_mm256_set1_ps(h(a1) * h(b1)), p1, acc1);
    }
    for (; i < nb; i++, a += 20, b += KERN_Q8_1_BYTES) {
        mm0 = _mm_fmadd_ss(_mm_set_ss(h(a + 2)), _mm_set_ss(h(b + 2)), mm0);
        acc0 = _mm256_fmadd_ps(_mm256_set1_ps(h(a) * h(b)),
                               dot_us8(nibbles32(a + 4), _mm256_loadu_si256((const __m256i *)(b + 4))), acc0);
    }
    return hsum8(_mm256_add_ps(acc0, acc1)) + _mm_cvtss_f32(_mm_add_ss(mm0, mm1));
}

/* llama.cpp's order (reference numerics): one accumulator of 8 lanes, each
 * lane the sum of 4 adjacent products, d·d' rounded, then fused; the m·s terms
 * fused into one scalar in block order; the lanes summed pairwise, then + m·s. */
static float dot_q4_1_q8_1_ref(const void *w, const void *x, size_t n)
{
    const uint8_t *a = w, *b = x;
    __m256 acc = _mm256_setzero_ps();
    float summs = 0;
    for (size_t i = 0; i < n / 32; i++, a += 20, b += KERN_Q8_1_BYTES) {
        summs = fmaf(h(a + 2), h(b + 2), summs);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(h(a) * h(b)),
                              dot_us8(nibbles32(a + 4), _mm256_loadu_si256((const __m256i *)(b + 4))), acc);
    }
    return hsum8(acc) + summs;
}

/* the same for four activation rows, the weight block unpacked once */
static void dot4_q4_1_q8_1_ref(const void *w, const void *x, size_t xs, size_t n, float out[4])
{
    const uint8_t *a = w, *b = x;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
    float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    for (size_t i = 0; i < n / 32; i++, a += 20, b += KERN_Q8_1_BYTES) {
        float d = h(a), m = h(a + 2);
        __m256i qx = nibbles32(a + 4);
        const uint8_t *b0 = b, *b1 = b + xs, *b2 = b + 2 * xs, *b3 = b + 3 * xs;
        s0 = fmaf(m, h(b0 + 2), s0);
        s1 = fmaf(m, h(b1 + 2), s1);
        s2 = fmaf(m, h(b2 + 2), s2);
        s3 = fmaf(m, h(b3 + 2), s3);
        acc0 = _mm256_fmadd_ps(_mm256_set1_ps(d * h(b0)), dot_us8(qx, _mm256_loadu_si256((const __m256i *)(b0 + 4))), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_set1_ps(d * h(b1)), dot_us8(qx, _mm256_loadu_si256((const __m256i *)(b1 + 4))), acc1);
        acc2 = _mm256_fmadd_ps(_mm256_set1_ps(d * h(b2)), dot_us8(qx, _mm256_loadu_si256((const __m256i *)(b2 + 4))), acc2);
        acc3 = _mm256_fmadd_ps(_mm256_set1_ps(d * h(b3)), dot_us8(qx, _mm256_loadu_si256((const __m256i *)(b3 + 4))), acc3);
    }
    out[0] = hsum8(acc0) + s0;
    out[1] = hsum8(acc1) + s1;
    out[2] = hsum8(acc2) + s2;
    out[3] = hsum8(acc3) + s3;
}

/* four weight rows (ws bytes apart) against one activation row: four
 * independent chains in flight, each in the single dot's order */
static void dot4r_q4_1_q8_1_ref(const void *w, const void *x, size_t ws, size_t n, float out[4])
{
    const uint8_t *a = w, *b = x;
    /* the next call's four rows: the weights stream from memory once per step */
    for (size_t k = 0; k < 4 * ws; k += 64)
        _mm_prefetch((const char *)w + 4 * ws + k, _MM_HINT_T0);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
    float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    for (size_t i = 0; i < n / 32; i++, a += 20, b += KERN_Q8_1_BYTES) {
        float dy = h(b), sy = h(b + 2);
        __m256i qy = _mm256_loadu_si256((const __m256i *)(b + 4));
        const uint8_t *a0 = a, *a1 = a + ws, *a2 = a + 2 * ws, *a3 = a + 3 * ws;
        s0 = fmaf(h(a0 + 2), sy, s0);
        s1 = fmaf(h(a1 + 2), sy, s1);
        s2 = fmaf(h(a2 + 2), sy, s2);
        s3 = fmaf(h(a3 + 2), sy, s3);
        acc0 = _mm256_fmadd_ps(_mm256_set1_ps(h(a0) * dy), dot_us8(nibbles32(a0 + 4), qy), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_set1_ps(h(a1) * dy), dot_us8(nibbles32(a1 + 4), qy), acc1);
        acc2 = _mm256_fmadd_ps(_mm256_set1_ps(h(a2) * dy), dot_us8(nibbles32(a2 + 4), qy), acc2);
        acc3 = _mm256_fmadd_ps(_mm256_set1_ps(h(a3) * dy), dot_us8(nibbles32(a3 + 4), qy), acc3);
    }
    out[0] = hsum8(acc0) + s0;
    out[1] = hsum8(acc1) + s1;
    out[2] = hsum8(acc2) + s2;
    out[3] = hsum8(acc3) + s3;
}

static float dot_q8_0_q8_0(const void *w, const void *x, size_t n)
{
    const uint8_t *a = w, *b = x;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    size_t nb = n / 32, i = 0;
    for (; i + 1 < nb; i += 2, a += 68, b += 2 * KERN_Q8_0_BYTES) {
        const uint8_t *a1 = a + 34, *b1 = b + KERN_Q8_0_BYTES;
        __m256 p0 = dot_ss8(_mm256_loadu_si256((const __m256i *)(a + 2)), _mm256_loadu_si256((const __m256i *)(b + 2)));
        __m256 p1 = dot_ss8(_mm256_loadu_si256((const __m256i *)(a1 + 2)), _mm256_loadu_si256((const __m256i *)(b1 + 2)));
        acc0 = _mm256_fmadd_ps(_mm256_set1_ps(h(a) * h(b)), p0, acc0);
        acc1 = _mm256_fmadd_ps(_mm256_set1_ps(h(a1) * h(b1)), p1, acc1);
    }
    for (; i < nb; i++, a += 34, b += KERN_Q8_0_BYTES)
        acc0 = _mm256_fmadd_ps(_mm256_set1_ps(h(a) * h(b)),
                               dot_ss8(_mm256_loadu_si256((const __m256i *)(a + 2)),
                                       _mm256_loadu_si256((const __m256i *)(b + 2))), acc0);
    return hsum8(_mm256_add_ps(acc0, acc1));
}

/* llama.cpp's order: one 8-lane accumulator, lanes summed pairwise */
static float dot_q8_0_q8_0_ref(const void *w, const void *x, size_t n)
{
    const uint8_t *a = w, *b = x;
    __m256 acc = _mm256_setzero_ps();
    for (size_t i = 0; i < n / 32; i++, a += 34, b += KERN_Q8_0_BYTES)
        acc = _mm256_fmadd_ps(_mm256_set1_ps(h(a) * h(b)),
                              dot_ss8(_mm256_loadu_si256((const __m256i *)(a + 2)),
                                      _mm256_loadu_si256((const __m256i *)(b + 2))), acc);
    return hsum8(acc);
}

static float dot_f16_f32(const void *w, const void *x, size_t n)
{
    const uint8_t *a = w;
    const float *b = x;
    __m256 acc = _mm256_setzero_ps();
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(a + 2 * i))),
                              _mm256_loadu_ps(b + i), acc);
    float s = hsum8(acc);
    for (; i < n; i++)
        s += h(a + 2 * i) * b[i];
    return s;
}

static float dot_bf16_f32(const void *w, const void *x, size_t n)
{
    const uint8_t *a = w;
    const float *b = x;
    __m256 acc = _mm256_setzero_ps();
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i wi = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(a + 2 * i))), 16);
        acc = _mm256_fmadd_ps(_mm256_castsi256_ps(wi), _mm256_loadu_ps(b + i), acc);
    }
    float s = hsum8(acc);
    for (; i < n; i++) {
        uint16_t v;
        memcpy(&v, a + 2 * i, 2);
        uint32_t bits = (uint32_t)v << 16;
        float f;
        memcpy(&f, &bits, 4);
        s += f * b[i];
    }
    return s;
}

static float dot_f32_f32(const void *w, const void *x, size_t n)
{
    const float *a = w, *b = x;
    __m256 acc = _mm256_setzero_ps();
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float s = hsum8(acc);
    for (; i < n; i++)
        s += a[i] * b[i];
    return s;
}

static void axpy_f16(float a, const void *x, float *y, size_t n)
{
    const uint8_t *p = x;
    __m256 va = _mm256_set1_ps(a);
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 2 * i))),
                                                _mm256_loadu_ps(y + i)));
    for (; i < n; i++)
        y[i] += a * h(p + 2 * i);
}

static void axpy_f32(float a, const void *x, float *y, size_t n)
{
    const float *p = x;
    __m256 va = _mm256_set1_ps(a);
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(p + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++)
        y[i] += a * p[i];
}

/* e^x for 8 floats: x = k·ln2 + r with |r| <= ln2/2, e^r by a degree-6
 * Taylor polynomial (relative error under 2e-7 on that range), 2^k through the
 * exponent bits. Inputs are clamped to [-87.3, 88.7] (fp32's range). */
static inline __m256 exp8(__m256 x)
{
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.7f));
    __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
    __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693145751953125f), x);   /* ln2, high part */
    r = _mm256_fnmadd_ps(k, _mm256_set1_ps(1.42860682030941723e-6f), r);    /* ln2, low part */
    __m256 p = _mm256_set1_ps(1.0f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* The sums of eight vectors, as one vector: [sum(a[0]), ..., sum(a[7])] */
static inline __m256 hsum8x8(const __m256 a[8])
{
    __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* kern_attn_rows_fn: the stretch's K and V widened to fp32 once for the nq
 * queries; per query eight scores at a time (eight independent FMA chains, one
 * transposing reduction), the exponentials eight lanes at a time, and acc read
 * and written once per eight columns for the whole stretch. */
static void attn_rows_f16(const void *k, const void *v, size_t n, const float *q, size_t nq, size_t hd, float scale,
                          float *m, float *l, float *acc)
{
    float kf[16 * 512] __attribute__((aligned(32))), vf[16 * 512] __attribute__((aligned(32)));
    const uint16_t *kr = k, *vr = v;
    size_t n8 = (n + 7) / 8 * 8;
    for (size_t x = 0; x < n * hd; x += 8) {
        _mm256_store_ps(kf + x, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(kr + x))));
        _mm256_store_ps(vf + x, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(vr + x))));
    }
    memset(kf + n * hd, 0, (n8 - n) * hd * sizeof(float)); /* rows past the stretch score 0, then weigh nothing */
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (size_t r = 0; r < nq; r++, q += hd, acc += hd) {
        float sc[16] __attribute__((aligned(32))) = {0}; /* (every lane below n8 is stored before it is read) */
        for (size_t i0 = 0; i0 < n8; i0 += 8) {
            const float *k0 = kf + i0 * hd;
            __m256 a[8] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                           _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
            for (size_t d = 0; d < hd; d += 8) {
                __m256 qv = _mm256_loadu_ps(q + d);
                a[0] = _mm256_fmadd_ps(_mm256_load_ps(k0 + 0 * hd + d), qv, a[0]);
                a[1] = _mm256_fmadd_ps(_mm256_load_ps(k0 + 1 * hd + d), qv, a[1]);
                a[2] = _mm256_fmadd_ps(_mm256_load_ps(k0 + 2 * hd + d), qv, a[2]);
                a[3] = _mm256_fmadd_ps(_mm256_load_ps(k0 + 3 * hd + d), qv, a[3]);
                a[4] = _mm256_fmadd_ps(_mm256_load_ps(k0 + 4 * hd + d), qv, a[4]);
                a[5] = _mm256_fmadd_ps(_mm256_load_ps(k0 + 5 * hd + d), qv, a[5]);
                a[6] = _mm256_fmadd_ps(_mm256_load_ps(k0 + 6 * hd + d), qv, a[6]);
                a[7] = _mm256_fmadd_ps(_mm256_load_ps(k0 + 7 * hd + d), qv, a[7]);
            }
            _mm256_store_ps(sc + i0, _mm256_mul_ps(hsum8x8(a), _mm256_set1_ps(scale)));
        }
        float bm = sc[0];
        for (size_t i = 1; i < n; i++)
            bm = sc[i] > bm ? sc[i] : bm;
        if (bm > m[r]) { /* the stretch raises the max: what came before is rescaled once */
            float f = expf(m[r] - bm);
            __m256 vfac = _mm256_set1_ps(f);
            l[r] *= f;
            for (size_t d = 0; d < hd; d += 8)
                _mm256_storeu_ps(acc + d, _mm256_mul_ps(_mm256_loadu_ps(acc + d), vfac));
            m[r] = bm;
        }
        __m256 vm = _mm256_set1_ps(m[r]), sum = _mm256_setzero_ps();
        for (size_t i0 = 0; i0 < n8; i0 += 8) {
            __m256 e = exp8(_mm256_sub_ps(_mm256_load_ps(sc + i0), vm));
            if (n - i0 < 8) /* lanes past the stretch weigh nothing */
                e = _mm256_and_ps(e, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n - i0)), lane)));
            sum = _mm256_add_ps(sum, e);
            _mm256_store_ps(sc + i0, e);
        }
        l[r] += hsum8(sum);
        size_t d = 0;
        for (; d + 32 <= hd; d += 32) { /* four columns' chains side by side */
            __m256 o0 = _mm256_loadu_ps(acc + d), o1 = _mm256_loadu_ps(acc + d + 8);
            __m256 o2 = _mm256_loadu_ps(acc + d + 16), o3 = _mm256_loadu_ps(acc + d + 24);
            for (size_t i = 0; i < n; i++) {
                __m256 e = _mm256_set1_ps(sc[i]);
                const float *vi = vf + i * hd + d;
                o0 = _mm256_fmadd_ps(e, _mm256_load_ps(vi), o0);
                o1 = _mm256_fmadd_ps(e, _mm256_load_ps(vi + 8), o1);
                o2 = _mm256_fmadd_ps(e, _mm256_load_ps(vi + 16), o2);
                o3 = _mm256_fmadd_ps(e, _mm256_load_ps(vi + 24), o3);
            }
            _mm256_storeu_ps(acc + d, o0), _mm256_storeu_ps(acc + d + 8, o1);
            _mm256_storeu_ps(acc + d + 16, o2), _mm256_storeu_ps(acc + d + 24, o3);
        }
        for (; d < hd; d += 8) {
            __m256 o = _mm256_loadu_ps(acc + d);
            for (size_t i = 0; i < n; i++)
                o = _mm256_fmadd_ps(_mm256_set1_ps(sc[i]), _mm256_load_ps(vf + i * hd + d), o);
            _mm256_storeu_ps(acc + d, o);
        }
    }
}

static void swiglu(const float *g, const float *u, float *y, size_t n)
{
    size_t i = 0;
    const __m256 one = _mm256_set1_ps(1.0f), neg = _mm256_set1_ps(-0.0f);
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_loadu_ps(g + i);
        __m256 s = _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_xor_ps(x, neg))));
        _mm256_storeu_ps(y + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
    }
    for (; i < n; i++)
        y[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

static void to_f16(const float *x, uint16_t *y, size_t n)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(y + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++)
        y[i] = _cvtss_sh(x[i], _MM_FROUND_TO_NEAREST_INT);
}

const kern_vecdot_table_t kern_vecdot_avx2_ref = {
    .quantize_q8_0 = q8_0, .quantize_q8_1 = q8_1, .q4_0_q8_0 = dot_q4_0_q8_0, .q4_1_q8_1 = dot_q4_1_q8_1_ref, .q4_1_q8_1_x4 = dot4_q4_1_q8_1_ref,
    .q4_1_q8_1_r4 = dot4r_q4_1_q8_1_ref,
    .q8_0_q8_0 = dot_q8_0_q8_0_ref, .f16_f32 = dot_f16_f32, .bf16_f32 = dot_bf16_f32, .f32_f32 = dot_f32_f32,
    .axpy_f16 = axpy_f16, .axpy_f32 = axpy_f32, .swiglu = kern_ref_swiglu, .to_f16 = to_f16,
};

const kern_vecdot_table_t kern_vecdot_avx2 = {
    .quantize_q8_0 = q8_0, .quantize_q8_1 = q8_1, .q4_0_q8_0 = dot_q4_0_q8_0, .q4_1_q8_1 = dot_q4_1_q8_1,
    .q8_0_q8_0 = dot_q8_0_q8_0, .f16_f32 = dot_f16_f32, .bf16_f32 = dot_bf16_f32, .f32_f32 = dot_f32_f32,
    .axpy_f16 = axpy_f16, .axpy_f32 = axpy_f32, .attn_rows_f16 = attn_rows_f16, .swiglu = swiglu, .to_f16 = to_f16,
};
#endif
