/* quant.c — the table of weight formats and scalar fp16/bf16 conversion. */
#include "kernels/quant.h"

#include <math.h>
#include <string.h>

static const kern_type_info_t kern_types[] = {
    [KERN_TYPE_F32] = {"F32", 1, 4},     [KERN_TYPE_F16] = {"F16", 1, 2},
    [KERN_TYPE_Q4_0] = {"Q4_0", 32, 18}, [KERN_TYPE_Q4_1] = {"Q4_1", 32, 20},
    [KERN_TYPE_Q8_0] = {"Q8_0", 32, 34}, [KERN_TYPE_Q4_K] = {"Q4_K", 256, 144},
    [KERN_TYPE_Q5_K] = {"Q5_K", 256, 176}, [KERN_TYPE_Q6_K] = {"Q6_K", 256, 210},
    [KERN_TYPE_BF16] = {"BF16", 1, 2},   [KERN_TYPE_F8_E4M3] = {"F8_E4M3", 1, 1},
};

/* ggml's numbering of every type, for naming the ones we refuse. */
static const char *const kern_type_names_all[] = {
    "F32", "F16", "Q4_0", "Q4_1", "Q4_2", "Q4_3", "Q5_0", "Q5_1", "Q8_0", "Q8_1",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K", "IQ2_XXS", "IQ2_XS", "IQ3_XXS",
    "IQ1_S", "IQ4_NL", "IQ3_S", "IQ2_S", "IQ4_XS", "I8", "I16", "I32", "I64", "F64",
    "IQ1_M", "BF16", "Q4_0_4_4", "Q4_0_4_8", "Q4_0_8_8", "TQ1_0", "TQ2_0",
};

const kern_type_info_t *kern_type_info(uint32_t type)
{
    if (type >= sizeof kern_types / sizeof kern_types[0] || !kern_types[type].name)
        return NULL;
    return &kern_types[type];
}

const char *kern_type_name_any(uint32_t type)
{
    if (type == KERN_TYPE_F8_E4M3)
        return "F8_E4M3";
    if (type >= sizeof kern_type_names_all / sizeof kern_type_names_all[0])
        return NULL;
    return kern_type_names_all[type];
}

float kern_fp16_to_fp32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f;
    uint32_t mant = h & 0x3ff;
    uint32_t bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else { /* subnormal: normalize */
            exp = 127 - 15 + 1;
            while (!(mant & 0x400)) {
                mant <<= 1;
                exp--;
            }
            mant &= 0x3ff;
            bits = sign | (exp << 23) | (mant << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

uint16_t kern_fp32_to_fp16(float f)
{
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    uint32_t sign = (x >> 16) & 0x8000;
    uint32_t absx = x & 0x7fffffff;
    if (absx > 0x7f800000)
        return (uint16_t)(sign | 0x7e00); /* NaN */
    if (absx >= 0x477ff000)
        return (uint16_t)(sign | 0x7c00); /* overflow to inf */
    if (absx < 0x38800000) {              /* subnormal or zero in fp16 */
        if (absx < 0x33000000)
            return (uint16_t)sign;
        uint32_t e = absx >> 23;
        uint32_t m = (absx & 0x7fffff) | 0x800000;
        uint32_t shift = 126 - e; /* 14 + (113 - e) */
        uint32_t half = 1u << (shift - 1);
        uint32_t r = m >> shift;
        uint32_t rem = m & ((1u << shift) - 1);
        if (rem > half || (rem == half && (r & 1)))
            r++;
        return (uint16_t)(sign | r);
    }
    uint32_t r = absx + 0xc8000fff + ((absx >> 13) & 1); /* rebias, round to even */
    return (uint16_t)(sign | (r >> 13));
}

float kern_bf16_to_fp32(uint16_t h)
{
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

float kern_fp8_to_fp32(uint8_t q)
{
    const uint32_t e = (q >> 3) & 0xf, m = q & 7, sign = (uint32_t)(q & 0x80) << 24;
    uint32_t bits;
    if (e == 0xf && m == 7) {
        bits = sign | 0x7fc00000u; /* NaN */
    } else if (e == 0) {
        const float v = (float)m * 0x1p-9f; /* subnormal: m * 2^-9 */
        memcpy(&bits, &v, sizeof bits);
        bits |= sign;
    } else {
        bits = sign | ((e + 120) << 23) | (m << 20); /* (1 + m/8) * 2^(e-7) */
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* v (0 <= v < 2^22) rounded to the nearest integer, ties to even: the float addition rounds */
static inline uint32_t round_even(float v)
{
    volatile float big = 0x1p23f; /* volatile: the sum is rounded to float, not kept wider */
    return (uint32_t)((v + big) - big);
}

uint8_t kern_fp32_to_fp8(float f)
{
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    const uint8_t sign = (uint8_t)((bits >> 24) & 0x80);
    const uint32_t abits = bits & 0x7fffffffu;
    if (abits > 0x7f800000u)
        return sign | 0x7f; /* NaN */
    if (abits >= 0x43e00000u)
        return sign | 0x7e; /* 448 and over, infinities too: saturated */
    float a;
    memcpy(&a, &abits, sizeof a);
    uint32_t code;
    if (abits < 0x3c800000u) { /* under 2^-6: subnormal; 8 carries into the smallest normal, code 8 */
        code = round_even(a * 0x1p9f);
    } else {
        const uint32_t be = abits >> 23; /* 121 .. 135: 2^-6 .. 2^8 */
        /* a * 2^(3 - (be - 127)), exact, in [8, 16) before rounding; 16 carries into the next exponent */
        const uint32_t sbits = (130u - be + 127u) << 23;
        float sc;
        memcpy(&sc, &sbits, sizeof sc);
        const uint32_t r = round_even(a * sc);
        code = ((be - 120u) << 3) + (r - 8);
    }
    return sign | (uint8_t)(code > 0x7e ? 0x7e : code);
}

void kern_fp8_quantize_row(const float *x, size_t n, uint8_t *q, float *scale)
{
    float amax = 0;
    for (size_t i = 0; i < n; i++)
        amax = fmaxf(amax, fabsf(x[i]));
    const float s = amax > 0 ? amax / 448.0f : 1.0f;
    for (size_t i = 0; i < n; i++)
        q[i] = kern_fp32_to_fp8(x[i] / s);
    *scale = s;
}

void kern_fill_row_f16(uint64_t seed, uint64_t row, uint32_t col0, uint32_t cols, uint16_t *dst)
{
    for (uint32_t i = 0; i < cols; i++)
        dst[i] = kern_fp32_to_fp16(kern_fill_value(seed, row, (uint64_t)col0 + i));
}
