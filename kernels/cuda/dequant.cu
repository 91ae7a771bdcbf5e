// dequant.cu — CUDA decoders of the 32-value block formats and plain halves
// (layouts in kernels/quant.h). One thread per output value; a block's scale is
// read by the 32 threads that share it (served from L1). Same arithmetic as the
// CPU reference (multiply, then add; no fused multiply-add), so values are
// bit-identical to it.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels/cuda/dequant.h"
#include "kernels/quant.h"

static __device__ __forceinline__ float h2f(const uint8_t *p)
{
    return __half2float(__ushort_as_half((unsigned short)(p[0] | (p[1] << 8))));
}

__global__ void dq_q4_0(const uint8_t *src, float *dst, size_t n)
{
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= n) return;
    const uint8_t *b = src + (i / 32) * 18;
    int j = i % 32;
    int q = j < 16 ? (b[2 + j] & 0xf) : (b[2 + j - 16] >> 4);
    dst[i] = __fmul_rn((float)(q - 8), h2f(b));
}

__global__ void dq_q4_1(const uint8_t *src, float *dst, size_t n)
{
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= n) return;
    const uint8_t *b = src + (i / 32) * 20;
    int j = i % 32;
    int q = j < 16 ? (b[4 + j] & 0xf) : (b[4 + j - 16] >> 4);
    dst[i] = __fadd_rn(__fmul_rn((float)q, h2f(b)), h2f(b + 2));
}

__global__ void dq_q8_0(const uint8_t *src, float *dst, size_t n)
{
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= n) return;
    const uint8_t *b = src + (i / 32) * 34;
    dst[i] = __fmul_rn((float)(int8_t)b[2 + i % 32], h2f(b));
}

__global__ void dq_f16(const uint16_t *src, float *dst, size_t n)
{
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n) dst[i] = __half2float(__ushort_as_half(src[i]));
}

__global__ void dq_bf16(const uint16_t *src, float *dst, size_t n)
{
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n) dst[i] = __uint_as_float((unsigned)src[i] << 16);
}

extern "C" td_status_t kern_cuda_dequant(uint32_t type, const void *src, float *dst, size_t n, void *stream)
{
    cudaStream_t s = (cudaStream_t)stream;
    unsigned threads = 256;
    unsigned blocks = (unsigned)((n + threads - 1) / threads);
    if (!n) return TD_OK;
    switch (type) {
    case KERN_TYPE_F32: cudaMemcpyAsync(dst, src, n * 4, cudaMemcpyDeviceToDevice, s); break;
    case KERN_TYPE_F16: dq_f16<<<blocks, threads, 0, s>>>((const uint16_t *)src, dst, n); break;
    case KERN_TYPE_BF16: dq_bf16<<<blocks, threads, 0, s>>>((const uint16_t *)src, dst, n); break;
    case KERN_TYPE_Q4_0: dq_q4_0<<<blocks, threads, 0, s>>>((const uint8_t *)src, dst, n); break;
    case KERN_TYPE_Q4_1: dq_q4_1<<<blocks, threads, 0, s>>>((const uint8_t *)src, dst, n); break;
    case KERN_TYPE_Q8_0: dq_q8_0<<<blocks, threads, 0, s>>>((const uint8_t *)src, dst, n); break;
    default: return TD_ERR_UNSUPPORTED;
    }
    return cudaGetLastError() == cudaSuccess ? TD_OK : TD_ERR_INTERNAL;
}
