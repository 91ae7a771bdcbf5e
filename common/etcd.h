/* etcd.h — a small client of etcd's v3 gRPC API over common/rpc.h.
 *
 * What tandem needs of etcd and nothing more: keys (get, put, delete, by key or
 * prefix), leases (grant, revoke, and a keep-alive thread that reports when
 * the lease is lost), watches (a thread per watch that calls back for every
 * put and delete under a prefix, resumes after a dropped stream from the
 * revision it had reached, and re-reads the prefix when that revision was
 * compacted away), and a Txn-based election (the key is created only
 * if it does not exist, under the candidate's lease). Keys are C strings;
 * values are bytes. Every call has a deadline (TD_ETCD_TIMEOUT_S). */
#ifndef TD_ETCD_H
#define TD_ETCD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/rpc.h"
#include "common/status.h"

#define TD_ETCD_TIMEOUT_S 5.0
#define TD_ETCD_REVOKE_S 1.0 /* a lease revoke (a process stopping): past it the TTL ends the lease */

typedef struct td_etcd td_etcd_t;

typedef struct td_etcd_kv {
    char *key;
    uint8_t *value; /* NUL-terminated for convenience; value_len excludes it */
    size_t value_len;
    int64_t lease, create_revision, mod_revision;
} td_etcd_kv_t;

typedef struct td_etcd_kvs {
    td_etcd_kv_t *kv;
    size_t n;
    int64_t revision; /* the store's revision when read */
} td_etcd_kvs_t;

/* etcd's own access control (auth), set up once on a fresh etcd: a role may
 * read, or read and write, a key or a prefix; a user is a client
 * certificate's common name (etcd with --client-cert-auth takes the CN as the
 * user name), and its role is the CN up to the first '-' ("decode-2" has
 * role "decode"). Users whose role has no grant are not made: etcd refuses
 * them everything. Then auth is enabled (a "root" user with no password, so
 * only a certificate named "root" could change this). */
typedef struct td_etcd_grant {
    const char *role, *key;
    bool prefix, write;
} td_etcd_grant_t;
td_status_t td_etcd_auth_enable(td_etcd_t *e, const td_etcd_grant_t *g, size_t n_grants, const char *const *users,
                                size_t n_users);

/* endpoint "127.0.0.1:2379" (an "http://" prefix is accepted). */
td_status_t td_etcd_connect(const char *endpoint, const td_rpc_tls_t *tls, td_etcd_t **out);
/* Stops the keep-alive (the lease is left to expire or be revoked first). */
void td_etcd_destroy(td_etcd_t *e);

td_status_t td_etcd_put(td_etcd_t *e, const char *key, const void *value, size_t len, int64_t lease);
td_status_t td_etcd_get(td_etcd_t *e, const char *key, bool prefix, td_etcd_kvs_t *out);
void td_etcd_kvs_free(td_etcd_kvs_t *kvs);
td_status_t td_etcd_delete(td_etcd_t *e, const char *key, bool prefix, int64_t *deleted);

td_status_t td_etcd_lease_grant(td_etcd_t *e, int64_t ttl_s, int64_t *id);
td_status_t td_etcd_lease_revoke(td_etcd_t *e, int64_t id);
/* Keeps lease id alive from a thread (a refresh every ttl/3 s). If etcd says
 * the lease is gone, or it cannot be refreshed before it would expire, lost()
 * is called once from that thread. One lease per client. */
td_status_t td_etcd_keepalive_start(td_etcd_t *e, int64_t id, int64_t ttl_s, void (*lost)(void *ctx), void *ctx);
void td_etcd_keepalive_stop(td_etcd_t *e);

/* Election: key becomes value under lease if nobody holds it. *won says
 * whether we hold it now (true also when we already did with this value). */
td_status_t td_etcd_campaign(td_etcd_t *e, const char *key, const void *value, size_t len, int64_t lease, bool *won);

typedef struct td_etcd_watch td_etcd_watch_t;
/* Called from the watch thread: put (true) or delete of kv (a delete has no value). */
typedef void (*td_etcd_watch_fn)(void *ctx, bool put, const td_etcd_kv_t *kv);
/* Called from the watch thread when the history the watch needed was
 * compacted away (it fell behind, or resumed after a long break): the events
 * in between are lost, so here is every key under the prefix as it is now;
 * the watch then goes on from there. A watcher forgets the keys not in it. */
typedef void (*td_etcd_resync_fn)(void *ctx, const td_etcd_kvs_t *now);
/* Watches every key under prefix from revision start_rev (0: from now). */
td_status_t td_etcd_watch_start(td_etcd_t *e, const char *prefix, int64_t start_rev, td_etcd_watch_fn fn,
                                td_etcd_resync_fn resync, void *ctx, td_etcd_watch_t **out);
void td_etcd_watch_stop(td_etcd_watch_t *w);

#endif
