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
 *  policy  the eviction policy (segmented LRU, kvstore/index.c) against plain
 *          LRU at equal capacity on a Mooncake trace (one block per hash id):
 *          each request reads its longest cached prefix of blocks (the hits),
 *          then stores the rest; beside them the trace's ideal (an infinite
 *          cache). Capacities: 1, 2, 5, 10, 20 and 50% of the distinct blocks.
 *  store   through a running node (kvstore/client.h, plaintext, etcd at ETCD):
 *          put GB/s (write-behind batches of 256 blocks: Put, UCX puts,
 *          Commit), get GB/s (one lookup of every name, one fetch: one UCX get
 *          per contiguous run, digests checked) and the latency of a one-block
 *          read (lookup + fetch + lease end) p50/p99. Four rounds of fresh
 *          names: the first maps the node's tier into this process (cold), the
 *          best later one is the steady state (warm). tandem-bench-kvxfer is
 *          the raw UCX and memcpy floor (bench/kvstore.sh runs both).
 *  hot     one chain read at a high rate by one reader per node, each near
 *          its node (bench_hot says more): tests/integration/test_kvstore_hot.py.
 * Usage: tandem-bench-kvstore index [N] | ssd DIR [BLOCKS] | policy TRACE | store ETCD [BLOCKS] |
 *        hot ETCD NODE,NODE,... BLOCKS SECONDS.
 * One JSON line per result. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/clock.h"
#include "common/log.h"
#include <jansson.h>

#include "common/rng.h"
#include "common/rpc.h"
#include "kvstore/client.h"
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

typedef struct trace {
    uint32_t *ids, *start; /* request i: ids[start[i] .. start[i + 1]) */
    uint32_t n_req, n_ids, distinct;
} trace_t;

static int trace_load(const char *path, trace_t *t)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return 1;
    size_t cap_ids = 1 << 20, cap_req = 1 << 15;
    t->ids = malloc(cap_ids * sizeof *t->ids);
    t->start = malloc((cap_req + 1) * sizeof *t->start);
    char line[1 << 16];
    uint32_t maxid = 0;
    while (fgets(line, sizeof line, f)) {
        json_t *j = json_loads(line, 0, NULL), *h = j ? json_object_get(j, "hash_ids") : NULL;
        if (!h) {
            json_decref(j);
            continue;
        }
        if (t->n_req + 1 >= cap_req) {
            cap_req *= 2;
            t->start = realloc(t->start, (cap_req + 1) * sizeof *t->start);
        }
        t->start[t->n_req++] = t->n_ids;
        for (size_t k = 0; k < json_array_size(h); k++) {
            if (t->n_ids == cap_ids) {
                cap_ids *= 2;
                t->ids = realloc(t->ids, cap_ids * sizeof *t->ids);
            }
            uint32_t v = (uint32_t)json_integer_value(json_array_get(h, k));
            t->ids[t->n_ids++] = v;
            if (v > maxid)
                maxid = v;
        }
        json_decref(j);
    }
    fclose(f);
    t->start[t->n_req] = t->n_ids;
    uint8_t *seen = calloc(maxid + 1, 1);
    for (uint32_t i = 0; i < t->n_ids; i++)
        if (!seen[t->ids[i]]++)
            t->distinct++;
    free(seen);
    return 0;
}

/* Hits (blocks of cached prefixes) with capacity blocks; slru: segmented
 * LRU (80% protected), else plain LRU (no protected segment). */
static uint64_t simulate(const trace_t *t, uint32_t capacity, double protected_frac)
{
    kv_index_t *ix;
    if (kv_index_create(capacity + 1, &ix))
        return 0;
    kv_index_set_protected(ix, KV_TIER_CPU, (uint32_t)(protected_frac * capacity));
    uint64_t hits = 0;
    for (uint32_t r = 0; r < t->n_req; r++) {
        uint32_t a = t->start[r], b = t->start[r + 1], k = a;
        while (k < b && kv_index_find(ix, nm(t->ids[k])) != KV_NONE) /* the longest cached prefix */
            k++;
        hits += k - a;
        /* the rest is computed and stored; then every block of the request is
         * touched deepest first, so that a chain's earlier blocks (which every
         * later one needs) are the more recent */
        for (uint32_t m = b; m-- > a;) {
            uint32_t id = kv_index_find(ix, nm(t->ids[m]));
            if (id == KV_NONE && m >= k) {
                if (kv_index_count(ix) >= capacity) {
                    uint32_t v = kv_index_victim(ix, KV_TIER_CPU);
                    if (v == KV_NONE)
                        continue;
                    kv_index_remove(ix, v);
                }
                id = kv_index_insert(ix, nm(t->ids[m]), KV_TIER_CPU, 0, r);
                kv_index_entry(ix, id)->state = KV_READY;
            } else if (id != KV_NONE && m < k) {
                kv_index_touch(ix, id, r);
            }
        }
    }
    kv_index_destroy(ix);
    return hits;
}

static int bench_policy(const char *path)
{
    trace_t t = {0};
    if (trace_load(path, &t)) {
        fprintf(stderr, "tandem-bench-kvstore: cannot read %s\n", path);
        return 1;
    }
    uint64_t ideal = simulate(&t, t.distinct, 0);
    static const double fr[] = {0.01, 0.02, 0.05, 0.10, 0.20, 0.50};
    for (size_t i = 0; i < sizeof fr / sizeof fr[0]; i++) {
        uint32_t cap = (uint32_t)(fr[i] * t.distinct);
        uint64_t s = simulate(&t, cap, 0.8), l = simulate(&t, cap, 0), s5 = simulate(&t, cap, 0.5),
                 s2 = simulate(&t, cap, 0.2);
        printf("{\"bench\":\"policy\",\"trace\":\"%s\",\"requests\":%u,\"blocks\":%u,\"distinct\":%u,"
               "\"capacity\":%u,\"capacity_frac\":%.2f,\"slru80_hit_rate\":%.4f,\"slru50_hit_rate\":%.4f,"
               "\"slru20_hit_rate\":%.4f,\"lru_hit_rate\":%.4f,\"ideal_hit_rate\":%.4f}\n", path, t.n_req, t.n_ids,
               t.distinct, cap, fr[i], (double)s / t.n_ids, (double)s5 / t.n_ids, (double)s2 / t.n_ids,
               (double)l / t.n_ids, (double)ideal / t.n_ids);
    }
    free(t.ids);
    free(t.start);
    return 0;
}

typedef struct put_wait {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    uint32_t done, stored;
} put_wait_t;

static void put_done(void *ctx, uint32_t stored)
{
    put_wait_t *w = ctx;
    pthread_mutex_lock(&w->mu);
    w->done++;
    w->stored += stored;
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

/* Waits up to timeout_s for `batches` put batches to be done: how many were. */
static uint32_t put_wait_for(put_wait_t *w, uint32_t batches, int timeout_s)
{
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += timeout_s;
    pthread_mutex_lock(&w->mu);
    int wr = 0;
    while (w->done < batches && wr == 0)
        wr = pthread_cond_timedwait(&w->cv, &w->mu, &until);
    uint32_t done = w->done;
    pthread_mutex_unlock(&w->mu);
    return done;
}

/* Blocks of random bytes to put (src, names base.., sp) and `copies`
 * destinations for reading them back (dst, dp). */
typedef struct bench_blocks {
    uint8_t *src, *dst;
    td_block_name_t *names;
    const void **sp;
    void **dp;
    uint64_t base;
} bench_blocks_t;

static bool bench_blocks_make(bench_blocks_t *b, uint32_t blocks, size_t bb, uint32_t copies, td_rng_t *r)
{
    b->src = malloc(blocks * bb);
    b->dst = malloc((size_t)copies * blocks * bb);
    b->names = malloc(blocks * sizeof *b->names);
    b->sp = malloc(blocks * sizeof *b->sp);
    b->dp = malloc((size_t)copies * blocks * sizeof *b->dp);
    if (!b->src || !b->dst || !b->names || !b->sp || !b->dp)
        return false;
    b->base = td_rng_u64(r);
    for (size_t i = 0; i < blocks * bb; i += 8) {
        uint64_t v = td_rng_u64(r);
        memcpy(b->src + i, &v, 8);
    }
    for (uint32_t i = 0; i < blocks; i++) {
        b->names[i] = nm(b->base + i);
        b->sp[i] = b->src + (size_t)i * bb;
    }
    for (size_t i = 0; i < (size_t)copies * blocks; i++)
        b->dp[i] = b->dst + i * bb;
    return true;
}

static void bench_blocks_free(bench_blocks_t *b)
{
    free(b->src);
    free(b->dst);
    free(b->names);
    free(b->sp);
    free(b->dp);
}

static int bench_store(const char *etcd, uint32_t blocks)
{
    td_rpc_init();
    kv_client_config_t cfg = {.etcd_endpoints = etcd,
                              .contract = td_kv_layout_make("bench", 30, 3, 64, 16, TD_KV_F16)};
    size_t bb = td_kv_block_bytes(&cfg.contract);
    kv_client_t *c;
    if (kv_client_create(&cfg, &c)) {
        fprintf(stderr, "tandem-bench-kvstore: %s\n", td_last_error());
        return 1;
    }
    td_sleep_s(1); /* the etcd watch's first listing of the nodes */
    td_rng_t r;
    td_rng_seed(&r, (uint64_t)(td_now_s() * 1e6));
    bench_blocks_t bk;
    if (!bench_blocks_make(&bk, blocks, bb, 1, &r))
        return 1;
    uint8_t *src = bk.src, *dst = bk.dst;
    td_block_name_t *names = bk.names;
    const void **sp = bk.sp;
    void **dp = bk.dp;
    uint64_t base = bk.base;
    /* Rounds of put then get, fresh names each round. The first round maps
     * the node's tier into this process page by page (UCX's shared-memory
     * segment); later rounds reuse mapped slots (the tier holds one round, so
     * each put evicts the round before) — the steady state of a long-running
     * worker, and what tandem-bench-kvxfer's best-of-5 measures. */
    enum { ROUNDS = 4 };
    double put_gbs[ROUNDS], get_gbs[ROUNDS], fetch_gbs[ROUNDS];
    bool same = true;
    uint32_t stored_all = 0, got = 0;
    for (int round = 0; round < ROUNDS; round++) {
        for (uint32_t i = 0; i < blocks; i++)
            names[i] = nm(base + (uint64_t)round * blocks + i);
        put_wait_t w = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0};
        uint32_t batches = 0;
        double t0 = td_now_s();
        for (uint32_t i = 0; i < blocks; i += 256, batches++) { /* write-behind batches of 256 */
            uint32_t n = blocks - i < 256 ? blocks - i : 256;
            if (kv_client_put_async(c, names + i, sp + i, n, put_done, &w)) {
                fprintf(stderr, "tandem-bench-kvstore: %s\n", td_last_error());
                return 1;
            }
        }
        /* each batch's RPCs and transfers have their own deadlines; this one bounds the whole */
        uint32_t done = put_wait_for(&w, batches, 120);
        if (done < batches) {
            fprintf(stderr, "tandem-bench-kvstore: %u of %u put batches done after 120 s\n", done, batches);
            return 1;
        }
        double t_put = td_now_s() - t0;
        stored_all += w.stored;
        /* get: the whole chain, one lookup and one fetch */
        kv_client_read_t *rd;
        uint32_t found = 0;
        got = 0;
        memset(dst, 0, blocks * bb); /* a reader's pool is resident: first-touch faults are not the store's */
        t0 = td_now_s();
        td_status_t rc = kv_client_lookup(c, names, blocks, 10, &rd, &found);
        double t_lookup = td_now_s() - t0;
        if (!rc && found)
            rc = kv_client_fetch(c, rd, 0, found, dp, 30, &got);
        double t_get = td_now_s() - t0;
        kv_client_read_end(c, rd);
        same = same && got == blocks && !memcmp(src, dst, blocks * bb);
        put_gbs[round] = blocks * bb / t_put / 1e9;
        get_gbs[round] = got * bb / t_get / 1e9;
        fetch_gbs[round] = got * bb / (t_get - t_lookup) / 1e9;
    }
    /* one-block reads: lookup + fetch + end */
    enum { L = 1000 };
    static double lat[L], lat_lookup[L];
    uint32_t ok1 = 0;
    kv_client_read_t *rd;
    for (int i = 0; i < L; i++) {
        uint32_t k = (uint32_t)(td_rng_u64(&r) % blocks), f = 0, g = 0;
        double a = td_now_s();
        kv_client_lookup(c, &names[k], 1, 5, &rd, &f);
        lat_lookup[i] = td_now_s() - a;
        if (f)
            kv_client_fetch(c, rd, 0, 1, &dp[0], 5, &g);
        kv_client_read_end(c, rd);
        lat[i] = td_now_s() - a;
        ok1 += g;
    }
    qsort(lat, L, sizeof lat[0], cmp_d);
    qsort(lat_lookup, L, sizeof lat[0], cmp_d);
    char rounds[512];
    int off = 0;
    for (int i = 0; i < ROUNDS; i++)
        off += snprintf(rounds + off, sizeof rounds - off, "%s[%.3f, %.3f, %.3f]", i ? ", " : "", put_gbs[i],
                        get_gbs[i], fetch_gbs[i]);
    /* the warm figure: the best later round, as tandem-bench-kvxfer takes its best */
    double pw = 0, gw = 0, fw = 0;
    for (int i = 1; i < ROUNDS; i++) {
        pw = put_gbs[i] > pw ? put_gbs[i] : pw;
        gw = get_gbs[i] > gw ? get_gbs[i] : gw;
        fw = fetch_gbs[i] > fw ? fetch_gbs[i] : fw;
    }
    printf("{\"bench\": \"store\", \"blocks\": %u, \"block_bytes\": %zu, \"stored\": %u, \"put_gbs\": %.3f, "
           "\"get_gbs\": %.3f, \"get_fetch_only_gbs\": %.3f, \"first_round_put_gbs\": %.3f, "
           "\"first_round_get_gbs\": %.3f, \"rounds_put_get_fetch\": [%s], \"got\": %u, \"bytes_equal\": %s, "
           "\"read1_p50_us\": %.0f, \"read1_p99_us\": %.0f, \"lookup1_p50_us\": %.0f, \"lookup1_p99_us\": %.0f, "
           "\"read1_ok\": %u}\n",
           blocks, bb, stored_all, pw, gw, fw, put_gbs[0], get_gbs[0], rounds, got, same ? "true" : "false",
           lat[L / 2] * 1e6, lat[L * 99 / 100] * 1e6, lat_lookup[L / 2] * 1e6, lat_lookup[L * 99 / 100] * 1e6, ok1);
    kv_client_destroy(c);
    bench_blocks_free(&bk);
    td_rpc_shutdown();
    return same && stored_all == (uint32_t)ROUNDS * blocks ? 0 : 1;
}

typedef struct hot_reader {
    kv_client_t *c;
    const td_block_name_t *names;
    const uint8_t *src; /* the bytes put: every block read is compared */
    size_t block_bytes;
    uint32_t blocks;
    void **dp;
    double seconds;
    uint64_t reads, full, blocks_got, bytes_differ;
} hot_reader_t;

static void *hot_read(void *arg)
{
    hot_reader_t *h = arg;
    h->reads = h->full = h->blocks_got = h->bytes_differ = 0;
    double until = td_now_s() + h->seconds;
    while (td_now_s() < until) {
        kv_client_read_t *rd;
        uint32_t f = 0, g = 0;
        if (kv_client_lookup(h->c, h->names, h->blocks, 5, &rd, &f) == TD_OK) {
            if (f)
                kv_client_fetch(h->c, rd, 0, f, h->dp, 5, &g);
            kv_client_read_end(h->c, rd);
        }
        for (uint32_t i = 0; i < g; i++)
            h->bytes_differ += memcmp(h->dp[i], h->src + (size_t)i * h->block_bytes, h->block_bytes) != 0;
        h->reads++;
        h->blocks_got += g;
        h->full += g == h->blocks;
        td_sleep_s(0.005);
    }
    return NULL;
}

/* hot: one chain of BLOCKS blocks put once, then read at a high rate by one
 * reader per node, each with that node as its near node (as tandem up gives
 * its prefill workers): the phase the kvstore's hot-block replication is
 * for. Reads for SECONDS, prints each reader's reads, full-chain hits and
 * blocks got; then waits for a line on stdin and reads again (the test
 * kills a node in between). */
static int bench_hot(const char *etcd, const char *node_list, uint32_t blocks, double seconds)
{
    td_rpc_init();
    char ids[8][64];
    int nr = 0;
    for (const char *p = node_list; *p && nr < 8;) {
        size_t l = strcspn(p, ",");
        snprintf(ids[nr++], sizeof ids[0], "%.*s", (int)l, p);
        p += l + (p[l] == ',');
    }
    kv_client_config_t cfg = {.etcd_endpoints = etcd,
                              .contract = td_kv_layout_make("bench", 30, 3, 64, 16, TD_KV_F16)};
    size_t bb = td_kv_block_bytes(&cfg.contract);
    kv_client_t *w, *rc[8];
    if (kv_client_create(&cfg, &w)) {
        fprintf(stderr, "tandem-bench-kvstore: %s\n", td_last_error());
        return 1;
    }
    for (int i = 0; i < nr; i++) {
        kv_client_config_t rcfg = cfg;
        rcfg.near_node = ids[i];
        if (kv_client_create(&rcfg, &rc[i])) {
            fprintf(stderr, "tandem-bench-kvstore: %s\n", td_last_error());
            return 1;
        }
    }
    td_sleep_s(1); /* the etcd watches' first listing of the nodes */
    td_rng_t r;
    td_rng_seed(&r, (uint64_t)(td_now_s() * 1e6));
    bench_blocks_t bk;
    if (!bench_blocks_make(&bk, blocks, bb, (uint32_t)nr, &r))
        return 1;
    put_wait_t pw = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0};
    if (kv_client_put_async(w, bk.names, bk.sp, blocks, put_done, &pw)) {
        fprintf(stderr, "tandem-bench-kvstore: %s\n", td_last_error());
        return 1;
    }
    put_wait_for(&pw, 1, 60);
    printf("{\"phase\": \"stored\", \"blocks\": %u, \"stored\": %u}\n", blocks, pw.stored);
    fflush(stdout);
    int code = pw.stored == blocks ? 0 : 1;
    for (int phase = 1; phase <= 2 && !code; phase++) {
        hot_reader_t h[8];
        pthread_t t[8];
        for (int i = 0; i < nr; i++) {
            h[i] = (hot_reader_t){.c = rc[i], .names = bk.names, .src = bk.src, .block_bytes = bb, .blocks = blocks,
                                  .dp = bk.dp + (size_t)i * blocks,
                                  .seconds = seconds};
            pthread_create(&t[i], NULL, hot_read, &h[i]);
        }
        printf("{\"phase\": %d, \"readers\": [", phase);
        for (int i = 0; i < nr; i++) {
            pthread_join(t[i], NULL);
            printf("%s{\"near\": \"%s\", \"reads\": %llu, \"full\": %llu, \"blocks_got\": %llu, "
                   "\"blocks_differ\": %llu}", i ? ", " : "", ids[i], (unsigned long long)h[i].reads,
                   (unsigned long long)h[i].full, (unsigned long long)h[i].blocks_got,
                   (unsigned long long)h[i].bytes_differ);
        }
        printf("]}\n");
        fflush(stdout);
        char line[64];
        if (phase == 1 && !fgets(line, sizeof line, stdin))
            break;
    }
    for (int i = 0; i < nr; i++)
        kv_client_destroy(rc[i]);
    kv_client_destroy(w);
    bench_blocks_free(&bk);
    td_rpc_shutdown();
    return code;
}

int main(int argc, char **argv)
{
    if (argc >= 2 && !strcmp(argv[1], "index"))
        return bench_index(argc > 2 ? (uint32_t)strtoul(argv[2], NULL, 10) : 1000000);
    if (argc >= 3 && !strcmp(argv[1], "ssd"))
        return bench_ssd(argv[2], argc > 3 ? (uint32_t)strtoul(argv[3], NULL, 10) : 2048);
    if (argc >= 3 && !strcmp(argv[1], "policy"))
        return bench_policy(argv[2]);
    if (argc >= 3 && !strcmp(argv[1], "store"))
        return bench_store(argv[2], argc > 3 ? (uint32_t)strtoul(argv[3], NULL, 10) : 1024);
    if (argc >= 6 && !strcmp(argv[1], "hot"))
        return bench_hot(argv[2], argv[3], (uint32_t)strtoul(argv[4], NULL, 10), atof(argv[5]));
    fprintf(stderr, "usage: tandem-bench-kvstore index [N] | ssd DIR [BLOCKS] | policy TRACE | store ETCD [BLOCKS] |\n"
                    "                            hot ETCD NODE,NODE,... BLOCKS SECONDS\n");
    return 2;
}
