/* index.h — a kvstore node's index: block name -> entry (DESIGN.md §4).
 *
 * Entries live in a fixed array (an entry's id is its place there); the name
 * table is open addressing with linear probing over entry ids, and deletion
 * is real: a removed name's slot is refilled by shifting the run after it
 * back (no tombstones), so a lookup of an absent name reads at most the
 * longest run, however long the node runs. Each entry is also on one of the
 * eviction lists of its tier (kvstore/index.c: segmented LRU, the policy's
 * reasons there). Not thread safe: the node's lock is around it. */
#ifndef KV_INDEX_H
#define KV_INDEX_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/blockhash.h"
#include "common/status.h"

#define KV_NONE UINT32_MAX
#define KV_ENTRY_REPLICAS 4

/* tier numbers (kvstore/tier.h): the CPU tier is 0, the SSD tier 1 when a node has one; KV_TIERS, the most */
typedef enum kv_tier { KV_TIER_CPU = 0, KV_TIER_SSD = 1, KV_TIERS = 4 } kv_tier_t;
typedef enum kv_state { KV_FREE = 0, KV_PENDING = 1, KV_READY = 2 } kv_state_t;

typedef struct kv_entry {
    td_block_name_t name;
    uint64_t digest;      /* td_kv_block_digest of its bytes, set when it was committed */
    double last_access;   /* td_now_s() */
    double hits;          /* hit count, halved every half-life */
    double hits_at;       /* when hits was last decayed */
    uint32_t slot;        /* its place in its tier */
    uint32_t refs;        /* readers' and writers' leases: not evicted while > 0 */
    uint32_t prev, next;  /* its eviction list */
    uint8_t tier, state, list;
    bool replica;         /* a copy of another node's hot block (DRAM only, dropped when it cools) */
    /* a home's hot block: the nodes (kv_client_node_seed) it was copied to
     * since it was last cool (kvstore/server.c) */
    uint64_t sent_to[KV_ENTRY_REPLICAS];
} kv_entry_t;

#define KV_HIT_HALF_LIFE_S 30.0 /* the default (kv_index_set_half_life) */

typedef struct kv_index kv_index_t;

/* An index of at most max_entries names. */
td_status_t kv_index_create(uint32_t max_entries, kv_index_t **out);
void kv_index_destroy(kv_index_t *ix);

/* The id of name's entry, or KV_NONE. */
uint32_t kv_index_find(const kv_index_t *ix, td_block_name_t name);
/* A new entry for name (absent: check first) on tier with slot, state
 * PENDING, at the head of the tier's probation list; KV_NONE when the index
 * is full. */
uint32_t kv_index_insert(kv_index_t *ix, td_block_name_t name, kv_tier_t tier, uint32_t slot, double now);
/* Drops entry id and its name. */
void kv_index_remove(kv_index_t *ix, uint32_t id);
kv_entry_t *kv_index_entry(kv_index_t *ix, uint32_t id);

/* A hit: the decayed count grows by one, and the entry moves to the head of
 * its tier's protected list (to probation's head on its first hit). */
void kv_index_touch(kv_index_t *ix, uint32_t id, double now);
/* The entry's hit rate now (hits, decayed to now). */
double kv_index_hits(const kv_index_t *ix, uint32_t id, double now);
/* Hit counts halve every half_life_s seconds (default KV_HIT_HALF_LIFE_S). */
void kv_index_set_half_life(kv_index_t *ix, double half_life_s);
/* Moves entry id to tier with slot (an SSD demotion, a promotion). */
void kv_index_move(kv_index_t *ix, uint32_t id, kv_tier_t tier, uint32_t slot);
/* The entry to evict from tier: the coldest one nobody holds (probation's
 * tail, then protected's), or KV_NONE. */
uint32_t kv_index_victim(const kv_index_t *ix, kv_tier_t tier);

/* The tier holds at most slots blocks: its protected list keeps at most
 * 20% of them (index.c says why). */
void kv_index_set_capacity(kv_index_t *ix, kv_tier_t tier, uint32_t slots);
/* The protected list keeps at most this many blocks (0: plain LRU). */
void kv_index_set_protected(kv_index_t *ix, kv_tier_t tier, uint32_t blocks);

uint32_t kv_index_count(const kv_index_t *ix);
uint32_t kv_index_tier_count(const kv_index_t *ix, kv_tier_t tier);
/* The longest run of occupied table slots (what a miss reads). */
uint32_t kv_index_longest_run(const kv_index_t *ix);
/* fn(ctx, id, entry) for each entry from id `from` on, in id order, while fn
 * returns true; returns the id where fn said stop (KV_NONE: all were seen). */
uint32_t kv_index_each(kv_index_t *ix, uint32_t from, bool (*fn)(void *ctx, uint32_t id, kv_entry_t *e), void *ctx);

#endif
