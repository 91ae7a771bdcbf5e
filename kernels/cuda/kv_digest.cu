// kv_digest.cu — a 64-bit digest of each named block of the KV pool, read
// where it lives (a pool's worth of KV never crosses to the host to be
// checked). Each 8-byte word is mixed with its index (splitmix64's
// finalizer) and the mixed words are summed, so the threads of a block may
// add in any order and the result is still one function of the bytes and
// their places; a missing, partial or overwritten block changes it. One
// CUDA block per KV block.
#include "kernels/cuda/cuda_int.h"

__device__ __forceinline__ unsigned long long kd_mix(unsigned long long z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

__global__ void k_kv_digest(const uint8_t *base, size_t block_bytes, const int32_t *blocks, unsigned long long *out)
{
    const unsigned long long *p = (const unsigned long long *)(base + (size_t)blocks[blockIdx.x] * block_bytes);
    size_t words = block_bytes / 8;
    unsigned long long acc = 0;
    for (size_t i = threadIdx.x; i < words; i += blockDim.x)
        acc += kd_mix(p[i] ^ (i * 0x9e3779b97f4a7c15ull));
    for (int o = 16; o; o >>= 1)
        acc += __shfl_xor_sync(0xffffffffu, acc, o);
    __shared__ unsigned long long part[32];
    if ((threadIdx.x & 31) == 0)
        part[threadIdx.x >> 5] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned long long s = 0;
        for (unsigned w = 0; w < blockDim.x / 32; w++)
            s += part[w];
        out[blockIdx.x] = kd_mix(s ^ block_bytes);
    }
}

td_status_t kc_kv_digest(kern_backend_t *b, const void *base, size_t block_bytes, const int32_t *blocks, uint32_t n,
                         uint64_t *out)
{
    kc_bind(b);
    kern_cuda_t *c = (kern_cuda_t *)b;
    if (!n)
        return TD_OK;
    if (block_bytes % 8)
        return td_error(TD_ERR_INVALID_ARG, "cuda: kv_digest: a block of %zu bytes is not whole 8-byte words",
                        block_bytes);
    size_t list = ((size_t)n * 4 + 7) / 8 * 8;
    td_status_t rc = kc_scratch(c, &c->dg, list + (size_t)n * 8);
    if (rc)
        return rc;
    int32_t *d_blocks = (int32_t *)c->dg.p;
    unsigned long long *d_out = (unsigned long long *)((uint8_t *)c->dg.p + list);
    CU(cudaMemcpyAsync(d_blocks, blocks, (size_t)n * 4, cudaMemcpyHostToDevice, c->stream));
    k_kv_digest<<<n, 512, 0, c->stream>>>((const uint8_t *)base, block_bytes, d_blocks, d_out);
    if ((rc = kc_launched("kv_digest")))
        return rc;
    CU(cudaMemcpyAsync(out, d_out, (size_t)n * 8, cudaMemcpyDeviceToHost, c->stream));
    CU(cudaStreamSynchronize(c->stream));
    return TD_OK;
}
