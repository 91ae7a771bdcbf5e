/* placement.c — the router's placement cost per request (DESIGN.md §5):
 * the prompt's chain of block names, the cache index lookup, predictions for
 * every prefill candidate and the pair's bookkeeping, under the predictive
 * policy. The table holds 2 prefill + 1 decode workers (records as etcd
 * gives them, with profiles), the index 10k blocks across the pools and 3
 * store nodes; each request is a 4k-token prompt sharing a prefix with
 * indexed ones. Prints p50/p99/max in microseconds.
 *
 * usage: tandem-bench-placement [--requests N] [--blocks B] [--tokens T] */
#define _GNU_SOURCE
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/blockhash.h"
#include "common/clock.h"
#include "common/kv_contract.h"
#include "common/rpc.h"
#include "router/kvindex.h"
#include "router/placement.h"

static int cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static void put_worker(rt_table_t *t, const td_kv_layout_t *l, const char *id, const char *role)
{
    eng_profile_t p = {.prefill = {2, 0.7, 0.002}, .decode = {2.5, 0.8, 0.005}, .samples = 10};
    json_t *j = json_pack("{s:s, s:s, s:s, s:i, s:o, s:o}", "id", id, "role", role, "addr", "127.0.0.1:9", "pid", 1,
                          "contract", td_kv_layout_to_json(l), "profile", eng_profile_to_json(&p));
    char *v = json_dumps(j, JSON_COMPACT), key[128];
    snprintf(key, sizeof key, "/tandem/workers/%s/%s", role, id);
    rt_table_put(t, key, v);
    free(v);
    json_decref(j);
}

int main(int argc, char **argv)
{
    uint32_t n_req = 20000, n_blocks = 10000, n_tokens = 4096;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--requests"))
            n_req = (uint32_t)atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--blocks"))
            n_blocks = (uint32_t)atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--tokens"))
            n_tokens = (uint32_t)atoi(argv[i + 1]);
    }
    td_rpc_init();
    td_kv_layout_t l = td_kv_layout_make("m", 30, 3, 64, 16, TD_KV_F16);
    rt_table_t t;
    rt_table_init(&t, &l, NULL);
    rt_kvindex_t *ix;
    if (rt_kvindex_create(262144, &ix))
        return 1;
    t.ix = ix;
    put_worker(&t, &l, "p0", "prefill");
    put_worker(&t, &l, "p1", "prefill");
    put_worker(&t, &l, "d0", "decode");
    const char *srcs[5] = {"/tandem/workers/prefill/p0", "/tandem/workers/prefill/p1", "/k/0", "/k/1", "/k/2"};
    int slot[5];
    for (int s = 0; s < 5; s++)
        slot[s] = rt_kvindex_source(ix, srcs[s], s >= 2);
    for (size_t i = 0; i < t.n; i++)
        t.w[i]->ix_src = !strcmp(t.w[i]->id, "p0") ? slot[0] : !strcmp(t.w[i]->id, "p1") ? slot[1] : -1;
    /* 40 "documents" of n_tokens: their chains indexed until n_blocks names are held */
    uint32_t bt = 16, nb = n_tokens / bt, n_docs = 40;
    td_block_name_t root = td_block_name_root("m", "fp16", bt);
    int32_t *tok = malloc((size_t)n_docs * n_tokens * sizeof *tok);
    td_block_name_t *chain = malloc(nb * sizeof *chain);
    uint64_t rng = 1;
    for (size_t i = 0; i < (size_t)n_docs * n_tokens; i++) {
        rng = rng * 6364136223846793005ull + 1442695040888963407ull;
        tok[i] = (int32_t)(rng >> 40) % 49000;
    }
    uint32_t indexed = 0;
    bool *yes = malloc(nb * sizeof *yes);
    for (uint32_t k = 0; k < nb; k++)
        yes[k] = true;
    for (uint32_t d = 0; d < n_docs && indexed < n_blocks; d++) {
        td_block_name_chain(root, tok + (size_t)d * n_tokens, n_tokens, bt, chain, nb);
        uint32_t take = n_blocks - indexed < nb ? n_blocks - indexed : nb;
        rt_kvindex_apply(ix, slot[d % 2], chain, yes, NULL, take / 2); /* the first half in a pool */
        rt_kvindex_apply(ix, slot[2 + d % 3], chain, yes, NULL, take);  /* all of it in the store */
        indexed += take;
    }
    rt_kvindex_stats_t st;
    rt_kvindex_stats(ix, &st);
    double *us = malloc(n_req * sizeof *us);
    rt_place_req_t rq = {.n_tokens = n_tokens, .chain = chain, .n_blocks = nb, .max_tokens = 128,
                         .ttft_slo_ms = 0, .tpot_slo_ms = 0};
    for (uint32_t i = 0; i < n_req; i++) {
        const int32_t *p = tok + (size_t)(i % n_docs) * n_tokens;
        rq.tokens = p;
        double t0 = td_now_s();
        td_block_name_chain(root, p, n_tokens, bt, chain, nb); /* the request path hashes its prompt too */
        rt_placement_t pl;
        rt_table_place(&t, &rt_placement_predictive, &rq, &pl);
        us[i] = (td_now_s() - t0) * 1e6;
        if (pl.code)
            return fprintf(stderr, "placement refused: %s\n", pl.why), 1;
        rt_table_prefill_done(&t, pl.prefill, &pl.pred);
        rt_table_done(&t, pl.prefill, NULL, 0);
        rt_table_done(&t, pl.decode, NULL, 0);
    }
    qsort(us, n_req, sizeof *us, cmp);
    printf("placement (predictive): %u requests of %u tokens (%u blocks), index %llu names over %u sources: "
           "p50 %.1f us, p99 %.1f us, max %.1f us (chain hashing included)\n",
           n_req, n_tokens, nb, (unsigned long long)st.names, st.sources, us[n_req / 2],
           us[(size_t)(0.99 * (n_req - 1))], us[n_req - 1]);
    /* the same without hashing: lookup, predictions, bookkeeping */
    uint32_t hit_blocks = 0;
    for (uint32_t i = 0; i < n_req; i++) {
        td_block_name_chain(root, tok + (size_t)(i % n_docs) * n_tokens, n_tokens, bt, chain, nb);
        double t0 = td_now_s();
        rt_placement_t pl;
        rt_table_place(&t, &rt_placement_predictive, &rq, &pl);
        us[i] = (td_now_s() - t0) * 1e6;
        hit_blocks += (pl.pred.pool_tokens + pl.pred.store_tokens) / bt;
        rt_table_prefill_done(&t, pl.prefill, &pl.pred);
        rt_table_done(&t, pl.prefill, NULL, 0);
        rt_table_done(&t, pl.decode, NULL, 0);
    }
    qsort(us, n_req, sizeof *us, cmp);
    printf("(cached blocks per request, mean: %.1f of %u)\n", (double)hit_blocks / n_req, nb);
    printf("placement (predictive) without hashing: p50 %.1f us, p99 %.1f us, max %.1f us\n", us[n_req / 2],
           us[(size_t)(0.99 * (n_req - 1))], us[n_req - 1]);
    free(us);
    free(yes);
    free(chain);
    free(tok);
    rt_kvindex_destroy(ix);
    return 0;
}
