/* etcd.c — see etcd.h. Messages are etcd's own (proto/etcd/, etcd's field
 * numbers), packed with protobuf-c and carried by common/rpc. */
#define _GNU_SOURCE
#include "common/clock.h"
#include "common/etcd.h"
#include "common/rpc_pb.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/log.h"
#include "etcd/rpc.pb-c.h"

struct td_etcd {
    td_rpc_channel_t *ch;
    char endpoint[256];
    pthread_t ka_thread;
    bool ka_running;
    pthread_mutex_t ka_mu;
    pthread_cond_t ka_cv;
    bool ka_stop;
    int64_t ka_id, ka_ttl;
    void (*ka_lost)(void *);
    void *ka_ctx;
};

struct td_etcd_watch {
    td_etcd_t *e;
    char *prefix;
    int64_t next_rev;
    td_etcd_watch_fn fn;
    td_etcd_resync_fn resync;
    void *ctx;
    pthread_t thread;
    pthread_mutex_t mu;
    bool stop;
    td_rpc_stream_t *st;
};

/* The prefix range end: the key with its last byte + 1 (carrying). */
static ProtobufCBinaryData range_end_of(const char *key, char *buf, size_t cap)
{
    size_t n = strlen(key);
    if (n > cap)
        n = cap;
    memcpy(buf, key, n);
    while (n > 0) {
        if ((unsigned char)buf[n - 1] < 0xff) {
            buf[n - 1]++;
            return (ProtobufCBinaryData){n, (uint8_t *)buf};
        }
        n--;
    }
    buf[0] = 0; /* all keys */
    return (ProtobufCBinaryData){1, (uint8_t *)buf};
}

static ProtobufCBinaryData bin_of(const char *s) { return (ProtobufCBinaryData){strlen(s), (uint8_t *)s}; }

/* Packs msg, calls method, unpacks the reply with desc. */
static td_status_t call_within(td_etcd_t *e, const char *method, const ProtobufCMessage *msg,
                               const ProtobufCMessageDescriptor *desc, double timeout_s, ProtobufCMessage **reply)
{
    td_rpc_result_t res;
    td_status_t rc = td_rpc_unary_pb(e->ch, method, msg, desc, timeout_s, NULL, reply, &res);
    if (rc)
        return td_error(rc, "etcd: %s", td_last_error());
    return TD_OK;
}

static td_status_t call(td_etcd_t *e, const char *method, const ProtobufCMessage *msg,
                        const ProtobufCMessageDescriptor *desc, ProtobufCMessage **reply)
{
    return call_within(e, method, msg, desc, TD_ETCD_TIMEOUT_S, reply);
}

td_status_t td_etcd_connect(const char *endpoint, const td_rpc_tls_t *tls, td_etcd_t **out)
{
    td_etcd_t *e = calloc(1, sizeof *e);
    if (!e)
        return td_error(TD_ERR_NO_MEMORY, "etcd: no memory");
    const char *ep = endpoint;
    if (!strncmp(ep, "http://", 7))
        ep += 7;
    else if (!strncmp(ep, "https://", 8))
        ep += 8;
    snprintf(e->endpoint, sizeof e->endpoint, "%s", ep);
    pthread_mutex_init(&e->ka_mu, NULL);
    pthread_cond_init(&e->ka_cv, NULL);
    td_status_t rc = td_rpc_channel_create(e->endpoint, tls, &e->ch);
    if (rc) {
        free(e);
        return rc;
    }
    *out = e;
    return TD_OK;
}

void td_etcd_destroy(td_etcd_t *e)
{
    if (!e)
        return;
    td_etcd_keepalive_stop(e);
    td_rpc_channel_destroy(e->ch);
    pthread_mutex_destroy(&e->ka_mu);
    pthread_cond_destroy(&e->ka_cv);
    free(e);
}

td_status_t td_etcd_put(td_etcd_t *e, const char *key, const void *value, size_t len, int64_t lease)
{
    Etcdserverpb__PutRequest rq = ETCDSERVERPB__PUT_REQUEST__INIT;
    rq.key = bin_of(key);
    rq.value = (ProtobufCBinaryData){len, (uint8_t *)value};
    rq.lease = lease;
    ProtobufCMessage *rp;
    td_status_t rc = call(e, "/etcdserverpb.KV/Put", &rq.base, &etcdserverpb__put_response__descriptor, &rp);
    if (!rc)
        protobuf_c_message_free_unpacked(rp, NULL);
    return rc;
}

static td_status_t kv_copy(const Mvccpb__KeyValue *src, td_etcd_kv_t *dst)
{
    memset(dst, 0, sizeof *dst);
    dst->key = strndup((const char *)src->key.data, src->key.len);
    dst->value = malloc(src->value.len + 1);
    if (!dst->key || !dst->value)
        return TD_ERR_NO_MEMORY;
    if (src->value.len)
        memcpy(dst->value, src->value.data, src->value.len);
    dst->value[src->value.len] = 0;
    dst->value_len = src->value.len;
    dst->lease = src->lease;
    dst->create_revision = src->create_revision;
    dst->mod_revision = src->mod_revision;
    return TD_OK;
}

static void kv_free(td_etcd_kv_t *kv)
{
    free(kv->key);
    free(kv->value);
}

td_status_t td_etcd_get(td_etcd_t *e, const char *key, bool prefix, td_etcd_kvs_t *out)
{
    char end[512];
    Etcdserverpb__RangeRequest rq = ETCDSERVERPB__RANGE_REQUEST__INIT;
    rq.key = bin_of(key);
    if (prefix)
        rq.range_end = range_end_of(key, end, sizeof end);
    ProtobufCMessage *m;
    td_status_t rc = call(e, "/etcdserverpb.KV/Range", &rq.base, &etcdserverpb__range_response__descriptor, &m);
    if (rc)
        return rc;
    Etcdserverpb__RangeResponse *rp = (Etcdserverpb__RangeResponse *)m;
    memset(out, 0, sizeof *out);
    out->revision = rp->header ? rp->header->revision : 0;
    out->kv = calloc(rp->n_kvs ? rp->n_kvs : 1, sizeof *out->kv);
    if (!out->kv)
        rc = TD_ERR_NO_MEMORY;
    for (size_t i = 0; !rc && i < rp->n_kvs; i++) {
        rc = kv_copy(rp->kvs[i], &out->kv[i]);
        out->n = i + 1;
    }
    protobuf_c_message_free_unpacked(m, NULL);
    if (rc) {
        td_etcd_kvs_free(out);
        return td_error(rc, "etcd: no memory");
    }
    return TD_OK;
}

void td_etcd_kvs_free(td_etcd_kvs_t *kvs)
{
    for (size_t i = 0; i < kvs->n; i++)
        kv_free(&kvs->kv[i]);
    free(kvs->kv);
    memset(kvs, 0, sizeof *kvs);
}

td_status_t td_etcd_delete(td_etcd_t *e, const char *key, bool prefix, int64_t *deleted)
{
    char end[512];
    Etcdserverpb__DeleteRangeRequest rq = ETCDSERVERPB__DELETE_RANGE_REQUEST__INIT;
    rq.key = bin_of(key);
    if (prefix)
        rq.range_end = range_end_of(key, end, sizeof end);
    ProtobufCMessage *m;
    td_status_t rc =
        call(e, "/etcdserverpb.KV/DeleteRange", &rq.base, &etcdserverpb__delete_range_response__descriptor, &m);
    if (rc)
        return rc;
    if (deleted)
        *deleted = ((Etcdserverpb__DeleteRangeResponse *)m)->deleted;
    protobuf_c_message_free_unpacked(m, NULL);
    return TD_OK;
}

td_status_t td_etcd_lease_grant(td_etcd_t *e, int64_t ttl_s, int64_t *id)
{
    Etcdserverpb__LeaseGrantRequest rq = ETCDSERVERPB__LEASE_GRANT_REQUEST__INIT;
    rq.ttl = ttl_s;
    ProtobufCMessage *m;
    td_status_t rc =
        call(e, "/etcdserverpb.Lease/LeaseGrant", &rq.base, &etcdserverpb__lease_grant_response__descriptor, &m);
    if (rc)
        return rc;
    Etcdserverpb__LeaseGrantResponse *rp = (Etcdserverpb__LeaseGrantResponse *)m;
    if (rp->error && rp->error[0])
        rc = td_error(TD_ERR_UNAVAILABLE, "etcd %s: lease grant refused: %s", e->endpoint, rp->error);
    else
        *id = rp->id;
    protobuf_c_message_free_unpacked(m, NULL);
    return rc;
}

td_status_t td_etcd_lease_revoke(td_etcd_t *e, int64_t id)
{
    Etcdserverpb__LeaseRevokeRequest rq = ETCDSERVERPB__LEASE_REVOKE_REQUEST__INIT;
    rq.id = id;
    ProtobufCMessage *m;
    /* a process stopping revokes its leases, etcd perhaps gone with whoever stopped it: a revoke not made at
     * once is left to the lease's TTL, which ends it anyway */
    td_status_t rc = call_within(e, "/etcdserverpb.Lease/LeaseRevoke", &rq.base,
                                 &etcdserverpb__lease_revoke_response__descriptor, TD_ETCD_REVOKE_S, &m);
    if (!rc)
        protobuf_c_message_free_unpacked(m, NULL);
    return rc;
}

/* One refresh over the stream: 1 alive, 0 lease gone, -1 transport trouble. */
static int keepalive_once(td_etcd_t *e, td_rpc_stream_t *st)
{
    Etcdserverpb__LeaseKeepAliveRequest rq = ETCDSERVERPB__LEASE_KEEP_ALIVE_REQUEST__INIT;
    rq.id = e->ka_id;
    uint8_t buf[32];
    size_t n = etcdserverpb__lease_keep_alive_request__pack(&rq, buf);
    if (td_rpc_stream_write(st, buf, n, TD_ETCD_TIMEOUT_S))
        return -1;
    const uint8_t *msg;
    size_t len;
    if (td_rpc_stream_read(st, &msg, &len, TD_ETCD_TIMEOUT_S))
        return -1;
    Etcdserverpb__LeaseKeepAliveResponse *rp = etcdserverpb__lease_keep_alive_response__unpack(NULL, len, msg);
    if (!rp)
        return -1;
    int alive = rp->ttl > 0;
    etcdserverpb__lease_keep_alive_response__free_unpacked(rp, NULL);
    return alive;
}

static void *keepalive_thread(void *arg)
{
    td_etcd_t *e = arg;
    td_rpc_stream_t *st = NULL;
    double period = e->ka_ttl / 3.0 > 0.2 ? e->ka_ttl / 3.0 : 0.2, last_ok = td_now_s();
    bool lost = false;
    pthread_mutex_lock(&e->ka_mu);
    while (!e->ka_stop) {
        pthread_mutex_unlock(&e->ka_mu);
        if (!st && td_rpc_stream_open(e->ch, "/etcdserverpb.Lease/LeaseKeepAlive", NULL, 0, 1e9, NULL, &st))
            st = NULL;
        int r = st ? keepalive_once(e, st) : -1;
        if (r < 0 && st) {
            td_rpc_stream_destroy(st);
            st = NULL;
        }
        if (r > 0)
            last_ok = td_now_s();
        if (!lost && (r == 0 || td_now_s() - last_ok > (double)e->ka_ttl)) {
            lost = true;
            TD_WARN("etcd %s: lease %llx %s", e->endpoint, (unsigned long long)e->ka_id,
                    r == 0 ? "is gone" : "could not be refreshed before its TTL");
            if (e->ka_lost)
                e->ka_lost(e->ka_ctx);
        }
        pthread_mutex_lock(&e->ka_mu);
        if (lost)
            break;
        double wait = r > 0 ? period : 0.25;
        struct timespec until = td_wall_deadline(wait);
        while (!e->ka_stop && pthread_cond_timedwait(&e->ka_cv, &e->ka_mu, &until) == 0)
            ;
    }
    pthread_mutex_unlock(&e->ka_mu);
    td_rpc_stream_destroy(st);
    return NULL;
}

td_status_t td_etcd_keepalive_start(td_etcd_t *e, int64_t id, int64_t ttl_s, void (*lost)(void *ctx), void *ctx)
{
    if (e->ka_running)
        return td_error(TD_ERR_INTERNAL, "etcd: a keep-alive is running already");
    e->ka_id = id;
    e->ka_ttl = ttl_s;
    e->ka_lost = lost;
    e->ka_ctx = ctx;
    e->ka_stop = false;
    if (pthread_create(&e->ka_thread, NULL, keepalive_thread, e))
        return td_error(TD_ERR_INTERNAL, "etcd: cannot start the keep-alive thread");
    e->ka_running = true;
    return TD_OK;
}

void td_etcd_keepalive_stop(td_etcd_t *e)
{
    if (!e->ka_running)
        return;
    pthread_mutex_lock(&e->ka_mu);
    e->ka_stop = true;
    pthread_cond_broadcast(&e->ka_cv);
    pthread_mutex_unlock(&e->ka_mu);
    pthread_join(e->ka_thread, NULL);
    e->ka_running = false;
}

td_status_t td_etcd_campaign(td_etcd_t *e, const char *key, const void *value, size_t len, int64_t lease, bool *won)
{
    Etcdserverpb__Compare cmp = ETCDSERVERPB__COMPARE__INIT;
    cmp.result = ETCDSERVERPB__COMPARE__COMPARE_RESULT__EQUAL;
    cmp.target = ETCDSERVERPB__COMPARE__COMPARE_TARGET__CREATE;
    cmp.key = bin_of(key);
    cmp.target_union_case = ETCDSERVERPB__COMPARE__TARGET_UNION_CREATE_REVISION;
    cmp.create_revision = 0;
    Etcdserverpb__PutRequest put = ETCDSERVERPB__PUT_REQUEST__INIT;
    put.key = bin_of(key);
    put.value = (ProtobufCBinaryData){len, (uint8_t *)value};
    put.lease = lease;
    Etcdserverpb__RequestOp okop = ETCDSERVERPB__REQUEST_OP__INIT;
    okop.request_case = ETCDSERVERPB__REQUEST_OP__REQUEST_REQUEST_PUT;
    okop.request_put = &put;
    Etcdserverpb__RangeRequest get = ETCDSERVERPB__RANGE_REQUEST__INIT;
    get.key = bin_of(key);
    Etcdserverpb__RequestOp failop = ETCDSERVERPB__REQUEST_OP__INIT;
    failop.request_case = ETCDSERVERPB__REQUEST_OP__REQUEST_REQUEST_RANGE;
    failop.request_range = &get;
    Etcdserverpb__Compare *cmps[1] = {&cmp};
    Etcdserverpb__RequestOp *oks[1] = {&okop}, *fails[1] = {&failop};
    Etcdserverpb__TxnRequest rq = ETCDSERVERPB__TXN_REQUEST__INIT;
    rq.n_compare = 1;
    rq.compare = cmps;
    rq.n_success = 1;
    rq.success = oks;
    rq.n_failure = 1;
    rq.failure = fails;
    ProtobufCMessage *m;
    td_status_t rc = call(e, "/etcdserverpb.KV/Txn", &rq.base, &etcdserverpb__txn_response__descriptor, &m);
    if (rc)
        return rc;
    Etcdserverpb__TxnResponse *rp = (Etcdserverpb__TxnResponse *)m;
    *won = rp->succeeded;
    if (!rp->succeeded && rp->n_responses == 1 &&
        rp->responses[0]->response_case == ETCDSERVERPB__RESPONSE_OP__RESPONSE_RESPONSE_RANGE) {
        Etcdserverpb__RangeResponse *r = rp->responses[0]->response_range;
        if (r->n_kvs == 1 && r->kvs[0]->lease == lease && r->kvs[0]->value.len == len &&
            !memcmp(r->kvs[0]->value.data, value, len))
            *won = true; /* ours already */
    }
    protobuf_c_message_free_unpacked(m, NULL);
    return TD_OK;
}

/* ------------------------------------------------------------------ watch */

static bool watch_stopping(td_etcd_watch_t *w)
{
    pthread_mutex_lock(&w->mu);
    bool s = w->stop;
    pthread_mutex_unlock(&w->mu);
    return s;
}

static td_rpc_stream_t *watch_open(td_etcd_watch_t *w)
{
    td_rpc_stream_t *st;
    if (td_rpc_stream_open(w->e->ch, "/etcdserverpb.Watch/Watch", NULL, 0, 1e9, NULL, &st))
        return NULL;
    char end[512];
    Etcdserverpb__WatchCreateRequest cr = ETCDSERVERPB__WATCH_CREATE_REQUEST__INIT;
    cr.key = bin_of(w->prefix);
    cr.range_end = range_end_of(w->prefix, end, sizeof end);
    cr.start_revision = w->next_rev;
    Etcdserverpb__WatchRequest rq = ETCDSERVERPB__WATCH_REQUEST__INIT;
    rq.request_union_case = ETCDSERVERPB__WATCH_REQUEST__REQUEST_UNION_CREATE_REQUEST;
    rq.create_request = &cr;
    size_t n = etcdserverpb__watch_request__get_packed_size(&rq);
    uint8_t *buf = malloc(n);
    if (!buf) {
        td_rpc_stream_destroy(st);
        return NULL;
    }
    etcdserverpb__watch_request__pack(&rq, buf);
    td_status_t rc = td_rpc_stream_write(st, buf, n, TD_ETCD_TIMEOUT_S);
    free(buf);
    if (rc) {
        td_rpc_stream_destroy(st);
        return NULL;
    }
    return st;
}

/* Re-reads the prefix after a compaction and hands it to the watcher; the
 * watch goes on from that read's revision. 0 on success. */
static int watch_resync(td_etcd_watch_t *w)
{
    td_etcd_kvs_t kvs = {0};
    for (int tries = 0; !watch_stopping(w); tries++) {
        if (td_etcd_get(w->e, w->prefix, true, &kvs) == TD_OK)
            break;
        struct timespec t = {0, 200 * 1000 * 1000};
        nanosleep(&t, NULL);
    }
    if (watch_stopping(w))
        return -1;
    if (w->resync)
        w->resync(w->ctx, &kvs);
    else
        for (size_t i = 0; i < kvs.n; i++)
            w->fn(w->ctx, true, &kvs.kv[i]);
    w->next_rev = kvs.revision + 1;
    td_etcd_kvs_free(&kvs);
    return 0;
}

static void *watch_thread(void *arg)
{
    td_etcd_watch_t *w = arg;
    td_rpc_stream_t *st = NULL;
    while (!watch_stopping(w)) {
        if (!st) {
            st = watch_open(w);
            pthread_mutex_lock(&w->mu);
            w->st = st;
            pthread_mutex_unlock(&w->mu);
            if (!st) {
                struct timespec t = {0, 200 * 1000 * 1000};
                nanosleep(&t, NULL);
                continue;
            }
        }
        const uint8_t *msg;
        size_t len;
        td_status_t rc = td_rpc_stream_read(st, &msg, &len, 0.5);
        if (rc == TD_ERR_TIMEOUT)
            continue;
        if (rc) { /* the stream ended: open again from the revision reached */
            pthread_mutex_lock(&w->mu);
            w->st = NULL;
            pthread_mutex_unlock(&w->mu);
            td_rpc_stream_destroy(st);
            st = NULL;
            continue;
        }
        Etcdserverpb__WatchResponse *rp = etcdserverpb__watch_response__unpack(NULL, len, msg);
        if (!rp)
            continue;
        for (size_t i = 0; i < rp->n_events; i++) {
            Mvccpb__Event *ev = rp->events[i];
            if (!ev->kv)
                continue;
            td_etcd_kv_t kv;
            if (kv_copy(ev->kv, &kv) == TD_OK)
                w->fn(w->ctx, ev->type == MVCCPB__EVENT__EVENT_TYPE__PUT, &kv);
            kv_free(&kv);
            if (ev->kv->mod_revision >= w->next_rev)
                w->next_rev = ev->kv->mod_revision + 1;
        }
        if (rp->created && w->next_rev == 0 && rp->header)
            w->next_rev = rp->header->revision + 1;
        bool canceled = rp->canceled;
        int64_t compacted = rp->compact_revision;
        etcdserverpb__watch_response__free_unpacked(rp, NULL);
        if (!canceled)
            continue;
        /* etcd ended the watch; when because next_rev was compacted away, the
         * events up to compacted are lost: read the prefix as it is now */
        pthread_mutex_lock(&w->mu);
        w->st = NULL;
        pthread_mutex_unlock(&w->mu);
        td_rpc_stream_destroy(st);
        st = NULL;
        if (compacted > 0 && !watch_resync(w))
            TD_WARN("etcd: the watch on %s resumed after a compaction (revision %lld)", w->prefix,
                    (long long)compacted);
    }
    pthread_mutex_lock(&w->mu);
    w->st = NULL;
    pthread_mutex_unlock(&w->mu);
    td_rpc_stream_destroy(st);
    return NULL;
}

td_status_t td_etcd_watch_start(td_etcd_t *e, const char *prefix, int64_t start_rev, td_etcd_watch_fn fn,
                                td_etcd_resync_fn resync, void *ctx, td_etcd_watch_t **out)
{
    td_etcd_watch_t *w = calloc(1, sizeof *w);
    if (!w || !(w->prefix = strdup(prefix))) {
        free(w);
        return td_error(TD_ERR_NO_MEMORY, "etcd: no memory");
    }
    w->e = e;
    w->next_rev = start_rev;
    w->fn = fn;
    w->resync = resync;
    w->ctx = ctx;
    pthread_mutex_init(&w->mu, NULL);
    if (pthread_create(&w->thread, NULL, watch_thread, w)) {
        free(w->prefix);
        free(w);
        return td_error(TD_ERR_INTERNAL, "etcd: cannot start a watch thread");
    }
    *out = w;
    return TD_OK;
}

void td_etcd_watch_stop(td_etcd_watch_t *w)
{
    if (!w)
        return;
    pthread_mutex_lock(&w->mu);
    w->stop = true;
    if (w->st)
        td_rpc_stream_cancel(w->st);
    pthread_mutex_unlock(&w->mu);
    pthread_join(w->thread, NULL);
    pthread_mutex_destroy(&w->mu);
    free(w->prefix);
    free(w);
}

/* ---------------------------------------------------------------- auth */

static td_status_t auth_call(td_etcd_t *e, const char *method, const ProtobufCMessage *msg,
                             const ProtobufCMessageDescriptor *desc)
{
    ProtobufCMessage *rp;
    td_status_t rc = call(e, method, msg, desc, &rp);
    if (!rc)
        protobuf_c_message_free_unpacked(rp, NULL);
    return rc;
}

static bool role_granted(const td_etcd_grant_t *g, size_t n, const char *role, size_t len)
{
    for (size_t i = 0; i < n; i++)
        if (strlen(g[i].role) == len && !strncmp(g[i].role, role, len))
            return true;
    return false;
}

static td_status_t user_add(td_etcd_t *e, const char *name, const char *role)
{
    Etcdserverpb__UserAddOptions o = ETCDSERVERPB__USER_ADD_OPTIONS__INIT;
    o.no_password = 1;
    Etcdserverpb__AuthUserAddRequest ua = ETCDSERVERPB__AUTH_USER_ADD_REQUEST__INIT;
    ua.name = (char *)name;
    ua.options = &o;
    Etcdserverpb__AuthUserGrantRoleRequest ug = ETCDSERVERPB__AUTH_USER_GRANT_ROLE_REQUEST__INIT;
    ug.user = (char *)name;
    ug.role = (char *)role;
    td_status_t rc = auth_call(e, "/etcdserverpb.Auth/UserAdd", &ua.base, &etcdserverpb__auth_user_add_response__descriptor);
    if (!rc)
        rc = auth_call(e, "/etcdserverpb.Auth/UserGrantRole", &ug.base,
                       &etcdserverpb__auth_user_grant_role_response__descriptor);
    return rc ? td_error(rc, "etcd auth: user %s (role %s): %s", name, role, td_last_error()) : TD_OK;
}

td_status_t td_etcd_auth_enable(td_etcd_t *e, const td_etcd_grant_t *g, size_t n_grants, const char *const *users,
                                size_t n_users)
{
    td_status_t rc = TD_OK;
    for (size_t i = 0; !rc && i < n_grants; i++) {
        if (!role_granted(g, i, g[i].role, strlen(g[i].role))) { /* the role's first grant: the role */
            Etcdserverpb__AuthRoleAddRequest ra = ETCDSERVERPB__AUTH_ROLE_ADD_REQUEST__INIT;
            ra.name = (char *)g[i].role;
            rc = auth_call(e, "/etcdserverpb.Auth/RoleAdd", &ra.base, &etcdserverpb__auth_role_add_response__descriptor);
        }
        char end[512];
        Etcdserverpb__Permission p = ETCDSERVERPB__PERMISSION__INIT;
        p.permtype = g[i].write ? ETCDSERVERPB__PERMISSION__TYPE__READWRITE : ETCDSERVERPB__PERMISSION__TYPE__READ;
        p.key = bin_of(g[i].key);
        if (g[i].prefix)
            p.range_end = range_end_of(g[i].key, end, sizeof end);
        Etcdserverpb__AuthRoleGrantPermissionRequest rg = ETCDSERVERPB__AUTH_ROLE_GRANT_PERMISSION_REQUEST__INIT;
        rg.name = (char *)g[i].role;
        rg.perm = &p;
        if (!rc)
            rc = auth_call(e, "/etcdserverpb.Auth/RoleGrantPermission", &rg.base,
                           &etcdserverpb__auth_role_grant_permission_response__descriptor);
        if (rc)
            return td_error(rc, "etcd auth: role %s on %s: %s", g[i].role, g[i].key, td_last_error());
    }
    for (size_t i = 0; i < n_users; i++) {
        size_t len = strcspn(users[i], "-");
        char role[64];
        if (!len || len >= sizeof role || !role_granted(g, n_grants, users[i], len))
            continue;
        snprintf(role, sizeof role, "%.*s", (int)len, users[i]);
        if ((rc = user_add(e, users[i], role)))
            return rc;
    }
    if ((rc = user_add(e, "root", "root")))
        return rc;
    Etcdserverpb__AuthEnableRequest en = ETCDSERVERPB__AUTH_ENABLE_REQUEST__INIT;
    rc = auth_call(e, "/etcdserverpb.Auth/AuthEnable", &en.base, &etcdserverpb__auth_enable_response__descriptor);
    return rc ? td_error(rc, "etcd auth: enabling it: %s", td_last_error()) : TD_OK;
}
