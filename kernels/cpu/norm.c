/* norm.c — RMSNorm. Shapes: x, y [n][dim] fp32, w [dim] fp32.
 * y = x / sqrt(mean(x²) + eps) * w, the sum of squares in double as ggml does. */
#include <math.h>

#include "kernels/cpu/cpu_int.h"

typedef struct norm_job {
    const float *x, *w;
    float *y;
    uint32_t dim;
    float eps;
} norm_job_t;

static void norm_task(void *ctx, int t, int n_tasks)
{
    (void)n_tasks;
    const norm_job_t *j = ctx;
    const float *x = j->x + (size_t)t * j->dim;
    float *y = j->y + (size_t)t * j->dim;
    double sum = 0;
    for (uint32_t i = 0; i < j->dim; i++)
        sum += (double)(x[i] * x[i]);
    float scale = 1.0f / sqrtf((float)(sum / j->dim) + j->eps);
    for (uint32_t i = 0; i < j->dim; i++)
        y[i] = (x[i] * scale) * j->w[i];
}

td_status_t kern_cpu_rmsnorm(kern_backend_t *b, const float *x, const float *w, float *y, uint32_t n, uint32_t dim,
                             float eps)
{
    kern_cpu_t *c = (kern_cpu_t *)b;
    norm_job_t j = {x, w, y, dim, eps};
    if (n < 8) {
        for (uint32_t t = 0; t < n; t++)
            norm_task(&j, (int)t, (int)n);
    } else {
        kern_pool_run(c->pool, (int)n, norm_task, &j);
    }
    return TD_OK;
}
