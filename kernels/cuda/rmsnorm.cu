// rmsnorm.cu — y[i] = x[i] / rms(x[i]) * w: one block per row, the sum of
// squares reduced in shared memory (fp32).
#include "kernels/cuda/cuda_int.h"

__global__ void k_rmsnorm(const float *x, const float *w, float *y, uint32_t dim, float eps)
{
    kc_pdl_wait();
    kc_pdl_release();
    const float *xr = x + (size_t)blockIdx.x * dim;
    float *yr = y + (size_t)blockIdx.x * dim;
    const float scale = kc_row_rms_scale(xr, dim, eps);
    for (uint32_t i = threadIdx.x; i < dim; i += blockDim.x)
        yr[i] = xr[i] * scale * w[i];
}

td_status_t kc_rmsnorm(kern_backend_t *b, const float *x, const float *w, float *y, uint32_t n, uint32_t dim, float eps)
{
    kc_bind(b);
    if (!n)
        return TD_OK;
    return kc_launch((kern_cuda_t *)b, "rmsnorm", k_rmsnorm, n, 256, 0, x, w, y, dim, eps);
}
