/* kvstatus.c — `tandem kvstore-status`: the KV store as an operator sees it.
 * Reads the kvstore nodes from etcd and asks each for its Stats: per tier
 * the bytes and blocks held, hits and evictions; per node the names asked
 * for and found, blocks stored, puts dropped for want of room, SSD checksum
 * errors, open leases, hot-block replicas (kvstore/status.h collects
 * them; the router's Health shows the same). The internal planes are mutual TLS: --tls-ca,
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
#include "kvstore/status.h"

const char cli_kvstatus_usage[] =
    "usage: tandem kvstore-status --etcd HOST:PORT [--tls-ca PEM --tls-cert PEM --tls-key PEM] [--json]\n";

static unsigned long long u(const json_t *j, const char *k) { return (unsigned long long)json_integer_value(json_object_get(j, k)); }

static void node_line(const json_t *n)
{
    const char *id = json_string_value(json_object_get(n, "id"));
    const char *err = json_string_value(json_object_get(n, "error"));
    if (err) {
        printf("%-16s no answer: %s\n", id, err);
        return;
    }
    printf("%-16s gets %llu, hits %llu (%.1f%%), puts %llu, stored %llu, dropped (full) %llu, checksum errors %llu, "
           "leases %llu\n  replicas: %llu held for other nodes' hot blocks, %llu of its own copied out, %llu dropped "
           "(cooled)\n", id, u(n, "gets"), u(n, "hits"), 100.0 * json_real_value(json_object_get(n, "hit_rate")),
           u(n, "puts"), u(n, "stored"), u(n, "dropped_full"), u(n, "checksum_errors"), u(n, "leases"),
           u(n, "replicas"), u(n, "replicas_pushed"), u(n, "replicas_dropped"));
    size_t t;
    json_t *s;
    json_array_foreach(json_object_get(n, "tiers"), t, s)
        printf("  %-4s %8.1f / %8.1f MiB, %6llu blocks, %8llu hits, %8llu evictions\n",
               json_string_value(json_object_get(s, "tier")), (double)u(s, "used_bytes") / 1048576.0,
               (double)u(s, "capacity_bytes") / 1048576.0, u(s, "blocks"), u(s, "hits"), u(s, "evictions"));
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
    json_t *nodes = NULL;
    int code = 1;
    if (td_etcd_connect(ep, tp, &etcd) || kv_status_collect(etcd, tp, 5.0, &nodes)) {
        fprintf(stderr, "tandem kvstore-status: %s\n", td_last_error());
        goto out;
    }
    if (!json_array_size(nodes) && !as_json)
        printf("no kvstore nodes registered in etcd at %s\n", ep);
    code = 0;
    size_t i;
    json_t *n;
    json_array_foreach(nodes, i, n) {
        if (json_object_get(n, "error")) {
            fprintf(stderr, "tandem kvstore-status: %s: %s\n", json_string_value(json_object_get(n, "id")),
                    json_string_value(json_object_get(n, "error")));
            code = 1;
            if (as_json)
                continue;
        }
        if (as_json) {
            char *s = json_dumps(n, JSON_COMPACT);
            printf("%s\n", s ? s : "{}");
            free(s);
        } else {
            node_line(n);
        }
    }
out:
    json_decref(nodes);
    td_etcd_destroy(etcd);
    td_rpc_shutdown();
    return code;
}
