// swiglu.cu — y = silu(gate) * up, elementwise.
#include "kernels/cuda/cuda_int.h"

__global__ void k_swiglu(const float *g, const float *u, float *y, size_t n)
{
    kc_pdl_wait();
    kc_pdl_release();
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n)
        y[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

td_status_t kc_swiglu(kern_backend_t *b, const float *g, const float *u, float *y, size_t n)
{
    kc_bind(b);
    if (!n)
        return TD_OK;
    return kc_launch((kern_cuda_t *)b, "swiglu", k_swiglu, kc_blocks(n, 256), 256, 0, g, u, y, n);
}
