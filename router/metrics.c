/* metrics.c — see metrics.h. */
#include "router/metrics.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/etcd.h"
#include "common/log.h"
#include "common/rpc.h"
#include "router/follow.h"
#include "router/planner.h"

static const double error_ratio[] = {0.01, 0.025, 0.05, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 10.0};

static double num(json_t *o, const char *key)
{
    json_t *v = json_object_get(o, key);
    return json_is_number(v) ? json_number_value(v) : 0;
}

static void set(td_metrics_t *m, td_metric_kind_t kind, const char *name, const char *help, const char *lk,
                const char *lv, double v)
{
    char l[160] = "";
    if (lk)
        td_metrics_label(l, sizeof l, lk, lv);
    td_metric_set(td_metrics_series(m, kind, name, help, l, NULL, 0), v);
}

/* Before each scrape: the router's own state into the series. */
static void collect(void *ctx, td_metrics_t *m)
{
    const rt_metrics_src_t *r = ctx;
    uint32_t np, nd;
    rt_table_counts(r->table, &np, &nd);
    set(m, TD_GAUGE, "tandem:workers", "Workers in the router's membership, by role.", "worker_role", "prefill", np);
    set(m, TD_GAUGE, "tandem:workers", "Workers in the router's membership, by role.", "worker_role", "decode", nd);
    json_t *pl = rt_table_metrics(r->table, r->place);
    json_t *placed = json_object_get(pl, "placed"), *rej = json_object_get(pl, "rejected");
    static const char *const reasons[] = {"pool_hit", "store_hit", "cold", "colocated", "local"};
    for (int i = 0; i < 5; i++)
        set(m, TD_COUNTER, "tandem:placements_total",
            "Requests placed, by what the prefill worker had cached (colocated: whole on a colocated worker; local: "
            "of those, prefilled there by choice though prefill workers were there).",
            "reason", reasons[i], num(placed, reasons[i]));
    set(m, TD_COUNTER, "tandem:request_rejections_total",
        "Requests rejected early: no pair of workers was predicted to meet the SLO.", "reason", "ttft",
        num(rej, "ttft"));
    set(m, TD_COUNTER, "tandem:request_rejections_total",
        "Requests rejected early: no pair of workers was predicted to meet the SLO.", "reason", "tpot",
        num(rej, "tpot"));
    json_decref(pl);
    struct rt_follow *follow = __atomic_load_n(&r->follow, __ATOMIC_ACQUIRE);
    if (follow) {
        json_t *ix = rt_follow_json(follow);
        set(m, TD_GAUGE, "tandem:cache_index_blocks", "Block names in the router's cache index.", NULL, NULL,
            num(ix, "blocks"));
        set(m, TD_GAUGE, "tandem:cache_index_staleness_seconds",
            "Since the cache index last heard from its most silent source.", NULL, NULL, num(ix, "stale_s_max"));
        json_decref(ix);
    }
    json_t *pj = rt_planner_json(__atomic_load_n(&r->planner, __ATOMIC_ACQUIRE));
    if (json_is_object(pj)) {
        set(m, TD_GAUGE, "tandem:planner_leader", "1 when this router is the elected planner.", NULL, NULL,
            json_is_true(json_object_get(pj, "leader")));
        set(m, TD_COUNTER, "tandem:planner_decisions_total", "Desired worker counts this router's planner wrote.",
            NULL, NULL, num(pj, "decisions"));
        json_t *d = json_object_get(pj, "desired");
        if (d) {
            set(m, TD_GAUGE, "tandem:planner_desired_workers", "The planner's desired workers, by role.",
                "worker_role", "prefill", num(d, "prefill"));
            set(m, TD_GAUGE, "tandem:planner_desired_workers", "The planner's desired workers, by role.",
                "worker_role", "decode", num(d, "decode"));
        }
    }
    json_decref(pj);
}

/* /targets: every process that serves metrics, from its etcd record. */
static char *targets(void *ctx, const char **ctype)
{
    const rt_metrics_src_t *r = ctx;
    *ctype = "application/json";
    static const char *const prefixes[] = {"/tandem/routers/", "/tandem/workers/", "/tandem/kvstores/"};
    json_t *out = json_array();
    for (size_t i = 0; i < 3 && out; i++) {
        td_etcd_kvs_t kvs = {0};
        if (td_etcd_get(r->etcd, prefixes[i], true, &kvs)) {
            json_decref(out);
            return NULL;
        }
        for (size_t k = 0; k < kvs.n; k++) {
            json_t *rec = json_loadb((const char *)kvs.kv[k].value, kvs.kv[k].value_len, 0, NULL);
            const char *at = json_string_value(json_object_get(rec, "metrics")),
                       *id = json_string_value(json_object_get(rec, "id"));
            if (at && at[0])
                json_array_append_new(out, json_pack("{s:[s], s:{s:s}}", "targets", at, "labels", "tandem_id",
                                                     id ? id : kvs.kv[k].key));
            json_decref(rec);
        }
        td_etcd_kvs_free(&kvs);
    }
    char *s = out ? json_dumps(out, JSON_COMPACT) : NULL;
    json_decref(out);
    if (!s)
        td_error(TD_ERR_NO_MEMORY, "targets: no memory");
    return s;
}

td_status_t rt_metrics_start(rt_metrics_t *m, const char *model, const char *listen, const td_rpc_tls_t *tls,
                             const rt_metrics_src_t *src)
{
    td_status_t rc = td_metrics_create(model, "router", &m->reg);
    if (rc)
        return rc;
    const double *lat = td_metrics_latency_s;
    size_t nl = td_metrics_latency_n;
    m->ttft = td_metrics_series(m->reg, TD_HISTOGRAM, "tandem:time_to_first_token_seconds",
                                "Time from a request's arrival to its first token.", NULL, lat, nl);
    m->itl = td_metrics_series(m->reg, TD_HISTOGRAM, "tandem:inter_token_latency_seconds",
                               "Time between a request's tokens as the router relays them.", NULL, lat, nl);
    m->e2e = td_metrics_series(m->reg, TD_HISTOGRAM, "tandem:e2e_request_latency_seconds",
                               "Time from a request's arrival to its end.", NULL, lat, nl);
    m->pred_err = td_metrics_series(m->reg, TD_HISTOGRAM, "tandem:ttft_prediction_error_ratio",
                                    "|predicted - measured| / measured TTFT of placed requests.", NULL, error_ratio,
                                    sizeof error_ratio / sizeof error_ratio[0]);
    m->outlen_err = td_metrics_series(m->reg, TD_HISTOGRAM, "tandem:output_length_prediction_error_ratio",
                                      "|predicted - generated| / generated output tokens of ended requests.", NULL,
                                      error_ratio, sizeof error_ratio / sizeof error_ratio[0]);
    m->running = td_metrics_series(m->reg, TD_GAUGE, "tandem:num_requests_running",
                                   "Requests the router is serving (admitted, not ended).", NULL, NULL, 0);
    m->prompt_tokens = td_metrics_series(m->reg, TD_COUNTER, "tandem:prompt_tokens_total",
                                         "Prompt tokens of requests that were placed.", NULL, NULL, 0);
    m->generation_tokens = td_metrics_series(m->reg, TD_COUNTER, "tandem:generation_tokens_total",
                                             "Tokens generated and relayed.", NULL, NULL, 0);
    m->prefix_queries = td_metrics_series(m->reg, TD_COUNTER, "tandem:prefix_cache_queries_total",
                                          "Prompt tokens looked up in the caches (the prefill pool, then the store).",
                                          NULL, NULL, 0);
    m->prefix_hits = td_metrics_series(m->reg, TD_COUNTER, "tandem:prefix_cache_hits_total",
                                       "Prompt tokens whose KV came from a cache (pool or store).", NULL, NULL, 0);
    m->store_hits = td_metrics_series(m->reg, TD_COUNTER, "tandem:store_cache_hits_total",
                                      "Prompt tokens whose KV the prefill worker fetched from the kvstore.", NULL, NULL,
                                      0);
    for (int c = 0; c < RT_METRICS_CODES; c++) {
        char l[96];
        m->by_code[c] = td_metrics_series(m->reg, TD_COUNTER, "tandem:requests_total", "Requests that ended, by gRPC code.",
                                       td_metrics_label(l, sizeof l, "code", td_rpc_code_name(c)), NULL, 0);
    }
    td_metrics_on_collect(m->reg, collect, (void *)src);
    return td_metrics_serve(m->reg,
                            &(td_metrics_endpoint_t){.listen = listen, .tls = tls, .path = "/targets",
                                                     .page = targets, .ctx = (void *)src},
                            &m->server, m->bound, sizeof m->bound);
}

void rt_metrics_unserve(rt_metrics_t *m)
{
    td_metrics_server_stop(m->server);
    m->server = NULL;
}

void rt_metrics_stop(rt_metrics_t *m)
{
    rt_metrics_unserve(m);
    td_metrics_destroy(m->reg);
    m->reg = NULL;
}

void rt_metrics_request_end(rt_metrics_t *m, int code)
{
    if (code >= 0 && code < RT_METRICS_CODES)
        td_metric_add(m->by_code[code], 1);
}
