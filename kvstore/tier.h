/* tier.h — a kvstore node's tiers as a table (DESIGN.md §4), as the KV
 * transport is one (kvstore/transfer.h).
 *
 * Tier 0 is the CPU tier: the region the transport registered, cut into
 * slots of one block each, which peers put into and get from one-sided
 * (kvstore/tier_cpu.c). Each further tier holds what the tier above it
 * evicts (the SSD tier, kvstore/ssd.c); a hit there is read back into tier
 * 0 before a peer gets it, and a block evicted from the last tier is gone.
 * The index (kvstore/index.h) says which tier and slot hold a block.
 *
 * Threads: every op is called under the node's one lock (kvstore/server.c).
 * A new tier is a file that fills these ops, and a line where the node
 * opens its tiers. */
#ifndef KV_TIER_H
#define KV_TIER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/blockhash.h"
#include "common/status.h"

typedef struct kv_tier_ops {
    const char *name; /* "cpu", "ssd": the label of its Stats and metrics */
    bool (*take)(void *tier, uint32_t *slot); /* a free slot, or false */
    void (*give)(void *tier, uint32_t slot);  /* a slot free again */
    /* the slot's bytes where the node and its peers reach them in memory;
     * NULL for a tier reached only by read and write */
    uint8_t *(*mem)(void *tier, uint32_t slot);
    td_status_t (*write)(void *tier, uint32_t slot, td_block_name_t name, uint64_t digest, const void *src);
    /* TD_ERR_FORMAT naming the block and what was wrong when the slot does
     * not hold name with that digest (the node drops it: a miss) */
    td_status_t (*read)(void *tier, uint32_t slot, td_block_name_t name, uint64_t digest, void *dst);
    uint64_t (*capacity)(const void *tier); /* bytes */
    uint64_t (*bad_reads)(const void *tier); /* blocks read back bad */
    /* GB/s a peer gets blocks at from this tier, as measured on our machines
     * (bench/results/kvstore-2026-11-24.md): in the node's etcd record, the
     * router prices a fetch from it with this (router/placement.h) */
    double read_gbps;
} kv_tier_ops_t;

/* The CPU tier over [base, base + bytes) (memory the transport owns); it
 * has no slots until it is cut into slots of block_bytes (*slots of them),
 * once the node knows its blocks' size. */
typedef struct kv_cpu_tier kv_cpu_tier_t;
td_status_t kv_cpu_tier_create(uint8_t *base, size_t bytes, kv_cpu_tier_t **out);
td_status_t kv_cpu_tier_cut(kv_cpu_tier_t *c, size_t block_bytes, uint32_t *slots);
void kv_cpu_tier_destroy(kv_cpu_tier_t *c);

extern const kv_tier_ops_t kv_tier_cpu, kv_tier_ssd;

#endif
