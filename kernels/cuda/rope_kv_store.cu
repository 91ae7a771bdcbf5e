// rope_kv_store.cu — a layer's rope on q and k and its KV store in one
// kernel (kernels/backend.h's rope_kv_store): at a decode step each of the
// three is a few thousand values, so their launches, not their bytes, are
// what they cost. A block a token row, a thread a rotated pair (of every
// head; below). fp8_e4m3 KV: one thread per rotated pair of q, one warp per
// row of k (rotated in place, then stored with its scale) and of v.
#include "kernels/cuda/cuda_int.h"

// A block a token row: each pair's angle made once into shared memory (a sine and cosine a pair, not a pair and
// head: at a 4k prompt the thread-a-pair version spent most of its time in sincosf and 64-bit index arithmetic),
// then the row's q and k pairs of every head rotated by them, k's stored, and its v stored. head_dim <= 512.
template <typename T>
__global__ void k_rope_kv_store(uint8_t *base, size_t block_bytes, uint32_t layer, uint32_t n_kv, uint32_t bt,
                                uint32_t hd, float *q, float *k, const float *v, uint32_t n_heads,
                                const int32_t *slots, uint32_t n, const int32_t *pos, const float *freq, int neox)
{
    __shared__ float sn[256], cs[256];
    kc_pdl_wait();
    kc_pdl_release();
    const uint32_t t = blockIdx.x, half = hd / 2, slot = (uint32_t)slots[t];
    for (uint32_t p = threadIdx.x; p < half; p += blockDim.x)
        kc_rope_angle(pos[t], freq, p, &sn[p], &cs[p]);
    __syncthreads();
    float *qr = q + (size_t)t * n_heads * hd, *kr = k + (size_t)t * n_kv * hd;
    uint32_t ia, ib;
    for (uint32_t i = threadIdx.x; i < n_heads * half; i += blockDim.x) {
        const uint32_t h = i / half, p = i % half;
        kc_rope_rot(qr + h * hd, p, hd, sn[p], cs[p], neox, &ia, &ib);
    }
    for (uint32_t i = threadIdx.x; i < n_kv * half; i += blockDim.x) {
        const uint32_t h = i / half, p = i % half;
        kc_rope_store_k<T>(kr + h * hd, p, hd, sn[p], cs[p], neox, base, block_bytes, layer, n_kv, bt, slot, h);
    }
    const float *vr = v + (size_t)t * n_kv * hd;
    for (uint32_t i = threadIdx.x; i < n_kv * hd; i += blockDim.x)
        *kc_kv_dst<T>(base, block_bytes, layer, 1, n_kv, bt, hd, slot, i / hd, i % hd) = kc_from_float<T>(vr[i]);
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
    if (g->head_dim > 512) // (the angles' shared memory)
        return td_error(TD_ERR_UNSUPPORTED, "cuda: rope_kv_store: head_dim %u is past 512", g->head_dim);
    if (g->dtype == TD_KV_F8_E4M3) {
        const unsigned qb = kc_blocks((size_t)n * n_heads * (g->head_dim / 2), 256);
        return kc_launch((kern_cuda_t *)b, "rope_kv_store", k_rope_kv_store_f8,
                         qb + kc_blocks((size_t)2 * n * g->n_kv_heads * 32, 256), 256, 0, (uint8_t *)kv->base,
                         kv->block_bytes, kv->layer, g->n_kv_heads, g->block_tokens, g->head_dim, q, k, v, n_heads,
                         slots, n, pos, freq, (int)(style == KERN_ROPE_NEOX), qb);
    }
    return kc_launch((kern_cuda_t *)b, "rope_kv_store",
                     g->dtype == TD_KV_F16 ? k_rope_kv_store<__half> : k_rope_kv_store<float>, n, 256, 0,
                     (uint8_t *)kv->base, kv->block_bytes, kv->layer,
                     g->n_kv_heads, g->block_tokens, g->head_dim, q, k, v, n_heads, slots, n, pos, freq,
                     (int)(style == KERN_ROPE_NEOX));
}
