/* kvindex.h — the router's cache index (DESIGN.md §5): which sources hold
 * which named KV blocks, a source being a worker's pool or a kvstore node.
 *
 * Built from the sources' event logs (common/kv_events.h) by the follower
 * (router/follow.c); read by placement to price a prompt's block chain. A
 * hash table over block names with, per name, a bitmask of the sources
 * holding it and one per tier below the first of the store sources holding
 * it there (a node's tiers: kvstore/tier.h); at most
 * max_blocks names (a name past it is not indexed and counted), at most
 * RT_IX_SOURCES sources. Internally locked: reads share, writes exclude. */
#ifndef RT_KVINDEX_H
#define RT_KVINDEX_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/blockhash.h"
#include "common/status.h"

#define RT_IX_SOURCES 64
#define RT_IX_TIERS 4 /* a store's tiers told apart (a deeper one counts as the last) */

typedef struct rt_kvindex rt_kvindex_t;

td_status_t rt_kvindex_create(uint32_t max_blocks, rt_kvindex_t **out);
void rt_kvindex_destroy(rt_kvindex_t *ix);

/* The slot of the source named key (a worker's or a node's etcd key), made
 * if new; store: a kvstore node. -1 when all RT_IX_SOURCES are taken. */
int rt_kvindex_source(rt_kvindex_t *ix, const char *key, bool store);
/* The slot of key, or -1. */
int rt_kvindex_find(rt_kvindex_t *ix, const char *key);
/* Forgets every name of a source (before its snapshot is applied) and,
 * with release, the slot itself (the source left). */
void rt_kvindex_clear(rt_kvindex_t *ix, int src, bool release);
/* Applies a batch of a source's events (stored[i]: STORED, else REMOVED;
 * tier[i]: the tier it is in, 0 the first; NULL: all in the first). */
void rt_kvindex_apply(rt_kvindex_t *ix, int src, const td_block_name_t *names, const bool *stored,
                      const uint8_t *tier, size_t n);

/* What a chain of names can be served from: for each source, how many
 * leading blocks it holds in a row (held[src], RT_IX_SOURCES entries), and
 * how many leading blocks some store source holds (store_run), of which
 * store_tier[k] are in tier k at best (the first tier of any store source
 * holding it). Linear in the chain's length. */
typedef struct rt_chain_hits {
    uint32_t held[RT_IX_SOURCES];
    uint32_t store_run, store_tier[RT_IX_TIERS];
} rt_chain_hits_t;
void rt_kvindex_chain(rt_kvindex_t *ix, const td_block_name_t *chain, size_t n, rt_chain_hits_t *out);
/* The source bits holding one name (0: none). */
uint64_t rt_kvindex_holders(rt_kvindex_t *ix, td_block_name_t name);

typedef struct rt_kvindex_stats {
    uint64_t names, max_names, dropped_full;
    uint32_t sources;
    uint32_t source_blocks[RT_IX_SOURCES]; /* names each source holds, by slot */
    uint64_t source_digest[RT_IX_SOURCES]; /* XOR of lo ^ hi over them */
} rt_kvindex_stats_t;
void rt_kvindex_stats(rt_kvindex_t *ix, rt_kvindex_stats_t *out);

#endif
