/* status.h — the KV store as an operator sees it, one place for every
 * reader of it (`tandem kvstore-status`, the router's Health): the nodes
 * registered in etcd, each asked for its Stats. */
#ifndef KV_STATUS_H
#define KV_STATUS_H

#include <jansson.h>

#include "common/etcd.h"
#include "common/rpc.h"
#include "common/status.h"

/* *nodes: a JSON array, one object per node registered under
 * /tandem/kvstores/: {id, gets, hits, hit_rate, puts, stored, dropped_full,
 * checksum_errors, leases, replicas, replicas_pushed, replicas_dropped,
 * tiers: [{tier, capacity_bytes, used_bytes, blocks, hits, evictions}]}, or
 * {id, error} for a node that did not answer within timeout_s. An error
 * only when etcd could not be read. */
td_status_t kv_status_collect(td_etcd_t *etcd, const td_rpc_tls_t *tls, double timeout_s, json_t **nodes);

#endif
