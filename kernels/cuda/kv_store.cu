// kv_store.cu — writes one layer's k and v [n][n_kv_heads][head_dim] into
// the paged pool at their slots (slot = block * block_tokens + offset), in
// the canonical block layout (common/kv_contract.h), fp16 (rounded to
// nearest) or fp32; one thread per value.
#include "kernels/cuda/cuda_int.h"

template <typename T> __device__ __forceinline__ T kc_from_float(float f);
template <> __device__ __forceinline__ float kc_from_float<float>(float f) { return f; }
template <> __device__ __forceinline__ __half kc_from_float<__half>(float f) { return __float2half_rn(f); }

template <typename T>
__global__ void k_kv_store(uint8_t *base, size_t block_bytes, uint32_t layer, uint32_t n_kv, uint32_t bt, uint32_t hd,
                           const float *k, const float *v, const int32_t *slots, uint32_t n)
{
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x, per = (size_t)n * n_kv * hd;
    if (i >= 2 * per)
        return;
    uint32_t which = i >= per;
    size_t r = i - which * per;
    uint32_t t = (uint32_t)(r / ((size_t)n_kv * hd)), h = (uint32_t)(r / hd % n_kv), d = (uint32_t)(r % hd);
    uint32_t slot = (uint32_t)slots[t], blk = slot / bt, off = slot % bt;
    T *dst = (T *)(base + (size_t)blk * block_bytes) + (((size_t)layer * 2 + which) * n_kv + h) * bt * hd +
             (size_t)off * hd + d;
    *dst = kc_from_float<T>((which ? v : k)[r]);
}

td_status_t kc_kv_store(kern_backend_t *b, const kern_kv_view_t *kv, const float *k, const float *v,
                        const int32_t *slots, uint32_t n)
{
    kc_bind(b);
    const td_kv_layout_t *g = kv->layout;
    size_t total = (size_t)2 * n * g->n_kv_heads * g->head_dim;
    if (!total)
        return TD_OK;
    cudaStream_t s = ((kern_cuda_t *)b)->stream;
    if (g->dtype == TD_KV_F16)
        k_kv_store<__half><<<kc_blocks(total, 256), 256, 0, s>>>((uint8_t *)kv->base, kv->block_bytes, kv->layer,
                                                                 g->n_kv_heads, g->block_tokens, g->head_dim, k, v,
                                                                 slots, n);
    else
        k_kv_store<float><<<kc_blocks(total, 256), 256, 0, s>>>((uint8_t *)kv->base, kv->block_bytes, kv->layer,
                                                                g->n_kv_heads, g->block_tokens, g->head_dim, k, v,
                                                                slots, n);
    return kc_launched("kv_store");
}
