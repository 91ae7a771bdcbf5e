// swiglu.cu — y = silu(gate) * up, elementwise (fp32, or fp16 for a GEMM's input; from fp32 or fp16 products).
#include "kernels/cuda/cuda_int.h"

__global__ void k_swiglu(const float *g, const float *u, float *y, size_t n)
{
    kc_pdl_wait();
    kc_pdl_release();
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n)
        y[i] = kc_silu_mul(g[i], u[i]);
}

// rows of `width` values, row r's inputs `stride` apart (dense: width == stride)
__global__ void k_swiglu_half(const float *g, const float *u, __half *y, size_t n, uint32_t width, uint32_t stride)
{
    kc_pdl_wait();
    kc_pdl_release();
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n) {
        const size_t at = width == stride ? i : i / width * stride + i % width;
        y[i] = __float2half_rn(kc_silu_mul(g[at], u[at]));
    }
}

// two values a thread
__global__ void k_swiglu_hh(const __half2 *g, const __half2 *u, __half2 *y, size_t n2)
{
    kc_pdl_wait();
    kc_pdl_release();
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n2) {
        const float2 a = __half22float2(g[i]), b = __half22float2(u[i]);
        y[i] = __floats2half2_rn(kc_silu_mul(a.x, b.x), kc_silu_mul(a.y, b.y));
    }
}

td_status_t kc_swiglu_hh(kern_cuda_t *c, const __half *g, const __half *u, __half *y, size_t n)
{
    const size_t n2 = n / 2;
    if (!n2)
        return TD_OK;
    return kc_launch(c, "swiglu_half", k_swiglu_hh, kc_blocks(n2, 256), 256, 0, (const __half2 *)g,
                     (const __half2 *)u, (__half2 *)y, n2);
}

td_status_t kc_swiglu_half(kern_cuda_t *c, const float *g, const float *u, __half *y, size_t n)
{
    if (!n)
        return TD_OK;
    return kc_launch(c, "swiglu_half", k_swiglu_half, kc_blocks(n, 256), 256, 0, g, u, y, n, (uint32_t)1, (uint32_t)1);
}

td_status_t kc_swiglu_half_rows(kern_cuda_t *c, const float *g, const float *u, uint32_t stride, __half *y,
                                uint32_t n, uint32_t width)
{
    const size_t all = (size_t)n * width;
    if (!all)
        return TD_OK;
    return kc_launch(c, "swiglu_half", k_swiglu_half, kc_blocks(all, 256), 256, 0, g, u, y, all, width, stride);
}

td_status_t kc_swiglu(kern_backend_t *b, const float *g, const float *u, float *y, size_t n)
{
    kc_bind(b);
    if (!n)
        return TD_OK;
    return kc_launch((kern_cuda_t *)b, "swiglu", k_swiglu, kc_blocks(n, 256), 256, 0, g, u, y, n);
}
