/* test_generate.c — the engine against llama.cpp on the default model, and
 * the invariances a serving engine must keep.
 *
 * fixtures/generate/greedy.jsonl (make_reference.py): 20 chat prompts with
 * llama.cpp's 64 greedy tokens and its top-2 logit gap at every step.
 * TANDEM_TEST_QUICK=1 (the sanitizer run) takes the first 4 prompts, 2 of
 * them where a test runs each several times, every other break of a resumed
 * stream and 2 perplexity chunks: the same code paths in half the time. */
#include "tests/unit/helpers.h"

#include <math.h>

#include "common/clock.h"
#include "common/log.h"
#include "engine/engine.h"
#include "engine/model.h"
#include "engine/tokenizer.h"

#define MAX_PROMPTS 20
#define N_GEN 64
#define NEAR_TIE 0.5 /* logits */

typedef struct ref {
    int32_t *ids, greedy[N_GEN];
    size_t n_ids;
    double gap[N_GEN];
} ref_t;

static ref_t refs[MAX_PROMPTS];
static size_t n_refs;
static eng_model_t *model;

static bool quick(void) { return getenv("TANDEM_TEST_QUICK") != NULL; }
/* Tokens a run() generates: fewer in the quick (sanitizer) pass, where each
 * step costs ~20 times more; the code paths are the same. */
static int n_gen(void) { return quick() ? 24 : N_GEN; }

static void load(void)
{
    require_default_model();
    cr_assert_eq(eng_model_open(DEFAULT_MODEL, &model), TD_OK);
    size_t len;
    char *data = read_file(FIXTURE("generate/greedy.jsonl"), &len);
    n_refs = 0;
    for (char *line = strtok(data, "\n"); line && n_refs < MAX_PROMPTS; line = strtok(NULL, "\n")) {
        json_t *row = json_loads(line, 0, NULL);
        ref_t *r = &refs[n_refs++];
        r->n_ids = json_ids(json_object_get(row, "ids"), &r->ids);
        for (int i = 0; i < N_GEN; i++) {
            r->greedy[i] = (int32_t)json_integer_value(json_array_get(json_object_get(row, "greedy"), i));
            r->gap[i] = json_real_value(json_array_get(json_object_get(row, "gap"), i));
        }
        json_decref(row);
    }
    free(data);
    if (quick())
        n_refs = 4;
}

static void unload(void)
{
    for (size_t i = 0; i < n_refs; i++)
        free(refs[i].ids);
    eng_model_close(model);
}

typedef struct collect {
    uint64_t first;
    int32_t out[64][N_GEN + 8];
    uint32_t n[64];
    uint32_t cached[64];
    eng_finish_t fin[64];
} collect_t;

static void on_ev(void *ctx, const eng_event_t *ev)
{
    collect_t *c = ctx;
    size_t i = ev->id - c->first;
    if (ev->token >= 0)
        c->out[i][c->n[i]++] = ev->token;
    c->cached[i] = ev->n_cached;
    if (ev->finish)
        c->fin[i] = ev->finish;
}

/* Runs prompts idx[0..k) together in one engine, greedy, EOS ignored. */
static void run(eng_engine_t *e, const size_t *idx, size_t k, collect_t *c)
{
    memset(c, 0, sizeof *c);
    for (size_t j = 0; j < k; j++) {
        eng_request_t r = {.prompt = refs[idx[j]].ids, .n_prompt = refs[idx[j]].n_ids,
                           .sampling = eng_sampling_default(), .max_tokens = (uint32_t)n_gen(), .ignore_eos = true};
        uint64_t id;
        cr_assert_eq(eng_engine_add(e, &r, &id), TD_OK, "%s", td_last_error());
        if (j == 0)
            c->first = id;
    }
    while (eng_engine_busy(e))
        cr_assert_eq(eng_engine_step(e, on_ev, c), TD_OK, "%s", td_last_error());
}

/* the KV dtype of engine_numerics' engines (a test that sets it runs in its own process) */
static td_kv_dtype_t kv_dtype = TD_KV_F16;
static double ppl_of(const char *numerics, const char *kv, int min_chunks, size_t *scored);

static eng_engine_t *engine_numerics(uint32_t budget, uint64_t kv_tokens, bool cache, kern_numerics_t numerics)
{
    eng_engine_config_t cfg = eng_engine_config_default();
    cfg.numerics = numerics;
    cfg.kv_dtype = kv_dtype;
    cfg.n_threads = 2;
    cfg.token_budget = budget;
    cfg.kv_tokens = kv_tokens;
    cfg.prefix_cache = cache;
    eng_engine_t *e;
    cr_assert_eq(eng_engine_create(model, &cfg, &e), TD_OK, "%s", td_last_error());
    return e;
}

static eng_engine_t *engine(uint32_t budget, uint64_t kv_tokens, bool cache)
{
    return engine_numerics(budget, kv_tokens, cache, KERN_NUMERICS_FAST);
}

/* An engine computing waiting prompts in the given order (engine/sched.h) */
static eng_engine_t *engine_order(uint32_t budget, uint64_t kv_tokens, eng_order_t order)
{
    eng_engine_config_t cfg = eng_engine_config_default();
    cfg.n_threads = 2;
    cfg.token_budget = budget;
    cfg.kv_tokens = kv_tokens;
    cfg.sched.order = order;
    cfg.sched.age_s = 0; /* no age bound: under the sanitizers on a loaded machine a step may take seconds */
    eng_engine_t *e;
    cr_assert_eq(eng_engine_create(model, &cfg, &e), TD_OK, "%s", td_last_error());
    return e;
}

/* Under the sanitizers the reference-numerics tests take most of 15 minutes on 2 busy cores. */
TestSuite(generate, .init = load, .fini = unload, .timeout = 1800);

/* Reference numerics (kernels/backend.h): llama.cpp's rounding, bit for bit,
 * so its greedy tokens. The issue asks for 90% of prompts identical and any
 * divergence at a near-tie (top-2 gap under 1e-3); bit-identical logits give
 * all 20. */
Test(generate, greedy_matches_llama_cpp_alone_and_batched)
{
    eng_engine_t *e = engine_numerics(512, 0, false, KERN_NUMERICS_REFERENCE);
    static collect_t alone[MAX_PROMPTS], batched;
    size_t same = 0;
    const size_t np = quick() ? 2 : n_refs; /* the sanitizer pass: 2 prompts alone, then both batched */
    for (size_t i = 0; i < np; i++) {
        run(e, &i, 1, &alone[i]);
        cr_assert_eq(alone[i].n[0], (uint32_t)n_gen());
        int d = -1;
        for (int t = 0; t < n_gen() && d < 0; t++)
            if (alone[i].out[0][t] != refs[i].greedy[t])
                d = t;
        if (d < 0) {
            same++;
        } else {
            fprintf(stderr, "prompt %zu parts from llama.cpp at token %d (tandem %d, llama.cpp %d); llama.cpp's "
                            "top-2 gap there: %.5f\n", i, d, alone[i].out[0][d], refs[i].greedy[d], refs[i].gap[d]);
        }
    }
    fprintf(stderr, "greedy, reference numerics: %zu of %zu prompts identical to llama.cpp for %d tokens\n", same,
            np, n_gen());
    cr_assert_geq(same * 10, np * 9, "at least 90%% of prompts identical");
    for (size_t i = 0; i < np; i++)
        for (int t = 0; t < n_gen(); t++)
            if (alone[i].out[0][t] != refs[i].greedy[t]) {
                cr_assert_lt(refs[i].gap[t], 1e-3, "prompt %zu token %d: llama.cpp was sure (gap %.4f)", i, t,
                             refs[i].gap[t]);
                break;
            }
    /* all prompts at once: each sequence's tokens are those it got alone */
    size_t idx[MAX_PROMPTS] = {0};
    for (size_t i = 0; i < np; i++)
        idx[i] = i;
    run(e, idx, np, &batched);
    for (size_t i = 0; i < np; i++)
        cr_assert(memcmp(batched.out[i], alone[i].out[0], (size_t)n_gen() * sizeof(int32_t)) == 0,
                  "prompt %zu batched with %zu others differs from alone", i, np - 1);
    eng_engine_destroy(e);
}

/* Chunked prefill, prefix-cache hits and preemption against one unchunked,
 * uncached run of the same prompts, in fast numerics and the KV dtype under
 * test. */
static void invariance(void)
{
    /* quick (the sanitizer pass): 2 prompts of ~40 tokens and 24 generated overfill a pool of 6 blocks, so
     * preemption still runs (4 prompts and 64 tokens overfill 10) */
    size_t k = n_refs < 4 ? n_refs : 4, idx[4] = {0, 1, 2, 3};
    if (quick())
        k = 2;
    const size_t ng = (size_t)n_gen();
    static collect_t base, chunked, cached, tight;
    eng_engine_t *e = engine(512, 0, false);
    run(e, idx, k, &base);
    eng_engine_destroy(e);
    e = engine(7, 0, false); /* prompts go in chunks of at most 7 tokens */
    run(e, idx, k, &chunked);
    eng_engine_destroy(e);
    e = engine(512, 0, true);
    run(e, idx, k, &cached);  /* fills the cache */
    run(e, idx, k, &cached);  /* the shared system prompt and whole prompts come from it */
    eng_engine_destroy(e);
    e = engine(512, quick() ? 96 : 160, true); /* 10 blocks for 4 sequences of ~100 tokens */
    run(e, idx, k, &tight);
    eng_engine_destroy(e);
    for (size_t i = 0; i < k; i++) {
        cr_assert(memcmp(chunked.out[i], base.out[i], ng * 4) == 0, "prompt %zu: chunked prefill differs", i);
        cr_assert(memcmp(cached.out[i], base.out[i], ng * 4) == 0, "prompt %zu: prefix-cache hit differs", i);
        cr_assert_gt(cached.cached[i], 0, "prompt %zu: the second run found its prefix cached", i);
        cr_assert(memcmp(tight.out[i], base.out[i], ng * 4) == 0, "prompt %zu: preemption differs", i);
        cr_assert_eq(tight.n[i], ng);
    }
}

/* The engine's paths in fast numerics: they are the same in both (the
 * numerics pick kernels, which test_kernels checks in both). Reference
 * numerics' chunking, prefix hits and preemption against cold output are the
 * cache-hits suite's reference rounds (a real cluster, budgets 64 and 512, a
 * decode pool that preempts); here they cost a minute of CI's 2 cores. */
Test(generate, chunked_prefill_prefix_cache_and_preemption_change_nothing)
{
    invariance();
}

/* An fp8_e4m3 KV cache (kv_contract.h: a scale per token and KV head): chunked prefill, prefix-cache hits and
 * preemption change no token of its output, as with fp16 (a token's bytes depend on its K and V alone); and its
 * quality against fp16 KV, stated: greedy agreement over 48 tokens on 10 prompts, perplexity on the fixed text. */
Test(generate, fp8_kv_cache_changes_nothing_but_its_rounding)
{
    kv_dtype = TD_KV_F8_E4M3;
    invariance();
    if (quick())
        return;
    enum { NP = 10, AGREE = 48 };
    size_t idx[NP];
    for (size_t i = 0; i < NP; i++)
        idx[i] = i;
    static collect_t f8, f16;
    eng_engine_t *e = engine(512, 0, false);
    run(e, idx, NP, &f8);
    eng_engine_destroy(e);
    kv_dtype = TD_KV_F16;
    e = engine(512, 0, false);
    run(e, idx, NP, &f16);
    eng_engine_destroy(e);
    size_t same = 0, agree = 0;
    for (size_t i = 0; i < NP; i++) {
        size_t t = 0;
        while (t < AGREE && f8.out[i][t] == f16.out[i][t])
            t++;
        same += t == AGREE;
        agree += t;
    }
    size_t n16 = 0, n8 = 0;
    double p16 = ppl_of("fast", "fp16", 2, &n16), p8 = ppl_of("fast", "fp8_e4m3", 2, &n8);
    fprintf(stderr, "fp8 KV vs fp16 KV: %zu of %d prompts identical over %d greedy tokens (%.1f tokens agree on "
                    "average); perplexity %.4f vs %.4f over %zu tokens (%+.2f%%)\n", same, NP, AGREE,
            (double)agree / NP, p8, p16, n8, (p8 / p16 - 1) * 100);
    cr_assert_eq(n8, n16);
    /* stated, not tuned: 2 of 10 identical, 23.9 tokens on average, +2.0% on this 135M model (head_dim 64; +1.6%
     * with the scale applied to the score instead of the row: 510 tokens' perplexity moves with such roundings);
     * the bounds catch a broken scale or layout (which parts at the first tokens, perplexity in the hundreds) */
    cr_assert_lt(fabs(p8 / p16 - 1), 0.05, "fp8 KV's perplexity within 5%% of fp16 KV's");
    cr_assert_geq(agree, (size_t)NP * 12, "on average the first 12 greedy tokens agree");
}

/* the order of requests' first tokens */
typedef struct order { uint64_t ids[8]; size_t n; } order_t;
static void on_first(void *ctx, const eng_event_t *ev)
{
    order_t *o = ctx;
    if (ev->token >= 0 && o->n < 8) {
        for (size_t i = 0; i < o->n; i++)
            if (o->ids[i] == ev->id)
                return;
        o->ids[o->n++] = ev->id;
    }
}

/* The cache and mlq orders (engine/sched.h) reorder prompts, defer one whose
 * prefix another is computing, and interleave chunks; none of it changes a
 * token: chunked by 7, a tight pool (preemption), the prompts twice (the
 * second time from the prefix cache), against fcfs with no cache. */
Test(generate, queue_orders_change_no_token)
{
    size_t k = quick() ? 2 : 4, idx[4] = {0, 1, 2, 3};
    const size_t ng = (size_t)n_gen();
    static collect_t base, got;
    eng_engine_t *e = engine(512, 0, false);
    run(e, idx, k, &base);
    eng_engine_destroy(e);
    for (eng_order_t o = ENG_ORDER_CACHE; o <= ENG_ORDER_MLQ; o++) {
        const uint32_t budgets[2] = {7, 512};
        for (int b = 0; b < 2; b++) {
            e = engine_order(budgets[b], quick() ? 96 : 160, o);
            for (int pass = 0; pass < 2; pass++) {
                run(e, idx, k, &got);
                for (size_t i = 0; i < k; i++)
                    cr_assert(memcmp(got.out[i], base.out[i], ng * 4) == 0 && got.n[i] == ng,
                              "order %s, budget %u, pass %d: prompt %zu differs from fcfs", eng_order_name(o),
                              budgets[b], pass, i);
            }
            eng_engine_destroy(e);
        }
    }
}

/* A pool too small for its sequences (preemption every few steps): with
 * swap on, the preempted sequences' KV goes to host memory and back instead
 * of being computed again — the same tokens, fewer prompt tokens computed. */
Test(generate, swap_instead_of_recompute_changes_no_token_and_computes_less)
{
    size_t k = quick() ? 2 : 4, idx[4] = {0, 1, 2, 3};
    const size_t ng = (size_t)n_gen();
    static collect_t base, got[3];
    eng_engine_t *e = engine(512, 0, false);
    run(e, idx, k, &base);
    eng_engine_destroy(e);
    uint64_t computed[3], preempted[3], out[3], in[3];
    /* off; a space for every preempted sequence; one of 3 MiB, about two short sequences' KV (the rest computed
     * again, regions freed and taken again) */
    for (int sw = 0; sw < 3; sw++) {
        eng_engine_config_t cfg = eng_engine_config_default();
        cfg.n_threads = 2;
        cfg.kv_tokens = quick() ? 96 : 160;
        cfg.swap_bytes = sw == 2 ? 3u << 20 : sw ? 64u << 20 : 0;
        cr_assert_eq(eng_engine_create(model, &cfg, &e), TD_OK, "%s", td_last_error());
        run(e, idx, k, &got[sw]);
        computed[sw] = eng_engine_prompt_computed(e);
        preempted[sw] = eng_engine_preemptions(e);
        eng_engine_swaps(e, &out[sw], &in[sw]);
        eng_engine_destroy(e);
        for (size_t i = 0; i < k; i++)
            cr_assert(memcmp(got[sw].out[i], base.out[i], ng * 4) == 0 && got[sw].n[i] == ng,
                      "swap %s: prompt %zu differs from an engine with room", sw == 2 ? "small" : sw ? "on" : "off",
                      i);
    }
    cr_assert(out[2] > 0 && in[2] == out[2], "a small swap space: %llu out, %llu back", (unsigned long long)out[2],
              (unsigned long long)in[2]);
    cr_assert(preempted[0] > 0 && out[0] == 0, "swap off: %llu preemptions, %llu swaps",
              (unsigned long long)preempted[0], (unsigned long long)out[0]);
    cr_assert(out[1] > 0 && in[1] == out[1], "swap on: %llu out, %llu back", (unsigned long long)out[1],
              (unsigned long long)in[1]);
    cr_assert_lt(computed[1], computed[0], "prompt tokens computed: %llu with swap, %llu without",
                 (unsigned long long)computed[1], (unsigned long long)computed[0]);
}

/* Six prompts of one 200-token prefix and their own questions, added at
 * once with a budget that holds two whole prompts: fcfs starts the second
 * (and a part of the third) beside the first, each computing the prefix
 * again; the cache order lets them wait one step for the first's blocks. */
Test(generate, cache_order_computes_a_shared_prefix_once)
{
    enum { N = 6 };
    static int32_t prompt[N][400];
    size_t n = 0, len[N];
    for (size_t r = 0; n < 200; r = (r + 1) % n_refs) /* the prefix: whole fixture prompts */
        for (size_t t = 0; t < refs[r].n_ids && n < 200; t++)
            prompt[0][n++] = refs[r].ids[t];
    size_t suffix = 0;
    for (size_t i = 0; i < N; i++) {
        const ref_t *q = &refs[(i + 1) % n_refs];
        memcpy(prompt[i], prompt[0], n * sizeof(int32_t));
        len[i] = n;
        for (size_t t = 0; t < q->n_ids && t < 30; t++)
            prompt[i][len[i]++] = q->ids[q->n_ids - 1 - t] ; /* the question: a fixture prompt backwards */
        prompt[i][len[i]++] = (int32_t)i + 100; /* distinct even where the questions repeat */
        suffix += len[i] - n;
    }
    uint64_t computed[2];
    static collect_t out[2];
    const eng_order_t orders[2] = {ENG_ORDER_FCFS, ENG_ORDER_CACHE};
    for (int o = 0; o < 2; o++) {
        eng_engine_t *e = engine_order(512, 0, orders[o]);
        memset(&out[o], 0, sizeof out[o]);
        for (size_t i = 0; i < N; i++) {
            eng_request_t r = {.prompt = prompt[i], .n_prompt = len[i], .sampling = eng_sampling_default(),
                               .max_tokens = 4, .ignore_eos = true};
            uint64_t id;
            cr_assert_eq(eng_engine_add(e, &r, &id), TD_OK, "%s", td_last_error());
            if (!i)
                out[o].first = id;
        }
        while (eng_engine_busy(e))
            cr_assert_eq(eng_engine_step(e, on_ev, &out[o]), TD_OK, "%s", td_last_error());
        computed[o] = eng_engine_prompt_computed(e);
        eng_engine_destroy(e);
    }
    for (size_t i = 0; i < N; i++)
        cr_assert(memcmp(out[0].out[i], out[1].out[i], 4 * sizeof(int32_t)) == 0, "prompt %zu differs", i);
    /* the cache order: the prefix once, each question, and the block each question's prompt shares
     * partly with the prefix (its full blocks only are cached) */
    cr_assert_leq(computed[1], n + suffix + N * 16, "cache order: %llu prompt tokens computed, prefix %zu + "
                  "questions %zu", (unsigned long long)computed[1], n, suffix);
    cr_assert_gt(computed[0], computed[1] + n, "fcfs %llu, cache %llu: fcfs computes the prefix at least twice more",
                 (unsigned long long)computed[0], (unsigned long long)computed[1]);
}

/* mlq: a short prompt that comes while a long one is under way is computed
 * first; fcfs finishes the long one before it. */
Test(generate, mlq_takes_a_short_prompt_before_a_long_one_under_way)
{
    if (quick()) /* a minute of the sanitizer pass: its queue's paths are queue_orders_change_no_token's too */
        cr_skip_test("the release run checks the order; the sanitizer pass runs mlq in queue_orders_change_no_token");
    static int32_t long_ids[600];
    size_t n = 0;
    for (size_t r = 0; n < 600; r = (r + 1) % n_refs)
        for (size_t t = 0; t < refs[r].n_ids && n < 600; t++)
            long_ids[n++] = refs[r].ids[t];
    const eng_order_t orders[2] = {ENG_ORDER_FCFS, ENG_ORDER_MLQ};
    for (int o = 0; o < 2; o++) {
        eng_engine_t *e = engine_order(64, 0, orders[o]);
        eng_request_t r = {.prompt = long_ids, .n_prompt = n, .sampling = eng_sampling_default(), .max_tokens = 2,
                           .ignore_eos = true};
        uint64_t id_long, id_short;
        cr_assert_eq(eng_engine_add(e, &r, &id_long), TD_OK, "%s", td_last_error());
        order_t first = {0};
        for (int i = 0; i < 3; i++) /* 192 of its 600 tokens computed */
            cr_assert_eq(eng_engine_step(e, on_first, &first), TD_OK, "%s", td_last_error());
        r.prompt = refs[0].ids;
        r.n_prompt = refs[0].n_ids;
        cr_assert_eq(eng_engine_add(e, &r, &id_short), TD_OK, "%s", td_last_error());
        int steps = 0, short_at = -1;
        while (eng_engine_busy(e)) {
            cr_assert_eq(eng_engine_step(e, on_first, &first), TD_OK, "%s", td_last_error());
            steps++;
            if (short_at < 0 && first.n && first.ids[first.n - 1] == id_short)
                short_at = steps;
        }
        cr_assert_eq(first.n, 2);
        if (orders[o] == ENG_ORDER_MLQ)
            cr_assert(first.ids[0] == id_short && short_at == 1, "mlq: the short prompt's first token came %s, at "
                      "step %d", first.ids[0] == id_short ? "first" : "second", short_at);
        else
            cr_assert(first.ids[0] == id_long && short_at >= 7, "fcfs: the short prompt's first token came %s, at "
                      "step %d", first.ids[0] == id_short ? "first" : "second", short_at);
        eng_engine_destroy(e);
    }
}

/* Long prompts that share prefixes in every way a cluster sees them — whole
 * blocks, a partial block, a multi-turn continuation that carries the first
 * turn's generated tokens, the same prompt again, two of them batched — run
 * hot (one engine, prefix cache on, prompts chunked by 64) and each cold
 * (a fresh engine, no cache): the tokens must be the same (DESIGN.md §1's
 * invariant). Under reference numerics a generated position rounds unlike a
 * prompt one, so the blocks holding generated tokens must not be reused as
 * a later prompt's prefix. */
#define LONG_GEN 16
#define LONG_DOC 700
typedef struct long_prompt {
    int32_t ids[LONG_DOC];
    size_t n;
} long_prompt_t;

static void long_run(eng_engine_t *e, long_prompt_t *const *p, size_t k, collect_t *c)
{
    memset(c, 0, sizeof *c);
    for (size_t j = 0; j < k; j++) {
        eng_request_t r = {.prompt = p[j]->ids, .n_prompt = p[j]->n, .sampling = eng_sampling_default(),
                           .max_tokens = LONG_GEN, .ignore_eos = true};
        uint64_t id;
        cr_assert_eq(eng_engine_add(e, &r, &id), TD_OK, "%s", td_last_error());
        if (j == 0)
            c->first = id;
    }
    while (eng_engine_busy(e))
        cr_assert_eq(eng_engine_step(e, on_ev, c), TD_OK, "%s", td_last_error());
}

static void long_prefix_sharing(kern_numerics_t nm)
{
    /* a document of real prompt tokens, the fixture prompts in a shuffled order */
    static int32_t doc[LONG_DOC];
    size_t nd = 0;
    uint32_t lcg = 12345;
    while (nd < LONG_DOC) {
        lcg = lcg * 1103515245u + 12345u;
        const ref_t *r = &refs[(lcg >> 16) % n_refs];
        for (size_t i = 0; i < r->n_ids && nd < LONG_DOC; i++)
            doc[nd++] = r->ids[i];
    }
    static long_prompt_t a, b, b2, c;
    a.n = 603;
    memcpy(a.ids, doc, a.n * 4);
    size_t shared = 556; /* 34 whole blocks and 12 tokens of the next */
    b.n = b2.n = shared + 37;
    memcpy(b.ids, doc, shared * 4);
    memcpy(b2.ids, doc, shared * 4);
    for (size_t i = 0; i < 37; i++) {
        b.ids[shared + i] = doc[LONG_DOC - 1 - i];
        b2.ids[shared + i] = doc[LONG_DOC - 100 - 2 * i];
    }
    /* c: the next turn of a — its prompt, its (cold) answer, a new question */
    static collect_t cold_a, cold, hot;
    eng_engine_t *e = engine_numerics(512, 0, false, nm);
    long_prompt_t *pa = &a;
    long_run(e, &pa, 1, &cold_a);
    eng_engine_destroy(e);
    c.n = a.n;
    memcpy(c.ids, a.ids, a.n * 4);
    memcpy(c.ids + c.n, cold_a.out[0], LONG_GEN * 4);
    c.n += LONG_GEN;
    memcpy(c.ids + c.n, doc + 250, 21 * 4);
    c.n += 21;
    long_prompt_t *all[] = {&a, &b, &b2, &c};
    int32_t want[4][LONG_GEN];
    memcpy(want[0], cold_a.out[0], sizeof want[0]);
    for (size_t i = 1; i < 4; i++) {
        e = engine_numerics(512, 0, false, nm);
        long_run(e, &all[i], 1, &cold);
        eng_engine_destroy(e);
        memcpy(want[i], cold.out[0], sizeof want[i]);
    }
    /* hot: a, then b (whole blocks + a partial one shared), then c (the next
     * turn), then a again beside b2 (batched, both from the cache) */
    e = engine_numerics(64, 0, true, nm);
    struct { long_prompt_t *p[2]; size_t k, want[2]; bool hit; } plan[] = {
        {{&a}, 1, {0}, false}, {{&b}, 1, {1}, true}, {{&c}, 1, {3}, true}, {{&a, &b2}, 2, {0, 2}, true}};
    uint32_t reused = 0;
    for (size_t s = 0; s < sizeof plan / sizeof plan[0]; s++) {
        long_run(e, plan[s].p, plan[s].k, &hot);
        for (size_t j = 0; j < plan[s].k; j++) {
            size_t w = plan[s].want[j];
            cr_assert(memcmp(hot.out[j], want[w], sizeof want[w]) == 0,
                      "%s numerics, step %zu: prompt %zu (%zu tokens, %u cached) differs from its cold run",
                      nm == KERN_NUMERICS_REFERENCE ? "reference" : "fast", s, w, all[w]->n, hot.cached[j]);
            if (plan[s].hit)
                cr_assert_gt(hot.cached[j], 0, "step %zu: prompt %zu found nothing cached", s, w);
            if (w == 3 && nm == KERN_NUMERICS_REFERENCE) /* the first turn's generated positions are not reused */
                cr_assert_leq(hot.cached[j], a.n / 16 * 16, "c reused %u tokens; a has %zu", hot.cached[j], a.n);
            if (w == 3 && nm == KERN_NUMERICS_FAST) /* here they are: every row rounds alike */
                cr_assert_gt(hot.cached[j], a.n, "c reused %u tokens; a has %zu", hot.cached[j], a.n);
            reused += hot.cached[j];
        }
    }
    fprintf(stderr, "long prompts, %s numerics: 5 hot runs of %zu-%zu tokens identical to cold, %u tokens reused\n",
            nm == KERN_NUMERICS_REFERENCE ? "reference" : "fast", b.n, c.n, reused);
    eng_engine_destroy(e);
}

Test(generate, long_prompts_sharing_prefixes_give_cold_tokens)
{
    if (quick()) { /* the sanitizer build: the invariance test covers these paths; 2 cores are busy enough */
        fprintf(stderr, "long prompts: skipped in the quick (sanitizer) pass\n");
        return;
    }
    long_prefix_sharing(KERN_NUMERICS_FAST); /* reference numerics: the cache-hits suite's reference rounds */
}

Test(generate, bad_requests_are_named_and_the_engine_goes_on)
{
    eng_engine_t *e = engine(512, 0, true);
    uint64_t id;
    static int32_t longp[9000];
    eng_request_t r = {.prompt = longp, .n_prompt = 9000, .sampling = eng_sampling_default(), .max_tokens = 8};
    cr_assert_eq(eng_engine_add(e, &r, &id), TD_ERR_INVALID_ARG);
    cr_assert(strstr(td_last_error(), "context"), "%s", td_last_error());
    r.prompt = refs[0].ids;
    r.n_prompt = refs[0].n_ids;
    r.max_tokens = 0;
    cr_assert_eq(eng_engine_add(e, &r, &id), TD_ERR_INVALID_ARG);
    cr_assert(strstr(td_last_error(), "max_tokens"));
    r.max_tokens = 8;
    r.sampling.temperature = -1;
    cr_assert_eq(eng_engine_add(e, &r, &id), TD_ERR_INVALID_ARG);
    cr_assert(strstr(td_last_error(), "temperature"));
    r.sampling = eng_sampling_default();
    r.sampling.top_p = 0;
    cr_assert_eq(eng_engine_add(e, &r, &id), TD_ERR_INVALID_ARG);
    cr_assert(strstr(td_last_error(), "top_p"));
    r.sampling.top_p = 1.5f;
    cr_assert_eq(eng_engine_add(e, &r, &id), TD_ERR_INVALID_ARG);
    r.sampling = eng_sampling_default();
    eng_logit_bias_t lb = {.token = 50000, .bias = 5};
    r.sampling.logit_bias = &lb;
    r.sampling.n_logit_bias = 1;
    cr_assert_eq(eng_engine_add(e, &r, &id), TD_ERR_INVALID_ARG);
    cr_assert(strstr(td_last_error(), "50000"), "%s", td_last_error());
    r.sampling = eng_sampling_default();
    int32_t bad_tok = 60000;
    eng_request_t r2 = r;
    r2.prompt = &bad_tok;
    r2.n_prompt = 1;
    cr_assert_eq(eng_engine_add(e, &r2, &id), TD_ERR_INVALID_ARG);
    cr_assert(strstr(td_last_error(), "60000"));
    /* still usable */
    static collect_t c;
    size_t i0 = 0;
    run(e, &i0, 1, &c);
    cr_assert_eq(c.n[0], (uint32_t)n_gen());
    eng_engine_destroy(e);
}

/* Priority: with a token budget of about one prompt a step, prompts added while
 * none has begun are computed higher priority first, equal ones in order; a
 * prompt already under way is not overtaken. The order of first tokens shows it. */

Test(generate, higher_priority_prompts_are_computed_first)
{
    eng_engine_t *e = engine((uint32_t)refs[2].n_ids, 0, false); /* the first step is prompt 2's alone */
    const int32_t prio[4] = {0, 0, 5, 1};
    uint64_t id[4];
    for (size_t i = 0; i < 4; i++) {
        eng_request_t r = {.prompt = refs[i].ids, .n_prompt = refs[i].n_ids, .sampling = eng_sampling_default(),
                           .max_tokens = 2, .ignore_eos = true, .priority = prio[i]};
        cr_assert_eq(eng_engine_add(e, &r, &id[i]), TD_OK, "%s", td_last_error());
    }
    order_t o = {0};
    cr_assert_eq(eng_engine_step(e, on_first, &o), TD_OK); /* prompt 2 (priority 5) begins */
    eng_request_t r = {.prompt = refs[4].ids, .n_prompt = refs[4].n_ids, .sampling = eng_sampling_default(),
                       .max_tokens = 2, .ignore_eos = true, .priority = 9};
    uint64_t late;
    cr_assert_eq(eng_engine_add(e, &r, &late), TD_OK, "%s", td_last_error());
    while (eng_engine_busy(e))
        cr_assert_eq(eng_engine_step(e, on_first, &o), TD_OK, "%s", td_last_error());
    const uint64_t want[5] = {id[2], late, id[3], id[0], id[1]};
    cr_assert_eq(o.n, 5);
    for (size_t i = 0; i < 5; i++)
        cr_assert_eq(o.ids[i], want[i], "first token %zu came from request %llu, not %llu", i,
                     (unsigned long long)o.ids[i], (unsigned long long)want[i]);
    eng_engine_destroy(e);
}

static collect_t sampled[3];
static void sample_once(int slot, uint64_t seed, float temp)
{
    eng_engine_t *e = engine(512, 0, true);
    eng_request_t r = {.prompt = refs[0].ids, .n_prompt = refs[0].n_ids, .sampling = eng_sampling_default(),
                       .max_tokens = 32, .ignore_eos = true};
    r.sampling.temperature = temp;
    r.sampling.top_p = 0.9f;
    r.sampling.top_k = 40;
    r.sampling.seed = seed;
    uint64_t id;
    memset(&sampled[slot], 0, sizeof sampled[slot]);
    cr_assert_eq(eng_engine_add(e, &r, &id), TD_OK);
    sampled[slot].first = id;
    while (eng_engine_busy(e))
        cr_assert_eq(eng_engine_step(e, on_ev, &sampled[slot]), TD_OK);
    eng_engine_destroy(e);
}

Test(generate, same_seed_same_tokens)
{
    sample_once(0, 42, 1.0f);
    sample_once(1, 42, 1.0f);
    sample_once(2, 43, 1.0f);
    cr_assert(memcmp(sampled[0].out[0], sampled[1].out[0], 32 * 4) == 0, "same seed, same tokens");
    cr_assert(memcmp(sampled[0].out[0], sampled[2].out[0], 32 * 4) != 0, "another seed, other tokens");
}

typedef struct text_collect {
    uint64_t id;
    char text[4096];
    size_t len;
    eng_finish_t fin;
    uint32_t n;
} text_collect_t;

static void on_text(void *ctx, const eng_event_t *ev)
{
    text_collect_t *c = ctx;
    if (ev->text_len && c->len + ev->text_len < sizeof c->text) {
        memcpy(c->text + c->len, ev->text, ev->text_len);
        c->len += ev->text_len;
        c->text[c->len] = '\0';
    }
    if (ev->token >= 0)
        c->n++;
    if (ev->finish)
        c->fin = ev->finish;
}

static void run_text(eng_engine_t *e, const char *stop, uint32_t max_tokens, text_collect_t *c)
{
    const char *stops[1] = {stop};
    eng_request_t r = {.prompt = refs[0].ids, .n_prompt = refs[0].n_ids, .sampling = eng_sampling_default(),
                       .max_tokens = max_tokens, .stop = stops, .n_stop = stop ? 1 : 0, .ignore_eos = true};
    memset(c, 0, sizeof *c);
    cr_assert_eq(eng_engine_add(e, &r, &c->id), TD_OK);
    while (eng_engine_busy(e))
        cr_assert_eq(eng_engine_step(e, on_text, c), TD_OK);
}

Test(generate, stop_strings_and_max_tokens)
{
    eng_engine_t *e = engine(512, 0, true);
    static text_collect_t full, stopped;
    run_text(e, NULL, 48, &full);
    cr_assert_eq(full.fin, ENG_FINISH_LENGTH);
    cr_assert_eq(full.n, 48);
    cr_assert_gt(full.len, 40, "text: %s", full.text);
    /* a stop string taken from the middle of that text ends it there */
    size_t at = full.len / 2;
    while (at < full.len && ((unsigned char)full.text[at] & 0xc0) == 0x80)
        at++;
    char stop[8];
    snprintf(stop, sizeof stop, "%.4s", full.text + at);
    size_t first = (size_t)(strstr(full.text, stop) - full.text);
    run_text(e, stop, 48, &stopped);
    cr_assert_eq(stopped.fin, ENG_FINISH_STOP, "stop '%s' in '%s'", stop, full.text);
    cr_assert_eq(stopped.len, first, "the text ends where the stop string begins");
    cr_assert(memcmp(stopped.text, full.text, first) == 0);
    eng_engine_destroy(e);
}

/* vLLM's stop_token_ids and min_tokens: a token of the greedy output named a
 * stop token ends it there (its text kept); with min_tokens past it, it is
 * held back there and the output goes on; the model's end token, forced by a
 * logit bias, is held back for min_tokens tokens and comes right after;
 * min_tokens over max_tokens is refused. */
typedef struct tok_collect {
    int32_t tok[64];
    uint32_t n;
    eng_finish_t fin;
} tok_collect_t;

static void on_tok(void *ctx, const eng_event_t *ev)
{
    tok_collect_t *c = ctx;
    if (ev->token >= 0 && c->n < 64)
        c->tok[c->n++] = ev->token;
    if (ev->finish)
        c->fin = ev->finish;
}

static void run_toks(eng_engine_t *e, eng_sampling_t sp, bool ignore_eos, tok_collect_t *c)
{
    eng_request_t r = {.prompt = refs[0].ids, .n_prompt = refs[0].n_ids, .sampling = sp, .max_tokens = 40,
                       .ignore_eos = ignore_eos};
    memset(c, 0, sizeof *c);
    uint64_t id;
    cr_assert_eq(eng_engine_add(e, &r, &id), TD_OK, "%s", td_last_error());
    while (eng_engine_busy(e))
        cr_assert_eq(eng_engine_step(e, on_tok, c), TD_OK);
}

Test(generate, stop_token_ids_and_min_tokens)
{
    eng_engine_t *e = engine(512, 0, true);
    static tok_collect_t full, stopped, held, eos;
    run_toks(e, eng_sampling_default(), true, &full);
    cr_assert_eq(full.n, 40);
    uint32_t i = 3; /* a token that does not occur before */
    for (bool seen = true; seen && i < 40; i += seen) {
        seen = false;
        for (uint32_t k = 0; k < i; k++)
            seen |= full.tok[k] == full.tok[i];
    }
    cr_assert_lt(i, 40);
    eng_sampling_t sp = eng_sampling_default();
    sp.stop_ids = &full.tok[i];
    sp.n_stop_ids = 1;
    run_toks(e, sp, true, &stopped);
    cr_assert_eq(stopped.fin, ENG_FINISH_STOP);
    cr_assert_eq(stopped.n, i + 1, "stopped after %u tokens, token %u is the stop token", stopped.n, i);
    cr_assert(!memcmp(stopped.tok, full.tok, (i + 1) * sizeof *full.tok));
    sp.min_tokens = i + 2;
    run_toks(e, sp, true, &held);
    cr_assert(!memcmp(held.tok, full.tok, i * sizeof *full.tok));
    cr_assert_neq(held.tok[i], full.tok[i], "min_tokens holds the stop token back");
    cr_assert_geq(held.n, i + 2);
    /* the end token, made certain by a bias, comes as soon as min_tokens lets it */
    eng_logit_bias_t bias = {model->desc.eos, 100.0f};
    eng_sampling_t eb = eng_sampling_default();
    eb.logit_bias = &bias;
    eb.n_logit_bias = 1;
    eb.min_tokens = 5;
    run_toks(e, eb, false, &eos);
    cr_assert_eq(eos.fin, ENG_FINISH_EOS);
    cr_assert_eq(eos.n, 6, "%u tokens", eos.n);
    eng_request_t bad = {.prompt = refs[0].ids, .n_prompt = refs[0].n_ids, .sampling = eng_sampling_default(),
                         .max_tokens = 4};
    bad.sampling.min_tokens = 5;
    uint64_t id;
    cr_assert_eq(eng_engine_add(e, &bad, &id), TD_ERR_INVALID_ARG);
    cr_assert(strstr(td_last_error(), "min_tokens"), "%s", td_last_error());
    eng_engine_destroy(e);
}

#include "engine/forward.h"

/* Log-probabilities: each generated token's, as the engine reports it, is
 * its row's log-softmax from a forward pass over the whole sequence
 * (eng_logsumexp: the one definition, which the perplexity check holds to
 * llama.cpp's); the top ones are sorted and the greedy token is the first. */
typedef struct lp_collect {
    int32_t tok[16];
    eng_logprobs_t lp[16];
    uint32_t n, with_lp;
} lp_collect_t;

static void on_lp(void *ctx, const eng_event_t *ev)
{
    lp_collect_t *c = ctx;
    if (ev->token >= 0 && c->n < 16) {
        c->with_lp += ev->logprobs != NULL;
        if (ev->logprobs)
            c->lp[c->n] = *ev->logprobs;
        c->tok[c->n++] = ev->token;
    }
}

Test(generate, logprobs_are_the_models_log_softmax)
{
    eng_engine_t *e = engine(512, 0, true);
    static lp_collect_t c;
    eng_request_t r = {.prompt = refs[0].ids, .n_prompt = refs[0].n_ids, .sampling = eng_sampling_default(),
                       .max_tokens = 12, .ignore_eos = true};
    r.sampling.logprobs = true;
    r.sampling.top_logprobs = 5;
    uint64_t id;
    cr_assert_eq(eng_engine_add(e, &r, &id), TD_OK);
    while (eng_engine_busy(e))
        cr_assert_eq(eng_engine_step(e, on_lp, &c), TD_OK);
    eng_engine_destroy(e);
    cr_assert_eq(c.n, 12);
    cr_assert_eq(c.with_lp, 12);
    /* the same sequence through the forward pass, every row's logits */
    const uint32_t n = (uint32_t)refs[0].n_ids + 12, V = model->desc.vocab;
    int32_t *seq = malloc(n * sizeof *seq);
    memcpy(seq, refs[0].ids, refs[0].n_ids * sizeof *seq);
    memcpy(seq + refs[0].n_ids, c.tok, 12 * sizeof *seq);
    kern_backend_t *be;
    cr_assert_eq(kern_cpu_backend_create(2, &be), TD_OK);
    td_kv_layout_t g = td_kv_layout_make(model->kv_id, model->desc.n_layers, model->desc.n_kv_heads,
                                         model->desc.head_dim, 16, TD_KV_F16);
    eng_kv_pool_t *pool;
    uint32_t nb = (n + 15) / 16;
    cr_assert_eq(eng_kv_pool_create(be, &g, nb, NULL, &pool), TD_OK);
    eng_forward_t *f;
    cr_assert_eq(eng_forward_create(model, be, pool, n, n, &f), TD_OK, "%s", td_last_error());
    int32_t table[64];
    for (uint32_t i = 0; i < nb; i++)
        table[i] = (int32_t)i;
    eng_batch_seq_t s = {.tokens = seq, .n = n, .pos0 = 0, .block_table = table, .n_blocks = nb, .all_logits = true};
    const float *lg;
    uint32_t nl;
    cr_assert_eq(eng_forward_run(f, &s, 1, &lg, &nl), TD_OK, "%s", td_last_error());
    double worst = 0;
    for (uint32_t k = 0; k < 12; k++) {
        const float *row = lg + (size_t)(refs[0].n_ids - 1 + k) * V;
        const double want = row[c.tok[k]] - eng_logsumexp(row, (int32_t)V);
        worst = fmax(worst, fabs(c.lp[k].logprob - want));
        cr_assert_eq(c.lp[k].n_top, 5);
        cr_assert_eq(c.lp[k].top_ids[0], c.tok[k], "greedy: the token is the most likely");
        for (int i = 1; i < 5; i++)
            cr_assert_geq(c.lp[k].top[i - 1], c.lp[k].top[i]);
    }
    fprintf(stderr, "logprobs vs the whole sequence's log-softmax: worst difference %.2e\n", worst);
    cr_assert_lt(worst, 1e-5);
    eng_forward_destroy(f);
    eng_kv_pool_destroy(pool);
    kern_cpu_backend_destroy(be);
    free(seq);
}

/* Prompt log-probabilities (what echo and lm-evaluation-harness's
 * log-likelihoods read): a 512-token chunk of the perplexity text scored with
 * max_tokens 0 under reference numerics sums to llama.cpp's NLL of that chunk
 * (fixtures/generate/perplexity.json: positions 256..510, llama-cpp-python's
 * log-softmax), its rows computed 64 a step (the logits' room), not from the
 * prefix cache; one event, no token. With max_tokens 3 the first event
 * carries the same values and the tokens follow. */
typedef struct plp_collect {
    eng_logprobs_t *plp;
    uint32_t n_plp, events, tokens;
    eng_finish_t fin;
} plp_collect_t;

static void on_plp(void *ctx, const eng_event_t *ev)
{
    plp_collect_t *c = ctx;
    c->events++;
    c->tokens += ev->token >= 0;
    if (ev->prompt_logprobs) {
        c->n_plp = ev->n_prompt_logprobs;
        c->plp = malloc(c->n_plp * sizeof *c->plp);
        memcpy(c->plp, ev->prompt_logprobs, c->n_plp * sizeof *c->plp);
    }
    if (ev->finish)
        c->fin = ev->finish;
}

static void score(eng_engine_t *e, const int32_t *ids, uint32_t n, uint32_t max_tokens, plp_collect_t *c)
{
    eng_request_t r = {.prompt = ids, .n_prompt = n, .sampling = eng_sampling_default(), .max_tokens = max_tokens,
                       .ignore_eos = true};
    r.sampling.prompt_logprobs = true;
    r.sampling.top_logprobs = 2;
    memset(c, 0, sizeof *c);
    uint64_t id;
    cr_assert_eq(eng_engine_add(e, &r, &id), TD_OK, "%s", td_last_error());
    while (eng_engine_busy(e))
        cr_assert_eq(eng_engine_step(e, on_plp, c), TD_OK);
}

Test(generate, prompt_logprobs_sum_to_llama_cpp_nll)
{
    json_error_t err;
    json_t *ref = json_load_file(FIXTURE("generate/perplexity.json"), 0, &err);
    cr_assert(ref, "%s", err.text);
    size_t len1, len2;
    char *t1 = read_file("/usr/share/common-licenses/GPL-3", &len1), *t2 = read_file("/usr/share/common-licenses/Apache-2.0", &len2);
    char *text = malloc(len1 + len2);
    memcpy(text, t1, len1), memcpy(text + len1, t2, len2);
    int32_t *ids = NULL;
    size_t cap = 0, n = 0;
    cr_assert_eq(eng_tokenizer_encode(model->tok, text, len1 + len2, 0, &ids, &cap, &n), TD_OK);
    cr_assert_eq(n, (size_t)json_integer_value(json_object_get(ref, "tokens")));
    /* the sanitizer pass (quick) scores with fast numerics, within the perplexity check's 1% for them */
    eng_engine_t *e = engine_numerics(512, 1024, true, quick() ? KERN_NUMERICS_FAST : KERN_NUMERICS_REFERENCE);
    static plp_collect_t c, g;
    score(e, ids, 512, 0, &c); /* chunk 0 */
    cr_assert_eq(c.events, 1);
    cr_assert_eq(c.tokens, 0);
    cr_assert_eq(c.fin, ENG_FINISH_LENGTH);
    cr_assert_eq(c.n_plp, 511);
    double nll = 0;
    for (uint32_t i = 256; i < 511; i++) {
        nll -= c.plp[i].logprob;
        cr_assert_eq(c.plp[i].n_top, 2);
        cr_assert_geq(c.plp[i].top[0], c.plp[i].logprob);
    }
    double want = json_number_value(json_array_get(json_object_get(ref, "chunk_nll"), 0));
    fprintf(stderr, "prompt logprobs: chunk 0's NLL %.6f, llama.cpp's %.6f (relative %.1e)\n", nll, want,
            fabs(nll - want) / want);
    cr_assert_lt(fabs(nll - want) / want, quick() ? 1e-2 : 1e-3);
    /* with tokens to generate: the same prompt values on the first event, then the tokens */
    score(e, ids, 100, 3, &g);
    cr_assert_eq(g.tokens, 3);
    cr_assert_eq(g.n_plp, 99);
    for (uint32_t i = 0; i < 99; i++)
        cr_assert_float_eq(g.plp[i].logprob, c.plp[i].logprob, 1e-6, "token %u", i + 1);
    eng_engine_destroy(e);
    free(c.plp), free(g.plp), free(ids), free(text), free(t1), free(t2);
    json_decref(ref);
}

/* A stream broken after k tokens and resumed elsewhere (the router re-prefills
 * prompt + those k tokens): with resume_generated / resume_text_sent the
 * resumed sequence delivers exactly the rest of the text — what was held back
 * for the stop-string window included — and finds a stop string that spans
 * the break, for every k. */
typedef struct resume_collect {
    int32_t tok[64];
    size_t sent_after[64]; /* bytes delivered after each token */
    uint32_t n;
    char text[4096];
    size_t len;
    eng_finish_t fin;
} resume_collect_t;

static void on_resume(void *ctx, const eng_event_t *ev)
{
    resume_collect_t *c = ctx;
    if (ev->text_len && c->len + ev->text_len < sizeof c->text) {
        memcpy(c->text + c->len, ev->text, ev->text_len);
        c->len += ev->text_len;
    }
    if (ev->token >= 0 && c->n < 64) {
        c->tok[c->n] = ev->token;
        c->sent_after[c->n++] = c->len;
    }
    if (ev->finish)
        c->fin = ev->finish;
}

Test(generate, a_resumed_stream_delivers_the_rest_and_finds_stop_strings_across_the_break)
{
    eng_engine_t *e = engine(512, 0, false);
    static text_collect_t full;
    run_text(e, NULL, 48, &full);
    /* a stop string of 6 bytes from the middle: the window holds back 5 */
    size_t at = full.len / 2;
    while (at < full.len && ((unsigned char)full.text[at] & 0xc0) == 0x80)
        at++;
    char stop[16];
    snprintf(stop, sizeof stop, "%.6s", full.text + at);
    const char *stops[1] = {stop};
    static resume_collect_t orig, res;
    memset(&orig, 0, sizeof orig);
    eng_request_t r = {.prompt = refs[0].ids, .n_prompt = refs[0].n_ids, .sampling = eng_sampling_default(),
                       .max_tokens = 48, .stop = stops, .n_stop = 1, .ignore_eos = true};
    uint64_t id;
    cr_assert_eq(eng_engine_add(e, &r, &id), TD_OK);
    while (eng_engine_busy(e))
        cr_assert_eq(eng_engine_step(e, on_resume, &orig), TD_OK);
    cr_assert_eq(orig.fin, ENG_FINISH_STOP, "stop '%s' in '%s'", stop, full.text);
    int32_t *prompt = malloc((refs[0].n_ids + 64) * sizeof *prompt);
    memcpy(prompt, refs[0].ids, refs[0].n_ids * sizeof *prompt);
    int held = 0;
    /* the break after token k; the sanitizer pass (quick) takes every other one */
    for (uint32_t k = 1; k < orig.n; k += quick() ? 2 : 1) {
        memcpy(prompt + refs[0].n_ids, orig.tok, k * sizeof *prompt);
        memset(&res, 0, sizeof res);
        eng_request_t rr = {.prompt = prompt, .n_prompt = refs[0].n_ids + k, .sampling = eng_sampling_default(),
                            .max_tokens = 48 - k, .stop = stops, .n_stop = 1, .ignore_eos = true,
                            .resume_generated = k, .resume_text_sent = orig.sent_after[k - 1]};
        cr_assert_eq(eng_engine_add(e, &rr, &id), TD_OK, "%s", td_last_error());
        while (eng_engine_busy(e))
            cr_assert_eq(eng_engine_step(e, on_resume, &res), TD_OK);
        cr_assert_eq(res.fin, ENG_FINISH_STOP, "break after %u: finish %d", k, res.fin);
        cr_assert_eq(orig.sent_after[k - 1] + res.len, orig.len, "break after %u: %zu + %zu bytes, want %zu", k,
                     orig.sent_after[k - 1], res.len, orig.len);
        cr_assert(!memcmp(res.text, orig.text + orig.sent_after[k - 1], res.len), "break after %u: text differs", k);
        held += orig.sent_after[k - 1] < orig.len && res.len > 0;
    }
    cr_assert_gt(held, 0, "some breaks fall where text was held back");
    free(prompt);
    eng_engine_destroy(e);
}

/* tandem perplexity's value on the first chunks of the licence texts */
static double ppl_of(const char *numerics, const char *kv, int min_chunks, size_t *scored)
{
    char cmd[2048];
    const char *tmp = "/tmp/tandem-ppl.txt";
    snprintf(cmd, sizeof cmd, "cat /usr/share/common-licenses/GPL-3 /usr/share/common-licenses/Apache-2.0 > %s", tmp);
    cr_assert_eq(system(cmd), 0, "needs Debian's base-files licence texts");
    snprintf(cmd, sizeof cmd, "head -c %d %s > %s.cut && timeout 600 %s/tandem perplexity %s.cut --model %s --threads 2 "
             "--numerics %s --kv-dtype %s 2>/dev/null", min_chunks * 2500, tmp, tmp, TANDEM_BIN_DIR, tmp,
             DEFAULT_MODEL, numerics, kv);
    FILE *p = popen(cmd, "r");
    char line[512] = "";
    cr_assert(fgets(line, sizeof line, p), "tandem perplexity printed nothing");
    pclose(p);
    double ppl = 0;
    cr_assert_eq(sscanf(line, "perplexity %lf over %zu", &ppl, scored), 2, "%s", line);
    return ppl;
}

static void perplexity(const char *numerics, double bound, int min_chunks)
{
    json_error_t err;
    json_t *ref = json_load_file(FIXTURE("generate/perplexity.json"), 0, &err);
    cr_assert(ref, "%s", err.text);
    /* the first min_chunks chunks of the fixture's 19 (the whole text took 2.5 minutes of CI in both numerics),
     * against the reference's NLL of those chunks */
    size_t scored = 0;
    double ppl = ppl_of(numerics, "fp16", min_chunks, &scored), s = 0;
    int chunks = (int)(scored / 255);
    cr_assert(chunks >= min_chunks && chunks <= (int)json_integer_value(json_object_get(ref, "chunks")) &&
                  scored == (size_t)chunks * 255, "scored %zu tokens", scored);
    for (int c = 0; c < chunks; c++)
        s += json_real_value(json_array_get(json_object_get(ref, "chunk_nll"), (size_t)c));
    double want = exp(s / (double)scored);
    fprintf(stderr, "perplexity, %s numerics: tandem %.6f, llama.cpp %.6f over %zu tokens (%+.5f%%)\n", numerics, ppl,
            want, scored, (ppl / want - 1) * 100);
    cr_assert(fabs(ppl / want - 1) < bound, "perplexity %.6f vs llama.cpp %.6f", ppl, want);
    json_decref(ref);
}

Test(generate, perplexity_within_one_percent_of_llama_cpp)
{
    /* the sanitizer pass: a scoring pass's memory is prompt_logprobs_sum_to_llama_cpp_nll's, and 2 chunks of 512
     * rows took a minute of its 2 cores */
    if (quick())
        cr_skip_test("the release run checks perplexity; the sanitizer pass checks the scoring path's memory in "
                     "prompt_logprobs_sum_to_llama_cpp_nll");
    perplexity("fast", 0.01, 6);
    perplexity("reference", 1e-6, 2); /* the same logits; only the NLL sums' order differs */
}

/* tiny-llama3's logits (the fixture's ids, every row) from dir with its matrices held as `hold` says; the worst
 * row's relative error against ref's rows */
static double tiny_logits(const char *dir, eng_weight_hold_t hold, json_t *ref, float **out)
{
    eng_model_t *m;
    cr_assert_eq(eng_model_open(dir, &m), TD_OK, "%s", td_last_error());
    eng_model_set_hold(m, hold);
    int32_t *ids;
    size_t n = json_ids(json_object_get(ref, "ids"), &ids);
    size_t first = (size_t)json_integer_value(json_object_get(ref, "first_row"));
    kern_backend_t *be;
    cr_assert_eq(kern_cpu_backend_create(2, &be), TD_OK);
    td_kv_layout_t g = td_kv_layout_make(m->kv_id, m->desc.n_layers, m->desc.n_kv_heads, m->desc.head_dim, 16, TD_KV_F32);
    eng_kv_pool_t *pool;
    cr_assert_eq(eng_kv_pool_create(be, &g, 4, NULL, &pool), TD_OK);
    eng_forward_t *f;
    cr_assert_eq(eng_forward_create(m, be, pool, 64, 64, &f), TD_OK, "%s", td_last_error());
    int32_t table[4] = {2, 0, 3, 1};
    eng_batch_seq_t s = {.tokens = ids, .n = (uint32_t)n, .pos0 = 0, .block_table = table, .n_blocks = 4,
                         .all_logits = true};
    const float *lg;
    uint32_t nl;
    cr_assert_eq(eng_forward_run(f, &s, 1, &lg, &nl), TD_OK, "%s", td_last_error());
    cr_assert_eq(nl, n);
    double worst = 0;
    json_t *rows = json_object_get(ref, "logits");
    for (size_t r = 0; r < json_array_size(rows); r++) {
        json_t *row = json_array_get(rows, r);
        const float *ours = lg + (first + r) * m->desc.vocab;
        double d = 0, q = 0;
        for (size_t v = 0; v < json_array_size(row); v++) {
            double want = json_real_value(json_array_get(row, v));
            d += (ours[v] - want) * (ours[v] - want);
            q += want * want;
        }
        worst = fmax(worst, sqrt(d / q));
    }
    *out = malloc(n * m->desc.vocab * sizeof **out);
    memcpy(*out, lg, n * m->desc.vocab * sizeof **out);
    eng_forward_destroy(f);
    eng_kv_pool_destroy(pool);
    kern_cpu_backend_destroy(be);
    eng_model_close(m);
    free(ids);
    return worst;
}

/* The forward pass against Hugging Face transformers: a tiny random Llama
 * (GQA, 2 layers, Llama 3 rope scaling, tied embeddings; BF16/F16/F32 tensors)
 * whose fp32 logits transformers computed on the GPU machine
 * (fixtures/hf/make_logits_hf.py). F16/BF16 weights meet fp32 activations here
 * and the KV pool is fp32, so the bound is fp32 rounding. */
Test(generate, tiny_llama_logits_match_transformers)
{
    json_error_t err;
    json_t *ref = json_load_file(FIXTURE("hf/tiny-llama3-logits.json"), 0, &err);
    cr_assert(ref, "%s", err.text);
    float *lg;
    double worst = tiny_logits(FIXTURE("hf/tiny-llama3"), ENG_WEIGHTS_FILE, ref, &lg);
    fprintf(stderr, "tiny llama vs transformers (%s): worst row relative error %.2e\n",
            json_string_value(json_object_get(ref, "transformers")), worst);
    cr_assert_lt(worst, 1e-4);
    free(lg);
    json_decref(ref);
}

/* FP8 E4M3 against PyTorch (fixtures/hf/make_fp8_ref.py, run on the GPU machine): every code's value; the
 * rounding of ties, subnormals, saturation, infinities and NaN; a matrix's per-row quantization; and tiny-llama3
 * with its layer matrices held in FP8 — converted at load, and read from an FP8 checkpoint written as the
 * anchors publish them (codes, "weight_scale" [rows][1]) — against transformers on the same FP8 round trip. */
#include "engine/safetensors.h"
#include "kernels/quant.h"

static float hex_float(const char *h)
{
    uint32_t b = (uint32_t)strtoul(h, NULL, 16);
    float f;
    memcpy(&f, &b, 4);
    return f;
}

Test(generate, fp8_codes_match_pytorch)
{
    json_error_t err;
    json_t *ref = json_load_file(FIXTURE("hf/tiny-llama3-fp8.json"), 0, &err);
    cr_assert(ref, "%s", err.text);
    json_t *dec = json_object_get(ref, "decode");
    cr_assert_eq(json_array_size(dec), 256);
    for (int c = 0; c < 256; c++) {
        json_t *v = json_array_get(dec, (size_t)c);
        float got = kern_fp8_to_fp32((uint8_t)c);
        if (json_is_null(v))
            cr_assert(isnan(got), "code 0x%02x: %g, PyTorch NaN", c, got);
        else
            cr_assert_eq(got, (float)json_number_value(v), "code 0x%02x: %g, PyTorch %g", c, got, json_number_value(v));
    }
    json_t *enc = json_object_get(ref, "encode");
    size_t bad = 0, n = json_array_size(enc);
    cr_assert_gt(n, 6000);
    for (size_t i = 0; i < n; i++) {
        json_t *e = json_array_get(enc, i);
        float f = hex_float(json_string_value(json_array_get(e, 0)));
        int want = (int)json_integer_value(json_array_get(e, 1)), got = kern_fp32_to_fp8(f);
        if (got != want && bad++ < 5)
            fprintf(stderr, "fp8(%.9g): 0x%02x, PyTorch 0x%02x\n", f, got, want);
    }
    cr_assert_eq(bad, 0, "%zu of %zu encodings differ from PyTorch's", bad, n);
    /* a matrix's rows as a backend holding it in FP8 has them */
    json_t *rows = json_object_get(ref, "rows");
    eng_model_t *m;
    cr_assert_eq(eng_model_open(FIXTURE("hf/tiny-llama3"), &m), TD_OK, "%s", td_last_error());
    const eng_st_tensor_t *t = eng_st_find(m->st, json_string_value(json_object_get(rows, "tensor")));
    cr_assert(t && t->n_dims == 2);
    kern_weight_t w = {t->type, (uint32_t)t->dims[0], (uint32_t)t->dims[1], t->data, NULL, KERN_TYPE_F8_E4M3, NULL, 0, 0, 0};
    uint8_t *q = malloc(w.cols);
    float *tmp = malloc(w.cols * sizeof *tmp), sc;
    for (uint32_t r = 0; r < json_array_size(json_object_get(rows, "codes")); r++) {
        json_t *codes = json_array_get(json_object_get(rows, "codes"), r);
        cr_assert_eq(kern_weight_fp8_row(&w, r, q, &sc, tmp), TD_OK);
        cr_assert_eq(sc, hex_float(json_string_value(json_array_get(json_object_get(rows, "scales"), r))), "row %u", r);
        for (uint32_t c = 0; c < w.cols; c++)
            cr_assert_eq(q[c], json_integer_value(json_array_get(codes, c)), "row %u column %u", r, c);
    }
    free(q), free(tmp);
    eng_model_close(m);
    json_decref(ref);
}


/* tiny-llama3's config and tokenizer files copied into dir (a model folder without weights, or one to add
 * weights to) */
static void copy_tiny_config(const char *dir)
{
    static const char *const files[] = {"config.json", "tokenizer.json", "tokenizer_config.json"};
    for (int i = 0; i < 3; i++) {
        char from[512], to[512];
        snprintf(from, sizeof from, "%s/%s", FIXTURE("hf/tiny-llama3"), files[i]);
        snprintf(to, sizeof to, "%s/%s", dir, files[i]);
        size_t len;
        char *text = read_file(from, &len);
        FILE *o = fopen(to, "wb");
        cr_assert(o && fwrite(text, 1, len, o) == len && !fclose(o));
        free(text);
    }
}

/* tiny-llama3 written as an FP8 checkpoint into dir: every layer matrix as F8_E4M3 codes with "<name>_scale"
 * [rows][1] F32 (kern_weight_fp8_row's), the rest as it is; the config and tokenizer copied */
static void write_fp8_checkpoint(const char *dir)
{
    copy_tiny_config(dir);
    eng_safetensors_t *st;
    cr_assert_eq(eng_st_open_dir(FIXTURE("hf/tiny-llama3"), &st), TD_OK);
    json_t *hdr = json_object();
    size_t cap = 1 << 20, at = 0;
    uint8_t *data = malloc(cap);
    for (size_t i = 0; i < eng_st_n_tensors(st); i++) {
        const eng_st_tensor_t *t = eng_st_tensor_at(st, i);
        json_t *shape = json_array();
        for (uint32_t d = 0; d < t->n_dims; d++)
            json_array_append_new(shape, json_integer((json_int_t)t->dims[d]));
        const bool layer = t->n_dims == 2 && strstr(t->name, "model.layers.") && strstr(t->name, "_proj.weight");
        if (!layer) {
            cr_assert_lt(at + t->n_bytes, cap);
            memcpy(data + at, t->data, t->n_bytes);
            json_object_set_new(hdr, t->name, json_pack("{s:s, s:o, s:[I, I]}", "dtype", kern_type_info(t->type)->name,
                                                         "shape", shape, "data_offsets", (json_int_t)at,
                                                         (json_int_t)(at + t->n_bytes)));
            at += t->n_bytes;
            continue;
        }
        kern_weight_t w = {t->type, (uint32_t)t->dims[0], (uint32_t)t->dims[1], t->data, NULL, KERN_TYPE_F8_E4M3, NULL, 0, 0, 0};
        const size_t codes = (size_t)w.rows * w.cols, scales = (size_t)w.rows * 4;
        cr_assert_lt(at + codes + scales, cap);
        float *tmp = malloc(w.cols * sizeof *tmp), *sc = (float *)(void *)(data + at + codes);
        for (uint32_t r = 0; r < w.rows; r++)
            cr_assert_eq(kern_weight_fp8_row(&w, r, data + at + (size_t)r * w.cols, &sc[r], tmp), TD_OK);
        free(tmp);
        char sname[256];
        snprintf(sname, sizeof sname, "%s_scale", t->name);
        json_object_set_new(hdr, t->name, json_pack("{s:s, s:o, s:[I, I]}", "dtype", "F8_E4M3", "shape", shape,
                                                     "data_offsets", (json_int_t)at, (json_int_t)(at + codes)));
        json_object_set_new(hdr, sname, json_pack("{s:s, s:[I, i], s:[I, I]}", "dtype", "F32", "shape",
                                                  (json_int_t)w.rows, 1, "data_offsets", (json_int_t)(at + codes),
                                                  (json_int_t)(at + codes + scales)));
        at += codes + scales;
    }
    eng_st_close(st);
    char *h = json_dumps(hdr, JSON_COMPACT);
    size_t hl = strlen(h), padded = (hl + 7) / 8 * 8;
    char path[512];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    FILE *o = fopen(path, "wb");
    uint64_t le = padded;
    cr_assert(o && fwrite(&le, 8, 1, o) == 1 && fwrite(h, 1, hl, o) == hl);
    for (size_t i = hl; i < padded; i++)
        fputc(' ', o);
    cr_assert(fwrite(data, 1, at, o) == at && !fclose(o));
    free(h), free(data);
    json_decref(hdr);
}

Test(generate, tiny_llama_fp8_matches_transformers)
{
    json_error_t err;
    json_t *ref = json_load_file(FIXTURE("hf/tiny-llama3-fp8.json"), 0, &err);
    cr_assert(ref, "%s", err.text);
    float *converted, *read;
    double e1 = tiny_logits(FIXTURE("hf/tiny-llama3"), ENG_WEIGHTS_FP8, ref, &converted);
    char dir[] = "/tmp/tandem-fp8-XXXXXX";
    cr_assert(mkdtemp(dir));
    write_fp8_checkpoint(dir);
    double e2 = tiny_logits(dir, ENG_WEIGHTS_FILE, ref, &read);
    fprintf(stderr, "tiny llama, fp8 weights vs transformers (%s) on the same FP8 round trip: worst row relative "
            "error %.2e converted at load, %.2e read from an FP8 checkpoint\n",
            json_string_value(json_object_get(ref, "transformers")), e1, e2);
    cr_assert_lt(e1, 1e-4);
    cr_assert_lt(e2, 1e-4);
    size_t n = json_array_size(json_object_get(ref, "ids")) * 600;
    cr_assert(!memcmp(converted, read, n * sizeof *converted), "converted at load and read from the file differ");
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    cr_assert_eq(system(cmd), 0);
    free(converted), free(read);
    json_decref(ref);
}

/* The dummy load format: a folder of config.json and tokenizer.json alone
 * opens; its weights need load_format dummy (else an error naming it); the
 * seeded values are uniform with std 0.02, the same for the same seed and
 * row; the forward pass over them is finite and repeats bit for bit; the KV
 * contract's model id says so. */
Test(generate, dummy_load_format)
{
    uint16_t a[4096], b[4096];
    kern_fill_row_f16(42, 7, 0, 4096, a);
    kern_fill_row_f16(42, 7, 0, 4096, b);
    cr_assert(!memcmp(a, b, sizeof a));
    kern_fill_row_f16(42, 8, 0, 4096, b);
    cr_assert(memcmp(a, b, sizeof a), "another row, other values");
    double s = 0, s2 = 0;
    for (int i = 0; i < 4096; i++) {
        const double v = kern_fp16_to_fp32(a[i]);
        s += v, s2 += v * v;
    }
    const double mean = s / 4096, sd = sqrt(s2 / 4096 - mean * mean);
    cr_assert(fabs(mean) < 0.002 && fabs(sd - 0.02) < 0.001, "mean %g, std %g", mean, sd);
    char dir[] = "/tmp/tandem-dummy-XXXXXX";
    cr_assert(mkdtemp(dir));
    copy_tiny_config(dir);
    eng_model_t *m;
    cr_assert_eq(eng_model_open(dir, &m), TD_OK, "%s", td_last_error());
    kern_backend_t *be;
    cr_assert_eq(kern_cpu_backend_create(2, &be), TD_OK);
    td_kv_layout_t g = td_kv_layout_make(m->kv_id, m->desc.n_layers, m->desc.n_kv_heads, m->desc.head_dim, 16, TD_KV_F32);
    eng_kv_pool_t *pool;
    cr_assert_eq(eng_kv_pool_create(be, &g, 4, NULL, &pool), TD_OK);
    eng_forward_t *f;
    cr_assert_neq(eng_forward_create(m, be, pool, 64, 64, &f), TD_OK, "no weights, no dummy: refused");
    cr_assert(strstr(td_last_error(), "load_format"), "%s", td_last_error());
    eng_model_set_dummy(m, true);
    cr_assert(strstr(m->kv_id, "(dummy weights)"), "%s", m->kv_id);
    float *first = NULL;
    for (int run = 0; run < 2; run++) {
        cr_assert_eq(eng_forward_create(m, be, pool, 64, 64, &f), TD_OK, "%s", td_last_error());
        int32_t ids[12] = {5, 100, 200, 300, 7, 8, 9, 400, 500, 10, 11, 12}, table[4] = {0, 1, 2, 3};
        eng_batch_seq_t sq = {.tokens = ids, .n = 12, .pos0 = 0, .block_table = table, .n_blocks = 4, .all_logits = true};
        const float *lg;
        uint32_t nl;
        cr_assert_eq(eng_forward_run(f, &sq, 1, &lg, &nl), TD_OK, "%s", td_last_error());
        const size_t n = (size_t)nl * m->desc.vocab;
        for (size_t i = 0; i < n; i++)
            cr_assert(isfinite(lg[i]));
        if (!first) {
            first = malloc(n * sizeof *first);
            memcpy(first, lg, n * sizeof *first);
        } else {
            cr_assert(!memcmp(first, lg, n * sizeof *first), "the same seeded weights, the same logits");
        }
        eng_forward_destroy(f);
    }
    free(first);
    eng_kv_pool_destroy(pool);
    kern_cpu_backend_destroy(be);
    eng_model_close(m);
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    cr_assert_eq(system(cmd), 0);
}

/* Teacher-forced agreement: feed each prompt and llama.cpp's own 64 greedy
 * tokens, and compare tandem's argmax with llama.cpp's choice at every step
 * (one divergence no longer decides the rest of the run). Every disagreement
 * must be at a step where llama.cpp's top two logits are within NEAR_TIE
 * (fast numerics); under reference numerics every step agrees. */
static void teacher_forced(kern_numerics_t nm)
{
    kern_backend_t *be;
    cr_assert_eq(kern_cpu_backend_create_numerics(2, nm, &be), TD_OK);
    td_kv_layout_t g = td_kv_layout_make(model->desc.name, model->desc.n_layers, model->desc.n_kv_heads, model->desc.head_dim, 16, TD_KV_F16);
    eng_kv_pool_t *pool;
    cr_assert_eq(eng_kv_pool_create(be, &g, 16, NULL, &pool), TD_OK);
    eng_forward_t *f;
    cr_assert_eq(eng_forward_create(model, be, pool, 256, 80, &f), TD_OK);
    int32_t table[16];
    for (int i = 0; i < 16; i++)
        table[i] = i;
    size_t steps = 0, agree = 0;
    double worst_gap = 0;
    const size_t prompts = quick() ? 2 : n_refs; /* the sanitizer pass: the same steps on fewer prompts */
    for (size_t p = 0; p < prompts; p++) {
        int32_t seq[256];
        size_t n = refs[p].n_ids;
        memcpy(seq, refs[p].ids, n * sizeof *seq);
        memcpy(seq + n, refs[p].greedy, N_GEN * sizeof *seq);
        /* the prompt but its last token, then the rest with every logit row */
        eng_batch_seq_t a = {.tokens = seq, .n = (uint32_t)n - 1, .pos0 = 0, .block_table = table, .n_blocks = 16};
        const float *lg;
        uint32_t nl;
        cr_assert_eq(eng_forward_run(f, &a, 1, &lg, &nl), TD_OK);
        eng_batch_seq_t b = {.tokens = seq + n - 1, .n = N_GEN, .pos0 = (uint32_t)n - 1, .block_table = table,
                             .n_blocks = 16, .all_logits = true, .decode_from = (uint32_t)n};
        cr_assert_eq(eng_forward_run(f, &b, 1, &lg, &nl), TD_OK);
        for (int t = 0; t < N_GEN; t++) {
            const float *row = lg + (size_t)t * model->desc.vocab;
            int32_t best = 0;
            for (uint32_t v = 1; v < model->desc.vocab; v++)
                if (row[v] > row[best])
                    best = (int32_t)v;
            steps++;
            if (best == refs[p].greedy[t]) {
                agree++;
            } else {
                worst_gap = fmax(worst_gap, refs[p].gap[t]);
                cr_assert_lt(refs[p].gap[t], NEAR_TIE, "prompt %zu step %d: llama.cpp was sure (gap %.4f)", p, t,
                             refs[p].gap[t]);
            }
        }
    }
    fprintf(stderr, "greedy, teacher-forced, %s numerics: %zu of %zu steps (%.1f%%) pick llama.cpp's token; the "
                    "rest are at llama.cpp top-2 gaps up to %.3f\n", nm == KERN_NUMERICS_FAST ? "fast" : "reference",
            agree, steps, 100.0 * agree / steps, worst_gap);
    if (nm == KERN_NUMERICS_FAST)
        cr_assert_geq(agree * 100, steps * 95, "at least 95%% of steps agree");
    else
        cr_assert_eq(agree, steps, "reference numerics: every step agrees");
    eng_forward_destroy(f);
    eng_kv_pool_destroy(pool);
    kern_cpu_backend_destroy(be);
}

/* A decode step of 32 sequences that share a 1,024-token prefix (64 blocks)
 * and each have a block of their own, on a forward of at most 32 tokens:
 * 2,080 block-table entries, past the 1,152 such a forward once held (it
 * refused the step). Every row's logits are those the row gets alone. The
 * quick (sanitizer) pass shares 576 tokens: 1,184 entries, still past it. */
Test(generate, a_decode_batch_of_long_block_tables_equals_each_row_alone)
{
    enum { PMAX = 1024, S = 32, BT = 16 };
    const int P = quick() ? 576 : PMAX, SHARED = P / BT;
    kern_backend_t *be;
    cr_assert_eq(kern_cpu_backend_create(2, &be), TD_OK);
    td_kv_layout_t g = td_kv_layout_make(model->desc.name, model->desc.n_layers, model->desc.n_kv_heads,
                                         model->desc.head_dim, BT, TD_KV_F16);
    eng_kv_pool_t *pool;
    cr_assert_eq(eng_kv_pool_create(be, &g, SHARED + S, NULL, &pool), TD_OK, "%s", td_last_error());
    eng_forward_t *f;
    cr_assert_eq(eng_forward_create(model, be, pool, S, S, &f), TD_OK, "%s", td_last_error());
    static int32_t prompt[PMAX], tables[S][PMAX / BT + 1], tok[S];
    for (int i = 0; i < P; i++)
        prompt[i] = refs[0].ids[i % refs[0].n_ids];
    for (int s = 0; s < S; s++) {
        for (int b = 0; b < SHARED; b++)
            tables[s][b] = b;
        tables[s][SHARED] = SHARED + s;
        tok[s] = refs[s % n_refs].greedy[s % N_GEN];
    }
    const float *lg;
    uint32_t nl;
    for (int p = 0; p < P; p += S) { /* the prefix in steps of S tokens, the forward's most */
        eng_batch_seq_t pre = {.tokens = prompt + p, .n = S, .pos0 = (uint32_t)p, .block_table = tables[0],
                               .n_blocks = SHARED};
        cr_assert_eq(eng_forward_run(f, &pre, 1, &lg, &nl), TD_OK, "%s", td_last_error());
    }
    eng_batch_seq_t b[S];
    for (int s = 0; s < S; s++)
        b[s] = (eng_batch_seq_t){.tokens = &tok[s], .n = 1, .pos0 = P, .block_table = tables[s],
                                 .n_blocks = SHARED + 1, .want_logits = true};
    cr_assert_eq(eng_forward_run(f, b, S, &lg, &nl), TD_OK, "%s", td_last_error());
    cr_assert_eq(nl, S);
    const uint32_t V = model->desc.vocab;
    float *batched = malloc((size_t)S * V * sizeof *batched);
    memcpy(batched, lg, (size_t)S * V * sizeof *batched);
    double worst = 0;
    /* each row alone; the quick (sanitizer) pass takes the first, two inner and the last */
    static const int some[] = {0, 1, S / 2, S - 1};
    const int n_alone = quick() ? (int)(sizeof some / sizeof some[0]) : S;
    for (int k = 0; k < n_alone; k++) {
        int s = quick() ? some[k] : k;
        cr_assert_eq(eng_forward_run(f, &b[s], 1, &lg, &nl), TD_OK, "%s", td_last_error());
        double d = 0, q = 0;
        for (uint32_t v = 0; v < V; v++) {
            d = fmax(d, fabs(batched[(size_t)s * V + v] - lg[v]));
            q = fmax(q, fabs(lg[v]));
        }
        worst = fmax(worst, d / q);
    }
    fprintf(stderr, "a decode batch of %d sequences at %d tokens (%d block-table entries): worst row's max "
                    "|batched - alone| %.2e of its largest logit\n", S, P, S * (SHARED + 1), worst);
    cr_assert_lt(worst, 1e-3, "a row's logits in the batch differ from its logits alone");
    free(batched);
    eng_forward_destroy(f);
    eng_kv_pool_destroy(pool);
    kern_cpu_backend_destroy(be);
}

Test(generate, teacher_forced_agreement_with_llama_cpp)
{
    /* reference numerics: greedy_matches_llama_cpp_alone_and_batched's identical sequences agree at every step */
    teacher_forced(KERN_NUMERICS_FAST);
}

/* Cancelling a request frees its blocks at once; a finished engine holds no
 * block in use (published blocks stay cached, reusable, evictable). */
Test(generate, cancel_frees_blocks)
{
    eng_engine_t *e = engine(512, 0, true);
    static collect_t c;
    memset(&c, 0, sizeof c);
    uint64_t ids[2];
    for (int i = 0; i < 2; i++) {
        eng_request_t r = {.prompt = refs[i].ids, .n_prompt = refs[i].n_ids, .sampling = eng_sampling_default(),
                           .max_tokens = N_GEN, .ignore_eos = true};
        cr_assert_eq(eng_engine_add(e, &r, &ids[i]), TD_OK);
    }
    c.first = ids[0];
    for (int s = 0; s < 5; s++)
        cr_assert_eq(eng_engine_step(e, on_ev, &c), TD_OK);
    uint32_t busy = eng_engine_kv_stats(e).in_use;
    cr_assert_gt(busy, 0);
    cr_assert_eq(eng_engine_cancel(e, ids[1]), TD_OK);
    uint32_t after = eng_engine_kv_stats(e).in_use;
    cr_assert_lt(after, busy, "the cancelled request's blocks are no longer in use");
    cr_assert_eq(eng_engine_cancel(e, ids[1]), TD_ERR_NOT_FOUND, "a second cancel names an unknown request");
    while (eng_engine_busy(e))
        cr_assert_eq(eng_engine_step(e, on_ev, &c), TD_OK);
    cr_assert_eq(c.n[0], N_GEN, "the other request finished");
    cr_assert_eq(eng_engine_kv_stats(e).in_use, 0, "nothing in use once idle");
    eng_engine_destroy(e);
}

/* Two engines state their KV contracts; a different block size is refused
 * with both values named. */
Test(generate, kv_contract_mismatch_names_both_values)
{
    eng_engine_t *a = engine(512, 0, true), *b;
    eng_engine_config_t cfg = eng_engine_config_default();
    cfg.n_threads = 1;
    cfg.block_tokens = 32;
    cr_assert_eq(eng_engine_create(model, &cfg, &b), TD_OK);
    td_kv_layout_t ca = eng_engine_kv_contract(a), cb = eng_engine_kv_contract(b);
    cr_assert_eq(td_kv_contract_check(&ca, &ca, "self"), TD_OK);
    cr_assert_eq(td_kv_contract_check(&ca, &cb, "decode-1"), TD_ERR_CONFIG);
    cr_assert(strstr(td_last_error(), "block_tokens: here 16, peer 32"), "%s", td_last_error());
    cr_assert(strstr(td_last_error(), "decode-1"));
    cr_assert_eq(td_kv_block_bytes(&ca), eng_engine_kv_stats(a).block_bytes);
    cb = ca;
    cb.dtype = TD_KV_F32;
    cr_assert_eq(td_kv_contract_check(&ca, &cb, "p"), TD_ERR_CONFIG);
    cr_assert(strstr(td_last_error(), "dtype: here 'fp16', peer 'fp32'"), "%s", td_last_error());
    eng_engine_destroy(a);
    eng_engine_destroy(b);
}

/* ---- a backend that fails on demand: the CPU backend with its attention
 * op swapped for one that errs while `flaky_armed` is set ---- */
static kern_backend_ops_t flaky_ops;
static const kern_backend_ops_t *real_ops;
static bool flaky_armed;

static td_status_t flaky_attention(kern_backend_t *b, const kern_kv_view_t *kv, const float *q, float *out,
                                   uint32_t n_heads, const kern_attn_seq_t *seqs, const kern_attn_seq_t *dev_seqs,
                                   uint32_t n_seqs, float scale)
{
    if (flaky_armed)
        return td_error(TD_ERR_INTERNAL, "attention failed on purpose");
    return real_ops->attention(b, kv, q, out, n_heads, seqs, dev_seqs, n_seqs, scale);
}

typedef struct failures {
    collect_t c;
    char error[64][256];
} failures_t;

static void on_fail_ev(void *ctx, const eng_event_t *ev)
{
    failures_t *f = ctx;
    on_ev(&f->c, ev);
    if (ev->finish == ENG_FINISH_ERROR)
        snprintf(f->error[ev->id - f->c.first], sizeof f->error[0], "%s", ev->error ? ev->error : "(none)");
}

/* A backend op that fails ends the requests of that step's batch with
 * ENG_FINISH_ERROR and the op's message; the engine serves the next request
 * as a fresh engine would. Before: the step's error was returned and the same
 * batch retried forever. */
Test(generate, a_failing_backend_op_ends_the_batch_with_an_error)
{
    kern_backend_t *be;
    cr_assert_eq(kern_cpu_backend_create(2, &be), TD_OK);
    real_ops = be->ops;
    flaky_ops = *be->ops;
    flaky_ops.attention = flaky_attention;
    be->ops = &flaky_ops;
    eng_engine_config_t cfg = eng_engine_config_default();
    cfg.backend = be;
    eng_engine_t *e;
    cr_assert_eq(eng_engine_create(model, &cfg, &e), TD_OK, "%s", td_last_error());
    static failures_t f;
    memset(&f, 0, sizeof f);
    for (int i = 0; i < 2; i++) {
        eng_request_t r = {.prompt = refs[i].ids, .n_prompt = refs[i].n_ids, .sampling = eng_sampling_default(),
                           .max_tokens = N_GEN, .ignore_eos = true};
        uint64_t id;
        cr_assert_eq(eng_engine_add(e, &r, &id), TD_OK);
        if (i == 0)
            f.c.first = id;
    }
    cr_assert_eq(eng_engine_step(e, on_fail_ev, &f), TD_OK, "%s", td_last_error());
    cr_assert_eq(f.c.n[0], 1, "the prompts were computed and sampled once before the failure");
    flaky_armed = true;
    cr_assert_eq(eng_engine_step(e, on_fail_ev, &f), TD_ERR_INTERNAL);
    flaky_armed = false;
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(f.c.fin[i], ENG_FINISH_ERROR, "request %d ended with an error", i);
        cr_assert(strstr(f.error[i], "attention failed on purpose"), "request %d's message: %s", i, f.error[i]);
    }
    cr_assert_not(eng_engine_busy(e), "the failed requests are gone");
    cr_assert_eq(eng_engine_kv_stats(e).in_use, 0, "their blocks are free");
    /* the engine goes on: the next request's tokens are a fresh engine's */
    static collect_t after, fresh;
    size_t idx = 2;
    run(e, &idx, 1, &after);
    eng_engine_t *clean = engine(512, 0, true);
    run(clean, &idx, 1, &fresh);
    cr_assert_eq(after.n[0], (uint32_t)n_gen());
    cr_assert_eq(memcmp(after.out[0], fresh.out[0], (size_t)n_gen() * sizeof(int32_t)), 0);
    eng_engine_destroy(clean);
    eng_engine_destroy(e);
    be->ops = real_ops;
    kern_backend_destroy(be);
}

/* A backend that lacks an op the forward pass needs is refused at creation,
 * the op named — not at its first step. */
Test(generate, a_backend_without_an_op_is_refused_up_front)
{
    kern_backend_t *be;
    cr_assert_eq(kern_cpu_backend_create(1, &be), TD_OK);
    real_ops = be->ops;
    flaky_ops = *be->ops;
    flaky_ops.supported &= ~(uint32_t)(KERN_OP_ATTENTION | KERN_OP_EMBED);
    be->ops = &flaky_ops;
    eng_engine_config_t cfg = eng_engine_config_default();
    cfg.backend = be;
    eng_engine_t *e = NULL;
    cr_assert_eq(eng_engine_create(model, &cfg, &e), TD_ERR_UNSUPPORTED);
    cr_assert(strstr(td_last_error(), "backend cpu does not support embed, attention"), "%s", td_last_error());
    be->ops = real_ops;
    kern_backend_destroy(be);
}

/* A pool held entirely by landing reservations: a request that can get no
 * block waits (reservations are claimed or expire within their lease) and,
 * past block_wait_s, ends with an error that says so — the other requests
 * and the engine go on (before: every step failed with "cannot hold one
 * sequence" and the request hung). Released in time, it completes. */
Test(generate, a_pool_pinned_by_reservations_waits_then_fails_not_hangs)
{
    eng_engine_config_t cfg = eng_engine_config_default();
    cfg.n_threads = 2;
    cfg.kv_tokens = 16 * 8;
    cfg.block_wait_s = 0.3;
    eng_engine_t *e;
    cr_assert_eq(eng_engine_create(model, &cfg, &e), TD_OK);
    int32_t held[8];
    cr_assert_eq(eng_engine_kv_reserve(e, 16 * 8, held), TD_OK);
    static failures_t f;
    memset(&f, 0, sizeof f);
    eng_request_t r = {.prompt = refs[0].ids, .n_prompt = refs[0].n_ids, .sampling = eng_sampling_default(),
                       .max_tokens = 8, .ignore_eos = true};
    cr_assert_eq(eng_engine_add(e, &r, &f.c.first), TD_OK);
    double t0 = td_now_s();
    while (eng_engine_busy(e) && td_now_s() - t0 < 5)
        cr_assert_eq(eng_engine_step(e, on_fail_ev, &f), TD_OK, "waiting is not a failed step");
    double waited = td_now_s() - t0;
    cr_assert_not(eng_engine_busy(e), "the request ended");
    cr_assert_eq(f.c.fin[0], ENG_FINISH_ERROR);
    cr_assert(strstr(f.error[0], "8 are held outside the engine's requests"), "%s", f.error[0]);
    cr_assert(waited >= 0.3 && waited < 2, "it waited its block_wait_s (%.2f s)", waited);
    /* released while the request waits: it completes */
    memset(&f, 0, sizeof f);
    cr_assert_eq(eng_engine_add(e, &r, &f.c.first), TD_OK);
    for (int s = 0; s < 3; s++) {
        cr_assert_eq(eng_engine_step(e, on_fail_ev, &f), TD_OK);
        cr_assert(eng_engine_stalled(e), "step %d: nothing can run yet", s);
    }
    eng_engine_kv_release(e, held, 8);
    while (eng_engine_busy(e))
        cr_assert_eq(eng_engine_step(e, on_fail_ev, &f), TD_OK, "%s", td_last_error());
    cr_assert_eq(f.c.fin[0], ENG_FINISH_LENGTH);
    cr_assert_eq(f.c.n[0], 8);
    eng_engine_destroy(e);
}

/* Landing blocks for a prompt whose leading blocks the prefix cache holds
 * (a decode worker's Reserve for a conversation's next turn): those come
 * from the cache, counted, the rest are fresh; never the last token's block;
 * none for another prompt; all given back on release. */
Test(generate, a_reservation_takes_the_cached_prefix_and_lands_the_rest)
{
    eng_engine_t *e = engine(512, 16 * 64, true);
    size_t idx = 0;
    static collect_t c;
    run(e, &idx, 1, &c);
    const ref_t *r = &refs[0];
    uint32_t k = (uint32_t)(r->n_ids / 16); /* the prompt's full blocks, published once computed */
    cr_assert_geq(k, 2, "the first prompt has %zu tokens", r->n_ids);
    int32_t next[256];
    cr_assert_leq(r->n_ids + 5, 256);
    memcpy(next, r->ids, r->n_ids * sizeof *next);
    memcpy(next + r->n_ids, r->ids, 5 * sizeof *next); /* the next turn: the prompt, then more */
    uint32_t n = (uint32_t)r->n_ids + 5, held = 99, in_use = eng_engine_kv_stats(e).in_use;
    int32_t blocks[32];
    cr_assert_eq(eng_engine_kv_reserve_prefix(e, next, n, blocks, &held), TD_OK, "%s", td_last_error());
    cr_assert_eq(held, k, "the prompt's %u full blocks are held (%u)", k, held);
    uint32_t all = (n + 15) / 16;
    cr_assert_eq(eng_engine_kv_stats(e).in_use, in_use + all, "the held blocks counted in use, the rest fresh");
    td_block_name_t h = eng_engine_block_name(e, next, held);
    cr_assert(td_block_name_eq(h, eng_engine_block_name(e, r->ids, held)));
    cr_assert_not(td_block_name_eq(h, eng_engine_block_name(e, next + 1, held)));
    for (uint32_t b = held; b < all; b++)
        for (uint32_t j = 0; j < held; j++)
            cr_assert_neq(blocks[b], blocks[j], "a landing block is not a held one");
    eng_engine_kv_release(e, blocks, all);
    cr_assert_eq(eng_engine_kv_stats(e).in_use, in_use);
    /* exactly k full blocks: the last one holds the token whose logits are needed, so it lands */
    cr_assert_eq(eng_engine_kv_reserve_prefix(e, r->ids, k * 16, blocks, &held), TD_OK);
    cr_assert_eq(held, k - 1);
    eng_engine_kv_release(e, blocks, k);
    /* another first token: nothing held */
    next[0] = next[0] == 1 ? 2 : 1;
    cr_assert_eq(eng_engine_kv_reserve_prefix(e, next, n, blocks, &held), TD_OK);
    cr_assert_eq(held, 0);
    eng_engine_kv_release(e, blocks, all);
    cr_assert_eq(eng_engine_kv_stats(e).in_use, in_use);
    eng_engine_destroy(e);
}

/* Device names: what eng_backend_open takes and how it refuses the rest
 * (CI has no GPU, so "cuda" itself is only checked to fail or work cleanly). */
Test(generate, backend_devices_are_named_or_refused)
{
    kern_backend_t *be = NULL;
    cr_assert_eq(eng_backend_open(NULL, 1, KERN_NUMERICS_FAST, &be), TD_OK);
    cr_assert_str_eq(be->ops->name, "cpu");
    kern_backend_destroy(be);
    cr_assert_eq(eng_backend_open("cpu", 1, KERN_NUMERICS_REFERENCE, &be), TD_OK);
    kern_backend_destroy(be);
    const char *bad[] = {"tpu", "cuda:", "cuda:x", "cuda:-1", "cuda:1x", "CUDA", ""};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        cr_assert_eq(eng_backend_open(bad[i], 1, KERN_NUMERICS_FAST, &be), TD_ERR_INVALID_ARG, "%s", bad[i]);
        char want[32];
        snprintf(want, sizeof want, "device '%s'", bad[i]);
        cr_assert(strstr(td_last_error(), want), "%s", td_last_error());
    }
    cr_assert_eq(eng_backend_open("cuda:0", 1, KERN_NUMERICS_REFERENCE, &be), TD_ERR_UNSUPPORTED);
    cr_assert(strstr(td_last_error(), "reference"), "%s", td_last_error());
    /* without a GPU (or without the CUDA backend in this build) a clear refusal, never a crash */
    td_status_t rc = eng_backend_open("cuda", 1, KERN_NUMERICS_FAST, &be);
    if (rc == TD_OK)
        kern_backend_destroy(be);
    else
        cr_assert(rc == TD_ERR_UNSUPPORTED && (strstr(td_last_error(), "cuda") || strstr(td_last_error(), "CUDA")),
                  "%d %s", rc, td_last_error());
}
