/* status.c — the KV store's nodes and their Stats (status.h). */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>

#include "common/log.h"
#include "common/rpc_pb.h"
#include "kvstore/status.h"
#include "tandem/internal/v1/kvstore.pb-c.h"

static json_t *node_json(const char *id, const Tandem__Internal__V1__KvStatsResponse *r)
{
    json_t *j = json_pack("{s:s, s:I, s:I, s:f, s:I, s:I, s:I, s:I, s:i, s:i, s:I, s:I, s:[]}", "id", id, "gets",
                          (json_int_t)r->gets, "hits", (json_int_t)r->hits, "hit_rate",
                          r->gets ? (double)r->hits / (double)r->gets : 0.0, "puts", (json_int_t)r->puts, "stored",
                          (json_int_t)r->stored, "dropped_full", (json_int_t)r->dropped_full, "checksum_errors",
                          (json_int_t)r->checksum_errors, "leases", (int)r->leases, "replicas", (int)r->replicas,
                          "replicas_pushed", (json_int_t)r->replicas_pushed, "replicas_dropped",
                          (json_int_t)r->replicas_dropped, "tiers");
    for (size_t t = 0; j && t < r->n_tiers; t++) {
        const Tandem__Internal__V1__KvTierStats *s = r->tiers[t];
        json_array_append_new(json_object_get(j, "tiers"),
                              json_pack("{s:s, s:I, s:I, s:i, s:I, s:I}", "tier", s->tier ? s->tier : "",
                                        "capacity_bytes", (json_int_t)s->capacity_bytes, "used_bytes",
                                        (json_int_t)s->used_bytes, "blocks", (int)s->blocks, "hits",
                                        (json_int_t)s->hits, "evictions", (json_int_t)s->evictions));
    }
    return j;
}

td_status_t kv_status_collect(td_etcd_t *etcd, const td_rpc_tls_t *tls, double timeout_s, json_t **nodes)
{
    td_etcd_kvs_t kvs = {0};
    td_status_t rc = td_etcd_get(etcd, "/tandem/kvstores/", true, &kvs);
    if (rc)
        return rc;
    /* every node's Stats at once, within the one timeout */
    size_t n = kvs.n;
    td_rpc_unary_pb_call_t *calls = calloc(n ? n : 1, sizeof *calls);
    json_t **recs = calloc(n ? n : 1, sizeof *recs);
    const char **ids = calloc(n ? n : 1, sizeof *ids);
    char(*why)[160] = calloc(n ? n : 1, sizeof *why);
    json_t *out = calls && recs && ids && why ? json_array() : NULL;
    Tandem__Internal__V1__KvStatsRequest rq = TANDEM__INTERNAL__V1__KV_STATS_REQUEST__INIT;
    td_rpc_tls_t tc;
    for (size_t i = 0; out && i < n; i++) {
        recs[i] = json_loads((const char *)kvs.kv[i].value, 0, NULL);
        const char *id = recs[i] ? json_string_value(json_object_get(recs[i], "id")) : NULL;
        const char *addr = recs[i] ? json_string_value(json_object_get(recs[i], "addr")) : NULL;
        ids[i] = id ? id : kvs.kv[i].key;
        calls[i] = (td_rpc_unary_pb_call_t){.method = "/tandem.internal.v1.KvStore/Stats", .msg = &rq.base,
                                            .desc = &tandem__internal__v1__kv_stats_response__descriptor};
        calls[i].rc = TD_ERR_UNAVAILABLE;
        if (!addr)
            snprintf(why[i], sizeof why[i], "its etcd record has no addr");
        else if (td_rpc_channel_create(addr, td_rpc_tls_peer(tls, "kvstore", &tc), &calls[i].ch))
            snprintf(why[i], sizeof why[i], "%s", td_last_error());
    }
    if (out) /* the nodes without a channel are skipped */
        td_rpc_unary_all_pb(calls, n, timeout_s);
    for (size_t i = 0; out && i < n; i++) {
        Tandem__Internal__V1__KvStatsResponse *m = (Tandem__Internal__V1__KvStatsResponse *)calls[i].reply;
        const char *err = why[i][0] ? why[i] : calls[i].res.message;
        json_array_append_new(out, m ? node_json(ids[i], m) : json_pack("{s:s, s:s}", "id", ids[i], "error", err));
        if (m)
            tandem__internal__v1__kv_stats_response__free_unpacked(m, NULL);
        td_rpc_channel_destroy(calls[i].ch);
    }
    for (size_t i = 0; recs && i < n; i++)
        json_decref(recs[i]);
    free(calls);
    free(recs);
    free(ids);
    free(why);
    td_etcd_kvs_free(&kvs);
    if (!out)
        return td_error(TD_ERR_NO_MEMORY, "kvstore status: no memory");
    *nodes = out;
    return TD_OK;
}
