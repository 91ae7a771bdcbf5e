/* forward.c — see forward.h. A Llama-family decoder layer:
 *
 *   h = x + Wo · attn(rope(Wq · n1(x)), rope(Wk · n1(x)), Wv · n1(x))
 *   x' = h + Wdown · (silu(Wgate · n2(h)) * (Wup · n2(h)))
 *
 * with n1, n2 RMSNorms, GQA attention over the paged KV, and logits =
 * Wout · norm(x) for the rows that need them. All buffers are backend memory
 * allocated at creation; a run allocates nothing.
 *
 * One rank of a tensor-parallel worker (engine/tp.h) runs the same pass over
 * its part of the model (engine/shard.h: its heads, FFN columns and
 * vocabulary rows, its KV heads in its pool); after the O and down
 * projections the ranks' partial sums meet in an all-reduce (rank 0 adds its
 * part to the residual, the others write theirs in its place, so that the sum
 * is the residual plus every part), and its logits are its vocabulary's:
 * the ranks' columns come together in rank 0's whole rows (the comm's
 * gather), where the backend picks the tokens or the host reads them. */
#include "engine/forward.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "engine/weights.h"
#include "kernels/comm.h"

#define PI_F 3.14159265358979323846
#define FWD_RANKS_MAX 16 /* engine/tp.h's ENG_TP_MAX */
/* decode batches up to this many sequences are captured and replayed */
#define FWD_GRAPH_MAX 256

struct eng_forward {
    void (*layer_fn)(void *ctx, uint32_t layer);
    void *layer_ctx;
    eng_tap_fn tap_fn;
    void *tap_ctx;
    const eng_model_t *m;
    eng_model_desc_t d; /* the model as this rank holds it (engine/shard.h) */
    eng_shard_t shard;
    kern_comm_t *comm; /* NULL: one rank */
    kern_backend_t *be;
    eng_kv_pool_t *pool;
    eng_weights_t w;
    uint32_t max_tokens, max_logits;
    size_t max_blocks; /* block-table entries a batch may bring */
    /* backend buffers */
    float *x, *xn, *q, *k, *v, *att, *tmp, *gate, *up, *xl, *logits, *freq;
    /* room for the joined Q|K|V product of side_rows rows (kern_matmul_spec_t's side; NULL where the backend
     * joins no weights); gate's room holds gate|up's (up is its second half) */
    float *side;
    uint32_t side_rows;
    int32_t *ids, *pos, *slots, *tables, *picked;
    /* aseqs in backend memory, where a device backend reads the positions
     * (so that a captured step replays with new ones); NULL on the host */
    kern_attn_seq_t *dseqs;
    kern_sample_t *dsample; /* each logit row's sampling (sample) */
    uint8_t *dmask;         /* the rows' masks for a masked pick (structured output), mask_rows of them */
    uint32_t mask_rows, mask_bytes;
    /* captured decode steps (KERN_OP_GRAPH), by context class (the longest
     * context under the backend's capture_ctx_split, or not) and batch: 0
     * not run yet, 1 run once uncaptured (scratch sized), 2 captured, 3
     * capture failed */
    uint8_t graph_state[2][2 * FWD_GRAPH_MAX + 2];
    /* host staging */
    int32_t *h_ids, *h_pos, *h_slots, *h_tables;
    kern_attn_seq_t *aseqs;
    float *h_logits;
    /* a tensor-parallel rank: every rank's vocabulary rows; rank 0's logit rows whole ([max_logits][vocab]) and,
     * where its comm carries the parts through one (gather_scratch), the scratch to gather them */
    uint32_t cols[FWD_RANKS_MAX];
    float *whole, *scratch;
    kern_rope_style_t rope_style;
};

/* Inverse frequency of each rotated pair, with the model's scaling. */
static td_status_t rope_freqs(const eng_model_desc_t *d, float *out)
{
    uint32_t half = d->head_dim / 2;
    for (uint32_t i = 0; i < half; i++) {
        double f = 1.0 / pow((double)d->rope_theta, (double)(2 * i) / d->head_dim);
        switch (d->rope_scaling) {
        case ENG_ROPE_SCALING_NONE: break;
        case ENG_ROPE_SCALING_LINEAR: f /= d->rope_factor; break;
        case ENG_ROPE_SCALING_LLAMA3: {
            double lo = d->rope_low_freq ? d->rope_low_freq : 1, hi = d->rope_high_freq ? d->rope_high_freq : 4;
            double ctx = d->rope_orig_context ? d->rope_orig_context : 8192;
            double wavelen = 2 * PI_F / f, lo_wl = ctx / lo, hi_wl = ctx / hi;
            if (wavelen > lo_wl) {
                f /= d->rope_factor;
            } else if (wavelen >= hi_wl) {
                double smooth = (ctx / wavelen - lo) / (hi - lo);
                f = (1 - smooth) * f / d->rope_factor + smooth * f;
            }
            break;
        }
        case ENG_ROPE_SCALING_YARN:
            return td_error(TD_ERR_UNSUPPORTED, "forward: YaRN rope scaling is not supported (none, linear and llama3 are)");
        }
        out[i] = (float)f;
    }
    /* the ratio of neighbouring pairs' angles, as llama.cpp computes it, for
     * backends that build angles as a product chain (reference numerics) */
    out[half] = d->rope_scaling == ENG_ROPE_SCALING_NONE ? powf(d->rope_theta, -2.0f / (float)d->head_dim) : 0;
    return TD_OK;
}

static td_status_t balloc(eng_forward_t *f, size_t bytes, void *pp)
{
    return f->be->ops->alloc(f->be, bytes ? bytes : 64, (void **)pp);
}

td_status_t eng_forward_create(const eng_model_t *m, kern_backend_t *be, eng_kv_pool_t *pool, uint32_t max_tokens,
                               uint32_t max_logits, eng_forward_t **out)
{
    const eng_shard_t whole = eng_shard_whole(&m->desc);
    return eng_forward_create_rank(m, be, pool, &whole, NULL, max_tokens, max_logits, out);
}

td_status_t eng_forward_create_rank(const eng_model_t *m, kern_backend_t *be, eng_kv_pool_t *pool,
                                    const eng_shard_t *shard, kern_comm_t *comm, uint32_t max_tokens,
                                    uint32_t max_logits, eng_forward_t **out)
{
    const eng_model_desc_t rd = eng_shard_desc(&m->desc, shard), *d = &rd;
    td_status_t rc = kern_backend_check(be, KERN_OPS_FORWARD);
    if (rc)
        return rc;
    /* a pool of parts holds each rank's KV heads apart (engine/kv_pool.h); a pool of whole blocks, this rank's */
    const uint32_t pool_heads = eng_kv_view_rank(pool, shard->rank, 0).layout->n_kv_heads;
    if (pool_heads != d->n_kv_heads)
        return td_error(TD_ERR_INVALID_ARG, "forward: the pool holds %u KV heads, rank %u of %u has %u", pool_heads,
                        shard->rank, shard->tp, d->n_kv_heads);
    if (shard->tp > 1 && (!comm || comm->ranks != shard->tp || !comm->ops->gather_cols))
        return td_error(TD_ERR_INVALID_ARG, "forward: rank %u of %u needs a comm of %u ranks", shard->rank,
                        shard->tp, shard->tp);
    if (shard->tp > FWD_RANKS_MAX)
        return td_error(TD_ERR_INVALID_ARG, "forward: %u ranks, at most %d", shard->tp, FWD_RANKS_MAX);
    if (d->head_dim > 512)
        return td_error(TD_ERR_UNSUPPORTED, "forward: head dimension %u is over 512", d->head_dim);
    eng_forward_t *f = calloc(1, sizeof *f);
    if (!f)
        return td_error(TD_ERR_NO_MEMORY, "forward: no memory");
    f->m = m;
    f->d = rd;
    f->shard = *shard;
    f->comm = shard->tp > 1 ? comm : NULL;
    f->be = be;
    f->pool = pool;
    f->max_tokens = max_tokens;
    f->max_logits = max_logits;
    f->rope_style = d->rope_style == ENG_ROPE_NEOX ? KERN_ROPE_NEOX : KERN_ROPE_NORM;
    uint32_t v0;
    for (uint32_t r = 0; r < shard->tp; r++)
        f->cols[r] = eng_shard_vocab(m->desc.vocab, shard->tp, r, &v0);
    /* the rows the host reads or the backend picks from: the whole vocabulary's (rank 0's, gathered), or none */
    const bool picks = !f->comm || shard->rank == 0;
    const size_t V = picks ? m->desc.vocab : 0;
    size_t T = max_tokens, qd = (size_t)d->n_heads * d->head_dim, kvd = (size_t)d->n_kv_heads * d->head_dim;
    /* Block-table entries a batch may bring: up to max_tokens sequences, each
     * with a table as long as the model's context (a request never passes it)
     * or the pool (a table names each block once), whichever is shorter. A
     * fixed guess here once refused decode batches of many long sequences. */
    const uint32_t bt = eng_kv_layout(pool)->block_tokens, pool_blocks = eng_kv_stats(pool).n_blocks;
    size_t per_seq = pool_blocks;
    if (d->context && (d->context + bt - 1) / bt < per_seq)
        per_seq = (d->context + bt - 1) / bt;
    const size_t max_blocks = T * (per_seq ? per_seq : 1);
    f->max_blocks = max_blocks;
    float hfreq[257];
    rc = rope_freqs(d, hfreq);
    if (!rc)
        rc = eng_weights_bind_shard(m, be, shard, &f->w);
    if (!rc && (be->ops->supported & KERN_OP_MATMUL_FUSED)) /* the norms ride in the fused matmuls' weights */
        rc = eng_weights_fold_norms(&f->w, be, d->tied_embeddings);
    struct { void *slot; size_t bytes; } bufs[] = {
        {&f->x, T * d->hidden * 4}, {&f->xn, T * d->hidden * 4}, {&f->q, T * qd * 4}, {&f->k, T * kvd * 4},
        {&f->v, T * kvd * 4}, {&f->att, T * qd * 4}, {&f->tmp, T * (d->hidden > qd ? d->hidden : qd) * 4},
        {&f->gate, 2 * T * d->ffn * 4}, {&f->xl, (size_t)max_logits * d->hidden * 4},
        {&f->logits, (size_t)max_logits * d->vocab * 4}, {&f->freq, (d->head_dim / 2 + 1) * 4}, {&f->ids, T * 4},
        {&f->pos, T * 4}, {&f->slots, T * 4}, {&f->tables, max_blocks * 4}, {&f->picked, (size_t)max_logits * 4},
        {&f->dsample, (size_t)max_logits * sizeof(kern_sample_t)},
    };
    /* masks for the decode batches a step picks on the device (the captured ones' size at most) */
    f->mask_bytes = (m->desc.vocab + 7) / 8;
    f->mask_rows = max_logits < FWD_GRAPH_MAX ? max_logits : FWD_GRAPH_MAX;
    for (size_t i = 0; !rc && i < sizeof bufs / sizeof bufs[0]; i++)
        rc = balloc(f, bufs[i].bytes, bufs[i].slot);
    if (!rc)
        f->up = f->gate + T * d->ffn;
    /* decode batches (up to the captured ones' size) multiply Q|K|V at once where the backend joined them */
    f->side_rows = T < FWD_GRAPH_MAX ? (uint32_t)T : FWD_GRAPH_MAX;
    if (!rc && be->ops->weights_join)
        rc = balloc(f, (size_t)f->side_rows * (qd + 2 * kvd) * 4, &f->side);
    if (!rc && picks && (be->ops->supported & KERN_OP_SAMPLE))
        rc = balloc(f, (size_t)f->mask_rows * f->mask_bytes, &f->dmask);
    if (!rc && f->comm && picks)
        rc = balloc(f, (size_t)max_logits * V * 4, &f->whole);
    if (!rc && f->comm && picks && f->comm->ops->gather_scratch)
        rc = balloc(f, (size_t)max_logits * V * 4, &f->scratch);
    if (!rc) {
        f->h_ids = malloc(T * 4);
        f->h_pos = malloc(T * 4);
        f->h_slots = malloc(T * 4);
        f->h_tables = malloc(max_blocks * 4);
        f->aseqs = malloc(T * sizeof *f->aseqs);
        f->h_logits = malloc((size_t)max_logits * (V ? V : 1) * 4);
        if (!f->h_ids || !f->h_pos || !f->h_slots || !f->h_tables || !f->aseqs || !f->h_logits)
            rc = td_error(TD_ERR_NO_MEMORY, "forward: no memory for batches of %u tokens", max_tokens);
    }
    if (!rc && be->ops->queue(be))
        rc = balloc(f, T * sizeof(kern_attn_seq_t), &f->dseqs);
    if (!rc)
        rc = be->ops->upload(be, f->freq, hfreq, (d->head_dim / 2 + 1) * 4);
    if (rc) {
        eng_forward_destroy(f);
        return rc;
    }
    *out = f;
    return TD_OK;
}

void eng_forward_destroy(eng_forward_t *f)
{
    if (!f)
        return;
    kern_backend_t *be = f->be;
    void *bufs[] = {f->x,      f->xn,     f->q,      f->k,     f->v,      f->att,    f->tmp,
                    f->gate,   f->side,   f->xl,     f->logits, f->freq,   f->ids,    f->pos,
                    f->slots,  f->tables, f->picked, f->dseqs,  f->dsample, f->dmask, f->whole, f->scratch};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i])
            be->ops->free(be, bufs[i]);
    eng_weights_release(&f->w, be);
    free(f->h_ids);
    free(f->h_pos);
    free(f->h_slots);
    free(f->h_tables);
    free(f->aseqs);
    free(f->h_logits);
    free(f);
}

/* Hands an intermediate to the tap (a copy in host memory), when one is set. */
static void tap(eng_forward_t *f, const char *name, int layer, const float *x, uint32_t rows, uint32_t cols)
{
    if (!f->tap_fn)
        return;
    size_t bytes = (size_t)rows * cols * sizeof(float);
    float *h = malloc(bytes);
    if (h && !f->be->ops->sync(f->be) && !f->be->ops->download(f->be, h, x, bytes) && !f->be->ops->sync(f->be))
        f->tap_fn(f->tap_ctx, name, layer, h, rows, cols);
    free(h);
}

static td_status_t add_bias(kern_backend_t *be, float *x, const float *b, uint32_t n, uint32_t dim)
{
    td_status_t rc = TD_OK;
    for (uint32_t t = 0; t < n && !rc; t++)
        rc = be->ops->add(be, x + (size_t)t * dim, b, dim);
    return rc;
}

/* Every op's status is checked: the first error ends the pass (and, through
 * the engine, the batch's requests). */
#define TRY(call)                                                                                                  \
    do {                                                                                                           \
        if ((rc = (call)))                                                                                         \
            return rc;                                                                                             \
    } while (0)

/* y_i = x · W_iᵀ for weights of one kind: one fused call when the backend has
 * it and the weights share a layout, else one matmul each. */
static td_status_t matmuls(eng_forward_t *f, const kern_weight_t *const *w, float *const *y, uint32_t k,
                           const float *x, uint32_t n)
{
    kern_backend_t *be = f->be;
    bool fuse = be->ops->supported & KERN_OP_MATMUL_MULTI;
    for (uint32_t i = 1; i < k && fuse; i++)
        fuse = w[i]->type == w[0]->type && !w[i]->priv == !w[0]->priv;
    if (fuse)
        return be->ops->matmul_multi(be, w, y, k, x, n);
    td_status_t rc = TD_OK;
    for (uint32_t i = 0; i < k && !rc; i++)
        rc = be->ops->matmul(be, w[i], x, y[i], n);
    return rc;
}

/* A layer's attention from its Q, K and V: biases, RoPE, the new KV into
 * the pool (then the layer hook), attention into att. */
static td_status_t attend(eng_forward_t *f, uint32_t l, uint32_t n, uint32_t n_seqs)
{
    const eng_model_desc_t *d = &f->d;
    kern_backend_t *be = f->be;
    const kern_backend_ops_t *o = be->ops;
    const eng_layer_weights_t *L = &f->w.layers[l];
    kern_kv_view_t kv = eng_kv_view_rank(f->pool, f->shard.rank, l);
    uint32_t H = d->n_heads, KV = d->n_kv_heads, hd = d->head_dim;
    td_status_t rc;
    if (L->bq) {
        TRY(add_bias(be, f->q, L->bq, n, H * hd));
        TRY(add_bias(be, f->k, L->bk, n, KV * hd));
        TRY(add_bias(be, f->v, L->bv, n, KV * hd));
    }
    tap(f, "Qcur", (int)l, f->q, n, H * hd);
    tap(f, "Kcur", (int)l, f->k, n, KV * hd);
    tap(f, "Vcur", (int)l, f->v, n, KV * hd);
    const float scale = 1.0f / sqrtf((float)hd);
    if ((o->supported & KERN_OP_ROPE_KV_ATTENTION) && !f->layer_fn && !f->tap_fn) { /* one pass for all four */
        kern_rope_kv_t r = {.q = f->q, .k = f->k, .v = f->v, .n_heads = H, .n = n, .slots = f->slots,
                            .pos = f->pos, .freq = f->freq, .style = f->rope_style};
        return o->rope_kv_attention(be, &kv, &r, f->att, f->aseqs, f->dseqs, n_seqs, scale);
    }
    if (o->supported & KERN_OP_ROPE_KV_STORE) { /* one pass for the three */
        TRY(o->rope_kv_store(be, &kv, f->q, f->k, f->v, H, f->slots, n, f->pos, f->freq, f->rope_style));
        tap(f, "Qrope", (int)l, f->q, n, H * hd);
        tap(f, "Krope", (int)l, f->k, n, KV * hd);
    } else {
        TRY(o->rope(be, f->q, n, H, hd, f->pos, f->freq, f->rope_style));
        TRY(o->rope(be, f->k, n, KV, hd, f->pos, f->freq, f->rope_style));
        tap(f, "Qrope", (int)l, f->q, n, H * hd);
        tap(f, "Krope", (int)l, f->k, n, KV * hd);
        TRY(o->kv_store(be, &kv, f->k, f->v, f->slots, n));
    }
    if (f->layer_fn && !f->comm) { /* (a rank's: after the layer's first all-reduce, layer_hook_tp) */
        TRY(o->sync(be)); /* the layer's KV is in the pool now */
        f->layer_fn(f->layer_ctx, l);
    }
    TRY(o->attention(be, &kv, f->q, f->att, H, f->aseqs, f->dseqs, n_seqs, scale));
    tap(f, "kqv_out", (int)l, f->att, n, H * hd);
    return TD_OK;
}

/* Tensor parallelism: x's n rows summed over the ranks (each holds its part of a row-parallel product, rank 0's
 * with the residual). One rank: nothing. */
static td_status_t ranks_sum(eng_forward_t *f, uint32_t n)
{
    return f->comm ? f->comm->ops->all_reduce(f->comm, f->shard.rank, f->be, f->x, (size_t)n * f->d.hidden) : TD_OK;
}

/* A rank's layer hook: after the layer's first all-reduce, which every rank reaches only after storing the layer's
 * KV (the queue drained: with NCCL the sum's completion is every rank's arrival). */
static td_status_t layer_hook_tp(eng_forward_t *f, uint32_t l)
{
    if (!f->layer_fn || !f->comm)
        return TD_OK;
    td_status_t rc = f->be->ops->sync(f->be);
    if (!rc)
        f->layer_fn(f->layer_ctx, l);
    return rc;
}

/* x += tmp (a row-parallel product), summed over the ranks: rank 0 adds its part, the others put theirs in x's
 * place before the sum. */
static td_status_t residual(eng_forward_t *f, uint32_t n)
{
    const size_t k = (size_t)n * f->d.hidden;
    td_status_t rc = f->shard.rank == 0 ? f->be->ops->add(f->be, f->x, f->tmp, k)
                                        : f->be->ops->copy(f->be, f->x, f->tmp, k * sizeof(float));
    return rc ? rc : ranks_sum(f, n);
}

/* One layer, op by op (every backend; the tap sees each intermediate). */
static td_status_t layer_ops(eng_forward_t *f, uint32_t l, uint32_t n, uint32_t n_seqs)
{
    const eng_model_desc_t *d = &f->d;
    kern_backend_t *be = f->be;
    const kern_backend_ops_t *o = be->ops;
    const eng_layer_weights_t *L = &f->w.layers[l];
    uint32_t hid = d->hidden;
    td_status_t rc;
    TRY(o->rmsnorm(be, f->x, L->attn_norm, f->xn, n, hid, d->norm_eps));
    tap(f, "attn_norm", (int)l, f->xn, n, hid);
    const kern_weight_t *qkv[3] = {&L->wq, &L->wk, &L->wv};
    float *qkv_out[3] = {f->q, f->k, f->v};
    TRY(matmuls(f, qkv, qkv_out, 3, f->xn, n));
    TRY(attend(f, l, n, n_seqs));
    TRY(o->matmul(be, &L->wo, f->att, f->tmp, n));
    tap(f, "attn_out", (int)l, f->tmp, n, hid);
    TRY(residual(f, n));
    TRY(layer_hook_tp(f, l));
    tap(f, "ffn_inp", (int)l, f->x, n, hid);
    TRY(o->rmsnorm(be, f->x, L->ffn_norm, f->xn, n, hid, d->norm_eps));
    tap(f, "ffn_norm", (int)l, f->xn, n, hid);
    const kern_weight_t *gu[2] = {&L->w_gate, &L->w_up};
    float *gu_out[2] = {f->gate, f->up};
    TRY(matmuls(f, gu, gu_out, 2, f->xn, n));
    tap(f, "ffn_gate", (int)l, f->gate, n, d->ffn);
    tap(f, "ffn_up", (int)l, f->up, n, d->ffn);
    TRY(o->swiglu(be, f->gate, f->up, f->gate, (size_t)n * d->ffn));
    tap(f, "ffn_swiglu", (int)l, f->gate, n, d->ffn);
    TRY(o->matmul(be, &L->w_down, f->gate, f->tmp, n));
    tap(f, "ffn_out", (int)l, f->tmp, n, hid);
    TRY(residual(f, n));
    tap(f, "l_out", (int)l, f->x, n, hid);
    return TD_OK;
}

/* One layer through the fused matmul: the norms ride in the Q/K/V and
 * gate/up matmuls, SwiGLU in gate/up's, the residual adds in the output and
 * down projections' (kernels/backend.h's kern_matmul_spec_t). */
static td_status_t layer_fused(eng_forward_t *f, uint32_t l, uint32_t n, uint32_t n_seqs)
{
    const eng_model_desc_t *d = &f->d;
    kern_backend_t *be = f->be;
    const kern_backend_ops_t *o = be->ops;
    const eng_layer_weights_t *L = &f->w.layers[l];
    td_status_t rc;
    const kern_weight_t *qkv[3] = {&L->wq, &L->wk, &L->wv};
    float *qkv_out[3] = {f->q, f->k, f->v};
    /* to_next: q, k and v go to attend()'s rope and attention alone (no bias added to them, no tap reads them) */
    TRY(o->matmul_fused(be, &(kern_matmul_spec_t){.w = qkv, .y = qkv_out, .k = 3, .x = f->x, .n = n,
                                                  .norm = L->attn_norm, .eps = d->norm_eps,
                                                  .norm_in_w = f->w.norms_folded,
                                                  .to_next = !L->bq && !f->tap_fn &&
                                                             (o->supported & KERN_OP_ROPE_KV_STORE),
                                                  .side = f->side, .side_rows = f->side ? f->side_rows : 0}));
    TRY(attend(f, l, n, n_seqs));
    const kern_weight_t *wo = &L->wo, *wd = &L->w_down;
    const bool first = f->shard.rank == 0; /* the rank whose part is added to the residual (above) */
    TRY(o->matmul_fused(be, &(kern_matmul_spec_t){.w = &wo, .y = &f->x, .k = 1, .x = f->att, .n = n,
                                                  .accumulate = first}));
    TRY(ranks_sum(f, n));
    TRY(layer_hook_tp(f, l));
    const kern_weight_t *gu[2] = {&L->w_gate, &L->w_up};
    float *gu_out[2] = {f->gate, f->up};
    TRY(o->matmul_fused(be, &(kern_matmul_spec_t){.w = gu, .y = gu_out, .k = 2, .x = f->x, .n = n,
                                                  .norm = L->ffn_norm, .eps = d->norm_eps,
                                                  .norm_in_w = f->w.norms_folded, .glu = true, .to_next = true,
                                                  .side = f->gate, .side_rows = f->max_tokens}));
    TRY(o->matmul_fused(be, &(kern_matmul_spec_t){.w = &wd, .y = &f->x, .k = 1, .x = f->gate, .n = n,
                                                  .accumulate = first}));
    return ranks_sum(f, n);
}

/* Everything a step queues after its uploads: embedding, layers, the
 * logit rows (and, with sampling, the picks). rows_direct: every sequence
 * is one token wanting logits, so x's rows are the logit rows as they are. */
static td_status_t pass(eng_forward_t *f, const eng_batch_seq_t *seqs, uint32_t n_seqs, uint32_t n, uint32_t nl,
                        bool rows_direct, bool sampled)
{
    const eng_model_desc_t *d = &f->d;
    kern_backend_t *be = f->be;
    const kern_backend_ops_t *o = be->ops;
    uint32_t hid = d->hidden;
    /* op by op where a tap wants every intermediate, unless the norms ride in the weights (which only the fused
     * matmul takes): then the tap sees the names the fused path has */
    bool fused = (o->supported & KERN_OP_MATMUL_FUSED) && (!f->tap_fn || f->w.norms_folded);
    td_status_t rc;
    TRY(o->embed(be, &f->w.tok_embd, f->ids, n, f->x));
    tap(f, "embd", -1, f->x, n, hid);
    for (uint32_t l = 0; l < d->n_layers; l++)
        TRY(fused ? layer_fused(f, l, n, n_seqs) : layer_ops(f, l, n, n_seqs));
    if (!nl)
        return TD_OK;
    /* the last row of each sequence that wants logits */
    const float *rows = f->x;
    if (!rows_direct) {
        uint32_t k = 0;
        for (uint32_t s = 0; s < n_seqs; s++) {
            if (seqs[s].all_logits) {
                TRY(o->copy(be, f->xl + (size_t)k * hid, f->x + (size_t)f->aseqs[s].row0 * hid,
                            (size_t)seqs[s].n * hid * 4));
                k += seqs[s].n;
            } else if (seqs[s].want_logits) {
                uint32_t row = f->aseqs[s].row0 + seqs[s].n - 1;
                TRY(o->copy(be, f->xl + (size_t)k * hid, f->x + (size_t)row * hid, hid * 4));
                k++;
            }
        }
        rows = f->xl;
    }
    if (fused) {
        const kern_weight_t *w = &f->w.output;
        TRY(o->matmul_fused(be, &(kern_matmul_spec_t){.w = &w, .y = &f->logits, .k = 1, .x = rows, .n = nl,
                                                      .norm = f->w.out_norm, .eps = d->norm_eps,
                                                      .norm_in_w = f->w.norms_folded && !d->tied_embeddings}));
    } else {
        TRY(o->rmsnorm(be, rows, f->w.out_norm, f->xl, nl, hid, d->norm_eps));
        tap(f, "result_norm", -1, f->xl, nl, hid);
        TRY(o->matmul(be, &f->w.output, f->xl, f->logits, nl));
    }
    if (f->comm) /* the ranks' columns side by side in rank 0's whole rows */
        TRY(f->comm->ops->gather_cols(f->comm, f->shard.rank, be, f->logits, nl, f->cols, f->whole, f->scratch));
    if (sampled && f->dmask) /* (a rank other than 0 picks nothing) */
        TRY(o->sample(be, f->whole ? f->whole : f->logits, nl, f->m->desc.vocab, f->dsample, f->dmask, f->picked));
    return TD_OK;
}

/* The step through a captured graph when it can be: decode steps (one token
 * a sequence) of up to FWD_GRAPH_MAX sequences, with no hook or tap. A key's
 * first step runs as is (sizing every scratch buffer), its second is
 * captured, later ones replay; a capture that fails leaves that key uncaptured. */
static td_status_t pass_graph(eng_forward_t *f, const eng_batch_seq_t *seqs, uint32_t n_seqs, uint32_t n,
                              uint32_t nl, bool rows_direct, bool sampled, uint32_t max_ctx)
{
    const kern_backend_ops_t *o = f->be->ops;
    if (!(o->supported & KERN_OP_GRAPH) || !rows_direct || n > FWD_GRAPH_MAX || f->layer_fn || f->tap_fn ||
        (f->comm && !f->comm->ops->capturable)) /* (a comm that drains the queue cannot be in a graph) */
        return pass(f, seqs, n_seqs, n, nl, rows_direct, sampled);
    /* the backend holds one graph per key: this forward's address names its
     * own (a later forward at the same address starts uncaptured and
     * replaces the key before it replays it) */
    const uint32_t split = o->capture_ctx_split, cls = split && max_ctx >= split;
    uint8_t *st = &f->graph_state[cls][2 * n + sampled];
    uint64_t key = ((uint64_t)(uintptr_t)f * 2 + cls) * 1024 + 2 * n + sampled;
    if (*st == 2) {
        td_status_t rc = o->replay(f->be, key);
        if (rc != TD_ERR_NOT_FOUND)
            return rc;
        *st = 1; /* dropped (scratch moved): capture again */
    }
    if (*st != 1) {
        if (*st == 0)
            *st = 1;
        return pass(f, seqs, n_seqs, n, nl, rows_direct, sampled);
    }
    td_status_t rc = o->capture_begin(f->be);
    if (rc)
        return rc;
    td_status_t prc = pass(f, seqs, n_seqs, n, nl, rows_direct, sampled);
    rc = o->capture_end(f->be, key, !prc);
    if (prc || rc) {
        td_log(TD_LOG_WARN, "forward: decode steps of %u sequences run uncaptured: %s", n, td_last_error());
        *st = 3;
        return pass(f, seqs, n_seqs, n, nl, rows_direct, sampled);
    }
    *st = 2;
    return o->replay(f->be, key);
}

static td_status_t run(eng_forward_t *f, const eng_batch_seq_t *seqs, uint32_t n_seqs, const kern_sample_t *sample,
                       const uint8_t *masks, const float **logits, int32_t *picked, uint32_t *n_logits)
{
    const eng_model_desc_t *d = &f->d;
    kern_backend_t *be = f->be;
    const kern_backend_ops_t *o = be->ops;
    uint32_t n = 0, nl = 0, bt = eng_kv_layout(f->pool)->block_tokens, max_ctx = 0;
    size_t nt = 0;
    bool rows_direct = true;
    /* lay the batch out: token rows, positions, KV slots, block tables */
    for (uint32_t s = 0; s < n_seqs; s++) {
        const eng_batch_seq_t *q = &seqs[s];
        if (n + q->n > f->max_tokens)
            return td_error(TD_ERR_INVALID_ARG, "forward: batch of more than %u tokens", f->max_tokens);
        if ((q->pos0 + q->n + bt - 1) / bt > q->n_blocks)
            return td_error(TD_ERR_INTERNAL, "forward: sequence %u: %u blocks do not cover position %u", s,
                            q->n_blocks, q->pos0 + q->n - 1);
        if (q->pos0 + q->n > d->context && d->context)
            return td_error(TD_ERR_INVALID_ARG, "forward: position %u is past the model's context of %u",
                            q->pos0 + q->n - 1, d->context);
        if (nt + q->n_blocks > f->max_blocks)
            return td_error(TD_ERR_INVALID_ARG, "forward: the batch's block tables pass the %zu entries it may bring",
                            f->max_blocks);
        memcpy(f->h_tables + nt, q->block_table, q->n_blocks * 4);
        f->aseqs[s] = (kern_attn_seq_t){.row0 = n, .n = q->n, .pos0 = q->pos0, .block_table = f->tables + nt,
                                        .n_blocks = q->n_blocks,
                                        .decode_from = q->decode_from ? q->decode_from
                                                       : q->n >= 2    ? UINT32_MAX
                                                                      : q->pos0};
        for (uint32_t i = 0; i < q->n; i++) {
            uint32_t p = q->pos0 + i;
            f->h_ids[n + i] = q->tokens[i];
            f->h_pos[n + i] = (int32_t)p;
            f->h_slots[n + i] = q->block_table[p / bt] * (int32_t)bt + (int32_t)(p % bt);
        }
        rows_direct = rows_direct && q->n == 1 && q->want_logits && !q->all_logits;
        max_ctx = max_ctx > q->pos0 + q->n ? max_ctx : q->pos0 + q->n;
        n += q->n;
        nt += q->n_blocks;
        nl += q->all_logits ? q->n : q->want_logits;
    }
    if (nl > f->max_logits)
        return td_error(TD_ERR_INVALID_ARG, "forward: %u logit rows asked, at most %u", nl, f->max_logits);
    if (!n) {
        *n_logits = 0;
        return TD_OK;
    }
    td_status_t rc;
    TRY(o->upload(be, f->ids, f->h_ids, n * 4));
    TRY(o->upload(be, f->pos, f->h_pos, n * 4));
    TRY(o->upload(be, f->slots, f->h_slots, n * 4));
    TRY(o->upload(be, f->tables, f->h_tables, nt * 4));
    if (f->dseqs)
        TRY(o->upload(be, f->dseqs, f->aseqs, n_seqs * sizeof *f->aseqs));
    if (sample && nl)
        TRY(o->upload(be, f->dsample, sample, nl * sizeof *sample));
    if (sample && masks) { /* the rows' masks, where a row is masked */
        bool any = false;
        for (uint32_t i = 0; i < nl; i++)
            any = any || sample[i].masked;
        if (any && nl > f->mask_rows)
            return td_error(TD_ERR_INVALID_ARG, "forward: %u masked picks asked, at most %u", nl, f->mask_rows);
        if (any)
            TRY(o->upload(be, f->dmask, masks, (size_t)nl * f->mask_bytes));
    }
    TRY(pass_graph(f, seqs, n_seqs, n, nl, rows_direct, sample != NULL, max_ctx));
    const bool whole = !f->comm || f->shard.rank == 0; /* the rows are here whole (rank 0's gathered) */
    if (nl && sample)
        TRY(o->download(be, picked, f->picked, (size_t)nl * 4));
    else if (nl && whole)
        TRY(o->download(be, f->h_logits, f->whole ? f->whole : f->logits, (size_t)nl * f->m->desc.vocab * 4));
    TRY(o->sync(be));
    if (logits)
        *logits = whole ? f->h_logits : NULL;
    *n_logits = nl;
    return TD_OK;
}

td_status_t eng_forward_run(eng_forward_t *f, const eng_batch_seq_t *seqs, uint32_t n_seqs, const float **logits,
                            uint32_t *n_logits)
{
    return run(f, seqs, n_seqs, NULL, NULL, logits, NULL, n_logits);
}

/* a tensor-parallel worker's picks are rank 0's, over the rows the ranks' columns make */
bool eng_forward_can_sample(const eng_forward_t *f)
{
    return (f->be->ops->supported & KERN_OP_SAMPLE) && (!f->comm || f->shard.rank == 0);
}

td_status_t eng_forward_run_sampled(eng_forward_t *f, const eng_batch_seq_t *seqs, uint32_t n_seqs,
                                    const kern_sample_t *p, const uint8_t *masks, int32_t *ids, uint32_t *n_ids)
{
    if (!eng_forward_can_sample(f))
        return td_error(TD_ERR_UNSUPPORTED, "forward: backend %s does not sample", f->be->ops->name);
    return run(f, seqs, n_seqs, p, masks, NULL, ids, n_ids);
}

uint32_t eng_forward_mask_rows(const eng_forward_t *f) { return f->dmask ? f->mask_rows : 0; }

void eng_forward_set_layer_hook(eng_forward_t *f, void (*fn)(void *ctx, uint32_t layer), void *ctx)
{
    f->layer_fn = fn;
    f->layer_ctx = ctx;
}

static td_status_t pass_run(void *p, const eng_batch_seq_t *seqs, uint32_t n_seqs, const float **logits,
                            uint32_t *n_logits)
{
    return eng_forward_run(p, seqs, n_seqs, logits, n_logits);
}
static bool pass_can_sample(const void *p) { return eng_forward_can_sample(p); }
static uint32_t pass_mask_rows(const void *p) { return eng_forward_mask_rows(p); }
static td_status_t pass_run_sampled(void *p, const eng_batch_seq_t *seqs, uint32_t n_seqs, const kern_sample_t *sp,
                                    const uint8_t *masks, int32_t *ids, uint32_t *n_ids)
{
    return eng_forward_run_sampled(p, seqs, n_seqs, sp, masks, ids, n_ids);
}
static void pass_set_layer_hook(void *p, void (*fn)(void *ctx, uint32_t layer), void *ctx)
{
    eng_forward_set_layer_hook(p, fn, ctx);
}

const eng_pass_ops_t eng_forward_pass = {.run = pass_run,
                                         .can_sample = pass_can_sample,
                                         .mask_rows = pass_mask_rows,
                                         .run_sampled = pass_run_sampled,
                                         .set_layer_hook = pass_set_layer_hook};

void eng_forward_set_tap(eng_forward_t *f, eng_tap_fn fn, void *ctx)
{
    f->tap_fn = fn;
    f->tap_ctx = ctx;
}
