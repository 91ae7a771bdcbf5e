// rope.cu — rotary position embedding in place, one thread per rotated pair;
// both pairings (norm: (2i, 2i+1); neox: (i, i + d/2)); freq holds the
// per-pair inverse frequencies with any scaling already applied.
#include "kernels/cuda/cuda_int.h"

__global__ void k_rope(float *x, uint32_t n, uint32_t heads, uint32_t hd, const int32_t *pos, const float *freq,
                       int neox)
{
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    uint32_t half = hd / 2;
    if (i >= (size_t)n * heads * half)
        return;
    uint32_t p = (uint32_t)(i % half);
    size_t th = i / half;
    uint32_t t = (uint32_t)(th / heads);
    float *v = x + th * hd;
    float s, c;
    sincosf((float)pos[t] * freq[p], &s, &c);
    uint32_t a = neox ? p : 2 * p, b = neox ? p + half : 2 * p + 1;
    float x0 = v[a], x1 = v[b];
    v[a] = x0 * c - x1 * s;
    v[b] = x0 * s + x1 * c;
}

td_status_t kc_rope(kern_backend_t *b, float *x, uint32_t n, uint32_t heads, uint32_t hd, const int32_t *pos,
                    const float *freq, kern_rope_style_t style)
{
    kc_bind(b);
    size_t pairs = (size_t)n * heads * (hd / 2);
    if (!pairs)
        return TD_OK;
    k_rope<<<kc_blocks(pairs, 256), 256, 0, ((kern_cuda_t *)b)->stream>>>(x, n, heads, hd, pos, freq,
                                                                            style == KERN_ROPE_NEOX);
    return kc_launched("rope");
}
