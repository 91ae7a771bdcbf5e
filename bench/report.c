/* report.c — see report.h. */
#include "bench/report.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <unistd.h>
#include <time.h>

#include "common/log.h"

void bench_print_table(const bench_report_t *r)
{
    printf("\n%-8s %6s %6s %6s %7s %9s %9s %9s %9s %9s %9s %8s\n", "rate", "sent", "ok", "failed", "SLO met", "TTFT p50",
           "TTFT p99", "TPOT p50", "TPOT p99", "gap max", "tok/s", "send err");
    for (size_t i = 0; i < r->n_points; i++) {
        const bench_summary_t *s = &r->points[i].sum;
        char ms[4][16];
        const double v[4] = {s->ttft_p50, s->ttft_p99, s->tpot_p50, s->tpot_p99};
        for (int j = 0; j < 4; j++) /* no successful request: no percentile */
            snprintf(ms[j], sizeof ms[j], isfinite(v[j]) ? "%.1fms" : "-", 1e3 * v[j]);
        printf("%-8.2f %6zu %6zu %6zu %6.1f%% %10s %9s %9s %9s %8.1fms %9.1f %6.1fms\n", r->points[i].rate, s->n,
               s->ok, s->failed, 100 * s->attainment, ms[0], ms[1], ms[2], ms[3], 1e3 * s->gap_max, s->out_tok_per_s,
               1e3 * s->send_err_max);
    }
    if (r->salt_base)
        printf("prompts: each rate's are its own (rate k salted %llu + k; the workload's own sharing kept): no rate "
               "is served from another rate's prompts\n", (unsigned long long)r->salt_base);
    else if (r->n_points > 1)
        printf("prompts: the same at every rate (--salt none): a server's cache filled by one rate serves the "
               "next\n");
    for (size_t i = 0; i < r->n_points; i++) { /* the first errors of a rate with failures, each once */
        const bench_point_t *p = &r->points[i];
        if (!p->sum.failed)
            continue;
        const char *seen[3] = {0};
        int n = 0;
        for (size_t j = 0; j < p->n && n < 3; j++) {
            const bench_result_t *q = &p->res[j];
            if (q->ok || q->rejected)
                continue;
            const char *e = q->error[0] ? q->error : "no error text";
            bool dup = false;
            for (int k = 0; k < n; k++)
                dup |= !strcmp(seen[k], e);
            if (!dup) {
                seen[n++] = e;
                printf("rate %.2f: failed (status %d): %s\n", p->rate, q->status, e);
            }
        }
    }
    for (size_t i = 0; i < r->n_points; i++) { /* what only some servers or runs have */
        const bench_summary_t *s = &r->points[i].sum;
        if (s->rejected)
            printf("rate %.2f: %zu rejected, answered in p50 %.1f ms / max %.1f ms; admitted requests' SLO "
                   "attainment %.1f%%\n", r->points[i].rate, s->rejected, 1e3 * s->reject_p50, 1e3 * s->reject_max,
                   100 * s->admitted_attainment);
        if (s->cached_share > 0 || r->n_points > 1)
            printf("rate %.2f: %.1f%% of prompt tokens were served from the KV cache\n", r->points[i].rate,
                   100 * s->cached_share);
        if (s->predicted)
            printf("rate %.2f: the server's TTFT prediction, |error| / TTFT over %zu requests: p50 %.1f%%, p90 "
                   "%.1f%%\n", r->points[i].rate, s->predicted, 100 * s->pred_err_p50, 100 * s->pred_err_p90);
    }
    for (size_t k = 0; k < r->n_slo_scales; k++) {
        printf("SLO x %-5.2g attainment:", r->slo_scales[k]);
        for (size_t i = 0; i < r->n_points; i++) {
            bench_summary_t s = bench_summarize(r->points[i].res, r->points[i].n, r->ttft_slo * r->slo_scales[k],
                                                r->tpot_slo * r->slo_scales[k]);
            printf(" %6.1f%%", 100 * s.attainment);
        }
        printf("\n");
    }
    printf("\nSLOs: TTFT <= %.0f ms, TPOT <= %.0f ms for %.0f%% of requests -> goodput %.2f req/s (%.2f per worker "
           "of %u)%s\n", 1e3 * r->ttft_slo, 1e3 * r->tpot_slo, 100 * r->attainment, r->goodput,
           r->goodput / (r->workers ? r->workers : 1), r->workers ? r->workers : 1,
           r->bounded ? "" : " (a lower bound: every rate met the target)");
}

static json_t *num(double v) { return isfinite(v) ? json_real(v) : json_null(); }

/* percentiles of an empty or all-failed run are NaN: null in the JSON */
static json_t *summary_json(const bench_summary_t *s)
{
    json_t *o = json_pack("{s:I,s:I,s:I,s:I,s:I}", "n", (json_int_t)s->n, "ok", (json_int_t)s->ok, "failed",
                          (json_int_t)s->failed, "rejected", (json_int_t)s->rejected, "slo_met", (json_int_t)s->met);
    const struct { const char *k; double v; } f[] = {
        {"attainment", s->attainment}, {"ttft_p50", s->ttft_p50}, {"ttft_p90", s->ttft_p90},
        {"ttft_p99", s->ttft_p99}, {"tpot_p50", s->tpot_p50}, {"tpot_p90", s->tpot_p90}, {"tpot_p99", s->tpot_p99},
        {"gap_p90_median", s->gap_p90_p50}, {"gap_max", s->gap_max}, {"e2e_p50", s->e2e_p50},
        {"e2e_p90", s->e2e_p90}, {"duration", s->duration}, {"req_per_s", s->req_per_s},
        {"out_tok_per_s", s->out_tok_per_s}, {"send_err_p50", s->send_err_p50}, {"send_err_max", s->send_err_max},
        {"admitted_attainment", s->admitted_attainment}, {"reject_p50", s->reject_p50},
        {"reject_max", s->reject_max}, {"pred_err_p50", s->pred_err_p50}, {"pred_err_p90", s->pred_err_p90},
        {"cached_share", s->cached_share},
    };
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++)
        json_object_set_new(o, f[i].k, num(f[i].v));
    return o;
}


static json_t *request_json(const bench_result_t *q)
{
    json_t *o = json_object();
    json_object_set_new(o, "t_planned", num(q->t_planned));
    json_object_set_new(o, "t_sent", num(q->t_sent));
    json_object_set_new(o, "ttft", q->ok ? num(q->t_first - q->t_sent) : json_null());
    json_object_set_new(o, "tpot", q->ok ? num(q->tpot) : json_null());
    json_object_set_new(o, "gap_p90", num(q->gap_p90));
    json_object_set_new(o, "gap_max", num(q->gap_max));
    json_object_set_new(o, "e2e", num(q->t_done - q->t_sent));
    json_object_set_new(o, "input_tokens", json_integer(q->n_in));
    json_object_set_new(o, "output_tokens", json_integer(q->n_out));
    json_object_set_new(o, "cached_tokens", json_integer(q->n_cached));
    json_object_set_new(o, "store_cached_tokens", json_integer(q->n_store_cached));
    json_object_set_new(o, "finish_reason", json_string(q->finish));
    json_object_set_new(o, "status", json_integer(q->status));
    json_object_set_new(o, "ok", json_boolean(q->ok));
    json_object_set_new(o, "rejected", json_boolean(q->rejected));
    if (q->retry_after_ms)
        json_object_set_new(o, "retry_after_ms", json_integer(q->retry_after_ms));
    if (q->predicted_ttft > 0)
        json_object_set_new(o, "predicted_ttft", num(q->predicted_ttft));
    if (q->server_ttft > 0)
        json_object_set_new(o, "server_ttft", num(q->server_ttft));
    if (q->prefill_worker[0])
        json_object_set_new(o, "prefill_worker", json_string(q->prefill_worker));
    if (q->decode_worker[0]) /* the way it went: local when it is the prefill worker too */
        json_object_set_new(o, "decode_worker", json_string(q->decode_worker));
    if (q->handoff_ms > 0) /* the disaggregated path's parts of its TTFT, ms */
        json_object_set_new(o, "first_token_path",
                            json_pack("{s:f,s:f,s:f,s:f,s:b}", "reserve_ms", q->reserve_ms, "prefill_call_ms",
                                      q->prefill_call_ms, "prefill_worker_ms", q->prefill_worker_ms, "handoff_ms",
                                      q->handoff_ms, "first_token_early", q->first_token_early));
    if (q->error[0])
        json_object_set_new(o, "error", json_string(q->error));
    return o;
}

static void machine(char *buf, size_t cap)
{
    struct utsname u;
    char cpu[128] = "unknown cpu";
    FILE *f = fopen("/proc/cpuinfo", "r");
    char line[256];
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, "model name", 10)) {
            char *c = strchr(line, ':');
            if (c)
                snprintf(cpu, sizeof cpu, "%s", c + 2);
            cpu[strcspn(cpu, "\n")] = '\0';
            break;
        }
    if (f)
        fclose(f);
    uname(&u);
    snprintf(buf, cap, "%s, %ld cores; %s %s %s", cpu, sysconf(_SC_NPROCESSORS_ONLN), u.sysname, u.release, u.machine);
}

static void git_commit(char *buf, size_t cap)
{
    snprintf(buf, cap, "unknown");
    FILE *p = popen("timeout 10 git rev-parse --short HEAD 2>/dev/null", "r");
    if (p) {
        if (fgets(buf, (int)cap, p))
            buf[strcspn(buf, "\n")] = '\0';
        pclose(p);
    }
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* gnuplot: attainment vs rate, and CDFs of TTFT and TPOT at each rate. */
static td_status_t plots(const bench_report_t *r, const char *base)
{
    char dat[1024], gp[1024];
    if ((size_t)snprintf(dat, sizeof dat, "%s-plot.dat", base) >= sizeof dat ||
        (size_t)snprintf(gp, sizeof gp, "%s-plot.gp", base) >= sizeof gp)
        return td_error(TD_ERR_INVALID_ARG, "bench: the report's path %.64s... is too long for its plot files", base);
    FILE *d = fopen(dat, "w"), *g = fopen(gp, "w");
    if (!d || !g) {
        if (d)
            fclose(d);
        if (g)
            fclose(g);
        return td_error(TD_ERR_IO, "bench: cannot write %s: %s", dat, strerror(errno));
    }
    /* block 0: the attainment curve; blocks 1..: per rate, sorted TTFT and TPOT with their CDF */
    for (size_t i = 0; i < r->n_points; i++)
        fprintf(d, "%g %g\n", r->points[i].rate, 100 * r->points[i].sum.attainment);
    for (size_t i = 0; i < r->n_points; i++) {
        const bench_point_t *p = &r->points[i];
        double *t = malloc((p->n + 1) * sizeof *t), *u = malloc((p->n + 1) * sizeof *u);
        size_t k = 0;
        for (size_t j = 0; j < p->n; j++)
            if (p->res[j].ok) {
                t[k] = 1e3 * (p->res[j].t_first - p->res[j].t_sent);
                u[k++] = 1e3 * p->res[j].tpot;
            }
        qsort(t, k, sizeof *t, cmp_d);
        qsort(u, k, sizeof *u, cmp_d);
        fprintf(d, "\n\n");
        for (size_t j = 0; j < k; j++)
            fprintf(d, "%g %g %g\n", t[j], u[j], (j + 1.0) / k);
        free(t), free(u);
    }
    fclose(d);
    const char *fmt[2][2] = {{"svg size 800,500", "svg"}, {"pngcairo size 800,500", "png"}};
    for (int f = 0; f < 2; f++) {
        fprintf(g, "set terminal %s\nset grid\nset key bottom right\n", fmt[f][0]);
        fprintf(g, "set output '%s-attainment.%s'\nset xlabel 'request rate (req/s)'\nset ylabel 'SLO attainment (%%)'\n"
                   "set yrange [0:105]\nset arrow from graph 0, first %g to graph 1, first %g nohead dt 2\n"
                   "plot '%s' index 0 with linespoints title 'attainment'\nunset arrow\nset yrange [*:*]\n",
                base, fmt[f][1], 100 * r->attainment, 100 * r->attainment, dat);
        for (int which = 0; which < 2; which++) {
            fprintf(g, "set output '%s-%s.%s'\nset xlabel '%s (ms)'\nset ylabel 'CDF'\nplot ", base,
                    which ? "tpot" : "ttft", fmt[f][1], which ? "TPOT" : "TTFT");
            for (size_t i = 0; i < r->n_points; i++)
                fprintf(g, "%s'%s' index %zu using %d:3 with lines title '%.2f req/s'", i ? ", " : "", dat, i + 1,
                        which + 1, r->points[i].rate);
            fprintf(g, "\n");
        }
    }
    fclose(g);
    char cmd[2200];
    snprintf(cmd, sizeof cmd, "timeout 60 gnuplot '%s' 2>&1", gp);
    FILE *p = popen(cmd, "r");
    char out[512];
    size_t said = 0;
    while (p && fgets(out, sizeof out, p))
        if (said++ < 3)
            TD_WARN("gnuplot: %s", out);
    int rc = p ? pclose(p) : -1;
    if (rc != -1 && WIFEXITED(rc) && WEXITSTATUS(rc) == 127) { /* the shell found no gnuplot: the report stands */
        TD_WARN("bench: gnuplot is not installed, so no plots were drawn; `gnuplot %s` draws them", gp);
        return TD_OK;
    }
    if (rc != 0)
        return td_error(TD_ERR_IO, "bench: gnuplot failed on %s", gp);
    return TD_OK;
}

td_status_t bench_write_report(const bench_report_t *r, const char *path)
{
    char mach[512], commit[64], when[64];
    machine(mach, sizeof mach);
    git_commit(commit, sizeof commit);
    time_t now = time(NULL);
    strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%SZ", gmtime(&now));
    json_t *root = json_object(), *points = json_array(), *curve = json_array();
    json_object_set_new(root, "command", json_string(r->argv_line));
    json_object_set_new(root, "date", json_string(when));
    json_object_set_new(root, "git_commit", json_string(commit));
    json_object_set_new(root, "machine", json_string(mach));
    json_object_set_new(root, "config", json_pack("{s:s,s:s,s:s,s:f,s:f,s:f}", "endpoint", r->endpoint, "api", r->api,
                                                  "workload", r->workload, "ttft_slo_ms", 1e3 * r->ttft_slo,
                                                  "tpot_slo_ms", 1e3 * r->tpot_slo, "attainment", r->attainment));
    json_object_set_new(json_object_get(root, "config"), "salt_base", json_integer((json_int_t)r->salt_base));
    for (size_t i = 0; i < r->n_points; i++) {
        const bench_point_t *p = &r->points[i];
        json_t *reqs = json_array();
        for (size_t j = 0; j < p->n; j++)
            json_array_append_new(reqs, request_json(&p->res[j]));
        json_array_append_new(points, json_pack("{s:f,s:o,s:o}", "rate", p->rate, "summary", summary_json(&p->sum),
                                                "requests", reqs));
        json_array_append_new(curve, json_pack("[f,f]", p->rate, p->sum.attainment));
    }
    json_object_set_new(root, "runs", points);
    json_object_set_new(root, "attainment_curve", curve);
    json_object_set_new(root, "goodput", json_real(r->goodput));
    json_object_set_new(root, "goodput_per_worker", json_real(r->goodput / (r->workers ? r->workers : 1)));
    json_object_set_new(root, "workers", json_integer(r->workers ? r->workers : 1));
    if (r->n_slo_scales) {
        json_t *sc = json_array();
        for (size_t k = 0; k < r->n_slo_scales; k++) {
            json_t *row = json_array();
            for (size_t i = 0; i < r->n_points; i++)
                json_array_append_new(row, json_real(bench_summarize(r->points[i].res, r->points[i].n,
                                                                     r->ttft_slo * r->slo_scales[k],
                                                                     r->tpot_slo * r->slo_scales[k]).attainment));
            json_array_append_new(sc, json_pack("{s:f,s:o}", "scale", r->slo_scales[k], "attainment_by_rate", row));
        }
        json_object_set_new(root, "slo_scale_sweep", sc);
    }
    json_object_set_new(root, "goodput_bounded", json_boolean(r->bounded));
    char dir[1024];
    snprintf(dir, sizeof dir, "%s", path);
    char *slash = strrchr(dir, '/');
    if (slash && slash != dir) { /* make the folder the report goes to */
        *slash = '\0';
        char cmd[1100];
        snprintf(cmd, sizeof cmd, "mkdir -p '%s'", dir);
        if (system(cmd) != 0)
            TD_WARN("bench: cannot make %s", dir);
    }
    int w = json_dump_file(root, path, JSON_INDENT(1));
    json_decref(root);
    if (w != 0)
        return td_error(TD_ERR_IO, "bench: cannot write %s", path);
    char base[1024];
    snprintf(base, sizeof base, "%s", path);
    size_t bl = strlen(base);
    if (bl > 5 && !strcmp(base + bl - 5, ".json"))
        base[bl - 5] = '\0';
    return plots(r, base);
}
