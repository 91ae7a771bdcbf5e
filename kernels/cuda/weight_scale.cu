// weight_scale.cu — weight_scale_cols (kernels/backend.h): each column of a
// weight's fp16 copy multiplied by a scale, so that an RMSNorm's weight rides
// in the matmul after it. The GEMV then reads only x, not x and the norm's
// weight, in every warp: in a 7B step that was 0.4 ms of 3.7
// (bench/results/gpu-2026-11-26, run 4).
#include <math.h>
#include <string.h>

#include "kernels/cuda/cuda_int.h"
#include "kernels/quant.h"

// The largest |W[r][c] * s[c]| (NaN counted as infinite) as a float's bits,
// which order as unsigned for non-negative floats: one block a row at a time.
__global__ void k_scaled_max(const __half *w, uint32_t rows, uint32_t cols, const float *s, unsigned *out)
{
    kc_pdl_wait();
    kc_pdl_release();
    float m = 0;
    for (uint32_t r = blockIdx.x; r < rows; r += gridDim.x)
        for (uint32_t c = threadIdx.x; c < cols; c += blockDim.x) {
            const float v = fabsf(__half2float(w[(size_t)r * cols + c]) * s[c]);
            m = v != v ? INFINITY : fmaxf(m, v);
        }
    for (int o = 16; o > 0; o >>= 1)
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if ((threadIdx.x & 31) == 0)
        atomicMax(out, __float_as_uint(m));
}

__global__ void k_scale_cols(__half *w, uint32_t rows, uint32_t cols, const float *s)
{
    kc_pdl_wait();
    kc_pdl_release();
    for (uint32_t r = blockIdx.x; r < rows; r += gridDim.x)
        for (uint32_t c = threadIdx.x; c < cols; c += blockDim.x) {
            __half *p = w + (size_t)r * cols + c;
            *p = __float2half_rn(__half2float(*p) * s[c]);
        }
}

td_status_t kc_weight_scale_cols(kern_backend_t *b, kern_weight_t *w, const float *s, bool apply, bool *fits)
{
    kc_bind(b);
    kern_cuda_t *c = (kern_cuda_t *)b;
    if (!w->priv || !s)
        return td_error(TD_ERR_INVALID_ARG, "cuda: weight_scale_cols: %s",
                        !w->priv ? "the weight is not prepared" : "no scales");
    if (w->hold == KERN_TYPE_F8_E4M3) { // its codes would need quantizing again: the norm stays apart
        *fits = false;
        return TD_OK;
    }
    __half *d = (__half *)w->priv;
    const unsigned blocks = (unsigned)(c->sms * 8 < (int)w->rows ? c->sms * 8 : (int)w->rows);
    unsigned *dmax;
    CU(cudaMalloc(&dmax, sizeof *dmax));
    unsigned bits = 0;
    td_status_t rc = TD_OK;
    cudaError_t e = cudaMemsetAsync(dmax, 0, sizeof *dmax, c->stream);
    if (e == cudaSuccess && !(rc = kc_launch(c, "scaled_max", k_scaled_max, blocks, 256, 0, (const __half *)d, w->rows,
                                             w->cols, s, dmax))) {
        e = cudaMemcpyAsync(&bits, dmax, sizeof bits, cudaMemcpyDeviceToHost, c->stream);
        if (e == cudaSuccess)
            e = cudaStreamSynchronize(c->stream);
    }
    cudaFree(dmax);
    if (rc)
        return rc;
    if (e != cudaSuccess)
        return td_error(TD_ERR_INTERNAL, "cuda: weight_scale_cols: %s", cudaGetErrorString(e));
    float max;
    memcpy(&max, &bits, sizeof max);
    *fits = max <= 65504.0f; // fp16's largest
    if (!apply || !*fits)
        return TD_OK;
    return kc_launch(c, "scale_cols", k_scale_cols, blocks, 256, 0, d, w->rows, w->cols, s);
}
