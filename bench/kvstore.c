/* kvstore.c — tandem-bench-kvstore: the KV store's node-local floors.
 *
 *  index   lookups per second on one core of a node's index (kvstore/index.h)
 *          holding N names: hits (random present names) and misses, and the
 *          p50/p99 of single lookups;
 *  ssd     the SSD tier (kvstore/ssd.h) writing then reading back B blocks of
 *          the default model's size (368,640 bytes: 30 layers x K,V x 3 heads
 *          x 16 tokens x 64 x fp16) through O_DIRECT + io_uring, digest
 *          checked on every read as the node does, in GB/s of block bytes;
 *          bench/kvstore.sh runs fio on the same file system and block size.
 * Usage: tandem-bench-kvstore index [N] | ssd DIR [BLOCKS]. One JSON line. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "common/log.h"
#include "common/rng.h"
#include "kvstore/index.h"
#include "kvstore/ssd.h"

static td_block_name_t nm(uint64_t i) { return (td_block_name_t){i * 0x9E3779B97F4A7C15ull + 1, i ^ 0x5bd1e995ull}; }

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static int bench_index(uint32_t n)
{
    kv_index_t *ix;
    if (kv_index_create(n, &ix))
        return 1;
    for (uint32_t i = 0; i < n; i++)
        kv_index_insert(ix, nm(i), KV_TIER_CPU, i, 0);
    td_rng_t r;
    td_rng_seed(&r, 1);
    enum { Q = 1 << 20 };
    uint64_t *keys = malloc(Q * sizeof *keys);
    for (uint32_t i = 0; i < Q; i++)
        keys[i] = td_rng_u64(&r) % n;
    volatile uint32_t sink = 0;
    double best_hit = 0, best_miss = 0;
    for (int rep = 0; rep < 5; rep++) {
        double t0 = td_now_s();
        for (uint32_t i = 0; i < Q; i++)
            sink += kv_index_find(ix, nm(keys[i]));
        double t1 = td_now_s();
        for (uint32_t i = 0; i < Q; i++)
            sink += kv_index_find(ix, nm(keys[i] + n));
        double t2 = td_now_s();
        if (Q / (t1 - t0) > best_hit)
            best_hit = Q / (t1 - t0);
        if (Q / (t2 - t1) > best_miss)
            best_miss = Q / (t2 - t1);
    }
    enum { L = 100000 };
    double *lat = malloc(L * sizeof *lat);
    for (uint32_t i = 0; i < L; i++) {
        double t0 = td_now_s();
        sink += kv_index_find(ix, nm(keys[i]));
        lat[i] = (td_now_s() - t0) * 1e9;
    }
    qsort(lat, L, sizeof *lat, cmp_d);
    printf("{\"bench\":\"index\",\"names\":%u,\"hit_lookups_per_s\":%.0f,\"miss_lookups_per_s\":%.0f,"
           "\"lookup_ns_p50\":%.0f,\"lookup_ns_p99\":%.0f,\"longest_run\":%u}\n",
           n, best_hit, best_miss, lat[L / 2], lat[L * 99 / 100], kv_index_longest_run(ix));
    (void)sink;
    free(lat);
    free(keys);
    kv_index_destroy(ix);
    return 0;
}

static int bench_ssd(const char *dir, uint32_t blocks)
{
    td_kv_layout_t l = td_kv_layout_make("bench", 30, 3, 64, 16, TD_KV_F16);
    size_t bb = td_kv_block_bytes(&l);
    kv_ssd_t *s;
    td_kv_layout_t found;
    bool have;
    uint32_t slots;
    if (kv_ssd_open(dir, (uint64_t)blocks * (bb + 4096), &s, &found, &have) || kv_ssd_set_block_bytes(s, &l, &slots)) {
        fprintf(stderr, "tandem-bench-kvstore: %s\n", td_last_error());
        return 1;
    }
    if (slots < blocks)
        blocks = slots;
    uint8_t *buf;
    if (posix_memalign((void **)&buf, 4096, bb))
        return 1;
    td_rng_t r;
    td_rng_seed(&r, 2);
    for (size_t i = 0; i < bb / 8; i++)
        ((uint64_t *)buf)[i] = td_rng_u64(&r);
    uint64_t dg = td_kv_block_digest(buf, bb);
    double t0 = td_now_s();
    for (uint32_t i = 0; i < blocks; i++)
        if (kv_ssd_write(s, i, nm(i), dg, buf)) {
            fprintf(stderr, "tandem-bench-kvstore: %s\n", td_last_error());
            return 1;
        }
    double t1 = td_now_s();
    for (uint32_t i = 0; i < blocks; i++)
        if (kv_ssd_read(s, i, nm(i), dg, buf)) {
            fprintf(stderr, "tandem-bench-kvstore: %s\n", td_last_error());
            return 1;
        }
    double t2 = td_now_s();
    double gb = (double)blocks * (double)bb / 1e9;
    printf("{\"bench\":\"ssd\",\"dir\":\"%s\",\"blocks\":%u,\"block_bytes\":%zu,\"write_gb_s\":%.3f,\"read_gb_s\":%.3f}\n",
           dir, blocks, bb, gb / (t1 - t0), gb / (t2 - t1));
    free(buf);
    kv_ssd_close(s);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc >= 2 && !strcmp(argv[1], "index"))
        return bench_index(argc > 2 ? (uint32_t)strtoul(argv[2], NULL, 10) : 1000000);
    if (argc >= 3 && !strcmp(argv[1], "ssd"))
        return bench_ssd(argv[2], argc > 3 ? (uint32_t)strtoul(argv[3], NULL, 10) : 2048);
    fprintf(stderr, "usage: tandem-bench-kvstore index [N] | ssd DIR [BLOCKS]\n");
    return 2;
}
