/* index.c — the node's name table and its eviction order.
 *
 * Eviction is segmented LRU per tier: a block enters the tier's probation
 * list; a hit while on probation promotes it to the protected list, whose
 * size is capped at 20% of the tier (its tail falls back to probation's
 * head); the victim is probation's tail first. A block read again is kept
 * past a burst of blocks read once (a long unique prompt), which plain LRU
 * cannot do. Why 20%: on Mooncake's traces (bench/kvstore.c policy,
 * bench/results/kvstore-2026-11-24.md) it beats LRU at 1-10% of the
 * distinct blocks on the conversation trace (most reuse there is the next
 * turn reading the previous turn's blocks once, after a long gap: a small
 * probation segment, as with 80% protected, drops them first and loses
 * to LRU by up to 7 points) and is within 1.4 points of it elsewhere. Each
 * operation is O(1). The decayed hit count beside it is what replication
 * reads. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "kvstore/index.h"

enum { PROBATION = 0, PROTECTED = 1 };

typedef struct list {
    uint32_t head, tail, n;
} list_t;

struct kv_index {
    kv_entry_t *e;
    uint32_t max, n, free_head; /* free entries chain through .next */
    uint32_t *table;            /* entry ids, KV_NONE empty */
    uint32_t mask;
    list_t lists[KV_TIERS][2];
    uint32_t protected_cap[KV_TIERS];
    double half_life_s;
};

static uint32_t slot_of(const kv_index_t *ix, td_block_name_t n) { return (uint32_t)(n.lo ^ (n.hi >> 17)) & ix->mask; }

td_status_t kv_index_create(uint32_t max_entries, kv_index_t **out)
{
    if (!max_entries || max_entries > (1u << 30))
        return td_error(TD_ERR_INVALID_ARG, "kvstore index: %u entries is out of range [1, 2^30]", max_entries);
    kv_index_t *ix = calloc(1, sizeof *ix);
    uint32_t cap = 1;
    while (cap < 2 * max_entries)
        cap <<= 1;
    if (!ix || !(ix->e = calloc(max_entries, sizeof *ix->e)) || !(ix->table = malloc((size_t)cap * sizeof *ix->table))) {
        if (ix)
            free(ix->e);
        free(ix);
        return td_error(TD_ERR_NO_MEMORY, "kvstore index: no memory for %u entries", max_entries);
    }
    memset(ix->table, 0xff, (size_t)cap * sizeof *ix->table);
    ix->mask = cap - 1;
    ix->max = max_entries;
    ix->half_life_s = KV_HIT_HALF_LIFE_S;
    for (uint32_t i = 0; i < max_entries; i++)
        ix->e[i].next = i + 1 < max_entries ? i + 1 : KV_NONE;
    ix->free_head = 0;
    for (int t = 0; t < KV_TIERS; t++) {
        for (int l = 0; l < 2; l++)
            ix->lists[t][l] = (list_t){KV_NONE, KV_NONE, 0};
        ix->protected_cap[t] = UINT32_MAX;
    }
    *out = ix;
    return TD_OK;
}

void kv_index_destroy(kv_index_t *ix)
{
    if (!ix)
        return;
    free(ix->e);
    free(ix->table);
    free(ix);
}

kv_entry_t *kv_index_entry(kv_index_t *ix, uint32_t id) { return &ix->e[id]; }
uint32_t kv_index_count(const kv_index_t *ix) { return ix->n; }
uint32_t kv_index_tier_count(const kv_index_t *ix, kv_tier_t t) { return ix->lists[t][0].n + ix->lists[t][1].n; }

void kv_index_set_capacity(kv_index_t *ix, kv_tier_t tier, uint32_t slots)
{
    ix->protected_cap[tier] = slots / 5;
}

void kv_index_set_protected(kv_index_t *ix, kv_tier_t tier, uint32_t blocks) { ix->protected_cap[tier] = blocks; }

uint32_t kv_index_find(const kv_index_t *ix, td_block_name_t name)
{
    for (uint32_t s = slot_of(ix, name);; s = (s + 1) & ix->mask) {
        uint32_t id = ix->table[s];
        if (id == KV_NONE)
            return KV_NONE;
        if (td_block_name_eq(ix->e[id].name, name))
            return id;
    }
}

static void unlink_entry(kv_index_t *ix, uint32_t id)
{
    kv_entry_t *x = &ix->e[id];
    list_t *l = &ix->lists[x->tier][x->list];
    if (x->prev != KV_NONE)
        ix->e[x->prev].next = x->next;
    else
        l->head = x->next;
    if (x->next != KV_NONE)
        ix->e[x->next].prev = x->prev;
    else
        l->tail = x->prev;
    l->n--;
}

static void push_head(kv_index_t *ix, uint32_t id, int which)
{
    kv_entry_t *x = &ix->e[id];
    list_t *l = &ix->lists[x->tier][which];
    x->list = (uint8_t)which;
    x->prev = KV_NONE;
    x->next = l->head;
    if (l->head != KV_NONE)
        ix->e[l->head].prev = id;
    else
        l->tail = id;
    l->head = id;
    l->n++;
}

uint32_t kv_index_insert(kv_index_t *ix, td_block_name_t name, kv_tier_t tier, uint32_t slot, double now)
{
    if (ix->free_head == KV_NONE)
        return KV_NONE;
    uint32_t id = ix->free_head;
    kv_entry_t *x = &ix->e[id];
    ix->free_head = x->next;
    *x = (kv_entry_t){.name = name, .slot = slot, .tier = (uint8_t)tier, .state = KV_PENDING, .last_access = now,
                      .hits_at = now};
    uint32_t s = slot_of(ix, name);
    while (ix->table[s] != KV_NONE)
        s = (s + 1) & ix->mask;
    ix->table[s] = id;
    push_head(ix, id, PROBATION);
    ix->n++;
    return id;
}

void kv_index_remove(kv_index_t *ix, uint32_t id)
{
    kv_entry_t *x = &ix->e[id];
    uint32_t s = slot_of(ix, x->name);
    while (ix->table[s] != id)
        s = (s + 1) & ix->mask;
    /* backward-shift deletion: move later members of the run into the hole
     * when their home slot does not lie cyclically in (hole, their slot] */
    uint32_t hole = s;
    for (uint32_t j = (s + 1) & ix->mask; ix->table[j] != KV_NONE; j = (j + 1) & ix->mask) {
        uint32_t home = slot_of(ix, ix->e[ix->table[j]].name);
        bool stays = hole <= j ? (home > hole && home <= j) : (home > hole || home <= j);
        if (!stays) {
            ix->table[hole] = ix->table[j];
            hole = j;
        }
    }
    ix->table[hole] = KV_NONE;
    unlink_entry(ix, id);
    x->state = KV_FREE;
    x->next = ix->free_head;
    ix->free_head = id;
    ix->n--;
}

static double decayed(const kv_index_t *ix, const kv_entry_t *x, double now)
{
    return x->hits * exp2(-(now - x->hits_at) / ix->half_life_s);
}

double kv_index_hits(const kv_index_t *ix, uint32_t id, double now) { return decayed(ix, &ix->e[id], now); }

void kv_index_set_half_life(kv_index_t *ix, double half_life_s)
{
    ix->half_life_s = half_life_s > 0 ? half_life_s : KV_HIT_HALF_LIFE_S;
}

void kv_index_touch(kv_index_t *ix, uint32_t id, double now)
{
    kv_entry_t *x = &ix->e[id];
    x->hits = decayed(ix, x, now) + 1;
    x->hits_at = now;
    x->last_access = now;
    unlink_entry(ix, id);
    push_head(ix, id, PROTECTED);
    list_t *p = &ix->lists[x->tier][PROTECTED];
    while (p->n > ix->protected_cap[x->tier] && p->tail != KV_NONE) {
        uint32_t t = p->tail;
        unlink_entry(ix, t);
        push_head(ix, t, PROBATION);
    }
}

void kv_index_move(kv_index_t *ix, uint32_t id, kv_tier_t tier, uint32_t slot)
{
    kv_entry_t *x = &ix->e[id];
    unlink_entry(ix, id);
    x->tier = (uint8_t)tier;
    x->slot = slot;
    push_head(ix, id, PROBATION);
}

uint32_t kv_index_victim(const kv_index_t *ix, kv_tier_t tier)
{
    for (int l = PROBATION; l <= PROTECTED; l++)
        for (uint32_t id = ix->lists[tier][l].tail; id != KV_NONE; id = ix->e[id].prev)
            if (!ix->e[id].refs && ix->e[id].state == KV_READY)
                return id;
    return KV_NONE;
}

uint32_t kv_index_longest_run(const kv_index_t *ix)
{
    uint32_t best = 0, run = 0;
    for (uint32_t pass = 0; pass < 2; pass++) /* twice round: a run may wrap */
        for (uint32_t s = 0; s <= ix->mask; s++) {
            run = ix->table[s] != KV_NONE ? run + 1 : 0;
            if (run > best)
                best = run;
        }
    return best > ix->mask + 1 ? ix->mask + 1 : best;
}

uint32_t kv_index_each(kv_index_t *ix, uint32_t from, bool (*fn)(void *ctx, uint32_t id, kv_entry_t *e), void *ctx)
{
    for (uint32_t i = from; i < ix->max; i++)
        if (ix->e[i].state != KV_FREE && !fn(ctx, i, &ix->e[i]))
            return i;
    return KV_NONE;
}
