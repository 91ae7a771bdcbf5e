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

int cli_bench(int argc, char **argv)
{
    const char *endpoint = NULL, *api = "openai", *model_name = NULL, *workload = "synthetic", *wfile = NULL,
               *out_path = NULL, *tls_ca = NULL, *tok_model = TD_DEFAULT_MODEL;
    double rates[64], scales[16], ttft_ms = 1000, tpot_ms = 100, attain = 90, timeout = 120, v = 0;
    bench_trace_opts_t topts = {.time_scale = 1};
    size_t n_rates = 0, n_req = 100, n_scales = 0;
    unsigned workers = 1;
    bool ignore_eos = false;
    /* a sweep's rates each get prompts of their own (salt base + rate index), unless --salt none */
    double salt_base = 1;
    bool salt_given = false, salt_none = false;
    bench_synthetic_t syn = {.rate = 1, .cv = 1, .input = {BENCH_DIST_FIXED, 128, 0},
                             .output = {BENCH_DIST_FIXED, 64, 0}, .seed = 1};
    char line[4096] = "tandem bench";
    for (int i = 0; i < argc; i++) {
        size_t at = strlen(line);
        snprintf(line + at, sizeof line - at, " %s", argv[i]);
    }
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i], *nx = i + 1 < argc ? argv[i + 1] : NULL;
        bool ok = true;
        if (!strcmp(a, "--endpoint") && nx) endpoint = argv[++i];
        else if (!strcmp(a, "--api") && nx) api = argv[++i];
        else if (!strcmp(a, "--model") && nx) model_name = argv[++i];
        else if (!strcmp(a, "--tokenizer") && nx) tok_model = argv[++i];
        else if (!strcmp(a, "--output") && nx) out_path = argv[++i];
        else if (!strcmp(a, "--tls-ca") && nx) tls_ca = argv[++i];
        else if (!strcmp(a, "--ignore-eos")) ignore_eos = true;
        else if (!strcmp(a, "--salt") && nx) {
            salt_none = !strcmp(nx, "none");
            salt_given = true;
            ok = salt_none || parse_num(nx, 1, 1e15, &salt_base);
            i++;
        }
        else if (!strcmp(a, "--workload") && nx) {
            workload = argv[++i];
            if (strcmp(workload, "synthetic")) {
                if (i + 1 >= argc) ok = false;
                else wfile = argv[++i];
            }
        } else if (!strcmp(a, "--rate") && nx) {
            ok = parse_num(argv[++i], 1e-6, 1e6, &rates[0]);
            n_rates = 1;
        } else if (!strcmp(a, "--sweep") && nx) {
            char *copy = strdup(argv[++i]), *save = NULL;
            n_rates = 0;
            for (char *t = strtok_r(copy, ",", &save); t && ok; t = strtok_r(NULL, ",", &save))
                ok = n_rates < 64 && parse_num(t, 1e-6, 1e6, &rates[n_rates++]);
            free(copy);
            for (size_t k = 1; ok && k < n_rates; k++)
                ok = rates[k] > rates[k - 1];
            if (!ok)
                fprintf(stderr, "tandem bench: --sweep needs ascending positive rates, like 1,2,4\n");
        } else if (!strcmp(a, "--slo-scale") && nx) {
            char *copy = strdup(argv[++i]), *save = NULL;
            for (char *t = strtok_r(copy, ",", &save); t && ok; t = strtok_r(NULL, ",", &save))
                ok = n_scales < 16 && parse_num(t, 0.01, 100, &scales[n_scales++]);
            free(copy);
        } else if (!strcmp(a, "--workers") && nx) {
            ok = parse_num(argv[++i], 1, 1e5, &v);
            workers = (unsigned)v;
        } else if (!strcmp(a, "--num-requests") && nx) {
            ok = parse_num(argv[++i], 1, 1e7, &v);
            n_req = (size_t)v;
        } else if (!strcmp(a, "--input-len") && nx) ok = parse_len(argv[++i], &syn.input);
        else if (!strcmp(a, "--output-len") && nx) ok = parse_len(argv[++i], &syn.output);
        else if (!strcmp(a, "--cv") && nx) ok = parse_num(argv[++i], 0.01, 100, &syn.cv);
        else if (!strcmp(a, "--prefix-groups") && nx) {
            ok = parse_num(argv[++i], 0, 1e6, &v);
            syn.groups = (uint32_t)v;
        } else if (!strcmp(a, "--prefix-share") && nx) ok = parse_num(argv[++i], 0, 0.99, &syn.prefix_share);
        else if (!strcmp(a, "--seed") && nx) {
            ok = parse_num(argv[++i], 0, 1e18, &v);
            syn.seed = (uint64_t)v;
        } else if (!strcmp(a, "--time-scale") && nx) ok = parse_num(argv[++i], 1e-6, 1e6, &topts.time_scale);
        else if (!strcmp(a, "--trace-block") && nx) {
            ok = parse_num(argv[++i], 1, 1 << 20, &v);
            topts.block_tokens = (uint32_t)v;
        } else if (!strcmp(a, "--trace-divide") && nx) {
            ok = parse_num(argv[++i], 1, 1 << 20, &v);
            topts.divide = (uint32_t)v;
        }
        else if (!strcmp(a, "--timeout") && nx) ok = parse_num(argv[++i], 0.1, 86400, &timeout);
        else if (!strcmp(a, "--attainment") && nx) ok = parse_num(argv[++i], 1, 100, &attain);
        else if (!strcmp(a, "--goodput") && nx) {
            ok = sscanf(argv[++i], "ttft:%lf,tpot:%lf", &ttft_ms, &tpot_ms) == 2 && ttft_ms > 0 && tpot_ms > 0;
        } else {
            fprintf(stderr, "tandem bench: unknown or incomplete option '%s'\n%s", a, cli_bench_usage);
            return 2;
        }
        if (!ok) {
            fprintf(stderr, "tandem bench: bad value for %s\n%s", a, cli_bench_usage);
            return 2;
        }
    }
    if (!endpoint) {
        fputs(cli_bench_usage, stderr);
        return 2;
    }
    const char *hostport = strstr(endpoint, "://") ? strstr(endpoint, "://") + 3 : endpoint;
    if (!*hostport || *hostport == ':' || *hostport == '/') {
        fprintf(stderr, "tandem bench: --endpoint '%s' names no host\n", endpoint);
        return 2;
    }
    bool grpc = !strcmp(api, "grpc");
    if (!grpc && strcmp(api, "openai")) {
        fprintf(stderr, "tandem bench: --api is openai or grpc, not '%s'\n", api);
        return 2;
    }
    if (strcmp(workload, "synthetic") && strcmp(workload, "trace") && strcmp(workload, "prompts")) {
        fprintf(stderr, "tandem bench: --workload is synthetic, trace FILE or prompts FILE, not '%s'\n", workload);
        return 2;
    }
    if (!n_rates)
        rates[n_rates++] = 1;
    char url[512];
    if (grpc)
        snprintf(url, sizeof url, "%s", strstr(endpoint, "://") ? strstr(endpoint, "://") + 3 : endpoint);
    else
        snprintf(url, sizeof url, "%s%s", strstr(endpoint, "://") ? "" : "http://", endpoint);
    eng_model_t *m = NULL; /* the tokenizer that makes prompts of words (a prompts file brings its own text) */
    bench_workload_t words = {0};
    if (strcmp(workload, "prompts") && (eng_model_open(tok_model, &m) || bench_words(m->tok, &words))) {
        eng_model_close(m);
        return 1;
    }
    bench_point_t *pts = calloc(n_rates, sizeof *pts);
    int ret = 1;
    /* a sweep sends each rate prompts no other rate sent (the workload's own sharing kept), so a server's cache
     * filled by one rate does not serve the next; one rate is salted only when asked */
    bool salted = !salt_none && (n_rates > 1 || salt_given);
    for (size_t k = 0; k < n_rates; k++) {
        bench_workload_t w = {.words = words.words, .n_words = words.n_words,
                              .salt = salted ? (uint64_t)salt_base + k : 0};
        td_status_t rc;
        if (!strcmp(workload, "synthetic")) {
            syn.rate = rates[k];
            syn.n = n_req;
            rc = bench_synthetic(&w, &syn);
        } else if (!strcmp(workload, "trace")) {
            rc = bench_trace(&w, wfile, &topts, n_req);
            if (!rc && n_rates > 1 && w.n > 1 && w.req[w.n - 1].t_send > 0) { /* rescale to the rate asked */
                double native = (w.n - 1) / w.req[w.n - 1].t_send;
                for (size_t i = 0; i < w.n; i++)
                    w.req[i].t_send *= native / rates[k];
            }
        } else {
            rc = bench_prompts(&w, wfile, rates[k], 64, n_req);
        }
        if (rc) {
            w.words = NULL, w.n_words = 0;
            bench_workload_free(&w);
            goto out;
        }
        double offered = rates[k];
        if (!strcmp(workload, "trace") && n_rates == 1 && w.n > 1 && w.req[w.n - 1].t_send > 0)
            offered = (w.n - 1) / w.req[w.n - 1].t_send;
        fprintf(stderr, "[bench] %s: %zu requests at %.2f req/s to %s\n", workload, w.n, offered, url);
        pts[k].res = calloc(w.n, sizeof *pts[k].res);
        pts[k].n = w.n;
        pts[k].rate = offered;
        if (grpc) {
            bench_grpc_t g = {.endpoint = url, .model = model_name, .tls_ca = tls_ca, .timeout_s = timeout,
                              .ignore_eos = ignore_eos, .progress = true};
            rc = bench_run_grpc(&g, &w, pts[k].res);
        } else {
            bench_openai_t o = {.endpoint = url, .model = model_name, .timeout_s = timeout,
                                .ignore_eos = ignore_eos, .progress = true};
            rc = bench_run_openai(&o, &w, pts[k].res);
        }
        w.words = NULL, w.n_words = 0; /* shared */
        bench_workload_free(&w);
        if (rc)
            goto out;
        pts[k].sum = bench_summarize(pts[k].res, pts[k].n, ttft_ms / 1e3, tpot_ms / 1e3);
    }
    double curve_r[64], curve_a[64];
    for (size_t k = 0; k < n_rates; k++)
        curve_r[k] = pts[k].rate, curve_a[k] = pts[k].sum.attainment;
    bench_report_t rep = {.argv_line = line, .endpoint = url, .api = api, .workload = workload,
                          .ttft_slo = ttft_ms / 1e3, .tpot_slo = tpot_ms / 1e3, .attainment = attain / 100,
                          .points = pts, .n_points = n_rates, .workers = workers, .slo_scales = scales,
                          .n_slo_scales = n_scales, .salt_base = salted ? (uint64_t)salt_base : 0};
    rep.goodput = bench_goodput(curve_r, curve_a, n_rates, attain / 100, &rep.bounded);
    bench_print_table(&rep);
    ret = 0;
    if (out_path && bench_write_report(&rep, out_path))
        ret = 1;
    else if (out_path)
        printf("report: %s (+ plots beside it)\n", out_path);
out:
    for (size_t k = 0; k < n_rates; k++)
        free(pts[k].res);
    free(pts);
    bench_workload_free(&words);
    eng_model_close(m);
    return ret;
}
