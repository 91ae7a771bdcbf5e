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
    json_t *out = json_array();
    for (size_t i = 0; out && i < kvs.n; i++) {
        json_t *rec = json_loads((const char *)kvs.kv[i].value, 0, NULL);
        const char *id = rec ? json_string_value(json_object_get(rec, "id")) : NULL;
        const char *addr = rec ? json_string_value(json_object_get(rec, "addr")) : NULL;
        id = id ? id : kvs.kv[i].key;
        td_rpc_channel_t *ch = NULL;
        td_rpc_result_t res = {0};
        Tandem__Internal__V1__KvStatsRequest rq = TANDEM__INTERNAL__V1__KV_STATS_REQUEST__INIT;
        ProtobufCMessage *m = NULL;
        if (!addr)
            td_error(TD_ERR_FORMAT, "its etcd record has no addr");
        else if (td_rpc_channel_create(addr, tls, &ch) == TD_OK)
            td_rpc_unary_pb(ch, "/tandem.internal.v1.KvStore/Stats", &rq.base,
                            &tandem__internal__v1__kv_stats_response__descriptor, timeout_s, NULL, &m, &res);
        json_array_append_new(out, m ? node_json(id, (Tandem__Internal__V1__KvStatsResponse *)m)
                                     : json_pack("{s:s, s:s}", "id", id, "error", td_last_error()));
        if (m)
            protobuf_c_message_free_unpacked(m, NULL);
        td_rpc_channel_destroy(ch);
        json_decref(rec);
    }
    td_etcd_kvs_free(&kvs);
    if (!out)
        return td_error(TD_ERR_NO_MEMORY, "kvstore status: no memory");
    *nodes = out;
    return TD_OK;
}
