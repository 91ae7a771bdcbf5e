/* router_rig.h — the router's request pipeline in a test process: fake
 * prefill and decode workers (real gRPC servers here that answer each
 * internal call as the test scripts: serve, or fail with a code; a decode
 * stream may break after some tokens; a prefill may hang until cancelled)
 * registered in a worker table, and the pipeline's env around it (the
 * default model's tokenizer, a pool, the renewer, statistics). A fake
 * worker's output token k is 1000 + k, its text "t1000 t1001 ...". Header-only
 * (each test is one executable). */
#ifndef TEST_ROUTER_RIG_H
#define TEST_ROUTER_RIG_H

#include "tests/unit/helpers.h"

#include <pthread.h>
#include <time.h>

#include "common/clock.h"
#include "common/kv_contract.h"
#include "common/log.h"
#include "common/pool.h"
#include "common/rpc.h"
#include "common/rpc_pb.h"
#include "router/request.h"
#include "tandem/internal/v1/worker.pb-c.h"

#define MAX_SCRIPT 8

/* A fake worker: its script and what it saw. */
typedef struct fake {
    char id[32], role[16];
    bool colocated;
    td_rpc_server_t *srv;
    int port;
    pthread_mutex_t mu;
    /* the code the k-th call answers (0: serve), past the script: serve */
    int reserve_code[MAX_SCRIPT], prefill_code[MAX_SCRIPT], decode_code[MAX_SCRIPT];
    int decode_break[MAX_SCRIPT]; /* tokens sent before the k-th stream fails with decode_code (0: at once) */
    bool prefill_hangs;           /* until the call is cancelled or its deadline passes */
    int reserves, prefills, decodes, releases, releases_closed, cancels, renews;
    uint32_t prefill_tokens, prefill_sampled_before; /* the last Prefill's */
    bool decode_whole; /* the last Decode had no reservation (a colocated worker's whole request) */
} fake_t;

static td_kv_layout_t expect;

static inline int script(fake_t *f, const int *codes, int *count)
{
    pthread_mutex_lock(&f->mu);
    int k = (*count)++;
    pthread_mutex_unlock(&f->mu);
    return k < MAX_SCRIPT ? codes[k] : 0;
}

static inline void h_reserve(void *ctx, td_rpc_call_t *call)
{
    fake_t *f = ctx;
    Tandem__Internal__V1__ReserveRequest *rq = (Tandem__Internal__V1__ReserveRequest *)td_rpc_request_pb(
        call, &tandem__internal__v1__reserve_request__descriptor);
    if (!rq)
        return;
    tandem__internal__v1__reserve_request__free_unpacked(rq, NULL);
    int k = f->reserves, code = script(f, f->reserve_code, &f->reserves);
    if (code) {
        td_rpc_call_finish(call, code, "%s: reserve scripted to fail", f->id);
        return;
    }
    Tandem__Internal__V1__LandingDescriptor ld = TANDEM__INTERNAL__V1__LANDING_DESCRIPTOR__INIT;
    ld.has_reservation_id = ld.has_land_by_unix_ms = 1;
    ld.reservation_id = 100 + (uint64_t)k;
    ld.land_by_unix_ms = td_unix_ms() + 60000;
    ld.decode_worker = f->id;
    Tandem__Internal__V1__ReserveResponse rp = TANDEM__INTERNAL__V1__RESERVE_RESPONSE__INIT;
    rp.landing = &ld;
    td_rpc_reply_pb(call, &rp.base);
}

static inline void h_release(void *ctx, td_rpc_call_t *call)
{
    fake_t *f = ctx;
    Tandem__Internal__V1__ReleaseRequest *rq = (Tandem__Internal__V1__ReleaseRequest *)td_rpc_request_pb(
        call, &tandem__internal__v1__release_request__descriptor);
    if (!rq)
        return;
    pthread_mutex_lock(&f->mu);
    f->releases++;
    f->releases_closed += rq->landing_closed;
    pthread_mutex_unlock(&f->mu);
    tandem__internal__v1__release_request__free_unpacked(rq, NULL);
    Tandem__Internal__V1__ReleaseResponse rp = TANDEM__INTERNAL__V1__RELEASE_RESPONSE__INIT;
    td_rpc_reply_pb(call, &rp.base);
}

static inline void h_renew(void *ctx, td_rpc_call_t *call)
{
    fake_t *f = ctx;
    pthread_mutex_lock(&f->mu);
    f->renews++;
    pthread_mutex_unlock(&f->mu);
    Tandem__Internal__V1__RenewResponse rp = TANDEM__INTERNAL__V1__RENEW_RESPONSE__INIT;
    td_rpc_reply_pb(call, &rp.base);
}

/* Streams output tokens from where the request stands: token k is 1000 + k. */
static inline void h_decode(void *ctx, td_rpc_call_t *call)
{
    fake_t *f = ctx;
    Tandem__Internal__V1__DecodeRequest *rq = (Tandem__Internal__V1__DecodeRequest *)td_rpc_request_pb(
        call, &tandem__internal__v1__decode_request__descriptor);
    if (!rq)
        return;
    int k = f->decodes, code = script(f, f->decode_code, &f->decodes);
    int brk = k < MAX_SCRIPT ? f->decode_break[k] : 0;
    pthread_mutex_lock(&f->mu);
    f->decode_whole = !rq->has_reservation_id;
    pthread_mutex_unlock(&f->mu);
    /* the first output token it sends: after a prefill, the first token (sampled_before counts it) */
    uint32_t at = rq->has_first_token ? rq->sampled_before - 1 : rq->resume_generated;
    uint32_t n = rq->sampling->max_tokens;
    tandem__internal__v1__decode_request__free_unpacked(rq, NULL);
    for (uint32_t i = 0; i < n; i++) {
        if (code && (int)i == brk) {
            td_rpc_call_finish(call, code, "%s: decode scripted to fail after %d tokens", f->id, brk);
            return;
        }
        int32_t tok = (int32_t)(1000 + at + i);
        char text[16];
        snprintf(text, sizeof text, "t%d ", tok);
        Tandem__Internal__V1__DecodeResponse dr = TANDEM__INTERNAL__V1__DECODE_RESPONSE__INIT;
        dr.text = text;
        dr.n_token_ids = 1;
        dr.token_ids = &tok;
        if (i + 1 == n) {
            dr.has_finish_reason = dr.has_completion_tokens = 1;
            dr.finish_reason = TANDEM__V1__FINISH_REASON__FINISH_REASON_LENGTH;
            dr.completion_tokens = at + n;
        }
        uint8_t buf[128];
        size_t len = tandem__internal__v1__decode_response__pack(&dr, buf);
        if (td_rpc_call_send(call, buf, len)) {
            td_rpc_call_finish(call, TD_RPC_CANCELLED, "gone");
            return;
        }
    }
    td_rpc_call_finish(call, TD_RPC_OK, NULL);
}

static inline void h_prefill(void *ctx, td_rpc_call_t *call)
{
    fake_t *f = ctx;
    Tandem__Internal__V1__PrefillRequest *rq = (Tandem__Internal__V1__PrefillRequest *)td_rpc_request_pb(
        call, &tandem__internal__v1__prefill_request__descriptor);
    if (!rq)
        return;
    pthread_mutex_lock(&f->mu);
    f->prefill_tokens = (uint32_t)rq->n_tokens;
    f->prefill_sampled_before = rq->sampled_before;
    pthread_mutex_unlock(&f->mu);
    Tandem__Internal__V1__PrefillResponse rp = TANDEM__INTERNAL__V1__PREFILL_RESPONSE__INIT;
    rp.has_first_token = 1;
    rp.first_token = (int32_t)(1000 + rq->sampled_before);
    rp.prefill_worker = f->id;
    char first_text[16]; /* as a prefill worker says it: the decode stream's first text, on a fresh request */
    snprintf(first_text, sizeof first_text, "t%d ", rp.first_token);
    if (!rq->sampled_before)
        rp.first_text = first_text;
    tandem__internal__v1__prefill_request__free_unpacked(rq, NULL);
    int code = script(f, f->prefill_code, &f->prefills);
    if (f->prefill_hangs) {
        while (!td_rpc_call_cancelled(call) && td_rpc_call_time_left(call) > 0)
            td_rpc_call_wait(call, 0.01);
        td_rpc_call_finish(call, TD_RPC_CANCELLED, "%s: gone", f->id);
        return;
    }
    if (code) {
        td_rpc_call_finish(call, code, "%s: prefill scripted to fail", f->id);
        return;
    }
    td_rpc_reply_pb(call, &rp.base);
}

static inline void h_cancel(void *ctx, td_rpc_call_t *call)
{
    fake_t *f = ctx;
    pthread_mutex_lock(&f->mu);
    f->cancels++;
    pthread_mutex_unlock(&f->mu);
    Tandem__Internal__V1__CancelPrefillResponse rp = TANDEM__INTERNAL__V1__CANCEL_PREFILL_RESPONSE__INIT;
    td_rpc_reply_pb(call, &rp.base);
}

static inline void h_extend(void *ctx, td_rpc_call_t *call)
{
    (void)ctx;
    Tandem__Internal__V1__ExtendLandingResponse rp = TANDEM__INTERNAL__V1__EXTEND_LANDING_RESPONSE__INIT;
    td_rpc_reply_pb(call, &rp.base);
}

static inline void fake_start(fake_t *f, const char *id, const char *role, bool colocated, rt_table_t *t)
{
    snprintf(f->id, sizeof f->id, "%s", id);
    snprintf(f->role, sizeof f->role, "%s", role);
    f->colocated = colocated;
    pthread_mutex_init(&f->mu, NULL);
    cr_assert_eq(td_rpc_server_create("127.0.0.1:0", NULL, &f->srv), TD_OK);
    if (!strcmp(role, "decode")) {
        td_rpc_server_add(f->srv, "/tandem.internal.v1.Decode/Reserve", h_reserve, f);
        td_rpc_server_add(f->srv, "/tandem.internal.v1.Decode/Decode", h_decode, f);
        td_rpc_server_add(f->srv, "/tandem.internal.v1.Decode/Release", h_release, f);
        td_rpc_server_add(f->srv, "/tandem.internal.v1.Decode/Renew", h_renew, f);
    } else {
        td_rpc_server_add(f->srv, "/tandem.internal.v1.Prefill/Prefill", h_prefill, f);
        td_rpc_server_add(f->srv, "/tandem.internal.v1.Prefill/Cancel", h_cancel, f);
        td_rpc_server_add(f->srv, "/tandem.internal.v1.Prefill/Extend", h_extend, f);
    }
    cr_assert_eq(td_rpc_server_start(f->srv, &f->port), TD_OK);
    char addr[64], key[128];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", f->port);
    json_t *j = json_pack("{s:s, s:s, s:s, s:i, s:o, s:b}", "id", id, "role", role, "addr", addr, "pid", 1,
                          "contract", td_kv_layout_to_json(&expect), "colocated", colocated);
    char *v = json_dumps(j, JSON_COMPACT);
    snprintf(key, sizeof key, "/tandem/workers/%s/%s", role, id);
    rt_table_put(t, key, v);
    free(v);
    json_decref(j);
}

static inline void fake_stop(fake_t *f)
{
    td_rpc_server_stop(f->srv, 2);
    td_rpc_server_destroy(f->srv);
    pthread_mutex_destroy(&f->mu);
}

/* ---- a sink that keeps what the request sent */

typedef struct sink {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int32_t tokens[256];
    size_t n;
    bool ended;
    int code;
    char message[1024];
    td_pool_t *acks; /* rt_request_sent from another thread, as a transport's write completion */
} sink_t;

static inline void ack_task(void *arg)
{
    rt_request_t *q = arg;
    rt_request_sent(q, true);
}

static inline td_status_t s_emit(void *ctx, rt_request_t *q, const Tandem__V1__GenerateResponse *m)
{
    sink_t *s = ctx;
    pthread_mutex_lock(&s->mu);
    for (size_t i = 0; i < m->n_token_ids && s->n < 256; i++)
        s->tokens[s->n++] = m->token_ids[i];
    pthread_mutex_unlock(&s->mu);
    return td_pool_submit(s->acks, ack_task, q);
}

static inline void s_end(void *ctx, int code, const char *message, uint32_t retry_after_ms, const char *rejected)
{
    (void)retry_after_ms;
    (void)rejected;
    sink_t *s = ctx;
    pthread_mutex_lock(&s->mu);
    s->ended = true;
    s->code = code;
    snprintf(s->message, sizeof s->message, "%s", message);
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

__attribute__((unused)) static const rt_sink_t sink_ops = {.emit = s_emit, .end = s_end};

/* ---- the router's side */

typedef struct rig {
    rt_input_t input;
    rt_table_t table;
    td_pool_t *pool;
    rt_renewer_t *renewer;
    rt_stats_t *stats;
    rt_metrics_t metrics; /* no series: nothing observed */
    rt_requests_t *requests;
    sink_t sink;
} rig_t;

static inline void rig_up(rig_t *g, rt_keys_t *api_keys)
{
    td_log_set_level(TD_LOG_OFF);
    td_rpc_init();
    require_default_model();
    memset(g, 0, sizeof *g);
    cr_assert_eq(rt_input_open(DEFAULT_MODEL, NULL, &g->input), TD_OK);
    const eng_model_desc_t *md = &g->input.model->desc;
    expect = td_kv_layout_make(md->name, md->n_layers, md->n_kv_heads, md->head_dim, 16, TD_KV_F16);
    rt_table_init(&g->table, &expect, NULL);
    cr_assert_eq(td_pool_create("test-router", 8, 64, &g->pool), TD_OK);
    cr_assert_eq(rt_renewer_start(&g->table, &g->renewer), TD_OK);
    cr_assert_eq(rt_stats_create(&g->stats), TD_OK);
    rt_env_t env = {.input = &g->input, .table = &g->table, .place = &rt_placement_least_loaded, .pool = g->pool,
                    .renewer = g->renewer, .stats = g->stats, .metrics = &g->metrics, .max_streams = 16,
                    .default_max_tokens = 16, .api_keys = api_keys,
                    .chain_root = td_block_name_root(expect.model_id, "fp16", expect.block_tokens)};
    cr_assert_eq(rt_requests_create(&env, &g->requests), TD_OK);
    pthread_mutex_init(&g->sink.mu, NULL);
    pthread_cond_init(&g->sink.cv, NULL);
    cr_assert_eq(td_pool_create("test-acks", 2, 256, &g->sink.acks), TD_OK);
}

static inline void rig_down(rig_t *g)
{
    td_pool_destroy(g->pool);
    td_pool_destroy(g->sink.acks);
    rt_requests_destroy(g->requests);
    rt_renewer_stop(g->renewer);
    rt_stats_destroy(g->stats);
    rt_table_fini(&g->table);
    rt_input_close(&g->input);
    td_rpc_shutdown();
}

/* Runs one request for max_tokens tokens of "hello world" within timeout_s;
 * returns once it ended (the sink says how). cancel_after_s > 0: the client
 * goes away then. */
static inline void run(rig_t *g, uint32_t max_tokens, double timeout_s, double cancel_after_s)
{
    Tandem__V1__SamplingParams sp = TANDEM__V1__SAMPLING_PARAMS__INIT;
    sp.has_max_tokens = 1;
    sp.max_tokens = max_tokens;
    Tandem__V1__GenerateRequest rq = TANDEM__V1__GENERATE_REQUEST__INIT;
    rq.request_id = "t-1";
    rq.input_case = TANDEM__V1__GENERATE_REQUEST__INPUT_PROMPT;
    rq.prompt = "hello world, a prompt of a few tokens";
    rq.sampling = &sp;
    rq.has_return_token_ids = rq.return_token_ids = 1;
    uint8_t buf[512];
    size_t n = tandem__v1__generate_request__pack(&rq, buf);
    Tandem__V1__GenerateRequest *heap = tandem__v1__generate_request__unpack(NULL, n, buf);
    sink_t *s = &g->sink;
    s->n = 0;
    s->ended = false;
    rt_request_t *q = rt_request_create(g->requests, heap, timeout_s, &sink_ops, s);
    cr_assert(q);
    rt_request_start(q);
    double t0 = td_now_s();
    pthread_mutex_lock(&s->mu);
    bool cancelled = false;
    while (!s->ended) {
        if (cancel_after_s > 0 && !cancelled && td_now_s() - t0 >= cancel_after_s) {
            cancelled = true;
            pthread_mutex_unlock(&s->mu);
            rt_request_cancel(q);
            pthread_mutex_lock(&s->mu);
            continue;
        }
        struct timespec until = td_wall_deadline(0.01);
        pthread_cond_timedwait(&s->cv, &s->mu, &until);
    }
    pthread_mutex_unlock(&s->mu);
}

/* Waits (3 s at most) until d saw `releases` Release calls. */
static inline void wait_settled(fake_t *d, int releases)
{
    for (int i = 0; i < 300 && d->releases < releases; i++)
        td_sleep_s(0.01);
    cr_assert_eq(d->releases, releases, "%s: %d releases, not %d", d->id, d->releases, releases);
}

static inline rt_worker_t *worker(rt_table_t *t, const char *id)
{
    for (size_t i = 0; i < t->n; i++)
        if (!strcmp(t->w[i]->id, id))
            return t->w[i];
    return NULL;
}

#endif
