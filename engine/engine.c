/* engine.c — see engine.h.
 *
 * A sequence's state: its tokens (prompt, then generated), how many have KV in
 * the pool (n_computed), the block table that holds them, its sampler and
 * stop-string window. A step:
 *   1. running sequences whose prompt is done take one decode token each; a
 *      sequence that needs a new block and finds none preempts the newest
 *      sequence (whose blocks are freed; it recomputes from its tokens later);
 *   2. waiting sequences (FIFO) take prompt chunks from what is left of the
 *      token budget; a sequence starting from zero first looks its full prompt
 *      blocks up in the prefix cache;
 *   3. one forward pass; sequences whose chunk reached their last token sample;
 *   4. full blocks are named and published; finished sequences free theirs.
 * Each row's arithmetic does not depend on the rest of the batch, so a
 * sequence's tokens are the same alone or batched, chunked or not, cached or not. */
#include "engine/engine.h"
#ifdef TANDEM_HAVE_CUDA
#include "kernels/cuda/backend_cuda.h"
#endif

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/blockhash.h"
#include "common/clock.h"
#include "common/config.h"
#include "common/log.h"
#include "engine/forward.h"
#include "engine/grammar_cache.h"
#include "engine/swap.h"
#include "engine/tp.h"
#include "engine/grammar.h"
#include "engine/tokenizer.h"

typedef enum seq_state { SEQ_WAITING, SEQ_RUNNING, SEQ_DONE } seq_state_t;

typedef struct eng_seq {
    uint64_t id;
    seq_state_t state;
    int32_t *tokens;
    uint32_t n_tokens, cap_tokens, n_prompt, n_computed, n_cached;
    uint32_t decode_from; /* first generated position (a resumed stream's prompt holds some) */
    double blocked_since; /* when it last found no KV block and nothing to preempt (0: not blocked) */
    int32_t *blocks;
    uint32_t n_blocks, cap_blocks, n_published; /* blocks [0, n_published) are named */
    td_block_name_t last_name;                  /* name of block n_published - 1 */
    eng_sampler_t sampler;
    eng_logprobs_t lp; /* the token being accepted's, where asked */
    bool has_lp;
    eng_logprobs_t *plp; /* sampling.prompt_logprobs: prompt tokens 1 .. n_prompt - 1's (entry i: token i + 1) */
    bool plp_sent;       /* they went out on the first event */
    uint32_t max_tokens;
    int32_t priority;
    double deadline; /* td_now_s() by which its prompt must be computed (0: none) */
    double arrived;  /* td_now_s() when added */
    /* the queue order's (engine/sched.h): the names of its shareable prompt blocks (cache and mlq orders), the
     * tokens it had to compute when first seen and those computed since (mlq) */
    td_block_name_t *pnames;
    uint32_t n_pnames, sched_entry, sched_served;
    /* preempted and swapped out (cfg.swap_bytes): its first swap_tokens positions' KV, swap_blocks blocks in a
     * region of the swap space (engine/swap.h), until the pool has room again */
    uint8_t *swap;
    uint32_t swap_blocks, swap_tokens;
    bool ignore_eos;
    char **stop;
    size_t n_stop, max_stop;
    eng_tok_stream_t stream;
    int32_t forced;                             /* a first token sampled elsewhere, not yet accepted (-1) */
    int grammar_slot;                           /* its grammar's slot in e->grammars (-1: none) */
    char *text;                                 /* generated text not yet emitted (held for stop strings) */
    size_t text_len, text_cap;
    struct eng_seq *next;
} eng_seq_t;

struct eng_engine {
    eng_model_t *m;
    eng_engine_config_t cfg;
    kern_backend_t *be;
    bool own_be; /* made here (cfg.backend NULL) */
    eng_kv_pool_t *pool;
    eng_forward_t *fwd; /* NULL with tensor parallelism: */
    eng_tp_set_t tp;    /* its ranks (tp.tp 0: none) */
    const eng_pass_ops_t *pass; /* the steps run on fwd or tp.fwd: */
    void *pass_on;
    td_block_name_t root;
    eng_seq_t *seqs; /* all live sequences, oldest first */
    uint64_t next_id;
    eng_batch_seq_t *batch;
    eng_seq_t **batch_seq;
    int32_t eog[8];
    size_t n_eog;
    eng_layer_fn layer_fn;
    void *layer_ctx;
    eng_layer_seq_t *layer_seqs;
    kern_sample_t *sample; /* a step's picks made by the backend: their parameters, */
    int32_t *picked;       /* and the tokens */
    uint8_t *masks;        /* and the masked ones' allowed tokens (structured output), eng_forward_mask_rows rows */
    uint32_t n_batch;
    eng_grammar_cache_t grammars; /* structured output's compiled grammars (engine/grammar_cache.h) */
    uint64_t preemptions;
    uint64_t prompt_computed; /* prompt tokens run through the model (not from the prefix cache), recomputed ones too */
    char err[512]; /* the message of the failure being reported */
    bool stalled;  /* the last step ran nothing: every request waits for blocks */
    double tok_s;  /* seconds a step takes per token it computes (a moving average; 0: none yet) */
    /* the prompt queue a step orders (engine/sched.h), room for every live sequence (grown in eng_engine_add):
     * the prompts still to compute, their order, and the names of the blocks prompts under way compute next */
    eng_sched_item_t *q_items;
    eng_seq_t **q_seqs;
    uint32_t *q_idx, *q_scratch, q_cap, n_live;
    td_block_name_t *q_busy;
    uint32_t n_busy;
    eng_swap_t sw; /* the swap space (cfg.swap_bytes) */
};

const char *eng_finish_name(eng_finish_t f)
{
    static const char *const n[] = {"", "eos", "stop", "length", "cancelled", "error"};
    return n[f];
}

eng_engine_config_t eng_engine_config_default(void)
{
    return (eng_engine_config_t){.n_threads = 0, .block_tokens = 16, .kv_dtype = TD_KV_F16, .kv_tokens = 0,
                                 .kv_bytes = 64u << 20, .token_budget = 512, .max_seqs = 64, .prefix_cache = true,
                                 .block_wait_s = 10, .sched = eng_sched_config_default()};
}

td_status_t eng_backend_open(const char *device, int n_threads, kern_numerics_t numerics, kern_backend_t **out)
{
    if (!device || !strcmp(device, "cpu"))
        return kern_cpu_backend_create_numerics(n_threads, numerics, out);
    int gpu;
    if (!td_device_parse(device, &gpu))
        return td_error(TD_ERR_INVALID_ARG, "device '%s': it must be cpu, cuda or cuda:N", device);
    if (numerics == KERN_NUMERICS_REFERENCE)
        return td_error(TD_ERR_UNSUPPORTED, "device '%s': reference numerics (llama.cpp's rounding) are the CPU "
                        "backend's only; use fast", device);
#ifdef TANDEM_HAVE_CUDA
    return kern_cuda_backend_create(gpu, out); /* its errors say "cuda: " and the device */
#else
    return td_error(TD_ERR_UNSUPPORTED, "device '%s': this build has no CUDA backend (configure with "
                    "-DTANDEM_CUDA=ON where the CUDA toolkit is installed)", device);
#endif
}

td_status_t eng_engine_create(eng_model_t *m, const eng_engine_config_t *cfg, eng_engine_t **out)
{
    if (cfg->block_tokens < 1 || cfg->block_tokens > 256 || !cfg->token_budget || !cfg->max_seqs)
        return td_error(TD_ERR_INVALID_ARG, "engine: block_tokens %u, token_budget %u, max_seqs %u: all must be "
                        "positive (block_tokens at most 256)", cfg->block_tokens, cfg->token_budget, cfg->max_seqs);
    if (cfg->sched.order >= ENG_ORDER_COUNT || cfg->sched.levels < 1 || cfg->sched.levels > 16 || !cfg->sched.quantum)
        return td_error(TD_ERR_INVALID_ARG, "engine: queue order %d with %u levels and a quantum of %u tokens: the "
                        "order must be fcfs, cache or mlq, the levels 1..16, the quantum positive",
                        (int)cfg->sched.order, cfg->sched.levels, cfg->sched.quantum);
    eng_engine_t *e = calloc(1, sizeof *e);
    if (!e)
        return td_error(TD_ERR_NO_MEMORY, "engine: no memory");
    e->m = m;
    e->cfg = *cfg;
    e->next_id = 1;
    td_kv_layout_t g = td_kv_layout_make(m->kv_id, m->desc.n_layers, m->desc.n_kv_heads, m->desc.head_dim,
                                         cfg->block_tokens, cfg->kv_dtype);
    g.tp = cfg->tp > 1 ? cfg->tp : 1;
    size_t bb = td_kv_block_bytes(&g);
    uint64_t blocks = cfg->kv_tokens ? (cfg->kv_tokens + cfg->block_tokens - 1) / cfg->block_tokens
                                     : (cfg->kv_bytes ? cfg->kv_bytes : 64u << 20) / bb;
    if (blocks < 2 || blocks > (1u << 30)) {
        free(e);
        return td_error(TD_ERR_INVALID_ARG, "engine: a KV pool of %llu blocks (%zu bytes each) is not usable",
                        (unsigned long long)blocks, bb);
    }
    td_status_t rc = TD_OK;
    if (cfg->tp > 1) { /* the ranks' backends, pool and forward (engine/tp.h) */
        if (cfg->backend)
            rc = td_error(TD_ERR_UNSUPPORTED, "engine: tp %u makes its own backends (a caller's backend is for one "
                          "rank)", cfg->tp);
        else if (!(rc = eng_tp_open(m, cfg->tp, cfg->device, cfg->n_threads, cfg->numerics, &g, (uint32_t)blocks,
                                    &cfg->kv_memory, cfg->token_budget, cfg->max_seqs, &e->tp)))
            e->be = e->tp.bes[0], e->pool = e->tp.pool, e->pass = &eng_tp_pass, e->pass_on = e->tp.fwd;
    } else {
        if (cfg->backend)
            e->be = cfg->backend;
        else if (!(rc = eng_backend_open(cfg->device, cfg->n_threads, cfg->numerics, &e->be)))
            e->own_be = true;
        if (!rc)
            rc = kern_backend_check(e->be, KERN_OPS_FORWARD);
        if (!rc)
            rc = eng_kv_pool_create(e->be, &g, (uint32_t)blocks, &cfg->kv_memory, &e->pool);
        if (!rc && !(rc = eng_forward_create(m, e->be, e->pool, cfg->token_budget, cfg->max_seqs, &e->fwd)))
            e->pass = &eng_forward_pass, e->pass_on = e->fwd;
    }
    e->batch = calloc(cfg->max_seqs, sizeof *e->batch);
    e->batch_seq = calloc(cfg->max_seqs, sizeof *e->batch_seq);
    e->layer_seqs = calloc(cfg->max_seqs, sizeof *e->layer_seqs);
    e->sample = calloc(cfg->max_seqs, sizeof *e->sample);
    e->picked = calloc(cfg->max_seqs, sizeof *e->picked);
    const uint32_t mask_rows = rc ? 0 : e->pass->mask_rows(e->pass_on);
    if (mask_rows && !(e->masks = calloc(mask_rows, ((size_t)m->desc.vocab + 7) / 8)))
        rc = td_error(TD_ERR_NO_MEMORY, "engine: no memory for structured output's masks");
    if (!rc && (!e->batch || !e->batch_seq || !e->layer_seqs || !e->sample || !e->picked))
        rc = td_error(TD_ERR_NO_MEMORY, "engine: no memory");
    if (rc) {
        eng_engine_destroy(e);
        return rc;
    }
    e->root = td_block_name_root(m->kv_id, td_kv_dtype_name(cfg->kv_dtype), cfg->block_tokens);
    eng_swap_init(&e->sw, e->be, cfg->swap_bytes);
    e->n_eog = eng_tokenizer_eog(m->tok, e->eog, 8);
    if (e->n_eog > 8)
        e->n_eog = 8;
    *out = e;
    return TD_OK;
}

static void seq_free_blocks(eng_engine_t *e, eng_seq_t *s)
{
    for (uint32_t i = 0; i < s->n_blocks; i++)
        eng_kv_unref(e->pool, s->blocks[i]);
    s->n_blocks = 0;
    s->n_published = 0;
    s->n_computed = 0;
}

static void seq_destroy(eng_engine_t *e, eng_seq_t *s)
{
    eng_grammar_cache_release(&e->grammars, s->grammar_slot);
    free(s->plp);
    seq_free_blocks(e, s);
    eng_sampler_free(&s->sampler);
    for (size_t i = 0; i < s->n_stop; i++)
        free(s->stop[i]);
    free(s->stop);
    free(s->tokens);
    free(s->blocks);
    free(s->pnames);
    eng_swap_give(&e->sw, s->swap); /* its region of the swap space (if it holds one) is free again */
    free(s->text);
    free(s);
}

void eng_engine_destroy(eng_engine_t *e)
{
    if (!e)
        return;
    while (e->seqs) {
        eng_seq_t *s = e->seqs;
        e->seqs = s->next;
        seq_destroy(e, s);
    }
    eng_swap_destroy(&e->sw);
    eng_forward_destroy(e->fwd);
    if (e->tp.tp)
        eng_tp_close(&e->tp);
    else
        eng_kv_pool_destroy(e->pool);
    if (e->own_be)
        kern_backend_destroy(e->be);
    free(e->batch);
    free(e->batch_seq);
    free(e->layer_seqs);
    free(e->sample);
    free(e->picked);
    free(e->masks);
    free(e->q_items);
    free(e->q_seqs);
    free(e->q_idx);
    free(e->q_scratch);
    free(e->q_busy);
    eng_grammar_cache_free(&e->grammars);
    free(e);
}

static void text_append(eng_seq_t *s, const char *p, size_t n);

/* Structured output for s (r->sampling.grammar): its matcher, moved past the
 * tokens a resumed stream generated before. */
static td_status_t seq_grammar(eng_engine_t *e, eng_seq_t *s, const eng_request_t *r)
{
    eng_matcher_t *m;
    td_status_t rc = eng_grammar_cache_matcher(&e->grammars, &r->sampling, e->m->tok, e->eog, e->n_eog,
                                               &s->grammar_slot, &m);
    if (rc)
        return rc;
    eng_sampler_set_matcher(&s->sampler, m);
    for (size_t i = r->n_prompt - r->resume_generated; i < r->n_prompt; i++)
        if (!eng_sampler_accept(&s->sampler, r->prompt[i]))
            return td_user_error("resume: generated token %zu (%d) does not continue the structured output",
                                 i - (r->n_prompt - r->resume_generated), r->prompt[i]);
    return TD_OK;
}

/* Room in the step's prompt queue for n sequences (a step allocates nothing). */
static bool queue_room(eng_engine_t *e, uint32_t n)
{
    if (n <= e->q_cap)
        return true;
    uint32_t cap = e->q_cap ? 2 * e->q_cap : 64;
    while (cap < n)
        cap *= 2;
    void *a = realloc(e->q_items, cap * sizeof *e->q_items);
    if (a)
        e->q_items = a;
    void *b = a ? realloc(e->q_seqs, cap * sizeof *e->q_seqs) : NULL;
    if (b)
        e->q_seqs = b;
    void *c = b ? realloc(e->q_idx, cap * sizeof *e->q_idx) : NULL;
    if (c)
        e->q_idx = c;
    void *d = c ? realloc(e->q_scratch, cap * sizeof *e->q_scratch) : NULL;
    if (d)
        e->q_scratch = d;
    void *f = d ? realloc(e->q_busy, 2 * cap * sizeof *e->q_busy) : NULL; /* a prompt's name twice at most */
    if (!f)
        return false;
    e->q_busy = f;
    e->q_cap = cap;
    return true;
}

static uint32_t seq_shareable(const eng_engine_t *e, const eng_seq_t *s, uint32_t limit);

/* The names of s's shareable full prompt blocks, which the cache and mlq
 * orders look up each step (computed once here, not per step). */
static bool seq_name_prompt(eng_engine_t *e, eng_seq_t *s)
{
    uint32_t bt = e->cfg.block_tokens, n = seq_shareable(e, s, s->n_prompt - 1) / bt;
    if (!n)
        return true;
    if (!(s->pnames = malloc(n * sizeof *s->pnames)))
        return false;
    td_block_name_t h = e->root;
    for (uint32_t b = 0; b < n; b++)
        s->pnames[b] = h = td_block_name_next(h, s->tokens + b * bt, bt);
    s->n_pnames = n;
    return true;
}

td_status_t eng_engine_add(eng_engine_t *e, const eng_request_t *r, uint64_t *id)
{
    const eng_model_desc_t *d = &e->m->desc;
    uint32_t ctx = d->context ? d->context : 4096;
    if (!r->n_prompt)
        return td_user_error("prompt is empty");
    if (!r->max_tokens && !r->sampling.prompt_logprobs)
        return td_user_error("max_tokens is 0; it must be at least 1 (0 only scores the prompt: prompt_logprobs)");
    if (r->n_prompt >= ctx || r->n_prompt + r->max_tokens > ctx)
        return td_user_error("prompt of %zu tokens + max_tokens %u is longer than the context of %u "
                             "tokens", r->n_prompt, r->max_tokens, ctx);
    uint64_t pool_tokens = (uint64_t)eng_kv_stats(e->pool).n_blocks * e->cfg.block_tokens;
    if (r->n_prompt + r->max_tokens > pool_tokens)
        return td_user_error("prompt of %zu tokens + max_tokens %u does not fit the KV pool of %llu "
                             "tokens", r->n_prompt, r->max_tokens, (unsigned long long)pool_tokens);
    for (size_t i = 0; i < r->n_prompt; i++)
        if (r->prompt[i] < 0 || (uint32_t)r->prompt[i] >= d->vocab)
            return td_user_error("prompt token %zu is %d, outside the vocabulary of %u", i,
                                 r->prompt[i], d->vocab);
    for (size_t i = 0; i < r->n_stop; i++)
        if (!r->stop[i] || !r->stop[i][0])
            return td_user_error("stop string %zu is empty", i);
    if (r->sampling.min_tokens > r->max_tokens)
        return td_user_error("min_tokens %u is over max_tokens %u", r->sampling.min_tokens, r->max_tokens);
    if (r->kv_blocks && (r->first_token < 0 || (uint32_t)r->first_token >= d->vocab))
        return td_user_error("first_token %d is outside the vocabulary of %u", r->first_token,
                             d->vocab);
    eng_seq_t *s = calloc(1, sizeof *s);
    if (!s)
        return td_error(TD_ERR_NO_MEMORY, "engine: no memory");
    s->grammar_slot = -1;
    td_status_t rc = eng_sampler_init(&s->sampler, &r->sampling, (int32_t)d->vocab);
    if (rc) {
        free(s);
        return rc;
    }
    s->sampler.p.grammar_src = NULL; /* the request's: compiled below, not kept */
    s->sampler.p.grammar_choices = NULL;
    eng_sampler_set_eog(&s->sampler, e->eog, (uint32_t)e->n_eog);
    eng_sampler_skip(&s->sampler, r->sampled_before);
    s->cap_tokens = (uint32_t)(r->n_prompt + r->max_tokens);
    s->tokens = malloc(s->cap_tokens * sizeof *s->tokens);
    s->cap_blocks = (s->cap_tokens + e->cfg.block_tokens - 1) / e->cfg.block_tokens;
    s->blocks = malloc(s->cap_blocks * sizeof *s->blocks);
    s->stop = calloc(r->n_stop ? r->n_stop : 1, sizeof *s->stop);
    if (r->sampling.prompt_logprobs && !(s->plp = calloc(r->n_prompt, sizeof *s->plp))) {
        seq_destroy(e, s);
        return td_error(TD_ERR_NO_MEMORY, "engine: no memory");
    }
    if (!s->tokens || !s->blocks || !s->stop) {
        seq_destroy(e, s);
        return td_error(TD_ERR_NO_MEMORY, "engine: no memory");
    }
    memcpy(s->tokens, r->prompt, r->n_prompt * sizeof *s->tokens);
    s->n_tokens = s->n_prompt = (uint32_t)r->n_prompt;
    s->decode_from = (uint32_t)r->n_prompt;
    s->max_tokens = r->max_tokens;
    s->ignore_eos = r->ignore_eos;
    for (size_t i = 0; i < r->n_stop; i++) {
        if (!(s->stop[i] = strdup(r->stop[i]))) {
            seq_destroy(e, s);
            return td_error(TD_ERR_NO_MEMORY, "engine: no memory");
        }
        s->n_stop++;
        size_t l = strlen(r->stop[i]);
        s->max_stop = l > s->max_stop ? l : s->max_stop;
    }
    eng_tok_stream_init(&s->stream, e->m->tok, true);
    if (r->resume_generated) {
        if (r->resume_generated > r->n_prompt) {
            seq_destroy(e, s);
            return td_error(TD_ERR_INVALID_ARG, "resume: %u generated tokens, but the prompt has %zu",
                            r->resume_generated, r->n_prompt);
        }
        s->decode_from = (uint32_t)(r->n_prompt - r->resume_generated);
        char piece[1024];
        size_t plen;
        for (size_t i = r->n_prompt - r->resume_generated; i < r->n_prompt; i++) {
            plen = 0;
            eng_tok_stream_push(&s->stream, r->prompt[i], piece, sizeof piece, &plen);
            text_append(s, piece, plen);
        }
        size_t drop = r->resume_text_sent < s->text_len ? r->resume_text_sent : s->text_len;
        memmove(s->text, s->text + drop, s->text_len - drop);
        s->text_len -= drop;
        if (s->text)
            s->text[s->text_len] = '\0';
    }
    if (r->sampling.grammar && (rc = seq_grammar(e, s, r))) {
        seq_destroy(e, s);
        return rc;
    }
    if (!queue_room(e, e->n_live + 1) ||
        (e->cfg.sched.order != ENG_ORDER_FCFS && e->cfg.prefix_cache && !r->kv_blocks && !seq_name_prompt(e, s))) {
        seq_destroy(e, s);
        return td_error(TD_ERR_NO_MEMORY, "engine: no memory");
    }
    s->arrived = td_now_s();
    s->id = e->next_id++;
    s->state = SEQ_WAITING;
    s->forced = -1;
    if (r->kv_blocks) { /* the prompt's KV is here already; the first token too */
        s->n_blocks = (s->n_prompt + e->cfg.block_tokens - 1) / e->cfg.block_tokens;
        memcpy(s->blocks, r->kv_blocks, s->n_blocks * sizeof *s->blocks);
        s->n_computed = s->n_prompt;
        s->forced = r->first_token;
        s->state = SEQ_RUNNING;
    }
    s->priority = r->priority;
    s->deadline = r->deadline;
    /* at the end, or before the first waiting prompt of lower priority not yet begun */
    eng_seq_t **at = &e->seqs;
    while (*at && !(s->state == SEQ_WAITING && (*at)->state == SEQ_WAITING && !(*at)->n_computed &&
                    (*at)->priority < s->priority))
        at = &(*at)->next;
    s->next = *at;
    *at = s;
    e->n_live++;
    *id = s->id;
    return TD_OK;
}

static void seq_unlink(eng_engine_t *e, eng_seq_t *s)
{
    for (eng_seq_t **p = &e->seqs; *p; p = &(*p)->next)
        if (*p == s) {
            *p = s->next;
            e->n_live--;
            return;
        }
}

td_status_t eng_engine_cancel(eng_engine_t *e, uint64_t id)
{
    for (eng_seq_t *s = e->seqs; s; s = s->next)
        if (s->id == id) {
            seq_unlink(e, s);
            seq_destroy(e, s);
            return TD_OK;
        }
    return td_error(TD_ERR_NOT_FOUND, "engine: no request %llu", (unsigned long long)id);
}

bool eng_engine_busy(const eng_engine_t *e) { return e->seqs != NULL; }
bool eng_engine_stalled(const eng_engine_t *e) { return e->stalled && e->seqs != NULL; }

uint64_t eng_engine_preemptions(const eng_engine_t *e) { return e->preemptions; }

uint64_t eng_engine_prompt_computed(const eng_engine_t *e) { return e->prompt_computed; }

void eng_engine_swaps(const eng_engine_t *e, uint64_t *out, uint64_t *in)
{
    *out = e->sw.outs;
    *in = e->sw.ins;
}

uint32_t eng_engine_n_requests(const eng_engine_t *e)
{
    uint32_t n = 0;
    for (const eng_seq_t *s = e->seqs; s; s = s->next)
        n++;
    return n;
}

td_status_t eng_engine_kv_reserve(eng_engine_t *e, uint32_t n_tokens, int32_t *blocks)
{
    uint32_t need = (n_tokens + e->cfg.block_tokens - 1) / e->cfg.block_tokens;
    for (uint32_t i = 0; i < need; i++)
        if (eng_kv_alloc(e->pool, &blocks[i]) != TD_OK) {
            eng_engine_kv_release(e, blocks, i);
            return TD_ERR_EXHAUSTED;
        }
    return TD_OK;
}

td_status_t eng_engine_kv_reserve_prefix(eng_engine_t *e, const int32_t *tokens, uint32_t n_tokens, int32_t *blocks,
                                         uint32_t *n_held)
{
    uint32_t bt = e->cfg.block_tokens, full = n_tokens ? (n_tokens - 1) / bt : 0, held = 0;
    td_block_name_t h = e->root;
    for (; e->cfg.prefix_cache && held < full; held++) {
        h = td_block_name_next(h, tokens + (size_t)held * bt, bt);
        if ((blocks[held] = eng_kv_lookup(e->pool, h)) < 0)
            break;
    }
    td_status_t rc = eng_engine_kv_reserve(e, n_tokens - held * bt, blocks + held);
    if (rc)
        eng_engine_kv_release(e, blocks, held);
    *n_held = rc ? 0 : held;
    return rc;
}

td_block_name_t eng_engine_block_name(const eng_engine_t *e, const int32_t *tokens, uint32_t n_blocks)
{
    td_block_name_t h = e->root;
    for (uint32_t b = 0; b < n_blocks; b++)
        h = td_block_name_next(h, tokens + (size_t)b * e->cfg.block_tokens, e->cfg.block_tokens);
    return h;
}

void eng_engine_kv_release(eng_engine_t *e, const int32_t *blocks, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++)
        eng_kv_unref(e->pool, blocks[i]);
}

void *eng_engine_kv_base(const eng_engine_t *e, size_t *block_bytes)
{
    if (e->tp.tp) { /* the blocks are in parts, in every rank's memory (eng_kv_layer_pieces) */
        *block_bytes = eng_kv_stats(e->pool).block_bytes;
        return NULL;
    }
    kern_kv_view_t v = eng_kv_view(e->pool, 0);
    *block_bytes = v.block_bytes;
    return v.base;
}

td_status_t eng_engine_kv_digest(eng_engine_t *e, const int32_t *blocks, uint32_t n, uint64_t *out)
{
    if (e->tp.tp) { /* the whole blocks put together on the host */
        const size_t bb = eng_kv_stats(e->pool).block_bytes;
        uint8_t *h = malloc(bb);
        td_status_t rc = h ? TD_OK : td_error(TD_ERR_NO_MEMORY, "engine: no memory for a block's digest");
        for (uint32_t i = 0; i < n && !rc; i++)
            if (!(rc = eng_kv_download(e->pool, blocks + i, 1, h)))
                out[i] = td_kv_block_digest(h, bb);
        free(h);
        return rc;
    }
    kern_kv_view_t v = eng_kv_view(e->pool, 0);
    return e->be->ops->kv_digest(e->be, v.base, v.block_bytes, blocks, n, out);
}

void *eng_engine_queue(eng_engine_t *e) { return e->be->ops->queue(e->be); }

void eng_engine_device_ids(eng_engine_t *e, char *out, size_t cap)
{
    size_t n = 0;
    out[0] = 0;
    for (uint32_t r = 0; r < (e->tp.tp ? e->tp.tp : 1); r++) {
        kern_backend_t *b = e->tp.tp ? e->tp.bes[r] : e->be;
        char id[96];
        if (!b->ops->device_id || b->ops->device_id(b, id, sizeof id) || n + strlen(id) + 2 > cap)
            continue;
        n += (size_t)snprintf(out + n, cap - n, "%s%s", n ? "," : "", id);
    }
}

bool eng_engine_kv_on_host(const eng_engine_t *e)
{
    return e->be->ops->queue(e->be) == NULL && !e->tp.tp; /* parts: no one range of whole blocks */
}

td_status_t eng_engine_kv_download(eng_engine_t *e, const int32_t *blocks, uint32_t n, void *dst)
{
    return eng_kv_download(e->pool, blocks, n, dst);
}

td_status_t eng_engine_kv_upload(eng_engine_t *e, const int32_t *blocks, uint32_t n, const void *src)
{
    td_status_t rc = eng_kv_upload(e->pool, blocks, n, src);
    return rc ? rc : e->be->ops->sync(e->be);
}

td_status_t eng_engine_host_alloc(eng_engine_t *e, size_t bytes, void **ptr)
{
    return e->be->ops->host_alloc(e->be, bytes, ptr);
}

void eng_engine_host_free(eng_engine_t *e, void *ptr)
{
    e->be->ops->host_free(e->be, ptr);
}

static void engine_layer_hook(void *ctx, uint32_t layer)
{
    eng_engine_t *e = ctx;
    e->layer_fn(e->layer_ctx, layer, e->layer_seqs, e->n_batch);
}

void eng_engine_set_layer_hook(eng_engine_t *e, eng_layer_fn fn, void *ctx)
{
    e->layer_fn = fn;
    e->layer_ctx = ctx;
    /* tensor-parallel: rank 0's, once every rank's layer is stored */
    e->pass->set_layer_hook(e->pass_on, fn ? engine_layer_hook : NULL, e);
}
eng_kv_stats_t eng_engine_kv_stats(const eng_engine_t *e) { return eng_kv_stats(e->pool); }
eng_kv_pool_t *eng_engine_kv_pool(eng_engine_t *e) { return e->pool; }
td_kv_layout_t eng_engine_kv_contract(const eng_engine_t *e) { return *eng_kv_layout(e->pool); }

/* Makes the block table cover positions [0, upto); false if the pool is out. */
static bool seq_reserve(eng_engine_t *e, eng_seq_t *s, uint32_t upto)
{
    uint32_t need = (upto + e->cfg.block_tokens - 1) / e->cfg.block_tokens;
    while (s->n_blocks < need) {
        int32_t b;
        if (eng_kv_alloc(e->pool, &b) != TD_OK)
            return false;
        s->blocks[s->n_blocks++] = b;
    }
    return true;
}

/* Copies s's computed KV to host memory before its blocks are freed, when
 * there is room under cfg.swap_bytes and the copy out and back is predicted
 * to take less than computing its tokens again (the engine's measured time a
 * token; a worker that never computed a prompt chunk swaps). */
static bool seq_swap_out(eng_engine_t *e, eng_seq_t *s)
{
    uint32_t bt = e->cfg.block_tokens, nb = (s->n_computed + bt - 1) / bt;
    size_t bytes = (size_t)nb * eng_kv_stats(e->pool).block_bytes;
    uint8_t *buf;
    if (!nb || nb > s->n_blocks || !eng_swap_worth(&e->sw, bytes, e->tok_s * s->n_computed) ||
        !(buf = eng_swap_take(&e->sw, bytes)))
        return false;
    double t0 = td_now_s();
    if (eng_engine_kv_download(e, s->blocks, nb, buf) != TD_OK) {
        eng_swap_give(&e->sw, buf);
        return false;
    }
    eng_swap_timed(&e->sw, bytes, td_now_s() - t0);
    s->swap = buf;
    s->swap_blocks = nb;
    s->swap_tokens = s->n_computed;
    e->sw.outs++;
    return true;
}

/* Frees the newest running or partly prefilled sequence other than keep;
 * it goes back to waiting, its KV swapped out (seq_swap_out) or computed
 * again later. */
static bool preempt_one(eng_engine_t *e, const eng_seq_t *keep)
{
    eng_seq_t *victim = NULL;
    for (eng_seq_t *s = e->seqs; s; s = s->next)
        if (s != keep && s->n_blocks > 0)
            victim = s;
    if (!victim)
        return false;
    bool swapped = seq_swap_out(e, victim);
    TD_DEBUG("engine: preempting request %llu (%u tokens): %s", (unsigned long long)victim->id, victim->n_tokens,
             swapped ? "swapped out" : "to be recomputed");
    seq_free_blocks(e, victim);
    victim->state = SEQ_WAITING;
    e->preemptions++;
    return true;
}

/* Brings swapped-out sequences back, oldest first, while the pool holds
 * them and a block for each sequence decoding beside them (else the next
 * step would preempt again). Nothing is computed: their KV is uploaded. */
static void swap_in(eng_engine_t *e)
{
    uint32_t decoding = 0;
    for (eng_seq_t *s = e->seqs; s; s = s->next)
        decoding += s->state == SEQ_RUNNING && !s->swap;
    for (eng_seq_t *s = e->seqs; s; s = s->next) {
        if (!s->swap)
            continue;
        eng_kv_stats_t k = eng_kv_stats(e->pool);
        if (k.free + k.cached < s->swap_blocks + decoding)
            return;
        if (!seq_reserve(e, s, s->swap_tokens)) {
            seq_free_blocks(e, s);
            return;
        }
        double t0 = td_now_s();
        td_status_t rc = eng_engine_kv_upload(e, s->blocks, s->swap_blocks, s->swap);
        if (rc) { /* the copy back failed: it is computed again instead */
            TD_WARN("engine: request %llu's KV could not come back from host memory (%s); computing it again",
                    (unsigned long long)s->id, td_last_error());
            seq_free_blocks(e, s);
        } else {
            s->n_computed = s->swap_tokens;
            s->state = SEQ_RUNNING;
            e->sw.ins++;
            eng_swap_timed(&e->sw, (size_t)s->swap_blocks * k.block_bytes, td_now_s() - t0);
        }
        eng_swap_give(&e->sw, s->swap); /* its region is free again */
        s->swap = NULL;
        s->swap_blocks = s->swap_tokens = 0;
        decoding++;
    }
}

/* The positions [0, limit) of s whose KV may be named and shared. A block's
 * bytes must be those any sequence with the same tokens would compute cold
 * (DESIGN.md §1's invariant). Under reference numerics a generated position
 * (from decode_from on) rounds unlike a prompt position, so the KV of a block
 * holding one is not what a later prompt with those tokens computes: such
 * blocks are neither published nor taken from the cache. Fast numerics round
 * every row alike. */
static uint32_t seq_shareable(const eng_engine_t *e, const eng_seq_t *s, uint32_t limit)
{
    if (e->cfg.numerics == KERN_NUMERICS_REFERENCE && limit > s->decode_from)
        return s->decode_from;
    return limit;
}

/* A sequence starting from zero takes its cached full prompt blocks (all but
 * the block of the last prompt token, which must be computed for its logits). */
static void seq_use_prefix_cache(eng_engine_t *e, eng_seq_t *s)
{
    uint32_t bt = e->cfg.block_tokens, full = seq_shareable(e, s, s->n_tokens - 1) / bt;
    td_block_name_t h = e->root;
    for (uint32_t b = 0; b < full; b++) {
        h = td_block_name_next(h, s->tokens + b * bt, bt);
        int32_t blk = eng_kv_lookup(e->pool, h);
        if (blk < 0)
            break;
        s->blocks[s->n_blocks++] = blk;
        s->n_published = b + 1;
        s->last_name = h;
    }
    s->n_computed = s->n_blocks * bt;
    if (s->n_cached < s->n_computed && s->n_computed <= s->n_prompt)
        s->n_cached = s->n_computed;
}

static void seq_publish(eng_engine_t *e, eng_seq_t *s)
{
    uint32_t bt = e->cfg.block_tokens;
    uint32_t limit = seq_shareable(e, s, s->n_computed);
    while (e->cfg.prefix_cache && (s->n_published + 1) * bt <= limit) {
        uint32_t b = s->n_published;
        td_block_name_t h = td_block_name_next(b ? s->last_name : e->root, s->tokens + b * bt, bt);
        int32_t got = eng_kv_publish(e->pool, s->blocks[b], h);
        if (got != s->blocks[b]) { /* an equal block is cached already: share it */
            eng_kv_ref(e->pool, got);
            eng_kv_unref(e->pool, s->blocks[b]);
            s->blocks[b] = got;
        }
        s->last_name = h;
        s->n_published++;
    }
}

static bool is_eog(const eng_engine_t *e, int32_t t)
{
    for (size_t i = 0; i < e->n_eog; i++)
        if (e->eog[i] == t)
            return true;
    return false;
}

static void text_append(eng_seq_t *s, const char *p, size_t n)
{
    if (s->text_len + n + 1 > s->text_cap) {
        size_t nc = s->text_cap ? s->text_cap * 2 : 256;
        while (nc < s->text_len + n + 1)
            nc *= 2;
        char *t = realloc(s->text, nc);
        if (!t)
            return;
        s->text = t;
        s->text_cap = nc;
    }
    memcpy(s->text + s->text_len, p, n);
    s->text_len += n;
    s->text[s->text_len] = '\0';
}

/* The prompt's log-probabilities on the first event (sampling.prompt_logprobs). */
static void seq_prompt_logprobs(eng_seq_t *s, eng_event_t *ev)
{
    if (!s->plp || s->plp_sent)
        return;
    ev->prompt_logprobs = s->plp;
    ev->n_prompt_logprobs = s->n_prompt - 1;
    s->plp_sent = true;
}

/* A request that only scores its prompt (max_tokens 0): its one event, after the prompt. */
static void seq_scored(eng_seq_t *s, eng_event_fn fn, void *ctx)
{
    eng_event_t ev = {.id = s->id, .token = -1, .text = "", .finish = ENG_FINISH_LENGTH, .n_prompt = s->n_prompt,
                      .n_cached = s->n_cached};
    seq_prompt_logprobs(s, &ev);
    fn(ctx, &ev);
    s->state = SEQ_DONE;
}

/* Appends a sampled token, decides whether the sequence ends, emits. */
static void seq_fail(eng_engine_t *e, eng_seq_t *s, eng_event_fn fn, void *ctx);

static void seq_accept(eng_engine_t *e, eng_seq_t *s, int32_t tok, eng_event_fn fn, void *ctx)
{
    if (!eng_sampler_accept(&s->sampler, tok)) { /* only a first token sampled without the grammar can */
        snprintf(e->err, sizeof e->err, "structured output: token %d does not continue the text", tok);
        seq_fail(e, s, fn, ctx);
        return;
    }
    s->tokens[s->n_tokens++] = tok;
    uint32_t gen = s->n_tokens - s->n_prompt;
    eng_finish_t fin = ENG_FINISH_NONE;
    char piece[1024];
    size_t plen = 0;
    /* no stop condition before min_tokens (the sampler held the end tokens and stop_ids back) */
    const bool may_stop = gen >= s->sampler.p.min_tokens;
    if (!s->ignore_eos && is_eog(e, tok))
        fin = ENG_FINISH_EOS;
    else
        eng_tok_stream_push(&s->stream, tok, piece, sizeof piece, &plen);
    if (fin == ENG_FINISH_NONE && may_stop && eng_sampler_is_stop_id(&s->sampler, tok))
        fin = ENG_FINISH_STOP; /* its text kept (a special token's is empty) */
    text_append(s, piece, plen);
    /* a stop string ends the text where it begins; keep back what could still
     * become one (max_stop - 1 bytes, on a character boundary) */
    size_t emit = s->text_len;
    for (size_t i = 0; i < s->n_stop && fin == ENG_FINISH_NONE && may_stop; i++) {
        char *hit = strstr(s->text, s->stop[i]);
        if (hit) {
            fin = ENG_FINISH_STOP;
            emit = (size_t)(hit - s->text);
        }
    }
    if (fin == ENG_FINISH_NONE && gen >= s->max_tokens)
        fin = ENG_FINISH_LENGTH;
    if (fin == ENG_FINISH_NONE && s->max_stop > 1) {
        emit = s->text_len > s->max_stop - 1 ? s->text_len - (s->max_stop - 1) : 0;
        while (emit > 0 && ((unsigned char)s->text[emit] & 0xc0) == 0x80)
            emit--;
    }
    eng_event_t ev = {.id = s->id, .token = tok, .text = s->text, .text_len = emit, .finish = fin,
                      .n_prompt = s->n_prompt, .n_generated = gen, .n_cached = s->n_cached,
                      .logprobs = s->has_lp ? &s->lp : NULL};
    seq_prompt_logprobs(s, &ev);
    fn(ctx, &ev);
    memmove(s->text, s->text + emit, s->text_len - emit);
    s->text_len -= emit;
    if (fin != ENG_FINISH_NONE)
        s->state = SEQ_DONE;
}

/* Ends s with ENG_FINISH_ERROR and e->err as its message. */
static void seq_fail(eng_engine_t *e, eng_seq_t *s, eng_event_fn fn, void *ctx)
{
    eng_event_t ev = {.id = s->id, .token = -1, .text = "", .finish = ENG_FINISH_ERROR, .error = e->err,
                      .n_prompt = s->n_prompt, .n_generated = s->n_tokens - s->n_prompt, .n_cached = s->n_cached};
    fn(ctx, &ev);
    s->state = SEQ_DONE;
}

/* A request that can get no KV block, with nothing this engine could
 * preempt: the blocks are held by landing reservations, which are claimed
 * (becoming sequences that can be preempted) or expire within their lease.
 * It waits that long — up to cfg.block_wait_s — and then fails, rather than
 * every step failing while it waits (true: it failed now). */
static bool seq_blocked(eng_engine_t *e, eng_seq_t *s, eng_event_fn fn, void *ctx);

static void no_block_error(eng_engine_t *e, const eng_seq_t *s)
{
    eng_kv_stats_t k = eng_kv_stats(e->pool);
    uint32_t mine = 0;
    for (const eng_seq_t *q = e->seqs; q; q = q->next)
        mine += q->n_blocks;
    snprintf(e->err, sizeof e->err, "the KV pool (%u blocks) has no block for request %llu: %u are held outside "
             "the engine's requests (landing reservations), nothing can be preempted", k.n_blocks,
             (unsigned long long)s->id, k.in_use > mine ? k.in_use - mine : 0);
}

static bool seq_blocked(eng_engine_t *e, eng_seq_t *s, eng_event_fn fn, void *ctx)
{
    double now = td_now_s();
    if (!s->blocked_since)
        s->blocked_since = now;
    if (now - s->blocked_since < e->cfg.block_wait_s)
        return false;
    no_block_error(e, s);
    size_t n = strlen(e->err);
    snprintf(e->err + n, sizeof e->err - n, " (waited %.1f s)", now - s->blocked_since);
    seq_fail(e, s, fn, ctx);
    return true;
}

static void reap_done(eng_engine_t *e)
{
    for (eng_seq_t *s = e->seqs, *nx; s; s = nx) {
        nx = s->next;
        if (s->state == SEQ_DONE) {
            seq_unlink(e, s);
            seq_destroy(e, s);
        }
    }
}

/* The run of s's prompt blocks the pool holds now (s not started). */
static uint32_t seq_cached_run(eng_engine_t *e, const eng_seq_t *s)
{
    uint32_t run = 0;
    while (run < s->n_pnames && eng_kv_holds(e->pool, s->pnames[run]))
        run++;
    return run;
}

/* The name of the prompt block s computes next, when it is a shareable full one. */
static bool seq_next_name(const eng_engine_t *e, const eng_seq_t *s, td_block_name_t *out)
{
    uint32_t bt = e->cfg.block_tokens, b = s->n_published;
    if ((b + 1) * bt > seq_shareable(e, s, s->n_prompt - 1))
        return false;
    *out = b < s->n_pnames ? s->pnames[b] : td_block_name_next(b ? s->last_name : e->root, s->tokens + b * bt, bt);
    return true;
}

/* The prompts a step may take chunks of (waiting, or part computed), as
 * engine/sched.h orders them: e->q_seqs[e->q_idx[i]] is the i-th of the
 * count returned. For the cache order, e->q_busy gets the blocks the prompts
 * under way compute next. */
static uint32_t queue_order(eng_engine_t *e, double now)
{
    const eng_sched_config_t *c = &e->cfg.sched;
    const bool names = c->order != ENG_ORDER_FCFS && e->cfg.prefix_cache;
    uint32_t n = 0;
    e->n_busy = 0;
    for (eng_seq_t *s = e->seqs; s; s = s->next) {
        if (s->state == SEQ_DONE || (s->state == SEQ_RUNNING && s->n_computed == s->n_tokens - 1) || s->swap)
            continue; /* decoding, or swapped out (swap_in brings it back) */
        bool started = s->n_computed > 0 || s->n_blocks > 0;
        uint32_t run = names && !started ? seq_cached_run(e, s) : 0;
        if (names && started && seq_next_name(e, s, &e->q_busy[e->n_busy]))
            e->n_busy++;
        if (!s->sched_entry) { /* skip-join: what it has to compute when first seen */
            uint32_t done = started ? s->n_computed : run * e->cfg.block_tokens;
            s->sched_entry = s->n_tokens > done ? s->n_tokens - done : 1;
        }
        e->q_items[n] = (eng_sched_item_t){.priority = s->priority, .arrived = s->arrived, .started = started,
                                           .cached = run, .entry = s->sched_entry, .served = s->sched_served};
        e->q_seqs[n++] = s;
    }
    eng_sched_order(c, e->q_items, n, now, e->q_idx, e->q_scratch);
    return n;
}

/* The cache order's wait: s (not started) would compute a block that a prompt
 * under way is computing now; it is published soon, and s takes it then. */
static bool queue_defer(const eng_engine_t *e, const eng_seq_t *s, const eng_sched_item_t *it, double now)
{
    if (!eng_sched_waits_for_shared(&e->cfg.sched) || it->started || it->cached >= s->n_pnames ||
        eng_sched_aged(&e->cfg.sched, it, now))
        return false;
    for (uint32_t i = 0; i < e->n_busy; i++)
        if (td_block_name_eq(e->q_busy[i], s->pnames[it->cached]))
            return true;
    return false;
}

td_status_t eng_engine_step(eng_engine_t *e, eng_event_fn fn, void *ctx)
{
    uint32_t budget = e->cfg.token_budget, nb = 0;
    /* 0. imported sequences accept the first token their prefill sampled */
    for (eng_seq_t *s = e->seqs; s; s = s->next)
        if (s->forced >= 0) {
            int32_t t = s->forced;
            s->forced = -1;
            seq_accept(e, s, t, fn, ctx);
        }
    reap_done(e);
    swap_in(e);
    /* 1. decode tokens for running sequences (oldest first) */
    for (eng_seq_t *s = e->seqs; s && nb < e->cfg.max_seqs && budget; s = s->next) {
        if (s->state != SEQ_RUNNING || s->n_computed != s->n_tokens - 1)
            continue;
        bool fits;
        while (!(fits = seq_reserve(e, s, s->n_tokens)) && preempt_one(e, s))
            ;
        if (!fits) {
            seq_blocked(e, s, fn, ctx);
            continue;
        }
        s->blocked_since = 0;
        if (s->state != SEQ_RUNNING)
            continue;
        e->batch_seq[nb] = s;
        e->batch[nb++] = (eng_batch_seq_t){.tokens = s->tokens + s->n_computed, .n = 1, .pos0 = s->n_computed,
                                           .block_table = s->blocks, .n_blocks = s->n_blocks, .want_logits = true,
                                           .decode_from = s->decode_from};
        budget--;
    }
    /* a preemption may have hit a sequence already in the batch */
    uint32_t k = 0;
    for (uint32_t i = 0; i < nb; i++)
        if (e->batch_seq[i]->n_blocks > 0) {
            e->batch_seq[k] = e->batch_seq[i];
            e->batch[k] = e->batch[i];
            e->batch[k].n_blocks = e->batch_seq[k]->n_blocks;
            k++;
        }
    nb = k;
    uint32_t rows = nb; /* logit rows the step holds so far: a decode row each */
    /* 2. prompt chunks (and recomputation after preemption), in the queue's order */
    const double now = td_now_s();
    const uint32_t n_queued = budget && nb < e->cfg.max_seqs ? queue_order(e, now) : 0;
    const eng_sched_item_t *first = NULL; /* the step's first prompt, which the order may keep others from */
    for (uint32_t qi = 0; qi < n_queued && nb < e->cfg.max_seqs && budget; qi++) {
        eng_seq_t *s = e->q_seqs[e->q_idx[qi]];
        const eng_sched_item_t *it = &e->q_items[e->q_idx[qi]];
        if (queue_defer(e, s, it, now) || (first && !eng_sched_joins(&e->cfg.sched, first, it, now)))
            continue;
        /* a prompt scored token by token is computed whole: the prefix cache holds KV, not logits */
        if (s->n_computed == 0 && s->n_blocks == 0 && e->cfg.prefix_cache && !s->plp)
            seq_use_prefix_cache(e, s);
        uint32_t left = s->n_tokens - s->n_computed;
        uint32_t chunk = left < budget ? left : budget;
        const bool scoring = s->plp && !s->plp_sent && s->n_computed < s->n_prompt; /* every row's logits */
        if (scoring) { /* as many rows as the step's logits have room for */
            uint32_t room = e->cfg.max_seqs > rows ? e->cfg.max_seqs - rows : 0;
            if (!room)
                continue;
            chunk = chunk < room ? chunk : room;
        } else if (s->n_computed + chunk == s->n_tokens && rows >= e->cfg.max_seqs) {
            continue; /* its last chunk's logits would not fit this step */
        }
        if (s->deadline > 0 && e->tok_s > 0) {
            /* a chunk that would overrun its request's deadline is cut to what fits (the engine thread is free
             * at the deadline, when the request's cancel comes); past it, nothing more is computed for it */
            double fit = (s->deadline - td_now_s()) / e->tok_s;
            if (fit < 1)
                continue;
            if (fit < chunk)
                chunk = (uint32_t)fit;
        }
        bool fits = seq_reserve(e, s, s->n_computed + chunk);
        while (!fits && nb == 0 && preempt_one(e, s)) /* nothing else can progress: make room */
            fits = seq_reserve(e, s, s->n_computed + chunk);
        if (!fits) {
            /* take what fits; if nothing, wait for blocks to free up */
            uint32_t have = s->n_blocks * e->cfg.block_tokens;
            if (have <= s->n_computed && nb == 0) { /* nothing runs that could free one */
                if (!seq_blocked(e, s, fn, ctx))
                    break;
                continue;
            }
            if (have <= s->n_computed)
                break;
            chunk = have - s->n_computed;
        }
        s->blocked_since = 0;
        s->state = SEQ_RUNNING;
        e->batch_seq[nb] = s;
        e->batch[nb++] = (eng_batch_seq_t){.tokens = s->tokens + s->n_computed, .n = chunk, .pos0 = s->n_computed,
                                           .block_table = s->blocks, .n_blocks = s->n_blocks,
                                           .want_logits = s->n_computed + chunk == s->n_tokens,
                                           .all_logits = scoring, .decode_from = s->decode_from};
        rows += scoring ? chunk : e->batch[nb - 1].want_logits;
        budget -= chunk;
        e->prompt_computed += chunk;
        s->sched_served += chunk;
        first = first ? first : it;
        if (eng_sched_waits_for_shared(&e->cfg.sched) && seq_next_name(e, s, &e->q_busy[e->n_busy]))
            e->n_busy++; /* its siblings wait for the block it computes */
    }
    e->stalled = !nb;
    if (!nb) {
        reap_done(e);
        return TD_OK;
    }
    if (e->layer_fn) {
        uint32_t bt = e->cfg.block_tokens;
        for (uint32_t i = 0; i < nb; i++) {
            const eng_batch_seq_t *b = &e->batch[i];
            e->layer_seqs[i] = (eng_layer_seq_t){.id = e->batch_seq[i]->id, .blocks = b->block_table,
                                                 .first_block = b->pos0 / bt, .end_block = (b->pos0 + b->n + bt - 1) / bt};
        }
        e->n_batch = nb;
    }
    /* the backend picks the tokens when it can pick every one of them: only
     * the ids cross back (structured output's masks, made here, go out) */
    bool on_device = e->pass->can_sample(e->pass_on), masked = false;
    uint32_t picks = 0;
    for (uint32_t i = 0; i < nb && on_device; i++) {
        on_device = !e->batch[i].all_logits &&
                    (!e->batch[i].want_logits || eng_sampler_on_device(&e->batch_seq[i]->sampler));
        picks += e->batch[i].want_logits;
        masked = masked || (e->batch[i].want_logits && eng_sampler_masked(&e->batch_seq[i]->sampler));
    }
    on_device = on_device &&
                (!masked || picks <= e->pass->mask_rows(e->pass_on));
    const float *logits = NULL;
    uint32_t nl = 0, n_tok = 0;
    for (uint32_t i = 0; i < nb; i++)
        n_tok += e->batch[i].n;
    double t_step = td_now_s();
    const size_t mb = ((size_t)e->m->desc.vocab + 7) / 8;
    if (on_device)
        for (uint32_t i = 0; i < nb; i++)
            if (e->batch[i].want_logits) {
                e->sample[nl] = eng_sampler_device(&e->batch_seq[i]->sampler, masked ? e->masks + nl * mb : NULL);
                nl++;
            }
    const uint8_t *masks = masked ? e->masks : NULL;
    td_status_t rc = on_device ? e->pass->run_sampled(e->pass_on, e->batch, nb, e->sample, masks, e->picked, &nl)
                               : e->pass->run(e->pass_on, e->batch, nb, &logits, &nl);
    if (rc) { /* the batch's requests end with the error; the others go on */
        snprintf(e->err, sizeof e->err, "engine step of %u requests failed: %s", nb, td_last_error());
        for (uint32_t i = 0; i < nb; i++)
            seq_fail(e, e->batch_seq[i], fn, ctx);
        reap_done(e);
        return rc;
    }
    if (n_tok >= 64) { /* prompt-sized steps: what a chunk costs a token (a decode step's token costs more) */
        double per_tok = (td_now_s() - t_step) / n_tok;
        e->tok_s = e->tok_s > 0 ? 0.8 * e->tok_s + 0.2 * per_tok : per_tok;
    }
    uint32_t li = 0;
    for (uint32_t i = 0; i < nb; i++) {
        eng_seq_t *s = e->batch_seq[i];
        s->n_computed += e->batch[i].n;
        seq_publish(e, s);
        if (e->batch[i].all_logits) { /* a scored prompt's rows: row r predicts token pos0 + r + 1 */
            const uint32_t V = e->m->desc.vocab, p0 = e->batch[i].pos0;
            for (uint32_t r = 0; r < e->batch[i].n; r++)
                if (p0 + r + 1 < s->n_prompt)
                    eng_sampler_logprobs(&s->sampler, logits + (size_t)(li + r) * V, s->tokens[p0 + r + 1],
                                         &s->plp[p0 + r]);
            li += e->batch[i].n - 1; /* the last row is the want_logits one */
            if (!e->batch[i].want_logits) {
                li++;
                continue;
            }
            if (!s->max_tokens) { /* the prompt scored, nothing to generate */
                li++;
                seq_scored(s, fn, ctx);
                continue;
            }
        }
        if (!e->batch[i].want_logits)
            continue;
        const float *row = on_device ? NULL : logits + (size_t)li * e->m->desc.vocab;
        int32_t tok = on_device ? e->picked[li] : eng_sampler_sample(&s->sampler, row, s->tokens, s->n_tokens);
        li++;
        if ((s->has_lp = row && s->sampler.p.logprobs))
            eng_sampler_logprobs(&s->sampler, row, tok, &s->lp);
        seq_accept(e, s, tok, fn, ctx);
        s->has_lp = false;
    }
    reap_done(e);
    return TD_OK;
}
