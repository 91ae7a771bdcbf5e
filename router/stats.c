/* stats.c — see stats.h. */
#include "router/stats.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "common/log.h"

#define RT_OVERHEAD_RING 4096
#define RT_DONE_RING 4096
#define RT_ARRIVE_RING 4096

typedef struct rt_done {
    double t, ttft_ms, tpot_ms;
    uint32_t prompt_tokens;
    bool ok, local;
} rt_done_t;

typedef struct rt_arrive {
    double t, out_tokens, ctx_tokens;
    uint32_t new_tokens;
    bool local;
} rt_arrive_t;

struct rt_stats {
    pthread_mutex_t mu; /* guards everything */
    uint64_t n_requests, n_errors, n_ok;
    double overhead[RT_OVERHEAD_RING];     /* seconds of router work per request (wall clock) */
    double overhead_cpu[RT_OVERHEAD_RING]; /* the same sections in thread CPU time */
    double handoff[RT_OVERHEAD_RING];      /* seconds its steps waited in the pool's queue */
    size_t n_overhead;
    rt_done_t done[RT_DONE_RING]; /* the last requests that ended */
    uint64_t n_done;
    rt_arrive_t arrive[RT_ARRIVE_RING]; /* the last requests placed */
    uint64_t n_arrive;
};

td_status_t rt_stats_create(rt_stats_t **out)
{
    rt_stats_t *s = calloc(1, sizeof *s);
    if (!s)
        return td_error(TD_ERR_NO_MEMORY, "router: no memory for its statistics");
    pthread_mutex_init(&s->mu, NULL);
    *out = s;
    return TD_OK;
}

void rt_stats_destroy(rt_stats_t *s)
{
    if (!s)
        return;
    pthread_mutex_destroy(&s->mu);
    free(s);
}

void rt_stats_count(rt_stats_t *s, bool ok, double overhead, double cpu, double handoff)
{
    pthread_mutex_lock(&s->mu);
    s->n_requests++;
    if (ok)
        s->n_ok++;
    else
        s->n_errors++;
    if (overhead >= 0) {
        s->overhead_cpu[s->n_overhead % RT_OVERHEAD_RING] = cpu;
        s->handoff[s->n_overhead % RT_OVERHEAD_RING] = handoff;
        s->overhead[s->n_overhead++ % RT_OVERHEAD_RING] = overhead;
    }
    pthread_mutex_unlock(&s->mu);
}

void rt_stats_done(rt_stats_t *s, double ttft_ms, double tpot_ms, bool ok, uint32_t prompt_tokens, bool local)
{
    pthread_mutex_lock(&s->mu);
    s->done[s->n_done++ % RT_DONE_RING] = (rt_done_t){td_now_s(), ttft_ms, tpot_ms, prompt_tokens, ok, local};
    pthread_mutex_unlock(&s->mu);
}

void rt_stats_arrive(rt_stats_t *s, uint32_t new_tokens, bool local, double out_tokens, double ctx_tokens)
{
    pthread_mutex_lock(&s->mu);
    s->arrive[s->n_arrive++ % RT_ARRIVE_RING] = (rt_arrive_t){td_now_s(), out_tokens, ctx_tokens, new_tokens, local};
    pthread_mutex_unlock(&s->mu);
}

void rt_stats_arrivals(rt_stats_t *s, double since, rt_arrivals_t *out)
{
    memset(out, 0, sizeof *out);
    double now = td_now_s(), first = now;
    pthread_mutex_lock(&s->mu);
    uint64_t n = s->n_arrive < RT_ARRIVE_RING ? s->n_arrive : RT_ARRIVE_RING;
    for (uint64_t k = 0; k < n; k++) {
        const rt_arrive_t *a = &s->arrive[(s->n_arrive - 1 - k) % RT_ARRIVE_RING];
        if (a->t < since)
            break;
        out->n++;
        out->new_tokens += a->new_tokens;
        out->local_tokens += a->local ? a->new_tokens : 0;
        out->out_tokens += a->out_tokens;
        out->ctx_tokens += a->ctx_tokens;
        first = a->t;
    }
    pthread_mutex_unlock(&s->mu);
    /* a ring that wrapped within the window holds less than it: its span is what it holds */
    out->seconds = now - (n == RT_ARRIVE_RING && out->n == n ? first : since);
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double p90(double *v, uint32_t n)
{
    if (!n)
        return 0;
    qsort(v, n, sizeof *v, cmp_double);
    return v[(size_t)(0.9 * (double)(n - 1))];
}

void rt_stats_window(rt_stats_t *s, double since, double ttft_slo_ms, double tpot_slo_ms, rt_slo_window_t *out)
{
    rt_stats_window_n(s, since, since, 0, ttft_slo_ms, tpot_slo_ms, out);
}

void rt_stats_window_n(rt_stats_t *s, double since, double floor, uint32_t min_n, double ttft_slo_ms,
                       double tpot_slo_ms, rt_slo_window_t *out)
{
    memset(out, 0, sizeof *out);
    double *ttft = malloc(RT_DONE_RING * sizeof *ttft), *tpot = malloc(RT_DONE_RING * sizeof *tpot);
    if (!ttft || !tpot) {
        free(ttft);
        free(tpot);
        return;
    }
    pthread_mutex_lock(&s->mu);
    uint64_t n = s->n_done < RT_DONE_RING ? s->n_done : RT_DONE_RING;
    for (uint64_t k = 0; k < n; k++) {
        const rt_done_t *d = &s->done[(s->n_done - 1 - k) % RT_DONE_RING];
        if (d->t < since && (out->n >= min_n || d->t < floor))
            break;
        bool ttft_miss = !d->ok || (ttft_slo_ms > 0 && d->ttft_ms > ttft_slo_ms);
        bool tpot_miss = !d->ok || (tpot_slo_ms > 0 && d->tpot_ms > tpot_slo_ms);
        out->ttft_missed += ttft_miss;
        out->tpot_missed += tpot_miss;
        out->met += !ttft_miss && !tpot_miss;
        out->prompt_tokens += d->prompt_tokens;
        out->local_tokens += d->local ? d->prompt_tokens : 0;
        ttft[out->n] = d->ttft_ms;
        tpot[out->n++] = d->tpot_ms;
    }
    pthread_mutex_unlock(&s->mu);
    out->ttft_p90_ms = p90(ttft, out->n);
    out->tpot_p90_ms = p90(tpot, out->n);
    free(ttft);
    free(tpot);
}

void rt_stats_json(rt_stats_t *s, json_t *j)
{
    /* each ring sorted for its quantiles: wall and CPU time of the router's work per request, and the
     * time its steps waited to be picked up by a pool thread */
    static const char *const names[3] = {"overhead_ms", "overhead_cpu_ms", "handoff_ms"};
    double *q[3];
    pthread_mutex_lock(&s->mu);
    size_t no = s->n_overhead < RT_OVERHEAD_RING ? s->n_overhead : RT_OVERHEAD_RING;
    for (int k = 0; k < 3; k++) {
        q[k] = malloc((no ? no : 1) * sizeof *q[k]);
        if (q[k])
            memcpy(q[k], k == 0 ? s->overhead : k == 1 ? s->overhead_cpu : s->handoff, no * sizeof *q[k]);
    }
    json_object_set_new(j, "requests", json_integer((json_int_t)s->n_requests));
    json_object_set_new(j, "ok", json_integer((json_int_t)s->n_ok));
    json_object_set_new(j, "errors", json_integer((json_int_t)s->n_errors));
    pthread_mutex_unlock(&s->mu);
    for (int k = 0; k < 3; k++) {
        if (q[k] && no) {
            char key[48];
            qsort(q[k], no, sizeof *q[k], cmp_double);
            snprintf(key, sizeof key, "%s_p50", names[k]);
            json_object_set_new(j, key, json_real(q[k][no / 2] * 1e3));
            snprintf(key, sizeof key, "%s_p99", names[k]);
            json_object_set_new(j, key, json_real(q[k][(size_t)(0.99 * (double)(no - 1))] * 1e3));
            snprintf(key, sizeof key, "%s_max", names[k]);
            json_object_set_new(j, key, json_real(q[k][no - 1] * 1e3));
        }
        free(q[k]);
    }
}
