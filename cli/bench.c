/* bench.c — `tandem bench`: SLO goodput benchmarking of a serving endpoint,
 * in the spirit of `vllm bench serve` (bench/workload.h, openai.h, stats.h,
 * report.h). One run per rate of --sweep (or the one --rate), open loop. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/grpc.h"
#include "bench/openai.h"
#include "bench/report.h"
#include "bench/stats.h"
#include "bench/workload.h"
#include "cli/cli.h"
#include "common/config.h"
#include "common/log.h"
#include "engine/model.h"

const char cli_bench_usage[] =
    "usage: tandem bench --endpoint HOST:PORT [--api openai|grpc] [--model NAME] [--tls-ca PEM]\n"
    "                    [--rate R | --sweep R1,R2,...] [--num-requests N]\n"
    "                    [--workload synthetic | trace FILE | prompts FILE] [--time-scale X]\n"
    "                    [--trace-block TOKENS] [--trace-divide K]\n"
    "                    [--input-len fixed:N|uniform:A:B|loguniform:A:B|lognormal:MEAN:SIGMA] [--output-len ...]\n"
    "                    [--cv C] [--prefix-groups G] [--prefix-share S] [--seed S]\n"
    "                    [--goodput ttft:MS,tpot:MS] [--attainment 90] [--timeout S] [--ignore-eos]\n"
    "                    [--workers N] [--slo-scale S1,S2,...] [--tokenizer MODEL] [--output FILE.json]\n"
    "                    [--salt N|none]\n"
    "  a sweep salts each rate's prompts (N + the rate's index, N 1 by default): no rate is served from another\n"
    "  rate's prompts by a cache, while the workload's own sharing stays; --salt none sends the same prompts at\n"
    "  every rate; --salt N with one rate salts it too (a run that must not meet an earlier run's prompts)\n";

static bool parse_len(const char *s, bench_len_t *l)
{
    char kind[16];
    double a = 0, b = 0;
    int k = sscanf(s, "%15[a-z]:%lf:%lf", kind, &a, &b);
    if (k >= 2 && !strcmp(kind, "fixed") && a >= 1)
        *l = (bench_len_t){BENCH_DIST_FIXED, a, 0};
    else if (k == 3 && !strcmp(kind, "uniform") && a >= 1 && b >= a)
        *l = (bench_len_t){BENCH_DIST_UNIFORM, a, b};
    else if (k == 3 && !strcmp(kind, "loguniform") && a >= 1 && b >= a)
        *l = (bench_len_t){BENCH_DIST_LOGUNIFORM, a, b};
    else if (k == 3 && !strcmp(kind, "lognormal") && a >= 1 && b > 0)
        *l = (bench_len_t){BENCH_DIST_LOGNORMAL, a, b};
    else
        return false;
    return true;
}

static bool parse_num(const char *s, double lo, double hi, double *out)
{
    char *end;
    errno = 0;
    double v = strtod(s ? s : "", &end);
    if (!s || errno || end == s || *end || !(v >= lo && v <= hi))
        return false;
    *out = v;
    return true;
}

/* What the flags ask for. */
typedef struct bench_opts {
    const char *endpoint, *api, *model_name, *workload, *wfile, *out_path, *tls_ca, *tok_model;
    double rates[64], scales[16], ttft_ms, tpot_ms, attain, timeout;
    bench_trace_opts_t topts;
    size_t n_rates, n_req, n_scales;
    unsigned workers;
    bool ignore_eos;
    /* a sweep's rates each get prompts of their own (salt base + rate index), unless --salt none */
    double salt_base;
    bool salt_given, salt_none;
    bench_synthetic_t syn;
} bench_opts_t;

/* Parses the flags into o; 0, or the exit code of a usage error (named on stderr). */
static int parse_args(int argc, char **argv, bench_opts_t *o)
{
    double v = 0;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i], *nx = i + 1 < argc ? argv[i + 1] : NULL;
        bool ok = true;
        if (!strcmp(a, "--endpoint") && nx) o->endpoint = argv[++i];
        else if (!strcmp(a, "--api") && nx) o->api = argv[++i];
        else if (!strcmp(a, "--model") && nx) o->model_name = argv[++i];
        else if (!strcmp(a, "--tokenizer") && nx) o->tok_model = argv[++i];
        else if (!strcmp(a, "--output") && nx) o->out_path = argv[++i];
        else if (!strcmp(a, "--tls-ca") && nx) o->tls_ca = argv[++i];
        else if (!strcmp(a, "--ignore-eos")) o->ignore_eos = true;
        else if (!strcmp(a, "--salt") && nx) {
            o->salt_none = !strcmp(nx, "none");
            o->salt_given = true;
            ok = o->salt_none || parse_num(nx, 1, 1e15, &o->salt_base);
            i++;
        }
        else if (!strcmp(a, "--workload") && nx) {
            o->workload = argv[++i];
            if (strcmp(o->workload, "synthetic")) {
                if (i + 1 >= argc) ok = false;
                else o->wfile = argv[++i];
            }
        } else if (!strcmp(a, "--rate") && nx) {
            ok = parse_num(argv[++i], 1e-6, 1e6, &o->rates[0]);
            o->n_rates = 1;
        } else if (!strcmp(a, "--sweep") && nx) {
            char *copy = strdup(argv[++i]), *save = NULL;
            o->n_rates = 0;
            for (char *t = strtok_r(copy, ",", &save); t && ok; t = strtok_r(NULL, ",", &save))
                ok = o->n_rates < 64 && parse_num(t, 1e-6, 1e6, &o->rates[o->n_rates++]);
            free(copy);
            for (size_t k = 1; ok && k < o->n_rates; k++)
                ok = o->rates[k] > o->rates[k - 1];
            if (!ok)
                fprintf(stderr, "tandem bench: --sweep needs ascending positive rates, like 1,2,4\n");
        } else if (!strcmp(a, "--slo-scale") && nx) {
            char *copy = strdup(argv[++i]), *save = NULL;
            for (char *t = strtok_r(copy, ",", &save); t && ok; t = strtok_r(NULL, ",", &save))
                ok = o->n_scales < 16 && parse_num(t, 0.01, 100, &o->scales[o->n_scales++]);
            free(copy);
        } else if (!strcmp(a, "--workers") && nx) {
            ok = parse_num(argv[++i], 1, 1e5, &v);
            o->workers = (unsigned)v;
        } else if (!strcmp(a, "--num-requests") && nx) {
            ok = parse_num(argv[++i], 1, 1e7, &v);
            o->n_req = (size_t)v;
        } else if (!strcmp(a, "--input-len") && nx) ok = parse_len(argv[++i], &o->syn.input);
        else if (!strcmp(a, "--output-len") && nx) ok = parse_len(argv[++i], &o->syn.output);
        else if (!strcmp(a, "--cv") && nx) ok = parse_num(argv[++i], 0.01, 100, &o->syn.cv);
        else if (!strcmp(a, "--prefix-groups") && nx) {
            ok = parse_num(argv[++i], 0, 1e6, &v);
            o->syn.groups = (uint32_t)v;
        } else if (!strcmp(a, "--prefix-share") && nx) ok = parse_num(argv[++i], 0, 0.99, &o->syn.prefix_share);
        else if (!strcmp(a, "--seed") && nx) {
            ok = parse_num(argv[++i], 0, 1e18, &v);
            o->syn.seed = (uint64_t)v;
        } else if (!strcmp(a, "--time-scale") && nx) ok = parse_num(argv[++i], 1e-6, 1e6, &o->topts.time_scale);
        else if (!strcmp(a, "--trace-block") && nx) {
            ok = parse_num(argv[++i], 1, 1 << 20, &v);
            o->topts.block_tokens = (uint32_t)v;
        } else if (!strcmp(a, "--trace-divide") && nx) {
            ok = parse_num(argv[++i], 1, 1 << 20, &v);
            o->topts.divide = (uint32_t)v;
        }
        else if (!strcmp(a, "--timeout") && nx) ok = parse_num(argv[++i], 0.1, 86400, &o->timeout);
        else if (!strcmp(a, "--attainment") && nx) ok = parse_num(argv[++i], 1, 100, &o->attain);
        else if (!strcmp(a, "--goodput") && nx) {
            ok = sscanf(argv[++i], "ttft:%lf,tpot:%lf", &o->ttft_ms, &o->tpot_ms) == 2 && o->ttft_ms > 0 && o->tpot_ms > 0;
        } else {
            fprintf(stderr, "tandem bench: unknown or incomplete option '%s'\n%s", a, cli_bench_usage);
            return 2;
        }
        if (!ok) {
            fprintf(stderr, "tandem bench: bad value for %s\n%s", a, cli_bench_usage);
            return 2;
        }
    }
    if (!o->endpoint) {
        fputs(cli_bench_usage, stderr);
        return 2;
    }
    const char *hostport = strstr(o->endpoint, "://") ? strstr(o->endpoint, "://") + 3 : o->endpoint;
    if (!*hostport || *hostport == ':' || *hostport == '/') {
        fprintf(stderr, "tandem bench: --endpoint '%s' names no host\n", o->endpoint);
        return 2;
    }
    bool grpc = !strcmp(o->api, "grpc");
    if (!grpc && strcmp(o->api, "openai")) {
        fprintf(stderr, "tandem bench: --api is openai or grpc, not '%s'\n", o->api);
        return 2;
    }
    if (strcmp(o->workload, "synthetic") && strcmp(o->workload, "trace") && strcmp(o->workload, "prompts")) {
        fprintf(stderr, "tandem bench: --workload is synthetic, trace FILE or prompts FILE, not '%s'\n",
                o->workload);
        return 2;
    }
    if (!o->n_rates)
        o->rates[o->n_rates++] = 1;
    if (!o->n_rates)
        o->rates[o->n_rates++] = 1;
    return 0;
}

/* Rate k's workload: synthetic at that rate, a trace (rescaled to the rate in a sweep) or a prompts file; its
 * offered rate in *offered. */
static td_status_t make_workload(bench_opts_t *o, size_t k, const bench_workload_t *words, bool salted,
                                 bench_workload_t *w, double *offered)
{
    *w = (bench_workload_t){.words = words->words, .n_words = words->n_words,
                            .salt = salted ? (uint64_t)o->salt_base + k : 0};
    td_status_t rc;
    if (!strcmp(o->workload, "synthetic")) {
        o->syn.rate = o->rates[k];
        o->syn.n = o->n_req;
        rc = bench_synthetic(w, &o->syn);
    } else if (!strcmp(o->workload, "trace")) {
        rc = bench_trace(w, o->wfile, &o->topts, o->n_req);
        if (!rc && o->n_rates > 1 && w->n > 1 && w->req[w->n - 1].t_send > 0) { /* rescale to the rate asked */
            double native = (w->n - 1) / w->req[w->n - 1].t_send;
            for (size_t i = 0; i < w->n; i++)
                w->req[i].t_send *= native / o->rates[k];
        }
    } else {
        rc = bench_prompts(w, o->wfile, o->rates[k], 64, o->n_req);
    }
    *offered = o->rates[k];
    if (!rc && !strcmp(o->workload, "trace") && o->n_rates == 1 && w->n > 1 && w->req[w->n - 1].t_send > 0)
        *offered = (w->n - 1) / w->req[w->n - 1].t_send;
    return rc;
}

int cli_bench(int argc, char **argv)
{
    bench_opts_t o = {.api = "openai", .workload = "synthetic", .tok_model = TD_DEFAULT_MODEL, .ttft_ms = 1000,
                      .tpot_ms = 100, .attain = 90, .timeout = 120, .topts = {.time_scale = 1}, .n_req = 100,
                      .workers = 1, .salt_base = 1,
                      .syn = {.rate = 1, .cv = 1, .input = {BENCH_DIST_FIXED, 128, 0},
                              .output = {BENCH_DIST_FIXED, 64, 0}, .seed = 1}};
    char line[4096] = "tandem bench";
    for (int i = 0; i < argc; i++) {
        size_t at = strlen(line);
        snprintf(line + at, sizeof line - at, " %s", argv[i]);
    }
    int bad = parse_args(argc, argv, &o);
    if (bad)
        return bad;
    bool grpc = !strcmp(o.api, "grpc");
    char url[512];
    if (grpc)
        snprintf(url, sizeof url, "%s", strstr(o.endpoint, "://") ? strstr(o.endpoint, "://") + 3 : o.endpoint);
    else
        snprintf(url, sizeof url, "%s%s", strstr(o.endpoint, "://") ? "" : "http://", o.endpoint);
    eng_model_t *m = NULL; /* the tokenizer that makes prompts of words (a prompts file brings its own text) */
    bench_workload_t words = {0};
    if (strcmp(o.workload, "prompts") && (eng_model_open(o.tok_model, &m) || bench_words(m->tok, &words))) {
        eng_model_close(m);
        return 1;
    }
    size_t n_rates = o.n_rates;
    bench_point_t *pts = calloc(n_rates, sizeof *pts);
    int ret = 1;
    /* a sweep sends each rate prompts no other rate sent (the workload's own sharing kept), so a server's cache
     * filled by one rate does not serve the next; one rate is salted only when asked */
    bool salted = !o.salt_none && (n_rates > 1 || o.salt_given);
    for (size_t k = 0; pts && k < n_rates; k++) {
        bench_workload_t w;
        double offered;
        td_status_t rc = make_workload(&o, k, &words, salted, &w, &offered);
        if (rc) {
            w.words = NULL, w.n_words = 0;
            bench_workload_free(&w);
            goto out;
        }
        fprintf(stderr, "[bench] %s: %zu requests at %.2f req/s to %s\n", o.workload, w.n, offered, url);
        pts[k].res = calloc(w.n, sizeof *pts[k].res);
        pts[k].n = w.n;
        pts[k].rate = offered;
        if (grpc) {
            bench_grpc_t g = {.endpoint = url, .model = o.model_name, .tls_ca = o.tls_ca, .timeout_s = o.timeout,
                              .ignore_eos = o.ignore_eos, .progress = true};
            rc = bench_run_grpc(&g, &w, pts[k].res);
        } else {
            bench_openai_t oa = {.endpoint = url, .model = o.model_name, .timeout_s = o.timeout,
                                 .ignore_eos = o.ignore_eos, .progress = true};
            rc = bench_run_openai(&oa, &w, pts[k].res);
        }
        w.words = NULL, w.n_words = 0; /* shared */
        bench_workload_free(&w);
        if (rc)
            goto out;
        pts[k].sum = bench_summarize(pts[k].res, pts[k].n, o.ttft_ms / 1e3, o.tpot_ms / 1e3);
    }
    if (!pts)
        goto out;
    double curve_r[64], curve_a[64];
    for (size_t k = 0; k < n_rates; k++)
        curve_r[k] = pts[k].rate, curve_a[k] = pts[k].sum.attainment;
    bench_report_t rep = {.argv_line = line, .endpoint = url, .api = o.api, .workload = o.workload,
                          .ttft_slo = o.ttft_ms / 1e3, .tpot_slo = o.tpot_ms / 1e3, .attainment = o.attain / 100,
                          .points = pts, .n_points = n_rates, .workers = o.workers, .slo_scales = o.scales,
                          .n_slo_scales = o.n_scales, .salt_base = salted ? (uint64_t)o.salt_base : 0};
    rep.goodput = bench_goodput(curve_r, curve_a, n_rates, o.attain / 100, &rep.bounded);
    bench_print_table(&rep);
    ret = 0;
    if (o.out_path && bench_write_report(&rep, o.out_path))
        ret = 1;
    else if (o.out_path)
        printf("report: %s (+ plots beside it)\n", o.out_path);
out:
    for (size_t k = 0; pts && k < n_rates; k++)
        free(pts[k].res);
    free(pts);
    bench_workload_free(&words);
    eng_model_close(m);
    return ret;
}
