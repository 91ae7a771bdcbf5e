/* tp.c — see tp.h. A step: the job is posted, each rank's thread runs its
 * forward, the caller runs rank 0's and waits for the rest (each rank's
 * waits inside the step have the comm's deadline; a rank's error aborts the
 * comm so that no other waits for it). */
#include "engine/tp.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine.h"
#include "engine/shard.h"
#ifdef TANDEM_HAVE_CUDA
#include "kernels/cuda/comm_nccl.h"
#endif
#include "common/log.h"
#include "engine/weights.h"

typedef struct rank {
    eng_tp_t *t;
    uint32_t r;
    eng_forward_t *f;
    eng_shard_t shard;
    pthread_t th;
    bool started;
    td_status_t rc;
    char err[256];
    const float *logits; /* rank 0's: the whole vocabulary's rows */
    uint32_t nl;
} rank_t;

struct eng_tp {
    const eng_model_t *m;
    uint32_t tp;
    kern_comm_t *comm;
    rank_t *ranks;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    uint64_t posted, done_gen; /* steps posted; */
    uint32_t done;             /* ranks past the current step */
    bool quit;
    const eng_batch_seq_t *seqs;
    uint32_t n_seqs;
    /* a step whose tokens rank 0's backend picks (NULL: the logits come back) */
    const kern_sample_t *sample;
    const uint8_t *masks;
    int32_t *ids;
};

static void run_rank(rank_t *k)
{
    eng_tp_t *t = k->t;
    k->rc = k->r == 0 && t->sample
                ? eng_forward_run_sampled(k->f, t->seqs, t->n_seqs, t->sample, t->masks, t->ids, &k->nl)
                : eng_forward_run(k->f, t->seqs, t->n_seqs, &k->logits, &k->nl);
    if (k->rc) {
        snprintf(k->err, sizeof k->err, "%s", td_last_error());
        t->comm->ops->abort(t->comm, k->r);
    }
}

static void *rank_main(void *arg)
{
    rank_t *k = arg;
    eng_tp_t *t = k->t;
    uint64_t seen = 0;
    for (;;) {
        pthread_mutex_lock(&t->mu);
        while (!t->quit && t->posted == seen)
            pthread_cond_wait(&t->cv, &t->mu);
        if (t->quit) {
            pthread_mutex_unlock(&t->mu);
            return NULL;
        }
        seen = t->posted;
        pthread_mutex_unlock(&t->mu);
        run_rank(k);
        pthread_mutex_lock(&t->mu);
        t->done++;
        pthread_cond_broadcast(&t->cv);
        pthread_mutex_unlock(&t->mu);
    }
}

td_status_t eng_tp_plan(const eng_model_t *m, uint32_t tp, uint32_t r, eng_shard_t *out)
{
    /* the columns O and down are cut at: whole quantization blocks, and whole groups of 32 values (the CPU
     * backend's matmul takes no other rows) */
    const uint32_t blk = eng_weights_col_block(m);
    return eng_shard_plan(&m->desc, tp, r, blk > 32 ? blk : 32, out);
}

td_status_t eng_tp_create(const eng_model_t *m, uint32_t tp, kern_backend_t *const *bes, eng_kv_pool_t *const *pools,
                          kern_comm_t *comm, uint32_t max_tokens, uint32_t max_logits, eng_tp_t **out)
{
    if (!comm || comm->ranks != tp)
        return td_error(TD_ERR_INVALID_ARG, "tp %u: the comm joins %u ranks", tp, comm ? comm->ranks : 0);
    eng_tp_t *t = calloc(1, sizeof *t);
    if (!t)
        return td_error(TD_ERR_NO_MEMORY, "tp: no memory");
    t->m = m;
    t->tp = tp;
    t->comm = comm;
    pthread_mutex_init(&t->mu, NULL);
    pthread_cond_init(&t->cv, NULL);
    td_status_t rc = TD_OK;
    if (!(t->ranks = calloc(tp, sizeof *t->ranks)))
        rc = td_error(TD_ERR_NO_MEMORY, "tp: no memory");
    for (uint32_t r = 0; !rc && r < tp; r++) {
        rank_t *k = &t->ranks[r];
        k->t = t, k->r = r;
        if (!(rc = eng_tp_plan(m, tp, r, &k->shard)))
            rc = eng_forward_create_rank(m, bes[r], pools[r], &k->shard, comm, max_tokens, max_logits, &k->f);
    }
    for (uint32_t r = 1; !rc && r < tp; r++) {
        if (pthread_create(&t->ranks[r].th, NULL, rank_main, &t->ranks[r]))
            rc = td_error(TD_ERR_NO_MEMORY, "tp: no thread for rank %u", r);
        else
            t->ranks[r].started = true;
    }
    if (rc) {
        eng_tp_destroy(t);
        return rc;
    }
    *out = t;
    return TD_OK;
}

void eng_tp_destroy(eng_tp_t *t)
{
    if (!t)
        return;
    pthread_mutex_lock(&t->mu);
    t->quit = true;
    pthread_cond_broadcast(&t->cv);
    pthread_mutex_unlock(&t->mu);
    for (uint32_t r = 0; t->ranks && r < t->tp; r++) {
        if (t->ranks[r].started)
            pthread_join(t->ranks[r].th, NULL);
        eng_forward_destroy(t->ranks[r].f);
    }
    pthread_mutex_destroy(&t->mu);
    pthread_cond_destroy(&t->cv);
    free(t->ranks);
    free(t);
}

/* One step on every rank: rank 0's here, the others' on their threads. */
static td_status_t step(eng_tp_t *t, const eng_batch_seq_t *seqs, uint32_t n_seqs, const kern_sample_t *sample,
                        const uint8_t *masks, int32_t *ids)
{
    pthread_mutex_lock(&t->mu);
    t->seqs = seqs, t->n_seqs = n_seqs;
    t->sample = sample, t->masks = masks, t->ids = ids;
    t->done = 0;
    t->posted++;
    pthread_cond_broadcast(&t->cv);
    pthread_mutex_unlock(&t->mu);
    run_rank(&t->ranks[0]);
    /* the other ranks end their step: each of their waits has the comm's deadline, and rank 0's error aborted it */
    pthread_mutex_lock(&t->mu);
    while (t->done < t->tp - 1)
        pthread_cond_wait(&t->cv, &t->mu);
    pthread_mutex_unlock(&t->mu);
    for (uint32_t r = 0; r < t->tp; r++)
        if (t->ranks[r].rc)
            return td_error(t->ranks[r].rc, "tp rank %u: %s", r, t->ranks[r].err);
    return TD_OK;
}

td_status_t eng_tp_run(eng_tp_t *t, const eng_batch_seq_t *seqs, uint32_t n_seqs, const float **logits,
                       uint32_t *n_logits)
{
    td_status_t rc = step(t, seqs, n_seqs, NULL, NULL, NULL);
    if (rc)
        return rc;
    *logits = t->ranks[0].logits; /* gathered: the whole vocabulary's rows */
    *n_logits = t->ranks[0].nl;
    return TD_OK;
}

bool eng_tp_can_sample(const eng_tp_t *t) { return eng_forward_can_sample(t->ranks[0].f); }
uint32_t eng_tp_mask_rows(const eng_tp_t *t) { return eng_forward_mask_rows(t->ranks[0].f); }

td_status_t eng_tp_run_sampled(eng_tp_t *t, const eng_batch_seq_t *seqs, uint32_t n_seqs, const kern_sample_t *p,
                               const uint8_t *masks, int32_t *ids, uint32_t *n_ids)
{
    td_status_t rc = step(t, seqs, n_seqs, p, masks, ids);
    if (!rc)
        *n_ids = t->ranks[0].nl;
    return rc;
}

void eng_tp_set_layer_hook(eng_tp_t *t, void (*fn)(void *ctx, uint32_t layer), void *ctx)
{
    eng_forward_set_layer_hook(t->ranks[0].f, fn, ctx);
}

static td_status_t pass_run(void *p, const eng_batch_seq_t *seqs, uint32_t n_seqs, const float **logits,
                            uint32_t *n_logits)
{
    return eng_tp_run(p, seqs, n_seqs, logits, n_logits);
}
static bool pass_can_sample(const void *p) { return eng_tp_can_sample(p); }
static uint32_t pass_mask_rows(const void *p) { return eng_tp_mask_rows(p); }
static td_status_t pass_run_sampled(void *p, const eng_batch_seq_t *seqs, uint32_t n_seqs, const kern_sample_t *sp,
                                    const uint8_t *masks, int32_t *ids, uint32_t *n_ids)
{
    return eng_tp_run_sampled(p, seqs, n_seqs, sp, masks, ids, n_ids);
}
static void pass_set_layer_hook(void *p, void (*fn)(void *ctx, uint32_t layer), void *ctx)
{
    eng_tp_set_layer_hook(p, fn, ctx);
}

const eng_pass_ops_t eng_tp_pass = {.run = pass_run,
                                    .can_sample = pass_can_sample,
                                    .mask_rows = pass_mask_rows,
                                    .run_sampled = pass_run_sampled,
                                    .set_layer_hook = pass_set_layer_hook};

void eng_tp_kv_heads(const eng_tp_t *t, uint32_t r, uint32_t *head0, uint32_t *heads)
{
    *head0 = t->ranks[r].shard.kv_head0;
    *heads = t->ranks[r].shard.kv_heads;
}

/* The device of rank r in a list "cuda:0,1" / "cuda:0,cuda:1" (*gpu), or the CPU for "cpu" / NULL (*gpu -1). */
static td_status_t rank_device(const char *devices, uint32_t tp, uint32_t r, int *gpu)
{
    *gpu = -1;
    if (!devices || !strcmp(devices, "cpu"))
        return TD_OK;
    if (strncmp(devices, "cuda:", 5))
        return td_error(TD_ERR_INVALID_ARG, "tp %u: devices '%s': cpu, or a GPU a rank (cuda:0,1)", tp, devices);
    const char *p = devices + 5;
    for (uint32_t i = 0;; i++) {
        if (!strncmp(p, "cuda:", 5))
            p += 5;
        char *end;
        long n = strtol(p, &end, 10);
        if (end == p || n < 0 || (*end && *end != ','))
            return td_error(TD_ERR_INVALID_ARG, "tp %u: devices '%s': cpu, or a GPU a rank (cuda:0,1)", tp, devices);
        if (i == r)
            *gpu = (int)n;
        if (!*end) {
            if (i + 1 != tp)
                return td_error(TD_ERR_INVALID_ARG, "tp %u: devices '%s' name %u GPUs: one a rank", tp, devices,
                                i + 1);
            return TD_OK;
        }
        p = end + 1;
    }
}

td_status_t eng_tp_open(const eng_model_t *m, uint32_t tp, const char *devices, int n_threads,
                        kern_numerics_t numerics, const td_kv_layout_t *g, uint32_t n_blocks,
                        const eng_kv_memory_t *mem, uint32_t max_tokens, uint32_t max_logits, eng_tp_set_t *out)
{
    memset(out, 0, sizeof *out);
    if (tp < 2 || tp > ENG_TP_MAX)
        return td_error(TD_ERR_INVALID_ARG, "tp %u: 2 to %d ranks", tp, ENG_TP_MAX);
    out->tp = tp;
    uint32_t head0[ENG_TP_MAX], heads[ENG_TP_MAX];
    int gpus[ENG_TP_MAX];
    bool distinct = true, same = true; /* a GPU a rank: NCCL; the CPU, or one GPU for all: the comm in memory */
    td_status_t rc = TD_OK;
    for (uint32_t r = 0; r < tp && !rc; r++) {
        eng_shard_t s;
        char name[24];
        if ((rc = eng_tp_plan(m, tp, r, &s)) || (rc = rank_device(devices, tp, r, &gpus[r])))
            break;
        head0[r] = s.kv_head0, heads[r] = s.kv_heads;
        for (uint32_t q = 0; q < r; q++)
            distinct = distinct && gpus[q] != gpus[r];
        same = same && gpus[r] == gpus[0];
        snprintf(name, sizeof name, gpus[r] >= 0 ? "cuda:%d" : "cpu", gpus[r]);
        rc = eng_backend_open(name, n_threads, numerics, &out->bes[r]);
    }
    if (!rc && gpus[0] >= 0 && distinct)
#ifdef TANDEM_HAVE_CUDA
        rc = kern_comm_nccl_create(tp, out->bes, &out->comm);
#else
        rc = td_error(TD_ERR_UNSUPPORTED, "tp %u: this build has no CUDA backend", tp);
#endif
    else if (!rc && !same)
        rc = td_error(TD_ERR_INVALID_ARG, "tp %u: devices '%s': a GPU a rank, or one GPU for them all", tp, devices);
    else if (!rc)
        rc = kern_comm_memory_create(tp, 60000, &out->comm);
    if (!rc)
        rc = eng_kv_pool_create_parts(out->bes, tp, head0, heads, g, n_blocks, mem, &out->pool);
    eng_kv_pool_t *pools[ENG_TP_MAX];
    for (uint32_t r = 0; r < tp; r++)
        pools[r] = out->pool;
    if (!rc)
        rc = eng_tp_create(m, tp, out->bes, pools, out->comm, max_tokens, max_logits, &out->fwd);
    if (rc)
        eng_tp_close(out);
    return rc;
}

void eng_tp_close(eng_tp_set_t *s)
{
    eng_tp_destroy(s->fwd);
    eng_kv_pool_destroy(s->pool);
    if (s->comm)
        s->comm->ops->destroy(s->comm);
    for (uint32_t r = 0; r < s->tp; r++)
        if (s->bes[r])
            kern_backend_destroy(s->bes[r]);
    memset(s, 0, sizeof *s);
}
