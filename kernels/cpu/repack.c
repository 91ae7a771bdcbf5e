/* repack.c — the byte shuffles of repack.h (portable; run once at load). */
#include "kernels/cpu/repack.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/quant.h"

size_t kern_repack_size(const kern_weight_t *w)
{
    if (w->rows % 8 || w->cols % 32)
        return 0;
    switch (w->type) {
    case KERN_TYPE_Q4_0: case KERN_TYPE_Q4_1: case KERN_TYPE_Q4_K:
        return (size_t)w->rows / 8 * (w->cols / 32) * 160;
    case KERN_TYPE_Q8_0:
        return (size_t)w->rows / 8 * (w->cols / 32) * 272;
    default:
        return 0;
    }
}

uint32_t kern_repack_kernel_type(uint32_t type)
{
    return type == KERN_TYPE_Q8_0 ? KERN_TYPE_Q8_0 : KERN_TYPE_Q4_1;
}

/* One 32-value block of row `row`, block b, as Q4_1 fields: fp16 d, fp16 m
 * (x = q·d + m) and qs[16] (value l in the low nibble of qs[l], l + 16 in the
 * high one). Q4_0 is exact (m = -8d); Q4_K's sub-block scale and min are
 * rounded to fp16 (2^-11 relative). */
static void q4_block(const kern_weight_t *w, const uint8_t *row, uint32_t b, uint8_t dm[4], uint8_t qs[16])
{
    if (w->type == KERN_TYPE_Q4_1) {
        memcpy(dm, row + (size_t)b * 20, 4);
        memcpy(qs, row + (size_t)b * 20 + 4, 16);
        return;
    }
    if (w->type == KERN_TYPE_Q4_0) {
        const uint8_t *blk = row + (size_t)b * 18;
        uint16_t d;
        memcpy(&d, blk, 2);
        uint16_t m = kern_fp32_to_fp16(-8.0f * kern_fp16_to_fp32(d));
        memcpy(dm, &d, 2);
        memcpy(dm + 2, &m, 2);
        memcpy(qs, blk + 2, 16);
        return;
    }
    /* Q4_K: 256-value super-blocks; sub-block s = b % 8 of super-block b / 8 */
    const uint8_t *sb = row + (size_t)(b / 8) * 144;
    uint32_t s = b % 8;
    uint16_t dh, mh;
    memcpy(&dh, sb, 2);
    memcpy(&mh, sb + 2, 2);
    const uint8_t *sc = sb + 4, *q = sb + 16 + (s / 2) * 32;
    uint8_t scale, min;
    if (s < 4) {
        scale = sc[s] & 63;
        min = sc[s + 4] & 63;
    } else {
        scale = (uint8_t)((sc[s + 4] & 0xf) | ((sc[s - 4] >> 6) << 4));
        min = (uint8_t)((sc[s + 4] >> 4) | ((sc[s] >> 6) << 4));
    }
    uint16_t d = kern_fp32_to_fp16(kern_fp16_to_fp32(dh) * scale);
    uint16_t m = kern_fp32_to_fp16(-(kern_fp16_to_fp32(mh) * min));
    memcpy(dm, &d, 2);
    memcpy(dm + 2, &m, 2);
    uint8_t v[32];
    for (int l = 0; l < 32; l++)
        v[l] = s % 2 ? q[l] >> 4 : q[l] & 0xf;
    for (int l = 0; l < 16; l++)
        qs[l] = (uint8_t)(v[l] | (v[l + 16] << 4));
}

bool kern_cpu_has_vnni(void)
{
#if defined(__x86_64__)
    const char *force = getenv("TANDEM_CPU");
    if (force && (!strcmp(force, "portable") || !strcmp(force, "avx2")))
        return false;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl");
#else
    return false;
#endif
}

void kern_repack(const kern_weight_t *w, void *dst, bool q8_unsigned)
{
    const uint8_t *src = w->data;
    uint8_t *out = dst;
    uint32_t nb = w->cols / 32;
    size_t row_bytes = kern_type_row_bytes(kern_type_info(w->type), w->cols);
    bool q41 = kern_repack_kernel_type(w->type) == KERN_TYPE_Q4_1;
    size_t gb = q41 ? 160 : 272, sb = 34;
    for (uint32_t g = 0; g < w->rows / 8; g++) {
        for (uint32_t b = 0; b < nb; b++) {
            uint8_t *o = out + ((size_t)g * nb + b) * gb;
            for (uint32_t r = 0; r < 8; r++) {
                const uint8_t *rowp = src + (size_t)(8 * g + r) * row_bytes;
                const uint8_t *blk = rowp + (size_t)b * sb;
                if (q41) {
                    uint8_t dm[4], qs[16];
                    q4_block(w, rowp, b, dm, qs);
                    memcpy(o + 2 * r, dm, 2);           /* d */
                    memcpy(o + 16 + 2 * r, dm + 2, 2);  /* m */
                    for (uint32_t c = 0; c < 4; c++)
                        memcpy(o + 32 + c * 32 + r * 4, qs + 4 * c, 4);
                } else {
                    memcpy(o + 2 * r, blk, 2);          /* d */
                    for (uint32_t c = 0; c < 8; c++)
                        for (uint32_t k = 0; k < 4; k++)
                            o[16 + c * 32 + r * 4 + k] = (uint8_t)(blk[2 + 4 * c + k] ^ (q8_unsigned ? 0x80 : 0));
                }
            }
        }
    }
}
