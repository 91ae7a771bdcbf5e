// rope.cu — rotary position embedding in place, one thread per rotated pair;
// both pairings (norm: (2i, 2i+1); neox: (i, i + d/2)); freq holds the
// per-pair inverse frequencies with any scaling already applied.
#include "kernels/cuda/cuda_int.h"

__global__ void k_rope(float *x, uint32_t n, uint32_t heads, uint32_t hd, const int32_t *pos, const float *freq,
                       int neox)
{
    kc_pdl_wait();
    kc_pdl_release();
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    uint32_t half = hd / 2;
    if (i >= (size_t)n * heads * half)
        return;
    uint32_t p = (uint32_t)(i % half);
    size_t th = i / half;
    uint32_t t = (uint32_t)(th / heads), ia, ib;
    kc_rope_pair(x + th * hd, p, hd, pos[t], freq, neox, &ia, &ib);
}

td_status_t kc_rope(kern_backend_t *b, float *x, uint32_t n, uint32_t heads, uint32_t hd, const int32_t *pos,
                    const float *freq, kern_rope_style_t style)
{
    kc_bind(b);
    size_t pairs = (size_t)n * heads * (hd / 2);
    if (!pairs)
        return TD_OK;
    return kc_launch((kern_cuda_t *)b, "rope", k_rope, kc_blocks(pairs, 256), 256, 0, x, n, heads, hd, pos, freq,
                     (int)(style == KERN_ROPE_NEOX));
}
