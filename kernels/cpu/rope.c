/* rope.c — rotary position embedding, in place.
 * Shapes: x [n][heads][head_dim] fp32; pos [n]; freq [head_dim / 2], the
 * inverse frequency of each rotated pair (any scaling already applied).
 * NORM rotates adjacent pairs (x[2i], x[2i+1]) — GGUF llama-family weights are
 * permuted for it; NEOX rotates halves (x[i], x[i + head_dim/2]) — Hugging Face
 * checkpoints and GGUF qwen2. Pair i at position p turns by p * freq[i]. */
#include <math.h>

#include "kernels/cpu/cpu_int.h"
#include "kernels/cpu/refnum.h"

td_status_t kern_cpu_rope(kern_backend_t *b, float *x, uint32_t n, uint32_t heads, uint32_t head_dim,
                          const int32_t *pos, const float *freq, kern_rope_style_t style)
{
    uint32_t half = head_dim / 2;
#if defined(__x86_64__)
    if (((kern_cpu_t *)b)->ref && freq[half] != 0) {
        kern_ref_rope(x, n, heads, head_dim, pos, freq[half], style == KERN_ROPE_NEOX);
        return TD_OK;
    }
#else
    (void)b;
#endif
    float cs[512], sn[512];
    int32_t last = -1;
    for (uint32_t t = 0; t < n; t++) {
        for (uint32_t i = 0; i < half && pos[t] != last; i++) {
            float theta = (float)pos[t] * freq[i];
            cs[i] = cosf(theta);
            sn[i] = sinf(theta);
        }
        last = pos[t];
        for (uint32_t h = 0; h < heads; h++) {
            float *v = x + ((size_t)t * heads + h) * head_dim;
            for (uint32_t i = 0; i < half; i++) {
                uint32_t a = style == KERN_ROPE_NORM ? 2 * i : i, c = style == KERN_ROPE_NORM ? 2 * i + 1 : i + half;
                float x0 = v[a], x1 = v[c];
                v[a] = x0 * cs[i] - x1 * sn[i];
                v[c] = x0 * sn[i] + x1 * cs[i];
            }
        }
    }
    return TD_OK;
}
