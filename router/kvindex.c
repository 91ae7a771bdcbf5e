/* kvindex.c — see kvindex.h. Open addressing with linear probing; a name
 * whose last holder lets go is deleted by shifting the run after it back
 * (no tombstones), so lookups stay short however long the router runs. */
#define _GNU_SOURCE
#include "router/kvindex.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"

typedef struct slot {
    td_block_name_t name;
    uint64_t holders; /* 0: the slot is empty */
    uint64_t below[RT_IX_TIERS - 1]; /* the holders that hold it in tier k + 1 */
} slot_t;

/* src's bit out of every tier mask of e, then into tier's (0: none). */
static void set_tier(slot_t *e, uint64_t bit, unsigned tier)
{
    for (unsigned k = 0; k < RT_IX_TIERS - 1; k++)
        e->below[k] &= ~bit;
    if (tier)
        e->below[(tier < RT_IX_TIERS ? tier : RT_IX_TIERS - 1) - 1] |= bit;
}

typedef struct source {
    char key[256];
    bool used, store;
    uint32_t blocks;
    uint64_t digest; /* XOR of lo ^ hi over its names: equal sets, equal digests */
} source_t;

struct rt_kvindex {
    pthread_rwlock_t mu;
    slot_t *t;
    uint64_t mask; /* capacity - 1 (a power of two, at least twice max) */
    uint64_t n, max, dropped_full;
    source_t src[RT_IX_SOURCES];
    uint64_t store_bits;
};

td_status_t rt_kvindex_create(uint32_t max_blocks, rt_kvindex_t **out)
{
    rt_kvindex_t *ix = calloc(1, sizeof *ix);
    uint64_t cap = 1024;
    while (cap < 2ull * max_blocks)
        cap <<= 1;
    if (!ix || !(ix->t = calloc(cap, sizeof *ix->t))) {
        free(ix);
        return td_error(TD_ERR_NO_MEMORY, "router: no memory for a cache index of %u blocks", max_blocks);
    }
    ix->mask = cap - 1;
    ix->max = max_blocks;
    pthread_rwlock_init(&ix->mu, NULL);
    *out = ix;
    return TD_OK;
}

void rt_kvindex_destroy(rt_kvindex_t *ix)
{
    if (!ix)
        return;
    pthread_rwlock_destroy(&ix->mu);
    free(ix->t);
    free(ix);
}

static uint64_t home(const rt_kvindex_t *ix, td_block_name_t n) { return (n.lo ^ (n.hi >> 7)) & ix->mask; }

/* The slot of name, or the empty slot that ends its run. */
static uint64_t probe(const rt_kvindex_t *ix, td_block_name_t name)
{
    uint64_t i = home(ix, name);
    while (ix->t[i].holders && !td_block_name_eq(ix->t[i].name, name))
        i = (i + 1) & ix->mask;
    return i;
}

/* Empties slot i, moving back the entries of the run after it that may. */
static void del(rt_kvindex_t *ix, uint64_t i)
{
    uint64_t j = i;
    for (;;) {
        memset(&ix->t[i], 0, sizeof ix->t[i]);
        for (;;) {
            j = (j + 1) & ix->mask;
            if (!ix->t[j].holders)
                return;
            uint64_t h = home(ix, ix->t[j].name);
            /* j's entry may move to i if its home is not in (i, j] cyclically */
            if (i <= j ? (h <= i || h > j) : (h <= i && h > j))
                break;
        }
        ix->t[i] = ix->t[j];
        i = j;
    }
}

int rt_kvindex_find(rt_kvindex_t *ix, const char *key)
{
    int got = -1;
    pthread_rwlock_rdlock(&ix->mu);
    for (int s = 0; s < RT_IX_SOURCES && got < 0; s++)
        if (ix->src[s].used && !strcmp(ix->src[s].key, key))
            got = s;
    pthread_rwlock_unlock(&ix->mu);
    return got;
}

int rt_kvindex_source(rt_kvindex_t *ix, const char *key, bool store)
{
    int got = rt_kvindex_find(ix, key);
    if (got >= 0)
        return got;
    pthread_rwlock_wrlock(&ix->mu);
    for (int s = 0; s < RT_IX_SOURCES && got < 0; s++)
        if (!ix->src[s].used) {
            got = s;
            ix->src[s] = (source_t){.used = true, .store = store};
            snprintf(ix->src[s].key, sizeof ix->src[s].key, "%s", key);
            if (store)
                ix->store_bits |= 1ull << s;
        }
    pthread_rwlock_unlock(&ix->mu);
    if (got < 0)
        TD_WARN("router: the cache index follows %d sources, its most; %s is not indexed", RT_IX_SOURCES, key);
    return got;
}

void rt_kvindex_clear(rt_kvindex_t *ix, int src, bool release)
{
    uint64_t bit = 1ull << src;
    pthread_rwlock_wrlock(&ix->mu);
    for (uint64_t i = 0; i <= ix->mask;) {
        if (ix->t[i].holders & bit) {
            ix->t[i].holders &= ~bit;
            set_tier(&ix->t[i], bit, 0);
            if (!ix->t[i].holders) {
                del(ix, i);
                ix->n--;
                continue; /* an entry may have moved into i */
            }
        }
        i++;
    }
    ix->src[src].blocks = 0;
    ix->src[src].digest = 0;
    if (release) {
        ix->src[src].used = false;
        ix->store_bits &= ~bit;
    }
    pthread_rwlock_unlock(&ix->mu);
}

void rt_kvindex_apply(rt_kvindex_t *ix, int src, const td_block_name_t *names, const bool *stored,
                      const uint8_t *tier, size_t n)
{
    uint64_t bit = 1ull << src;
    pthread_rwlock_wrlock(&ix->mu);
    for (size_t k = 0; k < n; k++) {
        uint64_t i = probe(ix, names[k]);
        slot_t *e = &ix->t[i];
        if (stored[k]) {
            if (!e->holders) {
                if (ix->n >= ix->max) {
                    ix->dropped_full++;
                    continue;
                }
                memset(e, 0, sizeof *e);
                e->name = names[k];
                ix->n++;
            }
            if (!(e->holders & bit)) {
                ix->src[src].blocks++;
                ix->src[src].digest ^= names[k].lo ^ names[k].hi;
            }
            e->holders |= bit;
            set_tier(e, bit, tier ? tier[k] : 0);
        } else if (e->holders & bit) {
            ix->src[src].blocks--;
            ix->src[src].digest ^= names[k].lo ^ names[k].hi;
            e->holders &= ~bit;
            set_tier(e, bit, 0);
            if (!e->holders) {
                del(ix, i);
                ix->n--;
            }
        }
    }
    pthread_rwlock_unlock(&ix->mu);
}

void rt_kvindex_chain(rt_kvindex_t *ix, const td_block_name_t *chain, size_t n, rt_chain_hits_t *out)
{
    memset(out, 0, sizeof *out);
    pthread_rwlock_rdlock(&ix->mu);
    uint64_t run = ~0ull; /* sources that held every block so far */
    bool store_on = true;
    for (size_t k = 0; k < n && (run || store_on); k++) {
        const slot_t *e = &ix->t[probe(ix, chain[k])];
        uint64_t h = e->holders;
        run &= h;
        for (uint64_t m = run; m; m &= m - 1)
            out->held[__builtin_ctzll(m)]++;
        if (store_on && (h & ix->store_bits)) {
            out->store_run++;
            uint64_t have = h & ix->store_bits, below = 0; /* the store holders; those holding it below tier 0 */
            for (unsigned t = 0; t < RT_IX_TIERS - 1; t++)
                below |= e->below[t];
            unsigned best = 0; /* the first tier any store holder has it in */
            if (!(have & ~below))
                for (best = 1; best < RT_IX_TIERS - 1 && !(have & e->below[best - 1]); best++)
                    ;
            out->store_tier[best]++;
        } else {
            store_on = false;
        }
    }
    pthread_rwlock_unlock(&ix->mu);
}

uint64_t rt_kvindex_holders(rt_kvindex_t *ix, td_block_name_t name)
{
    pthread_rwlock_rdlock(&ix->mu);
    uint64_t h = ix->t[probe(ix, name)].holders;
    pthread_rwlock_unlock(&ix->mu);
    return h;
}

void rt_kvindex_stats(rt_kvindex_t *ix, rt_kvindex_stats_t *out)
{
    memset(out, 0, sizeof *out);
    pthread_rwlock_rdlock(&ix->mu);
    out->names = ix->n;
    out->max_names = ix->max;
    out->dropped_full = ix->dropped_full;
    for (int s = 0; s < RT_IX_SOURCES; s++)
        if (ix->src[s].used) {
            out->sources++;
            out->source_blocks[s] = ix->src[s].blocks;
            out->source_digest[s] = ix->src[s].digest;
        }
    pthread_rwlock_unlock(&ix->mu);
}
