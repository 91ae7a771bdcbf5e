/* test_placement.c — the router's worker table and least-loaded placement
 * (router/placement.h): workers join from their etcd records, a worker whose
 * call failed is skipped while suspect and chosen again after, a refused
 * (contract mismatch) or departed worker is never chosen, and load spreads. */
#include "tests/unit/helpers.h"

#include <math.h>

#include "common/clock.h"
#include "common/config.h"
#include "common/kv_contract.h"
#include "common/log.h"
#include "common/rpc.h"
#include "router/demand.h"
#include "router/placement.h"
#include "router/stats.h"

static td_kv_layout_t expect;

/* Puts a worker's record: id, role, address, pid, the contract, and extra's
 * fields (taken). */
static void put_record(rt_table_t *t, const char *id, const char *role, const td_kv_layout_t *l, json_t *extra)
{
    json_t *j = json_pack("{s:s, s:s, s:s, s:i, s:o}", "id", id, "role", role, "addr", "127.0.0.1:9", "pid", 1,
                          "contract", td_kv_layout_to_json(l));
    json_object_update(j, extra);
    json_decref(extra);
    char *v = json_dumps(j, JSON_COMPACT), key[128];
    snprintf(key, sizeof key, "/tandem/workers/%s/%s", role, id);
    rt_table_put(t, key, v);
    free(v);
    json_decref(j);
}

static void put_worker_as(rt_table_t *t, const char *id, const char *role, uint32_t block_tokens, bool colocated)
{
    td_kv_layout_t l = expect;
    l.block_tokens = block_tokens;
    put_record(t, id, role, &l, json_pack("{s:b}", "colocated", colocated));
}

static void put_worker(rt_table_t *t, const char *id, const char *role, uint32_t block_tokens)
{
    put_worker_as(t, id, role, block_tokens, false);
}

/* Acquires n times (keeping every reference) and counts picks per id. */
static int picks(rt_table_t *t, const char *id, int n, rt_worker_t **held)
{
    int k = 0;
    for (int i = 0; i < n; i++) {
        held[i] = rt_table_acquire(t, &rt_placement_least_loaded, RT_DECODE, NULL);
        k += held[i] && !strcmp(held[i]->id, id);
    }
    return k;
}

static void release_all(rt_table_t *t, rt_worker_t **held, int n)
{
    for (int i = 0; i < n; i++)
        if (held[i])
            rt_table_done(t, held[i], false, 0);
}

Test(placement, skips_failed_suspect_refused_and_gone_workers, .timeout = 30)
{
    td_rpc_init();
    expect = td_kv_layout_make("m", 30, 3, 64, 16, TD_KV_F16);
    rt_table_t t;
    rt_table_init(&t, &expect, NULL);
    cr_assert_null(rt_table_acquire(&t, &rt_placement_least_loaded, RT_DECODE, NULL), "an empty table");
    put_worker(&t, "d1", "decode", 16);
    put_worker(&t, "d2", "decode", 16);
    put_worker(&t, "d3", "decode", 32); /* refused: its contract differs */
    put_worker(&t, "p1", "prefill", 16);
    cr_assert_eq(rt_table_registered(&t, RT_DECODE), 2, "the refused worker does not count");
    rt_worker_t *held[64];
    /* least loaded: 8 concurrent picks split 4/4; never the refused or the prefill worker */
    int d1 = picks(&t, "d1", 8, held), d2 = 0;
    for (int i = 0; i < 8; i++) {
        cr_assert_not_null(held[i]);
        cr_assert(strcmp(held[i]->id, "d3") && strcmp(held[i]->id, "p1"), "picked %s", held[i]->id);
        d2 += !strcmp(held[i]->id, "d2");
    }
    cr_assert(d1 == 4 && d2 == 4, "load spreads: d1 %d, d2 %d", d1, d2);
    release_all(&t, held, 8);
    /* a failed call makes d1 suspect: skipped until its time is up, then chosen again */
    rt_worker_t *w = NULL;
    for (int i = 0; i < 4 && (!w || strcmp(w->id, "d1")); i++) {
        if (w)
            rt_table_done(&t, w, false, 0);
        w = rt_table_acquire(&t, &rt_placement_least_loaded, RT_DECODE, NULL);
    }
    cr_assert_str_eq(w->id, "d1");
    td_rpc_result_t busy = {.code = TD_RPC_RESOURCE_EXHAUSTED, .message = "no room for 300 tokens of KV"};
    rt_table_done(&t, w, &busy, 0.5);
    cr_assert_eq(picks(&t, "d1", 10, held), 0, "a suspect worker is skipped");
    release_all(&t, held, 10);
    td_sleep_s(0.6);
    cr_assert_gt(picks(&t, "d1", 10, held), 0, "and chosen again once its suspect time is over");
    release_all(&t, held, 10);
    /* both suspect: nothing to pick, though both are still registered */
    for (int i = 0; i < 2; i++) {
        rt_worker_t *x = rt_table_acquire(&t, &rt_placement_least_loaded, RT_DECODE, NULL);
        held[i] = x;
    }
    td_rpc_result_t down = {.code = TD_RPC_UNAVAILABLE, .message = "Socket closed"};
    rt_table_done(&t, held[0], &down, 30);
    rt_table_done(&t, held[1], &busy, 20);
    cr_assert_null(rt_table_acquire(&t, &rt_placement_least_loaded, RT_DECODE, NULL), "every worker suspect");
    cr_assert_eq(rt_table_registered(&t, RT_DECODE), 2);
    /* placement refuses with the reason and when a worker is usable again (the sooner one) */
    rt_placement_t pl;
    rt_table_place(&t, &rt_placement_least_loaded, NULL, &pl);
    cr_assert_null(pl.decode);
    cr_assert_eq(pl.code, TD_RPC_RESOURCE_EXHAUSTED, "a full pool is exhaustion: %d %s", pl.code, pl.why);
    cr_assert(strstr(pl.why, "no room for 300 tokens") && strstr(pl.why, held[1]->id), "%s", pl.why);
    double in = pl.retry_at - td_now_s();
    cr_assert(in > 19 && in <= 20, "retry in %.1f s: the sooner of the two", in);
    /* a worker that left is gone at once, and a record held across its removal stays valid */
    rt_worker_t *pf = rt_table_acquire(&t, &rt_placement_least_loaded, RT_PREFILL, NULL);
    cr_assert_not_null(pf);
    rt_table_remove(&t, "/tandem/workers/prefill/p1");
    cr_assert_null(rt_table_acquire(&t, &rt_placement_least_loaded, RT_PREFILL, NULL), "p1 left");
    cr_assert_str_eq(pf->id, "p1", "the holder's record is still readable");
    rt_table_done(&t, pf, false, 0);
    cr_assert_eq(rt_table_registered(&t, RT_PREFILL), 0);
    rt_table_place(&t, &rt_placement_least_loaded, NULL, &pl);
    cr_assert(pl.code == TD_RPC_RESOURCE_EXHAUSTED || pl.code == TD_RPC_UNAVAILABLE);
    put_worker(&t, "d9", "decode", 32);
    rt_table_remove(&t, "/tandem/workers/decode/d1");
    rt_table_remove(&t, "/tandem/workers/decode/d2");
    rt_table_place(&t, &rt_placement_least_loaded, NULL, &pl);
    cr_assert_eq(pl.code, TD_RPC_FAILED_PRECONDITION, "only refused workers: %s", pl.why);
    cr_assert(strstr(pl.why, "block_tokens") && pl.retry_at == 0, "%s", pl.why);
    td_rpc_shutdown();
}

/* A registered worker whose connection fails (killed -9, its record not yet
 * expired; or the router has not yet seen its restart's record): placement
 * names it and looks again shortly instead of refusing for good. */
Test(placement, unreachable_worker_is_named_and_retried, .timeout = 30)
{
    td_rpc_init();
    expect = td_kv_layout_make("m", 30, 3, 64, 16, TD_KV_F16);
    rt_table_t t;
    rt_table_init(&t, &expect, NULL);
    put_worker(&t, "d1", "decode", 16);
    put_worker(&t, "p1", "prefill", 16); /* 127.0.0.1:9: nothing listens */
    rt_worker_t *pf = rt_table_acquire(&t, &rt_placement_least_loaded, RT_PREFILL, NULL);
    cr_assert_not_null(pf);
    uint8_t *resp = NULL;
    size_t n = 0;
    td_rpc_result_t res = {0};
    cr_assert_neq(td_rpc_unary(pf->ch, "/tandem.internal.v1.Prefill/Stats", "", 0, 5, NULL, &resp, &n, &res), TD_OK);
    free(resp);
    for (int i = 0; i < 100 && !td_rpc_channel_down(pf->ch); i++)
        td_sleep_s(0.02);
    cr_assert(td_rpc_channel_down(pf->ch), "a call to a closed port leaves its channel down");
    rt_table_done(&t, pf, NULL, 0);
    rt_placement_t pl;
    rt_table_place(&t, &rt_placement_least_loaded, NULL, &pl);
    cr_assert_null(pl.decode);
    cr_assert_eq(pl.code, TD_RPC_UNAVAILABLE, "%s", pl.why);
    cr_assert(strstr(pl.why, "no prefill worker can be reached") && strstr(pl.why, "p1") &&
              strstr(pl.why, "127.0.0.1:9"), "%s", pl.why);
    double in = pl.retry_at - td_now_s();
    cr_assert(in > 0 && in <= RT_DOWN_RETRY_S, "looked at again in %.2f s", in);
    put_record(&t, "p2", "prefill", &expect, json_pack("{s:s}", "addr", "127.0.0.1:10"));
    rt_table_place(&t, &rt_placement_least_loaded, NULL, &pl);
    cr_assert_eq(pl.code, TD_RPC_OK, "its restart (a new record) takes it: %s", pl.why);
    cr_assert_str_eq(pl.prefill->id, "p2");
    rt_table_done(&t, pl.prefill, NULL, 0);
    rt_table_done(&t, pl.decode, NULL, 0);
    rt_table_fini(&t);
    td_rpc_shutdown();
}

/* A placed request's measured timings reach the policy (least_loaded keeps
 * a moving mean of each worker's TTFT and TPOT for the predictive placement
 * to come); a pair is placed when both roles have a usable worker. */
Test(placement, pairs_and_observed_timings, .timeout = 30)
{
    td_rpc_init();
    expect = td_kv_layout_make("m", 30, 3, 64, 16, TD_KV_F16);
    rt_table_t t;
    rt_table_init(&t, &expect, NULL);
    rt_placement_t pl;
    rt_table_place(&t, &rt_placement_least_loaded, NULL, &pl);
    cr_assert_eq(pl.code, TD_RPC_UNAVAILABLE);
    cr_assert(strstr(pl.why, "no decode worker is registered"), "%s", pl.why);
    cr_assert_eq(pl.retry_at, 0, "nothing will become usable by itself");
    put_worker(&t, "d1", "decode", 16);
    rt_table_place(&t, &rt_placement_least_loaded, NULL, &pl);
    cr_assert(pl.code == TD_RPC_UNAVAILABLE && strstr(pl.why, "no prefill worker"), "%s", pl.why);
    put_worker(&t, "p1", "prefill", 16);
    rt_table_place(&t, &rt_placement_least_loaded, NULL, &pl);
    cr_assert_eq(pl.code, TD_RPC_OK, "%s", pl.why);
    cr_assert(!strcmp(pl.prefill->id, "p1") && !strcmp(pl.decode->id, "d1"));
    rt_timings_t tm = {.ttft_ms = 100, .tpot_ms = 10, .output_tokens = 8, .ok = true};
    rt_table_observe(&t, &rt_placement_least_loaded, pl.prefill, pl.decode, &tm);
    tm.ttft_ms = 200;
    tm.tpot_ms = 20;
    rt_table_observe(&t, &rt_placement_least_loaded, pl.prefill, pl.decode, &tm);
    cr_assert_float_eq(pl.prefill->ewma_ttft_ms, 120, 1e-9);
    cr_assert_float_eq(pl.decode->ewma_tpot_ms, 12, 1e-9);
    rt_table_done(&t, pl.prefill, NULL, 0);
    rt_table_done(&t, pl.decode, NULL, 0);
    td_rpc_shutdown();
}

/* The cache index against a plain reference: random stores and removals of
 * 3,000 names by 4 sources (deletions shift runs back: no tombstones), a
 * source cleared; every name's holders and every source's count agree. */
Test(kvindex, random_operations_match_a_reference, .timeout = 30)
{
    enum { N = 3000, S = 4 };
    rt_kvindex_t *ix;
    cr_assert_eq(rt_kvindex_create(4096, &ix), TD_OK);
    int src[S];
    for (int s = 0; s < S; s++) {
        char k[16];
        snprintf(k, sizeof k, "/s/%d", s);
        src[s] = rt_kvindex_source(ix, k, s == 3);
        cr_assert(src[s] >= 0);
    }
    static uint8_t ref[N]; /* bit s: source s holds name i */
    td_block_name_t names[N];
    for (int i = 0; i < N; i++) /* low bits collide on purpose: long runs */
        names[i] = (td_block_name_t){(uint64_t)(i % 97) | ((uint64_t)i << 20), (uint64_t)i * 0x9e3779b97f4a7c15ull};
    uint64_t rng = 7;
    for (int step = 0; step < 60000; step++) {
        rng = rng * 6364136223846793005ull + 1442695040888963407ull;
        int i = (int)((rng >> 33) % N), s = (int)((rng >> 20) % S);
        bool put = (rng >> 10) % 3 != 0;
        rt_kvindex_apply(ix, src[s], &names[i], &put, NULL, 1);
        ref[i] = put ? ref[i] | (1u << s) : ref[i] & ~(1u << s);
        if (step == 30000) {
            rt_kvindex_clear(ix, src[1], false);
            for (int k = 0; k < N; k++)
                ref[k] &= ~2u;
        }
    }
    rt_kvindex_stats_t st;
    rt_kvindex_stats(ix, &st);
    uint32_t count[S] = {0};
    uint64_t live = 0;
    for (int i = 0; i < N; i++) {
        uint64_t want = 0;
        for (int s = 0; s < S; s++)
            if (ref[i] & (1u << s)) {
                want |= 1ull << src[s];
                count[s]++;
            }
        live += want != 0;
        cr_assert_eq(rt_kvindex_holders(ix, names[i]), want, "name %d", i);
    }
    cr_assert_eq(st.names, live);
    for (int s = 0; s < S; s++)
        cr_assert_eq(st.source_blocks[src[s]], count[s], "source %d", s);
    rt_kvindex_destroy(ix);
}

/* A store run's blocks counted by the best tier any store source holds
 * each in (a node's tiers: 0 the CPU tier, deeper ones after; past the
 * index's last, as the last), moves between tiers followed; and the tiers'
 * read rates priced per block, deeper tiers than any rate given as the
 * last. */
Test(kvindex, a_store_run_is_counted_by_each_blocks_best_tier, .timeout = 30)
{
    rt_kvindex_t *ix;
    cr_assert_eq(rt_kvindex_create(64, &ix), TD_OK);
    int a = rt_kvindex_source(ix, "/kvstores/a", true), b = rt_kvindex_source(ix, "/kvstores/b", true);
    td_block_name_t chain[8];
    bool yes[8];
    uint8_t tier_a[8] = {0, 0, 1, 1, 2, 2, 3, 7}, tier_b[2] = {0, 2};
    for (int i = 0; i < 8; i++) {
        chain[i] = (td_block_name_t){(uint64_t)i + 1, 0x5151ull * (uint64_t)(i + 1)};
        yes[i] = true;
    }
    rt_kvindex_apply(ix, a, chain, yes, tier_a, 8);
    rt_kvindex_apply(ix, b, &chain[2], yes, tier_b, 2); /* b: block 2 in its CPU tier, block 3 in its tier 2 */
    rt_chain_hits_t h;
    rt_kvindex_chain(ix, chain, 8, &h);
    cr_assert(h.store_run == 8 && h.store_tier[0] == 3 && h.store_tier[1] == 1 && h.store_tier[2] == 2 &&
                  h.store_tier[3] == 2,
              "run %u, tiers %u %u %u %u", h.store_run, h.store_tier[0], h.store_tier[1], h.store_tier[2],
              h.store_tier[3]);
    uint8_t down = 2;
    rt_kvindex_apply(ix, a, chain, yes, &down, 1); /* a moves block 0 to its tier 2 */
    rt_kvindex_chain(ix, chain, 8, &h);
    cr_assert(h.store_tier[0] == 2 && h.store_tier[2] == 3, "tiers %u %u %u %u", h.store_tier[0], h.store_tier[1],
              h.store_tier[2], h.store_tier[3]);
    rt_kvindex_destroy(ix);

    expect = td_kv_layout_make("m", 30, 3, 64, 16, TD_KV_F16);
    rt_table_t t;
    rt_table_init(&t, &expect, NULL);
    double bytes = (double)td_kv_block_bytes(&expect);
    cr_assert_float_eq(t.tier_ms_per_block[1], bytes / 0.65e6, 1e-9, "the SSD tier's default");
    rt_table_set_tier_rates(&t, (const double[]){4.0, 0, 0.5}, 3);
    cr_assert_float_eq(t.tier_ms_per_block[0], bytes / 4e6, 1e-9);
    cr_assert_float_eq(t.tier_ms_per_block[1], bytes / 0.65e6, 1e-9, "a rate of 0 leaves the tier's cost");
    cr_assert_float_eq(t.tier_ms_per_block[2], bytes / 0.5e6, 1e-9);
    cr_assert_float_eq(t.tier_ms_per_block[3], bytes / 0.5e6, 1e-9, "deeper than any rate given: as the last");
    rt_table_fini(&t);
}

static void put_profiled(rt_table_t *t, const char *id, const char *role)
{
    eng_profile_t p = {.prefill = {1, 1, 0}, .decode = {2, 1, 0}};
    put_record(t, id, role, &expect, json_pack("{s:o}", "profile", eng_profile_to_json(&p)));
}

/* Predictive and kv_cost placement go where the index says the prompt's
 * prefix is (p2's pool), predictive's TTFT counts only the new tokens
 * (profile: 1 + 1 ms per new token); an SLO missed for the work queued ahead
 * is refused early with a retry hint, one that the request alone on an idle
 * worker would miss is refused with none; round_robin alternates. */
Test(placement, predictive_places_on_the_cached_prefix_and_rejects_early, .timeout = 30)
{
    td_rpc_init();
    expect = td_kv_layout_make("m", 30, 3, 64, 16, TD_KV_F16);
    rt_table_t t;
    rt_table_init(&t, &expect, NULL);
    rt_kvindex_t *ix;
    cr_assert_eq(rt_kvindex_create(4096, &ix), TD_OK);
    t.ix = ix;
    put_profiled(&t, "p1", "prefill");
    put_profiled(&t, "p2", "prefill");
    put_profiled(&t, "d1", "decode");
    int32_t tok[160];
    for (int i = 0; i < 160; i++)
        tok[i] = 100 + i;
    td_block_name_t chain[10];
    td_block_name_chain(td_block_name_root("m", "fp16", 16), tok, 160, 16, chain, 10);
    int s2 = rt_kvindex_source(ix, "/tandem/workers/prefill/p2", false);
    bool yes[10] = {true, true, true, true, true, true, true, true, true, true};
    rt_kvindex_apply(ix, s2, chain, yes, NULL, 8); /* p2 holds the first 8 blocks (128 tokens) */
    for (size_t i = 0; i < t.n; i++)
        if (!strcmp(t.w[i]->id, "p2"))
            t.w[i]->ix_src = s2;
    rt_place_req_t rq = {.tokens = tok, .n_tokens = 160, .chain = chain, .n_blocks = 10, .max_tokens = 16,
                         .early_reject = true};
    const rt_placement_ops_t *pols[2] = {&rt_placement_predictive, &rt_placement_kv_cost};
    for (int k = 0; k < 2; k++) {
        rt_placement_t pl;
        rt_table_place(&t, pols[k], &rq, &pl);
        cr_assert_eq(pl.code, TD_RPC_OK, "%s", pl.why);
        cr_assert_str_eq(pl.prefill->id, "p2", "%s", pols[k]->name);
        cr_assert_eq(pl.pred.pool_tokens, 128);
        cr_assert_eq(pl.pred.new_tokens, 32);
        cr_assert_float_eq(pl.pred.prefill_ms, 33, 1e-9);
        rt_table_prefill_done(&t, pl.prefill, &pl.pred);
        rt_table_done(&t, pl.prefill, NULL, 0);
        rt_table_done(&t, pl.decode, NULL, 0);
    }
    /* below what p2 alone takes (33 ms): no worker meets it however idle, so no hint */
    rq.ttft_slo_ms = 10;
    rt_placement_t pl;
    rt_table_place(&t, &rt_placement_predictive, &rq, &pl);
    cr_assert_eq(pl.code, TD_RPC_FAILED_PRECONDITION, "%s", pl.why);
    cr_assert(pl.rejected && !strcmp(pl.rejected, "ttft") && pl.retry_after_ms == 0 &&
              strstr(pl.why, "TTFT SLO of 10 ms; retrying will not help"),
              "%u %s", pl.retry_after_ms, pl.why);
    cr_assert_null(pl.prefill);
    /* late only for the work queued ahead (one placed on p2, not yet answered): a hint of the excess */
    rt_placement_t ahead;
    rq.ttft_slo_ms = 0;
    rt_table_place(&t, &rt_placement_predictive, &rq, &ahead);
    cr_assert(ahead.code == TD_RPC_OK && !strcmp(ahead.prefill->id, "p2"), "%s", ahead.why);
    rq.ttft_slo_ms = 50;
    rt_table_place(&t, &rt_placement_predictive, &rq, &pl);
    cr_assert(pl.code == TD_RPC_RESOURCE_EXHAUSTED && pl.rejected && strstr(pl.why, "TTFT SLO of 50 ms; retry after"),
              "%s", pl.why);
    cr_assert(pl.retry_after_ms >= 10 && pl.retry_after_ms <= 17, "hint %u ms for 66 ms predicted", pl.retry_after_ms);
    /* the decode profile's step is 2 + 1*batch ms: with one request in d1's batch a second is predicted at 4 ms,
     * alone at 3 */
    rq.ttft_slo_ms = 0;
    rq.tpot_slo_ms = 3.5;
    rt_table_place(&t, &rt_placement_predictive, &rq, &pl);
    cr_assert(pl.code == TD_RPC_RESOURCE_EXHAUSTED && pl.retry_after_ms && strstr(pl.why, "TPOT SLO") &&
              pl.rejected && !strcmp(pl.rejected, "tpot"), "%s", pl.why);
    rq.tpot_slo_ms = 1;
    rt_table_place(&t, &rt_placement_predictive, &rq, &pl);
    cr_assert(pl.code == TD_RPC_FAILED_PRECONDITION && !pl.retry_after_ms && strstr(pl.why, "will not help") &&
              pl.rejected && !strcmp(pl.rejected, "tpot"), "%s", pl.why);
    rt_table_prefill_done(&t, ahead.prefill, &ahead.pred);
    rt_table_done(&t, ahead.prefill, NULL, 0);
    rt_table_done(&t, ahead.decode, NULL, 0);
    rq.tpot_slo_ms = 3.5; /* d1 idle again: placed */
    rt_table_place(&t, &rt_placement_predictive, &rq, &pl);
    cr_assert(pl.code == TD_RPC_OK && !pl.rejected, "%s", pl.why);
    rt_table_prefill_done(&t, pl.prefill, &pl.pred);
    rt_table_done(&t, pl.prefill, NULL, 0);
    rt_table_done(&t, pl.decode, NULL, 0);
    rq.tpot_slo_ms = 0;
    const char *seen[2];
    for (int k = 0; k < 2; k++) {
        rt_table_place(&t, &rt_placement_round_robin, NULL, &pl);
        cr_assert_eq(pl.code, TD_RPC_OK);
        seen[k] = pl.prefill->id;
        rt_table_done(&t, pl.prefill, NULL, 0);
        rt_table_done(&t, pl.decode, NULL, 0);
    }
    cr_assert(strcmp(seen[0], seen[1]), "round_robin alternates (%s, %s)", seen[0], seen[1]);
    rt_kvindex_destroy(ix);
    td_rpc_shutdown();
}

/* A table of one profiled prefill worker p1 and one decode worker d1. */
static void profiled_pair(rt_table_t *t)
{
    td_rpc_init();
    expect = td_kv_layout_make("m", 30, 3, 64, 16, TD_KV_F16);
    rt_table_init(t, &expect, NULL);
    put_profiled(t, "p1", "prefill");
    put_profiled(t, "d1", "decode");
}

/* A prefill worker whose real speed differs from its profile in scale and in
 * shape (profile 1 + 1 ms a token; truth 5 + 2 ms a token + an attention
 * term): after calls that found it idle, of mixed lengths (64..2,048 tokens),
 * its model predicts a 3,000-token prompt within 2%, and a 4,096-token one,
 * past its reach, as the refit at the reach grown as the profile grows; a
 * second call placed while the first
 * is in flight waits for the first's predicted work, and once the first is
 * answered the queue is what is still in flight. */
Test(placement, prefill_model_is_refitted_from_measured_calls_and_queues, .timeout = 30)
{
    rt_table_t t;
    profiled_pair(&t);
    static int32_t tok[4096];
    for (int i = 0; i < 4096; i++)
        tok[i] = i;
    const double truth[3] = {5, 2, 0.0004};
    rt_placement_t pl;
    for (int i = 0; i < 24; i++) {
        size_t n = (size_t)(64 << (i % 6)); /* 64 .. 2048 */
        rt_place_req_t rq = {.tokens = tok, .n_tokens = n, .max_tokens = 4};
        rt_table_place(&t, &rt_placement_predictive, &rq, &pl);
        cr_assert_eq(pl.code, TD_RPC_OK, "%s", pl.why);
        cr_assert(pl.pred.alone && pl.pred.queue_ms == 0);
        double ms = truth[0] + truth[1] * (double)n + truth[2] * (double)n * ((double)n / 2);
        rt_table_prefill_done(&t, pl.prefill, &pl.pred);
        rt_timings_t tm = {.prefill_ms = ms, .ttft_ms = ms + 3 + 0.01 * (double)n, .prompt_tokens = (uint32_t)n,
                           .output_tokens = 1, .ok = true, .pred = pl.pred};
        tm.attempt_ttft_ms = tm.ttft_ms;
        if (i % 4 == 3) /* a retried request: its TTFT holds a failed attempt's seconds, its attempt's none */
            tm.ttft_ms += 5000, tm.attempt_ttft_ms = i % 8 == 3 ? 0 : tm.attempt_ttft_ms;
        rt_table_observe(&t, &rt_placement_predictive, pl.prefill, pl.decode, &tm);
        rt_table_done(&t, pl.prefill, NULL, 0);
        rt_table_done(&t, pl.decode, NULL, 0);
    }
    /* within the reach of what it measured (1.5x its largest call's work in the profile: 3,072 tokens) the
     * refit holds; past it, the refit at the reach grows as the profile does */
    rt_place_req_t near = {.tokens = tok, .n_tokens = 3000, .max_tokens = 4};
    double want = truth[0] + truth[1] * 3000 + truth[2] * 3000.0 * 1500;
    rt_table_place(&t, &rt_placement_predictive, &near, &pl);
    cr_assert(fabs(pl.pred.prefill_ms - want) / want < 0.02, "predicted %.1f ms for 3000 tokens, truth %.1f ms",
              pl.pred.prefill_ms, want);
    rt_table_prefill_done(&t, pl.prefill, &pl.pred);
    rt_table_done(&t, pl.prefill, NULL, 0);
    rt_table_done(&t, pl.decode, NULL, 0);
    rt_place_req_t big = {.tokens = tok, .n_tokens = 4096, .max_tokens = 4};
    double at = truth[0] + truth[1] * 3072 + truth[2] * 3072.0 * 1536;
    want = at * (1 + 4096) / (1 + 3072);
    rt_table_place(&t, &rt_placement_predictive, &big, &pl);
    cr_assert(fabs(pl.pred.prefill_ms - want) / want < 0.02, "predicted %.1f ms for 4096 tokens, want %.1f ms",
              pl.pred.prefill_ms, want);
    cr_assert_float_eq(pl.pred.overhead_ms, 3 + 0.01 * 4096, 1e-6); /* the router's own time, fitted by prompt size */
    rt_placement_t second;
    rt_place_req_t small = {.tokens = tok, .n_tokens = 64, .max_tokens = 4};
    rt_table_place(&t, &rt_placement_predictive, &small, &second);
    cr_assert(!second.pred.alone);
    cr_assert(second.pred.queue_ms > 0.98 * pl.pred.prefill_ms && second.pred.queue_ms <= pl.pred.prefill_ms,
              "queued %.1f ms behind a call of %.1f ms", second.pred.queue_ms, pl.pred.prefill_ms);
    rt_table_prefill_done(&t, pl.prefill, &pl.pred); /* the first answers: only the second is left */
    rt_placement_t third;
    rt_table_place(&t, &rt_placement_predictive, &small, &third);
    cr_assert(third.pred.queue_ms > 0.98 * second.pred.prefill_ms && third.pred.queue_ms <= second.pred.prefill_ms,
              "queued %.1f ms behind %.1f ms", third.pred.queue_ms, second.pred.prefill_ms);
    rt_placement_t *all[3] = {&pl, &second, &third};
    for (int i = 0; i < 3; i++) {
        if (i)
            rt_table_prefill_done(&t, all[i]->prefill, &all[i]->pred);
        rt_table_done(&t, all[i]->prefill, NULL, 0);
        rt_table_done(&t, all[i]->decode, NULL, 0);
    }
    td_rpc_shutdown();
}

/* A prefill worker whose engine runs the mlq order (its record's queue)
 * computes a short prompt before a long one in flight: the short one's
 * predicted queue is not the long one's work, as it is on an fcfs worker;
 * behind a call of its own level it still waits. */
Test(placement, the_queue_predicted_follows_the_workers_order, .timeout = 30)
{
    td_rpc_init();
    expect = td_kv_layout_make("m", 30, 3, 64, 16, TD_KV_F16);
    static int32_t tok[2048];
    for (int i = 0; i < 2048; i++)
        tok[i] = i;
    const char *orders[2] = {"fcfs", "mlq"};
    for (int o = 0; o < 2; o++) {
        rt_table_t t;
        rt_table_init(&t, &expect, NULL);
        eng_profile_t p = {.prefill = {1, 1, 0}, .decode = {2, 1, 0}};
        put_record(&t, "p1", "prefill", &expect,
                   json_pack("{s:o, s:{s:s, s:i, s:i}}", "profile", eng_profile_to_json(&p), "queue", "order",
                             orders[o], "levels", 4, "quantum", 256));
        put_profiled(&t, "d1", "decode");
        rt_place_req_t long_rq = {.tokens = tok, .n_tokens = 2048, .max_tokens = 4};
        rt_place_req_t short_rq = {.tokens = tok + 1000, .n_tokens = 64, .max_tokens = 4};
        rt_placement_t pl[3];
        rt_table_place(&t, &rt_placement_predictive, &long_rq, &pl[0]);
        rt_table_place(&t, &rt_placement_predictive, &short_rq, &pl[1]);
        rt_table_place(&t, &rt_placement_predictive, &short_rq, &pl[2]);
        for (int i = 0; i < 3; i++)
            cr_assert_eq(pl[i].code, TD_RPC_OK, "%s", pl[i].why);
        if (o == 0) { /* fcfs: behind the long one's 2,049 ms */
            cr_assert(pl[1].pred.queue_ms > 0.98 * pl[0].pred.prefill_ms, "fcfs: queued %.1f ms behind %.1f ms",
                      pl[1].pred.queue_ms, pl[0].pred.prefill_ms);
        } else { /* mlq: the long one is at level 3, the short ones at 0: the second waits for the first only */
            cr_assert(pl[1].pred.queue_ms < 0.1 * pl[0].pred.prefill_ms + 1e-9, "mlq: queued %.1f ms behind %.1f ms",
                      pl[1].pred.queue_ms, pl[0].pred.prefill_ms);
            cr_assert(pl[2].pred.queue_ms >= pl[1].pred.prefill_ms * 0.98 &&
                      pl[2].pred.queue_ms < pl[1].pred.prefill_ms + 0.1 * pl[0].pred.prefill_ms + 1e-9,
                      "mlq: the second short prompt queued %.1f ms behind %.1f ms", pl[2].pred.queue_ms,
                      pl[1].pred.prefill_ms);
        }
        for (int i = 0; i < 3; i++) {
            rt_table_prefill_done(&t, pl[i].prefill, &pl[i].pred);
            rt_table_done(&t, pl[i].prefill, NULL, 0);
            rt_table_done(&t, pl[i].decode, NULL, 0);
        }
        rt_table_fini(&t);
    }
    td_rpc_shutdown();
}

static void release_placed(rt_table_t *t, rt_placement_t *pl)
{
    if (pl->prefill) {
        rt_table_prefill_done(t, pl->prefill, &pl->pred);
        rt_table_done(t, pl->prefill, NULL, 0);
    }
    rt_table_decode_end(t, pl->decode, &pl->pred);
    rt_table_done(t, pl->decode, NULL, 0);
}

/* Decode load weighed by predicted output (router/outlen.h): beside a stream
 * predicted to make 500 tokens, a worker with two of 20 each is the lighter
 * one for a third of 20 (by streams it would be a tie, the first worker's);
 * of three workers, the two drawn are compared, so the heavily loaded one is
 * never picked. */
Test(placement, decode_load_is_the_output_predicted, .timeout = 30)
{
    rt_table_t t;
    profiled_pair(&t);
    put_profiled(&t, "d2", "decode");
    static int32_t tok[64];
    for (int i = 0; i < 64; i++)
        tok[i] = 7 + i;
    rt_place_req_t big = {.tokens = tok, .n_tokens = 64, .max_tokens = 512, .pred_out = 500};
    rt_place_req_t small = {.tokens = tok, .n_tokens = 64, .max_tokens = 512, .pred_out = 20};
    rt_placement_t a, b, c;
    rt_table_place(&t, &rt_placement_predictive, &big, &a);
    rt_table_place(&t, &rt_placement_predictive, &small, &b);
    rt_table_place(&t, &rt_placement_predictive, &small, &c);
    cr_assert(a.decode && b.decode && c.decode);
    cr_assert(strcmp(a.decode->id, b.decode->id) && !strcmp(b.decode->id, c.decode->id),
              "the 500-token stream on %s, the 20-token ones on %s and %s", a.decode->id, b.decode->id, c.decode->id);
    cr_assert_float_eq(b.decode->out_pred, 40, 1e-9);
    rt_placement_t *all[3] = {&a, &b, &c};
    for (int i = 0; i < 3; i++)
        release_placed(&t, all[i]);
    cr_assert_float_eq(b.decode->out_pred, 0, 1e-9);
    cr_assert_float_eq(a.decode->out_pred, 0, 1e-9);
    /* three workers: d1 carries 2,000 predicted tokens; 60 more placements never pick it */
    put_profiled(&t, "d3", "decode");
    rt_worker_t *d1 = NULL;
    for (size_t i = 0; i < t.n; i++)
        if (!strcmp(t.w[i]->id, "d1"))
            d1 = t.w[i];
    d1->out_pred = 2000;
    rt_placement_t pl;
    int on[3] = {0, 0, 0};
    for (int i = 0; i < 60; i++) {
        rt_table_place(&t, &rt_placement_predictive, &small, &pl);
        on[pl.decode->id[1] - '1']++;
        release_placed(&t, &pl);
    }
    cr_assert(on[0] == 0 && on[1] > 0 && on[2] > 0, "of 60: d1 %d, d2 %d, d3 %d", on[0], on[1], on[2]);
    rt_table_fini(&t);
    td_rpc_shutdown();
}

/* The refit learns from the split of cached and new tokens the worker found,
 * not the one the index guessed: calls the index priced as 184 new tokens
 * after 416 cached, which found 592 cached and computed 8, leave a cold
 * 200-token prompt predicted near its truth (3x the profile), not at the
 * few milliseconds those 8 tokens took. */
Test(placement, prefill_refit_takes_the_workers_cached_count, .timeout = 30)
{
    rt_table_t t;
    profiled_pair(&t);
    static int32_t tok[600];
    for (int i = 0; i < 600; i++)
        tok[i] = i;
    rt_placement_t pl;
    rt_place_req_t rq = {.tokens = tok, .n_tokens = 600, .max_tokens = 4};
    for (int i = 0; i < 6; i++) {
        rt_table_place(&t, &rt_placement_predictive, &rq, &pl);
        cr_assert_eq(pl.code, TD_RPC_OK, "%s", pl.why);
        rt_table_prefill_done(&t, pl.prefill, &pl.pred);
        rt_timings_t tm = {.prefill_ms = 3 * (1 + 8), .ttft_ms = 40, .attempt_ttft_ms = 40, .prompt_tokens = 600,
                           .cached_tokens = 592, .output_tokens = 1, .ok = true, .pred = pl.pred,
                           .call_cached = 592};
        tm.pred.new_tokens = 184, tm.pred.pool_tokens = 416, tm.pred.store_tokens = 0, tm.pred.fetch_ms = 0;
        rt_table_observe(&t, &rt_placement_predictive, pl.prefill, pl.decode, &tm);
        rt_table_done(&t, pl.prefill, NULL, 0);
        rt_table_done(&t, pl.decode, NULL, 0);
    }
    rt_place_req_t cold = {.tokens = tok + 300, .n_tokens = 200, .max_tokens = 4};
    rt_table_place(&t, &rt_placement_predictive, &cold, &pl);
    double truth = 3 * (1 + 200);
    cr_assert(pl.pred.prefill_ms > truth / 2 && pl.pred.prefill_ms < truth * 2,
              "a cold 200-token prompt predicted at %.1f ms, truth %.1f ms", pl.pred.prefill_ms, truth);
    rt_table_done(&t, pl.prefill, NULL, 0);
    rt_table_done(&t, pl.decode, NULL, 0);
    td_rpc_shutdown();
}

/* A cluster with no prefill worker serves a request whole on a colocated
 * decode worker: a plain decode worker beside it is never picked, however
 * idle, and with the plain one alone the answer names the missing prefill. */
Test(placement, a_request_served_whole_takes_a_colocated_worker_only, .timeout = 30)
{
    td_rpc_init();
    expect = td_kv_layout_make("m", 30, 3, 64, 16, TD_KV_F16);
    const rt_placement_ops_t *policies[] = {&rt_placement_least_loaded, &rt_placement_round_robin,
                                            &rt_placement_kv_cost, &rt_placement_predictive};
    for (size_t k = 0; k < sizeof policies / sizeof *policies; k++) {
        rt_table_t t;
        rt_table_init(&t, &expect, NULL);
        put_worker(&t, "d1", "decode", 16);
        put_worker_as(&t, "c1", "decode", 16, true);
        int32_t tok[40] = {0};
        const rt_place_req_t rq = {.tokens = tok, .n_tokens = 40, .max_tokens = 8, .tpot_slo_ms = 1e6};
        rt_placement_t held[6];
        for (int i = 0; i < 6; i++) { /* each kept: c1's load grows while d1 stays idle */
            rt_table_place(&t, policies[k], &rq, &held[i]);
            cr_assert_eq(held[i].code, TD_RPC_OK, "%s: %s", policies[k]->name, held[i].why);
            cr_assert(!held[i].prefill && !strcmp(held[i].decode->id, "c1"), "%s: placement %d took %s",
                      policies[k]->name, i, held[i].decode->id);
        }
        for (int i = 0; i < 6; i++)
            rt_table_done(&t, held[i].decode, NULL, 0);
        rt_table_remove(&t, "/tandem/workers/decode/c1");
        rt_placement_t pl;
        rt_table_place(&t, policies[k], &rq, &pl);
        cr_assert(pl.code == TD_RPC_UNAVAILABLE && strstr(pl.why, "no prefill worker"), "%s: %s", policies[k]->name,
                  pl.why);
    }
    td_rpc_shutdown();
}

/* Two workers for the tests below: a prefill worker of 1 + 0.5 ms a prompt
 * token (a budget of 512) and a colocated decode worker of 1 + 1 ms (a
 * budget of 64), a step of 2 + 1 ms a sequence, on the devices named; one
 * stream runs on the decode worker (*run, placed by least_loaded). */
static void two_workers(rt_table_t *t, const char *pdev, const char *ddev, rt_placement_t *run)
{
    rt_table_init(t, &expect, NULL);
    eng_profile_t pp = {.prefill = {1, 0.5, 0}, .decode = {2, 1, 0}}, dp = {.prefill = {1, 1, 0}, .decode = {2, 1, 0}};
    put_record(t, "p1", "prefill", &expect, json_pack("{s:o, s:i, s:s}", "profile", eng_profile_to_json(&pp),
                                                      "token_budget", 512, "devices", pdev));
    put_record(t, "c1", "decode", &expect, json_pack("{s:o, s:b, s:i, s:s}", "profile", eng_profile_to_json(&dp),
                                                     "colocated", 1, "token_budget", 64, "devices", ddev));
    static int32_t tok[16];
    const rt_place_req_t rq = {.tokens = tok, .n_tokens = 16, .max_tokens = 4};
    rt_table_place(t, &rt_placement_least_loaded, &rq, run);
    cr_assert(run->code == TD_RPC_OK && run->prefill && !strcmp(run->decode->id, "c1"), "%s", run->why);
    rt_table_prefill_done(t, run->prefill, &run->pred);
    rt_table_done(t, run->prefill, NULL, 0);
}

/* Ends a placement made by the tests below: its prefill, its stream. */
static void end_placed(rt_table_t *t, rt_placement_t *pl)
{
    rt_table_prefill_done(t, pl->prefill ? pl->prefill : pl->decode, &pl->pred);
    if (pl->prefill)
        rt_table_done(t, pl->prefill, NULL, 0);
    rt_table_done(t, pl->decode, NULL, 0);
}

/* A prefill worker that computes on a device the decode worker shares (the
 * devices of their records) stalls that worker's streams as a local prefill
 * does, a chunk of its token budget a step: the pair is priced so. A
 * 400-token prompt with a TPOT SLO of 50 ms (two_workers): on devices of
 * their own the pair (201 ms against 401 locally, no stall); on one device
 * the pair's 201 ms chunk would put the streams at 4 + 2 x 201 / 4 = 104.5
 * ms, a local 64-token chunk (65 ms) at 36.5: local. */
Test(placement, a_prefill_on_a_shared_device_is_priced_as_a_stall, .timeout = 30)
{
    td_rpc_init();
    expect = td_kv_layout_make("m", 30, 3, 64, 16, TD_KV_F16);
    const char *devs[][2] = {{"GPU-aa", "GPU-bb"}, {"GPU-aa,GPU-cc", "GPU-dd,GPU-aa"}};
    for (int shared = 0; shared < 2; shared++) {
        rt_table_t t;
        rt_placement_t run, pl;
        two_workers(&t, devs[shared][0], devs[shared][1], &run);
        static int32_t tok[400];
        const rt_place_req_t rq = {.tokens = tok, .n_tokens = 400, .max_tokens = 4, .tpot_slo_ms = 50};
        rt_table_place(&t, &rt_placement_predictive, &rq, &pl);
        cr_assert_eq(pl.code, TD_RPC_OK, "%s", pl.why);
        if (!shared)
            cr_assert(pl.prefill && !pl.pred.local && pl.pred.stall_ms == 0, "devices apart: the pair (local %d, "
                      "stall %.1f)", pl.pred.local, pl.pred.stall_ms);
        else
            cr_assert(!pl.prefill && pl.pred.local && fabs(pl.pred.stall_ms - 65) < 1e-6 &&
                      fabs(pl.pred.remote_ttft_ms - 201) < 1e-6, "one device: local (local %d, stall %.1f, the pair "
                      "%.1f ms)", pl.pred.local, pl.pred.stall_ms, pl.pred.remote_ttft_ms);
        end_placed(&t, &pl);
        json_t *m = rt_table_metrics(&t, &rt_placement_predictive);
        json_t *ws = json_object_get(m, "workers");
        cr_assert_str_eq(json_string_value(json_object_get(json_array_get(ws, 0), "devices")), devs[shared][0]);
        json_decref(m);
        rt_table_done(&t, run.decode, NULL, 0);
        rt_table_fini(&t);
    }
    td_rpc_shutdown();
}

/* The ops config's SLOs (rt_table_set_slo_aim) weigh a request that states
 * none as its own would, and refuse nothing; where no way keeps the SLOs,
 * the one past them least is taken. The shared-device case above, with no
 * SLO at all: the streams' step may grow a quarter (5 ms), which neither
 * keeps, the pair (104.5 ms) by more than local (36.5): local. With a TPOT
 * aim of 200 ms both keep it and the pair's first token is sooner (201
 * against 401 ms): the pair; with 50 ms only local keeps it: local. A TTFT
 * aim of 1 ms, which nothing keeps, places it all the same (the request's
 * own 1 ms is refused early). */
Test(placement, the_ops_slos_steer_placement_and_refuse_nothing, .timeout = 30)
{
    td_rpc_init();
    expect = td_kv_layout_make("m", 30, 3, 64, 16, TD_KV_F16);
    rt_table_t t;
    rt_placement_t run, pl;
    two_workers(&t, "GPU-aa", "GPU-aa", &run);
    static int32_t tok[400];
    rt_place_req_t rq = {.tokens = tok, .n_tokens = 400, .max_tokens = 4, .early_reject = true};
    const struct { uint32_t ttft, tpot; int want; const char *what; } cases[] = { /* want: 1 local, 0 the pair, -1 any */
        {0, 0, 1, "no SLO: local, past it least"},
        {0, 200, 0, "a TPOT aim both keep: the pair, its first token sooner"},
        {0, 50, 1, "a TPOT aim only local keeps: local"},
        {1, 0, -1, "a TTFT aim nothing keeps: placed all the same"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        rt_table_set_slo_aim(&t, cases[k].ttft, cases[k].tpot);
        rt_table_place(&t, &rt_placement_predictive, &rq, &pl);
        cr_assert(pl.code == TD_RPC_OK && (cases[k].want < 0 || (pl.pred.local == (cases[k].want == 1) &&
                                                                  !pl.prefill == (cases[k].want == 1))),
                  "%s (%s; local %d)", cases[k].what, pl.why, pl.pred.local);
        end_placed(&t, &pl);
        if (cases[k].tpot == 50) {
            json_t *m = rt_table_metrics(&t, &rt_placement_predictive);
            cr_assert_eq(json_integer_value(json_object_get(json_object_get(m, "slo_aim"), "tpot_ms")), 50);
            json_decref(m);
        }
    }
    rq.ttft_slo_ms = 1;
    rt_table_place(&t, &rt_placement_predictive, &rq, &pl);
    cr_assert(pl.code != TD_RPC_OK, "a request's own 1 ms TTFT SLO is refused early");
    rt_table_done(&t, run.decode, NULL, 0);
    rt_table_fini(&t);
    td_rpc_shutdown();
}

/* Conditional disaggregation (predictive only): a colocated decode worker
 * prefills a request itself when that keeps its SLOs with a sooner predicted
 * first token than the best pair. Profiles: prefill 1 + 1 ms a token on
 * both, a step of 2 + 1 ms a sequence. The decode worker, never measured
 * prefilling, is tried once while idle; its local first token (111 ms for
 * 100 tokens) refits its model; the pair then wins at 101 ms until its
 * measured overhead (30 ms) puts it at 131; a second local prefill while one
 * stream runs would stall it (a 64-token chunk, 65 ms, against a 4 ms step;
 * with 2 streams' prompts stalling a 4-token answer, a TPOT of 4 + 2 x 65 / 4
 * = 36.5 ms): the pair, unless a TPOT SLO leaves room (200 ms: local), never
 * when it does not (30 ms); least_loaded never prefills locally. */
Test(placement, conditional_disaggregation_prefills_locally_when_predicted_better, .timeout = 30)
{
    td_rpc_init();
    expect = td_kv_layout_make("m", 30, 3, 64, 16, TD_KV_F16);
    rt_table_t t;
    rt_table_init(&t, &expect, NULL);
    eng_profile_t prof = {.prefill = {1, 1, 0}, .decode = {2, 1, 0}};
    put_record(&t, "p1", "prefill", &expect, json_pack("{s:o}", "profile", eng_profile_to_json(&prof)));
    put_record(&t, "c1", "decode", &expect, json_pack("{s:o, s:b, s:i}", "profile", eng_profile_to_json(&prof),
                                                      "colocated", 1, "token_budget", 64));
    static int32_t tok[1000];
    rt_placement_t pl;
    rt_place_req_t rq = {.tokens = tok, .n_tokens = 100, .max_tokens = 4};
    rt_table_place(&t, &rt_placement_predictive, &rq, &pl); /* untried and idle: tried */
    cr_assert(pl.code == TD_RPC_OK && !pl.prefill && pl.pred.local && !strcmp(pl.decode->id, "c1"), "%s", pl.why);
    rt_table_prefill_done(&t, pl.decode, &pl.pred);
    rt_timings_t tm = {.ttft_ms = 111, .attempt_ttft_ms = 111, .prompt_tokens = 100, .output_tokens = 1, .ok = true,
                       .pred = pl.pred};
    rt_table_observe(&t, &rt_placement_predictive, NULL, pl.decode, &tm);
    rt_table_done(&t, pl.decode, NULL, 0);

    rt_table_place(&t, &rt_placement_predictive, &rq, &pl); /* local now over 101 (the refit), the pair 101 */
    cr_assert(pl.code == TD_RPC_OK && pl.prefill && !pl.pred.local, "%s", pl.why);
    rt_table_prefill_done(&t, pl.prefill, &pl.pred);
    tm = (rt_timings_t){.prefill_ms = 101, .ttft_ms = 131, .attempt_ttft_ms = 131, .prompt_tokens = 100,
                        .output_tokens = 1, .ok = true, .pred = pl.pred};
    rt_table_observe(&t, &rt_placement_predictive, pl.prefill, pl.decode, &tm);
    rt_table_done(&t, pl.prefill, NULL, 0);
    rt_table_done(&t, pl.decode, NULL, 0);

    rt_placement_t a, b;
    rt_table_place(&t, &rt_placement_predictive, &rq, &a); /* local ~107 against the pair's 131 */
    cr_assert(a.code == TD_RPC_OK && !a.prefill && !strcmp(a.decode->id, "c1") && a.pred.local, "%s", a.why);
    cr_assert(a.pred.ttft_ms > 103 && a.pred.ttft_ms < 115, "local at %.1f ms (a refit of one call and the profile)", a.pred.ttft_ms);
    cr_assert(fabs(a.pred.remote_ttft_ms - 131) < 3, "the pair at %.1f ms", a.pred.remote_ttft_ms);
    json_t *m = rt_table_metrics(&t, &rt_placement_predictive);
    cr_assert_eq(json_integer_value(json_object_get(json_object_get(m, "placed"), "local")), 2);
    json_decref(m);
    rt_table_place(&t, &rt_placement_predictive, &rq, &b); /* a is prefilling on c1: queued behind it, and stalling */
    cr_assert(b.code == TD_RPC_OK && b.prefill && !b.pred.local, "%s", b.why);
    rt_table_prefill_done(&t, b.prefill, &b.pred);
    rt_table_done(&t, b.prefill, NULL, 0);
    rt_table_done(&t, b.decode, NULL, 0);
    rt_table_prefill_done(&t, a.decode, &a.pred); /* a's first token; its stream runs on */

    rq.tpot_slo_ms = 200; /* a's stream may take the stall: local */
    rt_table_place(&t, &rt_placement_predictive, &rq, &pl);
    cr_assert(pl.code == TD_RPC_OK && pl.pred.local && pl.pred.stall_ms > 60, "%s (local %d, stall %.1f)", pl.why,
              pl.pred.local, pl.pred.stall_ms);
    rt_table_prefill_done(&t, pl.decode, &pl.pred);
    rt_table_done(&t, pl.decode, NULL, 0);
    rq.tpot_slo_ms = 30; /* it may not */
    rt_table_place(&t, &rt_placement_predictive, &rq, &pl);
    cr_assert(pl.code == TD_RPC_OK && pl.prefill && !pl.pred.local, "%s", pl.why);
    rt_table_prefill_done(&t, pl.prefill, &pl.pred);
    rt_table_done(&t, pl.prefill, NULL, 0);
    rt_table_done(&t, pl.decode, NULL, 0);
    rq.tpot_slo_ms = 0; /* no SLO: the streams' TPOT may grow a quarter at most (36.5 ms against 5) */
    rt_table_place(&t, &rt_placement_predictive, &rq, &pl);
    cr_assert(pl.code == TD_RPC_OK && pl.prefill && !pl.pred.local, "%s", pl.why);
    rt_table_prefill_done(&t, pl.prefill, &pl.pred);
    rt_table_done(&t, pl.prefill, NULL, 0);
    rt_table_done(&t, pl.decode, NULL, 0);
    rt_table_place(&t, &rt_placement_least_loaded, &rq, &pl);
    cr_assert(pl.code == TD_RPC_OK && pl.prefill && !pl.pred.local, "least_loaded pairs");
    rt_table_done(&t, pl.prefill, NULL, 0);
    rt_table_done(&t, pl.decode, NULL, 0);
    rt_table_done(&t, a.decode, NULL, 0);
    rt_table_fini(&t);
    td_rpc_shutdown();
}

static void put_sized(rt_table_t *t, const char *id, const char *role, int kv_blocks)
{
    put_record(t, id, role, &expect, json_pack("{s:i}", "kv_blocks", kv_blocks));
}

/* A prompt no decode worker's pool can hold is refused INVALID_ARGUMENT at
 * placement, naming the largest pool, by every policy; one a pool holds, or
 * any prompt while some decode worker has not said its pool's size, is placed. */
Test(placement, a_prompt_past_every_decode_pool_is_refused_naming_it, .timeout = 30)
{
    td_rpc_init();
    expect = td_kv_layout_make("m", 30, 3, 64, 16, TD_KV_F16);
    const rt_placement_ops_t *policies[] = {&rt_placement_least_loaded, &rt_placement_round_robin,
                                            &rt_placement_kv_cost, &rt_placement_predictive};
    static int32_t tok[4000];
    for (size_t k = 0; k < sizeof policies / sizeof *policies; k++) {
        rt_table_t t;
        rt_table_init(&t, &expect, NULL);
        put_sized(&t, "p1", "prefill", 4000);
        put_sized(&t, "d1", "decode", 100);
        put_sized(&t, "d2", "decode", 182);
        rt_placement_t pl;
        const rt_place_req_t big = {.tokens = tok, .n_tokens = 182 * 16 + 1, .max_tokens = 4};
        rt_table_place(&t, policies[k], &big, &pl);
        cr_assert(pl.code == TD_RPC_INVALID_ARGUMENT && !pl.decode && !pl.prefill &&
                      strstr(pl.why, "2913 tokens need 183 KV blocks") && strstr(pl.why, "pool has 182"),
                  "%s: %d %s", policies[k]->name, pl.code, pl.why);
        const rt_place_req_t fits = {.tokens = tok, .n_tokens = 182 * 16, .max_tokens = 4};
        rt_table_place(&t, policies[k], &fits, &pl);
        cr_assert(pl.code == TD_RPC_OK && pl.decode, "%s: %s", policies[k]->name, pl.why);
        rt_table_done(&t, pl.decode, NULL, 0);
        if (pl.prefill)
            rt_table_done(&t, pl.prefill, NULL, 0);
        put_worker(&t, "d3", "decode", 16); /* its record says no size: it may hold the prompt */
        rt_table_place(&t, policies[k], &big, &pl);
        cr_assert(pl.code != TD_RPC_INVALID_ARGUMENT, "%s: %s", policies[k]->name, pl.why);
        if (pl.decode)
            rt_table_done(&t, pl.decode, NULL, 0);
        if (pl.prefill)
            rt_table_done(&t, pl.prefill, NULL, 0);
        rt_table_fini(&t);
    }
    td_rpc_shutdown();
}

/* A prompt past the prefill workers' pools (their records' sizes) is not
 * sent to one to be refused there: a colocated decode worker whose pool holds
 * it prefills it itself; with none, it is refused INVALID_ARGUMENT naming
 * the largest prefill pool. A prompt a prefill pool holds goes to a pair. */
Test(placement, a_prompt_past_the_prefill_pools_is_prefilled_where_it_fits, .timeout = 30)
{
    td_rpc_init();
    expect = td_kv_layout_make("m", 30, 3, 64, 16, TD_KV_F16);
    static int32_t tok[400];
    const rt_placement_ops_t *policies[] = {&rt_placement_least_loaded, &rt_placement_predictive};
    for (size_t k = 0; k < 2; k++) {
        for (int colocated = 0; colocated < 2; colocated++) {
            rt_table_t t;
            rt_table_init(&t, &expect, NULL);
            put_sized(&t, "p1", "prefill", 10);
            put_record(&t, "d1", "decode", &expect, json_pack("{s:i, s:b}", "kv_blocks", 100, "colocated", colocated));
            rt_placement_t pl;
            const rt_place_req_t big = {.tokens = tok, .n_tokens = 300, .max_tokens = 4};
            rt_table_place(&t, policies[k], &big, &pl);
            if (colocated)
                cr_assert(pl.code == TD_RPC_OK && !pl.prefill && pl.decode && !strcmp(pl.decode->id, "d1"),
                          "%s: %d %s", policies[k]->name, pl.code, pl.why);
            else
                cr_assert(pl.code == TD_RPC_INVALID_ARGUMENT && !pl.decode &&
                              strstr(pl.why, "300 tokens need 19 KV blocks") && strstr(pl.why, "pool has 10"),
                          "%s: %d %s", policies[k]->name, pl.code, pl.why);
            if (pl.decode) {
                if (pl.pred.local)
                    rt_table_prefill_done(&t, pl.decode, &pl.pred);
                rt_table_done(&t, pl.decode, NULL, 0);
            }
            const rt_place_req_t small = {.tokens = tok, .n_tokens = 100, .max_tokens = 4};
            rt_table_place(&t, policies[k], &small, &pl);
            /* (predictive may prefill it on the colocated worker: conditional disaggregation) */
            cr_assert(pl.code == TD_RPC_OK && pl.decode && (pl.prefill || colocated), "%s: %s", policies[k]->name,
                      pl.why);
            if (pl.prefill) {
                rt_table_prefill_done(&t, pl.prefill, &pl.pred);
                rt_table_done(&t, pl.prefill, NULL, 0);
            } else if (pl.pred.local) {
                rt_table_prefill_done(&t, pl.decode, &pl.pred);
            }
            rt_table_done(&t, pl.decode, NULL, 0);
            rt_table_fini(&t);
        }
    }
    td_rpc_shutdown();
}

/* router.placement's names come from the policy table alone: once it has
 * registered them, an unknown name is refused listing every policy. */
Test(placement, the_config_takes_the_policy_tables_names, .timeout = 30)
{
    td_config_t cfg;
    cr_assert_eq(td_config_defaults(&cfg), TD_OK);
    rt_placement_register_names();
    cr_assert_eq(td_config_set(&cfg, "router.placement", "kv_cost"), TD_OK);
    cr_assert_eq(td_config_validate(&cfg), TD_OK);
    cr_assert_eq(td_config_set(&cfg, "router.placement", "fastest"), TD_OK);
    cr_assert_eq(td_config_validate(&cfg), TD_ERR_CONFIG);
    cr_assert(strstr(td_last_error(), "least_loaded, round_robin, kv_cost, predictive"), "%s", td_last_error());
    td_config_free(&cfg);
}

/* The planner's SLO window (router/stats.h): the requests that ended since
 * `since`, reaching back to `floor` at most until it holds min_n — an
 * overloaded prefill worker finishes few requests, and the planner must
 * still see how they fared. */
Test(stats, the_window_reaches_back_to_the_last_min_n, .timeout = 30)
{
    rt_stats_t *st;
    cr_assert_eq(rt_stats_create(&st), TD_OK);
    double t0 = td_now_s();
    for (int i = 0; i < 8; i++)
        rt_stats_done(st, i < 2 ? 5000 : 100, 10, true, 100 + i, i % 2 == 0); /* two missed a 2,500 ms TTFT SLO */
    td_sleep_s(0.2);
    rt_stats_done(st, 100, 10, true, 50, false);
    double since = td_now_s() - 0.1;
    rt_slo_window_t w;
    rt_stats_window(st, since, 2500, 30, &w);
    cr_assert_eq(w.n, 1, "the last 0.1 s: %u", w.n);
    rt_stats_window_n(st, since, t0 - 1, 8, 2500, 30, &w);
    cr_assert(w.n == 8 && w.ttft_missed == 1 && w.met == 7, "back to 8: %u requests, %u missed TTFT", w.n,
              w.ttft_missed);
    cr_assert(w.prompt_tokens == 50 + 101 + 102 + 103 + 104 + 105 + 106 + 107 && w.local_tokens == 102 + 104 + 106,
              "their prompt tokens, those prefilled by their decode workers: %llu, %llu",
              (unsigned long long)w.prompt_tokens, (unsigned long long)w.local_tokens);
    rt_stats_window_n(st, since, t0 - 1, 20, 2500, 30, &w);
    cr_assert(w.n == 9 && w.ttft_missed == 2, "all 9 since the floor: %u, %u missed", w.n, w.ttft_missed);
    rt_stats_window_n(st, since, since, 8, 2500, 30, &w);
    cr_assert_eq(w.n, 1, "not past the floor (the last change): %u", w.n);
    rt_stats_destroy(st);
}

/* What the planner's prediction reads of the table: a worker of each role's
 * rate by its profile (prefill 1 + 1 ms a token: 990 tokens a second in
 * calls of 99; a decode step of 2 + 1 ms a stream: 28 streams within a
 * 30 ms TPOT SLO, 933 tokens a second), a decode pool that holds fewer
 * streams capping its batch. */
Test(demand, capacity_from_the_profiles, .timeout = 30)
{
    td_rpc_init();
    expect = td_kv_layout_make("m", 30, 3, 64, 16, TD_KV_F16);
    rt_table_t t;
    rt_table_init(&t, &expect, NULL);
    put_profiled(&t, "p1", "prefill");
    put_profiled(&t, "p2", "prefill");
    put_profiled(&t, "d1", "decode");
    rt_capacity_t c;
    rt_table_capacity(&t, 99, 40, 30, &c);
    cr_assert(c.prefill == 2 && c.decode == 1, "%u prefill, %u decode workers", c.prefill, c.decode);
    cr_assert_float_eq(c.prefill_tok_s, 990, 1e-6, "%f", c.prefill_tok_s);
    cr_assert_float_eq(c.decode_tok_s, 28e3 / 30, 1e-6, "%f", c.decode_tok_s);
    rt_table_capacity(&t, 99, 40, 0, &c);
    cr_assert_float_eq(c.decode_tok_s, 512e3 / 514, 1e-6, "no SLO: the largest batch, %f", c.decode_tok_s);
    /* a pool of 10 blocks (160 tokens) holds 4 streams of 40: 4 a 6 ms step */
    eng_profile_t pf = {.prefill = {1, 1, 0}, .decode = {2, 1, 0}};
    put_record(&t, "d2", "decode", &expect,
               json_pack("{s:o, s:i}", "profile", eng_profile_to_json(&pf), "kv_blocks", 10));
    rt_table_capacity(&t, 99, 40, 30, &c);
    cr_assert(c.decode == 2, "%u decode workers", c.decode);
    cr_assert_float_eq(c.decode_tok_s, (28e3 / 30 + 4e3 / 6) / 2, 1e-6, "the two workers' mean: %f", c.decode_tok_s);
    for (size_t i = 0; i < t.n; i++) /* a loaded worker's call timed out: suspect, its speed the same */
        if (!strcmp(t.w[i]->id, "d2"))
            t.w[i]->suspect_until = td_now_s() + 100;
    rt_table_capacity(&t, 99, 40, 30, &c);
    cr_assert(c.decode == 2, "a suspect worker counts: %u decode workers", c.decode);
    rt_table_fini(&t);
}

/* The arrivals' window (router/stats.h): what was placed since `since`. */
Test(demand, the_arrivals_window, .timeout = 30)
{
    rt_stats_t *st;
    cr_assert_eq(rt_stats_create(&st), TD_OK);
    rt_stats_arrive(st, 500, false, 10, 505);
    td_sleep_s(0.2);
    double since = td_now_s();
    rt_stats_arrive(st, 100, false, 40, 120);
    rt_stats_arrive(st, 60, true, 20, 70);
    rt_arrivals_t a;
    rt_stats_arrivals(st, since, &a);
    cr_assert(a.n == 2 && a.new_tokens == 160 && a.local_tokens == 60 && a.out_tokens == 60 && a.ctx_tokens == 190,
              "%u arrivals: %f new, %f local, %f out, %f ctx", a.n, a.new_tokens, a.local_tokens, a.out_tokens,
              a.ctx_tokens);
    cr_assert(a.seconds >= 0 && a.seconds < 0.2, "the window is since `since`: %f s", a.seconds);
    rt_stats_arrivals(st, since - 1, &a);
    cr_assert(a.n == 3 && a.seconds >= 1, "%u arrivals in %f s", a.n, a.seconds);
    rt_stats_destroy(st);
}

/* The planner's predicted demand: a prompt-heavy load (1,980 prompt and 200
 * output tokens a second against 990 and 933 a worker) needs 2 prefill
 * workers: at 1P+2D it asks for a decode worker to become a prefill worker,
 * at 2P+1D for nothing, and it vetoes the move back the misses might ask for
 * (the single prefill worker would be twice over full); an output-heavy
 * load asks the reverse; a light one nothing; the bounds hold; prompts the
 * decode workers prefill count as their work; too few arrivals say nothing.
 * Each rule is seen to fail: the need's arithmetic checked by value. */
Test(demand, the_need_and_the_moves, .timeout = 30)
{
    rt_capacity_t c = {.prefill = 2, .decode = 1, .prefill_tok_s = 990, .decode_tok_s = 28e3 / 30};
    td_ops_model_t m = {.min_prefill = 1, .max_prefill = 3, .min_decode = 1, .max_decode = 3};
    rt_demand_t d;
    rt_arrivals_t prompts = {.n = 20, .seconds = 10, .new_tokens = 19800, .out_tokens = 2000};
    rt_demand_of(&prompts, &c, &d);
    cr_assert(d.known, "20 arrivals are enough");
    cr_assert_float_eq(d.prefill, 2.0, 1e-9, "%f prefill workers", d.prefill);
    cr_assert_float_eq(d.decode, 200 / (28e3 / 30), 1e-9, "%f decode workers", d.decode);
    cr_assert_eq(rt_demand_move(&d, 1, 2, &m), -1, "1P+2D: a decode worker to prefill");
    cr_assert_eq(rt_demand_move(&d, 2, 1, &m), 0, "2P+1D: balanced as it can be");
    cr_assert(rt_demand_vetoes(&d, +1, 2, 1), "2P+1D: back to one prefill worker would overload it");
    cr_assert(!rt_demand_vetoes(&d, -1, 1, 2), "1P+2D: a decode worker can go");
    td_ops_model_t capped = m;
    capped.max_prefill = 1;
    cr_assert_eq(rt_demand_move(&d, 1, 2, &capped), 0, "max_prefill 1: no move");

    rt_arrivals_t outputs = {.n = 20, .seconds = 10, .new_tokens = 2000, .out_tokens = 15000};
    rt_demand_of(&outputs, &c, &d);
    cr_assert_eq(rt_demand_move(&d, 2, 1, &m), +1, "2P+1D under outputs: a prefill worker to decode (%f, %f)",
                 d.prefill, d.decode);
    cr_assert_eq(rt_demand_move(&d, 1, 2, &m), 0, "1P+2D under outputs: stays");
    cr_assert(rt_demand_vetoes(&d, -1, 1, 2), "1P+2D under outputs: a decode worker cannot go");

    rt_arrivals_t light = {.n = 20, .seconds = 10, .new_tokens = 5000, .out_tokens = 1000};
    rt_demand_of(&light, &c, &d);
    cr_assert_eq(rt_demand_move(&d, 1, 2, &m), 0, "light: no move (%f, %f)", d.prefill, d.decode);

    rt_arrivals_t local = prompts;
    local.local_tokens = 9900;
    rt_demand_of(&local, &c, &d);
    cr_assert_float_eq(d.prefill, 1.0, 1e-9, "%f", d.prefill);
    cr_assert_float_eq(d.decode, 1.0 + 200 / (28e3 / 30), 1e-9, "local prefills are decode work: %f", d.decode);

    rt_arrivals_t few = prompts;
    few.n = RT_DEMAND_MIN_N - 1;
    rt_demand_of(&few, &c, &d);
    cr_assert(!d.known && !rt_demand_move(&d, 1, 2, &m) && !rt_demand_vetoes(&d, +1, 2, 1), "too few: nothing");
    rt_capacity_t blind = c;
    blind.decode_tok_s = 0;
    rt_demand_of(&prompts, &blind, &d);
    cr_assert(!d.known, "no decode profile: nothing");
}
