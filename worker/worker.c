/* worker.c — see worker.h. */
#define _GNU_SOURCE
#include "common/clock.h"
#include "worker/worker.h"

#include <assert.h>
#include <errno.h>
#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/config.h"
#include "common/grow.h"
#include "common/kv_events.h"
#include "common/rpc_pb.h"
#include "common/log.h"
#include "common/metrics.h"
#include "common/process.h"
#include "common/service.h"
#include "engine/model.h"
#include "engine/profile.h"
#include "engine/tp.h"
#include "worker/profile_store.h"
#include "kvstore/client.h"

typedef struct closure {
    void (*fn)(eng_worker_t *w, void *arg);
    void *arg;
    int refs; /* caller + engine thread */
    bool done;
    bool abandoned;           /* the caller timed out: drop(arg) after fn */
    void (*drop)(void *arg);  /* NULL: the caller keeps arg alive itself */
    struct closure *next;
} closure_t;

typedef struct listener {
    uint64_t id;
    eng_event_fn fn;
    void *ctx;
} listener_t;

/* A step's events wait (until the role's after-step hook ran) in w->held,
 * their texts back to back in w->held_text; both are reused every step. */
typedef struct held_event {
    eng_event_t ev;
    size_t text_off;
    char *error; /* ENG_FINISH_ERROR's message */
    /* the log-probabilities the event points at, copied: the sequence may be gone when the event is delivered */
    eng_logprobs_t lp;
    eng_logprobs_t *plp;
} held_event_t;

struct eng_worker {
    eng_worker_role_t *role;
    char id[96], listen[128], advertise[160];
    td_config_t cfg;               /* the file, then the flags over it; validated */
    const td_worker_config_t *rc;  /* this role's section of cfg */
    td_rpc_tls_t tls_files;        /* the internal planes' mutual TLS (cluster section) */
    const td_rpc_tls_t *tls;       /* &tls_files, or NULL under cluster.plaintext */
    kv_xfer_config_t xfer_cfg;
    eng_model_t *model;
    eng_engine_t *engine;
    td_kv_layout_t contract;
    const kv_transport_ops_t *xo;
    kv_xfer_t *xfer;
    /* the pool's memory as the transport maps it: one region, or one a rank's part (tensor parallelism) */
    struct pool_region {
        kv_xfer_mem_t *mem;
        void *base, *rkey;
        size_t bytes, rkey_len;
        uint32_t head0, heads; /* the KV heads of the part it holds */
    } regions[ENG_TP_MAX];
    uint32_t n_regions;
    size_t pool_bytes; /* every region's */
    void *ucx_addr;
    size_t ucx_addr_len;
    td_rpc_server_t *server;
    bool attached, thread_up, serving; /* what worker_start made: the role attached, the engine thread, the server
                                        * started (and not yet stopped) */
    /* engine thread */
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    closure_t *queue, **queue_tail;
    bool stop;
    listener_t *listeners;
    size_t n_listeners, cap_listeners;
    held_event_t *held;
    size_t n_held, cap_held;
    char *held_text;
    size_t held_text_len, held_text_cap;
    /* the KV store (NULL: none); engine thread: the names the pool gave
     * blocks during this step, to publish after it (at most the pool's
     * block count: a step names each block once), the batches at rest */
    kv_client_t *store;
    td_block_name_t *pub_names;
    uint32_t pub_n, pub_cap;
    bool pub_quiet;              /* naming a block that came from the store */
    struct pub_batch *pub_free;
    bool pub_staged;      /* the pool is device memory: batches carry host staging */
    uint32_t pub_batch_n; /* blocks a batch holds */
    uint32_t pub_batches; /* batches made (at rest or in flight) */
    uint64_t pub_staged_blocks;
    double pub_staged_s; /* the engine thread's time copying blocks out for the store */
    uint64_t pub_offered, pub_new, pub_unpublished;
    /* the pool's named blocks as events for followers (the router's cache
     * index): added on the engine thread, answered on RPC threads */
    pthread_mutex_t ev_mu;
    td_kv_events_t ev;
    eng_profile_t profile; /* measured at start-up (has_profile), published with the record */
    bool has_profile;
    td_metrics_t *metrics; /* Prometheus (common/metrics.h), filled from Stats at each scrape */
    td_metrics_server_t *metrics_server;
    char metrics_at[160];
};


eng_engine_t *eng_worker_engine(eng_worker_t *w) { return w->engine; }
td_rpc_server_t *eng_worker_server(eng_worker_t *w) { return w->server; }
const char *eng_worker_id(const eng_worker_t *w) { return w->id; }
td_kv_layout_t eng_worker_contract(const eng_worker_t *w) { return w->contract; }
const eng_model_t *eng_worker_model(const eng_worker_t *w) { return w->model; }

const kv_transport_ops_t *eng_worker_transport(eng_worker_t *w, kv_xfer_t **x)
{
    *x = w->xfer;
    return w->xo;
}

void eng_worker_pool_desc(eng_worker_t *w, const void **addr, size_t *addr_len, const void **rkey, size_t *rkey_len,
                          uint64_t *base, uint64_t *len)
{
    *addr = w->ucx_addr;
    *addr_len = w->ucx_addr_len;
    eng_pool_region_t r = eng_worker_pool_region(w, 0);
    *rkey = r.rkey, *rkey_len = r.rkey_len, *base = r.base, *len = r.len;
}

uint32_t eng_worker_pool_regions(const eng_worker_t *w) { return w->n_regions; }

eng_pool_region_t eng_worker_pool_region(eng_worker_t *w, uint32_t i)
{
    const struct pool_region *r = &w->regions[i];
    return (eng_pool_region_t){
        .rkey = r->rkey, .rkey_len = r->rkey_len, .len = r->bytes, .head0 = r->head0, .heads = r->heads,
        .base = w->xo->remote_base ? w->xo->remote_base(w->xfer, r->mem) : (uint64_t)(uintptr_t)r->base};
}

/* ---------------------------------------------------------- engine thread */

/* The engine and its listeners are the engine thread's (debug builds check). */
static inline bool on_engine_thread(const eng_worker_t *w) { return pthread_equal(pthread_self(), w->thread); }

td_status_t eng_worker_listen(eng_worker_t *w, uint64_t id, eng_event_fn fn, void *ctx)
{
    assert(on_engine_thread(w));
    if (w->n_listeners == w->cap_listeners) {
        size_t nc = w->cap_listeners ? 2 * w->cap_listeners : 64;
        listener_t *l = realloc(w->listeners, nc * sizeof *l);
        if (!l)
            return td_error(TD_ERR_NO_MEMORY, "%s: no memory for a request's listener", w->id);
        w->listeners = l;
        w->cap_listeners = nc;
    }
    w->listeners[w->n_listeners++] = (listener_t){id, fn, ctx};
    return TD_OK;
}

void eng_worker_unlisten(eng_worker_t *w, uint64_t id)
{
    assert(on_engine_thread(w));
    for (size_t i = 0; i < w->n_listeners; i++)
        if (w->listeners[i].id == id) {
            w->listeners[i] = w->listeners[--w->n_listeners];
            return;
        }
}

static void hold_event(void *ctx, const eng_event_t *ev)
{
    eng_worker_t *w = ctx;
    if (!td_grow((void **)&w->held, &w->cap_held, w->n_held + 1, sizeof *w->held, 64)) {
        TD_WARN("%s: no memory to hold an event of request %llu; it is lost", w->id, (unsigned long long)ev->id);
        return;
    }
    held_event_t *h = &w->held[w->n_held++];
    h->ev = *ev;
    h->ev.text_len = 0;
    h->text_off = w->held_text_len;
    if (td_grow((void **)&w->held_text, &w->held_text_cap, w->held_text_len + ev->text_len + 1, 1, 4096)) {
        memcpy(w->held_text + w->held_text_len, ev->text, ev->text_len);
        w->held_text[w->held_text_len + ev->text_len] = 0;
        w->held_text_len += ev->text_len + 1;
        h->ev.text_len = ev->text_len;
    }
    h->error = ev->error ? strdup(ev->error) : NULL;
    h->ev.error = ev->error ? (h->error ? h->error : "an engine step failed") : NULL;
    if (ev->logprobs)
        h->lp = *ev->logprobs;
    h->plp = NULL;
    if (ev->n_prompt_logprobs && (h->plp = malloc(ev->n_prompt_logprobs * sizeof *h->plp)))
        memcpy(h->plp, ev->prompt_logprobs, ev->n_prompt_logprobs * sizeof *h->plp);
    else
        h->ev.n_prompt_logprobs = 0; /* none, or no memory for them */
    h->ev.prompt_logprobs = NULL; /* pointers into w->held are set as it is delivered (it may move as it grows) */
}

static void deliver_events(eng_worker_t *w)
{
    for (size_t i = 0; i < w->n_held; i++) {
        held_event_t *h = &w->held[i];
        h->ev.text = h->ev.text_len ? w->held_text + h->text_off : "";
        if (h->ev.logprobs)
            h->ev.logprobs = &h->lp;
        h->ev.prompt_logprobs = h->plp;
        for (size_t k = 0; k < w->n_listeners; k++)
            if (w->listeners[k].id == h->ev.id) {
                listener_t l = w->listeners[k];
                if (h->ev.finish != ENG_FINISH_NONE)
                    w->listeners[k] = w->listeners[--w->n_listeners];
                l.fn(l.ctx, &h->ev);
                break;
            }
        free(h->error);
        free(h->plp);
    }
    w->n_held = 0;
    w->held_text_len = 0;
}

/* ------------------------------------------------------------ the KV store
 * Every full block the pool names is offered to the store write-behind:
 * collected from the pool's events during a step, looked up again (a
 * reference each, so the block stays until written) and queued for the
 * client's writers after the step's events are delivered, so it never
 * delays a token. A prefill worker's prompt blocks, a decode worker's
 * answer blocks (a conversation's next turn finds them) and hence every
 * block the pool evicts later went to the store once; the store drops what
 * it has already (kvstore/client.h). Blocks the pool took from the store
 * are named quietly (eng_worker_kv_adopt).
 *
 * A pool in device memory (a GPU worker) is not read by the writers: each
 * batch's blocks are copied into the batch's own page-locked host staging
 * (eng_engine_kv_download) before it is queued, and the writers put from
 * there. Staging is bounded: PUB_STAGED_MAX batches of at most
 * PUB_STAGE_BYTES each (1 GiB: two 1k-token prompts of a 7B model); while
 * all are in flight, further blocks are counted unpublished like those of a
 * full queue. */
#define PUB_BATCH 64u
#define PUB_STAGED_MAX 32u
#define PUB_STAGE_BYTES (32u << 20)

typedef struct pub_batch {
    eng_worker_t *w;
    uint32_t n, stored;
    int32_t blocks[PUB_BATCH];
    td_block_name_t names[PUB_BATCH];
    const void *src[PUB_BATCH];
    uint8_t *stage;         /* a device pool's: the blocks' bytes, back to back (host, page-locked) */
    struct pub_batch *next; /* on w->pub_free */
} pub_batch_t;

static void pub_batch_free(eng_worker_t *w, pub_batch_t *b)
{
    if (b->stage)
        eng_engine_host_free(w->engine, b->stage);
    free(b);
}

/* Engine thread: a batch at rest, or a new one (NULL when none can be had). */
static pub_batch_t *pub_take(eng_worker_t *w, size_t block_bytes)
{
    pub_batch_t *b = w->pub_free;
    if (b) {
        w->pub_free = b->next;
        return b;
    }
    if (w->pub_staged && w->pub_batches >= PUB_STAGED_MAX)
        return NULL; /* every staging batch is in flight */
    if (!(b = calloc(1, sizeof *b)))
        return NULL;
    if (w->pub_staged && eng_engine_host_alloc(w->engine, w->pub_batch_n * block_bytes, (void **)&b->stage)) {
        TD_WARN("%s: no host staging for publishing blocks to the KV store: %s", w->id, td_last_error());
        free(b);
        return NULL;
    }
    w->pub_batches++;
    return b;
}

static void on_pool_event(void *ctx, const eng_kv_event_t *ev)
{
    eng_worker_t *w = ctx;
    pthread_mutex_lock(&w->ev_mu);
    td_kv_events_add(&w->ev, ev->kind == ENG_KV_STORED ? TANDEM__INTERNAL__V1__KV_EVENT__KIND__KV_EVENT_STORED
                                                       : TANDEM__INTERNAL__V1__KV_EVENT__KIND__KV_EVENT_REMOVED,
                     ev->name, 0);
    pthread_mutex_unlock(&w->ev_mu);
    if (!w->store || ev->kind != ENG_KV_STORED || w->pub_quiet)
        return;
    if (w->pub_n < w->pub_cap)
        w->pub_names[w->pub_n++] = ev->name;
    else
        w->pub_unpublished++;
}

/* Engine thread: the batch's blocks are let go, the batch kept for reuse. */
static void pub_release(eng_worker_t *w, pub_batch_t *b)
{
    eng_kv_pool_t *pool = eng_engine_kv_pool(w->engine);
    for (uint32_t i = 0; i < b->n; i++)
        eng_kv_unref(pool, b->blocks[i]);
    w->pub_new += b->stored;
    b->next = w->pub_free;
    w->pub_free = b;
}

static void pub_release_on_engine(eng_worker_t *w, void *arg) { pub_release(w, arg); }

/* A writer thread: the batch is written (or failed). A worker that is
 * stopping refuses the call (its pool goes with it): the batch is freed; on
 * a timeout the queued closure still runs with it. */
static void pub_done(void *ctx, uint32_t stored)
{
    pub_batch_t *b = ctx;
    b->stored = stored;
    td_status_t rc = eng_worker_call(b->w, pub_release_on_engine, b, 60);
    if (rc == TD_ERR_UNAVAILABLE)
        pub_batch_free(b->w, b);
    else if (rc == TD_ERR_NO_MEMORY)
        TD_WARN("%s: %u published blocks stay held (no memory to release them)", b->w->id, b->n);
}

static void store_flush(eng_worker_t *w)
{
    eng_kv_pool_t *pool = eng_engine_kv_pool(w->engine);
    size_t bb;
    uint8_t *base = eng_engine_kv_base(w->engine, &bb);
    for (uint32_t i = 0; i < w->pub_n;) {
        pub_batch_t *b = pub_take(w, bb);
        if (!b) {
            w->pub_unpublished += w->pub_n - i;
            break;
        }
        b->w = w;
        b->n = b->stored = 0;
        for (; i < w->pub_n && b->n < w->pub_batch_n; i++) {
            int32_t blk = eng_kv_lookup(pool, w->pub_names[i]);
            if (blk < 0) /* named and evicted within the step */
                continue;
            b->blocks[b->n] = blk;
            b->names[b->n] = w->pub_names[i];
            b->src[b->n] = b->stage ? b->stage + (size_t)b->n * bb : base + (size_t)blk * bb;
            b->n++;
        }
        double t0 = b->stage ? td_now_s() : 0;
        if (b->n && b->stage && eng_engine_kv_download(w->engine, b->blocks, b->n, b->stage)) {
            TD_WARN("%s: copying %u blocks out of the pool for the KV store: %s", w->id, b->n, td_last_error());
            w->pub_unpublished += b->n;
            pub_release(w, b);
            continue;
        }
        if (b->stage) {
            w->pub_staged_s += td_now_s() - t0;
            w->pub_staged_blocks += b->n;
        }
        if (b->n && !kv_client_put_async(w->store, b->names, b->src, b->n, pub_done, b)) {
            w->pub_offered += b->n;
            continue;
        }
        w->pub_unpublished += b->n; /* the writers' queue is full */
        pub_release(w, b);
    }
    w->pub_n = 0;
}

kv_client_t *eng_worker_store(eng_worker_t *w) { return w->store; }

int32_t eng_worker_kv_adopt(eng_worker_t *w, int32_t block, td_block_name_t name)
{
    w->pub_quiet = true;
    int32_t got = eng_kv_publish(eng_engine_kv_pool(w->engine), block, name);
    w->pub_quiet = false;
    return got;
}

/* Before serving: the store's client, if the config uses one (a store that
 * cannot be reached is a warning: prefixes stay in this pool). */
static void store_open(eng_worker_t *w)
{
    if (!w->cfg.kvstore.use)
        return;
    kv_client_config_t kc = {.etcd_endpoints = w->cfg.etcd.endpoints, .tls = w->tls, .contract = w->contract,
                             .xfer = {.peer_errors = w->cfg.transport.peer_errors,
                                      .interfaces = w->cfg.transport.interfaces},
                             .near_node = w->cfg.kvstore.near};
    eng_kv_pool_t *pool = eng_engine_kv_pool(w->engine);
    w->pub_cap = eng_kv_stats(pool).n_blocks;
    w->pub_staged = !eng_engine_kv_on_host(w->engine);
    w->pub_batch_n = PUB_BATCH;
    if (w->pub_staged) {
        size_t bb;
        eng_engine_kv_base(w->engine, &bb);
        w->pub_batch_n = PUB_STAGE_BYTES / bb < 1           ? 1
                         : PUB_STAGE_BYTES / bb < PUB_BATCH ? PUB_STAGE_BYTES / bb
                                                            : PUB_BATCH;
    }
    if (!(w->pub_names = malloc(w->pub_cap * sizeof *w->pub_names)) || kv_client_create(&kc, &w->store)) {
        TD_WARN("%s: no KV store (%s): prefixes are cached in this pool only", w->id,
                w->pub_names ? td_last_error() : "no memory");
        w->store = NULL;
    }
}

/* At exit, the engine thread stopped: the writers finish (their releases are
 * refused now), then the batches go. */
static void store_close(eng_worker_t *w)
{
    if (w->store && w->pub_staged)
        TD_INFO("%s: %llu blocks copied out of the pool for the KV store; the engine thread spent %.1f ms on it",
                w->id, (unsigned long long)w->pub_staged_blocks, w->pub_staged_s * 1e3);
    kv_client_destroy(w->store);
    w->store = NULL;
    while (w->pub_free) {
        pub_batch_t *b = w->pub_free;
        w->pub_free = b->next;
        pub_batch_free(w, b);
    }
    free(w->pub_names);
    w->pub_names = NULL;
}

static void closure_put(eng_worker_t *w, closure_t *c)
{
    if (--c->refs == 0)
        free(c);
    (void)w;
}

static void *engine_thread(void *arg)
{
    eng_worker_t *w = arg;
    char last_err[256] = "";
    double last_err_t = 0;
    unsigned repeats = 0;
    for (;;) {
        pthread_mutex_lock(&w->mu);
        closure_t *q = w->queue;
        w->queue = NULL;
        w->queue_tail = &w->queue;
        bool stop = w->stop;
        pthread_mutex_unlock(&w->mu);
        for (closure_t *c = q, *nx; c; c = nx) {
            nx = c->next;
            c->fn(w, c->arg);
            pthread_mutex_lock(&w->mu);
            c->done = true;
            void (*drop)(void *) = c->abandoned ? c->drop : NULL;
            void *carg = c->arg;
            closure_put(w, c);
            pthread_cond_broadcast(&w->cv);
            pthread_mutex_unlock(&w->mu);
            if (drop) /* its caller gave up waiting: arg is the closure's to free */
                drop(carg);
        }
        if (stop)
            break;
        if (w->role->before_step)
            w->role->before_step(w, w->role->ctx);
        if (eng_engine_busy(w->engine)) {
            td_status_t rc = eng_engine_step(w->engine, hold_event, w);
            if (rc) { /* the same failure every step is said once every 5 s, with its count */
                const char *e = td_last_error();
                double t = td_now_s();
                if (strncmp(e, last_err, sizeof last_err - 1) || t - last_err_t >= 5) {
                    if (repeats)
                        TD_WARN("%s: an engine step failed: %s (%u more times since the last report)", w->id, e,
                                repeats);
                    else
                        TD_WARN("%s: an engine step failed: %s", w->id, e);
                    snprintf(last_err, sizeof last_err, "%s", e);
                    last_err_t = t;
                    repeats = 0;
                } else {
                    repeats++;
                }
            }
            if (w->role->after_step)
                w->role->after_step(w, w->role->ctx);
            deliver_events(w);
            if (w->pub_n)
                store_flush(w);
            if (eng_engine_stalled(w->engine)) { /* waiting for blocks: not a spin; a closure wakes it */
                pthread_mutex_lock(&w->mu);
                if (!w->queue && !w->stop) {
                    struct timespec until = td_wall_deadline(0.002);
                    pthread_cond_timedwait(&w->cv, &w->mu, &until);
                }
                pthread_mutex_unlock(&w->mu);
            }
            continue;
        }
        pthread_mutex_lock(&w->mu);
        if (!w->queue && !w->stop) {
            struct timespec until = td_wall_deadline(0.05);
            pthread_cond_timedwait(&w->cv, &w->mu, &until);
        }
        pthread_mutex_unlock(&w->mu);
    }
    return NULL;
}

td_status_t eng_worker_call(eng_worker_t *w, void (*fn)(eng_worker_t *w, void *arg), void *arg, double timeout_s)
{
    return eng_worker_call_or_drop(w, fn, arg, NULL, timeout_s);
}

td_status_t eng_worker_call_or_drop(eng_worker_t *w, void (*fn)(eng_worker_t *w, void *arg), void *arg,
                                    void (*drop)(void *arg), double timeout_s)
{
    closure_t *c = calloc(1, sizeof *c);
    if (!c)
        return td_error(TD_ERR_NO_MEMORY, "worker: no memory");
    c->fn = fn;
    c->arg = arg;
    c->drop = drop;
    c->refs = 2;
    struct timespec until = td_wall_deadline(timeout_s);
    pthread_mutex_lock(&w->mu);
    if (w->stop) {
        pthread_mutex_unlock(&w->mu);
        free(c);
        return td_error(TD_ERR_UNAVAILABLE, "%s is stopping", w->id);
    }
    *w->queue_tail = c;
    w->queue_tail = &c->next;
    pthread_cond_broadcast(&w->cv);
    int e = 0;
    while (!c->done && e != ETIMEDOUT)
        e = pthread_cond_timedwait(&w->cv, &w->mu, &until);
    bool done = c->done;
    c->abandoned = !done; /* the engine thread drops arg once fn has run */
    closure_put(w, c);
    pthread_mutex_unlock(&w->mu);
    return done ? TD_OK : td_error(TD_ERR_TIMEOUT, "%s: the engine did not answer in %.1f s", w->id, timeout_s);
}

/* ---------------------------------------------------------- stats, etcd */

typedef struct stats_call {
    Tandem__Internal__V1__StatsResponse r;
    Tandem__Internal__V1__KvContract c;
} stats_call_t;

static void stats_on_engine(eng_worker_t *w, void *arg)
{
    stats_call_t *s = arg;
    eng_kv_stats_t k = eng_engine_kv_stats(w->engine);
    s->r.has_kv_blocks = s->r.has_kv_in_use = s->r.has_kv_cached = s->r.has_running = 1;
    s->r.kv_blocks = k.n_blocks;
    s->r.kv_in_use = k.in_use;
    s->r.kv_cached = k.cached;
    s->r.running = eng_engine_n_requests(w->engine);
    s->r.has_preemptions = s->r.has_prompt_tokens_computed = 1;
    s->r.preemptions = eng_engine_preemptions(w->engine);
    s->r.prompt_tokens_computed = eng_engine_prompt_computed(w->engine);
    s->r.has_swapped_out = s->r.has_swapped_in = 1;
    eng_engine_swaps(w->engine, &s->r.swapped_out, &s->r.swapped_in);
    if (w->store) {
        s->r.has_store_offered = s->r.has_store_new = s->r.has_store_unpublished = 1;
        s->r.store_offered = w->pub_offered;
        s->r.store_new = w->pub_new;
        s->r.store_unpublished = w->pub_unpublished;
    }
    if (w->role->stats)
        w->role->stats(w, w->role->ctx, &s->r);
}

static void h_stats(void *ctx, td_rpc_call_t *call)
{
    eng_worker_t *w = ctx;
    stats_call_t *s = calloc(1, sizeof *s);
    if (!s) {
        td_rpc_call_finish(call, TD_RPC_RESOURCE_EXHAUSTED, "no memory");
        return;
    }
    tandem__internal__v1__stats_response__init(&s->r);
    if (eng_worker_call_or_drop(w, stats_on_engine, s, free, 5)) {
        td_rpc_call_finish(call, TD_RPC_UNAVAILABLE, "%s", td_last_error());
        return; /* s is the queued closure's now */
    }
    s->r.id = w->id;
    s->r.role = (char *)w->role->name;
    td_kv_layout_to_pb(&w->contract, &s->c);
    s->r.contract = &s->c;
    size_t n = tandem__internal__v1__stats_response__get_packed_size(&s->r);
    uint8_t *buf = malloc(n ? n : 1);
    if (buf) {
        tandem__internal__v1__stats_response__pack(&s->r, buf);
        td_rpc_call_reply(call, buf, n);
    } else {
        td_rpc_call_finish(call, TD_RPC_RESOURCE_EXHAUSTED, "no memory");
    }
    free(buf);
    free(s);
}

/* Before each scrape: the Stats answer as Prometheus series. */
static void metrics_collect(void *ctx, td_metrics_t *m)
{
    eng_worker_t *w = ctx;
    stats_call_t *s = calloc(1, sizeof *s);
    if (!s)
        return;
    tandem__internal__v1__stats_response__init(&s->r);
    if (eng_worker_call_or_drop(w, stats_on_engine, s, free, 2)) {
        TD_WARN("%s: metrics: %s", w->id, td_last_error());
        return; /* s is the queued closure's now */
    }
    const Tandem__Internal__V1__StatsResponse *r = &s->r;
    char l[64];
    struct {
        td_metric_kind_t kind;
        const char *name, *help, *label;
        double v;
        bool has;
    } rows[] = {
        {TD_GAUGE, "tandem:num_requests_running", "Requests in the engine (prefilling or decoding).", NULL,
         r->running, r->has_running},
        {TD_GAUGE, "tandem:num_requests_waiting", "Reservations made for requests not yet started.", NULL,
         r->reservations, r->has_reservations},
        {TD_GAUGE, "tandem:kv_cache_usage_perc", "Fraction of the KV pool's blocks in use (0 to 1).", NULL,
         r->kv_blocks ? (double)r->kv_in_use / r->kv_blocks : 0, r->has_kv_blocks},
        {TD_GAUGE, "tandem:kv_cache_blocks", "Blocks of the KV pool.", "total", r->kv_blocks, r->has_kv_blocks},
        {TD_GAUGE, "tandem:kv_cache_blocks", "Blocks of the KV pool.", "in_use", r->kv_in_use, r->has_kv_in_use},
        {TD_GAUGE, "tandem:kv_cache_blocks", "Blocks of the KV pool.", "cached", r->kv_cached, r->has_kv_cached},
        {TD_COUNTER, "tandem:num_preemptions_total", "Sequences whose KV was dropped for room and recomputed.", NULL,
         (double)r->preemptions, r->has_preemptions},
        {TD_COUNTER, "tandem:prompt_tokens_computed_total", "Prompt tokens the engine ran (not from a cache).", NULL,
         (double)r->prompt_tokens_computed, r->has_prompt_tokens_computed},
        {TD_COUNTER, "tandem:kv_swaps_total", "Preempted sequences' KV moved to host memory (out) and back (in).",
         "out", (double)r->swapped_out, r->has_swapped_out},
        {TD_COUNTER, "tandem:kv_swaps_total", "Preempted sequences' KV moved to host memory (out) and back (in).",
         "in", (double)r->swapped_in, r->has_swapped_in},
        {TD_COUNTER, "tandem:kv_transfer_bytes_total", "KV bytes this prefill worker put into decode pools.", NULL,
         (double)r->transfer_bytes, r->has_transfer_bytes},
        {TD_COUNTER, "tandem:kv_transfer_seconds_total", "Time the KV puts took.", NULL, r->transfer_ms * 1e-3,
         r->has_transfer_ms},
        {TD_COUNTER, "tandem:kv_transfer_exposed_seconds_total", "Time the KV puts added to prefill (not hidden).",
         NULL, r->exposed_transfer_ms * 1e-3, r->has_exposed_transfer_ms},
        {TD_COUNTER, "tandem:store_blocks_offered_total", "Full blocks handed to the kvstore's writers.", NULL,
         (double)r->store_offered, r->has_store_offered},
        {TD_COUNTER, "tandem:store_blocks_new_total", "Blocks the kvstore took as new.", NULL, (double)r->store_new,
         r->has_store_new},
    };
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++)
        if (rows[i].has)
            td_metric_set(td_metrics_series(m, rows[i].kind, rows[i].name, rows[i].help,
                                            rows[i].label ? td_metrics_label(l, sizeof l, "state", rows[i].label) : NULL,
                                            NULL, 0),
                          rows[i].v);
    free(s);
}

/* ---------------------------------------------------------- pool events */

static void h_events(void *ctx, td_rpc_call_t *call)
{
    eng_worker_t *w = ctx;
    td_kv_events_serve(call, &w->ev, &w->ev_mu, w->id);
}

/* A page of the pool's names: those from the cursor-th on, at most max. */
typedef struct snap_call {
    uint32_t cursor, max, seen, n;
    uint64_t epoch, seq;
    Tandem__Internal__V1__BlockName *names, **np;
} snap_call_t;

static void snap_add(void *ctx, td_block_name_t name, int32_t block)
{
    (void)block;
    snap_call_t *s = ctx;
    if (s->seen++ < s->cursor || s->n == s->max)
        return;
    Tandem__Internal__V1__BlockName *b = &s->names[s->n];
    tandem__internal__v1__block_name__init(b);
    b->has_lo = b->has_hi = 1;
    b->lo = name.lo;
    b->hi = name.hi;
    s->np[s->n++] = b;
}

static void snap_on_engine(eng_worker_t *w, void *arg)
{
    snap_call_t *s = arg;
    eng_kv_snapshot(eng_engine_kv_pool(w->engine), snap_add, s);
    pthread_mutex_lock(&w->ev_mu); /* every event up to here is in the snapshot (this thread raises them) */
    s->epoch = w->ev.epoch;
    s->seq = w->ev.seq;
    pthread_mutex_unlock(&w->ev_mu);
}

static void snap_free(void *arg)
{
    snap_call_t *s = arg;
    free(s->names);
    free(s->np);
    free(s);
}

static void h_snapshot(void *ctx, td_rpc_call_t *call)
{
    eng_worker_t *w = ctx;
    Tandem__Internal__V1__KvSnapshotRequest *rq = (Tandem__Internal__V1__KvSnapshotRequest *)td_rpc_request_pb(
        call, &tandem__internal__v1__kv_snapshot_request__descriptor);
    if (!rq)
        return;
    uint32_t blocks = w->ev.cap; /* the pool's block count (the ring holds as many events) */
    snap_call_t *s = calloc(1, sizeof *s);
    if (s) {
        s->cursor = rq->cursor;
        s->max = rq->max_names && rq->max_names < blocks ? rq->max_names : blocks;
        s->names = malloc((s->max ? s->max : 1) * sizeof *s->names);
        s->np = malloc((s->max ? s->max : 1) * sizeof *s->np);
    }
    tandem__internal__v1__kv_snapshot_request__free_unpacked(rq, NULL);
    if (!s || !s->names || !s->np) {
        if (s)
            snap_free(s);
        td_rpc_call_finish(call, TD_RPC_RESOURCE_EXHAUSTED, "%s: no memory for a snapshot page", w->id);
        return;
    }
    if (eng_worker_call_or_drop(w, snap_on_engine, s, snap_free, 5)) {
        td_rpc_call_finish(call, TD_RPC_UNAVAILABLE, "%s", td_last_error());
        return; /* s is the queued closure's now */
    }
    Tandem__Internal__V1__KvSnapshotResponse r = TANDEM__INTERNAL__V1__KV_SNAPSHOT_RESPONSE__INIT;
    r.has_epoch = r.has_seq = r.has_next_cursor = 1;
    r.epoch = s->epoch;
    r.seq = s->seq;
    r.next_cursor = s->seen > s->cursor + s->n ? s->cursor + s->n : 0;
    r.n_names = s->n;
    r.names = s->np;
    td_rpc_reply_pb(call, &r.base);
    snap_free(s);
}

/* The start-up profile (worker/profile_store.h), before anything else uses
 * the engine. A pool too small for the sweep, or a failed one, leaves the
 * worker without a profile (the router then learns its speed from what it
 * serves). */
static void profile(eng_worker_t *w)
{
    eng_kv_stats_t k = eng_engine_kv_stats(w->engine);
    uint32_t pool_tokens = k.n_blocks * w->contract.block_tokens;
    if (!w->rc->profile)
        return;
    if (pool_tokens < 2048) {
        TD_INFO("%s: no start-up profile (its KV pool holds %u tokens; the sweep needs 2048)", w->id, pool_tokens);
        return;
    }
    char host[64] = "", key[512], how[1100];
    gethostname(host, sizeof host - 1);
    /* the weights' bytes tell one quantization of a model from another; the device, a GPU's speed from a CPU's;
     * the ranks, a split worker from a whole one (CPU ranks name one device) */
    char tp[16] = "";
    if (w->rc->tp > 1)
        snprintf(tp, sizeof tp, "-tp%u", w->rc->tp);
    snprintf(key, sizeof key, "/tandem/profiles/%s/%s/%s-w%llu/%s-%s-%s-t%u-b%u%s", host, w->role->name,
             w->contract.model_id, (unsigned long long)w->model->desc.weight_bytes, w->rc->device ? w->rc->device : "cpu",
             td_kv_dtype_name(w->contract.dtype), w->cfg.model.numerics, w->rc->threads, w->rc->token_budget, tp);
    int32_t vocab = (int32_t)w->model->desc.vocab;
    if (wk_profile_get(w->id, key, w->cfg.etcd.endpoints, w->tls, w->engine, vocab > 1000 ? 100 : 0,
                       vocab > 1000 ? vocab - 100 : vocab, &w->profile, how, sizeof how)) {
        TD_WARN("%s: the start-up profile failed (%s); the router learns this worker's speed online", w->id,
                td_last_error());
        return;
    }
    w->has_profile = true;
    const eng_profile_t *p = &w->profile;
    TD_INFO("%s: profile %s (%.2f s sweep): prefill_ms = %.3g + %.3g*new + %.3g*new*(cached+new/2); step_ms = %.3g "
            "+ %.3g*batch + %.3g*batch*ctx", w->id, how, p->sweep_s, p->prefill[0], p->prefill[1], p->prefill[2],
            p->decode[0], p->decode[1], p->decode[2]);
}

/* This worker's etcd record (/tandem/workers/ROLE/ID): where it serves, its
 * KV contract and pool, its profile. */
static td_status_t record(eng_worker_t *w, char *key, size_t key_len, char **value)
{
    json_t *j = json_pack("{s:s, s:s, s:s, s:s, s:i, s:o, s:I, s:I}", "id", w->id, "role", w->role->name, "addr",
                          w->advertise, "metrics", w->metrics_at, "pid", (int)getpid(), "contract",
                          td_kv_layout_to_json(&w->contract), "kv_blocks",
                          (json_int_t)eng_engine_kv_stats(w->engine).n_blocks, "token_budget",
                          (json_int_t)w->rc->token_budget);
    if (j && w->has_profile)
        json_object_set_new(j, "profile", eng_profile_to_json(&w->profile));
    if (j && w->rc->colocated)
        json_object_set_new(j, "colocated", json_true());
    char devices[400];
    eng_engine_device_ids(w->engine, devices, sizeof devices);
    if (j && devices[0]) /* the router prices a prefill on a device a decode worker shares as a stall of it */
        json_object_set_new(j, "devices", json_string(devices));
    if (j) /* the router predicts queueing by the order the engine runs */
        json_object_set_new(j, "queue", json_pack("{s:s, s:i, s:i}", "order", w->rc->queue, "levels",
                                                  (json_int_t)w->rc->queue_levels, "quantum",
                                                  (json_int_t)w->rc->queue_quantum));
    *value = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
    snprintf(key, key_len, "/tandem/workers/%s/%s", w->role->name, w->id);
    return *value ? TD_OK : td_error(TD_ERR_NO_MEMORY, "%s: no memory for its etcd record", w->id);
}

/* ---------------------------------------------------------- main */

static const char usage_fmt[] =
    "usage: tandem-%s [--config FILE] [--listen HOST:PORT] [--id ID] [FLAG VALUE]...\n"
    "  --listen and --id name this one process; every other flag sets the config key it stands beside below\n"
    "  (docs/configuration.md; the role's keys are those of its section), over the file\n";

/* configured (common/service.h): the role's settings, the transport's. */
static td_status_t configured(void *ctx)
{
    eng_worker_t *w = ctx;
    w->rc = !strcmp(w->role->name, "prefill") ? &w->cfg.prefill : &w->cfg.decode;
    w->xfer_cfg.peer_errors = w->cfg.transport.peer_errors;
    w->xfer_cfg.interfaces = w->cfg.transport.interfaces;
    char one[32];
    unsigned nd = td_device_pick(w->rc->device, 0, one, sizeof one); /* validated */
    const uint32_t tp = w->rc->tp > 1 ? w->rc->tp : 1;
    if (nd != 1 && nd != tp)
        return td_error(TD_ERR_CONFIG, "%s.device = '%s' lists %u devices; a worker runs on one, or on one a rank "
                        "(%s.tp = %u; tandem up hands them out to the workers in turn; --device picks them)",
                        w->role->name, w->rc->device, nd, w->role->name, tp);
    td_device_parse(one, &w->xfer_cfg.device); /* a worker of ranks on GPUs: its transport on the first rank's */
    w->xfer_cfg.target = !strcmp(w->role->name, "decode"); /* peers put into a decode worker's pool */
    return TD_OK;
}

td_status_t eng_worker_kv_landed(eng_worker_t *w, const int32_t *blocks, uint32_t n)
{
    if (!w->xo->landed)
        return TD_OK;
    size_t bb;
    eng_engine_kv_base(w->engine, &bb);
    uint64_t offs[64];
    for (uint32_t i = 0; i < n; i += 64) {
        uint32_t k = n - i < 64 ? n - i : 64;
        for (uint32_t j = 0; j < k; j++)
            offs[j] = (uint64_t)blocks[i + j] * bb;
        td_status_t rc = w->xo->landed(w->xfer, w->regions[0].mem, offs, k, bb); /* one region (worker_start) */
        if (rc)
            return rc;
    }
    return TD_OK;
}

const td_config_t *eng_worker_config(const eng_worker_t *w) { return &w->cfg; }
const td_rpc_tls_t *eng_worker_tls(const eng_worker_t *w) { return w->tls; }
void *eng_worker_role_ctx(eng_worker_t *w) { return w->role->ctx; }

/* The GPU of rank r (-1: the CPU): the r-th entry of the role's device list, or its one entry for every rank. */
static int rank_gpu(const eng_worker_t *w, uint32_t r)
{
    char one[32];
    int gpu = -1;
    td_device_pick(w->rc->device, r, one, sizeof one); /* validated: one entry, or one a rank (r mod count) */
    td_device_parse(one, &gpu);
    return gpu;
}

/* The KV pool's memory provider: a region the transport maps, so that peers
 * can put KV into it (its remote key is taken here); a pool of parts asks
 * for one a rank, in rank order, each on its rank's device. */
static td_status_t pool_mem_alloc(void *ctx, size_t bytes, void **mem)
{
    eng_worker_t *w = ctx;
    if (w->n_regions == ENG_TP_MAX)
        return td_error(TD_ERR_INTERNAL, "%s: more than %d pool regions", w->id, ENG_TP_MAX);
    struct pool_region *r = &w->regions[w->n_regions];
    const int gpu = rank_gpu(w, w->n_regions);
    td_status_t rc;
    if (gpu == w->xfer_cfg.device)
        rc = w->xo->mem_alloc(w->xfer, bytes, &r->base, &r->mem);
    else if (w->xo->mem_alloc_on)
        rc = w->xo->mem_alloc_on(w->xfer, gpu, bytes, &r->base, &r->mem);
    else
        rc = td_error(TD_ERR_CONFIG, "%s: rank %u's KV part on cuda:%d: the %s transport maps cuda:%d's memory alone",
                      w->id, w->n_regions, gpu, w->xo->name, w->xfer_cfg.device);
    if (!rc && (rc = w->xo->mem_rkey(w->xfer, r->mem, &r->rkey, &r->rkey_len))) {
        w->xo->mem_free(w->xfer, r->mem);
        r->mem = NULL;
    }
    if (rc)
        return rc;
    r->bytes = bytes;
    w->pool_bytes += bytes;
    w->n_regions++;
    *mem = r->base;
    return TD_OK;
}

static void pool_mem_free(void *ctx, void *mem)
{
    eng_worker_t *w = ctx;
    for (uint32_t i = 0; i < w->n_regions; i++)
        if (w->regions[i].mem && w->regions[i].base == mem) {
            w->xo->mem_free(w->xfer, w->regions[i].mem);
            w->regions[i].mem = NULL;
        }
}

/* start (common/service.h): the model and engine, the transport and pool,
 * the profile, the KV events, the RPCs and the role's, the engine thread,
 * the metrics. */
static td_status_t worker_start(void *ctx, char *key, size_t key_len, char **value)
{
    eng_worker_t *w = ctx;
    eng_worker_role_t *role = w->role;
    pthread_mutex_init(&w->mu, NULL);
    pthread_mutex_init(&w->ev_mu, NULL);
    pthread_cond_init(&w->cv, NULL);
    w->queue_tail = &w->queue;
    td_status_t rc;
    if ((rc = eng_model_open(w->cfg.model.path, &w->model)))
        return rc;
    eng_weight_hold_t hold = ENG_WEIGHTS_FILE;
    eng_weight_hold_parse(w->cfg.model.weights, &hold); /* validated */
    eng_model_set_hold(w->model, hold);
    eng_model_set_dummy(w->model, !strcmp(w->cfg.model.load_format, "dummy"));
    eng_engine_config_t ec = eng_engine_config_default();
    ec.n_threads = (int)w->rc->threads;
    ec.block_tokens = w->cfg.model.block_tokens;
    td_kv_dtype_parse(w->cfg.model.kv_dtype, &ec.kv_dtype);    /* validated */
    kern_numerics_parse(w->cfg.model.numerics, &ec.numerics); /* validated */
    ec.token_budget = w->rc->token_budget;
    ec.device = w->rc->device;
    eng_order_parse(w->rc->queue, &ec.sched.order); /* validated */
    ec.sched.levels = w->rc->queue_levels;
    ec.sched.quantum = w->rc->queue_quantum;
    ec.sched.age_s = w->rc->queue_age_ms / 1000.0;
    ec.swap_bytes = w->rc->swap_mib << 20;
    const char *kind = w->cfg.transport.kind;
    if (w->xfer_cfg.device < 0 && !strcmp(kind, "cuda_ipc"))
        return td_error(TD_ERR_CONFIG, "transport.kind = cuda_ipc is for GPU workers; this one's device is '%s'",
                        w->rc->device);
    /* the pool's memory is the transport's: host memory UCX maps, or device
     * memory CUDA IPC exports or UCX reaches through host staging */
    w->xo =
        w->xfer_cfg.device < 0 ? &kv_transport_ucx : kv_transport_find(strcmp(kind, "ucx") ? "cuda_ipc" : "ucx_staged");
    if (!w->xo)
        return td_error(TD_ERR_UNSUPPORTED, "device '%s': this build has no CUDA (configure with -DTANDEM_CUDA=ON "
                        "where the CUDA toolkit is installed)", w->rc->device);
    if ((rc = w->xo->create(&w->xfer_cfg, &w->xfer)))
        return rc;
    /* ranks on other GPUs: their parts are puts' sources (a prefill worker's) or gets' destinations */
    for (uint32_t r = 1; r < w->rc->tp; r++) {
        const int gpu = rank_gpu(w, r);
        if (gpu != w->xfer_cfg.device && w->xo->reach && (rc = w->xo->reach(w->xfer, gpu)))
            return rc;
    }
    ec.kv_bytes = w->rc->kv_mib << 20;
    ec.tp = w->rc->tp;
    /* the pool is the transport's memory, which peers put into: one region, or for a decode worker of
     * tensor-parallel ranks one a rank's part (peers put each piece's overlap with each part:
     * td_kv_part_overlap); a prefill worker's parts are its backends' (it puts from them, run by run:
     * eng_kv_layer_pieces) */
    if (ec.tp > 1 && !strcmp(role->name, "prefill"))
        w->pool_bytes = (size_t)w->rc->kv_mib << 20;
    else
        ec.kv_memory = (eng_kv_memory_t){.alloc = pool_mem_alloc, .free = pool_mem_free, .ctx = w};
    if ((rc = eng_engine_create(w->model, &ec, &w->engine)) ||
        (rc = w->xo->address(w->xfer, &w->ucx_addr, &w->ucx_addr_len)) || (rc = w->xo->progress_start(w->xfer)))
        return rc;
    w->contract = eng_engine_kv_contract(w->engine);
    for (uint32_t i = 0; i < w->n_regions; i++)
        eng_kv_part_heads(eng_engine_kv_pool(w->engine), i, &w->regions[i].head0, &w->regions[i].heads);
    profile(w);
    /* stopped while starting (the profile's sweep waits its turn on the host): the rest of the start calls etcd,
     * which may be gone with whoever stopped this one, each call up to its deadline */
    if (td_process_stop_signal())
        return td_error(TD_ERR_CANCELLED, "%s: stopped while starting", w->id);
    if ((rc = td_kv_events_init(&w->ev, eng_engine_kv_stats(w->engine).n_blocks * 4 + 1024, w->id)))
        return rc;
    eng_kv_set_listener(eng_engine_kv_pool(w->engine), on_pool_event, w);
    store_open(w);
    if ((rc = td_rpc_server_create(w->listen, w->tls, &w->server)))
        return rc;
    char method[128];
    snprintf(method, sizeof method, "/tandem.internal.v1.%s/Stats", !strcmp(role->name, "prefill") ? "Prefill" : "Decode");
    if ((rc = td_rpc_server_add(w->server, method, h_stats, w)) ||
        (rc = td_rpc_server_add(w->server, "/tandem.internal.v1.KvEvents/Events", h_events, w)) ||
        (rc = td_rpc_server_allow(w->server, "/tandem.internal.v1.KvEvents/Events", "router")) ||
        (rc = td_rpc_server_add(w->server, "/tandem.internal.v1.KvEvents/Snapshot", h_snapshot, w)) ||
        (rc = td_rpc_server_allow(w->server, "/tandem.internal.v1.KvEvents/Snapshot", "router")) ||
        (role->attach && (rc = role->attach(w, role->ctx))))
        return rc;
    w->attached = true;
    if (pthread_create(&w->thread, NULL, engine_thread, w))
        return td_error(TD_ERR_INTERNAL, "cannot start the engine thread");
    w->thread_up = true;
    if ((rc = td_metrics_create(w->model->desc.name, role->name, &w->metrics)))
        return rc;
    td_metrics_on_collect(w->metrics, metrics_collect, w);
    if ((rc = td_metrics_serve(w->metrics, &(td_metrics_endpoint_t){.listen = w->cfg.metrics.listen, .tls = w->tls},
                               &w->metrics_server, w->metrics_at, sizeof w->metrics_at)))
        return rc;
    int port;
    if ((rc = td_rpc_server_start(w->server, &port)))
        return rc;
    w->serving = true;
    td_rpc_advertise_addr(w->listen, port, w->advertise, sizeof w->advertise);
    char tp[24] = "";
    if (w->contract.tp > 1)
        snprintf(tp, sizeof tp, ", tp %u", w->contract.tp);
    TD_INFO("%s serving on %s (KV pool %zu MiB, %u blocks of %u tokens, %s%s; etcd %s; metrics %s)", w->id,
            w->advertise, w->pool_bytes >> 20, eng_engine_kv_stats(w->engine).n_blocks, w->contract.block_tokens,
            td_kv_dtype_name(w->contract.dtype), tp, w->cfg.etcd.endpoints, w->metrics_at[0] ? w->metrics_at : "none");
    return record(w, key, key_len, value);
}

/* drain (common/service.h): out of the membership already, the calls in
 * flight get 30 s to end. */
static void worker_drain(void *ctx)
{
    eng_worker_t *w = ctx;
    TD_INFO("%s: draining", w->id);
    td_rpc_server_stop(w->server, 30);
    w->serving = false;
}

/* stop (common/service.h): the server, the metrics, the engine thread, the
 * role, the store, the engine and transport, in that order; any part
 * start() did not make is skipped. */
static void worker_stop(void *ctx)
{
    eng_worker_t *w = ctx;
    if (w->serving) /* started, then not registered */
        td_rpc_server_stop(w->server, 30);
    td_metrics_server_stop(w->metrics_server); /* its scrapes ask the engine thread */
    w->metrics_server = NULL;
    if (w->thread_up) {
        pthread_mutex_lock(&w->mu);
        w->stop = true;
        pthread_cond_broadcast(&w->cv);
        pthread_mutex_unlock(&w->mu);
        pthread_join(w->thread, NULL);
    }
    td_rpc_server_destroy(w->server);
    if (w->attached && w->role->detach)
        w->role->detach(w, w->role->ctx);
    store_close(w);
    eng_engine_destroy(w->engine);
    if (w->xo && w->xfer)
        w->xo->destroy(w->xfer);
    free(w->ucx_addr);
    for (uint32_t i = 0; i < w->n_regions; i++)
        free(w->regions[i].rkey);
    eng_model_close(w->model);
    free(w->listeners);
    free(w->held);
    free(w->held_text);
    td_kv_events_free(&w->ev);
    td_metrics_destroy(w->metrics);
}

int eng_worker_main(int argc, char **argv, eng_worker_role_t *role)
{
    eng_worker_t *w = calloc(1, sizeof *w);
    if (!w)
        return 1;
    w->role = role;
    snprintf(w->listen, sizeof w->listen, "127.0.0.1:0");
    snprintf(w->id, sizeof w->id, "%s-%d", role->name, (int)getpid());
    char prog[32], usage[1024];
    snprintf(prog, sizeof prog, "tandem-%s", role->name);
    snprintf(usage, sizeof usage, usage_fmt, role->name);
    static const char *const own[] = {"--listen", "--id", NULL};
    td_listen_id_t li = {w->listen, w->id, sizeof w->listen, sizeof w->id};
    const td_service_t service = {.prog = prog, .section = role->name, .procs = TD_PROC_WORKER, .own = own,
                                  .own_fn = td_own_listen_id, .own_ctx = &li, .usage = usage, .cfg = &w->cfg,
                                  .tls_files = &w->tls_files, .tls = &w->tls, .ctx = w, .configured = configured,
                                  .start = worker_start, .drain = worker_drain, .stop = worker_stop};
    int code = td_service_main(&service, argc, argv);
    free(w);
    return code;
}
