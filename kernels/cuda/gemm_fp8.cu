// gemm_fp8.cu — the fused matmul of more than one row over FP8 matrices on
// the FP8 tensor cores (cuBLASLt, loaded at run time as cuBLAS is): the rows
// of x (normed first where the call asks) are quantized to FP8 with a scale
// a row (amax / 448, as the weights' rows: W8A8 with dynamic per-token
// scales, as vLLM serves FP8 checkpoints on Hopper), cuBLASLt multiplies the
// codes with fp32 accumulation into fp32, and one pass multiplies each result
// by its token's and its row's scales, adding the residual or making SwiGLU's
// product where the call asks. Weights joined at load (Q|K|V, gate|up) are
// one GEMM up to KC_JOIN_MAXN rows, its sums scaled on their way out to each
// weight's rows. A batch-1 step keeps the GEMV and its fp32
// activations (matmul_fp8.cu). Where cuBLASLt is missing or has no algorithm
// for a shape, the caller takes the fp16 copy into cuBLAS instead.
#include <cublasLt.h>
#include <cuda_fp8.h>
#include <dlfcn.h>
#include <pthread.h>

#include "kernels/cuda/cuda_int.h"
#include "kernels/quant.h"

// ---- cuBLASLt, loaded once ----

static struct {
    decltype(&cublasLtCreate) create;
    decltype(&cublasLtDestroy) destroy;
    decltype(&cublasLtMatmulDescCreate) desc_create;
    decltype(&cublasLtMatmulDescDestroy) desc_destroy;
    decltype(&cublasLtMatmulDescSetAttribute) desc_set;
    decltype(&cublasLtMatrixLayoutCreate) layout_create;
    decltype(&cublasLtMatrixLayoutDestroy) layout_destroy;
    decltype(&cublasLtMatmulPreferenceCreate) pref_create;
    decltype(&cublasLtMatmulPreferenceDestroy) pref_destroy;
    decltype(&cublasLtMatmulPreferenceSetAttribute) pref_set;
    decltype(&cublasLtMatmulAlgoGetHeuristic) heuristic;
    decltype(&cublasLtMatmul) matmul;
    bool ok;
} lt;

static void load_lt(void)
{
    void *h = dlopen("libcublasLt.so.13", RTLD_NOW | RTLD_LOCAL);
    if (!h)
        return;
#define LT(f, name) *(void **)&lt.f = dlsym(h, name)
    LT(create, "cublasLtCreate");
    LT(destroy, "cublasLtDestroy");
    LT(desc_create, "cublasLtMatmulDescCreate");
    LT(desc_destroy, "cublasLtMatmulDescDestroy");
    LT(desc_set, "cublasLtMatmulDescSetAttribute");
    LT(layout_create, "cublasLtMatrixLayoutCreate");
    LT(layout_destroy, "cublasLtMatrixLayoutDestroy");
    LT(pref_create, "cublasLtMatmulPreferenceCreate");
    LT(pref_destroy, "cublasLtMatmulPreferenceDestroy");
    LT(pref_set, "cublasLtMatmulPreferenceSetAttribute");
    LT(heuristic, "cublasLtMatmulAlgoGetHeuristic");
    LT(matmul, "cublasLtMatmul");
#undef LT
    lt.ok = lt.create && lt.destroy && lt.desc_create && lt.desc_destroy && lt.desc_set && lt.layout_create &&
            lt.layout_destroy && lt.pref_create && lt.pref_destroy && lt.pref_set && lt.heuristic && lt.matmul;
}

// One shape's plan: D [n][rows] fp32 = X [n][cols] · Wᵀ with both in E4M3 (cuBLASLt's column-major "TN": W is A
// transposed, cols x rows with ld cols; X is B, cols x n; D is rows x n).
#define F8_PLANS 128
typedef struct f8_plan {
    uint32_t rows, n, cols;
    bool ok; // an algorithm was found
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t a, b, d;
    cublasLtMatmulAlgo_t algo;
} f8_plan_t;

struct kc_f8_lt {
    cublasLtHandle_t h;
    f8_plan_t plans[F8_PLANS];
    uint32_t n_plans, next;
};

static void plan_free(f8_plan_t *p)
{
    if (p->desc)
        lt.desc_destroy(p->desc);
    if (p->a)
        lt.layout_destroy(p->a);
    if (p->b)
        lt.layout_destroy(p->b);
    if (p->d)
        lt.layout_destroy(p->d);
    memset(p, 0, sizeof *p);
}

// The plan of a shape, made (and kept, replacing the oldest when full) on first use; NULL: no algorithm
static const f8_plan_t *plan_get(kern_cuda_t *c, uint32_t rows, uint32_t n, uint32_t cols)
{
    kc_f8_lt *L = c->f8_lt;
    for (uint32_t i = 0; i < L->n_plans; i++)
        if (L->plans[i].rows == rows && L->plans[i].n == n && L->plans[i].cols == cols)
            return L->plans[i].ok ? &L->plans[i] : NULL;
    f8_plan_t *p = &L->plans[L->n_plans < F8_PLANS ? L->n_plans++ : L->next++ % F8_PLANS];
    plan_free(p);
    p->rows = rows, p->n = n, p->cols = cols;
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    cublasLtMatmulPreference_t pref = NULL;
    size_t ws = KC_BLAS_WS;
    cublasLtMatmulHeuristicResult_t res = {};
    int found = 0;
    if (lt.desc_create(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F) == CUBLAS_STATUS_SUCCESS &&
        lt.desc_set(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta) == CUBLAS_STATUS_SUCCESS &&
        lt.desc_set(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb) == CUBLAS_STATUS_SUCCESS &&
        lt.layout_create(&p->a, CUDA_R_8F_E4M3, cols, rows, cols) == CUBLAS_STATUS_SUCCESS &&
        lt.layout_create(&p->b, CUDA_R_8F_E4M3, cols, n, cols) == CUBLAS_STATUS_SUCCESS &&
        lt.layout_create(&p->d, CUDA_R_32F, rows, n, rows) == CUBLAS_STATUS_SUCCESS &&
        lt.pref_create(&pref) == CUBLAS_STATUS_SUCCESS &&
        lt.pref_set(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws) == CUBLAS_STATUS_SUCCESS &&
        lt.heuristic(L->h, p->desc, p->a, p->b, p->d, p->d, pref, 1, &res, &found) == CUBLAS_STATUS_SUCCESS &&
        found > 0) {
        p->algo = res.algo;
        p->ok = true;
    }
    if (pref)
        lt.pref_destroy(pref);
    if (!p->ok)
        TD_DEBUG("cuda: cuBLASLt has no FP8 algorithm for %u x %u x %u: the fp16 copy takes it", rows, n, cols);
    return p->ok ? p : NULL;
}

td_status_t kc_fp8_gemm_init(kern_cuda_t *c)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, load_lt);
    if (!lt.ok) {
        TD_INFO("cuda: libcublasLt.so.13 is not loadable: FP8 matrices take an fp16 copy into cuBLAS above one row");
        return TD_OK;
    }
    kc_f8_lt *L = (kc_f8_lt *)calloc(1, sizeof *L);
    if (!L)
        return td_error(TD_ERR_NO_MEMORY, "cuda: no memory");
    if (lt.create(&L->h) != CUBLAS_STATUS_SUCCESS) {
        free(L);
        TD_INFO("cuda: cuBLASLt did not start: FP8 matrices take an fp16 copy into cuBLAS above one row");
        return TD_OK;
    }
    c->f8_lt = L;
    return TD_OK;
}

void kc_fp8_gemm_destroy(kern_cuda_t *c)
{
    kc_f8_lt *L = c->f8_lt;
    if (!L)
        return;
    for (uint32_t i = 0; i < L->n_plans; i++)
        plan_free(&L->plans[i]);
    lt.destroy(L->h);
    free(L);
    c->f8_lt = NULL;
}

// ---- the activations' codes, the results' scales ----

// One block a row of x: norm(x) (NM 0: none; 1: RMS only; 2: with the weight g) quantized as
// kern_fp8_quantize_row quantizes: q [cols] codes, xs its scale.
template <int NM>
__global__ void k_fp8_quantize_x(const float *x, const float *g, uint32_t cols, float eps, uint8_t *q, float *xs)
{
    kc_pdl_wait();
    kc_pdl_release();
    const float *xr = x + (size_t)blockIdx.x * cols;
    const float rs = NM ? kc_row_rms_scale(xr, cols, eps) : 1.0f;
    __shared__ float part[256];
    float m = 0;
    for (uint32_t i = threadIdx.x; i < cols; i += blockDim.x)
        m = fmaxf(m, fabsf(NM == 2 ? xr[i] * rs * g[i] : xr[i] * rs));
    __syncthreads(); // kc_row_rms_scale's shared memory is read before part is written
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
        qr[i] = (uint8_t)__nv_cvt_float_to_fp8(__fdiv_rn(NM == 2 ? xr[i] * rs * g[i] : xr[i] * rs, s),
                                               __NV_SATFINITE, __NV_E4M3);
    if (threadIdx.x == 0)
        xs[blockIdx.x] = s;
}

// y[t][r] (+)= d[t][r] · xs[t] · ws[r]; with glu (d1 set) y = silu(that) · d1[t][r] · xs[t] · ws1[r]; d's and
// d1's rows are ld apart (a joined gate|up product's: 2 x rows)
__global__ void k_fp8_scale(const float *d, const float *d1, float *y, const float *xs, const float *ws,
                            const float *ws1, uint32_t rows, uint32_t ld, size_t total, int acc)
{
    kc_pdl_wait();
    kc_pdl_release();
    const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= total)
        return;
    const uint32_t t = (uint32_t)(i / rows), r = (uint32_t)(i % rows);
    const size_t at = (size_t)t * ld + r;
    float v = d[at] * xs[t] * ws[r];
    if (d1)
        v = kc_silu_mul(v, d1[at] * xs[t] * ws1[r]);
    y[i] = acc ? y[i] + v : v;
}

// Whether s's FP8 weights lie side by side (weights_join), so that one GEMM takes them all, as matmul_fused.cu's
// joined() for fp16: up to KC_JOIN_MAXN rows, nothing added to y
static bool f8_joined(const kern_matmul_spec_t *s)
{
    return s->k >= 2 && s->n <= KC_JOIN_MAXN && !s->accumulate && kc_side_by_side(s, KERN_TYPE_F8_E4M3);
}

td_status_t kc_fp8_matmul(kern_cuda_t *c, const kern_matmul_spec_t *s)
{
    if (!c->f8_lt)
        return TD_ERR_UNSUPPORTED;
    const uint32_t cols = s->w[0]->cols, n = s->n;
    const f8_plan_t *p[4];
    uint32_t total = 0;
    for (uint32_t i = 0; i < s->k; i++)
        total += s->w[i]->rows;
    // joined weights: one GEMM over them all into f8d, then its sums scaled out to y (split, or SwiGLU's product)
    const f8_plan_t *pj = f8_joined(s) ? plan_get(c, total, n, cols) : NULL;
    for (uint32_t i = 0; i < s->k && !pj; i++)
        if (s->w[i]->hold != KERN_TYPE_F8_E4M3 || !(p[i] = plan_get(c, s->w[i]->rows, n, cols)))
            return TD_ERR_UNSUPPORTED; // quietly: the caller takes the fp16 copy
    size_t most = 0;
    for (uint32_t i = 0; i < s->k; i++)
        most = s->w[i]->rows > most ? s->w[i]->rows : most;
    td_status_t rc;
    if ((rc = kc_scratch(c, &c->x8, (size_t)n * cols + 256 + (size_t)n * 4)) ||
        ((s->accumulate || pj) && (rc = kc_scratch(c, &c->f8d, (size_t)n * (pj ? total : most) * 4))))
        return rc;
    uint8_t *xq = (uint8_t *)c->x8.p;
    float *xs = (float *)(xq + (((size_t)n * cols + 255) & ~(size_t)255));
    void (*const qk[3])(const float *, const float *, uint32_t, float, uint8_t *, float *) = {
        k_fp8_quantize_x<0>, k_fp8_quantize_x<1>, k_fp8_quantize_x<2>};
    const int nm = !s->norm ? 0 : s->norm_in_w ? 1 : 2;
    if ((rc = kc_launch(c, "fp8_quantize_x", qk[nm], n, 256, 0, s->x, (const float *)s->norm, cols, s->eps, xq, xs)))
        return rc;
    const float one = 1.0f, zero = 0.0f;
    if (pj) {
        float *d = (float *)c->f8d.p;
        const float *ws = kc_fp8_scales(c, s->w[0]); // every part's, in order (weights_join)
        cublasStatus_t st = lt.matmul(c->f8_lt->h, pj->desc, &one, s->w[0]->priv, pj->a, xq, pj->b, &zero, d, pj->d,
                                      d, pj->d, &pj->algo, c->blas_ws, KC_BLAS_WS, c->stream);
        if (st != CUBLAS_STATUS_SUCCESS)
            return td_error(TD_ERR_INTERNAL, "cuda: cublasLtMatmul FP8 (%u x %u x %u, joined) failed: status %d",
                            total, n, cols, (int)st);
        if (!s->glu)
            return kc_split_rows(c, s, d, xs, ws);
        const uint32_t f = s->w[0]->rows;
        const size_t ny = (size_t)n * f;
        return kc_launch(c, "fp8_scale", k_fp8_scale, kc_blocks(ny, 256), 256, 0, (const float *)d,
                         (const float *)(d + f), s->y[0], (const float *)xs, ws, ws + f, f, total, ny, 0);
    }
    for (uint32_t i = 0; i < s->k && !rc; i++) {
        float *d = s->accumulate ? (float *)c->f8d.p : s->y[i];
        cublasStatus_t st = lt.matmul(c->f8_lt->h, p[i]->desc, &one, s->w[i]->priv, p[i]->a, xq, p[i]->b, &zero, d,
                                      p[i]->d, d, p[i]->d, &p[i]->algo, c->blas_ws, KC_BLAS_WS, c->stream);
        if (st != CUBLAS_STATUS_SUCCESS)
            return td_error(TD_ERR_INTERNAL, "cuda: cublasLtMatmul FP8 (%u x %u x %u) failed: status %d",
                            s->w[i]->rows, n, cols, (int)st);
        if (s->glu)
            continue;
        const size_t ny = (size_t)n * s->w[i]->rows;
        rc = kc_launch(c, "fp8_scale", k_fp8_scale, kc_blocks(ny, 256), 256, 0, (const float *)d, (const float *)NULL,
                       s->y[i], (const float *)xs, kc_fp8_scales(c, s->w[i]), (const float *)NULL, s->w[i]->rows,
                       s->w[i]->rows, ny, (int)s->accumulate);
    }
    if (rc || !s->glu)
        return rc;
    const size_t ny = (size_t)n * s->w[0]->rows;
    return kc_launch(c, "fp8_scale", k_fp8_scale, kc_blocks(ny, 256), 256, 0, (const float *)s->y[0],
                     (const float *)s->y[1], s->y[0], (const float *)xs, kc_fp8_scales(c, s->w[0]),
                     kc_fp8_scales(c, s->w[1]), s->w[0]->rows, s->w[0]->rows, ny, 0);
}
