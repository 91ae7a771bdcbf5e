/* router.c — tandem-router: the public API (tandem.v1) in front of the
 * prefill and decode workers (DESIGN.md §1).
 *
 * This file is the process and its gRPC front: it owns the router's state
 * (router_t, private to it), starts its parts — membership from etcd, the
 * cache index (follow.c), the reservation renewer (renewer.c), the request
 * pipeline (request.c), the HTTP front door (http.c), metrics (metrics.c),
 * the planner (planner.c) — handing each what it uses, and serves the
 * tandem.v1 handlers. A Generate call becomes a transport-neutral request
 * (request.h) whose sink writes to the call; the handler returns its thread
 * at once and the request runs on the router's pool and the RPC
 * completion-queue threads. */
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
#include "common/ops.h"
#include "kvstore/status.h"
#include "router/keys.h"
#include "router/follow.h"
#include "common/grow.h"
#include "common/log.h"
#include "common/process.h"
#include "common/service.h"
#include "common/rpc_pb.h"
#include "common/rpc.h"
#include "engine/model.h"
#include "router/http.h"
#include "router/input.h"
#include "router/metrics.h"
#include "router/placement.h"
#include "router/planner.h"
#include "router/renewer.h"
#include "router/choices.h"
#include "router/request.h"
#include "router/stats.h"
#include "tandem/internal/v1/worker.pb-c.h"
#include "tandem/v1/tandem.pb-c.h"

#define RT_POOL_THREADS 32 /* steps that wait on a worker (reserve, prefill) at once */

typedef struct router {
    rt_input_t input;                /* the model's tokenizer and chat template */
    rt_table_t table;                /* the workers, from etcd */
    const rt_placement_ops_t *place; /* router.placement */
    rt_kvindex_t *index;             /* the cache index (router/kvindex.h) */
    struct rt_follow *follow;        /* keeps it (router/follow.h) */
    td_etcd_t *etcd;
    td_etcd_watch_t *watch;
    td_config_t cfg;         /* the file, then the flags over it; validated */
    td_rpc_tls_t tls_files;  /* the internal planes' mutual TLS (cluster section) */
    const td_rpc_tls_t *tls; /* &tls_files, or NULL under cluster.plaintext */
    rt_keys_t *api_keys, *admin_keys; /* router.api_keys, router.admin_keys (NULL: none) */
    td_pool_t *pool;         /* runs the requests' steps that wait (placement, reserve, prefill) */
    rt_renewer_t *renewer;
    rt_stats_t *stats;
    rt_requests_t *requests;
    rt_planner_t *planner;
    rt_metrics_t metrics;         /* Prometheus (router/metrics.h) */
    rt_metrics_src_t metrics_src; /* what its scrapes read */
    td_rpc_server_t *srv;         /* the public gRPC API */
    rt_http_t *http;              /* the OpenAI HTTP API (NULL: router.http_listen is empty) */
    char self_addr[160], self_id[200]; /* where its API is; its id (router@ADDR) in etcd and the planner */
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
    td_status_t rc = td_etcd_connect(r->cfg.etcd.endpoints, r->tls, &r->etcd);
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

/* ---------------------------------------------------------------- Generate over gRPC */

/* The gRPC sink of a request: its call, and the buffer each response is
 * packed into (reused: no allocation per token once large enough). */
typedef struct grpc_sink {
    td_rpc_call_t *call;
    rt_choices_t *choices;
    uint8_t *buf;
    size_t cap;
} grpc_sink_t;

static void g_sent(void *ctx, bool ok) { rt_choices_sent(ctx, ok); }

static td_status_t g_emit(void *ctx, rt_request_t *q, const Tandem__V1__GenerateResponse *m)
{
    (void)q; /* its write is reported to the choices it belongs to */
    grpc_sink_t *g = ctx;
    size_t n = tandem__v1__generate_response__get_packed_size(m);
    if (!td_grow((void **)&g->buf, &g->cap, n + 1, 1, 512))
        return TD_ERR_NO_MEMORY;
    tandem__v1__generate_response__pack(m, g->buf);
    return td_rpc_call_send_async(g->call, g->buf, n, g_sent, g->choices);
}

static void g_end(void *ctx, int code, const char *message, uint32_t retry_after_ms, const char *rejected)
{
    grpc_sink_t *g = ctx;
    if (retry_after_ms) { /* an early rejection: when to try again, as trailing metadata */
        char v[16];
        snprintf(v, sizeof v, "%u", retry_after_ms);
        td_rpc_call_set_trailer(g->call, "retry-after-ms", v);
    }
    if (rejected)
        td_rpc_call_set_trailer(g->call, "rejected-early", rejected);
    td_rpc_call_finish(g->call, code, "%s", message);
    td_rpc_call_done(g->call); /* waits for a cancel callback under way */
    free(g->buf);
    free(g);
}

static void g_cancel(void *ctx, bool ok)
{
    (void)ok;
    rt_choices_cancel(ctx);
}

static const rt_sink_t grpc_sink = {.emit = g_emit, .end = g_end};

static void h_generate(void *ctx, td_rpc_call_t *call)
{
    router_t *r = ctx;
    Tandem__V1__GenerateRequest *rq =
        (Tandem__V1__GenerateRequest *)td_rpc_request_pb(call, &tandem__v1__generate_request__descriptor);
    if (!rq) {
        rt_stats_count(r->stats, false, -1, -1, -1);
        return;
    }
    const rt_key_t *key = NULL;
    if (r->api_keys) { /* as the HTTP API: "authorization: Bearer KEY" */
        char auth[256], msg[256];
        double retry_s;
        bool has = td_rpc_call_metadata(call, "authorization", auth, sizeof auth);
        int kc = rt_keys_admit(r->api_keys, has ? auth : NULL, &key, msg, sizeof msg, &retry_s);
        if (kc) {
            tandem__v1__generate_request__free_unpacked(rq, NULL);
            if (retry_s > 0) {
                char ms[24];
                snprintf(ms, sizeof ms, "%.0f", retry_s * 1e3 + 0.5);
                td_rpc_call_set_trailer(call, "retry-after-ms", ms);
            }
            TD_WARN("router: Generate from %s refused: %s", td_rpc_call_peer(call), msg);
            td_rpc_call_finish(call, kc, "%s", msg);
            rt_stats_count(r->stats, false, -1, -1, -1);
            return;
        }
    }
    grpc_sink_t *g = calloc(1, sizeof *g);
    rt_choices_t *q = g ? rt_choices_create(r->requests, rq, td_rpc_call_time_left(call), &grpc_sink, g) : NULL;
    if (!q) {
        if (!g)
            tandem__v1__generate_request__free_unpacked(rq, NULL);
        free(g);
        td_rpc_call_finish(call, TD_RPC_RESOURCE_EXHAUSTED, "the router holds %u requests at once, its most "
                           "(router.max_streams), or has no memory; try again later", r->cfg.router.max_streams);
        rt_stats_count(r->stats, false, -1, -1, -1);
        return;
    }
    g->call = call;
    g->choices = q;
    rt_choices_set_key(q, key);
    td_rpc_call_detach(call); /* the request ends it (g_end) */
    td_rpc_call_on_cancel(call, g_cancel, q);
    rt_choices_start(q);
}

/* ---------------------------------------------------------------- the rest */

static void h_tokenize(void *ctx, td_rpc_call_t *call)
{
    router_t *r = ctx;
    Tandem__V1__TokenizeRequest *rq =
        (Tandem__V1__TokenizeRequest *)td_rpc_request_pb(call, &tandem__v1__tokenize_request__descriptor);
    if (!rq)
        return;
    char err[600];
    int32_t *ids = NULL;
    size_t n_ids = 0;
    td_status_t rc = rt_tokenize_input(&r->input, rq->input_case == TANDEM__V1__TOKENIZE_REQUEST__INPUT_TEXT ? rq->text : NULL,
                                    rq->input_case == TANDEM__V1__TOKENIZE_REQUEST__INPUT_CHAT ? rq->chat : NULL,
                                    rq->parse_special, rq->add_bos, &ids, &n_ids, err, sizeof err);
    if (rc) {
        td_rpc_call_finish(call, td_rpc_code_of(rc), "%s", err);
    } else {
        Tandem__V1__TokenizeResponse tr = TANDEM__V1__TOKENIZE_RESPONSE__INIT;
        tr.n_token_ids = n_ids;
        tr.token_ids = ids;
        td_rpc_reply_pb(call, &tr.base);
    }
    free(ids);
    tandem__v1__tokenize_request__free_unpacked(rq, NULL);
}

static void h_list_models(void *ctx, td_rpc_call_t *call)
{
    router_t *r = ctx;
    Tandem__V1__ModelInfo mi = TANDEM__V1__MODEL_INFO__INIT;
    mi.id = (char *)rt_input_name(&r->input);
    mi.family = r->input.model->desc.family;
    mi.has_context_length = mi.has_vocab_size = mi.has_prefill_workers = mi.has_decode_workers = 1;
    mi.context_length = r->input.model->desc.context;
    mi.vocab_size = r->input.model->desc.vocab;
    rt_table_counts(&r->table, &mi.prefill_workers, &mi.decode_workers);
    Tandem__V1__ModelInfo *list[1] = {&mi};
    Tandem__V1__ListModelsResponse lr = TANDEM__V1__LIST_MODELS_RESPONSE__INIT;
    lr.n_models = 1;
    lr.models = list;
    td_rpc_reply_pb(call, &lr.base);
}

/* For `tandem status`: the nodes and routers registered in etcd, and SLO
 * attainment over the last minute against the ops config's SLOs (the config
 * file's when etcd holds none). */
static void cluster_json(router_t *r, json_t *j)
{
    static const struct { const char *key, *prefix; } lists[] = {{"nodes", TD_OPS_NODES_PREFIX},
                                                                 {"routers", "/tandem/routers/"}};
    for (size_t i = 0; i < 2; i++) {
        td_etcd_kvs_t kvs = {0};
        json_t *a = json_array();
        if (td_etcd_get(r->etcd, lists[i].prefix, true, &kvs) == TD_OK) {
            for (size_t k = 0; k < kvs.n; k++) {
                json_t *v = json_loadb((const char *)kvs.kv[k].value, kvs.kv[k].value_len, 0, NULL);
                if (!json_is_object(v)) {
                    json_decref(v);
                    v = json_object();
                }
                json_object_set_new(v, "key", json_string(kvs.kv[k].key + strlen(lists[i].prefix)));
                json_array_append_new(a, v);
            }
        }
        td_etcd_kvs_free(&kvs);
        json_object_set_new(j, lists[i].key, a);
    }
    double ttft = r->cfg.router.ttft_slo_ms, tpot = r->cfg.router.tpot_slo_ms, target = 0.9;
    td_etcd_kvs_t kvs = {0};
    td_ops_t *ops = NULL;
    if (td_etcd_get(r->etcd, TD_OPS_KEY, false, &kvs) == TD_OK && kvs.n &&
        td_ops_parse((const char *)kvs.kv[0].value, kvs.kv[0].value_len, "etcd " TD_OPS_KEY, &ops) == TD_OK) {
        ttft = ops->slo.ttft_ms;
        tpot = ops->slo.tpot_ms;
        target = ops->slo.attainment;
    }
    td_ops_free(ops);
    td_etcd_kvs_free(&kvs);
    rt_slo_window_t w;
    rt_stats_window(r->stats, td_now_s() - 60, ttft, tpot, &w);
    json_t *slo = json_pack("{s:i, s:f, s:f, s:f, s:i, s:i, s:f, s:f}", "window_s", 60, "ttft_ms", ttft, "tpot_ms", tpot,
                            "target", target, "requests", (int)w.n, "met", (int)w.met, "ttft_p90_ms", w.ttft_p90_ms,
                            "tpot_p90_ms", w.tpot_p90_ms);
    if (w.n)
        json_object_set_new(slo, "attainment", json_real((double)w.met / w.n));
    json_object_set_new(j, "slo", slo);
}

/* For `tandem status`: each worker's KV pool and load as its Stats says
 * (0.5 s each at most; a worker that does not answer says so). */
static json_t *pools_json(router_t *r)
{
    rt_worker_t *w[64];
    size_t n = 0;
    pthread_mutex_lock(&r->table.mu);
    for (size_t i = 0; i < r->table.n && n < 64; i++)
        if (!r->table.w[i]->refused && !r->table.w[i]->gone && r->table.w[i]->ch) {
            w[n] = r->table.w[i];
            w[n++]->refs++; /* kept until rt_table_unhold */
        }
    pthread_mutex_unlock(&r->table.mu);
    /* every worker's Stats at once: a frozen or unreachable one costs its 0.5 s once, not once each */
    td_rpc_unary_pb_call_t calls[64];
    Tandem__Internal__V1__StatsRequest rq = TANDEM__INTERNAL__V1__STATS_REQUEST__INIT;
    for (size_t i = 0; i < n; i++)
        calls[i] = (td_rpc_unary_pb_call_t){.ch = w[i]->ch, .method = w[i]->role == RT_PREFILL
                                                                          ? "/tandem.internal.v1.Prefill/Stats"
                                                                          : "/tandem.internal.v1.Decode/Stats",
                                            .msg = &rq.base, .desc = &tandem__internal__v1__stats_response__descriptor};
    td_rpc_unary_all_pb(calls, n, 0.5);
    json_t *a = json_array();
    for (size_t i = 0; i < n; i++) {
        Tandem__Internal__V1__StatsResponse *st = (Tandem__Internal__V1__StatsResponse *)calls[i].reply;
        json_t *o = json_pack("{s:s, s:s}", "id", w[i]->id, "role", w[i]->role == RT_PREFILL ? "prefill" : "decode");
        if (st)
            json_object_update_new(o, json_pack("{s:i, s:i, s:i, s:i, s:i}", "kv_blocks", (int)st->kv_blocks,
                                                "kv_in_use", (int)st->kv_in_use, "kv_cached", (int)st->kv_cached,
                                                "running", (int)st->running, "reservations", (int)st->reservations));
        if (st && st->has_prompt_tokens_computed) /* what its engine computed, not taken from a cache */
            json_object_update_new(o, json_pack("{s:I, s:I, s:I}", "prompt_tokens_computed",
                                                (json_int_t)st->prompt_tokens_computed, "preemptions",
                                                (json_int_t)st->preemptions, "swapped_out",
                                                (json_int_t)st->swapped_out));
        else
            json_object_set_new(o, "error", json_string(calls[i].res.message));
        json_array_append_new(a, o);
        if (st)
            tandem__internal__v1__stats_response__free_unpacked(st, NULL);
        rt_table_unhold(&r->table, w[i]);
    }
    return a;
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
    json_t *j = json_pack("{s:i, s:i}", "prefill_workers", (int)np, "decode_workers", (int)nd);
    rt_stats_json(r->stats, j);
    json_object_set_new(j, "refused", refused);
    cluster_json(r, j);
    json_object_set_new(j, "pools", pools_json(r));
    json_object_set_new(j, "planner", rt_planner_json(r->planner));
    if (r->requests) {
        json_object_set_new(j, "tenants", rt_requests_fair_json(r->requests));
        json_object_set_new(j, "output_length", rt_requests_outlen_json(r->requests));
    }
    json_object_set_new(j, "placement", rt_table_metrics(&r->table, r->place));
    if (r->follow)
        json_object_set_new(j, "index", rt_follow_json(r->follow));
    /* the KV store as kvstore-status shows it: per node tiers, hit rate, replicas */
    json_t *kv = NULL;
    if (kv_status_collect(r->etcd, r->tls, 0.5, &kv) == TD_OK)
        json_object_set_new(j, "kvstore", kv);
    else
        json_object_set_new(j, "kvstore_error", json_string(td_last_error()));
    char *detail = json_dumps(j, JSON_COMPACT);
    json_decref(j);
    Tandem__V1__HealthResponse hr = TANDEM__V1__HEALTH_RESPONSE__INIT;
    hr.has_status = 1;
    hr.status = rt_table_serving(&r->table) ? TANDEM__V1__HEALTH_RESPONSE__STATUS__STATUS_SERVING
                         : TANDEM__V1__HEALTH_RESPONSE__STATUS__STATUS_NOT_SERVING;
    hr.detail = detail ? detail : "";
    td_rpc_reply_pb(call, &hr.base);
    free(detail);
}

/* Scale is an administrator's call: one that shows a client certificate
 * named "admin" (a router with tls_client_ca), or sends one of
 * router.admin_keys as "authorization: Bearer KEY" — never one let in by the
 * address it comes from (any local user shares the loopback). */
static bool admin_peer(router_t *r, td_rpc_call_t *call)
{
    if (!strcmp(td_rpc_call_identity(call), "admin"))
        return true;
    char auth[256], msg[256];
    const rt_key_t *k;
    double retry_s;
    return r->admin_keys && td_rpc_call_metadata(call, "authorization", auth, sizeof auth) &&
           rt_keys_admit(r->admin_keys, auth, &k, msg, sizeof msg, &retry_s) == 0;
}

static void h_scale(void *ctx, td_rpc_call_t *call)
{
    router_t *r = ctx;
    if (!admin_peer(r, call)) {
        TD_WARN("router: Scale from %s refused: not an administrator", td_rpc_call_peer(call));
        td_rpc_call_finish(call, TD_RPC_PERMISSION_DENIED, "Scale: %s is not an administrator (send a key of "
                           "router.admin_keys, tandem scale --admin-key FILE, or show a client certificate named "
                           "\"admin\")", td_rpc_call_peer(call));
        return;
    }
    Tandem__V1__ScaleRequest *rq = (Tandem__V1__ScaleRequest *)td_rpc_request_pb(call, &tandem__v1__scale_request__descriptor);
    if (!rq)
        return;
    td_ops_t *ops = NULL;
    char *text = NULL;
    int code = TD_RPC_OK;
    char msg[640] = "";
    td_etcd_kvs_t kvs = {0};
    if (rq->ops_yaml && (rq->has_prefill || rq->has_decode)) {
        code = TD_RPC_INVALID_ARGUMENT;
        snprintf(msg, sizeof msg, "Scale: ops_yaml or prefill + decode, not both");
    } else if (rq->ops_yaml) {
        if (td_ops_parse(rq->ops_yaml, strlen(rq->ops_yaml), "ops_yaml", &ops)) {
            code = TD_RPC_INVALID_ARGUMENT;
            snprintf(msg, sizeof msg, "Scale: %s", td_last_error());
        }
    } else if (rq->has_prefill && rq->has_decode) {
        /* the ops config in force (or the defaults) with fixed counts for this model */
        static const char defaults[] = "models: [{name: \"*\"}]";
        if (td_etcd_get(r->etcd, TD_OPS_KEY, false, &kvs)) {
            code = TD_RPC_UNAVAILABLE;
            snprintf(msg, sizeof msg, "Scale: etcd: %s", td_last_error());
        } else if (kvs.n ? td_ops_parse((const char *)kvs.kv[0].value, kvs.kv[0].value_len, "etcd " TD_OPS_KEY, &ops)
                         : td_ops_parse(defaults, strlen(defaults), "defaults", &ops)) {
            code = TD_RPC_FAILED_PRECONDITION;
            snprintf(msg, sizeof msg, "Scale: the ops config in etcd: %s", td_last_error());
        } else if (td_ops_set_counts(ops, rt_input_name(&r->input), r->input.model->desc.name, rq->prefill, rq->decode)) {
            code = TD_RPC_INVALID_ARGUMENT;
            snprintf(msg, sizeof msg, "Scale: %s", td_last_error());
        }
    } else {
        code = TD_RPC_INVALID_ARGUMENT;
        snprintf(msg, sizeof msg, "Scale: give ops_yaml, or prefill and decode");
    }
    if (!code && td_ops_format(ops, &text)) {
        code = TD_RPC_INTERNAL;
        snprintf(msg, sizeof msg, "Scale: %s", td_last_error());
    }
    if (!code && td_etcd_put(r->etcd, TD_OPS_KEY, text, strlen(text), 0)) {
        code = TD_RPC_UNAVAILABLE;
        snprintf(msg, sizeof msg, "Scale: cannot keep the ops config in etcd: %s", td_last_error());
    }
    tandem__v1__scale_request__free_unpacked(rq, NULL);
    td_etcd_kvs_free(&kvs);
    td_ops_free(ops);
    if (code) {
        free(text);
        td_rpc_call_finish(call, code, "%s", msg);
        return;
    }
    TD_INFO("router: ops config applied by %s", td_rpc_call_peer(call));
    rt_planner_poke(r->planner);
    json_t *pj = rt_planner_json(r->planner);
    char *desired = json_object_get(pj, "desired") ? json_dumps(json_object_get(pj, "desired"), JSON_COMPACT) : NULL;
    json_decref(pj);
    Tandem__V1__ScaleResponse sr = TANDEM__V1__SCALE_RESPONSE__INIT;
    sr.ops_yaml = text;
    sr.desired = desired ? desired : "";
    td_rpc_reply_pb(call, &sr.base);
    free(desired);
    free(text);
}

/* The router's own record (/tandem/routers/ID, leased): where its API and
 * its metrics are, for `tandem status` and Prometheus's targets. */
static td_status_t record(router_t *r, char *key, size_t key_len, char **value)
{
    json_t *j = json_pack("{s:s, s:s, s:s, s:i}", "id", r->self_id, "addr", r->self_addr, "metrics",
                          r->metrics.bound, "pid", (int)getpid());
    *value = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
    snprintf(key, key_len, "/tandem/routers/%s", r->self_id);
    return *value ? TD_OK : td_error(TD_ERR_NO_MEMORY, "router: no memory for its etcd record");
}

static const char router_usage[] =
    "usage: tandem-router [--config FILE] [FLAG VALUE]...\n"
    "  each flag sets the config key it stands beside below (docs/configuration.md), over the file\n";

/* configured (common/service.h): the API keys' files read. */
static td_status_t configured(void *ctx)
{
    router_t *r = ctx;
    td_status_t rc;
    if ((r->cfg.router.api_keys[0] && (rc = rt_keys_load(r->cfg.router.api_keys, "router.api_keys", &r->api_keys))) ||
        (r->cfg.router.admin_keys[0] &&
         (rc = rt_keys_load(r->cfg.router.admin_keys, "router.admin_keys", &r->admin_keys))))
        return rc;
    if (!r->api_keys)
        TD_WARN("router.api_keys is not set: the public API (gRPC and HTTP) takes requests without an API key");
    return TD_OK;
}

/* The parts that serve requests: the worker table and placement, the
 * cache index and its follower, the pool, the renewer, the statistics, the
 * request pipeline's objects and metrics. */
static td_status_t parts_start(router_t *r)
{
    const eng_model_desc_t *md = &r->input.model->desc;
    eng_weight_hold_t hold = ENG_WEIGHTS_FILE;
    eng_weight_hold_parse(r->cfg.model.weights, &hold); /* validated */
    eng_model_set_hold(r->input.model, hold);
    eng_model_set_dummy(r->input.model, !strcmp(r->cfg.model.load_format, "dummy"));
    td_kv_layout_t expect = td_kv_layout_make(r->input.model->kv_id, md->n_layers, md->n_kv_heads, md->head_dim,
                                              r->cfg.model.block_tokens, TD_KV_F16);
    td_kv_dtype_parse(r->cfg.model.kv_dtype, &expect.dtype); /* validated */
    rt_table_init(&r->table, &expect, r->tls);
    r->place = rt_placement_by_name(r->cfg.router.placement); /* validated */
    td_status_t rc = rt_kvindex_create(r->cfg.router.index_max_blocks, &r->index);
    if (rc)
        return rc;
    r->table.ix = r->index;
    /* a queued step per request at most: the queue holds every request the router admits */
    if ((rc = td_pool_create("router", RT_POOL_THREADS, (size_t)r->cfg.router.max_streams + 64, &r->pool)) ||
        (rc = rt_renewer_start(&r->table, &r->renewer)) || (rc = rt_stats_create(&r->stats)) ||
        (rc = membership_start(r)) ||
        (rc = rt_follow_start(&r->table, r->index, r->etcd, r->tls, r->cfg.router.index_drop_events, &r->follow)))
        return rc;
    r->metrics_src = (rt_metrics_src_t){.table = &r->table, .place = r->place, .follow = r->follow, .etcd = r->etcd};
    if ((rc = rt_metrics_start(&r->metrics, md->name, r->cfg.metrics.listen, r->tls, &r->metrics_src)))
        return rc;
    rt_env_t env = {.input = &r->input, .table = &r->table, .place = r->place, .pool = r->pool,
                    .renewer = r->renewer, .stats = r->stats, .metrics = &r->metrics, .api_keys = r->api_keys,
                    .max_streams = r->cfg.router.max_streams, .default_max_tokens = 128,
                    .ttft_slo_ms = r->cfg.router.ttft_slo_ms, .tpot_slo_ms = r->cfg.router.tpot_slo_ms,
                    .early_reject = r->cfg.router.early_reject,
                    .admit_max = r->cfg.router.admit_max, .tenant_queue_max = r->cfg.router.tenant_queue_max,
                    .chain_root = td_block_name_root(expect.model_id, td_kv_dtype_name(expect.dtype),
                                                     expect.block_tokens)};
    return rt_requests_create(&env, &r->requests);
}

/* start (common/service.h): the model's tokenizer, the parts, the public
 * gRPC API, the OpenAI HTTP API, the planner. */
static td_status_t router_start(void *ctx, char *key, size_t key_len, char **value)
{
    router_t *r = ctx;
    td_status_t rc;
    if ((rc = rt_input_open(r->cfg.model.path, r->cfg.router.served_model_names, &r->input)) || (rc = parts_start(r)))
        return rc;
    int port;
    const char *cert = r->cfg.router.tls_cert, *tkey = r->cfg.router.tls_key, *cca = r->cfg.router.tls_client_ca;
    if ((cert[0] || tkey[0] || cca[0]) && !(cert[0] && tkey[0]))
        return td_error(TD_ERR_CONFIG, "router: TLS needs both tls_cert and tls_key (tls_client_ca is optional)");
    td_rpc_tls_t tls = {.cert_file = cert, .key_file = tkey, .ca_file = cca};
    if ((rc = td_rpc_server_create(r->cfg.router.listen, cert[0] ? &tls : NULL, &r->srv)) ||
        (rc = td_rpc_server_add(r->srv, "/tandem.v1.Tandem/Generate", h_generate, r)) ||
        (rc = td_rpc_server_add(r->srv, "/tandem.v1.Tandem/Tokenize", h_tokenize, r)) ||
        (rc = td_rpc_server_add(r->srv, "/tandem.v1.Tandem/ListModels", h_list_models, r)) ||
        (rc = td_rpc_server_add(r->srv, "/tandem.v1.Tandem/Health", h_health, r)) ||
        (rc = td_rpc_server_add(r->srv, "/tandem.v1.Tandem/Scale", h_scale, r)))
        return rc;
    td_rpc_server_set_max_calls(r->srv, (int)r->cfg.router.max_streams);
    td_rpc_server_set_max_message(r->srv, RT_MAX_REQUEST_BYTES);
    td_rpc_server_set_threads(r->srv, 4); /* its handlers return at once: a Generate runs on the router's pool */
    if ((rc = td_rpc_server_start(r->srv, &port)))
        return rc;
    int http_port = 0;
    if (r->cfg.router.http_listen[0] &&
        (rc = rt_http_start(r->requests, r->cfg.router.http_listen, cert[0] ? &tls : NULL, &r->http, &http_port)))
        return rc;
    td_rpc_advertise_addr(r->cfg.router.listen, port, r->self_addr, sizeof r->self_addr);
    snprintf(r->self_id, sizeof r->self_id, "router@%s", r->self_addr);
    rt_planner_cfg_t pc = {.id = r->self_id, .model = rt_input_name(&r->input), .alias = r->input.model->desc.name,
                           .etcd_endpoints = r->cfg.etcd.endpoints, .lease_ttl_s = r->cfg.etcd.lease_ttl_s,
                           .tls = r->tls, .stats = r->stats, .table = &r->table};
    if ((rc = rt_planner_start(&pc, &r->planner)))
        return rc;
    __atomic_store_n(&r->metrics_src.planner, r->planner, __ATOMIC_RELEASE); /* scrapes may run already */
    char http_at[32] = "none";
    if (r->http)
        snprintf(http_at, sizeof http_at, "port %d", http_port);
    TD_INFO("router serving %s on port %d%s, OpenAI HTTP on %s, metrics on %s (etcd %s, placement %s)",
            rt_input_name(&r->input), port, !cert[0] ? "" : cca[0] ? " with mutual TLS" : " with TLS", http_at,
            r->metrics.bound[0] ? r->metrics.bound : "none", r->cfg.etcd.endpoints, r->place->name);
    return record(r, key, key_len, value);
}

/* registered (common/service.h): placement asks the membership whether
 * etcd was just away; NULL before it is left. */
static void router_registered(void *ctx, td_member_t *member)
{
    router_t *r = ctx;
    pthread_mutex_lock(&r->table.mu);
    r->table.member = member;
    pthread_mutex_unlock(&r->table.mu);
}

/* stop (common/service.h): out of the membership already; the planner
 * resigns, the follower, the HTTP API and the gRPC API stop (every request
 * ends with its call), then the parts; any part start() did not make is
 * skipped. */
static void router_stop(void *ctx)
{
    router_t *r = ctx;
    rt_metrics_unserve(&r->metrics); /* no scrape reads the planner or the follower while they stop */
    rt_planner_stop(r->planner); /* resigns: another router plans */
    r->planner = NULL;
    rt_follow_stop(r->follow); /* first: it may wait on etcd or a source until its deadline */
    r->follow = NULL;
    rt_http_stop(r->http); /* its requests cancelled and ended (they need the pool) */
    if (r->srv)
        td_rpc_server_stop(r->srv, 10); /* every request ends with its call */
    td_pool_destroy(r->pool);
    td_rpc_server_destroy(r->srv);
    rt_metrics_stop(&r->metrics);
    rt_requests_destroy(r->requests);
    rt_renewer_stop(r->renewer);
    rt_stats_destroy(r->stats);
    td_etcd_watch_stop(r->watch);
    td_etcd_destroy(r->etcd);
    if (r->place) /* the table was made */
        rt_table_fini(&r->table);
    rt_kvindex_destroy(r->index);
    if (r->input.model)
        rt_input_close(&r->input);
    rt_keys_free(r->api_keys);
    rt_keys_free(r->admin_keys);
}

int main(int argc, char **argv)
{
    static router_t r;
    rt_placement_register_names(); /* before the config is read: router.placement's names */
    const td_service_t service = {.prog = "tandem-router", .section = "router", .procs = TD_PROC_ROUTER,
                                  .usage = router_usage,
                                  .cfg = &r.cfg, .tls_files = &r.tls_files, .tls = &r.tls, .ctx = &r,
                                  .configured = configured, .start = router_start, .registered = router_registered,
                                  .stop = router_stop};
    return td_service_main(&service, argc, argv);
}
