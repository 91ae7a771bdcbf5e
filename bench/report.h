/* report.h — a benchmark's results for people and machines: the summary table
 * (stdout), a JSON file with the configuration, git commit, machine, every
 * request of every rate, the attainment curve and the goodput, and plots
 * (attainment vs rate; TTFT and TPOT CDFs) as SVG and PNG through gnuplot. */
#ifndef BENCH_REPORT_H
#define BENCH_REPORT_H

#include <stddef.h>

#include "bench/openai.h"
#include "bench/stats.h"
#include "common/status.h"

typedef struct bench_point {
    double rate;              /* requests/s offered (trace: its mean rate) */
    bench_result_t *res;
    size_t n;
    bench_summary_t sum;
} bench_point_t;

typedef struct bench_report {
    const char *argv_line;    /* the command, as typed */
    const char *endpoint, *api, *workload;
    double ttft_slo, tpot_slo, attainment;  /* seconds, seconds, 0..1 */
    bench_point_t *points;
    size_t n_points;
    double goodput;
    int bounded;
    unsigned workers;         /* goodput per worker = goodput / workers */
    const double *slo_scales; /* optional: attainment with both SLOs times each scale */
    size_t n_slo_scales;
    uint64_t salt_base;       /* rate k's prompts were salted with salt_base + k (0: the same prompts at every rate) */
} bench_report_t;

void bench_print_table(const bench_report_t *r);
/* Writes path (JSON) and, beside it, PATH-attainment.{svg,png},
 * PATH-ttft.{svg,png}, PATH-tpot.{svg,png} (PATH = path without .json). */
td_status_t bench_write_report(const bench_report_t *r, const char *path);

#endif
