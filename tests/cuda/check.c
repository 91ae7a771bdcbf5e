/* check.c — tandem-cuda-check: the CUDA backend against the CPU backend on
 * the GPU machine. Every op on random inputs at several sizes (relative error
 * ‖gpu − cpu‖ / ‖cpu‖ against a bound stated per op), the GPU decoders bit
 * for bit on a GGUF's tensors, whole models through the forward pass (a GGUF
 * on both backends; a Hugging Face directory against the logits transformers
 * computed there), then timings against the GPU's floors. Exits non-zero if
 * any check fails.
 *
 *   tandem-cuda-check [--crafted GGUF] [--model GGUF_OR_DIR]... [--hf DIR LOGITS_JSON]... [--no-timings]
 *                     [--no-ops] [--time-model PATH]... [--fp8-model PATH]... [--dummy] [--time-attention]
 *                     [--time-prefill PATH]...
 *                     (--no-ops: the models only; --dummy: the models' weights are the dummy load format's, filled
 *                     by each backend; --fp8-model: FP8 weights against the file's on the GPU alone; --time-model:
 *                     a 4k prefill and decode steps timed, whole and op by op; --time-attention with --no-timings:
 *                     the prompt attention's checks and timings alone. TANDEM_CUDA_WGMMA=0 in the environment keeps the
 *                     prompt attention off Hopper's warpgroup MMA, to time one kernel against the other; --time-prefill:
 *                     prompts of 1k, 4k and 16k tokens in one step, warm, fp16 and FP8 weights, against the measured
 *                     cuBLAS peak; fp16 weights also with Q/K/V in fp32, alternating, their logits compared)
 */
#include <cuda_runtime_api.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <jansson.h>

#include "common/log.h"
#include "engine/forward.h"
#include "engine/gguf.h"
#include "engine/kv_pool.h"
#include "engine/model.h"
#include "engine/tp.h"
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
    kern_weight_t wc = {type, rows, cols, wdata, NULL, 0, NULL, 0, 0, 0}, wg = wc;
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

/* matmul_fused of three weights over norm(x) (norm_in_w: the norm's weight is in the weights), its largest
 * rel err against the CPU backend's yc */
static double fused3_err(kern_backend_t *gpu, const kern_weight_t *const *w, bool norm_in_w, const float *dx,
                         const float *dg, uint32_t n, float *const *dy, float *yh, float *const *yc,
                         const uint32_t *rows, float *side)
{
    if (gpu->ops->matmul_fused(gpu, &(kern_matmul_spec_t){.w = w, .y = dy, .k = 3, .x = dx, .n = n, .norm = dg,
                                                          .eps = 1e-5f, .norm_in_w = norm_in_w, .side = side,
                                                          .side_rows = side ? n : 0}))
        exit(1);
    double e = 0;
    for (int i = 0; i < 3; i++) {
        get(gpu, yh, dy[i], (size_t)n * rows[i] * 4);
        double ei = rel_err(yh, yc[i], (size_t)n * rows[i]);
        e = ei > e ? ei : e;
    }
    return e;
}

/* The fused matmul against the CPU backend's separate ops: Q/K/V-like
 * (3 weights, norm), gate/up (norm, glu), both again with the norm's weight
 * in the weights (norm_in_w), a projection with the residual add
 * (accumulate) and gate/up handed to a down projection (to_next), at n rows
 * (the GEMV for one, cuBLAS above). */
/* Rows of x as the FP8 GEMM takes its activations (gemm_fp8.cu): each row's FP8 round trip, with its own scale */
static void fp8_rows(float *x, uint32_t n, uint32_t cols)
{
    uint8_t *q = malloc(cols);
    for (uint32_t r = 0; r < n; r++) {
        float s, *row = x + (size_t)r * cols;
        kern_fp8_quantize_row(row, cols, q, &s);
        for (uint32_t i = 0; i < cols; i++)
            row[i] = kern_fp8_to_fp32(q[i]) * s;
    }
    free(q);
}

static void check_matmul_fused(kern_backend_t *cpu, kern_backend_t *gpu, uint32_t cols, uint32_t n, uint32_t hold)
{
    const char *h = hold ? " (fp8)" : "";
    /* above one row FP8 matrices meet FP8 activations (W8A8): the reference takes the same rounded activations,
     * and a normed row may round an element the other way where the GPU's norm differs in its last bit */
    const bool a8 = hold && n > 1;
    const double bound = a8 ? 5e-3 : 2e-3;
    const uint32_t rows[3] = {2 * cols, cols / 2 + 8, cols / 2 + 8};
    uint8_t *wd[3];
    kern_weight_t wc[3], wg[3];
    for (int i = 0; i < 3; i++) {
        wd[i] = random_weight(KERN_TYPE_F16, rows[i], cols);
        wc[i] = wg[i] = (kern_weight_t){KERN_TYPE_F16, rows[i], cols, wd[i], NULL, hold, NULL, 0, 0, 0};
        if (cpu->ops->weight_prepare(cpu, &wc[i]) || gpu->ops->weight_prepare(gpu, &wg[i]))
            exit(1);
    }
    size_t nx = (size_t)n * cols, ny = (size_t)n * rows[0];
    float *x = malloc(nx * 4), *g = malloc(cols * 4), *xn = malloc(nx * 4), *yc[3], *yh = malloc(ny * 4), *dy[3];
    for (size_t i = 0; i < nx; i++)
        x[i] = frand() * 2;
    for (uint32_t i = 0; i < cols; i++)
        g[i] = frand();
    float *dx = put(gpu, x, nx * 4), *dg = put(gpu, g, cols * 4);
    for (int i = 0; i < 3; i++) {
        yc[i] = malloc(ny * 4);
        gpu->ops->alloc(gpu, ny * 4, (void **)&dy[i]);
    }
    char what[96];
    /* 1. three weights over norm(x) */
    cpu->ops->rmsnorm(cpu, x, g, xn, n, cols, 1e-5f);
    if (a8)
        fp8_rows(xn, n, cols);
    for (int i = 0; i < 3; i++)
        cpu->ops->matmul(cpu, &wc[i], xn, yc[i], n);
    const kern_weight_t *w3[3] = {&wg[0], &wg[1], &wg[2]};
    snprintf(what, sizeof what, "matmul_fused norm, 3 weights, %u x %u, %u rows%s", rows[0], cols, n, h);
    report(what, fused3_err(gpu, w3, false, dx, dg, n, dy, yh, yc, rows, NULL), bound);
    /* 1b. the same with the norm's weight in the weights' columns (weight_scale_cols, norm_in_w), as the forward
     * pass runs a model on this backend: against the same reference */
    kern_weight_t wf[3];
    for (int i = 0; i < 3 && !hold; i++) { /* FP8 matrices keep the norm apart */
        bool fits = false;
        wf[i] = (kern_weight_t){KERN_TYPE_F16, rows[i], cols, wd[i], NULL, hold, NULL, 0, 0, 0};
        if (gpu->ops->weight_prepare(gpu, &wf[i]) || gpu->ops->weight_scale_cols(gpu, &wf[i], dg, true, &fits) ||
            !fits)
            exit(1);
    }
    const kern_weight_t *wf3[3] = {&wf[0], &wf[1], &wf[2]};
    if (!hold) {
        snprintf(what, sizeof what, "matmul_fused norm in the weights, 3 weights, %u x %u, %u rows%s", rows[0], cols, n, h);
        report(what, fused3_err(gpu, wf3, true, dx, dg, n, dy, yh, yc, rows, NULL), bound);
    }
    /* 1c. the three weights joined side by side (weights_join) and room given for their product: one GEMM above
     * a row, its rows copied out to each y */
    float *dside = NULL;
    gpu->ops->alloc(gpu, (size_t)n * (rows[0] + rows[1] + rows[2]) * 4, (void **)&dside);
    kern_weight_t wj[3], wk[2]; /* FP8: codes side by side, then scales side by side (gemm_fp8.cu's one GEMM) */
    for (int i = 0; i < 3; i++) {
        wj[i] = (kern_weight_t){KERN_TYPE_F16, rows[i], cols, wd[i], NULL, hold, NULL, 0, 0, 0};
        if (gpu->ops->weight_prepare(gpu, &wj[i]))
            exit(1);
    }
    kern_weight_t *wjp[3] = {&wj[0], &wj[1], &wj[2]};
    if (gpu->ops->weights_join(gpu, wjp, 3))
        exit(1);
    const kern_weight_t *wj3[3] = {&wj[0], &wj[1], &wj[2]};
    snprintf(what, sizeof what, "matmul_fused norm, 3 weights joined, %u x %u, %u rows%s", rows[0], cols, n, h);
    report(what, fused3_err(gpu, wj3, false, dx, dg, n, dy, yh, yc, rows, dside), bound);
    /* 2. gate/up with glu over norm(x) */
    cpu->ops->swiglu(cpu, yc[1], yc[2], yc[1], (size_t)n * rows[1]);
    const kern_weight_t *w2[2] = {&wg[1], &wg[2]};
    if (gpu->ops->matmul_fused(gpu, &(kern_matmul_spec_t){.w = w2, .y = dy + 1, .k = 2, .x = dx, .n = n, .norm = dg,
                                                          .eps = 1e-5f, .glu = true}))
        exit(1);
    get(gpu, yh, dy[1], (size_t)n * rows[1] * 4);
    snprintf(what, sizeof what, "matmul_fused norm + glu, %u x %u, %u rows%s", rows[1], cols, n, h);
    report(what, rel_err(yh, yc[1], (size_t)n * rows[1]), bound);
    const kern_weight_t *wf2[2] = {&wf[1], &wf[2]};
    if (!hold && gpu->ops->matmul_fused(gpu, &(kern_matmul_spec_t){.w = wf2, .y = dy + 1, .k = 2, .x = dx, .n = n, .norm = dg,
                                                          .eps = 1e-5f, .norm_in_w = true, .glu = true}))
        exit(1);
    get(gpu, yh, dy[1], (size_t)n * rows[1] * 4);
    snprintf(what, sizeof what, "matmul_fused norm in the weights + glu, %u x %u, %u rows%s", rows[1], cols, n, h);
    if (!hold)
        report(what, rel_err(yh, yc[1], (size_t)n * rows[1]), bound);
    /* 2b. FP8 gate/up joined: one GEMM, SwiGLU's product made from its two halves */
    for (int i = 0; i < 2 && hold; i++) {
        wk[i] = (kern_weight_t){KERN_TYPE_F16, rows[i + 1], cols, wd[i + 1], NULL, hold, NULL, 0, 0, 0};
        if (gpu->ops->weight_prepare(gpu, &wk[i]))
            exit(1);
    }
    kern_weight_t *wkp[2] = {&wk[0], &wk[1]};
    const kern_weight_t *wk2[2] = {&wk[0], &wk[1]};
    if (hold && (gpu->ops->weights_join(gpu, wkp, 2) ||
                 gpu->ops->matmul_fused(gpu, &(kern_matmul_spec_t){.w = wk2, .y = dy + 1, .k = 2, .x = dx, .n = n,
                                                                   .norm = dg, .eps = 1e-5f, .glu = true})))
        exit(1);
    if (hold) {
        get(gpu, yh, dy[1], (size_t)n * rows[1] * 4);
        snprintf(what, sizeof what, "matmul_fused norm + glu, joined, %u x %u, %u rows%s", rows[1], cols, n, h);
        report(what, rel_err(yh, yc[1], (size_t)n * rows[1]), bound);
    }
    for (int i = 0; i < 3; i++) {
        gpu->ops->weight_release(gpu, &wj[i]);
        if (!hold)
            gpu->ops->weight_release(gpu, &wf[i]);
        else if (i < 2)
            gpu->ops->weight_release(gpu, &wk[i]);
    }
    gpu->ops->free(gpu, dside);
    /* 3. a square projection added onto a residual: y = r + x·W0[:cols]ᵀ */
    kern_weight_t sq_c = {KERN_TYPE_F16, cols, cols, wd[0], NULL, hold, NULL, 0, 0, 0}, sq_g = sq_c;
    if (cpu->ops->weight_prepare(cpu, &sq_c) || gpu->ops->weight_prepare(gpu, &sq_g))
        exit(1);
    float *r = malloc(nx * 4);
    for (size_t i = 0; i < nx; i++)
        r[i] = frand();
    float *x8 = malloc(nx * 4);
    memcpy(x8, x, nx * 4);
    if (a8)
        fp8_rows(x8, n, cols);
    cpu->ops->matmul(cpu, &sq_c, x8, yc[0], n);
    free(x8);
    cpu->ops->add(cpu, yc[0], r, nx);
    gpu->ops->upload(gpu, dy[0], r, nx * 4);
    const kern_weight_t *w1 = &sq_g;
    if (gpu->ops->matmul_fused(gpu, &(kern_matmul_spec_t){.w = &w1, .y = dy, .k = 1, .x = dx, .n = n,
                                                          .accumulate = true}))
        exit(1);
    get(gpu, yh, dy[0], nx * 4);
    snprintf(what, sizeof what, "matmul_fused accumulate, %u x %u, %u rows%s", cols, cols, n, h);
    report(what, rel_err(yh, yc[0], nx), bound);
    gpu->ops->weight_release(gpu, &sq_g), cpu->ops->weight_release(cpu, &sq_c);
    /* 4. as a layer runs them: gate/up with glu handed to the next call (to_next), the down projection over the
     * product added onto a residual (widths the CPU backend takes: multiples of 32) */
    const uint32_t f4 = cols / 64 * 32 + 32;
    uint8_t *wd4[3] = {random_weight(KERN_TYPE_F16, f4, cols), random_weight(KERN_TYPE_F16, f4, cols),
                       random_weight(KERN_TYPE_F16, cols, f4)};
    kern_weight_t w4c[3], w4g[3];
    for (int i = 0; i < 3; i++) {
        w4c[i] = w4g[i] = (kern_weight_t){KERN_TYPE_F16, i < 2 ? f4 : cols, i < 2 ? cols : f4, wd4[i], NULL, hold, NULL, 0, 0, 0};
        if (cpu->ops->weight_prepare(cpu, &w4c[i]) || gpu->ops->weight_prepare(gpu, &w4g[i]))
            exit(1);
    }
    float *h4[2] = {malloc((size_t)n * f4 * 4), malloc((size_t)n * f4 * 4)}, *d4[2];
    for (int i = 0; i < 2; i++)
        gpu->ops->alloc(gpu, (size_t)n * f4 * 4, (void **)&d4[i]);
    if (cpu->ops->matmul(cpu, &w4c[0], xn, h4[0], n) || cpu->ops->matmul(cpu, &w4c[1], xn, h4[1], n) ||
        cpu->ops->swiglu(cpu, h4[0], h4[1], h4[0], (size_t)n * f4) || (a8 && (fp8_rows(h4[0], n, f4), false)) ||
        cpu->ops->matmul(cpu, &w4c[2], h4[0], yc[0], n) ||
        cpu->ops->add(cpu, yc[0], r, nx))
        exit(1);
    gpu->ops->upload(gpu, dy[0], r, nx * 4);
    const kern_weight_t *gu4[2] = {&w4g[0], &w4g[1]}, *dn4 = &w4g[2];
    if (gpu->ops->matmul_fused(gpu, &(kern_matmul_spec_t){.w = gu4, .y = d4, .k = 2, .x = dx, .n = n, .norm = dg,
                                                          .eps = 1e-5f, .glu = true, .to_next = true}) ||
        gpu->ops->matmul_fused(gpu, &(kern_matmul_spec_t){.w = &dn4, .y = dy, .k = 1, .x = d4[0], .n = n,
                                                          .accumulate = true}))
        exit(1);
    get(gpu, yh, dy[0], nx * 4);
    snprintf(what, sizeof what, "matmul_fused glu to the next, %u x %u, %u rows%s", f4, cols, n, h);
    report(what, rel_err(yh, yc[0], nx), bound);
    /* 4b. gate/up joined, their product in the room the forward gives (gate's own: two rows' worth a row) */
    if (!hold) {
        kern_weight_t *gj[2] = {&w4g[0], &w4g[1]};
        float *d4side;
        gpu->ops->alloc(gpu, (size_t)n * 2 * f4 * 4, (void **)&d4side);
        if (gpu->ops->weights_join(gpu, gj, 2))
            exit(1);
        gpu->ops->upload(gpu, dy[0], r, nx * 4);
        float *d4j[2] = {d4side, d4side + (size_t)n * f4};
        if (gpu->ops->matmul_fused(gpu, &(kern_matmul_spec_t){.w = gu4, .y = d4j, .k = 2, .x = dx, .n = n, .norm = dg,
                                                              .eps = 1e-5f, .glu = true, .to_next = true,
                                                              .side = d4side, .side_rows = n}) ||
            gpu->ops->matmul_fused(gpu, &(kern_matmul_spec_t){.w = &dn4, .y = dy, .k = 1, .x = d4j[0], .n = n,
                                                              .accumulate = true}))
            exit(1);
        get(gpu, yh, dy[0], nx * 4);
        snprintf(what, sizeof what, "matmul_fused glu joined to the next, %u x %u, %u rows", f4, cols, n);
        report(what, rel_err(yh, yc[0], nx), bound);
        gpu->ops->free(gpu, d4side);
    }
    for (int i = 0; i < 3; i++) {
        gpu->ops->weight_release(gpu, &w4g[i]), cpu->ops->weight_release(cpu, &w4c[i]);
        free(wd4[i]);
    }
    for (int i = 0; i < 2; i++)
        gpu->ops->free(gpu, d4[i]), free(h4[i]);
    for (int i = 0; i < 3; i++) {
        gpu->ops->weight_release(gpu, &wg[i]), cpu->ops->weight_release(cpu, &wc[i]);
        gpu->ops->free(gpu, dy[i]);
        free(wd[i]), free(yc[i]);
    }
    gpu->ops->free(gpu, dx), gpu->ops->free(gpu, dg);
    free(x), free(g), free(xn), free(yh), free(r);
}

/* A matrix held in FP8 on the GPU: its codes and scales as kern_weight_fp8_row makes them on the host, byte for
 * byte, from the types the GPU decodes (F16, BF16, Q4_1), one it does not (Q6_K: made on the host) and an FP8 file's
 * codes with their scales. */
static void check_fp8_hold(kern_backend_t *gpu)
{
    const uint32_t types[] = {KERN_TYPE_F16, KERN_TYPE_BF16, KERN_TYPE_Q4_1, KERN_TYPE_F8_E4M3};
    const uint32_t rows = 37, cols = 576;
    uint8_t *q = malloc((size_t)rows * cols), *qg = malloc((size_t)rows * cols);
    float *sc = malloc(rows * 4), *sg = malloc(rows * 4), *tmp = malloc(cols * 4);
    for (size_t t = 0; t < sizeof types / sizeof *types; t++) {
        const bool f8 = types[t] == KERN_TYPE_F8_E4M3;
        uint8_t *wd = f8 ? malloc((size_t)rows * cols) : random_weight(types[t], rows, cols);
        float *fs = f8 ? malloc(rows * 4) : NULL;
        for (size_t i = 0; f8 && i < (size_t)rows * cols; i++)
            wd[i] = (uint8_t)(frand() * 127 + 128) & 0xf7; /* 0x7f / 0xff (NaN) never */
        for (uint32_t r = 0; f8 && r < rows; r++)
            fs[r] = 0.001f + 0.01f * (frand() + 1);
        kern_weight_t w = {types[t], rows, cols, wd, NULL, KERN_TYPE_F8_E4M3, fs, 0, 0, 0};
        size_t bytes = 0, scales = 0;
        for (uint32_t r = 0; r < rows; r++)
            if (kern_weight_fp8_row(&w, r, q + (size_t)r * cols, &sc[r], tmp))
                exit(1);
        if (gpu->ops->weight_prepare(gpu, &w) || kern_cuda_fp8_download(gpu, &w, qg, sg)) {
            fprintf(stderr, "fp8: %s\n", td_last_error());
            exit(1);
        }
        for (size_t i = 0; i < (size_t)rows * cols; i++)
            bytes += q[i] != qg[i];
        for (uint32_t r = 0; r < rows; r++)
            scales += memcmp(&sc[r], &sg[r], 4) != 0;
        char what[96];
        snprintf(what, sizeof what, "fp8 hold from %s: codes, scales differing", kern_type_info(types[t])->name);
        report(what, (double)(bytes + scales), 0.5);
        gpu->ops->weight_release(gpu, &w);
        free(wd), free(fs);
    }
    free(q), free(qg), free(sc), free(sg), free(tmp);
}

/* weight_scale_cols itself: scaled, each value is the fp16 of the value times
 * its column's scale, bit for bit as the host rounds it; checked only, or
 * with a product past fp16's range, the weight is unchanged byte for byte. */
static void check_weight_scale(kern_backend_t *gpu)
{
    const uint32_t rows = 37, cols = 200;
    uint8_t *wd = random_weight(KERN_TYPE_F16, rows, cols);
    float *sc = malloc(cols * 4);
    for (uint32_t c = 0; c < cols; c++)
        sc[c] = 0.25f + frand() * 8;
    uint16_t *out = malloc((size_t)rows * cols * 2);
    kern_weight_t w = {KERN_TYPE_F16, rows, cols, wd, NULL, 0, NULL, 0, 0, 0};
    float *ds = put(gpu, sc, cols * 4);
    bool fits = false;
    size_t diff = 0;
    if (gpu->ops->weight_prepare(gpu, &w) || gpu->ops->weight_scale_cols(gpu, &w, ds, false, &fits) || !fits)
        exit(1);
    get(gpu, out, w.priv, (size_t)rows * cols * 2);
    diff += memcmp(out, wd, (size_t)rows * cols * 2) != 0;
    if (gpu->ops->weight_scale_cols(gpu, &w, ds, true, &fits) || !fits)
        exit(1);
    get(gpu, out, w.priv, (size_t)rows * cols * 2);
    for (size_t i = 0; i < (size_t)rows * cols; i++) {
        uint16_t h;
        memcpy(&h, wd + 2 * i, 2);
        diff += out[i] != kern_fp32_to_fp16(kern_fp16_to_fp32(h) * sc[i % cols]);
    }
    /* past the range: one column scaled by 1e7 (the weights are up to 0.1) */
    memcpy(wd, out, (size_t)rows * cols * 2);
    sc[cols / 2] = 1e7f;
    gpu->ops->upload(gpu, ds, sc, cols * 4);
    if (gpu->ops->weight_scale_cols(gpu, &w, ds, true, &fits))
        exit(1);
    get(gpu, out, w.priv, (size_t)rows * cols * 2);
    diff += fits + (memcmp(out, wd, (size_t)rows * cols * 2) != 0);
    report("weight_scale_cols: scaled values exact, unchanged when checked only or past fp16", (double)diff, 0.5);
    gpu->ops->weight_release(gpu, &w);
    gpu->ops->free(gpu, ds);
    free(wd), free(sc), free(out);
}

/* Sampling on the GPU against the host's reckoning of the same rule: greedy
 * is the first largest logit (a planted tie); for each setting, the kept set
 * (top-k, top-p, min-p over softmax(logits / T), found on the host by
 * sorting) walked in vocabulary order, each kept token asked for at the
 * middle of its share of u: the GPU must answer exactly that token. */
static int cmp_desc_f(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return x < y ? 1 : x > y ? -1 : 0;
}

static void check_sample(kern_backend_t *gpu)
{
    enum { V = 49152, MAXR = 64 };
    float *lg = malloc((size_t)V * 4), *rows = malloc((size_t)MAXR * V * 4), *sorted = malloc((size_t)V * 4);
    for (uint32_t i = 0; i < V; i++)
        lg[i] = frand() * 4 + (i % 97 == 0 ? 6 : 0); /* a head of likely tokens */
    float *dl, mx = -INFINITY;
    kern_sample_t *dp, p[MAXR];
    int32_t *dids, ids[MAXR], want[MAXR];
    gpu->ops->alloc(gpu, (size_t)MAXR * V * 4, (void **)&dl);
    gpu->ops->alloc(gpu, sizeof p, (void **)&dp);
    gpu->ops->alloc(gpu, sizeof ids, (void **)&dids);
    uint32_t best = 0;
    for (uint32_t i = 0; i < V; i++)
        if (lg[i] > lg[best])
            best = i;
    mx = lg[best];
    lg[V - 5] = mx; /* a tie after the first largest: greedy keeps the first */
    const kern_sample_t set[] = {{0.7f, 1, 0, 0, 40, 0}, {1.0f, 0.9f, 0, 0, 0, 0},   {0.8f, 1, 0.2f, 0, 0, 0},
                                 {1.2f, 0.95f, 0.05f, 0, 200, 0}, {1.0f, 1, 0, 0, 1, 0}};
    int bad = 0, asked = 0;
    /* greedy: one row */
    gpu->ops->upload(gpu, dl, lg, (size_t)V * 4);
    p[0] = (kern_sample_t){0};
    gpu->ops->upload(gpu, dp, p, sizeof p[0]);
    if (gpu->ops->sample(gpu, dl, 1, V, dp, NULL, dids))
        exit(1);
    get(gpu, ids, dids, 4);
    bad += ids[0] != (int32_t)best, asked++;
    for (size_t k = 0; k < sizeof set / sizeof *set; k++) {
        const kern_sample_t *q = &set[k];
        /* the threshold from the sorted logits, as eng_sampler cuts them */
        memcpy(sorted, lg, (size_t)V * 4);
        qsort(sorted, V, 4, cmp_desc_f);
        uint32_t limit = q->top_k > 0 && q->top_k < V ? (uint32_t)q->top_k : V, keep = limit;
        double z = 0, acc = 0;
        for (uint32_t i = 0; i < limit; i++)
            z += exp((sorted[i] - mx) / q->temperature);
        for (uint32_t i = 0; i < limit; i++) {
            double e = exp((sorted[i] - mx) / q->temperature);
            if (q->min_p > 0 && e < q->min_p) {
                keep = i;
                break;
            }
            acc += e;
            if (q->top_p < 1 && acc >= q->top_p * z) {
                keep = i + 1;
                break;
            }
        }
        float t = sorted[keep - 1];
        double total = 0;
        for (uint32_t i = 0; i < V; i++)
            if (lg[i] >= t)
                total += exp((lg[i] - mx) / q->temperature);
        /* up to MAXR kept tokens, each at the middle of its share */
        uint32_t nr = 0, seen = 0, stride = keep / MAXR + 1;
        double before = 0;
        for (uint32_t i = 0; i < V && nr < MAXR; i++) {
            if (lg[i] < t)
                continue;
            double e = exp((lg[i] - mx) / q->temperature);
            if (seen++ % stride == 0) {
                p[nr] = *q;
                p[nr].u = (float)((before + e / 2) / total);
                want[nr] = (int32_t)i;
                memcpy(rows + (size_t)nr * V, lg, (size_t)V * 4);
                nr++;
            }
            before += e;
        }
        gpu->ops->upload(gpu, dl, rows, (size_t)nr * V * 4);
        gpu->ops->upload(gpu, dp, p, nr * sizeof *p);
        if (gpu->ops->sample(gpu, dl, nr, V, dp, NULL, dids))
            exit(1);
        get(gpu, ids, dids, nr * 4);
        for (uint32_t i = 0; i < nr; i++)
            bad += ids[i] != want[i];
        asked += (int)nr;
    }
    printf("%-44s %d of %d picks differ from the host's %s\n", "sample (greedy, top-k/top-p/min-p, 49152)", bad, asked,
           bad ? "FAIL" : "ok");
    failures += bad != 0;
    /* masked rows (structured output): each setting and draw on the whole row with a mask against the same on the
     * row with the masked tokens' logits -inf, unmasked; masks of about half the tokens, of 3 tokens, and of the
     * first largest's neighbours only (never the largest) */
    const uint32_t MB = (V + 7) / 8;
    uint8_t *masks = calloc((size_t)MAXR, MB), *dm;
    gpu->ops->alloc(gpu, (size_t)MAXR * MB, (void **)&dm);
    int mbad = 0, masked = 0;
    for (uint32_t r = 0; r < MAXR; r++) {
        uint8_t *mk = masks + (size_t)r * MB;
        const uint32_t kind = r % 3;
        for (uint32_t t = 0; t < V; t++) {
            const bool allow = kind == 0 ? frand() > 0 : kind == 1 ? (t == r * 700 % V || t == 97 * r % V || t == V - 1)
                                                                 : t != best && (t + 1 == best || t == best + 1 || t % 97 == 0);
            if (allow)
                mk[t >> 3] |= (uint8_t)(1u << (t & 7));
        }
        float *row = rows + (size_t)r * V;
        for (uint32_t t = 0; t < V; t++)
            row[t] = mk[t >> 3] >> (t & 7) & 1 ? lg[t] : -INFINITY;
        p[r] = r % 6 == 5 ? (kern_sample_t){0} : set[r % 5];
        p[r].u = (float)(r + 0.5) / MAXR;
    }
    int32_t ref[MAXR];
    gpu->ops->upload(gpu, dl, rows, (size_t)MAXR * V * 4);
    gpu->ops->upload(gpu, dp, p, sizeof p);
    if (gpu->ops->sample(gpu, dl, MAXR, V, dp, NULL, dids))
        exit(1);
    get(gpu, ref, dids, sizeof ref);
    for (uint32_t r = 0; r < MAXR; r++) {
        memcpy(rows + (size_t)r * V, lg, (size_t)V * 4);
        p[r].masked = 1;
    }
    gpu->ops->upload(gpu, dl, rows, (size_t)MAXR * V * 4);
    gpu->ops->upload(gpu, dp, p, sizeof p);
    gpu->ops->upload(gpu, dm, masks, (size_t)MAXR * MB);
    if (gpu->ops->sample(gpu, dl, MAXR, V, dp, dm, dids))
        exit(1);
    get(gpu, ids, dids, sizeof ids);
    for (uint32_t r = 0; r < MAXR; r++) {
        const uint8_t *mk = masks + (size_t)r * MB;
        const bool allowed = ids[r] >= 0 && ids[r] < V && (mk[ids[r] >> 3] >> (ids[r] & 7) & 1);
        mbad += ids[r] != ref[r] || !allowed;
        masked++;
    }
    printf("%-44s %d of %d picks differ from the -inf rows' or pass the mask %s\n", "sample masked (structured output)",
           mbad, masked, mbad ? "FAIL" : "ok");
    failures += mbad != 0;
    gpu->ops->free(gpu, dm);
    free(masks);
    gpu->ops->free(gpu, dl), gpu->ops->free(gpu, dp), gpu->ops->free(gpu, dids);
    free(lg), free(rows), free(sorted);
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

/* A step's rows for the rope checks: random q (nq values), k and v (nk
 * each), and rope's inverse frequencies for head_dim hd (base 10000). */
static void random_rope_rows(float *q, size_t nq, float *k, float *v, size_t nk, float *freq, uint32_t hd)
{
    for (size_t i = 0; i < nq; i++)
        q[i] = frand() * 2;
    for (size_t i = 0; i < nk; i++)
        k[i] = frand() * 2, v[i] = frand();
    for (uint32_t i = 0; i < hd / 2; i++)
        freq[i] = (float)pow(10000.0, -2.0 * i / hd);
}

/* n positions of random K and V, through a block table of bt tokens a
 * block, into the CPU pool vc (when cpu is set) and each of the n_vg GPU
 * pools vg: the same values in all. */
static void store_random_kv(kern_backend_t *cpu, const kern_kv_view_t *vc, kern_backend_t *gpu,
                            const kern_kv_view_t *const *vg, int n_vg, const int32_t *table, uint32_t bt, uint32_t n,
                            uint32_t nkv, uint32_t hd)
{
    const size_t ne = (size_t)n * nkv * hd;
    float *k = malloc(ne * 4), *v = malloc(ne * 4);
    int32_t *slots = malloc(n * 4);
    for (size_t i = 0; i < ne; i++)
        k[i] = frand(), v[i] = frand();
    for (uint32_t p = 0; p < n; p++)
        slots[p] = table[p / bt] * (int32_t)bt + (int32_t)(p % bt);
    float *dk = put(gpu, k, ne * 4), *dv = put(gpu, v, ne * 4);
    int32_t *dslots = put(gpu, slots, n * 4);
    if (cpu && cpu->ops->kv_store(cpu, vc, k, v, slots, n))
        exit(1);
    for (int i = 0; i < n_vg; i++)
        if (gpu->ops->kv_store(gpu, vg[i], dk, dv, dslots, n))
            exit(1);
    gpu->ops->sync(gpu);
    gpu->ops->free(gpu, dk), gpu->ops->free(gpu, dv), gpu->ops->free(gpu, dslots);
    free(k), free(v), free(slots);
}

/* The attention checks' batches: a mix of prompt and decode rows; many decode rows (one past KC_DEC_KS_CTX); many
 * decode rows at short contexts, read from device memory (attention_wide.cu's kernel); long prompts, fresh and
 * after a cached prefix, each many of the prompt kernels' tiles and blocks, the last ones part-filled */
enum { ATT_MIXED, ATT_MANY, ATT_WIDE, ATT_LONG };

/* rope_kv_attention against the two ops it stands for (rope_kv_store, then
 * attention), on two pools with the same history: decode rows of sequences
 * at several contexts (one of them split in slices), the sequences read from
 * device memory as a captured step reads them. The pools must come out bit
 * for bit the same, the outputs within rounding. many: 64 sequences at 2..312
 * positions and one at 700 instead (a large decode batch: with many KV heads,
 * thousands of blocks in the grid; a context past KC_DEC_KS_CTX, so the
 * decode kernel reads K through shared memory). */
static void check_rope_kv_attention(kern_backend_t *gpu, uint32_t nh, uint32_t nkv, uint32_t hd, td_kv_dtype_t dtype,
                                    kern_rope_style_t style, int mode)
{
    enum { MAXS = 64, BT = 16, NBMAX = 704, LAYERS = 2 };
    const bool many = mode != ATT_MIXED;
    const uint32_t few[] = {1, 18, 101, 301}, NS = many ? MAXS : 4, NB = many ? NBMAX : 32;
    uint32_t ctx[MAXS];
    for (uint32_t s = 0; s < NS; s++) /* wide: every context short (attention_wide.cu) */
        ctx[s] = many ? (s == MAXS - 1 && mode == ATT_MANY ? 700 : 2 + 5 * s) : few[s];
    td_kv_layout_t g = td_kv_layout_make("check", LAYERS, nkv, hd, BT, dtype);
    eng_kv_pool_t *pa, *pb;
    if (eng_kv_pool_create(gpu, &g, NB, NULL, &pa) || eng_kv_pool_create(gpu, &g, NB, NULL, &pb))
        exit(1);
    kern_kv_view_t va = eng_kv_view(pa, 1), vb = eng_kv_view(pb, 1);
    const size_t pool_bytes = (size_t)NB * td_kv_block_bytes(&g);
    uint8_t *zero = calloc(1, pool_bytes);
    if (gpu->ops->upload(gpu, va.base, zero, pool_bytes) || gpu->ops->upload(gpu, vb.base, zero, pool_bytes))
        exit(1);
    static int32_t tables[MAXS][NBMAX];
    int32_t slots[MAXS], pos[MAXS];
    uint32_t used = 0;
    kern_attn_seq_t seqs[MAXS];
    int32_t *dtab[MAXS];
    for (uint32_t s = 0; s < NS; s++) { /* each sequence on its own blocks, in reverse order */
        const uint32_t nbk = (ctx[s] + BT - 1) / BT;
        for (uint32_t i = 0; i < nbk; i++)
            tables[s][i] = (int32_t)(NB - 1 - used - i);
        used += nbk;
        pos[s] = (int32_t)ctx[s] - 1;
        slots[s] = tables[s][pos[s] / BT] * BT + pos[s] % BT;
        dtab[s] = put(gpu, tables[s], nbk * 4);
        seqs[s] = (kern_attn_seq_t){.row0 = s, .n = 1, .pos0 = (uint32_t)pos[s], .block_table = dtab[s],
                                    .n_blocks = nbk, .decode_from = UINT32_MAX};
        /* the history before the row: the same K and V in both pools */
        const kern_kv_view_t *both[2] = {&va, &vb};
        if (ctx[s] > 1)
            store_random_kv(NULL, NULL, gpu, both, 2, tables[s], BT, ctx[s] - 1, nkv, hd);
    }
    if (used > NB)
        exit(1);
    const size_t nq = (size_t)NS * nh * hd, nk = (size_t)NS * nkv * hd;
    float *q = malloc(nq * 4), *k = malloc(nk * 4), *v = malloc(nk * 4), freq[128];
    random_rope_rows(q, nq, k, v, nk, freq, hd);
    float *qa = put(gpu, q, nq * 4), *qb = put(gpu, q, nq * 4), *ka = put(gpu, k, nk * 4), *kb = put(gpu, k, nk * 4);
    float *dv = put(gpu, v, nk * 4), *dfreq = put(gpu, freq, sizeof freq), *oa, *ob;
    int32_t *dpos = put(gpu, pos, NS * sizeof *pos), *dslots = put(gpu, slots, NS * sizeof *slots);
    kern_attn_seq_t *dseqs = put(gpu, seqs, NS * sizeof *seqs);
    gpu->ops->alloc(gpu, nq * 4, (void **)&oa);
    gpu->ops->alloc(gpu, nq * 4, (void **)&ob);
    const float scale = 1.0f / sqrtf((float)hd);
    kern_rope_kv_t r = {.q = qb, .k = kb, .v = dv, .n_heads = nh, .n = NS, .slots = dslots, .pos = dpos,
                        .freq = dfreq, .style = style};
    if (gpu->ops->rope_kv_store(gpu, &va, qa, ka, dv, nh, dslots, NS, dpos, dfreq, style) ||
        gpu->ops->attention(gpu, &va, qa, oa, nh, seqs, dseqs, NS, scale) ||
        gpu->ops->rope_kv_attention(gpu, &vb, &r, ob, seqs, dseqs, NS, scale))
        exit(1);
    uint8_t *a = malloc(pool_bytes), *b = malloc(pool_bytes);
    float *ha = malloc(nq * 4), *hb = malloc(nq * 4);
    get(gpu, a, va.base, pool_bytes);
    get(gpu, b, vb.base, pool_bytes);
    const bool same = !memcmp(a, b, pool_bytes);
    get(gpu, ha, oa, nq * 4);
    get(gpu, hb, ob, nq * 4);
    const double e = rel_err(hb, ha, nq);
    failures += !same;
    char what[128];
    snprintf(what, sizeof what, "rope_kv_attention %u/%u heads x %u, %s KV, %s, %u seqs: pool %s; out", nh, nkv,
             hd, td_kv_dtype_name(dtype), style == KERN_ROPE_NEOX ? "neox" : "norm", NS, same ? "same" : "DIFFERS");
    report(what, e, 1e-6);
    for (uint32_t s = 0; s < NS; s++)
        gpu->ops->free(gpu, dtab[s]);
    gpu->ops->free(gpu, qa), gpu->ops->free(gpu, qb), gpu->ops->free(gpu, ka), gpu->ops->free(gpu, kb);
    gpu->ops->free(gpu, dv), gpu->ops->free(gpu, dfreq), gpu->ops->free(gpu, dpos), gpu->ops->free(gpu, dslots);
    gpu->ops->free(gpu, dseqs), gpu->ops->free(gpu, oa), gpu->ops->free(gpu, ob);
    free(zero), free(q), free(k), free(v), free(a), free(b), free(ha), free(hb);
    eng_kv_pool_destroy(pa), eng_kv_pool_destroy(pb);
}

/* rope_kv_store against the ops it stands for (rope on q, rope on k,
 * kv_store), both on the GPU (each checked against the CPU above): q, k and
 * the pool must come out bit for bit the same. */
static void check_rope_kv_store(kern_backend_t *gpu, uint32_t nh, uint32_t nkv, uint32_t hd, td_kv_dtype_t dtype,
                                kern_rope_style_t style)
{
    enum { N = 5, BT = 16, NB = 8, LAYERS = 2 };
    const int32_t pos[N] = {0, 3, 17, 100, 1000}, slots[N] = {5, 17, 40, 77, 127};
    td_kv_layout_t g = td_kv_layout_make("check", LAYERS, nkv, hd, BT, dtype);
    eng_kv_pool_t *pa, *pb;
    if (eng_kv_pool_create(gpu, &g, NB, NULL, &pa) || eng_kv_pool_create(gpu, &g, NB, NULL, &pb))
        exit(1);
    kern_kv_view_t va = eng_kv_view(pa, 1), vb = eng_kv_view(pb, 1);
    const size_t pool_bytes = (size_t)NB * td_kv_block_bytes(&g), nq = (size_t)N * nh * hd, nk = (size_t)N * nkv * hd;
    uint8_t *zero = calloc(1, pool_bytes);
    float *q = malloc(nq * 4), *k = malloc(nk * 4), *v = malloc(nk * 4), freq[128];
    random_rope_rows(q, nq, k, v, nk, freq, hd);
    if (gpu->ops->upload(gpu, va.base, zero, pool_bytes) || gpu->ops->upload(gpu, vb.base, zero, pool_bytes))
        exit(1);
    float *qa = put(gpu, q, nq * 4), *qb = put(gpu, q, nq * 4), *ka = put(gpu, k, nk * 4), *kb = put(gpu, k, nk * 4);
    float *dv = put(gpu, v, nk * 4), *dfreq = put(gpu, freq, sizeof freq);
    int32_t *dpos = put(gpu, pos, sizeof pos), *dslots = put(gpu, slots, sizeof slots);
    if (gpu->ops->rope(gpu, qa, N, nh, hd, dpos, dfreq, style) ||
        gpu->ops->rope(gpu, ka, N, nkv, hd, dpos, dfreq, style) ||
        gpu->ops->kv_store(gpu, &va, ka, dv, dslots, N) ||
        gpu->ops->rope_kv_store(gpu, &vb, qb, kb, dv, nh, dslots, N, dpos, dfreq, style))
        exit(1);
    uint8_t *a = malloc(pool_bytes), *b = malloc(pool_bytes);
    float *ha = malloc(nq * 4), *hb = malloc(nq * 4);
    get(gpu, a, va.base, pool_bytes);
    get(gpu, b, vb.base, pool_bytes);
    bool same = !memcmp(a, b, pool_bytes);
    get(gpu, ha, qa, nq * 4);
    get(gpu, hb, qb, nq * 4);
    same = same && !memcmp(ha, hb, nq * 4);
    get(gpu, ha, ka, nk * 4);
    get(gpu, hb, kb, nk * 4);
    same = same && !memcmp(ha, hb, nk * 4);
    failures += !same;
    printf("rope_kv_store %u/%u heads x %u, %s KV, %s: q, k and pool = rope, rope, kv_store's %s\n", nh, nkv, hd,
           td_kv_dtype_name(dtype), style == KERN_ROPE_NEOX ? "neox" : "norm", same ? "ok" : "FAIL");
    gpu->ops->free(gpu, qa), gpu->ops->free(gpu, qb), gpu->ops->free(gpu, ka), gpu->ops->free(gpu, kb);
    gpu->ops->free(gpu, dv), gpu->ops->free(gpu, dfreq), gpu->ops->free(gpu, dpos), gpu->ops->free(gpu, dslots);
    free(zero), free(q), free(k), free(v), free(a), free(b), free(ha), free(hb);
    eng_kv_pool_destroy(pa), eng_kv_pool_destroy(pb);
}

/* A prompt step's Q, K and V handed to the rope and the attention in fp16 (matmul_fused's to_next) against the same
 * step in fp32 (to_next off): n fresh rows of one sequence through Q/K/V, rope_kv_store, attention and the O
 * projection (which takes the attention's output in fp16 alone when handed), on two pools. The pools' K and V and
 * the projections must agree within fp16 rounding (the products are rounded before the rope). */
static void check_qkv_handed(kern_backend_t *gpu, uint32_t nh, uint32_t nkv, uint32_t hd, kern_rope_style_t style,
                             uint32_t n)
{
    enum { BT = 16, LAYERS = 1 };
    const uint32_t cols = 256, nb = (n + BT - 1) / BT, rows[4] = {nh * hd, nkv * hd, nkv * hd, cols};
    td_kv_layout_t g = td_kv_layout_make("check", LAYERS, nkv, hd, BT, TD_KV_F16);
    eng_kv_pool_t *pool[2];
    uint8_t *wd[4];
    kern_weight_t wg[4];
    for (int i = 0; i < 4; i++) { /* Q, K, V, and O: cols x (nh x hd) */
        const uint32_t r = i < 3 ? rows[i] : cols, c = i < 3 ? cols : nh * hd;
        wd[i] = random_weight(KERN_TYPE_F16, r, c);
        wg[i] = (kern_weight_t){KERN_TYPE_F16, r, c, wd[i], NULL, 0, NULL, 0, 0, 0};
        if (gpu->ops->weight_prepare(gpu, &wg[i]))
            exit(1);
    }
    const size_t nx = (size_t)n * cols, nq = (size_t)n * rows[0], nk = (size_t)n * rows[1];
    const size_t pool_bytes = (size_t)nb * td_kv_block_bytes(&g);
    float *x = malloc(nx * 4), *freq = malloc(hd / 2 * 4), *out[2], *proj[2];
    int32_t *table = malloc(nb * 4), *pos = malloc(n * 4), *slots = malloc(n * 4);
    for (size_t i = 0; i < nx; i++)
        x[i] = frand() * 2;
    for (uint32_t i = 0; i < hd / 2; i++)
        freq[i] = (float)pow(10000.0, -2.0 * i / hd);
    for (uint32_t i = 0; i < nb; i++)
        table[i] = (int32_t)(nb - 1 - i);
    for (uint32_t i = 0; i < n; i++)
        pos[i] = (int32_t)i, slots[i] = table[i / BT] * BT + (int32_t)(i % BT);
    float *dx = put(gpu, x, nx * 4), *dfreq = put(gpu, freq, hd / 2 * 4), *dq, *dk, *dv;
    int32_t *dtab = put(gpu, table, nb * 4), *dpos = put(gpu, pos, n * 4), *dslots = put(gpu, slots, n * 4);
    gpu->ops->alloc(gpu, nq * 4, (void **)&dq);
    gpu->ops->alloc(gpu, nk * 4, (void **)&dk);
    gpu->ops->alloc(gpu, nk * 4, (void **)&dv);
    const kern_attn_seq_t seq = {.row0 = 0, .n = n, .pos0 = 0, .block_table = dtab, .n_blocks = nb,
                                 .decode_from = UINT32_MAX};
    uint8_t *pb[2];
    float *ho[2];
    for (int v = 0; v < 2; v++) { /* 0: fp32, 1: handed in fp16 */
        if (eng_kv_pool_create(gpu, &g, nb, NULL, &pool[v]))
            exit(1);
        kern_kv_view_t kv = eng_kv_view(pool[v], 0);
        const kern_weight_t *w3[3] = {&wg[0], &wg[1], &wg[2]};
        float *y[3] = {dq, dk, dv};
        gpu->ops->alloc(gpu, nq * 4, (void **)&out[v]);
        gpu->ops->alloc(gpu, nx * 4, (void **)&proj[v]);
        const kern_weight_t *wo = &wg[3];
        if (gpu->ops->matmul_fused(gpu, &(kern_matmul_spec_t){.w = w3, .y = y, .k = 3, .x = dx, .n = n,
                                                              .to_next = v == 1}) ||
            gpu->ops->rope_kv_store(gpu, &kv, dq, dk, dv, nh, dslots, n, dpos, dfreq, style) ||
            gpu->ops->attention(gpu, &kv, dq, out[v], nh, &seq, NULL, 1, 1.0f / sqrtf((float)hd)) ||
            gpu->ops->matmul_fused(gpu, &(kern_matmul_spec_t){.w = &wo, .y = &proj[v], .k = 1, .x = out[v], .n = n}))
            exit(1);
        pb[v] = malloc(pool_bytes);
        ho[v] = malloc(nx * 4);
        get(gpu, pb[v], kv.base, pool_bytes);
        get(gpu, ho[v], proj[v], nx * 4);
    }
    /* the pools' fp16 values as floats, one against the other */
    const size_t nh16 = pool_bytes / 2;
    float *fa = malloc(nh16 * 4), *fb = malloc(nh16 * 4);
    for (size_t i = 0; i < nh16; i++) {
        uint16_t a, b;
        memcpy(&a, pb[0] + 2 * i, 2), memcpy(&b, pb[1] + 2 * i, 2);
        fa[i] = kern_fp16_to_fp32(a), fb[i] = kern_fp16_to_fp32(b);
    }
    char what[128];
    snprintf(what, sizeof what, "Q/K/V handed in fp16, %u/%u heads x %u, %s, %u rows: pool", nh, nkv, hd,
             style == KERN_ROPE_NEOX ? "neox" : "norm", n);
    const double pe = rel_err(fb, fa, nh16);
    report(what, pe, 2e-3);
    if (pe == 0) { /* K rounded before its rope changes some of its values: equal pools mean the fp32 path ran twice */
        failures++;
        printf("%-44s FAIL: the pools are bit for bit alike, so the handed path did not run\n", what);
    }
    snprintf(what, sizeof what, "Q/K/V handed in fp16, %u/%u heads x %u, %s, %u rows: O proj", nh, nkv, hd,
             style == KERN_ROPE_NEOX ? "neox" : "norm", n);
    report(what, rel_err(ho[1], ho[0], nx), 3e-3);
    for (int v = 0; v < 2; v++) {
        gpu->ops->free(gpu, out[v]);
        gpu->ops->free(gpu, proj[v]);
        eng_kv_pool_destroy(pool[v]);
        free(pb[v]), free(ho[v]);
    }
    for (int i = 0; i < 4; i++) {
        gpu->ops->weight_release(gpu, &wg[i]);
        free(wd[i]);
    }
    gpu->ops->free(gpu, dx), gpu->ops->free(gpu, dfreq), gpu->ops->free(gpu, dtab), gpu->ops->free(gpu, dpos);
    gpu->ops->free(gpu, dslots), gpu->ops->free(gpu, dq), gpu->ops->free(gpu, dk), gpu->ops->free(gpu, dv);
    free(x), free(freq), free(table), free(pos), free(slots), free(fa), free(fb);
}

static void check_embed(kern_backend_t *cpu, kern_backend_t *gpu, uint32_t type)
{
    enum { ROWS = 1000, COLS = 576, N = 9 };
    uint8_t *wdata = random_weight(type, ROWS, COLS);
    int32_t ids[N] = {0, 999, 5, 5, 123, 456, 789, 1, 998};
    static float yc[N * COLS], yg[N * COLS];
    kern_weight_t wc = {type, ROWS, COLS, wdata, NULL, 0, NULL, 0, 0, 0}, wg = wc;
    if (cpu->ops->weight_prepare(cpu, &wc) || cpu->ops->embed(cpu, &wc, ids, N, yc) ||
        gpu->ops->weight_prepare(gpu, &wg))
        exit(1);
    int32_t *dids = put(gpu, ids, sizeof ids);
    float *dy;
    gpu->ops->alloc(gpu, sizeof yg, (void **)&dy);
    if (gpu->ops->embed(gpu, &wg, dids, N, dy))
        exit(1);
    get(gpu, yg, dy, sizeof yg);
    char what[96];
    snprintf(what, sizeof what, "embed %s 1000 x 576, 9 ids", kern_type_info(type)->name);
    report(what, rel_err(yg, yc, N * COLS), 1e-3); /* rows kept as fp16 */
    gpu->ops->free(gpu, dids), gpu->ops->free(gpu, dy);
    gpu->ops->weight_release(gpu, &wg), cpu->ops->weight_release(cpu, &wc);
    free(wdata);
}

/* KV store and attention: a batch mixing prompts that continue a cached
 * prefix (two long enough for the tensor-core kernel, one of them ending in a
 * block of 8 rows), a fresh prompt and decode rows at several context lengths, each
 * sequence on its own shuffled blocks; the pools are compared byte for byte
 * after the stores, the attention outputs by relative error. many: instead 96
 * decode rows at 20..1160 positions (a large decode batch: with many KV heads,
 * thousands of blocks in the decode kernel's grid), whose blocks overlap
 * (later sequences' stores overwrite earlier ones' in both pools alike). */
static void check_attention(kern_backend_t *cpu, kern_backend_t *gpu, uint32_t nh, uint32_t nkv, uint32_t hd,
                            td_kv_dtype_t dtype, int mode)
{
    enum { MAXS = 128, BT = 16, NB = 192, LAYERS = 2 };
    const uint32_t mixed_pos0[] = {37, 700, 0, 15, 1500, 130}, mixed_n[] = {100, 1, 5, 1, 1, 200};
    const uint32_t long_pos0[] = {0, 517, 64, 1000, 30, 0}, long_n[] = {700, 333, 130, 16, 1, 64};
    const bool many = mode == ATT_MANY || mode == ATT_WIDE;
    const int NS = mode == ATT_WIDE ? MAXS : many ? 96 : 6;
    uint32_t pos0[MAXS], n[MAXS];
    const uint32_t *few_pos0 = mode == ATT_LONG ? long_pos0 : mixed_pos0, *few_n = mode == ATT_LONG ? long_n : mixed_n;
    for (int s = 0; s < NS; s++)
        pos0[s] = mode == ATT_WIDE ? 20 + 3 * (uint32_t)s : many ? 20 + 12 * (uint32_t)s : few_pos0[s % 6],
        n[s] = many ? 1 : few_n[s % 6];
    td_kv_layout_t g = td_kv_layout_make("check", LAYERS, nkv, hd, BT, dtype);
    eng_kv_pool_t *pc, *pg;
    if (eng_kv_pool_create(cpu, &g, NB, NULL, &pc) || eng_kv_pool_create(gpu, &g, NB, NULL, &pg))
        exit(1);
    int32_t perm[NB];
    static int32_t tables[MAXS][NB];
    for (int i = 0; i < NB; i++)
        perm[i] = i;
    for (int i = NB - 1; i > 0; i--) {
        int j = (int)((frand() + 1) / 2 * i), t = perm[i];
        perm[i] = perm[j], perm[j] = t;
    }
    uint32_t used = 0, rows = 0, nbk[MAXS];
    for (int s = 0; s < NS; s++) {
        nbk[s] = (pos0[s] + n[s] + BT - 1) / BT;
        for (uint32_t i = 0; i < nbk[s]; i++)
            tables[s][i] = perm[(used + i) % NB];
        used += nbk[s];
        rows += n[s];
    }
    if (used > NB && !many)
        exit(1);
    kern_kv_view_t vc = eng_kv_view(pc, 1), vg = eng_kv_view(pg, 1);
    size_t pool_bytes = (size_t)NB * td_kv_block_bytes(&g);
    uint8_t *zero = calloc(1, pool_bytes); /* what neither store writes compares equal */
    memcpy(vc.base, zero, pool_bytes);
    if (gpu->ops->upload(gpu, vg.base, zero, pool_bytes))
        exit(1);
    free(zero);
    /* every position's K and V, history first, then the rows of this step */
    const kern_kv_view_t *gpu_pool[1] = {&vg};
    for (int s = 0; s < NS; s++)
        store_random_kv(cpu, &vc, gpu, gpu_pool, 1, tables[s], BT, pos0[s] + n[s], nkv, hd);
    uint8_t *gp = malloc(pool_bytes);
    get(gpu, gp, vg.base, pool_bytes);
    bool same = !memcmp(gp, vc.base, pool_bytes);
    failures += !same;
    char what[128];
    snprintf(what, sizeof what, "kv_store %s: pools equal byte for byte", td_kv_dtype_name(dtype));
    printf("%-44s %s\n", what, same ? "ok" : "FAIL");
    free(gp);
    size_t nq = (size_t)rows * nh * hd;
    float *q = malloc(nq * 4), *oc = malloc(nq * 4), *og = malloc(nq * 4);
    for (size_t i = 0; i < nq; i++)
        q[i] = frand();
    kern_attn_seq_t sc[MAXS], sg[MAXS];
    int32_t *dtab[MAXS];
    uint32_t row = 0;
    for (int s = 0; s < NS; s++) {
        dtab[s] = put(gpu, tables[s], nbk[s] * 4);
        sc[s] = (kern_attn_seq_t){.row0 = row, .n = n[s], .pos0 = pos0[s], .block_table = tables[s],
                                  .n_blocks = nbk[s], .decode_from = UINT32_MAX};
        sg[s] = sc[s];
        sg[s].block_table = dtab[s];
        row += n[s];
    }
    float *dq = put(gpu, q, nq * 4), *dout;
    gpu->ops->alloc(gpu, nq * 4, (void **)&dout);
    float scale = 1.0f / sqrtf((float)hd);
    /* wide: the sequences also in device memory, as a captured decode step gives them (every row a decode row,
     * a short context, many (sequence, KV head) pairs: attention_wide.cu's kernel) */
    kern_attn_seq_t *dsg = mode == ATT_WIDE ? put(gpu, sg, NS * sizeof *sg) : NULL;
    if (cpu->ops->attention(cpu, &vc, q, oc, nh, sc, NULL, NS, scale) ||
        gpu->ops->attention(gpu, &vg, dq, dout, nh, sg, dsg, NS, scale))
        exit(1);
    get(gpu, og, dout, nq * 4);
    snprintf(what, sizeof what, "attention %u/%u heads x %u, %s KV, %d seqs to %u%s", nh, nkv, hd,
             td_kv_dtype_name(dtype), NS, many ? pos0[NS - 1] + 1 : mode == ATT_LONG ? 1016 : 1501,
             mode == ATT_WIDE ? " (wide)" : mode == ATT_LONG ? " (long prompts)" : "");
    if (dsg)
        gpu->ops->free(gpu, dsg);
    /* fp16 and fp8 KV: prompt rows go through the tensor cores, P (and fp8's values times their scale) rounded to
     * fp16 */
    report(what, rel_err(og, oc, nq), dtype == TD_KV_F32 ? 1e-4 : 3e-3);
    for (int s = 0; s < NS; s++)
        gpu->ops->free(gpu, dtab[s]);
    gpu->ops->free(gpu, dq), gpu->ops->free(gpu, dout);
    free(q), free(oc), free(og);
    eng_kv_pool_destroy(pc), eng_kv_pool_destroy(pg);
}

/* Runs tokens through a model on a backend as two steps (a prompt, then its
 * continuation over the cached prefix) and keeps every row's logits. */
/* n rows' logits: the first split rows in one step, the rest in another (split 0: one row a step) */
static float *model_logits(const eng_model_t *m, kern_backend_t *be, td_kv_dtype_t dtype, const int32_t *ids,
                           uint32_t n, uint32_t split)
{
    td_kv_layout_t g = td_kv_layout_make(m->desc.name, m->desc.n_layers, m->desc.n_kv_heads, m->desc.head_dim, 16, dtype);
    uint32_t nb = (n + 15) / 16;
    eng_kv_pool_t *pool;
    eng_forward_t *f;
    if (eng_kv_pool_create(be, &g, nb + 2, NULL, &pool) || eng_forward_create(m, be, pool, n, n, &f)) {
        fprintf(stderr, "tandem-cuda-check: %s\n", td_last_error());
        exit(1);
    }
    int32_t table[256];
    for (uint32_t i = 0; i < nb; i++)
        table[i] = (int32_t)(nb - 1 - i); /* not in order */
    float *out = malloc((size_t)n * m->desc.vocab * 4);
    uint32_t at = 0;
    for (int step = 0; at < n; step++) {
        uint32_t k = !split ? 1 : step ? n - split : split; /* split 0: a row a step */
        eng_batch_seq_t s = {.tokens = ids + at, .n = k, .pos0 = at, .block_table = table, .n_blocks = nb,
                             .all_logits = true};
        const float *lg;
        uint32_t nl;
        if (eng_forward_run(f, &s, 1, &lg, &nl)) {
            fprintf(stderr, "tandem-cuda-check: %s\n", td_last_error());
            exit(1);
        }
        memcpy(out + (size_t)at * m->desc.vocab, lg, (size_t)nl * m->desc.vocab * 4);
        at += k;
    }
    eng_forward_destroy(f);
    eng_kv_pool_destroy(pool);
    return out;
}

static uint32_t argmax(const float *x, uint32_t n)
{
    uint32_t b = 0;
    for (uint32_t i = 1; i < n; i++)
        if (x[i] > x[b])
            b = i;
    return b;
}

/* A model on both backends: every row's logits, and whether the greedy
 * choices agree. */
static bool dummy_weights; /* --dummy: the models' weights are the dummy load format's seeded values */

static eng_model_t *open_model(const char *path, eng_weight_hold_t hold)
{
    eng_model_t *m;
    if (eng_model_open(path, &m)) {
        fprintf(stderr, "tandem-cuda-check: %s\n", td_last_error());
        exit(1);
    }
    eng_model_set_hold(m, hold);
    eng_model_set_dummy(m, dummy_weights);
    return m;
}

/* FP8 weights against the file's on the GPU (the quality FP8 costs): 48 rows' logits, relative error and greedy
 * agreement, printed (random weights move further than trained ones: SmolLM2's perplexity states the cost) */
static void fp8_quality(kern_backend_t *gpu, const char *path, const int32_t *ids, int n, int split,
                        const float *l8)
{
    eng_model_t *m = open_model(path, ENG_WEIGHTS_FILE);
    float *l16 = model_logits(m, gpu, TD_KV_F16, ids, n, split);
    uint32_t agree = 0;
    for (int r = 0; r < n; r++)
        agree += argmax(l16 + (size_t)r * m->desc.vocab, m->desc.vocab) ==
                 argmax(l8 + (size_t)r * m->desc.vocab, m->desc.vocab);
    printf("model %s: fp8 vs fp16 weights on the gpu: logits rel err %.2e, greedy token equal at %u of %d rows "
           "(a statement of quality, not a check: correctness is the fp8 model's against the cpu's)\n",
           m->desc.name, rel_err(l8, l16, (size_t)n * m->desc.vocab), agree, n);
    free(l16);
    eng_model_close(m);
}

static void check_model(kern_backend_t *cpu, kern_backend_t *gpu, const char *path, eng_weight_hold_t hold,
                        td_kv_dtype_t kvd)
{
    eng_model_t *m = open_model(path, hold);
    enum { N = 48, SPLIT = 29 };
    int32_t ids[N];
    for (int i = 0; i < N; i++)
        ids[i] = (int32_t)(((frand() + 1) / 2) * (m->desc.vocab - 1));
    const bool f8 = hold == ENG_WEIGHTS_FP8;
    /* FP8: one row a step, as batch-1 decode runs (the GEMV, fp32 activations: the CPU's arithmetic); steps of
     * more rows put the activations in FP8 too (gemm_fp8.cu), which the ops' checks hold against their reference */
    float *lc = model_logits(m, cpu, kvd, ids, N, SPLIT), *lg = model_logits(m, gpu, kvd, ids, N, f8 ? 0 : SPLIT);
    uint32_t agree = 0;
    for (int r = 0; r < N; r++)
        agree += argmax(lc + (size_t)r * m->desc.vocab, m->desc.vocab) ==
                 argmax(lg + (size_t)r * m->desc.vocab, m->desc.vocab);
    char what[200];
    const char *h = f8 ? " (fp8, a row a step)" : kvd == TD_KV_F8_E4M3 ? " (fp8_e4m3 KV)" : "";
    snprintf(what, sizeof what, "model %s%s: 48 rows' logits vs cpu", m->desc.name, h);
    /* fp8 KV: a K or V value the two backends compute a little apart (fp16 weights here, Q4_1 with 8-bit
     * activations there) takes another code where it lies near the edge between two (3 bits of mantissa, steps of
     * 1/8 to 1/16): the ops store the same codes from the same values (kv_store above), the models differ more
     * (SmolLM2, H100: 5.4e-2, against 1.5e-2 with fp16 KV) */
    report(what, rel_err(lg, lc, (size_t)N * m->desc.vocab), kvd == TD_KV_F8_E4M3 ? 8e-2 : 3e-2);
    printf("model %s%s: greedy token equal to the cpu's at %u of %d rows\n", m->desc.name, h, agree, N);
    if (f8) {
        float *l2 = model_logits(m, gpu, TD_KV_F16, ids, N, SPLIT);
        printf("model %s (fp8): steps of 29 and 19 rows (FP8 activations) vs a row a step: logits rel err %.2e\n",
               m->desc.name, rel_err(l2, lg, (size_t)N * m->desc.vocab));
        free(l2);
        fp8_quality(gpu, path, ids, N, 0, lg);
    }
    free(lc), free(lg);
    eng_model_close(m);
}

/* Tensor parallelism on one GPU (engine/tp.h: both ranks on this device, their all-reduce the comm in memory, NCCL
 * taking only a GPU a rank): the model split over 2 ranks against one rank on the same GPU, every row's logits of
 * a prompt step and its continuation. What it checks is the CUDA backend's part of the split (its matrices cut by
 * rows and columns, the pool of parts, the ranks' sums); NCCL itself needs two GPUs. */
static void check_tp_one_gpu(kern_backend_t *gpu, const char *path)
{
    eng_model_t *m = open_model(path, ENG_WEIGHTS_FILE);
    enum { N = 40, SPLIT = 25 };
    int32_t ids[N], table[8];
    for (int i = 0; i < N; i++)
        ids[i] = (int32_t)(((frand() + 1) / 2) * (m->desc.vocab - 1));
    float *l1 = model_logits(m, gpu, TD_KV_F16, ids, N, SPLIT), *l2 = malloc((size_t)N * m->desc.vocab * 4);
    const uint32_t nb = (N + 15) / 16;
    td_kv_layout_t g = td_kv_layout_make(m->desc.name, m->desc.n_layers, m->desc.n_kv_heads, m->desc.head_dim, 16,
                                         TD_KV_F16);
    g.tp = 2;
    eng_tp_set_t t;
    if (eng_tp_open(m, 2, "cuda:0,0", 0, KERN_NUMERICS_FAST, &g, nb + 2, NULL, N, N, &t)) {
        fprintf(stderr, "tandem-cuda-check: %s\n", td_last_error());
        exit(1);
    }
    for (uint32_t i = 0; i < nb; i++)
        table[i] = (int32_t)(nb - 1 - i);
    for (uint32_t at = 0, step = 0; at < N; step++) {
        const uint32_t k = step ? N - SPLIT : SPLIT;
        eng_batch_seq_t sq = {.tokens = ids + at, .n = k, .pos0 = at, .block_table = table, .n_blocks = nb,
                              .all_logits = true};
        const float *lg;
        uint32_t nl;
        if (eng_tp_run(t.fwd, &sq, 1, &lg, &nl)) {
            fprintf(stderr, "tandem-cuda-check: %s\n", td_last_error());
            exit(1);
        }
        memcpy(l2 + (size_t)at * m->desc.vocab, lg, (size_t)nl * m->desc.vocab * 4);
        at += k;
    }
    uint32_t agree = 0;
    for (int r = 0; r < N; r++)
        agree += argmax(l1 + (size_t)r * m->desc.vocab, m->desc.vocab) ==
                 argmax(l2 + (size_t)r * m->desc.vocab, m->desc.vocab);
    char what[200];
    snprintf(what, sizeof what, "tp 2 on one gpu, %s: %d rows' logits vs one rank (greedy equal at %u)", m->desc.name, N,
             agree);
    /* fp16 GEMMs of other shapes (cuBLAS may pick other algorithms) and the ranks' sums in another order */
    report(what, rel_err(l2, l1, (size_t)N * m->desc.vocab), 5e-3);
    /* rank 0 picks on the GPU from the rows the comm gathered (eng_tp_run_sampled): greedy, the host's argmax of the
     * same step's rows; with a mask allowing one token, that token. The step is run three times at one position:
     * each writes the same KV. */
    const int32_t next = (int32_t)argmax(l2 + (size_t)(N - 1) * m->desc.vocab, m->desc.vocab), allowed = ids[0];
    eng_batch_seq_t one = {.tokens = &next, .n = 1, .pos0 = N, .block_table = table, .n_blocks = nb,
                           .want_logits = true};
    const size_t mb = ((size_t)m->desc.vocab + 7) / 8;
    uint8_t *mask = calloc(1, mb);
    mask[allowed / 8] |= (uint8_t)(1u << (allowed % 8));
    const kern_sample_t greedy = {0}, masked = {.masked = 1};
    const float *lg = NULL;
    uint32_t nl = 0, np1 = 0, np2 = 0;
    int32_t pick = -1, only = -1;
    const bool can = eng_tp_can_sample(t.fwd);
    const bool ran = can && !eng_tp_run(t.fwd, &one, 1, &lg, &nl) && nl == 1 &&
                     !eng_tp_run_sampled(t.fwd, &one, 1, &greedy, NULL, &pick, &np1) && np1 == 1 &&
                     !eng_tp_run_sampled(t.fwd, &one, 1, &masked, mask, &only, &np2) && np2 == 1;
    const int32_t host = ran ? (int32_t)argmax(lg, m->desc.vocab) : -1;
    const bool same = ran && pick == host && only == allowed;
    failures += !same;
    printf("tp 2 on one gpu, %s: rank 0 picks %s (greedy %d, the host's argmax %d; masked to %d: %d)%s%s\n",
           m->desc.name, same ? "ok" : "FAIL", pick, host, allowed, only, can ? "" : " — rank 0 cannot pick",
           ran || !can ? "" : td_last_error());
    free(mask);
    eng_tp_close(&t);
    free(l1), free(l2);
    eng_model_close(m);
}

/* fp8_quality alone, for a model too large for the CPU backend's turn */
static void check_fp8_model(kern_backend_t *gpu, const char *path)
{
    eng_model_t *m = open_model(path, ENG_WEIGHTS_FP8);
    enum { N = 48, SPLIT = 29 };
    int32_t ids[N];
    for (int i = 0; i < N; i++)
        ids[i] = (int32_t)(((frand() + 1) / 2) * (m->desc.vocab - 1));
    float *l8 = model_logits(m, gpu, TD_KV_F16, ids, N, 0);
    fp8_quality(gpu, path, ids, N, 0, l8);
    free(l8);
    eng_model_close(m);
}

/* Decode steps through captured graphs: three sequences, a prompt step,
 * then 8 decode steps (the first of a batch size runs as is, the second is
 * captured, the rest replay): their logits must equal, bit for bit, the same
 * steps run without graphs, and match the CPU backend's; the GPU's greedy
 * picks (sample, inside the graph) must be the argmax of those logits. */
static void graph_steps(const eng_model_t *m, kern_backend_t *be, td_kv_dtype_t kvd, const int32_t *ids, bool sampled,
                        float *logits, int32_t *picks)
{
    enum { S = 3, P = 9, STEPS = 8 };
    td_kv_layout_t g = td_kv_layout_make(m->desc.name, m->desc.n_layers, m->desc.n_kv_heads, m->desc.head_dim, 16,
                                         kvd);
    eng_kv_pool_t *pool;
    eng_forward_t *f;
    if (eng_kv_pool_create(be, &g, 3 * S, NULL, &pool) || eng_forward_create(m, be, pool, 64, S, &f)) {
        fprintf(stderr, "tandem-cuda-check: %s\n", td_last_error());
        exit(1);
    }
    int32_t table[S][2] = {{4, 1}, {0, 7}, {5, 2}};
    eng_batch_seq_t b[S];
    kern_sample_t greedy[S] = {{0}};
    for (uint32_t step = 0; step <= STEPS; step++) {
        for (int q = 0; q < S; q++) {
            uint32_t at = step ? P + step - 1 : 0;
            b[q] = (eng_batch_seq_t){.tokens = ids + q * 32 + at, .n = step ? 1 : P, .pos0 = at,
                                     .block_table = table[q], .n_blocks = 2, .want_logits = true};
        }
        const float *lg;
        uint32_t nl;
        td_status_t rc = sampled && step ? eng_forward_run_sampled(f, b, S, greedy, NULL, picks + (step - 1) * S, &nl)
                                         : eng_forward_run(f, b, S, &lg, &nl);
        if (rc) {
            fprintf(stderr, "tandem-cuda-check: %s\n", td_last_error());
            exit(1);
        }
        if (step && !sampled)
            memcpy(logits + (size_t)(step - 1) * S * m->desc.vocab, lg, (size_t)S * m->desc.vocab * 4);
    }
    eng_forward_destroy(f);
    eng_kv_pool_destroy(pool);
}

static void check_graph(kern_backend_t *cpu, kern_backend_t *gpu, const char *path, eng_weight_hold_t hold,
                        td_kv_dtype_t kvd)
{
    enum { S = 3, STEPS = 8 };
    eng_model_t *m = open_model(path, hold);
    size_t V = m->desc.vocab, nlog = (size_t)STEPS * S * V;
    int32_t ids[S * 32], picks[STEPS * S];
    for (int i = 0; i < S * 32; i++)
        ids[i] = (int32_t)(((frand() + 1) / 2) * (V - 1));
    float *lg = malloc(nlog * 4), *le = malloc(nlog * 4), *lc = malloc(nlog * 4);
    graph_steps(m, gpu, kvd, ids, false, lg, NULL);
    const kern_backend_ops_t *ops = gpu->ops; /* the same backend with its graphs turned off */
    kern_backend_ops_t eager = *ops;
    eager.supported &= ~(uint32_t)KERN_OP_GRAPH;
    gpu->ops = &eager;
    graph_steps(m, gpu, kvd, ids, false, le, NULL);
    gpu->ops = ops;
    graph_steps(m, gpu, kvd, ids, true, NULL, picks);
    graph_steps(m, cpu, kvd, ids, false, lc, NULL);
    int same = !memcmp(lg, le, nlog * 4), argmax_ok = 0;
    for (int r = 0; r < STEPS * S; r++)
        argmax_ok += picks[r] == (int32_t)argmax(le + (size_t)r * V, (uint32_t)V);
    printf("graphs %s, %s KV: 8 decode steps of 3 sequences replayed %s the uncaptured steps; greedy on the GPU = "
           "argmax at %d of %d %s\n",
           m->desc.name, td_kv_dtype_name(kvd), same ? "bit-identical to" : "DIFFERENT from", argmax_ok, STEPS * S,
           same && argmax_ok == STEPS * S ? "ok" : "FAIL");
    failures += !same || argmax_ok != STEPS * S;
    char what[200];
    snprintf(what, sizeof what, "graphs %s, %s KV: decode logits vs cpu", m->desc.name, td_kv_dtype_name(kvd));
    /* the CPU's Q4_1/Q8_0 matmuls take 8-bit activation blocks: SmolLM2's decode rows 1.0-3.5e-2 from the GPU's;
     * FP8 matrices take FP8 activations here (three rows a step): compared with the CPU by check_model, a row a
     * step */
    if (hold == ENG_WEIGHTS_FP8)
        printf("%s (fp8, FP8 activations): rel err %.2e\n", what, rel_err(lg, lc, nlog));
    else
        report(what, rel_err(lg, lc, nlog), 5e-2);
    free(lg), free(le), free(lc);
    eng_model_close(m);
}

/* A Hugging Face directory against the logits transformers computed for it
 * (tests/fixtures/hf/make_logits_hf.py: ids, first_row, logits[rows][vocab]). */
static void check_hf(kern_backend_t *gpu, const char *dir, const char *json_path)
{
    json_error_t err;
    json_t *ref = json_load_file(json_path, 0, &err);
    eng_model_t *m;
    if (!ref || eng_model_open(dir, &m)) {
        fprintf(stderr, "tandem-cuda-check: %s: %s\n", ref ? dir : json_path, ref ? td_last_error() : err.text);
        exit(1);
    }
    json_t *jids = json_object_get(ref, "ids"), *rows = json_object_get(ref, "logits");
    uint32_t n = (uint32_t)json_array_size(jids), first = (uint32_t)json_integer_value(json_object_get(ref, "first_row"));
    int32_t ids[256];
    for (uint32_t i = 0; i < n && i < 256; i++)
        ids[i] = (int32_t)json_integer_value(json_array_get(jids, i));
    float *lg = model_logits(m, gpu, TD_KV_F32, ids, n, n / 2);
    double d = 0, q = 0;
    for (size_t r = 0; r < json_array_size(rows); r++)
        for (size_t v = 0; v < json_array_size(json_array_get(rows, r)); v++) {
            double want = json_real_value(json_array_get(json_array_get(rows, r), v));
            double got = lg[(first + r) * m->desc.vocab + v];
            d += (got - want) * (got - want), q += want * want;
        }
    const char *dt = json_string_value(json_object_get(ref, "dtype"));
    char what[160];
    snprintf(what, sizeof what, "hf %s vs transformers %s", m->desc.name, dt ? dt : "fp32");
    /* fp16 weights and GEMM inputs here; a bf16 reference is itself off from
     * fp32 by vs_fp32 (make_logits_hf.py measures it), the bound allows 1.5x that */
    double vs32 = json_real_value(json_object_get(ref, "vs_fp32"));
    double e = sqrt(d / (q + 1e-300)), bound = !dt ? 5e-3 : !strcmp(dt, "bf16") ? fmax(3e-2, 1.5 * vs32) : 1e-2;
    report(what, e, bound);
    if (vs32 > 0)
        printf("  (transformers %s itself vs its fp32: rel err %.2e)\n", dt, vs32);
    free(lg);
    json_decref(ref);
    eng_model_close(m);
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

double kern_cuda_probe_read_gbs(size_t bytes); /* probe.cu */

/* One layer's attention: ns sequences of n rows after pos0 cached
 * positions, fp16 KV on contiguous blocks; FLOPs counted causally. The pool
 * holds `layers` layers (a block holds every layer's rows, the engine's
 * layout); the middle one is timed. */
static void time_attention(kern_backend_t *gpu, uint32_t nh, uint32_t nkv, uint32_t hd, uint32_t ns, uint32_t n,
                           uint32_t pos0, uint32_t layers)
{
    enum { BT = 16 };
    uint32_t per = (pos0 + n + BT - 1) / BT, nb = per * ns, rows = ns * n;
    td_kv_layout_t g = td_kv_layout_make("timing", layers, nkv, hd, BT, TD_KV_F16);
    eng_kv_pool_t *pool;
    if (eng_kv_pool_create(gpu, &g, nb, NULL, &pool))
        exit(1);
    kern_kv_view_t kv = eng_kv_view(pool, layers / 2);
    int32_t *tab = malloc(nb * 4);
    for (uint32_t i = 0; i < nb; i++)
        tab[i] = (int32_t)i;
    int32_t *dtab = put(gpu, tab, nb * 4);
    kern_attn_seq_t *seqs = malloc(ns * sizeof *seqs);
    for (uint32_t s = 0; s < ns; s++)
        seqs[s] = (kern_attn_seq_t){.row0 = s * n, .n = n, .pos0 = pos0, .block_table = dtab + s * per,
                                    .n_blocks = per, .decode_from = UINT32_MAX};
    float *q, *out;
    gpu->ops->alloc(gpu, (size_t)rows * nh * hd * 4, (void **)&q);
    gpu->ops->alloc(gpu, (size_t)rows * nh * hd * 4, (void **)&out);
    cudaMemset(q, 0, (size_t)rows * nh * hd * 4);
    cudaMemset(kv.base, 0, (size_t)nb * td_kv_block_bytes(&g));
    gpu->ops->attention(gpu, &kv, q, out, nh, seqs, NULL, ns, 0.1f);
    gpu->ops->sync(gpu);
    int reps = 10;
    double t0 = now_s();
    for (int i = 0; i < reps; i++)
        gpu->ops->attention(gpu, &kv, q, out, nh, seqs, NULL, ns, 0.1f);
    gpu->ops->sync(gpu);
    double dt = (now_s() - t0) / reps;
    /* causal: row i of a sequence sees pos0 + i + 1 positions; 4 FLOPs per (row, head, position, dim) */
    double pairs = (double)ns * ((double)n * pos0 + (double)n * (n + 1) / 2);
    double flops = 4.0 * pairs * nh * hd, bytes = 2.0 * ns * (pos0 + n) * nkv * hd * 2;
    printf("timing attention %u/%u heads x %u, %u seqs x %u rows after %u, %u-layer pool: %.3f ms = %.1f TFLOP/s, KV "
           "%.0f GB/s\n", nh, nkv, hd, ns, n, pos0, layers, dt * 1e3, flops / dt / 1e12, bytes / dt / 1e9);
    gpu->ops->free(gpu, q), gpu->ops->free(gpu, out), gpu->ops->free(gpu, dtab);
    free(tab), free(seqs);
    eng_kv_pool_destroy(pool);
}

/* The prompt kernels at Llama-2-7B's heads: fresh prompts of 1k, 4k and 16k rows, 1k rows after a 3k prefix */
static void time_prompt_attention(kern_backend_t *gpu)
{
    time_attention(gpu, 32, 32, 128, 1, 4096, 0, 1);
    time_attention(gpu, 32, 32, 128, 1, 1024, 0, 1);
    time_attention(gpu, 32, 32, 128, 1, 16384, 0, 1);
    time_attention(gpu, 32, 32, 128, 1, 1024, 3072, 1);
}

/* A backend that times each compute op of another (synchronizing before and
 * after it), for --time-model's breakdown. */
enum { OP_MATMUL, OP_MULTI, OP_RMSNORM, OP_ROPE, OP_SWIGLU, OP_ADD, OP_EMBED, OP_KV, OP_ATTN, OP_COPY, OP_XFER,
       OP_FUSED_QKV, OP_FUSED_O, OP_FUSED_GU, OP_FUSED_DOWN, OP_FUSED_OUT, OP_ROPE_KV, OP_N };
static const char *const op_names[OP_N] = {"matmul", "matmul_multi", "rmsnorm", "rope", "swiglu", "add",
                                          "embed", "kv_store", "attention", "copy", "upload/download",
                                          "fused Q/K/V (norm in)", "fused O (+residual)", "fused gate/up (norm, SwiGLU)",
                                          "fused down (+residual)", "fused output", "rope_kv_store"};
typedef struct timed_be {
    kern_backend_t base;
    kern_backend_t *in;
    double t[OP_N];
} timed_be_t;
static timed_be_t g_timed;
static double t_begin(void)
{
    g_timed.in->ops->sync(g_timed.in);
    return now_s();
}
static td_status_t t_end(int op, double t0, td_status_t rc)
{
    g_timed.in->ops->sync(g_timed.in);
    g_timed.t[op] += now_s() - t0;
    return rc;
}
#define IN g_timed.in
static void t_destroy(kern_backend_t *b) { (void)b; }
static td_status_t t_alloc(kern_backend_t *b, size_t n, void **p) { (void)b; return IN->ops->alloc(IN, n, p); }
static void t_free(kern_backend_t *b, void *p) { (void)b; IN->ops->free(IN, p); }
static td_status_t t_halloc(kern_backend_t *b, size_t n, void **p) { (void)b; return IN->ops->host_alloc(IN, n, p); }
static void t_hfree(kern_backend_t *b, void *p) { (void)b; IN->ops->host_free(IN, p); }
static td_status_t t_upload(kern_backend_t *b, void *d, const void *s, size_t n)
{ (void)b; double t = t_begin(); return t_end(OP_XFER, t, IN->ops->upload(IN, d, s, n)); }
static td_status_t t_download(kern_backend_t *b, void *d, const void *s, size_t n)
{ (void)b; double t = t_begin(); return t_end(OP_XFER, t, IN->ops->download(IN, d, s, n)); }
static td_status_t t_copy(kern_backend_t *b, void *d, const void *s, size_t n)
{ (void)b; double t = t_begin(); return t_end(OP_COPY, t, IN->ops->copy(IN, d, s, n)); }
static td_status_t t_sync(kern_backend_t *b) { (void)b; return IN->ops->sync(IN); }
static td_status_t t_wprep(kern_backend_t *b, kern_weight_t *w) { (void)b; return IN->ops->weight_prepare(IN, w); }
static void t_wrel(kern_backend_t *b, kern_weight_t *w) { (void)b; IN->ops->weight_release(IN, w); }
static td_status_t t_join(kern_backend_t *b, kern_weight_t *const *w, uint32_t k)
{ (void)b; return IN->ops->weights_join(IN, w, k); }
static td_status_t t_matmul(kern_backend_t *b, const kern_weight_t *w, const float *x, float *y, uint32_t n)
{ (void)b; double t = t_begin(); return t_end(OP_MATMUL, t, IN->ops->matmul(IN, w, x, y, n)); }
static td_status_t t_multi(kern_backend_t *b, const kern_weight_t *const *w, float *const *y, uint32_t k, const float *x,
                           uint32_t n)
{ (void)b; double t = t_begin(); return t_end(OP_MULTI, t, IN->ops->matmul_multi(IN, w, y, k, x, n)); }
static td_status_t t_rmsnorm(kern_backend_t *b, const float *x, const float *w, float *y, uint32_t n, uint32_t d, float e)
{ (void)b; double t = t_begin(); return t_end(OP_RMSNORM, t, IN->ops->rmsnorm(IN, x, w, y, n, d, e)); }
static td_status_t t_rope(kern_backend_t *b, float *x, uint32_t n, uint32_t h, uint32_t hd, const int32_t *pos,
                          const float *f, kern_rope_style_t st)
{ (void)b; double t = t_begin(); return t_end(OP_ROPE, t, IN->ops->rope(IN, x, n, h, hd, pos, f, st)); }
static td_status_t t_swiglu(kern_backend_t *b, const float *g, const float *u, float *y, size_t n)
{ (void)b; double t = t_begin(); return t_end(OP_SWIGLU, t, IN->ops->swiglu(IN, g, u, y, n)); }
static td_status_t t_add(kern_backend_t *b, float *x, const float *y, size_t n)
{ (void)b; double t = t_begin(); return t_end(OP_ADD, t, IN->ops->add(IN, x, y, n)); }
static td_status_t t_embed(kern_backend_t *b, const kern_weight_t *w, const int32_t *ids, uint32_t n, float *o)
{ (void)b; double t = t_begin(); return t_end(OP_EMBED, t, IN->ops->embed(IN, w, ids, n, o)); }
static td_status_t t_kv(kern_backend_t *b, const kern_kv_view_t *kv, const float *k, const float *v, const int32_t *sl,
                        uint32_t n)
{ (void)b; double t = t_begin(); return t_end(OP_KV, t, IN->ops->kv_store(IN, kv, k, v, sl, n)); }
static td_status_t t_attn(kern_backend_t *b, const kern_kv_view_t *kv, const float *q, float *o, uint32_t h,
                          const kern_attn_seq_t *s, const kern_attn_seq_t *ds, uint32_t ns, float sc)
{ (void)b; double t = t_begin(); return t_end(OP_ATTN, t, IN->ops->attention(IN, kv, q, o, h, s, ds, ns, sc)); }
/* the fused matmul, timed by what it multiplies: Q/K/V (3 weights), gate/up (glu), the output matrix (vocabulary
 * rows), the others by their width (O: the attention's, down: the FFN's) */
static td_status_t t_fused(kern_backend_t *b, const kern_matmul_spec_t *s)
{
    (void)b;
    const int op = s->k == 3 ? OP_FUSED_QKV : s->glu ? OP_FUSED_GU : s->w[0]->rows > 4 * s->w[0]->cols ? OP_FUSED_OUT
                   : s->w[0]->cols > s->w[0]->rows                                                  ? OP_FUSED_DOWN
                                                                                                     : OP_FUSED_O;
    double t = t_begin();
    return t_end(op, t, g_timed.in->ops->matmul_fused(g_timed.in, s));
}
static td_status_t t_rope_kv(kern_backend_t *b, const kern_kv_view_t *kv, float *q, float *k, const float *v,
                             uint32_t h, const int32_t *sl, uint32_t n, const int32_t *pos, const float *f,
                             kern_rope_style_t st)
{
    (void)b;
    double t = t_begin();
    return t_end(OP_ROPE_KV, t, g_timed.in->ops->rope_kv_store(g_timed.in, kv, q, k, v, h, sl, n, pos, f, st));
}
static void *t_queue(kern_backend_t *b) { (void)b; return IN->ops->queue(IN); }
static td_status_t t_digest(kern_backend_t *b, const void *base, size_t bb, const int32_t *bl, uint32_t n, uint64_t *o)
{ (void)b; return IN->ops->kv_digest(IN, base, bb, bl, n, o); }
#undef IN
static const kern_backend_ops_t timed_ops = {
    .name = "timed", .supported = KERN_OPS_ALL | KERN_OP_MATMUL_FUSED | KERN_OP_ROPE_KV_STORE, .kv_dtypes = (1u << TD_KV_F32) | (1u << TD_KV_F16), .destroy = t_destroy, .alloc = t_alloc, .free = t_free,
    .host_alloc = t_halloc, .host_free = t_hfree,
    .upload = t_upload, .download = t_download, .copy = t_copy, .sync = t_sync, .queue = t_queue,
    .kv_digest = t_digest, .weight_prepare = t_wprep,
    .weight_release = t_wrel, .weights_join = t_join, .matmul = t_matmul, .matmul_multi = t_multi, .rmsnorm = t_rmsnorm, .rope = t_rope,
    .swiglu = t_swiglu, .add = t_add, .embed = t_embed, .kv_store = t_kv, .attention = t_attn,
    .matmul_fused = t_fused, .rope_kv_store = t_rope_kv};

/* Seconds per decode step of one sequence over positions from pos_first on:
 * `warm` steps first (the first runs as is, the second is captured), then
 * `steps` timed. */
static double decode_step_s(eng_forward_t *f, int32_t *ids, int32_t *table, uint32_t nb, uint32_t pos_first,
                            uint32_t warm, uint32_t steps)
{
    const float *lg;
    uint32_t nl;
    double t = 0;
    for (uint32_t k = 0; k < warm + steps; k++) {
        eng_batch_seq_t d = {.tokens = ids + k, .n = 1, .pos0 = pos_first + k, .block_table = table, .n_blocks = nb,
                             .want_logits = true};
        double t1 = now_s();
        eng_forward_run(f, &d, 1, &lg, &nl);
        if (k >= warm)
            t += now_s() - t1;
    }
    return t / steps;
}

/* Decode steps of `batch` sequences at a short context (positions 64 on, each sequence its own blocks), as the
 * engine runs them: captured, the tokens picked on the GPU (greedy); the median step of STEPS; then the same steps
 * op by op (each synchronized, the logits downloaded instead of picked), for where a large batch's step goes
 * (issue 51). Against the floors: the weights and the KV a step reads, and its matmuls' FLOPs. */
static void time_decode_batch(kern_backend_t *gpu, const eng_model_t *m, uint32_t batch)
{
    enum { POS0 = 64, WARM = 4, STEPS = 16, OPSTEPS = 4, BT = 16 };
    const eng_model_desc_t *d = &m->desc;
    const uint32_t per = (POS0 + WARM + STEPS + OPSTEPS + 1 + BT - 1) / BT;
    td_kv_layout_t g = td_kv_layout_make(d->name, d->n_layers, d->n_kv_heads, d->head_dim, BT, TD_KV_F16);
    eng_kv_pool_t *pool;
    eng_forward_t *f[2];
    if (eng_kv_pool_create(gpu, &g, batch * per, NULL, &pool) ||
        eng_forward_create(m, gpu, pool, batch, batch, &f[0]) ||
        eng_forward_create(m, &g_timed.base, pool, batch, batch, &f[1])) {
        fprintf(stderr, "tandem-cuda-check: %s\n", td_last_error());
        exit(1);
    }
    int32_t *table = malloc((size_t)batch * per * 4), *ids = malloc((size_t)batch * 4), *picked = malloc(batch * 4);
    eng_batch_seq_t *seqs = calloc(batch, sizeof *seqs);
    kern_sample_t *sp = calloc(batch, sizeof *sp); /* temperature 0: greedy */
    for (uint32_t i = 0; i < batch * per; i++)
        table[i] = (int32_t)i;
    double st[STEPS];
    uint32_t pos = POS0, np;
    for (uint32_t k = 0; k < WARM + STEPS; k++, pos++) {
        for (uint32_t q = 0; q < batch; q++) {
            ids[q] = (int32_t)((q * 31 + k * 7) % 500 + 2);
            seqs[q] = (eng_batch_seq_t){.tokens = ids + q, .n = 1, .pos0 = pos, .block_table = table + q * per,
                                        .n_blocks = per, .want_logits = true};
        }
        double t0 = now_s();
        if (eng_forward_run_sampled(f[0], seqs, batch, sp, NULL, picked, &np)) {
            fprintf(stderr, "tandem-cuda-check: %s\n", td_last_error());
            exit(1);
        }
        if (k >= WARM)
            st[k - WARM] = now_s() - t0;
    }
    qsort(st, STEPS, sizeof *st, cmp_double);
    const double step = st[STEPS / 2], ctx = pos - STEPS / 2.0;
    memset(g_timed.t, 0, sizeof g_timed.t);
    double t_ops = 0;
    for (uint32_t k = 0; k < OPSTEPS; k++, pos++) {
        for (uint32_t q = 0; q < batch; q++)
            seqs[q].pos0 = pos;
        const float *lg;
        double t0 = now_s();
        eng_forward_run(f[1], seqs, batch, &lg, &np);
        t_ops += now_s() - t0;
    }
    const double layer_params = (double)d->n_params - (double)d->vocab * d->hidden * (d->tied_embeddings ? 1 : 2);
    const double w_bytes = (m->hold == ENG_WEIGHTS_FP8 ? 1.0 : 2.0) * layer_params + 2.0 * d->vocab * d->hidden,
                 kv_bytes = (double)batch * ctx * d->n_layers * 2.0 * d->n_kv_heads * d->head_dim * 2,
                 flops = 2.0 * batch * (layer_params + (double)d->vocab * d->hidden);
    printf("timing decode batch %u at a context of ~%.0f: step %.3f ms = %.0f tok/s; reads %.2f GB of weights + %.2f GB "
           "of KV, %.2f TFLOP\n",
           batch, ctx, step * 1e3, batch / step, w_bytes / 1e9, kv_bytes / 1e9, flops / 1e12);
    printf("  op by op (each synchronized; %.3f ms a step):", t_ops / OPSTEPS * 1e3);
    for (int o = 0; o < OP_N; o++)
        if (g_timed.t[o] > 0)
            printf(" %s %.3f", op_names[o], g_timed.t[o] / OPSTEPS * 1e3);
    printf("\n");
    free(table), free(ids), free(picked), free(seqs), free(sp);
    eng_forward_destroy(f[0]), eng_forward_destroy(f[1]);
    eng_kv_pool_destroy(pool);
}

/* The timed prompts' ids (n of them, small numbers) and their one sequence's block table (nb blocks, in order) */
static void timed_prompt(uint32_t n, uint32_t nb, int32_t **ids, int32_t **table)
{
    *ids = malloc(n * 4), *table = malloc(nb * 4);
    for (uint32_t i = 0; i < n; i++)
        (*ids)[i] = (int32_t)(i * 7 % 500 + 2);
    for (uint32_t i = 0; i < nb; i++)
        (*table)[i] = (int32_t)i;
}

/* A model's forward pass on the GPU: a prompt of n_prompt tokens (the median
 * of five), then decode steps of one sequence, each timed whole and then op
 * by op. */
static void time_model(kern_backend_t *gpu, const char *path, uint32_t n_prompt)
{
    eng_model_t *m;
    if (eng_model_open(path, &m)) {
        fprintf(stderr, "tandem-cuda-check: %s\n", td_last_error());
        exit(1);
    }
    eng_model_set_dummy(m, dummy_weights);
    g_timed = (timed_be_t){.base.ops = &timed_ops, .in = gpu};
    td_kv_layout_t g = td_kv_layout_make(m->desc.name, m->desc.n_layers, m->desc.n_kv_heads, m->desc.head_dim, 16,
                                         TD_KV_F16);
    uint32_t nb = (n_prompt + 64 + 15) / 16;
    eng_kv_pool_t *pool;
    eng_forward_t *f[2];
    if (eng_kv_pool_create(gpu, &g, nb, NULL, &pool) || eng_forward_create(m, gpu, pool, n_prompt, 1, &f[0]) ||
        eng_forward_create(m, &g_timed.base, pool, n_prompt, 1, &f[1])) {
        fprintf(stderr, "tandem-cuda-check: %s\n", td_last_error());
        exit(1);
    }
    int32_t *ids, *table;
    timed_prompt(n_prompt, nb, &ids, &table);
    for (int timed = 0; timed < 2; timed++) {
        memset(g_timed.t, 0, sizeof g_timed.t);
        const float *lg;
        uint32_t nl;
        eng_batch_seq_t s = {.tokens = ids, .n = n_prompt, .pos0 = 0, .block_table = table, .n_blocks = nb,
                             .want_logits = true};
        eng_forward_run(f[timed], &s, 1, &lg, &nl); /* warm-up: the first of each shape loads kernels */
        /* the median of PREFILLS prefills (one, op by op); each op's time over the last */
        enum { PREFILLS = 5 };
        double tps[PREFILLS];
        int np = timed ? 1 : PREFILLS;
        for (int r = 0; r < np; r++) {
            memset(g_timed.t, 0, sizeof g_timed.t);
            double t0 = now_s();
            if (eng_forward_run(f[timed], &s, 1, &lg, &nl)) {
                fprintf(stderr, "tandem-cuda-check: %s\n", td_last_error());
                exit(1);
            }
            tps[r] = now_s() - t0;
        }
        qsort(tps, (size_t)np, sizeof *tps, cmp_double);
        /* the layers' weights (not the embedding table, nor the output matrix a prefill uses for one row) */
        double layer_params = (double)m->desc.n_params - (double)m->desc.vocab * m->desc.hidden *
                                                               (m->desc.tied_embeddings ? 1 : 2);
        double tp = tps[np / 2], flops = 2.0 * n_prompt * layer_params;
        /* the causal attention's: q·k and p·v over n(n+1)/2 (row, position) pairs a head and layer */
        double att_flops = 4.0 * m->desc.head_dim * m->desc.n_heads * m->desc.n_layers *
                           (0.5 * n_prompt * (n_prompt + 1.0));
        double t_prefill[OP_N]; /* each op's time in the prefill alone (synchronized) */
        memcpy(t_prefill, g_timed.t, sizeof t_prefill);
        /* decode steps over the prompt's last positions and over its first
         * ones (a short context); untimed ops with programmatic dependent
         * launch and without */
        enum { WARM = 4, STEPS = 32 };
        double td[2] = {0, 0}, ts[2] = {0, 0};
        for (int pdl = 1; pdl >= 0; pdl--) {
            if (!timed && kern_cuda_set_pdl(gpu, pdl) != (bool)pdl)
                continue;
            td[pdl] = decode_step_s(f[timed], ids, table, nb, n_prompt - WARM - STEPS, WARM, STEPS);
            ts[pdl] = decode_step_s(f[timed], ids, table, nb, 64, WARM, STEPS);
            if (timed)
                break;
        }
        kern_cuda_set_pdl(gpu, true);
        printf("timing model %s%s: prefill %u tokens %.1f ms (%.1f TFLOP/s in the layers' matmuls, %.1f with the "
               "attention's), decode step at %u: %.3f ms, at 64..%u: %.3f ms",
               m->desc.name, timed ? " (each op synchronized)" : "", n_prompt, tp * 1e3, flops / tp / 1e12,
               (flops + att_flops) / tp / 1e12, n_prompt,
               td[1] * 1e3, 64 + WARM + STEPS, ts[1] * 1e3);
        if (!timed && td[0] > 0)
            printf(" (without programmatic dependent launch %.3f and %.3f ms)", td[0] * 1e3, ts[0] * 1e3);
        printf("\n");
        if (!timed) {
            decode_step_s(f[0], ids, table, nb, 64, 2, 1); /* a fresh capture, to count its edges */
            size_t all, prog;
            kern_cuda_graph_edges(gpu, &all, &prog);
            printf("  the captured decode step: %zu edges, %zu of them programmatic\n", all, prog);
        }
        if (timed) {
            printf("  ops, ms in the prefill:");
            for (int o = 0; o < OP_N; o++)
                if (t_prefill[o] > 0)
                    printf(" %s %.2f", op_names[o], t_prefill[o] * 1e3);
            printf("\n  ops, ms in the prefill and the %d decode steps after it:", 2 * (WARM + STEPS));
            for (int o = 0; o < OP_N; o++)
                if (g_timed.t[o] > 0)
                    printf(" %s %.2f", op_names[o], g_timed.t[o] * 1e3);
            printf("\n");
        }
    }
    /* the prompt attention's kernels against each other through the whole model: the prompt's last logits with the
     * mma.sync kernel and with the one in use (on Hopper the warpgroup MMA's, its output handed to the O projection
     * in fp16) */
    const uint32_t used = kern_cuda_set_prompt_attention(gpu, 0);
    if (used) {
        float *ref = malloc((size_t)m->desc.vocab * 4);
        const float *lg;
        uint32_t nl;
        eng_batch_seq_t s = {.tokens = ids, .n = n_prompt, .pos0 = 0, .block_table = table, .n_blocks = nb,
                             .want_logits = true};
        int bad = eng_forward_run(f[0], &s, 1, &lg, &nl);
        if (!bad)
            memcpy(ref, lg, (size_t)m->desc.vocab * 4);
        kern_cuda_set_prompt_attention(gpu, used);
        bad = bad || eng_forward_run(f[0], &s, 1, &lg, &nl);
        char what[256];
        snprintf(what, sizeof what, "model %.100s: a %u-token prompt's logits, prompt attention %u vs mma.sync",
                 m->desc.name, n_prompt, used);
        report(what, bad ? INFINITY : rel_err(lg, ref, m->desc.vocab), 1e-2);
        free(ref);
    }
    free(ids), free(table);
    eng_forward_destroy(f[0]), eng_forward_destroy(f[1]);
    eng_kv_pool_destroy(pool);
    for (uint32_t b = 64; b <= 256; b *= 4)
        time_decode_batch(gpu, m, b);
    eng_model_close(m);
}

/* Seconds of one fp16 GEMM of an 8192-square weight over n rows (fp32 in and out, as the layers' matmuls take
 * them), the mean of reps after three warm-ups: 2 * 8192^2 * n / that is the peak the prefill goals count. */
static double gemm_8192_s(kern_backend_t *gpu, uint32_t n, int reps)
{
    const uint32_t rows = 8192, cols = 8192;
    uint8_t *w = random_weight(KERN_TYPE_F16, rows, cols);
    kern_weight_t wg = {KERN_TYPE_F16, rows, cols, w, NULL, 0, NULL, 0, 0, 0};
    float *dx, *dy;
    gpu->ops->weight_prepare(gpu, &wg);
    gpu->ops->alloc(gpu, (size_t)n * cols * 4, (void **)&dx);
    gpu->ops->alloc(gpu, (size_t)n * rows * 4, (void **)&dy);
    cudaMemset(dx, 0, (size_t)n * cols * 4);
    for (int i = 0; i < 3; i++)
        gpu->ops->matmul(gpu, &wg, dx, dy, n);
    gpu->ops->sync(gpu);
    double t0 = now_s();
    for (int i = 0; i < reps; i++)
        gpu->ops->matmul(gpu, &wg, dx, dy, n);
    gpu->ops->sync(gpu);
    const double dt = (now_s() - t0) / reps;
    gpu->ops->free(gpu, dx);
    gpu->ops->free(gpu, dy);
    gpu->ops->weight_release(gpu, &wg);
    free(w);
    return dt;
}

/* --time-prefill: a model's prefill of one prompt of 1k, 4k and 16k tokens in one step, warm (the median of 3 after
 * one), with the file's weights and with FP8 ones, against the measured cuBLAS peak (the issue 51 table's MFU; the
 * read bandwidth too, for its roofline: bench/gpu/peers_table.py); then a batch-256 decode step with each, whole and
 * op by op. */
static void time_prefill(kern_backend_t *gpu, const char *path)
{
    g_timed = (timed_be_t){.base.ops = &timed_ops, .in = gpu};
    const double peak = 2.0 * 8192 * 8192 * 4096 / gemm_8192_s(gpu, 4096, 20);
    printf("timing prefill: cuBLAS's measured peak (fp16 8192x8192 over 4096 rows, fp32 out) %.1f TFLOP/s\n",
           peak / 1e12);
    printf("timing prefill: read bandwidth (8 GiB, median of 9) %.0f GB/s\n", kern_cuda_probe_read_gbs((size_t)8 << 30));
    const uint32_t lens[] = {1024, 4096, 16384};
    for (int h = 0; h < 2; h++) {
        eng_model_t *m;
        if (eng_model_open(path, &m)) {
            fprintf(stderr, "tandem-cuda-check: %s\n", td_last_error());
            exit(1);
        }
        eng_model_set_dummy(m, dummy_weights);
        eng_model_set_hold(m, h ? ENG_WEIGHTS_FP8 : ENG_WEIGHTS_FILE);
        const eng_model_desc_t *d = &m->desc;
        const uint32_t most = lens[sizeof lens / sizeof *lens - 1], nb = (most + 15) / 16;
        td_kv_layout_t g = td_kv_layout_make(d->name, d->n_layers, d->n_kv_heads, d->head_dim, 16, TD_KV_F16);
        eng_kv_pool_t *pool;
        eng_forward_t *f;
        if (eng_kv_pool_create(gpu, &g, nb, NULL, &pool) || eng_forward_create(m, gpu, pool, most, 1, &f)) {
            fprintf(stderr, "tandem-cuda-check: %s\n", td_last_error());
            exit(1);
        }
        int32_t *ids, *table;
        timed_prompt(most, nb, &ids, &table);
        const double layer_params =
            (double)d->n_params - (double)d->vocab * d->hidden * (d->tied_embeddings ? 1 : 2);
        for (size_t l = 0; l < sizeof lens / sizeof *lens; l++) {
            const uint32_t n = lens[l];
            eng_batch_seq_t s = {.tokens = ids, .n = n, .pos0 = 0, .block_table = table, .n_blocks = nb,
                                 .want_logits = true};
            /* fp16 weights: Q, K and V handed to the rope and the attention in fp16 (the default, v 0) and in fp32
             * (v 1, as before it), alternating; their last logits compared */
            const int vs = h ? 1 : 2;
            double t[2][3];
            const float *lg;
            uint32_t nl;
            float *ref = malloc((size_t)d->vocab * 4);
            double err = 0;
            for (int r = 0; r < 4 * vs; r++) {
                const int v = r % vs;
                kern_cuda_set_qkv_half(gpu, v == 0);
                double t0 = now_s();
                if (eng_forward_run(f, &s, 1, &lg, &nl)) {
                    fprintf(stderr, "tandem-cuda-check: %s\n", td_last_error());
                    exit(1);
                }
                if (r >= vs)
                    t[v][r / vs - 1] = now_s() - t0;
                if (r == 0 && vs == 2)
                    memcpy(ref, lg, (size_t)d->vocab * 4);
                if (r == 1)
                    err = rel_err(lg, ref, d->vocab);
            }
            kern_cuda_set_qkv_half(gpu, true);
            free(ref);
            const double flops = 2.0 * n * layer_params +
                                 4.0 * d->head_dim * d->n_heads * d->n_layers * (0.5 * n * (n + 1.0));
            for (int v = 0; v < vs; v++) {
                qsort(t[v], 3, sizeof *t[v], cmp_double);
                printf("timing prefill %s, weights %s%s: %u tokens %.1f ms = %.0f tok/s, %.1f TFLOP/s (the layers' "
                       "matmuls and the causal attention) = %.0f%% of the measured peak\n",
                       d->name, h ? "fp8" : "file", v ? " (Q/K/V in fp32)" : "", n, t[v][1] * 1e3, n / t[v][1],
                       flops / t[v][1] / 1e12, 100.0 * flops / t[v][1] / peak);
            }
            if (vs == 2) {
                char what[160];
                snprintf(what, sizeof what, "model %.60s: a %u-token prompt's logits, Q/K/V in fp16 vs fp32",
                         d->name, n);
                report(what, err, 2e-2);
            }
        }
        free(ids), free(table);
        eng_forward_destroy(f);
        eng_kv_pool_destroy(pool);
        printf("timing decode, weights %s:\n", h ? "fp8" : "file");
        time_decode_batch(gpu, m, 256);
        eng_model_close(m);
    }
}

/* GEMM and GEMV speed of the fp16 path against the GPU's floors. */
static void timings(kern_backend_t *gpu)
{
    printf("timing read bandwidth (8 GiB, median of 9): %.0f GB/s\n", kern_cuda_probe_read_gbs((size_t)8 << 30));
    const uint32_t rows = 8192, cols = 8192;
    for (uint32_t n = 1; n <= 4096; n *= 4096) {
        const double dt = gemm_8192_s(gpu, n, n == 1 ? 200 : 20);
        const double flops = 2.0 * rows * cols * n, bytes = 2.0 * rows * cols + 4.0 * n * (rows + cols) + 2.0 * n * cols;
        printf("timing matmul fp16 %ux%u, %u tokens: %.3f ms = %.1f TFLOP/s, %.0f GB/s\n", rows, cols, n, dt * 1e3,
               flops / dt / 1e12, bytes / dt / 1e9);
    }
    /* the decode matmul: cuBLAS (matmul) against the fused op's GEMV at a few
     * rows, on square and Llama-2-7B shapes (Q/K/V together, down) */
    const uint32_t gv[][2] = {{8192, 8192}, {12288, 4096}, {4096, 11008}};
    for (size_t s = 0; s < sizeof gv / sizeof *gv; s++) {
        uint8_t *wd = random_weight(KERN_TYPE_F16, gv[s][0], gv[s][1]);
        kern_weight_t wt = {KERN_TYPE_F16, gv[s][0], gv[s][1], wd, NULL, 0, NULL, 0, 0, 0};
        gpu->ops->weight_prepare(gpu, &wt);
        for (uint32_t n = 1; n <= 8; n *= 2) {
            float *dx, *dy;
            gpu->ops->alloc(gpu, (size_t)n * wt.cols * 4, (void **)&dx);
            gpu->ops->alloc(gpu, (size_t)n * wt.rows * 4, (void **)&dy);
            cudaMemset(dx, 0, (size_t)n * wt.cols * 4);
            const kern_weight_t *wp = &wt;
            kern_matmul_spec_t spec = {.w = &wp, .y = &dy, .k = 1, .x = dx, .n = n};
            double ms[3]; /* cuBLAS, the fused op, the fused op without programmatic dependent launch */
            for (int v = 0; v < 3; v++) {
                kern_cuda_set_pdl(gpu, v != 2);
                for (int i = 0; i < 3; i++)
                    v ? gpu->ops->matmul_fused(gpu, &spec) : gpu->ops->matmul(gpu, &wt, dx, dy, n);
                gpu->ops->sync(gpu);
                double t0 = now_s();
                for (int i = 0; i < 100; i++)
                    v ? gpu->ops->matmul_fused(gpu, &spec) : gpu->ops->matmul(gpu, &wt, dx, dy, n);
                gpu->ops->sync(gpu);
                ms[v] = (now_s() - t0) / 100 * 1e3;
            }
            kern_cuda_set_pdl(gpu, true);
            double bytes = 2.0 * wt.rows * wt.cols;
            printf("timing decode matmul %ux%u, %u rows: cuBLAS %.3f ms = %.0f GB/s, fused GEMV %.3f ms = %.0f GB/s "
                   "(without programmatic dependent launch %.3f ms = %.0f GB/s)\n",
                   wt.rows, wt.cols, n, ms[0], bytes / ms[0] / 1e6, ms[1], bytes / ms[1] / 1e6, ms[2],
                   bytes / ms[2] / 1e6);
            gpu->ops->free(gpu, dx), gpu->ops->free(gpu, dy);
        }
        gpu->ops->weight_release(gpu, &wt);
        free(wd);
    }
    time_prompt_attention(gpu);
    time_attention(gpu, 32, 32, 128, 256, 1, 1023, 1); /* decode: 256 sequences at 1k context */
    time_attention(gpu, 32, 32, 128, 1, 1, 4095, 1);   /* decode: one sequence at 4k context */
    /* the same decode in a pool of the model's 32 layers (64 GB), as the engine reads it, beside one layer */
    time_attention(gpu, 32, 32, 128, 128, 1, 1023, 1);
    time_attention(gpu, 32, 32, 128, 128, 1, 1023, 32);
    time_attention(gpu, 32, 32, 128, 1, 1, 4095, 32);
}

/* The device digest of pool blocks: one value per block's bytes wherever the
 * block lies, the same on every call, and a flipped bit changes its block's
 * digest and no other's. */
static void check_kv_digest(kern_backend_t *gpu)
{
    enum { BB = 3 * 8192, NB = 6 };
    uint8_t *h = malloc((size_t)BB * NB);
    for (size_t i = 0; i < (size_t)BB * NB; i++)
        h[i] = (uint8_t)(frand() * 127);
    memcpy(h + 4 * BB, h + 1 * BB, BB); /* blocks 1 and 4 hold the same bytes */
    uint8_t *d = put(gpu, h, (size_t)BB * NB);
    int32_t blocks[NB] = {5, 0, 3, 1, 4, 2};
    uint64_t a[NB], b[NB], c[NB];
    int ok = !gpu->ops->kv_digest(gpu, d, BB, blocks, NB, a) && !gpu->ops->kv_digest(gpu, d, BB, blocks, NB, b);
    ok = ok && !memcmp(a, b, sizeof a) && a[3] == a[4];
    for (int i = 0; i < NB && ok; i++)
        for (int j = i + 1; j < NB; j++)
            ok = ok && (a[i] != a[j] || (i == 3 && j == 4));
    uint8_t flip = h[3 * BB + 777] ^ 4;
    gpu->ops->upload(gpu, d + 3 * BB + 777, &flip, 1);
    ok = ok && !gpu->ops->kv_digest(gpu, d, BB, blocks, NB, c);
    for (int i = 0; i < NB && ok; i++)
        ok = i == 2 ? c[i] != a[i] : c[i] == a[i];
    printf("%-44s %s\n", "kv_digest (6 blocks of 24 KiB)", ok ? "ok" : "FAIL");
    failures += !ok;
    gpu->ops->free(gpu, d);
    free(h);
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
    const char *crafted = "tests/fixtures/dequant/crafted.gguf", *models[8], *hf[8][2], *timed_models[8],
               *fp8_models[8], *prefill_models[8];
    int nm = 0, nh = 0, nt = 0, n8 = 0, np = 0;
    bool timed = true, ops = true, time_att = false; /* --time-attention: with --no-timings, the prompt kernels alone */
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--crafted") && i + 1 < argc) crafted = argv[++i];
        else if (!strcmp(argv[i], "--model") && i + 1 < argc && nm < 8) models[nm++] = argv[++i];
        else if (!strcmp(argv[i], "--hf") && i + 2 < argc && nh < 8) hf[nh][0] = argv[i + 1], hf[nh++][1] = argv[i + 2], i += 2;
        else if (!strcmp(argv[i], "--no-timings")) timed = false;
        else if (!strcmp(argv[i], "--no-ops")) ops = false;
        else if (!strcmp(argv[i], "--time-model") && i + 1 < argc && nt < 8) timed_models[nt++] = argv[++i];
        else if (!strcmp(argv[i], "--fp8-model") && i + 1 < argc && n8 < 8) fp8_models[n8++] = argv[++i];
        else if (!strcmp(argv[i], "--time-prefill") && i + 1 < argc && np < 8) prefill_models[np++] = argv[++i];
        else if (!strcmp(argv[i], "--dummy")) dummy_weights = true;
        else if (!strcmp(argv[i], "--time-attention")) time_att = true;
        else {
            fprintf(stderr, "usage: tandem-cuda-check [--crafted GGUF] [--model PATH]... [--hf DIR LOGITS_JSON]... "
                            "[--no-timings] [--no-ops] [--time-model PATH]... [--fp8-model PATH]... [--dummy] "
                            "[--time-attention] [--time-prefill PATH]...\n");
            return 2;
        }
    }
    struct cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) {
        fprintf(stderr, "tandem-cuda-check: no CUDA device\n");
        return 1;
    }
    printf("device: %s, sm_%d%d, %d SMs, %.1f GiB\n", prop.name, prop.major, prop.minor, prop.multiProcessorCount,
           prop.totalGlobalMem / 1073741824.0);
    kern_backend_t *cpu, *gpu;
    if (kern_cpu_backend_create(0, &cpu) || kern_cuda_backend_create(0, &gpu)) {
        fprintf(stderr, "tandem-cuda-check: %s\n", td_last_error());
        return 1;
    }
    uint32_t types[] = {KERN_TYPE_F16, KERN_TYPE_BF16, KERN_TYPE_Q4_1, KERN_TYPE_Q8_0};
    uint32_t shapes[][3] = {{576, 576, 1}, {1536, 576, 7}, {576, 1536, 64}, {49152, 576, 1}, {192, 576, 512}};
    const uint32_t heads[][3] = {{9, 3, 64}, {32, 8, 128}, {32, 32, 128}, {8, 1, 256}, {4, 2, 16}};
    for (size_t t = 0; ops && t < 4; t++)
        for (size_t s = 0; s < 5; s++)
            check_matmul(cpu, gpu, types[t], shapes[s][0], shapes[s][1], shapes[s][2]);
    if (ops) {
        check_elementwise(cpu, gpu);
        check_embed(cpu, gpu, KERN_TYPE_Q4_1);
        check_embed(cpu, gpu, KERN_TYPE_F16);
        const td_kv_dtype_t kvds[] = {TD_KV_F16, TD_KV_F32, TD_KV_F8_E4M3};
        for (size_t h = 0; h < sizeof heads / sizeof *heads; h++)
            for (int dt = 0; dt < 3; dt++)
                check_attention(cpu, gpu, heads[h][0], heads[h][1], heads[h][2], kvds[dt], ATT_MIXED);
        check_attention(cpu, gpu, 32, 32, 128, TD_KV_F16, ATT_MANY);
        check_attention(cpu, gpu, 64, 64, 64, TD_KV_F16, ATT_MANY);
        /* long prompts (the prompt kernels' many tiles): 7B's heads, GQA of 4 at 128 and of 3 at 64 wide, fp8 */
        check_attention(cpu, gpu, 32, 32, 128, TD_KV_F16, ATT_LONG);
        check_attention(cpu, gpu, 32, 8, 128, TD_KV_F16, ATT_LONG);
        check_attention(cpu, gpu, 9, 3, 64, TD_KV_F16, ATT_LONG);
        check_attention(cpu, gpu, 32, 8, 128, TD_KV_F8_E4M3, ATT_LONG);
        check_attention(cpu, gpu, 32, 8, 128, TD_KV_F8_E4M3, ATT_MANY);
        check_attention(cpu, gpu, 64, 64, 64, TD_KV_F8_E4M3, ATT_MANY);
        /* the wide decode kernel: one query head a KV head, and groups of 2, 4 and 8 */
        const uint32_t wide[][3] = {{32, 32, 128}, {64, 64, 64}, {32, 16, 64}, {64, 16, 128}, {128, 16, 64}};
        for (size_t i = 0; i < sizeof wide / sizeof *wide; i++)
            check_attention(cpu, gpu, wide[i][0], wide[i][1], wide[i][2], TD_KV_F16, ATT_WIDE);
        /* fp16 with neox pairs, fp32 and fp8 with norm pairs, and fp8 with neox on the 64-wide heads */
        for (size_t h = 0; h < sizeof heads / sizeof *heads; h++)
            for (int st = 0; st < 3; st++)
                check_rope_kv_store(gpu, heads[h][0], heads[h][1], heads[h][2], kvds[st],
                                    st == 1 || (st == 2 && h == 0) ? KERN_ROPE_NEOX : KERN_ROPE_NORM);
        for (size_t h = 0; h < sizeof heads / sizeof *heads; h++)
            for (int st = 0; st < 3; st++)
                check_rope_kv_attention(gpu, heads[h][0], heads[h][1], heads[h][2], kvds[st],
                                        st == 1 ? KERN_ROPE_NEOX : KERN_ROPE_NORM, ATT_MIXED);
        check_rope_kv_attention(gpu, 32, 32, 128, TD_KV_F16, KERN_ROPE_NORM, ATT_MANY);
        check_rope_kv_attention(gpu, 32, 32, 128, TD_KV_F16, KERN_ROPE_NORM, ATT_WIDE);
        check_rope_kv_attention(gpu, 64, 32, 64, TD_KV_F16, KERN_ROPE_NEOX, ATT_WIDE);
        check_qkv_handed(gpu, 32, 32, 128, KERN_ROPE_NORM, 600); /* past KC_JOIN_MAXN: not joined */
        check_qkv_handed(gpu, 32, 8, 128, KERN_ROPE_NEOX, 700);
        check_qkv_handed(gpu, 9, 3, 64, KERN_ROPE_NORM, 530);
        check_decode(crafted);
        check_kv_digest(gpu);
        const uint32_t fused_rows[] = {1, 5, 8, 64, 600}; /* the GEMV (8 or fewer), cuBLAS, a prompt past JOIN_MAXN */
        for (size_t i = 0; i < sizeof fused_rows / sizeof *fused_rows; i++)
            for (uint32_t hold = 0; hold <= KERN_TYPE_F8_E4M3; hold += KERN_TYPE_F8_E4M3)
                check_matmul_fused(cpu, gpu, 576, fused_rows[i], hold);
        /* one row: 576 and 4096 wide take matmul_fused.cu's k_gemv_cols shape A; 4128 (a last chunk of 32 columns)
         * and 11008 its shape B, whose glu cases take k_gemv; 14336 (the 8B shape's down projection) k_gemv */
        const uint32_t fused_cols[] = {4096, 4128, 11008, 14336};
        for (size_t i = 0; i < sizeof fused_cols / sizeof *fused_cols; i++)
            for (uint32_t hold = 0; hold <= KERN_TYPE_F8_E4M3; hold += KERN_TYPE_F8_E4M3)
                check_matmul_fused(cpu, gpu, fused_cols[i], 1, hold);
        /* FP8: 576 and 4096 wide take matmul_fp8.cu's shape A, the wider ones its shape B; more rows its fp16 copy */
        check_fp8_hold(gpu);
        check_weight_scale(gpu);
        check_sample(gpu);
    }
    for (int i = 0; i < nm; i++)
        for (int h = 0; h < 2; h++) {
            check_model(cpu, gpu, models[i], h ? ENG_WEIGHTS_FP8 : ENG_WEIGHTS_FILE, TD_KV_F16);
            check_graph(cpu, gpu, models[i], h ? ENG_WEIGHTS_FP8 : ENG_WEIGHTS_FILE, TD_KV_F16);
        }
    for (int i = 0; i < nm; i++) { /* an fp8_e4m3 KV cache: the GPU's against the CPU's */
        check_model(cpu, gpu, models[i], ENG_WEIGHTS_FILE, TD_KV_F8_E4M3);
        check_graph(cpu, gpu, models[i], ENG_WEIGHTS_FILE, TD_KV_F8_E4M3);
    }
    for (int i = 0; i < nh; i++) {
        check_hf(gpu, hf[i][0], hf[i][1]);
        if (i == 0)
            check_tp_one_gpu(gpu, hf[i][0]);
        if (ops)
            check_graph(cpu, gpu, hf[i][0], ENG_WEIGHTS_FILE, TD_KV_F16);
    }
    for (int i = 0; i < n8; i++)
        check_fp8_model(gpu, fp8_models[i]);
    if (timed)
        timings(gpu);
    else if (time_att) { /* the prompt kernels' checks, then their timings */
        const uint32_t ph[][3] = {{9, 3, 64}, {32, 8, 128}, {32, 32, 128}};
        for (size_t h = 0; h < sizeof ph / sizeof *ph; h++) {
            check_attention(cpu, gpu, ph[h][0], ph[h][1], ph[h][2], TD_KV_F16, ATT_MIXED);
            check_attention(cpu, gpu, ph[h][0], ph[h][1], ph[h][2], TD_KV_F16, ATT_LONG);
        }
        time_prompt_attention(gpu);
    }
    for (int i = 0; i < nt; i++)
        time_model(gpu, timed_models[i], 4096);
    for (int i = 0; i < np; i++)
        time_prefill(gpu, prefill_models[i]);
    kern_cuda_backend_destroy(gpu);
    kern_cpu_backend_destroy(cpu);
    printf("cuda check: %d failed\n", failures);
    return failures ? 1 : 0;
}
