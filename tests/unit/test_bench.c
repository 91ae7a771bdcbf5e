/* test_bench.c — `tandem bench`'s statistics with known answers, its
 * workloads (trace replay shares exactly the stated prefixes, checked with the
 * engine's block names), its errors for bad input, and its sender against a
 * dead endpoint and a server that dies mid-stream (a partial report, no hang),
 * over HTTP (openai) and over gRPC (a real gRPC server made with common/rpc),
 * and how it counts refusals (an early rejection is rejected, a bad request
 * failed). */
#include "tests/unit/helpers.h"

#include <arpa/inet.h>
#include <math.h>
#include <netinet/in.h>
#include <pthread.h>
#include <sys/socket.h>
#include <time.h>

#include "bench/grpc.h"
#include "bench/openai.h"
#include "bench/report.h"
#include "bench/stats.h"
#include "bench/workload.h"
#include "common/blockhash.h"
#include "common/log.h"
#include "common/rpc.h"
#include "tandem/v1/tandem.pb-c.h"
#include "engine/model.h"
#include "engine/tokenizer.h"

Test(bench, percentiles)
{
    double v[] = {5, 1, 4, 2, 3};
    cr_assert_float_eq(bench_percentile(v, 5, 50), 3, 1e-12);
    cr_assert_float_eq(bench_percentile(v, 5, 0), 1, 1e-12);
    cr_assert_float_eq(bench_percentile(v, 5, 100), 5, 1e-12);
    cr_assert_float_eq(bench_percentile(v, 5, 90), 4.6, 1e-12);
    double one[] = {7};
    cr_assert_float_eq(bench_percentile(one, 1, 99), 7, 1e-12);
    cr_assert(isnan(bench_percentile(NULL, 0, 50)));
}

Test(bench, goodput_crossing_by_construction)
{
    double r[] = {1, 2, 3, 4}, a[] = {1.0, 0.95, 0.85, 0.5};
    int bounded;
    cr_assert_float_eq(bench_goodput(r, a, 4, 0.9, &bounded), 2.5, 1e-12);
    cr_assert_eq(bounded, 1);
    double all[] = {1, 1, 0.99, 0.95};
    cr_assert_float_eq(bench_goodput(r, all, 4, 0.9, &bounded), 4, 1e-12);
    cr_assert_eq(bounded, 0, "every rate met it: a lower bound");
    double none[] = {0.5, 0.4, 0.1, 0};
    cr_assert_float_eq(bench_goodput(r, none, 4, 0.9, &bounded), 0, 1e-12);
    cr_assert_float_eq(bench_goodput(r, a, 0, 0.9, &bounded), 0, 1e-12);
}

Test(bench, summaries_of_empty_failed_and_mixed_runs)
{
    bench_summary_t s = bench_summarize(NULL, 0, 1, 1);
    cr_assert_eq(s.n, 0);
    cr_assert_eq(s.attainment, 0);
    cr_assert(isnan(s.ttft_p50));
    bench_result_t r[4];
    memset(r, 0, sizeof r);
    for (int i = 0; i < 4; i++)
        r[i].t_sent = r[i].t_planned = i, r[i].t_done = i + 1;
    s = bench_summarize(r, 4, 1, 1);
    cr_assert_eq(s.failed, 4, "nothing ok: all failed");
    cr_assert_eq(s.attainment, 0);
    double ttft[] = {0.1, 0.2, 0.3, 2.0};
    for (int i = 0; i < 4; i++) {
        r[i].ok = true;
        r[i].t_first = r[i].t_sent + ttft[i];
        r[i].tpot = 0.01;
        r[i].n_out = 10;
    }
    r[1].tpot = 0.2; /* too slow between tokens */
    s = bench_summarize(r, 4, 0.5, 0.05);
    cr_assert_eq(s.met, 2, "one misses TTFT, one misses TPOT");
    cr_assert_float_eq(s.attainment, 0.5, 1e-12);
    cr_assert_float_eq(s.ttft_p50, 0.25, 1e-12);
}

/* The report stands without gnuplot: the JSON and the plot script are
 * written, the missing program is a warning (the script draws the plots
 * later), not a failed run. gnuplot present: the SVGs are drawn. */
Test(bench, report_without_gnuplot_still_written)
{
    char dir[] = "/tmp/tandem-report-XXXXXX", path[128], gp[160], svg[160];
    cr_assert_not_null(mkdtemp(dir));
    snprintf(path, sizeof path, "%s/run.json", dir);
    snprintf(gp, sizeof gp, "%s/run-plot.gp", dir);
    snprintf(svg, sizeof svg, "%s/run-ttft.svg", dir);
    bench_result_t res[2] = {0};
    for (int i = 0; i < 2; i++) {
        res[i].ok = true;
        res[i].t_sent = res[i].t_planned = i;
        res[i].t_first = i + 0.1;
        res[i].t_done = i + 0.5;
        res[i].tpot = 0.01;
        res[i].n_out = 8;
    }
    bench_point_t pt = {.rate = 1, .res = res, .n = 2, .sum = bench_summarize(res, 2, 1, 0.1)};
    bench_report_t r = {.argv_line = "tandem bench (test)", .endpoint = "none", .api = "grpc", .workload = "test",
                        .ttft_slo = 1, .tpot_slo = 0.1, .attainment = 0.9, .points = &pt, .n_points = 1,
                        .workers = 1};
    const char *old = getenv("PATH");
    char *saved = old ? strdup(old) : NULL;
    setenv("PATH", "/nonexistent", 1); /* `timeout` is not found either: the shell answers 127 */
    td_status_t rc = bench_write_report(&r, path);
    if (saved)
        setenv("PATH", saved, 1);
    free(saved);
    cr_assert_eq(rc, TD_OK, "no gnuplot: %s", td_last_error());
    cr_assert_eq(access(path, R_OK), 0, "the JSON report");
    cr_assert_eq(access(gp, R_OK), 0, "the plot script");
    if (system("command -v gnuplot >/dev/null 2>&1") == 0) {
        cr_assert_eq(bench_write_report(&r, path), TD_OK, "%s", td_last_error());
        cr_assert_eq(access(svg, R_OK), 0, "gnuplot drew %s", svg);
    }
    char cmd[160];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    cr_assert_eq(system(cmd), 0);
}

static bench_workload_t words;
static eng_model_t *model;

static void setup(void)
{
    require_default_model();
    cr_assert_eq(eng_model_open(DEFAULT_MODEL, &model), TD_OK);
    cr_assert_eq(bench_words(model->tok, &words), TD_OK);
}

static void teardown(void)
{
    bench_workload_free(&words);
    eng_model_close(model);
}

static size_t names(const char *prompt, td_block_name_t *out, size_t cap, size_t *n_tokens)
{
    int32_t *ids = NULL;
    size_t c = 0, n;
    cr_assert_eq(eng_tokenizer_encode(model->tok, prompt, strlen(prompt), 0, &ids, &c, &n), TD_OK);
    *n_tokens = n;
    size_t k = td_block_name_chain(td_block_name_root("m", "fp16", 16), ids, n, 16, out, cap);
    free(ids);
    return k;
}

Test(bench, trace_replay_shares_exactly_the_stated_prefixes, .init = setup, .fini = teardown)
{
    const char *trace = "{\"timestamp\": 0, \"input_length\": 1536, \"output_length\": 10, \"hash_ids\": [1, 2, 3]}\n"
                        "{\"timestamp\": 500, \"input_length\": 1300, \"output_length\": 5, \"hash_ids\": [1, 2, 4]}\n"
                        "{\"timestamp\": 1500, \"input_length\": 100, \"output_length\": 7, \"hash_ids\": [5]}\n";
    char *path = write_temp(trace, strlen(trace), ".jsonl");
    bench_workload_t w = {.words = words.words, .n_words = words.n_words};
    cr_assert_eq(bench_trace(&w, path, &(bench_trace_opts_t){.time_scale = 2.0}, 0), TD_OK, "%s", td_last_error());
    cr_assert_eq(w.n, 3);
    cr_assert_float_eq(w.req[1].t_send, 1.0, 1e-9, "500 ms scaled by 2");
    static td_block_name_t a[128], b[128], c[128];
    size_t ta, tb, tc;
    size_t na = names(w.req[0].prompt, a, 128, &ta), nb = names(w.req[1].prompt, b, 128, &tb);
    names(w.req[2].prompt, c, 128, &tc);
    cr_assert_eq(ta, 1536, "input_length tokens");
    cr_assert_eq(tb, 1300);
    cr_assert_eq(tc, 100);
    cr_assert_eq(na, 96);
    cr_assert_eq(nb, 81);
    for (size_t i = 0; i < 64; i++) /* hash ids 1, 2: 1,024 tokens = 64 blocks */
        cr_assert(td_block_name_eq(a[i], b[i]), "block %zu of the shared prefix", i);
    cr_assert(!td_block_name_eq(a[64], b[64]), "hash id 3 vs 4: the prefix ends");
    cr_assert(!td_block_name_eq(a[0], c[0]), "hash id 5 shares nothing");
    w.words = NULL, w.n_words = 0;
    bench_workload_free(&w);
    unlink(path);
    free(path);
}

/* A sweep's salts: the same trace under salts 1 and 2 keeps its own sharing exactly (hash ids 1, 2 shared by
 * both lines, block for block) and lengths, while no block of one salt's prompts is a block of the other's;
 * salt 0 is the unsalted text. */
Test(bench, salted_rates_share_nothing_but_keep_their_own_sharing, .init = setup, .fini = teardown)
{
    const char *trace = "{\"timestamp\": 0, \"input_length\": 1536, \"output_length\": 10, \"hash_ids\": [1, 2, 3]}\n"
                        "{\"timestamp\": 500, \"input_length\": 1300, \"output_length\": 5, \"hash_ids\": [1, 2, 4]}\n";
    char *path = write_temp(trace, strlen(trace), ".jsonl");
    static td_block_name_t b[3][2][128];
    size_t nb[3][2], nt[3][2];
    for (uint64_t salt = 0; salt < 3; salt++) {
        bench_workload_t w = {.words = words.words, .n_words = words.n_words, .salt = salt};
        cr_assert_eq(bench_trace(&w, path, &(bench_trace_opts_t){.time_scale = 1}, 0), TD_OK, "%s", td_last_error());
        for (int i = 0; i < 2; i++)
            nb[salt][i] = names(w.req[i].prompt, b[salt][i], 128, &nt[salt][i]);
        w.words = NULL, w.n_words = 0;
        bench_workload_free(&w);
    }
    for (int s = 0; s < 3; s++) {
        cr_assert_eq(nt[s][0], 1536, "salt %d: input_length tokens", s);
        cr_assert_eq(nt[s][1], 1300, "salt %d", s);
        for (size_t i = 0; i < 64; i++)
            cr_assert(td_block_name_eq(b[s][0][i], b[s][1][i]), "salt %d: block %zu of the shared prefix", s, i);
        cr_assert(!td_block_name_eq(b[s][0][64], b[s][1][64]), "salt %d: the prefix ends", s);
    }
    for (int s = 0; s < 3; s++)
        for (int t = s + 1; t < 3; t++)
            for (int i = 0; i < 2; i++)
                for (int j = 0; j < 2; j++)
                    for (size_t k = 0; k < nb[s][i]; k++)
                        for (size_t l = 0; l < nb[t][j]; l++)
                            cr_assert(!td_block_name_eq(b[s][i][k], b[t][j][l]), "salts %d and %d share a block", s, t);
    unlink(path);
    free(path);
}

/* Mooncake's 512-token ids scaled down by 32 (16 tokens per id): the shared
 * prefix is still exactly the shared ids, now one 16-token block each; a trace
 * written with 64-token ids is read with --trace-block 64. */
Test(bench, trace_block_size_and_scaling_keep_the_sharing, .init = setup, .fini = teardown)
{
    const char *trace = "{\"timestamp\": 0, \"input_length\": 1536, \"output_length\": 64, \"hash_ids\": [1, 2, 3]}\n"
                        "{\"timestamp\": 10, \"input_length\": 1100, \"output_length\": 33, \"hash_ids\": [1, 2, 4]}\n";
    char *path = write_temp(trace, strlen(trace), ".jsonl");
    bench_workload_t w = {.words = words.words, .n_words = words.n_words};
    cr_assert_eq(bench_trace(&w, path, &(bench_trace_opts_t){.time_scale = 1, .divide = 32}, 0), TD_OK, "%s",
                 td_last_error());
    static td_block_name_t a[128], b[128];
    size_t ta, tb;
    size_t na = names(w.req[0].prompt, a, 128, &ta), nb = names(w.req[1].prompt, b, 128, &tb);
    cr_assert_eq(ta, 48, "1536 / 32");
    cr_assert_eq(tb, 35, "1100 / 32, rounded up");
    cr_assert_eq(w.req[0].output_len, 2);
    cr_assert_eq(w.req[1].output_len, 2, "33 / 32, rounded up");
    cr_assert_eq(na, 3);
    cr_assert_eq(nb, 2);
    cr_assert(td_block_name_eq(a[0], b[0]) && td_block_name_eq(a[1], b[1]), "ids 1, 2: two shared 16-token blocks");
    w.words = NULL, w.n_words = 0;
    bench_workload_free(&w);
    w = (bench_workload_t){.words = words.words, .n_words = words.n_words};
    cr_assert_neq(bench_trace(&w, path, &(bench_trace_opts_t){.time_scale = 1, .divide = 3}, 0), TD_OK);
    cr_assert(strstr(td_last_error(), "not a multiple of the divisor 3"), "%s", td_last_error());
    unlink(path);
    free(path);

    trace = "{\"timestamp\": 0, \"input_length\": 130, \"output_length\": 1, \"hash_ids\": [7, 8, 9]}\n"
            "{\"timestamp\": 1, \"input_length\": 64, \"output_length\": 1, \"hash_ids\": [7]}\n";
    path = write_temp(trace, strlen(trace), ".jsonl");
    w = (bench_workload_t){.words = words.words, .n_words = words.n_words};
    cr_assert_neq(bench_trace(&w, path, &(bench_trace_opts_t){.time_scale = 1}, 0), TD_OK, "512-token ids: 130 "
                  "tokens cannot need 3 ids");
    cr_assert(strstr(td_last_error(), "blocks of 512 tokens"), "%s", td_last_error());
    w.words = NULL, w.n_words = 0;
    bench_workload_free(&w);
    w = (bench_workload_t){.words = words.words, .n_words = words.n_words};
    cr_assert_eq(bench_trace(&w, path, &(bench_trace_opts_t){.time_scale = 1, .block_tokens = 64}, 0), TD_OK, "%s",
                 td_last_error());
    na = names(w.req[0].prompt, a, 128, &ta);
    nb = names(w.req[1].prompt, b, 128, &tb);
    cr_assert_eq(ta, 130);
    cr_assert_eq(tb, 64);
    for (size_t i = 0; i < 4; i++)
        cr_assert(td_block_name_eq(a[i], b[i]), "id 7: 64 tokens = 4 shared blocks (%zu)", i);
    w.words = NULL, w.n_words = 0;
    bench_workload_free(&w);
    unlink(path);
    free(path);
}

static void expect_bad(const char *text, const char *needle, bool prompts)
{
    char *path = write_temp(text, strlen(text), ".jsonl");
    bench_workload_t w = {.words = words.words, .n_words = words.n_words};
    td_status_t rc = prompts ? bench_prompts(&w, path, 1, 8, 0)
                             : bench_trace(&w, path, &(bench_trace_opts_t){.time_scale = 1}, 0);
    cr_assert_neq(rc, TD_OK, "'%s' was accepted", text);
    cr_assert(strstr(td_last_error(), needle), "'%s' should say '%s'", td_last_error(), needle);
    w.words = NULL, w.n_words = 0;
    bench_workload_free(&w);
    unlink(path);
    free(path);
}

Test(bench, malformed_lines_are_named, .init = setup, .fini = teardown)
{
    const char *ok = "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1]}\n";
    char buf[512];
    snprintf(buf, sizeof buf, "%s{\"timestamp\": 5, \"input_length\": 10, \"hash_ids\": [1]}\n", ok);
    expect_bad(buf, ":2: field 'output_length'", false);
    snprintf(buf, sizeof buf, "%s%s{\"timestamp\": 5, \"input_length\": 600, \"output_length\": 1, \"hash_ids\": [1]}\n",
             ok, ok);
    expect_bad(buf, ":3: field 'hash_ids'", false);
    expect_bad("{\"timestamp\": -1, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [1]}\n",
               ":1: field 'timestamp'", false);
    expect_bad("not json\n", ":1: not a JSON object", false);
    expect_bad("{\"prompt\": \"hi\"}\n{\"text\": \"no prompt\"}\n", ":2: field 'prompt'", true);
    expect_bad("{\"prompt\": \"hi\", \"max_tokens\": 0}\n", ":1: field 'max_tokens'", true);
}

Test(bench, synthetic_arrivals_lengths_and_groups, .init = setup, .fini = teardown)
{
    bench_workload_t w = {.words = words.words, .n_words = words.n_words};
    bench_synthetic_t s = {.rate = 4, .cv = 2, .n = 4000, .input = {BENCH_DIST_UNIFORM, 10, 20},
                           .output = {BENCH_DIST_LOGNORMAL, 50, 0.5}, .groups = 3, .prefix_share = 0.5, .seed = 3};
    cr_assert_eq(bench_synthetic(&w, &s), TD_OK);
    double mean = w.req[w.n - 1].t_send / (double)(w.n - 1), var = 0, out = 0;
    for (size_t i = 1; i < w.n; i++) {
        double g = w.req[i].t_send - w.req[i - 1].t_send - mean;
        var += g * g;
        out += w.req[i].output_len;
        cr_assert(w.req[i].input_len >= 10 && w.req[i].input_len <= 20);
    }
    double cv = sqrt(var / (double)(w.n - 1)) / mean;
    cr_assert(fabs(mean - 0.25) < 0.025, "mean gap %.3f for rate 4", mean);
    cr_assert(fabs(cv - 2) < 0.3, "gap cv %.2f for cv 2", cv);
    cr_assert(fabs(out / (double)(w.n - 1) - 50) < 3, "lognormal mean %.1f", out / (double)(w.n - 1));
    /* same group: the first half of the shorter prompt is common */
    for (size_t i = 1; i < 50; i++)
        if (w.req[i].group == w.req[0].group) {
            size_t words_shared = (size_t)(fmin(w.req[0].input_len, w.req[i].input_len) * 0.5);
            size_t at = 0, seen = 0;
            while (w.req[0].prompt[at] && seen <= words_shared)
                if (w.req[0].prompt[at++] == ' ')
                    seen++;
            cr_assert(strncmp(w.req[0].prompt, w.req[i].prompt, at - 1) == 0, "group prefix");
            break;
        }
    w.words = NULL, w.n_words = 0;
    bench_workload_free(&w);
}

/* log-uniform lengths: within [a, b], each doubling as likely (the median is sqrt(a b), a quarter below 2a) */
Test(bench, loguniform_lengths, .init = setup, .fini = teardown)
{
    bench_workload_t w = {.words = words.words, .n_words = words.n_words};
    bench_synthetic_t s = {.rate = 100, .cv = 1, .n = 2000, .input = {BENCH_DIST_LOGUNIFORM, 4, 64},
                           .output = {BENCH_DIST_FIXED, 1, 0}, .seed = 5};
    cr_assert_eq(bench_synthetic(&w, &s), TD_OK);
    size_t below16 = 0, below8 = 0;
    for (size_t i = 0; i < w.n; i++) {
        cr_assert(w.req[i].input_len >= 4 && w.req[i].input_len <= 64, "length %u", w.req[i].input_len);
        below16 += w.req[i].input_len < 16;
        below8 += w.req[i].input_len < 8;
    }
    cr_assert(fabs((double)below16 / (double)w.n - 0.5) < 0.05, "%zu of %zu below 16", below16, w.n);
    cr_assert(fabs((double)below8 / (double)w.n - 0.25) < 0.05, "%zu of %zu below 8", below8, w.n);
    w.words = NULL, w.n_words = 0;
    bench_workload_free(&w);
}

/* A listening loopback socket (*ls) served by fn(ls) on thread *th; its URL. */
static void serve_loopback(void *(*fn)(void *), int *ls, pthread_t *th, char *url, size_t cap)
{
    *ls = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    cr_assert_eq(bind(*ls, (struct sockaddr *)&a, sizeof a), 0);
    socklen_t al = sizeof a;
    cr_assert_eq(getsockname(*ls, (struct sockaddr *)&a, &al), 0);
    cr_assert_eq(listen(*ls, 4), 0);
    cr_assert_eq(pthread_create(th, NULL, fn, ls), 0);
    snprintf(url, cap, "http://127.0.0.1:%d", ntohs(a.sin_port));
}

/* A server that answers one request with two SSE tokens, then drops the connection. */
static void *dying_server(void *arg)
{
    int ls = *(int *)arg;
    int c = accept(ls, NULL, NULL);
    char buf[4096];
    ssize_t got = read(c, buf, sizeof buf);
    (void)got;
    const char *resp = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: 100000\r\n\r\n"
                       "data: {\"choices\": [{\"text\": \"a\"}]}\n\ndata: {\"choices\": [{\"text\": \"b\"}]}\n\n";
    ssize_t wr = write(c, resp, strlen(resp));
    (void)wr;
    nanosleep(&(struct timespec){.tv_sec = 0, .tv_nsec = 100000000}, NULL);
    close(c);
    return NULL;
}

Test(bench, dead_endpoint_and_dying_server_give_partial_reports, .init = setup, .fini = teardown)
{
    bench_workload_t w = {.words = words.words, .n_words = words.n_words};
    bench_synthetic_t s = {.rate = 50, .cv = 1, .n = 3, .input = {BENCH_DIST_FIXED, 8, 0},
                           .output = {BENCH_DIST_FIXED, 4, 0}, .seed = 1};
    cr_assert_eq(bench_synthetic(&w, &s), TD_OK);
    bench_result_t res[3];
    bench_openai_t o = {.endpoint = "http://127.0.0.1:1", .timeout_s = 5};
    time_t t0 = time(NULL);
    cr_assert_eq(bench_run_openai(&o, &w, res), TD_OK);
    cr_assert_lt(time(NULL) - t0, 5, "a dead endpoint fails fast");
    for (int i = 0; i < 3; i++) {
        cr_assert(!res[i].ok);
        cr_assert(res[i].error[0], "request %d has an error", i);
    }
    bench_summary_t sum = bench_summarize(res, 3, 1, 1);
    cr_assert_eq(sum.failed, 3);
    /* a server that stops mid-stream */
    int ls;
    pthread_t th;
    char url[64];
    serve_loopback(dying_server, &ls, &th, url, sizeof url);
    o.endpoint = url;
    w.n = 1;
    cr_assert_eq(bench_run_openai(&o, &w, res), TD_OK);
    pthread_join(th, NULL);
    close(ls);
    cr_assert(!res[0].ok, "a cut stream is a failure");
    cr_assert_eq(res[0].n_out, 2, "the tokens that came are counted");
    cr_assert(res[0].error[0]);
    w.n = 3;
    w.words = NULL, w.n_words = 0;
    bench_workload_free(&w);
}

/* A server that refuses the requests of refusal_counts, one connection each,
 * as the prompt says: "slo" 400 with rejected-early (the router's early
 * rejection when retrying cannot help), "bad" a plain 400, "busy" 429 with
 * retry-after-ms. */
static void *refusing_server(void *arg)
{
    int ls = *(int *)arg;
    for (int k = 0; k < 3; k++) {
        int c = accept(ls, NULL, NULL);
        char buf[8192];
        size_t n = 0;
        const char *resp = NULL;
        while (!resp && n < sizeof buf - 1) {
            ssize_t got = read(c, buf + n, sizeof buf - 1 - n);
            if (got <= 0)
                break;
            n += (size_t)got;
            buf[n] = '\0';
            resp = strstr(buf, "slo-") ? "HTTP/1.1 400 Bad Request\r\nrejected-early: ttft\r\n"
                   : strstr(buf, "bad-") ? "HTTP/1.1 400 Bad Request\r\n"
                   : strstr(buf, "busy-") ? "HTTP/1.1 429 Too Many Requests\r\nretry-after-ms: 250\r\n"
                                          : NULL;
        }
        char out[256];
        int len = snprintf(out, sizeof out, "%sContent-Type: application/json\r\nContent-Length: 2\r\n"
                           "Connection: close\r\n\r\n{}", resp ? resp : "HTTP/1.1 500 Internal Server Error\r\n");
        ssize_t wr = write(c, out, (size_t)len);
        (void)wr;
        close(c);
    }
    return NULL;
}

Test(bench, openai_sender_tells_early_rejections_from_bad_requests)
{
    int ls;
    pthread_t th;
    char url[64];
    serve_loopback(refusing_server, &ls, &th, url, sizeof url);
    bench_request_t req[3] = {{.t_send = 0, .prompt = "slo-one", .input_len = 1, .output_len = 3},
                              {.t_send = 0.1, .prompt = "bad-two", .input_len = 1, .output_len = 3},
                              {.t_send = 0.2, .prompt = "busy-three", .input_len = 1, .output_len = 3}};
    bench_workload_t w = {.req = req, .n = 3};
    bench_result_t res[3];
    bench_openai_t o = {.endpoint = url, .timeout_s = 10};
    cr_assert_eq(bench_run_openai(&o, &w, res), TD_OK);
    pthread_join(th, NULL);
    close(ls);
    cr_assert(!res[0].ok && res[0].status == 400 && res[0].rejected, "400 with rejected-early: rejected (%s)",
              res[0].error);
    cr_assert(!res[1].ok && res[1].status == 400 && !res[1].rejected, "a plain 400 is a failure");
    cr_assert(!res[2].ok && res[2].status == 429 && res[2].rejected && res[2].retry_after_ms == 250,
              "429: rejected with its hint (%u ms)", res[2].retry_after_ms);
}

/* A gRPC Generate that streams the prompt's length back as token ids 1..3,
 * one message each, then ends well ("ok" prompts) or with UNAVAILABLE after
 * two ("die" prompts); or refuses at once with FAILED_PRECONDITION, as the
 * router's early rejection ("slo" prompts: with rejected-early and
 * retry-after-ms trailers) or as any other error ("bad"): what the gRPC
 * sender must count. */
static void h_generate(void *ctx, td_rpc_call_t *c)
{
    (void)ctx;
    size_t n;
    const uint8_t *p = td_rpc_call_payload(c, &n);
    Tandem__V1__GenerateRequest *rq = tandem__v1__generate_request__unpack(NULL, n, p);
    if (!rq || rq->input_case != TANDEM__V1__GENERATE_REQUEST__INPUT_PROMPT || !rq->return_token_ids) {
        td_rpc_call_finish(c, TD_RPC_INVALID_ARGUMENT, "want a prompt and return_token_ids");
        if (rq)
            tandem__v1__generate_request__free_unpacked(rq, NULL);
        return;
    }
    bool die = !strncmp(rq->prompt, "die", 3), slo = !strncmp(rq->prompt, "slo", 3),
         bad = !strncmp(rq->prompt, "bad", 3);
    tandem__v1__generate_request__free_unpacked(rq, NULL);
    if (slo || bad) {
        if (slo) {
            td_rpc_call_set_trailer(c, "retry-after-ms", "7");
            td_rpc_call_set_trailer(c, "rejected-early", "tpot");
            td_rpc_call_set_trailer(c, "retry-after-ms", "70"); /* set again: the new value */
        }
        td_rpc_call_finish(c, TD_RPC_FAILED_PRECONDITION, "refused");
        return;
    }
    for (int32_t i = 1; i <= 3; i++) {
        if (die && i == 3) {
            td_rpc_call_finish(c, TD_RPC_UNAVAILABLE, "the worker went away");
            return;
        }
        Tandem__V1__GenerateResponse r = TANDEM__V1__GENERATE_RESPONSE__INIT;
        Tandem__V1__Usage u = TANDEM__V1__USAGE__INIT;
        r.text = "x";
        r.n_token_ids = 1;
        r.token_ids = &i;
        if (i == 3) {
            r.has_finish_reason = 1;
            r.finish_reason = TANDEM__V1__FINISH_REASON__FINISH_REASON_LENGTH;
            u.has_prompt_tokens = 1;
            u.prompt_tokens = 42;
            r.usage = &u;
        }
        uint8_t buf[128];
        size_t len = tandem__v1__generate_response__pack(&r, buf);
        td_rpc_call_send(c, buf, len);
        nanosleep(&(struct timespec){.tv_sec = 0, .tv_nsec = 20000000}, NULL);
    }
    td_rpc_call_finish(c, TD_RPC_OK, NULL);
}

Test(bench, grpc_sender_counts_tokens_errors_and_dead_endpoints, .init = setup, .fini = teardown, .timeout = 60)
{
    td_rpc_init();
    td_rpc_server_t *srv;
    int port;
    cr_assert_eq(td_rpc_server_create("127.0.0.1:0", NULL, &srv), TD_OK);
    td_rpc_server_add(srv, "/tandem.v1.Tandem/Generate", h_generate, NULL);
    cr_assert_eq(td_rpc_server_start(srv, &port), TD_OK);
    char ep[64];
    snprintf(ep, sizeof ep, "127.0.0.1:%d", port);
    bench_request_t req[6] = {{.t_send = 0, .prompt = "ok one", .input_len = 2, .output_len = 3},
                              {.t_send = 0.05, .prompt = "die two", .input_len = 2, .output_len = 3},
                              {.t_send = 0.1, .prompt = "ok three", .input_len = 2, .output_len = 3},
                              {.t_send = 0.3, .prompt = "ok four", .input_len = 2, .output_len = 3},
                              {.t_send = 0.3, .prompt = "slo five", .input_len = 2, .output_len = 3},
                              {.t_send = 0.3, .prompt = "bad six", .input_len = 2, .output_len = 3}};
    bench_workload_t w = {.req = req, .n = 6};
    bench_result_t res[6];
    bench_grpc_t o = {.endpoint = ep, .timeout_s = 10};
    cr_assert_eq(bench_run_grpc(&o, &w, res), TD_OK);
    cr_assert(!res[4].ok && res[4].rejected && res[4].retry_after_ms == 70,
              "an early rejection (rejected-early) counts as rejected, with its last hint: %s, %u ms", res[4].error,
              res[4].retry_after_ms);
    cr_assert(!res[5].ok && !res[5].rejected && res[5].status == TD_RPC_FAILED_PRECONDITION,
              "the same code without rejected-early is a failure");
    for (int i = 0; i < 4; i++) {
        if (i == 1)
            continue;
        cr_assert(res[i].ok, "request %d: %s", i, res[i].error);
        cr_assert_eq(res[i].n_out, 3);
        cr_assert_eq(res[i].n_in, 42, "the server's prompt token count wins");
        cr_assert_str_eq(res[i].finish, "length");
        cr_assert(res[i].t_first > res[i].t_sent && res[i].t_done >= res[i].t_first);
        cr_assert(res[i].tpot > 0.015 && res[i].tpot < 0.5, "tpot %f: the server paces tokens 20 ms apart",
                  res[i].tpot);
        cr_assert_lt(fabs(res[i].t_sent - res[i].t_planned), 0.05, "sent on schedule");
    }
    cr_assert(!res[1].ok && !res[1].rejected);
    cr_assert_eq(res[1].n_out, 2, "the tokens that came are counted");
    cr_assert_eq(res[1].status, TD_RPC_UNAVAILABLE);
    cr_assert(strstr(res[1].error, "went away"), "%s", res[1].error);
    td_rpc_server_stop(srv, 1);
    td_rpc_server_destroy(srv);

    /* the endpoint is gone now: every request fails at once, none hangs */
    double t0 = (double)time(NULL);
    cr_assert_eq(bench_run_grpc(&o, &w, res), TD_OK);
    cr_assert_lt((double)time(NULL) - t0, 5);
    for (int i = 0; i < 4; i++)
        cr_assert(!res[i].ok && res[i].error[0] && res[i].n_out == 0);
    bench_summary_t sum = bench_summarize(res, 4, 1, 1);
    cr_assert_eq(sum.failed, 4);
    cr_assert(isnan(sum.ttft_p50), "no successful request: no percentile");
    td_rpc_shutdown();
}
