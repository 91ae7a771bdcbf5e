/* outlen.c — see outlen.h. */
#include "router/outlen.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"

#define OL_CLASSES 24   /* prompt-length classes: floor(log2(tokens)) */
#define OL_TENANTS 256  /* more share the last one's cells */
#define OL_ERRORS 256   /* the window the error is reported over */
#define OL_TRUST 20.0   /* ends a cell's weight grows to */
#define OL_ALPHA 0.2    /* a cell's moving average follows each end by this */

typedef struct cell {
    double mean; /* of log(1 + output) */
    double n;    /* ends seen (its weight, up to OL_TRUST) */
} cell_t;

typedef struct tenant {
    char name[64];
    cell_t all, by_class[OL_CLASSES];
} tenant_t;

struct rt_outlen {
    pthread_mutex_t mu;
    cell_t all, by_class[OL_CLASSES];
    tenant_t t[OL_TENANTS];
    uint32_t n_t;
    double err[OL_ERRORS];
    uint32_t n_err, err_at;
    uint64_t ends;
};

td_status_t rt_outlen_create(rt_outlen_t **out)
{
    rt_outlen_t *o = calloc(1, sizeof *o);
    if (!o)
        return td_error(TD_ERR_NO_MEMORY, "router: no memory for the output-length predictor");
    pthread_mutex_init(&o->mu, NULL);
    *out = o;
    return TD_OK;
}

void rt_outlen_destroy(rt_outlen_t *o)
{
    if (!o)
        return;
    pthread_mutex_destroy(&o->mu);
    free(o);
}

static uint32_t class_of(uint32_t tokens)
{
    uint32_t c = 0;
    while (tokens > 1 && c < OL_CLASSES - 1)
        tokens >>= 1, c++;
    return c;
}

/* The tenant's cells (made on first sight; NULL for no tenant). */
static tenant_t *tenant_of(rt_outlen_t *o, const char *name, bool make)
{
    if (!name || !name[0])
        return NULL;
    for (uint32_t i = 0; i < o->n_t; i++)
        if (!strcmp(o->t[i].name, name))
            return &o->t[i];
    if (!make)
        return NULL;
    if (o->n_t == OL_TENANTS)
        return &o->t[OL_TENANTS - 1];
    tenant_t *t = &o->t[o->n_t++];
    snprintf(t->name, sizeof t->name, "%s", o->n_t == OL_TENANTS ? "*" : name);
    return t;
}

/* Backs off from est to c as far as c has seen ends: k ends of trust in what came before */
static double refine(double est, const cell_t *c)
{
    const double k = 2;
    return c->n > 0 ? (c->n * c->mean + k * est) / (c->n + k) : est;
}

double rt_outlen_predict(rt_outlen_t *o, const rt_outlen_query_t *q)
{
    double cap = q->max_tokens ? q->max_tokens : 1;
    double est = log1p(cap / 2); /* the prior: half the cap */
    uint32_t c = class_of(q->prompt_tokens);
    pthread_mutex_lock(&o->mu);
    est = refine(refine(est, &o->all), &o->by_class[c]);
    const tenant_t *t = tenant_of(o, q->tenant, false);
    if (t)
        est = refine(refine(est, &t->all), &t->by_class[c]);
    pthread_mutex_unlock(&o->mu);
    if (q->history_tokens > 0) /* twice the weight of all the rest: the conversation's own answers */
        est = (est + 2 * log1p(q->history_tokens)) / 3;
    double p = expm1(est);
    return p < 1 ? 1 : p > cap ? cap : p;
}

static void learn(cell_t *c, double x)
{
    c->mean = c->n > 0 ? c->mean + OL_ALPHA * (x - c->mean) : x;
    c->n = c->n + 1 < OL_TRUST ? c->n + 1 : OL_TRUST;
}

void rt_outlen_observe(rt_outlen_t *o, const rt_outlen_query_t *q, double predicted, uint32_t output)
{
    double x = log1p((double)output);
    uint32_t c = class_of(q->prompt_tokens);
    pthread_mutex_lock(&o->mu);
    tenant_t *t = tenant_of(o, q->tenant, true);
    if (t) {
        learn(&t->by_class[c], x);
        learn(&t->all, x);
    }
    learn(&o->by_class[c], x);
    learn(&o->all, x);
    o->ends++;
    if (predicted > 0 && output > 0) {
        o->err[o->err_at] = fabs(predicted - output) / output;
        o->err_at = (o->err_at + 1) % OL_ERRORS;
        o->n_err += o->n_err < OL_ERRORS;
    }
    pthread_mutex_unlock(&o->mu);
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

void rt_outlen_error(rt_outlen_t *o, double *p50, double *p90, uint32_t *n)
{
    double e[OL_ERRORS];
    pthread_mutex_lock(&o->mu);
    uint32_t k = o->n_err;
    memcpy(e, o->err, k * sizeof *e);
    pthread_mutex_unlock(&o->mu);
    *n = k;
    if (!k) {
        *p50 = *p90 = -1;
        return;
    }
    qsort(e, k, sizeof *e, cmp_double);
    *p50 = e[(k - 1) / 2];
    *p90 = e[(uint32_t)(0.9 * (k - 1))];
}

json_t *rt_outlen_json(rt_outlen_t *o)
{
    double p50, p90;
    uint32_t n;
    rt_outlen_error(o, &p50, &p90, &n);
    pthread_mutex_lock(&o->mu);
    json_t *j = json_pack("{s:I, s:i, s:i}", "ends", (json_int_t)o->ends, "tenants", (int)o->n_t, "error_window",
                          (int)n);
    pthread_mutex_unlock(&o->mu);
    if (j && n) {
        json_object_set_new(j, "error_p50", json_real(p50));
        json_object_set_new(j, "error_p90", json_real(p90));
    }
    return j;
}
