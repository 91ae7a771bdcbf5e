/* elementwise.c — SwiGLU, residual add, embedding lookup.
 * swiglu: y[i] = silu(gate[i]) * up[i], silu(g) = g / (1 + e^-g); add: x += y;
 * embed: out[i][cols] = row ids[i] of the table, decoded to fp32. */
#include <math.h>

#include "common/log.h"
#include "kernels/cpu/cpu_int.h"
#include "kernels/quant.h"

typedef struct swiglu_job {
    kern_swiglu_fn fn;
    const float *g, *u;
    float *y;
    size_t n, per;
} swiglu_job_t;

static void swiglu_task(void *ctx, int t, int n_tasks)
{
    (void)n_tasks;
    const swiglu_job_t *j = ctx;
    size_t a = (size_t)t * j->per, e = a + j->per < j->n ? a + j->per : j->n;
    j->fn(j->g + a, j->u + a, j->y + a, e - a);
}

td_status_t kern_cpu_swiglu(kern_backend_t *b, const float *gate, const float *up, float *y, size_t n)
{
    kern_cpu_t *c = (kern_cpu_t *)b;
    if (n < 16384) { /* a decode step's worth: cheaper than waking the pool */
        c->vd->swiglu(gate, up, y, n);
        return TD_OK;
    }
    size_t per = (n / (size_t)kern_pool_threads(c->pool) / 4 + 7) & ~(size_t)7;
    swiglu_job_t j = {c->vd->swiglu, gate, up, y, n, per ? per : 8};
    kern_pool_run(c->pool, (int)((n + j.per - 1) / j.per), swiglu_task, &j);
    return TD_OK;
}

td_status_t kern_cpu_add(kern_backend_t *b, float *x, const float *y, size_t n)
{
    (void)b;
    for (size_t i = 0; i < n; i++)
        x[i] += y[i];
    return TD_OK;
}

td_status_t kern_cpu_embed(kern_backend_t *b, const kern_weight_t *table, const int32_t *ids, uint32_t n, float *out)
{
    (void)b;
    const kern_type_info_t *info = kern_type_info(table->type);
    size_t stride = kern_type_row_bytes(info, table->cols);
    for (uint32_t i = 0; i < n; i++) {
        if (ids[i] < 0 || (uint32_t)ids[i] >= table->rows)
            return td_error(TD_ERR_OUT_OF_RANGE, "embed: token id %d is outside the vocabulary of %u", ids[i],
                            table->rows);
        td_status_t rc = kern_dequant_row(table->type, (const uint8_t *)table->data + (size_t)ids[i] * stride,
                                          out + (size_t)i * table->cols, table->cols);
        if (rc)
            return rc;
    }
    return TD_OK;
}
