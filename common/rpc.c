/* rpc.c — see rpc.h: the loop threads, status codes, TLS files and scopes
 * (the server is rpc_server.c, the client rpc_client.c, what they share
 * rpc_int.h).
 *
 * How it works: every batch started on a call is tagged with an rpc_op_t, a
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
#include "common/rpc_int.h"

#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/support/alloc.h>
#include <math.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/grow.h"
#include "common/log.h"

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

bool rpc_on_loop_thread(void) { return t_on_loop; }

static void *loop_thread(void *arg)
{
    grpc_completion_queue *cq = arg;
    t_on_loop = true;
    for (;;) {
        grpc_event ev = grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL);
        if (ev.type == GRPC_QUEUE_SHUTDOWN)
            break;
        if (ev.type == GRPC_OP_COMPLETE) {
            rpc_op_t *op = ev.tag;
            (void)__atomic_load_n(&op->armed, __ATOMIC_ACQUIRE);
            op->done(op, ev.success != 0);
        }
    }
    return NULL;
}

grpc_completion_queue *rpc_loop_pick(void)
{
    unsigned i = __atomic_fetch_add(&g_loop.next, 1, __ATOMIC_RELAXED);
    return g_loop.cq[i % (unsigned)g_loop.n];
}

int rpc_loop_count(void) { return g_loop.n; }
grpc_completion_queue *rpc_loop_cq(int i) { return g_loop.cq[i]; }

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

/* ------------------------------------------------------------------ sync */

void rpc_sync_init(rpc_sync_t *s)
{
    pthread_mutex_init(&s->mu, NULL);
    pthread_condattr_t a;
    pthread_condattr_init(&a);
    pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
    pthread_cond_init(&s->cv, &a);
    pthread_condattr_destroy(&a);
    s->posted = s->done = s->ok = 0;
}

void rpc_sync_destroy(rpc_sync_t *s)
{
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
}

int rpc_sync_wait_locked(rpc_sync_t *s, rpc_tag_t t, double wait_s)
{
    unsigned bit = 1u << t;
    struct timespec until = rpc_mono_in(wait_s);
    while (!(s->done & bit))
        if (pthread_cond_timedwait(&s->cv, &s->mu, &until) == ETIMEDOUT && !(s->done & bit))
            return 0;
    s->done &= ~bit;
    return (s->ok & bit) ? 1 : -1;
}

int rpc_sync_wait(rpc_sync_t *s, rpc_tag_t t, double wait_s)
{
    pthread_mutex_lock(&s->mu);
    int r = rpc_sync_wait_locked(s, t, wait_s);
    pthread_mutex_unlock(&s->mu);
    return r;
}

void rpc_sync_complete_locked(rpc_sync_t *s, rpc_tag_t t, bool ok)
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

void rpc_sync_settle_locked(rpc_sync_t *s, rpc_tag_t t)
{
    while (s->posted & (1u << t))
        pthread_cond_wait(&s->cv, &s->mu);
}

bool rpc_buffer_into(grpc_byte_buffer *bb, uint8_t **buf, size_t *cap, size_t *len)
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

bool rpc_tls_on(const td_rpc_tls_t *tls)
{
    return tls && ((tls->ca_file && tls->ca_file[0]) || (tls->cert_file && tls->cert_file[0]));
}


/* ------------------------------------------------------------------ scopes */

void rpc_scope_init(td_rpc_scope_t *sc, double timeout_s)
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
    rpc_scope_init(sc, timeout_s);
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

void rpc_scope_track(td_rpc_scope_t *sc, grpc_call *call)
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

void rpc_scope_untrack(td_rpc_scope_t *sc, grpc_call *call)
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
