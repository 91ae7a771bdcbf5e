// rope_kv_store.cu — a layer's rope on q and k and its KV store in one
// kernel (kernels/backend.h's rope_kv_store): at a decode step each of the
// three is a few thousand values, so their launches, not their bytes, are
// what they cost. One thread per rotated pair of q, per rotated pair of k
// (which it also stores) and per value of v. fp8_e4m3 KV: one thread per
// rotated pair of q, one warp per row of k (rotated in place, then stored
// with its scale) and of v.
#include "kernels/cuda/cuda_int.h"

template <typename T>
__global__ void k_rope_kv_store(uint8_t *base, size_t block_bytes, uint32_t layer, uint32_t n_kv, uint32_t bt,
                                uint32_t hd, float *q, float *k, const float *v, uint32_t n_heads,
                                const int32_t *slots, uint32_t n, const int32_t *pos, const float *freq, int neox)
{
    kc_pdl_wait();
    kc_pdl_release();
    const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x, half = hd / 2;
    const size_t qp = (size_t)n * n_heads * half, kp = (size_t)n * n_kv * half, vn = (size_t)n * n_kv * hd;
    uint32_t ia, ib;
    if (i < qp) {
        const size_t th = i / half;
        kc_rope_pair(q + th * hd, (uint32_t)(i % half), hd, pos[th / n_heads], freq, neox, &ia, &ib);
    } else if (i < qp + kp) {
        const size_t r = i - qp, th = r / half;
        const uint32_t t = (uint32_t)(th / n_kv), h = (uint32_t)(th % n_kv);
        const uint32_t pr = (uint32_t)(r % half);
        float s, c;
        kc_rope_angle(pos[t], freq, pr, &s, &c);
        kc_rope_store_k<T>(k + th * hd, pr, hd, s, c, neox, base, block_bytes, layer, n_kv, bt, (uint32_t)slots[t], h);
    } else if (i < qp + kp + vn) {
        const size_t r = i - qp - kp;
        const uint32_t t = (uint32_t)(r / ((size_t)n_kv * hd)), h = (uint32_t)(r / hd % n_kv), d = (uint32_t)(r % hd);
        *kc_kv_dst<T>(base, block_bytes, layer, 1, n_kv, bt, hd, (uint32_t)slots[t], h, d) = kc_from_float<T>(v[r]);
    }
}

// fp8_e4m3: the first qb blocks rotate q, a pair a thread; the rest take K and V rows, a warp each
__global__ void k_rope_kv_store_f8(uint8_t *base, size_t block_bytes, uint32_t layer, uint32_t n_kv, uint32_t bt,
                                   uint32_t hd, float *q, float *k, const float *v, uint32_t n_heads,
                                   const int32_t *slots, uint32_t n, const int32_t *pos, const float *freq, int neox,
                                   uint32_t qb)
{
    kc_pdl_wait();
    kc_pdl_release();
    const uint32_t half = hd / 2;
    uint32_t ia, ib;
    if (blockIdx.x < qb) {
        const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x, th = i / half;
        if (i < (size_t)n * n_heads * half)
            kc_rope_pair(q + th * hd, (uint32_t)(i % half), hd, pos[th / n_heads], freq, neox, &ia, &ib);
        return;
    }
    const size_t w = ((blockIdx.x - qb) * (size_t)blockDim.x + threadIdx.x) / 32, per = (size_t)n * n_kv;
    if (w >= 2 * per) // a whole warp
        return;
    const uint32_t which = w >= per, t = (uint32_t)((w - which * per) / n_kv), h = (uint32_t)((w - which * per) % n_kv);
    float *kr = k + ((size_t)t * n_kv + h) * hd;
    if (!which) {
        for (uint32_t p = threadIdx.x & 31; p < half; p += 32)
            kc_rope_pair(kr, p, hd, pos[t], freq, neox, &ia, &ib);
        __syncwarp(); // the lanes' rotated pairs are seen by every lane
    }
    kc_kv8_store(base, block_bytes, layer, which, n_kv, bt, hd, (uint32_t)slots[t], h,
                 which ? v + ((size_t)t * n_kv + h) * hd : kr);
}

td_status_t kc_rope_kv_store(kern_backend_t *b, const kern_kv_view_t *kv, float *q, float *k, const float *v,
                             uint32_t n_heads, const int32_t *slots, uint32_t n, const int32_t *pos, const float *freq,
                             kern_rope_style_t style)
{
    kc_bind(b);
    const td_kv_layout_t *g = kv->layout;
    const size_t total =
        (size_t)n * (n_heads + g->n_kv_heads) * (g->head_dim / 2) + (size_t)n * g->n_kv_heads * g->head_dim;
    if (!total)
        return TD_OK;
    if (g->dtype == TD_KV_F8_E4M3) {
        const unsigned qb = kc_blocks((size_t)n * n_heads * (g->head_dim / 2), 256);
        return kc_launch((kern_cuda_t *)b, "rope_kv_store", k_rope_kv_store_f8,
                         qb + kc_blocks((size_t)2 * n * g->n_kv_heads * 32, 256), 256, 0, (uint8_t *)kv->base,
                         kv->block_bytes, kv->layer, g->n_kv_heads, g->block_tokens, g->head_dim, q, k, v, n_heads,
                         slots, n, pos, freq, (int)(style == KERN_ROPE_NEOX), qb);
    }
    return kc_launch((kern_cuda_t *)b, "rope_kv_store",
                     g->dtype == TD_KV_F16 ? k_rope_kv_store<__half> : k_rope_kv_store<float>, kc_blocks(total, 256),
                     256, 0, (uint8_t *)kv->base, kv->block_bytes, kv->layer, g->n_kv_heads, g->block_tokens,
                     g->head_dim, q, k, v, n_heads, slots, n, pos, freq, (int)(style == KERN_ROPE_NEOX));
}
