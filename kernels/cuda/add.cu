// add.cu — x += y, elementwise (the residual adds and biases).
#include "kernels/cuda/cuda_int.h"

__global__ void k_add(float *x, const float *y, size_t n)
{
    kc_pdl_wait();
    kc_pdl_release();
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n)
        x[i] += y[i];
}

td_status_t kc_add(kern_backend_t *b, float *x, const float *y, size_t n)
{
    kc_bind(b);
    if (!n)
        return TD_OK;
    return kc_launch((kern_cuda_t *)b, "add", k_add, kc_blocks(n, 256), 256, 0, x, y, n);
}
