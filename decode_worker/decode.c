/* decode.c — tandem-decode, the decode worker (DESIGN.md §1 steps 2 and 4).
 *
 * Reserve takes landing blocks out of the engine's pool (UCX-allocated
 * memory) and answers with where they are; the reservation is held on a
 * lease (lease_ms), which its holder renews (Renew) while the prompt is
 * prefilled, and reclaimed by the engine thread if no Decode claims it in
 * time. Prefill workers put the prompt's KV straight into those blocks —
 * except the leading blocks this worker's prefix cache holds already (a
 * conversation's earlier turns, when the Reserve names the tokens): the
 * reservation takes those as they are and the landing starts after them.
 * Decode is the completion notice: the blocks become an imported sequence
 * whose first token the prefill side sampled, it joins the running batch,
 * and its tokens stream back. Release is the abort path. A client that goes
 * away cancels its sequence, which frees its blocks at once.
 *
 * The data plane touches only what was granted (DESIGN.md §2 "Security").
 * UCX's remote key covers the whole pool (with shared memory a key maps the
 * whole segment; over TCP it carries no check), so keys are per pool and the
 * grant is the landing descriptor: the decode worker signs it with its
 * cluster key (the reservation, its blocks, the pool, a land-by time), and
 * the prefill worker puts only into blocks of a descriptor a decode worker
 * of this cluster signed, and only until land-by. Blocks of a reservation
 * that ends unclaimed stay fenced until land-by has passed, unless the
 * router says the prefill worker answered its call (Release landing_closed),
 * so a late put from a stalled prefill worker cannot reach their next owner.
 * Only the router's certificate may call Reserve, Decode, Release and Renew,
 * and one peer holds at most MAX_RESERVATIONS_PER_PEER reservations.
 *
 * A colocated decode worker (decode.colocated) also takes a Decode with no
 * reservation: the whole request, its prompt prefilled by this worker's own
 * engine in the steps it shares with the running decodes (as vLLM or SGLang
 * serve without disaggregation), its first token streamed like the rest. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "common/certs.h"
#include "common/clock.h"
#include "common/grow.h"
#include "common/log.h"
#include "common/rpc_pb.h"
#include "engine/tp.h"
#include "worker/worker.h"

/* A reservation's lease is short; its holder renews it while the prompt is
 * prefilled (the router every second for 3 s), so a holder that dies pins
 * blocks for one lease at most. */
#define MAX_LEASE_MS 30000u
#define DEFAULT_LEASE_MS 3000u
/* Reservations open at once (claimed ones are sequences, not counted), in
 * all and by one peer (certificate). */
#define MAX_RESERVATIONS 4096
#define MAX_RESERVATIONS_PER_PEER 1024
/* How long puts may land after a Reserve: the router asks for its Prefill
 * call's deadline; 60 s when it asks nothing, at most 10 min. A fenced block
 * is held FENCE_MARGIN_S past land-by (clocks of two hosts may differ). */
#define DEFAULT_LANDING_MS 60000u
#define MAX_LANDING_MS 600000u
#define FENCE_MARGIN_S 1.0

typedef struct reservation {
    uint64_t id;
    int32_t *blocks;
    uint32_t n_blocks, n_tokens;
    uint32_t n_held;           /* blocks[0..n_held): the prefix cache's, not landed */
    td_block_name_t held_name; /* the name of block n_held - 1 (the Decode's tokens must have it) */
    double expires;
    double fence_until; /* td_now_s() past which no put of its landing can come */
    char owner[64];     /* the certificate that reserved it ("" under plaintext) */
} reservation_t;

/* Blocks of a reservation that ended unclaimed, until a late put cannot come. */
typedef struct fenced {
    int32_t *blocks;
    uint32_t n_blocks;
    double until;
} fenced_t;

/* The role's state, behind its context (eng_worker_role_t.ctx); engine thread
 * (signer: set before serving, then read-only). */
typedef struct decode_role {
    reservation_t *res;
    size_t n_res, cap_res;
    fenced_t *fenced;
    size_t n_fenced, cap_fenced;
    uint32_t fenced_blocks;
    uint64_t landed_blocks, held_blocks; /* over the claimed reservations (Stats) */
    td_signer_t *signer; /* NULL under cluster.plaintext: landings go unsigned */
} decode_role_t;

/* Engine thread: a reservation that ended unclaimed gives its blocks back,
 * at once when its landing is closed or past land-by, else once it is — or
 * once its lease is over, if sooner: a prefill worker puts into a landing only
 * while the router extends its lease, which it does only for reservations it
 * has renewed here, to the lease it asked for counted from before it asked
 * (PrefillRequest.landing_lease_until_unix_ms, Prefill.Extend). */
static void reservation_end(eng_worker_t *w, decode_role_t *R, reservation_t *r, bool landing_closed)
{
    /* no put reaches the prefix cache's blocks: they go back at once */
    eng_engine_kv_release(eng_worker_engine(w), r->blocks, r->n_held);
    memmove(r->blocks, r->blocks + r->n_held, (r->n_blocks - r->n_held) * sizeof *r->blocks);
    r->n_blocks -= r->n_held;
    r->n_held = 0;
    if (r->expires + FENCE_MARGIN_S < r->fence_until)
        r->fence_until = r->expires + FENCE_MARGIN_S;
    if (!landing_closed && r->fence_until > td_now_s()) {
        if (R->n_fenced == R->cap_fenced) {
            size_t nc = R->cap_fenced ? 2 * R->cap_fenced : 16;
            fenced_t *f = realloc(R->fenced, nc * sizeof *f);
            if (!f) { /* no room to remember them: they stay out of the pool (a leak, not a hazard) */
                TD_WARN("%s: no memory to fence %u blocks; they are lost until restart", eng_worker_id(w), r->n_blocks);
                free(r->blocks);
                return;
            }
            R->fenced = f;
            R->cap_fenced = nc;
        }
        R->fenced[R->n_fenced++] = (fenced_t){r->blocks, r->n_blocks, r->fence_until};
        R->fenced_blocks += r->n_blocks;
        return;
    }
    eng_engine_kv_release(eng_worker_engine(w), r->blocks, r->n_blocks);
    free(r->blocks);
}


/* ---- Reserve ---- */
typedef struct reserve_op {
    uint32_t n_tokens, lease_ms;
    int32_t *tokens; /* the Reserve's, copied (NULL: every block lands) */
    uint32_t n_held;
    td_block_name_t held_name;
    double fence_until;
    char owner[64];
    td_status_t rc;
    char err[160]; /* what rc means, for the caller (not logged: a peer's request, answered) */
    uint64_t id;
    int32_t *blocks;
    uint32_t n_blocks;
} reserve_op_t;

static void reserve_on_engine(eng_worker_t *w, void *arg)
{
    reserve_op_t *op = arg;
    decode_role_t *R = eng_worker_role_ctx(w);
    eng_engine_t *e = eng_worker_engine(w);
    uint32_t bt = eng_worker_contract(w).block_tokens;
    /* counted in 64 bits: n_tokens near 2^32 must not wrap to a few blocks */
    uint64_t nb = ((uint64_t)op->n_tokens + bt - 1) / bt, pool = eng_engine_kv_stats(e).n_blocks;
    if (nb > pool) {
        op->rc = TD_ERR_INVALID_ARG;
        snprintf(op->err, sizeof op->err, "n_tokens: %u tokens need %llu blocks; the pool has %llu", op->n_tokens,
                 (unsigned long long)nb, (unsigned long long)pool);
        return;
    }
    if (R->n_res >= MAX_RESERVATIONS) {
        op->rc = TD_ERR_EXHAUSTED;
        snprintf(op->err, sizeof op->err, "%u reservations open, the most this worker holds", (unsigned)R->n_res);
        return;
    }
    unsigned mine = 0;
    for (size_t i = 0; i < R->n_res; i++)
        mine += !strcmp(R->res[i].owner, op->owner);
    if (mine >= MAX_RESERVATIONS_PER_PEER) {
        op->rc = TD_ERR_EXHAUSTED;
        snprintf(op->err, sizeof op->err, "\"%.40s\" holds %u reservations, the most one peer may hold", op->owner,
                 mine);
        return;
    }
    op->n_blocks = (uint32_t)nb;
    op->blocks = malloc(op->n_blocks * sizeof *op->blocks);
    if (!op->blocks || R->n_res == R->cap_res) {
        size_t nc = R->cap_res ? 2 * R->cap_res : 64;
        reservation_t *r = op->blocks ? realloc(R->res, nc * sizeof *r) : NULL;
        if (!r) {
            op->rc = TD_ERR_NO_MEMORY;
            snprintf(op->err, sizeof op->err, "no memory");
            return;
        }
        R->res = r;
        R->cap_res = nc;
    }
    /* an id no one can guess: Renew, Release and Decode name a reservation by it */
    do {
        if (getrandom(&op->id, sizeof op->id, 0) != sizeof op->id) {
            op->rc = TD_ERR_INTERNAL;
            snprintf(op->err, sizeof op->err, "getrandom failed");
            return;
        }
    } while (!op->id);
    op->rc = op->tokens ? eng_engine_kv_reserve_prefix(e, op->tokens, op->n_tokens, op->blocks, &op->n_held)
                        : eng_engine_kv_reserve(e, op->n_tokens, op->blocks);
    if (op->rc) {
        snprintf(op->err, sizeof op->err, "no room for %u tokens of KV (pool full)", op->n_tokens);
        return;
    }
    if (op->n_held)
        op->held_name = eng_engine_block_name(e, op->tokens, op->n_held);
    reservation_t *r = &R->res[R->n_res++];
    *r = (reservation_t){op->id,           op->blocks, op->n_blocks, op->n_tokens, op->n_held,
                         op->held_name,    td_now_s() + op->lease_ms / 1000.0, op->fence_until, ""};
    memcpy(r->owner, op->owner, sizeof r->owner);
}

/* Takes reservation id out of the table (engine thread); false if unknown. */
static bool reservation_take(decode_role_t *R, uint64_t id, reservation_t *out)
{
    for (size_t i = 0; i < R->n_res; i++)
        if (R->res[i].id == id) {
            *out = R->res[i];
            R->res[i] = R->res[--R->n_res];
            return true;
        }
    return false;
}

static void expire_reservations(eng_worker_t *w, void *ctx)
{
    decode_role_t *R = ctx;
    double t = td_now_s();
    for (size_t i = 0; i < R->n_res;) {
        reservation_t *r = &R->res[i];
        if (r->expires < t) {
            TD_WARN("%s: reservation %llu (%u blocks) expired unclaimed; its blocks are free again%s", eng_worker_id(w),
                    (unsigned long long)r->id, r->n_blocks, r->fence_until > t ? " once its landing time is over" : "");
            reservation_t gone = *r;
            R->res[i] = R->res[--R->n_res];
            reservation_end(w, R, &gone, false);
        } else {
            i++;
        }
    }
    for (size_t i = 0; i < R->n_fenced;) {
        if (R->fenced[i].until <= t) {
            eng_engine_kv_release(eng_worker_engine(w), R->fenced[i].blocks, R->fenced[i].n_blocks);
            free(R->fenced[i].blocks);
            R->fenced_blocks -= R->fenced[i].n_blocks;
            R->fenced[i] = R->fenced[--R->n_fenced];
        } else {
            i++;
        }
    }
}

/* A reserve whose caller gave up waiting: blocks a late success reserved
 * belong to the reservation (its lease returns them); others are freed. */
static void reserve_op_drop(void *arg)
{
    reserve_op_t *op = arg;
    if (op->rc)
        free(op->blocks);
    free(op->tokens);
    free(op);
}

static void h_reserve(void *ctx, td_rpc_call_t *call)
{
    eng_worker_t *w = ctx;
    Tandem__Internal__V1__ReserveRequest *rq =
        (Tandem__Internal__V1__ReserveRequest *)td_rpc_request_pb(call, &tandem__internal__v1__reserve_request__descriptor);
    if (!rq)
        return;
    td_kv_layout_t ours = eng_worker_contract(w), peer;
    if (!rq->contract) {
        td_rpc_call_finish(call, TD_RPC_INVALID_ARGUMENT, "contract: missing");
        goto out;
    }
    if (td_kv_layout_from_pb(rq->contract, &peer) || td_kv_contract_check(&ours, &peer, "prefill side")) {
        td_rpc_call_finish(call, TD_RPC_FAILED_PRECONDITION, "KV contract refused by %s: %s", eng_worker_id(w),
                           td_last_error());
        goto out;
    }
    if (!rq->n_tokens) {
        td_rpc_call_finish(call, TD_RPC_INVALID_ARGUMENT, "n_tokens: must be at least 1");
        goto out;
    }
    if (rq->n_prompt_tokens && rq->n_prompt_tokens != rq->n_tokens) {
        td_rpc_call_finish(call, TD_RPC_INVALID_ARGUMENT, "prompt_tokens: %zu given for n_tokens %u", rq->n_prompt_tokens,
                           rq->n_tokens);
        goto out;
    }
    reserve_op_t *op = calloc(1, sizeof *op);
    if (op && rq->n_prompt_tokens && (op->tokens = malloc(rq->n_tokens * sizeof *op->tokens)))
        memcpy(op->tokens, rq->prompt_tokens, rq->n_tokens * sizeof *op->tokens);
    if (!op || (rq->n_prompt_tokens && !op->tokens)) {
        free(op);
        td_rpc_call_finish(call, TD_RPC_RESOURCE_EXHAUSTED, "no memory");
        goto out;
    }
    op->n_tokens = rq->n_tokens;
    op->lease_ms = rq->lease_ms ? (rq->lease_ms < MAX_LEASE_MS ? rq->lease_ms : MAX_LEASE_MS) : DEFAULT_LEASE_MS;
    uint32_t landing_ms = rq->landing_ms ? (rq->landing_ms < MAX_LANDING_MS ? rq->landing_ms : MAX_LANDING_MS)
                                         : DEFAULT_LANDING_MS;
    uint64_t land_by = td_unix_ms() + landing_ms;
    op->fence_until = td_local_of_unix_ms(land_by) + FENCE_MARGIN_S;
    snprintf(op->owner, sizeof op->owner, "%s", td_rpc_call_identity(call));
    if (eng_worker_call_or_drop(w, reserve_on_engine, op, reserve_op_drop, 5)) {
        td_rpc_call_finish(call, TD_RPC_UNAVAILABLE, "%s", td_last_error());
        goto out; /* op is the queued closure's now */
    }
    if (op->rc) {
        td_rpc_call_finish(call, op->rc == TD_ERR_INVALID_ARG ? TD_RPC_INVALID_ARGUMENT : TD_RPC_RESOURCE_EXHAUSTED,
                           "%s: %s", eng_worker_id(w), op->err);
        reserve_op_drop(op);
        goto out;
    }
    Tandem__Internal__V1__LandingDescriptor land = TANDEM__INTERNAL__V1__LANDING_DESCRIPTOR__INIT;
    Tandem__Internal__V1__KvContract c;
    td_kv_layout_to_pb(&ours, &c);
    const void *addr, *rkey;
    size_t addr_len, rkey_len;
    uint64_t base, pool_len;
    eng_worker_pool_desc(w, &addr, &addr_len, &rkey, &rkey_len, &base, &pool_len);
    size_t bb;
    eng_engine_kv_base(eng_worker_engine(w), &bb); /* block size only; constant after start */
    /* only the blocks the prefix cache did not supply land */
    uint32_t n_land = op->n_blocks - op->n_held;
    uint64_t *offs = malloc(n_land * sizeof *offs);
    for (uint32_t i = 0; offs && i < n_land; i++)
        offs[i] = (uint64_t)op->blocks[op->n_held + i] * bb;
    kv_xfer_t *xfer;
    land.has_reservation_id = land.has_address = land.has_region_key = land.has_remote_base = land.has_block_bytes =
        land.has_region_bytes = 1;
    land.reservation_id = op->id;
    land.transport = (char *)eng_worker_transport(w, &xfer)->name;
    land.address = (ProtobufCBinaryData){addr_len, (uint8_t *)addr};
    land.region_key = (ProtobufCBinaryData){rkey_len, (uint8_t *)rkey};
    land.remote_base = base;
    land.region_bytes = pool_len;
    land.n_block_offsets = offs ? n_land : 0;
    land.block_offsets = offs;
    land.has_first_block = op->n_held > 0;
    land.first_block = op->n_held;
    land.block_bytes = bb;
    land.contract = &c;
    /* a pool of parts: a region a rank, each with its KV heads */
    uint32_t n_parts = eng_worker_pool_regions(w) > 1 ? eng_worker_pool_regions(w) : 0;
    Tandem__Internal__V1__LandingPart parts[ENG_TP_MAX], *part_ptrs[ENG_TP_MAX];
    Tandem__Internal__V1__KvRegion regions[ENG_TP_MAX];
    for (uint32_t i = 0; i < n_parts; i++) {
        Tandem__Internal__V1__LandingPart *p = &parts[i];
        Tandem__Internal__V1__KvRegion *rg = &regions[i];
        const eng_pool_region_t pr = eng_worker_pool_region(w, i);
        tandem__internal__v1__landing_part__init(p);
        tandem__internal__v1__kv_region__init(rg);
        rg->remote_base = pr.base, rg->region_bytes = pr.len;
        rg->region_key = (ProtobufCBinaryData){pr.rkey_len, (uint8_t *)pr.rkey};
        rg->has_region_key = rg->has_remote_base = rg->has_region_bytes = 1;
        p->region = rg, p->kv_head0 = pr.head0, p->kv_heads = pr.heads;
        p->has_kv_head0 = p->has_kv_heads = 1;
        part_ptrs[i] = p;
    }
    land.n_parts = n_parts;
    land.parts = part_ptrs;
    land.decode_worker = (char *)eng_worker_id(w);
    land.has_land_by_unix_ms = 1;
    land.land_by_unix_ms = land_by;
    /* the grant: this descriptor as packed now, signed (fields 12, 13 added after) */
    decode_role_t *R = eng_worker_role_ctx(w);
    uint8_t sig[TD_SIG_MAX];
    size_t sig_len = 0, gn = 0;
    uint8_t *grant = NULL;
    bool signed_ok = !R->signer;
    if (R->signer && offs && (grant = malloc(gn = tandem__internal__v1__landing_descriptor__get_packed_size(&land)))) {
        tandem__internal__v1__landing_descriptor__pack(&land, grant);
        if (td_sign(R->signer, grant, gn, sig, &sig_len) == TD_OK) {
            size_t cl;
            const uint8_t *cert = td_signer_cert(R->signer, &cl);
            land.has_signature = land.has_signer_cert = 1;
            land.signature = (ProtobufCBinaryData){sig_len, sig};
            land.signer_cert = (ProtobufCBinaryData){cl, (uint8_t *)cert};
            signed_ok = true;
        }
        free(grant);
    }
    Tandem__Internal__V1__ReserveResponse rp = TANDEM__INTERNAL__V1__RESERVE_RESPONSE__INIT;
    rp.landing = &land;
    size_t pn = tandem__internal__v1__reserve_response__get_packed_size(&rp);
    uint8_t *buf = malloc(pn);
    if (!signed_ok) {
        td_rpc_call_finish(call, TD_RPC_INTERNAL, "%s: cannot sign the landing: %s", eng_worker_id(w),
                           td_last_error());
    } else if (buf && offs) {
        tandem__internal__v1__reserve_response__pack(&rp, buf);
        td_rpc_call_reply(call, buf, pn);
    } else {
        td_rpc_call_finish(call, TD_RPC_RESOURCE_EXHAUSTED, "no memory");
    }
    free(buf);
    free(offs);
    free(op); /* the blocks array now belongs to the reservation */
out:
    tandem__internal__v1__reserve_request__free_unpacked(rq, NULL);
}

/* ---- Release ---- */
typedef struct release_op {
    uint64_t id;
    bool landing_closed;
    bool found;
} release_op_t;

static void release_on_engine(eng_worker_t *w, void *arg)
{
    release_op_t *op = arg;
    reservation_t r;
    op->found = reservation_take(eng_worker_role_ctx(w), op->id, &r);
    if (op->found)
        reservation_end(w, eng_worker_role_ctx(w), &r, op->landing_closed);
}

static void h_release(void *ctx, td_rpc_call_t *call)
{
    eng_worker_t *w = ctx;
    Tandem__Internal__V1__ReleaseRequest *rq =
        (Tandem__Internal__V1__ReleaseRequest *)td_rpc_request_pb(call, &tandem__internal__v1__release_request__descriptor);
    if (!rq)
        return;
    release_op_t *op = calloc(1, sizeof *op);
    if (op) {
        op->id = rq->reservation_id;
        op->landing_closed = rq->landing_closed;
    }
    tandem__internal__v1__release_request__free_unpacked(rq, NULL);
    if (!op) {
        td_rpc_call_finish(call, TD_RPC_RESOURCE_EXHAUSTED, "no memory");
        return;
    }
    if (eng_worker_call_or_drop(w, release_on_engine, op, free, 5)) {
        td_rpc_call_finish(call, TD_RPC_UNAVAILABLE, "%s", td_last_error());
        return; /* op is the queued closure's now */
    }
    /* an unknown id is fine: it was claimed, expired or released already */
    td_rpc_call_reply(call, "", 0);
    free(op);
}

/* ---- Renew ---- */
typedef struct renew_op {
    Tandem__Internal__V1__RenewRequest *rq;
    uint64_t *unknown;
    size_t n_unknown;
} renew_op_t;

static void renew_on_engine(eng_worker_t *w, void *arg)
{
    renew_op_t *op = arg;
    decode_role_t *R = eng_worker_role_ctx(w);
    uint32_t ms = op->rq->lease_ms < MAX_LEASE_MS ? op->rq->lease_ms : MAX_LEASE_MS;
    double until = td_now_s() + ms / 1000.0;
    for (size_t k = 0; k < op->rq->n_reservation_ids; k++) {
        bool found = false;
        for (size_t i = 0; i < R->n_res && !found; i++)
            if (R->res[i].id == op->rq->reservation_ids[k]) {
                R->res[i].expires = until;
                found = true;
            }
        if (!found)
            op->unknown[op->n_unknown++] = op->rq->reservation_ids[k];
    }
}

static void renew_op_drop(void *arg)
{
    renew_op_t *op = arg;
    if (op->rq)
        tandem__internal__v1__renew_request__free_unpacked(op->rq, NULL);
    free(op->unknown);
    free(op);
}

static void h_renew(void *ctx, td_rpc_call_t *call)
{
    eng_worker_t *w = ctx;
    renew_op_t *op = calloc(1, sizeof *op);
    if (!op) {
        td_rpc_call_finish(call, TD_RPC_RESOURCE_EXHAUSTED, "no memory");
        return;
    }
    op->rq = (Tandem__Internal__V1__RenewRequest *)td_rpc_request_pb(call, &tandem__internal__v1__renew_request__descriptor);
    if (!op->rq)
        goto out;
    if (!op->rq->lease_ms) {
        td_rpc_call_finish(call, TD_RPC_INVALID_ARGUMENT, "lease_ms: must be at least 1");
        goto out;
    }
    if (!(op->unknown = calloc(op->rq->n_reservation_ids + 1, sizeof *op->unknown))) {
        td_rpc_call_finish(call, TD_RPC_RESOURCE_EXHAUSTED, "no memory");
        goto out;
    }
    if (eng_worker_call_or_drop(w, renew_on_engine, op, renew_op_drop, 5)) {
        td_rpc_call_finish(call, TD_RPC_UNAVAILABLE, "%s", td_last_error());
        return; /* op is the queued closure's now */
    }
    Tandem__Internal__V1__RenewResponse rp = TANDEM__INTERNAL__V1__RENEW_RESPONSE__INIT;
    rp.n_unknown_ids = op->n_unknown;
    rp.unknown_ids = op->unknown;
    td_rpc_reply_pb(call, &rp.base);
out:
    renew_op_drop(op);
}

/* ---- Decode ---- */
/* Events wait in d->ev, their texts back to back in d->text (each
 * NUL-terminated); both are reused once the handler has sent everything, so
 * a stream allocates nothing per token once they are large enough. */
typedef struct dec_event {
    int32_t token;    /* the client's (-1: none; an end token is not one) */
    int32_t lp_token; /* the token of lp: an end token's too */
    eng_finish_t finish;
    size_t text_off;
    uint32_t n_generated, n_cached;
    char *error; /* ENG_FINISH_ERROR's message */
    bool has_lp;
    eng_logprobs_t lp; /* the token's, where the request asked (sampling.logprobs) */
    eng_logprobs_t *plp; /* the prompt's (sampling.prompt_logprobs), on the first event */
    uint32_t n_plp;
} dec_event_t;

typedef struct dreq {
    pthread_mutex_t mu;
    int refs;
    td_rpc_call_t *call; /* NULL once the handler is done */
    dec_event_t *ev;
    size_t n_ev, cap_ev;
    char *text;
    size_t text_len, text_cap;
    bool lost; /* an event could not be queued (no memory): the stream ends with an error */
    double t_final; /* when the engine queued the last event (0: not yet) */
    /* the pump's (touched by the call's callbacks only, which never overlap) */
    eng_worker_t *w;
    size_t sent;       /* events of the queue sent */
    bool sending;      /* a message is being written */
    bool final_queued; /* the message with the finish reason is written or being written */
    bool ending;       /* the end is under way on the pool */
    int end_code;
    double t_pumped;   /* when the pump last ran (for the report of a stream cancelled with its end queued) */
    uint8_t buf[4096 + 64]; /* the message being packed (longer ones take the heap once) */
    /* the start closure's inputs and outputs */
    Tandem__Internal__V1__DecodeRequest *rq;
    eng_logit_bias_t *bias;
    uint64_t eng_id;
    td_status_t rc;
    char err[512];
    double deadline; /* td_now_s() at its call's deadline (a colocated prompt's chunks fit it) */
} dreq_t;

static void dreq_put(dreq_t *d)
{
    pthread_mutex_lock(&d->mu);
    int r = --d->refs;
    pthread_mutex_unlock(&d->mu);
    if (r)
        return;
    for (size_t i = 0; i < d->n_ev; i++) {
        free(d->ev[i].error);
        free(d->ev[i].plp);
    }
    free(d->text);
    free(d->ev);
    free(d->bias);
    if (d->rq)
        tandem__internal__v1__decode_request__free_unpacked(d->rq, NULL);
    pthread_mutex_destroy(&d->mu);
    free(d);
}

static void on_decode_event(void *ctx, const eng_event_t *ev)
{
    dreq_t *d = ctx;
    pthread_mutex_lock(&d->mu);
    if (td_grow((void **)&d->ev, &d->cap_ev, d->n_ev + 1, sizeof *d->ev, 16) &&
        td_grow((void **)&d->text, &d->text_cap, d->text_len + ev->text_len + 1, 1, 256)) {
        dec_event_t *x = &d->ev[d->n_ev++];
        x->token = ev->finish == ENG_FINISH_EOS ? -1 : ev->token;
        x->lp_token = ev->token;
        x->finish = ev->finish;
        x->text_off = d->text_len;
        memcpy(d->text + d->text_len, ev->text, ev->text_len);
        d->text[d->text_len + ev->text_len] = 0;
        d->text_len += ev->text_len + 1;
        x->n_generated = ev->n_generated;
        x->n_cached = ev->n_cached;
        x->error = ev->error ? strdup(ev->error) : NULL;
        if ((x->has_lp = ev->logprobs != NULL))
            x->lp = *ev->logprobs;
        x->plp = NULL;
        x->n_plp = 0;
        if (ev->n_prompt_logprobs && (x->plp = malloc(ev->n_prompt_logprobs * sizeof *x->plp))) {
            memcpy(x->plp, ev->prompt_logprobs, ev->n_prompt_logprobs * sizeof *x->plp);
            x->n_plp = ev->n_prompt_logprobs;
        }
    } else {
        d->lost = true;
    }
    if (ev->finish != ENG_FINISH_NONE)
        d->t_final = td_now_s();
    if (d->call)
        td_rpc_call_wake(d->call);
    pthread_mutex_unlock(&d->mu);
    if (ev->finish != ENG_FINISH_NONE)
        dreq_put(d); /* the listener's reference */
}

static const Tandem__V1__FinishReason finish_pb[] = {
    [ENG_FINISH_NONE] = TANDEM__V1__FINISH_REASON__FINISH_REASON_UNSPECIFIED,
    [ENG_FINISH_EOS] = TANDEM__V1__FINISH_REASON__FINISH_REASON_EOS,
    [ENG_FINISH_STOP] = TANDEM__V1__FINISH_REASON__FINISH_REASON_STOP,
    [ENG_FINISH_LENGTH] = TANDEM__V1__FINISH_REASON__FINISH_REASON_LENGTH,
    [ENG_FINISH_CANCELLED] = TANDEM__V1__FINISH_REASON__FINISH_REASON_CANCELLED,
    [ENG_FINISH_ERROR] = TANDEM__V1__FINISH_REASON__FINISH_REASON_ERROR,
};

/* Packs the next event not sent into buf (the heap when longer than cap;
 * *out says where); 0 when none is waiting. Once every event is sent, the
 * queue and its text buffer start over. */
static size_t next_message(dreq_t *d, size_t *sent, uint8_t *buf, size_t cap, uint8_t **out, eng_finish_t *fin)
{
    size_t pn = 0;
    pthread_mutex_lock(&d->mu);
    if (*sent < d->n_ev) {
        dec_event_t *x = &d->ev[*sent];
        Tandem__Internal__V1__DecodeResponse r = TANDEM__INTERNAL__V1__DECODE_RESPONSE__INIT;
        r.text = d->text + x->text_off;
        int32_t tok = x->token;
        eng_logprob_pb_t lpb;
        Tandem__V1__TokenLogprob *lp;
        if (tok >= 0) {
            r.n_token_ids = 1;
            r.token_ids = &tok;
        }
        if (x->has_lp && x->lp_token >= 0) { /* an end token's log-probability too (OpenAI lists it) */
            lp = eng_logprob_to_pb(x->lp_token, &x->lp, &lpb);
            r.n_logprobs = 1;
            r.logprobs = &lp;
        }
        r.has_completion_tokens = 1;
        r.completion_tokens = x->n_generated;
        if (x->finish != ENG_FINISH_NONE) {
            r.has_finish_reason = 1;
            r.finish_reason = finish_pb[x->finish];
            r.has_cached_tokens = !d->rq->has_reservation_id;
            r.cached_tokens = x->n_cached;
        }
        if (x->finish == ENG_FINISH_ERROR)
            r.error = x->error ? x->error : "an engine step failed";
        void *plp_mem = NULL;
        if (x->n_plp && !eng_prompt_logprobs_to_pb(d->rq->tokens, x->plp, x->n_plp, &plp_mem, &r.prompt_logprobs))
            r.n_prompt_logprobs = x->n_plp + 1;
        *fin = x->finish;
        pn = tandem__internal__v1__decode_response__get_packed_size(&r);
        *out = pn <= cap ? buf : malloc(pn);
        if (*out)
            tandem__internal__v1__decode_response__pack(&r, *out);
        free(plp_mem);
        if (++*sent == d->n_ev) { /* all sent: reuse the queue */
            for (size_t i = 0; i < d->n_ev; i++) {
                free(d->ev[i].error);
                free(d->ev[i].plp);
            }
            d->n_ev = d->text_len = 0;
            *sent = 0;
        }
    }
    pthread_mutex_unlock(&d->mu);
    return pn;
}

/* The landing check (DESIGN.md §1's invariant): before a sequence decodes
 * on imported KV, every reserved block must hold exactly the bytes the
 * prefill side stated — a block that was never put, put only in part or
 * overwritten is refused (d->rc, d->err), never decoded on. */
static td_status_t landing_check(eng_worker_t *w, dreq_t *d, const reservation_t *r)
{
    uint32_t n = r->n_blocks - r->n_held;
    const int32_t *blocks = r->blocks + r->n_held;
    if (r->n_held &&
        !td_block_name_eq(eng_engine_block_name(eng_worker_engine(w), d->rq->tokens, r->n_held), r->held_name)) {
        d->rc = TD_ERR_INVALID_ARG;
        snprintf(d->err, sizeof d->err, "tokens: not the prompt reservation %llu was made for (its first %u blocks "
                 "differ)", (unsigned long long)r->id, r->n_held);
        return d->rc;
    }
    if (d->rq->n_block_digests != n) {
        d->rc = TD_ERR_INVALID_ARG;
        snprintf(d->err, sizeof d->err, "block_digests: %zu given for the %u landing blocks of reservation %llu",
                 d->rq->n_block_digests, n, (unsigned long long)r->id);
        return d->rc;
    }
    if (eng_worker_kv_landed(w, blocks, n)) {
        d->rc = TD_ERR_INTERNAL;
        snprintf(d->err, sizeof d->err, "%s: the landing blocks of reservation %llu: %s", eng_worker_id(w),
                 (unsigned long long)r->id, td_last_error());
        return d->rc;
    }
    uint64_t dg[64]; /* computed where the pool is (a GPU's pool on the GPU), 64 blocks a call */
    for (uint32_t b = 0; b < n; b++) {
        if (b % 64 == 0) {
            uint32_t k = n - b < 64 ? n - b : 64;
            if (eng_engine_kv_digest(eng_worker_engine(w), blocks + b, k, dg)) {
                d->rc = TD_ERR_INTERNAL;
                snprintf(d->err, sizeof d->err, "%s: digests of the landing blocks: %s", eng_worker_id(w),
                         td_last_error());
                return d->rc;
            }
        }
        uint64_t got = dg[b % 64];
        if (got != d->rq->block_digests[b]) {
            d->rc = TD_ERR_INTERNAL;
            snprintf(d->err, sizeof d->err, "%s: KV block %u of %u (reservation %llu) did not land as the prefill "
                     "side sent it (digest %016llx, expected %016llx); not decoding on it", eng_worker_id(w),
                     r->n_held + b, r->n_blocks, (unsigned long long)r->id, (unsigned long long)got,
                     (unsigned long long)d->rq->block_digests[b]);
            td_log(TD_LOG_ERROR, "%s", d->err);
            return d->rc;
        }
    }
    return TD_OK;
}

/* Engine thread: d's request into the engine, its events to d: imported
 * (kv: the landing blocks holding its tokens' KV, which the engine owns once
 * it is added, and the first token the prefill side sampled), or, kv NULL,
 * whole (a colocated worker computes its tokens: the prompt, and on a resume
 * those streamed before). */
static void add_request(eng_worker_t *w, dreq_t *d, const int32_t *kv, uint32_t n_kv)
{
    const Tandem__V1__SamplingParams *sp = d->rq->sampling;
    eng_engine_t *e = eng_worker_engine(w);
    d->bias = calloc(sp && sp->n_logit_bias ? sp->n_logit_bias : 1, sizeof *d->bias);
    if (!d->bias) {
        d->rc = TD_ERR_NO_MEMORY;
        snprintf(d->err, sizeof d->err, "no memory");
        if (kv)
            eng_engine_kv_release(e, kv, n_kv);
        return;
    }
    eng_request_t er = {.prompt = d->rq->tokens, .n_prompt = d->rq->n_tokens, .kv_blocks = kv,
                        .first_token = kv ? d->rq->first_token : 0, .sampled_before = d->rq->sampled_before,
                        .resume_generated = d->rq->resume_generated, .resume_text_sent = d->rq->resume_text_sent,
                        .priority = d->rq->has_priority ? d->rq->priority : 0, .deadline = d->deadline};
    eng_sampling_from_pb(sp, &er.sampling, d->bias);
    er.max_tokens = sp && sp->max_tokens ? sp->max_tokens : 128;
    if (kv) /* the prefill worker that computed the prompt scored it */
        er.sampling.prompt_logprobs = false;
    er.ignore_eos = sp && sp->ignore_eos;
    er.stop = sp ? (const char *const *)sp->stop : NULL;
    er.n_stop = sp ? sp->n_stop : 0;
    d->rc = eng_engine_add(e, &er, &d->eng_id);
    if (d->rc) {
        snprintf(d->err, sizeof d->err, "%s", td_last_error());
        if (d->rc == TD_ERR_INVALID_ARG) /* the request's own error (td_user_error): said once, here */
            TD_WARN("decode: %s refused: %s", d->rq->request_id && d->rq->request_id[0] ? d->rq->request_id : "-",
                    d->err);
        if (kv)
            eng_engine_kv_release(e, kv, n_kv);
    } else if ((d->rc = eng_worker_listen(w, d->eng_id, on_decode_event, d))) {
        snprintf(d->err, sizeof d->err, "%s", td_last_error());
        eng_engine_cancel(e, d->eng_id); /* the engine owned the blocks: it frees them */
    } else {
        d->refs++; /* the listener's */
    }
}

static void start_on_engine(eng_worker_t *w, void *arg)
{
    dreq_t *d = arg;
    if (!d->rq->has_reservation_id) {
        add_request(w, d, NULL, 0);
        return;
    }
    reservation_t r;
    if (!reservation_take(eng_worker_role_ctx(w), d->rq->reservation_id, &r)) {
        d->rc = TD_ERR_NOT_FOUND;
        snprintf(d->err, sizeof d->err, "reservation_id %llu: unknown or expired on %s",
                 (unsigned long long)d->rq->reservation_id, eng_worker_id(w));
        return;
    }
    uint32_t bt = eng_worker_contract(w).block_tokens;
    if (r.n_blocks != (d->rq->n_tokens + bt - 1) / bt) {
        d->rc = TD_ERR_INVALID_ARG;
        snprintf(d->err, sizeof d->err, "tokens: %zu tokens do not fill the %u blocks reserved for %u",
                 d->rq->n_tokens, r.n_blocks, r.n_tokens);
        eng_engine_kv_release(eng_worker_engine(w), r.blocks, r.n_blocks);
        free(r.blocks);
        return;
    }
    if (landing_check(w, d, &r)) {
        eng_engine_kv_release(eng_worker_engine(w), r.blocks, r.n_blocks);
        free(r.blocks);
        return;
    }
    decode_role_t *R = eng_worker_role_ctx(w);
    R->landed_blocks += r.n_blocks - r.n_held;
    R->held_blocks += r.n_held;
    add_request(w, d, r.blocks, r.n_blocks);
    free(r.blocks);
}

/* The closure holds its own reference (cancel_async takes it): it may run
 * after the handler that queued it gave up waiting and went away. */
static void cancel_on_engine(eng_worker_t *w, void *arg)
{
    dreq_t *d = arg;
    bool listening = false;
    /* still running: stop it (frees its blocks) and drop the listener's reference */
    if (eng_engine_cancel(eng_worker_engine(w), d->eng_id) == TD_OK)
        listening = true;
    td_clear_error();
    if (listening) {
        eng_worker_unlisten(w, d->eng_id);
        dreq_put(d);
    }
    dreq_put(d); /* the closure's */
}

static void cancel_async(eng_worker_t *w, dreq_t *d)
{
    pthread_mutex_lock(&d->mu);
    d->refs++;
    pthread_mutex_unlock(&d->mu);
    eng_worker_call(w, cancel_on_engine, d, 5);
}

static void decode_pump(void *ctx, bool ok);

/* The end of a stream, on the pool (it may wait for the engine): the
 * sequence is cancelled unless it finished, the status goes out, and the
 * call ends when this returns. */
static void decode_end(void *ctx, td_rpc_call_t *call)
{
    dreq_t *d = ctx;
    if (d->end_code == TD_RPC_OK) {
        td_rpc_call_finish(call, TD_RPC_OK, NULL);
    } else {
        pthread_mutex_lock(&d->mu);
        size_t unsent = d->n_ev - d->sent;
        double t_final = d->t_final;
        pthread_mutex_unlock(&d->mu);
        if (t_final) /* the sequence had ended but its stream had not: say where the pump stood */
            TD_WARN("%s: decode stream cancelled after its sequence ended %.1f s ago (%zu event(s) unsent; the "
                    "last one written: %s; a write in flight: %s; the pump last looked %.1f s ago)",
                    eng_worker_id(d->w), td_now_s() - t_final, unsent, d->final_queued ? "yes" : "no",
                    d->sending ? "yes" : "no", td_now_s() - d->t_pumped);
        cancel_async(d->w, d); /* frees the sequence's blocks */
        if (d->end_code == TD_RPC_INTERNAL)
            td_rpc_call_finish(call, TD_RPC_INTERNAL, "%s: no memory to queue a token", eng_worker_id(d->w));
        else
            td_rpc_call_finish(call, TD_RPC_CANCELLED, "the caller went away");
    }
    td_rpc_call_on_wake(call, NULL, NULL); /* and wait for a callback still returning: d may go now */
    pthread_mutex_lock(&d->mu);
    d->call = NULL;
    pthread_mutex_unlock(&d->mu);
    dreq_put(d);
}

static void decode_end_async(dreq_t *d, int code)
{
    d->ending = true;
    d->end_code = code;
    td_rpc_call_t *call = d->call; /* still set: only decode_end clears it */
    td_rpc_call_on_wake(call, NULL, NULL);
    if (td_rpc_call_resume(call, decode_end, d) != TD_OK)
        TD_WARN("%s: cannot end a decode stream (the server is stopping)", eng_worker_id(d->w));
}

static void decode_sent(void *ctx, bool ok)
{
    dreq_t *d = ctx;
    d->sending = false;
    if (!ok) {
        decode_end_async(d, TD_RPC_CANCELLED);
        return;
    }
    decode_pump(d, true);
}

/* Runs on the call's completion-queue thread whenever the engine queued
 * events (td_rpc_call_wake), a write completed, or the client went away:
 * one message in flight at a time, so a slow client holds the stream back
 * without holding a thread. */
static void decode_pump(void *ctx, bool ok)
{
    (void)ok;
    dreq_t *d = ctx;
    if (d->ending || d->sending)
        return;
    d->t_pumped = td_now_s();
    pthread_mutex_lock(&d->mu);
    bool lost = d->lost;
    td_rpc_call_t *call = d->call;
    pthread_mutex_unlock(&d->mu);
    if (lost) {
        decode_end_async(d, TD_RPC_INTERNAL);
        return;
    }
    if (td_rpc_call_cancelled(call)) {
        decode_end_async(d, TD_RPC_CANCELLED);
        return;
    }
    if (d->final_queued) { /* written: the stream is complete */
        decode_end_async(d, TD_RPC_OK);
        return;
    }
    uint8_t *b = NULL;
    eng_finish_t fin = ENG_FINISH_NONE;
    size_t pn = next_message(d, &d->sent, d->buf, sizeof d->buf, &b, &fin);
    if (!pn)
        return; /* nothing new: the next wake comes with the next event */
    d->sending = true; /* before the write: its completion comes on this thread, but only after */
    d->final_queued = fin != ENG_FINISH_NONE;
    td_status_t rc = b ? td_rpc_call_send_async(call, b, pn, decode_sent, d) : TD_ERR_NO_MEMORY;
    if (b != d->buf)
        free(b);
    if (rc) {
        d->sending = false;
        decode_end_async(d, rc == TD_ERR_NO_MEMORY ? TD_RPC_INTERNAL : TD_RPC_CANCELLED);
    }
}

static void h_decode(void *ctx, td_rpc_call_t *call)
{
    eng_worker_t *w = ctx;
    dreq_t *d = calloc(1, sizeof *d);
    if (!d) {
        td_rpc_call_finish(call, TD_RPC_RESOURCE_EXHAUSTED, "no memory");
        return;
    }
    pthread_mutex_init(&d->mu, NULL);
    d->refs = 1;
    d->call = call;
    d->deadline = td_now_s() + td_rpc_call_time_left(call);
    d->w = w;
    d->rq = (Tandem__Internal__V1__DecodeRequest *)td_rpc_request_pb(call, &tandem__internal__v1__decode_request__descriptor);
    bool colocated = eng_worker_config(w)->decode.colocated;
    if (!d->rq)
        goto done;
    if (!d->rq->n_tokens || (d->rq->has_reservation_id && !d->rq->has_first_token)) {
        td_rpc_call_finish(call, TD_RPC_INVALID_ARGUMENT, "%s", !d->rq->n_tokens ? "tokens: empty" : "first_token: missing");
        goto done;
    }
    if (!d->rq->has_reservation_id && (!colocated || d->rq->has_first_token)) {
        td_rpc_call_finish(call, colocated ? TD_RPC_INVALID_ARGUMENT : TD_RPC_FAILED_PRECONDITION, "%s: %s",
                           eng_worker_id(w), colocated ? "a whole request (no reservation_id) has no first_token"
                                                       : "reservation_id: missing, and this decode worker is not "
                                                         "colocated (decode.colocated), so it serves only prompts "
                                                         "a prefill worker computed");
        goto done;
    }
    d->refs++; /* the start closure may outlive a timed-out wait */
    td_status_t rc = eng_worker_call(w, start_on_engine, d, 10);
    if (rc) {
        td_rpc_call_finish(call, TD_RPC_UNAVAILABLE, "%s", td_last_error());
        goto done; /* the closure keeps its reference */
    }
    dreq_put(d);
    if (d->rc) {
        td_rpc_call_finish(call, td_rpc_code_of(d->rc), "%s", d->err);
        goto done;
    }
    /* the stream goes on without this thread: the pump sends as events come */
    td_rpc_call_detach(call);
    td_rpc_call_on_wake(call, decode_pump, d);
    return;
done:
    pthread_mutex_lock(&d->mu);
    d->call = NULL;
    pthread_mutex_unlock(&d->mu);
    dreq_put(d);
}

static void decode_stats(eng_worker_t *w, void *ctx, Tandem__Internal__V1__StatsResponse *r)
{
    (void)w;
    decode_role_t *R = ctx;
    r->has_reservations = r->has_fenced_blocks = r->has_landed_blocks = r->has_held_blocks = 1;
    r->reservations = (uint32_t)R->n_res;
    r->fenced_blocks = R->fenced_blocks;
    r->landed_blocks = R->landed_blocks;
    r->held_blocks = R->held_blocks;
}

static td_status_t decode_attach(eng_worker_t *w, void *ctx)
{
    decode_role_t *R = ctx;
    const td_rpc_tls_t *tls = eng_worker_tls(w);
    td_status_t rc = tls ? td_signer_open(tls->cert_file, tls->key_file, &R->signer) : TD_OK;
    static const char *const methods[] = {"/tandem.internal.v1.Decode/Reserve", "/tandem.internal.v1.Decode/Decode",
                                          "/tandem.internal.v1.Decode/Release", "/tandem.internal.v1.Decode/Renew"};
    static const td_rpc_handler_fn fns[] = {h_reserve, h_decode, h_release, h_renew};
    td_rpc_server_t *s = eng_worker_server(w);
    for (size_t i = 0; !rc && i < sizeof methods / sizeof *methods; i++)
        if (!(rc = td_rpc_server_add(s, methods[i], fns[i], w)))
            rc = td_rpc_server_allow(s, methods[i], "router");
    return rc;
}

static void decode_detach(eng_worker_t *w, void *ctx)
{
    decode_role_t *R = ctx;
    for (size_t i = 0; i < R->n_fenced; i++)
        free(R->fenced[i].blocks);
    free(R->fenced);
    R->fenced = NULL;
    R->n_fenced = R->cap_fenced = 0;
    td_signer_close(R->signer);
    R->signer = NULL;
    (void)w;
}

int main(int argc, char **argv)
{
    static decode_role_t state;
    eng_worker_role_t role = {.name = "decode", .attach = decode_attach, .before_step = expire_reservations,
                              .stats = decode_stats, .detach = decode_detach, .ctx = &state};
    return eng_worker_main(argc, argv, &role);
}
