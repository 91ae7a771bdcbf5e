// matmul.cu — y[n][rows] = x[n][cols] · Wᵀ with W held as fp16 rows on the
// device (backend_cuda.cu's weight_prepare): the activations are converted to
// fp16 and cuBLAS multiplies with fp32 accumulation and fp32 output.
#include "kernels/cuda/cuda_int.h"
#include "kernels/quant.h"

__global__ void k_to_half(const float *x, __half *y, size_t n)
{
    kc_pdl_wait();
    kc_pdl_release();
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n)
        y[i] = __float2half_rn(x[i]);
}

td_status_t kc_to_half(kern_cuda_t *c, const float *x, __half *y, size_t n)
{
    if (!n)
        return TD_OK;
    return kc_launch(c, "to_half", k_to_half, kc_blocks(n, 256), 256, 0, x, y, n);
}

td_status_t kc_scratch(kern_cuda_t *c, kc_scratch_t *sc, size_t bytes)
{
    if (bytes <= sc->cap)
        return TD_OK;
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    cudaStreamIsCapturing(c->stream, &cs);
    if (cs != cudaStreamCaptureStatusNone) // a recording cannot wait; the step runs uncaptured first
        return td_error(TD_ERR_UNSUPPORTED, "cuda: scratch must grow to %zu bytes while a step is captured", bytes);
    CU(cudaStreamSynchronize(c->stream)); // the old scratch may still be read
    if (sc != &c->dg)
        kc_graphs_drop(c); // and captured steps hold its address
    cudaFree(sc->p);
    sc->p = NULL;
    sc->cap = 0;
    CU(cudaMalloc(&sc->p, bytes));
    sc->cap = bytes;
    return TD_OK;
}

td_status_t kc_gemm(kern_cuda_t *c, const kern_weight_t *w, float *y, uint32_t n, bool accumulate)
{
    const void *a = w->priv;
    if (w->hold == KERN_TYPE_F8_E4M3) { // its fp16 copy (matmul_fp8.cu)
        td_status_t rc = kc_fp8_half(c, w, (const __half **)&a);
        if (rc)
            return rc;
    }
    return kc_gemm_rows(c, (const __half *)a, w->rows, w->cols, y, w->rows, n, accumulate);
}

static td_status_t gemm_to(kern_cuda_t *c, const __half *a, uint32_t rows, uint32_t cols, void *y, cudaDataType_t yt,
                           uint32_t ldy, uint32_t n, bool accumulate)
{
    // cuBLAS is column-major: row-major y[n][ldy] is Y (rows x n, ld ldy);
    // row-major W[rows][cols] is A (cols x rows, ld cols) and x[n][cols] is
    // B (cols x n, ld cols); so Y = Aᵀ · B.
    const float one = 1.0f, beta = accumulate ? 1.0f : 0.0f;
    cublasStatus_t s = c->blas_api->gemm_ex(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)rows, (int)n, (int)cols, &one, a,
                                            CUDA_R_16F, (int)cols, c->xh.p, CUDA_R_16F, (int)cols, &beta, y, yt,
                                            (int)ldy, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    if (s != CUBLAS_STATUS_SUCCESS)
        return td_error(TD_ERR_INTERNAL, "cuda: cublasGemmEx (%u x %u x %u) failed: status %d", rows, n, cols,
                        (int)s);
    return TD_OK;
}

td_status_t kc_gemm_rows(kern_cuda_t *c, const __half *a, uint32_t rows, uint32_t cols, float *y, uint32_t ldy,
                         uint32_t n, bool accumulate)
{
    return gemm_to(c, a, rows, cols, y, CUDA_R_32F, ldy, n, accumulate);
}

td_status_t kc_gemm_rows_half(kern_cuda_t *c, const __half *a, uint32_t rows, uint32_t cols, __half *y, uint32_t n)
{
    return gemm_to(c, a, rows, cols, y, CUDA_R_16F, rows, n, false);
}

td_status_t kc_matmul(kern_backend_t *b, const kern_weight_t *w, const float *x, float *y, uint32_t n)
{
    kc_bind(b);
    kern_cuda_t *c = (kern_cuda_t *)b;
    size_t nx = (size_t)n * w->cols;
    td_status_t rc;
    c->xh_of = NULL;
    c->qkvh_of = c->qh_of = NULL;
    if ((rc = kc_scratch(c, &c->xh, nx * sizeof(__half))) || (rc = kc_to_half(c, x, (__half *)c->xh.p, nx)))
        return rc;
    return kc_gemm(c, w, y, n, false);
}

// Several weights of one width over the same x: the fused matmul with
// nothing fused in (matmul_fused.cu).
td_status_t kc_matmul_multi(kern_backend_t *b, const kern_weight_t *const *w, float *const *y, uint32_t k,
                            const float *x, uint32_t n)
{
    const kern_matmul_spec_t s = {.w = w, .y = y, .k = k, .x = x, .n = n};
    return kc_matmul_fused(b, &s);
}
