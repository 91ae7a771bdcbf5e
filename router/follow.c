/* follow.c — see follow.h. */
#define _GNU_SOURCE
#include "router/follow.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "common/kv_events.h"
#include "common/log.h"
#include "common/rpc_pb.h"
#include "tandem/internal/v1/kvstore.pb-c.h"

#define POLL_TIMEOUT_S 0.5
#define NODES_EVERY_S 1.0  /* how often etcd is asked for the kvstore nodes */
#define MAX_ROUNDS 16      /* Events calls per source per period (4096 events each) */

typedef struct fsrc {
    char key[256], id[96], addr[160];
    bool store, seen;
    int slot;
    rt_worker_t *w;        /* a worker's record, held (its channel) */
    td_rpc_channel_t *ch;  /* a kvstore node's channel, owned */
    uint64_t epoch, seq, last_seq;
    double last_ok;
    uint64_t snapshots, gaps, dropped;
    bool failing;
    double retry_at; /* while failing: the next poll (once a second, not every period) */
} fsrc_t;

struct rt_follow {
    rt_table_t *t;
    rt_kvindex_t *ix;
    td_etcd_t *etcd;
    const td_rpc_tls_t *tls;
    uint32_t drop_every;
    uint64_t received;
    pthread_t thread;
    pthread_mutex_t mu; /* src and the stats, against rt_follow_json */
    pthread_cond_t cv;
    bool stop;
    fsrc_t src[RT_IX_SOURCES];
    double nodes_at;
};

static fsrc_t *find(rt_follow_t *f, const char *key)
{
    for (int i = 0; i < RT_IX_SOURCES; i++)
        if (f->src[i].key[0] && !strcmp(f->src[i].key, key))
            return &f->src[i];
    return NULL;
}

static fsrc_t *add(rt_follow_t *f, const char *key, bool store)
{
    int slot = rt_kvindex_source(f->ix, key, store);
    if (slot < 0)
        return NULL;
    fsrc_t *s = &f->src[slot];
    pthread_mutex_lock(&f->mu);
    *s = (fsrc_t){.store = store, .slot = slot};
    snprintf(s->key, sizeof s->key, "%s", key);
    pthread_mutex_unlock(&f->mu);
    return s;
}

static void forget(rt_follow_t *f, fsrc_t *s)
{
    TD_INFO("router: the cache index forgets %s (%s left)", s->id, s->store ? "kvstore node" : "worker");
    rt_kvindex_clear(f->ix, s->slot, true);
    if (s->w)
        rt_table_unhold(f->t, s->w);
    td_rpc_channel_destroy(s->ch);
    pthread_mutex_lock(&f->mu);
    memset(s, 0, sizeof *s);
    pthread_mutex_unlock(&f->mu);
}

/* The sources now: the table's usable workers — prefill workers, and decode
 * workers, whose prefix caches keep conversations (a colocated one's local
 * prefill is priced by what it holds, and any decode worker lands only what
 * it lacks) — and etcd's kvstore nodes. */
static void refresh(rt_follow_t *f, double now)
{
    rt_worker_t *old[RT_IX_SOURCES];
    int n_old = 0;
    for (int i = 0; i < RT_IX_SOURCES; i++)
        if (f->src[i].key[0] && !f->src[i].store)
            f->src[i].seen = false;
    pthread_mutex_lock(&f->t->mu);
    for (size_t i = 0; i < f->t->n; i++) {
        rt_worker_t *w = f->t->w[i];
        if (w->refused || w->gone)
            continue;
        fsrc_t *s = find(f, w->key);
        if (!s && !(s = add(f, w->key, false)))
            continue;
        if (s->w != w) { /* new, or registered again (perhaps another process) */
            if (s->w)
                old[n_old++] = s->w;
            w->refs++;
            pthread_mutex_lock(&f->mu);
            s->w = w;
            snprintf(s->id, sizeof s->id, "%s", w->id);
            pthread_mutex_unlock(&f->mu);
        }
        w->ix_src = s->slot;
        s->seen = true;
    }
    pthread_mutex_unlock(&f->t->mu);
    for (int i = 0; i < n_old; i++)
        rt_table_unhold(f->t, old[i]);
    if (now - f->nodes_at >= NODES_EVERY_S) {
        td_etcd_kvs_t kvs = {0};
        if (td_etcd_get(f->etcd, "/tandem/kvstores/", true, &kvs) == TD_OK) {
            f->nodes_at = now;
            for (int i = 0; i < RT_IX_SOURCES; i++)
                if (f->src[i].key[0] && f->src[i].store)
                    f->src[i].seen = false;
            double gbps[RT_IX_TIERS] = {0}; /* each tier's slowest rate among the nodes */
            size_t n_tiers = 0;
            for (size_t i = 0; i < kvs.n; i++) {
                json_t *rec = json_loads((const char *)kvs.kv[i].value, 0, NULL);
                const json_t *tiers = json_object_get(rec, "tiers");
                for (size_t k = 0; k < json_array_size(tiers) && k < RT_IX_TIERS; k++) {
                    double r = json_number_value(json_object_get(json_array_get(tiers, k), "read_gbps"));
                    if (r > 0 && (!gbps[k] || r < gbps[k]))
                        gbps[k] = r;
                    n_tiers = k + 1 > n_tiers ? k + 1 : n_tiers;
                }
                const char *id = json_string_value(json_object_get(rec, "id"));
                const char *addr = json_string_value(json_object_get(rec, "addr"));
                fsrc_t *s = find(f, kvs.kv[i].key);
                if (addr && s && strcmp(s->addr, addr)) { /* another process at the key */
                    forget(f, s);
                    s = NULL;
                }
                td_rpc_channel_t *ch = NULL;
                td_rpc_tls_t tc;
                if (addr && !s && td_rpc_channel_create(addr, td_rpc_tls_peer(f->tls, "kvstore", &tc), &ch) == TD_OK) {
                    if ((s = add(f, kvs.kv[i].key, true))) {
                        pthread_mutex_lock(&f->mu);
                        snprintf(s->id, sizeof s->id, "%s", id ? id : kvs.kv[i].key);
                        snprintf(s->addr, sizeof s->addr, "%s", addr);
                        s->ch = ch;
                        pthread_mutex_unlock(&f->mu);
                    } else {
                        td_rpc_channel_destroy(ch);
                    }
                }
                if (s)
                    s->seen = true;
                json_decref(rec);
            }
            td_etcd_kvs_free(&kvs);
            if (n_tiers)
                rt_table_set_tier_rates(f->t, gbps, n_tiers);
        } else {
            for (int i = 0; i < RT_IX_SOURCES; i++) /* etcd did not answer: keep the nodes known */
                if (f->src[i].store)
                    f->src[i].seen = true;
        }
    }
    for (int i = 0; i < RT_IX_SOURCES; i++)
        if (f->src[i].key[0] && !f->src[i].seen)
            forget(f, &f->src[i]);
}

/* One name of a Snapshot page (src: the response) or of an Events batch. */
typedef void (*name_at_fn)(const void *src, size_t i, td_block_name_t *name, bool *stored, uint8_t *tier);

/* a node's tier number (the index counts one past its last as its last) */
static uint8_t tier_of(uint32_t t) { return (uint8_t)(t < UINT8_MAX ? t : UINT8_MAX); }

static void snapshot_name(const void *src, size_t i, td_block_name_t *name, bool *stored, uint8_t *tier)
{
    const Tandem__Internal__V1__KvSnapshotResponse *r = src;
    *name = (td_block_name_t){r->names[i]->lo, r->names[i]->hi};
    *stored = true;
    *tier = i < r->n_tiers ? tier_of(r->tiers[i]) : 0;
}

static void event_name(const void *src, size_t i, td_block_name_t *name, bool *stored, uint8_t *tier)
{
    const Tandem__Internal__V1__KvEvent *e = ((const Tandem__Internal__V1__KvEventsResponse *)src)->events[i];
    *name = (td_block_name_t){e->name->lo, e->name->hi};
    *stored = e->kind == TANDEM__INTERNAL__V1__KV_EVENT__KIND__KV_EVENT_STORED;
    *tier = e->has_tier ? tier_of(e->tier) : 0;
}

/* Applies n names to s's slot in the index, in chunks (no allocation). */
static void apply_names(rt_follow_t *f, const fsrc_t *s, const void *src, size_t n, name_at_fn at)
{
    enum { CHUNK = 1024 };
    td_block_name_t names[CHUNK];
    bool stored[CHUNK];
    uint8_t tier[CHUNK];
    for (size_t i = 0; i < n;) {
        size_t k = 0;
        for (; k < CHUNK && i < n; k++, i++)
            at(src, i, &names[k], &stored[k], &tier[k]);
        rt_kvindex_apply(f->ix, s->slot, names, stored, tier, k);
    }
}

static td_rpc_channel_t *chan(fsrc_t *s) { return s->w ? s->w->ch : s->ch; }

/* Takes the source's snapshot into the index; false when it did not answer. */
static bool snapshot(rt_follow_t *f, fsrc_t *s)
{
    uint32_t cursor = 0;
    uint64_t epoch = 0, seq = 0;
    for (int page = 0;; page++) {
        Tandem__Internal__V1__KvSnapshotRequest rq = TANDEM__INTERNAL__V1__KV_SNAPSHOT_REQUEST__INIT;
        rq.has_cursor = rq.has_max_names = 1;
        rq.cursor = cursor;
        rq.max_names = 65536;
        ProtobufCMessage *m = NULL;
        td_rpc_result_t res = {0};
        if (td_rpc_unary_pb(chan(s), "/tandem.internal.v1.KvEvents/Snapshot", &rq.base,
                            &tandem__internal__v1__kv_snapshot_response__descriptor, POLL_TIMEOUT_S, NULL, &m, &res))
            return false;
        Tandem__Internal__V1__KvSnapshotResponse *r = (Tandem__Internal__V1__KvSnapshotResponse *)m;
        if (page == 0) {
            epoch = r->epoch;
            seq = r->seq;
            rt_kvindex_clear(f->ix, s->slot, false);
        } else if (r->epoch != epoch) { /* it restarted between pages: the next period starts again */
            protobuf_c_message_free_unpacked(m, NULL);
            return false;
        }
        apply_names(f, s, r, r->n_names, snapshot_name);
        cursor = r->next_cursor;
        protobuf_c_message_free_unpacked(m, NULL);
        if (!cursor)
            break;
    }
    pthread_mutex_lock(&f->mu);
    s->epoch = epoch;
    s->seq = seq;
    s->snapshots++;
    pthread_mutex_unlock(&f->mu);
    return true;
}

/* The test hook: takes one event in every drop_every out of the batch (it
 * is returned, to be put back before the response is freed). */
static Tandem__Internal__V1__KvEvent *drop_hook(rt_follow_t *f, fsrc_t *s, Tandem__Internal__V1__KvEventsResponse *r)
{
    for (size_t i = 0; i < r->n_events; i++)
        if (++f->received % f->drop_every == 0) {
            Tandem__Internal__V1__KvEvent *gone = r->events[i];
            memmove(&r->events[i], &r->events[i + 1], (r->n_events - i - 1) * sizeof r->events[0]);
            r->n_events--;
            pthread_mutex_lock(&f->mu);
            s->dropped++;
            pthread_mutex_unlock(&f->mu);
            return gone;
        }
    return NULL;
}

static void poll_source(rt_follow_t *f, fsrc_t *s, double now)
{
    for (int round = 0; round < MAX_ROUNDS; round++) {
        Tandem__Internal__V1__KvEventsRequest rq = TANDEM__INTERNAL__V1__KV_EVENTS_REQUEST__INIT;
        rq.has_epoch = rq.has_after_seq = rq.has_max_events = 1;
        rq.epoch = s->epoch;
        rq.after_seq = s->seq;
        rq.max_events = 4096;
        ProtobufCMessage *m = NULL;
        td_rpc_result_t res = {0};
        if (td_rpc_unary_pb(chan(s), "/tandem.internal.v1.KvEvents/Events", &rq.base,
                            &tandem__internal__v1__kv_events_response__descriptor, POLL_TIMEOUT_S, NULL, &m, &res)) {
            if (!s->failing)
                TD_WARN("router: the cache index cannot follow %s (%s: %s); its blocks are kept until it leaves",
                        s->id, td_rpc_code_name(res.code), res.message);
            s->failing = true;
            s->retry_at = now + 1.0;
            return;
        }
        s->failing = false;
        Tandem__Internal__V1__KvEventsResponse *r = (Tandem__Internal__V1__KvEventsResponse *)m;
        size_t n_sent = r->n_events;
        Tandem__Internal__V1__KvEvent *gone = f->drop_every && r->n_events ? drop_hook(f, s, r) : NULL;
        bool heal = r->gap || r->epoch != s->epoch || !td_kv_events_contiguous(r, s->seq);
        if (heal) {
            bool first = s->epoch == 0;
            uint64_t last = r->last_seq;
            if (gone)
                r->events[r->n_events++] = gone;
            protobuf_c_message_free_unpacked(m, NULL);
            if (!first) {
                pthread_mutex_lock(&f->mu);
                s->gaps++;
                pthread_mutex_unlock(&f->mu);
                TD_INFO("router: the cache index re-reads %s (%s)", s->id,
                        gone ? "an event was dropped (index_drop_events)"
                        : n_sent ? "a sequence number out of order" : "a gap or a new epoch");
            }
            if (!snapshot(f, s))
                return;
            pthread_mutex_lock(&f->mu);
            s->last_seq = last;
            s->last_ok = now;
            pthread_mutex_unlock(&f->mu);
            continue; /* the events after the snapshot */
        }
        apply_names(f, s, r, r->n_events, event_name);
        pthread_mutex_lock(&f->mu);
        s->seq += r->n_events;
        s->last_seq = r->last_seq;
        s->last_ok = now;
        pthread_mutex_unlock(&f->mu);
        bool more = r->last_seq > s->seq && r->n_events;
        if (gone)
            r->events[r->n_events++] = gone;
        protobuf_c_message_free_unpacked(m, NULL);
        if (!more)
            return;
    }
}

static bool stopping(rt_follow_t *f)
{
    pthread_mutex_lock(&f->mu);
    bool s = f->stop;
    pthread_mutex_unlock(&f->mu);
    return s;
}

static void *follow_thread(void *arg)
{
    rt_follow_t *f = arg;
    pthread_mutex_lock(&f->mu);
    while (!f->stop) {
        pthread_mutex_unlock(&f->mu);
        double now = td_now_s();
        refresh(f, now);
        for (int i = 0; i < RT_IX_SOURCES && !stopping(f); i++)
            if (f->src[i].key[0] && (!f->src[i].failing || now >= f->src[i].retry_at))
                poll_source(f, &f->src[i], now);
        pthread_mutex_lock(&f->mu);
        struct timespec ts = td_wall_deadline(RT_FOLLOW_PERIOD_S);
        if (!f->stop)
            pthread_cond_timedwait(&f->cv, &f->mu, &ts);
    }
    pthread_mutex_unlock(&f->mu);
    for (int i = 0; i < RT_IX_SOURCES; i++)
        if (f->src[i].key[0]) {
            if (f->src[i].w)
                rt_table_unhold(f->t, f->src[i].w);
            td_rpc_channel_destroy(f->src[i].ch);
        }
    return NULL;
}

td_status_t rt_follow_start(rt_table_t *t, rt_kvindex_t *ix, td_etcd_t *etcd, const td_rpc_tls_t *tls,
                            uint32_t drop_every, rt_follow_t **out)
{
    rt_follow_t *f = calloc(1, sizeof *f);
    if (!f)
        return td_error(TD_ERR_NO_MEMORY, "router: no memory for the cache index's follower");
    *f = (rt_follow_t){.t = t, .ix = ix, .etcd = etcd, .tls = tls, .drop_every = drop_every};
    pthread_mutex_init(&f->mu, NULL);
    pthread_cond_init(&f->cv, NULL);
    if (pthread_create(&f->thread, NULL, follow_thread, f)) {
        free(f);
        return td_error(TD_ERR_INTERNAL, "router: cannot start the cache index's follower");
    }
    if (drop_every)
        TD_WARN("router: index_drop_events = %u: the cache index's follower drops events on purpose (a test hook)",
                drop_every);
    *out = f;
    return TD_OK;
}

void rt_follow_stop(rt_follow_t *f)
{
    if (!f)
        return;
    pthread_mutex_lock(&f->mu);
    f->stop = true;
    pthread_cond_broadcast(&f->cv);
    pthread_mutex_unlock(&f->mu);
    pthread_join(f->thread, NULL);
    free(f);
}

json_t *rt_follow_json(rt_follow_t *f)
{
    rt_kvindex_stats_t st;
    rt_kvindex_stats(f->ix, &st);
    json_t *srcs = json_array();
    double now = td_now_s(), stale_max = 0;
    pthread_mutex_lock(&f->mu);
    for (int i = 0; i < RT_IX_SOURCES; i++) {
        const fsrc_t *s = &f->src[i];
        if (!s->key[0])
            continue;
        double stale = s->last_ok ? now - s->last_ok : -1;
        stale_max = stale < 0 || stale > stale_max ? (stale < 0 ? 1e9 : stale) : stale_max;
        char digest[20];
        snprintf(digest, sizeof digest, "%016llx", (unsigned long long)st.source_digest[i]);
        json_array_append_new(
            srcs, json_pack("{s:s, s:s, s:i, s:s, s:I, s:I, s:I, s:f, s:I, s:I, s:I}", "id", s->id, "kind",
                            s->store ? "kvstore" : s->w && s->w->role == RT_DECODE ? "decode" : "prefill", "blocks", (int)st.source_blocks[i], "digest", digest,
                            "epoch", (json_int_t)(s->epoch >> 1), "seq", (json_int_t)s->seq, "lag",
                            (json_int_t)(s->last_seq > s->seq ? s->last_seq - s->seq : 0), "stale_s", stale,
                            "snapshots", (json_int_t)s->snapshots, "gaps", (json_int_t)s->gaps, "dropped_by_hook",
                            (json_int_t)s->dropped));
    }
    pthread_mutex_unlock(&f->mu);
    return json_pack("{s:I, s:I, s:I, s:f, s:o}", "blocks", (json_int_t)st.names, "max_blocks",
                     (json_int_t)st.max_names, "dropped_full", (json_int_t)st.dropped_full, "stale_s_max", stale_max,
                     "sources", srcs);
}
