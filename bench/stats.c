/* stats.c — see stats.h. */
#include "bench/stats.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

double bench_percentile(double *v, size_t n, double p)
{
    if (!n)
        return NAN;
    qsort(v, n, sizeof *v, cmp_d);
    double pos = p / 100.0 * (double)(n - 1);
    size_t lo = (size_t)floor(pos), hi = lo + 1 < n ? lo + 1 : lo;
    return v[lo] + (v[hi] - v[lo]) * (pos - (double)lo);
}

bench_summary_t bench_summarize(const bench_result_t *r, size_t n, double ttft_slo, double tpot_slo)
{
    bench_summary_t s;
    memset(&s, 0, sizeof s);
    s.n = n;
    double *a = malloc((n ? n : 1) * sizeof *a), *b = malloc((n ? n : 1) * sizeof *b),
           *c = malloc((n ? n : 1) * sizeof *c), *d = malloc((n ? n : 1) * sizeof *d),
           *e = malloc((n ? n : 1) * sizeof *e), *f = malloc((n ? n : 1) * sizeof *f),
           *g = malloc((n ? n : 1) * sizeof *g);
    size_t k = 0, nrej = 0;
    double first = INFINITY, last = 0, toks = 0, in_toks = 0, cached = 0;
    for (size_t i = 0; i < n; i++) {
        const bench_result_t *q = &r[i];
        e[i] = fabs(q->t_sent - q->t_planned);
        s.send_err_max = fmax(s.send_err_max, e[i]);
        first = fmin(first, q->t_sent);
        last = fmax(last, q->t_done);
        if (!q->ok) {
            s.failed++;
            s.rejected += q->rejected;
            if (q->rejected && q->t_done > 0)
                f[nrej++] = q->t_done - q->t_sent;
            continue;
        }
        if (q->predicted_ttft > 0 && q->server_ttft > 0)
            g[s.predicted++] = fabs(q->predicted_ttft - q->server_ttft) / q->server_ttft;
        s.ok++;
        toks += q->n_out;
        in_toks += q->n_in;
        cached += q->n_cached;
        double ttft = q->t_first - q->t_sent;
        a[k] = ttft;
        b[k] = q->tpot;
        c[k] = q->t_done - q->t_sent;
        d[k] = q->gap_p90;
        s.gap_max = fmax(s.gap_max, q->gap_max);
        k++;
        if (ttft <= ttft_slo && q->tpot <= tpot_slo)
            s.met++;
    }
    s.attainment = n ? (double)s.met / (double)n : 0;
    s.cached_share = in_toks > 0 ? cached / in_toks : 0;
    s.admitted_attainment = n > s.rejected ? (double)s.met / (double)(n - s.rejected) : 0;
    s.reject_p50 = bench_percentile(f, nrej, 50);
    s.reject_max = nrej ? bench_percentile(f, nrej, 100) : NAN;
    s.pred_err_p50 = bench_percentile(g, s.predicted, 50);
    s.pred_err_p90 = bench_percentile(g, s.predicted, 90);
    s.ttft_p50 = bench_percentile(a, k, 50), s.ttft_p90 = bench_percentile(a, k, 90),
    s.ttft_p99 = bench_percentile(a, k, 99);
    s.tpot_p50 = bench_percentile(b, k, 50), s.tpot_p90 = bench_percentile(b, k, 90),
    s.tpot_p99 = bench_percentile(b, k, 99);
    s.e2e_p50 = bench_percentile(c, k, 50), s.e2e_p90 = bench_percentile(c, k, 90);
    s.gap_p90_p50 = bench_percentile(d, k, 50);
    s.send_err_p50 = bench_percentile(e, n, 50);
    s.duration = n && last > first ? last - first : 0;
    s.req_per_s = s.duration > 0 ? (double)s.ok / s.duration : 0;
    s.out_tok_per_s = s.duration > 0 ? toks / s.duration : 0;
    free(a), free(b), free(c), free(d), free(e), free(f), free(g);
    return s;
}

double bench_goodput(const double *rates, const double *attain, size_t n, double target, int *bounded)
{
    *bounded = 1;
    if (!n || attain[0] < target)
        return 0;
    for (size_t i = 1; i < n; i++)
        if (attain[i] < target) {
            double t = (attain[i - 1] - target) / (attain[i - 1] - attain[i]);
            return rates[i - 1] + t * (rates[i] - rates[i - 1]);
        }
    *bounded = 0;
    return rates[n - 1];
}
