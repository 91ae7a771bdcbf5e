/* tsan_stress.c — the objects tandem shares between threads, driven from
 * several threads at once, for ThreadSanitizer (tests/run.sh builds this with
 * -fsanitize=thread and runs it; a data race aborts it). Criterion cannot
 * run under ThreadSanitizer (its inheritable arena and TSan's memory map
 * collide: Snaipe/Criterion#274), so this is a plain program; the Criterion
 * suites check what these objects compute, this checks who touches them.
 *
 * Covered, each with its owner rule (the file that states it):
 *   tokenizer  one tokenizer, encodes from 4 threads        (engine/pretok.c)
 *   threadpool the kernel pool, runs from one owner thread   (kernels/cpu/threadpool.h)
 *   rpc        a server's handler threads, clients on 6 threads, unary, streams,
 *              wakes from another thread, a channel shut down while calls fly;
 *              detached calls pumped by wakes and asynchronous sends, read by
 *              asynchronous client reads, some cancelled through their scope
 *                                                            (common/rpc.h)
 *   placement  the router's table: acquire/done from 6 threads, joins, leaves,
 *              holds, while etcd-style puts and removes arrive (router/placement.h)
 *   renewer,   reservations added and removed from 4 threads while the renewer
 *   stats      renews them (router/renewer.h), the same threads counting ends
 *              and reading the SLO window and Health (router/stats.h)
 *   fair,      the admission queue: requests enter, leave and cancel from 4
 *   outlen     threads, handed over by whichever thread ends one, while its
 *              timer expires deadlines; the output-length predictor learnt and
 *              read from the same threads (router/fair.h, router/outlen.h)
 *   transport  puts and flushes while the target's progress thread runs
 *                                                            (kvstore/transfer.h)
 *   tp         a tensor-parallel engine's steps, a thread a rank meeting in the
 *              all-reduce (engine/tp.h, kernels/comm.h); tiny-llama3 from the
 *              fixtures (the default model's 9 heads do not split in two)
 * Usage: tsan_stress MODEL.gguf; exit 0 when every check held. */
#define _GNU_SOURCE
#include <jansson.h>
#include <stdatomic.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/kv_contract.h"
#include "common/log.h"
#include "common/rpc.h"
#include "engine/engine.h"
#include "engine/gguf.h"
#include "engine/tokenizer.h"
#include "kernels/backend.h"
#include "kvstore/transfer.h"
#include "prefill_worker/peers.h"
#include "router/fair.h"
#include "router/kvindex.h"
#include "router/outlen.h"
#include "router/placement.h"
#include "router/renewer.h"
#include "router/stats.h"

static int failures;
#define CHECK(cond, ...)                                                                                           \
    do {                                                                                                           \
        if (!(cond)) {                                                                                             \
            fprintf(stderr, "tsan_stress: FAILED: " __VA_ARGS__);                                                   \
            fprintf(stderr, "\n");                                                                                 \
            __atomic_add_fetch(&failures, 1, __ATOMIC_RELAXED);                                                    \
        }                                                                                                          \
    } while (0)

/* ---- tokenizer ---- */
typedef struct enc_job {
    const eng_tokenizer_t *tok;
    const char *text;
    size_t n_want;
} enc_job_t;

static void *enc_thread(void *arg)
{
    enc_job_t *j = arg;
    for (int it = 0; it < 50; it++) {
        int32_t *ids = NULL;
        size_t n = 0, cap = 0;
        td_status_t rc = eng_tokenizer_encode(j->tok, j->text, strlen(j->text), 0, &ids, &cap, &n);
        CHECK(!rc && n == j->n_want, "tokenizer: a concurrent encode differs");
        free(ids);
    }
    return NULL;
}

static void stress_tokenizer(const char *model)
{
    eng_gguf_t *g;
    eng_tokenizer_t *tok;
    if (eng_gguf_open(model, &g) || eng_tokenizer_from_gguf(g, &tok)) {
        CHECK(0, "tokenizer: cannot open %s", model);
        return;
    }
    static const char *texts[4] = {"The history of the lighthouse begins in ancient times.",
                                   "def f(n):\n    return n + 12345  # 67890", "Ünïcödé 🙂 3.14159",
                                   "  tabs\tand\nnewlines it's"};
    enc_job_t jobs[4];
    pthread_t th[4];
    for (int i = 0; i < 4; i++) {
        int32_t *ids = NULL;
        size_t n = 0, cap = 0;
        eng_tokenizer_encode(tok, texts[i], strlen(texts[i]), 0, &ids, &cap, &n);
        free(ids);
        jobs[i] = (enc_job_t){tok, texts[i], n};
        pthread_create(&th[i], NULL, enc_thread, &jobs[i]);
    }
    for (int i = 0; i < 4; i++)
        pthread_join(th[i], NULL);
    eng_tokenizer_destroy(tok);
    eng_gguf_close(g);
}

/* ---- threadpool (through the CPU backend's ops) ---- */
static void stress_threadpool(void)
{
    kern_backend_t *be;
    if (kern_cpu_backend_create(4, &be)) {
        CHECK(0, "threadpool: no backend");
        return;
    }
    enum { N = 64, D = 512 };
    float *x = malloc(sizeof(float) * N * D), *y = malloc(sizeof(float) * N * D), w[D];
    for (int i = 0; i < N * D; i++)
        x[i] = (float)(i % 17) * 0.25f;
    for (int i = 0; i < D; i++)
        w[i] = 1.0f;
    for (int rep = 0; rep < 50; rep++) {
        CHECK(!be->ops->rmsnorm(be, x, w, y, N, D, 1e-5f), "threadpool: rmsnorm");
        CHECK(!be->ops->swiglu(be, x, y, y, (size_t)N * D), "threadpool: swiglu");
    }
    free(x);
    free(y);
    kern_backend_destroy(be);
}

/* ---- tp ---- */
static void tp_event(void *ctx, const eng_event_t *ev)
{
    if (ev->finish)
        (*(int *)ctx)++;
}

static void stress_tp(void)
{
    eng_model_t *m;
    eng_engine_t *e;
    if (eng_model_open("tests/fixtures/hf/tiny-llama3", &m)) {
        CHECK(0, "tp: tiny-llama3 (run from the repository's root)");
        return;
    }
    eng_engine_config_t cfg = eng_engine_config_default();
    cfg.tp = 2, cfg.device = "cpu", cfg.n_threads = 2, cfg.token_budget = 16, cfg.kv_tokens = 512;
    if (eng_engine_create(m, &cfg, &e)) {
        CHECK(0, "tp: engine");
        eng_model_close(m);
        return;
    }
    int32_t prompt[40];
    for (int i = 0; i < 40; i++)
        prompt[i] = (int32_t)(i * 13 % 600);
    for (int k = 0; k < 3; k++) {
        eng_request_t r = {.prompt = prompt, .n_prompt = 20 + 10 * (size_t)k, .sampling = eng_sampling_default(),
                           .max_tokens = 12, .ignore_eos = true};
        uint64_t id;
        CHECK(!eng_engine_add(e, &r, &id), "tp: add");
    }
    int done = 0;
    while (eng_engine_busy(e))
        if (eng_engine_step(e, tp_event, &done)) {
            CHECK(0, "tp: step");
            break;
        }
    CHECK(done == 3, "tp: 3 requests finished");
    eng_engine_destroy(e);
    eng_model_close(m);
}

/* ---- rpc ---- */
static void h_echo(void *ctx, td_rpc_call_t *c)
{
    (void)ctx;
    size_t n;
    const uint8_t *p = td_rpc_call_payload(c, &n);
    td_rpc_call_reply(c, p, n);
}

static void *waker(void *arg)
{
    td_sleep_s(0.002);
    td_rpc_call_wake(arg);
    return NULL;
}

/* streams 5 messages, each after a wake from another thread */
static void h_stream(void *ctx, td_rpc_call_t *c)
{
    (void)ctx;
    for (int i = 0; i < 5; i++) {
        pthread_t t;
        pthread_create(&t, NULL, waker, c);
        td_status_t rc = td_rpc_call_wait(c, 5);
        pthread_join(t, NULL);
        if (rc || td_rpc_call_send(c, "m", 1)) {
            td_rpc_call_finish(c, TD_RPC_CANCELLED, "gone");
            return;
        }
    }
    td_rpc_call_finish(c, TD_RPC_OK, NULL);
}

/* the asynchronous shape: the handler detaches; a thread queues 5 events
 * and wakes the call; the pump (on a completion-queue thread) sends one at a
 * time and resumes the call on the pool to finish */
typedef struct pump {
    pthread_mutex_t mu;
    int queued;                  /* events from the producer (under mu) */
    int sent;                    /* the pump's own */
    bool sending, ending;
    td_rpc_call_t *call;
    pthread_t producer;
} pump_t;

static void pump_run(void *ctx, bool ok);

static void pump_end(void *ctx, td_rpc_call_t *c)
{
    pump_t *p = ctx;
    pthread_join(p->producer, NULL);
    td_rpc_call_finish(c, p->sent == 5 ? TD_RPC_OK : TD_RPC_CANCELLED, "pump");
    pthread_mutex_destroy(&p->mu);
    free(p);
}

static void pump_sent(void *ctx, bool ok)
{
    pump_t *p = ctx;
    p->sending = false;
    if (!ok)
        p->ending = true, td_rpc_call_resume(p->call, pump_end, p);
    else
        pump_run(p, true);
}

static void pump_run(void *ctx, bool ok)
{
    (void)ok;
    pump_t *p = ctx;
    if (p->sending || p->ending)
        return;
    pthread_mutex_lock(&p->mu);
    int q = p->queued;
    pthread_mutex_unlock(&p->mu);
    if (td_rpc_call_cancelled(p->call) || p->sent == 5) {
        p->ending = true;
        td_rpc_call_on_wake(p->call, NULL, NULL);
        td_rpc_call_resume(p->call, pump_end, p);
        return;
    }
    if (p->sent < q) {
        p->sending = true;
        p->sent++;
        if (td_rpc_call_send_async(p->call, "p", 1, pump_sent, p) != TD_OK) {
            p->sending = false;
            p->ending = true;
            td_rpc_call_resume(p->call, pump_end, p);
        }
    }
}

static void *producer(void *arg)
{
    pump_t *p = arg;
    for (int i = 0; i < 5; i++) {
        td_sleep_s(0.001);
        pthread_mutex_lock(&p->mu);
        p->queued++;
        td_rpc_call_wake(p->call); /* under the producer's lock, as the decode worker does */
        pthread_mutex_unlock(&p->mu);
    }
    return NULL;
}

static void h_pump(void *ctx, td_rpc_call_t *c)
{
    (void)ctx;
    pump_t *p = calloc(1, sizeof *p);
    pthread_mutex_init(&p->mu, NULL);
    p->call = c;
    td_rpc_call_detach(c);
    td_rpc_call_on_wake(c, pump_run, p);
    pthread_create(&p->producer, NULL, producer, p);
}

/* the client side: asynchronous reads, counted; the last read wakes the waiter */
typedef struct areader {
    td_rpc_stream_t *st;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int got;
    bool done;
} areader_t;

static void on_aread(void *ctx, td_status_t rc, const uint8_t *msg, size_t len)
{
    areader_t *a = ctx;
    if (rc == TD_OK && len == 1 && msg[0] == 'p') {
        a->got++;
        if (td_rpc_stream_read_async(a->st, on_aread, a) == TD_OK)
            return;
    }
    pthread_mutex_lock(&a->mu);
    a->done = true;
    pthread_cond_signal(&a->cv);
    pthread_mutex_unlock(&a->mu);
}

typedef struct rpc_job {
    td_rpc_channel_t *ch;
    int ok, shut; /* calls that succeeded; that ended UNAVAILABLE after the shutdown */
    int async_ok, async_cancelled;
} rpc_job_t;

static void async_round(rpc_job_t *j, bool cancel)
{
    td_rpc_scope_t *sc;
    if (td_rpc_scope_create(5, &sc))
        return;
    areader_t a = {.got = 0};
    pthread_mutex_init(&a.mu, NULL);
    pthread_cond_init(&a.cv, NULL);
    if (td_rpc_stream_open(j->ch, "/t.T/Pump", "x", 1, 5, sc, &a.st) == TD_OK &&
        td_rpc_stream_read_async(a.st, on_aread, &a) == TD_OK) {
        if (cancel)
            td_rpc_scope_cancel(sc); /* from this thread, while the callbacks run */
        pthread_mutex_lock(&a.mu);
        while (!a.done)
            pthread_cond_wait(&a.cv, &a.mu);
        pthread_mutex_unlock(&a.mu);
        td_rpc_result_t res;
        td_rpc_stream_result(a.st, 0, &res);
        j->async_ok += !cancel && a.got == 5 && res.code == TD_RPC_OK;
        j->async_cancelled += cancel && (res.code == TD_RPC_CANCELLED || (a.got == 5 && res.code == TD_RPC_OK));
    }
    td_rpc_stream_destroy(a.st);
    pthread_mutex_destroy(&a.mu);
    pthread_cond_destroy(&a.cv);
    td_rpc_scope_destroy(sc);
}


static void *rpc_client(void *arg)
{
    rpc_job_t *j = arg;
    for (int it = 0; it < 30; it++) {
        uint8_t *out = NULL;
        size_t on;
        td_rpc_result_t res;
        if (td_rpc_unary(j->ch, "/t.T/Echo", "hello", 5, 5, NULL, &out, &on, &res) == TD_OK)
            j->ok += on == 5 && !memcmp(out, "hello", 5);
        else
            j->shut += res.code == TD_RPC_UNAVAILABLE;
        free(out);
        td_rpc_stream_t *st;
        if (td_rpc_stream_open(j->ch, "/t.T/Stream", "x", 1, 5, NULL, &st) == TD_OK) {
            const uint8_t *m;
            size_t l;
            int got = 0;
            while (td_rpc_stream_read(st, &m, &l, 5) == TD_OK) {
                got++;
            }
            td_rpc_stream_result(st, 5, &res);
            j->ok += got == 5 && res.code == TD_RPC_OK;
            j->shut += res.code == TD_RPC_UNAVAILABLE;
            td_rpc_stream_destroy(st);
        }
        async_round(j, it % 3 == 2);
    }
    return NULL;
}

static void stress_rpc(void)
{
    td_rpc_server_t *s;
    int port;
    if (td_rpc_server_create("127.0.0.1:0", NULL, &s) || td_rpc_server_add(s, "/t.T/Echo", h_echo, NULL) ||
        td_rpc_server_add(s, "/t.T/Stream", h_stream, NULL) || td_rpc_server_add(s, "/t.T/Pump", h_pump, NULL) ||
        td_rpc_server_start(s, &port)) {
        CHECK(0, "rpc: no server");
        return;
    }
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
    td_rpc_channel_t *a, *b;
    td_rpc_channel_create(addr, NULL, &a);
    td_rpc_channel_create(addr, NULL, &b);
    rpc_job_t jobs[6];
    pthread_t th[6];
    for (int i = 0; i < 6; i++) {
        jobs[i] = (rpc_job_t){.ch = i < 3 ? a : b};
        pthread_create(&th[i], NULL, rpc_client, &jobs[i]);
    }
    td_sleep_s(0.3);
    td_rpc_channel_shutdown(b); /* while b's calls are in flight */
    int ok_a = 0, ok_b = 0, async_a = 0, cancelled_a = 0;
    for (int i = 0; i < 6; i++) {
        pthread_join(th[i], NULL);
        if (i < 3) {
            ok_a += jobs[i].ok;
            async_a += jobs[i].async_ok;
            cancelled_a += jobs[i].async_cancelled;
        } else {
            ok_b += jobs[i].ok + jobs[i].shut;
        }
    }
    CHECK(ok_a == 3 * 60, "rpc: %d of 180 calls on the live channel succeeded", ok_a);
    CHECK(async_a == 3 * 20, "rpc: %d of 60 asynchronous streams on the live channel delivered 5 of 5", async_a);
    CHECK(cancelled_a == 3 * 10, "rpc: %d of 30 cancelled asynchronous streams ended CANCELLED (or complete)",
          cancelled_a);
    CHECK(ok_b > 0, "rpc: the shut channel's calls neither succeeded nor ended UNAVAILABLE");
    td_rpc_channel_destroy(a);
    td_rpc_channel_destroy(b);
    td_rpc_server_stop(s, 5);
    td_rpc_server_destroy(s);
}

/* ---- placement ---- */
typedef struct place_job {
    rt_table_t *t;
    int picked;
    const rt_place_req_t *rq; /* the predictive placement's request (its chain in the index) */
} place_job_t;

static void *place_user(void *arg)
{
    place_job_t *j = arg;
    for (int it = 0; it < 2000; it++) {
        if (it % 5 == 0) { /* a whole placement, its refusal or its pair; predictive every other time */
            const rt_placement_ops_t *pol = it % 10 ? &rt_placement_least_loaded : &rt_placement_predictive;
            rt_placement_t pl;
            rt_table_place(j->t, pol, it % 10 ? NULL : j->rq, &pl);
            if (it % 50 == 0)
                json_decref(rt_table_metrics(j->t, pol)); /* Health, meanwhile */
            if (!pl.code) {
                rt_timings_t tm = {.ttft_ms = 2, .prefill_ms = 1, .tpot_ms = 1, .output_tokens = 3, .ok = true,
                                   .pred = pl.pred};
                rt_table_prefill_done(j->t, pl.prefill, &pl.pred);
                rt_table_observe(j->t, pol, pl.prefill, pl.decode, &tm);
                rt_table_done(j->t, pl.prefill, NULL, 0);
                rt_table_done(j->t, pl.decode, NULL, 0);
            }
            continue;
        }
        rt_worker_t *w = rt_table_acquire(j->t, &rt_placement_least_loaded, it & 1 ? RT_DECODE : RT_PREFILL, NULL);
        if (!w)
            continue;
        j->picked++;
        rt_table_hold(j->t, w);
        char id[sizeof w->id];
        memcpy(id, w->id, sizeof id); /* the record stays valid while held */
        rt_table_unhold(j->t, w);
        td_rpc_result_t failed = {.code = TD_RPC_UNAVAILABLE, .message = "stress"};
        rt_table_done(j->t, w, it % 97 == 0 ? &failed : NULL, 0.0001);
    }
    return NULL;
}

static void put_worker(rt_table_t *t, const td_kv_layout_t *l, const char *role, int k)
{
    char rec[1024], key[96];
    json_t *c = td_kv_layout_to_json(l);
    char *cs = json_dumps(c, JSON_COMPACT);
    json_decref(c);
    snprintf(rec, sizeof rec, "{\"id\":\"%s-%d\",\"role\":\"%s\",\"addr\":\"127.0.0.1:9\",\"pid\":1,\"contract\":%s}",
             role, k, role, cs);
    free(cs);
    snprintf(key, sizeof key, "/tandem/workers/%s/%s-%d", role, role, k);
    rt_table_put(t, key, rec);
}

static void stress_placement(void)
{
    td_kv_layout_t l = td_kv_layout_make("m", 30, 3, 64, 16, TD_KV_F16);
    rt_table_t t;
    rt_table_init(&t, &l, NULL);
    rt_kvindex_t *ix = NULL;
    CHECK(rt_kvindex_create(4096, &ix) == TD_OK, "placement: no cache index");
    t.ix = ix;
    int32_t tok[256];
    for (int i = 0; i < 256; i++)
        tok[i] = 100 + i;
    td_block_name_t chain[16];
    td_block_name_chain(td_block_name_root("m", "fp16", 16), tok, 256, 16, chain, 16);
    rt_place_req_t rq = {.tokens = tok, .n_tokens = 256, .chain = chain, .n_blocks = 16, .max_tokens = 8,
                         .ttft_slo_ms = 1e6, .early_reject = true};
    for (int k = 0; k < 3; k++) {
        put_worker(&t, &l, "prefill", k);
        put_worker(&t, &l, "decode", k);
    }
    place_job_t jobs[6];
    pthread_t th[6];
    for (int i = 0; i < 6; i++) {
        jobs[i] = (place_job_t){&t, 0, &rq};
        pthread_create(&th[i], NULL, place_user, &jobs[i]);
    }
    bool yes[16], no[16];
    for (int k = 0; k < 16; k++)
        yes[k] = true, no[k] = false;
    for (int r = 0; r < 50; r++) { /* membership and the index change while requests pick (as the follower does) */
        char key[96];
        snprintf(key, sizeof key, "/tandem/workers/decode/decode-%d", r % 3);
        rt_table_remove(&t, key);
        put_worker(&t, &l, "decode", r % 3);
        snprintf(key, sizeof key, "/tandem/workers/prefill/prefill-%d", r % 3);
        int slot = rt_kvindex_source(ix, key, false);
        pthread_mutex_lock(&t.mu);
        for (size_t i = 0; i < t.n; i++)
            if (!strcmp(t.w[i]->key, key))
                t.w[i]->ix_src = slot;
        pthread_mutex_unlock(&t.mu);
        rt_kvindex_apply(ix, slot, chain, r % 2 ? yes : no, NULL, 1 + (size_t)(r % 16));
        if (r % 10 == 9)
            rt_kvindex_clear(ix, slot, false);
        td_sleep_s(0.001);
    }
    int picked = 0;
    for (int i = 0; i < 6; i++) {
        pthread_join(th[i], NULL);
        picked += jobs[i].picked;
    }
    CHECK(picked > 1000, "placement: only %d of 12000 acquires found a worker", picked);
    const char *none[1] = {NULL};
    rt_table_retain(&t, none, 0);
    CHECK(rt_table_registered(&t, RT_DECODE) == 0 && rt_table_registered(&t, RT_PREFILL) == 0,
          "placement: workers left after retaining none");
    rt_kvindex_destroy(ix);
}

/* ---- transport ---- */
/* ---- the router's renewer and statistics (and the planner's reads of both: arrivals, capacity) ---- */
typedef struct parts_job {
    rt_table_t *t;
    rt_renewer_t *rn;
    rt_stats_t *st;
    rt_worker_t **w; /* 2 decode, then 2 prefill workers, held */
    int k;
    double until; /* past two renewal rounds */
} parts_job_t;

static void *parts_user(void *arg)
{
    parts_job_t *j = arg;
    for (int it = 0; it < 3000 || td_now_s() < j->until; it++) {
        rt_worker_t *d = j->w[it % 2], *p = it % 5 ? j->w[2 + it % 2] : NULL;
        uint64_t id = (uint64_t)j->k << 32 | (uint64_t)it;
        if (rt_renewer_add(j->rn, d, id, p)) {
            if (it % 3)
                td_sleep_s(0.0002); /* held across a renewal now and then */
            rt_renewer_remove(j->rn, d, id);
        }
        rt_stats_count(j->st, it % 7 != 0, 0.001 * it, 0.0005, 0.0001);
        rt_stats_done(j->st, 10 + it % 50, 1 + it % 5, it % 11 != 0, 100, it % 3 == 0);
        rt_stats_arrive(j->st, 100 + it % 300, it % 4 == 0, 16 + it % 32, 150);
        if (it % 500 == 0) {
            rt_slo_window_t w;
            rt_stats_window(j->st, td_now_s() - 60, 30, 3, &w);
            rt_arrivals_t a; /* the planner's predicted demand, meanwhile */
            rt_stats_arrivals(j->st, td_now_s() - 60, &a);
            rt_capacity_t cap;
            rt_table_capacity(j->t, a.n ? a.new_tokens / a.n : 1, 150, 30, &cap);
            json_t *o = json_object();
            rt_stats_json(j->st, o); /* Health, meanwhile */
            json_decref(o);
        }
    }
    return NULL;
}

static void stress_router_parts(void)
{
    td_kv_layout_t l = td_kv_layout_make("m", 30, 3, 64, 16, TD_KV_F16);
    rt_table_t t;
    rt_table_init(&t, &l, NULL);
    for (int k = 0; k < 2; k++) { /* at a closed port: every Renew and Extend fails fast */
        put_worker(&t, &l, "prefill", k);
        put_worker(&t, &l, "decode", k);
    }
    rt_worker_t *w[4];
    for (size_t i = 0, nd = 0, np = 0; i < t.n; i++) {
        rt_worker_t **slot = t.w[i]->role == RT_DECODE ? &w[nd++] : &w[2 + np++];
        *slot = t.w[i];
        rt_table_hold(&t, *slot);
    }
    rt_renewer_t *rn = NULL;
    rt_stats_t *st = NULL;
    CHECK(rt_renewer_start(&t, &rn) == TD_OK && rt_stats_create(&st) == TD_OK, "router parts: cannot start");
    if (!rn || !st)
        return;
    parts_job_t jobs[4];
    pthread_t th[4];
    for (int i = 0; i < 4; i++) {
        jobs[i] = (parts_job_t){&t, rn, st, w, i, td_now_s() + 2.5};
        pthread_create(&th[i], NULL, parts_user, &jobs[i]);
    }
    for (int i = 0; i < 4; i++)
        pthread_join(th[i], NULL);
    rt_slo_window_t win;
    rt_stats_window(st, td_now_s() - 600, 30, 3, &win);
    CHECK(win.n == 4096, "router parts: the SLO window holds %u ends, not its ring's 4096", win.n);
    rt_arrivals_t arr;
    rt_stats_arrivals(st, td_now_s() - 600, &arr);
    CHECK(arr.n == 4096, "router parts: the arrivals window holds %u, not its ring's 4096", arr.n);
    rt_renewer_stop(rn);
    rt_stats_destroy(st);
    for (int i = 0; i < 4; i++)
        rt_table_unhold(&t, w[i]);
    rt_table_fini(&t);
}

/* An admission-queue entry's state as its owner thread sees it: the queue's
 * callbacks (on any thread) move it. */
enum { FAIR_IDLE, FAIR_WAITING, FAIR_GOING, FAIR_EXPIRED };
typedef struct fair_req {
    rt_fair_entry_t e;
    int st; /* atomic */
} fair_req_t;

static int fair_handed, fair_expired; /* callbacks seen: queued requests that went, and that expired */
static void fair_on_go(void *r)
{
    __atomic_add_fetch(&fair_handed, 1, __ATOMIC_RELAXED);
    __atomic_store_n(&((fair_req_t *)r)->st, FAIR_GOING, __ATOMIC_RELEASE);
}
static void fair_on_expire(void *r)
{
    __atomic_add_fetch(&fair_expired, 1, __ATOMIC_RELAXED);
    __atomic_store_n(&((fair_req_t *)r)->st, FAIR_EXPIRED, __ATOMIC_RELEASE);
}

typedef struct fair_job {
    rt_fair_t *f;
    rt_outlen_t *o;
    fair_req_t r[8];
    int k;
    double until;
} fair_job_t;

static void *fair_user(void *arg)
{
    fair_job_t *j = arg;
    const char *tenant[3] = {"a", "b", "c"};
    for (int it = 0; it < 4000 || td_now_s() < j->until; it++) {
        fair_req_t *q = &j->r[it % 8];
        int st = __atomic_load_n(&q->st, __ATOMIC_ACQUIRE);
        char msg[256];
        double retry;
        if (st == FAIR_IDLE) {
            q->e = (rt_fair_entry_t){.req = q, .prompt = 10 + it % 50, .max_tokens = 16,
                                     .deadline = it % 5 == 0 ? td_now_s() + 0.002 : 0};
            int rc = rt_fair_enter(j->f, &q->e, tenant[(j->k + it) % 3], 1 + j->k, j->k % 2, msg, sizeof msg, &retry);
            int idle = FAIR_IDLE;
            if (rc == 0)
                __atomic_store_n(&q->st, FAIR_GOING, __ATOMIC_RELEASE);
            else if (rc == 1) /* unless go or expire came first */
                __atomic_compare_exchange_n(&q->st, &idle, FAIR_WAITING, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
        } else if (st == FAIR_GOING) {
            __atomic_store_n(&q->st, FAIR_IDLE, __ATOMIC_RELEASE);
            rt_fair_leave(j->f, &q->e, q->e.prompt, (uint32_t)(it % 16));
        } else if (st == FAIR_EXPIRED || (st == FAIR_WAITING && it % 7 == 0 && rt_fair_cancel(j->f, &q->e))) {
            __atomic_store_n(&q->st, FAIR_IDLE, __ATOMIC_RELEASE);
        }
        rt_outlen_query_t oq = {.tenant = tenant[it % 3], .prompt_tokens = 10 + (uint32_t)it % 500, .max_tokens = 64};
        rt_outlen_observe(j->o, &oq, rt_outlen_predict(j->o, &oq), (uint32_t)(1 + it % 60));
        if (it % 500 == 0) {
            json_decref(rt_fair_json(j->f));
            json_decref(rt_outlen_json(j->o));
        }
    }
    return NULL;
}

static void stress_fair(void)
{
    rt_fair_config_t fc = {.admit_max = 3, .tenant_queue_max = 6};
    rt_fair_t *f = NULL;
    rt_outlen_t *o = NULL;
    CHECK(rt_fair_create(&fc, fair_on_go, fair_on_expire, NULL, &f) == TD_OK && rt_outlen_create(&o) == TD_OK,
          "fair: cannot start");
    if (!f || !o)
        return;
    static fair_job_t jobs[4];
    pthread_t th[4];
    for (int i = 0; i < 4; i++) {
        memset(&jobs[i], 0, sizeof jobs[i]);
        jobs[i] = (fair_job_t){.f = f, .o = o, .k = i, .until = td_now_s() + 1.5};
        pthread_create(&th[i], NULL, fair_user, &jobs[i]);
    }
    for (int i = 0; i < 4; i++)
        pthread_join(th[i], NULL);
    /* the rest: leave what runs, take back what waits; nothing may stay running */
    for (int round = 0; round < 1000; round++)
        for (int i = 0; i < 4; i++)
            for (int k = 0; k < 8; k++) {
                fair_req_t *q = &jobs[i].r[k];
                int st = __atomic_load_n(&q->st, __ATOMIC_ACQUIRE);
                if (st == FAIR_GOING) {
                    __atomic_store_n(&q->st, FAIR_IDLE, __ATOMIC_RELEASE);
                    rt_fair_leave(f, &q->e, q->e.prompt, 1);
                } else if (st == FAIR_EXPIRED || (st == FAIR_WAITING && rt_fair_cancel(f, &q->e))) {
                    __atomic_store_n(&q->st, FAIR_IDLE, __ATOMIC_RELEASE);
                }
            }
    json_t *j = rt_fair_json(f);
    size_t i;
    json_t *t;
    int running = 0, waiting = 0;
    json_array_foreach(j, i, t) {
        running += (int)json_integer_value(json_object_get(t, "running"));
        waiting += (int)json_integer_value(json_object_get(t, "waiting"));
    }
    json_decref(j);
    CHECK(!running && !waiting, "fair: %d running and %d waiting after every request ended", running, waiting);
    CHECK(fair_handed > 0 && fair_expired > 0, "fair: %d queued requests went, %d expired: the queue was not "
          "exercised", fair_handed, fair_expired);
    rt_fair_destroy(f);
    rt_outlen_destroy(o);
}

/* The prefill worker's peers (prefill_worker/peers.c) against the transport's target: the engine's thread queues
 * slices of KV and waits at barriers while the pusher thread puts and flushes them; a second thread reads the stats
 * throughout and, midway, fails every peer (as a failed put or a fence does); the engine's thread sees its peer
 * failed after the step, lets it go, reaps it and connects anew, and the last step's bytes are read back. */
static atomic_int peers_phase; /* 0: steps; 1: fail every peer; 2: done */

static void *peers_watcher(void *arg)
{
    pw_peers_t *P = arg;
    uint64_t last = 0;
    while (atomic_load(&peers_phase) < 2) {
        pw_peers_stats_t st = pw_peers_stats(P);
        CHECK(st.bytes >= last, "peers: the bytes put went back (%llu after %llu)", (unsigned long long)st.bytes,
              (unsigned long long)last);
        last = st.bytes;
        int one = 1;
        if (atomic_compare_exchange_strong(&peers_phase, &one, 3))
            pw_peers_fail_all(P, "tsan_stress: every peer failed midway");
        usleep(200);
    }
    return NULL;
}

static void stress_peers(const kv_transport_ops_t *xo, void *addr, size_t al, void *rkey, size_t rl, uint64_t base)
{
    kv_xfer_t *x;
    pw_peers_t *P;
    if (xo->create(NULL, &x) || xo->progress_start(x) || pw_peers_create(xo, x, 60, &P)) {
        CHECK(0, "peers: cannot start");
        return;
    }
    Tandem__Internal__V1__LandingDescriptor ld = TANDEM__INTERNAL__V1__LANDING_DESCRIPTOR__INIT;
    ld.has_address = ld.has_region_key = ld.has_remote_base = ld.has_region_bytes = 1;
    ld.address = (ProtobufCBinaryData){al, addr};
    ld.region_key = (ProtobufCBinaryData){rl, rkey};
    ld.remote_base = base;
    ld.region_bytes = 1 << 20;
    enum { SLICE = 4096, SLICES = 16 };
    static uint8_t src[SLICES * SLICE], got[SLICES * SLICE];
    pthread_t th;
    pthread_create(&th, NULL, peers_watcher, P);
    int failed_seen = 0, steps = 0;
    pw_peer_t *last = NULL;
    for (int step = 0; step < 60; step++) {
        pw_peer_t *pe = pw_peer_get(P, &ld, NULL);
        if (!pe) {
            CHECK(0, "peers: step %d could not connect", step);
            break;
        }
        for (size_t i = 0; i < sizeof src; i++)
            src[i] = (uint8_t)(i * 7 + (size_t)step);
        for (int k = 0; k < SLICES; k++)
            pw_peers_put(P, pe, pe->region, src + k * SLICE, SLICE, (uint64_t)k * SLICE, td_now_s() + 30, 0);
        if (step == 20) { /* the watcher fails every peer while this step's puts are queued (10 s at most) */
            atomic_store(&peers_phase, 1);
            for (int waited = 0; atomic_load(&peers_phase) == 1 && waited < 100000; waited++)
                usleep(100);
            CHECK(atomic_load(&peers_phase) != 1, "peers: the watcher did not fail the peers within 10 s");
        }
        pw_peers_barrier(P);
        steps++;
        last = pe;
        if (atomic_load(&pe->failed)) {
            failed_seen++;
            last = NULL;
        } else if (step == 59) {
            CHECK(!xo->get(x, pe->peer, pe->region, got, sizeof got, 0) && !xo->flush(x, pe->peer, 10) &&
                      !memcmp(got, src, sizeof got), "peers: the last step's bytes read back differ");
        }
        pw_peer_release(P, pe);
        pw_peers_reap(P);
    }
    atomic_store(&peers_phase, 2);
    pthread_join(th, NULL);
    pw_peers_stats_t st = pw_peers_stats(P);
    CHECK(steps == 60 && failed_seen >= 1 && last, "peers: %d steps, %d saw their peer failed, the last %s", steps,
          failed_seen, last ? "landed" : "did not land");
    CHECK(st.bytes >= (uint64_t)(60 - failed_seen) * sizeof src, "peers: %llu bytes put in %d steps",
          (unsigned long long)st.bytes, steps);
    pw_peers_destroy(P);
    xo->destroy(x);
}

static void stress_transport(void)
{
    const kv_transport_ops_t *xo = &kv_transport_ucx;
    int up[2], down[2];
    if (pipe(up) || pipe(down))
        return;
    pid_t pid = fork();
    if (pid == 0) {
        close(up[0]);
        close(down[1]);
        kv_xfer_t *x;
        kv_xfer_mem_t *m;
        void *base, *addr, *rkey;
        size_t al, rl;
        if (xo->create(NULL, &x) || xo->mem_alloc(x, 1 << 20, &base, &m) || xo->mem_rkey(x, m, &rkey, &rl) ||
            xo->address(x, &addr, &al) || xo->progress_start(x))
            _exit(1);
        uint64_t b = (uint64_t)(uintptr_t)base;
        (void)!write(up[1], &al, sizeof al);
        (void)!write(up[1], addr, al);
        (void)!write(up[1], &rl, sizeof rl);
        (void)!write(up[1], rkey, rl);
        (void)!write(up[1], &b, sizeof b);
        char c;
        while (read(down[0], &c, 1) > 0)
            ;
        _exit(0);
    }
    close(up[1]);
    close(down[0]);
    size_t al, rl;
    uint64_t base;
    if (read(up[0], &al, sizeof al) != sizeof al) {
        CHECK(0, "transport: the target did not start");
        return;
    }
    void *addr = malloc(al);
    (void)!read(up[0], addr, al);
    (void)!read(up[0], &rl, sizeof rl);
    void *rkey = malloc(rl);
    (void)!read(up[0], rkey, rl);
    (void)!read(up[0], &base, sizeof base);
    /* an initiator with its own progress thread too (as the decode side has) */
    kv_xfer_t *x;
    kv_xfer_peer_t *p;
    uint32_t region;
    static uint8_t src[1 << 16], got[1 << 16];
    for (size_t i = 0; i < sizeof src; i++)
        src[i] = (uint8_t)i;
    if (xo->create(NULL, &x) || xo->progress_start(x) || xo->connect(x, addr, al, &p) ||
        xo->region_add(x, p, rkey, rl, base, 1 << 20, &region)) {
        CHECK(0, "transport: cannot connect");
    } else {
        for (int rep = 0; rep < 20; rep++) {
            CHECK(!xo->put(x, p, region, src, sizeof src, (uint64_t)rep * 4096), "transport: put");
            CHECK(!xo->flush(x, p, 10), "transport: flush");
        }
        CHECK(!xo->get(x, p, region, got, sizeof got, 19 * 4096) && !xo->flush(x, p, 10) &&
                  !memcmp(got, src, sizeof got), "transport: the bytes read back differ");
        xo->disconnect(x, p);
        xo->destroy(x);
    }
    stress_peers(xo, addr, al, rkey, rl, base);
    close(down[1]);
    close(up[0]);
    waitpid(pid, NULL, 0);
    free(addr);
    free(rkey);
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: tsan_stress MODEL.gguf\n");
        return 2;
    }
    td_log_init("tsan_stress", TD_LOG_WARN, false);
    double t0 = td_now_s();
    stress_transport(); /* first: it forks its target, before any other thread exists */
    td_rpc_init();
    stress_tokenizer(argv[1]);
    stress_threadpool();
    stress_tp();
    stress_rpc();
    stress_placement();
    stress_router_parts();
    stress_fair();
    td_rpc_shutdown();
    printf("tsan_stress: transport, prefill peers, tokenizer, threadpool, tp, rpc, placement, renewer, stats (arrivals, capacity), fair, outlen: %s (%.1f s)\n",
           failures ? "FAILED" : "ok", td_now_s() - t0);
    return failures ? 1 : 0;
}
