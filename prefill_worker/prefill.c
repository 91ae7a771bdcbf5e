/* prefill.c — tandem-prefill, the prefill worker (DESIGN.md §1 step 3).
 *
 * A Prefill request brings the prompt's tokens and a landing descriptor (where
 * on a decode worker its KV goes). The prompt joins the engine's batch like
 * any other (chunked, batched, prefix-cached); after every layer of every step
 * the engine thread queues that layer's slice of each touched block for the
 * pusher thread, which puts it into the landing block with UCX while the next
 * layers compute. After the step the engine thread waits for the pusher to
 * drain and flush (the exposed part of the transfer), and only then are the
 * step's first tokens delivered: a first token is never announced before its
 * KV has landed. A decode peer that fails fails exactly the requests that
 * were landing on it (UNAVAILABLE), and their sequences are cancelled here.
 *
 * Contract handshake: the landing descriptor states the decode side's KV
 * contract; a mismatch is refused with both values named, before any byte
 * moves.
 *
 * Grants: with the cluster's mutual TLS, a landing descriptor is put into
 * only when a decode worker of this cluster signed it (decode.c says why the
 * remote keys cannot be narrower), every offset lies inside the pool it
 * names, and its land-by time has not passed: the pusher drops a put that
 * comes later (the blocks may belong to another request by then) and the
 * request fails DEADLINE_EXCEEDED. Only the router may call Prefill. */
#define _GNU_SOURCE
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/certs.h"
#include "common/clock.h"
#include "common/grow.h"
#include "common/log.h"
#include "common/rpc_pb.h"
#include "engine/tokenizer.h"
#include "worker/worker.h"
#include "kvstore/client.h"
#include "prefill_worker/peers.h"

typedef struct prefill_role prefill_role_t;

/* ------------------------------------------------------------ requests */

typedef struct preq {
    prefill_role_t *role;
    pthread_mutex_t mu;
    int refs;
    td_rpc_call_t *call;
    Tandem__Internal__V1__PrefillRequest *rq;
    eng_logit_bias_t *bias;
    pw_peer_t *pe;
    uint64_t eng_id;
    td_status_t rc;
    char err[512];
    bool done;
    int32_t first_token;
    bool has_lp;
    eng_logprobs_t lp; /* first_token's, where the request asked (sampling.logprobs) */
    eng_logprobs_t *plp; /* the prompt's (sampling.prompt_logprobs): tokens 1 .. n - 1's */
    uint32_t n_plp;
    uint32_t n_cached;
    double t0, t_done, busy0, exposed_s;
    double land_by; /* td_now_s() at the landing's land-by time (HUGE_VAL: unsigned, unlimited) */
    /* td_now_s() at the end of the landing's lease (HUGE_VAL: none), which the router extends while it renews
     * the reservation (Extend); atomic: written by Extend's thread, read by the engine and pusher threads */
    double lease_until;
    double deadline; /* td_now_s() at its call's deadline: the engine computes nothing of it past that */
    uint64_t bytes0, bytes;
    double busy_s;
    /* Engine thread: the prompt's blocks [first, pushed) have had every layer
     * put at least once (the decode worker holds those before first: the
     * landing's first_block); digests[b] is landing block b's (the prompt's
     * first + b) td_kv_block_digest as of its last put (the decode side
     * checks its landing against them). */
    uint32_t first, pushed;
    uint64_t *digests;
    size_t n_digests;
    /* The KV store: the prompt's block names (its full blocks but the last
     * token's), how many leading ones the pool held, and the blocks fetched
     * from the store after them, held (engine thread) until the request
     * leaves the engine so that its first step finds them. */
    td_block_name_t *names;
    uint32_t n_names, pool_have, n_fetched, store_found, store_got;
    int32_t *fetched;
    void *stage;          /* a device pool's: host staging the fetched blocks arrive in, back to back */
    size_t stage_bytes;
    bool store_abandoned; /* the handler gave up waiting for the alloc closure (under mu) */
} preq_t;

#define STAGE_KEEP 4u

/* The role's state, behind its context (eng_worker_role_t.ctx). */
struct prefill_role {
    eng_worker_t *w;
    pw_peers_t *peers; /* the decode workers' pools, and the pusher thread putting KV into them */
    td_verifier_t *verifier; /* NULL under cluster.plaintext: landings are not checked for a grant */
    /* Engine thread: reservations the router cancelled before their Prefill
     * ran here (one may still arrive), until their land-by. */
    struct tomb { uint64_t id; double until; } *tombs;
    size_t n_tombs;
    preq_t **active; /* engine thread */
    size_t n_active, cap_active;
    double exposed_total, busy_total;
    uint64_t bytes_total;
    double busy_at_step;
    kv_client_t *store; /* NULL: no KV store (kvstore.use false, or none could be set up) */
    /* the requests whose landing leases Extend may find (their handlers register them while they run) */
    pthread_mutex_t lease_mu;
    preq_t **leased;
    size_t n_leased, cap_leased;
    /* a device pool's host staging for blocks read from the store, kept for
     * reuse (page-locking memory costs milliseconds): STAGE_KEEP at most */
    pthread_mutex_t stage_mu;
    struct kept_stage { void *p; size_t bytes; } kept[STAGE_KEEP];
    uint32_t n_kept;
};

/* Host staging of at least `bytes` (*got: its size), a kept one if one fits. */
static td_status_t stage_take(prefill_role_t *R, size_t bytes, void **p, size_t *got)
{
    pthread_mutex_lock(&R->stage_mu);
    int best = -1;
    for (uint32_t i = 0; i < R->n_kept; i++)
        if (R->kept[i].bytes >= bytes && (best < 0 || R->kept[i].bytes < R->kept[best].bytes))
            best = (int)i;
    if (best >= 0) {
        *p = R->kept[best].p;
        *got = R->kept[best].bytes;
        R->kept[best] = R->kept[--R->n_kept];
    }
    pthread_mutex_unlock(&R->stage_mu);
    if (best >= 0)
        return TD_OK;
    *got = bytes;
    return eng_engine_host_alloc(eng_worker_engine(R->w), bytes, p);
}

/* Staging back: kept (the smallest kept one goes when all are taken), or freed. */
static void stage_give(prefill_role_t *R, void *p, size_t bytes)
{
    pthread_mutex_lock(&R->stage_mu);
    if (R->n_kept < STAGE_KEEP) {
        R->kept[R->n_kept++] = (struct kept_stage){p, bytes};
        p = NULL;
    } else {
        uint32_t s = 0;
        for (uint32_t i = 1; i < R->n_kept; i++)
            if (R->kept[i].bytes < R->kept[s].bytes)
                s = i;
        if (R->kept[s].bytes < bytes) {
            void *smaller = R->kept[s].p;
            R->kept[s] = (struct kept_stage){p, bytes};
            p = smaller;
        }
    }
    pthread_mutex_unlock(&R->stage_mu);
    if (p)
        eng_engine_host_free(eng_worker_engine(R->w), p);
}

static void preq_put(preq_t *r)
{
    pthread_mutex_lock(&r->mu);
    int n = --r->refs;
    pthread_mutex_unlock(&r->mu);
    if (n)
        return;
    if (r->pe)
        pw_peer_release(r->role->peers, r->pe);
    if (r->rq)
        tandem__internal__v1__prefill_request__free_unpacked(r->rq, NULL);
    free(r->bias);
    free(r->plp);
    free(r->digests);
    free(r->names);
    free(r->fetched);
    if (r->stage)
        stage_give(r->role, r->stage, r->stage_bytes);
    pthread_mutex_destroy(&r->mu);
    free(r);
}

/* Engine thread: the blocks fetched from the store for r are let go (the
 * sequence holds its own references to those it took). */
static void fetched_release(preq_t *r)
{
    eng_kv_pool_t *pool = eng_engine_kv_pool(eng_worker_engine(r->role->w));
    for (uint32_t i = 0; i < r->n_fetched; i++)
        eng_kv_unref(pool, r->fetched[i]);
    r->n_fetched = 0;
}

static void active_remove_at(prefill_role_t *R, size_t k)
{
    fetched_release(R->active[k]);
    R->active[k] = R->active[--R->n_active];
}

static void active_remove(preq_t *r)
{
    prefill_role_t *R = r->role;
    for (size_t i = 0; i < R->n_active; i++)
        if (R->active[i] == r) {
            active_remove_at(R, i);
            return;
        }
}

/* Until when r may put: its land-by, or its lease's end if sooner. */
static double put_by(preq_t *r)
{
    double lease;
    __atomic_load(&r->lease_until, &lease, __ATOMIC_ACQUIRE);
    return lease < r->land_by ? lease : r->land_by;
}

static void lease_register(prefill_role_t *R, preq_t *r)
{
    pthread_mutex_lock(&R->lease_mu);
    if (td_grow((void **)&R->leased, &R->cap_leased, R->n_leased + 1, sizeof *R->leased, 64))
        R->leased[R->n_leased++] = r;
    pthread_mutex_unlock(&R->lease_mu);
}

static void lease_unregister(prefill_role_t *R, preq_t *r)
{
    pthread_mutex_lock(&R->lease_mu);
    for (size_t i = 0; i < R->n_leased; i++)
        if (R->leased[i] == r) {
            R->leased[i] = R->leased[--R->n_leased];
            break;
        }
    pthread_mutex_unlock(&R->lease_mu);
}

static void preq_finish(preq_t *r, td_status_t rc, const char *err, int32_t tok, uint32_t cached)
{
    pthread_mutex_lock(&r->mu);
    r->done = true;
    r->rc = rc;
    if (err)
        snprintf(r->err, sizeof r->err, "%s", err);
    r->first_token = tok;
    r->n_cached = cached;
    r->t_done = td_now_s();
    if (r->call)
        td_rpc_call_wake(r->call);
    pthread_mutex_unlock(&r->mu);
}

/* ------------------------------------------------------------ the KV store
 * Before a prompt joins the engine: its block names are looked up in the
 * store (every home node asked for its names, kvstore/client.h); the blocks
 * after the ones this pool holds are allocated in the pool (engine thread),
 * read into it with UCX gets and their digests checked (handler thread),
 * then named in the pool where the engine's prefix cache finds them
 * (engine thread, in add_on_engine). Any failure is a shorter prefix, so the
 * rest is computed. The blocks this pool computes go to the store
 * write-behind through the worker (eng_worker_store, worker/worker.h). */
#define STORE_LOOKUP_S 1.0
#define STORE_FETCH_S 3.0

static void store_alloc_on_engine(eng_worker_t *w, void *arg)
{
    preq_t *r = arg;
    eng_kv_pool_t *pool = eng_engine_kv_pool(eng_worker_engine(w));
    uint32_t have = 0;
    int32_t *held = r->fetched + r->n_names; /* the pool's own prefix, held while blocks are taken */
    for (; have < r->n_names; have++)
        if ((held[have] = eng_kv_lookup(pool, r->names[have])) < 0)
            break;
    r->pool_have = have;
    uint32_t k = 0;
    pthread_mutex_lock(&r->mu);
    bool abandoned = r->store_abandoned;
    pthread_mutex_unlock(&r->mu);
    for (uint32_t want = r->store_found > have && !abandoned ? r->store_found - have : 0; k < want; k++)
        if (eng_kv_alloc(pool, &r->fetched[k]))
            break;
    r->n_fetched = k;
    for (uint32_t i = 0; i < have; i++)
        eng_kv_unref(pool, held[i]);
    preq_put(r); /* the closure's */
}

/* Engine thread, before the request is added: the fetched blocks get their
 * names (or the block already named so, if one appeared meanwhile). */
static void store_name_fetched(eng_worker_t *w, preq_t *r)
{
    eng_engine_t *e = eng_worker_engine(w);
    eng_kv_pool_t *pool = eng_engine_kv_pool(e);
    if (r->stage && r->store_got && eng_engine_kv_upload(e, r->fetched, r->store_got, r->stage)) {
        TD_WARN("prefill: copying %u blocks read from the KV store into the pool: %s; they are computed instead",
                r->store_got, td_last_error());
        r->store_got = 0;
    }
    if (r->stage) {
        stage_give(r->role, r->stage, r->stage_bytes);
        r->stage = NULL;
    }
    for (uint32_t i = r->store_got; i < r->n_fetched; i++)
        eng_kv_unref(pool, r->fetched[i]); /* taken, but nothing valid arrived */
    if (r->n_fetched > r->store_got)
        r->n_fetched = r->store_got;
    for (uint32_t i = 0; i < r->n_fetched; i++) {
        int32_t got = eng_worker_kv_adopt(w, r->fetched[i], r->names[r->pool_have + i]);
        if (got != r->fetched[i]) {
            eng_kv_ref(pool, got);
            eng_kv_unref(pool, r->fetched[i]);
            r->fetched[i] = got;
        }
    }
}

/* Handler thread: looks the prompt up in the store and reads what the pool
 * lacks into fresh pool blocks. r->store_got: blocks read (after the pool's
 * r->pool_have). */
static void store_fetch(eng_worker_t *w, preq_t *r)
{
    prefill_role_t *R = r->role;
    td_kv_layout_t l = eng_worker_contract(w);
    uint32_t bt = l.block_tokens, full = (uint32_t)((r->rq->n_tokens - 1) / bt);
    if (!full || !(r->names = malloc(full * sizeof *r->names)) || !(r->fetched = malloc(2 * full * sizeof *r->fetched)))
        return;
    td_block_name_t root = td_block_name_root(l.model_id, td_kv_dtype_name(l.dtype), bt);
    td_block_name_chain(root, r->rq->tokens, r->rq->n_tokens, bt, r->names, full);
    r->n_names = full;
    kv_client_read_t *rd = NULL;
    uint32_t found = 0;
    kv_client_lookup(R->store, r->names, full, STORE_LOOKUP_S, &rd, &found);
    if (found) {
        r->store_found = found; /* what to allocate for */
        pthread_mutex_lock(&r->mu);
        r->refs++; /* the closure's */
        pthread_mutex_unlock(&r->mu);
        td_status_t rc = eng_worker_call(w, store_alloc_on_engine, r, 10);
        if (rc) {
            pthread_mutex_lock(&r->mu);
            r->store_abandoned = true;
            pthread_mutex_unlock(&r->mu);
            if (rc != TD_ERR_TIMEOUT)
                preq_put(r); /* refused (the worker is stopping): no closure holds r */
            kv_client_read_end(R->store, rd);
            return; /* on a timeout the closure, run later, takes nothing */
        }
        if (r->n_fetched) {
            eng_engine_t *e = eng_worker_engine(w);
            size_t bb;
            uint8_t *base = eng_engine_kv_base(e, &bb); /* constant: no engine state */
            void **dst = malloc(r->n_fetched * sizeof *dst);
            /* a device pool: the blocks arrive in host staging, copied in on the engine thread (store_name_fetched) */
            if (dst && !eng_engine_kv_on_host(e) && stage_take(R, r->n_fetched * bb, &r->stage, &r->stage_bytes)) {
                TD_WARN("prefill: no host staging for %u blocks from the KV store: %s; they are computed instead",
                        r->n_fetched, td_last_error());
                free(dst);
                dst = NULL;
            }
            if (dst) {
                for (uint32_t i = 0; i < r->n_fetched; i++)
                    dst[i] = r->stage ? (uint8_t *)r->stage + (size_t)i * bb : base + (size_t)r->fetched[i] * bb;
                kv_client_fetch(R->store, rd, r->pool_have, r->n_fetched, dst, STORE_FETCH_S, &r->store_got);
                free(dst);
            }
        }
    }
    kv_client_read_end(R->store, rd);
}

static void on_prefill_event(void *ctx, const eng_event_t *ev)
{
    preq_t *r = ctx;
    active_remove(r);
    if (ev->finish == ENG_FINISH_ERROR)
        preq_finish(r, TD_ERR_INTERNAL, ev->error, -1, 0);
    else if (r->pe->failed)
        preq_finish(r, TD_ERR_UNAVAILABLE, "the decode worker stopped taking KV (put or flush failed)", -1, 0);
    else if (td_now_s() > put_by(r)) /* a put may have been dropped: the landing is not whole */
        preq_finish(r, TD_ERR_TIMEOUT, td_now_s() > r->land_by ? "landing: its land-by time passed before the KV was put"
                                                                : "landing: its lease ran out (the router stopped "
                                                                  "renewing it) before the KV was put", -1, 0);
    else if (r->pushed < r->first + r->n_digests) /* a bug: the landing would decode on garbage */
        preq_finish(r, TD_ERR_INTERNAL, "prefill: not every landing block was pushed", -1, 0);
    else {
        if ((r->has_lp = ev->logprobs != NULL)) /* before preq_finish wakes the call */
            r->lp = *ev->logprobs;
        if (ev->n_prompt_logprobs && (r->plp = malloc(ev->n_prompt_logprobs * sizeof *r->plp))) {
            memcpy(r->plp, ev->prompt_logprobs, ev->n_prompt_logprobs * sizeof *r->plp);
            r->n_plp = ev->n_prompt_logprobs;
        }
        preq_finish(r, TD_OK, NULL, ev->token, ev->n_cached);
    }
    preq_put(r); /* the listener's */
}

/* A piece of a whole block (off: where in it) to the landing block at offset `at` of the decode worker's pool:
 * as it is into a pool of whole blocks; into a pool of parts, what each part holds of it, at that part's block
 * (fence: the device work that writes it, pw_peers_put) */
static void push_piece(prefill_role_t *R, preq_t *r, const td_kv_layout_t *g, const eng_kv_piece_t *pc, uint64_t at,
                       uint64_t fence)
{
    pw_peer_t *pe = r->pe;
    if (!pe->n_parts) {
        pw_peers_put(R->peers, pe, pe->region, pc->src, pc->bytes, at + pc->off, put_by(r), fence);
        return;
    }
    const uint64_t block = at / td_kv_block_bytes(g);
    td_kv_run_t runs[TD_KV_RUNS_PER_LAYER];
    for (uint32_t k = 0; k < pe->n_parts; k++) {
        const struct pw_peer_part *pp = &pe->parts[k];
        for (uint32_t j = 0, n = td_kv_part_overlap(g, pp->head0, pp->heads, pc->off, pc->bytes, runs,
                                                     TD_KV_RUNS_PER_LAYER);
             j < n; j++)
            pw_peers_put(R->peers, pe, pp->region, pc->src + (runs[j].block_off - pc->off), runs[j].bytes,
                        block * pp->part_bytes + runs[j].part_off, put_by(r), fence);
    }
}

/* Engine thread, after each layer: queue that layer's slice of each block
 * the landing does not hold yet — the blocks the step wrote, and before them
 * any blocks the sequence took from the prefix cache instead of computing
 * (the landing needs the whole prompt's KV, whatever this pool had cached:
 * DESIGN.md §1's invariant). A partial block is put again by the next chunk
 * that writes into it; each step's puts are flushed before the next step. */
static void on_layer(void *ctx, uint32_t layer, const eng_layer_seq_t *seqs, uint32_t n)
{
    prefill_role_t *R = ctx;
    eng_engine_t *e = eng_worker_engine(R->w);
    eng_kv_pool_t *pool = eng_engine_kv_pool(e);
    const td_kv_layout_t g = eng_worker_contract(R->w);
    const uint32_t n_layers = g.n_layers;
    eng_kv_piece_t pc[ENG_KV_PIECES_MAX];
    /* a GPU pool: the layer's kernels are queued, not done; its puts wait for
     * them (a fence only in a step that lands KV somewhere) */
    uint64_t fence = 0;
    if (R->n_active && pw_peers_fence(R->peers, eng_engine_queue(e), &fence))
        return; /* every peer failed: unordered puts could copy KV not yet written */
    for (uint32_t i = 0; i < n; i++)
        for (size_t k = 0; k < R->n_active; k++) {
            preq_t *r = R->active[k];
            if (r->eng_id != seqs[i].id)
                continue;
            /* the prompt's blocks [first, first + n_block_offsets) land; the decode worker holds those before */
            const Tandem__Internal__V1__LandingDescriptor *ld = r->rq->landing;
            uint32_t last = r->first + (uint32_t)ld->n_block_offsets;
            uint32_t from = seqs[i].first_block < r->pushed ? seqs[i].first_block : r->pushed;
            uint32_t end = seqs[i].end_block < last ? seqs[i].end_block : last;
            if (from < r->first)
                from = r->first;
            for (uint32_t b = from; b < end; b++) /* the layer's slice: one piece, or a run a rank's part */
                for (uint32_t j = 0, np = eng_kv_layer_pieces(pool, seqs[i].blocks[b], layer, pc); j < np; j++)
                    push_piece(R, r, &g, &pc[j], ld->block_offsets[b - r->first], fence);
            if (layer + 1 == n_layers) { /* every layer of these blocks is queued: what they now carry */
                if (end > from &&
                    eng_engine_kv_digest(e, seqs[i].blocks + from, end - from, r->digests + (from - r->first)))
                    TD_WARN("prefill: digests of request %llu's blocks: %s (its step fails)",
                            (unsigned long long)r->eng_id, td_last_error());
                if (end > r->pushed)
                    r->pushed = end;
            }
            break;
        }
}

static void prefill_after_step(eng_worker_t *w, void *ctx)
{
    prefill_role_t *R = ctx;
    double waited = pw_peers_barrier(R->peers);
    pw_peers_stats_t st = pw_peers_stats(R->peers);
    double busy = st.busy_s - R->busy_at_step;
    R->busy_at_step = st.busy_s;
    R->exposed_total += waited;
    R->busy_total += busy;
    R->bytes_total = st.bytes;
    for (size_t k = 0; k < R->n_active;) {
        preq_t *r = R->active[k];
        r->exposed_s += waited;
        r->busy_s += busy;
        if (r->pe->failed) { /* its KV cannot land: stop computing it */
            eng_engine_cancel(eng_worker_engine(w), r->eng_id);
            eng_worker_unlisten(w, r->eng_id);
            active_remove_at(R, k);
            preq_finish(r, TD_ERR_UNAVAILABLE, "the decode worker stopped taking KV (put or flush failed)", -1, 0);
            preq_put(r);
            continue;
        }
        k++;
    }
    pw_peers_reap(R->peers);
}

/* Engine thread: at most this many cancelled reservations are remembered. */
#define MAX_TOMBS 4096

static void tombs_expire(prefill_role_t *R)
{
    double now = td_now_s();
    for (size_t i = 0; i < R->n_tombs;)
        if (R->tombs[i].until < now)
            R->tombs[i] = R->tombs[--R->n_tombs];
        else
            i++;
}

static bool tombstoned(prefill_role_t *R, uint64_t id)
{
    tombs_expire(R);
    for (size_t i = 0; i < R->n_tombs; i++)
        if (R->tombs[i].id == id)
            return true;
    return false;
}

static void add_on_engine(eng_worker_t *w, void *arg)
{
    preq_t *r = arg;
    prefill_role_t *R = r->role;
    store_name_fetched(w, r);
    if (R->n_tombs && tombstoned(R, r->rq->landing->reservation_id)) {
        fetched_release(r);
        r->rc = TD_ERR_CANCELLED;
        snprintf(r->err, sizeof r->err, "the router cancelled reservation %llu's prefill before it began",
                 (unsigned long long)r->rq->landing->reservation_id);
        return;
    }
    const Tandem__V1__SamplingParams *sp = r->rq->sampling;
    r->bias = calloc(sp && sp->n_logit_bias ? sp->n_logit_bias : 1, sizeof *r->bias);
    eng_request_t er = {.prompt = r->rq->tokens, .n_prompt = r->rq->n_tokens, .max_tokens = 1, .ignore_eos = true,
                        .sampled_before = r->rq->sampled_before, .priority = r->rq->priority,
                        .deadline = r->deadline};
    eng_sampling_from_pb(sp, &er.sampling, r->bias);
    if (er.sampling.min_tokens > 1) /* the first token alone here: min_tokens holds the end tokens back from it */
        er.sampling.min_tokens = 1;
    r->rc = eng_engine_add(eng_worker_engine(w), &er, &r->eng_id);
    if (r->rc) {
        snprintf(r->err, sizeof r->err, "%s", td_last_error());
        if (r->rc == TD_ERR_INVALID_ARG) /* the request's own error (td_user_error): said once, here */
            TD_WARN("prefill: %s refused: %s", r->rq->request_id && r->rq->request_id[0] ? r->rq->request_id : "-",
                    r->err);
        fetched_release(r);
        return;
    }
    if (R->n_active == R->cap_active) {
        size_t nc = R->cap_active ? 2 * R->cap_active : 64;
        preq_t **a = realloc(R->active, nc * sizeof *a);
        if (!a) {
            eng_engine_cancel(eng_worker_engine(w), r->eng_id);
            fetched_release(r);
            r->rc = TD_ERR_NO_MEMORY;
            snprintf(r->err, sizeof r->err, "no memory");
            return;
        }
        R->active = a;
        R->cap_active = nc;
    }
    if ((r->rc = eng_worker_listen(w, r->eng_id, on_prefill_event, r))) {
        snprintf(r->err, sizeof r->err, "%s", td_last_error());
        eng_engine_cancel(eng_worker_engine(w), r->eng_id);
        fetched_release(r);
        return;
    }
    R->active[R->n_active++] = r;
    r->refs++;
}

/* The closure holds its own reference (taken by the caller): it may run
 * after the handler that queued it gave up waiting and went away. */
static void cancel_on_engine(eng_worker_t *w, void *arg)
{
    preq_t *r = arg;
    prefill_role_t *R = r->role;
    for (size_t k = 0; k < R->n_active; k++)
        if (R->active[k] == r) {
            eng_engine_cancel(eng_worker_engine(w), r->eng_id);
            eng_worker_unlisten(w, r->eng_id);
            active_remove_at(R, k);
            preq_put(r); /* the active list's */
            break;
        }
    preq_put(r); /* the closure's */
}

/* ---- Cancel: the router's acknowledged cancel ----
 * It waits for the engine thread to be between steps (one step of a long
 * prompt can take seconds on a loaded CPU); the router waits a little
 * longer (router/request.c). */
#define CANCEL_WAIT_S 15.0
typedef struct pcancel_op {
    uint64_t id;
    double until;
    bool found;
    td_status_t rc;
} pcancel_op_t;

static void pcancel_on_engine(eng_worker_t *w, void *arg)
{
    pcancel_op_t *op = arg;
    prefill_role_t *R = eng_worker_role_ctx(w);
    for (size_t k = 0; k < R->n_active; k++) {
        preq_t *r = R->active[k];
        if (r->rq->landing->reservation_id != op->id)
            continue;
        /* between steps: the pusher has drained, so nothing of it is left to put */
        eng_engine_cancel(eng_worker_engine(w), r->eng_id);
        eng_worker_unlisten(w, r->eng_id);
        active_remove_at(R, k);
        preq_finish(r, TD_ERR_CANCELLED, "the router cancelled it", -1, 0);
        preq_put(r); /* the active list's */
        op->found = true;
        return;
    }
    tombs_expire(R);
    if (R->n_tombs == MAX_TOMBS || (!R->tombs && !(R->tombs = malloc(MAX_TOMBS * sizeof *R->tombs)))) {
        op->rc = TD_ERR_EXHAUSTED;
        return;
    }
    R->tombs[R->n_tombs++] = (struct tomb){op->id, op->until};
}

static void h_cancel(void *ctx, td_rpc_call_t *call)
{
    eng_worker_t *w = ctx;
    Tandem__Internal__V1__CancelPrefillRequest *rq = (Tandem__Internal__V1__CancelPrefillRequest *)td_rpc_request_pb(
        call, &tandem__internal__v1__cancel_prefill_request__descriptor);
    if (!rq)
        return;
    if (!rq->reservation_id) {
        td_rpc_call_finish(call, TD_RPC_INVALID_ARGUMENT, "reservation_id: missing");
        tandem__internal__v1__cancel_prefill_request__free_unpacked(rq, NULL);
        return;
    }
    pcancel_op_t *op = calloc(1, sizeof *op);
    if (op) {
        op->id = rq->reservation_id;
        op->until = fmax(td_local_of_unix_ms(rq->land_by_unix_ms), td_now_s()) + 1.0;
    }
    tandem__internal__v1__cancel_prefill_request__free_unpacked(rq, NULL);
    if (!op) {
        td_rpc_call_finish(call, TD_RPC_RESOURCE_EXHAUSTED, "no memory");
        return;
    }
    if (eng_worker_call_or_drop(w, pcancel_on_engine, op, free, CANCEL_WAIT_S)) {
        td_rpc_call_finish(call, TD_RPC_UNAVAILABLE, "%s", td_last_error());
        return; /* op is the queued closure's now */
    }
    if (op->rc) {
        td_rpc_call_finish(call, TD_RPC_RESOURCE_EXHAUSTED, "%s remembers %d cancelled reservations, its most",
                           eng_worker_id(w), MAX_TOMBS);
    } else {
        Tandem__Internal__V1__CancelPrefillResponse rp = TANDEM__INTERNAL__V1__CANCEL_PREFILL_RESPONSE__INIT;
        rp.has_found = 1;
        rp.found = op->found;
        uint8_t buf[8];
        td_rpc_call_reply(call, buf, tandem__internal__v1__cancel_prefill_response__pack(&rp, buf));
    }
    free(op);
}

static void h_prefill(void *ctx, td_rpc_call_t *call)
{
    eng_worker_t *w = ctx;
    preq_t *r = calloc(1, sizeof *r);
    if (!r) {
        td_rpc_call_finish(call, TD_RPC_RESOURCE_EXHAUSTED, "no memory");
        return;
    }
    pthread_mutex_init(&r->mu, NULL);
    r->role = eng_worker_role_ctx(w);
    r->refs = 1;
    r->t0 = td_now_s();
    r->rq = (Tandem__Internal__V1__PrefillRequest *)td_rpc_request_pb(call, &tandem__internal__v1__prefill_request__descriptor);
    const Tandem__Internal__V1__LandingDescriptor *ld = r->rq ? r->rq->landing : NULL;
    if (!r->rq || !r->rq->n_tokens || !ld) {
        if (r->rq)
            td_rpc_call_finish(call, TD_RPC_INVALID_ARGUMENT, "%s", !r->rq->n_tokens ? "tokens: empty" : "landing: missing");
        preq_put(r);
        return;
    }
    r->land_by = HUGE_VAL;
    r->lease_until = r->rq->has_landing_lease_until_unix_ms ? td_local_of_unix_ms(r->rq->landing_lease_until_unix_ms)
                                                            : HUGE_VAL;
    r->deadline = td_now_s() + td_rpc_call_time_left(call);
    if (r->role->verifier) {
        const char *why = pw_landing_grant(r->role->verifier, ld, &r->land_by);
        if (why) {
            td_rpc_call_finish(call, r->land_by < HUGE_VAL ? TD_RPC_DEADLINE_EXCEEDED : TD_RPC_PERMISSION_DENIED,
                               "landing: %s", why);
            preq_put(r);
            return;
        }
    }
    td_kv_layout_t ours = eng_worker_contract(w), peer;
    char who[160];
    snprintf(who, sizeof who, "decode worker %s", ld->decode_worker ? ld->decode_worker : "?");
    if (!ld->contract || td_kv_layout_from_pb(ld->contract, &peer) || td_kv_contract_check(&ours, &peer, who)) {
        td_rpc_call_finish(call, TD_RPC_FAILED_PRECONDITION, "KV contract refused by %s: %s", eng_worker_id(w),
                           ld->contract ? td_last_error() : "the landing states no contract");
        preq_put(r);
        return;
    }
    size_t bb;
    eng_engine_kv_base(eng_worker_engine(w), &bb);
    uint32_t all = (uint32_t)((r->rq->n_tokens + ours.block_tokens - 1) / ours.block_tokens);
    if (ld->first_block >= all) { /* the last token's block is always computed, so always lands */
        td_rpc_call_finish(call, TD_RPC_INVALID_ARGUMENT, "landing: first_block %u, but %zu tokens have %u blocks",
                           ld->first_block, r->rq->n_tokens, all);
        preq_put(r);
        return;
    }
    uint32_t need = all - ld->first_block;
    if (ld->n_block_offsets != need || ld->block_bytes != bb) {
        td_rpc_call_finish(call, TD_RPC_INVALID_ARGUMENT,
                           "landing: %zu blocks of %llu bytes for %zu tokens from block %u; %u blocks of %zu bytes "
                           "are needed", ld->n_block_offsets, (unsigned long long)ld->block_bytes, r->rq->n_tokens,
                           ld->first_block, need, bb);
        preq_put(r);
        return;
    }
    r->first = r->pushed = ld->first_block;
    for (uint32_t b = 0; b < need && !ld->n_parts; b++) /* (a pool of parts: pw_landing_parts_ok) */
        if (ld->block_offsets[b] > ld->region_bytes || bb > ld->region_bytes - ld->block_offsets[b]) {
            td_rpc_call_finish(call, TD_RPC_INVALID_ARGUMENT, "landing: block %u at offset %llu is past the pool's "
                               "%llu bytes", b, (unsigned long long)ld->block_offsets[b],
                               (unsigned long long)ld->region_bytes);
            preq_put(r);
            return;
        }
    char perr[200];
    if (!pw_landing_parts_ok(ld, &ours, bb, perr, sizeof perr)) {
        td_rpc_call_finish(call, TD_RPC_INVALID_ARGUMENT, "%s", perr);
        preq_put(r);
        return;
    }
    kv_xfer_t *xfer;
    if (kv_transport_find(ld->transport) != eng_worker_transport(w, &xfer)) {
        td_rpc_call_finish(call, TD_RPC_FAILED_PRECONDITION, "landing: transport '%s' is not one %s has (it has %s)",
                           ld->transport, eng_worker_id(w), eng_worker_transport(w, &xfer)->name);
        preq_put(r);
        return;
    }
    r->n_digests = need;
    if (!(r->digests = calloc(need, sizeof *r->digests))) {
        td_rpc_call_finish(call, TD_RPC_RESOURCE_EXHAUSTED, "no memory for %u block digests", need);
        preq_put(r);
        return;
    }
    if (!(r->pe = pw_peer_get(r->role->peers, ld, &ours))) {
        td_rpc_call_finish(call, TD_RPC_UNAVAILABLE, "cannot reach %s over %s: %s", who, eng_worker_transport(w, &xfer)->name,
                           td_last_error());
        preq_put(r);
        return;
    }
    pthread_mutex_lock(&r->mu);
    r->call = call;
    pthread_mutex_unlock(&r->mu);
    lease_register(r->role, r);
    if (r->role->store)
        store_fetch(w, r);
    pthread_mutex_lock(&r->mu);
    r->refs++; /* the add closure's */
    pthread_mutex_unlock(&r->mu);
    if (eng_worker_call(w, add_on_engine, r, 10)) {
        td_rpc_call_finish(call, TD_RPC_UNAVAILABLE, "%s", td_last_error());
        goto done;
    }
    preq_put(r);
    if (r->rc) {
        td_rpc_call_finish(call, td_rpc_code_of(r->rc), "%s", r->err);
        goto done;
    }
    for (;;) {
        pthread_mutex_lock(&r->mu);
        bool done = r->done;
        pthread_mutex_unlock(&r->mu);
        if (done)
            break;
        if (td_rpc_call_wait(call, 1.0) == TD_ERR_CANCELLED) {
            pthread_mutex_lock(&r->mu);
            r->refs++; /* the cancel closure's */
            pthread_mutex_unlock(&r->mu);
            eng_worker_call(w, cancel_on_engine, r, 5);
            td_rpc_call_finish(call, TD_RPC_CANCELLED, "the caller went away");
            goto done;
        }
    }
    if (r->rc) {
        td_rpc_call_finish(call, td_rpc_code_of(r->rc), "%s", r->err);
        goto done;
    }
    Tandem__Internal__V1__PrefillResponse rp = TANDEM__INTERNAL__V1__PREFILL_RESPONSE__INIT;
    rp.has_first_token = rp.has_cached_tokens = rp.has_prefill_ms = rp.has_transfer_ms = 1;
    rp.has_exposed_transfer_ms = rp.has_bytes = 1;
    rp.first_token = r->first_token;
    eng_logprob_pb_t lpb;
    if (r->has_lp)
        rp.first_logprob = eng_logprob_to_pb(r->first_token, &r->lp, &lpb);
    void *plp_mem = NULL;
    if (r->n_plp && !eng_prompt_logprobs_to_pb(r->rq->tokens, r->plp, r->n_plp, &plp_mem, &rp.prompt_logprobs))
        rp.n_prompt_logprobs = r->n_plp + 1;
    rp.cached_tokens = r->n_cached;
    rp.prefill_ms = (r->t_done - r->t0) * 1e3;
    rp.transfer_ms = r->busy_s * 1e3;
    rp.exposed_transfer_ms = r->exposed_s * 1e3;
    rp.bytes = (uint64_t)need * bb;
    rp.prefill_worker = (char *)eng_worker_id(w);
    /* of the cached tokens, those the store brought (the pool's own come first) */
    uint32_t bt = eng_worker_contract(w).block_tokens, own = r->pool_have * bt;
    rp.has_store_tokens = 1;
    rp.store_tokens = r->n_cached > own ? r->n_cached - own : 0;
    if (rp.store_tokens > r->store_got * bt)
        rp.store_tokens = r->store_got * bt;
    rp.n_block_digests = r->n_digests;
    rp.block_digests = r->digests;
    /* the first token's text as a fresh stream of the engine's gives it (eng_tok_stream: whole characters) */
    char first_text[256];
    size_t first_len = 0;
    eng_tok_stream_t ts;
    eng_tok_stream_init(&ts, eng_worker_model(w)->tok, true);
    if ((!r->rq->sampling || !r->rq->sampling->n_stop) && !r->rq->sampled_before &&
        !eng_tok_stream_push(&ts, r->first_token, first_text, sizeof first_text - 1, &first_len) && first_len &&
        !ts.n_pending) {
        first_text[first_len] = '\0';
        rp.first_text = first_text;
    }
    td_clear_error();
    size_t pn = tandem__internal__v1__prefill_response__get_packed_size(&rp);
    uint8_t *buf = malloc(pn);
    if (buf) {
        tandem__internal__v1__prefill_response__pack(&rp, buf);
        td_rpc_call_reply(call, buf, pn);
    } else {
        td_rpc_call_finish(call, TD_RPC_RESOURCE_EXHAUSTED, "no memory for the PrefillResponse");
    }
    free(buf);
    free(plp_mem);
done:
    lease_unregister(r->role, r);
    pthread_mutex_lock(&r->mu);
    r->call = NULL;
    pthread_mutex_unlock(&r->mu);
    preq_put(r);
}

/* ---- Extend: the router renewed these reservations; their landings' leases run on ---- */
static void h_extend(void *ctx, td_rpc_call_t *call)
{
    eng_worker_t *w = ctx;
    prefill_role_t *R = eng_worker_role_ctx(w);
    Tandem__Internal__V1__ExtendLandingRequest *rq = (Tandem__Internal__V1__ExtendLandingRequest *)td_rpc_request_pb(
        call, &tandem__internal__v1__extend_landing_request__descriptor);
    if (!rq)
        return;
    double until = td_local_of_unix_ms(rq->until_unix_ms);
    uint32_t n = 0;
    pthread_mutex_lock(&R->lease_mu);
    for (size_t i = 0; i < rq->n_reservation_ids; i++)
        for (size_t k = 0; k < R->n_leased; k++) {
            preq_t *r = R->leased[k];
            if (r->rq->landing->reservation_id != rq->reservation_ids[i])
                continue;
            double cur;
            __atomic_load(&r->lease_until, &cur, __ATOMIC_ACQUIRE);
            if (until > cur)
                __atomic_store(&r->lease_until, &until, __ATOMIC_RELEASE);
            n++;
            break;
        }
    pthread_mutex_unlock(&R->lease_mu);
    tandem__internal__v1__extend_landing_request__free_unpacked(rq, NULL);
    Tandem__Internal__V1__ExtendLandingResponse rp = TANDEM__INTERNAL__V1__EXTEND_LANDING_RESPONSE__INIT;
    rp.has_extended = 1;
    rp.extended = n;
    td_rpc_reply_pb(call, &rp.base);
}

static void prefill_stats(eng_worker_t *w, void *ctx, Tandem__Internal__V1__StatsResponse *r)
{
    (void)w;
    prefill_role_t *R = ctx;
    r->has_transfer_bytes = r->has_transfer_ms = r->has_exposed_transfer_ms = 1;
    r->transfer_bytes = R->bytes_total;
    r->transfer_ms = R->busy_total * 1e3;
    r->exposed_transfer_ms = R->exposed_total * 1e3;
    pw_peers_stats_t st = pw_peers_stats(R->peers);
    r->has_late_puts_dropped = r->has_kv_peers = 1;
    r->late_puts_dropped = st.dropped;
    r->kv_peers = st.n_peers;
}

static td_status_t prefill_attach(eng_worker_t *w, void *ctx)
{
    prefill_role_t *R = ctx;
    R->w = w;
    pthread_mutex_init(&R->stage_mu, NULL);
    pthread_mutex_init(&R->lease_mu, NULL);
    kv_xfer_t *x;
    const kv_transport_ops_t *xo = eng_worker_transport(w, &x);
    td_status_t rc = pw_peers_create(xo, x, eng_worker_config(w)->transport.peer_idle_s, &R->peers);
    if (rc)
        return rc;
    eng_engine_set_layer_hook(eng_worker_engine(w), on_layer, R);
    const td_rpc_tls_t *tls = eng_worker_tls(w);
    rc = tls ? td_verifier_open(tls->ca_file, &R->verifier) : TD_OK;
    R->store = eng_worker_store(w);
    static const char *const methods[] = {"/tandem.internal.v1.Prefill/Prefill", "/tandem.internal.v1.Prefill/Cancel",
                                          "/tandem.internal.v1.Prefill/Extend"};
    static const td_rpc_handler_fn fns[] = {h_prefill, h_cancel, h_extend};
    for (size_t i = 0; !rc && i < 3; i++)
        if (!(rc = td_rpc_server_add(eng_worker_server(w), methods[i], fns[i], w)))
            rc = td_rpc_server_allow(eng_worker_server(w), methods[i], "router");
    return rc;
}

/* At exit: the pusher stops (its queue is empty: the engine thread ended
 * with a barrier after its last step) and every connection is closed. */
static void prefill_detach(eng_worker_t *w, void *ctx)
{
    prefill_role_t *R = ctx;
    if (R->peers) {
        kv_xfer_t *x;
        TD_INFO("%s: KV pushed over %s: %llu bytes, the pusher busy %.1f ms, the engine waited %.1f ms of it",
                eng_worker_id(w), eng_worker_transport(w, &x)->name,
                (unsigned long long)pw_peers_stats(R->peers).bytes, R->busy_total * 1e3, R->exposed_total * 1e3);
    }
    pw_peers_destroy(R->peers);
    R->peers = NULL;
    free(R->active);
    td_verifier_close(R->verifier);
    R->verifier = NULL;
    free(R->tombs);
    R->tombs = NULL;
    for (uint32_t i = 0; i < R->n_kept; i++)
        eng_engine_host_free(eng_worker_engine(w), R->kept[i].p);
    R->n_kept = 0;
    pthread_mutex_destroy(&R->stage_mu);
    free(R->leased);
    R->leased = NULL;
    pthread_mutex_destroy(&R->lease_mu);
}

int main(int argc, char **argv)
{
    static prefill_role_t state;
    eng_worker_role_t role = {.name = "prefill", .attach = prefill_attach, .after_step = prefill_after_step,
                              .stats = prefill_stats, .detach = prefill_detach, .ctx = &state};
    return eng_worker_main(argc, argv, &role);
}
