// backend_cuda.cu — the CUDA backend: device memory, one stream, cuBLAS.
//
// Weights: weight_prepare decodes the file's format on the host (the CPU
// decoders, exact) and uploads fp16 rows; matmul converts the activations to
// fp16 and runs cublasGemmEx with fp32 accumulation and fp32 output.
// Elementwise ops are one thread per value (RMSNorm: one block per row with a
// shared-memory reduction).
#include <cublas_v2.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "kernels/cuda/backend_cuda.h"
#include "kernels/quant.h"

typedef struct kern_cuda {
    kern_backend_t base;
    int device;
    cudaStream_t stream;
    cublasHandle_t blas;
    __half *xh;        // fp16 activations scratch
    size_t xh_cap;
} kern_cuda_t;

#define CU(call)                                                                                          \
    do {                                                                                                  \
        cudaError_t e_ = (call);                                                                          \
        if (e_ != cudaSuccess)                                                                            \
            return td_error(TD_ERR_INTERNAL, "cuda: %s failed: %s", #call, cudaGetErrorString(e_));        \
    } while (0)

static td_status_t cu_alloc(kern_backend_t *b, size_t bytes, void **ptr)
{
    (void)b;
    CU(cudaMalloc(ptr, bytes ? bytes : 64));
    return TD_OK;
}

static void cu_free(kern_backend_t *b, void *ptr)
{
    (void)b;
    cudaFree(ptr);
}

static td_status_t cu_upload(kern_backend_t *b, void *dst, const void *src, size_t n)
{
    CU(cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, ((kern_cuda_t *)b)->stream));
    return TD_OK;
}

static td_status_t cu_download(kern_backend_t *b, void *dst, const void *src, size_t n)
{
    kern_cuda_t *c = (kern_cuda_t *)b;
    CU(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToHost, c->stream));
    CU(cudaStreamSynchronize(c->stream));
    return TD_OK;
}

static td_status_t cu_copy(kern_backend_t *b, void *dst, const void *src, size_t n)
{
    CU(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, ((kern_cuda_t *)b)->stream));
    return TD_OK;
}

static td_status_t cu_sync(kern_backend_t *b)
{
    CU(cudaStreamSynchronize(((kern_cuda_t *)b)->stream));
    return TD_OK;
}

// Decodes every row on the host and uploads them as fp16.
static td_status_t cu_weight_prepare(kern_backend_t *b, kern_weight_t *w)
{
    const kern_type_info_t *info = kern_type_info(w->type);
    size_t n = (size_t)w->rows * w->cols, rb = kern_type_row_bytes(info, w->cols);
    float *row = (float *)malloc(w->cols * sizeof(float));
    __half *h = (__half *)malloc(n * sizeof(__half));
    if (!row || !h) {
        free(row);
        free(h);
        return td_error(TD_ERR_NO_MEMORY, "cuda: no host memory to convert a %ux%u matrix", w->rows, w->cols);
    }
    for (uint32_t r = 0; r < w->rows; r++) {
        kern_dequant_row(w->type, (const uint8_t *)w->data + r * rb, row, w->cols);
        for (uint32_t k = 0; k < w->cols; k++)
            h[(size_t)r * w->cols + k] = __float2half_rn(row[k]);
    }
    free(row);
    td_status_t rc = cu_alloc(b, n * sizeof(__half), &w->priv);
    if (!rc) {
        cudaError_t e = cudaMemcpy(w->priv, h, n * sizeof(__half), cudaMemcpyHostToDevice);
        if (e != cudaSuccess)
            rc = td_error(TD_ERR_INTERNAL, "cuda: weight upload failed: %s", cudaGetErrorString(e));
    }
    free(h);
    return rc;
}

static void cu_weight_release(kern_backend_t *b, kern_weight_t *w)
{
    cu_free(b, w->priv);
    w->priv = NULL;
}

__global__ void k_to_half(const float *x, __half *y, size_t n)
{
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n)
        y[i] = __float2half_rn(x[i]);
}

static unsigned blocks_for(size_t n, unsigned t) { return (unsigned)((n + t - 1) / t); }

static td_status_t cu_matmul(kern_backend_t *b, const kern_weight_t *w, const float *x, float *y, uint32_t n)
{
    kern_cuda_t *c = (kern_cuda_t *)b;
    size_t nx = (size_t)n * w->cols;
    if (nx > c->xh_cap) {
        cudaFree(c->xh);
        c->xh = NULL;
        CU(cudaMalloc((void **)&c->xh, nx * sizeof(__half)));
        c->xh_cap = nx;
    }
    k_to_half<<<blocks_for(nx, 256), 256, 0, c->stream>>>(x, c->xh, nx);
    // cuBLAS is column-major: row-major y[n][rows] is Y (rows x n, ld rows);
    // row-major W[rows][cols] is A (cols x rows, ld cols) and x[n][cols] is
    // B (cols x n, ld cols); so Y = Aᵀ · B.
    const float one = 1.0f, zero = 0.0f;
    cublasStatus_t s = cublasGemmEx(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)w->rows, (int)n, (int)w->cols, &one,
                                    w->priv, CUDA_R_16F, (int)w->cols, c->xh, CUDA_R_16F, (int)w->cols, &zero, y,
                                    CUDA_R_32F, (int)w->rows, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    if (s != CUBLAS_STATUS_SUCCESS)
        return td_error(TD_ERR_INTERNAL, "cuda: cublasGemmEx (%u x %u x %u) failed: status %d", w->rows, n, w->cols,
                        (int)s);
    return TD_OK;
}

// One block per row: the sum of squares reduced in shared memory (fp32).
__global__ void k_rmsnorm(const float *x, const float *w, float *y, uint32_t dim, float eps)
{
    extern __shared__ float part[];
    const float *xr = x + (size_t)blockIdx.x * dim;
    float *yr = y + (size_t)blockIdx.x * dim;
    float s = 0;
    for (uint32_t i = threadIdx.x; i < dim; i += blockDim.x)
        s += xr[i] * xr[i];
    part[threadIdx.x] = s;
    __syncthreads();
    for (unsigned k = blockDim.x / 2; k > 0; k /= 2) {
        if (threadIdx.x < k)
            part[threadIdx.x] += part[threadIdx.x + k];
        __syncthreads();
    }
    float scale = rsqrtf(part[0] / dim + eps);
    for (uint32_t i = threadIdx.x; i < dim; i += blockDim.x)
        yr[i] = xr[i] * scale * w[i];
}

static td_status_t cu_rmsnorm(kern_backend_t *b, const float *x, const float *w, float *y, uint32_t n, uint32_t dim,
                              float eps)
{
    kern_cuda_t *c = (kern_cuda_t *)b;
    k_rmsnorm<<<n, 256, 256 * sizeof(float), c->stream>>>(x, w, y, dim, eps);
    CU(cudaGetLastError());
    return TD_OK;
}

// One thread per rotated pair.
__global__ void k_rope(float *x, uint32_t n, uint32_t heads, uint32_t hd, const int32_t *pos, const float *freq,
                       int neox)
{
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    uint32_t half = hd / 2;
    if (i >= (size_t)n * heads * half)
        return;
    uint32_t p = (uint32_t)(i % half);
    size_t th = i / half;
    uint32_t t = (uint32_t)(th / heads);
    float *v = x + th * hd;
    float s, c;
    sincosf((float)pos[t] * freq[p], &s, &c);
    uint32_t a = neox ? p : 2 * p, b = neox ? p + half : 2 * p + 1;
    float x0 = v[a], x1 = v[b];
    v[a] = x0 * c - x1 * s;
    v[b] = x0 * s + x1 * c;
}

static td_status_t cu_rope(kern_backend_t *b, float *x, uint32_t n, uint32_t heads, uint32_t hd, const int32_t *pos,
                           const float *freq, kern_rope_style_t style)
{
    kern_cuda_t *c = (kern_cuda_t *)b;
    size_t pairs = (size_t)n * heads * (hd / 2);
    k_rope<<<blocks_for(pairs, 256), 256, 0, c->stream>>>(x, n, heads, hd, pos, freq, style == KERN_ROPE_NEOX);
    CU(cudaGetLastError());
    return TD_OK;
}

__global__ void k_swiglu(const float *g, const float *u, float *y, size_t n)
{
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n)
        y[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

static td_status_t cu_swiglu(kern_backend_t *b, const float *g, const float *u, float *y, size_t n)
{
    k_swiglu<<<blocks_for(n, 256), 256, 0, ((kern_cuda_t *)b)->stream>>>(g, u, y, n);
    CU(cudaGetLastError());
    return TD_OK;
}

__global__ void k_add(float *x, const float *y, size_t n)
{
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n)
        x[i] += y[i];
}

static td_status_t cu_add(kern_backend_t *b, float *x, const float *y, size_t n)
{
    k_add<<<blocks_for(n, 256), 256, 0, ((kern_cuda_t *)b)->stream>>>(x, y, n);
    CU(cudaGetLastError());
    return TD_OK;
}

// The ops this backend does not have yet: a clear error, never a NULL entry.
static td_status_t cu_matmul_multi(kern_backend_t *, const kern_weight_t *const *, float *const *, uint32_t,
                                   const float *, uint32_t)
{
    return td_error(TD_ERR_UNSUPPORTED, "cuda: matmul_multi is not implemented yet");
}

static td_status_t cu_embed(kern_backend_t *, const kern_weight_t *, const int32_t *, uint32_t, float *)
{
    return td_error(TD_ERR_UNSUPPORTED, "cuda: embed is not implemented yet");
}

static td_status_t cu_kv_store(kern_backend_t *, const kern_kv_view_t *, const float *, const float *,
                               const int32_t *, uint32_t)
{
    return td_error(TD_ERR_UNSUPPORTED, "cuda: kv_store is not implemented yet");
}

static td_status_t cu_attention(kern_backend_t *, const kern_kv_view_t *, const float *, float *, uint32_t,
                                const kern_attn_seq_t *, uint32_t, float)
{
    return td_error(TD_ERR_UNSUPPORTED, "cuda: attention is not implemented yet");
}

static const kern_backend_ops_t kern_cuda_ops = {
    .name = "cuda",
    .supported = KERN_OP_MATMUL | KERN_OP_RMSNORM | KERN_OP_ROPE | KERN_OP_SWIGLU | KERN_OP_ADD,
    .destroy = kern_cuda_backend_destroy,
    .alloc = cu_alloc,
    .free = cu_free,
    .upload = cu_upload,
    .download = cu_download,
    .copy = cu_copy,
    .sync = cu_sync,
    .weight_prepare = cu_weight_prepare,
    .weight_release = cu_weight_release,
    .matmul = cu_matmul,
    .matmul_multi = cu_matmul_multi,
    .rmsnorm = cu_rmsnorm,
    .rope = cu_rope,
    .swiglu = cu_swiglu,
    .add = cu_add,
    .embed = cu_embed,
    .kv_store = cu_kv_store,
    .attention = cu_attention,
};

extern "C" td_status_t kern_cuda_backend_create(int device, kern_backend_t **out)
{
    kern_cuda_t *c = (kern_cuda_t *)calloc(1, sizeof *c);
    if (!c)
        return td_error(TD_ERR_NO_MEMORY, "cuda: no memory");
    c->base.ops = &kern_cuda_ops;
    c->device = device;
    cudaError_t e = cudaSetDevice(device);
    if (e == cudaSuccess)
        e = cudaStreamCreate(&c->stream);
    if (e != cudaSuccess) {
        free(c);
        return td_error(TD_ERR_UNSUPPORTED, "cuda: device %d: %s", device, cudaGetErrorString(e));
    }
    if (cublasCreate(&c->blas) != CUBLAS_STATUS_SUCCESS || cublasSetStream(c->blas, c->stream) != CUBLAS_STATUS_SUCCESS) {
        cudaStreamDestroy(c->stream);
        free(c);
        return td_error(TD_ERR_INTERNAL, "cuda: cublasCreate failed");
    }
    *out = &c->base;
    return TD_OK;
}

extern "C" void kern_cuda_backend_destroy(kern_backend_t *b)
{
    kern_cuda_t *c = (kern_cuda_t *)b;
    if (!c)
        return;
    cudaFree(c->xh);
    cublasDestroy(c->blas);
    cudaStreamDestroy(c->stream);
    free(c);
}
