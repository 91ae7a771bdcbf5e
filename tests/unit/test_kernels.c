/* test_kernels.c — every CPU kernel against a plain reference on random
 * inputs, at several sizes, with stated tolerances; both CPU paths.
 *
 * matmul: against double-precision sums over the weights the `gguf` package
 * decodes (kern_dequant_row is checked against it in test_dequant.c) and the
 * activations as the kernel quantizes them (8-bit blocks, fp16 scale), so the
 * tolerance is fp32 rounding, not quantization error. */
#include "tests/unit/helpers.h"

#include <math.h>

#include "common/log.h"
#include "engine/kv_pool.h"
#include "engine/sampler.h"
#include "kernels/backend.h"
#include "kernels/cpu/threadpool.h"
#include "kernels/quant.h"

static uint64_t rs = 88172645463325252ull;
static float frand(void)
{
    rs ^= rs << 13, rs ^= rs >> 7, rs ^= rs << 17;
    return (float)((rs >> 11) * (1.0 / 9007199254740992.0)) * 2 - 1;
}

/* x as the kernel sees it: 8-bit blocks of 32 with an fp16 scale */
static double q8(const float *x, size_t i)
{
    const float *b = x + i / 32 * 32;
    float amax = 0;
    for (int j = 0; j < 32; j++)
        amax = fmaxf(amax, fabsf(b[j]));
    float d = amax / 127.f, id = amax ? 127.f / amax : 0;
    return (double)nearbyintf(x[i] * id) * kern_fp16_to_fp32(kern_fp32_to_fp16(d));
}

static void check_matmul(uint32_t type, uint32_t rows, uint32_t cols, uint32_t n, bool prepare)
{
    const kern_type_info_t *info = kern_type_info(type);
    size_t rb = kern_type_row_bytes(info, cols);
    uint8_t *w = malloc(rb * rows);
    for (size_t i = 0; i < rb * rows; i++)
        w[i] = (uint8_t)(frand() * 127 + 128);
    /* sane scales: set every fp16 scale field of the block formats */
    for (size_t b = 0; b < rb * rows / info->block_bytes; b++) {
        uint8_t *blk = w + b * info->block_bytes;
        uint16_t d = kern_fp32_to_fp16(0.01f + 0.02f * fabsf(frand()));
        if (type == KERN_TYPE_Q4_0 || type == KERN_TYPE_Q8_0 || type == KERN_TYPE_Q4_1 || type == KERN_TYPE_Q4_K ||
            type == KERN_TYPE_Q5_K)
            memcpy(blk, &d, 2);
        if (type == KERN_TYPE_Q4_1 || type == KERN_TYPE_Q4_K || type == KERN_TYPE_Q5_K)
            memcpy(blk + 2, &d, 2);
        if (type == KERN_TYPE_Q6_K)
            memcpy(blk + 208, &d, 2);
        if (type == KERN_TYPE_F16) {
            uint16_t h = kern_fp32_to_fp16(frand());
            memcpy(blk, &h, 2);
        }
        if (type == KERN_TYPE_BF16) {
            float f = frand();
            uint32_t bits;
            memcpy(&bits, &f, 4);
            uint16_t h = (uint16_t)(bits >> 16);
            memcpy(blk, &h, 2);
        }
        if (type == KERN_TYPE_F32) {
            float f = frand();
            memcpy(blk, &f, 4);
        }
    }
    float *x = malloc((size_t)n * cols * 4), *y = malloc((size_t)n * rows * 4), *wr = malloc(cols * 4);
    for (size_t i = 0; i < (size_t)n * cols; i++)
        x[i] = frand() * 3;
    kern_backend_t *be;
    cr_assert_eq(kern_cpu_backend_create(2, &be), TD_OK);
    kern_weight_t wt = {.type = type, .rows = rows, .cols = cols, .data = w};
    if (prepare) /* on the AVX2 path: the 8-row interleaved copy (repack.h) */
        cr_assert_eq(be->ops->weight_prepare(be, &wt), TD_OK);
    cr_assert_eq(be->ops->matmul(be, &wt, x, y, n), TD_OK, "%s", td_last_error());
    /* the kernel meets these weights with 8-bit activation blocks */
    bool quantized = type == KERN_TYPE_Q4_0 || type == KERN_TYPE_Q4_1 || type == KERN_TYPE_Q8_0 || wt.priv;
    double worst = 0;
    for (uint32_t r = 0; r < rows; r++) {
        kern_dequant_row(type, w + r * rb, wr, cols);
        for (uint32_t t = 0; t < n; t++) {
            double ref = 0, mag = 0;
            for (uint32_t c = 0; c < cols; c++) {
                double xv = quantized ? q8(x + (size_t)t * cols, c) : x[(size_t)t * cols + c];
                ref += xv * wr[c];
                mag += fabs(xv * wr[c]);
            }
            double err = fabs(y[(size_t)t * rows + r] - ref) / (mag + 1e-30);
            worst = err > worst ? err : worst;
        }
    }
    /* Q4_1 carries Σq·d in fp16 (its 's' field): 2^-11 of the min term; the
     * repacked path keeps activation scales in fp32 where the reference rounds
     * them to fp16: 2^-11 */
    double tol = type == KERN_TYPE_Q4_1 || (prepare && wt.priv) ? 2e-3 : 2e-5;
    if (prepare && wt.priv && type == KERN_TYPE_Q4_K) /* + Q4_K's scales rounded to fp16 */
        tol = 3e-3;
    if (getenv("TANDEM_TEST_VERBOSE"))
        fprintf(stderr, "kernels: matmul %s %ux%u x %u%s: worst %.2e\n", info->name, rows, cols, n,
                prepare && wt.priv ? " (repacked)" : "", worst);
    be->ops->weight_release(be, &wt);
    cr_assert_lt(worst, tol, "%s %ux%u x %u: worst error %.3g of the magnitude (tolerance %.0g)", info->name, rows,
                 cols, n, worst, tol);
    kern_cpu_backend_destroy(be);
    free(w), free(x), free(y), free(wr);
}

static void all_types(void)
{
    uint32_t types[] = {KERN_TYPE_F32, KERN_TYPE_F16, KERN_TYPE_BF16, KERN_TYPE_Q4_0, KERN_TYPE_Q4_1,
                        KERN_TYPE_Q8_0, KERN_TYPE_Q4_K, KERN_TYPE_Q5_K, KERN_TYPE_Q6_K};
    uint32_t shapes[][3] = {{1, 256, 1}, {37, 512, 1}, {64, 256, 7}, {19, 768, 16}, {24, 128, 5}, {40, 96, 1}};
    for (size_t t = 0; t < sizeof types / sizeof *types; t++)
        for (size_t s = 0; s < 6; s++)
            for (int prep = 0; prep < 2; prep++)
                if (shapes[s][1] % kern_type_info(types[t])->block_elems == 0)
                    check_matmul(types[t], shapes[s][0], shapes[s][1], shapes[s][2], prep);
}

Test(kernels, matmul_every_type_default_path) { all_types(); }
Test(kernels, matmul_every_type_portable_path)
{
    setenv("TANDEM_CPU", "portable", 1);
    all_types();
    cr_assert_str_eq(kern_cpu_path(), "portable");
}

Test(kernels, rmsnorm_and_rope_both_styles)
{
    kern_backend_t *be;
    kern_cpu_backend_create(2, &be);
    float x[3 * 64], w[64], y[3 * 64];
    for (int i = 0; i < 192; i++)
        x[i] = frand() * 4;
    for (int i = 0; i < 64; i++)
        w[i] = frand();
    be->ops->rmsnorm(be, x, w, y, 3, 64, 1e-5f);
    for (int t = 0; t < 3; t++) {
        double ss = 0;
        for (int i = 0; i < 64; i++)
            ss += (double)x[t * 64 + i] * x[t * 64 + i];
        double sc = 1 / sqrt(ss / 64 + 1e-5);
        for (int i = 0; i < 64; i++)
            cr_assert_float_eq(y[t * 64 + i], x[t * 64 + i] * sc * w[i], 1e-5 * (fabs(x[t * 64 + i] * sc * w[i]) + 1));
    }
    /* rope: 2 tokens x 3 heads x 16 dims */
    float freq[8], q[96], r[96];
    int32_t pos[2] = {5, 1000};
    for (int i = 0; i < 8; i++)
        freq[i] = (float)pow(10000.0, -2.0 * i / 16);
    for (int style = 0; style < 2; style++) {
        for (int i = 0; i < 96; i++)
            q[i] = r[i] = frand();
        be->ops->rope(be, r, 2, 3, 16, pos, freq, (kern_rope_style_t)style);
        for (int t = 0; t < 2; t++)
            for (int h = 0; h < 3; h++)
                for (int i = 0; i < 8; i++) {
                    int a = style ? i : 2 * i, b = style ? i + 8 : 2 * i + 1;
                    double th = pos[t] * (double)freq[i];
                    const float *v = q + (t * 3 + h) * 16;
                    double e0 = v[a] * cos(th) - v[b] * sin(th), e1 = v[a] * sin(th) + v[b] * cos(th);
                    cr_assert_float_eq(r[(t * 3 + h) * 16 + a], e0, 2e-4, "style %d", style);
                    cr_assert_float_eq(r[(t * 3 + h) * 16 + b], e1, 2e-4, "style %d", style);
                }
    }
    kern_cpu_backend_destroy(be);
}

/* What a pool of dtype dt holds for element i of a K or V row of HD values: the value, its fp16 rounding, or its
 * fp8 code (the row's amax over 448 its scale, kv_contract.h) times the scale. */
static float stored(td_kv_dtype_t dt, const float *row, int hd, int i)
{
    if (dt == TD_KV_F16)
        return kern_fp16_to_fp32(kern_fp32_to_fp16(row[i]));
    if (dt == TD_KV_F32)
        return row[i];
    float amax = 0;
    for (int j = 0; j < hd; j++)
        amax = fmaxf(amax, fabsf(row[j]));
    float sc = amax > 0 ? amax / 448.0f : 1.0f;
    return kern_fp8_to_fp32(kern_fp32_to_fp8(row[i] / sc)) * sc;
}

Test(kernels, paged_attention_against_naive)
{
    kern_backend_t *be;
    kern_cpu_backend_create(2, &be);
    const td_kv_dtype_t dts[3] = {TD_KV_F32, TD_KV_F16, TD_KV_F8_E4M3};
    for (int di = 0; di < 3; di++) {
        const td_kv_dtype_t dt = dts[di];
        td_kv_layout_t g = td_kv_layout_make("test", 2, 2, 16, 4, dt);
        eng_kv_pool_t *pool;
        cr_assert_eq(eng_kv_pool_create(be, &g, 8, NULL, &pool), TD_OK);
        enum { N = 11, H = 4, KVH = 2, HD = 16 };
        float q[N * H * HD], k[N * KVH * HD], v[N * KVH * HD], out[N * H * HD];
        for (int i = 0; i < N * H * HD; i++)
            q[i] = frand();
        for (int i = 0; i < N * KVH * HD; i++)
            k[i] = frand() * (1 + i % 7), v[i] = frand(); /* rows of unlike ranges: unlike fp8 scales */
        int32_t table[3] = {6, 1, 4}, slots[N];
        for (int t = 0; t < N; t++)
            slots[t] = table[t / 4] * 4 + t % 4;
        kern_kv_view_t view = eng_kv_view(pool, 1);
        be->ops->kv_store(be, &view, k, v, slots, N);
        /* two sequences in one call: rows 0..4 are a prefill of positions 6..10
         * of the same history (as after a cached prefix), rows 5..10 a fresh one */
        kern_attn_seq_t seqs[2] = {{0, 5, 6, table, 3, UINT32_MAX}, {5, 6, 0, table, 2, UINT32_MAX}};
        be->ops->attention(be, &view, q, out, H, seqs, NULL, 2, 0.25f);
        double worst = 0;
        for (int row = 0; row < N; row++) {
            int pos = row < 5 ? 6 + row : row - 5;
            for (int h = 0; h < H; h++) {
                int kh = h / 2;
                double sc[N], mx = -1e30, sum = 0;
                for (int p = 0; p <= pos; p++) {
                    double d = 0;
                    for (int i = 0; i < HD; i++) {
                        float kk = stored(dt, k + (p * KVH + kh) * HD, HD, i);
                        /* an fp16 pool: q meets k in fp16 too */
                        float qq = dt == TD_KV_F16 ? kern_fp16_to_fp32(kern_fp32_to_fp16(q[(row * H + h) * HD + i]))
                                                   : q[(row * H + h) * HD + i];
                        d += qq * kk;
                    }
                    sc[p] = d * 0.25;
                    mx = sc[p] > mx ? sc[p] : mx;
                }
                for (int p = 0; p <= pos; p++)
                    sum += sc[p] = exp(sc[p] - mx);
                for (int i = 0; i < HD; i++) {
                    double o = 0;
                    for (int p = 0; p <= pos; p++)
                        o += sc[p] / sum * stored(dt, v + (p * KVH + kh) * HD, HD, i);
                    double e = fabs(o - out[(row * H + h) * HD + i]);
                    worst = e > worst ? e : worst;
                }
            }
        }
        cr_assert_lt(worst, 1e-5, "%s KV: worst error %g", td_kv_dtype_name(dt), worst);
        if (dt == TD_KV_F8_E4M3) { /* the scale of token 9's V row of KV head 1 in layer 1, where the layout says */
            float want = 0, got;
            for (int i = 0; i < HD; i++)
                want = fmaxf(want, fabsf(v[(9 * KVH + 1) * HD + i]));
            memcpy(&got, (uint8_t *)view.base + (size_t)table[2] * td_kv_block_bytes(&g) +
                   td_kv_scale_offset(&g, 1, 1, 1) + 1 * sizeof(float), sizeof got);
            cr_assert_float_eq(got, want / 448.0f, 1e-9f);
        }
        eng_kv_pool_destroy(pool);
    }
    kern_cpu_backend_destroy(be);
}

/* A backend states the KV dtypes it stores (kv_dtypes); a pool of another is refused up front, naming both — as
 * the CUDA backend, whose kernels read fp16 and fp32 KV, refuses fp8_e4m3. */
Test(kernels, a_pool_of_a_kv_dtype_its_backend_lacks_is_refused)
{
    kern_backend_t *be;
    kern_cpu_backend_create(1, &be);
    const kern_backend_ops_t *real = be->ops;
    static kern_backend_ops_t no_fp8;
    no_fp8 = *real;
    no_fp8.kv_dtypes &= ~(1u << TD_KV_F8_E4M3);
    be->ops = &no_fp8;
    td_kv_layout_t g = td_kv_layout_make("test", 2, 2, 16, 4, TD_KV_F8_E4M3);
    eng_kv_pool_t *pool;
    cr_assert_eq(eng_kv_pool_create(be, &g, 8, NULL, &pool), TD_ERR_UNSUPPORTED);
    cr_assert(strstr(td_last_error(), "cpu backend") && strstr(td_last_error(), "fp8_e4m3"), "%s", td_last_error());
    be->ops = real;
    kern_cpu_backend_destroy(be);
}

static void sum_task(void *ctx, int t, int n)
{
    (void)n;
    _Atomic long *s = ctx;
    *s += t + 1;
}

Test(kernels, thread_pool_runs_every_task_once)
{
    kern_pool_t *p;
    cr_assert_eq(kern_pool_create(2, &p), TD_OK);
    for (int rep = 0; rep < 2000; rep++) {
        _Atomic long s = 0;
        int n = 1 + rep % 37;
        kern_pool_run(p, n, sum_task, &s);
        cr_assert_eq(s, (long)n * (n + 1) / 2, "rep %d", rep);
    }
    kern_pool_destroy(p);
}

Test(kernels, kv_pool_refcounts_and_prefix_cache)
{
    kern_backend_t *be;
    kern_cpu_backend_create(1, &be);
    td_kv_layout_t g = td_kv_layout_make("test", 1, 1, 8, 16, TD_KV_F16);
    eng_kv_pool_t *p;
    cr_assert_eq(eng_kv_pool_create(be, &g, 3, NULL, &p), TD_OK);
    int32_t a, b, c, d;
    cr_assert_eq(eng_kv_alloc(p, &a), TD_OK);
    cr_assert_eq(eng_kv_alloc(p, &b), TD_OK);
    cr_assert_eq(eng_kv_alloc(p, &c), TD_OK);
    cr_assert_eq(eng_kv_alloc(p, &d), TD_ERR_NO_MEMORY, "all three in use");
    td_block_name_t n1 = {1, 2}, n2 = {3, 4};
    cr_assert_eq(eng_kv_publish(p, a, n1), a);
    cr_assert_eq(eng_kv_publish(p, b, n1), a, "an equal block is cached already");
    eng_kv_unref(p, a);
    cr_assert_eq(eng_kv_stats(p).cached, 1);
    cr_assert_eq(eng_kv_lookup(p, n1), a, "found by name");
    cr_assert_eq(eng_kv_stats(p).cached, 0);
    eng_kv_unref(p, a);
    eng_kv_publish(p, c, n2);
    eng_kv_unref(p, c);
    cr_assert_eq(eng_kv_stats(p).cached, 2);
    cr_assert_eq(eng_kv_alloc(p, &d), TD_OK);
    cr_assert_eq(d, a, "the least recently used cached block is evicted first");
    cr_assert_eq(eng_kv_lookup(p, n1), -1, "and its name is gone");
    cr_assert_eq(eng_kv_lookup(p, n2), c);
    eng_kv_pool_destroy(p);
    kern_cpu_backend_destroy(be);
}

Test(kernels, sampler_filters_and_seed)
{
    enum { V = 1000 };
    static float logits[V];
    for (int i = 0; i < V; i++)
        logits[i] = -5 + 0.001f * i;
    logits[7] = 10, logits[8] = 9.5f, logits[9] = 9;
    eng_sampling_t p = eng_sampling_default();
    eng_sampler_t s;
    cr_assert_eq(eng_sampler_init(&s, &p, V), TD_OK);
    cr_assert_eq(eng_sampler_sample(&s, logits, NULL, 0), 7, "greedy");
    eng_sampler_free(&s);
    p.temperature = 1;
    p.top_k = 2;
    eng_sampler_init(&s, &p, V);
    for (int i = 0; i < 200; i++) {
        int32_t t = eng_sampler_sample(&s, logits, NULL, 0);
        cr_assert(t == 7 || t == 8, "top_k 2 keeps 7 and 8, got %d", t);
    }
    eng_sampler_free(&s);
    p.top_k = 0;
    p.min_p = 0.5f; /* e^-0.5 = 0.61 and e^-1 = 0.37 of the top: keeps 7 and 8 */
    eng_sampler_init(&s, &p, V);
    for (int i = 0; i < 200; i++) {
        int32_t t = eng_sampler_sample(&s, logits, NULL, 0);
        cr_assert(t == 7 || t == 8, "min_p keeps 7 and 8, got %d", t);
    }
    eng_sampler_free(&s);
    p.min_p = 0;
    p.top_p = 0.5f;
    eng_sampler_init(&s, &p, V);
    for (int i = 0; i < 100; i++)
        cr_assert_eq(eng_sampler_sample(&s, logits, NULL, 0), 7, "top_p 0.5: token 7 alone holds over half");
    eng_sampler_free(&s);
    p = eng_sampling_default();
    p.repetition_penalty = 2; /* 10 / 2 = 5 < 9.5 */
    int32_t hist[] = {7};
    cr_assert_eq(eng_sampler_init(&s, &p, V), TD_OK);
    cr_assert_eq(eng_sampler_sample(&s, logits, hist, 1), 8, "a repeated token is penalized");
    eng_sampler_free(&s);
    eng_logit_bias_t lb = {9, 5};
    p = eng_sampling_default();
    p.logit_bias = &lb;
    p.n_logit_bias = 1;
    cr_assert_eq(eng_sampler_init(&s, &p, V), TD_OK);
    cr_assert_eq(eng_sampler_sample(&s, logits, NULL, 0), 9, "logit bias");
    eng_sampler_free(&s);
    /* the draw follows the probabilities: P(7) = e^0.5 / (e^0.5 + 1) = 0.62 with top_k 2 */
    p = eng_sampling_default();
    p.temperature = 1;
    p.top_k = 2;
    p.seed = 9;
    eng_sampler_init(&s, &p, V);
    int hits = 0;
    for (int i = 0; i < 4000; i++)
        hits += eng_sampler_sample(&s, logits, NULL, 0) == 7;
    cr_assert(fabs(hits / 4000.0 - 0.6225) < 0.03, "P(7) = %.3f", hits / 4000.0);
    eng_sampler_free(&s);
}

/* The CPU backend's block digests are the KV contract's (td_kv_block_digest,
 * XXH3 over the block's bytes), for the blocks named, in their order; a
 * changed byte changes its block's digest only. */
Test(kernels, kv_digest_is_the_contracts_on_the_cpu)
{
    kern_backend_t *be;
    kern_cpu_backend_create(1, &be);
    enum { BB = 4096, NB = 5 };
    uint8_t *pool = malloc(BB * NB);
    for (size_t i = 0; i < BB * NB; i++)
        pool[i] = (uint8_t)(i * 131 + i / 7);
    int32_t blocks[3] = {4, 0, 2};
    uint64_t d[3], e[3];
    cr_assert_eq(be->ops->kv_digest(be, pool, BB, blocks, 3, d), TD_OK);
    for (int i = 0; i < 3; i++)
        cr_assert_eq(d[i], td_kv_block_digest(pool + (size_t)blocks[i] * BB, BB));
    cr_assert_neq(d[0], d[1]);
    pool[2 * BB + 100] ^= 1;
    cr_assert_eq(be->ops->kv_digest(be, pool, BB, blocks, 3, e), TD_OK);
    cr_assert(e[0] == d[0] && e[1] == d[1] && e[2] != d[2]);
    cr_assert_null(be->ops->queue(be), "the CPU backend's ops are done when they return");
    free(pool);
    kern_cpu_backend_destroy(be);
}
