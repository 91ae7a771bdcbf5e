// matmul_fp8.cu — matrices held in FP8 E4M3 with a scale per row
// (kernels/backend.h's kern_weight_t.hold): their preparation, the GEMV a
// batch-1 step takes, and the fp16 copy the GEMMs of more rows take.
//
// Held form: one device buffer, the codes [rows][cols] (one byte a value),
// then from the next 256-byte boundary the rows' scales (fp32). A matrix from
// another type is decoded on the GPU (dequant.cu) and each row quantized by
// one block: amax, scale = amax / 448, code = fp8(x / scale) rounded to
// nearest even and saturated — kern_fp8_quantize_row's arithmetic, so the
// codes equal the CPU's (tests/cuda/check.c compares them byte for byte).
//
// The GEMV (k_gemv_f8) is matmul_fused.cu's k_gemv_cols with a byte a value:
// a block of W warps takes a unit of rows at a time, the warps split the
// columns in chunks of 512 (a lane's 16-byte load is 16 values), each lane
// keeps its chunks of x in registers (read once, the norm applied once), the
// next unit's loads are issued before this one is used, the warps' sums meet
// in shared memory and each row's sum is multiplied by its scale (and the
// norm's) when written. A unit is 4 rows (2 of gate/up's output rows with
// glu) of a matrix up to 4096 wide, else 2 (1), so that a unit moves as many
// bytes as the fp16 kernel's.
//
// More rows take cuBLAS: the matrix is expanded to fp16 (code times scale)
// into scratch, then matmul.cu's GEMM. That reads 3 bytes a value more than
// the fp16 path and is kept for prefill, where the GEMM's FLOPs dominate.
#include <cuda_fp8.h>

#include "kernels/cuda/backend_cuda.h"
#include "kernels/cuda/cuda_int.h"
#include "kernels/cuda/dequant.h"
#include "kernels/quant.h"

#define F8_MAXK 4
#define F8_A_COLS 4096  // shape A: W 8, CMAX 1
#define F8_B_COLS 16384 // shape B: W 16, CMAX 2

size_t kc_fp8_scales_at(const kern_weight_t *w) { return ((size_t)w->rows * w->cols + 255) & ~(size_t)255; }

static inline const uint8_t *f8_codes(const kern_weight_t *w) { return (const uint8_t *)w->priv; }

const float *kc_fp8_scales(const kern_cuda_t *c, const kern_weight_t *w)
{
    const char *p = (const char *)w->priv;
    for (uint32_t i = 0; i < c->n_joins; i++) {
        const kc_join_t *j = &c->joins[i];
        if (j->f8_rows && p >= j->base && p < j->base + j->bytes) // joined: the scales after every part's codes
            return (const float *)(j->base + (((size_t)j->f8_rows * w->cols + 255) & ~(size_t)255)) +
                   (size_t)(p - j->base) / w->cols;
    }
    return (const float *)(p + kc_fp8_scales_at(w));
}

// ---- preparation ----

// One block a row of x [rows][cols] (fp32, or fp16 widened exactly): the row's scale and codes
// (kern_fp8_quantize_row's arithmetic).
__device__ __forceinline__ float f8_in(float v) { return v; }
__device__ __forceinline__ float f8_in(__half v) { return __half2float(v); }
template <typename T> __global__ void k_fp8_quantize_rows(const T *x, uint32_t cols, uint8_t *q, float *scales)
{
    const T *xr = x + (size_t)blockIdx.x * cols;
    __shared__ float part[256];
    float m = 0;
    for (uint32_t i = threadIdx.x; i < cols; i += blockDim.x)
        m = fmaxf(m, fabsf(f8_in(xr[i])));
    part[threadIdx.x] = m;
    __syncthreads();
    for (unsigned k = blockDim.x / 2; k > 0; k /= 2) {
        if (threadIdx.x < k)
            part[threadIdx.x] = fmaxf(part[threadIdx.x], part[threadIdx.x + k]);
        __syncthreads();
    }
    const float s = part[0] > 0 ? __fdiv_rn(part[0], 448.0f) : 1.0f;
    uint8_t *qr = q + (size_t)blockIdx.x * cols;
    for (uint32_t i = threadIdx.x; i < cols; i += blockDim.x)
        qr[i] = (uint8_t)__nv_cvt_float_to_fp8(__fdiv_rn(f8_in(xr[i]), s), __NV_SATFINITE, __NV_E4M3);
    if (threadIdx.x == 0)
        scales[blockIdx.x] = s;
}

static bool f8_gpu_decodes(uint32_t type)
{
    return type == KERN_TYPE_F32 || type == KERN_TYPE_F16 || type == KERN_TYPE_BF16 || type == KERN_TYPE_Q4_0 ||
           type == KERN_TYPE_Q4_1 || type == KERN_TYPE_Q8_0;
}

// Codes and scales made on the host (kern_weight_fp8_row), row by row: an FP8 file's, or a type the GPU does not
// decode.
static td_status_t f8_from_host(kern_cuda_t *c, const kern_weight_t *w, uint8_t *buf)
{
    uint8_t *q = (uint8_t *)malloc((size_t)w->rows * w->cols);
    float *s = (float *)malloc((size_t)w->rows * sizeof *s), *tmp = (float *)malloc((size_t)w->cols * sizeof *tmp);
    td_status_t rc = q && s && tmp ? TD_OK : td_error(TD_ERR_NO_MEMORY, "cuda: no host memory for an FP8 matrix");
    for (uint32_t r = 0; r < w->rows && !rc; r++)
        rc = kern_weight_fp8_row(w, r, q + (size_t)r * w->cols, &s[r], tmp);
    cudaError_t e = cudaSuccess;
    if (!rc && ((e = cudaMemcpy(buf, q, (size_t)w->rows * w->cols, cudaMemcpyHostToDevice)) != cudaSuccess ||
                (e = cudaMemcpy(buf + kc_fp8_scales_at(w), s, (size_t)w->rows * 4, cudaMemcpyHostToDevice)) !=
                    cudaSuccess))
        rc = td_error(TD_ERR_INTERNAL, "cuda: FP8 weight upload failed: %s", cudaGetErrorString(e));
    free(q);
    free(s);
    free(tmp);
    return rc;
}

// Decoded on the GPU in slices of rows, each quantized there.
static td_status_t f8_on_gpu(kern_cuda_t *c, const kern_weight_t *w, uint8_t *buf)
{
    const kern_type_info_t *info = kern_type_info(w->type);
    const size_t rb = kern_type_row_bytes(info, w->cols), raw_bytes = rb * w->rows;
    size_t slice = ((size_t)8 << 20) / w->cols + 1;
    if (slice > w->rows)
        slice = w->rows;
    void *raw = NULL;
    float *f = NULL;
    cudaError_t e = cudaMalloc(&raw, raw_bytes);
    if (e == cudaSuccess)
        e = cudaMalloc(&f, slice * w->cols * 4);
    if (e == cudaSuccess)
        e = cudaMemcpyAsync(raw, w->data, raw_bytes, cudaMemcpyHostToDevice, c->stream);
    td_status_t rc = e == cudaSuccess ? TD_OK : td_error(TD_ERR_INTERNAL, "cuda: FP8 weight upload failed: %s",
                                                          cudaGetErrorString(e));
    float *scales = (float *)(buf + kc_fp8_scales_at(w));
    for (size_t r0 = 0; r0 < w->rows && !rc; r0 += slice) {
        const size_t nr = w->rows - r0 < slice ? w->rows - r0 : slice;
        rc = kern_cuda_dequant(w->type, (const uint8_t *)raw + r0 * rb, f, nr * w->cols, c->stream);
        if (rc) {
            rc = td_error(rc, "cuda: decoding a %s weight failed", info->name);
            break;
        }
        k_fp8_quantize_rows<float><<<(unsigned)nr, 256, 0, c->stream>>>(f, w->cols, buf + r0 * w->cols, scales + r0);
        rc = kc_launched("fp8_quantize_rows");
    }
    if (!rc && (e = cudaStreamSynchronize(c->stream)) != cudaSuccess)
        rc = td_error(TD_ERR_INTERNAL, "cuda: FP8 weight conversion failed: %s", cudaGetErrorString(e));
    cudaFree(raw);
    cudaFree(f);
    return rc;
}

// A matrix without a file: filled in fp16 (kc_fill), then quantized as any other.
static td_status_t f8_filled(kern_cuda_t *c, const kern_weight_t *w, uint8_t *buf)
{
    __half *h = NULL;
    cudaError_t e = cudaMalloc(&h, (size_t)w->rows * w->cols * sizeof *h);
    if (e != cudaSuccess)
        return td_error(TD_ERR_NO_MEMORY, "cuda: no device memory to fill a %ux%u matrix: %s", w->rows, w->cols,
                        cudaGetErrorString(e));
    td_status_t rc = kc_fill(c, w, h);
    if (!rc) {
        k_fp8_quantize_rows<__half><<<w->rows, 256, 0, c->stream>>>(h, w->cols, buf,
                                                                    (float *)(buf + kc_fp8_scales_at(w)));
        rc = kc_launched("fp8_quantize_rows");
    }
    if (!rc && (e = cudaStreamSynchronize(c->stream)) != cudaSuccess)
        rc = td_error(TD_ERR_INTERNAL, "cuda: FP8 weight conversion failed: %s", cudaGetErrorString(e));
    cudaFree(h);
    return rc;
}

td_status_t kc_fp8_prepare(kern_cuda_t *c, kern_weight_t *w)
{
    if (w->cols % 16)
        return td_error(TD_ERR_UNSUPPORTED, "cuda: an FP8 matrix of %u columns (a multiple of 16 is held)", w->cols);
    uint8_t *buf = NULL;
    const size_t bytes = kc_fp8_scales_at(w) + (size_t)w->rows * 4;
    cudaError_t e = cudaMalloc(&buf, bytes);
    if (e != cudaSuccess)
        return td_error(e == cudaErrorMemoryAllocation ? TD_ERR_NO_MEMORY : TD_ERR_INTERNAL,
                        "cuda: cannot allocate %zu bytes for an FP8 matrix: %s", bytes, cudaGetErrorString(e));
    td_status_t rc = !w->data && w->type == KERN_TYPE_F16                  ? f8_filled(c, w, buf)
                     : w->type != KERN_TYPE_F8_E4M3 && f8_gpu_decodes(w->type) ? f8_on_gpu(c, w, buf)
                                                                               : f8_from_host(c, w, buf);
    if (rc) {
        cudaFree(buf);
        return rc;
    }
    w->priv = buf;
    w->hold = KERN_TYPE_F8_E4M3;
    return TD_OK;
}

extern "C" td_status_t kern_cuda_fp8_download(kern_backend_t *b, const kern_weight_t *w, uint8_t *codes, float *scales)
{
    kc_bind(b);
    if (w->hold != KERN_TYPE_F8_E4M3 || !w->priv)
        return td_error(TD_ERR_INVALID_ARG, "cuda: the matrix is not held in FP8");
    CU(cudaMemcpy(codes, f8_codes(w), (size_t)w->rows * w->cols, cudaMemcpyDeviceToHost));
    CU(cudaMemcpy(scales, kc_fp8_scales((const kern_cuda_t *)b, w), (size_t)w->rows * 4, cudaMemcpyDeviceToHost));
    return TD_OK;
}

// ---- the fp16 copy for the GEMMs ----

// 8 codes a thread: y = code * its row's scale, rounded to fp16.
__global__ void k_fp8_to_half(const uint8_t *q, const float *scales, uint32_t cols, size_t n8, __half *y)
{
    kc_pdl_wait();
    kc_pdl_release();
    const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= n8)
        return;
    const float s = scales[i * 8 / cols];
    const uint2 v = *(const uint2 *)(q + i * 8);
    const __nv_fp8x2_storage_t *p = (const __nv_fp8x2_storage_t *)&v;
    __half2 out[4];
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const float2 f = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(p[k], __NV_E4M3)));
        out[k] = __floats2half2_rn(f.x * s, f.y * s);
    }
    *(uint4 *)(y + i * 8) = *(const uint4 *)out;
}

td_status_t kc_fp8_half(kern_cuda_t *c, const kern_weight_t *w, const __half **out)
{
    const size_t n = (size_t)w->rows * w->cols;
    td_status_t rc = kc_scratch(c, &c->wh, n * sizeof(__half));
    if (!rc)
        rc = kc_launch(c, "fp8_to_half", k_fp8_to_half, kc_blocks(n / 8, 256), 256, 0, f8_codes(w), kc_fp8_scales(c, w),
                       w->cols, n / 8, (__half *)c->wh.p);
    *out = (const __half *)c->wh.p;
    return rc;
}

// ---- the GEMV ----

typedef struct f8_args {
    const uint8_t *w[F8_MAXK];
    const float *s[F8_MAXK];
    float *y[F8_MAXK];
    uint32_t end[F8_MAXK]; // the rows of weights 0 .. i together
    uint32_t k, cols, units, total;
    const float *x, *norm;
    float eps;
    int acc;
} f8_args_t;

// Row g of the weights' row space (glu: of weight `which`'s): its codes, its scale's and its result's place;
// *live false past the rows (then row 0's codes, read and not used).
__device__ __forceinline__ void f8_row(const f8_args_t &a, int glu, uint32_t which, uint32_t g, const uint8_t **w,
                                       const float **s, float **y, bool *live)
{
    const uint8_t *wp = a.w[0];
    const float *sp = a.s[0];
    float *yp = a.y[0];
    uint32_t lo = 0, hi = a.total;
    if (glu) {
        if (which)
            wp = a.w[1], sp = a.s[1];
        hi = a.end[0];
    } else {
#pragma unroll
        for (int j = 1; j < F8_MAXK; j++)
            if ((uint32_t)j < a.k && g >= a.end[j - 1])
                wp = a.w[j], sp = a.s[j], yp = a.y[j], lo = a.end[j - 1];
    }
    *live = g < hi;
    const uint32_t r = *live ? g - lo : 0;
    *w = wp + (size_t)r * a.cols;
    *s = sp + r;
    *y = yp + r;
}

// The unit's R weight rows: U output rows; with glu rows r < U are W0's, the rest W1's of the same output rows.
template <int U, int GLU, int W, int CMAX>
__device__ __forceinline__ void f8_load(uint4 (&wv)[GLU ? 2 * U : U][CMAX], const f8_args_t &a, uint32_t unit,
                                        uint32_t warp, uint32_t lane, uint32_t nch)
{
    constexpr int R = GLU ? 2 * U : U;
#pragma unroll
    for (int r = 0; r < R; r++) {
        const uint8_t *w;
        const float *s;
        float *y;
        bool live;
        f8_row(a, GLU, r >= U, unit * U + (r % U), &w, &s, &y, &live);
#pragma unroll
        for (int c = 0; c < CMAX; c++) {
            const uint32_t ch = warp + c * W, col = ch * 512 + lane * 16;
            if (live && ch < nch && col < a.cols)
                asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                             : "=r"(wv[r][c].x), "=r"(wv[r][c].y), "=r"(wv[r][c].z), "=r"(wv[r][c].w)
                             : "l"(w + col));
            else
                wv[r][c] = make_uint4(0, 0, 0, 0);
        }
    }
}

// 16 codes against 16 values of x
__device__ __forceinline__ float f8_dot16(uint4 w, const float (&x)[16])
{
    const __nv_fp8x2_storage_t *p = (const __nv_fp8x2_storage_t *)&w;
    float acc = 0;
#pragma unroll
    for (int k = 0; k < 8; k++) {
        const float2 f = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(p[k], __NV_E4M3)));
        acc = fmaf(f.x, x[2 * k], acc);
        acc = fmaf(f.y, x[2 * k + 1], acc);
    }
    return acc;
}

template <int U, int GLU, int W, int CMAX, int NM>
__global__ void __launch_bounds__(W * 32, 1024 / (W * 32)) k_gemv_f8(const f8_args_t a)
{
    constexpr int R = GLU ? 2 * U : U;
    const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5, cols = a.cols, nch = (cols + 511) / 512;
    __shared__ float part[2][R][W], ssw[W];
    uint32_t unit = blockIdx.x;
    uint4 wv[R][CMAX];
    f8_load<U, GLU, W, CMAX>(wv, a, unit, warp, lane, nch); // weights only before the wait (cuda_int.h)
    kc_pdl_wait();
    float xs[CMAX][16];
    float ss = 0;
#pragma unroll
    for (int c = 0; c < CMAX; c++) {
        const uint32_t ch = warp + c * W, col = ch * 512 + lane * 16;
        const bool in = ch < nch && col < cols;
#pragma unroll
        for (int q = 0; q < 4; q++) {
            float4 v = in ? __ldg((const float4 *)(a.x + col) + q) : make_float4(0, 0, 0, 0);
            if (NM)
                ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
            if (NM == 2 && in) {
                const float4 g = __ldg((const float4 *)(a.norm + col) + q);
                v.x *= g.x, v.y *= g.y, v.z *= g.z, v.w *= g.w;
            }
            xs[c][4 * q] = v.x, xs[c][4 * q + 1] = v.y, xs[c][4 * q + 2] = v.z, xs[c][4 * q + 3] = v.w;
        }
    }
    float nscale = 1.0f;
    if (NM) {
        ss = kc_warp_sum(ss);
        if (lane == 0)
            ssw[warp] = ss;
        __syncthreads();
        float t = 0;
#pragma unroll
        for (int i = 0; i < W; i++)
            t += ssw[i];
        nscale = rsqrtf(t / cols + a.eps);
    }
    for (int buf = 0; unit < a.units; unit += gridDim.x, buf ^= 1) {
        uint4 nx[R][CMAX];
        f8_load<U, GLU, W, CMAX>(nx, a, unit + gridDim.x, warp, lane, nch);
        float acc[R];
#pragma unroll
        for (int r = 0; r < R; r++) {
            acc[r] = 0;
#pragma unroll
            for (int c = 0; c < CMAX; c++)
                acc[r] += f8_dot16(wv[r][c], xs[c]);
            acc[r] = kc_warp_sum(acc[r]);
            if (lane == 0)
                part[buf][r][warp] = acc[r];
        }
        __syncthreads();
        if (threadIdx.x < U) { // thread t writes the unit's output row t
            const uint32_t t = threadIdx.x;
            const uint8_t *w;
            const float *s;
            float *y;
            bool live;
            f8_row(a, GLU, 0, unit * U + t, &w, &s, &y, &live);
            if (live) {
                float v = 0;
#pragma unroll
                for (int i = 0; i < W; i++)
                    v += part[buf][t][i];
                v *= *s * nscale;
                if (GLU) {
                    const float *s1;
                    float *y1;
                    f8_row(a, GLU, 1, unit * U + t, &w, &s1, &y1, &live);
                    float u = 0;
#pragma unroll
                    for (int i = 0; i < W; i++)
                        u += part[buf][U + t][i];
                    *y = kc_silu_mul(v, u * *s1 * nscale);
                } else {
                    *y = a.acc ? *y + v : v;
                }
            }
        }
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int c = 0; c < CMAX; c++)
                wv[r][c] = nx[r][c];
    }
    kc_pdl_release();
}

typedef void (*f8_kernel_t)(f8_args_t);
// [shape A, B][glu][norm]
static const f8_kernel_t f8_kernels[2][2][3] = {
    {{k_gemv_f8<4, 0, 8, 1, 0>, k_gemv_f8<4, 0, 8, 1, 1>, k_gemv_f8<4, 0, 8, 1, 2>},
     {k_gemv_f8<2, 1, 8, 1, 0>, k_gemv_f8<2, 1, 8, 1, 1>, k_gemv_f8<2, 1, 8, 1, 2>}},
    {{k_gemv_f8<2, 0, 16, 2, 0>, k_gemv_f8<2, 0, 16, 2, 1>, k_gemv_f8<2, 0, 16, 2, 2>},
     {k_gemv_f8<1, 1, 16, 2, 0>, k_gemv_f8<1, 1, 16, 2, 1>, k_gemv_f8<1, 1, 16, 2, 2>}},
};

bool kc_fp8_gemv_takes(const kern_matmul_spec_t *s)
{
    return s->n == 1 && s->w[0]->cols <= F8_B_COLS && s->w[0]->cols % 16 == 0;
}

td_status_t kc_fp8_gemv(kern_cuda_t *c, const kern_matmul_spec_t *s)
{
    f8_args_t a = {};
    uint32_t total = 0;
    for (uint32_t i = 0; i < s->k; i++) {
        if (s->w[i]->hold != KERN_TYPE_F8_E4M3)
            return td_error(TD_ERR_INVALID_ARG, "cuda: matmul_fused: FP8 and other matrices in one call");
        a.w[i] = f8_codes(s->w[i]);
        a.s[i] = kc_fp8_scales(c, s->w[i]);
        a.y[i] = s->y[i];
        a.end[i] = total += s->w[i]->rows;
    }
    a.k = s->k;
    a.total = total;
    a.cols = s->w[0]->cols;
    a.x = s->x;
    a.norm = s->norm;
    a.eps = s->eps;
    a.acc = s->accumulate;
    const int shape = a.cols <= F8_A_COLS ? 0 : 1, glu = s->glu ? 1 : 0, nm = !s->norm ? 0 : s->norm_in_w ? 1 : 2;
    const unsigned u = shape == 0 ? (glu ? 2 : 4) : (glu ? 1 : 2), warps = shape == 0 ? 8 : 16;
    a.units = ((glu ? s->w[0]->rows : total) + u - 1) / u;
    const unsigned held = c->f8_grid[shape][glu], grid = a.units < held ? a.units : held;
    return kc_launch(c, "gemv_f8", f8_kernels[shape][glu][nm], grid, warps * 32, 0, a);
}

td_status_t kc_fp8_init(kern_cuda_t *c)
{
    for (int sh = 0; sh < 2; sh++)
        for (int g = 0; g < 2; g++) {
            int per_sm = 0;
            CU(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, f8_kernels[sh][g][2], sh == 0 ? 256 : 512, 0));
            c->f8_grid[sh][g] = (unsigned)(per_sm > 0 ? per_sm : 1) * (unsigned)c->sms;
        }
    return TD_OK;
}
