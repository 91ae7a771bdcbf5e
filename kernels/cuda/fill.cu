// fill.cu — a matrix without a file (kern_weight_t.fill: a dummy load format,
// for benchmarks) filled on the GPU with kern_fill_row_f16's values, bit for
// bit (kernels/quant.h: integer arithmetic and one multiplication).
#include "kernels/cuda/cuda_int.h"
#include "kernels/quant.h"

__global__ void k_fill(__half *dst, uint64_t seed, uint32_t rows, uint32_t cols, uint32_t row0, uint32_t col0)
{
    const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= (size_t)rows * cols)
        return;
    dst[i] = __float2half_rn(kern_fill_value(seed, row0 + i / cols, col0 + i % cols));
}

td_status_t kc_fill(kern_cuda_t *c, const kern_weight_t *w, __half *dst)
{
    const size_t n = (size_t)w->rows * w->cols;
    k_fill<<<kc_blocks(n, 256), 256, 0, c->stream>>>(dst, w->fill, w->rows, w->cols, w->fill_row0, w->fill_col0);
    td_status_t rc = kc_launched("fill");
    if (!rc) {
        cudaError_t e = cudaStreamSynchronize(c->stream);
        if (e != cudaSuccess)
            rc = td_error(TD_ERR_INTERNAL, "cuda: filling a %ux%u matrix failed: %s", w->rows, w->cols,
                          cudaGetErrorString(e));
    }
    return rc;
}
