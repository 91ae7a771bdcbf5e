/* openai.c — see openai.h. State per request: its curl handle, the SSE line
 * being assembled, the times of its tokens. */
#include "bench/openai.h"

#include <curl/curl.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/log.h"

typedef struct flight {
    CURL *h;
    struct curl_slist *hdr;
    char *body;
    char line[65536];
    size_t line_len;
    double *times;
    uint32_t n_times, cap_times;
    bench_result_t *res;
    const bench_request_t *req;
    double t0;
} flight_t;

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* One SSE line: "data: {json}" or "data: [DONE]". */
static void sse_line(flight_t *f, const char *s, size_t n)
{
    if (n < 6 || strncmp(s, "data:", 5))
        return;
    s += 5, n -= 5;
    while (n && *s == ' ')
        s++, n--;
    if (n >= 6 && !strncmp(s, "[DONE]", 6))
        return;
    json_t *o = json_loadb(s, n, 0, NULL);
    json_t *c = json_array_get(json_object_get(o, "choices"), 0);
    json_t *text = json_object_get(c, "text");
    if (!text)
        text = json_object_get(json_object_get(c, "delta"), "content");
    const char *fr = json_string_value(json_object_get(c, "finish_reason"));
    if (fr)
        snprintf(f->res->finish, sizeof f->res->finish, "%s", fr);
    if (json_is_string(text) && json_string_length(text) > 0) {
        if (f->n_times == f->cap_times) {
            uint32_t nc = f->cap_times ? f->cap_times * 2 : 64;
            double *nt = realloc(f->times, nc * sizeof *nt);
            if (nt) {
                f->times = nt;
                f->cap_times = nc;
            }
        }
        if (f->n_times < f->cap_times)
            f->times[f->n_times++] = td_now_s() - f->t0;
    }
    json_t *err = json_object_get(o, "error");
    if (err) {
        const char *msg = json_string_value(json_object_get(err, "message"));
        snprintf(f->res->error, sizeof f->res->error, "server error: %s", msg ? msg : "(no message)");
    }
    json_decref(o);
}

static size_t on_data(char *p, size_t sz, size_t nm, void *ctx)
{
    flight_t *f = ctx;
    size_t n = sz * nm;
    for (size_t i = 0; i < n; i++) {
        if (p[i] == '\n') {
            if (f->line_len && f->line[f->line_len - 1] == '\r')
                f->line_len--;
            sse_line(f, f->line, f->line_len);
            f->line_len = 0;
        } else if (f->line_len < sizeof f->line - 1) {
            f->line[f->line_len++] = p[i];
        }
    }
    return n;
}

static char *request_body(const bench_openai_t *o, const bench_request_t *r)
{
    json_t *b = json_object();
    if (o->model)
        json_object_set_new(b, "model", json_string(o->model));
    if (r->chat)
        json_object_set_new(b, "messages", json_loads(r->prompt, 0, NULL));
    else
        json_object_set_new(b, "prompt", json_string(r->prompt));
    json_object_set_new(b, "max_tokens", json_integer(r->output_len));
    json_object_set_new(b, "temperature", json_real(0));
    json_object_set_new(b, "stream", json_true());
    if (o->ignore_eos)
        json_object_set_new(b, "ignore_eos", json_true());
    char *s = json_dumps(b, JSON_COMPACT);
    json_decref(b);
    return s;
}

void bench_result_times(bench_result_t *r, double *times, uint32_t n)
{
    r->n_out = n;
    if (!n)
        return;
    r->t_first = times[0];
    if (n < 2)
        return;
    r->tpot = (times[n - 1] - times[0]) / (n - 1);
    for (uint32_t i = n - 1; i > 0; i--) /* the gaps, then sorted */
        times[i] -= times[i - 1];
    qsort(times + 1, n - 1, sizeof *times, cmp_d);
    r->gap_max = times[n - 1];
    r->gap_p90 = times[1 + (size_t)floor(0.9 * (n - 2))];
}

void bench_progress(double now, double *last_print, bool final, size_t sent, size_t n, size_t in_flight,
                    size_t done, size_t failed)
{
    bool tty = isatty(STDERR_FILENO);
    if (final) {
        fprintf(stderr, "%s[bench] sent %zu, done %zu, failed %zu%s\n", tty ? "\r" : "", sent, done, failed,
                tty ? "                              " : "");
        return;
    }
    if (now - *last_print <= (tty ? 0.5 : 10))
        return;
    fprintf(stderr, "%s[bench] t=%.1fs sent %zu/%zu, in flight %zu, done %zu, failed %zu%s", tty ? "\r" : "", now,
            sent, n, in_flight, done, failed, tty ? "   " : "\n");
    *last_print = now;
}

static void finish(flight_t *f, CURLcode code)
{
    bench_result_t *r = f->res;
    long status = 0;
    curl_easy_getinfo(f->h, CURLINFO_RESPONSE_CODE, &status);
    r->status = (int)status;
    r->t_done = td_now_s() - f->t0;
    bench_result_times(r, f->times, f->n_times);
    if (code != CURLE_OK)
        snprintf(r->error, sizeof r->error, "%s", curl_easy_strerror(code));
    else if (status < 200 || status >= 300)
        snprintf(r->error, sizeof r->error, "HTTP %ld", status);
    else if (!f->n_times && !r->error[0])
        snprintf(r->error, sizeof r->error, "no tokens in the response");
    r->ok = !r->error[0];
    /* refused at admission: busy (429, 503), or an early rejection for an SLO (its rejected-early header; a
     * 400 when retrying cannot help), with the server's hint when it gives one */
    struct curl_header *h = NULL;
    bool early = curl_easy_header(f->h, "rejected-early", 0, CURLH_HEADER, -1, &h) == CURLHE_OK;
    r->rejected = !r->ok && !f->n_times && (status == 429 || status == 503 || early);
    if (curl_easy_header(f->h, "retry-after-ms", 0, CURLH_HEADER, -1, &h) == CURLHE_OK) {
        char *end;
        unsigned long ms = strtoul(h->value, &end, 10);
        r->retry_after_ms = !*end && ms <= UINT32_MAX ? (uint32_t)ms : 0;
    }
}

static void flight_free(flight_t *f)
{
    if (f->h)
        curl_easy_cleanup(f->h);
    curl_slist_free_all(f->hdr);
    free(f->body);
    free(f->times);
}

td_status_t bench_run_openai(const bench_openai_t *o, const bench_workload_t *w, bench_result_t *res)
{
    if (curl_global_init(CURL_GLOBAL_DEFAULT) != CURLE_OK)
        return td_error(TD_ERR_INTERNAL, "bench: curl_global_init failed");
    CURLM *m = curl_multi_init();
    flight_t *fl = calloc(w->n ? w->n : 1, sizeof *fl);
    if (!m || !fl) {
        free(fl);
        return td_error(TD_ERR_NO_MEMORY, "bench: no memory");
    }
    char url[512];
    double t0 = td_now_s(), last_print = 0;
    size_t next = 0, running_n = 0, done = 0, failed = 0;
    while (done < w->n) {
        double now = td_now_s() - t0;
        while (next < w->n && w->req[next].t_send <= now) { /* open loop: send on schedule */
            flight_t *f = &fl[next];
            const bench_request_t *r = &w->req[next];
            f->res = &res[next];
            memset(f->res, 0, sizeof *f->res);
            f->req = r;
            f->t0 = t0;
            f->res->t_planned = r->t_send;
            f->res->n_in = r->input_len;
            f->res->t_sent = td_now_s() - t0;
            snprintf(url, sizeof url, "%s/v1/%s", o->endpoint, r->chat ? "chat/completions" : "completions");
            f->h = curl_easy_init();
            f->body = request_body(o, r);
            f->hdr = curl_slist_append(NULL, "Content-Type: application/json");
            curl_easy_setopt(f->h, CURLOPT_URL, url);
            curl_easy_setopt(f->h, CURLOPT_POSTFIELDS, f->body);
            curl_easy_setopt(f->h, CURLOPT_HTTPHEADER, f->hdr);
            curl_easy_setopt(f->h, CURLOPT_WRITEFUNCTION, on_data);
            curl_easy_setopt(f->h, CURLOPT_WRITEDATA, f);
            curl_easy_setopt(f->h, CURLOPT_PRIVATE, f);
            curl_easy_setopt(f->h, CURLOPT_CONNECTTIMEOUT_MS, 3000L);
            curl_easy_setopt(f->h, CURLOPT_TIMEOUT_MS, (long)(o->timeout_s * 1000));
            curl_easy_setopt(f->h, CURLOPT_NOSIGNAL, 1L);
            curl_multi_add_handle(m, f->h);
            next++;
            running_n++;
        }
        int still;
        curl_multi_perform(m, &still);
        CURLMsg *msg;
        int left;
        while ((msg = curl_multi_info_read(m, &left))) {
            if (msg->msg != CURLMSG_DONE)
                continue;
            flight_t *f;
            curl_easy_getinfo(msg->easy_handle, CURLINFO_PRIVATE, (char **)&f);
            finish(f, msg->data.result);
            curl_multi_remove_handle(m, f->h);
            flight_free(f);
            f->h = NULL;
            running_n--;
            done++;
            failed += !f->res->ok;
        }
        if (o->progress)
            bench_progress(now, &last_print, false, next, w->n, running_n, done, failed);
        double wait = next < w->n ? w->req[next].t_send - (td_now_s() - t0) : 0.05;
        int ms = wait <= 0 ? 0 : wait > 0.05 ? 50 : (int)(wait * 1000) + 1;
        if (done < w->n)
            curl_multi_poll(m, NULL, 0, ms, NULL);
    }
    if (o->progress)
        bench_progress(0, &last_print, true, next, w->n, 0, done, failed);
    curl_multi_cleanup(m);
    free(fl);
    return TD_OK;
}
