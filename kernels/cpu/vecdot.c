/* vecdot.c — portable dot products and quantizers (see vecdot.h), written to
 * give what the AVX2 versions give up to summation order: activations round
 * to nearest even, the scale's inverse is 127 / max|x|. */
#include "kernels/cpu/vecdot.h"

#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/quant.h"

static inline float h(const uint8_t *p)
{
    uint16_t v;
    memcpy(&v, p, 2);
    return kern_fp16_to_fp32(v);
}

static inline void put_h(uint8_t *p, float f)
{
    uint16_t v = kern_fp32_to_fp16(f);
    memcpy(p, &v, 2);
}

static void quantize_q8(const float *x, uint8_t *y, size_t n, bool with_sum)
{
    size_t stride = with_sum ? KERN_Q8_1_BYTES : KERN_Q8_0_BYTES;
    for (size_t b = 0; b < n / 32; b++, x += 32, y += stride) {
        float amax = 0;
        for (int j = 0; j < 32; j++)
            amax = fmaxf(amax, fabsf(x[j]));
        float d = amax / 127.f, id = amax != 0.f ? 127.f / amax : 0.f;
        int8_t *qs = (int8_t *)(y + (with_sum ? 4 : 2));
        int sum = 0;
        for (int j = 0; j < 32; j++) {
            qs[j] = (int8_t)nearbyintf(x[j] * id);
            sum += qs[j];
        }
        put_h(y, d);
        if (with_sum)
            put_h(y + 2, d * (float)sum);
    }
}

static void q8_0(const float *x, void *y, size_t n) { quantize_q8(x, y, n, false); }
static void q8_1(const float *x, void *y, size_t n) { quantize_q8(x, y, n, true); }

static float dot_q4_0_q8_0(const void *w, const void *x, size_t n)
{
    const uint8_t *a = w, *b = x;
    float sum = 0;
    for (size_t i = 0; i < n / 32; i++, a += 18, b += KERN_Q8_0_BYTES) {
        const int8_t *q = (const int8_t *)(b + 2);
        int s = 0;
        for (int j = 0; j < 16; j++)
            s += ((a[2 + j] & 0xf) - 8) * q[j] + ((a[2 + j] >> 4) - 8) * q[j + 16];
        sum += h(a) * h(b) * (float)s;
    }
    return sum;
}

static float dot_q4_1_q8_1(const void *w, const void *x, size_t n)
{
    const uint8_t *a = w, *b = x;
    float sum = 0, summs = 0;
    for (size_t i = 0; i < n / 32; i++, a += 20, b += KERN_Q8_1_BYTES) {
        const int8_t *q = (const int8_t *)(b + 4);
        int s = 0;
        for (int j = 0; j < 16; j++)
            s += (a[4 + j] & 0xf) * q[j] + (a[4 + j] >> 4) * q[j + 16];
        sum += h(a) * h(b) * (float)s;
        summs += h(a + 2) * h(b + 2);
    }
    return sum + summs;
}

static float dot_q8_0_q8_0(const void *w, const void *x, size_t n)
{
    const uint8_t *a = w, *b = x;
    float sum = 0;
    for (size_t i = 0; i < n / 32; i++, a += 34, b += KERN_Q8_0_BYTES) {
        const int8_t *p = (const int8_t *)(a + 2), *q = (const int8_t *)(b + 2);
        int s = 0;
        for (int j = 0; j < 32; j++)
            s += p[j] * q[j];
        sum += h(a) * h(b) * (float)s;
    }
    return sum;
}

static float dot_f16_f32(const void *w, const void *x, size_t n)
{
    const uint8_t *a = w;
    const float *b = x;
    float s = 0;
    for (size_t i = 0; i < n; i++)
        s += h(a + 2 * i) * b[i];
    return s;
}

static float dot_bf16_f32(const void *w, const void *x, size_t n)
{
    const uint8_t *a = w;
    const float *b = x;
    float s = 0;
    for (size_t i = 0; i < n; i++) {
        uint16_t v;
        memcpy(&v, a + 2 * i, 2);
        s += kern_bf16_to_fp32(v) * b[i];
    }
    return s;
}

static float dot_f32_f32(const void *w, const void *x, size_t n)
{
    const float *a = w, *b = x;
    float s = 0;
    for (size_t i = 0; i < n; i++)
        s += a[i] * b[i];
    return s;
}

static void axpy_f16(float a, const void *x, float *y, size_t n)
{
    const uint8_t *p = x;
    for (size_t i = 0; i < n; i++)
        y[i] += a * h(p + 2 * i);
}

static void axpy_f32(float a, const void *x, float *y, size_t n)
{
    const float *p = x;
    for (size_t i = 0; i < n; i++)
        y[i] += a * p[i];
}

static void swiglu(const float *g, const float *u, float *y, size_t n)
{
    for (size_t i = 0; i < n; i++)
        y[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

static void to_f16(const float *x, uint16_t *y, size_t n)
{
    for (size_t i = 0; i < n; i++)
        y[i] = kern_fp32_to_fp16(x[i]);
}

const kern_vecdot_table_t kern_vecdot_portable = {
    .quantize_q8_0 = q8_0, .quantize_q8_1 = q8_1, .q4_0_q8_0 = dot_q4_0_q8_0, .q4_1_q8_1 = dot_q4_1_q8_1,
    .q8_0_q8_0 = dot_q8_0_q8_0, .f16_f32 = dot_f16_f32, .bf16_f32 = dot_bf16_f32, .f32_f32 = dot_f32_f32,
    .axpy_f16 = axpy_f16, .axpy_f32 = axpy_f32, .swiglu = swiglu, .to_f16 = to_f16,
};

const kern_vecdot_table_t *kern_vecdot(void)
{
    return kern_cpu_path()[0] == 'a' ? &kern_vecdot_avx2 : &kern_vecdot_portable;
}
