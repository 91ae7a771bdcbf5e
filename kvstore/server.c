/* server.c — tandem-kvstore, one node of the KV store (DESIGN.md §4).
 *
 * The CPU tier is one region of kvstore.dram_mb bytes allocated by the KV
 * transport (UCX maps it, so peers' puts and gets into it are one-sided),
 * cut into slots of one block each; the SSD tier (kvstore/ssd.h), when
 * kvstore.ssd_mb is set, holds blocks the CPU tier evicts, in block files
 * under kvstore.data_dir, and brings them back on a hit. The index
 * (kvstore/index.h) names every block the node holds.
 *
 * A node serves one KV contract's blocks: the first writer's (its block
 * size cuts the region); a peer stating another is refused, naming both.
 *
 * Reads and writes are leased: Get holds the blocks of the prefix it returns
 * (they are not evicted) until Unlease or lease_ms passes — a reader that
 * died leaves nothing held for long. Put takes room for the names the node
 * lacks (a name held already, or being written, is skipped) and holds it
 * until Commit, which records the writer's digest of every block (or
 * until the lease ends: the room is freed). The digest is the writer's, not
 * recomputed here (a pass over every byte, under the lock, at the memory
 * bandwidth the put itself needs): every reader checks the bytes it gets
 * against it and the SSD tier checks its reads, so a block that landed
 * otherwise than its writer sent is a miss where it is read, never KV. A full tier evicts
 * its coldest unheld block (kvstore/index.c); when none can go the name is
 * not stored, and Put says so per name, never fails.
 *
 * Events: every name that becomes readable, moves tier or goes is one
 * event in a ring (EVENT_RING), numbered from 1 in this run (the epoch, a
 * random number drawn at start); a follower polls Events for what came
 * after the last it applied, and takes a Snapshot when it fell off the
 * ring, the epoch changed or it has none yet.
 *
 * One lock around the index and tiers: every operation under it is a
 * table probe or a list move per name; SSD reads and writes happen under it
 * too (simple, and the SSD tier is the slow path). */
#define _GNU_SOURCE
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/grow.h"
#include "common/kv_contract_pb.h"
#include "common/kv_events.h"
#include "common/log.h"
#include "common/metrics.h"
#include "common/process.h"
#include "common/service.h"
#include "common/rpc_pb.h"
#include "kvstore/client.h"
#include "kvstore/index.h"
#include "kvstore/ssd.h"
#include "kvstore/tier.h"
#include "kvstore/transfer.h"
#include "tandem/internal/v1/kvstore.pb-c.h"

#define MAX_LEASE_MS 60000u
#define DEFAULT_LEASE_MS 10000u
#define MAX_NAMES 65536u   /* names in one Get or Put (a 1M-token prompt of 16-token blocks) */
#define MAX_LEASES 65536u
#define EVENT_RING 65536u  /* events a follower may fall behind by before it needs a Snapshot */
#define MAX_SNAPSHOT 65536u /* names in one Snapshot page */
#define REPL_QUEUE 1024u   /* hot blocks waiting to be copied to a reader's node */
#define REPL_BATCH 64u     /* copied to one node in one Put */

/* A hot block to copy to the node near its reader: the entry is held (refs)
 * until the copy is done. */
typedef struct repl_job {
    uint32_t id;
    td_block_name_t name;
    char to[64];
} repl_job_t;

typedef struct lease {
    uint64_t id;
    double until;
    bool put;
    uint32_t *ids; /* entries held */
    uint32_t n;
} lease_t;

typedef struct node {
    td_config_t cfg;
    char id[64], listen[128], advertise[160], metrics_at[160];
    td_rpc_tls_t tls_files;
    const td_rpc_tls_t *tls;
    td_rpc_server_t *srv;
    td_metrics_t *metrics;
    td_metrics_server_t *msrv;
    bool ev_up; /* ev made */
    /* the CPU tier's region */
    const kv_transport_ops_t *xo;
    kv_xfer_t *xfer;
    kv_xfer_mem_t *mem;
    uint8_t *base;
    size_t bytes;
    void *rkey, *addr;
    size_t rkey_len, addr_len;
    kv_ssd_t *ssd;
    pthread_mutex_t mu;
    /* set by the first writer's contract (or the SSD tier's files) */
    bool have_contract;
    td_kv_layout_t contract;
    size_t block_bytes;
    kv_index_t *ix;
    /* the tiers (kvstore/tier.h): the CPU tier first, each further one below the one before */
    const kv_tier_ops_t *tier_ops[KV_TIERS];
    void *tier[KV_TIERS];
    uint32_t n_tiers;
    uint8_t *bounce; /* one block: a move between tiers neither of which is in memory */
    lease_t *leases;
    uint32_t n_leases;
    size_t cap_leases;
    uint64_t next_lease;
    td_kv_events_t ev; /* names that became readable, moved tier or went (common/kv_events.h) */
    /* hot-block replication (kvstore.replicas_max, hot_hits, hit_half_life_s) */
    repl_job_t *repl_q;
    uint32_t repl_n; /* jobs queued: repl_q[0 .. repl_n) */
    pthread_cond_t repl_cv;
    pthread_t repl_thread;
    bool repl_up, repl_stop;
    kv_client_t *repl; /* made by the replicator once the contract is known */
    uint32_t n_replicas;
    double cool_scan_at;
    /* stats */
    uint64_t gets, hits, puts, stored, dropped_full, evictions[KV_TIERS], tier_hits[KV_TIERS];
    uint64_t replicas_pushed, replicas_dropped;
} node_t;

/* ------------------------------------------------------------ tiers */

/* Makes the index and cuts the tiers into slots once the block size is
 * known. */
static td_status_t adopt_contract(node_t *N, const td_kv_layout_t *l)
{
    size_t bb = td_kv_block_bytes(l);
    uint32_t slots[KV_TIERS] = {0}, total = 0;
    td_status_t rc = kv_cpu_tier_cut(N->tier[KV_TIER_CPU], bb, &slots[KV_TIER_CPU]);
    if (rc)
        return rc;
    if (N->ssd && (rc = kv_ssd_set_block_bytes(N->ssd, l, &slots[KV_TIER_SSD])))
        return rc;
    for (uint32_t k = 0; k < N->n_tiers; k++)
        total += slots[k];
    if (!(N->bounce = malloc(bb)))
        return td_error(TD_ERR_NO_MEMORY, "kvstore %s: no memory", N->id);
    if ((rc = kv_index_create(total, &N->ix)))
        return rc;
    kv_index_set_half_life(N->ix, N->cfg.kvstore.hit_half_life_s);
    for (uint32_t k = 0; k < N->n_tiers; k++)
        if (slots[k])
            kv_index_set_capacity(N->ix, (kv_tier_t)k, slots[k]);
    N->block_bytes = bb;
    N->contract = *l;
    N->have_contract = true;
    TD_INFO("kvstore %s: blocks of %zu bytes (%s, %u tokens, %s): %u in DRAM, %u on SSD", N->id, bb, l->model_id,
            l->block_tokens, td_kv_dtype_name(l->dtype), slots[KV_TIER_CPU], slots[KV_TIER_SSD]);
    return TD_OK;
}

/* A CPU-tier slot's bytes (the memory peers put into and get from). */
static uint8_t *slot_mem(node_t *N, uint32_t slot) { return kv_tier_cpu.mem(N->tier[KV_TIER_CPU], slot); }

static void tier_give(node_t *N, uint32_t k, uint32_t slot) { N->tier_ops[k]->give(N->tier[k], slot); }

/* An event about a readable entry: it is now in its tier (STORED) or gone. */
static void emit(node_t *N, const kv_entry_t *e, Tandem__Internal__V1__KvEvent__Kind kind)
{
    if (e->state != KV_READY)
        return;
    td_kv_events_add(&N->ev, kind, e->name, e->tier);
}

static void drop_entry(node_t *N, uint32_t id)
{
    kv_entry_t *e = kv_index_entry(N->ix, id);
    emit(N, e, TANDEM__INTERNAL__V1__KV_EVENT__KIND__KV_EVENT_REMOVED);
    if (e->replica && e->state == KV_READY)
        N->n_replicas--;
    tier_give(N, e->tier, e->slot);
    kv_index_remove(N->ix, id);
}

static bool demote(node_t *N, uint32_t id);

/* A free slot in tier k, its coldest unheld blocks moved a tier down (or
 * dropped, from the last tier) until one is; false when every block of
 * tier k is held. */
static bool tier_slot(node_t *N, uint32_t k, uint32_t *slot)
{
    while (!N->tier_ops[k]->take(N->tier[k], slot)) {
        uint32_t v = kv_index_victim(N->ix, (kv_tier_t)k);
        if (v == KV_NONE)
            return false;
        N->evictions[k]++;
        if (!demote(N, v))
            drop_entry(N, v);
    }
    return true;
}

/* Entry id goes one tier down, its slot above freed; false: it could not
 * (no tier below, no room there, an I/O error, logged) and stays. A
 * replica's home keeps the block: evicting a replica drops it. */
static bool demote(node_t *N, uint32_t id)
{
    kv_entry_t *e = kv_index_entry(N->ix, id);
    uint32_t from = e->tier, to = from + 1u, slot;
    if (e->replica || to >= N->n_tiers || !tier_slot(N, to, &slot))
        return false;
    const kv_tier_ops_t *fo = N->tier_ops[from]; /* a tier not in memory is read into the bounce block first */
    const uint8_t *src = fo->mem ? fo->mem(N->tier[from], e->slot) : N->bounce;
    td_status_t rc = fo->mem ? TD_OK : fo->read(N->tier[from], e->slot, e->name, e->digest, N->bounce);
    if (rc || (rc = N->tier_ops[to]->write(N->tier[to], slot, e->name, e->digest, src))) {
        TD_WARN("kvstore %s: %s", N->id, td_last_error());
        tier_give(N, to, slot);
        return false;
    }
    tier_give(N, from, e->slot);
    kv_index_move(N->ix, id, (kv_tier_t)to, slot);
    emit(N, e, TANDEM__INTERNAL__V1__KV_EVENT__KIND__KV_EVENT_STORED);
    return true;
}

/* A hit below the CPU tier: read into a CPU slot (its digest checked) and
 * moved there; false (the block dropped, said in the log) if its bytes are
 * bad. */
static bool promote(node_t *N, uint32_t id)
{
    kv_entry_t *e = kv_index_entry(N->ix, id);
    uint32_t from = e->tier, slot;
    e->refs++; /* not a victim of the room made for it */
    bool ok = tier_slot(N, KV_TIER_CPU, &slot);
    e->refs--;
    if (!ok)
        return false;
    if (N->tier_ops[from]->read(N->tier[from], e->slot, e->name, e->digest, slot_mem(N, slot)) != TD_OK) {
        TD_WARN("kvstore %s: %s; the block is dropped (a miss)", N->id, td_last_error());
        tier_give(N, KV_TIER_CPU, slot);
        drop_entry(N, id);
        return false;
    }
    tier_give(N, from, e->slot);
    kv_index_move(N->ix, id, KV_TIER_CPU, slot);
    emit(N, e, TANDEM__INTERNAL__V1__KV_EVENT__KIND__KV_EVENT_STORED);
    return true;
}

/* ------------------------------------------------------------ leases */

static lease_t *lease_new(node_t *N, bool put, uint32_t lease_ms, uint32_t cap)
{
    if (N->n_leases == MAX_LEASES)
        return NULL;
    if (!td_grow((void **)&N->leases, &N->cap_leases, N->n_leases + 1, sizeof *N->leases, 64))
        return NULL;
    lease_t *l = &N->leases[N->n_leases];
    if (!(l->ids = malloc((cap ? cap : 1) * sizeof *l->ids)))
        return NULL;
    l->id = ++N->next_lease;
    l->until = td_now_s() + (lease_ms ? (lease_ms < MAX_LEASE_MS ? lease_ms : MAX_LEASE_MS) : DEFAULT_LEASE_MS) / 1e3;
    l->put = put;
    l->n = 0;
    N->n_leases++;
    return l;
}

/* Ends lease i: a read lease lets go of its blocks; an uncommitted write
 * lease frees the room it took. */
static void lease_end(node_t *N, uint32_t i)
{
    lease_t *l = &N->leases[i];
    for (uint32_t k = 0; k < l->n; k++) {
        kv_entry_t *e = kv_index_entry(N->ix, l->ids[k]);
        if (e->refs)
            e->refs--;
        if (l->put && e->state == KV_PENDING)
            drop_entry(N, l->ids[k]);
    }
    free(l->ids);
    N->leases[i] = N->leases[--N->n_leases];
}

static int lease_find(node_t *N, uint64_t id)
{
    for (uint32_t i = 0; i < N->n_leases; i++)
        if (N->leases[i].id == id)
            return (int)i;
    return -1;
}

static void leases_expire(node_t *N)
{
    double now = td_now_s();
    for (uint32_t i = 0; i < N->n_leases;)
        if (N->leases[i].until < now) {
            TD_DEBUG("kvstore %s: %s lease %llu expired", N->id, N->leases[i].put ? "write" : "read",
                     (unsigned long long)N->leases[i].id);
            lease_end(N, i);
        } else {
            i++;
        }
}

/* ------------------------------------------------------------ replication */

/* A hit on one of this node's own blocks, read by a worker near reader
 * (its kvstore.near; readers ask their near node first). When the block is
 * hot (its decayed hits reach hot_hits) and fewer than replicas_max nodes
 * got a copy since it was last cool, one is queued for the reader's node:
 * reads of it move to the readers' nodes, and a reader whose block's home
 * dies still finds it. The count is reset when the block cools here
 * (hot_hits / 4): a copy that cools elsewhere first is not replaced until
 * then, so copies never exceed replicas_max. */
static void maybe_replicate(node_t *N, uint32_t id, const char *reader, double now)
{
    kv_entry_t *e = kv_index_entry(N->ix, id);
    uint32_t max = N->cfg.kvstore.replicas_max;
    if (!max || e->replica || !reader || !reader[0] || !strcmp(reader, N->id) || e->tier != KV_TIER_CPU || !N->repl_q)
        return;
    double h = kv_index_hits(N->ix, id, now);
    if (h < N->cfg.kvstore.hot_hits / 4.0) {
        memset(e->sent_to, 0, sizeof e->sent_to);
        return;
    }
    if (h < N->cfg.kvstore.hot_hits || N->repl_n == REPL_QUEUE)
        return;
    uint64_t seed = kv_client_node_seed(reader);
    uint32_t k = 0;
    for (; k < max && k < KV_ENTRY_REPLICAS && e->sent_to[k]; k++)
        if (e->sent_to[k] == seed)
            return;
    if (k == max || k == KV_ENTRY_REPLICAS)
        return;
    e->sent_to[k] = seed;
    e->refs++;
    repl_job_t *j = &N->repl_q[N->repl_n++];
    j->id = id;
    j->name = e->name;
    snprintf(j->to, sizeof j->to, "%s", reader);
    pthread_cond_signal(&N->repl_cv);
}

/* The replicator: copies queued hot blocks, a batch per target node, with
 * the client library (Put as replicas, UCX puts from this node's own CPU
 * tier, Commit with the digests their writers gave); the blocks are held
 * until then. */
static void *replicator(void *arg)
{
    node_t *N = arg;
    repl_job_t batch[REPL_BATCH];
    td_block_name_t names[REPL_BATCH];
    const void *src[REPL_BATCH];
    uint64_t digests[REPL_BATCH];
    pthread_mutex_lock(&N->mu);
    for (;;) {
        while (!N->repl_n && !N->repl_stop)
            pthread_cond_wait(&N->repl_cv, &N->mu);
        if (N->repl_stop)
            break;
        /* the first job's target, and every queued job for it */
        uint32_t nb = 0, kept = 0;
        char to[64];
        snprintf(to, sizeof to, "%s", N->repl_q[0].to);
        for (uint32_t i = 0; i < N->repl_n; i++) {
            repl_job_t *j = &N->repl_q[i];
            if (nb < REPL_BATCH && !strcmp(j->to, to))
                batch[nb++] = *j;
            else
                N->repl_q[kept++] = *j;
        }
        N->repl_n = kept;
        for (uint32_t i = 0; i < nb; i++) {
            kv_entry_t *e = kv_index_entry(N->ix, batch[i].id);
            names[i] = batch[i].name;
            src[i] = slot_mem(N, e->slot);
            digests[i] = e->digest; /* its writer's: a copy does not vouch for bytes changed since */
        }
        td_status_t rc = TD_OK;
        if (!N->repl) {
            kv_client_config_t kc = {.etcd_endpoints = N->cfg.etcd.endpoints, .tls = N->tls, .contract = N->contract,
                                     .xfer = {.peer_errors = N->cfg.transport.peer_errors,
                                              .interfaces = N->cfg.transport.interfaces}};
            pthread_mutex_unlock(&N->mu);
            rc = kv_client_create(&kc, &N->repl);
            pthread_mutex_lock(&N->mu);
        }
        uint32_t stored = 0;
        if (!rc) {
            pthread_mutex_unlock(&N->mu); /* the blocks are held: their slots stay theirs */
            rc = kv_client_put_node(N->repl, to, names, src, digests, nb, true, &stored);
            pthread_mutex_lock(&N->mu);
        }
        if (rc)
            TD_WARN("kvstore %s: copying %u hot blocks to %s: %s", N->id, nb, to, td_last_error());
        else
            TD_DEBUG("kvstore %s: %u hot blocks copied to %s (%u new)", N->id, nb, to, stored);
        N->replicas_pushed += stored;
        for (uint32_t i = 0; i < nb; i++) {
            kv_entry_t *e = kv_index_entry(N->ix, batch[i].id);
            if (e->refs)
                e->refs--;
        }
    }
    pthread_mutex_unlock(&N->mu);
    return NULL;
}

static bool drop_cool(void *ctx, uint32_t id, kv_entry_t *e)
{
    node_t *N = ctx;
    double now = td_now_s();
    if (e->replica && e->state == KV_READY && !e->refs &&
        kv_index_hits(N->ix, id, now) < N->cfg.kvstore.hot_hits / 4.0) {
        TD_DEBUG("kvstore %s: a replica cooled: dropped", N->id);
        N->replicas_dropped++;
        drop_entry(N, id);
    }
    return N->n_replicas > 0;
}

/* ------------------------------------------------------------ RPCs */


static void region_pb(node_t *N, Tandem__Internal__V1__KvRegion *r)
{
    tandem__internal__v1__kv_region__init(r);
    r->transport = (char *)N->xo->name;
    r->has_address = r->has_region_key = r->has_remote_base = r->has_region_bytes = 1;
    r->address = (ProtobufCBinaryData){N->addr_len, N->addr};
    r->region_key = (ProtobufCBinaryData){N->rkey_len, N->rkey};
    r->remote_base = (uint64_t)(uintptr_t)N->base;
    r->region_bytes = N->bytes;
}

/* The peer's contract against the node's (adopted when the node has none
 * and adopt is set): an RPC code, with msg filled on refusal. */
static int contract_ok(node_t *N, const Tandem__Internal__V1__KvContract *pb, bool adopt, char *msg, size_t cap)
{
    td_kv_layout_t l;
    if (td_kv_layout_from_pb(pb, &l)) {
        snprintf(msg, cap, "contract: %s", td_last_error());
        return TD_RPC_INVALID_ARGUMENT;
    }
    if (!N->have_contract) {
        if (!adopt)
            return TD_RPC_OK;
        if (adopt_contract(N, &l)) {
            snprintf(msg, cap, "%s", td_last_error());
            return TD_RPC_FAILED_PRECONDITION;
        }
        return TD_RPC_OK;
    }
    if (td_kv_contract_check(&N->contract, &l, "the caller")) {
        snprintf(msg, cap, "kvstore %s holds another KV contract's blocks: %s", N->id, td_last_error());
        return TD_RPC_FAILED_PRECONDITION;
    }
    return TD_RPC_OK;
}

static td_block_name_t name_of(const Tandem__Internal__V1__BlockName *b)
{
    return (td_block_name_t){b->lo, b->hi};
}

static void h_get(void *ctx, td_rpc_call_t *call)
{
    node_t *N = ctx;
    Tandem__Internal__V1__KvGetRequest *rq = (Tandem__Internal__V1__KvGetRequest *)td_rpc_request_pb(call, &tandem__internal__v1__kv_get_request__descriptor);
    if (!rq)
        return;
    if (rq->reader_node && strlen(rq->reader_node) >= sizeof ((repl_job_t *)0)->to) {
        td_rpc_call_finish(call, TD_RPC_INVALID_ARGUMENT, "kvstore Get: reader_node is %zu bytes, more than %zu",
                           strlen(rq->reader_node), sizeof ((repl_job_t *)0)->to - 1);
        tandem__internal__v1__kv_get_request__free_unpacked(rq, NULL);
        return;
    }
    if (rq->n_names > MAX_NAMES) {
        td_rpc_call_finish(call, TD_RPC_INVALID_ARGUMENT, "kvstore Get: %zu names, more than %u", rq->n_names,
                           MAX_NAMES);
        tandem__internal__v1__kv_get_request__free_unpacked(rq, NULL);
        return;
    }
    uint64_t *offsets = malloc((rq->n_names + 1) * sizeof *offsets), *digests = malloc((rq->n_names + 1) * sizeof *digests);
    Tandem__Internal__V1__KvGetResponse r = TANDEM__INTERNAL__V1__KV_GET_RESPONSE__INIT;
    Tandem__Internal__V1__KvRegion reg;
    char msg[512];
    pthread_mutex_lock(&N->mu);
    int code = offsets && digests ? contract_ok(N, rq->contract, false, msg, sizeof msg) : TD_RPC_RESOURCE_EXHAUSTED;
    if (code == TD_RPC_RESOURCE_EXHAUSTED)
        snprintf(msg, sizeof msg, "no memory");
    size_t found = 0;
    uint32_t ssd_hits = 0;
    if (!code && N->have_contract && rq->n_names) {
        leases_expire(N);
        lease_t *l = lease_new(N, false, rq->lease_ms, (uint32_t)rq->n_names);
        if (!l) {
            code = TD_RPC_RESOURCE_EXHAUSTED;
            snprintf(msg, sizeof msg, "kvstore %s: %u leases open, the most it holds", N->id, N->n_leases);
        } else {
            double now = td_now_s();
            N->gets += rq->n_names;
            for (; found < rq->n_names; found++) {
                uint32_t id = kv_index_find(N->ix, name_of(rq->names[found]));
                if (id == KV_NONE)
                    break;
                kv_entry_t *e = kv_index_entry(N->ix, id);
                if (e->state != KV_READY)
                    break;
                uint32_t tier = e->tier;
                if (tier != KV_TIER_CPU && !promote(N, id))
                    break;
                ssd_hits += tier != KV_TIER_CPU;
                N->tier_hits[tier]++;
                kv_index_touch(N->ix, id, now);
                maybe_replicate(N, id, rq->reader_node, now);
                e->refs++;
                l->ids[l->n++] = id;
                offsets[found] = (uint64_t)e->slot * N->block_bytes;
                digests[found] = e->digest;
            }
            N->hits += found;
            if (found) {
                r.has_lease_id = 1;
                r.lease_id = l->id;
            } else {
                lease_end(N, N->n_leases - 1);
            }
        }
    }
    if (!code) {
        r.n_offsets = r.n_digests = found;
        r.offsets = offsets;
        r.digests = digests;
        r.has_block_bytes = 1;
        r.block_bytes = N->block_bytes;
        region_pb(N, &reg);
        r.region = &reg;
        r.node = N->id;
        r.has_ssd_hits = 1;
        r.ssd_hits = ssd_hits;
    }
    pthread_mutex_unlock(&N->mu);
    if (code)
        td_rpc_call_finish(call, code, "%s", msg);
    else
        td_rpc_reply_pb(call, &r.base);
    free(offsets);
    free(digests);
    tandem__internal__v1__kv_get_request__free_unpacked(rq, NULL);
}

static void h_unlease(void *ctx, td_rpc_call_t *call)
{
    node_t *N = ctx;
    Tandem__Internal__V1__KvUnleaseRequest *rq = (Tandem__Internal__V1__KvUnleaseRequest *)td_rpc_request_pb(call, &tandem__internal__v1__kv_unlease_request__descriptor);
    if (!rq)
        return;
    pthread_mutex_lock(&N->mu);
    int i = lease_find(N, rq->lease_id);
    if (i >= 0 && !N->leases[i].put)
        lease_end(N, (uint32_t)i);
    pthread_mutex_unlock(&N->mu);
    tandem__internal__v1__kv_unlease_request__free_unpacked(rq, NULL);
    Tandem__Internal__V1__KvUnleaseResponse r = TANDEM__INTERNAL__V1__KV_UNLEASE_RESPONSE__INIT;
    td_rpc_reply_pb(call, &r.base);
}

static void h_put(void *ctx, td_rpc_call_t *call)
{
    node_t *N = ctx;
    Tandem__Internal__V1__KvPutRequest *rq = (Tandem__Internal__V1__KvPutRequest *)td_rpc_request_pb(call, &tandem__internal__v1__kv_put_request__descriptor);
    if (!rq)
        return;
    if (rq->n_names > MAX_NAMES) {
        td_rpc_call_finish(call, TD_RPC_INVALID_ARGUMENT, "kvstore Put: %zu names, more than %u", rq->n_names,
                           MAX_NAMES);
        tandem__internal__v1__kv_put_request__free_unpacked(rq, NULL);
        return;
    }
    uint64_t *slots = calloc(rq->n_names + 1, sizeof *slots);
    Tandem__Internal__V1__KvPutResponse r = TANDEM__INTERNAL__V1__KV_PUT_RESPONSE__INIT;
    Tandem__Internal__V1__KvRegion reg;
    char msg[512];
    pthread_mutex_lock(&N->mu);
    int code = slots ? contract_ok(N, rq->contract, true, msg, sizeof msg) : TD_RPC_RESOURCE_EXHAUSTED;
    if (code == TD_RPC_RESOURCE_EXHAUSTED)
        snprintf(msg, sizeof msg, "no memory");
    if (!code && rq->n_names) {
        leases_expire(N);
        lease_t *l = lease_new(N, true, rq->lease_ms, (uint32_t)rq->n_names);
        if (!l) {
            code = TD_RPC_RESOURCE_EXHAUSTED;
            snprintf(msg, sizeof msg, "kvstore %s: %u leases open, the most it holds", N->id, N->n_leases);
        } else {
            double now = td_now_s();
            N->puts += rq->n_names;
            for (size_t i = 0; i < rq->n_names; i++) {
                td_block_name_t nm = name_of(rq->names[i]);
                uint32_t have = kv_index_find(N->ix, nm);
                if (have != KV_NONE) { /* held or being written: deduplicated */
                    kv_entry_t *e = kv_index_entry(N->ix, have);
                    if (e->replica && !rq->replica && e->state == KV_READY) {
                        e->replica = false; /* a writer's own block now, not a copy that may cool away */
                        N->n_replicas--;
                    }
                    continue;
                }
                uint32_t slot, id;
                if (!tier_slot(N, KV_TIER_CPU, &slot)) {
                    N->dropped_full++;
                    continue;
                }
                if ((id = kv_index_insert(N->ix, nm, KV_TIER_CPU, slot, now)) == KV_NONE) {
                    tier_give(N, KV_TIER_CPU, slot);
                    N->dropped_full++;
                    continue;
                }
                kv_index_entry(N->ix, id)->refs = 1;
                kv_index_entry(N->ix, id)->replica = rq->replica;
                l->ids[l->n++] = id;
                slots[i] = 1 + (uint64_t)slot * N->block_bytes;
            }
            if (l->n) {
                r.has_put_id = 1;
                r.put_id = l->id;
            } else {
                lease_end(N, N->n_leases - 1);
            }
        }
    }
    if (!code) {
        r.n_slots = rq->n_names;
        r.slots = slots;
        r.has_block_bytes = 1;
        r.block_bytes = N->block_bytes;
        region_pb(N, &reg);
        r.region = &reg;
        r.node = N->id;
    }
    pthread_mutex_unlock(&N->mu);
    if (code)
        td_rpc_call_finish(call, code, "%s", msg);
    else
        td_rpc_reply_pb(call, &r.base);
    free(slots);
    tandem__internal__v1__kv_put_request__free_unpacked(rq, NULL);
}

static void h_commit(void *ctx, td_rpc_call_t *call)
{
    node_t *N = ctx;
    Tandem__Internal__V1__KvCommitRequest *rq = (Tandem__Internal__V1__KvCommitRequest *)td_rpc_request_pb(call, &tandem__internal__v1__kv_commit_request__descriptor);
    if (!rq)
        return;
    Tandem__Internal__V1__KvCommitResponse r = TANDEM__INTERNAL__V1__KV_COMMIT_RESPONSE__INIT;
    r.has_stored = 1;
    int code = TD_RPC_OK;
    char msg[256];
    pthread_mutex_lock(&N->mu);
    int i = lease_find(N, rq->put_id);
    if (i < 0 || !N->leases[i].put) {
        code = TD_RPC_NOT_FOUND;
        snprintf(msg, sizeof msg, "kvstore %s: no open put %llu (its lease ended: the room was freed)", N->id,
                 (unsigned long long)rq->put_id);
    } else if (rq->n_digests != N->leases[i].n) {
        code = TD_RPC_INVALID_ARGUMENT;
        snprintf(msg, sizeof msg, "kvstore Commit: %zu digests for %u blocks", rq->n_digests, N->leases[i].n);
    } else {
        lease_t *l = &N->leases[i];
        for (uint32_t k = 0; k < l->n; k++) {
            kv_entry_t *e = kv_index_entry(N->ix, l->ids[k]);
            e->digest = rq->digests[k];
            e->state = KV_READY;
            if (e->replica) { /* as hot as its home found it: it cools from there */
                N->n_replicas++;
                e->hits = N->cfg.kvstore.hot_hits;
                e->hits_at = td_now_s();
            }
            emit(N, e, TANDEM__INTERNAL__V1__KV_EVENT__KIND__KV_EVENT_STORED);
            r.stored++;
        }
        N->stored += r.stored;
        lease_end(N, (uint32_t)i);
    }
    pthread_mutex_unlock(&N->mu);
    tandem__internal__v1__kv_commit_request__free_unpacked(rq, NULL);
    if (code)
        td_rpc_call_finish(call, code, "%s", msg);
    else
        td_rpc_reply_pb(call, &r.base);
}

static void h_stats(void *ctx, td_rpc_call_t *call)
{
    node_t *N = ctx;
    Tandem__Internal__V1__KvStatsResponse r = TANDEM__INTERNAL__V1__KV_STATS_RESPONSE__INIT;
    Tandem__Internal__V1__KvTierStats t[KV_TIERS], *tp[KV_TIERS];
    Tandem__Internal__V1__KvContract c;
    pthread_mutex_lock(&N->mu);
    leases_expire(N);
    r.id = N->id;
    size_t nt = N->n_tiers;
    r.checksum_errors = 0;
    for (size_t k = 0; k < nt; k++) {
        tandem__internal__v1__kv_tier_stats__init(&t[k]);
        tp[k] = &t[k];
        t[k].tier = (char *)N->tier_ops[k]->name;
        t[k].has_capacity_bytes = t[k].has_used_bytes = t[k].has_blocks = t[k].has_hits = t[k].has_evictions = 1;
        t[k].capacity_bytes = N->tier_ops[k]->capacity(N->tier[k]);
        r.checksum_errors += N->tier_ops[k]->bad_reads(N->tier[k]);
        t[k].blocks = N->ix ? kv_index_tier_count(N->ix, (kv_tier_t)k) : 0;
        t[k].used_bytes = (uint64_t)t[k].blocks * N->block_bytes;
        t[k].hits = N->tier_hits[k];
        t[k].evictions = N->evictions[k];
    }
    r.n_tiers = nt;
    r.tiers = tp;
    r.has_gets = r.has_hits = r.has_puts = r.has_stored = r.has_dropped_full = r.has_checksum_errors = 1;
    r.has_leases = r.has_block_bytes = 1;
    r.gets = N->gets;
    r.hits = N->hits;
    r.puts = N->puts;
    r.stored = N->stored;
    r.dropped_full = N->dropped_full;
    r.leases = N->n_leases;
    r.block_bytes = N->block_bytes;
    r.has_replicas = r.has_replicas_pushed = r.has_replicas_dropped = 1;
    r.replicas = N->n_replicas;
    r.replicas_pushed = N->replicas_pushed;
    r.replicas_dropped = N->replicas_dropped;
    if (N->have_contract) {
        td_kv_layout_to_pb(&N->contract, &c);
        r.contract = &c;
    }
    td_rpc_reply_pb(call, &r.base); /* under the lock: the contract's strings are the node's */
    pthread_mutex_unlock(&N->mu);
}

/* Before each scrape: the node's counters and tiers as Prometheus series. */
static void metrics_collect(void *ctx, td_metrics_t *m)
{
    node_t *N = ctx;
    char l[96], t[48];
    pthread_mutex_lock(&N->mu);
    double bad = 0;
    for (size_t k = 0; k < N->n_tiers; k++) {
        const char *tier = N->tier_ops[k]->name;
        bad += (double)N->tier_ops[k]->bad_reads(N->tier[k]);
        uint32_t blocks = N->ix ? kv_index_tier_count(N->ix, (kv_tier_t)k) : 0;
        td_metrics_label(t, sizeof t, "tier", tier);
        snprintf(l, sizeof l, "%s,state=\"capacity\"", t);
        td_metric_set(td_metrics_series(m, TD_GAUGE, "tandem:kvstore_tier_bytes", "Bytes of a tier: capacity, used.",
                                        l, NULL, 0), (double)N->tier_ops[k]->capacity(N->tier[k]));
        snprintf(l, sizeof l, "%s,state=\"used\"", t);
        td_metric_set(td_metrics_series(m, TD_GAUGE, "tandem:kvstore_tier_bytes", "Bytes of a tier: capacity, used.",
                                        l, NULL, 0), (double)blocks * (double)N->block_bytes);
        td_metric_set(td_metrics_series(m, TD_GAUGE, "tandem:kvstore_tier_blocks", "Blocks held in a tier.", t, NULL,
                                        0), blocks);
        td_metric_set(td_metrics_series(m, TD_COUNTER, "tandem:kvstore_tier_hits_total", "Blocks read from a tier.",
                                        t, NULL, 0), (double)N->tier_hits[k]);
        td_metric_set(td_metrics_series(m, TD_COUNTER, "tandem:kvstore_evictions_total", "Blocks evicted from a tier.",
                                        t, NULL, 0), (double)N->evictions[k]);
    }
    const struct { const char *name, *help; double v; } rows[] = {
        {"tandem:kvstore_lookups_total", "Blocks asked for (Get).", (double)N->gets},
        {"tandem:kvstore_hits_total", "Blocks asked for and found.", (double)N->hits},
        {"tandem:kvstore_puts_total", "Blocks offered (Put).", (double)N->puts},
        {"tandem:kvstore_stored_total", "Blocks stored as new.", (double)N->stored},
        {"tandem:kvstore_dropped_full_total", "Blocks not stored: every tier full of blocks in use.",
         (double)N->dropped_full},
        {"tandem:kvstore_replicas_pushed_total", "Copies of hot blocks pushed to other nodes.",
         (double)N->replicas_pushed},
        {"tandem:kvstore_checksum_errors_total", "SSD blocks whose checksum did not match (read as misses).", bad},
    };
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++)
        td_metric_set(td_metrics_series(m, TD_COUNTER, rows[i].name, rows[i].help, NULL, NULL, 0), rows[i].v);
    td_metric_set(td_metrics_series(m, TD_GAUGE, "tandem:kvstore_replicas", "Replica blocks this node holds.", NULL,
                                    NULL, 0), N->n_replicas);
    pthread_mutex_unlock(&N->mu);
}

static void h_events(void *ctx, td_rpc_call_t *call)
{
    node_t *N = ctx;
    char who[80];
    snprintf(who, sizeof who, "kvstore %s", N->id);
    td_kv_events_serve(call, &N->ev, &N->mu, who);
}

typedef struct snap {
    Tandem__Internal__V1__BlockName *names, **np;
    uint32_t *tiers, n, max;
} snap_t;

static bool snap_add(void *ctx, uint32_t id, kv_entry_t *e)
{
    (void)id;
    snap_t *sn = ctx;
    if (e->state != KV_READY)
        return true;
    if (sn->n == sn->max)
        return false;
    Tandem__Internal__V1__BlockName *b = &sn->names[sn->n];
    tandem__internal__v1__block_name__init(b);
    b->has_lo = b->has_hi = 1;
    b->lo = e->name.lo;
    b->hi = e->name.hi;
    sn->np[sn->n] = b;
    sn->tiers[sn->n++] = e->tier;
    return true;
}

static void h_snapshot(void *ctx, td_rpc_call_t *call)
{
    node_t *N = ctx;
    Tandem__Internal__V1__KvSnapshotRequest *rq = (Tandem__Internal__V1__KvSnapshotRequest *)td_rpc_request_pb(call, &tandem__internal__v1__kv_snapshot_request__descriptor);
    if (!rq)
        return;
    snap_t sn = {.max = rq->max_names && rq->max_names < MAX_SNAPSHOT ? rq->max_names : MAX_SNAPSHOT};
    uint32_t cursor = rq->cursor;
    tandem__internal__v1__kv_snapshot_request__free_unpacked(rq, NULL);
    Tandem__Internal__V1__KvSnapshotResponse r = TANDEM__INTERNAL__V1__KV_SNAPSHOT_RESPONSE__INIT;
    if (!(sn.names = malloc(sn.max * sizeof *sn.names)) || !(sn.np = malloc(sn.max * sizeof *sn.np)) ||
        !(sn.tiers = malloc(sn.max * sizeof *sn.tiers))) {
        free(sn.names);
        free(sn.np);
        td_rpc_call_finish(call, TD_RPC_RESOURCE_EXHAUSTED, "kvstore %s: no memory for a snapshot page", N->id);
        return;
    }
    pthread_mutex_lock(&N->mu);
    r.has_epoch = r.has_seq = r.has_next_cursor = 1;
    r.epoch = N->ev.epoch;
    r.seq = N->ev.seq;
    uint32_t stop = N->ix ? kv_index_each(N->ix, cursor, snap_add, &sn) : KV_NONE;
    pthread_mutex_unlock(&N->mu);
    r.next_cursor = stop == KV_NONE ? 0 : stop;
    r.n_names = r.n_tiers = sn.n;
    r.names = sn.np;
    r.tiers = sn.tiers;
    td_rpc_reply_pb(call, &r.base);
    free(sn.names);
    free(sn.np);
    free(sn.tiers);
}

/* ------------------------------------------------------------ process */

static void tick(void *ctx)
{
    node_t *N = ctx;
    pthread_mutex_lock(&N->mu);
    leases_expire(N);
    double now = td_now_s();
    if (N->n_replicas && now - N->cool_scan_at >= 1.0) { /* replicas whose reads cooled go */
        N->cool_scan_at = now;
        kv_index_each(N->ix, 0, drop_cool, N);
    }
    pthread_mutex_unlock(&N->mu);
}

static const char kvstore_usage[] =
    "usage: tandem-kvstore [--config FILE] [--listen HOST:PORT] [--id ID] [FLAG VALUE]...\n"
    "  --listen and --id name this one node; every other flag sets the config key it stands beside below\n"
    "  (docs/configuration.md), over the file\n";

static td_status_t region_setup(node_t *N)
{
    kv_xfer_config_t xc = {.peer_errors = N->cfg.transport.peer_errors, .interfaces = N->cfg.transport.interfaces};
    N->xo = &kv_transport_ucx;
    N->bytes = (size_t)N->cfg.kvstore.dram_mb << 20;
    if (!N->bytes)
        return td_error(TD_ERR_CONFIG, "kvstore: kvstore.dram_mb is 0: a node needs a CPU tier");
    void *base;
    td_status_t rc = N->xo->create(&xc, &N->xfer);
    if (!rc)
        rc = N->xo->mem_alloc(N->xfer, N->bytes, &base, &N->mem);
    if (!rc)
        rc = N->xo->mem_rkey(N->xfer, N->mem, &N->rkey, &N->rkey_len);
    if (!rc)
        rc = N->xo->address(N->xfer, &N->addr, &N->addr_len);
    if (!rc && N->xo->progress_start)
        rc = N->xo->progress_start(N->xfer);
    if (!rc)
        N->base = base;
    kv_cpu_tier_t *cpu;
    if (!rc && !(rc = kv_cpu_tier_create(base, N->bytes, &cpu))) {
        N->tier_ops[KV_TIER_CPU] = &kv_tier_cpu;
        N->tier[KV_TIER_CPU] = cpu;
        N->n_tiers = 1;
    }
    return rc;
}

/* The node's etcd record (/tandem/kvstores/ID): where it serves, its
 * metrics, and each tier's name, size and read rate, the first first
 * (kvstore/tier.h). */
static td_status_t record(node_t *N, char *key, size_t key_len, char **value)
{
    json_t *tiers = json_array();
    for (uint32_t k = 0; k < N->n_tiers; k++)
        json_array_append_new(tiers, json_pack("{s:s, s:I, s:f}", "name", N->tier_ops[k]->name, "bytes",
                                               (json_int_t)N->tier_ops[k]->capacity(N->tier[k]), "read_gbps",
                                               N->tier_ops[k]->read_gbps));
    json_t *j = json_pack("{s:s, s:s, s:s, s:i, s:I, s:I, s:o}", "id", N->id, "addr", N->advertise, "metrics",
                          N->metrics_at, "pid", (int)getpid(),
                          "dram_bytes", (json_int_t)N->bytes, "ssd_bytes",
                          (json_int_t)(N->ssd ? kv_ssd_capacity(N->ssd) : 0), "tiers", tiers);
    *value = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
    snprintf(key, key_len, "/tandem/kvstores/%s", N->id);
    return *value ? TD_OK : td_error(TD_ERR_NO_MEMORY, "kvstore %s: no memory for its etcd record", N->id);
}

/* The SSD tier's blocks, back in the index after a restart. */
static void ssd_restore(void *ctx, uint32_t slot, td_block_name_t name, uint64_t digest)
{
    node_t *N = ctx;
    uint32_t id = kv_index_insert(N->ix, name, KV_TIER_SSD, slot, td_now_s());
    if (id == KV_NONE) {
        kv_ssd_free(N->ssd, slot);
        return;
    }
    kv_entry_t *e = kv_index_entry(N->ix, id);
    e->state = KV_READY;
    e->digest = digest;
    emit(N, e, TANDEM__INTERNAL__V1__KV_EVENT__KIND__KV_EVENT_STORED);
}

/* start (common/service.h): the events' ring, the replicator, the CPU tier's
 * region, the SSD tier (its blocks back), the RPCs, the metrics. */
static td_status_t node_start(void *ctx, char *key, size_t key_len, char **value)
{
    node_t *N = ctx;
    char who[80];
    snprintf(who, sizeof who, "kvstore %s", N->id);
    td_status_t rc = td_kv_events_init(&N->ev, EVENT_RING, who);
    if (rc)
        return rc;
    N->ev_up = true;
    pthread_cond_init(&N->repl_cv, NULL);
    if (!(N->repl_q = calloc(REPL_QUEUE, sizeof *N->repl_q)) || pthread_create(&N->repl_thread, NULL, replicator, N))
        return td_error(TD_ERR_NO_MEMORY, "kvstore %s: cannot start the replicator", N->id);
    N->repl_up = true;
    if ((rc = region_setup(N)))
        return rc;
    if (N->cfg.kvstore.ssd_mb) {
        if (!N->cfg.kvstore.data_dir[0])
            return td_error(TD_ERR_CONFIG, "kvstore: kvstore.ssd_mb is set but kvstore.data_dir is empty");
        td_kv_layout_t l;
        bool have = false;
        if ((rc = kv_ssd_open(N->cfg.kvstore.data_dir, (uint64_t)N->cfg.kvstore.ssd_mb << 20, &N->ssd, &l, &have)))
            return rc;
        N->tier_ops[N->n_tiers] = &kv_tier_ssd; /* below the CPU tier */
        N->tier[N->n_tiers++] = N->ssd;
        if (have) { /* warm: the files' contract and blocks */
            if ((rc = adopt_contract(N, &l)))
                return rc;
            uint32_t n = kv_ssd_restore(N->ssd, ssd_restore, N);
            TD_INFO("kvstore %s: %u blocks back from the SSD tier in %s", N->id, n, N->cfg.kvstore.data_dir);
        }
    }
    /* the data plane's keys only to the roles that move blocks; Stats to any cluster certificate */
    static const struct {
        const char *service, *method, *roles;
        td_rpc_handler_fn fn;
    } rpcs[] = {{"KvStore", "Get", "prefill,decode,kvstore", h_get},
                {"KvStore", "Unlease", "prefill,decode,kvstore", h_unlease},
                {"KvStore", "Put", "prefill,decode,kvstore", h_put},
                {"KvStore", "Commit", "prefill,decode,kvstore", h_commit},
                {"KvStore", "Stats", NULL, h_stats},
                {"KvEvents", "Events", "router,prefill,decode,kvstore", h_events},
                {"KvEvents", "Snapshot", "router,prefill,decode,kvstore", h_snapshot}};
    if ((rc = td_rpc_server_create(N->listen, N->tls, &N->srv)))
        return rc;
    for (size_t i = 0; i < sizeof rpcs / sizeof rpcs[0]; i++) {
        char m[96];
        snprintf(m, sizeof m, "/tandem.internal.v1.%s/%s", rpcs[i].service, rpcs[i].method);
        if ((rc = td_rpc_server_add(N->srv, m, rpcs[i].fn, N)) ||
            (rpcs[i].roles && (rc = td_rpc_server_allow(N->srv, m, rpcs[i].roles))))
            return rc;
    }
    td_rpc_server_set_max_message(N->srv, 16u << 20);
    /* the store serves every model: no model_name */
    if ((rc = td_metrics_create(NULL, "kvstore", &N->metrics)))
        return rc;
    td_metrics_on_collect(N->metrics, metrics_collect, N);
    if ((rc = td_metrics_serve(N->metrics, &(td_metrics_endpoint_t){.listen = N->cfg.metrics.listen, .tls = N->tls},
                               &N->msrv, N->metrics_at, sizeof N->metrics_at)))
        return rc;
    int port;
    if ((rc = td_rpc_server_start(N->srv, &port)))
        return rc;
    td_rpc_advertise_addr(N->listen, port, N->advertise, sizeof N->advertise);
    TD_INFO("kvstore %s serving on %s: %llu MiB DRAM, %llu MiB SSD%s%s (etcd %s; metrics %s)", N->id, N->advertise,
            (unsigned long long)N->cfg.kvstore.dram_mb, (unsigned long long)N->cfg.kvstore.ssd_mb,
            N->ssd ? " in " : "", N->ssd ? N->cfg.kvstore.data_dir : "", N->cfg.etcd.endpoints,
            N->metrics_at[0] ? N->metrics_at : "none");
    return record(N, key, key_len, value);
}

/* stop (common/service.h): the server and the replicator stopped, the CPU
 * tier's blocks spilled to the SSD tier with its manifest (the next start is
 * warm), everything freed; any part start() did not make is skipped. */
static void node_stop(void *ctx)
{
    node_t *N = ctx;
    td_metrics_server_stop(N->msrv);
    if (N->srv)
        td_rpc_server_stop(N->srv, 5);
    td_rpc_server_destroy(N->srv);
    if (N->repl_up) { /* a copy in flight has its own deadlines */
        pthread_mutex_lock(&N->mu);
        N->repl_stop = true;
        pthread_cond_signal(&N->repl_cv);
        pthread_mutex_unlock(&N->mu);
        pthread_join(N->repl_thread, NULL);
    }
    kv_client_destroy(N->repl);
    for (uint32_t i = 0; i < N->repl_n; i++) { /* jobs never run let their blocks go */
        kv_entry_t *e = kv_index_entry(N->ix, N->repl_q[i].id);
        if (e->refs)
            e->refs--;
    }
    free(N->repl_q);
    pthread_mutex_lock(&N->mu);
    while (N->n_leases)
        lease_end(N, N->n_leases - 1);
    if (N->ssd && N->ix) { /* the CPU tier's blocks go to the SSD tier where room is: the next start is warm */
        uint32_t spilled = 0, v; /* coldest first: the hottest are the last evicted to make room */
        while ((v = kv_index_victim(N->ix, KV_TIER_CPU)) != KV_NONE) {
            if (kv_index_entry(N->ix, v)->replica)
                drop_entry(N, v); /* a copy: its home has the block */
            else if (demote(N, v))
                spilled++;
            else
                break;
        }
        if (kv_ssd_save_manifest(N->ssd, N->ix))
            TD_WARN("kvstore %s: %s (the next start reads every slot's header instead)", N->id, td_last_error());
        else
            TD_INFO("kvstore %s: %u blocks of the CPU tier written to the SSD tier, manifest saved", N->id, spilled);
    }
    pthread_mutex_unlock(&N->mu);
    kv_ssd_close(N->ssd);
    kv_index_destroy(N->ix);
    if (N->n_tiers)
        kv_cpu_tier_destroy(N->tier[KV_TIER_CPU]);
    free(N->bounce);
    free(N->leases);
    if (N->ev_up)
        td_kv_events_free(&N->ev);
    if (N->xfer) {
        N->xo->mem_free(N->xfer, N->mem);
        N->xo->destroy(N->xfer);
    }
    free(N->rkey);
    free(N->addr);
    td_metrics_destroy(N->metrics);
}

int main(int argc, char **argv)
{
    static node_t N;
    pthread_mutex_init(&N.mu, NULL);
    snprintf(N.listen, sizeof N.listen, "127.0.0.1:0");
    snprintf(N.id, sizeof N.id, "kvstore-%d", (int)getpid());
    static const char *const own[] = {"--listen", "--id", NULL};
    td_listen_id_t li = {N.listen, N.id, sizeof N.listen, sizeof N.id};
    const td_service_t service = {.prog = "tandem-kvstore", .section = "kvstore", .procs = TD_PROC_KVSTORE, .own = own,
                                  .own_fn = td_own_listen_id, .own_ctx = &li, .usage = kvstore_usage, .cfg = &N.cfg,
                                  .tls_files = &N.tls_files, .tls = &N.tls, .ctx = &N, .start = node_start,
                                  .tick = tick, .stop = node_stop};
    return td_service_main(&service, argc, argv);
}
