/* test_tp.c — tensor parallelism on the CPU backend (engine/shard.h,
 * engine/tp.h, kernels/comm.h, common/kv_contract.h's parts): the split a
 * model allows and the ones it refuses; the cut of a quantized matrix's
 * columns; a rank's part of a KV block against the canonical layout's own
 * index arithmetic, byte for byte, and blocks landing between TP degrees
 * (TP2 -> TP1, TP1 -> TP2, a replicated KV head); the all-reduce's sum, its
 * deadline and a rank's abort; and tiny-llama3 run at TP 2 and 4 against
 * the same model unsplit: logits, greedy tokens and the KV its ranks wrote. */
#include <criterion/criterion.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/kv_contract.h"
#include "common/log.h"
#include "engine/engine.h"
#include "engine/forward.h"
#include "engine/kv_pool.h"
#include "engine/model.h"
#include "engine/shard.h"
#include "engine/tp.h"
#include "engine/weights.h"
#include "helpers.h"
#include "kernels/comm.h"
#include "kernels/quant.h"

#define TINY FIXTURE("hf/tiny-llama3")

static eng_model_desc_t shape(uint32_t heads, uint32_t kv, uint32_t hd, uint32_t ffn, uint32_t vocab)
{
    eng_model_desc_t d = {.n_layers = 2, .hidden = heads * hd, .n_heads = heads, .n_kv_heads = kv, .head_dim = hd,
                          .ffn = ffn, .vocab = vocab};
    strcpy(d.name, "shape");
    return d;
}

Test(tp, the_split_a_model_allows)
{
    const eng_model_desc_t d = shape(32, 8, 128, 14336, 128256); /* Llama-3-8B */
    eng_shard_t s;
    cr_assert_eq(eng_shard_plan(&d, 2, 1, 32, &s), TD_OK);
    cr_assert(s.q_head0 == 16 && s.q_heads == 16 && s.kv_head0 == 4 && s.kv_heads == 4);
    cr_assert(s.ffn0 == 7168 && s.ffn == 7168 && s.vocab0 == 64128 && s.vocab == 64128);
    /* more ranks than KV heads: one each, replicated over the ranks whose query heads use it */
    cr_assert_eq(eng_shard_plan(&d, 16, 5, 1, &s), TD_OK);
    cr_assert(s.q_head0 == 10 && s.q_heads == 2 && s.kv_head0 == 2 && s.kv_heads == 1);
    for (uint32_t r = 0; r < 16; r++) { /* each rank's query heads use its KV head (GQA: 4 a KV head) */
        cr_assert_eq(eng_shard_plan(&d, 16, r, 1, &s), TD_OK);
        cr_assert_eq(s.q_head0 / 4, s.kv_head0, "rank %u", r);
        cr_assert_eq((s.q_head0 + s.q_heads - 1) / 4, s.kv_head0, "rank %u", r);
    }
    /* a vocabulary that does not divide: the last rank takes the rest, every row once */
    const eng_model_desc_t t = shape(4, 2, 16, 128, 601);
    uint32_t next = 0;
    for (uint32_t r = 0; r < 4; r++) {
        cr_assert_eq(eng_shard_plan(&t, 4, r, 1, &s), TD_OK);
        cr_assert_eq(s.vocab0, next);
        next += s.vocab;
    }
    cr_assert_eq(next, 601);
}

Test(tp, splits_the_model_does_not_allow_are_refused_naming_the_numbers)
{
    eng_shard_t s;
    const eng_model_desc_t smol = shape(9, 3, 64, 1536, 49152);
    cr_assert_eq(eng_shard_plan(&smol, 2, 0, 32, &s), TD_ERR_INVALID_ARG);
    cr_assert(strstr(td_last_error(), "9 attention heads do not divide over 2 ranks"), "%s", td_last_error());
    const eng_model_desc_t kv3 = shape(12, 3, 64, 1536, 100);
    cr_assert_eq(eng_shard_plan(&kv3, 2, 0, 1, &s), TD_ERR_INVALID_ARG);
    cr_assert(strstr(td_last_error(), "3 KV heads"), "%s", td_last_error());
    const eng_model_desc_t tiny = shape(4, 2, 16, 128, 600);
    cr_assert_eq(eng_shard_plan(&tiny, 4, 0, 32, &s), TD_ERR_INVALID_ARG); /* 16 columns of O a rank */
    cr_assert(strstr(td_last_error(), "not whole quantization blocks of 32"), "%s", td_last_error());
    cr_assert_eq(eng_shard_plan(&tiny, 2, 2, 1, &s), TD_ERR_INVALID_ARG);
    cr_assert_eq(eng_shard_plan(&tiny, 4, 3, 1, &s), TD_OK);
}

/* SmolLM2's FFN (1536 columns, Q4_1 in the file) split in two by columns, as tensor parallelism cuts down: each
 * rank's rows are the whole matrix's rows' halves, value for value */
Test(tp, a_quantized_matrix_cut_by_columns_keeps_each_rows_values)
{
    require_default_model();
    eng_model_t *m;
    kern_backend_t *be;
    cr_assert_eq(eng_model_open(DEFAULT_MODEL, &m), TD_OK);
    cr_assert_eq(kern_cpu_backend_create_numerics(1, KERN_NUMERICS_REFERENCE, &be), TD_OK); /* no repacking */
    cr_assert_eq(eng_weights_col_block(m), 32);
    eng_weights_t whole, part[2];
    cr_assert_eq(eng_weights_bind(m, be, &whole), TD_OK);
    const uint32_t hid = m->desc.hidden, ffn = m->desc.ffn;
    float *a = malloc(ffn * sizeof *a), *b = malloc(ffn * sizeof *b);
    for (uint32_t r = 0; r < 2; r++) {
        eng_shard_t s = eng_shard_whole(&m->desc);
        s.tp = 2, s.rank = r, s.ffn0 = r * ffn / 2, s.ffn = ffn / 2; /* the FFN alone cut (9 heads do not divide) */
        cr_assert_eq(eng_weights_bind_shard(m, be, &s, &part[r]), TD_OK, "%s", td_last_error());
        const kern_weight_t *wd = &whole.layers[3].w_down, *pd = &part[r].layers[3].w_down;
        const kern_weight_t *wg = &whole.layers[3].w_gate, *pg = &part[r].layers[3].w_gate;
        cr_assert(pd->rows == hid && pd->cols == ffn / 2 && pg->rows == ffn / 2 && pg->cols == hid);
        const kern_type_info_t *ti = kern_type_info(wd->type);
        const size_t wrow = ffn / ti->block_elems * ti->block_bytes, prow = wrow / 2;
        for (uint32_t row = 0; row < hid; row += 97) {
            cr_assert_eq(kern_dequant_row(wd->type, (const uint8_t *)wd->data + row * wrow, a, ffn), TD_OK);
            cr_assert_eq(kern_dequant_row(pd->type, (const uint8_t *)pd->data + row * prow, b, ffn / 2), TD_OK);
            cr_assert(!memcmp(a + s.ffn0, b, ffn / 2 * sizeof *a), "down row %u, rank %u", row, r);
        }
        const kern_type_info_t *tg = kern_type_info(wg->type);
        const size_t grow = hid / tg->block_elems * tg->block_bytes;
        cr_assert(!memcmp((const uint8_t *)wg->data + (size_t)s.ffn0 * grow, pg->data, (size_t)(ffn / 2) * grow),
                  "gate rows, rank %u", r);
    }
    for (int r = 0; r < 2; r++)
        eng_weights_release(&part[r], be);
    eng_weights_release(&whole, be);
    free(a), free(b);
    kern_cpu_backend_destroy(be);
    eng_model_close(m);
}

/* The byte of value (layer, which, head, token, d) in a block of g: the canonical layout's definition, written
 * out; fp8's scale of (layer, which, head, token) with d = UINT32_MAX, byte by byte (k). */
static size_t canon(const td_kv_layout_t *g, uint32_t l, uint32_t which, uint32_t h, uint32_t t, uint32_t d,
                    uint32_t k)
{
    const size_t es = td_kv_dtype_size(g->dtype), bt = g->block_tokens, hd = g->head_dim, H = g->n_kv_heads;
    const size_t rows = 2 * H * bt * hd * es, scales = g->dtype == TD_KV_F8_E4M3 ? 2 * H * bt * 4 : 0;
    const size_t layer = l * (rows + scales);
    if (d == UINT32_MAX)
        return layer + rows + ((which * H + h) * bt + t) * 4 + k;
    return layer + (((which * H + h) * bt + t) * hd + d) * es + k;
}

/* every byte of the part of heads [h0, h0 + n) equals the whole block's byte the definition names */
static void expect_part(const td_kv_layout_t *g, uint32_t h0, uint32_t n, const uint8_t *part, const uint8_t *block)
{
    const td_kv_layout_t p = td_kv_part_layout(g, n);
    const size_t es = td_kv_dtype_size(g->dtype);
    for (uint32_t l = 0; l < g->n_layers; l++)
        for (uint32_t w = 0; w < 2; w++)
            for (uint32_t h = 0; h < n; h++)
                for (uint32_t t = 0; t < g->block_tokens; t++) {
                    for (uint32_t d = 0; d < g->head_dim; d++)
                        for (uint32_t k = 0; k < es; k++)
                            cr_assert_eq(part[canon(&p, l, w, h, t, d, k)], block[canon(g, l, w, h0 + h, t, d, k)],
                                         "%s layer %u %c head %u token %u dim %u", td_kv_dtype_name(g->dtype), l,
                                         "KV"[w], h0 + h, t, d);
                    for (uint32_t k = 0; g->dtype == TD_KV_F8_E4M3 && k < 4; k++)
                        cr_assert_eq(part[canon(&p, l, w, h, t, UINT32_MAX, k)],
                                     block[canon(g, l, w, h0 + h, t, UINT32_MAX, k)]);
                }
}

Test(tp, a_ranks_part_of_a_block_lands_between_tp_degrees_byte_for_byte)
{
    const td_kv_dtype_t dts[] = {TD_KV_F16, TD_KV_F32, TD_KV_F8_E4M3};
    for (int i = 0; i < 3; i++) {
        const td_kv_layout_t g = td_kv_layout_make("m", 3, 4, 8, 16, dts[i]);
        const size_t bb = td_kv_block_bytes(&g);
        uint8_t *whole = malloc(bb), *landed = malloc(bb), *parts[4];
        for (size_t k = 0; k < bb; k++)
            whole[k] = (uint8_t)(rand() & 0xff);
        /* TP1 -> TP2: each rank takes its two heads out of the whole block */
        for (uint32_t r = 0; r < 2; r++) {
            const td_kv_layout_t p = td_kv_part_layout(&g, 2);
            parts[r] = malloc(td_kv_block_bytes(&p));
            td_kv_block_to_part(&g, 2 * r, 2, whole, parts[r]);
            expect_part(&g, 2 * r, 2, parts[r], whole);
        }
        /* TP2 -> TP1: each rank puts its heads into the landing block, which then is the whole, byte for byte */
        memset(landed, 0, bb);
        for (uint32_t r = 0; r < 2; r++)
            td_kv_part_to_block(&g, 2 * r, 2, parts[r], landed);
        cr_assert(!memcmp(landed, whole, bb), "%s: TP2 -> TP1", td_kv_dtype_name(g.dtype));
        /* the runs cover every byte of the block once */
        td_kv_run_t runs[3 * TD_KV_RUNS_PER_LAYER];
        size_t covered = 0;
        for (uint32_t r = 0; r < 2; r++) {
            const uint32_t n = td_kv_part_runs(&g, 2 * r, 2, runs);
            cr_assert_eq(n, 3 * (dts[i] == TD_KV_F8_E4M3 ? 4 : 2));
            for (uint32_t k = 0; k < n; k++)
                covered += runs[k].bytes;
        }
        cr_assert_eq(covered, bb);
        for (int r = 0; r < 2; r++)
            free(parts[r]);
        /* a replicated KV head (a model of 2 KV heads at TP4): ranks 2k and 2k + 1 hold head k; a TP4 sender's
         * first rank of each head lands it, a TP4 receiver's ranks take theirs */
        const td_kv_layout_t g2 = td_kv_layout_make("m", 3, 2, 8, 16, dts[i]), p1 = td_kv_part_layout(&g2, 1);
        const size_t bb2 = td_kv_block_bytes(&g2);
        for (uint32_t r = 0; r < 4; r++) {
            parts[r] = malloc(td_kv_block_bytes(&p1));
            td_kv_block_to_part(&g2, r / 2, 1, whole, parts[r]);
            expect_part(&g2, r / 2, 1, parts[r], whole);
        }
        cr_assert(!memcmp(parts[0], parts[1], td_kv_block_bytes(&p1)) &&
                  !memcmp(parts[2], parts[3], td_kv_block_bytes(&p1)));
        memset(landed, 0, bb2);
        td_kv_part_to_block(&g2, 0, 1, parts[0], landed);
        td_kv_part_to_block(&g2, 1, 1, parts[2], landed);
        cr_assert(!memcmp(landed, whole, bb2), "%s: TP4 (replicated) -> TP1", td_kv_dtype_name(g.dtype));
        for (int r = 0; r < 4; r++)
            free(parts[r]);
        free(whole), free(landed);
    }
}

/* The sender's pieces (a TP1 sender's: a layer's slice each; a TP2 sender's: its runs) put into a receiver's parts
 * as the prefill worker puts them (td_kv_part_overlap of each piece with each part): every part then equals the
 * whole block's heads it holds, byte for byte — TP1 -> TP2, TP2 -> TP2, TP2 -> TP4 (a head a rank), and a model of
 * 2 KV heads into TP4 (each head on two ranks). */
static void land_in_parts(const td_kv_layout_t *g, const uint8_t *whole, uint32_t sender_tp, uint32_t receiver_tp)
{
    const uint32_t H = g->n_kv_heads;
    const uint32_t rh = H >= receiver_tp ? H / receiver_tp : 1, sh = H >= sender_tp ? H / sender_tp : 1;
    const td_kv_layout_t rp = td_kv_part_layout(g, rh);
    uint8_t *parts[4];
    for (uint32_t r = 0; r < receiver_tp; r++)
        memset(parts[r] = malloc(td_kv_block_bytes(&rp)), 0xee, td_kv_block_bytes(&rp));
    /* the sender's pieces: (offset in the whole block, bytes), with their bytes taken from the whole block */
    size_t n_pieces = 0, offs[64], lens[64];
    if (sender_tp == 1)
        for (uint32_t l = 0; l < g->n_layers; l++)
            offs[n_pieces] = l * td_kv_layer_bytes(g), lens[n_pieces++] = td_kv_layer_bytes(g);
    else
        for (uint32_t s = 0; s < sender_tp; s++) {
            td_kv_run_t runs[8 * TD_KV_RUNS_PER_LAYER];
            if (H < sender_tp && s % (sender_tp / H)) /* a replicated head goes from its first rank */
                continue;
            for (uint32_t k = 0, n = td_kv_part_runs(g, H >= sender_tp ? s * sh : s / (sender_tp / H), sh, runs);
                 k < n; k++)
                offs[n_pieces] = runs[k].block_off, lens[n_pieces++] = runs[k].bytes;
        }
    size_t put = 0;
    for (size_t i = 0; i < n_pieces; i++)
        for (uint32_t r = 0; r < receiver_tp; r++) {
            const uint32_t h0 = H >= receiver_tp ? r * rh : r / (receiver_tp / H);
            td_kv_run_t o[TD_KV_RUNS_PER_LAYER];
            for (uint32_t k = 0, n = td_kv_part_overlap(g, h0, rh, offs[i], lens[i], o, TD_KV_RUNS_PER_LAYER); k < n;
                 k++) {
                cr_assert(o[k].block_off >= offs[i] && o[k].block_off + o[k].bytes <= offs[i] + lens[i]);
                memcpy(parts[r] + o[k].part_off, whole + o[k].block_off, o[k].bytes);
                put += o[k].bytes;
            }
        }
    for (uint32_t r = 0; r < receiver_tp; r++) {
        expect_part(g, H >= receiver_tp ? r * rh : r / (receiver_tp / H), rh, parts[r], whole);
        free(parts[r]);
    }
    /* each receiver got its part once: the parts' bytes, no more */
    cr_assert_eq(put, receiver_tp * td_kv_block_bytes(&rp), "%s: TP%u -> TP%u put %zu bytes",
                 td_kv_dtype_name(g->dtype), sender_tp, receiver_tp, put);
}

Test(tp, a_senders_pieces_land_in_a_receivers_parts_byte_for_byte)
{
    const td_kv_dtype_t dts[] = {TD_KV_F16, TD_KV_F32, TD_KV_F8_E4M3};
    for (int i = 0; i < 3; i++) {
        const td_kv_layout_t g = td_kv_layout_make("m", 3, 4, 8, 16, dts[i]), g2 = td_kv_layout_make("m", 3, 2, 8, 16,
                                                                                                      dts[i]);
        const size_t bb = td_kv_block_bytes(&g);
        uint8_t *whole = malloc(bb);
        for (size_t k = 0; k < bb; k++)
            whole[k] = (uint8_t)(rand() & 0xff);
        land_in_parts(&g, whole, 1, 2);
        land_in_parts(&g, whole, 2, 2);
        land_in_parts(&g, whole, 2, 4);
        land_in_parts(&g, whole, 4, 2);
        land_in_parts(&g2, whole, 1, 4);
        land_in_parts(&g2, whole, 4, 2);
        /* a range across layers is cut at the parts' runs of each */
        td_kv_run_t o[3 * TD_KV_RUNS_PER_LAYER];
        const uint32_t n = td_kv_part_overlap(&g, 1, 2, 0, bb, o, 3 * TD_KV_RUNS_PER_LAYER);
        cr_assert_eq(n, 3 * (dts[i] == TD_KV_F8_E4M3 ? 4 : 2));
        cr_assert_eq(td_kv_part_overlap(&g, 1, 2, 0, bb, o, 2), 2, "at most max runs");
        free(whole);
    }
}

/* The contract between peers of different degrees: whole blocks move between them, so another degree is a peer
 * like any other; a degree whose ranks could not each hold whole KV heads is refused, naming both sides' */
Test(tp, the_kv_contract_takes_any_mappable_degree_and_refuses_the_others_naming_both)
{
    td_kv_layout_t one = td_kv_layout_make("m", 32, 8, 128, 16, TD_KV_F16), peer = one;
    cr_assert_eq(one.tp, 1);
    for (uint32_t tp = 1; tp <= 16; tp *= 2) { /* 8 KV heads: 8, 4, 2, 1 a rank, or one replicated over 2 */
        peer.tp = tp;
        cr_assert_eq(td_kv_contract_check(&one, &peer, "prefill-1"), TD_OK, "tp %u: %s", tp, td_last_error());
        cr_assert_eq(td_kv_contract_check(&peer, &one, "decode-1"), TD_OK, "tp %u: %s", tp, td_last_error());
    }
    peer.tp = 3;
    cr_assert_eq(td_kv_contract_check(&one, &peer, "prefill-1"), TD_ERR_CONFIG);
    cr_assert(strstr(td_last_error(), "tp: here 1 (8 KV heads), peer 3") &&
              strstr(td_last_error(), "cannot be mapped"), "%s", td_last_error());
    peer.tp = 12; /* more ranks than heads, but not a whole number of ranks a head */
    cr_assert_eq(td_kv_contract_check(&one, &peer, "prefill-1"), TD_ERR_CONFIG);
    /* an engine's contract states its degree */
    eng_model_t *m;
    eng_engine_t *e;
    cr_assert_eq(eng_model_open(TINY, &m), TD_OK);
    eng_engine_config_t cfg = eng_engine_config_default();
    cfg.tp = 2, cfg.n_threads = 1, cfg.kv_tokens = 256;
    cr_assert_eq(eng_engine_create(m, &cfg, &e), TD_OK, "%s", td_last_error());
    td_kv_layout_t c = eng_engine_kv_contract(e);
    cr_assert(c.tp == 2 && c.n_kv_heads == 2, "tp %u, %u KV heads", c.tp, c.n_kv_heads);
    cr_assert_eq(eng_engine_kv_stats(e).block_bytes, td_kv_block_bytes(&c)); /* whole blocks, as the wire has them */
    eng_engine_destroy(e);
    eng_model_close(m);
}

/* ---- the all-reduce ---- */

typedef struct job {
    kern_comm_t *c;
    kern_backend_t *be;
    uint32_t rank, calls;
    bool stop_early; /* this rank aborts before its second call */
    float buf[1000];
    td_status_t rc;
} job_t;

static void *ranker(void *arg)
{
    job_t *j = arg;
    for (uint32_t call = 0; call < j->calls; call++) {
        if (j->stop_early && call == 1) {
            j->c->ops->abort(j->c, j->rank);
            return NULL;
        }
        for (int i = 0; i < 1000; i++)
            j->buf[i] = (float)(j->rank + 1) * (float)(i + call);
        if ((j->rc = j->c->ops->all_reduce(j->c, j->rank, j->be, j->buf, 1000)))
            return NULL;
        for (int i = 0; i < 1000; i++) /* 1 + 2 + 3 = 6 times (i + call), exactly */
            if (j->buf[i] != 6.0f * (float)(i + call)) {
                j->rc = TD_ERR_INTERNAL;
                return NULL;
            }
    }
    return NULL;
}

static double run_ranks(job_t *jobs, uint32_t n)
{
    static kern_backend_t *bes[3];
    for (uint32_t r = 0; r < 3; r++)
        if (!bes[r])
            cr_assert_eq(kern_cpu_backend_create(1, &bes[r]), TD_OK);
    for (uint32_t r = 0; r < n; r++)
        jobs[r].be = bes[r];
    pthread_t th[3];
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (uint32_t r = 0; r < n; r++)
        pthread_create(&th[r], NULL, ranker, &jobs[r]);
    for (uint32_t r = 0; r < n; r++)
        pthread_join(th[r], NULL);
    clock_gettime(CLOCK_MONOTONIC, &b);
    return (double)(b.tv_sec - a.tv_sec) + (double)(b.tv_nsec - a.tv_nsec) / 1e9;
}

Test(tp, the_all_reduce_sums_every_rank_waits_with_a_deadline_and_ends_on_an_abort)
{
    kern_comm_t *c;
    static job_t jobs[3];
    cr_assert_eq(kern_comm_memory_create(3, 300, &c), TD_OK);
    for (uint32_t r = 0; r < 3; r++)
        jobs[r] = (job_t){.c = c, .rank = r, .calls = 50};
    run_ranks(jobs, 3);
    for (uint32_t r = 0; r < 3; r++)
        cr_assert_eq(jobs[r].rc, TD_OK, "rank %u: %s", r, td_last_error());
    c->ops->destroy(c);
    /* rank 2 stops after one call: the others' second call ends with its name, long before the deadline */
    cr_assert_eq(kern_comm_memory_create(3, 5000, &c), TD_OK);
    for (uint32_t r = 0; r < 3; r++)
        jobs[r] = (job_t){.c = c, .rank = r, .calls = 3, .stop_early = r == 2};
    double s = run_ranks(jobs, 3);
    cr_assert(jobs[0].rc == TD_ERR_UNAVAILABLE && jobs[1].rc == TD_ERR_UNAVAILABLE, "%d %d", jobs[0].rc, jobs[1].rc);
    cr_assert_lt(s, 2.0);
    c->ops->destroy(c);
    /* a rank that never comes: the others wait 300 ms, no more */
    cr_assert_eq(kern_comm_memory_create(3, 300, &c), TD_OK);
    for (uint32_t r = 0; r < 2; r++)
        jobs[r] = (job_t){.c = c, .rank = r, .calls = 1};
    s = run_ranks(jobs, 2);
    cr_assert(jobs[0].rc == TD_ERR_TIMEOUT || jobs[1].rc == TD_ERR_TIMEOUT);
    cr_assert(jobs[0].rc != TD_OK && jobs[1].rc != TD_OK);
    cr_assert(s >= 0.29 && s < 3.0, "%.3f s", s);
    c->ops->destroy(c);
}

/* the gather: 3 ranks' columns of 4 rows (7, 7 and 3 of them, as a vocabulary of 17 splits) side by side in rank
 * 0's rows; a rank that brings another number of rows is refused on every rank, naming both */
typedef struct gjob {
    kern_comm_t *c;
    kern_backend_t *be;
    uint32_t rank, rows;
    float part[4 * 7], whole[4 * 17];
    td_status_t rc;
    char err[200]; /* the rank's error (td_last_error is a thread's own) */
} gjob_t;

static void *gatherer(void *arg)
{
    gjob_t *j = arg;
    static const uint32_t cols[3] = {7, 7, 3};
    for (uint32_t i = 0; i < j->rows; i++)
        for (uint32_t k = 0; k < cols[j->rank]; k++)
            j->part[i * cols[j->rank] + k] = (float)(j->rank * 1000 + i * 100 + k);
    j->rc = j->c->ops->gather_cols(j->c, j->rank, j->be, j->part, j->rows, cols, j->rank ? NULL : j->whole, NULL);
    snprintf(j->err, sizeof j->err, "%s", j->rc ? td_last_error() : "");
    return NULL;
}

Test(tp, the_gather_puts_each_ranks_columns_at_their_place_in_rank_0s_rows)
{
    static const uint32_t cols[3] = {7, 7, 3}, off[3] = {0, 7, 14};
    static gjob_t jobs[3];
    kern_backend_t *bes[3];
    for (uint32_t r = 0; r < 3; r++)
        cr_assert_eq(kern_cpu_backend_create(1, &bes[r]), TD_OK);
    for (int round = 0; round < 2; round++) {
        kern_comm_t *c;
        cr_assert_eq(kern_comm_memory_create(3, 5000, &c), TD_OK);
        pthread_t th[3];
        for (uint32_t r = 0; r < 3; r++) {
            jobs[r] = (gjob_t){.c = c, .be = bes[r], .rank = r, .rows = round && r == 2 ? 3 : 4};
            pthread_create(&th[r], NULL, gatherer, &jobs[r]);
        }
        for (uint32_t r = 0; r < 3; r++)
            pthread_join(th[r], NULL);
        if (round == 0) {
            for (uint32_t r = 0; r < 3; r++)
                cr_assert_eq(jobs[r].rc, TD_OK, "rank %u: %s", r, jobs[r].err);
            for (uint32_t r = 0; r < 3; r++)
                for (uint32_t i = 0; i < 4; i++)
                    for (uint32_t k = 0; k < cols[r]; k++)
                        cr_assert_eq(jobs[0].whole[i * 17 + off[r] + k], (float)(r * 1000 + i * 100 + k),
                                     "row %u, rank %u's column %u", i, r, k);
        } else {
            for (uint32_t r = 0; r < 3; r++)
                cr_assert(jobs[r].rc != TD_OK && strstr(jobs[r].err, "a gather of") &&
                              (strstr(jobs[r].err, "3 on rank 2") || strstr(jobs[r].err, "3 rows on rank 2")),
                          "rank %u: %s", r, jobs[r].err);
        }
        c->ops->destroy(c);
    }
    for (uint32_t r = 0; r < 3; r++)
        kern_backend_destroy(bes[r]);
}

/* ---- the model split ---- */

enum { PROMPT = 21, STEPS = 12, NB = 4, BT = 16 };

/* tiny-llama3 at tp ranks (1: the plain forward): the prompt's last logits row, then STEPS greedy tokens, each
 * step's logits kept (logits [(STEPS + 1)][vocab]); each rank's pool left for the caller (pools[r]) */
static void run_tiny(const eng_model_t *m, uint32_t tp, td_kv_dtype_t dt, float *logits, int32_t *toks,
                     kern_backend_t **bes, eng_kv_pool_t **pools)
{
    const eng_model_desc_t *d = &m->desc;
    const td_kv_layout_t g = td_kv_layout_make(m->kv_id, d->n_layers, d->n_kv_heads, d->head_dim, BT, dt);
    kern_comm_t *c = NULL;
    eng_tp_t *t = NULL;
    eng_forward_t *f = NULL;
    if (tp > 1)
        cr_assert_eq(kern_comm_memory_create(tp, 30000, &c), TD_OK);
    for (uint32_t r = 0; r < tp; r++) {
        eng_shard_t s = eng_shard_whole(d);
        if (tp > 1)
            cr_assert_eq(eng_shard_plan(d, tp, r, 1, &s), TD_OK);
        const td_kv_layout_t p = td_kv_part_layout(&g, s.kv_heads);
        cr_assert_eq(kern_cpu_backend_create(1, &bes[r]), TD_OK);
        cr_assert_eq(eng_kv_pool_create(bes[r], &p, NB, NULL, &pools[r]), TD_OK);
        const kern_kv_view_t v = eng_kv_view(pools[r], 0); /* what no token writes compares equal */
        memset(v.base, 0, NB * v.block_bytes);
    }
    if (tp > 1)
        cr_assert_eq(eng_tp_create(m, tp, bes, pools, c, 64, 4, &t), TD_OK, "%s", td_last_error());
    else
        cr_assert_eq(eng_forward_create(m, bes[0], pools[0], 64, 4, &f), TD_OK);
    int32_t ids[PROMPT + STEPS], table[NB] = {2, 0, 3, 1};
    for (int i = 0; i < PROMPT; i++)
        ids[i] = (int32_t)((i * 37 + 11) % d->vocab);
    for (int step = 0; step <= STEPS; step++) {
        const uint32_t pos0 = step ? PROMPT + step - 1 : 0, n = step ? 1 : PROMPT;
        eng_batch_seq_t s = {.tokens = ids + pos0, .n = n, .pos0 = pos0, .block_table = table, .n_blocks = NB,
                             .want_logits = true};
        const float *lg;
        uint32_t nl;
        cr_assert_eq(tp > 1 ? eng_tp_run(t, &s, 1, &lg, &nl) : eng_forward_run(f, &s, 1, &lg, &nl), TD_OK, "%s",
                     td_last_error());
        cr_assert_eq(nl, 1);
        memcpy(logits + (size_t)step * d->vocab, lg, d->vocab * sizeof *lg);
        uint32_t best = 0;
        for (uint32_t v = 1; v < d->vocab; v++)
            best = lg[v] > lg[best] ? v : best;
        toks[step] = (int32_t)best;
        if (step < STEPS)
            ids[PROMPT + step] = (int32_t)best;
    }
    eng_tp_destroy(t);
    eng_forward_destroy(f);
    if (c)
        c->ops->destroy(c);
}

static double rel(const float *a, const float *b, size_t n)
{
    double d = 0, q = 0;
    for (size_t i = 0; i < n; i++)
        d += ((double)a[i] - b[i]) * ((double)a[i] - b[i]), q += (double)b[i] * b[i];
    return q > 0 ? sqrt(d / q) : d > 0 ? INFINITY : 0; /* a block no token reached: zeros on both sides */
}

/* tiny-llama3 (2 KV heads of 16 values: TP 2), or its shape widened to heads of 64 values with the dummy load
 * format's seeded weights (TP 2, and TP 4 with each KV head on two ranks) */
static eng_model_t *open_tiny(bool wide, char *dir)
{
    eng_model_t *m;
    if (!wide) {
        cr_assert_eq(eng_model_open(TINY, &m), TD_OK);
        return m;
    }
    strcpy(dir, "/tmp/tandem-tp-XXXXXX");
    cr_assert(mkdtemp(dir));
    char path[512], cmd[1200];
    snprintf(cmd, sizeof cmd, "cp %s/tokenizer.json %s/ && sed -e 's/\"hidden_size\": 64/\"hidden_size\": 256/' "
             "-e 's/\"intermediate_size\": 128/\"intermediate_size\": 512/' %s/config.json > %s/config.json",
             TINY, dir, TINY, dir);
    cr_assert_eq(system(cmd), 0);
    cr_assert_eq(eng_model_open(dir, &m), TD_OK, "%s", td_last_error());
    eng_model_set_dummy(m, true);
    cr_assert(m->desc.head_dim == 64 && m->desc.ffn == 512, "%u %u", m->desc.head_dim, m->desc.ffn);
    snprintf(path, sizeof path, "rm -rf %s", dir);
    cr_assert_eq(system(path), 0);
    return m;
}

static void tp_matches_unsplit(bool wide)
{
    char dir[64];
    eng_model_t *m = open_tiny(wide, dir);
    const eng_model_desc_t *d = &m->desc;
    const size_t nlg = (size_t)(STEPS + 1) * d->vocab;
    float *l1 = malloc(nlg * sizeof *l1), *lt = malloc(nlg * sizeof *lt);
    int32_t t1[STEPS + 1], tt[STEPS + 1];
    kern_backend_t *b1[1], *bt[4];
    eng_kv_pool_t *p1[1], *pt[4];
    run_tiny(m, 1, TD_KV_F32, l1, t1, b1, p1);
    const td_kv_layout_t g = *eng_kv_layout(p1[0]);
    const size_t bb = td_kv_block_bytes(&g);
    uint8_t *landed = malloc(bb);
    for (uint32_t tp = 2; tp <= (wide ? 4 : 2); tp += 2) {
        run_tiny(m, tp, TD_KV_F32, lt, tt, bt, pt);
        const double e = rel(lt, l1, nlg);
        cr_assert_lt(e, 1e-5, "tp %u: logits rel err %.3g", tp, e);
        cr_assert(!memcmp(tt, t1, sizeof tt), "tp %u: greedy tokens differ", tp);
        /* the ranks' parts of each block put together are the unsplit pool's block (the ranks' sums add in
         * another order: within rounding); a replicated head's two copies are equal */
        for (int32_t b = 0; b < NB; b++) {
            memset(landed, 0, bb);
            for (uint32_t r = 0; r < tp; r++) {
                const kern_kv_view_t v = eng_kv_view(pt[r], 0);
                uint32_t h0 = r * g.n_kv_heads / tp, nh = tp > g.n_kv_heads ? 1 : g.n_kv_heads / tp;
                if (tp > g.n_kv_heads)
                    h0 = r / (tp / g.n_kv_heads);
                const uint8_t *part = (const uint8_t *)v.base + (size_t)b * v.block_bytes;
                if (tp > g.n_kv_heads && r % 2) { /* the replica: the same bytes as its twin's */
                    const kern_kv_view_t tw = eng_kv_view(pt[r - 1], 0);
                    cr_assert(!memcmp(part, (const uint8_t *)tw.base + (size_t)b * tw.block_bytes, v.block_bytes));
                    continue;
                }
                td_kv_part_to_block(&g, h0, nh, part, landed);
            }
            const kern_kv_view_t w = eng_kv_view(p1[0], 0);
            const double ek = rel((const float *)landed, (const float *)((const uint8_t *)w.base + b * bb), bb / 4);
            cr_assert_lt(ek, 1e-5, "tp %u block %d: KV rel err %.3g", tp, b, ek);
        }
        printf("%s tp %u vs 1: logits rel err %.2e over %d steps, greedy %d of %d equal\n",
               wide ? "tiny-llama3 widened (dummy weights)" : "tiny-llama3", tp, e, STEPS + 1, STEPS + 1, STEPS + 1);
        for (uint32_t r = 0; r < tp; r++) {
            eng_kv_pool_destroy(pt[r]);
            kern_cpu_backend_destroy(bt[r]);
        }
    }
    eng_kv_pool_destroy(p1[0]);
    kern_cpu_backend_destroy(b1[0]);
    free(l1), free(lt), free(landed);
    eng_model_close(m);
}

Test(tp, tiny_llama3_at_tp_2_matches_the_unsplit_model, .timeout = 120) { tp_matches_unsplit(false); }
Test(tp, a_wider_shape_at_tp_2_and_4_matches_the_unsplit_model, .timeout = 120) { tp_matches_unsplit(true); }

Test(tp, a_pool_of_the_wrong_heads_or_a_comm_of_other_ranks_is_refused)
{
    eng_model_t *m;
    kern_backend_t *be[2];
    eng_kv_pool_t *pool[2];
    kern_comm_t *c;
    cr_assert_eq(eng_model_open(TINY, &m), TD_OK);
    const eng_model_desc_t *d = &m->desc;
    const td_kv_layout_t g = td_kv_layout_make(m->kv_id, d->n_layers, d->n_kv_heads, d->head_dim, BT, TD_KV_F16);
    for (int r = 0; r < 2; r++) {
        cr_assert_eq(kern_cpu_backend_create(1, &be[r]), TD_OK);
        cr_assert_eq(eng_kv_pool_create(be[r], &g, NB, NULL, &pool[r]), TD_OK); /* both KV heads: the unsplit pool */
    }
    cr_assert_eq(kern_comm_memory_create(2, 1000, &c), TD_OK);
    eng_tp_t *t;
    cr_assert_eq(eng_tp_create(m, 2, be, pool, c, 16, 1, &t), TD_ERR_INVALID_ARG);
    cr_assert(strstr(td_last_error(), "the pool holds 2 KV heads, rank 0 of 2 has 1"), "%s", td_last_error());
    cr_assert_eq(eng_tp_create(m, 4, be, pool, c, 16, 1, &t), TD_ERR_INVALID_ARG);
    cr_assert(strstr(td_last_error(), "the comm joins 2 ranks"), "%s", td_last_error());
    c->ops->destroy(c);
    for (int r = 0; r < 2; r++) {
        eng_kv_pool_destroy(pool[r]);
        kern_cpu_backend_destroy(be[r]);
    }
    eng_model_close(m);
}

/* ---- the engine at tp 2 ---- */

typedef struct outs {
    uint64_t first;
    int32_t tok[8][40];
    uint32_t n[8];
    eng_finish_t fin[8];
} outs_t;

static void on_tok(void *ctx, const eng_event_t *ev)
{
    outs_t *o = ctx;
    const size_t i = ev->id - o->first;
    if (ev->token >= 0 && o->n[i] < 40)
        o->tok[i][o->n[i]++] = ev->token;
    if (ev->finish)
        o->fin[i] = ev->finish;
}

/* 6 prompts sharing prefixes, 32 tokens each, on an engine of tp ranks: budget 8 (chunked prompts), a pool of 14
 * blocks (preemption, with swap to host memory or without); *swaps: the sequences swapped out */
static void run_engine(eng_model_t *m, uint32_t tp, uint64_t swap, outs_t *o, uint64_t *preempted, uint64_t *swaps)
{
    eng_engine_config_t cfg = eng_engine_config_default();
    cfg.tp = tp, cfg.device = "cpu", cfg.n_threads = 1, cfg.token_budget = 8, cfg.kv_tokens = 14 * 16;
    cfg.kv_dtype = TD_KV_F32, cfg.swap_bytes = swap;
    eng_engine_t *e;
    cr_assert_eq(eng_engine_create(m, &cfg, &e), TD_OK, "%s", td_last_error());
    int32_t p[6][40];
    memset(o, 0, sizeof *o);
    for (int i = 0; i < 6; i++) {
        const int n = 20 + 3 * i;
        for (int k = 0; k < n; k++) /* prompts 0-2 share 18 tokens, 3-5 another 18 */
            p[i][k] = k < 18 ? (int32_t)((k * 31 + (i / 3) * 7 + 5) % 600) : (int32_t)((k * 13 + i * 101) % 600);
        eng_request_t r = {.prompt = p[i], .n_prompt = (size_t)n, .sampling = eng_sampling_default(),
                           .max_tokens = 32, .ignore_eos = true};
        uint64_t id;
        cr_assert_eq(eng_engine_add(e, &r, &id), TD_OK, "%s", td_last_error());
        if (!i)
            o->first = id;
    }
    while (eng_engine_busy(e))
        cr_assert_eq(eng_engine_step(e, on_tok, o), TD_OK, "%s", td_last_error());
    *preempted = eng_engine_preemptions(e);
    uint64_t in;
    eng_engine_swaps(e, swaps, &in);
    eng_engine_destroy(e);
}

Test(tp, the_engine_at_tp_2_gives_the_unsplit_engines_tokens_through_chunks_cache_hits_and_preemption,
     .timeout = 120)
{
    eng_model_t *m;
    cr_assert_eq(eng_model_open(TINY, &m), TD_OK);
    static outs_t one, two, swapped;
    uint64_t pre1, pre2, pre3, sw1, sw2, sw3;
    run_engine(m, 1, 0, &one, &pre1, &sw1);
    run_engine(m, 2, 0, &two, &pre2, &sw2);
    run_engine(m, 2, 1 << 20, &swapped, &pre3, &sw3);
    cr_assert(pre2 > 0 && pre3 > 0 && sw3 > 0, "the pool preempted %llu and %llu times, %llu swapped",
              (unsigned long long)pre2, (unsigned long long)pre3, (unsigned long long)sw3);
    for (int i = 0; i < 6; i++) {
        cr_assert(one.fin[i] == ENG_FINISH_LENGTH && two.fin[i] == ENG_FINISH_LENGTH &&
                  swapped.fin[i] == ENG_FINISH_LENGTH, "prompt %d", i);
        cr_assert(!memcmp(one.tok[i], two.tok[i], sizeof one.tok[i]), "prompt %d: tp 2 differs", i);
        cr_assert(!memcmp(one.tok[i], swapped.tok[i], sizeof one.tok[i]), "prompt %d: tp 2 with swap differs", i);
    }
    eng_model_close(m);
}
