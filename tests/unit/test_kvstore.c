/* The kvstore's index (kvstore/index.h) against a brute-force reference,
 * its eviction order, and rendezvous homes (kvstore/client.h). */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "common/rng.h"
#include "kvstore/client.h"
#include "kvstore/index.h"

static td_block_name_t nm(uint64_t i) { return (td_block_name_t){i * 0x9E3779B97F4A7C15ull + 1, i ^ 0xABCDEFull}; }

/* Random inserts and removes; after each, every name the reference holds is
 * found with its slot and a sample of absent ones is not. */
Test(kv_index, matches_a_reference_under_churn)
{
    enum { MAX = 4096, SPACE = 20000, OPS = 200000 };
    kv_index_t *ix;
    cr_assert_eq(kv_index_create(MAX, &ix), TD_OK);
    uint32_t *id_of = malloc(SPACE * sizeof *id_of);
    for (uint32_t i = 0; i < SPACE; i++)
        id_of[i] = KV_NONE;
    uint32_t held = 0;
    td_rng_t r;
    td_rng_seed(&r, 7);
    for (uint32_t op = 0; op < OPS; op++) {
        uint32_t k = (uint32_t)(td_rng_u64(&r) % SPACE);
        if (id_of[k] == KV_NONE && held < MAX) {
            cr_assert_eq(kv_index_find(ix, nm(k)), KV_NONE);
            id_of[k] = kv_index_insert(ix, nm(k), KV_TIER_CPU, k, 0);
            cr_assert_neq(id_of[k], KV_NONE);
            held++;
        } else if (id_of[k] != KV_NONE) {
            cr_assert_eq(kv_index_find(ix, nm(k)), id_of[k]);
            kv_index_remove(ix, id_of[k]);
            id_of[k] = KV_NONE;
            held--;
        }
        if (op % 10000 == 0)
            for (uint32_t i = 0; i < SPACE; i++) {
                uint32_t id = kv_index_find(ix, nm(i));
                cr_assert_eq(id, id_of[i], "name %u after %u ops", i, op);
                if (id != KV_NONE)
                    cr_assert_eq(kv_index_entry(ix, id)->slot, i);
            }
    }
    cr_assert_eq(kv_index_count(ix), held);
    /* real deletion: a table at most half full keeps short runs however long it churned */
    cr_assert_lt(kv_index_longest_run(ix), 64, "longest run %u", kv_index_longest_run(ix));
    free(id_of);
    kv_index_destroy(ix);
}

static uint32_t add_ready(kv_index_t *ix, uint64_t k)
{
    uint32_t id = kv_index_insert(ix, nm(k), KV_TIER_CPU, (uint32_t)k, 0);
    kv_index_entry(ix, id)->state = KV_READY;
    return id;
}

/* Segmented LRU: a block read again outlives a scan of blocks read once,
 * which plain LRU (evict the least recently used) would not allow. */
Test(kv_index, a_reused_block_outlives_a_scan)
{
    kv_index_t *ix;
    cr_assert_eq(kv_index_create(1024, &ix), TD_OK);
    kv_index_set_capacity(ix, KV_TIER_CPU, 100);
    uint32_t hot = add_ready(ix, 1);
    kv_index_touch(ix, hot, 1.0); /* read again: protected */
    for (uint64_t k = 2; k < 60; k++) /* a scan, more recent than the hot block's last use */
        add_ready(ix, k);
    for (int i = 0; i < 58; i++) {
        uint32_t v = kv_index_victim(ix, KV_TIER_CPU);
        cr_assert_neq(v, hot, "the hot block was evicted before the scan's blocks (victim %d)", i);
        kv_index_remove(ix, v);
    }
    cr_assert_eq(kv_index_victim(ix, KV_TIER_CPU), hot);
    /* a held block is never a victim */
    kv_index_entry(ix, hot)->refs = 1;
    cr_assert_eq(kv_index_victim(ix, KV_TIER_CPU), KV_NONE);
    kv_index_destroy(ix);
}

/* The decayed hit count halves every KV_HIT_HALF_LIFE_S seconds. */
Test(kv_index, hits_decay)
{
    kv_index_t *ix;
    cr_assert_eq(kv_index_create(16, &ix), TD_OK);
    uint32_t id = add_ready(ix, 5);
    for (int i = 0; i < 8; i++)
        kv_index_touch(ix, id, 10.0);
    cr_assert_float_eq(kv_index_hits(ix, id, 10.0), 8.0, 1e-9);
    cr_assert_float_eq(kv_index_hits(ix, id, 10.0 + KV_HIT_HALF_LIFE_S), 4.0, 1e-9);
    /* kvstore.hit_half_life_s: the same count, halving every 2 s */
    kv_index_set_half_life(ix, 2.0);
    cr_assert_float_eq(kv_index_hits(ix, id, 14.0), 2.0, 1e-9);
    kv_index_destroy(ix);
}

/* Rendezvous hashing: a node's loss moves only the names it was home to,
 * and its return moves back only those. */
Test(kv_client, rendezvous_moves_only_the_lost_nodes_names)
{
    const char *ids[] = {"kvstore-0", "kvstore-1", "kvstore-2", "kvstore-3"};
    uint64_t all[4], without2[3];
    for (int i = 0; i < 4; i++)
        all[i] = kv_client_node_seed(ids[i]);
    without2[0] = all[0];
    without2[1] = all[1];
    without2[2] = all[3];
    int count[4] = {0}, moved = 0;
    for (uint64_t k = 0; k < 40000; k++) {
        int h = kv_client_home(nm(k), all, 4);
        count[h]++;
        int h2 = kv_client_home(nm(k), without2, 3);
        int back = h2 == 2 ? 3 : h2; /* index in `all` */
        if (h != 2)
            cr_assert_eq(back, h, "name %llu moved from a live node", (unsigned long long)k);
        else
            moved++;
    }
    cr_assert_eq(moved, count[2]);
    for (int i = 0; i < 4; i++) /* an even spread: 10,000 +- 5% each */
        cr_assert(count[i] > 9500 && count[i] < 10500, "node %d is home to %d of 40,000", i, count[i]);
}
