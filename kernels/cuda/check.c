/* check.c — tandem-cuda-check [GGUF]: the CUDA backend against the CPU backend
 * on random inputs, and the GPU decoders against the CPU ones, on the GPU
 * machine. Prints one line per check (relative error ‖gpu − cpu‖ / ‖cpu‖ and
 * its bound) and timings against the GPU's floors; exits non-zero if any
 * check fails. GGUF (default tests/fixtures/dequant/crafted.gguf) is decoded
 * tensor by tensor on both sides. */
#include <cuda_runtime_api.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/log.h"
#include "engine/gguf.h"
#include "kernels/backend.h"
#include "kernels/cuda/backend_cuda.h"
#include "kernels/cuda/dequant.h"
#include "kernels/quant.h"

static int failures;
static uint64_t rng = 0x9e3779b97f4a7c15ull;

static float frand(void)
{
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (float)((rng >> 11) * (1.0 / 9007199254740992.0)) * 2 - 1;
}

static double rel_err(const float *a, const float *b, size_t n)
{
    double d = 0, r = 0;
    for (size_t i = 0; i < n; i++) {
        d += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        r += (double)b[i] * b[i];
    }
    return sqrt(d / (r + 1e-300));
}

static void report(const char *what, double err, double bound)
{
    bool ok = err <= bound;
    failures += !ok;
    printf("%-44s rel err %.2e (bound %.0e) %s\n", what, err, bound, ok ? "ok" : "FAIL");
}

/* Copies host data into backend memory of be. */
static void *put(kern_backend_t *be, const void *src, size_t n)
{
    void *p;
    if (be->ops->alloc(be, n, &p) || be->ops->upload(be, p, src, n))
        exit(1);
    return p;
}

static void get(kern_backend_t *be, void *dst, const void *src, size_t n)
{
    if (be->ops->download(be, dst, src, n))
        exit(1);
}

/* A random weight of a type, rows x cols, with sane scales. */
static uint8_t *random_weight(uint32_t type, uint32_t rows, uint32_t cols)
{
    const kern_type_info_t *info = kern_type_info(type);
    size_t rb = kern_type_row_bytes(info, cols), nbytes = rb * rows;
    uint8_t *w = malloc(nbytes);
    float *row = malloc(cols * sizeof(float));
    for (uint32_t r = 0; r < rows; r++) {
        uint8_t *dst = w + r * rb;
        for (size_t i = 0; i < rb; i++)
            dst[i] = (uint8_t)(frand() * 127 + 128);
        for (size_t b = 0; b < rb / info->block_bytes; b++) {
            uint8_t *blk = dst + b * info->block_bytes;
            uint16_t d = kern_fp32_to_fp16(0.02f + 0.01f * frand());
            if (type == KERN_TYPE_Q4_1 || type == KERN_TYPE_Q8_0 || type == KERN_TYPE_Q4_0)
                memcpy(blk, &d, 2);
            if (type == KERN_TYPE_Q4_1)
                memcpy(blk + 2, &d, 2);
        }
        if (type == KERN_TYPE_F16 || type == KERN_TYPE_BF16)
            for (uint32_t k = 0; k < cols; k++) {
                float f = frand() * 0.1f;
                uint32_t bits;
                memcpy(&bits, &f, 4);
                uint16_t h = type == KERN_TYPE_F16 ? kern_fp32_to_fp16(f) : (uint16_t)(bits >> 16);
                memcpy(dst + 2 * k, &h, 2);
            }
    }
    free(row);
    return w;
}

static void check_matmul(kern_backend_t *cpu, kern_backend_t *gpu, uint32_t type, uint32_t rows, uint32_t cols,
                         uint32_t n)
{
    uint8_t *wdata = random_weight(type, rows, cols);
    float *x = malloc((size_t)n * cols * 4), *yc = malloc((size_t)n * rows * 4), *yg = malloc((size_t)n * rows * 4);
    for (size_t i = 0; i < (size_t)n * cols; i++)
        x[i] = frand();
    kern_weight_t wc = {type, rows, cols, wdata, NULL}, wg = wc;
    cpu->ops->weight_prepare(cpu, &wc);
    cpu->ops->matmul(cpu, &wc, x, yc, n);
    if (gpu->ops->weight_prepare(gpu, &wg))
        exit(1);
    float *dx = put(gpu, x, (size_t)n * cols * 4), *dy;
    gpu->ops->alloc(gpu, (size_t)n * rows * 4, (void **)&dy);
    if (gpu->ops->matmul(gpu, &wg, dx, dy, n))
        exit(1);
    get(gpu, yg, dy, (size_t)n * rows * 4);
    char what[96];
    snprintf(what, sizeof what, "matmul %s %ux%u, %u tokens", kern_type_info(type)->name, rows, cols, n);
    /* fp16 activations on the GPU; 8-bit activation blocks on the CPU for Q types */
    bool q = type == KERN_TYPE_Q4_1 || type == KERN_TYPE_Q8_0 || type == KERN_TYPE_Q4_0;
    report(what, rel_err(yg, yc, (size_t)n * rows), q ? 2e-2 : 2e-3);
    gpu->ops->free(gpu, dx);
    gpu->ops->free(gpu, dy);
    gpu->ops->weight_release(gpu, &wg);
    cpu->ops->weight_release(cpu, &wc);
    free(wdata), free(x), free(yc), free(yg);
}

static void check_elementwise(kern_backend_t *cpu, kern_backend_t *gpu)
{
    enum { N = 7, DIM = 576, H = 9, HD = 64 };
    static float x[N * DIM], w[DIM], yc[N * DIM], yg[N * DIM], u[N * DIM], freq[HD / 2];
    int32_t pos[N] = {0, 1, 5, 17, 100, 1000, 8000};
    for (int i = 0; i < N * DIM; i++)
        x[i] = frand() * 3, u[i] = frand();
    for (int i = 0; i < DIM; i++)
        w[i] = frand();
    for (int i = 0; i < HD / 2; i++)
        freq[i] = (float)pow(100000.0, -2.0 * i / HD);
    float *dx = put(gpu, x, sizeof x), *dw = put(gpu, w, sizeof w), *du = put(gpu, u, sizeof u), *dy;
    gpu->ops->alloc(gpu, sizeof yg, (void **)&dy);
    cpu->ops->rmsnorm(cpu, x, w, yc, N, DIM, 1e-5f);
    gpu->ops->rmsnorm(gpu, dx, dw, dy, N, DIM, 1e-5f);
    get(gpu, yg, dy, sizeof yg);
    report("rmsnorm 7 x 576", rel_err(yg, yc, N * DIM), 1e-6);
    int32_t *dpos = put(gpu, pos, sizeof pos);
    float *dfreq = put(gpu, freq, sizeof freq);
    for (int style = 0; style < 2; style++) {
        memcpy(yc, x, sizeof x);
        gpu->ops->upload(gpu, dy, x, sizeof x);
        cpu->ops->rope(cpu, yc, N, H, HD, pos, freq, (kern_rope_style_t)style);
        gpu->ops->rope(gpu, dy, N, H, HD, dpos, dfreq, (kern_rope_style_t)style);
        get(gpu, yg, dy, sizeof yg);
        report(style ? "rope neox 7 tokens x 9 heads x 64 (pos to 8000)" : "rope norm 7 tokens x 9 heads x 64 (pos to 8000)",
               rel_err(yg, yc, N * DIM), 1e-5);
    }
    cpu->ops->swiglu(cpu, x, u, yc, N * DIM);
    gpu->ops->swiglu(gpu, dx, du, dy, N * DIM);
    get(gpu, yg, dy, sizeof yg);
    report("swiglu 4032", rel_err(yg, yc, N * DIM), 1e-6);
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* GEMM and GEMV speed of the fp16 path against the GPU's floors. */
static void timings(kern_backend_t *gpu)
{
    uint32_t rows = 8192, cols = 8192;
    uint8_t *w = random_weight(KERN_TYPE_F16, rows, cols);
    kern_weight_t wg = {KERN_TYPE_F16, rows, cols, w, NULL};
    gpu->ops->weight_prepare(gpu, &wg);
    for (uint32_t n = 1; n <= 4096; n *= 4096) {
        float *dx, *dy;
        gpu->ops->alloc(gpu, (size_t)n * cols * 4, (void **)&dx);
        gpu->ops->alloc(gpu, (size_t)n * rows * 4, (void **)&dy);
        cudaMemset(dx, 0, (size_t)n * cols * 4);
        for (int i = 0; i < 3; i++)
            gpu->ops->matmul(gpu, &wg, dx, dy, n);
        gpu->ops->sync(gpu);
        int reps = n == 1 ? 200 : 20;
        double t0 = now_s();
        for (int i = 0; i < reps; i++)
            gpu->ops->matmul(gpu, &wg, dx, dy, n);
        gpu->ops->sync(gpu);
        double dt = (now_s() - t0) / reps;
        double flops = 2.0 * rows * cols * n, bytes = 2.0 * rows * cols + 4.0 * n * (rows + cols) + 2.0 * n * cols;
        printf("timing matmul fp16 %ux%u, %u tokens: %.3f ms = %.1f TFLOP/s, %.0f GB/s\n", rows, cols, n, dt * 1e3,
               flops / dt / 1e12, bytes / dt / 1e9);
        gpu->ops->free(gpu, dx);
        gpu->ops->free(gpu, dy);
    }
    gpu->ops->weight_release(gpu, &wg);
    free(w);
}

/* The GPU decoders against the CPU's, tensor by tensor, bit for bit. */
static void check_decode(const char *path)
{
    eng_gguf_t *g;
    if (eng_gguf_open(path, &g))
        exit(1);
    size_t checked = 0, bad = 0;
    for (size_t i = 0; i < eng_gguf_n_tensors(g); i++) {
        const eng_gguf_tensor_t *t = eng_gguf_tensor_at(g, i);
        void *src;
        float *dst, *host = malloc(t->n_elems * 4), *ref = malloc(t->n_elems * 4);
        cudaMalloc(&src, t->n_bytes);
        cudaMalloc((void **)&dst, t->n_elems * 4);
        cudaMemcpy(src, t->data, t->n_bytes, cudaMemcpyHostToDevice);
        if (kern_cuda_dequant(t->type, src, dst, t->n_elems, NULL) == TD_OK) {
            cudaMemcpy(host, dst, t->n_elems * 4, cudaMemcpyDeviceToHost);
            eng_gguf_tensor_read_f32(t, 0, t->n_elems, ref);
            bad += memcmp(host, ref, t->n_elems * 4) != 0;
            checked++;
        }
        cudaFree(src);
        cudaFree(dst);
        free(host);
        free(ref);
    }
    printf("decode %s: %zu tensors on the GPU, %zu differ from the CPU bit for bit %s\n", path, checked, bad,
           bad ? "FAIL" : "ok");
    failures += bad > 0;
    eng_gguf_close(g);
}

int main(int argc, char **argv)
{
    td_log_init("cuda-check", TD_LOG_WARN, false);
    struct cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) {
        fprintf(stderr, "tandem-cuda-check: no CUDA device\n");
        return 1;
    }
    printf("device: %s, sm_%d%d, %d SMs, %.1f GiB\n", prop.name, prop.major, prop.minor, prop.multiProcessorCount,
           prop.totalGlobalMem / 1073741824.0);
    kern_backend_t *cpu, *gpu;
    if (kern_cpu_backend_create(0, &cpu) || kern_cuda_backend_create(0, &gpu))
        return 1;
    uint32_t types[] = {KERN_TYPE_F16, KERN_TYPE_BF16, KERN_TYPE_Q4_1, KERN_TYPE_Q8_0};
    uint32_t shapes[][3] = {{576, 576, 1}, {1536, 576, 7}, {576, 1536, 64}, {49152, 576, 1}, {192, 576, 512}};
    for (size_t t = 0; t < 4; t++)
        for (size_t s = 0; s < 5; s++)
            check_matmul(cpu, gpu, types[t], shapes[s][0], shapes[s][1], shapes[s][2]);
    check_elementwise(cpu, gpu);
    check_decode(argc > 1 ? argv[1] : "tests/fixtures/dequant/crafted.gguf");
    timings(gpu);
    kern_cuda_backend_destroy(gpu);
    kern_cpu_backend_destroy(cpu);
    printf("cuda check: %d failed\n", failures);
    return failures ? 1 : 0;
}
