// gemm_study.cu — how a batched decode step's matmuls should be laid out for cuBLAS on this GPU (issue 51).
// A 7B-shaped layer (Q, K, V, O 4096x4096; gate, up 11008x4096; down 4096x11008), 8 distinct copies of it
// so that no matrix stays in L2 from one round to the next, multiplied by M rows of fp16 activations:
//   separate — one GEMM a matrix, fp32 out (what kernels/cuda/matmul_fused.cu does above one row);
//   joined   — Q|K|V as one 12288-row matrix and gate|up as one 22016-row matrix (weights side by side);
//   joined, fp16 out — the same with fp16 output (half the bytes written);
//   Lt best  — the joined shapes through cuBLASLt, every algorithm its heuristic offers timed, the fastest kept.
// Each variant's time for a layer's matmuls, x32 for a step, against the FLOPs at the measured peak of one big
// GEMM and against the weight bytes at the read bandwidth. Run on a GPU machine: tandem-gemm-study [M...].
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <vector>

#define CK(x)                                                                                                  \
    do {                                                                                                       \
        cudaError_t e_ = (x);                                                                                  \
        if (e_ != cudaSuccess) {                                                                               \
            fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_));                         \
            exit(1);                                                                                           \
        }                                                                                                      \
    } while (0)
#define CB(x)                                                                                                  \
    do {                                                                                                       \
        int s_ = (int)(x);                                                                                     \
        if (s_) {                                                                                              \
            fprintf(stderr, "%s:%d cublas status %d\n", __FILE__, __LINE__, s_);                               \
            exit(1);                                                                                           \
        }                                                                                                      \
    } while (0)

enum { COPIES = 8, H = 4096, F = 11008 };

static cublasHandle_t blas;
static cublasLtHandle_t lt;
static void *ws;
static const size_t WS = 64 << 20;

// y[m][rows] = x[m][cols] · W[rows][cols]ᵀ, cuBLAS column-major as matmul.cu does it
static void gemm(const __half *w, const __half *x, void *y, int rows, int cols, int m, cudaDataType_t yt)
{
    const float one = 1, zero = 0;
    CB(cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, rows, m, cols, &one, w, CUDA_R_16F, cols, x, CUDA_R_16F, cols,
                    &zero, y, yt, rows, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

typedef struct lt_plan {
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t a, b, c;
    cublasLtMatmulAlgo_t algo;
    double ms;
    int tried;
} lt_plan_t;

static double time_ms(void (*fn)(void *, int), void *ctx, int reps)
{
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    for (int i = 0; i < 3; i++)
        fn(ctx, i);
    CK(cudaEventRecord(e0));
    for (int i = 0; i < reps; i++)
        fn(ctx, i);
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    cudaEventDestroy(e0), cudaEventDestroy(e1);
    return ms / reps;
}

typedef struct layer {
    __half *qkv, *o, *gu, *down; // Q|K|V and gate|up side by side: each part is also the separate matrix
} layer_t;

typedef struct run_ctx {
    layer_t *L;
    __half *x, *xf; // x: m x 4096; xf: m x 11008
    void *y;        // big enough for m x 22016 fp32
    int m, variant;
    lt_plan_t *plan; // Lt: qkv, o, gu, down
} run_ctx_t;

static void lt_run(lt_plan_t *p, const __half *w, const __half *x, void *y)
{
    const float one = 1, zero = 0;
    CB(cublasLtMatmul(lt, p->desc, &one, w, p->a, x, p->b, &zero, y, p->c, y, p->c, &p->algo, ws, WS, 0));
}

static void layer_run(void *vc, int i)
{
    run_ctx_t *c = (run_ctx_t *)vc;
    const layer_t *L = &c->L[i % COPIES];
    const int m = c->m;
    float *y = (float *)c->y;
    switch (c->variant) {
    case 0: // separate, fp32 out
        for (int k = 0; k < 3; k++)
            gemm(L->qkv + (size_t)k * H * H, c->x, y, H, H, m, CUDA_R_32F);
        gemm(L->o, c->x, y, H, H, m, CUDA_R_32F);
        for (int k = 0; k < 2; k++)
            gemm(L->gu + (size_t)k * F * H, c->x, y, F, H, m, CUDA_R_32F);
        gemm(L->down, c->xf, y, H, F, m, CUDA_R_32F);
        break;
    case 1: // joined, fp32 out
    case 2: { // joined, fp16 out
        cudaDataType_t t = c->variant == 1 ? CUDA_R_32F : CUDA_R_16F;
        gemm(L->qkv, c->x, y, 3 * H, H, m, t);
        gemm(L->o, c->x, y, H, H, m, t);
        gemm(L->gu, c->x, y, 2 * F, H, m, t);
        gemm(L->down, c->xf, y, H, F, m, t);
        break;
    }
    default: // Lt best, fp32 out
        lt_run(&c->plan[0], L->qkv, c->x, y);
        lt_run(&c->plan[1], L->o, c->x, y);
        lt_run(&c->plan[2], L->gu, c->x, y);
        lt_run(&c->plan[3], L->down, c->xf, y);
    }
}

typedef struct one_ctx {
    lt_plan_t *p;
    const __half *w[COPIES];
    const __half *x;
    void *y;
} one_ctx_t;

static void one_run(void *vc, int i)
{
    one_ctx_t *c = (one_ctx_t *)vc;
    lt_run(c->p, c->w[i % COPIES], c->x, c->y);
}

// the fastest of the heuristic's algorithms for rows x cols at m rows of x (fp32 out)
static void lt_pick(lt_plan_t *p, const __half *const *w, const __half *x, void *y, int rows, int cols, int m)
{
    CB(cublasLtMatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    CB(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    CB(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    CB(cublasLtMatrixLayoutCreate(&p->a, CUDA_R_16F, cols, rows, cols));
    CB(cublasLtMatrixLayoutCreate(&p->b, CUDA_R_16F, cols, m, cols));
    CB(cublasLtMatrixLayoutCreate(&p->c, CUDA_R_32F, rows, m, rows));
    cublasLtMatmulPreference_t pref;
    CB(cublasLtMatmulPreferenceCreate(&pref));
    size_t wsb = WS;
    CB(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof wsb));
    cublasLtMatmulHeuristicResult_t res[32];
    int n = 0;
    CB(cublasLtMatmulAlgoGetHeuristic(lt, p->desc, p->a, p->b, p->c, p->c, pref, 32, res, &n));
    cublasLtMatmulPreferenceDestroy(pref);
    p->ms = 1e30;
    p->tried = n;
    one_ctx_t oc = {.p = p, .x = x, .y = y};
    for (int k = 0; k < COPIES; k++)
        oc.w[k] = w[k];
    for (int i = 0; i < n; i++) {
        lt_plan_t t = *p;
        t.algo = res[i].algo;
        oc.p = &t;
        double ms = time_ms(one_run, &oc, 20);
        if (ms < p->ms)
            p->ms = ms, p->algo = res[i].algo;
    }
}

int main(int argc, char **argv)
{
    std::vector<int> ms_list;
    for (int i = 1; i < argc; i++)
        ms_list.push_back(atoi(argv[i]));
    if (ms_list.empty())
        ms_list = {1, 8, 32, 64, 128, 256};
    CB(cublasCreate(&blas));
    CB(cublasLtCreate(&lt));
    CK(cudaMalloc(&ws, WS));
    CB(cublasSetWorkspace(blas, ws, WS));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("gemm study on %s (%d SMs)\n", prop.name, prop.multiProcessorCount);
    layer_t L[COPIES];
    std::vector<__half> host((size_t)2 * F * H);
    for (size_t i = 0; i < host.size(); i++)
        host[i] = __float2half((float)((i * 2654435761u) % 2001) / 1000.0f - 1.0f);
    for (int k = 0; k < COPIES; k++) {
        CK(cudaMalloc(&L[k].qkv, (size_t)3 * H * H * 2));
        CK(cudaMalloc(&L[k].o, (size_t)H * H * 2));
        CK(cudaMalloc(&L[k].gu, (size_t)2 * F * H * 2));
        CK(cudaMalloc(&L[k].down, (size_t)H * F * 2));
        CK(cudaMemcpy(L[k].qkv, host.data(), (size_t)3 * H * H * 2, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(L[k].o, host.data(), (size_t)H * H * 2, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(L[k].gu, host.data(), (size_t)2 * F * H * 2, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(L[k].down, host.data(), (size_t)H * F * 2, cudaMemcpyHostToDevice));
    }
    const int MAXM = 4096;
    __half *x, *xf;
    void *y;
    CK(cudaMalloc(&x, (size_t)MAXM * H * 2));
    CK(cudaMalloc(&xf, (size_t)MAXM * F * 2));
    CK(cudaMalloc(&y, (size_t)MAXM * 2 * F * 4));
    CK(cudaMemcpy(x, host.data(), (size_t)256 * H * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(xf, host.data(), (size_t)256 * F * 2, cudaMemcpyHostToDevice));
    // the peak: one big GEMM (8192 x 8192 x 4096 rows), and the read bandwidth: a device-to-device copy's read
    {
        run_ctx_t c = {.L = L, .x = x, .xf = xf, .y = y, .m = 4096, .variant = 2};
        c.m = 4096;
        double t = time_ms(
            [](void *vc, int) {
                run_ctx_t *c = (run_ctx_t *)vc;
                gemm(c->L[0].gu, c->x, c->y, 2 * F, H, c->m, CUDA_R_16F);
            },
            &c, 10);
        printf("peak: 22016x4096 by 4096 rows, fp16 out: %.3f ms = %.0f TFLOP/s\n", t, 2.0 * 2 * F * H * 4096 / t / 1e9);
    }
    const double layer_bytes = 2.0 * (4.0 * H * H + 3.0 * F * H), layer_flops_row = 2.0 * (4.0 * H * H + 3.0 * F * H);
    printf("a layer's matmuls: %.1f MB of weights, %.1f GFLOP a row\n", layer_bytes / 1e6, layer_flops_row / 1e9);
    const char *names[4] = {"separate, fp32 out", "joined, fp32 out", "joined, fp16 out", "joined, Lt best"};
    for (int m : ms_list) {
        if (m > MAXM)
            continue;
        lt_plan_t plan[4];
        const __half *wq[COPIES], *wo[COPIES], *wg[COPIES], *wd[COPIES];
        for (int k = 0; k < COPIES; k++)
            wq[k] = L[k].qkv, wo[k] = L[k].o, wg[k] = L[k].gu, wd[k] = L[k].down;
        lt_pick(&plan[0], wq, x, y, 3 * H, H, m);
        lt_pick(&plan[1], wo, x, y, H, H, m);
        lt_pick(&plan[2], wg, x, y, 2 * F, H, m);
        lt_pick(&plan[3], wd, xf, y, H, F, m);
        for (int v = 0; v < 4; v++) {
            run_ctx_t c = {.L = L, .x = x, .xf = xf, .y = y, .m = m, .variant = v, .plan = plan};
            double t = time_ms(layer_run, &c, 40);
            printf("m %4d  %-20s layer %.1f us, step (x32) %.3f ms, %.0f TFLOP/s, %.0f GB/s of weights\n", m,
                   names[v], t * 1e3, t * 32, layer_flops_row * m / t / 1e9, layer_bytes / t / 1e6);
        }
        printf("m %4d  Lt best per matrix: qkv %.1f us (%d algos), o %.1f (%d), gate|up %.1f (%d), down %.1f (%d)\n", m,
               plan[0].ms * 1e3, plan[0].tried, plan[1].ms * 1e3, plan[1].tried, plan[2].ms * 1e3, plan[2].tried,
               plan[3].ms * 1e3, plan[3].tried);
    }
    return 0;
}
