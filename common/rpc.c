/* rpc.c — see rpc.h.
 *
 * How it works: every batch started on a call is tagged with an op_t, a
 * small record naming the call and what to do when the batch completes. A
 * few loop threads, each owning one completion queue, take completions and
 * run the op: it clears the op's "posted" bit and either runs the op's
 * callback (asynchronous use) or records the outcome and signals the call's
 * condition variable (a thread blocked in one of the waits below). A call is
 * bound to one queue, so all of its completions, and callbacks, come on one
 * thread, in order.
 *
 * A server call is reference counted: its owner (the handler, or whoever
 * holds a detached call) and every batch in flight hold one, so the record
 * outlives a completion that arrives after the owner let go. Client calls
 * are owned by their caller, who waits for their batches before freeing. */
#define _GNU_SOURCE
#include "common/rpc.h"

#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/slice.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>
#include <arpa/inet.h>
#include <errno.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/certs.h"
#include "common/clock.h"
#include "common/grow.h"
#include "common/log.h"
#include "common/pool.h"

#define MAX_METHODS 16
#define POSTED_PER_METHOD 8
#define MAX_MESSAGE (64 << 20)
#define MAX_LOOPS 4
#define DEFAULT_MAX_CALLS 4096
#define DEFAULT_THREADS 16
#define SCOPE_CALLS 8

typedef enum tag { TAG_SEND, TAG_RECV, TAG_STATUS, TAG_CLOSE, TAG_WAKE, TAG_FINISH, TAG_COUNT } tag_t;

/* A batch in flight: done(op, ok) runs on the loop thread. armed: bumped
 * (release) just before the batch starts and read (acquire) by the loop
 * thread, so that what the poster wrote is ordered before done() in the
 * memory model, and ThreadSanitizer sees it (the hand-off inside gRPC is
 * invisible to it). */
typedef struct op {
    void (*done)(struct op *op, bool ok);
    unsigned armed;
} op_t;

static inline op_t *op_arm(op_t *op)
{
    __atomic_fetch_add(&op->armed, 1, __ATOMIC_RELEASE);
    return op;
}

/* ------------------------------------------------------------------ loop */

/* The completion-queue threads: process-wide, like gRPC's own state, and
 * started and stopped with it (td_rpc_init / td_rpc_shutdown). */
static struct loop {
    pthread_mutex_t mu;
    int refs, n;
    unsigned next;
    grpc_completion_queue *cq[MAX_LOOPS];
    pthread_t thread[MAX_LOOPS];
} g_loop = {.mu = PTHREAD_MUTEX_INITIALIZER};

static __thread bool t_on_loop; /* this thread is a loop thread (callbacks must not block) */

static void *loop_thread(void *arg)
{
    grpc_completion_queue *cq = arg;
    t_on_loop = true;
    for (;;) {
        grpc_event ev = grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL);
        if (ev.type == GRPC_QUEUE_SHUTDOWN)
            break;
        if (ev.type == GRPC_OP_COMPLETE) {
            op_t *op = ev.tag;
            (void)__atomic_load_n(&op->armed, __ATOMIC_ACQUIRE);
            op->done(op, ev.success != 0);
        }
    }
    return NULL;
}

static grpc_completion_queue *loop_pick(void)
{
    unsigned i = __atomic_fetch_add(&g_loop.next, 1, __ATOMIC_RELAXED);
    return g_loop.cq[i % (unsigned)g_loop.n];
}

void td_rpc_init(void)
{
    pthread_mutex_lock(&g_loop.mu);
    if (g_loop.refs++ == 0) {
        grpc_init();
        long cpus = sysconf(_SC_NPROCESSORS_ONLN);
        int n = cpus > MAX_LOOPS ? MAX_LOOPS : cpus < 2 ? 2 : (int)cpus;
        g_loop.n = 0;
        for (int i = 0; i < n; i++) {
            g_loop.cq[i] = grpc_completion_queue_create_for_next(NULL);
            if (pthread_create(&g_loop.thread[i], NULL, loop_thread, g_loop.cq[i]) != 0) {
                grpc_completion_queue_shutdown(g_loop.cq[i]);
                grpc_completion_queue_destroy(g_loop.cq[i]);
                break;
            }
            g_loop.n++;
        }
        if (!g_loop.n)
            { td_log(TD_LOG_ERROR, "rpc: cannot start a completion-queue thread"); abort(); }
    }
    pthread_mutex_unlock(&g_loop.mu);
}

void td_rpc_shutdown(void)
{
    pthread_mutex_lock(&g_loop.mu);
    if (--g_loop.refs == 0) {
        for (int i = 0; i < g_loop.n; i++)
            grpc_completion_queue_shutdown(g_loop.cq[i]);
        for (int i = 0; i < g_loop.n; i++) {
            pthread_join(g_loop.thread[i], NULL);
            grpc_completion_queue_destroy(g_loop.cq[i]);
        }
        g_loop.n = 0;
        grpc_shutdown();
    }
    pthread_mutex_unlock(&g_loop.mu);
}

static gpr_timespec deadline_in(double s)
{
    if (!(s < 1e8))
        return gpr_inf_future(GPR_CLOCK_MONOTONIC);
    if (s < 0)
        s = 0;
    return gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_micros((int64_t)(s * 1e6), GPR_TIMESPAN));
}

/* ------------------------------------------------------------------ sync */

/* What a blocked thread waits on: bits per tag, under mu. */
typedef struct sync {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    unsigned posted, done, ok;
} sync_t;

static void sync_init(sync_t *s)
{
    pthread_mutex_init(&s->mu, NULL);
    pthread_condattr_t a;
    pthread_condattr_init(&a);
    pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
    pthread_cond_init(&s->cv, &a);
    pthread_condattr_destroy(&a);
    s->posted = s->done = s->ok = 0;
}

static void sync_destroy(sync_t *s)
{
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
}

/* s seconds from now on the clock the condition variables here wait on */
static struct timespec mono_in(double s) { return td_deadline_on(CLOCK_MONOTONIC, s); }

/* With mu held: waits for tag t to complete (consuming it). 1 it went
 * well, -1 it failed, 0 wait_s passed first. */
static int sync_wait_locked(sync_t *s, tag_t t, double wait_s)
{
    unsigned bit = 1u << t;
    struct timespec until = mono_in(wait_s);
    while (!(s->done & bit))
        if (pthread_cond_timedwait(&s->cv, &s->mu, &until) == ETIMEDOUT && !(s->done & bit))
            return 0;
    s->done &= ~bit;
    return (s->ok & bit) ? 1 : -1;
}

static int sync_wait(sync_t *s, tag_t t, double wait_s)
{
    pthread_mutex_lock(&s->mu);
    int r = sync_wait_locked(s, t, wait_s);
    pthread_mutex_unlock(&s->mu);
    return r;
}

/* With mu held: records tag t's outcome and wakes the waiters. */
static void sync_complete_locked(sync_t *s, tag_t t, bool ok)
{
    unsigned bit = 1u << t;
    s->posted &= ~bit;
    s->done |= bit;
    if (ok)
        s->ok |= bit;
    else
        s->ok &= ~bit;
    pthread_cond_broadcast(&s->cv);
}

/* With mu held: waits until no batch of tag t is in flight. */
static void sync_settle_locked(sync_t *s, tag_t t)
{
    while (s->posted & (1u << t))
        pthread_cond_wait(&s->cv, &s->mu);
}

/* The message into *buf (capacity *cap, grown when short: no allocation
 * once it is large enough); false without memory. */
static bool buffer_into(grpc_byte_buffer *bb, uint8_t **buf, size_t *cap, size_t *len)
{
    grpc_byte_buffer_reader r;
    if (!grpc_byte_buffer_reader_init(&r, bb))
        return false;
    bool ok = td_grow((void **)buf, cap, grpc_byte_buffer_length(bb), 1, 256);
    size_t off = 0;
    grpc_slice s;
    while (ok && grpc_byte_buffer_reader_next(&r, &s)) {
        size_t k = GRPC_SLICE_LENGTH(s);
        if ((ok = td_grow((void **)buf, cap, off + k, 1, 256)))
            memcpy(*buf + off, GRPC_SLICE_START_PTR(s), k);
        off += k;
        grpc_slice_unref(s);
    }
    grpc_byte_buffer_reader_destroy(&r);
    *len = off;
    return ok;
}

int td_rpc_code_of(td_status_t st)
{
    switch (st) {
    case TD_OK: return TD_RPC_OK;
    case TD_ERR_INVALID_ARG: case TD_ERR_FORMAT: case TD_ERR_OUT_OF_RANGE: return TD_RPC_INVALID_ARGUMENT;
    case TD_ERR_NOT_FOUND: return TD_RPC_NOT_FOUND;
    case TD_ERR_TIMEOUT: return TD_RPC_DEADLINE_EXCEEDED;
    case TD_ERR_CANCELLED: return TD_RPC_CANCELLED;
    case TD_ERR_UNAVAILABLE: return TD_RPC_UNAVAILABLE;
    case TD_ERR_EXHAUSTED: case TD_ERR_NO_MEMORY: return TD_RPC_RESOURCE_EXHAUSTED;
    case TD_ERR_UNSUPPORTED: return TD_RPC_UNIMPLEMENTED;
    case TD_ERR_CONFIG: return TD_RPC_FAILED_PRECONDITION;
    default: return TD_RPC_INTERNAL;
    }
}

td_status_t td_rpc_status_of(int code)
{
    switch (code) {
    case TD_RPC_OK: return TD_OK;
    case TD_RPC_INVALID_ARGUMENT: return TD_ERR_INVALID_ARG;
    case TD_RPC_NOT_FOUND: return TD_ERR_NOT_FOUND;
    case TD_RPC_DEADLINE_EXCEEDED: return TD_ERR_TIMEOUT;
    case TD_RPC_CANCELLED: return TD_ERR_CANCELLED;
    case TD_RPC_UNAVAILABLE: return TD_ERR_UNAVAILABLE;
    case TD_RPC_RESOURCE_EXHAUSTED: return TD_ERR_EXHAUSTED;
    case TD_RPC_UNIMPLEMENTED: return TD_ERR_UNSUPPORTED;
    case TD_RPC_FAILED_PRECONDITION: return TD_ERR_CONFIG;
    default: return TD_ERR_INTERNAL;
    }
}

const char *td_rpc_code_name(int code)
{
    static const char *const n[] = {"OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED",
                                    "NOT_FOUND", "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED",
                                    "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL",
                                    "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED"};
    return code >= 0 && code < 17 ? n[code] : "?";
}

static char *read_pem(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *s = n >= 0 ? malloc((size_t)n + 1) : NULL;
    if (s && fread(s, 1, (size_t)n, f) != (size_t)n) {
        free(s);
        s = NULL;
    }
    if (s)
        s[n] = '\0';
    fclose(f);
    return s;
}

void td_tls_pems_free(td_tls_pems_t *p)
{
    free(p->ca);
    free(p->cert);
    free(p->key);
    memset(p, 0, sizeof *p);
}

td_status_t td_tls_pems_load(const td_rpc_tls_t *tls, td_tls_pems_t *p)
{
    memset(p, 0, sizeof *p);
    const char *paths[3] = {tls->ca_file, tls->cert_file, tls->key_file};
    char **dst[3] = {&p->ca, &p->cert, &p->key};
    for (int i = 0; i < 3; i++)
        if (paths[i] && paths[i][0] && !(*dst[i] = read_pem(paths[i]))) {
            td_tls_pems_free(p);
            return td_error(TD_ERR_IO, "tls: cannot read %s", paths[i]);
        }
    if (!p->cert != !p->key) {
        td_tls_pems_free(p);
        return td_error(TD_ERR_CONFIG, "tls: cert_file and key_file go together (one of them is missing)");
    }
    return TD_OK;
}

static bool tls_on(const td_rpc_tls_t *tls)
{
    return tls && ((tls->ca_file && tls->ca_file[0]) || (tls->cert_file && tls->cert_file[0]));
}


/* ------------------------------------------------------------------ scopes */

struct td_rpc_scope {
    pthread_mutex_t mu;
    double deadline; /* td_now_s() clock; INFINITY: none */
    bool cancelled;
    grpc_call *calls[SCOPE_CALLS];
    size_t n;
};

static void scope_init(td_rpc_scope_t *sc, double timeout_s)
{
    pthread_mutex_init(&sc->mu, NULL);
    sc->deadline = timeout_s < 1e8 ? td_now_s() + timeout_s : INFINITY;
    sc->cancelled = false;
    sc->n = 0;
}

td_status_t td_rpc_scope_create(double timeout_s, td_rpc_scope_t **out)
{
    td_rpc_scope_t *sc = calloc(1, sizeof *sc);
    if (!sc)
        return td_error(TD_ERR_NO_MEMORY, "rpc: no memory");
    scope_init(sc, timeout_s);
    *out = sc;
    return TD_OK;
}

void td_rpc_scope_destroy(td_rpc_scope_t *sc)
{
    if (!sc)
        return;
    pthread_mutex_destroy(&sc->mu);
    free(sc);
}

void td_rpc_scope_cancel(td_rpc_scope_t *sc)
{
    pthread_mutex_lock(&sc->mu);
    sc->cancelled = true;
    for (size_t i = 0; i < sc->n; i++)
        grpc_call_cancel_with_status(sc->calls[i], GRPC_STATUS_CANCELLED, "the caller cancelled", NULL);
    pthread_mutex_unlock(&sc->mu);
}

bool td_rpc_scope_cancelled(td_rpc_scope_t *sc)
{
    pthread_mutex_lock(&sc->mu);
    bool c = sc->cancelled;
    pthread_mutex_unlock(&sc->mu);
    return c;
}

double td_rpc_scope_left(td_rpc_scope_t *sc)
{
    return isinf(sc->deadline) ? 1e9 : sc->deadline - td_now_s();
}

/* Registers a call made under sc; cancels it at once when sc is cancelled
 * (or has no room: a scope serves a few calls at a time). */
static void scope_track(td_rpc_scope_t *sc, grpc_call *call)
{
    if (!sc)
        return;
    pthread_mutex_lock(&sc->mu);
    if (sc->cancelled)
        grpc_call_cancel_with_status(call, GRPC_STATUS_CANCELLED, "the caller cancelled", NULL);
    else if (sc->n == SCOPE_CALLS)
        grpc_call_cancel_with_status(call, GRPC_STATUS_RESOURCE_EXHAUSTED, "too many calls at once in one scope",
                                     NULL);
    else
        sc->calls[sc->n++] = call;
    pthread_mutex_unlock(&sc->mu);
}

static void scope_untrack(td_rpc_scope_t *sc, grpc_call *call)
{
    if (!sc)
        return;
    pthread_mutex_lock(&sc->mu);
    for (size_t i = 0; i < sc->n; i++)
        if (sc->calls[i] == call) {
            sc->calls[i] = sc->calls[--sc->n];
            break;
        }
    pthread_mutex_unlock(&sc->mu);
}

/* ------------------------------------------------------------------ server */

typedef struct method {
    char name[128];
    td_rpc_handler_fn fn;
    void *ctx;
    void *handle;
    char roles[64]; /* who may call it (td_rpc_server_allow); "" anyone the server admits */
} method_t;

/* A request for the next call of a method, posted to gRPC. */
typedef struct posted {
    op_t op;
    struct td_rpc_server *srv;
    int method; /* -1: the unimplemented catch-all */
    grpc_call *call;
    gpr_timespec deadline;
    grpc_metadata_array md;
    grpc_byte_buffer *payload;
    grpc_call_details details;
    grpc_completion_queue *cq;
} posted_t;

struct td_rpc_server {
    grpc_server *srv;
    char addr[256];
    bool tls;
    td_tls_pems_t pems;
    method_t methods[MAX_METHODS];
    int n_methods;
    td_pool_t *pool;
    int threads;
    int max_active; /* calls open at once, past which new ones are refused */
    size_t max_message; /* a request message larger is refused */
    op_t shutdown_op;
    pthread_mutex_t mu; /* guards what follows */
    pthread_cond_t cv;
    bool started, stopping, shut;
    bool abandoned; /* stop gave up waiting for calls: destroy leaves it */
    int active;     /* call records alive */
    int n_posted;   /* requests posted and not completed */
};

typedef struct call_op {
    op_t op;
    struct td_rpc_call *c;
    tag_t tag;
} call_op_t;

struct td_rpc_call {
    td_rpc_server_t *srv;
    method_t *m;
    grpc_call *call;
    gpr_timespec deadline;
    grpc_metadata_array md;
    uint8_t *payload;
    size_t payload_len;
    char *peer;
    char identity[64]; /* the peer certificate's common name, "" if none */
    td_rpc_scope_t scope;
    call_op_t ops[TAG_COUNT];
    sync_t s;    /* s.mu guards what follows */
    int refs;    /* the owner's, and one per batch in flight or pool task queued */
    int in_cb;   /* callbacks running now */
    int cancelled_flag; /* written by gRPC when TAG_CLOSE completes */
    bool closed, md_sent, finished, send_failed, detached, ended, wake_posted;
    bool task_running; /* a pool task has the call (a resume waits for it to detach) */
    grpc_byte_buffer *send_bb; /* the message in flight (one at a time) */
    grpc_byte_buffer *fin_bb;  /* the reply sent with the status */
    grpc_slice fin_details;
    bool fin_set;
    grpc_metadata trailer[TD_RPC_MAX_TRAILERS]; /* trailing metadata sent with the status */
    size_t n_trailers;
    unsigned wakes, wakes_seen;
    td_rpc_event_fn send_cb, wake_cb, cancel_cb;
    void *send_ctx, *wake_ctx, *cancel_ctx;
    td_rpc_handler_fn resume_fn;
    void *resume_ctx;
};

static void call_free(td_rpc_call_t *c)
{
    td_rpc_server_t *s = c->srv;
    grpc_call_unref(c->call);
    grpc_metadata_array_destroy(&c->md);
    if (c->send_bb)
        grpc_byte_buffer_destroy(c->send_bb);
    if (c->fin_bb)
        grpc_byte_buffer_destroy(c->fin_bb);
    if (c->fin_set)
        grpc_slice_unref(c->fin_details);
    for (size_t i = 0; i < c->n_trailers; i++) {
        grpc_slice_unref(c->trailer[i].key);
        grpc_slice_unref(c->trailer[i].value);
    }
    free(c->payload);
    if (c->peer)
        gpr_free(c->peer);
    sync_destroy(&c->s);
    pthread_mutex_destroy(&c->scope.mu);
    free(c);
    pthread_mutex_lock(&s->mu);
    s->active--;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

static void call_unref(td_rpc_call_t *c)
{
    pthread_mutex_lock(&c->s.mu);
    int r = --c->refs;
    pthread_mutex_unlock(&c->s.mu);
    if (!r)
        call_free(c);
}

/* Starts a batch tagged t (the caller has set posted and taken the ref,
 * under mu); false (both undone) when gRPC refuses it. */
static bool call_start_batch(td_rpc_call_t *c, tag_t t, const grpc_op *ops, size_t n)
{
    if (grpc_call_start_batch(c->call, ops, n, op_arm(&c->ops[t].op), NULL) == GRPC_CALL_OK)
        return true;
    pthread_mutex_lock(&c->s.mu);
    c->s.posted &= ~(1u << t);
    c->refs--; /* the owner still holds one */
    pthread_mutex_unlock(&c->s.mu);
    return false;
}

static void run_cb(td_rpc_call_t *c, td_rpc_event_fn fn, void *ctx, bool ok)
{
    if (!fn)
        return;
    fn(ctx, ok);
    pthread_mutex_lock(&c->s.mu);
    c->in_cb--;
    pthread_cond_broadcast(&c->s.cv);
    pthread_mutex_unlock(&c->s.mu);
}

static void call_op_done(op_t *op, bool ok)
{
    call_op_t *o = (call_op_t *)op;
    td_rpc_call_t *c = o->c;
    td_rpc_event_fn cb1 = NULL, cb2 = NULL;
    void *ctx1 = NULL, *ctx2 = NULL;
    bool cancelled = false;
    pthread_mutex_lock(&c->s.mu);
    switch (o->tag) {
    case TAG_SEND:
        grpc_byte_buffer_destroy(c->send_bb);
        c->send_bb = NULL;
        if (!ok)
            c->send_failed = true;
        cb1 = c->send_cb;
        ctx1 = c->send_ctx;
        c->send_cb = NULL;
        sync_complete_locked(&c->s, TAG_SEND, ok);
        break;
    case TAG_CLOSE:
        c->closed = true;
        cancelled = c->cancelled_flag != 0;
        if (cancelled && !c->finished) {
            cb1 = c->cancel_cb;
            ctx1 = c->cancel_ctx;
            c->cancel_cb = NULL;
            cb2 = c->wake_cb;
            ctx2 = c->wake_ctx;
        }
        sync_complete_locked(&c->s, TAG_CLOSE, ok);
        break;
    case TAG_WAKE:
        c->wake_posted = false;
        c->s.posted &= ~(1u << TAG_WAKE);
        if (!c->finished && !c->ended) {
            cb1 = c->wake_cb;
            ctx1 = c->wake_ctx;
        }
        break;
    default: /* TAG_FINISH */
        sync_complete_locked(&c->s, o->tag, ok);
        break;
    }
    c->in_cb += (cb1 != NULL) + (cb2 != NULL);
    pthread_mutex_unlock(&c->s.mu);
    if (cancelled)
        td_rpc_scope_cancel(&c->scope);
    run_cb(c, cb1, ctx1, ok);
    run_cb(c, cb2, ctx2, ok);
    call_unref(c);
}

static void server_post(td_rpc_server_t *s, int method);

static void posted_free(posted_t *p)
{
    grpc_metadata_array_destroy(&p->md);
    if (p->method < 0)
        grpc_call_details_destroy(&p->details);
    free(p);
}

/* Waits until the message in flight is written or failed (with mu held);
 * a client that went away while it waits has the call cancelled. */
static void send_settle_locked(td_rpc_call_t *c)
{
    while (c->s.posted & (1u << TAG_SEND)) {
        struct timespec until = mono_in(1);
        if (pthread_cond_timedwait(&c->s.cv, &c->s.mu, &until) == ETIMEDOUT && c->closed && c->cancelled_flag)
            grpc_call_cancel(c->call, NULL);
    }
}

/* Sends the status (and reply); waits up to 5 s for it to go out (then
 * cancels), except on a loop thread, which must not wait. */
static void call_status(td_rpc_call_t *c, int code, const char *msg, const void *reply, size_t reply_len)
{
    pthread_mutex_lock(&c->s.mu);
    if (c->finished) {
        pthread_mutex_unlock(&c->s.mu);
        return;
    }
    c->finished = true;
    c->wake_cb = c->cancel_cb = NULL;
    if (!t_on_loop)
        send_settle_locked(c);
    grpc_op ops[3];
    memset(ops, 0, sizeof ops);
    int n = 0;
    if (!c->md_sent) {
        ops[n++].op = GRPC_OP_SEND_INITIAL_METADATA;
        c->md_sent = true;
    }
    if (reply) {
        grpc_slice sl = grpc_slice_from_copied_buffer(reply, reply_len);
        c->fin_bb = grpc_raw_byte_buffer_create(&sl, 1);
        grpc_slice_unref(sl);
        ops[n].op = GRPC_OP_SEND_MESSAGE;
        ops[n++].data.send_message.send_message = c->fin_bb;
    }
    c->fin_details = grpc_slice_from_copied_string(msg ? msg : "");
    c->fin_set = true;
    ops[n].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
    ops[n].data.send_status_from_server.status = (grpc_status_code)code;
    ops[n].data.send_status_from_server.status_details = &c->fin_details;
    if (c->n_trailers) {
        ops[n].data.send_status_from_server.trailing_metadata_count = c->n_trailers;
        ops[n].data.send_status_from_server.trailing_metadata = c->trailer;
    }
    n++;
    c->s.posted |= 1u << TAG_FINISH;
    c->refs++;
    pthread_mutex_unlock(&c->s.mu);
    if (!call_start_batch(c, TAG_FINISH, ops, (size_t)n) || t_on_loop)
        return;
    pthread_mutex_lock(&c->s.mu);
    if (sync_wait_locked(&c->s, TAG_FINISH, 5) == 0) {
        grpc_call_cancel(c->call, NULL);
        sync_wait_locked(&c->s, TAG_FINISH, 1e9);
    }
    pthread_mutex_unlock(&c->s.mu);
}

/* With mu held, off the loop threads: waits for the callbacks under way. */
static void callbacks_settle_locked(td_rpc_call_t *c)
{
    while (c->in_cb && !t_on_loop)
        pthread_cond_wait(&c->s.cv, &c->s.mu);
}

/* The owner lets go: the status goes out if the handler sent none, the
 * callbacks are turned off (waiting for one under way) and the owner's
 * reference is dropped. */
static void call_end(td_rpc_call_t *c)
{
    if (!c->finished)
        call_status(c, TD_RPC_INTERNAL, "the handler ended without a status", NULL, 0);
    pthread_mutex_lock(&c->s.mu);
    c->ended = true;
    c->wake_cb = c->cancel_cb = c->send_cb = NULL;
    callbacks_settle_locked(c);
    pthread_mutex_unlock(&c->s.mu);
    call_unref(c);
}

/* A pool task: the handler (or a resumed step) of a call. While it runs the
 * call is its own; unless it detaches again, the call ends when it returns. */
static void call_task(void *arg)
{
    td_rpc_call_t *c = arg;
    for (;;) {
        pthread_mutex_lock(&c->s.mu);
        td_rpc_handler_fn fn = c->resume_fn;
        void *ctx = c->resume_ctx;
        c->resume_fn = NULL;
        c->detached = false;
        pthread_mutex_unlock(&c->s.mu);
        if (fn)
            fn(ctx, c);
        else if (c->m)
            c->m->fn(c->m->ctx, c);
        else
            call_status(c, TD_RPC_UNIMPLEMENTED, "no such method", NULL, 0);
        pthread_mutex_lock(&c->s.mu);
        bool detached = c->detached, again = detached && c->resume_fn;
        if (detached && !again)
            c->task_running = false;
        pthread_mutex_unlock(&c->s.mu);
        if (!again) {
            if (!detached)
                call_end(c); /* the owner's reference */
            break;
        }
        /* a callback asked to resume while this task still had the call: run it now */
    }
    call_unref(c); /* the task's */
}

/* The peer certificate's common name, as the TLS handshake verified it. */
static void call_identity(td_rpc_call_t *c)
{
    grpc_auth_context *ac = grpc_call_auth_context(c->call);
    if (!ac)
        return;
    grpc_auth_property_iterator it = grpc_auth_context_find_properties_by_name(ac, GRPC_X509_CN_PROPERTY_NAME);
    const grpc_auth_property *p = grpc_auth_property_iterator_next(&it);
    if (p && p->value_length < sizeof c->identity && !memchr(p->value, 0, p->value_length)) {
        memcpy(c->identity, p->value, p->value_length);
        c->identity[p->value_length] = 0;
    }
    grpc_auth_context_release(ac);
}

static void on_arrival(op_t *op, bool ok)
{
    posted_t *p = (posted_t *)op;
    td_rpc_server_t *s = p->srv;
    pthread_mutex_lock(&s->mu);
    s->n_posted--;
    bool stopping = s->stopping;
    if (!ok)
        pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    if (!ok) { /* the server is shutting down */
        posted_free(p);
        return;
    }
    if (!stopping)
        server_post(s, p->method);
    td_rpc_call_t *c = calloc(1, sizeof *c);
    if (!c) {
        grpc_call_cancel(p->call, NULL);
        grpc_call_unref(p->call);
        if (p->payload)
            grpc_byte_buffer_destroy(p->payload);
        posted_free(p);
        return;
    }
    c->srv = s;
    c->m = p->method >= 0 ? &s->methods[p->method] : NULL;
    c->call = p->call;
    c->deadline = p->deadline;
    c->md = p->md;
    grpc_metadata_array_init(&p->md);
    c->peer = grpc_call_get_peer(c->call);
    if (s->tls)
        call_identity(c);
    size_t big = 0;
    if (p->payload && grpc_byte_buffer_length(p->payload) > s->max_message) {
        big = grpc_byte_buffer_length(p->payload);
        grpc_byte_buffer_destroy(p->payload);
        p->payload = NULL;
    }
    if (p->payload) {
        size_t cap = 0;
        if (!buffer_into(p->payload, &c->payload, &cap, &c->payload_len)) {
            free(c->payload);
            c->payload = NULL;
            c->payload_len = 0;
        }
        grpc_byte_buffer_destroy(p->payload);
    }
    posted_free(p);
    gpr_timespec dl = gpr_convert_clock_type(c->deadline, GPR_CLOCK_MONOTONIC);
    double left = gpr_time_cmp(dl, gpr_inf_future(GPR_CLOCK_MONOTONIC)) == 0
                      ? 1e9
                      : gpr_timespec_to_micros(gpr_time_sub(dl, gpr_now(GPR_CLOCK_MONOTONIC))) * 1e-6;
    scope_init(&c->scope, left);
    sync_init(&c->s);
    for (int t = 0; t < TAG_COUNT; t++)
        c->ops[t] = (call_op_t){.op.done = call_op_done, .c = c, .tag = (tag_t)t};
    pthread_mutex_lock(&s->mu);
    s->active++;
    bool over = s->active > s->max_active;
    pthread_mutex_unlock(&s->mu);
    c->refs = 2; /* the owner's and TAG_CLOSE's */
    c->s.posted = 1u << TAG_CLOSE;
    grpc_op cl = {.op = GRPC_OP_RECV_CLOSE_ON_SERVER};
    cl.data.recv_close_on_server.cancelled = &c->cancelled_flag;
    call_start_batch(c, TAG_CLOSE, &cl, 1);
    if (c->m && c->m->roles[0] && !td_cert_role_in(c->m->roles, c->identity)) {
        char msg[400];
        snprintf(msg, sizeof msg, "%s: the peer's certificate (CN \"%s\") is not one of the roles that may call "
                 "it (%s)", c->m->name, c->identity[0] ? c->identity : "none", c->m->roles);
        call_status(c, TD_RPC_PERMISSION_DENIED, msg, NULL, 0);
        call_end(c);
        return;
    }
    if ((over || big) && c->m) { /* admission: refused now, not queued */
        char msg[160];
        if (big)
            snprintf(msg, sizeof msg, "request message: %zu bytes, over this server's limit of %zu bytes", big,
                     s->max_message);
        else
            snprintf(msg, sizeof msg, "the server handles %d calls at once, its most; try again later",
                     s->max_active);
        call_status(c, TD_RPC_RESOURCE_EXHAUSTED, msg, NULL, 0);
        call_end(c);
        return;
    }
    c->refs++; /* the task's */
    c->task_running = true;
    if (td_pool_submit(s->pool, call_task, c) != TD_OK) {
        c->refs--;
        call_status(c, TD_RPC_UNAVAILABLE, "the server is stopping", NULL, 0);
        call_end(c);
    }
}

static void server_post(td_rpc_server_t *s, int method)
{
    posted_t *p = calloc(1, sizeof *p);
    if (!p)
        return;
    p->op.done = on_arrival;
    p->srv = s;
    p->method = method;
    p->cq = loop_pick();
    grpc_metadata_array_init(&p->md);
    pthread_mutex_lock(&s->mu);
    s->n_posted++;
    pthread_mutex_unlock(&s->mu);
    grpc_call_error e;
    /* every read of p comes before the arming (its release is what the
     * thread that completes and frees p acquires): arguments are evaluated
     * in no set order, so none of them may read p */
    grpc_completion_queue *cq = p->cq;
    if (method >= 0) {
        void *handle = s->methods[method].handle;
        op_t *tag = op_arm(&p->op);
        e = grpc_server_request_registered_call(s->srv, handle, &p->call, &p->deadline, &p->md, &p->payload, cq, cq,
                                                tag);
    } else {
        grpc_call_details_init(&p->details);
        op_t *tag = op_arm(&p->op);
        e = grpc_server_request_call(s->srv, &p->call, &p->details, &p->md, cq, cq, tag);
    }
    if (e != GRPC_CALL_OK) {
        TD_WARN("rpc: cannot post a request for %s: error %d", method >= 0 ? s->methods[method].name : "*", e);
        pthread_mutex_lock(&s->mu);
        s->n_posted--;
        pthread_mutex_unlock(&s->mu);
        posted_free(p);
    }
}

static void on_server_shutdown(op_t *op, bool ok)
{
    (void)ok;
    td_rpc_server_t *s = (td_rpc_server_t *)((char *)op - offsetof(td_rpc_server_t, shutdown_op));
    pthread_mutex_lock(&s->mu);
    s->shut = true;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

td_status_t td_rpc_server_create(const char *addr, const td_rpc_tls_t *tls, td_rpc_server_t **out)
{
    td_rpc_server_t *s = calloc(1, sizeof *s);
    if (!s)
        return td_error(TD_ERR_NO_MEMORY, "rpc: no memory");
    snprintf(s->addr, sizeof s->addr, "%s", addr);
    if (tls_on(tls)) {
        td_status_t rc = td_tls_pems_load(tls, &s->pems);
        if (rc) {
            free(s);
            return rc;
        }
        if (!s->pems.cert) {
            td_tls_pems_free(&s->pems);
            free(s);
            return td_error(TD_ERR_CONFIG, "tls: a server needs cert_file and key_file");
        }
        s->tls = true;
    }
    grpc_arg args[2] = {
        {.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, .value.integer = MAX_MESSAGE},
        {.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_ALLOW_REUSEPORT, .value.integer = 0},
    };
    grpc_channel_args ca = {2, args};
    s->srv = grpc_server_create(&ca, NULL);
    for (int i = 0; i < g_loop.n; i++)
        grpc_server_register_completion_queue(s->srv, g_loop.cq[i], NULL);
    s->shutdown_op.done = on_server_shutdown;
    s->max_active = DEFAULT_MAX_CALLS;
    s->max_message = MAX_MESSAGE;
    s->threads = DEFAULT_THREADS;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    *out = s;
    return TD_OK;
}

td_status_t td_rpc_server_add(td_rpc_server_t *s, const char *method, td_rpc_handler_fn fn, void *ctx)
{
    if (s->started || s->n_methods == MAX_METHODS)
        return td_error(TD_ERR_INTERNAL, "rpc: cannot register %s (started, or %d methods already)", method,
                        MAX_METHODS);
    method_t *m = &s->methods[s->n_methods];
    snprintf(m->name, sizeof m->name, "%s", method);
    m->fn = fn;
    m->ctx = ctx;
    m->handle = grpc_server_register_method(s->srv, m->name, NULL, GRPC_SRM_PAYLOAD_READ_INITIAL_BYTE_BUFFER, 0);
    if (!m->handle)
        return td_error(TD_ERR_INTERNAL, "rpc: gRPC refused to register %s", method);
    s->n_methods++;
    return TD_OK;
}

td_status_t td_rpc_server_allow(td_rpc_server_t *s, const char *method, const char *roles)
{
    for (int i = 0; i < s->n_methods; i++)
        if (!strcmp(s->methods[i].name, method)) {
            if (s->started || strlen(roles) >= sizeof s->methods[i].roles)
                return td_error(TD_ERR_INTERNAL, "rpc: cannot restrict %s to '%s'", method, roles);
            if (s->tls)
                snprintf(s->methods[i].roles, sizeof s->methods[i].roles, "%s", roles);
            return TD_OK;
        }
    return td_error(TD_ERR_INTERNAL, "rpc: %s is not registered", method);
}

td_status_t td_rpc_server_start(td_rpc_server_t *s, int *port)
{
    /* one queued task per admitted call at most, and the unimplemented ones */
    td_status_t rc = td_pool_create("rpc", s->threads, (size_t)s->max_active + 64, &s->pool);
    if (rc)
        return rc;
    grpc_server_credentials *cr;
    if (s->tls) {
        grpc_ssl_pem_key_cert_pair pair = {.private_key = s->pems.key, .cert_chain = s->pems.cert};
        cr = grpc_ssl_server_credentials_create_ex(
            s->pems.ca, &pair, 1,
            s->pems.ca ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE,
            NULL);
    } else {
        cr = grpc_insecure_server_credentials_create();
    }
    int p = grpc_server_add_http2_port(s->srv, s->addr, cr);
    grpc_server_credentials_release(cr);
    if (p <= 0)
        return td_error(TD_ERR_UNAVAILABLE, "rpc: cannot listen on %s (in use, or not an address of this host)",
                        s->addr);
    grpc_server_start(s->srv);
    s->started = true;
    for (int i = 0; i < s->n_methods; i++)
        for (int k = 0; k < POSTED_PER_METHOD; k++)
            server_post(s, i);
    server_post(s, -1);
    if (port)
        *port = p;
    return TD_OK;
}

void td_rpc_server_set_max_calls(td_rpc_server_t *s, int max) { s->max_active = max > 0 ? max : DEFAULT_MAX_CALLS; }

void td_rpc_server_set_max_message(td_rpc_server_t *s, size_t bytes)
{
    s->max_message = bytes && bytes < MAX_MESSAGE ? bytes : MAX_MESSAGE;
}
void td_rpc_server_set_threads(td_rpc_server_t *s, int threads) { s->threads = threads > 0 ? threads : DEFAULT_THREADS; }

int td_rpc_server_active(td_rpc_server_t *s)
{
    pthread_mutex_lock(&s->mu);
    int n = s->active;
    pthread_mutex_unlock(&s->mu);
    return n;
}

void td_rpc_server_stop(td_rpc_server_t *s, double grace_s)
{
    if (!s || !s->started)
        return;
    pthread_mutex_lock(&s->mu);
    bool was = s->stopping;
    s->stopping = true;
    pthread_mutex_unlock(&s->mu);
    if (was)
        return;
    grpc_server_shutdown_and_notify(s->srv, g_loop.cq[0], op_arm(&s->shutdown_op));
    struct timespec until = td_wall_deadline(grace_s);
    pthread_mutex_lock(&s->mu);
    while (s->active > 0 && pthread_cond_timedwait(&s->cv, &s->mu, &until) == 0)
        ;
    pthread_mutex_unlock(&s->mu);
    grpc_server_cancel_all_calls(s->srv);
    /* cancelled calls end within their own waits' deadlines; one that does
     * not in 10 s is left behind (logged) rather than waited on forever */
    until = td_wall_deadline(10);
    int e = 0;
    pthread_mutex_lock(&s->mu);
    while ((s->active > 0 || !s->shut || s->n_posted > 0) && e != ETIMEDOUT)
        e = pthread_cond_timedwait(&s->cv, &s->mu, &until);
    int left = s->active;
    bool done = s->shut && !s->n_posted && !left;
    pthread_mutex_unlock(&s->mu);
    if (!done) {
        TD_WARN("rpc: %d call(s) did not end within 10 s of being cancelled; the server is left running", left);
        s->abandoned = true;
        return;
    }
    td_pool_destroy(s->pool);
    s->pool = NULL;
    s->started = false;
}

void td_rpc_advertise_addr(const char *listen, int port, char *out, size_t cap)
{
    char host[128];
    snprintf(host, sizeof host, "%s", listen ? listen : "");
    char *colon = strrchr(host, ':');
    if (colon)
        *colon = 0;
    if (host[0] == '[') { /* [v6] */
        memmove(host, host + 1, strlen(host));
        char *b = strchr(host, ']');
        if (b)
            *b = 0;
    }
    if (!host[0] || !strcmp(host, "0.0.0.0") || !strcmp(host, "::") || !strcmp(host, "*")) {
        snprintf(host, sizeof host, "127.0.0.1");
        struct ifaddrs *ifs = NULL;
        if (getifaddrs(&ifs) == 0) {
            for (struct ifaddrs *i = ifs; i; i = i->ifa_next)
                if (i->ifa_addr && i->ifa_addr->sa_family == AF_INET && (i->ifa_flags & IFF_UP) &&
                    !(i->ifa_flags & IFF_LOOPBACK)) {
                    inet_ntop(AF_INET, &((struct sockaddr_in *)(void *)i->ifa_addr)->sin_addr, host, sizeof host);
                    break;
                }
            freeifaddrs(ifs);
        }
    }
    snprintf(out, cap, strchr(host, ':') ? "[%s]:%d" : "%s:%d", host, port);
}

void td_rpc_server_destroy(td_rpc_server_t *s)
{
    if (!s)
        return;
    if (s->started)
        td_rpc_server_stop(s, 0);
    if (s->abandoned) /* calls still hold it (td_rpc_server_stop said so): the process is ending */
        return;
    if (!s->stopping) { /* created, never started */
        grpc_server_shutdown_and_notify(s->srv, g_loop.cq[0], op_arm(&s->shutdown_op));
        grpc_server_cancel_all_calls(s->srv);
        pthread_mutex_lock(&s->mu);
        while (!s->shut || s->n_posted > 0)
            pthread_cond_wait(&s->cv, &s->mu);
        pthread_mutex_unlock(&s->mu);
    }
    grpc_server_destroy(s->srv);
    td_pool_destroy(s->pool);
    td_tls_pems_free(&s->pems);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    free(s);
}

const uint8_t *td_rpc_call_payload(td_rpc_call_t *c, size_t *len)
{
    *len = c->payload_len;
    return c->payload;
}

const char *td_rpc_call_method(td_rpc_call_t *c) { return c->m ? c->m->name : "?"; }
const char *td_rpc_call_peer(td_rpc_call_t *c) { return c->peer ? c->peer : "?"; }
const char *td_rpc_call_identity(td_rpc_call_t *c) { return c->identity; }

bool td_rpc_call_metadata(td_rpc_call_t *c, const char *key, char *out, size_t n)
{
    size_t kl = strlen(key);
    for (size_t i = 0; i < c->md.count; i++) {
        const grpc_slice *k = &c->md.metadata[i].key, *v = &c->md.metadata[i].value;
        if (GRPC_SLICE_LENGTH(*k) == kl && !memcmp(GRPC_SLICE_START_PTR(*k), key, kl)) {
            size_t vl = GRPC_SLICE_LENGTH(*v);
            if (vl >= n || memchr(GRPC_SLICE_START_PTR(*v), 0, vl))
                return false;
            memcpy(out, GRPC_SLICE_START_PTR(*v), vl);
            out[vl] = 0;
            return true;
        }
    }
    return false;
}
td_rpc_scope_t *td_rpc_call_scope(td_rpc_call_t *c) { return &c->scope; }

double td_rpc_call_time_left(td_rpc_call_t *c)
{
    gpr_timespec d = gpr_convert_clock_type(c->deadline, GPR_CLOCK_MONOTONIC);
    if (gpr_time_cmp(d, gpr_inf_future(GPR_CLOCK_MONOTONIC)) == 0)
        return 1e9;
    gpr_timespec left = gpr_time_sub(d, gpr_now(GPR_CLOCK_MONOTONIC));
    return (double)left.tv_sec + left.tv_nsec * 1e-9;
}

bool td_rpc_call_cancelled(td_rpc_call_t *c)
{
    pthread_mutex_lock(&c->s.mu);
    bool r = c->closed && c->cancelled_flag;
    pthread_mutex_unlock(&c->s.mu);
    return r;
}

/* Posts one message (mu held, no send in flight); cb NULL: blocking use. */
static td_status_t send_post_locked(td_rpc_call_t *c, const void *msg, size_t len, td_rpc_event_fn cb, void *ctx,
                                    grpc_op *ops, int *n)
{
    if (c->finished || c->send_failed || (c->closed && c->cancelled_flag))
        return TD_ERR_CANCELLED;
    *n = 0;
    memset(ops, 0, 2 * sizeof *ops);
    if (!c->md_sent) {
        ops[(*n)++].op = GRPC_OP_SEND_INITIAL_METADATA;
        c->md_sent = true;
    }
    grpc_slice sl = grpc_slice_from_copied_buffer(msg, len);
    c->send_bb = grpc_raw_byte_buffer_create(&sl, 1);
    grpc_slice_unref(sl);
    ops[*n].op = GRPC_OP_SEND_MESSAGE;
    ops[(*n)++].data.send_message.send_message = c->send_bb;
    c->send_cb = cb;
    c->send_ctx = ctx;
    c->s.posted |= 1u << TAG_SEND;
    c->refs++;
    return TD_OK;
}

/* Sends without waiting for the write: the caller goes on (say, to read the
 * next message from upstream) while gRPC writes; the next send or the finish
 * waits for this one first, so flow control still holds the sender back. */
td_status_t td_rpc_call_send(td_rpc_call_t *c, const void *msg, size_t len)
{
    grpc_op ops[2];
    int n;
    pthread_mutex_lock(&c->s.mu);
    send_settle_locked(c);
    td_status_t rc = send_post_locked(c, msg, len, NULL, NULL, ops, &n);
    pthread_mutex_unlock(&c->s.mu);
    if (rc)
        return rc;
    return call_start_batch(c, TAG_SEND, ops, (size_t)n) ? TD_OK : TD_ERR_CANCELLED;
}

td_status_t td_rpc_call_send_async(td_rpc_call_t *c, const void *msg, size_t len, td_rpc_event_fn done, void *ctx)
{
    grpc_op ops[2];
    int n;
    pthread_mutex_lock(&c->s.mu);
    td_status_t rc = c->s.posted & (1u << TAG_SEND) ? TD_ERR_INTERNAL : send_post_locked(c, msg, len, done, ctx, ops, &n);
    pthread_mutex_unlock(&c->s.mu);
    if (rc == TD_ERR_INTERNAL)
        return td_error(rc, "rpc: a send is already in flight on this call");
    if (rc)
        return rc;
    if (!call_start_batch(c, TAG_SEND, ops, (size_t)n)) {
        pthread_mutex_lock(&c->s.mu);
        c->send_cb = NULL;
        pthread_mutex_unlock(&c->s.mu);
        return TD_ERR_CANCELLED;
    }
    return TD_OK;
}

td_status_t td_rpc_call_wait(td_rpc_call_t *c, double timeout_s)
{
    struct timespec until = mono_in(timeout_s);
    td_status_t rc = TD_OK;
    pthread_mutex_lock(&c->s.mu);
    for (;;) {
        if (c->wakes != c->wakes_seen) {
            c->wakes_seen = c->wakes;
            break;
        }
        if (c->closed && c->cancelled_flag) {
            rc = TD_ERR_CANCELLED;
            break;
        }
        if (pthread_cond_timedwait(&c->s.cv, &c->s.mu, &until) == ETIMEDOUT) {
            rc = TD_ERR_TIMEOUT;
            break;
        }
    }
    pthread_mutex_unlock(&c->s.mu);
    return rc;
}

/* With mu held: posts an empty batch whose completion runs the wake
 * callback on the call's loop thread (one at a time: wakes coalesce). */
static bool wake_post_locked(td_rpc_call_t *c)
{
    if (!c->wake_cb || c->wake_posted || c->finished || c->ended)
        return false;
    c->wake_posted = true;
    c->s.posted |= 1u << TAG_WAKE;
    c->refs++;
    return true;
}

static void wake_start(td_rpc_call_t *c)
{
    if (!call_start_batch(c, TAG_WAKE, NULL, 0)) {
        pthread_mutex_lock(&c->s.mu);
        c->wake_posted = false;
        pthread_mutex_unlock(&c->s.mu);
    }
}

void td_rpc_call_wake(td_rpc_call_t *c)
{
    pthread_mutex_lock(&c->s.mu);
    c->wakes++;
    pthread_cond_broadcast(&c->s.cv);
    bool post = wake_post_locked(c);
    pthread_mutex_unlock(&c->s.mu);
    if (post)
        wake_start(c);
}

void td_rpc_call_on_wake(td_rpc_call_t *c, td_rpc_event_fn fn, void *ctx)
{
    pthread_mutex_lock(&c->s.mu);
    c->wake_cb = fn;
    c->wake_ctx = ctx;
    bool post = fn && wake_post_locked(c); /* one at once: wakes that came before */
    if (!fn)
        callbacks_settle_locked(c);
    pthread_mutex_unlock(&c->s.mu);
    if (post)
        wake_start(c);
}

void td_rpc_call_on_cancel(td_rpc_call_t *c, td_rpc_event_fn fn, void *ctx)
{
    pthread_mutex_lock(&c->s.mu);
    bool now = fn && c->closed && c->cancelled_flag && !c->finished;
    c->cancel_cb = now ? NULL : fn;
    c->cancel_ctx = ctx;
    if (!fn)
        callbacks_settle_locked(c);
    pthread_mutex_unlock(&c->s.mu);
    if (now)
        fn(ctx, true);
}

void td_rpc_call_detach(td_rpc_call_t *c)
{
    pthread_mutex_lock(&c->s.mu);
    c->detached = true;
    pthread_mutex_unlock(&c->s.mu);
}

void td_rpc_call_done(td_rpc_call_t *c) { call_end(c); }

td_status_t td_rpc_call_resume(td_rpc_call_t *c, td_rpc_handler_fn fn, void *ctx)
{
    pthread_mutex_lock(&c->s.mu);
    c->resume_fn = fn;
    c->resume_ctx = ctx;
    bool queued = c->task_running; /* the task that has it runs fn once it lets go */
    if (!queued) {
        c->task_running = true;
        c->refs++;
    }
    pthread_mutex_unlock(&c->s.mu);
    if (queued)
        return TD_OK;
    td_status_t rc = td_pool_submit(c->srv->pool, call_task, c);
    if (rc) {
        grpc_call_cancel(c->call, NULL);
        pthread_mutex_lock(&c->s.mu);
        c->task_running = false;
        pthread_mutex_unlock(&c->s.mu);
        call_unref(c);
    }
    return rc;
}

void td_rpc_call_finish(td_rpc_call_t *c, int code, const char *fmt, ...)
{
    char msg[1024] = "";
    if (fmt) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(msg, sizeof msg, fmt, ap);
        va_end(ap);
    }
    call_status(c, code, msg, NULL, 0);
}

void td_rpc_call_set_trailer(td_rpc_call_t *c, const char *key, const char *value)
{
    pthread_mutex_lock(&c->s.mu);
    size_t i = 0;
    while (i < c->n_trailers && grpc_slice_str_cmp(c->trailer[i].key, key))
        i++;
    if (c->finished || i == TD_RPC_MAX_TRAILERS) {
        bool full = !c->finished;
        pthread_mutex_unlock(&c->s.mu);
        if (full)
            TD_WARN("rpc: trailer %s dropped: a call sends at most %d", key, TD_RPC_MAX_TRAILERS);
        return;
    }
    if (i < c->n_trailers) {
        grpc_slice_unref(c->trailer[i].key);
        grpc_slice_unref(c->trailer[i].value);
    } else {
        c->n_trailers++;
    }
    memset(&c->trailer[i], 0, sizeof c->trailer[i]);
    c->trailer[i].key = grpc_slice_from_copied_string(key);
    c->trailer[i].value = grpc_slice_from_copied_string(value);
    pthread_mutex_unlock(&c->s.mu);
}

void td_rpc_call_reply(td_rpc_call_t *c, const void *msg, size_t len)
{
    call_status(c, TD_RPC_OK, "", msg ? msg : "", len);
}

/* ------------------------------------------------------------------ client */

/* calls: the client calls in flight on this channel (under mu), so that
 * td_rpc_channel_shutdown can end them; closed: no new call starts. */
struct td_rpc_channel {
    grpc_channel *ch;
    char target[256];
    pthread_mutex_t mu;
    grpc_call **calls;
    size_t n_calls, cap_calls;
    bool closed, fail_fast;
    grpc_metadata auth; /* "authorization" sent with every call (value empty: none) */
    size_t n_md;
    struct peer_check *pc; /* the server's role check (NULL: none) */
};

/* A channel's check of the server's certificate role, shared with gRPC's
 * copy of the verify options (which may outlive the channel: counted). A
 * server that fails it is refused for good: calls waiting for it (they wait
 * for the connection) are ended at once, and later calls end at start. */
typedef struct peer_check {
    pthread_mutex_t mu;
    int refs;
    char roles[128];
    char why[320];         /* the refusal, once refused */
    td_rpc_channel_t *ch;  /* NULL once the channel is destroyed */
    int refused;           /* atomic */
} peer_check_t;

static void peer_check_put(void *arg)
{
    peer_check_t *pc = arg;
    pthread_mutex_lock(&pc->mu);
    bool last = --pc->refs == 0;
    pthread_mutex_unlock(&pc->mu);
    if (last) {
        pthread_mutex_destroy(&pc->mu);
        free(pc);
    }
}

/* Ends the calls a refused server's channel holds (a thread of its own: not
 * from inside gRPC's handshake). */
static void *peer_refused_thread(void *arg)
{
    peer_check_t *pc = arg;
    pthread_mutex_lock(&pc->mu);
    td_rpc_channel_t *ch = pc->ch;
    if (ch) {
        pthread_mutex_lock(&ch->mu);
        for (size_t i = 0; i < ch->n_calls; i++)
            grpc_call_cancel_with_status(ch->calls[i], GRPC_STATUS_PERMISSION_DENIED, pc->why, NULL);
        pthread_mutex_unlock(&ch->mu);
    }
    pthread_mutex_unlock(&pc->mu);
    peer_check_put(pc);
    return NULL;
}

/* The initial metadata of a call on ch into op. */
static void channel_md(td_rpc_channel_t *ch, grpc_op *op)
{
    op->data.send_initial_metadata.count = ch->n_md;
    op->data.send_initial_metadata.metadata = ch->n_md ? &ch->auth : NULL;
}

void td_rpc_channel_set_authorization(td_rpc_channel_t *ch, const char *value)
{
    if (ch->n_md) {
        grpc_slice_unref(ch->auth.key);
        grpc_slice_unref(ch->auth.value);
        ch->n_md = 0;
    }
    if (value && value[0]) {
        ch->auth.key = grpc_slice_from_static_string("authorization");
        ch->auth.value = grpc_slice_from_copied_string(value);
        ch->n_md = 1;
    }
}

#define SHUTDOWN_MSG "the peer left the cluster; the call was ended by the caller"

/* Registers a new call; a closed channel (or no memory) cancels it at once. */
static void channel_track(td_rpc_channel_t *ch, grpc_call *call)
{
    pthread_mutex_lock(&ch->mu);
    bool ok = !ch->closed && td_grow((void **)&ch->calls, &ch->cap_calls, ch->n_calls + 1, sizeof *ch->calls, 16);
    if (ok)
        ch->calls[ch->n_calls++] = call;
    else
        grpc_call_cancel_with_status(call, GRPC_STATUS_UNAVAILABLE,
                                     ch->closed ? SHUTDOWN_MSG : "no memory to track the call", NULL);
    pthread_mutex_unlock(&ch->mu);
}

static void channel_untrack(td_rpc_channel_t *ch, grpc_call *call)
{
    pthread_mutex_lock(&ch->mu);
    for (size_t i = 0; i < ch->n_calls; i++)
        if (ch->calls[i] == call) {
            ch->calls[i] = ch->calls[--ch->n_calls];
            break;
        }
    pthread_mutex_unlock(&ch->mu);
}

void td_rpc_channel_shutdown(td_rpc_channel_t *ch)
{
    if (!ch)
        return;
    pthread_mutex_lock(&ch->mu);
    ch->closed = true;
    for (size_t i = 0; i < ch->n_calls; i++)
        grpc_call_cancel_with_status(ch->calls[i], GRPC_STATUS_UNAVAILABLE, SHUTDOWN_MSG, NULL);
    pthread_mutex_unlock(&ch->mu);
}

/* The server's certificate must name one of the channel's peer roles; a
 * non-zero answer makes gRPC refuse the connection. */
static int verify_peer_role(const char *target, const char *peer_pem, void *arg)
{
    peer_check_t *pc = arg;
    char cn[128];
    if (td_cert_pem_cn(peer_pem, cn, sizeof cn) && td_cert_role_in(pc->roles, cn))
        return 0;
    pthread_mutex_lock(&pc->mu);
    bool first = !pc->refused;
    if (first) {
        snprintf(pc->why, sizeof pc->why, "%s shows a certificate of this cluster named \"%.100s\", not one of role "
                 "%.100s: not connecting", target ? target : "?", cn, pc->roles);
        __atomic_store_n(&pc->refused, 1, __ATOMIC_RELEASE);
    }
    pthread_t t;
    pthread_attr_t a;
    bool cancel = pc->ch != NULL;
    if (cancel)
        pc->refs++;
    pthread_mutex_unlock(&pc->mu);
    if (first)
        TD_WARN("rpc: %s", pc->why);
    if (cancel) {
        pthread_attr_init(&a);
        pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
        if (pthread_create(&t, &a, peer_refused_thread, pc))
            peer_check_put(pc);
        pthread_attr_destroy(&a);
    }
    return 1;
}

bool td_rpc_channel_down(const td_rpc_channel_t *ch)
{
    return ch && grpc_channel_check_connectivity_state(ch->ch, 0) == GRPC_CHANNEL_TRANSIENT_FAILURE;
}

bool td_rpc_channel_peer_refused(const td_rpc_channel_t *ch)
{
    return ch && ch->pc && __atomic_load_n(&ch->pc->refused, __ATOMIC_ACQUIRE);
}

td_status_t td_rpc_channel_create(const char *target, const td_rpc_tls_t *tls, td_rpc_channel_t **out)
{
    td_rpc_channel_t *c = calloc(1, sizeof *c);
    if (!c)
        return td_error(TD_ERR_NO_MEMORY, "rpc: no memory");
    snprintf(c->target, sizeof c->target, "%s", target);
    grpc_channel_credentials *cr;
    if (tls_on(tls)) {
        td_tls_pems_t p;
        td_status_t rc = td_tls_pems_load(tls, &p);
        if (rc) {
            free(c);
            return rc;
        }
        grpc_ssl_pem_key_cert_pair pair = {.private_key = p.key, .cert_chain = p.cert};
        if (tls->peer_roles && !(c->pc = calloc(1, sizeof *c->pc))) {
            td_tls_pems_free(&p);
            free(c);
            return td_error(TD_ERR_NO_MEMORY, "rpc: no memory");
        }
        if (c->pc) {
            pthread_mutex_init(&c->pc->mu, NULL);
            c->pc->refs = 2; /* the channel's, the credentials' (their destruct) */
            c->pc->ch = c;
            snprintf(c->pc->roles, sizeof c->pc->roles, "%s", tls->peer_roles);
        }
        grpc_ssl_verify_peer_options vo = {.verify_peer_callback = verify_peer_role,
                                           .verify_peer_callback_userdata = c->pc,
                                           .verify_peer_destruct = peer_check_put};
        cr = grpc_ssl_credentials_create_ex(p.ca, p.cert ? &pair : NULL, c->pc ? &vo : NULL, NULL);
        td_tls_pems_free(&p);
    } else {
        cr = grpc_insecure_credentials_create();
    }
    grpc_arg args[5] = {
        {.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, .value.integer = MAX_MESSAGE},
        /* reconnect fast after a peer restarts (the defaults back off to minutes);
         * calls wait for the connection (WAIT_FOR_READY) up to their deadline:
         * fail-fast calls to a peer that was down once never saw it come back */
        {.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, .value.integer = 1000},
        {.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, .value.integer = 100},
        {.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, .value.integer = 1000},
        /* no retry filter: gRPC 1.51's aborts the process (an absl assertion) on trailing metadata
         * without grpc-status, which a peer closing its transport mid-call can send (etcd stopping
         * while our calls to it are in flight). Every caller handles a failed call itself. */
        {.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_ENABLE_RETRIES, .value.integer = 0},
    };
    grpc_channel_args ca = {5, args};
    pthread_mutex_init(&c->mu, NULL);
    c->ch = grpc_channel_create(target, cr, &ca);
    grpc_channel_credentials_release(cr);
    if (!c->ch) {
        if (c->pc)
            peer_check_put(c->pc);
        free(c);
        return td_error(TD_ERR_INVALID_ARG, "rpc: cannot make a channel to '%s'", target);
    }
    *out = c;
    return TD_OK;
}

void td_rpc_channel_set_fail_fast(td_rpc_channel_t *ch, bool on) { ch->fail_fast = on; }

void td_rpc_channel_destroy(td_rpc_channel_t *ch)
{
    if (!ch)
        return;
    if (ch->pc) {
        pthread_mutex_lock(&ch->pc->mu);
        ch->pc->ch = NULL;
        pthread_mutex_unlock(&ch->pc->mu);
        peer_check_put(ch->pc);
    }
    grpc_channel_destroy(ch->ch);
    td_rpc_channel_set_authorization(ch, NULL);
    pthread_mutex_destroy(&ch->mu);
    free(ch->calls);
    free(ch);
}

const char *td_rpc_channel_target(const td_rpc_channel_t *ch) { return ch->target; }

static grpc_call *client_call(td_rpc_channel_t *ch, const char *method, double timeout_s, td_rpc_scope_t *scope,
                              grpc_completion_queue *cq)
{
    if (scope && td_rpc_scope_left(scope) < timeout_s)
        timeout_s = td_rpc_scope_left(scope);
    grpc_slice m = grpc_slice_from_copied_string(method);
    grpc_call *call = grpc_channel_create_call(ch->ch, NULL, GRPC_PROPAGATE_DEFAULTS, cq, m, NULL,
                                               deadline_in(timeout_s), NULL);
    grpc_slice_unref(m);
    channel_track(ch, call);
    scope_track(scope, call);
    if (td_rpc_channel_peer_refused(ch))
        grpc_call_cancel_with_status(call, GRPC_STATUS_PERMISSION_DENIED, ch->pc->why, NULL);
    return call;
}

static void client_call_end(td_rpc_channel_t *ch, td_rpc_scope_t *scope, grpc_call *call)
{
    scope_untrack(scope, call);
    channel_untrack(ch, call);
    grpc_call_unref(call);
}

static void result_set(td_rpc_result_t *res, grpc_status_code code, grpc_slice details, const char *fallback,
                       const grpc_metadata_array *trailing)
{
    if (!res)
        return;
    res->code = (int)code;
    res->retry_after_ms = 0;
    res->rejected_early[0] = '\0';
    for (size_t i = 0; trailing && i < trailing->count; i++) {
        const grpc_metadata *m = &trailing->metadata[i];
        char v[16];
        size_t vn = GRPC_SLICE_LENGTH(m->value);
        if (!grpc_slice_str_cmp(m->key, "rejected-early") && vn && vn < sizeof res->rejected_early) {
            memcpy(res->rejected_early, GRPC_SLICE_START_PTR(m->value), vn);
            res->rejected_early[vn] = '\0';
            continue;
        }
        if (grpc_slice_str_cmp(m->key, "retry-after-ms") || !vn || vn >= sizeof v)
            continue;
        memcpy(v, GRPC_SLICE_START_PTR(m->value), vn);
        v[vn] = '\0';
        char *end;
        unsigned long ms = strtoul(v, &end, 10);
        if (!*end && ms <= UINT32_MAX)
            res->retry_after_ms = (uint32_t)ms;
    }
    size_t n = GRPC_SLICE_LENGTH(details);
    if (n >= sizeof res->message)
        n = sizeof res->message - 1;
    memcpy(res->message, GRPC_SLICE_START_PTR(details), n);
    res->message[n] = '\0';
    if (!n && fallback)
        snprintf(res->message, sizeof res->message, "%s", fallback);
}

/* A call that ran out of time without ever having a connection says so:
 * the bare "Deadline Exceeded" hides a wrong address, a server that is down
 * or a TLS mismatch (a handshake that fails leaves the channel failing). */
static void explain_unconnected(td_rpc_channel_t *ch, td_rpc_result_t *res)
{
    if (!res || res->code != GRPC_STATUS_DEADLINE_EXCEEDED)
        return;
    grpc_connectivity_state s = grpc_channel_check_connectivity_state(ch->ch, 0);
    if (s == GRPC_CHANNEL_READY || s == GRPC_CHANNEL_IDLE)
        return;
    size_t n = strlen(res->message);
    snprintf(res->message + n, sizeof res->message - n,
             " (no connection to %s was made: the server is down, the address is wrong, or TLS does not match)",
             ch->target);
}

/* A client batch: completes into its sync (and, for streams, the stream). */
typedef struct client_op {
    op_t op;
    sync_t *s;
    struct td_rpc_stream *st; /* NULL: a unary call */
    tag_t tag;
} client_op_t;

static void stream_op_done(client_op_t *o, bool ok);

static void client_op_done(op_t *op, bool ok)
{
    client_op_t *o = (client_op_t *)op;
    if (o->st) {
        stream_op_done(o, ok);
        return;
    }
    pthread_mutex_lock(&o->s->mu);
    sync_complete_locked(o->s, o->tag, ok);
    pthread_mutex_unlock(&o->s->mu);
}

td_status_t td_rpc_unary(td_rpc_channel_t *ch, const char *method, const void *req, size_t req_len,
                         double timeout_s, td_rpc_scope_t *scope, uint8_t **resp, size_t *resp_len,
                         td_rpc_result_t *res)
{
    sync_t s;
    sync_init(&s);
    client_op_t op = {.op.done = client_op_done, .s = &s, .tag = TAG_STATUS};
    grpc_call *call = client_call(ch, method, timeout_s, scope, loop_pick());
    grpc_metadata_array mi, mt;
    grpc_metadata_array_init(&mi);
    grpc_metadata_array_init(&mt);
    grpc_slice sl = grpc_slice_from_copied_buffer(req, req_len);
    grpc_byte_buffer *out = grpc_raw_byte_buffer_create(&sl, 1), *in = NULL;
    grpc_slice_unref(sl);
    grpc_status_code code = GRPC_STATUS_UNKNOWN;
    grpc_slice details = grpc_empty_slice();
    const char *err_str = NULL;
    grpc_op ops[6];
    memset(ops, 0, sizeof ops);
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[0].flags = ch->fail_fast ? 0 : GRPC_INITIAL_METADATA_WAIT_FOR_READY;
    channel_md(ch, &ops[0]);
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = out;
    ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[3].data.recv_initial_metadata.recv_initial_metadata = &mi;
    ops[4].op = GRPC_OP_RECV_MESSAGE;
    ops[4].data.recv_message.recv_message = &in;
    ops[5].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    ops[5].data.recv_status_on_client.trailing_metadata = &mt;
    ops[5].data.recv_status_on_client.status = &code;
    ops[5].data.recv_status_on_client.status_details = &details;
    ops[5].data.recv_status_on_client.error_string = &err_str;
    td_status_t rc = TD_OK;
    if (grpc_call_start_batch(call, ops, 6, op_arm(&op.op), NULL) != GRPC_CALL_OK) {
        code = GRPC_STATUS_INTERNAL;
        rc = TD_ERR_INTERNAL;
    } else {
        sync_wait(&s, TAG_STATUS, 1e9); /* the call's deadline bounds it */
    }
    client_call_end(ch, scope, call);
    sync_destroy(&s);
    result_set(res, code, details, err_str, &mt);
    explain_unconnected(ch, res);
    if (!rc && code == GRPC_STATUS_OK && in) {
        size_t cap = 0;
        *resp = NULL;
        if (!buffer_into(in, resp, &cap, resp_len)) {
            free(*resp);
            *resp = NULL;
            rc = TD_ERR_NO_MEMORY;
        } else if (!*resp) { /* an empty reply: still a buffer the caller frees */
            *resp = malloc(1);
            rc = *resp ? TD_OK : TD_ERR_NO_MEMORY;
        }
    } else if (!rc) {
        rc = code == GRPC_STATUS_OK ? TD_ERR_FORMAT : td_rpc_status_of(code);
        if (code == GRPC_STATUS_OK && res)
            snprintf(res->message, sizeof res->message, "the reply had no message");
    }
    if (in)
        grpc_byte_buffer_destroy(in);
    grpc_byte_buffer_destroy(out);
    grpc_slice_unref(details);
    if (err_str)
        gpr_free((void *)err_str);
    grpc_metadata_array_destroy(&mi);
    grpc_metadata_array_destroy(&mt);
    return rc;
}

struct td_rpc_stream {
    td_rpc_channel_t *ch;
    td_rpc_scope_t *scope;
    grpc_call *call;
    client_op_t ops[TAG_COUNT];
    grpc_metadata_array md_initial, md_trailing;
    grpc_status_code code;
    grpc_slice details;
    char *error_string;
    grpc_byte_buffer *recv;
    grpc_byte_buffer *send_bb; /* the message in flight (the request after open, or a write) */
    bool md_sent, got_initial, ended;
    uint8_t *msg; /* the last message read, reused (grown, never shrunk) */
    size_t msg_cap, msg_len;
    sync_t s; /* s.mu guards what follows */
    bool status_done, end_pending;
    int in_cb;
    td_rpc_read_fn read_cb;
    void *read_ctx;
};

static void stream_read_cb(td_rpc_stream_t *st, td_rpc_read_fn cb, void *ctx, td_status_t rc)
{
    cb(ctx, rc, rc ? NULL : st->msg, rc ? 0 : st->msg_len);
    pthread_mutex_lock(&st->s.mu);
    st->in_cb--;
    pthread_cond_broadcast(&st->s.cv);
    pthread_mutex_unlock(&st->s.mu);
}

static void stream_op_done(client_op_t *o, bool ok)
{
    td_rpc_stream_t *st = o->st;
    td_rpc_read_fn cb = NULL;
    void *ctx = NULL;
    td_status_t rc = TD_OK;
    pthread_mutex_lock(&st->s.mu);
    if (o->tag == TAG_RECV && st->read_cb) {
        st->s.posted &= ~(1u << TAG_RECV);
        cb = st->read_cb;
        ctx = st->read_ctx;
        st->read_cb = NULL;
        bool got = ok && st->recv;
        if (got) {
            got = buffer_into(st->recv, &st->msg, &st->msg_cap, &st->msg_len);
            rc = got ? TD_OK : TD_ERR_NO_MEMORY;
        }
        if (st->recv)
            grpc_byte_buffer_destroy(st->recv);
        st->recv = NULL;
        if (!got && rc == TD_OK) { /* the end: told once the status is in */
            st->ended = true;
            rc = TD_ERR_NOT_FOUND;
            if (!st->status_done) {
                st->end_pending = true;
                st->read_cb = cb;
                st->read_ctx = ctx;
                cb = NULL;
            }
        }
    } else if (o->tag == TAG_STATUS) {
        st->status_done = true;
        if (st->end_pending) {
            st->end_pending = false;
            cb = st->read_cb;
            ctx = st->read_ctx;
            st->read_cb = NULL;
            rc = TD_ERR_NOT_FOUND;
        }
        sync_complete_locked(&st->s, TAG_STATUS, ok);
    } else {
        sync_complete_locked(&st->s, o->tag, ok);
    }
    if (cb)
        st->in_cb++;
    pthread_mutex_unlock(&st->s.mu);
    if (cb)
        stream_read_cb(st, cb, ctx, rc);
}

td_status_t td_rpc_stream_open(td_rpc_channel_t *ch, const char *method, const void *req, size_t req_len,
                               double timeout_s, td_rpc_scope_t *scope, td_rpc_stream_t **out)
{
    td_rpc_stream_t *st = calloc(1, sizeof *st);
    if (!st)
        return td_error(TD_ERR_NO_MEMORY, "rpc: no memory");
    st->ch = ch;
    st->scope = scope;
    sync_init(&st->s);
    for (int t = 0; t < TAG_COUNT; t++)
        st->ops[t] = (client_op_t){.op.done = client_op_done, .s = &st->s, .st = st, .tag = (tag_t)t};
    st->call = client_call(ch, method, timeout_s, scope, loop_pick());
    grpc_metadata_array_init(&st->md_initial);
    grpc_metadata_array_init(&st->md_trailing);
    st->details = grpc_empty_slice();
    grpc_op op = {.op = GRPC_OP_RECV_STATUS_ON_CLIENT};
    op.data.recv_status_on_client.trailing_metadata = &st->md_trailing;
    op.data.recv_status_on_client.status = &st->code;
    op.data.recv_status_on_client.status_details = &st->details;
    op.data.recv_status_on_client.error_string = (const char **)&st->error_string;
    st->s.posted |= 1u << TAG_STATUS;
    if (grpc_call_start_batch(st->call, &op, 1, op_arm(&st->ops[TAG_STATUS].op), NULL) != GRPC_CALL_OK) {
        st->s.posted = 0;
        st->status_done = true;
        st->code = GRPC_STATUS_INTERNAL;
    }
    if (req) {
        grpc_slice sl = grpc_slice_from_copied_buffer(req, req_len);
        st->send_bb = grpc_raw_byte_buffer_create(&sl, 1);
        grpc_slice_unref(sl);
        grpc_op ops[3];
        memset(ops, 0, sizeof ops);
        ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
        ops[0].flags = ch->fail_fast ? 0 : GRPC_INITIAL_METADATA_WAIT_FOR_READY;
        channel_md(ch, &ops[0]);
        ops[1].op = GRPC_OP_SEND_MESSAGE;
        ops[1].data.send_message.send_message = st->send_bb;
        ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
        st->md_sent = true;
        /* not waited for: the first read waits for the reply anyway */
        pthread_mutex_lock(&st->s.mu);
        st->s.posted |= 1u << TAG_SEND;
        pthread_mutex_unlock(&st->s.mu);
        if (grpc_call_start_batch(st->call, ops, 3, op_arm(&st->ops[TAG_SEND].op), NULL) != GRPC_CALL_OK) {
            pthread_mutex_lock(&st->s.mu);
            st->s.posted &= ~(1u << TAG_SEND);
            pthread_mutex_unlock(&st->s.mu);
        }
    }
    *out = st;
    return TD_OK;
}

td_status_t td_rpc_stream_write(td_rpc_stream_t *st, const void *msg, size_t len, double timeout_s)
{
    pthread_mutex_lock(&st->s.mu);
    sync_settle_locked(&st->s, TAG_SEND);
    st->s.done &= ~(1u << TAG_SEND);
    if (st->send_bb)
        grpc_byte_buffer_destroy(st->send_bb);
    grpc_slice sl = grpc_slice_from_copied_buffer(msg, len);
    st->send_bb = grpc_raw_byte_buffer_create(&sl, 1);
    grpc_slice_unref(sl);
    st->s.posted |= 1u << TAG_SEND;
    pthread_mutex_unlock(&st->s.mu);
    grpc_op ops[2];
    memset(ops, 0, sizeof ops);
    int n = 0;
    if (!st->md_sent) {
        ops[n].flags = st->ch->fail_fast ? 0 : GRPC_INITIAL_METADATA_WAIT_FOR_READY;
        channel_md(st->ch, &ops[n]);
        ops[n++].op = GRPC_OP_SEND_INITIAL_METADATA;
        st->md_sent = true;
    }
    ops[n].op = GRPC_OP_SEND_MESSAGE;
    ops[n++].data.send_message.send_message = st->send_bb;
    int r = -1;
    if (grpc_call_start_batch(st->call, ops, (size_t)n, op_arm(&st->ops[TAG_SEND].op), NULL) == GRPC_CALL_OK) {
        r = sync_wait(&st->s, TAG_SEND, timeout_s);
        if (r == 0) {
            grpc_call_cancel(st->call, NULL);
            r = sync_wait(&st->s, TAG_SEND, 1e9) == 1 ? 0 : -1;
        }
    } else {
        pthread_mutex_lock(&st->s.mu);
        st->s.posted &= ~(1u << TAG_SEND);
        pthread_mutex_unlock(&st->s.mu);
    }
    return r == 1 ? TD_OK : r == 0 ? TD_ERR_TIMEOUT : TD_ERR_UNAVAILABLE;
}

/* Posts a receive (mu not held); false when gRPC refuses it (the stream is over). */
static bool stream_post_recv(td_rpc_stream_t *st)
{
    grpc_op ops[2];
    memset(ops, 0, sizeof ops);
    int n = 0;
    if (!st->got_initial) {
        ops[n].op = GRPC_OP_RECV_INITIAL_METADATA;
        ops[n++].data.recv_initial_metadata.recv_initial_metadata = &st->md_initial;
        st->got_initial = true;
    }
    ops[n].op = GRPC_OP_RECV_MESSAGE;
    ops[n++].data.recv_message.recv_message = &st->recv;
    return grpc_call_start_batch(st->call, ops, (size_t)n, op_arm(&st->ops[TAG_RECV].op), NULL) == GRPC_CALL_OK;
}

td_status_t td_rpc_stream_read(td_rpc_stream_t *st, const uint8_t **msg, size_t *len, double wait_s)
{
    if (st->ended)
        return TD_ERR_NOT_FOUND;
    pthread_mutex_lock(&st->s.mu);
    bool post = !(st->s.posted & (1u << TAG_RECV)) && !(st->s.done & (1u << TAG_RECV));
    if (post)
        st->s.posted |= 1u << TAG_RECV;
    pthread_mutex_unlock(&st->s.mu);
    if (post && !stream_post_recv(st)) {
        pthread_mutex_lock(&st->s.mu);
        st->s.posted &= ~(1u << TAG_RECV);
        pthread_mutex_unlock(&st->s.mu);
        st->ended = true;
        return TD_ERR_NOT_FOUND;
    }
    int r = sync_wait(&st->s, TAG_RECV, wait_s);
    if (r == 0)
        return TD_ERR_TIMEOUT;
    if (r < 0 || !st->recv) {
        st->ended = true;
        return TD_ERR_NOT_FOUND;
    }
    bool ok = buffer_into(st->recv, &st->msg, &st->msg_cap, len);
    grpc_byte_buffer_destroy(st->recv);
    st->recv = NULL;
    *msg = st->msg;
    return ok ? TD_OK : TD_ERR_NO_MEMORY;
}

td_status_t td_rpc_stream_read_async(td_rpc_stream_t *st, td_rpc_read_fn cb, void *ctx)
{
    pthread_mutex_lock(&st->s.mu);
    td_status_t rc = st->ended ? TD_ERR_NOT_FOUND
                     : (st->s.posted & (1u << TAG_RECV)) || st->read_cb ? TD_ERR_INTERNAL
                                                                        : TD_OK;
    if (!rc) {
        st->read_cb = cb;
        st->read_ctx = ctx;
        st->s.posted |= 1u << TAG_RECV;
    }
    pthread_mutex_unlock(&st->s.mu);
    if (rc == TD_ERR_INTERNAL)
        return td_error(rc, "rpc: a read is already posted on this stream");
    if (rc)
        return rc;
    if (!stream_post_recv(st)) {
        pthread_mutex_lock(&st->s.mu);
        st->s.posted &= ~(1u << TAG_RECV);
        st->read_cb = NULL;
        st->ended = true;
        pthread_mutex_unlock(&st->s.mu);
        return TD_ERR_NOT_FOUND;
    }
    return TD_OK;
}

td_status_t td_rpc_stream_result(td_rpc_stream_t *st, double wait_s, td_rpc_result_t *res)
{
    pthread_mutex_lock(&st->s.mu);
    bool done = st->status_done;
    if (!done && wait_s > 0) {
        struct timespec until = mono_in(wait_s);
        while (!st->status_done && pthread_cond_timedwait(&st->s.cv, &st->s.mu, &until) != ETIMEDOUT)
            ;
        done = st->status_done;
    }
    pthread_mutex_unlock(&st->s.mu);
    if (!done)
        return TD_ERR_TIMEOUT;
    result_set(res, st->code, st->details, st->error_string, &st->md_trailing);
    explain_unconnected(st->ch, res);
    return td_rpc_status_of(st->code);
}

void td_rpc_stream_cancel(td_rpc_stream_t *st) { grpc_call_cancel(st->call, NULL); }

/* td_rpc_unary_all: each call as a server-streaming one (the wire of a unary
 * call), all sent first with their reads posted, then one wait for them all. */
typedef struct unary_all {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    size_t left; /* reads not yet answered */
} unary_all_t;

typedef struct unary_slot {
    unary_all_t *all;
    td_rpc_unary_call_t *c;
    bool answered, got; /* the read came back; with a message */
} unary_slot_t;

static void unary_all_read(void *ctx, td_status_t rc, const uint8_t *msg, size_t len)
{
    unary_slot_t *sl = ctx;
    pthread_mutex_lock(&sl->all->mu);
    if (rc == TD_OK && (sl->c->resp = malloc(len ? len : 1))) {
        memcpy(sl->c->resp, msg, len);
        sl->c->resp_len = len;
        sl->got = true;
    }
    sl->answered = true;
    sl->all->left--;
    pthread_cond_broadcast(&sl->all->cv);
    pthread_mutex_unlock(&sl->all->mu);
}

void td_rpc_unary_all(td_rpc_unary_call_t *calls, size_t n, double timeout_s)
{
    td_rpc_stream_t **st = calloc(n ? n : 1, sizeof *st);
    unary_slot_t *slot = calloc(n ? n : 1, sizeof *slot);
    unary_all_t all = {.left = 0};
    pthread_mutex_init(&all.mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&all.cv, &ca);
    pthread_condattr_destroy(&ca);
    for (size_t i = 0; i < n; i++) {
        td_rpc_unary_call_t *c = &calls[i];
        c->resp = NULL;
        c->resp_len = 0;
        if (!c->ch)
            continue;
        memset(&c->res, 0, sizeof c->res);
        if (!st || !slot) { /* no memory for the lists: one after the other */
            c->rc = td_rpc_unary(c->ch, c->method, c->req ? c->req : "", c->req_len, timeout_s, NULL, &c->resp,
                                 &c->resp_len, &c->res);
            continue;
        }
        slot[i] = (unary_slot_t){.all = &all, .c = c};
        /* req NULL: an empty message */
        if ((c->rc = td_rpc_stream_open(c->ch, c->method, c->req ? c->req : "", c->req_len, timeout_s, NULL, &st[i]))) {
            snprintf(c->res.message, sizeof c->res.message, "%s", td_last_error());
            continue;
        }
        pthread_mutex_lock(&all.mu);
        all.left++;
        pthread_mutex_unlock(&all.mu);
        if (td_rpc_stream_read_async(st[i], unary_all_read, &slot[i])) { /* over already: its status says why */
            pthread_mutex_lock(&all.mu);
            all.left--;
            slot[i].answered = true;
            pthread_mutex_unlock(&all.mu);
        }
    }
    struct timespec until = mono_in(timeout_s);
    pthread_mutex_lock(&all.mu);
    while (all.left && pthread_cond_timedwait(&all.cv, &all.mu, &until) != ETIMEDOUT)
        ;
    pthread_mutex_unlock(&all.mu);
    for (size_t i = 0; st && slot && i < n; i++) {
        td_rpc_unary_call_t *c = &calls[i];
        if (!st[i])
            continue;
        pthread_mutex_lock(&all.mu);
        bool answered = slot[i].answered, got = slot[i].got;
        pthread_mutex_unlock(&all.mu);
        if (got) {
            c->rc = TD_OK;
        } else if (!answered) {
            td_rpc_stream_cancel(st[i]);
            c->rc = TD_ERR_TIMEOUT;
            c->res.code = TD_RPC_DEADLINE_EXCEEDED;
            snprintf(c->res.message, sizeof c->res.message, "%s did not answer within %.1f s", c->method, timeout_s);
        } else if ((c->rc = td_rpc_stream_result(st[i], 1.0, &c->res)) == TD_OK) { /* OK without a message */
            c->rc = TD_ERR_FORMAT;
            snprintf(c->res.message, sizeof c->res.message, "the reply had no message");
        } else if (c->res.code == TD_RPC_DEADLINE_EXCEEDED) { /* the call's own deadline came before the wait's */
            snprintf(c->res.message, sizeof c->res.message, "%s did not answer within %.1f s", c->method, timeout_s);
        } else if (c->rc == TD_ERR_TIMEOUT && !c->res.message[0]) {
            snprintf(c->res.message, sizeof c->res.message, "%s ended without its status", c->method);
        }
        td_rpc_stream_destroy(st[i]); /* waits for its read's callback */
    }
    pthread_cond_destroy(&all.cv);
    pthread_mutex_destroy(&all.mu);
    free(slot);
    free(st);
}

void td_rpc_stream_destroy(td_rpc_stream_t *st)
{
    if (!st)
        return;
    pthread_mutex_lock(&st->s.mu);
    if (!st->status_done)
        grpc_call_cancel(st->call, NULL);
    while (st->s.posted || st->in_cb || st->end_pending)
        pthread_cond_wait(&st->s.cv, &st->s.mu);
    pthread_mutex_unlock(&st->s.mu);
    if (st->recv)
        grpc_byte_buffer_destroy(st->recv);
    free(st->msg);
    client_call_end(st->ch, st->scope, st->call);
    if (st->send_bb)
        grpc_byte_buffer_destroy(st->send_bb);
    grpc_metadata_array_destroy(&st->md_initial);
    grpc_metadata_array_destroy(&st->md_trailing);
    grpc_slice_unref(st->details);
    if (st->error_string)
        gpr_free(st->error_string);
    sync_destroy(&st->s);
    free(st);
}
