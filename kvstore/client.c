/* client.c — the KV store's client library (client.h). */
#define _GNU_SOURCE
#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "common/clock.h"
#include "common/etcd.h"
#include "common/kv_contract_pb.h"
#include "common/log.h"
#include "common/rpc_pb.h"
#include "kvstore/client.h"
#include "tandem/internal/v1/kvstore.pb-c.h"

#define PREFIX "/tandem/kvstores/"
#define RPC_TIMEOUT_S 2.0
#define LEASE_MS 15000u
/* Writer threads: while one hashes its blocks or waits for a node's Put or
 * Commit, the other moves its batch's bytes. */
#define KV_WRITERS 2

typedef struct knode {
    char id[64], addr[160];
    uint64_t seed;
    bool live;
    td_rpc_channel_t *ch;
    /* the node's region, connected on first use (under the client's xmu) */
    kv_xfer_peer_t *peer;
    uint32_t region;
    uint64_t region_base, region_bytes;
    uint64_t peer_gen; /* counts connections made: a writer between its puts sees a reconnect */
    bool peer_failed;
} knode_t;

typedef struct put_job {
    td_block_name_t *names;
    const void **src;
    const uint64_t *digests; /* the blocks' digests as known (NULL: hashed here before each put) */
    uint32_t n;
    void (*done)(void *ctx, uint32_t stored);
    void *ctx;
    struct put_job *next;
} put_job_t;

struct kv_client {
    kv_client_config_t cfg;
    Tandem__Internal__V1__KvContract contract_pb;
    td_etcd_t *etcd;
    td_etcd_watch_t *watch;
    pthread_mutex_t mu; /* nodes, stats */
    knode_t **nodes;    /* every node seen (a dead one is kept: calls may hold it) */
    size_t n_nodes, cap_nodes;
    const kv_transport_ops_t *xo;
    kv_xfer_t *x;
    pthread_mutex_t xmu; /* the transport: one thread at a time */
    pthread_t writers[KV_WRITERS];
    uint32_t n_writers;
    bool stop;
    pthread_cond_t cv, idle_cv;
    put_job_t *head, *tail;
    uint32_t queued_blocks;
    uint32_t busy; /* writers running a job */
};

typedef struct part {
    knode_t *node;
    uint64_t lease;
    uint32_t *pos; /* chain positions of this node's names */
    uint32_t n_pos, found;
    uint64_t *offsets, *digests;
    size_t block_bytes;
} part_t;

struct kv_client_read {
    part_t *parts;
    uint32_t n_parts, found;
};

uint64_t kv_client_node_seed(const char *id) { return XXH3_64bits(id, strlen(id)); }

int kv_client_home(td_block_name_t name, const uint64_t *seeds, uint32_t n)
{
    int best = -1;
    uint64_t top = 0;
    for (uint32_t i = 0; i < n; i++) {
        uint64_t s = XXH3_64bits_withSeed(&name, sizeof name, seeds[i]);
        if (best < 0 || s > top) {
            top = s;
            best = (int)i;
        }
    }
    return best;
}

/* ------------------------------------------------------------ membership */

static void node_set(kv_client_t *c, const char *key, const char *value, bool put)
{
    const char *id = key + strlen(PREFIX);
    char addr[160] = "";
    if (put) {
        json_t *j = json_loads(value, 0, NULL);
        const char *a = j ? json_string_value(json_object_get(j, "addr")) : NULL;
        if (a)
            snprintf(addr, sizeof addr, "%s", a);
        json_decref(j);
        if (!addr[0]) {
            TD_WARN("kvstore client: %s has no addr: ignored", key);
            return;
        }
    }
    pthread_mutex_lock(&c->mu);
    for (size_t i = 0; i < c->n_nodes; i++) {
        knode_t *k = c->nodes[i];
        if (!k->live || strcmp(k->id, id))
            continue;
        if (put && !strcmp(k->addr, addr)) {
            pthread_mutex_unlock(&c->mu);
            return;
        }
        k->live = false; /* gone, or back at another address */
        td_rpc_channel_shutdown(k->ch);
    }
    if (put && c->n_nodes < 4096) {
        if (c->n_nodes == c->cap_nodes) {
            size_t nc = c->cap_nodes ? 2 * c->cap_nodes : 8;
            knode_t **nn = realloc(c->nodes, nc * sizeof *nn);
            if (nn) {
                c->nodes = nn;
                c->cap_nodes = nc;
            }
        }
        knode_t *k = c->n_nodes < c->cap_nodes ? calloc(1, sizeof *k) : NULL;
        td_rpc_tls_t tc;
        if (k && td_rpc_channel_create(addr, td_rpc_tls_peer(c->cfg.tls, "kvstore", &tc), &k->ch) == TD_OK) {
            snprintf(k->id, sizeof k->id, "%s", id);
            snprintf(k->addr, sizeof k->addr, "%s", addr);
            k->seed = kv_client_node_seed(k->id);
            k->live = true;
            td_rpc_channel_set_fail_fast(k->ch, true);
            c->nodes[c->n_nodes++] = k;
            TD_INFO("kvstore client: node %s at %s", k->id, k->addr);
        } else {
            free(k);
        }
    }
    pthread_mutex_unlock(&c->mu);
}

static void on_watch(void *ctx, bool put, const td_etcd_kv_t *kv)
{
    node_set(ctx, kv->key, (const char *)kv->value, put);
}

static void on_resync(void *ctx, const td_etcd_kvs_t *now)
{
    kv_client_t *c = ctx;
    pthread_mutex_lock(&c->mu);
    for (size_t i = 0; i < c->n_nodes; i++) {
        knode_t *k = c->nodes[i];
        bool there = false;
        for (size_t j = 0; j < now->n && !there; j++)
            there = !strcmp(now->kv[j].key + strlen(PREFIX), k->id);
        if (k->live && !there) {
            k->live = false;
            td_rpc_channel_shutdown(k->ch);
        }
    }
    pthread_mutex_unlock(&c->mu);
    for (size_t j = 0; j < now->n; j++)
        node_set(c, now->kv[j].key, (const char *)now->kv[j].value, true);
}

/* The live nodes now (their structs stay until the client goes). */
static uint32_t live_nodes(kv_client_t *c, knode_t **out, uint64_t *seeds, uint32_t cap)
{
    uint32_t n = 0;
    pthread_mutex_lock(&c->mu);
    for (size_t i = 0; i < c->n_nodes && n < cap; i++)
        if (c->nodes[i]->live) {
            seeds[n] = c->nodes[i]->seed;
            out[n++] = c->nodes[i];
        }
    pthread_mutex_unlock(&c->mu);
    return n;
}

/* ------------------------------------------------------------ transport */

/* Connects to the node's region as a response described it (xmu held). */
static td_status_t node_peer(kv_client_t *c, knode_t *k, const Tandem__Internal__V1__KvRegion *r)
{
    if (!r || !r->has_address || !r->has_region_key)
        return td_error(TD_ERR_FORMAT, "kvstore %s: a reply without its region", k->id);
    if (k->peer && !k->peer_failed && k->region_base == r->remote_base && k->region_bytes == r->region_bytes)
        return TD_OK;
    if (k->peer) {
        c->xo->disconnect(c->x, k->peer);
        k->peer = NULL;
    }
    td_status_t rc = c->xo->connect(c->x, r->address.data, r->address.len, &k->peer);
    if (!rc && (rc = c->xo->region_add(c->x, k->peer, r->region_key.data, r->region_key.len, r->remote_base,
                                       r->region_bytes, &k->region))) {
        c->xo->disconnect(c->x, k->peer);
        k->peer = NULL;
    }
    if (!rc) {
        k->peer_gen++;
        k->peer_failed = false;
        k->region_base = r->remote_base;
        k->region_bytes = r->region_bytes;
    }
    return rc;
}

/* ------------------------------------------------------------ reads */

static Tandem__Internal__V1__BlockName **names_pb(const td_block_name_t *names, const uint32_t *pos, uint32_t n,
                                                  Tandem__Internal__V1__BlockName *store)
{
    Tandem__Internal__V1__BlockName **p = malloc((n ? n : 1) * sizeof *p);
    if (!p)
        return NULL;
    for (uint32_t i = 0; i < n; i++) {
        tandem__internal__v1__block_name__init(&store[i]);
        store[i].has_lo = store[i].has_hi = 1;
        td_block_name_t nm = names[pos ? pos[i] : i];
        store[i].lo = nm.lo;
        store[i].hi = nm.hi;
        p[i] = &store[i];
    }
    return p;
}

static void part_free(part_t *p)
{
    free(p->pos);
    free(p->offsets);
    free(p->digests);
}

/* One node's Get of its names of the chain. */
static void part_get(kv_client_t *c, part_t *p, const td_block_name_t *names, double timeout_s)
{
    Tandem__Internal__V1__BlockName *store = malloc(p->n_pos * sizeof *store);
    Tandem__Internal__V1__KvGetRequest rq = TANDEM__INTERNAL__V1__KV_GET_REQUEST__INIT;
    rq.contract = &c->contract_pb;
    rq.has_lease_ms = 1;
    rq.lease_ms = LEASE_MS;
    rq.reader_node = c->cfg.near_node && c->cfg.near_node[0] ? (char *)c->cfg.near_node : NULL;
    rq.n_names = p->n_pos;
    rq.names = store ? names_pb(names, p->pos, p->n_pos, store) : NULL;
    td_rpc_result_t res;
    ProtobufCMessage *m = NULL;
    if (rq.names && td_rpc_unary_pb(p->node->ch, "/tandem.internal.v1.KvStore/Get", &rq.base,
                                    &tandem__internal__v1__kv_get_response__descriptor, timeout_s, NULL, &m,
                                    &res) == TD_OK) {
        Tandem__Internal__V1__KvGetResponse *r = (Tandem__Internal__V1__KvGetResponse *)m;
        if (!r->n_offsets) {
            /* a miss (a node with no blocks yet states no block size) */
        } else if (r->n_offsets == r->n_digests && r->n_offsets <= p->n_pos &&
                   r->block_bytes == td_kv_block_bytes(&c->cfg.contract) &&
                   (p->offsets = malloc((r->n_offsets + 1) * 8)) && (p->digests = malloc((r->n_offsets + 1) * 8))) {
            p->lease = r->lease_id;
            p->found = (uint32_t)r->n_offsets;
            p->block_bytes = r->block_bytes;
            memcpy(p->offsets, r->offsets, r->n_offsets * 8);
            memcpy(p->digests, r->digests, r->n_offsets * 8);
            pthread_mutex_lock(&c->xmu);
            if (node_peer(c, p->node, r->region)) {
                TD_WARN("kvstore client: %s: %s", p->node->id, td_last_error());
                p->found = 0;
            }
            pthread_mutex_unlock(&c->xmu);
        } else {
            TD_WARN("kvstore client: %s answered Get with %zu offsets for %u names of %llu bytes", p->node->id,
                    r->n_offsets, p->n_pos, (unsigned long long)r->block_bytes);
        }
    } else if (rq.names) {
        TD_DEBUG("kvstore client: %s", td_last_error());
    }
    if (m)
        protobuf_c_message_free_unpacked(m, NULL);
    free(rq.names);
    free(store);
}

static void unlease(part_t *p)
{
    if (!p->lease)
        return;
    Tandem__Internal__V1__KvUnleaseRequest rq = TANDEM__INTERNAL__V1__KV_UNLEASE_REQUEST__INIT;
    rq.has_lease_id = 1;
    rq.lease_id = p->lease;
    td_rpc_result_t res;
    ProtobufCMessage *m = NULL;
    td_rpc_unary_pb(p->node->ch, "/tandem.internal.v1.KvStore/Unlease", &rq.base,
                    &tandem__internal__v1__kv_unlease_response__descriptor, 1.0, NULL, &m, &res);
    if (m)
        protobuf_c_message_free_unpacked(m, NULL);
    p->lease = 0;
}

#define MAX_NODES 256

td_status_t kv_client_lookup(kv_client_t *c, const td_block_name_t *names, uint32_t n, double timeout_s,
                             kv_client_read_t **rd, uint32_t *found)
{
    *found = 0;
    kv_client_read_t *r = calloc(1, sizeof *r);
    knode_t *nodes[MAX_NODES];
    uint64_t seeds[MAX_NODES];
    uint32_t nn = live_nodes(c, nodes, seeds, MAX_NODES);
    if (!r || (nn && !(r->parts = calloc(nn + 1, sizeof *r->parts)))) {
        free(r);
        return td_error(TD_ERR_NO_MEMORY, "kvstore client: no memory");
    }
    *rd = r;
    if (!nn || !n)
        return TD_OK;
    double deadline = td_now_s() + timeout_s;
    /* The near node first, for the whole chain: it holds its own names and
     * replicas of hot ones; the homes are asked for the rest. */
    uint32_t from = 0;
    part_t *near = &r->parts[nn];
    for (uint32_t i = 0; i < nn && c->cfg.near_node && c->cfg.near_node[0]; i++)
        if (!strcmp(nodes[i]->id, c->cfg.near_node)) {
            near->node = nodes[i];
            if (!(near->pos = malloc(n * sizeof *near->pos)))
                return td_error(TD_ERR_NO_MEMORY, "kvstore client: no memory");
            for (uint32_t k = 0; k < n; k++)
                near->pos[k] = k;
            near->n_pos = n;
            part_get(c, near, names, timeout_s < RPC_TIMEOUT_S ? timeout_s : RPC_TIMEOUT_S);
            near->n_pos = from = near->found;
            r->n_parts = nn + 1;
            break;
        }
    if (from == n) {
        r->found = *found = n;
        return TD_OK;
    }
    int *home = malloc(n * sizeof *home);
    if (!home)
        return td_error(TD_ERR_NO_MEMORY, "kvstore client: no memory");
    for (uint32_t i = 0; i < nn; i++)
        r->parts[i].node = nodes[i];
    if (r->n_parts < nn)
        r->n_parts = nn;
    for (uint32_t i = from; i < n; i++) {
        home[i] = kv_client_home(names[i], seeds, nn);
        r->parts[home[i]].n_pos++;
    }
    for (uint32_t k = 0; k < nn; k++) {
        part_t *p = &r->parts[k];
        if (p->n_pos && !(p->pos = malloc(p->n_pos * sizeof *p->pos))) {
            free(home);
            return td_error(TD_ERR_NO_MEMORY, "kvstore client: no memory");
        }
        p->n_pos = 0;
    }
    for (uint32_t i = from; i < n; i++) {
        part_t *p = &r->parts[home[i]];
        p->pos[p->n_pos++] = i;
    }
    free(home);
    uint32_t prefix = n;
    for (uint32_t k = 0; k < nn; k++) { /* each node: its names, in chain order, up to the prefix known */
        part_t *p = &r->parts[k];
        uint32_t m = 0;
        while (m < p->n_pos && p->pos[m] < prefix)
            m++;
        p->n_pos = m;
        if (!m)
            continue;
        double left = deadline - td_now_s();
        if (left > 0)
            part_get(c, p, names, left < RPC_TIMEOUT_S ? left : RPC_TIMEOUT_S);
        if (p->found < p->n_pos && p->pos[p->found] < prefix)
            prefix = p->pos[p->found];
    }
    r->found = *found = prefix;
    return TD_OK;
}

td_status_t kv_client_fetch(kv_client_t *c, kv_client_read_t *rd, uint32_t from, uint32_t n, void *const *dst,
                            double timeout_s, uint32_t *got)
{
    *got = 0;
    if (from >= rd->found)
        return TD_OK;
    uint32_t end = from + n < rd->found ? from + n : rd->found, ok_end = end;
    double deadline = td_now_s() + timeout_s;
#define DST(pos) ((uint8_t *)dst[(pos) - from])
    for (uint32_t k = 0; k < rd->n_parts; k++) {
        part_t *p = &rd->parts[k];
        knode_t *nd = p->node;
        uint32_t a = 0, m;
        while (a < p->found && p->pos[a] < from)
            a++;
        m = a;
        while (m < p->found && p->pos[m] < end)
            m++;
        if (m == a)
            continue;
        pthread_mutex_lock(&c->xmu);
        td_status_t rc = nd->peer && !nd->peer_failed ? TD_OK
                                                       : td_error(TD_ERR_UNAVAILABLE, "no connection to %s", nd->id);
        size_t bb = p->block_bytes;
        for (uint32_t i = a; i < m && !rc;) { /* one get per run contiguous on both ends */
            uint32_t j = i + 1;
            while (j < m && p->offsets[j] == p->offsets[j - 1] + bb && DST(p->pos[j]) == DST(p->pos[j - 1]) + bb)
                j++;
            rc = c->xo->get(c->x, nd->peer, nd->region, DST(p->pos[i]), (j - i) * bb, p->offsets[i]);
            i = j;
        }
        double left = deadline - td_now_s();
        if (!rc)
            rc = c->xo->flush(c->x, nd->peer, left > 0.01 ? left : 0.01);
        if (rc)
            nd->peer_failed = true;
        pthread_mutex_unlock(&c->xmu);
        if (rc) {
            TD_WARN("kvstore client: reading %u blocks from %s: %s; the prefix ends before them", m - a, nd->id,
                    td_last_error());
            if (p->pos[a] < ok_end)
                ok_end = p->pos[a];
            continue;
        }
        for (uint32_t i = a; i < m; i++) /* outside the lock: another reader's gets move meanwhile */
            if (td_kv_block_digest(DST(p->pos[i]), bb) != p->digests[i]) {
                TD_WARN("kvstore client: block %u of the chain from %s arrived with another digest; the prefix ends "
                        "before it", p->pos[i], nd->id);
                if (p->pos[i] < ok_end)
                    ok_end = p->pos[i];
                break;
            }
    }
#undef DST
    *got = ok_end - from;
    return TD_OK;
}

void kv_client_read_end(kv_client_t *c, kv_client_read_t *rd)
{
    (void)c; /* the leases end on their nodes' channels */
    if (!rd)
        return;
    for (uint32_t k = 0; k < rd->n_parts; k++) {
        unlease(&rd->parts[k]);
        part_free(&rd->parts[k]);
    }
    free(rd->parts);
    free(rd);
}

/* ------------------------------------------------------------ writes */

/* One node's share of a put job: Put, the puts, Commit; blocks stored. */
static uint32_t put_part(kv_client_t *c, knode_t *nd, const put_job_t *j, const uint32_t *pos, uint32_t m_names,
                         bool replica)
{
    Tandem__Internal__V1__BlockName *store = malloc(m_names * sizeof *store);
    Tandem__Internal__V1__KvPutRequest rq = TANDEM__INTERNAL__V1__KV_PUT_REQUEST__INIT;
    rq.contract = &c->contract_pb;
    rq.has_lease_ms = 1;
    rq.lease_ms = LEASE_MS;
    rq.has_replica = replica;
    rq.replica = replica;
    rq.n_names = m_names;
    rq.names = store ? names_pb(j->names, pos, m_names, store) : NULL;
    td_rpc_result_t res;
    uint32_t stored = 0;
    ProtobufCMessage *m = NULL;
    Tandem__Internal__V1__KvPutResponse *r = NULL;
    if (!rq.names)
        goto out;
    if (td_rpc_unary_pb(nd->ch, "/tandem.internal.v1.KvStore/Put", &rq.base,
                        &tandem__internal__v1__kv_put_response__descriptor, RPC_TIMEOUT_S, NULL, &m, &res)) {
        TD_DEBUG("kvstore client: %s", td_last_error());
        goto out;
    }
    r = (Tandem__Internal__V1__KvPutResponse *)m;
    if (r->n_slots != m_names || !r->put_id)
        goto out;
    size_t bb = td_kv_block_bytes(&c->cfg.contract);
    uint64_t *digests = malloc(m_names * sizeof *digests);
    size_t nd_ = 0;
    /* each block hashed just before its put (its bytes still in cache for
     * the copy), outside the transport's lock: one writer hashes while the
     * other's puts move */
    pthread_mutex_lock(&c->xmu);
    td_status_t rc = digests ? node_peer(c, nd, r->region) : TD_ERR_NO_MEMORY;
    uint64_t gen = nd->peer_gen;
    pthread_mutex_unlock(&c->xmu);
    for (uint32_t i = 0; i < m_names && !rc; i++)
        if (r->slots[i]) {
            digests[nd_++] = j->digests ? j->digests[pos[i]] : td_kv_block_digest(j->src[pos[i]], bb);
            pthread_mutex_lock(&c->xmu);
            if (nd->peer_gen != gen || nd->peer_failed) /* another writer's failure closed this connection */
                rc = td_error(TD_ERR_UNAVAILABLE, "kvstore %s: the connection failed meanwhile", nd->id);
            else
                rc = c->xo->put(c->x, nd->peer, nd->region, j->src[pos[i]], bb, r->slots[i] - 1);
            pthread_mutex_unlock(&c->xmu);
        }
    pthread_mutex_lock(&c->xmu);
    if (!rc && (nd->peer_gen != gen || nd->peer_failed))
        rc = td_error(TD_ERR_UNAVAILABLE, "kvstore %s: the connection failed meanwhile", nd->id);
    if (!rc)
        rc = c->xo->flush(c->x, nd->peer, RPC_TIMEOUT_S);
    if (rc)
        nd->peer_failed = true;
    pthread_mutex_unlock(&c->xmu);
    if (rc) {
        TD_WARN("kvstore client: writing to %s: %s", nd->id, td_last_error());
        free(digests);
        goto out; /* the node frees the room when the put's lease ends */
    }
    Tandem__Internal__V1__KvCommitRequest cq = TANDEM__INTERNAL__V1__KV_COMMIT_REQUEST__INIT;
    cq.has_put_id = 1;
    cq.put_id = r->put_id;
    cq.n_digests = nd_;
    cq.digests = digests;
    ProtobufCMessage *cm = NULL;
    if (td_rpc_unary_pb(nd->ch, "/tandem.internal.v1.KvStore/Commit", &cq.base,
                        &tandem__internal__v1__kv_commit_response__descriptor, RPC_TIMEOUT_S, NULL, &cm, &res) == TD_OK)
        stored = ((Tandem__Internal__V1__KvCommitResponse *)cm)->stored;
    else
        TD_WARN("kvstore client: %s", td_last_error());
    if (cm)
        protobuf_c_message_free_unpacked(cm, NULL);
    free(digests);
out:
    if (m)
        protobuf_c_message_free_unpacked(m, NULL);
    free(rq.names);
    free(store);
    return stored;
}

static void put_run(kv_client_t *c, put_job_t *j)
{
    knode_t *nodes[MAX_NODES];
    uint64_t seeds[MAX_NODES];
    uint32_t nn = live_nodes(c, nodes, seeds, MAX_NODES), stored = 0;
    uint32_t *pos = malloc((j->n + 1) * sizeof *pos);
    int *home = malloc((j->n + 1) * sizeof *home);
    if (nn && pos && home) {
        for (uint32_t i = 0; i < j->n; i++)
            home[i] = kv_client_home(j->names[i], seeds, nn);
        for (uint32_t k = 0; k < nn; k++) {
            uint32_t m = 0;
            for (uint32_t i = 0; i < j->n; i++)
                if (home[i] == (int)k)
                    pos[m++] = i;
            if (m)
                stored += put_part(c, nodes[k], j, pos, m, false);
        }
    }
    free(pos);
    free(home);
    if (j->done)
        j->done(j->ctx, stored);
}

static void *writer_thread(void *arg)
{
    kv_client_t *c = arg;
    pthread_mutex_lock(&c->mu);
    for (;;) {
        while (!c->head && !c->stop)
            pthread_cond_wait(&c->cv, &c->mu);
        if (!c->head)
            break;
        put_job_t *j = c->head;
        c->head = j->next;
        if (!c->head)
            c->tail = NULL;
        c->busy++;
        pthread_mutex_unlock(&c->mu);
        put_run(c, j);
        pthread_mutex_lock(&c->mu);
        c->queued_blocks -= j->n;
        c->busy--;
        pthread_cond_broadcast(&c->idle_cv);
        free(j);
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

td_status_t kv_client_put_async(kv_client_t *c, const td_block_name_t *names, const void *const *src, uint32_t n,
                                void (*done)(void *ctx, uint32_t stored), void *ctx)
{
    put_job_t *j = malloc(sizeof *j + n * (sizeof *j->names + sizeof *j->src));
    if (!j)
        return td_error(TD_ERR_NO_MEMORY, "kvstore client: no memory");
    j->names = (td_block_name_t *)(j + 1);
    j->src = (const void **)(j->names + n);
    memcpy(j->names, names, n * sizeof *names);
    memcpy(j->src, src, n * sizeof *src);
    j->digests = NULL;
    j->n = n;
    j->done = done;
    j->ctx = ctx;
    j->next = NULL;
    pthread_mutex_lock(&c->mu);
    if (c->stop || c->queued_blocks + n > c->cfg.max_queued_blocks) {
        pthread_mutex_unlock(&c->mu);
        free(j);
        return td_error(TD_ERR_EXHAUSTED, "kvstore client: %u blocks wait to be written already", c->queued_blocks);
    }
    c->queued_blocks += n;
    if (c->tail)
        c->tail->next = j;
    else
        c->head = j;
    c->tail = j;
    pthread_cond_signal(&c->cv);
    pthread_mutex_unlock(&c->mu);
    return TD_OK;
}

td_status_t kv_client_put_node(kv_client_t *c, const char *node_id, const td_block_name_t *names,
                               const void *const *src, const uint64_t *digests, uint32_t n, bool replica,
                               uint32_t *stored)
{
    *stored = 0;
    knode_t *nodes[MAX_NODES], *nd = NULL;
    uint64_t seeds[MAX_NODES];
    uint32_t nn = live_nodes(c, nodes, seeds, MAX_NODES);
    for (uint32_t i = 0; i < nn && !nd; i++)
        if (!strcmp(nodes[i]->id, node_id))
            nd = nodes[i];
    if (!nd)
        return td_error(TD_ERR_NOT_FOUND, "kvstore client: no live node %s", node_id);
    uint32_t *pos = malloc((n + 1) * sizeof *pos);
    if (!pos)
        return td_error(TD_ERR_NO_MEMORY, "kvstore client: no memory");
    for (uint32_t i = 0; i < n; i++)
        pos[i] = i;
    put_job_t j = {.names = (td_block_name_t *)names, .src = (const void **)src, .digests = digests, .n = n};
    *stored = put_part(c, nd, &j, pos, n, replica);
    free(pos);
    return TD_OK;
}

/* ------------------------------------------------------------ life */

td_status_t kv_client_create(const kv_client_config_t *cfg, kv_client_t **out)
{
    kv_client_t *c = calloc(1, sizeof *c);
    if (!c)
        return td_error(TD_ERR_NO_MEMORY, "kvstore client: no memory");
    c->cfg = *cfg;
    if (!c->cfg.max_queued_blocks)
        c->cfg.max_queued_blocks = 4096;
    td_kv_layout_to_pb(&c->cfg.contract, &c->contract_pb);
    pthread_mutex_init(&c->mu, NULL);
    pthread_mutex_init(&c->xmu, NULL);
    pthread_cond_init(&c->cv, NULL);
    pthread_cond_init(&c->idle_cv, NULL);
    c->xo = &kv_transport_ucx;
    td_status_t rc = c->xo->create(&c->cfg.xfer, &c->x);
    if (!rc)
        rc = td_etcd_connect(cfg->etcd_endpoints, cfg->tls, &c->etcd);
    td_etcd_kvs_t kvs = {0};
    if (!rc)
        rc = td_etcd_get(c->etcd, PREFIX, true, &kvs);
    if (!rc) {
        for (size_t i = 0; i < kvs.n; i++)
            node_set(c, kvs.kv[i].key, (const char *)kvs.kv[i].value, true);
        rc = td_etcd_watch_start(c->etcd, PREFIX, kvs.revision + 1, on_watch, on_resync, c, &c->watch);
        td_etcd_kvs_free(&kvs);
    }
    if (!rc) {
        while (!rc && c->n_writers < KV_WRITERS)
            if (pthread_create(&c->writers[c->n_writers], NULL, writer_thread, c))
                rc = td_error(TD_ERR_INTERNAL, "kvstore client: cannot start its writers");
            else
                c->n_writers++;
    }
    if (rc) {
        kv_client_destroy(c);
        return rc;
    }
    *out = c;
    return TD_OK;
}

void kv_client_destroy(kv_client_t *c)
{
    if (!c)
        return;
    if (c->n_writers) {
        pthread_mutex_lock(&c->mu);
        struct timespec dl = td_deadline_on(CLOCK_REALTIME, 5.0);
        while ((c->head || c->busy) && pthread_cond_timedwait(&c->idle_cv, &c->mu, &dl) == 0)
            ;
        /* what is still queued is dropped, its done called */
        put_job_t *left = c->head;
        c->head = c->tail = NULL;
        c->stop = true;
        pthread_cond_broadcast(&c->cv);
        pthread_mutex_unlock(&c->mu);
        for (uint32_t i = 0; i < c->n_writers; i++)
            pthread_join(c->writers[i], NULL);
        while (left) {
            put_job_t *nx = left->next;
            if (left->done)
                left->done(left->ctx, 0);
            free(left);
            left = nx;
        }
    }
    td_etcd_watch_stop(c->watch);
    td_etcd_destroy(c->etcd);
    for (size_t i = 0; i < c->n_nodes; i++) {
        if (c->nodes[i]->peer)
            c->xo->disconnect(c->x, c->nodes[i]->peer);
        td_rpc_channel_destroy(c->nodes[i]->ch);
        free(c->nodes[i]);
    }
    free(c->nodes);
    if (c->x)
        c->xo->destroy(c->x);
    free(c);
}
