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
    if (w->type == KERN_TYPE_Q4_1 || w->type == KERN_TYPE_Q8_0)
        return kern_type_row_bytes(kern_type_info(w->type), w->cols) * w->rows;
    return 0;
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
    bool q41 = w->type == KERN_TYPE_Q4_1;
    size_t gb = q41 ? 160 : 272, sb = q41 ? 20 : 34;
    for (uint32_t g = 0; g < w->rows / 8; g++) {
        for (uint32_t b = 0; b < nb; b++) {
            uint8_t *o = out + ((size_t)g * nb + b) * gb;
            for (uint32_t r = 0; r < 8; r++) {
                const uint8_t *blk = src + (size_t)(8 * g + r) * row_bytes + (size_t)b * sb;
                memcpy(o + 2 * r, blk, 2);                 /* d */
                if (q41) {
                    memcpy(o + 16 + 2 * r, blk + 2, 2);    /* m */
                    for (uint32_t c = 0; c < 4; c++)
                        memcpy(o + 32 + c * 32 + r * 4, blk + 4 + 4 * c, 4);
                } else {
                    for (uint32_t c = 0; c < 8; c++)
                        for (uint32_t k = 0; k < 4; k++)
                            o[16 + c * 32 + r * 4 + k] = (uint8_t)(blk[2 + 4 * c + k] ^ (q8_unsigned ? 0x80 : 0));
                }
            }
        }
    }
}
