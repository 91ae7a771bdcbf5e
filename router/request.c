/* request.c — see request.h.
 *
 * A request goes through attempts, each the pipeline place → reserve →
 * prefill → open_decode → stream (below, "the pipeline"): a (prefill,
 * decode) pair placed, landing blocks reserved on the decode worker, the
 * prompt computed by the prefill worker with its KV pushed there, the decode
 * stream opened and relayed. A worker that fails is skipped for a while
 * (placement's rt_suspect_for) and the request goes on elsewhere: a failed
 * prefill is redone, a decode stream that breaks is resumed by
 * re-prefilling the prompt plus the tokens already streamed — within the
 * request's deadline, after which it ends DEADLINE_EXCEEDED, never a hang.
 * In a cluster with no prefill worker the attempt is one Decode stream to a
 * colocated decode worker, which computes the prompt itself. Every upstream
 * call is made under the request's scope, so the deadline bounds it and a
 * cancel ends it, whatever transport the client came by.
 *
 * Threads: the steps (step, after_stream) run on the router's pool, one at a
 * time per request; the relay (on_upstream, rt_request_sent) runs on RPC
 * completion-queue threads, one callback at a time: each message read posts
 * one write to the sink, and each write done posts the next read. mu guards
 * only `cancelled`. */
#define _GNU_SOURCE
#include "router/request.h"

#include <assert.h>
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
#include "common/rpc_pb.h"
#include "engine/sampler.h"
#include "router/fair.h"
#include "router/outlen.h"
#include "tandem/internal/v1/worker.pb-c.h"

struct rt_requests {
    rt_env_t env;
    pthread_mutex_t mu; /* guards what follows */
    uint32_t n_active;  /* requests started and not ended (at most env.max_streams) */
    uint32_t n_reqs;    /* request objects that exist, in use or free */
    rt_request_t *free_reqs; /* ended request objects, kept for reuse */
    rt_fair_t *fair;         /* the admission queue (router/fair.h) */
    rt_outlen_t *outlen;     /* the output-length predictor (router/outlen.h) */
};

struct rt_request {
    rt_requests_t *rs;
    const rt_env_t *env;
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
    uint32_t call_cached, call_store; /* the last prefill call's (q->pred is for it) */
    double t0, deadline, t_first, t_last, overhead, cpu; /* cpu: overhead in thread CPU time */
    double t_queued, handoff; /* when the next step was queued; the time steps waited for a pool thread */
    char prefill_id[96], decode_id[96];
    uint64_t text_sent; /* bytes of text relayed to the client, all attempts */
    int internal_errors; /* attempts a worker ended with INTERNAL */
    bool validated, sent_any;
    bool answered;         /* the sink has its end already (the rest is clean-up) */
    uint64_t landing_lease_until; /* unix ms: the first lease of the attempt's landing (then the renewer's) */
    uint32_t choice, n_choices; /* choice `choice` of n_choices (router/choices.h); 0 of 0 alone */
    const rt_key_t *key;   /* the caller's API key (NULL: keys are off) */
    uint32_t key_charged;  /* tokens charged to it at admission, settled at the end */
    rt_fair_entry_t fair;  /* its place in the admission queue */
    double out_predicted;  /* the output tokens predicted for it at its first placement (0: not yet) */
    double history_tokens; /* a chat's earlier assistant turns' mean length (router/outlen.h) */
    /* the attempt under way */
    rt_worker_t *p, *d;
    char did[96];
    double t_attempt, prefill_ms; /* when it began; its prefill call */
    /* the disaggregated path's parts (Timing): the Reserve, the prefill worker's own time, when the Prefill answered */
    double reserve_ms, worker_prefill_ms, t_prefilled, t_decode_first; /* t_decode_first: its stream's first token */
    /* the first token went to the client when the Prefill answered (send_first): the decode worker's stream
     * brings it again, first (its forced token), and that copy is dropped — the id, and the bytes of text left */
    bool early_pending;
    int32_t early_token;
    size_t early_skip_text;
    /* the prefill worker's first token's log-probabilities (sampling.logprobs), for the message that brings the
     * client that token */
    bool plp_sent; /* the prompt's log-probabilities went to the client (sampling.prompt_logprobs) */
    Tandem__Internal__V1__PrefillResponse *plp_resp; /* the prefill worker's answer holding them, until they go */
    bool first_lp_pending;
    Tandem__V1__TokenLogprob first_lp, first_top[ENG_MAX_LOGPROBS], *first_top_p[ENG_MAX_LOGPROBS];
    td_rpc_stream_t *st;
    bool finished;    /* the message with the finish reason was relayed */
    bool local_pending; /* q->d's queue counts this request's local prefill until its first token */
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

/* The request's id for log lines. */
static const char *rid(const rt_request_t *q)
{
    return q->rq->request_id && q->rq->request_id[0] ? q->rq->request_id : "-";
}


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
    rt_metrics_request_end(q->env->metrics, code);
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
static void drop_plp_resp(rt_request_t *q);
static void finish(rt_request_t *q, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void finish(rt_request_t *q, int code, const char *fmt, ...)
{
    rt_requests_t *rs = q->rs;
    assert(!q->st && !q->p && !q->d); /* nothing upstream is held past the end */
    drop_plp_resp(q);
    if (q->fair.state == RT_FAIR_RUNNING)
        rt_fair_leave(rs->fair, &q->fair, (uint32_t)q->n_prompt, (uint32_t)(q->n_tokens - q->n_prompt));
    if (q->key_charged || q->key)
        rt_keys_settle(q->env->api_keys, q->key, q->key_charged, (uint32_t)q->n_tokens);
    if (q->validated)
        rt_stats_count(q->env->stats, true, q->overhead, q->cpu, q->handoff);
    else
        rt_stats_count(q->env->stats, false, -1, -1, -1);
    va_list ap;
    va_start(ap, fmt);
    answer_v(q, code, fmt, ap);
    va_end(ap);
    tandem__v1__generate_request__free_unpacked(q->rq, NULL);
    td_rpc_scope_destroy(q->scope);
    pthread_mutex_destroy(&q->mu);
    pthread_mutex_lock(&rs->mu);
    rs->n_active--;
    q->next_free = rs->free_reqs; /* kept, with its token buffer, for the next request */
    rs->free_reqs = q;
    pthread_mutex_unlock(&rs->mu);
    td_metric_add(rs->env.metrics->running, -1);
}

/* ---------------------------------------------------------------- validation */

/* A chat's earlier assistant turns' mean length in tokens, from their bytes at the chat's own bytes per token. */
static void chat_history(rt_request_t *q)
{
    const Tandem__V1__ChatInput *chat = q->rq->input_case == TANDEM__V1__GENERATE_REQUEST__INPUT_CHAT ? q->rq->chat : NULL;
    size_t all = 0, said = 0, turns = 0;
    for (size_t i = 0; chat && i < chat->n_messages; i++) {
        size_t b = chat->messages[i]->content ? strlen(chat->messages[i]->content) : 0;
        all += b;
        if (chat->messages[i]->role && !strcmp(chat->messages[i]->role, "assistant") && b)
            said += b, turns++;
    }
    q->history_tokens = turns && all && q->n_prompt ? (double)said / turns * (double)q->n_prompt / (double)all : 0;
}

/* Checks the request and tokenizes it (router/input.h), charges its key;
 * false when it ended (the error sent). */
static bool validate(rt_request_t *q)
{
    const rt_env_t *env = q->env;
    char err[600] = "";
    int32_t *ids = NULL;
    size_t n_ids = 0;
    q->plp_sent = false;
    int code = rt_input_check(env->input, q->rq, env->default_max_tokens, &ids, &n_ids, &q->max_tokens, err,
                              sizeof err);
    if (!code && q->key) { /* the most it may use, charged now; what it used is settled at the end */
        double retry_s;
        uint64_t most = (uint64_t)n_ids + q->max_tokens;
        code = rt_keys_charge(env->api_keys, q->key, most > UINT32_MAX ? UINT32_MAX : (uint32_t)most, &q->key_charged,
                              err, sizeof err, &retry_s);
        if (code)
            q->retry_after_ms = (uint32_t)(retry_s * 1e3 + 0.5);
    }
    size_t need = n_ids + q->max_tokens + 1;
    if (!code && need > q->cap_tokens) { /* a pooled request keeps its buffer: most requests allocate nothing here */
        int32_t *t = realloc(q->tokens, need * sizeof *t);
        if (t) {
            q->tokens = t;
            q->cap_tokens = need;
        }
    }
    if (!code && need > q->cap_tokens) {
        code = TD_RPC_RESOURCE_EXHAUSTED;
        snprintf(err, sizeof err, "no memory for %zu tokens", need);
    }
    if (code) {
        free(ids);
        TD_WARN("router: %s refused (%s): %s", rid(q), td_rpc_code_name(code), err);
        finish(q, code, "%s", err);
        return false;
    }
    memcpy(q->tokens, ids, n_ids * sizeof *ids);
    free(ids);
    q->n_prompt = q->n_tokens = n_ids;
    chat_history(q);
    q->validated = true;
    return true;
}

/* ---------------------------------------------------------------- the relay */

static void on_upstream(void *ctx, td_status_t rc, const uint8_t *m, size_t ml);

/* Frees the prefill worker's answer kept for its prompt log-probabilities (their message is out, or the
 * request ends, or another attempt's answer replaces it). */
static void drop_plp_resp(rt_request_t *q)
{
    if (q->plp_resp)
        tandem__internal__v1__prefill_response__free_unpacked(q->plp_resp, NULL);
    q->plp_resp = NULL;
}

/* Keeps the prefill worker's first-token log-probabilities (lp: its response's, or NULL) in q's storage. */
static void keep_first_lp(rt_request_t *q, const Tandem__V1__TokenLogprob *lp)
{
    q->first_lp_pending = lp != NULL;
    if (!lp)
        return;
    tandem__v1__token_logprob__init(&q->first_lp);
    q->first_lp.has_token_id = q->first_lp.has_logprob = 1;
    q->first_lp.token_id = lp->token_id;
    q->first_lp.logprob = lp->logprob;
    size_t n = lp->n_top < ENG_MAX_LOGPROBS ? lp->n_top : ENG_MAX_LOGPROBS;
    for (size_t i = 0; i < n; i++) {
        tandem__v1__token_logprob__init(&q->first_top[i]);
        q->first_top[i].has_token_id = q->first_top[i].has_logprob = 1;
        q->first_top[i].token_id = lp->top[i]->token_id;
        q->first_top[i].logprob = lp->top[i]->logprob;
        q->first_top_p[i] = &q->first_top[i];
    }
    q->first_lp.n_top = n;
    q->first_lp.top = q->first_top_p;
}
static void after_stream_task(void *arg);

/* From a relay callback: the stream is over (or must be), the rest waits. */
static void relay_over(rt_request_t *q)
{
    q->t_queued = td_now_s();
    if (td_pool_submit(q->env->pool, after_stream_task, q) != TD_OK) /* sized for every request: cannot be full */
        TD_WARN("router: %s cannot be queued to end; it waits for its deadline", rid(q));
}

static void read_next(rt_request_t *q)
{
    if (td_rpc_stream_read_async(q->st, on_upstream, q) != TD_OK)
        relay_over(q);
}

/* A local prefill (conditional disaggregation) is over: its decode worker's queue no longer counts it. */
static void local_prefilled(rt_request_t *q)
{
    if (q->local_pending) {
        q->local_pending = false;
        rt_table_prefill_done(q->env->table, q->d, &q->pred);
    }
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
    /* the first token was sent already (send_first): this stream's copy of it is dropped */
    size_t skip = 0;
    if (q->early_pending && dr->n_token_ids) {
        q->early_pending = false;
        skip = dr->token_ids[0] == q->early_token;
        q->t_decode_first = t_m;
        if (!skip)
            TD_WARN("router: %s: the decode worker's first token %d is not the prefill worker's %d", rid(q),
                    dr->token_ids[0], q->early_token);
    }
    if (q->early_skip_text) {
        size_t l = strlen(dr->text), k = l < q->early_skip_text ? l : q->early_skip_text;
        dr->text += k;
        q->early_skip_text -= k;
    }
    if (!q->max_tokens) { /* the prompt scored alone: the one token the workers made is not the client's */
        dr->n_token_ids = dr->n_logprobs = 0;
        dr->text = (char *)"";
    }
    size_t n_ids = dr->n_token_ids - skip;
    for (size_t i = skip; i < dr->n_token_ids && q->n_tokens < q->cap_tokens; i++)
        q->tokens[q->n_tokens++] = dr->token_ids[i];
    Tandem__V1__GenerateResponse gr = TANDEM__V1__GENERATE_RESPONSE__INIT;
    gr.request_id = q->rq->request_id;
    gr.has_index = q->n_choices > 1;
    gr.index = q->choice;
    gr.text = dr->text;
    if (q->rq->return_token_ids) {
        gr.n_token_ids = n_ids;
        gr.token_ids = dr->token_ids + skip;
    }
    /* the tokens' log-probabilities: the decode worker's, after the prefill worker's first token's (which the
     * decode worker streams without them) */
    Tandem__V1__TokenLogprob *lps[8];
    size_t nlp = 0;
    bool ends_eos = dr->has_finish_reason && dr->finish_reason == TANDEM__V1__FINISH_REASON__FINISH_REASON_EOS;
    if (q->first_lp_pending && (n_ids ? dr->n_logprobs < n_ids : ends_eos && !dr->n_logprobs)) {
        /* (the prefill worker's first token was the end token: its log-probability is listed too) */
        lps[nlp++] = &q->first_lp;
        q->first_lp_pending = false;
    }
    for (size_t i = 0; i < dr->n_logprobs && nlp < 8; i++)
        lps[nlp++] = dr->logprobs[i];
    gr.n_logprobs = nlp;
    gr.logprobs = lps;
    const Tandem__Internal__V1__PrefillResponse *plp_from = q->plp_resp;
    if (!q->plp_sent && (dr->n_prompt_logprobs || plp_from)) { /* a whole request's worker scored the prompt, or the
                                                                  * prefill worker did */
        gr.n_prompt_logprobs = plp_from ? plp_from->n_prompt_logprobs : dr->n_prompt_logprobs;
        gr.prompt_logprobs = plp_from ? plp_from->prompt_logprobs : dr->prompt_logprobs;
        q->plp_sent = true;
    }
    Tandem__V1__Usage usage = TANDEM__V1__USAGE__INIT;
    Tandem__V1__Timing timing = TANDEM__V1__TIMING__INIT;
    double t = td_now_s();
    if (n_ids) {
        if (!q->t_first) {
            q->t_first = q->t_decode_first = t;
            td_metric_observe(q->env->metrics->ttft, t - q->t0);
            local_prefilled(q);
        } else {
            for (size_t i = 0; i < n_ids; i++) /* a chunk's tokens share its gap */
                td_metric_observe(q->env->metrics->itl, (t - q->t_last) / (double)n_ids);
        }
        q->t_last = t;
        td_metric_add(q->env->metrics->generation_tokens, (double)n_ids);
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
        if (q->t_prefilled && q->t_first >= q->t_prefilled && q->t_decode_first >= q->t_prefilled) {
            timing.has_reserve_ms = timing.has_prefill_call_ms = timing.has_prefill_worker_ms = timing.has_handoff_ms = 1;
            timing.reserve_ms = q->reserve_ms;
            timing.prefill_call_ms = q->prefill_ms;
            timing.prefill_worker_ms = q->worker_prefill_ms;
            timing.handoff_ms = (q->t_decode_first - q->t_prefilled) * 1e3;
            timing.has_first_token_early = 1;
            timing.first_token_early = q->t_first < q->t_decode_first;
        }
        gr.timing = &timing;
    }
    bool emit = gr.text[0] || gr.n_token_ids || gr.n_prompt_logprobs || gr.n_logprobs || fin;
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
    td_status_t sent = q->sink.emit(q->sink_ctx, q, &gr);
    if (q->plp_sent) /* they are out (the sink copied them) */
        drop_plp_resp(q);
    if (sent != TD_OK) { /* the client is gone: end the upstream stream too */
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

/* ---------------------------------------------------------------- the pipeline
 *
 * One attempt is five steps — place, reserve, prefill, open_decode, stream —
 * each returning TD_OK to go on or the status of what stopped it, with the
 * attempt's result in the attempt_t: again (another attempt follows; the
 * worker at fault, if any, is named in fail_p / fail_d), or the request's
 * answer (code, why). What a step takes stays in the attempt — the workers
 * placement held, the prefill's place in its worker's queue, the
 * reservation and its landing, the renewal — and attempt() gives it back on
 * one unwinding path, whatever step stopped. A colocated decode worker
 * (a cluster with no prefill worker) skips reserve and prefill. */

typedef struct attempt {
    rt_placement_t pl;
    rt_worker_t *p, *d; /* held by placement (rt_table_done); d is the stream's once it opens */
    bool queued;        /* p's queue counts the predicted prefill (rt_table_prefill_done) */
    bool local_queued;  /* d's queue counts its local prefill (conditional disaggregation), until the stream is q's */
    Tandem__Internal__V1__ReserveResponse *reserved; /* the reservation and its landing */
    bool renewing;      /* the renewer holds the reservation */
    bool landing_open;  /* a prefill worker may still put into the landing */
    bool claimed;       /* the decode stream took the reservation */
    Tandem__Internal__V1__PrefillResponse *prefilled;
    int32_t first_token; /* the prefill worker's (-1: none) and its text ("": none), for send_first */
    char first_text[256];
    bool p_failed, d_failed; /* the worker's own call failed: suspect it (rt_suspect_for) */
    td_rpc_result_t fail_p, fail_d;
    bool again;         /* the request goes on with another attempt */
    int code;           /* else it ends with this answer */
    char why[1024];
} attempt_t;

/* The request ends with code and the message; the status says why the step stopped. */
static td_status_t end(attempt_t *a, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static td_status_t end(attempt_t *a, int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(a->why, sizeof a->why, fmt, ap);
    va_end(ap);
    a->again = false;
    a->code = code;
    return code ? td_rpc_status_of(code) : TD_ERR_INTERNAL;
}

/* The attempt is over and the request goes on with another. */
static td_status_t again(attempt_t *a, td_status_t st)
{
    a->again = true;
    return st;
}

/* A small call whose answer carries nothing the caller reads (wait_s at
 * most, outside any request's scope): true when it succeeded. */
static bool tell(rt_worker_t *w, const char *method, const ProtobufCMessage *m, const ProtobufCMessageDescriptor *reply,
                 double wait_s)
{
    ProtobufCMessage *out = NULL;
    td_rpc_result_t res;
    if (td_rpc_unary_pb(w->ch, method, m, reply, wait_s, NULL, &out, &res) != TD_OK) {
        TD_DEBUG("router: %s", td_last_error());
        return false;
    }
    protobuf_c_message_free_unpacked(out, NULL);
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
    tell(d, "/tandem.internal.v1.Decode/Release", &rq.base, &tandem__internal__v1__release_response__descriptor, 2.0);
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
    return tell(p, "/tandem.internal.v1.Prefill/Cancel", &rq.base,
                &tandem__internal__v1__cancel_prefill_response__descriptor, 16.0);
}

static Tandem__V1__SamplingParams *sampling_for(rt_request_t *q, Tandem__V1__SamplingParams *copy)
{
    static const Tandem__V1__SamplingParams none = TANDEM__V1__SAMPLING_PARAMS__INIT;
    *copy = q->rq->sampling ? *q->rq->sampling : none;
    copy->has_max_tokens = 1;
    copy->max_tokens = q->max_tokens - (uint32_t)(q->n_tokens - q->n_prompt);
    copy->prompt_logprobs = copy->prompt_logprobs && !q->plp_sent; /* a resume's prompt is not scored again */
    if (!q->max_tokens) /* the prompt scored alone: the workers make one token, which is not relayed */
        copy->max_tokens = 1;
    return copy;
}

/* The priority the workers order q by: its own, else its API key's class (router/fair.h). */
static int32_t req_priority(const rt_request_t *q)
{
    return q->rq->has_priority ? q->rq->priority : rt_key_priority(q->key);
}

/* What the output-length predictor knows of q: its tenant, prompt, cap, and a chat's history. */
static rt_outlen_query_t outlen_query(const rt_request_t *q)
{
    return (rt_outlen_query_t){.tenant = q->key ? rt_key_name(q->key) : NULL, .prompt_tokens = (uint32_t)q->n_prompt,
                               .max_tokens = q->max_tokens, .history_tokens = q->history_tokens};
}

/* What placement is asked: the tokens (a resume's too) and their chain of
 * block names, the request's SLOs (the router's, tightened by the request's). */
static void place_req(rt_request_t *q, rt_place_req_t *pr)
{
    const rt_env_t *env = q->env;
    uint32_t bt = env->table->expect.block_tokens;
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
    td_block_name_chain(env->chain_root, q->tokens, nb * bt, bt, q->chain, nb);
    if (!q->out_predicted) {
        rt_outlen_query_t oq = outlen_query(q);
        q->out_predicted = rt_outlen_predict(q->rs->outlen, &oq);
    }
    /* a resumed stream: what is predicted to be left of it */
    size_t made = q->n_tokens - q->n_prompt;
    double out_left = q->out_predicted > made + 1 ? q->out_predicted - made : 1;
    uint32_t ttft = env->ttft_slo_ms, tpot = env->tpot_slo_ms;
    if (q->rq->ttft_slo_ms && (!ttft || q->rq->ttft_slo_ms < ttft))
        ttft = q->rq->ttft_slo_ms;
    if (q->rq->tpot_slo_ms && (!tpot || q->rq->tpot_slo_ms < tpot))
        tpot = q->rq->tpot_slo_ms;
    *pr = (rt_place_req_t){.tokens = q->tokens, .n_tokens = q->n_tokens, .chain = q->chain, .n_blocks = nb,
                           .max_tokens = q->max_tokens, .ttft_slo_ms = ttft, .tpot_slo_ms = tpot,
                           /* a stream under way is finished, not judged again: its resume re-prefills
                            * what was streamed, which the TTFT SLO never covered */
                           .early_reject = q->env->early_reject && !q->sent_any,
                           .priority = req_priority(q), .pred_out = out_left,
                           .n_choices = q->choice == 0 && !q->sent_any ? q->n_choices : 0};
}

/* place: a (prefill, decode) pair, or a decode worker alone in a cluster with
 * none for prefill; refused early for its SLOs, or for its deadline by the
 * same prediction (a stream under way is finished however late, as early
 * rejection does); with no usable worker, waits for one while the deadline
 * allows. */
static td_status_t place(rt_request_t *q, attempt_t *a)
{
    const rt_env_t *env = q->env;
    rt_place_req_t prq;
    place_req(q, &prq);
    rt_table_place(env->table, env->place, &prq, &a->pl);
    const rt_placement_t *pl = &a->pl;
    if (pl->rejected) {
        q->retry_after_ms = pl->retry_after_ms; /* rejected early: at once, never queued */
        q->rejected = pl->rejected;
        return end(a, pl->code, "%s", pl->why);
    }
    if (pl->code == TD_RPC_INVALID_ARGUMENT) /* the request itself: no wait makes it fit */
        return end(a, pl->code, "%s", pl->why);
    if (pl->code) {
        /* nothing can serve it: say why now, unless a worker becomes usable before the deadline (its
         * suspect time ends) or, for a stream already under way, a worker may still join to resume it */
        double until = pl->retry_at ? pl->retry_at : q->sent_any ? q->deadline : 0;
        if (until <= td_now_s() && !pl->retry_at)
            return end(a, pl->code, "%s", pl->why);
        if (until >= q->deadline && !q->sent_any)
            return end(a, pl->code, "%s (the deadline comes first)", pl->why);
        /* woken by the table (a worker joined, left or failed), capped at 1 s to see a cancel */
        rt_table_wait(env->table, fmin(fmin(until, q->deadline), td_now_s() + 1.0));
        return again(a, TD_ERR_UNAVAILABLE);
    }
    a->d = pl->decode;
    a->p = pl->prefill;
    a->queued = a->p != NULL;
    a->local_queued = pl->pred.local;
    memcpy(q->did, a->d->id, sizeof q->did);
    double left_ms = left(q) * 1e3;
    if (!q->sent_any && pl->pred.valid && pl->pred.ttft_ms > left_ms)
        return end(a, TD_RPC_DEADLINE_EXCEEDED, "deadline: the first token is predicted in %.0f ms (queue %.0f, "
                   "prefill %.0f, for %u new tokens), past the %.0f ms the deadline leaves; not started",
                   pl->pred.ttft_ms, pl->pred.queue_ms, pl->pred.prefill_ms, pl->pred.new_tokens, left_ms);
    q->pred = pl->pred;
    if (!q->first_pred.valid) { /* the load on its way, for the planner's predicted demand */
        q->first_pred = pl->pred;
        rt_stats_arrive(env->stats, pl->pred.new_tokens, pl->pred.local || !a->p, prq.pred_out,
                        (double)prq.n_tokens + prq.pred_out / 2);
    }
    return TD_OK;
}

/* reserve: landing blocks on the decode worker, renewed by the renewer
 * until the decode stream claims them. The prefill may put until its call's
 * deadline (the decode side caps it); a landing's blocks are fenced only
 * while the reservation is renewed (its lease), which the prefill worker's
 * puts also stop at: each renewal is forwarded to it. */
static td_status_t reserve(rt_request_t *q, attempt_t *a)
{
    Tandem__Internal__V1__ReserveRequest rq = TANDEM__INTERNAL__V1__RESERVE_REQUEST__INIT;
    Tandem__Internal__V1__KvContract c;
    td_kv_layout_to_pb(&q->env->table->expect, &c);
    rq.contract = &c;
    rq.has_n_tokens = rq.has_max_tokens = rq.has_lease_ms = rq.has_landing_ms = 1;
    rq.n_tokens = (uint32_t)q->n_tokens;
    rq.n_prompt_tokens = q->n_tokens; /* its prefix cache's blocks of them are not landed again */
    rq.prompt_tokens = q->tokens;
    rq.max_tokens = q->max_tokens;
    rq.lease_ms = RT_RES_LEASE_MS;
    double ms = ceil(left(q) * 1e3);
    rq.landing_ms = ms < 1 ? 1 : ms > UINT32_MAX ? UINT32_MAX : (uint32_t)ms;
    /* the landing's first lease: counted from before the decode worker starts its own */
    q->landing_lease_until = td_unix_ms() + RT_RES_LEASE_MS;
    ProtobufCMessage *m = NULL;
    td_rpc_result_t res = {0};
    double t_r = td_now_s();
    q->t_prefilled = 0;
    if (td_rpc_unary_pb(a->d->ch, "/tandem.internal.v1.Decode/Reserve", &rq.base,
                        &tandem__internal__v1__reserve_response__descriptor, fmin(left(q), 5.0), q->scope, &m, &res) ||
        !((Tandem__Internal__V1__ReserveResponse *)m)->landing) {
        protobuf_c_message_free_unpacked(m, NULL);
        if (!res.code) {
            res.code = TD_RPC_INTERNAL;
            snprintf(res.message, sizeof res.message, "decode worker %s: bad ReserveResponse", q->did);
        }
        /* the client's own deadline or cancel says nothing about the worker's health; a full pool
         * is load, not a fault: the worker is skipped only briefly */
        bool own = left(q) <= 0.001 || cancelled(q);
        a->d_failed = !own;
        a->fail_d = res;
        if (fatal_code(res.code) && res.code != TD_RPC_DEADLINE_EXCEEDED)
            return end(a, res.code, "decode worker %s: %s", q->did, res.message);
        if (!own)
            TD_WARN("router: %s: reserve on %s failed (%s: %s); trying elsewhere", rid(q), q->did,
                    td_rpc_code_name(res.code), res.message);
        return again(a, TD_ERR_UNAVAILABLE);
    }
    a->reserved = (Tandem__Internal__V1__ReserveResponse *)m;
    q->reserve_ms = (td_now_s() - t_r) * 1e3;
    if (!rt_renewer_add(q->env->renewer, a->d, a->reserved->landing->reservation_id, a->p))
        return end(a, TD_RPC_RESOURCE_EXHAUSTED, "the router holds %d reservations, its most; try again later",
                   RT_MAX_HELD);
    a->renewing = true;
    return TD_OK;
}

/* prefill: the prompt (plus what was streamed already, on a resume)
 * computed on the prefill worker, its KV put into the landing. A failure
 * the client caused (cancel, deadline) is answered at once, before the
 * landing is closed (the prefill worker asked to stop, which may take it
 * seconds). */
static td_status_t prefill(rt_request_t *q, attempt_t *a)
{
    const rt_env_t *env = q->env;
    double t_b = td_now_s();
    Tandem__V1__SamplingParams sp;
    Tandem__Internal__V1__PrefillRequest prq = TANDEM__INTERNAL__V1__PREFILL_REQUEST__INIT;
    prq.request_id = q->rq->request_id;
    prq.n_tokens = q->n_tokens;
    prq.tokens = q->tokens;
    prq.sampling = sampling_for(q, &sp);
    prq.landing = a->reserved->landing;
    prq.priority = req_priority(q);
    prq.has_priority = prq.priority != 0;
    prq.has_sampled_before = 1;
    prq.sampled_before = (uint32_t)(q->n_tokens - q->n_prompt); /* streamed before a resume */
    prq.has_landing_lease_until_unix_ms = 1;
    prq.landing_lease_until_unix_ms = q->landing_lease_until;
    ProtobufCMessage *m = NULL;
    td_rpc_result_t res = {0};
    a->landing_open = true;
    td_status_t rc = td_rpc_unary_pb(a->p->ch, "/tandem.internal.v1.Prefill/Prefill", &prq.base,
                                     &tandem__internal__v1__prefill_response__descriptor, left(q), q->scope, &m, &res);
    rt_table_prefill_done(env->table, a->p, &q->pred);
    a->queued = false;
    if (!rc) {
        a->prefilled = (Tandem__Internal__V1__PrefillResponse *)m;
        a->landing_open = false; /* it answered: everything it puts is in */
        q->t_prefilled = td_now_s();
        q->prefill_ms = (q->t_prefilled - t_b) * 1e3;
        q->worker_prefill_ms = a->prefilled->prefill_ms;
        a->first_token = a->prefilled->first_token;
        keep_first_lp(q, a->prefilled->first_logprob);
        snprintf(a->first_text, sizeof a->first_text, "%s", a->prefilled->first_text ? a->prefilled->first_text : "");
        snprintf(q->prefill_id, sizeof q->prefill_id, "%s", a->p->id);
        snprintf(q->decode_id, sizeof q->decode_id, "%s", q->did);
        q->call_cached = a->prefilled->cached_tokens;
        q->call_store = a->prefilled->store_tokens;
        if (q->n_tokens == q->n_prompt) {
            q->cached = a->prefilled->cached_tokens;
            q->store_cached = a->prefilled->store_tokens;
        }
        return TD_OK;
    }
    /* an answer the prefill worker gave (not a local cancel, deadline or lost connection) means it
     * stopped putting; so does a call never sent (no memory to pack it); else it is asked to stop, and
     * says when it has */
    bool sent = !(rc == TD_ERR_NO_MEMORY && !res.code);
    if (!res.code && sent) {
        res.code = TD_RPC_INTERNAL;
        snprintf(res.message, sizeof res.message, "bad PrefillResponse");
    }
    bool answered = !sent || res.code == TD_RPC_INVALID_ARGUMENT || res.code == TD_RPC_FAILED_PRECONDITION ||
                    res.code == TD_RPC_NOT_FOUND || res.code == TD_RPC_PERMISSION_DENIED;
    /* the client gone or its deadline passed: it hears so now, not after the worker's next chunk */
    if (cancelled(q))
        answer(q, TD_RPC_CANCELLED, "the client cancelled");
    else if (left(q) <= 0)
        answer(q, TD_RPC_DEADLINE_EXCEEDED, "prefill worker %s: %s", a->p->id, res.message);
    if (!answered)
        answered = cancel_prefill(a->p, a->reserved->landing->reservation_id, a->reserved->landing->land_by_unix_ms);
    a->landing_open = !answered;
    bool gone = cancelled(q);
    /* DEADLINE_EXCEEDED with time left is the landing's lease (the call's deadline is the client's) */
    a->p_failed = !gone && left(q) > 0.001 && res.code != TD_RPC_DEADLINE_EXCEEDED;
    a->fail_p = res;
    if (gone)
        return end(a, TD_RPC_CANCELLED, "the client cancelled");
    if (left(q) <= 0 || (fatal_code(res.code) && res.code != TD_RPC_DEADLINE_EXCEEDED))
        return end(a, res.code ? res.code : TD_RPC_DEADLINE_EXCEEDED, "prefill worker %s: %s", a->p->id, res.message);
    if (res.code == TD_RPC_DEADLINE_EXCEEDED) /* the landing's lease ran out, not the client's deadline */
        TD_WARN("router: %s: the landing lease of reservation %llu on %s ran out before its KV was put", rid(q),
                (unsigned long long)a->reserved->landing->reservation_id, q->did);
    TD_WARN("router: %s: prefill on %s failed (%s: %s); trying again", rid(q), a->p->id, td_rpc_code_name(res.code),
            res.message);
    return again(a, TD_ERR_UNAVAILABLE);
}

/* open_decode: the decode stream — after a prefill, the completion notice
 * (the first token, the landing's digests: the decode worker joins its
 * batch and claims the reservation); on a colocated worker, the whole
 * request (the prompt, and on a resume the tokens streamed before, computed
 * there). The stream is the request's from here: q->d, and q->p held for
 * what the stream measures (rt_table_observe). */
static td_status_t open_decode(rt_request_t *q, attempt_t *a)
{
    Tandem__V1__SamplingParams sp;
    Tandem__Internal__V1__DecodeRequest drq = TANDEM__INTERNAL__V1__DECODE_REQUEST__INIT;
    drq.request_id = q->rq->request_id;
    drq.n_tokens = q->n_tokens;
    drq.tokens = q->tokens;
    drq.has_sampled_before = drq.has_resume_generated = drq.has_resume_text_sent = 1;
    drq.sampled_before = drq.resume_generated = (uint32_t)(q->n_tokens - q->n_prompt);
    drq.resume_text_sent = q->text_sent;
    drq.sampling = sampling_for(q, &sp);
    if (a->prefilled) {
        drq.has_reservation_id = drq.has_first_token = 1;
        drq.reservation_id = a->reserved->landing->reservation_id;
        drq.first_token = a->prefilled->first_token;
        drq.sampled_before++; /* and the first token */
        drq.n_block_digests = a->prefilled->n_block_digests;
        drq.block_digests = a->prefilled->block_digests;
    } else {
        drq.priority = req_priority(q);
        drq.has_priority = drq.priority != 0;
        snprintf(q->prefill_id, sizeof q->prefill_id, "%s", q->did);
        snprintf(q->decode_id, sizeof q->decode_id, "%s", q->did);
        q->prefill_ms = 0;
        q->t_prefilled = 0;
    }
    q->st = NULL;
    if (td_rpc_stream_open_pb(a->d->ch, "/tandem.internal.v1.Decode/Decode", &drq.base, left(q), q->scope, &q->st))
        return end(a, TD_RPC_RESOURCE_EXHAUSTED, "no memory for the decode request");
    if (a->renewing) /* the Decode claims it (or, failing, its lease runs out) */
        rt_renewer_remove(q->env->renewer, a->d, a->reserved->landing->reservation_id);
    a->renewing = false;
    a->claimed = true;
    q->d = a->d;
    a->d = NULL;
    q->local_pending = a->local_queued; /* released at the first token (local_prefilled) */
    a->local_queued = false;
    q->p = a->p;
    if (q->p)
        rt_table_hold(q->env->table, q->p);
    q->finished = q->sink_failed = false;
    q->early_pending = false;
    q->early_skip_text = 0;
    return TD_OK;
}

static int after_stream(rt_request_t *q);

/* The first token to the client as soon as the prefill worker answered,
 * not after the decode worker's hand-off (its Decode call, the landing's
 * check, its next step): the relay starts once the sink has written it
 * (rt_request_sent). Only with its text as the decode worker will stream it
 * (the prefill worker's first_text: none for a request with stop strings, a
 * special token or part of a character) and on a fresh request (a resume's
 * first text depends on what was streamed before). false: not sent; the
 * relay brings it. */
static bool send_first(rt_request_t *q, int32_t token, const char *text)
{
    size_t len = strlen(text);
    if (!len || len + 1 >= 256 || q->n_tokens != q->n_prompt || q->n_tokens >= q->cap_tokens)
        return false;
    Tandem__V1__GenerateResponse gr = TANDEM__V1__GENERATE_RESPONSE__INIT;
    gr.request_id = q->rq->request_id;
    gr.has_index = q->n_choices > 1;
    gr.index = q->choice;
    gr.text = (char *)text;
    if (q->rq->return_token_ids) {
        gr.n_token_ids = 1;
        gr.token_ids = &token;
    }
    Tandem__V1__TokenLogprob *lp = &q->first_lp;
    if (q->first_lp_pending) {
        gr.n_logprobs = 1;
        gr.logprobs = &lp;
        q->first_lp_pending = false;
    }
    if (q->plp_resp && !q->plp_sent) {
        gr.n_prompt_logprobs = q->plp_resp->n_prompt_logprobs;
        gr.prompt_logprobs = q->plp_resp->prompt_logprobs;
        q->plp_sent = true;
    }
    q->tokens[q->n_tokens++] = token;
    q->t_first = q->t_last = td_now_s();
    td_metric_observe(q->env->metrics->ttft, q->t_first - q->t0);
    td_metric_add(q->env->metrics->generation_tokens, 1);
    q->early_pending = true;
    q->early_token = token;
    q->early_skip_text = len;
    q->sent_any = true; /* before the write: its completion may run on another thread at once */
    q->text_sent += len;
    td_status_t sent = q->sink.emit(q->sink_ctx, q, &gr);
    if (q->plp_sent)
        drop_plp_resp(q);
    if (sent != TD_OK) { /* the client is gone: end the upstream stream too */
        q->text_sent -= len;
        q->sink_failed = true;
        td_rpc_stream_cancel(q->st);
        read_next(q);
    }
    return true;
}

/* stream: the relay runs on the completion-queue threads (2), or, when no
 * read can be posted, the stream is over at once. */
static int stream(rt_request_t *q)
{
    if (td_rpc_stream_read_async(q->st, on_upstream, q) != TD_OK)
        return after_stream(q);
    return 2;
}

/* The router's own work in a step (not the waits on workers), for Health. */
static void own_work(rt_request_t *q, double t0, double c0)
{
    q->overhead += td_now_s() - t0;
    q->cpu += cpu_s() - c0;
}

/* One attempt: 2 the relay runs (this thread is free), 1 the request ended,
 * 0 try again. */
static int attempt(rt_request_t *q)
{
    const rt_env_t *env = q->env;
    assert(!q->st && !q->p && !q->d); /* the last attempt's stream was given back (after_stream) */
    attempt_t a = {.first_token = -1};
    q->first_lp_pending = false;
    double t0 = td_now_s(), c0 = cpu_s();
    q->t_attempt = t0;
    td_status_t st = place(q, &a);
    own_work(q, t0, c0);
    if (st)
        goto release_workers;
    if (a.p && ((st = reserve(q, &a)) || (st = prefill(q, &a))))
        goto release_reservation;
    t0 = td_now_s(), c0 = cpu_s();
    st = open_decode(q, &a);
    own_work(q, t0, c0);
release_reservation:
    if (a.renewing)
        rt_renewer_remove(env->renewer, a.d, a.reserved->landing->reservation_id);
    if (a.reserved && !a.claimed)
        release(a.d, a.reserved->landing->reservation_id, !a.landing_open);
    if (a.reserved)
        tandem__internal__v1__reserve_response__free_unpacked(a.reserved, NULL);
    if (a.prefilled && !st && a.prefilled->n_prompt_logprobs && !q->plp_sent) {
        drop_plp_resp(q); /* an earlier attempt's */
        q->plp_resp = a.prefilled; /* its prompt log-probabilities go with the first message */
    } else if (a.prefilled) {
        tandem__internal__v1__prefill_response__free_unpacked(a.prefilled, NULL);
    }
release_workers:
    if (a.queued)
        rt_table_prefill_done(env->table, a.p, &a.pl.pred);
    if (a.local_queued)
        rt_table_prefill_done(env->table, a.d, &a.pl.pred);
    if (a.d) {
        rt_table_decode_end(env->table, a.d, &a.pl.pred);
        rt_table_done(env->table, a.d, a.d_failed ? &a.fail_d : NULL, rt_suspect_for(a.fail_d.code));
    }
    if (a.p)
        rt_table_done(env->table, a.p, a.p_failed ? &a.fail_p : NULL, rt_suspect_for(a.fail_p.code));
    if (!st && a.first_token >= 0 && q->max_tokens && send_first(q, a.first_token, a.first_text))
        return 2;
    if (!st)
        return stream(q);
    if (a.again)
        return 0;
    finish(q, a.code, "%s", a.why);
    return 1;
}

/* After the relay: how the stream ended decides. 1: the request ended, 0:
 * try again. */
static int after_stream(rt_request_t *q)
{
    const rt_env_t *env = q->env;
    assert(q->st && q->d); /* open_decode gave the stream and its worker to the request */
    rt_worker_t *p = q->p, *d = q->d;
    td_rpc_result_t sres = {0};
    if (!q->finished)
        td_rpc_stream_cancel(q->st);
    td_rpc_stream_result(q->st, 2.0, &sres);
    td_rpc_stream_destroy(q->st);
    q->st = NULL;
    local_prefilled(q); /* a stream that ended before its first token */
    bool gone = cancelled(q) || q->sink_failed;
    double now = td_now_s();
    rt_timings_t tm = {.prefill_ms = q->prefill_ms, .ttft_ms = ((q->t_first ? q->t_first : now) - q->t0) * 1e3,
                       .e2e_ms = (now - q->t0) * 1e3, .prompt_tokens = (uint32_t)q->n_prompt,
                       .cached_tokens = q->cached, .output_tokens = (uint32_t)(q->n_tokens - q->n_prompt),
                       .ok = q->finished, .pred = q->pred, .call_cached = q->call_cached, .call_store = q->call_store,
                       .attempt_ttft_ms = q->t_first >= q->t_attempt ? (q->t_first - q->t_attempt) * 1e3 : 0};
    tm.tpot_ms = tm.output_tokens > 1 ? (q->t_last - q->t_first) * 1e3 / (tm.output_tokens - 1) : 0;
    if (tm.ok && q->pred.valid)
        TD_DEBUG("router: %s on %s: predicted TTFT %.1f ms (queue %.1f, fetch %.1f, prefill %.1f, overhead %.1f; "
                 "%u new, %u pool, %u store tokens%s); measured %.1f ms (prefill call %.1f ms, %u cached)",
                 q->rq->request_id ? q->rq->request_id : "-", q->prefill_id, q->pred.ttft_ms, q->pred.queue_ms,
                 q->pred.fetch_ms, q->pred.prefill_ms, q->pred.overhead_ms, q->pred.new_tokens, q->pred.pool_tokens,
                 q->pred.store_tokens, q->pred.alone ? ", alone" : "",
                 tm.ttft_ms, tm.prefill_ms, tm.cached_tokens);
    rt_table_observe(env->table, env->place, p, d, &tm);
    if (!gone)
        rt_stats_done(env->stats, tm.ttft_ms, tm.tpot_ms, tm.ok, tm.prompt_tokens, q->pred.local);
    if (tm.ok) {
        td_metric_observe(env->metrics->e2e, tm.e2e_ms * 1e-3);
        td_metric_add(env->metrics->prompt_tokens, tm.prompt_tokens);
        td_metric_add(env->metrics->prefix_queries, tm.prompt_tokens);
        td_metric_add(env->metrics->prefix_hits, q->cached);
        td_metric_add(env->metrics->store_hits, q->store_cached);
        if (q->pred.valid && tm.ttft_ms > 0)
            td_metric_observe(env->metrics->pred_err, fabs(q->pred.ttft_ms - tm.ttft_ms) / tm.ttft_ms);
    }
    if (tm.ok) { /* what it generated, all attempts, teaches the output-length predictor */
        rt_outlen_query_t oq = outlen_query(q);
        rt_outlen_observe(q->rs->outlen, &oq, q->out_predicted, tm.output_tokens);
        td_metric_observe(env->metrics->outlen_err,
                          tm.output_tokens ? fabs(q->out_predicted - tm.output_tokens) / tm.output_tokens : 0);
    }
    if (p)
        rt_table_unhold(env->table, p);
    rt_table_decode_end(env->table, d, &q->pred);
    rt_table_done(env->table, d, !q->finished && !gone && left(q) > 0.001 ? &sres : NULL, rt_suspect_for(sres.code));
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
    TD_WARN("router: %s: the decode stream on %s broke after %zu tokens (%s: %s); resuming elsewhere", rid(q),
            q->did, q->n_tokens - q->n_prompt, td_rpc_code_name(sres.code), sres.message);
    return 0;
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
            rt_table_counts(q->env->table, &np, &nd);
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

/* A request that waited its turn in the admission queue goes (a pool thread). */
static void fair_run_task(void *arg)
{
    rt_request_t *q = arg;
    q->handoff += td_now_s() - q->t_queued;
    if (cancelled(q))
        finish(q, TD_RPC_CANCELLED, "the client cancelled");
    else if (left(q) <= 0)
        finish(q, TD_RPC_DEADLINE_EXCEEDED, "the deadline passed as the request's turn came");
    else
        run(q);
}

static void fair_go(void *req)
{
    rt_request_t *q = req;
    q->t_queued = td_now_s();
    if (td_pool_submit(q->env->pool, fair_run_task, q) != TD_OK)
        finish(q, TD_RPC_UNAVAILABLE, "the router is stopping");
}

static void fair_expire(void *req)
{
    rt_request_t *q = req;
    finish(q, TD_RPC_DEADLINE_EXCEEDED, "the deadline passed while the request waited its turn in the admission "
           "queue (%.1f s; router.admit_max requests were out)", td_now_s() - q->fair.t_queued);
}

static void fair_cancelled_task(void *arg)
{
    finish(arg, TD_RPC_CANCELLED, "the client cancelled while the request waited its turn");
}

/* Its turn in the admission queue (router/fair.h): true when it goes now;
 * false when it waits (fair_go or fair_expire comes) or was refused. */
static bool admit(rt_request_t *q)
{
    rt_fair_entry_t *e = &q->fair;
    e->req = q;
    e->prompt = (uint32_t)q->n_prompt;
    e->max_tokens = q->max_tokens;
    e->deadline = q->deadline;
    char msg[300];
    double retry_s;
    int code = rt_fair_enter(q->rs->fair, e, q->key ? rt_key_name(q->key) : NULL, rt_key_weight(q->key),
                             rt_key_priority(q->key), msg, sizeof msg, &retry_s);
    if (code <= 1)
        return code == 0;
    q->retry_after_ms = (uint32_t)(retry_s * 1e3 + 0.5);
    TD_WARN("router: %s refused (%s): %s", rid(q), td_rpc_code_name(code), msg);
    finish(q, code, "%s", msg);
    return false;
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
    if (admit(q))
        run(q);
}

/* ---------------------------------------------------------------- the API */

td_status_t rt_requests_create(const rt_env_t *env, rt_requests_t **out)
{
    rt_requests_t *rs = calloc(1, sizeof *rs);
    if (!rs)
        return td_error(TD_ERR_NO_MEMORY, "router: no memory for its requests");
    rs->env = *env;
    pthread_mutex_init(&rs->mu, NULL);
    rt_fair_config_t fc = {.admit_max = env->admit_max, .tenant_queue_max = env->tenant_queue_max};
    td_status_t rc = rt_fair_create(&fc, fair_go, fair_expire, env->metrics ? env->metrics->reg : NULL, &rs->fair);
    if (!rc && (rc = rt_outlen_create(&rs->outlen)))
        rt_fair_destroy(rs->fair);
    if (rc) {
        pthread_mutex_destroy(&rs->mu);
        free(rs);
        return rc;
    }
    *out = rs;
    return TD_OK;
}

void rt_requests_destroy(rt_requests_t *rs)
{
    if (!rs)
        return;
    rt_fair_destroy(rs->fair);
    rt_outlen_destroy(rs->outlen);
    while (rs->free_reqs) {
        rt_request_t *q = rs->free_reqs;
        rs->free_reqs = q->next_free;
        free(q->tokens);
        free(q->chain);
        free(q);
    }
    pthread_mutex_destroy(&rs->mu);
    free(rs);
}

const rt_env_t *rt_requests_env(const rt_requests_t *rs) { return &rs->env; }

uint32_t rt_requests_active(rt_requests_t *rs)
{
    pthread_mutex_lock(&rs->mu);
    uint32_t n = rs->n_active;
    pthread_mutex_unlock(&rs->mu);
    return n;
}

rt_request_t *rt_request_create(rt_requests_t *rs, Tandem__V1__GenerateRequest *rq, double timeout_s,
                                const rt_sink_t *sink, void *sink_ctx)
{
    /* from the free list; a new one while fewer than the most that can be in flight exist */
    pthread_mutex_lock(&rs->mu);
    rt_request_t *q = rs->free_reqs;
    bool make = !q && rs->n_reqs < rs->env.max_streams + RT_REQ_SLACK;
    if (q)
        rs->free_reqs = q->next_free;
    else if (make)
        rs->n_reqs++;
    pthread_mutex_unlock(&rs->mu);
    if (make && !(q = calloc(1, sizeof *q))) {
        pthread_mutex_lock(&rs->mu);
        rs->n_reqs--;
        pthread_mutex_unlock(&rs->mu);
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
            pthread_mutex_lock(&rs->mu);
            q->next_free = rs->free_reqs;
            rs->free_reqs = q;
            pthread_mutex_unlock(&rs->mu);
        }
        tandem__v1__generate_request__free_unpacked(rq, NULL);
        return NULL;
    }
    q->rs = rs;
    q->env = &rs->env;
    q->rq = rq;
    q->sink = *sink;
    q->sink_ctx = sink_ctx;
    q->t0 = td_now_s();
    q->deadline = q->t0 + dl;
    td_pb_arena_init(&q->arena, q->pb_mem, sizeof q->pb_mem);
    pthread_mutex_init(&q->mu, NULL);
    return q;
}

void rt_request_set_key(rt_request_t *q, const rt_key_t *key) { q->key = key; }

void rt_request_set_choice(rt_request_t *q, uint32_t index, uint32_t n)
{
    q->choice = index;
    q->n_choices = n;
}

void rt_request_start(rt_request_t *q)
{
    rt_requests_t *rs = q->rs;
    pthread_mutex_lock(&rs->mu);
    bool room = rs->n_active < rs->env.max_streams;
    rs->n_active++; /* finish counts it out */
    pthread_mutex_unlock(&rs->mu);
    td_metric_add(rs->env.metrics->running, 1);
    q->t_queued = td_now_s();
    if (!room)
        finish(q, TD_RPC_RESOURCE_EXHAUSTED, "the router serves %u requests at once, its most (router.max_streams); "
               "try again later", rs->env.max_streams);
    else if (td_pool_submit(rs->env.pool, start_task, q) != TD_OK)
        finish(q, TD_RPC_UNAVAILABLE, "the router is stopping");
}

void rt_request_cancel(rt_request_t *q)
{
    pthread_mutex_lock(&q->mu);
    q->cancelled = true;
    pthread_mutex_unlock(&q->mu);
    td_rpc_scope_cancel(q->scope);
    /* waiting its turn, nothing else would notice: it ends now, on a pool thread (not the caller's, which
     * may hold the transport's lock that the answer takes) */
    if (rt_fair_cancel(q->rs->fair, &q->fair) && td_pool_submit(q->env->pool, fair_cancelled_task, q) != TD_OK)
        finish(q, TD_RPC_CANCELLED, "the client cancelled while the request waited its turn");
}

json_t *rt_requests_fair_json(rt_requests_t *rs) { return rt_fair_json(rs->fair); }
json_t *rt_requests_outlen_json(rt_requests_t *rs) { return rt_outlen_json(rs->outlen); }
