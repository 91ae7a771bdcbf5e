/* request.c — see request.h.
 *
 * A request goes through attempts: place a (prefill, decode) pair, reserve
 * landing blocks on the decode worker, have the prefill worker compute the
 * prompt and push its KV there, open the decode stream and relay it. A
 * worker that fails is skipped for a while and the request goes on
 * elsewhere: a failed prefill is redone, a decode stream that breaks is
 * resumed by re-prefilling the prompt plus the tokens already streamed —
 * within the request's deadline, after which it ends DEADLINE_EXCEEDED, never
 * a hang. In a cluster with no prefill worker the attempt is one Decode
 * stream to a colocated decode worker, which computes the prompt itself.
 * Every upstream call is made under the request's scope, so the deadline
 * bounds it and a cancel ends it, whatever transport the client came by.
 *
 * Threads: the steps (step, after_stream) run on the router's pool, one at a
 * time per request; the relay (on_upstream, rt_request_sent) runs on RPC
 * completion-queue threads, one callback at a time: each message read posts
 * one write to the sink, and each write done posts the next read. mu guards
 * only `cancelled`. */
#define _GNU_SOURCE
#include "router/keys.h"
#include "router/request.h"

#include <math.h>
#include <stddef.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/clock.h"
#include "common/kv_contract_pb.h"
#include "common/log.h"
#include "common/pb_arena.h"
#include "common/rpc.h"
#include "engine/sampler.h"
#include "engine/sampling_pb.h"
#include "tandem/internal/v1/worker.pb-c.h"

struct rt_request {
    router_t *r;
    rt_sink_t sink;
    void *sink_ctx;
    td_rpc_scope_t *scope; /* the deadline and cancel of every upstream call */
    Tandem__V1__GenerateRequest *rq;
    int32_t *tokens; /* prompt, then the tokens streamed so far */
    size_t n_prompt, n_tokens, cap_tokens;
    td_block_name_t *chain; /* the names of tokens' full blocks (placement prices them) */
    size_t cap_chain;
    rt_prediction_t pred, first_pred; /* the attempt's placement's prediction; the first attempt's */
    uint32_t retry_after_ms;          /* an early rejection's hint */
    const char *rejected;             /* rejected early: the SLO it was for ("ttft", "tpot") */
    uint32_t max_tokens, cached, store_cached;
    double t0, deadline, t_first, t_last, overhead, cpu; /* cpu: overhead in thread CPU time */
    double t_queued, handoff; /* when the next step was queued; the time steps waited for a pool thread */
    char prefill_id[96], decode_id[96];
    uint64_t text_sent; /* bytes of text relayed to the client, all attempts */
    int internal_errors; /* attempts a worker ended with INTERNAL */
    bool validated, sent_any;
    bool answered;         /* the sink has its end already (the rest is clean-up) */
    uint64_t landing_lease_until; /* unix ms: the first lease of the attempt's landing (then the renewer's) */
    const rt_key_t *key;   /* the caller's API key (NULL: keys are off) */
    uint32_t key_charged;  /* tokens charged to it at admission, settled at the end */
    /* the attempt under way */
    rt_worker_t *p, *d;
    char did[96];
    double t_attempt, prefill_ms; /* when it began; its prefill call */
    td_rpc_stream_t *st;
    bool finished;    /* the message with the finish reason was relayed */
    bool sink_failed; /* the client could not be written to */
    _Alignas(16) uint8_t pb_mem[8192]; /* each DecodeResponse unpacks here: no allocation per token */
    td_pb_arena_t arena;
    pthread_mutex_t mu;
    bool cancelled;
    rt_request_t *next_free; /* in the router's free list (router.h) */
};

static double cpu_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (double)t.tv_sec + t.tv_nsec * 1e-9;
}

static double left(const rt_request_t *q) { return q->deadline - td_now_s(); }


static bool cancelled(rt_request_t *q)
{
    pthread_mutex_lock(&q->mu);
    bool c = q->cancelled;
    pthread_mutex_unlock(&q->mu);
    return c;
}

static bool fatal_code(int code)
{
    return code == TD_RPC_INVALID_ARGUMENT || code == TD_RPC_CANCELLED || code == TD_RPC_DEADLINE_EXCEEDED;
}

/* The client's answer: the sink's last call (once). */
static void answer_v(rt_request_t *q, int code, const char *fmt, va_list ap)
{
    if (q->answered)
        return;
    char msg[1024] = "";
    if (fmt)
        vsnprintf(msg, sizeof msg, fmt, ap);
    q->answered = true;
    rt_metrics_request_end(&q->r->metrics, code);
    q->sink.end(q->sink_ctx, code, msg, q->retry_after_ms, q->rejected);
}

/* The answer now, the clean-up after (releasing what the request held may
 * wait on a worker; the client's deadline does not). */
static void answer(rt_request_t *q, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void answer(rt_request_t *q, int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    answer_v(q, code, fmt, ap);
    va_end(ap);
}

/* The end: the answer (unless given already), then the request is freed. */
static void finish(rt_request_t *q, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void finish(rt_request_t *q, int code, const char *fmt, ...)
{
    router_t *r = q->r;
    if (q->key_charged || q->key)
        rt_keys_settle(r->api_keys, q->key, q->key_charged, (uint32_t)q->n_tokens);
    if (q->validated)
        rt_count(r, true, q->overhead, q->cpu, q->handoff);
    else
        rt_count(r, false, -1, -1, -1);
    va_list ap;
    va_start(ap, fmt);
    answer_v(q, code, fmt, ap);
    va_end(ap);
    tandem__v1__generate_request__free_unpacked(q->rq, NULL);
    td_rpc_scope_destroy(q->scope);
    pthread_mutex_destroy(&q->mu);
    pthread_mutex_lock(&r->mu);
    r->n_active--;
    q->next_free = r->free_reqs; /* kept, with its token buffer, for the next request */
    r->free_reqs = q;
    pthread_mutex_unlock(&r->mu);
}

/* ---------------------------------------------------------------- validation */

/* Checks the request and tokenizes it; false when it ended (the error sent). */
static bool validate(rt_request_t *q)
{
    router_t *r = q->r;
    Tandem__V1__GenerateRequest *rq = q->rq;
    char err[600] = "";
    int code = TD_RPC_INVALID_ARGUMENT;
    int32_t *ids = NULL;
    size_t n_ids = 0;
    if (rq->model && rq->model[0] && strcmp(rq->model, r->model->desc.name)) {
        snprintf(err, sizeof err, "model: '%s' is not served here (this router serves '%s')", rq->model,
                 r->model->desc.name);
        code = TD_RPC_NOT_FOUND;
        goto fail;
    }
    if (rq->request_id && strlen(rq->request_id) > RT_MAX_REQUEST_ID) {
        snprintf(err, sizeof err, "request_id: %zu bytes, at most %d", strlen(rq->request_id), RT_MAX_REQUEST_ID);
        goto fail;
    }
    if (rq->input_case == TANDEM__V1__GENERATE_REQUEST__INPUT__NOT_SET) {
        snprintf(err, sizeof err, "input: set prompt or chat");
        goto fail;
    }
    td_status_t rc = rt_tokenize_input(r, rq->input_case == TANDEM__V1__GENERATE_REQUEST__INPUT_PROMPT ? rq->prompt : NULL,
                                       rq->input_case == TANDEM__V1__GENERATE_REQUEST__INPUT_CHAT ? rq->chat : NULL,
                                       false, true, &ids, &n_ids, err, sizeof err);
    if (rc) {
        code = td_rpc_code_of(rc);
        goto fail;
    }
    const Tandem__V1__SamplingParams *sp = rq->sampling;
    if (sp && sp->n_stop > RT_MAX_STOP) {
        snprintf(err, sizeof err, "sampling.stop: %zu strings, at most %d", sp->n_stop, RT_MAX_STOP);
        goto fail;
    }
    for (size_t i = 0; sp && i < sp->n_stop; i++)
        if (strlen(sp->stop[i]) > RT_MAX_STOP_BYTES) {
            snprintf(err, sizeof err, "sampling.stop[%zu]: %zu bytes, at most %d", i, strlen(sp->stop[i]),
                     RT_MAX_STOP_BYTES);
            goto fail;
        }
    if (sp && sp->n_logit_bias > RT_MAX_LOGIT_BIAS) {
        snprintf(err, sizeof err, "sampling.logit_bias: %zu entries, at most %d", sp->n_logit_bias,
                 RT_MAX_LOGIT_BIAS);
        goto fail;
    }
    q->max_tokens = sp && sp->max_tokens ? sp->max_tokens : r->default_max_tokens;
    uint32_t ctxlen = r->model->desc.context ? r->model->desc.context : 4096;
    if (n_ids + q->max_tokens > ctxlen) {
        snprintf(err, sizeof err, "%s: %zu prompt tokens + max_tokens %u exceed the context of %u tokens",
                 n_ids >= ctxlen ? "prompt" : "sampling.max_tokens", n_ids, q->max_tokens, ctxlen);
        goto fail;
    }
    if (q->key) { /* the most it may use, charged now; what it used is settled at the end */
        double retry_s;
        uint64_t most = (uint64_t)n_ids + q->max_tokens;
        code = rt_keys_charge(r->api_keys, q->key, most > UINT32_MAX ? UINT32_MAX : (uint32_t)most, &q->key_charged,
                              err, sizeof err, &retry_s);
        if (code) {
            q->retry_after_ms = (uint32_t)(retry_s * 1e3 + 0.5);
            goto fail;
        }
        code = TD_RPC_INVALID_ARGUMENT;
    }
    eng_sampling_t es;
    eng_logit_bias_t *bias = calloc(sp && sp->n_logit_bias ? sp->n_logit_bias : 1, sizeof *bias);
    if (!bias) {
        code = TD_RPC_RESOURCE_EXHAUSTED;
        snprintf(err, sizeof err, "no memory");
        goto fail;
    }
    eng_sampling_from_pb(sp, &es, bias);
    rc = eng_sampling_validate(&es, (int32_t)r->model->desc.vocab);
    free(bias);
    if (rc) {
        snprintf(err, sizeof err, "sampling: %s", td_last_error());
        goto fail;
    }
    for (size_t i = 0; sp && i < sp->n_stop; i++)
        if (!sp->stop[i][0]) {
            snprintf(err, sizeof err, "sampling.stop[%zu]: empty", i);
            goto fail;
        }
    size_t need = n_ids + q->max_tokens + 1;
    if (need > q->cap_tokens) { /* a pooled request keeps its buffer: most requests allocate nothing here */
        int32_t *t = realloc(q->tokens, need * sizeof *t);
        if (t) {
            q->tokens = t;
            q->cap_tokens = need;
        }
    }
    if (need > q->cap_tokens) {
        code = TD_RPC_RESOURCE_EXHAUSTED;
        snprintf(err, sizeof err, "no memory");
        goto fail;
    }
    memcpy(q->tokens, ids, n_ids * sizeof *ids);
    free(ids);
    q->n_prompt = q->n_tokens = n_ids;
    q->validated = true;
    return true;
fail:
    free(ids);
    finish(q, code, "%s", err);
    return false;
}

/* ---------------------------------------------------------------- upstream calls */

/* Reserve on D; 1 done, 0 try again, -1 give up (res says why). */
static int reserve(rt_request_t *q, rt_worker_t *d, Tandem__Internal__V1__LandingDescriptor **land,
                   td_rpc_result_t *res)
{
    Tandem__Internal__V1__ReserveRequest rq = TANDEM__INTERNAL__V1__RESERVE_REQUEST__INIT;
    Tandem__Internal__V1__KvContract c;
    td_kv_layout_to_pb(&q->r->table.expect, &c);
    rq.contract = &c;
    rq.has_n_tokens = rq.has_max_tokens = rq.has_lease_ms = 1;
    rq.n_tokens = (uint32_t)q->n_tokens;
    rq.max_tokens = q->max_tokens;
    rq.lease_ms = RT_RES_LEASE_MS; /* renewed while held (the router's renewer) */
    /* the prefill may put until its call's deadline (the decode side caps it); a landing's blocks are fenced
     * only while the router renews the reservation (its lease), which the prefill worker's puts also stop at:
     * the router forwards each renewal to it (rt_held: the landing lease) */
    double ms = ceil(left(q) * 1e3);
    rq.has_landing_ms = 1;
    rq.landing_ms = ms < 1 ? 1 : ms > UINT32_MAX ? UINT32_MAX : (uint32_t)ms;
    uint8_t buf[512];
    size_t n = tandem__internal__v1__reserve_request__pack(&rq, buf);
    uint8_t *out;
    size_t on;
    /* the landing's first lease: counted from before the decode worker starts its own */
    q->landing_lease_until = td_unix_ms() + RT_RES_LEASE_MS;
    td_status_t rc = td_rpc_unary(d->ch, "/tandem.internal.v1.Decode/Reserve", buf, n, fmin(left(q), 5.0), q->scope,
                                  &out, &on, res);
    if (rc)
        return fatal_code(res->code) && res->code != TD_RPC_DEADLINE_EXCEEDED ? -1 : 0;
    Tandem__Internal__V1__ReserveResponse *rp = tandem__internal__v1__reserve_response__unpack(NULL, on, out);
    free(out);
    if (!rp || !rp->landing) {
        if (rp)
            tandem__internal__v1__reserve_response__free_unpacked(rp, NULL);
        snprintf(res->message, sizeof res->message, "decode worker %s: bad ReserveResponse", d->id);
        res->code = TD_RPC_INTERNAL;
        return 0;
    }
    *land = rp->landing;
    rp->landing = NULL;
    tandem__internal__v1__reserve_response__free_unpacked(rp, NULL);
    return 1;
}

/* A small unary call whose answer carries nothing the caller reads (wait_s
 * at most, outside any request's scope): true when it succeeded. */
static bool tell(td_rpc_channel_t *ch, const char *method, const uint8_t *msg, size_t n, double wait_s)
{
    uint8_t *out = NULL;
    size_t on;
    td_rpc_result_t res;
    if (td_rpc_unary(ch, method, msg, n, wait_s, NULL, &out, &on, &res) != TD_OK)
        return false;
    free(out);
    return true;
}

/* Gives reservation id back to D. landing_closed: no prefill worker can put
 * into its blocks any more (none was asked, or the one asked answered), so
 * they are free at once; else D fences them until the landing's land-by. */
static void release(rt_worker_t *d, uint64_t id, bool landing_closed)
{
    Tandem__Internal__V1__ReleaseRequest rq = TANDEM__INTERNAL__V1__RELEASE_REQUEST__INIT;
    rq.has_reservation_id = rq.has_landing_closed = 1;
    rq.reservation_id = id;
    rq.landing_closed = landing_closed;
    uint8_t buf[32];
    tell(d->ch, "/tandem.internal.v1.Decode/Release", buf, tandem__internal__v1__release_request__pack(&rq, buf), 2.0);
}

/* Asks prefill worker P to stop the prefill landing in reservation id and
 * waits for its answer: true once P said nothing more will be put there. P
 * answers between two engine steps, at most 15 s away (prefill.c); past
 * 16 s the blocks stay fenced instead. Only abnormal ends come here. */
static bool cancel_prefill(rt_worker_t *p, uint64_t id, uint64_t land_by)
{
    Tandem__Internal__V1__CancelPrefillRequest rq = TANDEM__INTERNAL__V1__CANCEL_PREFILL_REQUEST__INIT;
    rq.has_reservation_id = rq.has_land_by_unix_ms = 1;
    rq.reservation_id = id;
    rq.land_by_unix_ms = land_by;
    uint8_t buf[32];
    return tell(p->ch, "/tandem.internal.v1.Prefill/Cancel", buf,
                tandem__internal__v1__cancel_prefill_request__pack(&rq, buf), 16.0);
}

static Tandem__V1__SamplingParams *sampling_for(rt_request_t *q, Tandem__V1__SamplingParams *copy)
{
    static const Tandem__V1__SamplingParams none = TANDEM__V1__SAMPLING_PARAMS__INIT;
    *copy = q->rq->sampling ? *q->rq->sampling : none;
    copy->has_max_tokens = 1;
    copy->max_tokens = q->max_tokens - (uint32_t)(q->n_tokens - q->n_prompt);
    return copy;
}

/* ---------------------------------------------------------------- the relay */

static void on_upstream(void *ctx, td_status_t rc, const uint8_t *m, size_t ml);
static void after_stream_task(void *arg);

/* From a relay callback: the stream is over (or must be), the rest waits. */
static void relay_over(rt_request_t *q)
{
    q->t_queued = td_now_s();
    if (td_pool_submit(q->r->pool, after_stream_task, q) != TD_OK) /* sized for every request: cannot be full */
        TD_WARN("router: request %s cannot be queued to end; it waits for its deadline", q->rq->request_id);
}

static void read_next(rt_request_t *q)
{
    if (td_rpc_stream_read_async(q->st, on_upstream, q) != TD_OK)
        relay_over(q);
}

/* A decode worker's message: relayed to the sink as a GenerateResponse. */
static void on_upstream(void *ctx, td_status_t rc, const uint8_t *m, size_t ml)
{
    rt_request_t *q = ctx;
    if (rc) {
        relay_over(q);
        return;
    }
    double t_m = td_now_s(), c_m = cpu_s();
    td_pb_arena_reset(&q->arena);
    Tandem__Internal__V1__DecodeResponse *dr = tandem__internal__v1__decode_response__unpack(&q->arena.a, ml, m);
    if (!dr) {
        td_rpc_stream_cancel(q->st);
        read_next(q); /* to its end */
        return;
    }
    for (size_t i = 0; i < dr->n_token_ids && q->n_tokens < q->cap_tokens; i++)
        q->tokens[q->n_tokens++] = dr->token_ids[i];
    Tandem__V1__GenerateResponse gr = TANDEM__V1__GENERATE_RESPONSE__INIT;
    gr.request_id = q->rq->request_id;
    gr.text = dr->text;
    if (q->rq->return_token_ids) {
        gr.n_token_ids = dr->n_token_ids;
        gr.token_ids = dr->token_ids;
    }
    Tandem__V1__Usage usage = TANDEM__V1__USAGE__INIT;
    Tandem__V1__Timing timing = TANDEM__V1__TIMING__INIT;
    double t = td_now_s();
    if (dr->n_token_ids) {
        if (!q->t_first) {
            q->t_first = t;
            td_metric_observe(q->r->metrics.ttft, t - q->t0);
        } else {
            for (size_t i = 0; i < dr->n_token_ids; i++) /* a chunk's tokens share its gap */
                td_metric_observe(q->r->metrics.itl, (t - q->t_last) / (double)dr->n_token_ids);
        }
        q->t_last = t;
        td_metric_add(q->r->metrics.generation_tokens, (double)dr->n_token_ids);
    }
    bool fin = dr->has_finish_reason;
    if (fin && dr->has_cached_tokens) /* a colocated worker's prefix cache (a resume's prompt counts the answer) */
        q->cached = dr->cached_tokens < q->n_prompt ? dr->cached_tokens : (uint32_t)q->n_prompt;
    if (fin) {
        gr.has_finish_reason = 1;
        gr.finish_reason = dr->finish_reason;
        gr.error = dr->error;
        usage.has_prompt_tokens = usage.has_completion_tokens = usage.has_cached_prompt_tokens = 1;
        usage.prompt_tokens = (uint32_t)q->n_prompt;
        usage.completion_tokens = (uint32_t)(q->n_tokens - q->n_prompt);
        usage.cached_prompt_tokens = q->cached;
        usage.has_store_cached_tokens = 1;
        usage.store_cached_tokens = q->store_cached;
        gr.usage = &usage;
        uint32_t gen = usage.completion_tokens;
        timing.has_ttft_ms = timing.has_tpot_ms = timing.has_e2e_ms = timing.has_queue_ms = 1;
        timing.ttft_ms = ((q->t_first ? q->t_first : t) - q->t0) * 1e3;
        timing.tpot_ms = gen > 1 ? (q->t_last - q->t_first) * 1e3 / (gen - 1) : 0;
        timing.e2e_ms = (t - q->t0) * 1e3;
        timing.queue_ms = 0;
        timing.prefill_worker = q->prefill_id;
        if (q->first_pred.valid) {
            timing.has_predicted_ttft_ms = 1;
            timing.predicted_ttft_ms = q->first_pred.ttft_ms;
        }
        timing.decode_worker = q->decode_id;
        gr.timing = &timing;
    }
    bool emit = gr.text[0] || gr.n_token_ids || fin;
    size_t text_len = strlen(gr.text);
    if (emit) { /* before the write: its completion may run on another thread at once */
        q->sent_any = true;
        q->text_sent += text_len;
        q->finished = fin;
    }
    q->overhead += td_now_s() - t_m;
    q->cpu += cpu_s() - c_m;
    if (!emit) {
        read_next(q);
        return;
    }
    if (q->sink.emit(q->sink_ctx, q, &gr) != TD_OK) { /* the client is gone: end the upstream stream too */
        q->text_sent -= text_len;
        q->finished = false;
        q->sink_failed = true;
        td_rpc_stream_cancel(q->st);
        read_next(q);
    } /* else rt_request_sent goes on */
}

void rt_request_sent(rt_request_t *q, bool ok)
{
    if (!ok) {
        q->sink_failed = true;
        q->finished = false;
        td_rpc_stream_cancel(q->st);
    }
    if (q->finished)
        relay_over(q);
    else
        read_next(q);
}

/* ---------------------------------------------------------------- attempts */

/* After the relay: how the stream ended decides. 1: the request ended, 0:
 * try again. */
static int after_stream(rt_request_t *q)
{
    router_t *r = q->r;
    rt_worker_t *p = q->p, *d = q->d;
    td_rpc_result_t sres = {0};
    if (!q->finished)
        td_rpc_stream_cancel(q->st);
    td_rpc_stream_result(q->st, 2.0, &sres);
    td_rpc_stream_destroy(q->st);
    q->st = NULL;
    bool gone = cancelled(q) || q->sink_failed;
    double now = td_now_s();
    rt_timings_t tm = {.prefill_ms = q->prefill_ms, .ttft_ms = ((q->t_first ? q->t_first : now) - q->t0) * 1e3,
                       .e2e_ms = (now - q->t0) * 1e3, .prompt_tokens = (uint32_t)q->n_prompt,
                       .cached_tokens = q->cached, .output_tokens = (uint32_t)(q->n_tokens - q->n_prompt),
                       .ok = q->finished, .pred = q->pred,
                       .attempt_ttft_ms = q->t_first >= q->t_attempt ? (q->t_first - q->t_attempt) * 1e3 : 0};
    tm.tpot_ms = tm.output_tokens > 1 ? (q->t_last - q->t_first) * 1e3 / (tm.output_tokens - 1) : 0;
    if (tm.ok && q->pred.valid)
        TD_DEBUG("router: %s on %s: predicted TTFT %.1f ms (queue %.1f, fetch %.1f, prefill %.1f, overhead %.1f; "
                 "%u new, %u pool, %u store tokens%s); measured %.1f ms (prefill call %.1f ms, %u cached)",
                 q->rq->request_id ? q->rq->request_id : "-", q->prefill_id, q->pred.ttft_ms, q->pred.queue_ms,
                 q->pred.fetch_ms, q->pred.prefill_ms, q->pred.overhead_ms, q->pred.new_tokens, q->pred.pool_tokens,
                 q->pred.store_tokens, q->pred.alone ? ", alone" : "",
                 tm.ttft_ms, tm.prefill_ms, tm.cached_tokens);
    rt_table_observe(&r->table, r->place, p, d, &tm);
    if (!gone)
        rt_record_done(r, tm.ttft_ms, tm.tpot_ms, tm.ok);
    if (tm.ok) {
        td_metric_observe(r->metrics.e2e, tm.e2e_ms * 1e-3);
        td_metric_add(r->metrics.prompt_tokens, tm.prompt_tokens);
        td_metric_add(r->metrics.prefix_queries, tm.prompt_tokens);
        td_metric_add(r->metrics.prefix_hits, q->cached);
        td_metric_add(r->metrics.store_hits, q->store_cached);
        if (q->pred.valid && tm.ttft_ms > 0)
            td_metric_observe(r->metrics.pred_err, fabs(q->pred.ttft_ms - tm.ttft_ms) / tm.ttft_ms);
    }
    if (p)
        rt_table_unhold(&r->table, p);
    rt_table_done(&r->table, d, !q->finished && !gone && left(q) > 0.001 ? &sres : NULL, rt_suspect_for(sres.code));
    q->p = q->d = NULL;
    if (q->finished) {
        finish(q, TD_RPC_OK, NULL);
        return 1;
    }
    if (gone) {
        finish(q, TD_RPC_CANCELLED, "the client cancelled");
        return 1;
    }
    if (left(q) <= 0 || sres.code == TD_RPC_DEADLINE_EXCEEDED) {
        finish(q, TD_RPC_DEADLINE_EXCEEDED, "the deadline passed after %zu tokens", q->n_tokens - q->n_prompt);
        return 1;
    }
    if (fatal_code(sres.code)) {
        finish(q, sres.code, "decode worker %s: %s", q->did, sres.message);
        return 1;
    }
    /* a worker's own error (a landing refused by its check) is tried again
     * on a fresh prefill, but not forever */
    if (sres.code == TD_RPC_INTERNAL && ++q->internal_errors >= 3) {
        finish(q, sres.code, "decode worker %s, 3 attempts: %s", q->did, sres.message);
        return 1;
    }
    TD_WARN("router: the decode stream on %s broke after %zu tokens (%s: %s); resuming elsewhere", q->did,
            q->n_tokens - q->n_prompt, td_rpc_code_name(sres.code), sres.message);
    return 0;
}

/* What placement is asked: the tokens (a resume's too) and their chain of
 * block names, the request's SLOs (the router's, tightened by the request's). */
static void place_req(rt_request_t *q, rt_place_req_t *pr)
{
    router_t *r = q->r;
    uint32_t bt = r->table.expect.block_tokens;
    size_t nb = q->n_tokens / bt;
    if (nb > q->cap_chain) {
        td_block_name_t *c = realloc(q->chain, nb * sizeof *c);
        if (c) {
            q->chain = c;
            q->cap_chain = nb;
        }
    }
    if (nb > q->cap_chain) /* no memory: priced as if nothing were cached */
        nb = 0;
    td_block_name_chain(r->chain_root, q->tokens, nb * bt, bt, q->chain, nb);
    uint32_t ttft = r->cfg.router.ttft_slo_ms, tpot = r->cfg.router.tpot_slo_ms;
    if (q->rq->ttft_slo_ms && (!ttft || q->rq->ttft_slo_ms < ttft))
        ttft = q->rq->ttft_slo_ms;
    if (q->rq->tpot_slo_ms && (!tpot || q->rq->tpot_slo_ms < tpot))
        tpot = q->rq->tpot_slo_ms;
    *pr = (rt_place_req_t){.tokens = q->tokens, .n_tokens = q->n_tokens, .chain = q->chain, .n_blocks = nb,
                           .max_tokens = q->max_tokens, .ttft_slo_ms = ttft, .tpot_slo_ms = tpot,
                           /* a stream under way is finished, not judged again: its resume re-prefills
                            * what was streamed, which the TTFT SLO never covered */
                           .early_reject = r->cfg.router.early_reject && !q->sent_any,
                           .priority = q->rq->has_priority ? q->rq->priority : 0};
}

/* The whole request on colocated decode worker d (a cluster with no prefill
 * worker): one Decode stream, the prompt (and on a resume the tokens
 * streamed before) computed there. 2 the relay runs, 1 the request ended. */
static int attempt_whole(rt_request_t *q, rt_worker_t *d)
{
    router_t *r = q->r;
    double t_c = td_now_s(), c_c = cpu_s();
    memcpy(q->did, d->id, sizeof q->did);
    snprintf(q->prefill_id, sizeof q->prefill_id, "%s", d->id);
    snprintf(q->decode_id, sizeof q->decode_id, "%s", d->id);
    Tandem__V1__SamplingParams sp;
    Tandem__Internal__V1__DecodeRequest drq = TANDEM__INTERNAL__V1__DECODE_REQUEST__INIT;
    drq.request_id = q->rq->request_id;
    drq.n_tokens = q->n_tokens;
    drq.tokens = q->tokens;
    drq.has_sampled_before = drq.has_resume_generated = drq.has_resume_text_sent = 1;
    drq.sampled_before = drq.resume_generated = (uint32_t)(q->n_tokens - q->n_prompt);
    drq.resume_text_sent = q->text_sent;
    drq.sampling = sampling_for(q, &sp);
    drq.has_priority = q->rq->has_priority;
    drq.priority = q->rq->priority;
    size_t pn = tandem__internal__v1__decode_request__get_packed_size(&drq);
    uint8_t *pbuf = malloc(pn);
    if (pbuf)
        tandem__internal__v1__decode_request__pack(&drq, pbuf);
    q->st = NULL;
    td_status_t rc = pbuf ? td_rpc_stream_open(d->ch, "/tandem.internal.v1.Decode/Decode", pbuf, pn, left(q), q->scope,
                                               &q->st)
                          : TD_ERR_NO_MEMORY;
    free(pbuf);
    q->p = NULL;
    q->d = d;
    q->prefill_ms = 0;
    q->finished = q->sink_failed = false;
    q->overhead += td_now_s() - t_c;
    q->cpu += cpu_s() - c_c;
    if (rc) {
        q->st = NULL;
        rt_table_done(&r->table, d, NULL, 0);
        q->d = NULL;
        finish(q, TD_RPC_RESOURCE_EXHAUSTED, "no memory for the decode request");
        return 1;
    }
    if (td_rpc_stream_read_async(q->st, on_upstream, q) != TD_OK)
        return after_stream(q);
    return 2;
}

/* One attempt up to the decode stream: 2 the relay runs (this thread is
 * free), 1 the request ended, 0 try again. */
static int attempt(rt_request_t *q)
{
    router_t *r = q->r;
    double t_a = td_now_s(), c_a = cpu_s();
    q->t_attempt = t_a;
    rt_placement_t pl;
    rt_place_req_t prq_place;
    place_req(q, &prq_place);
    rt_table_place(&r->table, r->place, &prq_place, &pl);
    if (pl.rejected) {
        q->retry_after_ms = pl.retry_after_ms; /* rejected early: at once, never queued */
        q->rejected = pl.rejected;
        finish(q, pl.code, "%s", pl.why);
        return 1;
    }
    if (pl.code) {
        /* nothing can serve it: say why now, unless a worker becomes usable before the deadline (its
         * suspect time ends) or, for a stream already under way, a worker may still join to resume it */
        double until = pl.retry_at ? pl.retry_at : q->sent_any ? q->deadline : 0;
        if (until <= td_now_s() && !pl.retry_at) {
            finish(q, pl.code, "%s", pl.why);
            return 1;
        }
        if (until >= q->deadline && !q->sent_any) {
            finish(q, pl.code, "%s (the deadline comes first)", pl.why);
            return 1;
        }
        /* woken by the table (a worker joined, left or failed), capped at 1 s to see a cancel */
        rt_table_wait(&r->table, fmin(fmin(until, q->deadline), td_now_s() + 1.0));
        return 0;
    }
    rt_worker_t *d = pl.decode, *p = pl.prefill;
    /* the deadline judged by the same prediction as early rejection: a first token predicted past it is
     * answered now, not computed (a stream under way is finished however late, as early rejection does) */
    double left_ms = left(q) * 1e3;
    if (!q->sent_any && pl.pred.valid && pl.pred.ttft_ms > left_ms) {
        rt_table_done(&r->table, d, NULL, 0);
        if (p) {
            rt_table_prefill_done(&r->table, p, &pl.pred);
            rt_table_done(&r->table, p, NULL, 0);
        }
        finish(q, TD_RPC_DEADLINE_EXCEEDED, "deadline: the first token is predicted in %.0f ms (queue %.0f, "
               "prefill %.0f, for %u new tokens), past the %.0f ms the deadline leaves; not started",
               pl.pred.ttft_ms, pl.pred.queue_ms, pl.pred.prefill_ms, pl.pred.new_tokens, left_ms);
        return 1;
    }
    q->pred = pl.pred;
    if (!q->first_pred.valid)
        q->first_pred = pl.pred;
    q->overhead += td_now_s() - t_a;
    q->cpu += cpu_s() - c_a;
    if (!p)
        return attempt_whole(q, d);
    /* the records may be freed once released (rt_table_done): messages use copies */
    char pid[sizeof p->id];
    memcpy(pid, p->id, sizeof pid);
    memcpy(q->did, d->id, sizeof q->did);
    Tandem__Internal__V1__LandingDescriptor *land = NULL;
    td_rpc_result_t res = {0};
    int rv = reserve(q, d, &land, &res);
    if (rv <= 0) {
        /* the client's own deadline or cancel says nothing about the worker's health; a full pool
         * is load, not a fault: the worker is skipped only briefly */
        bool own = left(q) <= 0.001 || cancelled(q);
        rt_table_done(&r->table, d, !own ? &res : NULL, rt_suspect_for(res.code));
        rt_table_prefill_done(&r->table, p, &q->pred);
        rt_table_done(&r->table, p, NULL, 0);
        if (rv < 0) {
            finish(q, res.code, "decode worker %s: %s", q->did, res.message);
            return 1;
        }
        if (!own)
            TD_WARN("router: reserve on %s failed (%s: %s); trying elsewhere", q->did, td_rpc_code_name(res.code),
                    res.message);
        return 0;
    }
    uint64_t res_id = land->reservation_id;
    if (!rt_held_add(r, d, res_id, p)) {
        release(d, res_id, true);
        tandem__internal__v1__landing_descriptor__free_unpacked(land, NULL);
        rt_table_done(&r->table, d, NULL, 0);
        rt_table_prefill_done(&r->table, p, &q->pred);
        rt_table_done(&r->table, p, NULL, 0);
        finish(q, TD_RPC_RESOURCE_EXHAUSTED, "the router holds %d reservations, its most; try again later",
               RT_MAX_HELD);
        return 1;
    }
    /* prefill the prompt (plus what was streamed already, on a resume) */
    double t_b = td_now_s(), c_b = cpu_s();
    Tandem__V1__SamplingParams sp;
    Tandem__Internal__V1__PrefillRequest prq = TANDEM__INTERNAL__V1__PREFILL_REQUEST__INIT;
    prq.request_id = q->rq->request_id;
    prq.n_tokens = q->n_tokens;
    prq.tokens = q->tokens;
    prq.sampling = sampling_for(q, &sp);
    prq.landing = land;
    prq.has_priority = q->rq->has_priority;
    prq.priority = q->rq->priority;
    prq.has_sampled_before = 1;
    prq.sampled_before = (uint32_t)(q->n_tokens - q->n_prompt); /* streamed before a resume */
    prq.has_landing_lease_until_unix_ms = 1;
    prq.landing_lease_until_unix_ms = q->landing_lease_until;
    size_t pn = tandem__internal__v1__prefill_request__get_packed_size(&prq);
    uint8_t *pbuf = malloc(pn);
    if (pbuf)
        tandem__internal__v1__prefill_request__pack(&prq, pbuf);
    q->overhead += td_now_s() - t_b;
    q->cpu += cpu_s() - c_b;
    uint8_t *out = NULL;
    size_t on = 0;
    td_status_t rc = pbuf ? td_rpc_unary(p->ch, "/tandem.internal.v1.Prefill/Prefill", pbuf, pn, left(q), q->scope,
                                         &out, &on, &res)
                          : TD_ERR_NO_MEMORY;
    bool sent = pbuf != NULL;
    free(pbuf);
    Tandem__Internal__V1__PrefillResponse *prp = rc ? NULL : tandem__internal__v1__prefill_response__unpack(NULL, on, out);
    free(out);
    uint64_t land_by = land->land_by_unix_ms;
    tandem__internal__v1__landing_descriptor__free_unpacked(land, NULL);
    rt_table_prefill_done(&r->table, p, &q->pred);
    if (!prp) {
        /* an answer the prefill worker gave (not a local cancel, deadline or lost connection) means it
         * stopped putting; so does a call never sent; else it is asked to stop, and says when it has */
        bool answered = !sent || res.code == TD_RPC_INVALID_ARGUMENT || res.code == TD_RPC_FAILED_PRECONDITION ||
                        res.code == TD_RPC_NOT_FOUND || res.code == TD_RPC_PERMISSION_DENIED;
        /* the client gone or its deadline passed: it hears so now, not after the worker's next chunk */
        if (cancelled(q))
            answer(q, TD_RPC_CANCELLED, "the client cancelled");
        else if (left(q) <= 0)
            answer(q, TD_RPC_DEADLINE_EXCEEDED, "prefill worker %s: %s", pid, res.message);
        if (!answered)
            answered = cancel_prefill(p, res_id, land_by);
        rt_held_remove(r, d, res_id);
        release(d, res_id, answered);
        rt_table_done(&r->table, d, NULL, 0);
        bool gone = cancelled(q);
        /* DEADLINE_EXCEEDED with time left is the landing's lease (the call's deadline is the client's) */
        rt_table_done(&r->table, p, !gone && left(q) > 0.001 && res.code != TD_RPC_DEADLINE_EXCEEDED ? &res : NULL,
                      rt_suspect_for(res.code));
        if (gone) {
            finish(q, TD_RPC_CANCELLED, "the client cancelled");
            return 1;
        }
        if (left(q) <= 0 || (fatal_code(res.code) && res.code != TD_RPC_DEADLINE_EXCEEDED)) {
            finish(q, res.code ? res.code : TD_RPC_DEADLINE_EXCEEDED, "prefill worker %s: %s", pid, res.message);
            return 1;
        }
        if (res.code == TD_RPC_DEADLINE_EXCEEDED) /* the landing's lease ran out, not the client's deadline */
            TD_WARN("router: the landing lease of reservation %llu on %s ran out before its KV was put",
                    (unsigned long long)res_id, q->did);
        TD_WARN("router: prefill on %s failed (%s: %s); trying again", pid, td_rpc_code_name(res.code), res.message);
        return 0;
    }
    snprintf(q->prefill_id, sizeof q->prefill_id, "%s", pid);
    snprintf(q->decode_id, sizeof q->decode_id, "%s", q->did);
    if (q->n_tokens == q->n_prompt) {
        q->cached = prp->cached_tokens;
        q->store_cached = prp->store_tokens;
    }
    int32_t first = prp->first_token;
    q->prefill_ms = (td_now_s() - t_b) * 1e3;
    rt_table_hold(&r->table, p); /* for rt_table_observe once the stream is done */
    rt_table_done(&r->table, p, NULL, 0);

    /* the completion notice: decode joins its batch and streams */
    double t_c = td_now_s(), c_c = cpu_s();
    Tandem__Internal__V1__DecodeRequest drq = TANDEM__INTERNAL__V1__DECODE_REQUEST__INIT;
    drq.request_id = q->rq->request_id;
    drq.has_reservation_id = drq.has_first_token = 1;
    drq.reservation_id = res_id;
    drq.n_tokens = q->n_tokens;
    drq.tokens = q->tokens;
    drq.first_token = first;
    drq.has_sampled_before = 1;
    drq.sampled_before = (uint32_t)(q->n_tokens - q->n_prompt) + 1; /* and the first token */
    drq.has_resume_generated = drq.has_resume_text_sent = 1;
    drq.resume_generated = (uint32_t)(q->n_tokens - q->n_prompt);
    drq.resume_text_sent = q->text_sent;
    drq.sampling = sampling_for(q, &sp);
    drq.n_block_digests = prp->n_block_digests;
    drq.block_digests = prp->block_digests;
    pn = tandem__internal__v1__decode_request__get_packed_size(&drq);
    pbuf = malloc(pn);
    if (pbuf)
        tandem__internal__v1__decode_request__pack(&drq, pbuf);
    tandem__internal__v1__prefill_response__free_unpacked(prp, NULL);
    q->st = NULL;
    rc = pbuf ? td_rpc_stream_open(d->ch, "/tandem.internal.v1.Decode/Decode", pbuf, pn, left(q), q->scope, &q->st)
              : TD_ERR_NO_MEMORY;
    free(pbuf);
    rt_held_remove(r, d, res_id); /* the Decode claims it (or, failing, its lease runs out) */
    q->p = p;
    q->d = d;
    q->finished = q->sink_failed = false;
    q->overhead += td_now_s() - t_c;
    q->cpu += cpu_s() - c_c;
    if (rc) { /* no stream: as if it broke at once */
        q->st = NULL;
        rt_table_observe(&r->table, r->place, p, d, &(rt_timings_t){.prefill_ms = q->prefill_ms, .pred = q->pred});
        rt_table_unhold(&r->table, p);
        rt_table_done(&r->table, d, NULL, 0);
        q->p = q->d = NULL;
        finish(q, TD_RPC_RESOURCE_EXHAUSTED, "no memory for the decode request");
        return 1;
    }
    if (td_rpc_stream_read_async(q->st, on_upstream, q) != TD_OK)
        return after_stream(q);
    return 2;
}

/* Attempts until the relay runs or the request ends. */
static void run(rt_request_t *q)
{
    for (;;) {
        int a = attempt(q);
        if (a)
            return;
        if (cancelled(q)) {
            finish(q, TD_RPC_CANCELLED, "the client cancelled");
            return;
        }
        if (left(q) <= 0) {
            uint32_t np, nd;
            rt_table_counts(&q->r->table, &np, &nd);
            finish(q, np && nd ? TD_RPC_DEADLINE_EXCEEDED : TD_RPC_UNAVAILABLE,
                   "no answer within the deadline (%zu tokens made; %u prefill and %u decode workers usable)",
                   q->n_tokens - q->n_prompt, np, nd);
            return;
        }
    }
}

static void after_stream_task(void *arg)
{
    rt_request_t *q = arg;
    q->handoff += td_now_s() - q->t_queued;
    if (after_stream(q))
        return;
    if (cancelled(q)) {
        finish(q, TD_RPC_CANCELLED, "the client cancelled");
        return;
    }
    run(q);
}

static void start_task(void *arg)
{
    rt_request_t *q = arg;
    double t = td_now_s(), c0 = cpu_s();
    q->handoff += t - q->t_queued;
    if (!validate(q))
        return;
    q->overhead = td_now_s() - t;
    q->cpu = cpu_s() - c0;
    if (cancelled(q)) {
        finish(q, TD_RPC_CANCELLED, "the client cancelled");
        return;
    }
    run(q);
}

/* ---------------------------------------------------------------- the API */

rt_request_t *rt_request_create(router_t *r, Tandem__V1__GenerateRequest *rq, double timeout_s, const rt_sink_t *sink,
                                void *sink_ctx)
{
    /* from the free list; a new one while fewer than the most that can be in flight exist */
    pthread_mutex_lock(&r->mu);
    rt_request_t *q = r->free_reqs;
    bool make = !q && r->n_reqs < r->cfg.router.max_streams + RT_REQ_SLACK;
    if (q)
        r->free_reqs = q->next_free;
    else if (make)
        r->n_reqs++;
    pthread_mutex_unlock(&r->mu);
    if (make && !(q = calloc(1, sizeof *q))) {
        pthread_mutex_lock(&r->mu);
        r->n_reqs--;
        pthread_mutex_unlock(&r->mu);
    }
    if (q) {
        int32_t *tokens = q->tokens;
        size_t cap = q->cap_tokens, cap_chain = q->cap_chain;
        td_block_name_t *chain = q->chain;
        memset(q, 0, offsetof(rt_request_t, pb_mem));
        q->tokens = tokens;
        q->cap_tokens = cap;
        q->chain = chain;
        q->cap_chain = cap_chain;
        q->cancelled = false;
        q->next_free = NULL;
    }
    double dl = timeout_s;
    if (rq->deadline_ms && rq->deadline_ms / 1e3 < dl)
        dl = rq->deadline_ms / 1e3;
    if (dl > 3600)
        dl = 3600;
    if (!q || td_rpc_scope_create(dl, &q->scope)) {
        if (q) {
            pthread_mutex_lock(&r->mu);
            q->next_free = r->free_reqs;
            r->free_reqs = q;
            pthread_mutex_unlock(&r->mu);
        }
        tandem__v1__generate_request__free_unpacked(rq, NULL);
        return NULL;
    }
    q->r = r;
    q->rq = rq;
    q->sink = *sink;
    q->sink_ctx = sink_ctx;
    q->t0 = td_now_s();
    q->deadline = q->t0 + dl;
    td_pb_arena_init(&q->arena, q->pb_mem, sizeof q->pb_mem);
    pthread_mutex_init(&q->mu, NULL);
    return q;
}

void rt_request_pool_free(router_t *r)
{
    pthread_mutex_lock(&r->mu);
    while (r->free_reqs) {
        rt_request_t *q = r->free_reqs;
        r->free_reqs = q->next_free;
        free(q->tokens);
        free(q->chain);
        free(q);
        r->n_reqs--;
    }
    pthread_mutex_unlock(&r->mu);
}

void rt_request_set_key(rt_request_t *q, const rt_key_t *key) { q->key = key; }

void rt_request_start(rt_request_t *q)
{
    router_t *r = q->r;
    pthread_mutex_lock(&r->mu);
    bool room = r->n_active < r->cfg.router.max_streams;
    r->n_active++; /* finish counts it out */
    pthread_mutex_unlock(&r->mu);
    q->t_queued = td_now_s();
    if (!room)
        finish(q, TD_RPC_RESOURCE_EXHAUSTED, "the router serves %u requests at once, its most (router.max_streams); "
               "try again later", r->cfg.router.max_streams);
    else if (td_pool_submit(r->pool, start_task, q) != TD_OK)
        finish(q, TD_RPC_UNAVAILABLE, "the router is stopping");
}

void rt_request_cancel(rt_request_t *q)
{
    pthread_mutex_lock(&q->mu);
    q->cancelled = true;
    pthread_mutex_unlock(&q->mu);
    td_rpc_scope_cancel(q->scope);
}
