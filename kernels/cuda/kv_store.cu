// kv_store.cu — writes one layer's k and v [n][n_kv_heads][head_dim] into
// the paged pool at their slots (slot = block * block_tokens + offset), in
// the canonical block layout (common/kv_contract.h): fp16 (rounded to
// nearest) or fp32 one thread per value; fp8_e4m3 one warp per row, which
// makes the row's scale and codes (cuda_int.h's kc_kv8_store).
#include "kernels/cuda/cuda_int.h"


template <typename T>
__global__ void k_kv_store(uint8_t *base, size_t block_bytes, uint32_t layer, uint32_t n_kv, uint32_t bt, uint32_t hd,
                           const float *k, const float *v, const int32_t *slots, uint32_t n)
{
    kc_pdl_wait();
    kc_pdl_release();
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x, per = (size_t)n * n_kv * hd;
    if (i >= 2 * per)
        return;
    uint32_t which = i >= per;
    size_t r = i - which * per;
    uint32_t t = (uint32_t)(r / ((size_t)n_kv * hd)), h = (uint32_t)(r / hd % n_kv), d = (uint32_t)(r % hd);
    *kc_kv_dst<T>(base, block_bytes, layer, which, n_kv, bt, hd, (uint32_t)slots[t], h, d) =
        kc_from_float<T>((which ? v : k)[r]);
}

__global__ void k_kv_store_f8(uint8_t *base, size_t block_bytes, uint32_t layer, uint32_t n_kv, uint32_t bt,
                              uint32_t hd, const float *k, const float *v, const int32_t *slots, uint32_t n)
{
    kc_pdl_wait();
    kc_pdl_release();
    const size_t w = (blockIdx.x * (size_t)blockDim.x + threadIdx.x) / 32, per = (size_t)n * n_kv;
    if (w >= 2 * per) // a whole warp
        return;
    const uint32_t which = w >= per;
    const size_t r = w - which * per;
    kc_kv8_store(base, block_bytes, layer, which, n_kv, bt, hd, (uint32_t)slots[r / n_kv], (uint32_t)(r % n_kv),
                 (which ? v : k) + r * hd);
}

td_status_t kc_kv_store(kern_backend_t *b, const kern_kv_view_t *kv, const float *k, const float *v,
                        const int32_t *slots, uint32_t n)
{
    kc_bind(b);
    const td_kv_layout_t *g = kv->layout;
    size_t total = (size_t)2 * n * g->n_kv_heads * g->head_dim;
    if (!total)
        return TD_OK;
    kern_cuda_t *c = (kern_cuda_t *)b;
    if (g->dtype == TD_KV_F8_E4M3)
        return kc_launch(c, "kv_store", k_kv_store_f8, kc_blocks((size_t)2 * n * g->n_kv_heads * 32, 256), 256, 0,
                         (uint8_t *)kv->base, kv->block_bytes, kv->layer, g->n_kv_heads, g->block_tokens,
                         g->head_dim, k, v, slots, n);
    return kc_launch(c, "kv_store", g->dtype == TD_KV_F16 ? k_kv_store<__half> : k_kv_store<float>,
                     kc_blocks(total, 256), 256, 0, (uint8_t *)kv->base, kv->block_bytes, kv->layer, g->n_kv_heads,
                     g->block_tokens, g->head_dim, k, v, slots, n);
}
