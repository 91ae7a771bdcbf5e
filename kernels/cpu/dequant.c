/* dequant.c — portable decoders of every weight format (layouts in
 * kernels/quant.h) and the run-time choice between them and the AVX2 ones.
 * The arithmetic follows ggml's reference decoders operation for operation
 * (e.g. d * scale first, then * q), so results are bit-identical to it. */
#include "kernels/cpu/dequant.h"

#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "kernels/quant.h"

#if defined(__x86_64__)
#include <cpuid.h>

/* AVX2 and FMA through the compiler's check (which also asks the OS about
 * the AVX state); F16C, which not every compiler's check names, from CPUID. */
static bool cpu_has_avx2_fma_f16c(void)
{
    unsigned a, b, c, d;
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma"))
        return false;
    if (!__get_cpuid(1, &a, &b, &c, &d))
        return false;
    return (c >> 29) & 1;
}
#endif

static inline uint16_t rd16(const uint8_t *p)
{
    uint16_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

static void dq_f16(const void *src, float *dst, size_t n)
{
    const uint8_t *s = src;
    for (size_t i = 0; i < n; i++)
        dst[i] = kern_fp16_to_fp32(rd16(s + 2 * i));
}

static void dq_bf16(const void *src, float *dst, size_t n)
{
    const uint8_t *s = src;
    for (size_t i = 0; i < n; i++)
        dst[i] = kern_bf16_to_fp32(rd16(s + 2 * i));
}

static void dq_q4_0(const void *src, float *dst, size_t n)
{
    const uint8_t *b = src;
    for (size_t i = 0; i < n / 32; i++, b += 18, dst += 32) {
        float d = kern_fp16_to_fp32(rd16(b));
        const uint8_t *qs = b + 2;
        for (int j = 0; j < 16; j++) {
            dst[j] = (float)((qs[j] & 0x0f) - 8) * d;
            dst[j + 16] = (float)((qs[j] >> 4) - 8) * d;
        }
    }
}

static void dq_q4_1(const void *src, float *dst, size_t n)
{
    const uint8_t *b = src;
    for (size_t i = 0; i < n / 32; i++, b += 20, dst += 32) {
        float d = kern_fp16_to_fp32(rd16(b));
        float m = kern_fp16_to_fp32(rd16(b + 2));
        const uint8_t *qs = b + 4;
        for (int j = 0; j < 16; j++) {
            dst[j] = (float)(qs[j] & 0x0f) * d + m;
            dst[j + 16] = (float)(qs[j] >> 4) * d + m;
        }
    }
}

static void dq_q8_0(const void *src, float *dst, size_t n)
{
    const uint8_t *b = src;
    for (size_t i = 0; i < n / 32; i++, b += 34, dst += 32) {
        float d = kern_fp16_to_fp32(rd16(b));
        const int8_t *qs = (const int8_t *)(b + 2);
        for (int j = 0; j < 32; j++)
            dst[j] = (float)qs[j] * d;
    }
}

/* The 6-bit scale and min of sub-block j of a Q4_K/Q5_K block. */
static inline void k_scale_min(int j, const uint8_t *q, uint8_t *sc, uint8_t *m)
{
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (uint8_t)((q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4));
        *m = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

void kern_dq_q4_k_ref(const void *src, float *dst, size_t n)
{
    const uint8_t *b = src;
    for (size_t i = 0; i < n / 256; i++, b += 144) {
        float d = kern_fp16_to_fp32(rd16(b));
        float dmin = kern_fp16_to_fp32(rd16(b + 2));
        const uint8_t *scales = b + 4, *q = b + 16;
        for (int j = 0, is = 0; j < 256; j += 64, is += 2, q += 32) {
            uint8_t sc, m;
            k_scale_min(is, scales, &sc, &m);
            float d1 = d * sc, m1 = dmin * m;
            k_scale_min(is + 1, scales, &sc, &m);
            float d2 = d * sc, m2 = dmin * m;
            for (int l = 0; l < 32; l++)
                *dst++ = d1 * (q[l] & 0xf) - m1;
            for (int l = 0; l < 32; l++)
                *dst++ = d2 * (q[l] >> 4) - m2;
        }
    }
}

void kern_dq_q5_k_ref(const void *src, float *dst, size_t n)
{
    const uint8_t *b = src;
    for (size_t i = 0; i < n / 256; i++, b += 176) {
        float d = kern_fp16_to_fp32(rd16(b));
        float dmin = kern_fp16_to_fp32(rd16(b + 2));
        const uint8_t *scales = b + 4, *qh = b + 16, *ql = b + 48;
        uint8_t u1 = 1, u2 = 2;
        for (int j = 0, is = 0; j < 256; j += 64, is += 2, ql += 32) {
            uint8_t sc, m;
            k_scale_min(is, scales, &sc, &m);
            float d1 = d * sc, m1 = dmin * m;
            k_scale_min(is + 1, scales, &sc, &m);
            float d2 = d * sc, m2 = dmin * m;
            for (int l = 0; l < 32; l++)
                *dst++ = d1 * ((ql[l] & 0xf) + (qh[l] & u1 ? 16 : 0)) - m1;
            for (int l = 0; l < 32; l++)
                *dst++ = d2 * ((ql[l] >> 4) + (qh[l] & u2 ? 16 : 0)) - m2;
            u1 = (uint8_t)(u1 << 2);
            u2 = (uint8_t)(u2 << 2);
        }
    }
}

void kern_dq_q6_k_ref(const void *src, float *dst, size_t n)
{
    const uint8_t *b = src;
    for (size_t i = 0; i < n / 256; i++, b += 210) {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *sc = (const int8_t *)(b + 192);
        float d = kern_fp16_to_fp32(rd16(b + 208));
        for (int half = 0; half < 2; half++, dst += 128, ql += 64, qh += 32, sc += 8) {
            for (int l = 0; l < 32; l++) {
                int is = l / 16;
                int q1 = (int)((ql[l] & 0xf) | ((qh[l] & 3) << 4)) - 32;
                int q2 = (int)((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) - 32;
                int q3 = (int)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                int q4 = (int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                dst[l] = d * sc[is] * q1;
                dst[l + 32] = d * sc[is + 2] * q2;
                dst[l + 64] = d * sc[is + 4] * q3;
                dst[l + 96] = d * sc[is + 6] * q4;
            }
        }
    }
}

const kern_dequant_table_t kern_dequant_portable = {
    .f16 = dq_f16, .bf16 = dq_bf16, .q4_0 = dq_q4_0, .q4_1 = dq_q4_1,
    .q8_0 = dq_q8_0, .q4_k = kern_dq_q4_k_ref, .q5_k = kern_dq_q5_k_ref, .q6_k = kern_dq_q6_k_ref,
};

static const kern_dequant_table_t *kern_dequant_active;

static const kern_dequant_table_t *kern_dequant_pick(void)
{
    if (kern_dequant_active)
        return kern_dequant_active;
    const kern_dequant_table_t *t = &kern_dequant_portable;
#if defined(__x86_64__)
    const char *force = getenv("TANDEM_CPU");
    if (!(force && strcmp(force, "portable") == 0) && cpu_has_avx2_fma_f16c())
        t = &kern_dequant_avx2;
#endif
    kern_dequant_active = t; /* benign race: every thread picks the same table */
    return t;
}

const char *kern_cpu_path(void)
{
    return kern_dequant_pick() == &kern_dequant_portable ? "portable" : "avx2";
}

td_status_t kern_dequant_row(uint32_t type, const void *src, float *dst, size_t n)
{
    const kern_type_info_t *info = kern_type_info(type);
    if (!info)
        return td_error(TD_ERR_UNSUPPORTED, "dequant: unsupported tensor type %u", type);
    if (n % info->block_elems)
        return td_error(TD_ERR_INVALID_ARG, "dequant: %zu values is not a multiple of %s's block of %u",
                        n, info->name, info->block_elems);
    const kern_dequant_table_t *t = kern_dequant_pick();
    switch ((kern_type_t)type) {
    case KERN_TYPE_F32: memcpy(dst, src, n * sizeof(float)); break;
    case KERN_TYPE_F16: t->f16(src, dst, n); break;
    case KERN_TYPE_BF16: t->bf16(src, dst, n); break;
    case KERN_TYPE_Q4_0: t->q4_0(src, dst, n); break;
    case KERN_TYPE_Q4_1: t->q4_1(src, dst, n); break;
    case KERN_TYPE_Q8_0: t->q8_0(src, dst, n); break;
    case KERN_TYPE_Q4_K: t->q4_k(src, dst, n); break;
    case KERN_TYPE_Q5_K: t->q5_k(src, dst, n); break;
    case KERN_TYPE_Q6_K: t->q6_k(src, dst, n); break;
    case KERN_TYPE_F8_E4M3:
        for (size_t i = 0; i < n; i++)
            dst[i] = kern_fp8_to_fp32(((const uint8_t *)src)[i]);
        break;
    }
    return TD_OK;
}
