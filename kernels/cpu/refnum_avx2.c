/* refnum_avx2.c — reference numerics: the ops whose rounding llama.cpp's CPU
 * backend (ggml, AVX2/FMA/F16C build) fixes by its order of operations,
 * computed in that same order so that tandem's floats are bit-identical to it
 * and greedy decoding picks the same tokens (cpu_int.h: kern_cpu_t.ref).
 *
 * What decides each result, and what we reproduce here:
 *   - exp: ggml's 8-lane expf (a range reduction by 2^n and a degree-5
 *     polynomial with special cases past |n| > 126), used by softmax and SiLU.
 *   - attention scores q·k: Q rounded to fp16 like the fp16 KV. A prompt row
 *     (llama.cpp runs the prompt as one batch: its tinyBLAS kernel) sums the
 *     head dimension in 8 lanes (lane = index mod 8, fused multiply-adds in
 *     index order) then pairwise; a generated row (one-token steps: its fp16
 *     dot product) sums in 4 x 8 lanes over runs of 32, then horizontal adds.
 *     Which one a row is comes from kern_attn_seq_t.decode_from.
 *   - softmax over positions: max, exp(x - max) in groups of 8 positions, each
 *     group summed pairwise in fp32 and added into a double; probabilities
 *     times (float)(1 / sum), rounded to fp16.
 *   - the weighted sum of V: as the scores, over positions instead of the head
 *     dimension (positions past the row's own are zero and add nothing).
 *   - RoPE: the angle of pair i is the float product chain p·s·s·…·s with
 *     s = powf(base, -2/head_dim), cos and sin from sincosf; outputs
 *     fma(x0, cos, -(x1·sin)) and fma(x0, sin, x1·cos).
 *   - SwiGLU: g / (1 + exp(0 - g)) · u.
 * The Q4_1 and Q8_0 dot products in the same order are in vecdot_avx2.c
 * (kern_vecdot_avx2_ref). Compiled with -mavx2 -mfma -mf16c. */
#define _GNU_SOURCE /* sincosf */
#include "kernels/cpu/refnum.h"

#if defined(__x86_64__)
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "kernels/quant.h"

/* ggml's expf, 8 lanes */
static inline __m256 expf8(__m256 x)
{
    const __m256 r = _mm256_set1_ps(0x1.8p23f);
    const __m256 z = _mm256_fmadd_ps(x, _mm256_set1_ps(0x1.715476p+0f), r);
    const __m256 n = _mm256_sub_ps(z, r);
    const __m256 b = _mm256_fnmadd_ps(n, _mm256_set1_ps(0x1.7f7d1cp-20f),
                                      _mm256_fnmadd_ps(n, _mm256_set1_ps(0x1.62e4p-1f), x));
    const __m256i e = _mm256_slli_epi32(_mm256_castps_si256(z), 23);
    const __m256 k = _mm256_castsi256_ps(_mm256_add_epi32(e, _mm256_castps_si256(_mm256_set1_ps(1))));
    const __m256 an = _mm256_andnot_ps(_mm256_set1_ps(-0.f), n);
    const __m256 c = _mm256_cmp_ps(an, _mm256_set1_ps(126), _CMP_GT_OQ);
    const __m256 u = _mm256_mul_ps(b, b);
    const __m256 j = _mm256_fmadd_ps(
        _mm256_fmadd_ps(_mm256_fmadd_ps(_mm256_set1_ps(0x1.0e4020p-7f), b, _mm256_set1_ps(0x1.573e2ep-5f)), u,
                        _mm256_fmadd_ps(_mm256_set1_ps(0x1.555e66p-3f), b, _mm256_set1_ps(0x1.fffdb6p-2f))),
        u, _mm256_mul_ps(_mm256_set1_ps(0x1.ffffecp-1f), b));
    if (!_mm256_movemask_ps(c))
        return _mm256_fmadd_ps(j, k, k);
    const __m256i g = _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(n, _mm256_setzero_ps(), _CMP_LE_OQ)),
                                       _mm256_set1_epi32((int)0x82000000u));
    const __m256 s1 = _mm256_castsi256_ps(_mm256_add_epi32(g, _mm256_set1_epi32(0x7f000000)));
    const __m256 s2 = _mm256_castsi256_ps(_mm256_sub_epi32(e, g));
    const __m256 d = _mm256_cmp_ps(an, _mm256_set1_ps(192), _CMP_GT_OQ);
    return _mm256_or_ps(_mm256_and_ps(d, _mm256_mul_ps(s1, s1)),
                        _mm256_andnot_ps(d, _mm256_or_ps(_mm256_and_ps(c, _mm256_mul_ps(_mm256_fmadd_ps(s2, j, s2), s1)),
                                                         _mm256_andnot_ps(c, _mm256_fmadd_ps(k, j, k)))));
}

/* lanes summed as (l0+l4 + l2+l6) + (l1+l5 + l3+l7) */
static inline float hsum8(__m256 v)
{
    __m128 r = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}

/* four 8-lane accumulators: (a0+a2)+(a1+a3), halves added, then two
 * horizontal adds: (t0+t1)+(t2+t3) */
static inline float hsum4x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3)
{
    __m256 s = _mm256_add_ps(_mm256_add_ps(a1, a3), _mm256_add_ps(a0, a2));
    __m128 t = _mm_add_ps(_mm256_extractf128_ps(s, 1), _mm256_castps256_ps128(s));
    t = _mm_hadd_ps(t, t);
    t = _mm_hadd_ps(t, t);
    return _mm_cvtss_f32(t);
}

void kern_ref_swiglu(const float *g, const float *u, float *y, size_t n)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_loadu_ps(g + i);
        __m256 e = expf8(_mm256_sub_ps(_mm256_setzero_ps(), x));
        __m256 s = _mm256_div_ps(x, _mm256_add_ps(e, _mm256_set1_ps(1.0f)));
        _mm256_storeu_ps(y + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
    }
    for (; i < n; i++)
        y[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

void kern_ref_rope(float *x, uint32_t n, uint32_t heads, uint32_t head_dim, const int32_t *pos, float theta_scale,
                   bool neox)
{
    uint32_t half = head_dim / 2;
    float cs[256], sn[256];
    int32_t last = -1;
    for (uint32_t t = 0; t < n; t++) {
        if (pos[t] != last) {
            float theta = (float)pos[t];
            for (uint32_t i = 0; i < half; i++) {
                sincosf(theta, &sn[i], &cs[i]);
                theta *= theta_scale;
            }
            last = pos[t];
        }
        for (uint32_t h = 0; h < heads; h++) {
            float *v = x + ((size_t)t * heads + h) * head_dim;
            for (uint32_t i = 0; i < half; i++) {
                uint32_t a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
                float x0 = v[a], x1 = v[b];
                v[a] = fmaf(x0, cs[i], -(x1 * sn[i]));
                v[b] = fmaf(x0, sn[i], x1 * cs[i]);
            }
        }
    }
}

static inline __m256 ld16(const uint16_t *p)
{
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)p));
}

/* q·k over hd fp16 values in the prefill order (8 lanes) or decode order (4 x 8) */
static float dot16(const uint16_t *a, const uint16_t *b, uint32_t n, bool decode)
{
    if (!decode) {
        __m256 acc = _mm256_setzero_ps();
        for (uint32_t i = 0; i < n; i += 8)
            acc = _mm256_fmadd_ps(ld16(a + i), ld16(b + i), acc);
        return hsum8(acc);
    }
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    uint32_t i = 0;
    for (; i + 32 <= n; i += 32) {
        s0 = _mm256_fmadd_ps(ld16(a + i), ld16(b + i), s0);
        s1 = _mm256_fmadd_ps(ld16(a + i + 8), ld16(b + i + 8), s1);
        s2 = _mm256_fmadd_ps(ld16(a + i + 16), ld16(b + i + 16), s2);
        s3 = _mm256_fmadd_ps(ld16(a + i + 24), ld16(b + i + 24), s3);
    }
    double sum = i ? hsum4x8(s0, s1, s2, s3) : 0.0;
    for (; i < n; i++)
        sum += (double)(kern_fp16_to_fp32(a[i]) * kern_fp16_to_fp32(b[i]));
    return (float)sum;
}

void kern_ref_attention_row(const kern_kv_view_t *kv, const kern_attn_seq_t *s, uint32_t row, uint32_t head,
                            uint32_t n_heads, const float *q_all, float *out_all, float scale, float *scratch)
{
    uint32_t pos = s->pos0 + (row - s->row0), hd = kv->layout->head_dim, kvh = head / (n_heads / kv->layout->n_kv_heads);
    bool decode = pos >= s->decode_from;
    uint32_t n_pos = pos + 1, n_pad = (n_pos + 31) / 32 * 32;
    float *sc = scratch;                               /* n_pad scores, then probabilities */
    uint16_t *p16 = (uint16_t *)(void *)(sc + n_pad);  /* n_pad fp16 probabilities */
    uint16_t q16[512];
    const float *q = q_all + ((size_t)row * n_heads + head) * hd;
    for (uint32_t i = 0; i < hd; i++)
        q16[i] = _cvtss_sh(q[i], _MM_FROUND_TO_NEAREST_INT);
    size_t k_off = kern_kv_offset(kv, 0, kvh), v_off = kern_kv_offset(kv, 1, kvh);
    float mx = -INFINITY;
    for (uint32_t p = 0; p < n_pos; p++) {
        uint32_t blk = (uint32_t)s->block_table[p / kv->layout->block_tokens], off = p % kv->layout->block_tokens;
        const uint16_t *k = (const uint16_t *)((const uint8_t *)kv->base + (size_t)blk * kv->block_bytes) + k_off +
                            (size_t)off * hd;
        sc[p] = dot16(k, q16, hd, decode) * scale;
        mx = sc[p] > mx ? sc[p] : mx;
    }
    for (uint32_t p = n_pos; p < n_pad; p++)
        sc[p] = -INFINITY;
    double sum = 0;
    __m256 vmx = _mm256_set1_ps(mx);
    for (uint32_t p = 0; p < n_pad; p += 8) {
        __m256 e = expf8(_mm256_sub_ps(_mm256_loadu_ps(sc + p), vmx));
        _mm256_storeu_ps(sc + p, e);
        sum += (double)hsum8(e);
    }
    __m256 inv = _mm256_set1_ps((float)(1.0 / sum));
    for (uint32_t p = 0; p < n_pad; p += 8)
        _mm_storeu_si128((__m128i *)(void *)(p16 + p),
                         _mm256_cvtps_ph(_mm256_mul_ps(_mm256_loadu_ps(sc + p), inv), _MM_FROUND_TO_NEAREST_INT));
    /* out[d] = Σ_p v[p][d]·prob[p]: lane accumulators per d, kept as rows
     * acc[lane][d] (prefill: lane = p mod 8; decode: 32 lanes, p mod 32) */
    uint32_t lanes = decode ? 32 : 8;
    float acc[32 * 512];
    memset(acc, 0, (size_t)lanes * hd * sizeof(float));
    for (uint32_t p = 0; p < n_pos; p++) {
        uint32_t blk = (uint32_t)s->block_table[p / kv->layout->block_tokens], off = p % kv->layout->block_tokens;
        const uint16_t *v = (const uint16_t *)((const uint8_t *)kv->base + (size_t)blk * kv->block_bytes) + v_off +
                            (size_t)off * hd;
        __m256 pr = _mm256_set1_ps(kern_fp16_to_fp32(p16[p]));
        float *a = acc + (size_t)(p % lanes) * hd;
        for (uint32_t d = 0; d < hd; d += 8)
            _mm256_storeu_ps(a + d, _mm256_fmadd_ps(ld16(v + d), pr, _mm256_loadu_ps(a + d)));
    }
    float *o = out_all + ((size_t)row * n_heads + head) * hd;
    for (uint32_t d = 0; d < hd; d++) {
        if (!decode) {
            __m256 l8 = _mm256_setr_ps(acc[0 * hd + d], acc[1 * hd + d], acc[2 * hd + d], acc[3 * hd + d],
                                       acc[4 * hd + d], acc[5 * hd + d], acc[6 * hd + d], acc[7 * hd + d]);
            o[d] = hsum8(l8);
        } else {
            __m256 l[4];
            for (int j = 0; j < 4; j++)
                l[j] = _mm256_setr_ps(acc[(8 * j + 0) * hd + d], acc[(8 * j + 1) * hd + d], acc[(8 * j + 2) * hd + d],
                                      acc[(8 * j + 3) * hd + d], acc[(8 * j + 4) * hd + d], acc[(8 * j + 5) * hd + d],
                                      acc[(8 * j + 6) * hd + d], acc[(8 * j + 7) * hd + d]);
            o[d] = (float)(double)hsum4x8(l[0], l[1], l[2], l[3]);
        }
    }
}
#endif
