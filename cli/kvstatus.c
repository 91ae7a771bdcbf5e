/* kvstatus.c — `tandem kvstore-status`: the KV store as an operator sees it.
 * Reads the kvstore nodes from etcd and asks each for its Stats: per tier
 * the bytes and blocks held, hits and evictions; per node the names asked
 * for and found, blocks stored, puts dropped for want of room, SSD checksum
 * errors, open leases. The internal planes are mutual TLS: --tls-ca,
 * --tls-cert and --tls-key name a certificate of the cluster (tandem up's
 * ca.pem, client.pem, client.key). */
#define _GNU_SOURCE
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "common/etcd.h"
#include "common/log.h"
#include "common/rpc_pb.h"
#include "tandem/internal/v1/kvstore.pb-c.h"

const char cli_kvstatus_usage[] =
    "usage: tandem kvstore-status --etcd HOST:PORT [--tls-ca PEM --tls-cert PEM --tls-key PEM] [--json]\n";

static void node_line(const char *id, const Tandem__Internal__V1__KvStatsResponse *r, bool as_json)
{
    if (as_json) {
        json_t *j = json_pack("{s:s, s:I, s:I, s:I, s:I, s:I, s:I, s:i, s:i, s:I, s:I, s:[]}", "id", id, "gets",
                              (json_int_t)r->gets, "hits", (json_int_t)r->hits, "puts", (json_int_t)r->puts, "stored",
                              (json_int_t)r->stored, "dropped_full", (json_int_t)r->dropped_full, "checksum_errors",
                              (json_int_t)r->checksum_errors, "leases", (int)r->leases, "replicas", (int)r->replicas,
                              "replicas_pushed", (json_int_t)r->replicas_pushed, "replicas_dropped",
                              (json_int_t)r->replicas_dropped, "tiers");
        for (size_t t = 0; j && t < r->n_tiers; t++) {
            const Tandem__Internal__V1__KvTierStats *s = r->tiers[t];
            json_array_append_new(json_object_get(j, "tiers"),
                                  json_pack("{s:s, s:I, s:I, s:i, s:I, s:I}", "tier", s->tier, "capacity_bytes",
                                            (json_int_t)s->capacity_bytes, "used_bytes", (json_int_t)s->used_bytes,
                                            "blocks", (int)s->blocks, "hits", (json_int_t)s->hits, "evictions",
                                            (json_int_t)s->evictions));
        }
        char *s = j ? json_dumps(j, JSON_COMPACT) : NULL;
        printf("%s\n", s ? s : "{}");
        free(s);
        json_decref(j);
        return;
    }
    printf("%-16s gets %llu, hits %llu (%.1f%%), puts %llu, stored %llu, dropped (full) %llu, checksum errors %llu, "
           "leases %u\n  replicas: %u held for other nodes' hot blocks, %llu of its own copied out, %llu dropped "
           "(cooled)\n", id, (unsigned long long)r->gets, (unsigned long long)r->hits,
           r->gets ? 100.0 * (double)r->hits / (double)r->gets : 0.0, (unsigned long long)r->puts,
           (unsigned long long)r->stored, (unsigned long long)r->dropped_full, (unsigned long long)r->checksum_errors,
           r->leases, r->replicas, (unsigned long long)r->replicas_pushed, (unsigned long long)r->replicas_dropped);
    for (size_t t = 0; t < r->n_tiers; t++) {
        const Tandem__Internal__V1__KvTierStats *s = r->tiers[t];
        printf("  %-4s %8.1f / %8.1f MiB, %6u blocks, %8llu hits, %8llu evictions\n", s->tier,
               (double)s->used_bytes / 1048576.0, (double)s->capacity_bytes / 1048576.0, s->blocks,
               (unsigned long long)s->hits, (unsigned long long)s->evictions);
    }
}

int cli_kvstatus(int argc, char **argv)
{
    const char *ep = NULL;
    bool as_json = false;
    td_rpc_tls_t tls = {0};
    for (int i = 0; i < argc; i++) {
        if (!strcmp(argv[i], "--etcd") && i + 1 < argc)
            ep = argv[++i];
        else if (!strcmp(argv[i], "--json"))
            as_json = true;
        else if (!cli_tls_flag(argc, argv, &i, &tls)) {
            fprintf(stderr, "tandem kvstore-status: unknown argument '%s'\n%s", argv[i], cli_kvstatus_usage);
            return 2;
        }
    }
    if (!ep) {
        fprintf(stderr, "%s", cli_kvstatus_usage);
        return 2;
    }
    const td_rpc_tls_t *tp = tls.ca_file ? &tls : NULL;
    td_rpc_init();
    td_etcd_t *etcd = NULL;
    td_etcd_kvs_t kvs = {0};
    int code = 1;
    if (td_etcd_connect(ep, tp, &etcd) || td_etcd_get(etcd, "/tandem/kvstores/", true, &kvs)) {
        fprintf(stderr, "tandem kvstore-status: %s\n", td_last_error());
        goto out;
    }
    if (!kvs.n && !as_json)
        printf("no kvstore nodes registered in etcd at %s\n", ep);
    code = 0;
    for (size_t i = 0; i < kvs.n; i++) {
        json_t *j = json_loads((const char *)kvs.kv[i].value, 0, NULL);
        const char *id = j ? json_string_value(json_object_get(j, "id")) : NULL;
        const char *addr = j ? json_string_value(json_object_get(j, "addr")) : NULL;
        td_rpc_channel_t *ch = NULL;
        td_rpc_result_t res = {0};
        Tandem__Internal__V1__KvStatsRequest rq = TANDEM__INTERNAL__V1__KV_STATS_REQUEST__INIT;
        ProtobufCMessage *m = NULL;
        if (addr && td_rpc_channel_create(addr, tp, &ch) == TD_OK)
            td_rpc_unary_pb(ch, "/tandem.internal.v1.KvStore/Stats", &rq.base,
                            &tandem__internal__v1__kv_stats_response__descriptor, 5.0, NULL, &m, &res);
        Tandem__Internal__V1__KvStatsResponse *r = (Tandem__Internal__V1__KvStatsResponse *)m;
        if (r) {
            node_line(id ? id : kvs.kv[i].key, r, as_json);
        } else {
            fprintf(stderr, "tandem kvstore-status: %s: %s\n", id ? id : kvs.kv[i].key, td_last_error());
            code = 1;
        }
        if (m)
            protobuf_c_message_free_unpacked(m, NULL);
        td_rpc_channel_destroy(ch);
        json_decref(j);
    }
out:
    td_etcd_kvs_free(&kvs);
    td_etcd_destroy(etcd);
    td_rpc_shutdown();
    return code;
}
