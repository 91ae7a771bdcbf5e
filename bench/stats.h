/* stats.h — what a benchmark run comes to: percentiles, SLO attainment and
 * goodput as DistServe defines it (the highest request rate at which at least
 * X% of requests meet both their TTFT and TPOT SLO). */
#ifndef BENCH_STATS_H
#define BENCH_STATS_H

#include <stddef.h>

#include "bench/openai.h"

/* The p-th percentile (0..100) of v[0..n), linear between order statistics
 * (numpy's default); sorts v; NAN for n = 0. */
double bench_percentile(double *v, size_t n, double p);

typedef struct bench_summary {
    size_t n, ok, failed, rejected, met; /* rejected: of the failed, refused before any token */
    double attainment;                   /* met / n, 0..1 (failed requests miss) */
    double admitted_attainment;          /* met / (n - rejected): of the requests the server took */
    double ttft_p50, ttft_p90, ttft_p99;  /* seconds, over ok requests */
    double tpot_p50, tpot_p90, tpot_p99;
    double gap_p90_p50, gap_max;          /* per-request p90 gap (median over requests), worst gap */
    double e2e_p50, e2e_p90;
    double duration, req_per_s, out_tok_per_s;
    double send_err_p50, send_err_max;    /* open-loop schedule error, seconds */
    double reject_p50, reject_max;        /* how fast rejections were answered, seconds (NAN: none) */
    double cached_share;                  /* prompt tokens served from a KV cache, of all prompt tokens (ok requests) */
    size_t predicted;                     /* ok requests that carried the server's TTFT prediction */
    double pred_err_p50, pred_err_p90;    /* |predicted - server TTFT| / server TTFT over them (NAN: none) */
} bench_summary_t;

/* A request meets the SLOs when it succeeded, its TTFT <= ttft_slo and its
 * mean inter-token gap <= tpot_slo (seconds). */
bench_summary_t bench_summarize(const bench_result_t *r, size_t n, double ttft_slo, double tpot_slo);

/* Goodput from an attainment curve (rates ascending, attainment 0..1): the
 * rate where attainment first falls below target, interpolated linearly
 * between the last rate that met it and the first that did not; the highest
 * rate if all meet it (*bounded = 0: the sweep did not reach the limit); 0 if
 * none does. */
double bench_goodput(const double *rates, const double *attain, size_t n, double target, int *bounded);

#endif
