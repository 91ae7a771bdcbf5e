/* matmul.c — y[n][rows] = x[n][cols] · Wᵀ for every weight format.
 *
 * Shapes: W is rows x cols in its format (kernels/quant.h), x is n x cols fp32,
 * y is n x rows fp32. One path serves decode (n = 1: a GEMV, bound by reading
 * W once) and prefill (n large: each task takes a slice of W's rows and runs
 * them against every token, so the slice is read from memory once and then
 * from cache).
 *
 * First the activations are quantized to the 8-bit blocks the weight format
 * takes (vecdot.h) — once per call, shared by all tasks; then tasks of
 * contiguous rows (a few per thread, at least MATMUL_ROWS) run the dot products. K-quant rows are decoded to fp32 in a
 * per-task buffer (K-quants are read, not yet fast). */
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "kernels/cpu/cpu_int.h"
#include "kernels/cpu/repack.h"
#include "kernels/quant.h"

#define MATMUL_ROWS 16 /* the smallest task */
#define MATMUL_TASKS_PER_THREAD 4

#define MATMUL_MAX_MULTI 4

/* One weight of a (multi-)matmul job. */
typedef struct matmul_part {
    const kern_weight_t *w;
    float *y;
    uint32_t rows_per_task;
    uint32_t first_task;  /* index of this part's first task in the job */
} matmul_part_t;

typedef struct matmul_job {
    bool vnni;
    const void *xq;      /* activations in the format the weights take */
    size_t xq_stride;    /* bytes per token row of xq */
    kern_vec_dot_fn dot;
    kern_vec_dot4_fn dot4; /* optional: one row against four tokens */
    kern_vec_dot4_fn dot4r; /* optional: four rows against one token */
    uint32_t n;
    size_t w_stride;     /* bytes per weight row */
    float *decode;       /* K-quants: scratch, cols floats per task */
    matmul_part_t part[MATMUL_MAX_MULTI];
    uint32_t n_parts;
} matmul_job_t;

static const matmul_part_t *job_part(const matmul_job_t *j, int task, uint32_t *local)
{
    uint32_t i = j->n_parts - 1;
    while (i > 0 && (uint32_t)task < j->part[i].first_task)
        i--;
    *local = (uint32_t)task - j->part[i].first_task;
    return &j->part[i];
}

#if defined(__x86_64__)
/* The repacked path: tasks are contiguous runs of 8-row groups. */
static void matmul_x8_task(void *ctx, int task, int n_tasks)
{
    (void)n_tasks;
    const matmul_job_t *j = ctx;
    uint32_t lt;
    const matmul_part_t *p = job_part(j, task, &lt);
    const kern_weight_t *w = p->w;
    uint32_t groups = w->rows / 8, per = p->rows_per_task / 8;
    uint32_t g0 = lt * per, g1 = g0 + per < groups ? g0 + per : groups;
    if (kern_repack_kernel_type(w->type) == KERN_TYPE_Q4_1)
        (j->vnni ? kern_gemm_q4_1x8_vnni : kern_gemm_q4_1x8)(w->priv, w->cols, g0, g1, j->xq, j->xq_stride, j->n,
                                                              p->y, w->rows);
    else
        (j->vnni ? kern_gemm_q8_0x8_vnni : kern_gemm_q8_0x8)(w->priv, w->cols, g0, g1, j->xq, j->xq_stride, j->n,
                                                              p->y, w->rows);
}
#endif

static void matmul_task(void *ctx, int task, int n_tasks)
{
    (void)n_tasks;
    const matmul_job_t *j = ctx;
    uint32_t lt;
    const matmul_part_t *p = job_part(j, task, &lt);
    const kern_weight_t *w = p->w;
    uint32_t r0 = lt * p->rows_per_task, r1 = r0 + p->rows_per_task;
    if (r1 > w->rows)
        r1 = w->rows;
    const uint8_t *wb = w->data;
    if (j->dot4r && j->n < 4) { /* decode: four rows at a time */
        float o[4];
        for (; r0 + 4 <= r1; r0 += 4)
            for (uint32_t t = 0; t < j->n; t++) {
                j->dot4r(wb + r0 * j->w_stride, (const uint8_t *)j->xq + t * j->xq_stride, j->w_stride, w->cols, o);
                for (int k = 0; k < 4; k++)
                    p->y[(size_t)t * w->rows + r0 + k] = o[k];
            }
    }
    for (uint32_t r = r0; r < r1; r++) {
        const void *row = wb + r * j->w_stride;
        if (j->decode) { /* K-quants: decode the row once, then fp32 dots */
            float *d = j->decode + (size_t)task * w->cols;
            kern_dequant_row(w->type, row, d, w->cols);
            row = d;
        }
        uint32_t t = 0;
        if (j->dot4) {
            float o[4];
            for (; t + 4 <= j->n; t += 4) {
                j->dot4(row, (const uint8_t *)j->xq + t * j->xq_stride, j->xq_stride, w->cols, o);
                for (int k = 0; k < 4; k++)
                    p->y[(size_t)(t + k) * w->rows + r] = o[k];
            }
        }
        for (; t < j->n; t++)
            p->y[(size_t)t * w->rows + r] = j->dot(row, (const uint8_t *)j->xq + t * j->xq_stride, w->cols);
    }
}

typedef struct quant_job {
    kern_quantize_fn fn;
    const float *x;
    uint8_t *xq;
    uint32_t cols;
    size_t stride;
} quant_job_t;

static void quant_task(void *ctx, int t, int n_tasks)
{
    (void)n_tasks;
    const quant_job_t *q = ctx;
    q->fn(q->x + (size_t)t * q->cols, q->xq + (size_t)t * q->stride, q->cols);
}

td_status_t kern_cpu_matmul_multi(kern_backend_t *b, const kern_weight_t *const *ws, float *const *ys, uint32_t k,
                                  const float *x, uint32_t n)
{
    kern_cpu_t *c = (kern_cpu_t *)b;
    const kern_vecdot_table_t *vd = c->vd;
    const kern_weight_t *w = ws[0];
    const kern_type_info_t *info = kern_type_info(w->type);
    if (!info || w->cols % info->block_elems || w->cols % 32)
        return td_error(TD_ERR_INVALID_ARG, "matmul: weight of type %u with %u columns is not supported", w->type,
                        w->cols);
    if (k < 1 || k > MATMUL_MAX_MULTI)
        return td_error(TD_ERR_INVALID_ARG, "matmul: %u weights in one call (1..%d)", k, MATMUL_MAX_MULTI);
    for (uint32_t i = 1; i < k; i++)
        if (ws[i]->type != w->type || ws[i]->cols != w->cols || !ws[i]->priv != !w->priv)
            return td_error(TD_ERR_INVALID_ARG, "matmul: weights of one call must share type, columns and layout");
    matmul_job_t j = {.n = n, .w_stride = kern_type_row_bytes(info, w->cols), .n_parts = k, .vnni = c->vnni};
    kern_quantize_fn quant = NULL;
    switch ((kern_type_t)w->type) {
    case KERN_TYPE_Q4_0: j.dot = vd->q4_0_q8_0, quant = vd->quantize_q8_0, j.xq_stride = w->cols / 32 * KERN_Q8_0_BYTES; break;
    case KERN_TYPE_Q8_0: j.dot = vd->q8_0_q8_0, quant = vd->quantize_q8_0, j.xq_stride = w->cols / 32 * KERN_Q8_0_BYTES; break;
    case KERN_TYPE_Q4_1: j.dot = vd->q4_1_q8_1, j.dot4 = vd->q4_1_q8_1_x4, j.dot4r = vd->q4_1_q8_1_r4, quant = vd->quantize_q8_1, j.xq_stride = w->cols / 32 * KERN_Q8_1_BYTES; break;
    case KERN_TYPE_F16: j.dot = vd->f16_f32; break;
    case KERN_TYPE_BF16: j.dot = vd->bf16_f32; break;
    case KERN_TYPE_F32: j.dot = vd->f32_f32; break;
    case KERN_TYPE_Q4_K: case KERN_TYPE_Q5_K: case KERN_TYPE_Q6_K: j.dot = vd->f32_f32; break;
    case KERN_TYPE_F8_E4M3: /* weight_prepare made it F32 */
        return td_error(TD_ERR_INVALID_ARG, "matmul: an FP8 matrix the backend did not prepare");
    }
#if defined(__x86_64__)
    if (w->priv) { /* 8-row interleaved copies (repack.h): Q8F activations */
        quant = kern_quantize_q8f;
        j.xq_stride = w->cols / 32 * KERN_Q8F_BYTES;
    }
#endif
    /* few, contiguous tasks per weight: each thread streams long runs of W
     * (hardware prefetch), and a handful per thread still balance uneven progress */
    uint32_t n_tasks = 0, slots = (uint32_t)kern_pool_threads(c->pool) * MATMUL_TASKS_PER_THREAD;
    for (uint32_t i = 0; i < k; i++) {
        uint32_t per = (ws[i]->rows + slots - 1) / slots;
        per = per < MATMUL_ROWS ? MATMUL_ROWS : per;
        if (w->priv)
            per = (per + 7) / 8 * 8;
        j.part[i] = (matmul_part_t){.w = ws[i], .y = ys[i], .rows_per_task = per, .first_task = n_tasks};
        n_tasks += (ws[i]->rows + per - 1) / per;
    }
    size_t q_bytes = quant ? (size_t)n * j.xq_stride : 0;
    size_t d_bytes = w->type >= KERN_TYPE_Q4_K && w->type <= KERN_TYPE_Q6_K && !w->priv
                         ? n_tasks * w->cols * sizeof(float) : 0;
    uint8_t *scratch = kern_cpu_scratch(c, q_bytes + d_bytes + 64);
    if (!scratch)
        return td_error(TD_ERR_NO_MEMORY, "matmul: no memory for %zu bytes of scratch", q_bytes + d_bytes);
    if (quant) {
        quant_job_t q = {.fn = quant, .x = x, .xq = scratch, .cols = w->cols, .stride = j.xq_stride};
        if (n <= 4) /* a few rows: not worth waking the pool */
            for (uint32_t t = 0; t < n; t++)
                quant_task(&q, (int)t, (int)n);
        else
            kern_pool_run(c->pool, (int)n, quant_task, &q);
        j.xq = scratch;
    } else {
        j.xq = x;
        j.xq_stride = w->cols * sizeof(float);
    }
    if (d_bytes)
        j.decode = (float *)(void *)(scratch + ((q_bytes + 63) & ~(size_t)63));
#if defined(__x86_64__)
    if (w->priv) {
        kern_pool_run(c->pool, (int)n_tasks, matmul_x8_task, &j);
        return TD_OK;
    }
#endif
    kern_pool_run(c->pool, (int)n_tasks, matmul_task, &j);
    return TD_OK;
}

td_status_t kern_cpu_matmul(kern_backend_t *b, const kern_weight_t *w, const float *x, float *y, uint32_t n)
{
    return kern_cpu_matmul_multi(b, &w, &y, 1, x, n);
}
