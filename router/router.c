/* router.c — tandem-router: the public API (tandem.v1) in front of the
 * prefill and decode workers (DESIGN.md §1).
 *
 * Each Generate runs in its own handler thread: validate (an error names the
 * field), apply the chat template and tokenize, then reserve landing blocks
 * on a decode worker, have a prefill worker compute the prompt and push its KV
 * there, and relay the decode worker's token stream. Upstream calls are made
 * with the client's call as parent, so the client's deadline and cancellation
 * reach the workers by themselves. A worker that fails is skipped for a while
 * and the request goes on elsewhere: a failed prefill is redone, a decode
 * stream that breaks is resumed by re-prefilling the prompt plus the tokens
 * already streamed — within the request's deadline, after which the client
 * gets DEADLINE_EXCEEDED, never a hang. */
#define _GNU_SOURCE
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/config.h"
#include "common/etcd.h"
#include "common/kv_contract_pb.h"
#include "common/pb_arena.h"
#include "common/log.h"
#include "common/process.h"
#include "common/rpc.h"
#include "engine/chat.h"
#include "engine/model.h"
#include "engine/sampler.h"
#include "engine/sampling_pb.h"
#include "engine/tokenizer.h"
#include "router/placement.h"
#include "tandem/internal/v1/worker.pb-c.h"
#include "tandem/v1/tandem.pb-c.h"

#define MAX_PROMPT_BYTES (1u << 20)
#define OVERHEAD_RING 4096

/* Reservations this router holds (reserved on a decode worker, not yet
 * claimed by a Decode or released). Their leases are short and renewed
 * every second, so a router that dies leaves them for one lease at most. A
 * fixed table: a request that finds it full is refused at admission. */
#define RES_LEASE_MS 3000
#define RES_RENEW_S 1.0
#define MAX_HELD 4096

typedef struct held_res {
    rt_worker_t *d;
    uint64_t id;
} held_res_t;

typedef struct router {
    eng_model_t *model;
    eng_chat_t chat;
    bool has_chat;
    rt_table_t table;
    const rt_placement_ops_t *place;
    td_etcd_t *etcd;
    td_etcd_watch_t *watch;
    td_config_t cfg; /* the file, then the flags over it; validated (router.tls_*: TLS on the public API) */
    uint32_t default_max_tokens;
    pthread_mutex_t mu;
    uint64_t n_requests, n_errors, n_ok;
    double overhead[OVERHEAD_RING]; /* seconds of router work per request (wall clock) */
    double overhead_cpu[OVERHEAD_RING]; /* the same sections in the handler thread's CPU time */
    size_t n_overhead;
    /* reservation renewal (held_*: under held_mu) */
    pthread_mutex_t held_mu;
    pthread_cond_t held_cv;
    held_res_t held[MAX_HELD];
    size_t n_held;
    pthread_t renewer;
    bool renewer_running, renewer_stop;
} router_t;


/* ---------------------------------------------------------------- etcd */

static void on_watch(void *ctx, bool put, const td_etcd_kv_t *kv)
{
    router_t *r = ctx;
    if (put)
        rt_table_put(&r->table, kv->key, (const char *)kv->value);
    else
        rt_table_remove(&r->table, kv->key);
}

/* The watch fell behind a compaction: the membership as it is now. */
static void on_resync(void *ctx, const td_etcd_kvs_t *now)
{
    router_t *r = ctx;
    const char **keys = calloc(now->n + 1, sizeof *keys);
    if (!keys)
        return;
    for (size_t i = 0; i < now->n; i++)
        keys[i] = now->kv[i].key;
    rt_table_retain(&r->table, keys, now->n);
    free(keys);
    for (size_t i = 0; i < now->n; i++)
        rt_table_put(&r->table, now->kv[i].key, (const char *)now->kv[i].value);
}

static td_status_t membership_start(router_t *r)
{
    td_status_t rc = td_etcd_connect(r->cfg.etcd.endpoints, NULL, &r->etcd);
    td_etcd_kvs_t kvs = {0};
    if (!rc)
        rc = td_etcd_get(r->etcd, "/tandem/workers/", true, &kvs); /* waits for etcd up to its deadline */
    if (rc)
        return rc;
    for (size_t i = 0; i < kvs.n; i++)
        rt_table_put(&r->table, kvs.kv[i].key, (const char *)kvs.kv[i].value);
    int64_t rev = kvs.revision;
    td_etcd_kvs_free(&kvs);
    return td_etcd_watch_start(r->etcd, "/tandem/workers/", rev + 1, on_watch, on_resync, r, &r->watch);
}

/* ---------------------------------------------------------------- helpers */

static void reply_pb(td_rpc_call_t *call, const ProtobufCMessage *m)
{
    size_t n = protobuf_c_message_get_packed_size(m);
    uint8_t *b = malloc(n ? n : 1);
    if (!b) {
        td_rpc_call_finish(call, TD_RPC_RESOURCE_EXHAUSTED, "no memory");
        return;
    }
    protobuf_c_message_pack(m, b);
    td_rpc_call_reply(call, b, n);
    free(b);
}

static td_status_t send_pb(td_rpc_call_t *call, const ProtobufCMessage *m)
{
    uint8_t stack[2048];
    size_t n = protobuf_c_message_get_packed_size(m);
    uint8_t *b = n <= sizeof stack ? stack : malloc(n);
    if (!b)
        return TD_ERR_NO_MEMORY;
    protobuf_c_message_pack(m, b);
    td_status_t rc = td_rpc_call_send(call, b, n);
    if (b != stack)
        free(b);
    return rc;
}

/* Renders and tokenizes the input; an error (INVALID_ARGUMENT) names the field. */
static td_status_t tokenize_input(router_t *r, const char *prompt, const Tandem__V1__ChatInput *chat, bool parse_special,
                                  bool add_bos, int32_t **ids, size_t *n, char *err, size_t errcap)
{
    char *text = NULL;
    const char *input = prompt;
    unsigned flags = add_bos ? ENG_TOK_ADD_BOS : 0;
    if (chat) {
        if (!r->has_chat) {
            snprintf(err, errcap, "chat: the model %s has no chat template; send a prompt", r->model->desc.name);
            return TD_ERR_INVALID_ARG;
        }
        if (!chat->n_messages) {
            snprintf(err, errcap, "chat.messages: empty");
            return TD_ERR_INVALID_ARG;
        }
        eng_chat_msg_t *msgs = calloc(chat->n_messages, sizeof *msgs);
        if (!msgs)
            return TD_ERR_NO_MEMORY;
        size_t bytes = 0;
        for (size_t i = 0; i < chat->n_messages; i++) {
            msgs[i].role = chat->messages[i]->role ? chat->messages[i]->role : "";
            msgs[i].content = chat->messages[i]->content ? chat->messages[i]->content : "";
            bytes += strlen(msgs[i].content);
        }
        bool agp = chat->has_add_generation_prompt ? chat->add_generation_prompt
                                                   : strcmp(msgs[chat->n_messages - 1].role, "assistant") != 0;
        td_status_t rc = bytes > MAX_PROMPT_BYTES ? TD_ERR_INVALID_ARG
                                                  : eng_chat_render(&r->chat, msgs, chat->n_messages, agp, &text);
        free(msgs);
        if (rc) {
            if (bytes > MAX_PROMPT_BYTES)
                snprintf(err, errcap, "chat.messages: %zu bytes of content, more than the limit of %u", bytes,
                         MAX_PROMPT_BYTES);
            else
                snprintf(err, errcap, "chat.messages: %s", td_last_error());
            return TD_ERR_INVALID_ARG;
        }
        input = text;
        flags |= ENG_TOK_PARSE_SPECIAL;
    } else {
        if (!prompt || !prompt[0]) {
            snprintf(err, errcap, "prompt: empty (set prompt or chat)");
            return TD_ERR_INVALID_ARG;
        }
        if (strlen(prompt) > MAX_PROMPT_BYTES) {
            snprintf(err, errcap, "prompt: %zu bytes, more than the limit of %u", strlen(prompt), MAX_PROMPT_BYTES);
            return TD_ERR_INVALID_ARG;
        }
        if (parse_special)
            flags |= ENG_TOK_PARSE_SPECIAL;
    }
    size_t cap = 0;
    *ids = NULL;
    td_status_t rc = eng_tokenizer_encode(r->model->tok, input, strlen(input), flags, ids, &cap, n);
    free(text);
    if (rc)
        snprintf(err, errcap, "%s: %s", chat ? "chat" : "prompt", td_last_error());
    return rc;
}

static void count(router_t *r, bool ok, double overhead, double cpu)
{
    pthread_mutex_lock(&r->mu);
    r->n_requests++;
    if (ok)
        r->n_ok++;
    else
        r->n_errors++;
    if (overhead >= 0) {
        r->overhead_cpu[r->n_overhead % OVERHEAD_RING] = cpu;
        r->overhead[r->n_overhead++ % OVERHEAD_RING] = overhead;
    }
    pthread_mutex_unlock(&r->mu);
}

/* ---------------------------------------------------------------- Generate */

typedef struct gen {
    router_t *r;
    td_rpc_call_t *call;
    Tandem__V1__GenerateRequest *rq;
    int32_t *tokens; /* prompt, then the tokens streamed so far */
    size_t n_prompt, n_tokens, cap_tokens;
    uint32_t max_tokens, cached;
    double t0, c0, deadline, t_first, t_last, overhead, cpu; /* cpu: overhead in thread CPU time */
    char prefill_id[96], decode_id[96];
    uint64_t text_sent; /* bytes of text relayed to the client, all attempts */
    int internal_errors; /* attempts a worker ended with INTERNAL */
    bool sent_any;
} gen_t;

static double cpu_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (double)t.tv_sec + t.tv_nsec * 1e-9;
}

static double left(const gen_t *g) { return g->deadline - td_now_s(); }

static bool fatal_code(int code)
{
    return code == TD_RPC_INVALID_ARGUMENT || code == TD_RPC_CANCELLED || code == TD_RPC_DEADLINE_EXCEEDED;
}

/* Starts renewing reservation id on d; false when the table is full. */
static bool held_add(router_t *r, rt_worker_t *d, uint64_t id)
{
    pthread_mutex_lock(&r->held_mu);
    bool ok = r->n_held < MAX_HELD;
    if (ok)
        r->held[r->n_held++] = (held_res_t){d, id};
    pthread_mutex_unlock(&r->held_mu);
    return ok;
}

static void held_remove(router_t *r, rt_worker_t *d, uint64_t id)
{
    pthread_mutex_lock(&r->held_mu);
    for (size_t i = 0; i < r->n_held; i++)
        if (r->held[i].d == d && r->held[i].id == id) {
            r->held[i] = r->held[--r->n_held];
            break;
        }
    pthread_mutex_unlock(&r->held_mu);
}

/* Every RES_RENEW_S: one Renew per decode worker for the reservations held
 * on it (each call bounded by 0.5 s, so one slow worker delays the others'
 * renewals by that much at most, well within the lease). */
static void *renewer_thread(void *arg)
{
    router_t *r = arg;
    static held_res_t snap[MAX_HELD];
    static uint64_t ids[MAX_HELD];
    static bool sent[MAX_HELD];
    pthread_mutex_lock(&r->held_mu);
    while (!r->renewer_stop) {
        struct timespec until = td_wall_deadline(RES_RENEW_S);
        pthread_cond_timedwait(&r->held_cv, &r->held_mu, &until);
        if (r->renewer_stop)
            break;
        size_t n = r->n_held;
        memcpy(snap, r->held, n * sizeof *snap);
        for (size_t i = 0; i < n; i++) { /* the holder may finish meanwhile: keep the record alive */
            rt_table_hold(&r->table, snap[i].d);
            sent[i] = false;
        }
        pthread_mutex_unlock(&r->held_mu);
        for (size_t i = 0; i < n; i++) {
            if (sent[i])
                continue;
            rt_worker_t *d = snap[i].d;
            size_t k = 0;
            for (size_t j = i; j < n; j++)
                if (snap[j].d == d) {
                    ids[k++] = snap[j].id;
                    sent[j] = true;
                }
            Tandem__Internal__V1__RenewRequest rq = TANDEM__INTERNAL__V1__RENEW_REQUEST__INIT;
            rq.n_reservation_ids = k;
            rq.reservation_ids = ids;
            rq.has_lease_ms = 1;
            rq.lease_ms = RES_LEASE_MS;
            size_t pn = tandem__internal__v1__renew_request__get_packed_size(&rq);
            uint8_t *buf = malloc(pn ? pn : 1), *out = NULL;
            size_t on;
            td_rpc_result_t res;
            if (buf) {
                tandem__internal__v1__renew_request__pack(&rq, buf);
                if (td_rpc_unary(d->ch, "/tandem.internal.v1.Decode/Renew", buf, pn, 0.5, NULL, &out, &on, &res))
                    TD_DEBUG("router: renewing %zu reservations on %s: %s", k, d->id, res.message);
            }
            free(buf);
            free(out);
        }
        for (size_t i = 0; i < n; i++)
            rt_table_unhold(&r->table, snap[i].d);
        pthread_mutex_lock(&r->held_mu);
    }
    pthread_mutex_unlock(&r->held_mu);
    return NULL;
}

/* Reserve on D; 1 done, 0 try again, -1 give up (res says why). */
static int reserve(gen_t *g, rt_worker_t *d, Tandem__Internal__V1__LandingDescriptor **land, td_rpc_result_t *res)
{
    Tandem__Internal__V1__ReserveRequest rq = TANDEM__INTERNAL__V1__RESERVE_REQUEST__INIT;
    Tandem__Internal__V1__KvContract c;
    td_kv_layout_to_pb(&g->r->table.expect, &c);
    rq.contract = &c;
    rq.has_n_tokens = rq.has_max_tokens = rq.has_lease_ms = 1;
    rq.n_tokens = (uint32_t)g->n_tokens;
    rq.max_tokens = g->max_tokens;
    double l = left(g);
    rq.lease_ms = RES_LEASE_MS; /* renewed while held (renewer_thread) */
    uint8_t buf[512];
    size_t n = tandem__internal__v1__reserve_request__pack(&rq, buf);
    uint8_t *out;
    size_t on;
    td_status_t rc = td_rpc_unary(d->ch, "/tandem.internal.v1.Decode/Reserve", buf, n, fmin(l, 5.0), g->call, &out,
                                  &on, res);
    if (rc)
        return fatal_code(res->code) && res->code != TD_RPC_DEADLINE_EXCEEDED ? -1 : 0;
    Tandem__Internal__V1__ReserveResponse *rp = tandem__internal__v1__reserve_response__unpack(NULL, on, out);
    free(out);
    if (!rp || !rp->landing) {
        if (rp)
            tandem__internal__v1__reserve_response__free_unpacked(rp, NULL);
        snprintf(res->message, sizeof res->message, "decode worker %s: bad ReserveResponse", d->id);
        return 0;
    }
    *land = rp->landing;
    rp->landing = NULL;
    tandem__internal__v1__reserve_response__free_unpacked(rp, NULL);
    return 1;
}

static void release(gen_t *g, rt_worker_t *d, uint64_t id)
{
    Tandem__Internal__V1__ReleaseRequest rq = TANDEM__INTERNAL__V1__RELEASE_REQUEST__INIT;
    rq.has_reservation_id = 1;
    rq.reservation_id = id;
    uint8_t buf[32];
    size_t n = tandem__internal__v1__release_request__pack(&rq, buf);
    uint8_t *out = NULL;
    size_t on;
    td_rpc_result_t res;
    (void)g;
    if (td_rpc_unary(d->ch, "/tandem.internal.v1.Decode/Release", buf, n, 2.0, NULL, &out, &on, &res) == TD_OK)
        free(out);
}

static Tandem__V1__SamplingParams *sampling_for(gen_t *g, Tandem__V1__SamplingParams *copy)
{
    static const Tandem__V1__SamplingParams none = TANDEM__V1__SAMPLING_PARAMS__INIT;
    *copy = g->rq->sampling ? *g->rq->sampling : none;
    copy->has_max_tokens = 1;
    copy->max_tokens = g->max_tokens - (uint32_t)(g->n_tokens - g->n_prompt);
    return copy;
}

/* One attempt: reserve, prefill, decode-relay. Returns 1 when the request
 * ended (finished or failed for good: status sent), 0 to try again. */
static int attempt(gen_t *g)
{
    router_t *r = g->r;
    double t_a = td_now_s(), c_a = cpu_s();
    rt_placement_t pl;
    rt_table_place(&r->table, r->place, g->tokens, g->n_tokens, &pl);
    if (pl.code) {
        /* nothing can serve it: say why now, unless a worker becomes usable before the deadline (its
         * suspect time ends) or, for a stream already under way, a worker may still join to resume it */
        double until = pl.retry_at ? pl.retry_at : g->sent_any ? g->deadline : 0;
        if (until <= td_now_s() && !pl.retry_at) {
            td_rpc_call_finish(g->call, pl.code, "%s", pl.why);
            return 1;
        }
        if (until >= g->deadline && !g->sent_any) {
            td_rpc_call_finish(g->call, pl.code, "%s (the deadline comes first)", pl.why);
            return 1;
        }
        /* woken by the table (a worker joined, left or failed), capped at 1 s to see a cancel */
        rt_table_wait(&r->table, fmin(fmin(until, g->deadline), td_now_s() + 1.0));
        if (td_rpc_call_cancelled(g->call)) {
            td_rpc_call_finish(g->call, TD_RPC_CANCELLED, "the client cancelled");
            return 1;
        }
        return 0;
    }
    rt_worker_t *d = pl.decode, *p = pl.prefill;
    g->overhead += td_now_s() - t_a;
    g->cpu += cpu_s() - c_a;
    /* the records may be freed once released (rt_table_done): messages use copies */
    char pid[sizeof p->id], did[sizeof d->id];
    memcpy(pid, p->id, sizeof pid);
    memcpy(did, d->id, sizeof did);
    Tandem__Internal__V1__LandingDescriptor *land = NULL;
    td_rpc_result_t res = {0};
    int rv = reserve(g, d, &land, &res);
    if (rv <= 0) {
        /* the client's own deadline or cancel says nothing about the worker's health; a full pool
         * is load, not a fault: the worker is skipped only briefly */
        bool own = left(g) <= 0.001 || td_rpc_call_cancelled(g->call);
        double skip = res.code == TD_RPC_FAILED_PRECONDITION ? 60 : res.code == TD_RPC_RESOURCE_EXHAUSTED ? 0.1 : 2;
        rt_table_done(&r->table, d, !own ? &res : NULL, skip);
        rt_table_done(&r->table, p, NULL, 0);
        if (rv < 0) {
            td_rpc_call_finish(g->call, res.code, "decode worker %s: %s", did, res.message);
            return 1;
        }
        TD_WARN("router: reserve on %s failed (%s: %s); trying elsewhere", did, td_rpc_code_name(res.code),
                res.message);
        return 0;
    }
    uint64_t res_id = land->reservation_id;
    if (!held_add(r, d, res_id)) {
        release(g, d, res_id);
        tandem__internal__v1__landing_descriptor__free_unpacked(land, NULL);
        rt_table_done(&r->table, d, NULL, 0);
        rt_table_done(&r->table, p, NULL, 0);
        td_rpc_call_finish(g->call, TD_RPC_RESOURCE_EXHAUSTED, "the router holds %d reservations, its most; try "
                           "again later", MAX_HELD);
        return 1;
    }
    /* prefill the prompt (plus what was streamed already, on a resume) */
    double t_b = td_now_s(), c_b = cpu_s();
    Tandem__V1__SamplingParams sp;
    Tandem__Internal__V1__PrefillRequest prq = TANDEM__INTERNAL__V1__PREFILL_REQUEST__INIT;
    prq.request_id = g->rq->request_id;
    prq.n_tokens = g->n_tokens;
    prq.tokens = g->tokens;
    prq.sampling = sampling_for(g, &sp);
    prq.landing = land;
    prq.has_sampled_before = 1;
    prq.sampled_before = (uint32_t)(g->n_tokens - g->n_prompt); /* streamed before a resume */
    size_t pn = tandem__internal__v1__prefill_request__get_packed_size(&prq);
    uint8_t *pbuf = malloc(pn);
    if (pbuf)
        tandem__internal__v1__prefill_request__pack(&prq, pbuf);
    g->overhead += td_now_s() - t_b;
    g->cpu += cpu_s() - c_b;
    uint8_t *out = NULL;
    size_t on = 0;
    td_status_t rc = pbuf ? td_rpc_unary(p->ch, "/tandem.internal.v1.Prefill/Prefill", pbuf, pn, left(g), g->call, &out,
                                         &on, &res)
                          : TD_ERR_NO_MEMORY;
    free(pbuf);
    Tandem__Internal__V1__PrefillResponse *prp = rc ? NULL : tandem__internal__v1__prefill_response__unpack(NULL, on, out);
    free(out);
    tandem__internal__v1__landing_descriptor__free_unpacked(land, NULL);
    if (!prp) {
        held_remove(r, d, res_id);
        release(g, d, res_id);
        rt_table_done(&r->table, d, NULL, 0);
        bool cancelled = td_rpc_call_cancelled(g->call);
        rt_table_done(&r->table, p, !cancelled && !fatal_code(res.code) ? &res : NULL,
                      res.code == TD_RPC_FAILED_PRECONDITION ? 60 : 2);
        if (cancelled) {
            td_rpc_call_finish(g->call, TD_RPC_CANCELLED, "the client cancelled");
            return 1;
        }
        if (fatal_code(res.code) || left(g) <= 0) {
            td_rpc_call_finish(g->call, res.code ? res.code : TD_RPC_DEADLINE_EXCEEDED, "prefill worker %s: %s", pid,
                               res.message);
            return 1;
        }
        TD_WARN("router: prefill on %s failed (%s: %s); trying again", pid, td_rpc_code_name(res.code), res.message);
        return 0;
    }
    snprintf(g->prefill_id, sizeof g->prefill_id, "%s", pid);
    snprintf(g->decode_id, sizeof g->decode_id, "%s", did);
    if (g->n_tokens == g->n_prompt)
        g->cached = prp->cached_tokens;
    int32_t first = prp->first_token;
    double prefill_ms = (td_now_s() - t_b) * 1e3;
    rt_table_hold(&r->table, p); /* for rt_table_observe once the stream is done */
    rt_table_done(&r->table, p, NULL, 0);

    /* the completion notice: decode joins its batch and streams */
    double t_c = td_now_s(), c_c = cpu_s();
    Tandem__Internal__V1__DecodeRequest drq = TANDEM__INTERNAL__V1__DECODE_REQUEST__INIT;
    drq.request_id = g->rq->request_id;
    drq.has_reservation_id = drq.has_first_token = 1;
    drq.reservation_id = res_id;
    drq.n_tokens = g->n_tokens;
    drq.tokens = g->tokens;
    drq.first_token = first;
    drq.has_sampled_before = 1;
    drq.sampled_before = (uint32_t)(g->n_tokens - g->n_prompt) + 1; /* and the first token */
    drq.has_resume_generated = drq.has_resume_text_sent = 1;
    drq.resume_generated = (uint32_t)(g->n_tokens - g->n_prompt);
    drq.resume_text_sent = g->text_sent;
    drq.sampling = sampling_for(g, &sp);
    drq.n_block_digests = prp->n_block_digests;
    drq.block_digests = prp->block_digests;
    pn = tandem__internal__v1__decode_request__get_packed_size(&drq);
    pbuf = malloc(pn);
    if (pbuf)
        tandem__internal__v1__decode_request__pack(&drq, pbuf);
    tandem__internal__v1__prefill_response__free_unpacked(prp, NULL);
    td_rpc_stream_t *st = NULL;
    rc = pbuf ? td_rpc_stream_open(d->ch, "/tandem.internal.v1.Decode/Decode", pbuf, pn, left(g), g->call, &st)
              : TD_ERR_NO_MEMORY;
    free(pbuf);
    held_remove(r, d, res_id); /* the Decode claims it (or, failing, its lease runs out) */
    g->overhead += td_now_s() - t_c;
    g->cpu += cpu_s() - c_c;
    bool finished = false;
    _Alignas(16) uint8_t pb_mem[8192]; /* each DecodeResponse unpacks here: no allocation per token */
    td_pb_arena_t arena;
    td_pb_arena_init(&arena, pb_mem, sizeof pb_mem);
    while (!rc) {
        const uint8_t *m;
        size_t ml;
        td_status_t rr = td_rpc_stream_read(st, &m, &ml, fmax(left(g), 0.01));
        if (rr)
            break;
        double t_m = td_now_s(), c_m = cpu_s();
        td_pb_arena_reset(&arena);
        Tandem__Internal__V1__DecodeResponse *dr = tandem__internal__v1__decode_response__unpack(&arena.a, ml, m);
        if (!dr)
            break;
        for (size_t i = 0; i < dr->n_token_ids && g->n_tokens < g->cap_tokens; i++)
            g->tokens[g->n_tokens++] = dr->token_ids[i];
        Tandem__V1__GenerateResponse gr = TANDEM__V1__GENERATE_RESPONSE__INIT;
        gr.request_id = g->rq->request_id;
        gr.text = dr->text;
        if (g->rq->return_token_ids) {
            gr.n_token_ids = dr->n_token_ids;
            gr.token_ids = dr->token_ids;
        }
        Tandem__V1__Usage usage = TANDEM__V1__USAGE__INIT;
        Tandem__V1__Timing timing = TANDEM__V1__TIMING__INIT;
        double t = td_now_s();
        if (dr->n_token_ids) {
            if (!g->t_first)
                g->t_first = t;
            g->t_last = t;
        }
        if (dr->has_finish_reason) {
            finished = true;
            gr.has_finish_reason = 1;
            gr.finish_reason = dr->finish_reason;
            gr.error = dr->error;
            usage.has_prompt_tokens = usage.has_completion_tokens = usage.has_cached_prompt_tokens = 1;
            usage.prompt_tokens = (uint32_t)g->n_prompt;
            usage.completion_tokens = (uint32_t)(g->n_tokens - g->n_prompt);
            usage.cached_prompt_tokens = g->cached;
            gr.usage = &usage;
            uint32_t gen = usage.completion_tokens;
            timing.has_ttft_ms = timing.has_tpot_ms = timing.has_e2e_ms = timing.has_queue_ms = 1;
            timing.ttft_ms = ((g->t_first ? g->t_first : t) - g->t0) * 1e3;
            timing.tpot_ms = gen > 1 ? (g->t_last - g->t_first) * 1e3 / (gen - 1) : 0;
            timing.e2e_ms = (t - g->t0) * 1e3;
            timing.queue_ms = 0;
            timing.prefill_worker = g->prefill_id;
            timing.decode_worker = g->decode_id;
            gr.timing = &timing;
        }
        td_status_t sr = TD_OK;
        if (gr.text[0] || gr.n_token_ids || finished) {
            sr = send_pb(g->call, &gr.base);
            g->sent_any = true;
            if (!sr)
                g->text_sent += strlen(gr.text);
        }
        tandem__internal__v1__decode_response__free_unpacked(dr, &arena.a);
        g->overhead += td_now_s() - t_m;
    g->cpu += cpu_s() - c_m;
        if (sr || finished)
            break;
    }
    td_rpc_result_t sres = {0};
    if (st) {
        if (!finished)
            td_rpc_stream_cancel(st);
        td_rpc_stream_result(st, 2.0, &sres);
        td_rpc_stream_destroy(st);
    }
    bool cancelled = td_rpc_call_cancelled(g->call);
    double now = td_now_s();
    rt_timings_t tm = {.prefill_ms = prefill_ms, .ttft_ms = ((g->t_first ? g->t_first : now) - g->t0) * 1e3,
                       .e2e_ms = (now - g->t0) * 1e3, .prompt_tokens = (uint32_t)g->n_prompt,
                       .cached_tokens = g->cached, .output_tokens = (uint32_t)(g->n_tokens - g->n_prompt),
                       .ok = finished};
    tm.tpot_ms = tm.output_tokens > 1 ? (g->t_last - g->t_first) * 1e3 / (tm.output_tokens - 1) : 0;
    rt_table_observe(&r->table, r->place, p, d, &tm);
    rt_table_unhold(&r->table, p);
    rt_table_done(&r->table, d, !finished && !cancelled && !fatal_code(sres.code) ? &sres : NULL, 2);
    if (finished) {
        td_rpc_call_finish(g->call, TD_RPC_OK, NULL);
        return 1;
    }
    if (cancelled) {
        td_rpc_call_finish(g->call, TD_RPC_CANCELLED, "the client cancelled");
        return 1;
    }
    if (left(g) <= 0 || sres.code == TD_RPC_DEADLINE_EXCEEDED) {
        td_rpc_call_finish(g->call, TD_RPC_DEADLINE_EXCEEDED, "the deadline passed after %zu tokens",
                           g->n_tokens - g->n_prompt);
        return 1;
    }
    if (fatal_code(sres.code)) {
        td_rpc_call_finish(g->call, sres.code, "decode worker %s: %s", did, sres.message);
        return 1;
    }
    /* a worker's own error (a landing refused by its check) is tried again
     * on a fresh prefill, but not until the deadline */
    if (sres.code == TD_RPC_INTERNAL && ++g->internal_errors >= 3) {
        td_rpc_call_finish(g->call, sres.code, "decode worker %s, 3 attempts: %s", did, sres.message);
        return 1;
    }
    TD_WARN("router: the decode stream on %s broke after %zu tokens (%s: %s); resuming elsewhere", did,
            g->n_tokens - g->n_prompt, td_rpc_code_name(sres.code), sres.message);
    return 0;
}

static void h_generate(void *ctx, td_rpc_call_t *call)
{
    router_t *r = ctx;
    gen_t g = {.r = r, .call = call, .t0 = td_now_s(), .c0 = cpu_s()};
    size_t n;
    const uint8_t *p = td_rpc_call_payload(call, &n);
    char err[600];
    g.rq = tandem__v1__generate_request__unpack(NULL, n, p);
    if (!g.rq) {
        td_rpc_call_finish(call, TD_RPC_INVALID_ARGUMENT, "GenerateRequest does not parse");
        count(r, false, -1, -1);
        return;
    }
    Tandem__V1__GenerateRequest *rq = g.rq;
    int code = TD_RPC_INVALID_ARGUMENT;
    err[0] = 0;
    if (rq->model && rq->model[0] && strcmp(rq->model, r->model->desc.name)) {
        snprintf(err, sizeof err, "model: '%s' is not served here (this router serves '%s')", rq->model,
                 r->model->desc.name);
        code = TD_RPC_NOT_FOUND;
        goto fail;
    }
    if (rq->input_case == TANDEM__V1__GENERATE_REQUEST__INPUT__NOT_SET) {
        snprintf(err, sizeof err, "input: set prompt or chat");
        goto fail;
    }
    int32_t *ids = NULL;
    size_t n_ids = 0;
    td_status_t rc = tokenize_input(r, rq->input_case == TANDEM__V1__GENERATE_REQUEST__INPUT_PROMPT ? rq->prompt : NULL,
                                    rq->input_case == TANDEM__V1__GENERATE_REQUEST__INPUT_CHAT ? rq->chat : NULL,
                                    false, true, &ids, &n_ids, err, sizeof err);
    if (rc) {
        code = td_rpc_code_of(rc);
        goto fail;
    }
    const Tandem__V1__SamplingParams *sp = rq->sampling;
    g.max_tokens = sp && sp->max_tokens ? sp->max_tokens : r->default_max_tokens;
    uint32_t ctxlen = r->model->desc.context ? r->model->desc.context : 4096;
    if (n_ids + g.max_tokens > ctxlen) {
        snprintf(err, sizeof err, "%s: %zu prompt tokens + max_tokens %u exceed the context of %u tokens",
                 n_ids >= ctxlen ? "prompt" : "sampling.max_tokens", n_ids, g.max_tokens, ctxlen);
        free(ids);
        goto fail;
    }
    eng_sampling_t es;
    eng_logit_bias_t *bias = calloc(sp && sp->n_logit_bias ? sp->n_logit_bias : 1, sizeof *bias);
    if (!bias) {
        free(ids);
        code = TD_RPC_RESOURCE_EXHAUSTED;
        snprintf(err, sizeof err, "no memory");
        goto fail;
    }
    eng_sampling_from_pb(sp, &es, bias);
    rc = eng_sampling_validate(&es, (int32_t)r->model->desc.vocab);
    free(bias);
    if (rc) {
        snprintf(err, sizeof err, "sampling: %s", td_last_error());
        free(ids);
        goto fail;
    }
    for (size_t i = 0; sp && i < sp->n_stop; i++)
        if (!sp->stop[i][0]) {
            snprintf(err, sizeof err, "sampling.stop[%zu]: empty", i);
            free(ids);
            goto fail;
        }
    g.cap_tokens = n_ids + g.max_tokens + 1;
    g.tokens = malloc(g.cap_tokens * sizeof *g.tokens);
    if (!g.tokens) {
        free(ids);
        code = TD_RPC_RESOURCE_EXHAUSTED;
        snprintf(err, sizeof err, "no memory");
        goto fail;
    }
    memcpy(g.tokens, ids, n_ids * sizeof *ids);
    free(ids);
    g.n_prompt = g.n_tokens = n_ids;
    double dl = td_rpc_call_time_left(call);
    if (rq->deadline_ms && rq->deadline_ms / 1e3 < dl)
        dl = rq->deadline_ms / 1e3;
    if (dl > 3600)
        dl = 3600;
    g.deadline = g.t0 + dl;
    g.overhead = td_now_s() - g.t0;
    g.cpu = cpu_s() - g.c0;
    while (!attempt(&g)) {
        if (td_rpc_call_cancelled(call)) {
            td_rpc_call_finish(call, TD_RPC_CANCELLED, "the client cancelled");
            break;
        }
        if (left(&g) <= 0) {
            uint32_t np, nd;
            rt_table_counts(&r->table, &np, &nd);
            td_rpc_call_finish(call, np && nd ? TD_RPC_DEADLINE_EXCEEDED : TD_RPC_UNAVAILABLE,
                               "no answer within the deadline (%zu tokens made; %u prefill and %u decode workers usable)",
                               g.n_tokens - g.n_prompt, np, nd);
            break;
        }
    }
    count(r, true, g.overhead, g.cpu);
    free(g.tokens);
    tandem__v1__generate_request__free_unpacked(rq, NULL);
    return;
fail:
    td_rpc_call_finish(call, code, "%s", err);
    count(r, false, -1, -1);
    tandem__v1__generate_request__free_unpacked(rq, NULL);
}

/* ---------------------------------------------------------------- the rest */

static void h_tokenize(void *ctx, td_rpc_call_t *call)
{
    router_t *r = ctx;
    size_t n;
    const uint8_t *p = td_rpc_call_payload(call, &n);
    Tandem__V1__TokenizeRequest *rq = tandem__v1__tokenize_request__unpack(NULL, n, p);
    if (!rq) {
        td_rpc_call_finish(call, TD_RPC_INVALID_ARGUMENT, "TokenizeRequest does not parse");
        return;
    }
    char err[600];
    int32_t *ids = NULL;
    size_t n_ids = 0;
    td_status_t rc = tokenize_input(r, rq->input_case == TANDEM__V1__TOKENIZE_REQUEST__INPUT_TEXT ? rq->text : NULL,
                                    rq->input_case == TANDEM__V1__TOKENIZE_REQUEST__INPUT_CHAT ? rq->chat : NULL,
                                    rq->parse_special, rq->add_bos, &ids, &n_ids, err, sizeof err);
    if (rc) {
        td_rpc_call_finish(call, td_rpc_code_of(rc), "%s", err);
    } else {
        Tandem__V1__TokenizeResponse tr = TANDEM__V1__TOKENIZE_RESPONSE__INIT;
        tr.n_token_ids = n_ids;
        tr.token_ids = ids;
        reply_pb(call, &tr.base);
    }
    free(ids);
    tandem__v1__tokenize_request__free_unpacked(rq, NULL);
}

static void h_list_models(void *ctx, td_rpc_call_t *call)
{
    router_t *r = ctx;
    Tandem__V1__ModelInfo mi = TANDEM__V1__MODEL_INFO__INIT;
    mi.id = r->model->desc.name;
    mi.family = r->model->desc.family;
    mi.has_context_length = mi.has_vocab_size = mi.has_prefill_workers = mi.has_decode_workers = 1;
    mi.context_length = r->model->desc.context;
    mi.vocab_size = r->model->desc.vocab;
    rt_table_counts(&r->table, &mi.prefill_workers, &mi.decode_workers);
    Tandem__V1__ModelInfo *list[1] = {&mi};
    Tandem__V1__ListModelsResponse lr = TANDEM__V1__LIST_MODELS_RESPONSE__INIT;
    lr.n_models = 1;
    lr.models = list;
    reply_pb(call, &lr.base);
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static void h_health(void *ctx, td_rpc_call_t *call)
{
    router_t *r = ctx;
    uint32_t np, nd;
    rt_table_counts(&r->table, &np, &nd);
    json_t *refused = json_array();
    pthread_mutex_lock(&r->table.mu);
    for (size_t i = 0; i < r->table.n; i++)
        if (r->table.w[i]->refused)
            json_array_append_new(refused, json_pack("{s:s, s:s}", "id", r->table.w[i]->id, "why",
                                                     r->table.w[i]->refused_why));
    pthread_mutex_unlock(&r->table.mu);
    pthread_mutex_lock(&r->mu);
    size_t no = r->n_overhead < OVERHEAD_RING ? r->n_overhead : OVERHEAD_RING;
    double *o = malloc((no ? no : 1) * sizeof *o);
    double *oc = malloc((no ? no : 1) * sizeof *oc);
    if (o)
        memcpy(o, r->overhead, no * sizeof *o);
    if (oc)
        memcpy(oc, r->overhead_cpu, no * sizeof *oc);
    json_t *j = json_pack("{s:i, s:i, s:I, s:I, s:I}", "prefill_workers", (int)np, "decode_workers", (int)nd,
                          "requests", (json_int_t)r->n_requests, "ok", (json_int_t)r->n_ok, "errors",
                          (json_int_t)r->n_errors);
    pthread_mutex_unlock(&r->mu);
    if (o && no) {
        qsort(o, no, sizeof *o, cmp_double);
        json_object_set_new(j, "overhead_ms_p50", json_real(o[no / 2] * 1e3));
        json_object_set_new(j, "overhead_ms_p99", json_real(o[(size_t)(0.99 * (double)(no - 1))] * 1e3));
        json_object_set_new(j, "overhead_ms_max", json_real(o[no - 1] * 1e3));
    }
    if (oc && no) {
        qsort(oc, no, sizeof *oc, cmp_double);
        json_object_set_new(j, "overhead_cpu_ms_p50", json_real(oc[no / 2] * 1e3));
        json_object_set_new(j, "overhead_cpu_ms_p99", json_real(oc[(size_t)(0.99 * (double)(no - 1))] * 1e3));
    }
    free(o);
    free(oc);
    json_object_set_new(j, "refused", refused);
    char *detail = json_dumps(j, JSON_COMPACT);
    json_decref(j);
    Tandem__V1__HealthResponse hr = TANDEM__V1__HEALTH_RESPONSE__INIT;
    hr.has_status = 1;
    hr.status = np && nd ? TANDEM__V1__HEALTH_RESPONSE__STATUS__STATUS_SERVING
                         : TANDEM__V1__HEALTH_RESPONSE__STATUS__STATUS_NOT_SERVING;
    hr.detail = detail ? detail : "";
    reply_pb(call, &hr.base);
    free(detail);
}

/* Each flag sets one config key: the YAML is the source of truth. */
static const td_flag_t router_flags[] = {
    {"--model", "model.path"},           {"--listen", "router.listen"},     {"--etcd", "etcd.endpoints"},
    {"--block-tokens", "model.block_tokens"}, {"--kv-dtype", "model.kv_dtype"}, {"--tls-cert", "router.tls_cert"},
    {"--tls-key", "router.tls_key"},     {"--tls-client-ca", "router.tls_client_ca"},
    {"--max-streams", "router.max_streams"},
};

static const char router_usage[] =
    "usage: tandem-router [--config FILE] [--model PATH] [--listen HOST:PORT] [--etcd HOST:PORT]\n"
    "                     [--block-tokens N] [--kv-dtype fp16|fp32] [--tls-cert PEM --tls-key PEM [--tls-client-ca PEM]]\n"
    "                     [--max-streams N]\n"
    "  every flag but --config sets a key of the config file (deploy/tandem.yaml), which it overrides\n";

static int parse_args(router_t *r, int argc, char **argv)
{
    r->default_max_tokens = 128;
    return td_config_from_args(&r->cfg, "tandem-router", "router", router_flags,
                               sizeof router_flags / sizeof router_flags[0], NULL, NULL, NULL, router_usage, argc, argv);
}

int main(int argc, char **argv)
{
    td_process_init("tandem-router");
    static router_t r;
    pthread_mutex_init(&r.mu, NULL);
    int code = parse_args(&r, argc, argv);
    if (code) {
        td_config_free(&r.cfg);
        td_rpc_shutdown();
        return code;
    }
    code = 1;
    td_rpc_server_t *srv = NULL;
    if (eng_model_open(r.cfg.model.path, &r.model))
        goto out;
    r.has_chat = eng_chat_init(&r.chat, r.model->tok) == TD_OK;
    td_clear_error();
    td_kv_layout_t expect = td_kv_layout_make(r.model->desc.name, r.model->desc.n_layers, r.model->desc.n_kv_heads,
                                              r.model->desc.head_dim, r.cfg.model.block_tokens, TD_KV_F16);
    td_kv_dtype_parse(r.cfg.model.kv_dtype, &expect.dtype); /* validated */
    rt_table_init(&r.table, &expect);
    r.place = &rt_placement_least_loaded;
    pthread_mutex_init(&r.held_mu, NULL);
    pthread_cond_init(&r.held_cv, NULL);
    if (pthread_create(&r.renewer, NULL, renewer_thread, &r)) {
        td_error(TD_ERR_INTERNAL, "router: cannot start the reservation renewer");
        goto out;
    }
    r.renewer_running = true;
    if (membership_start(&r))
        goto out;
    int port;
    const char *cert = r.cfg.router.tls_cert, *key = r.cfg.router.tls_key, *cca = r.cfg.router.tls_client_ca;
    if ((cert[0] || key[0] || cca[0]) && !(cert[0] && key[0])) {
        td_error(TD_ERR_CONFIG, "router: TLS needs both tls_cert and tls_key (tls_client_ca is optional)");
        goto out;
    }
    td_rpc_tls_t tls = {.cert_file = cert, .key_file = key, .ca_file = cca};
    if (td_rpc_server_create(r.cfg.router.listen, cert[0] ? &tls : NULL, &srv) ||
        td_rpc_server_add(srv, "/tandem.v1.Tandem/Generate", h_generate, &r) ||
        td_rpc_server_add(srv, "/tandem.v1.Tandem/Tokenize", h_tokenize, &r) ||
        td_rpc_server_add(srv, "/tandem.v1.Tandem/ListModels", h_list_models, &r) ||
        td_rpc_server_add(srv, "/tandem.v1.Tandem/Health", h_health, &r))
        goto out;
    td_rpc_server_set_max_calls(srv, (int)r.cfg.router.max_streams);
    if (td_rpc_server_start(srv, &port))
        goto out;
    TD_INFO("router serving %s on port %d%s (etcd %s, placement %s)", r.model->desc.name, port,
            !cert[0] ? "" : cca[0] ? " with mutual TLS" : " with TLS", r.cfg.etcd.endpoints, r.place->name);
    td_process_run(NULL, NULL);
    TD_INFO("router: stopping (signal %d)", td_process_stop_signal());
    code = 0;
out:
    if (code)
        fprintf(stderr, "tandem-router: %s\n", td_last_error());
    if (srv) {
        td_rpc_server_stop(srv, 10);
        td_rpc_server_destroy(srv);
    }
    if (r.renewer_running) {
        pthread_mutex_lock(&r.held_mu);
        r.renewer_stop = true;
        pthread_cond_broadcast(&r.held_cv);
        pthread_mutex_unlock(&r.held_mu);
        pthread_join(r.renewer, NULL);
    }
    td_etcd_watch_stop(r.watch);
    td_etcd_destroy(r.etcd);
    if (r.has_chat)
        eng_chat_free(&r.chat);
    eng_model_close(r.model);
    td_config_free(&r.cfg);
    td_rpc_shutdown();
    return code;
}
