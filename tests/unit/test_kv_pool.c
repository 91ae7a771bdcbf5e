/* test_kv_pool.c — the paged KV pool against a plain model of it: counts,
 * the LRU of cached blocks, the name index, the stored/removed events and
 * the snapshot, under long random churn. */
#include "tests/unit/helpers.h"

#include "engine/kv_pool.h"
#include "kernels/backend.h"

enum { NB = 512, NAMES = 4096, OPS = 200000 };

/* What the pool should be: per block its count and name (or none); the LRU
 * order of cached blocks as a last-use stamp. */
typedef struct model {
    int count[NB];
    int name[NB]; /* -1: unnamed */
    uint64_t used[NB];
    int where[NAMES]; /* name -> block, -1 */
} model_t;

/* What the events said: the set of named blocks, rebuilt from them alone. */
typedef struct seen {
    int where[NAMES];
    uint64_t last_seq;
    long stored, removed;
} seen_t;

static td_block_name_t name_of(int k)
{
    /* distinct names whose low bits collide often (long probe runs) */
    return (td_block_name_t){.lo = (uint64_t)(k % 97) * 0x10000 + (uint64_t)k, .hi = (uint64_t)k * 2654435761u};
}

static int name_id(td_block_name_t n) { return (int)((n.hi / 2654435761u)); }

static void on_event(void *ctx, const eng_kv_event_t *ev)
{
    seen_t *s = ctx;
    cr_assert_eq(ev->seq, s->last_seq + 1, "events are numbered without gaps");
    s->last_seq = ev->seq;
    int k = name_id(ev->name);
    if (ev->kind == ENG_KV_STORED) {
        cr_assert_eq(s->where[k], -1, "name %d stored twice", k);
        s->where[k] = ev->block;
        s->stored++;
    } else {
        cr_assert_eq(s->where[k], ev->block, "name %d removed from block %d", k, ev->block);
        s->where[k] = -1;
        s->removed++;
    }
}

static void on_snap(void *ctx, td_block_name_t n, int32_t b)
{
    int *where = ctx;
    where[name_id(n)] = b;
}

static uint64_t rs = 0x9e3779b97f4a7c15ull;
static uint32_t rnd(uint32_t n)
{
    rs ^= rs << 13;
    rs ^= rs >> 7;
    rs ^= rs << 17;
    return (uint32_t)(rs % n);
}

Test(kv_pool, churn_against_a_model)
{
    kern_backend_t *be;
    cr_assert_eq(kern_cpu_backend_create(1, &be), TD_OK);
    td_kv_layout_t g = td_kv_layout_make("test", 1, 1, 8, 16, TD_KV_F16);
    eng_kv_pool_t *p;
    cr_assert_eq(eng_kv_pool_create(be, &g, NB, NULL, &p), TD_OK);
    static model_t m;
    static seen_t seen;
    for (int b = 0; b < NB; b++)
        m.name[b] = -1;
    for (int k = 0; k < NAMES; k++)
        m.where[k] = seen.where[k] = -1;
    eng_kv_set_listener(p, on_event, &seen);
    uint64_t clock = 0;
    int held[NB * 4], n_held = 0; /* references the test holds, one entry each */
    uint32_t longest = 0;
    long lookups_hit = 0, evictions = 0;
    for (int op = 0; op < OPS; op++) {
        clock++;
        uint32_t r = rnd(100);
        if (r < 30) { /* alloc: a free block, else the least recently used cached one */
            int32_t b;
            int free_n = 0, lru = -1;
            for (int i = 0; i < NB; i++) {
                free_n += m.count[i] == 0 && m.name[i] < 0;
                if (m.count[i] == 0 && m.name[i] >= 0 && (lru < 0 || m.used[i] < m.used[lru]))
                    lru = i;
            }
            td_status_t rc = eng_kv_alloc(p, &b);
            if (!free_n && lru < 0) {
                cr_assert_eq(rc, TD_ERR_NO_MEMORY, "op %d: nothing free or cached", op);
                continue;
            }
            cr_assert_eq(rc, TD_OK, "op %d", op);
            if (!free_n) {
                cr_assert_eq(b, lru, "op %d: the least recently used cached block is evicted", op);
                m.where[m.name[b]] = -1;
                m.name[b] = -1;
                evictions++;
            } else {
                cr_assert(m.count[b] == 0 && m.name[b] < 0, "op %d: block %d was free", op, b);
            }
            m.count[b] = 1;
            if (n_held < (int)(sizeof held / sizeof held[0]))
                held[n_held++] = b;
        } else if (r < 50 && n_held) { /* publish a held block under a random name */
            int32_t b = held[rnd((uint32_t)n_held)];
            int k = (int)rnd(NAMES);
            int32_t got = eng_kv_publish(p, b, name_of(k));
            if (m.where[k] >= 0) {
                cr_assert_eq(got, m.where[k], "op %d: name %d already has block %d", op, k, m.where[k]);
            } else {
                cr_assert_eq(got, b, "op %d", op);
                if (m.name[b] >= 0)
                    m.where[m.name[b]] = -1;
                m.name[b] = k;
                m.where[k] = b;
            }
        } else if (r < 75) { /* lookup */
            int k = (int)rnd(NAMES);
            int32_t got = eng_kv_lookup(p, name_of(k));
            cr_assert_eq(got, m.where[k], "op %d: lookup of name %d", op, k);
            if (got >= 0) {
                m.count[got]++;
                m.used[got] = clock;
                if (n_held < (int)(sizeof held / sizeof held[0])) {
                    held[n_held++] = got;
                } else { /* keep the count of held references exact: drop one of ours */
                    eng_kv_unref(p, got);
                    if (--m.count[got] == 0)
                        m.used[got] = clock;
                }
                lookups_hit++;
            }
        } else if (n_held) { /* drop a reference */
            int i = (int)rnd((uint32_t)n_held);
            int32_t b = held[i];
            held[i] = held[--n_held];
            eng_kv_unref(p, b);
            if (--m.count[b] == 0)
                m.used[b] = clock;
        }
        if (op % 1000 == 0) {
            uint32_t in_use = 0, cached = 0, fr = 0;
            for (int i = 0; i < NB; i++) {
                in_use += m.count[i] > 0;
                cached += m.count[i] == 0 && m.name[i] >= 0;
                fr += m.count[i] == 0 && m.name[i] < 0;
            }
            eng_kv_stats_t st = eng_kv_stats(p);
            cr_assert(st.in_use == in_use && st.cached == cached && st.free == fr, "op %d: stats %u/%u/%u, model "
                      "%u/%u/%u", op, st.in_use, st.cached, st.free, in_use, cached, fr);
            uint32_t run = eng_kv_index_longest_run(p);
            longest = run > longest ? run : longest;
        }
    }
    /* the snapshot, the events and the model agree on every name */
    static int snap[NAMES];
    for (int k = 0; k < NAMES; k++)
        snap[k] = -1;
    uint64_t seq = eng_kv_snapshot(p, on_snap, snap);
    cr_assert_eq(seq, seen.last_seq, "the snapshot is as of the last event");
    for (int k = 0; k < NAMES; k++) {
        cr_assert_eq(snap[k], m.where[k], "name %d: snapshot %d, model %d", k, snap[k], m.where[k]);
        cr_assert_eq(seen.where[k], m.where[k], "name %d: events %d, model %d", k, seen.where[k], m.where[k]);
    }
    cr_log_info("kv_pool churn: %d ops, %ld stored, %ld removed, %ld evictions, %ld lookup hits, longest index run %u "
                "(of %u slots)", OPS, seen.stored, seen.removed, evictions, lookups_hit, longest, 2 * NB);
    cr_assert_gt(seen.removed, 10000, "the churn evicted and renamed blocks");
    /* 1024 slots at most half full: a run past 64 means deletions left debris */
    cr_assert_leq(longest, 64, "longest index run %u", longest);
    eng_kv_pool_destroy(p);
    kern_backend_destroy(be);
}
