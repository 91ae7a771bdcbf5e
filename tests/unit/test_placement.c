/* test_placement.c — the router's worker table and least-loaded placement
 * (router/placement.h): workers join from their etcd records, a worker whose
 * call failed is skipped while suspect and chosen again after, a refused
 * (contract mismatch) or departed worker is never chosen, and load spreads. */
#include "tests/unit/helpers.h"

#include "common/clock.h"
#include "common/kv_contract.h"
#include "common/log.h"
#include "common/rpc.h"
#include "router/placement.h"

static td_kv_layout_t expect;

static void put_worker(rt_table_t *t, const char *id, const char *role, uint32_t block_tokens)
{
    td_kv_layout_t l = expect;
    l.block_tokens = block_tokens;
    json_t *j = json_pack("{s:s, s:s, s:s, s:i, s:o}", "id", id, "role", role, "addr", "127.0.0.1:9", "pid", 1,
                          "contract", td_kv_layout_to_json(&l));
    char *v = json_dumps(j, JSON_COMPACT), key[128];
    snprintf(key, sizeof key, "/tandem/workers/%s/%s", role, id);
    rt_table_put(t, key, v);
    free(v);
    json_decref(j);
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
